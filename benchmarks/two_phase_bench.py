"""Bytes and time of averaging a gradient buffer: dense fp32 all-reduce, the quantisers'
all-gather, and their two-phase exchange, on W local gloo processes.

For each buffer size M (``--numel``, elements per worker) and worker count W
(``--workers``), W processes (one thread each, a file rendezvous) average one fp32
buffer of M elements, drawn per rank, with:

* ``dense fp32``: ``dist.all_reduce`` of the buffer, then ``/ W``;
* per quantiser (``--codecs``: int8, int4, int2, nq2), ``all-gather`` and ``two-phase``:
  ``TorchTransport().run(compressor.exchange(["g"], [buffer], W))`` for
  ``IntQuantizer(bits, collective=...)`` or ``NormalQuantizer(2, collective=...)``.

**Bytes are the primary metric.** Per worker per exchange, from the transport's
``bytes_sent`` (ring algorithms: :func:`~accordion.compress.transport.collective_bytes`,
which gives the dense all-reduce's too): the all-gather sends ``W - 1`` times its
payload, growing with W; two phases send ``2 (W - 1) / W`` of it plus the padding of the
chunks to whole blocks, flat in W as a dense ring all-reduce is. **The times are
secondary**: W processes over loopback on a 2-core machine are CPU-bound (W = 8 shares 2
cores 8 ways; the wire costs nothing), so they price the arithmetic and the collectives'
copies, not a network. A time is the slowest rank's per exchange (a barrier before each),
median over ``--iters`` exchanges after ``--warmup``; the buffer is restored before each
(an exchange leaves its residual in it) and the compressor's state (server errors) is
kept, as in training. The error is ``|average - mean| / |mean|`` of the first exchange
(no error feedback yet), against the dense mean.

    PYTHONPATH=src .venv/bin/python benchmarks/two_phase_bench.py --json runs/two_phase.json
    PYTHONPATH=src .venv/bin/python benchmarks/two_phase_bench.py --quick   # ~30 s

``--quick``: M = 65,536, W in {2, 4}, 3 iterations after 1. Prints a Markdown table;
``--json PATH`` writes the rows and the settings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accordion.compress import TorchTransport
from accordion.compress.normalquant import NormalQuantizer
from accordion.compress.quantize import IntQuantizer
from accordion.compress.transport import AllReduce, collective_bytes

#: The quantisers: label, class and bit width.
CODECS = {"int8": (IntQuantizer, 8), "int4": (IntQuantizer, 4), "int2": (IntQuantizer, 2),
          "nq2": (NormalQuantizer, 2)}  # fmt: skip
#: The collectives each quantiser is measured in: the constructor's name, the table's.
COLLECTIVES = {"all_gather": "all-gather", "two_phase": "two-phase"}
DENSE = "dense fp32"


def method_name(codec: str, collective: str) -> str:
    """A row's method: ``"int8 two-phase"``, say."""
    return f"{codec} {COLLECTIVES[collective]}"


def _relative_error(average: torch.Tensor, mean: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(average.double() - mean.double())
            / torch.linalg.vector_norm(mean.double())).item()  # fmt: skip


def _timed(run, restore, warmup: int, iters: int) -> list[float]:
    """This rank's seconds of ``run()`` for ``iters`` calls after ``warmup``, every rank
    starting each call together (a barrier), ``restore()`` untimed before it."""
    times = []
    for i in range(warmup + iters):
        restore()
        dist.barrier()
        start = time.perf_counter()
        run()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _slowest_ms(times: list[float]) -> list[float]:
    """Per call the slowest rank's milliseconds (every rank gets them)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    return [max(per_rank) * 1e3 for per_rank in zip(*everyone)]


def measure(numel: int, codecs: Sequence[str], warmup: int, iters: int) -> list[dict[str, Any]]:
    """Every method's row for one buffer of ``numel`` elements on this process group
    (collective: every rank calls it with the same arguments)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    source = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    mean = source.clone()
    dist.all_reduce(mean)
    mean.div_(world)
    buffer = torch.empty_like(source)

    def restore() -> None:
        buffer.copy_(source)

    def dense() -> None:
        dist.all_reduce(buffer)
        buffer.div_(world)

    times = _slowest_ms(_timed(dense, restore, warmup, iters))
    rows = [_row(numel, world, DENSE, collective_bytes(AllReduce(buffer), world), times,
                 _relative_error(buffer, mean))]  # fmt: skip
    for codec in codecs:
        for collective in COLLECTIVES:
            rows.append(_measure_codec(codec, collective, buffer, restore, mean, warmup, iters))
    dense_bytes = rows[0]["bytes_per_worker"]
    for row in rows:
        row["vs_dense"] = row["bytes_per_worker"] / dense_bytes
    return rows


