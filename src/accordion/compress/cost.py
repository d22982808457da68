"""The cost description of a compressor: the second part of the compressor contract.

:class:`CostDescription` says, at class level (no instance needed), what compressing
costs: which tensors the compressor takes (:meth:`~CostDescription.applies_to`), what
one tensor costs at a level in the paper's floats (:meth:`~CostDescription.paper_floats`),
in messages on the wire (:meth:`~CostDescription.messages`) and in ring bytes
(:meth:`~CostDescription.wire_bytes`), whether a level pays for a shape at all
(:meth:`~CostDescription.pays`: it must send less than dense; a tensor at a level that
does not pay is averaged dense while it stays there), what would make a level pointless
for a model (:meth:`~CostDescription.level_warning`) and where, for a model at a worker
count, its levels stop paying (:meth:`~CostDescription.break_even`). The reducer, the
accounting, the plan, the cost model and the command line price tensors through it
only, so that nothing else branches on a compressor's name.

The other parts are the level language (``levels.py``) and the math and state
(``base.py``), which :class:`~accordion.compress.Compressor` combines.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

from .wire import Message, ring_bytes

#: Bytes per element at which :meth:`CostDescription.pays` compares a level with dense:
#: fp32, what gradients are kept in (under AMP too), so the decision never depends on a
#: dtype.
REFERENCE_ELEMENT_SIZE = 4


def check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Validate a tensor shape (a sequence of ints >= 0) and return it as a tuple."""
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError as exc:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from exc
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must have non-negative sizes, got {shape!r}")
    return dims


class BreakEvenDescription(Protocol):
    """A compressor's break-even for one model at ``workers`` workers, as
    :meth:`CostDescription.break_even` returns it: any frozen record with
    :meth:`as_dict`; :meth:`CostDescription.break_even_text` writes it for people."""

    @property
    def workers(self) -> int:
        """The worker count W (read-only, so that a frozen dataclass matches)."""
        ...

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the break-even (``accordion plan --json``)."""
        ...


class CostDescription(ABC):
    """What compressing costs, at class level.

    Subclasses implement :meth:`paper_floats` and :meth:`messages`; the others have
    defaults (the compressor applies to tensors of >= 2 dimensions, a level pays when it
    hands its collectives fewer bytes than dense, no warning, no break-even).
    """

    #: Collectives per bucket that compressing adds to the dense all-reduce, each paying
    #: the link's latency (a second round of factors, say); the cost model charges them.
    extra_collectives: ClassVar[int] = 1

    @classmethod
    def applies_to(cls, shape: Sequence[int]) -> bool:
        """Whether tensors of this shape go through the compressor (else they go dense)."""
        return len(shape) >= 2

    @classmethod
    def applies_at(cls, shape: Sequence[int], level: Any) -> bool:
        """Whether tensors of this shape go through the compressor at ``level``: by default
        :meth:`applies_to`, whatever the level (a ladder across compressors says per level).
        A tensor it does not take at a level is sent dense there as a matter of course, not
        because the level fails to pay."""
        return cls.applies_to(shape)

    @classmethod
    @abstractmethod
    def paper_floats(cls, shape: tuple[int, ...], level: Any, world_size: int) -> int:
        """Floats one worker sends for one tensor it applies to, in the paper's convention."""

    @classmethod
    @abstractmethod
    def messages(cls, shape: tuple[int, ...], level: Any, element_size: int) -> list[Message]:
        """What one tensor it applies to adds to the collectives of one step (bytes of
        ``element_size``-byte elements)."""

    @classmethod
    def wire_bytes(
        cls, shape: tuple[int, ...], level: Any, world_size: int, element_size: int
    ) -> float:
        """Bytes one worker puts on the wire for one tensor it applies to (ring algorithms)."""
        return ring_bytes(cls.messages(shape, level, element_size), world_size)

    @classmethod
    def pays(cls, shape: Sequence[int], level: Any) -> bool:
        """Whether ``level`` sends less than dense for a tensor of ``shape`` that the
        compressor applies to; where it does not, the tensor is averaged dense at that
        level (the reducer, the accounting and the plan all say so).

        Compares the bytes one worker hands its collectives (:meth:`messages`, before the
        ring factor) with the dense tensor's, both at :data:`REFERENCE_ELEMENT_SIZE`
        bytes per element: bytes, since the paper's floats do not see a float's width
        (half precision) and count indices only as floats; before the ring factor, since
        it must be a pure function of ``(shape, level)``, the same on every rank, at
        every world size and in the plan (an all-gather grows with the workers besides:
        see :meth:`break_even`). An empty tensor sends nothing either way: it pays.
        Override it for another rule (top-k does: a fraction is a choice of level, the
        same share of every tensor).
        """
        dims = check_shape(shape)
        numel = math.prod(dims)
        sent = sum(m.nbytes for m in cls.messages(dims, level, REFERENCE_ELEMENT_SIZE))
        return numel == 0 or sent < numel * REFERENCE_ELEMENT_SIZE

    @classmethod
    def level_warning(cls, shapes: Sequence[tuple[int, ...]], level: Any) -> str | None:
        """Why ``level`` would be pointless for a model whose compressed tensors have
        ``shapes`` (e.g. it sends more than dense for every one), or ``None``. The
        controller lists the tensors that go dense at a level (:meth:`pays`) itself."""
        return None

    @classmethod
    def break_even(
        cls, shapes: Sequence[Sequence[int]], world_size: int, element_size: int = 4
    ) -> BreakEvenDescription | None:
        """Where the compressor's levels stop paying against a dense ring all-reduce for
        a model of ``shapes`` at ``world_size`` workers (``element_size`` bytes per
        value), for ``accordion plan``; ``None`` when it has no such point for any model
        (the default: :meth:`pays` decides per tensor, whatever the workers, as for the
        all-reduces and the integer quantisers' two phases, whose bytes against dense are
        flat in the workers; top-k's all-gathers have one). A compressor that has one
        returns a description for every model, an empty one included, saying in it when
        there is no point."""
        return None

    @classmethod
    def break_even_text(cls, entry: Mapping[str, Any], labels: Sequence[str]) -> str:
        """The plain form of a break-even's ``entry``: :meth:`break_even`'s ``as_dict()``
        and ``"bytes_vs_dense"``, each level's bytes per step against dense's (``None``
        where dense sends nothing), in the order of ``labels``, the levels' labels."""
        fields = ", ".join(
            f"{key} {value}" for key, value in entry.items()
            if key not in ("workers", "bytes_vs_dense")
        )  # fmt: skip
        ratios = ", ".join(
            f"{label} {'-' if ratio is None else f'{ratio:.3g}x'}"
            for label, ratio in zip(labels, entry.get("bytes_vs_dense", ()))
        )
        return (
            f"{cls.__name__} break-even at {entry.get('workers')} workers: {fields}; "
            f"bytes against dense: {ratios}"
        )
