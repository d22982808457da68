"""What a compressor would send for a model, before any training: the ``accordion plan``.

For each level (and for dense), from the parameter shapes alone: paper-convention floats
per step and over a run, real bytes per step and their ratio to dense's, the paper's
compression ratio and the communication time per step predicted by the alpha-beta
model. The time assumes the gradients travel as one bucket the way our reducer sends
it: one all-reduce of all the dense tensors, plus one per collective of the
compressor's messages (PowerSGD's P and Q factors, top-k's values and indices, the
integer quantisers' two-phase exchange). A tensor whose level does not pay for it
(``Compressor.pays``: it would send at least as much as dense) counts dense at that
level, as the hook sends it.

:func:`break_even` says where a compressor's levels stop paying for a model at a worker
count, where its cost description has such a point (``Compressor.break_even``: top-k's
all-gathers put more bytes on the wire than a dense ring all-reduce above a density of
``1/W`` for fp32 values and int32 indices; the integer quantisers' two phases have none,
their bytes against dense being flat in the workers). :func:`scaling_plan` repeats the plan over
worker counts and link rates. :func:`diloco_plan` turns a plan's rows into DiLoCo's,
per inner step of a run that syncs every H of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ._validate import check_int
from .accounting import check_world_size, paper_floats, wire_bytes
from .compress import BreakEvenDescription, Dense, compressor_class, sent_as
from .costmodel import allgather_time, allreduce_time, transfer_time, two_phase_time

#: The alpha-beta time of each collective a message travels in (``wire.OPS``).
_TIMES = {"allreduce": allreduce_time, "allgather": allgather_time, "twophase": two_phase_time}


@dataclass(frozen=True)
class PlanRow:
    """One level of a plan. Floats follow the paper's convention; bytes are per worker.

    ``compression_ratio`` is dense's floats over the level's (the paper's); ``bytes_vs_dense``
    the level's wire bytes per step over dense's (``None`` where dense sends none: one
    worker), what the link carries: they differ where the paper's floats do not see a
    collective's factor of the workers or a value's width.
    """

    label: str
    compressor: str
    level: Any
    floats_per_step: float  # an int but in DiLoCo's rows (one sync's floats / H)
    floats_total: float
    bytes_per_step: float
    compression_ratio: float
    bytes_vs_dense: float | None
    comm_time_per_step_s: float

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the row."""
        return asdict(self)


def comm_time_per_step(
    shapes: Sequence[Sequence[int]],
    kind: str,
    level: Any,
    world_size: int,
    bandwidth: float,
    latency: float,
    element_size: int = 4,
) -> float:
    """Predicted seconds of communication per step for one bucket of these tensors: each
    collective (the compressor's ``Message`` slots, and one all-reduce of the dense
    tensors) carries the shares of every tensor and pays its latency once."""
    # the dense all-reduce first, then the compressor's collectives in their order
    slots = {(m.op, m.slot): 0.0 for m in Dense.messages((0,), None, element_size)}
    for shape in shapes:
        shape = tuple(shape)
        for message in sent_as(shape, kind, level).messages(shape, level, element_size):
            key = (message.op, message.slot)
            slots[key] = slots.get(key, 0) + message.nbytes
    time = 0.0
    for (op, _), nbytes in slots.items():
        time += _TIMES[op](nbytes, world_size, bandwidth, latency)
    return time


def make_plan(
    shapes: Sequence[Sequence[int]],
    compressor: str,
    levels: Sequence[Any],
    world_size: int,
    steps: int,
    bandwidth: float,
    latency: float,
    element_size: int = 4,
) -> list[PlanRow]:
    """Rows for dense and for each of ``levels`` of ``compressor`` (a registered name other
    than "dense")."""
    check_world_size(world_size)
    check_int("steps", steps, 0)
    cls = _compressing(compressor)

    def sent(kind: str, level: Any) -> float:
        return sum(wire_bytes(s, kind, level, world_size, element_size) for s in shapes)

    dense_floats = sum(paper_floats(s, "dense", None, world_size) for s in shapes)
    dense_bytes = sent("dense", None)

    def row(label: str, kind: str, level: Any) -> PlanRow:
        floats = sum(paper_floats(s, kind, level, world_size) for s in shapes)
        nbytes = sent(kind, level)
        return PlanRow(
            label=label,
            compressor=kind,
            level=level,
            floats_per_step=floats,
            floats_total=floats * steps,
            bytes_per_step=nbytes,
            compression_ratio=dense_floats / floats if floats else math.inf,
            bytes_vs_dense=nbytes / dense_bytes if dense_bytes else None,
            comm_time_per_step_s=comm_time_per_step(
                shapes, kind, level, world_size, bandwidth, latency, element_size
            ),
        )

    rows = [row("dense", "dense", None)]
    for level in levels:
        rows.append(row(cls.label(level), compressor, level))
    return rows


def diloco_plan(rows: Sequence[PlanRow], sync_every: int) -> list[PlanRow]:
    """``rows`` (a :func:`make_plan`, dense first) for DiLoCo syncing every ``sync_every``
    (H) inner steps: each row's floats, bytes and seconds per inner step are one sync's
    divided by H, its total over the run's inner steps likewise, and its ratios are against
    dense *every step* (data-parallel training), so H multiplies the compression ratio
    and divides the bytes against dense. Labels read ``DiLoCo H=10, rank 4``."""
    h = check_int("sync_every", sync_every, 1)
    if not rows or rows[0].compressor != "dense":
        raise ValueError("rows must be a plan with dense first, as make_plan returns")
    dense = rows[0].floats_per_step
    return [
        replace(row, label=f"DiLoCo H={h}, {row.label}", floats_per_step=row.floats_per_step / h,
                floats_total=row.floats_total / h, bytes_per_step=row.bytes_per_step / h,
                compression_ratio=dense * h / row.floats_per_step if row.floats_per_step
                else math.inf,
                bytes_vs_dense=None if row.bytes_vs_dense is None else row.bytes_vs_dense / h,
                comm_time_per_step_s=row.comm_time_per_step_s / h)
        for row in rows
    ]  # fmt: skip


@dataclass(frozen=True)
class LayerRow:
    """One tensor of a plan: bytes one worker sends per step and their transfer time
    (bandwidth term only: the latency is paid per bucket, not per tensor), dense and at
    each level, in the order of the plan's levels."""

    name: str
    shape: tuple[int, ...]
    dense_bytes: float
    dense_time_s: float
    bytes: tuple[float, ...]
    time_s: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the row."""
        return asdict(self)


def layer_plan(
    named_shapes: Sequence[tuple[str, Sequence[int]]],
    compressor: str,
    levels: Sequence[Any],
    world_size: int,
    bandwidth: float,
    element_size: int = 4,
) -> list[LayerRow]:
    """Per-tensor bytes and transfer times (s, at ``bandwidth`` bytes/s) for dense and
    each of ``levels``; tensors the compressor does not apply to are dense at every level,
    and a tensor is dense at a level that does not pay for it."""
    check_world_size(world_size)
    _compressing(compressor)
    rows = []
    for name, shape in named_shapes:
        shape = tuple(shape)
        sent = [wire_bytes(shape, compressor, level, world_size, element_size) for level in levels]
        dense = wire_bytes(shape, "dense", None, world_size, element_size)
        rows.append(
            LayerRow(
                name,
                shape,
                dense,
                transfer_time(shape, "dense", None, world_size, bandwidth, element_size),
                tuple(sent),
                tuple(
                    transfer_time(shape, compressor, level, world_size, bandwidth, element_size)
                    for level in levels
                ),
            )  # fmt: skip
        )
    return rows


def _compressing(name: str):
    """The registered compressor ``name``, which must compress something (not dense)."""
    cls = compressor_class(name)
    if cls is Dense:
        raise ValueError(
            "compressor must be a registered compressor other than 'dense', got 'dense'"
        )
    return cls


def break_even(
    shapes: Sequence[Sequence[int]], compressor: str, world_size: int, element_size: int = 4
) -> BreakEvenDescription | None:
    """Where the levels of ``compressor`` (a registered name) stop paying against dense
    for a model of ``shapes`` at ``world_size`` workers, with ``element_size``-byte values:
    its cost description's :meth:`~accordion.compress.Compressor.break_even` (``None``
    when it has no such point for any model; a compressor that has one describes it for
    every model, an empty one included)."""
    return compressor_class(compressor).break_even(shapes, world_size, element_size)


@dataclass(frozen=True)
class ScalingCell:
    """The plan's rows (dense first, then each level) at one worker count and link rate."""

    workers: int
    bandwidth: float
    rows: tuple[PlanRow, ...]


def scaling_plan(
    shapes: Sequence[Sequence[int]],
    compressor: str,
    levels: Sequence[Any],
    workers: Sequence[int],
    bandwidths: Sequence[float],
    steps: int,
    latency: float,
    element_size: int = 4,
) -> list[ScalingCell]:
    """:func:`make_plan` at every worker count of ``workers`` and link rate of
    ``bandwidths`` (bytes/s), worker counts outermost; ``latency`` in seconds."""
    for name, values in (("workers", workers), ("bandwidths", bandwidths)):
        if not values:
            raise ValueError(f"{name} must list at least one value, got {list(values)!r}")
    return [
        ScalingCell(w, b, tuple(make_plan(shapes, compressor, levels, w, steps, b, latency,
                                          element_size)))
        for w in workers
        for b in bandwidths
    ]  # fmt: skip
