"""The ladder: a compressor's levels in order, from the mildest to the most aggressive."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..compress.base import Compressor


class Ladder:
    """Levels of one compressor class, mildest first; decisions are rung indices.

    Rung 0 is the mildest level (critical regimes), rung ``len - 1`` the most aggressive.
    Each level must compress at least as much as the one before
    (``Compressor.aggressiveness``). Equal levels are allowed: a ladder whose levels are
    all equal is a static compressor.

    Args:
        compressor: the compressor class (``PowerSGD``, ``TopK``, ...).
        levels: two or more levels, mildest first, e.g. ``(4, 2, 1)`` PowerSGD ranks.
    """

    def __init__(self, compressor: type[Compressor], levels: Sequence[Any]):
        if isinstance(levels, str | bytes) or not isinstance(levels, Sequence):
            raise TypeError(
                f"levels must be a sequence of {compressor.name} levels, mildest first, "
                f"got {levels!r}"
            )
        if len(levels) < 2:
            raise ValueError(
                f"levels must hold at least 2 levels (mildest first; equal levels make a "
                f"static compressor), got {tuple(levels)!r}"
            )
        checked = tuple(compressor.check_level(level) for level in levels)
        for before, after in zip(checked, checked[1:]):
            if compressor.aggressiveness(after) < compressor.aggressiveness(before):
                raise ValueError(
                    "levels must go from the mildest to the most aggressive, each compressing "
                    "at least as much as the one before (with two, aggressive must compress "
                    f"at least as much as mild): got {compressor.name} levels {checked!r}, "
                    f"where {compressor.label(after)} compresses less than "
                    f"{compressor.label(before)}"
                )
        self.compressor = compressor
        self.levels = checked
        self._adaptive = len(set(checked)) > 1  # asked per bucket: computed once

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
        return f"Ladder({self.compressor.name}, {self.levels!r})"
