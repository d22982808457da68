"""Communication accounting: what each tensor costs to send, per worker per step.

Two measures are kept apart on purpose:

* **paper floats** -- the convention of the Accordion paper's "Data Sent" columns:
  a PowerSGD tensor costs ``(n + m) * r'`` floats, a dense tensor ``numel`` floats,
  a top-k tensor ``2 * floor(k * numel) * W`` floats (values and indices, times the
  ``W`` workers of the all-gather). No ring factor.
* **wire bytes** -- what one worker really puts on the network for the collective
  used, assuming bandwidth-optimal ring algorithms: an all-reduce of ``S`` bytes
  sends ``2 (W - 1) / W * S`` bytes per worker, an all-gather of ``s`` bytes per
  worker sends ``(W - 1) * s`` bytes per worker.

Everything here is pure arithmetic on shapes: no tensors, no ``torch.distributed``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._validate import check_int

#: Names of the compressor kinds that the accounting knows.
KINDS = ("dense", "powersgd", "topk")

#: Bytes of an int32 index; top-k indices are int32 whenever the tensor has < 2**31 entries.
INT32_BYTES = 4
INT64_BYTES = 8


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError as exc:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from exc
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must have non-negative sizes, got {shape!r}")
    return dims


def check_world_size(world_size: int) -> int:
    """Validate a number of workers (an int >= 1) and return it."""
    return check_int("world_size", world_size, 1)


def check_rank(rank: Any) -> int:
    """Validate a PowerSGD rank (an int >= 1, not a bool) and return it as an int."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise TypeError(f"rank must be an int >= 1, got {rank!r}")
    if rank < 1:
        raise ValueError(f"rank must be an int >= 1, got {rank}")
    return int(rank)


def check_fraction(fraction: Any) -> float:
    """Validate a top-k fraction (a real number in (0, 1]) and return it as a float."""
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise TypeError(f"fraction must be a number in (0, 1], got {fraction!r}")
    if math.isnan(fraction) or not 0.0 < float(fraction) <= 1.0:
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction}")
    return float(fraction)


def is_compressible(shape: Sequence[int]) -> bool:
    """Whether a tensor of this shape is compressed: only tensors with 2 or more dimensions are."""
    return len(shape) >= 2


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The ``(n, m)`` matrix view PowerSGD uses: ``n = shape[0]``, ``m = numel / n``."""
    dims = _check_shape(shape)
    if len(dims) < 2:
        raise ValueError(f"a matrix view needs a tensor with >= 2 dimensions, got shape {dims}")
    n = dims[0]
    return n, (math.prod(dims) // n if n else 0)


def powersgd_rank(shape: Sequence[int], rank: int) -> int:
    """The effective PowerSGD rank ``r' = min(n, m, rank)`` for a tensor of this shape."""
    n, m = matrix_shape(shape)
    return min(n, m, rank)


def topk_count(numel: int, fraction: float) -> int:
    """Entries top-k keeps: ``floor(fraction * numel)``, at least 1 (0 for an empty tensor)."""
    if numel == 0:
        return 0
    return max(1, math.floor(fraction * numel))


def index_bytes(numel: int) -> int:
    """Bytes per top-k index: int32 when every flat index fits in it, else int64."""
    return INT32_BYTES if numel <= 2**31 - 1 else INT64_BYTES


def allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one worker sends in a ring all-reduce of ``nbytes``: ``2 (W - 1) / W * nbytes``."""
    return 2.0 * (world_size - 1) / world_size * nbytes


def allgather_bytes(nbytes_per_worker: float, world_size: int) -> float:
    """Bytes one worker sends in a ring all-gather of ``nbytes_per_worker`` each: ``(W-1) * s``."""
    return float(world_size - 1) * nbytes_per_worker


def effective_kind(shape: Sequence[int], kind: str) -> str:
    """The kind a tensor is really sent with: tensors with < 2 dimensions always go dense."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return kind if is_compressible(shape) else "dense"


def paper_floats(shape: Sequence[int], kind: str, level: Any, world_size: int) -> int:
    """Floats one worker sends for one tensor in one step, in the paper's convention.

    ``level`` is the PowerSGD rank (int) or the top-k fraction (float in (0, 1]); it is
    ignored for ``kind="dense"`` and for tensors with fewer than 2 dimensions.
    """
    dims = _check_shape(shape)
    check_world_size(world_size)
    kind = effective_kind(dims, kind)
    numel = math.prod(dims)
    if kind == "dense":
        return numel
    if kind == "powersgd":
        n, m = matrix_shape(dims)
        return (n + m) * powersgd_rank(dims, check_rank(level))
    return 2 * topk_count(numel, check_fraction(level)) * world_size


