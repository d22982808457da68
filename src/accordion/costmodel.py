"""Alpha-beta model of communication time.

A collective on ``W`` workers over links of bandwidth ``B`` (bytes/s) and per-message
latency ``a`` (s) costs, with bandwidth-optimal ring algorithms:

* all-reduce of ``S`` bytes: ``2 (W - 1) a + 2 (W - 1) / W * S / B``
* all-gather of ``s`` bytes per worker: ``(W - 1) a + (W - 1) s / B``
* two-phase exchange of ``S`` compressed bytes per worker (an all-to-all of ``W``
  chunks, then an all-gather of one): ``(W - 1) a + (W - 1) / W * S / B`` each, an
  all-reduce's ``2 (W - 1) a + 2 (W - 1) / W * S / B`` in all

It also decides what to compress: :func:`fit_link` turns timed all-reduces into a
bandwidth and a latency, and :func:`choose_dense` picks the tensors whose compression
costs more time (computation) than it saves (transfer). Pure functions: no tensors, no
``torch.distributed`` (``accordion.calibration`` measures the inputs).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ._validate import check_int, check_number
from .accounting import check_world_size, wire_bytes

_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BANDWIDTH_HELP = (
    "a number with a unit: bit, kbit, mbit, gbit, tbit (bits/s, any case); "
    "b/s or bps with a lowercase b for bits/s and B/s or Bps with an uppercase B for bytes/s, "
    "after a prefix k, M, G or T; for example '10Gbit', '100Mb/s', '1.25GB/s'"
)
_LATENCY_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]+)\s*$")


def _bandwidth_scale(unit: str) -> float | None:
    """Bytes/s per unit of ``unit``, or ``None`` when it is not a known unit."""
    lower = unit.lower()
    if lower.endswith("bit"):
        prefix, per_unit = lower[:-3], 1 / 8
    elif lower.endswith(("b/s", "bps")):
        # the case of the b decides: Gb/s and Gbps are gigabits, GB/s and GBps gigabytes
        prefix, per_unit = lower[:-3], (1.0 if unit[-3] == "B" else 1 / 8)
    else:
        return None
    return _PREFIXES[prefix] * per_unit if prefix in _PREFIXES else None


def parse_bandwidth(text: str) -> float:
    """Parse a link rate such as ``"10Gbit"``, ``"100Mb/s"`` or ``"1.25GB/s"`` into bytes/s.

    ``bit`` units are bits per second whatever their case; in ``b/s`` and ``bps`` units a
    lowercase ``b`` means bits and an uppercase ``B`` bytes. Prefixes are SI (k, M, G, T).
    """
    if not isinstance(text, str):
        raise TypeError(f"bandwidth must be a str, {_BANDWIDTH_HELP}; got {text!r}")
    match = _QUANTITY.match(text)
    scale = _bandwidth_scale(match.group(2)) if match else None
    if match is None or scale is None:
        raise ValueError(f"bandwidth must be {_BANDWIDTH_HELP}; got {text!r}")
    value = float(match.group(1)) * scale
    if not value > 0 or math.isinf(value):
        raise ValueError(f"bandwidth must be positive and finite, {_BANDWIDTH_HELP}; got {text!r}")
    return value


def parse_latency(text: str) -> float:
    """Parse a latency such as ``"50us"``, ``"1ms"`` or ``"0"`` into seconds."""
    if not isinstance(text, str):
        raise TypeError(f"latency must be a str such as '50us', got {text!r}")
    if text.strip() == "0":
        return 0.0
    match = _QUANTITY.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _LATENCY_UNITS:
        raise ValueError(
            f"latency must be a number with a unit in {sorted(_LATENCY_UNITS)}, "
            f"such as '50us', got {text!r}"
        )
    value = float(match.group(1)) * _LATENCY_UNITS[unit]
    if math.isinf(value):
        raise ValueError(f"latency must be finite, got {text!r}")
    return value


def _check(world_size: int, bandwidth: float, latency: float) -> None:
    check_world_size(world_size)
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    if not latency >= 0:
        raise ValueError(f"latency must be >= 0 s, got {latency!r}")


def allreduce_time(nbytes: float, world_size: int, bandwidth: float, latency: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` (bandwidth in bytes/s, latency in s)."""
    _check(world_size, bandwidth, latency)
    if world_size == 1 or nbytes == 0:
        return 0.0
    w = world_size
    return 2 * (w - 1) * latency + 2 * (w - 1) / w * nbytes / bandwidth


