"""Measurements for the cost model: the link (timed all-reduces) and compression's cost.

:func:`measure_link` times all-reduces of growing sizes over a process group and fits
the alpha-beta model (``accordion.costmodel.fit_link``); :func:`measure_compute` times
the extra computation a compressor adds to one tensor; :func:`measure_step_compute`
times a training step's own computation (no communication). All three agree across ranks (times
are maxima over the ranks), so every rank takes the same decisions from them.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._validate import check_int, check_number
from .compress import Compressor, Dense, ErrorFeedback, LocalTransport, Reducer, TorchTransport
from .compress.transport import group_transport
from .costmodel import TensorCost, choose_dense, fit_link, transfer_time

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


def _agreed_max(values: list[float], transport: TorchTransport | LocalTransport) -> list[float]:
    """The maxima of ``values`` over the ranks of ``transport`` (``values`` for one)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    transport.all_reduce(tensor, "max")
    return tensor.tolist()


def _time_allreduce(nbytes: int, repeats: int, transport: TorchTransport) -> float:
    tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    transport.all_reduce(tensor)  # warm-up: connections, allocation
    times = []
    for _ in range(repeats):
        transport.barrier()
        start = time.perf_counter()
        transport.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    # the slowest rank's median: that is when every rank has the result
    return _agreed_max([statistics.median(times)], transport)[0]


def measure_link(
    group: Any = None, *, repeats: int = 3, target_s: float = 0.02, max_bytes: int = MAX_BYTES
) -> Link:
    """Time all-reduces over ``group`` and fit bandwidth (bytes/s) and latency (s).

    Sizes double from 256 KiB until one takes ``target_s`` seconds or reaches
    ``max_bytes``; with the 4 KiB one, the fit sees both the latency and the bandwidth.
    Collective: call it on every rank of ``group``; every rank gets the same result.
    """
    transport = group_transport(group)
    if not isinstance(transport, TorchTransport):
        raise RuntimeError("measure_link needs an initialised process group")
    check_int("repeats", repeats, 1)
    check_number("target_s", target_s, minimum=0, strict=True, unit="seconds")
    samples = [(SMALL_BYTES, _time_allreduce(SMALL_BYTES, repeats, transport))]
    nbytes = 256 * 1024
    while True:
        seconds = _time_allreduce(nbytes, repeats, transport)
        samples.append((nbytes, seconds))
        if seconds >= target_s or nbytes * 2 > max_bytes:
            break
        nbytes *= 2
    sizes, times = [s for s, _ in samples], [t for _, t in samples]
    bandwidth, latency = fit_link(sizes, times, transport.world_size)
    return Link(bandwidth, latency, tuple(samples))


def _time_reducer(
    reducer: Reducer, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, repeats: int
) -> float:
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    transport = LocalTransport()
    times = []
    for _ in range(repeats + 1):  # the first call allocates warm-start state
        work = grad.clone()
        start = time.perf_counter()
        transport.run(reducer.exchange(["t"], [work], 1))
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
    check_int("repeats", repeats, 1)
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
    if times:  # over one process (no group initialised), the maxima are the times
        times = _agreed_max(times, group_transport(group))
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
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 0)
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
    return _agreed_max([statistics.median(times)], group_transport(group))[0]


#: DDP's default bucket size (bytes), to estimate the number of buckets.
DDP_BUCKET_BYTES = 25 * 2**20


