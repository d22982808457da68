"""What a collective puts on the wire: ring formulas and a tensor's messages.

Pure arithmetic, no tensors: the compressors describe their traffic with it
(:class:`Message`), and the accounting, the plan and the cost model sum it.

A message travels in one of :data:`OPS`: ``"allreduce"`` (a ring all-reduce, flat in
the workers), ``"allgather"`` (each worker's payload to every other, growing with them)
or ``"twophase"`` (the two-phase compressed all-reduce of ``two_phase.py``: an
all-to-all of compressed chunks to their owners, then an all-gather of the owners'
compressed averages, flat in the workers like an all-reduce).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from .._validate import check_int

#: The collectives a message can travel in.
OPS = ("allreduce", "allgather", "twophase")


def check_world_size(world_size: int) -> int:
    """Validate a number of workers (an int >= 1) and return it."""
    return check_int("world_size", world_size, 1)


def allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one worker sends in a ring all-reduce of ``nbytes``: ``2 (W - 1) / W * nbytes``."""
    return 2.0 * (world_size - 1) / world_size * nbytes


def allgather_bytes(nbytes_per_worker: float, world_size: int) -> float:
    """Bytes one worker sends in a ring all-gather of ``nbytes_per_worker`` each: ``(W-1) * s``."""
    return float(world_size - 1) * nbytes_per_worker


def two_phase_message_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one worker sends to average a compressed payload of ``nbytes`` (its whole
    buffer, compressed) in two phases: ``W - 1`` of its ``W`` chunks in the all-to-all,
    then its own chunk, averaged and compressed again, to the ``W - 1`` others:
    ``2 (W - 1) / W * nbytes``, an all-reduce's (``nbytes`` at two workers, as an
    all-gather; 0 at one). The padding of the last chunks to whole blocks is left out:
    under one block per owner per call (``two_phase.two_phase_bytes`` counts it)."""
    return allreduce_bytes(nbytes, world_size)


def alltoall_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one worker sends in an all-to-all of ``nbytes`` (``W`` equal rows, one per
    destination): every row but its own, ``(W - 1) / W * nbytes``."""
    return (world_size - 1) / world_size * nbytes


@dataclass(frozen=True)
class Message:
    """One tensor's share of one collective per step.

    ``op`` is one of :data:`OPS`; ``slot`` names the collective that the shares of all
    tensors of a bucket travel in together (PowerSGD's ``"P"`` and ``"Q"``, say);
    ``nbytes`` is this tensor's payload in bytes: what one worker hands the collective
    (per worker for an all-gather; the compressed tensor for two phases), before any
    ring factor. A two-phase share may also give ``gathered``, its payload were it
    all-gathered instead (no padding to whole blocks), when the sender picks whichever
    costs less (the quantisers' ``"auto"``).
    """

    op: str
    slot: str
    nbytes: float
    gathered: float | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Message op must be one of {OPS}, got {self.op!r}")
        if not isinstance(self.nbytes, numbers.Real) or isinstance(self.nbytes, bool):
            raise TypeError(f"Message nbytes must be a number of bytes, got {self.nbytes!r}")
        if not self.nbytes >= 0:
            raise ValueError(f"Message nbytes must be >= 0 bytes, got {self.nbytes!r}")


#: Bytes one worker sends per collective, from the payloads handed it (summed per op).
_RING = {"allreduce": allreduce_bytes, "allgather": allgather_bytes,
         "twophase": two_phase_message_bytes}  # fmt: skip


def ring_bytes(messages: list[Message], world_size: int) -> float:
    """Bytes one worker puts on the wire for ``messages`` at ``world_size`` workers, ring
    algorithms: ``2 (W - 1) / W`` of the all-reduced and the two-phase payloads, ``W - 1``
    times the all-gathered ones; two-phase shares that all give ``gathered`` cost the
    fewer of their two ways (at two workers, the all-gather)."""
    # payloads summed per collective first: the ring factor applied once, as one call sends
    payload = dict.fromkeys(OPS, 0.0)
    for m in messages:
        payload[m.op] += m.nbytes
    total = sum(_RING[op](nbytes, world_size) for op, nbytes in payload.items())
    phased = [m for m in messages if m.op == "twophase"]
    if phased and all(m.gathered is not None for m in phased):
        gathered = allgather_bytes(sum(m.gathered or 0.0 for m in phased), world_size)
        total -= max(0.0, _RING["twophase"](payload["twophase"], world_size) - gathered)
    return total
