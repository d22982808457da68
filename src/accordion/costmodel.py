"""Alpha-beta model of communication time.

A collective on ``W`` workers over links of bandwidth ``B`` (bytes/s) and per-message
latency ``a`` (s) costs, with bandwidth-optimal ring algorithms:

* all-reduce of ``S`` bytes: ``2 (W - 1) a + 2 (W - 1) / W * S / B``
* all-gather of ``s`` bytes per worker: ``(W - 1) a + (W - 1) s / B``

Pure functions: no tensors, no ``torch.distributed``.
"""

from __future__ import annotations

import math
import re

from .accounting import check_world_size

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