def allgather_time(
    nbytes_per_worker: float, world_size: int, bandwidth: float, latency: float
) -> float:
    """Seconds for a ring all-gather of ``nbytes_per_worker`` from each worker."""
    _check(world_size, bandwidth, latency)
    if world_size == 1 or nbytes_per_worker == 0:
        return 0.0
    w = world_size
    return (w - 1) * latency + (w - 1) * nbytes_per_worker / bandwidth


def two_phase_time(nbytes: float, world_size: int, bandwidth: float, latency: float) -> float:
    """Seconds for the two-phase exchange of ``nbytes`` compressed bytes per worker: an
    all-to-all of its ``W`` chunks and an all-gather of one chunk from each worker, each
    ``(W - 1) a + (W - 1) / W * nbytes / B``, which is :func:`allreduce_time` (chunk
    padding left out; bandwidth in bytes/s, latency in s)."""
    return allreduce_time(nbytes, world_size, bandwidth, latency)


def transfer_time(
    shape: Sequence[int], kind: str, level: object, world_size: int, bandwidth: float,
    element_size: int = 4,
) -> float:  # fmt: skip
    """Seconds one tensor adds to its bucket's collectives: its wire bytes per worker
    (ring algorithms, ``accordion.accounting.wire_bytes``) over ``bandwidth`` (bytes/s).

    The latency terms belong to the bucket's collectives, not to one tensor.
    """
    _check(world_size, bandwidth, 0.0)
    return wire_bytes(shape, kind, level, world_size, element_size) / bandwidth


def fit_link(
    sizes: Sequence[float], seconds: Sequence[float], world_size: int
) -> tuple[float, float]:
    """Fit :func:`allreduce_time` to timed all-reduces: ``(bandwidth bytes/s, latency s)``.

    ``sizes`` are the all-reduced bytes, ``seconds`` the times measured (least squares
    over at least two distinct sizes). A negative fitted latency, which noise can give
    on a fast link, is taken as zero and the bandwidth refitted through the origin.
    """
    check_world_size(world_size)
    if world_size == 1:
        raise ValueError("world_size must be >= 2 to fit a link: one worker sends nothing")
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError(
            "sizes and seconds must have the same length and at least two distinct sizes, "
            f"got {len(set(sizes))} distinct sizes for {len(seconds)} times"
        )
    if any(not (s > 0 and math.isfinite(s)) for s in [*sizes, *seconds]):
        raise ValueError("sizes and seconds must be positive and finite")
    n = len(sizes)
    mean_s, mean_t = sum(sizes) / n, sum(seconds) / n
    var = sum((s - mean_s) ** 2 for s in sizes)
    slope = sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, seconds)) / var
    intercept = mean_t - slope * mean_s
    if intercept < 0:
        intercept = 0.0
        slope = sum(s * t for s, t in zip(sizes, seconds)) / sum(s * s for s in sizes)
    if not slope > 0:
        raise ValueError("the measured times do not grow with the size: cannot fit a bandwidth")
    w = world_size
    return 2 * (w - 1) / w / slope, intercept / (2 * (w - 1))


@dataclass(frozen=True)
class TensorCost:
    """Predicted seconds per step for one tensor, sent dense or compressed.

    ``dense_s`` and ``compressed_s`` are the bandwidth terms of its collectives (what it
    adds to a bucket's transfer); ``compute_s`` is the extra computation compression
    costs (compress, decompress, error feedback) beyond the dense path.
    """

    key: str
    shape: tuple[int, ...]
    dense_s: float
    compressed_s: float
    compute_s: float

    @property
    def saving_s(self) -> float:
        """Seconds per step that compressing this tensor saves (negative: it costs)."""
        return self.dense_s - self.compressed_s - self.compute_s


