"""Measurements for the cost model: the link (timed all-reduces) and compression's cost.

:func:`measure_link` times all-reduces of growing sizes over a process group and fits
the alpha-beta model (``accordion.costmodel.fit_link``); :func:`measure_compute` times
the extra computation a compressor adds to one tensor; :func:`measure_step_compute`
times a training step's own computation (no communication). All three agree across ranks (times
are maxima over the ranks), so every rank takes the same decisions from them.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .compress import Compressor, Dense, ErrorFeedback, Reducer, SimulatedTransport
from .costmodel import fit_link

#: Smallest all-reduce timed (bytes): mostly latency.
SMALL_BYTES = 4 * 1024
#: Largest all-reduce timed (bytes).
MAX_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Link:
    """A measured link: ``bandwidth`` in bytes/s, ``latency`` in s, and the samples
    ``(bytes, seconds)`` it was fitted to."""

    bandwidth: float
    latency: float
    samples: tuple[tuple[int, float], ...]


def _agreed_max(values: list[float], group: Any) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def _time_allreduce(nbytes: int, repeats: int, group: Any) -> float:
    tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    dist.all_reduce(tensor, group=group)  # warm-up: connections, allocation
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        times.append(time.perf_counter() - start)
    # the slowest rank's median: that is when every rank has the result
    return _agreed_max([statistics.median(times)], group)[0]


def measure_link(
    group: Any = None, *, repeats: int = 3, target_s: float = 0.02, max_bytes: int = MAX_BYTES
) -> Link:
    """Time all-reduces over ``group`` and fit bandwidth (bytes/s) and latency (s).

    Sizes double from 256 KiB until one takes ``target_s`` seconds or reaches
    ``max_bytes``; with the 4 KiB one, the fit sees both the latency and the bandwidth.
    Collective: call it on every rank of ``group``; every rank gets the same result.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("measure_link needs an initialised process group")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not target_s > 0:
        raise ValueError(f"target_s must be > 0 seconds, got {target_s!r}")
    world = dist.get_world_size(group)
    samples = [(SMALL_BYTES, _time_allreduce(SMALL_BYTES, repeats, group))]
    nbytes = 256 * 1024
    while True:
        seconds = _time_allreduce(nbytes, repeats, group)
        samples.append((nbytes, seconds))
        if seconds >= target_s or nbytes * 2 > max_bytes:
            break
        nbytes *= 2
    bandwidth, latency = fit_link([s for s, _ in samples], [t for _, t in samples], world)
    return Link(bandwidth, latency, tuple(samples))


def _time_reducer(
    reducer: Reducer, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, repeats: int
) -> float:
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    transport = SimulatedTransport(1)
    times = []
    for _ in range(repeats + 1):  # the first call allocates warm-start state
        work = grad.clone()
        start = time.perf_counter()
        transport.run([reducer.exchange(["t"], [work], 1)])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure_compute(
    make_compressor: Callable[[], Compressor],
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    repeats: int = 5,
    group: Any = None,
) -> list[float]:
    """Seconds per step that compressing each of ``shapes`` adds over sending it dense.

    Each shape is run through a fresh ``Reducer(make_compressor(), ErrorFeedback())`` and
    a dense one, on one simulated worker, with this process's torch threads; the result
    is the difference of the medians (at least 0). With a process group, the maxima over
    its ranks are returned, so that every rank decides alike (collective then).
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    device = torch.device(device)
    measured: dict[tuple[int, ...], float] = {}
    for shape in shapes:
        shape = tuple(shape)
        if shape not in measured:
            compressed = _time_reducer(
                Reducer(make_compressor(), ErrorFeedback()), shape, dtype, device, repeats
            )
            dense = _time_reducer(Reducer(Dense()), shape, dtype, device, repeats)
            measured[shape] = max(0.0, compressed - dense)
    times = [measured[tuple(s)] for s in shapes]
    if times and dist.is_available() and dist.is_initialized():
        times = _agreed_max(times, group)
    return times


def measure_step_compute(
    model: torch.nn.Module,
    step: Callable[[], Any],
    *,
    steps: int = 5,
    warmup: int = 1,
    group: Any = None,
) -> float:
    """Seconds of computation per training step, without communication.

    Runs ``step()`` (a closure doing one forward and backward pass) ``warmup + steps``
    times under ``model.no_sync()`` when ``model`` is DDP-wrapped, so that no gradient is
    sent, and returns the median time (the maximum over the ranks under a process group:
    collective then). The model's parameters, buffers (e.g. BatchNorm statistics),
    gradients and the torch random state are restored afterwards, so that training goes
    on exactly as if this had not run.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(step):
        raise TypeError(f"step must be a callable doing one forward and backward, got {step!r}")
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {p: None if p.grad is None else p.grad.detach().clone() for p in model.parameters()}
    rng = torch.get_rng_state()
    no_sync = getattr(model, "no_sync", None)
    times = []
    try:
        for i in range(warmup + steps):
            start = time.perf_counter()
            with no_sync() if no_sync is not None else contextlib.nullcontext():
                step()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    finally:
        model.load_state_dict(saved)
        for param, grad in grads.items():
            param.grad = grad
        torch.set_rng_state(rng)
    seconds = statistics.median(times)
    if dist.is_available() and dist.is_initialized():
        seconds = _agreed_max([seconds], group)[0]
    return seconds


__all__ = [
    "Link",
    "measure_link",
    "measure_compute",
    "measure_step_compute",
    "MAX_BYTES",
    "SMALL_BYTES",
]
