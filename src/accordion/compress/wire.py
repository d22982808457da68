"""What a collective puts on the wire: ring formulas and a tensor's messages.

Pure arithmetic, no tensors: the compressors describe their traffic with it
(:class:`Message`), and the accounting, the plan and the cost model sum it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._validate import check_int

#: The collectives a message can travel in.
OPS = ("allreduce", "allgather")


def check_world_size(world_size: int) -> int:
    """Validate a number of workers (an int >= 1) and return it."""
    return check_int("world_size", world_size, 1)


def allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one worker sends in a ring all-reduce of ``nbytes``: ``2 (W - 1) / W * nbytes``."""
    return 2.0 * (world_size - 1) / world_size * nbytes


def allgather_bytes(nbytes_per_worker: float, world_size: int) -> float:
    """Bytes one worker sends in a ring all-gather of ``nbytes_per_worker`` each: ``(W-1) * s``."""
    return float(world_size - 1) * nbytes_per_worker


def alltoall_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one worker sends in an all-to-all of ``nbytes`` (``W`` equal rows, one per
    destination): every row but its own, ``(W - 1) / W * nbytes``."""
    return (world_size - 1) / world_size * nbytes


@dataclass(frozen=True)
class Message:
    """One tensor's share of one collective per step.

    ``op`` is ``"allreduce"`` or ``"allgather"``; ``slot`` names the collective that the
    shares of all tensors of a bucket travel in together (PowerSGD's ``"P"`` and ``"Q"``,
    say); ``nbytes`` is this tensor's payload in bytes (per worker for an all-gather).
    """

    op: str
    slot: str
    nbytes: float


def ring_bytes(messages: list[Message], world_size: int) -> float:
    """Bytes one worker puts on the wire for ``messages`` under ring algorithms."""
    # payloads summed per collective first: the ring factor applied once, as one call sends
    reduced = sum(m.nbytes for m in messages if m.op == "allreduce")
    gathered = sum(m.nbytes for m in messages if m.op == "allgather")
    return allreduce_bytes(reduced, world_size) + allgather_bytes(gathered, world_size)
