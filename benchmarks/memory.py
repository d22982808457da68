"""Extra memory per worker of our hook against plain DDP and PyTorch's ``powerSGD_hook``.

Two local gloo workers train a model (ResNet-18 on CIFAR-shaped random data by default)
for ``--steps`` steps under one configuration; each worker then reports its peak resident
set size (``VmHWM``: peak RSS is monotonic, so every configuration runs in a fresh pair of
processes) and the bytes of the tensors the hook's state keeps between steps:

* ours: error-feedback memory (``reducer.memory``), the compressor's factors (PowerSGD's
  warm-start Q and its shared-seed cache), the flat buffers the memory lives in (whole
  storages: also the next step's inputs) and the statistic's accumulators
  (``state.sums``). The memory lives in the buffers, so the categories overlap;
  ``unique`` counts every storage once, which is what the state really holds.
* PyTorch: ``error_dict``, ``p_memory_dict`` and ``q_memory_dict``.

Each configuration runs ``--reps`` times, in interleaved order; the table gives the
median peak RSS of the worse worker, its spread (min-max) and the extra over dense DDP.
The workers run with a fixed glibc mmap threshold (``--mmap-threshold``), so that a freed
tensor leaves the RSS at once: with glibc's dynamic threshold, the peak RSS of the same
run varies by ~40 MiB. ``--json`` also keeps each rank's peak after every step.

    PYTHONPATH=src .venv/bin/python benchmarks/memory.py --steps 5 --reps 3

Numbers depend on the allocator and the machine; the accounted bytes do not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.ddp import AccordionState
from accordion.models import get_model

MiB = 2**20
#: name -> description; the order of the table.
CONFIGS = {
    "dense": "dense DDP (baseline)",
    "torch-psgd4": "torch powerSGD_hook r4",
    "ours-psgd4": "ours static PowerSGD r4",
    "ours-accordion421": "ours Accordion 4,2,1",  # the default statistic: "sharded"
    "ours-accordion421-rank0": "ours Accordion rank0",
    "ours-topk0.01": "ours static top-k 0.01",
}
MODELS = ("resnet18", "mnist1d-cnn")
#: Whose extra memory the goal compares with PyTorch's hook, and the allowed excess.
GOAL_CONFIGS = ("ours-psgd4", "ours-accordion421", "ours-accordion421-rank0")
GOAL_MARGIN = 0.10


def make_batch(model: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch shaped for ``model`` (CIFAR images or MNIST-1D signals)."""
    gen = torch.Generator().manual_seed(0)
    shape = (batch, 3, 32, 32) if model == "resnet18" else (batch, 40)
    return torch.randn(shape, generator=gen), torch.randint(0, 10, (batch,), generator=gen)


def attach(config: str, net: nn.Module, ddp: DDP):
    """Register the configuration's hook on ``ddp``; return its state (``None``: dense)."""
    if config == "dense":
        return None
    if config == "torch-psgd4":
        state = torch_psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
            use_error_feedback=True, warm_start=True,
        )  # fmt: skip
        ddp.register_comm_hook(state, torch_psgd.powerSGD_hook)
        return state
    if config == "ours-psgd4":
        state = AccordionState(net, "powersgd", mild=4, aggressive=4)
    elif config == "ours-accordion421":
        state = AccordionState(net, "powersgd", levels=(4, 2, 1))
    elif config == "ours-accordion421-rank0":
        state = AccordionState(net, "powersgd", levels=(4, 2, 1), statistic="rank0")
    elif config == "ours-topk0.01":
        state = AccordionState(net, "topk", mild=0.01, aggressive=0.01)
    else:
        raise ValueError(f"unknown configuration {config!r}")
    state.register(ddp)
    return state


def _tensors_in(value) -> list[torch.Tensor]:
    """The tensors in ``value``: a tensor, or a (nested) dict, list or tuple of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors_in(item)]
    return []


def nominal_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the tensors' elements (a view counts its own elements only)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind the tensors, each counted once: what they hold."""
    return nominal_bytes(_storages_of(tensors))


def state_tensors(state) -> dict[str, list[torch.Tensor]]:
    """The tensors a hook's state keeps between steps, by category."""
    if state is None:
        return {}
    if isinstance(state, torch_psgd.PowerSGDState):
        return {"memory": _tensors_in(state.error_dict),
                "factors": _tensors_in([state.p_memory_dict, state.q_memory_dict])}  # fmt: skip
    reducer = state.reducer
    # every table of the compressor (PowerSGD: _q, its shared-seed cache _seed_q), so
    # that state a compressor adds later is counted too
    factors = [t for value in vars(reducer.compressor).values() for t in _tensors_in(value)]
    return {
        "memory": _tensors_in(reducer.memory._memory),
        "factors": factors,
        # the storages the memories live in, whole (views of a flat buffer count it all)
        "buffers": _storages_of(_tensors_in(reducer.memory._memory)),
        "accumulators": _tensors_in([state.sums._sums, state.sums._skipped]),
    }


