"""All-reduce bandwidth probe, run under ``torchrun``.

``python -m torch.distributed.run ... -m accordion.cluster.netprobe --mbytes 4 --repeats 3``
times gloo all-reduces of a float32 tensor of ``--mbytes`` MB and prints, on rank 0, one
JSON line::

    {"world_size": 2, "bytes": 4000000, "seconds": 0.66, "bus_bandwidth_bytes_per_s": 6.0e6,
     "repeats": 3, "all_seconds": [...]}

``seconds`` is the median over the repeats of one all-reduce's wall time, and the bus
bandwidth (bytes/s) is ``2 (W - 1) / W * bytes / seconds``: the link rate that the ring
all-reduce model of :func:`accordion.costmodel.allreduce_time` (with zero latency) would
need to take that long, so it can be compared directly with an emulated link's rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence


def bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> float:
    """Bytes/s of the ring all-reduce model for ``nbytes`` all-reduced in ``seconds``."""
    if world_size < 2 or not seconds > 0:
        raise ValueError(
            f"bus bandwidth needs world_size >= 2 and seconds > 0, got {world_size}, {seconds}"
        )
    return 2 * (world_size - 1) / world_size * nbytes / seconds


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m accordion.cluster.netprobe",
        description="Time gloo all-reduces under torchrun; rank 0 prints one JSON line.",
    )
    parser.add_argument("--mbytes", type=float, default=4.0, help="tensor size, MB (1e6 bytes)")
    parser.add_argument("--repeats", type=int, default=3, help="timed all-reduces (median)")
    args = parser.parse_args(argv)
    if not args.mbytes > 0:
        parser.error(f"argument --mbytes: must be > 0, got {args.mbytes}")
    if args.repeats < 1:
        parser.error(f"argument --repeats: must be an int >= 1, got {args.repeats}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Run the probe in this torchrun worker; exits the process (see the end)."""
    args = _parse(argv)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    numel = max(1, int(args.mbytes * 1e6) // 4)
    tensor = torch.ones(numel, dtype=torch.float32)
    # the first collective sets up gloo's connections and buffers: not part of the rate
    dist.all_reduce(tensor)
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    nbytes = numel * 4
    if dist.get_rank() == 0:
        result = {
            "world_size": world,
            "bytes": nbytes,
            "seconds": seconds,
            "bus_bandwidth_bytes_per_s": bus_bandwidth(nbytes, seconds, world),
            "repeats": args.repeats,
            "all_seconds": times,
        }
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # gloo on torch 2.13 sometimes aborts while C++ statics are destroyed at exit
    # ("terminate called without an active exception"): the work is done, skip that
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
