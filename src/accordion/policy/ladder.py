"""The ladder: ordered levels of one kind, from the mildest to the most aggressive.

A *level kind* says what its levels are: a compressor class (PowerSGD ranks, TopK
fractions; ``accordion.compress``) or the global batch sizes of
``accordion.batch.BatchSizes``. Rules decide rung indices, so one rule serves any kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

#: The attributes a level kind has (see :class:`LevelKind`).
_KIND_ATTRIBUTES = ("name", "check_level", "aggressiveness", "label")


class LevelKind(Protocol):
    """What a ladder asks of its levels' kind; compressor classes are level kinds.

    Attributes:
        name: a short name of the kind, for messages ("powersgd", "batch").
    """

    name: str

    def check_level(self, level: Any) -> Any:
        """Validate a level and return it normalised; raise ``TypeError``/``ValueError``."""

    def aggressiveness(self, level: Any) -> float:
        """A number that orders levels: larger is more aggressive (equal: as much)."""

    def label(self, level: Any) -> str:
        """A human label of ``level`` for messages, tables and plots ("rank 4")."""


class Ladder:
    """Levels of one kind, mildest first; decisions are rung indices.

    Rung 0 is the mildest level (critical regimes), rung ``len - 1`` the most aggressive.
    Each level must be at least as aggressive as the one before (the kind's
    ``aggressiveness``). Equal levels are allowed: a ladder whose levels are all equal
    is static.

    Args:
        kind: the levels' kind (:class:`LevelKind`): a compressor class (``PowerSGD``,
            ``TopK``, ...) or ``accordion.batch.BatchSizes``.
        levels: two or more levels, mildest first, e.g. ``(4, 2, 1)`` PowerSGD ranks.
    """

    def __init__(self, kind: LevelKind, levels: Sequence[Any]):
        missing = [attr for attr in _KIND_ATTRIBUTES if not hasattr(kind, attr)]
        if missing:
            raise TypeError(
                f"kind must be a level kind (a compressor class, or an object with "
                f"{', '.join(_KIND_ATTRIBUTES)}), got {kind!r}, which lacks {', '.join(missing)}"
            )
        if isinstance(levels, str | bytes) or not isinstance(levels, Sequence):
            raise TypeError(
                f"levels must be a sequence of {kind.name} levels, mildest first, got {levels!r}"
            )
        if len(levels) < 2:
            raise ValueError(
                f"levels must hold at least 2 levels (mildest first; equal levels make a "
                f"static compressor), got {tuple(levels)!r}"
            )
        checked = tuple(kind.check_level(level) for level in levels)
        for before, after in zip(checked, checked[1:]):
            if kind.aggressiveness(after) < kind.aggressiveness(before):
                raise ValueError(
                    "levels must go from the mildest to the most aggressive, each compressing "
                    "at least as much as the one before (with two, aggressive must compress "
                    f"at least as much as mild): got {kind.name} levels {checked!r}, "
                    f"where {kind.label(after)} compresses less than {kind.label(before)}"
                )
        self.kind = kind
        self.levels = checked
        self._adaptive = len(set(checked)) > 1  # asked per bucket: computed once

    @property
    def compressor(self) -> Any:
        """The level kind, under the name a ladder of compressor levels has always used."""
        return self.kind

    @property
    def mildest(self) -> Any:
        """The level of rung 0, used in critical regimes."""
        return self.levels[0]

    @property
    def most_aggressive(self) -> Any:
        """The level of the last rung."""
        return self.levels[-1]

    @property
    def top(self) -> int:
        """The index of the most aggressive rung (``len(self) - 1``)."""
        return len(self.levels) - 1

    @property
    def adaptive(self) -> bool:
        """Whether the rungs differ, i.e. a decision can change what is sent."""
        return self._adaptive

    def check_rung(self, name: str, rung: Any) -> int:
        """Validate a rung index for layer ``name`` and return it."""
        if isinstance(rung, bool) or not isinstance(rung, int):
            raise TypeError(f"the rung of {name!r} must be an int in [0, {self.top}], got {rung!r}")
        if not 0 <= rung <= self.top:
            raise ValueError(
                f"the rung of {name!r} must be an int in [0, {self.top}], got {rung!r}"
            )
        return rung

    def __len__(self) -> int:
        return len(self.levels)

    def __getitem__(self, rung: int) -> Any:
        return self.levels[rung]

    def __repr__(self) -> str:
        return f"Ladder({self.kind.name}, {self.levels!r})"
