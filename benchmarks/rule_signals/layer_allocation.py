"""How much could a per-layer allocation of bit widths (L-GreCo's idea) save on the
character transformer, at the total error of uniform 2-bit ``nq``?

L-GreCo (Alimohammadi et al., MLSys 2024) chooses each layer's compression level by
dynamic programming: the fewest bytes whose summed squared compression error stays within
that of a uniform reference level. Whether it can beat a static level by 1.5x depends on
how unequal the layers' errors are. This script measures that before anything is built.

Two simulated workers train ``transformer-tiny`` densely (``lm_probe.py``'s setup,
charlm-tiny's schedule). Along that trajectory one shadow reducer per bit width of
``nq`` (4, 3, 2, 1), each with its own error-feedback memory, is fed the same local
gradients. Per window of 25 steps and per tensor (``nq`` quantises all) it records the summed
``|g_hat - g_bar|^2`` and ``|g_bar|^2``. Then, per window, it finds the allocation with the
fewest wire bytes whose error stays within uniform 2-bit's, under two budgets:

* ``absolute`` (L-GreCo's): the sum over tensors of ``|g_hat - g_bar|^2``;
* ``relative``: the sum over tensors of ``numel * |g_hat - g_bar|^2 / |g_bar|^2``, each
  element weighted alike, since Adam normalises every coordinate.

and prints uniform 2-bit's bytes over the allocation's (the potential gain, before any
cost of measuring the errors). The allocation is exact: the
Pareto front of (bytes, error) over the tensors, built one tensor at a time.

    PYTHONPATH=src:benchmarks/rule_signals .venv/bin/python \
        benchmarks/rule_signals/layer_allocation.py [steps] [seed]
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import lm_probe as probe
import numpy as np
import torch

from accordion.compress import Reducer, SimulatedTransport, make_compressor
from accordion.compress.memory import ErrorFeedback
from accordion.compress.normalquant import NormalQuantizer
from accordion.harness.data.charlm import load_charlm
from accordion.models import get_model

BITS = (4, 3, 2, 1)
REFERENCE = 2
SCHEDULE_STEPS = 896
WINDOW = 25
OUT = Path(__file__).resolve().parents[2] / "docs" / "results" / "layer_allocation_lm.json"


def nq_bytes(shape: tuple[int, ...], bits: int) -> int:
    """Wire bytes one worker hands its collectives for one tensor at ``bits``."""
    return sum(m.nbytes for m in NormalQuantizer.messages(shape, bits, 4))


def pareto(options: list[list[tuple[float, float]]]) -> list[tuple[float, float, tuple]]:
    """The (bytes, error, choice) front of one choice per tensor, sums over tensors."""
    front = [(0.0, 0.0, ())]
    for choices in options:
        merged = sorted((b + cb, e + ce, picked + (i,)) for b, e, picked in front
                        for i, (cb, ce) in enumerate(choices))  # fmt: skip
        front, best = [], math.inf
        for b, e, picked in merged:  # ascending bytes: keep strictly falling errors
            if e < best:
                front.append((b, e, picked))
                best = e
    return front


def allocate(sizes, errors, budget):
    """The cheapest choice per tensor whose summed error is within ``budget``."""
    front = pareto([list(zip(s, e)) for s, e in zip(sizes, errors)])
    return min((f for f in front if f[1] <= budget * (1 + 1e-9)), key=lambda f: f[0])


def train(steps: int, seed: int) -> dict:
    """Per window and compressed tensor, the summed squared errors per width, and norms."""
    torch.manual_seed(seed)
    data = load_charlm(28672, 1024, probe.BPTT)
    model = get_model("transformer-tiny", ntoken=len(data.vocabulary))
    names, params = zip(*model.named_parameters())
    index = list(range(len(params)))  # nq quantises every tensor, biases too
    opt = torch.optim.AdamW(params, lr=probe.LR, betas=probe.BETAS, eps=probe.EPS,
                            weight_decay=probe.WD)  # fmt: skip
    shadows = {b: [Reducer(make_compressor("nq", b), ErrorFeedback()) for _ in range(2)]
               for b in BITS}  # fmt: skip
    windows = []
    order = np.random.RandomState(seed)  # a fresh permutation per epoch
    perm = torch.from_numpy(np.concatenate([order.permutation(len(data.x_train))
                                            for _ in range(2)]))  # fmt: skip
    for step in range(steps):
        if step % WINDOW == 0:
            windows.append({"norm2": np.zeros(len(index)),
                            "error2": {b: np.zeros(len(index)) for b in BITS}})  # fmt: skip
        for group in opt.param_groups:
            group["lr"] = probe.lr_at(step, SCHEDULE_STEPS)
        idx = perm[step * probe.BATCH : (step + 1) * probe.BATCH]
        grads, _ = probe.local_grads(model, params, data.x_train, data.y_train, idx)
        true = [(a + b) / probe.WORKERS for a, b in zip(*grads)]
        window = windows[-1]
        window["norm2"] += [float(true[i].double().norm() ** 2) for i in index]
        for b, reducers in shadows.items():
            shadow = probe.shadow_average(reducers, SimulatedTransport(probe.WORKERS), grads)
            window["error2"][b] += [float((shadow[i] - true[i]).double().norm() ** 2)
                                    for i in index]  # fmt: skip
        norm = float(torch.cat([t.reshape(-1) for t in true]).norm())
        for p, t in zip(params, true):
            p.grad = t * min(1.0, probe.CLIP / (norm + 1e-6))
        opt.step()
    return {"names": list(names), "shapes": [tuple(p.shape) for p in params],
            "windows": windows}  # fmt: skip


def gains(run: dict) -> dict:
    """Per window and budget, uniform 2-bit's bytes over the allocation's, and the widths."""
    sizes = [[nq_bytes(s, b) for b in BITS] for s in run["shapes"]]
    numel = [math.prod(s) for s in run["shapes"]]
    ref = BITS.index(REFERENCE)
    uniform = sum(s[ref] for s in sizes)
    out: dict = {"absolute": [], "relative": []}
    for w in run["windows"]:
        absolute = [[w["error2"][b][t] for b in BITS] for t in range(len(sizes))]
        relative = [[n * e / max(w["norm2"][t], 1e-30) for e in row]
                    for t, (n, row) in enumerate(zip(numel, absolute))]  # fmt: skip
        for budget, errors in (("absolute", absolute), ("relative", relative)):
            cost, _, picked = allocate(sizes, errors, sum(e[ref] for e in errors))
            out[budget].append({"gain": uniform / cost,
                                "bits": [BITS[i] for i in picked]})  # fmt: skip
    return out


def main(steps: int, seed: int) -> dict:
    start = time.perf_counter()
    run = train(steps, seed)
    result = gains(run)
    shares = [[float(x) for x in w["norm2"] / w["norm2"].sum()] for w in run["windows"]]
    return {"steps": steps, "seed": seed, "window": WINDOW, "names": run["names"],
            "norm2_share": shares, **result, "seconds": time.perf_counter() - start}  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    report = main(int(sys.argv[1]) if len(sys.argv) > 1 else 300,
                  int(sys.argv[2]) if len(sys.argv) > 2 else 0)  # fmt: skip
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    print(" ".join(report["names"]))
    for budget in ("absolute", "relative"):
        for i, w in enumerate(report[budget]):
            print(f"{budget:8s} window {i:2d}: {w['gain']:.2f}x  bits {w['bits']}")
