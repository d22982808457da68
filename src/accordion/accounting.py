"""Communication accounting: what each tensor costs to send, per worker per step.

Two measures are kept apart on purpose:

* **paper floats** -- the convention of the Accordion paper's "Data Sent" columns, as
  each compressor's cost description states it (``Compressor.paper_floats``): a
  PowerSGD tensor costs ``(n + m) * r'`` floats, a dense tensor ``numel`` floats, a
  top-k tensor ``2 * floor(k * numel) * W`` floats (values and indices, times the
  ``W`` workers of the all-gather). No ring factor.
* **wire bytes** -- what one worker really puts on the network for the collective
  used, assuming bandwidth-optimal ring algorithms: an all-reduce of ``S`` bytes
  sends ``2 (W - 1) / W * S`` bytes per worker, an all-gather of ``s`` bytes per
  worker sends ``(W - 1) * s`` bytes per worker, and the integer quantisers' two-phase
  exchange of ``S`` compressed bytes sends ``2 (W - 1) / W * S``, as an all-reduce
  (``compress/wire.py``: the chunks' padding to whole blocks left out).

A tensor is charged as it is really sent: dense when the compressor does not apply to
its shape, or when its level does not pay for it (sends at least as much as dense:
``Compressor.pays``, e.g. a 3 x 64 matrix at PowerSGD rank 8 costs 192 floats, not 201).

Everything here is pure arithmetic on shapes: no tensors, no ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._validate import check_int
from .compress.base import sent_as
from .compress.cost import check_shape
from .compress.wire import allgather_bytes, allreduce_bytes, check_world_size

__all__ = [
    "LayerTotals",
    "Ledger",
    "allgather_bytes",
    "allreduce_bytes",
    "check_world_size",
    "effective_kind",
    "is_compressible",
    "paper_floats",
    "wire_bytes",
]


def is_compressible(shape: Sequence[int]) -> bool:
    """Whether a tensor of this shape has 2 or more dimensions, which is what a
    compressor applies to unless it says otherwise; ask the compressor itself:
    ``compressor_class(name).applies_to(shape)``."""
    return len(shape) >= 2


def effective_kind(shape: Sequence[int], kind: str, level: Any = None) -> str:
    """The compressor a tensor is really sent with: ``kind`` when it applies to the
    shape (and, given a ``level`` other than ``None``, when that level pays for it:
    ``Compressor.pays``), else ``"dense"``. An unregistered ``kind`` is a ``ValueError``."""
    return (sent_as(shape, kind) if level is None else sent_as(shape, kind, level)).name


def paper_floats(shape: Sequence[int], kind: str, level: Any, world_size: int) -> int:
    """Floats one worker sends for one tensor in one step, in the paper's convention.

    ``level`` is the compressor's level (PowerSGD rank, top-k fraction, ...); it is
    ignored for ``kind="dense"`` and for tensors the compressor does not apply to. A
    tensor whose level does not pay for it (``Compressor.pays``) costs its dense
    ``numel`` floats: the hook sends it dense.
    """
    dims = check_shape(shape)
    check_world_size(world_size)
    return sent_as(dims, kind, level).paper_floats(dims, level, world_size)


def wire_bytes(
    shape: Sequence[int], kind: str, level: Any, world_size: int, element_size: int = 4
) -> float:
    """Bytes one worker puts on the wire for one tensor in one step (ring collectives).

    ``element_size`` is the size in bytes of one gradient element (4 for fp32, 2 for
    fp16/bf16). A single worker sends nothing. A tensor whose level does not pay for
    it costs its dense bytes, as :func:`paper_floats` says.
    """
    dims = check_shape(shape)
    check_world_size(world_size)
    return sent_as(dims, kind, level).wire_bytes(dims, level, world_size, element_size)


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
        check_int("steps", steps, 0)
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

    def add_extra(self, name: str, floats: int, nbytes: float) -> None:
        """Add a cost beyond a step's to tensor ``name`` (a rule's measurement), counting
        no step."""
        totals = self.layers.setdefault(str(name), LayerTotals())
        totals.floats += floats
        totals.bytes += nbytes

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