def choose_dense(
    costs: Sequence[TensorCost],
    world_size: int,
    latency: float,
    buckets: int = 1,
    compute_s: float | None = None,
    other_s: float = 0.0,
    element_size: int = 4,
    rounds: int = 1,
) -> list[str]:
    """Keys to send dense: those whose compression costs more than it saves.

    Compression adds ``rounds`` collectives per bucket (its cost description's
    ``extra_collectives``: a second round of factors, a second all-gather; none where
    they travel with the dense tensors), ``2 (W - 1) latency`` each, counted once any
    tensor is compressed.

    Without ``compute_s`` the transfer is assumed not to overlap computation: each tensor
    is compressed when its own saving (``TensorCost.saving_s``) is positive, and nothing
    is when the savings together do not cover the extra collectives.

    With ``compute_s``, the seconds per step of forward and backward, the transfer hides
    behind the backward pass only, and only once each gradient is ready (DDP's overlap):
    see :func:`overlapped_step`. ``costs`` must be in the module's parameter order (the
    backward pass produces their gradients in reverse). ``other_s`` is the transfer time
    of the tensors sent dense anyway (biases, norms), counted at the end; ``element_size``
    (bytes per gradient element) places the tensors in DDP's buckets. The tensors are
    taken in order of transfer saved per second of computation, and the prefix with the
    shortest predicted step is kept (none on a tie).
    """
    check_world_size(world_size)
    check_int("buckets", buckets, 1)
    check_int("rounds", rounds, 0)
    extra_latency = buckets * rounds * 2 * (world_size - 1) * latency
    if compute_s is None:
        paying = [c for c in costs if c.saving_s > 0]
        if sum(c.saving_s for c in paying) <= extra_latency:
            return [c.key for c in costs]
        return [c.key for c in costs if c.saving_s <= 0]
    check_number("compute_s", compute_s, minimum=0, unit="seconds")
    check_number("other_s", other_s, minimum=0, unit="seconds")
    order = sorted(
        costs,
        key=lambda c: (c.dense_s - c.compressed_s) / max(c.compute_s, 1e-12),
        reverse=True,
    )
    steps = [
        overlapped_step(
            costs, {c.key for c in order[:i]}, compute_s, other_s, extra_latency, element_size
        )
        for i in range(len(order) + 1)
    ]
    best = min(range(len(steps)), key=lambda i: (steps[i], i))  # none on a tie
    compressed = {c.key for c in order[:best]}
    return [c.key for c in costs if c.key not in compressed]


#: The backward pass's share of a step's computation (about twice the forward's work).
BACKWARD_SHARE = 2 / 3
#: DDP's bucket caps (bytes): its first bucket, then every other (``bucket_cap_mb``).
FIRST_BUCKET_BYTES, BUCKET_BYTES = 2**20, 25 * 2**20


def overlapped_step(
    costs: Sequence[TensorCost],
    compressed: set[str],
    compute_s: float,
    other_s: float = 0.0,
    extra_latency: float = 0.0,
    element_size: int = 4,
) -> float:
    """Predicted seconds of a step that compresses the keys ``compressed`` of ``costs``
    (in parameter order), with DDP's overlap of communication and backward.

    The forward pass (``1 - BACKWARD_SHARE`` of ``compute_s``) hides nothing. The
    backward pass, lengthened by the compression's computation, produces the gradients
    in reverse parameter order at even intervals, into DDP's buckets (1 MiB, then 25 MiB
    of ``element_size``-byte gradients). A bucket goes on the link once its last
    gradient is ready and the link is free. The step ends when both the computation and
    the link are done; ``other_s`` and, if anything is compressed, ``extra_latency``
    (the extra sequential collectives) come last on the link.
    """
    work = compute_s * BACKWARD_SHARE + sum(c.compute_s for c in costs if c.key in compressed)
    start = compute_s - compute_s * BACKWARD_SHARE
    link, filled, cap, pending = start, 0, FIRST_BUCKET_BYTES, 0.0
    backward = list(reversed(costs))
    for j, c in enumerate(backward, start=1):
        pending += c.compressed_s if c.key in compressed else c.dense_s
        filled += math.prod(c.shape) * element_size
        if filled >= cap or j == len(backward):  # the bucket is full: it is sent now
            link = max(link, start + work * j / len(backward)) + pending
            filled, cap, pending = 0, BUCKET_BYTES, 0.0
    link += other_s + (extra_latency if compressed else 0.0)
    return max(start + work, link)
