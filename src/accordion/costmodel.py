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

_BANDWIDTH_UNITS = {
    # bits per second, SI prefixes (as `tc` and network vendors use them)
    "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
    "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8, "tbps": 1e12 / 8,
    # bytes per second
    "b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
}  # fmt: skip
_LATENCY_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]+)\s*$")


def parse_bandwidth(text: str) -> float:
    """Parse a link rate such as ``"10Gbit"``, ``"100mbit"`` or ``"1.25GB/s"`` into bytes/s.

    ``bit``/``kbit``/``mbit``/``gbit``/``tbit`` (and ``...bps``) are bits per second with SI
    prefixes; ``B/s``, ``KB/s``, ``MB/s``, ``GB/s``, ``TB/s`` are bytes per second.
    """
    if not isinstance(text, str):
        raise TypeError(f"bandwidth must be a str such as '10Gbit', got {text!r}")
    match = _QUANTITY.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BANDWIDTH_UNITS:
        raise ValueError(
            f"bandwidth must be a number with a unit in {sorted(_BANDWIDTH_UNITS)} "
            f"(case-insensitive), such as '10Gbit', got {text!r}"
        )
    value = float(match.group(1)) * _BANDWIDTH_UNITS[unit]
    if not value > 0 or math.isinf(value):
        raise ValueError(f"bandwidth must be positive and finite, got {text!r}")
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
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
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