def calibrate(controller: Any, bandwidth: float | None = None, latency: float | None = None, *,
              buckets: int | None = None, repeats: int = 5,
              compute_s: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Measure what compression costs and saves, and send dense the tensors for which
    it does not pay (the ``auto`` mode). Call it on every rank once the module is bound
    and the process group initialised, before training.

    The link is measured with timed all-reduces over the controller's group unless
    ``bandwidth`` (bytes/s) and ``latency`` (s) are given; the extra computation of
    compressing each tensor at the mild level is timed on this process. A tensor is
    sent dense when that computation takes longer than the transfer time it saves
    (see :func:`accordion.costmodel.choose_dense`); ``buckets`` (default: estimated
    from DDP's 25 MiB buckets) counts the extra sequential collectives compression
    adds. Times are maxima over the ranks, so every rank decides alike. Deciding at
    the mild level is conservative: the aggressive level costs about as much
    computation and saves more transfer.

    ``compute_s`` (seconds per step of forward and backward, e.g. from
    :func:`measure_step_compute`) lets the model count the transfer that hides behind
    the backward pass, bucket by bucket as DDP overlaps it
    (:func:`accordion.costmodel.overlapped_step`): compression is chosen only where the
    link would still bind. Without it the transfer is assumed not to overlap at all,
    which favours compression.

    Returns a JSON-serialisable report (also in ``stats()["calibration"]``):
    ``bandwidth`` (bytes/s), ``latency`` (s), ``link_samples`` ([bytes, s] pairs, empty
    when given), ``buckets``, ``step_compute_s`` (``compute_s``), ``dense_keys`` and,
    per compressible tensor, ``dense_s``, ``compressed_s``, ``compute_s`` and
    ``compress``.
    """
    params = controller.params
    if params.module is None and not params.shapes:
        raise ValueError("calibrate needs bound parameters: pass model= or call bind_module")
    _check_calibration(bandwidth, latency, buckets, repeats, compute_s)
    transport = controller.transport()
    world = transport.world_size
    group = getattr(transport, "group", None)
    bandwidth, latency, samples = _link(bandwidth, latency, transport)
    if buckets is None:
        total = sum(math.prod(s) * params.element_size[k] for k, s in params.shapes.items())
        buckets = 1 + math.ceil(total / DDP_BUCKET_BYTES)
    costs = _tensor_costs(controller, bandwidth, repeats, world, group if world > 1 else None)
    other = _uncompressed_s(controller, world, bandwidth)
    size = next(iter(params.element_size.values()), 4)  # DDP's buckets count bytes
    dense = []
    if costs:
        rounds = controller.compressor.extra_collectives
        dense = choose_dense(costs, max(world, 2), latency, buckets, compute_s, other, size, rounds)
    controller.set_dense(dense)
    controller.calibration = _report(bandwidth, latency, samples, buckets, compute_s, dense, costs)
    return controller.calibration


def _uncompressed_s(controller: Any, world: int, bandwidth: float) -> float:
    """Seconds per step that the tensors the compressor does not apply to take, dense."""
    params, applies = controller.params, controller.compressor.applies_to
    return sum(
        transfer_time(shape, "dense", None, max(world, 2), bandwidth, params.element_size[k])
        for k, shape in params.shapes.items()
        if not applies(shape)
    )


def _link(bandwidth, latency, transport: Any) -> tuple[float, float, list[list[float]]]:
    """The given link, or one measured over ``transport``'s group with its samples."""
    if bandwidth is not None:
        return bandwidth, latency, []
    if transport.world_size == 1:
        raise ValueError("a single process has no link to measure: give bandwidth")
    link = measure_link(transport.group)
    return link.bandwidth, link.latency, [[nbytes, seconds] for nbytes, seconds in link.samples]


def _check_calibration(bandwidth, latency, buckets, repeats, compute_s) -> None:
    if (bandwidth is None) != (latency is None):
        raise ValueError("bandwidth and latency must be given together, or neither")
    if bandwidth is not None:
        check_number("bandwidth", bandwidth, minimum=0, strict=True, unit="bytes/s")
        check_number("latency", latency, minimum=0, unit="seconds")
    if buckets is not None:
        check_int("buckets", buckets, 1)
    check_int("repeats", repeats, 1)
    if compute_s is not None:
        check_number("compute_s", compute_s, minimum=0, unit="seconds")


def _tensor_costs(
    controller: Any, bandwidth: float, repeats: int, world: int, group: Any
) -> list[TensorCost]:
    """Per tensor the compressor applies to: dense and compressed transfer times at the
    mild level, and the computation compression adds (measured)."""
    params, name, mild = controller.params, controller.compressor_name, controller.mild
    keys = [k for k, s in params.shapes.items() if controller.compressor.applies_to(s)]
    if not keys:
        return []
    dtype = torch.float16 if params.element_size[keys[0]] == 2 else torch.float32
    device = next(iter(params.module.parameters())).device if params.module else "cpu"
    compute = measure_compute(
        controller._new_compressor, [params.shapes[k] for k in keys], dtype, device,
        repeats=repeats, group=group,
    )  # fmt: skip
    world = max(world, 2)  # a single process still gets a verdict for the model
    costs = []
    for key, extra_s in zip(keys, compute):
        shape, size = params.shapes[key], params.element_size[key]
        costs.append(TensorCost(
            key, shape,
            dense_s=transfer_time(shape, "dense", None, world, bandwidth, size),
            compressed_s=transfer_time(shape, name, mild, world, bandwidth, size),
            compute_s=extra_s,
        ))  # fmt: skip
    return costs


def _report(bandwidth, latency, samples, buckets, compute_s, dense, costs) -> dict[str, Any]:
    return {
        "bandwidth": float(bandwidth),
        "latency": float(latency),
        "link_samples": samples,
        "buckets": buckets,
        "step_compute_s": compute_s,
        "dense_keys": list(dense),
        "tensors": {
            c.key: {
                "dense_s": c.dense_s,
                "compressed_s": c.compressed_s,
                "compute_s": c.compute_s,
                "compress": c.key not in dense,
            }
            for c in costs
        },
    }


__all__ = [
    "calibrate",
    "DDP_BUCKET_BYTES",
    "Link",
    "measure_link",
    "measure_compute",
    "measure_step_compute",
    "MAX_BYTES",
    "SMALL_BYTES",
]