def wire_bytes(
    shape: Sequence[int], kind: str, level: Any, world_size: int, element_size: int = 4
) -> float:
    """Bytes one worker puts on the wire for one tensor in one step (ring collectives).

    ``element_size`` is the size in bytes of one gradient element (4 for fp32, 2 for
    fp16/bf16). A single worker sends nothing.
    """
    dims = _check_shape(shape)
    check_world_size(world_size)
    kind = effective_kind(dims, kind)
    numel = math.prod(dims)
    if kind == "dense":
        return allreduce_bytes(numel * element_size, world_size)
    if kind == "powersgd":
        n, m = matrix_shape(dims)
        rank = powersgd_rank(dims, check_rank(level))
        return allreduce_bytes((n + m) * rank * element_size, world_size)
    k = topk_count(numel, check_fraction(level))
    return allgather_bytes(k * (element_size + index_bytes(numel)), world_size)


@dataclass
class LayerTotals:
    """Running totals of one layer (tensor): paper floats, wire bytes and steps counted."""

    floats: int = 0
    bytes: float = 0.0
    steps: int = 0


@dataclass
class Ledger:
    """Sums communication per layer over steps.

    ``record`` adds one step of one tensor; ``totals`` and ``total_floats`` /
    ``total_bytes`` read the sums back. Holds only plain Python values, so its
    ``state_dict()`` can be saved with ``torch.save`` and read with ``weights_only=True``.
    """

    layers: dict[str, LayerTotals] = field(default_factory=dict)

    def record(
        self,
        name: str,
        shape: Sequence[int],
        kind: str,
        level: Any,
        world_size: int,
        element_size: int = 4,
        steps: int = 1,
    ) -> None:
        """Add ``steps`` steps of tensor ``name`` sent with ``kind`` at ``level``."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        # both costs first: a rejected record must leave the ledger unchanged
        floats = paper_floats(shape, kind, level, world_size)
        nbytes = wire_bytes(shape, kind, level, world_size, element_size)
        self.add(name, floats, nbytes, steps)

    def add(self, name: str, floats: int, nbytes: float, steps: int = 1) -> None:
        """Add ``steps`` steps of a tensor whose per-step cost is already known
        (``floats`` paper-convention floats and ``nbytes`` wire bytes per step)."""
        totals = self.layers.setdefault(str(name), LayerTotals())
        totals.floats += steps * floats
        totals.bytes += steps * nbytes
        totals.steps += steps

    def record_all(
        self,
        tensors: Iterable[tuple[str, Sequence[int], str, Any]],
        world_size: int,
        element_size: int = 4,
        steps: int = 1,
    ) -> None:
        """Record many ``(name, shape, kind, level)`` tensors at once."""
        for name, shape, kind, level in tensors:
            self.record(name, shape, kind, level, world_size, element_size, steps)

    @property
    def total_floats(self) -> int:
        """Paper-convention floats sent per worker, summed over layers and steps."""
        return sum(t.floats for t in self.layers.values())

    @property
    def total_bytes(self) -> float:
        """Wire bytes sent per worker, summed over layers and steps."""
        return sum(t.bytes for t in self.layers.values())

    def totals(self) -> dict[str, dict[str, float]]:
        """Per-layer totals as plain dicts (JSON-serialisable)."""
        return {
            name: {"floats": t.floats, "bytes": t.bytes, "steps": t.steps}
            for name, t in self.layers.items()
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain-value state for checkpoints."""
        return {"layers": self.totals()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore totals saved by :meth:`state_dict`."""
        layers = state.get("layers") if isinstance(state, Mapping) else None
        if not isinstance(layers, Mapping) or not all(
            isinstance(v, Mapping) and {"floats", "bytes", "steps"} <= v.keys()
            for v in layers.values()
        ):
            raise ValueError(
                "state must be a dict from Ledger.state_dict(): "
                "{'layers': {name: {'floats', 'bytes', 'steps'}}}"
            )
        self.layers = {
            name: LayerTotals(int(v["floats"]), float(v["bytes"]), int(v["steps"]))
            for name, v in layers.items()
        }
