"""Accordion's cost model: when does compression pay, before and at the start of training?

Shows, in one process and without training:

* ``accordion.make_plan``: from a model's parameter shapes alone, the bytes one worker
  sends per step and the predicted communication time (the alpha-beta model of ring
  collectives), dense and at each level of a PowerSGD ladder;
* ``accordion.layer_plan``: the same, per tensor;
* ``accordion.calibrate`` (``state.calibrate``, the "auto" mode): it times the extra
  computation compressing each tensor costs on this machine, and sends dense the
  tensors whose compression costs more time than it saves on the given link. On a slow
  link every matrix is compressed; on a very fast one none is.

In a real job, call ``state.calibrate()`` without ``bandwidth``/``latency`` on every
rank after registering the hook: it then measures the link with a few all-reduces.

Run it with plain Python::

    python examples/cost_model.py
"""

import torch
from torch import nn

import accordion

WORKERS, LEVELS = 8, (4, 1)
LATENCY = 50e-6  # s per message: TCP over Ethernet, roughly
LINKS = {"10 Mbit/s": 10e6 / 8, "1 Gbit/s": 1e9 / 8, "1 Tbit/s": 1e12 / 8}  # bytes/s


def model() -> nn.Module:
    """One large matrix, where compression saves most, and two small ones."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 16))  # fmt: skip


def megabytes(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3f} MB"


def show_plan(net: nn.Module, bandwidth: float) -> None:
    """The plan for the whole model (one bucket per step) and per tensor."""
    shapes = [tuple(p.shape) for p in net.parameters()]
    rows = accordion.make_plan(shapes, "powersgd", LEVELS, world_size=WORKERS, steps=1000,
                               bandwidth=bandwidth, latency=LATENCY)  # fmt: skip
    print(f"plan: {WORKERS} workers at 1 Gbit/s, per step and worker")
    dense = rows[0]
    for row in rows:  # dense first, then each level
        print(f"  plan {row.label}: {megabytes(row.bytes_per_step)}, "
              f"{row.comm_time_per_step_s * 1e3:.2f} ms predicted")  # fmt: skip
    best = rows[-1]
    print(f"traffic: {best.label} would send {megabytes(best.bytes_per_step)} per step, dense "
          f"would send {megabytes(dense.bytes_per_step)} "
          f"({dense.bytes_per_step / best.bytes_per_step:.1f}x less)")  # fmt: skip
    named = [(name, tuple(p.shape)) for name, p in net.named_parameters()]
    for layer in accordion.layer_plan(named, "powersgd", LEVELS, WORKERS, bandwidth):
        levels = ", ".join(f"rank {lv} {megabytes(b)}" for lv, b in zip(LEVELS, layer.bytes))
        print(f"  layer {layer.name} {layer.shape}: dense {megabytes(layer.dense_bytes)}; {levels}")


def show_calibration(net: nn.Module) -> None:
    """What ``calibrate`` chooses for this model on each link, with this machine's
    compression times. One process: no link to measure, so it is given."""
    for name, bandwidth in LINKS.items():
        state = accordion.AccordionState(net, "powersgd", levels=LEVELS)
        # the same as state.calibrate(...): times compression of each matrix here
        report = accordion.calibrate(state, bandwidth=bandwidth, latency=LATENCY)
        tensors = report["tensors"]
        compressed = [key for key, t in tensors.items() if t["compress"]]
        print(f"calibrate at {name}: compressed {len(compressed)} of {len(tensors)} matrices "
              f"({', '.join(compressed) or 'none'}); dense: "
              f"{', '.join(report['dense_keys']) or 'none'}")  # fmt: skip


def main() -> None:
    net = model()
    show_plan(net, LINKS["1 Gbit/s"])
    show_calibration(net)


if __name__ == "__main__":
    main()