def _storages_of(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One flat tensor over each distinct storage that ``tensors`` live in."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    return [torch.empty(0, dtype=torch.uint8).set_(s) for s in storages.values()]


def breakdown(state) -> dict[str, int]:
    """Bytes per category, ``unique`` (all categories, each storage once) and, for ours,
    the number of buffers the memory lives in and their bytes that hold no memory."""
    parts = state_tensors(state)
    out = {name: nominal_bytes(ts) for name, ts in parts.items()}
    out["unique"] = unique_bytes([t for ts in parts.values() for t in ts])
    if "buffers" in parts:
        out["buffer_sets"] = len(parts["buffers"])
        # bytes of those storages that hold no live memory (freed once the keys move out)
        out["stale_buffers"] = out["buffers"] - out["memory"]
    return out


def peak_rss() -> int:
    """This process's peak resident set size in bytes (Linux: ``VmHWM``, which exec
    resets; elsewhere ``ru_maxrss``, which may include the parent's before the exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux: ``clear_refs`` 5);
    whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def compressed_numel(state, net: nn.Module) -> int:
    """Elements of the parameters our hook compresses (0 for the others)."""
    if not isinstance(state, AccordionState):
        return 0
    reducer = state.reducer
    return sum(p.numel() for p in net.parameters() if reducer.compresses(p))


def worker(rank: int, world: int, store: str, config: str, args, out_dir: str) -> None:
    """Train ``args.steps`` steps under ``config`` and write this rank's figures."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    net = get_model(args.model, num_classes=10)
    ddp = DDP(net)
    state = attach(config, net, ddp)
    x, y = make_batch(args.model, args.batch)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    before, by_step, steady, early = peak_rss(), [], False, 0
    for step in range(args.steps):
        if step == args.steady_after:
            # DDP rebuilds its buckets after its first step, so state may move once: the
            # peak from here on is what a long run keeps paying
            early = peak_rss()
            steady = reset_peak_rss()
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        if config.startswith("ours-accordion"):
            # every step an epoch: the rule checks and may switch ranks, so that the
            # factors of every rank it reaches exist by the end
            state.end_epoch(optimizer)
        by_step.append(peak_rss())  # which step set the peak (after a reset: since it)
    result = {
        "rank": rank,
        "peak_rss": max(early, peak_rss()),
        "peak_rss_before_training": before,
        "peak_rss_by_step": by_step,
        "steady_peak_rss": peak_rss() if steady else None,
        "state": breakdown(state),
        "compressed_numel": compressed_numel(state, net),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # gloo on torch 2.13 may abort at exit without a barrier before teardown, and even
    # after one while C++ statics are destroyed: the file is written, skip that teardown
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_config(config: str, args, world: int = 2) -> list[dict]:
    """One fresh pair of worker processes under ``config``; their results, by rank."""
    tmp = tempfile.mkdtemp(prefix="accordion-memory-")
    try:
        ctx = mp.start_processes(
            worker, args=(world, os.path.join(tmp, "store"), config, args, tmp),
            nprocs=world, join=False, start_method="spawn",
        )  # fmt: skip
        deadline = time.monotonic() + args.timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{config}: workers did not finish in {args.timeout} s")
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_with_retries(config: str, args, failed: dict[str, int], tries: int = 3) -> list[dict]:
    """:func:`run_config`, run again (fresh processes) when a worker dies, counting it.

    A worker died once in these runs of a gloo collective mismatch ("Received data size
    doesn't match expected size"). A likely cause: PyTorch's ``powerSGD_hook`` issues
    its P all-reduce from a future's callback while the next bucket's all-reduce comes
    from the backward pass, so two ranks may issue them in different orders (our hook
    runs its collectives on a private group). Such a run measures nothing.
    """
    for _ in range(tries - 1):
        try:
            return run_config(config, args)
        except mp.ProcessExitedException as exc:
            failed[config] += 1
            print(f"{config}: a worker died ({exc}); running it again", file=sys.stderr)
    return run_config(config, args)


def summarize(config: str, reps: list[list[dict]], dense: tuple[float | None, float | None]
              ) -> dict:  # fmt: skip
    """One row: the worse worker's peak RSS per repetition, median and spread, the extra
    over dense (``dense``: its whole-run and steady medians), the steady peak (after
    ``--steady-after`` steps) and its extra, and the accounted state of each rank (the
    same on every repetition)."""
    dense_mib, dense_steady = dense
    peaks = [max(r["peak_rss"] for r in rep) / MiB for rep in reps]
    median = statistics.median(peaks)
    steady = [[r.get("steady_peak_rss") for r in rep] for rep in reps]
    steady_peaks = [max(s) / MiB for s in steady if None not in s]
    steady_median = statistics.median(steady_peaks) if steady_peaks else None
    return {
        "config": config,
        "label": CONFIGS[config],
        "peak_rss_mib": peaks,
        "peak_rss_mib_by_rank": [[r["peak_rss"] / MiB for r in rep] for rep in reps],
        "peak_rss_mib_by_step": [[p / MiB for p in r["peak_rss_by_step"]] for r in reps[0]],
        "peak_rss_mib_median": median,
        "peak_rss_mib_min": min(peaks),
        "peak_rss_mib_max": max(peaks),
        "extra_mib": None if dense_mib is None else median - dense_mib,
        "steady_peak_rss_mib": steady_peaks,
        "steady_peak_rss_mib_median": steady_median,
        "steady_extra_mib": (steady_median - dense_steady
                             if steady_median is not None and dense_steady is not None
                             else None),
        "state": reps[0][0]["state"],
        "state_by_rank": [r["state"] for r in reps[0]],
        "compressed_numel": reps[0][0]["compressed_numel"],
    }


def goal(rows: dict[str, dict]) -> dict[str, dict]:
    """Per configuration of ours: whether its extra is at most PyTorch's hook's extra
    plus ``GOAL_MARGIN`` (only when both and dense DDP were measured)."""
    torch_row = rows.get("torch-psgd4")
    if torch_row is None or torch_row["extra_mib"] is None:
        return {}
    limit = torch_row["extra_mib"] * (1 + GOAL_MARGIN)
    return {
        name: {
            "extra_mib": rows[name]["extra_mib"],
            "limit_mib": limit,
            "met": rows[name]["extra_mib"] <= limit,
        }  # fmt: skip
        for name in GOAL_CONFIGS
        if name in rows
    }


def print_table(rows: dict[str, dict], args) -> None:
    """The table: RSS figures in MiB, then the accounted state in MiB."""
    print(
        f"{args.model}, 2 gloo workers, batch {args.batch}/worker, peak RSS (VmHWM) of the "
        f"worse worker after {args.steps} steps, median of {args.reps} fresh runs (min-max); "
        f"steady: extra peak over the steps after the first {args.steady_after}"
    )
    head = f"{'configuration':<26} {'peak':>8} {'spread':>13} {'extra':>7} {'steady':>7} |"
    cols = ("memory", "factors", "buffers", "accumulators", "unique")
    print(head + "".join(f" {c[:7]:>8}" for c in cols) + "  (MiB; state accounted by tensor)")
    for row in rows.values():
        extra = "-" if row["extra_mib"] is None else f"{row['extra_mib']:.1f}"
        spread = f"{row['peak_rss_mib_min']:.1f}-{row['peak_rss_mib_max']:.1f}"
        steady = row.get("steady_extra_mib")
        steady = "-" if steady is None else f"{steady:.1f}"
        line = (f"{row['label']:<26} {row['peak_rss_mib_median']:>8.1f} {spread:>13} {extra:>7}"
                f" {steady:>7} |")  # fmt: skip
        state = row["state"]
        line += "".join(f" {state[c] / MiB:>8.2f}" if c in state else f" {'-':>8}" for c in cols)
        print(line)
    for name, verdict in goal(rows).items():
        word = "met" if verdict["met"] else "NOT met"
        print(
            f"goal ({CONFIGS[name]} extra <= torch hook extra + {GOAL_MARGIN:.0%}): {word}: "
            f"{verdict['extra_mib']:.1f} MiB vs limit {verdict['limit_mib']:.1f} MiB"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="resnet18")
    parser.add_argument("--batch", type=int, default=32, help="samples per worker per step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--steady-after", type=int, default=2, metavar="K",
        help="also report the peak over the steps after the first K (Linux only)",
    )  # fmt: skip
    parser.add_argument("--reps", type=int, default=3, help="fresh runs per configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    parser.add_argument(
        "--mmap-threshold", type=int, default=128 * 1024, metavar="BYTES",
        help="glibc's M_MMAP_THRESHOLD for the workers (0: glibc's dynamic default)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.mmap_threshold:
        # A fixed threshold: every large tensor is mapped and unmapped. glibc's dynamic
        # one rises after each free of a large block, so later ones come from the heap,
        # whose freed pages stay resident depending on timing (spread of ~40 MiB).
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    configs = [c for c in CONFIGS if c in args.configs]
    runs: dict[str, list[list[dict]]] = {c: [] for c in configs}
    failed = {c: 0 for c in configs}
    for _ in range(args.reps):  # interleaved: a slow phase of the machine hits them all
        for config in configs:
            runs[config].append(run_with_retries(config, args, failed))
    dense: tuple[float | None, float | None] = (None, None)
    if "dense" in runs:
        row = summarize("dense", runs["dense"], dense)
        dense = (row["peak_rss_mib_median"], row["steady_peak_rss_mib_median"])
    rows = {c: summarize(c, runs[c], dense) for c in configs}
    for config, count in failed.items():
        rows[config]["failed_runs"] = count
    print_table(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": list(rows.values()), "goal": goal(rows)},
                      f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