def _measure_codec(codec: str, collective: str, buffer: torch.Tensor, restore: Any,
                   mean: torch.Tensor, warmup: int, iters: int) -> dict[str, Any]:  # fmt: skip
    """One quantiser's row in one collective (a fresh compressor, kept over the calls)."""
    world = dist.get_world_size()
    cls, bits = CODECS[codec]
    compressor, transport = cls(bits, collective=collective), TorchTransport()
    sent, first = [], []

    def exchange() -> None:
        before = transport.bytes_sent
        [(average, _)] = transport.run(compressor.exchange(["g"], [buffer], world))
        sent.append(transport.bytes_sent - before)
        if not first:  # no error feedback yet
            first.append(_relative_error(average, mean))

    times = _slowest_ms(_timed(exchange, restore, warmup, iters))
    if len(set(sent)) != 1:
        raise RuntimeError(f"{method_name(codec, collective)} sent {sorted(set(sent))} bytes "
                           "in different exchanges of one buffer")  # fmt: skip
    return _row(buffer.numel(), world, method_name(codec, collective), sent[0], times, first[0])


def _row(numel: int, world: int, method: str, nbytes: float, times: list[float],
         error: float) -> dict[str, Any]:  # fmt: skip
    return {"numel": numel, "workers": world, "method": method, "bytes_per_worker": nbytes,
            "ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
            "error": error}  # fmt: skip


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)  # W processes share the cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))  # fmt: skip
    try:
        rows = [row for numel in args.numel
                for row in measure(numel, args.codecs, args.warmup, args.iters)]  # fmt: skip
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        dist.barrier()  # gloo may abort at exit without one before teardown
        dist.destroy_process_group()
    # gloo's threads sometimes abort the process in C++ teardown at exit, after the work
    # is done and written: skip that teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_workers(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row at ``world`` workers, from ``world`` spawned gloo processes; a worker's
    error is raised, and workers still running after ``args.timeout`` s are killed."""
    with tempfile.TemporaryDirectory(prefix="two-phase-bench-") as tmp:
        out = os.path.join(tmp, "rows.json")
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), args, out),
                                 nprocs=world, join=False, start_method="spawn")  # fmt: skip
        deadline = time.monotonic() + args.timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in ctx.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{world} workers did not finish in {args.timeout} s")
        with open(out) as f:
            return json.load(f)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table, by size, then workers, then method."""
    lines = ["| M | W | method | bytes / worker | vs dense | ms (min-max) | error |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['numel']:,} | {r['workers']} | {r['method']} | "
                     f"{r['bytes_per_worker']:,.0f} | {r['vs_dense']:.3f}x | {r['ms']:.1f} "
                     f"({r['ms_min']:.1f}-{r['ms_max']:.1f}) | {r['error']:.2e} |")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--numel",
        type=int,
        nargs="+",
        default=None,
        help="elements a worker (1,000,000 16,000,000; quick 65,536)",
    )
    parser.add_argument(
        "--workers", type=int, nargs="+", default=None, help="worker counts (2 4 8; quick 2 4)"
    )
    parser.add_argument("--codecs", nargs="+", choices=tuple(CODECS), default=list(CODECS))
    parser.add_argument("--iters", type=int, default=None, help="timed exchanges (10; quick 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed exchanges first (1)")
    parser.add_argument("--quick", action="store_true", help="M 65,536, W 2 and 4, 3 iterations")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a worker count may run before its workers are killed",
    )
    parser.add_argument("--json", default=None, help="write the rows and settings here")
    args = parser.parse_args(argv)
    if args.numel is None:
        args.numel = [65_536] if args.quick else [1_000_000, 16_000_000]
    if args.workers is None:
        args.workers = [2, 4] if args.quick else [2, 4, 8]
    if args.iters is None:
        args.iters = 3 if args.quick else 10
    for name, values in (("--numel", args.numel), ("--workers", args.workers),
                         ("--iters", [args.iters])):  # fmt: skip
        bad = [v for v in values if v < 1]
        if bad:
            parser.error(f"{name} must be at least 1, got {bad}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    rows = [row for world in args.workers for row in run_workers(world, args)]
    rows.sort(key=lambda r: (r["numel"], r["workers"]))  # stable: methods keep their order
    print(
        f"Averaging M fp32 elements a worker over W gloo processes (1 thread each) on "
        f"{os.cpu_count()} cores; bytes a worker sends per exchange (ring algorithms), "
        f"time: the slowest rank's, median of {args.iters} after {args.warmup} "
        f"(CPU-bound on loopback: bytes are the measure); error: |average - mean| / |mean|"
    )
    print(table(rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = {"numel": args.numel, "workers": args.workers, "codecs": args.codecs,
                "iters": args.iters, "warmup": args.warmup, "quick": args.quick,
                "cores": os.cpu_count(), "torch": torch.__version__,
                "python": platform.python_version(),
                "elapsed_s": time.monotonic() - start}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
