"""Global batch sizes as a ladder's levels: the batch-size lever's level kind."""

from __future__ import annotations

from typing import Any, ClassVar

from .._validate import check_int


class BatchSizes:
    """The level kind of a :class:`~accordion.policy.Ladder` of global batch sizes.

    A level is a global batch: samples per optimizer step over all workers, an int >= 1.
    A larger batch is more aggressive: fewer synchronisations (all-reduces) per sample.

    Example:
        >>> from accordion.policy import Ladder
        >>> Ladder(BatchSizes, (512, 4096))
        Ladder(batch, (512, 4096))
    """

    #: The kind's name, in messages.
    name: ClassVar[str] = "batch"

    @staticmethod
    def check_level(level: Any) -> int:
        """``level`` as an int if it is a batch size (an int >= 1), else ``TypeError`` or
        ``ValueError``."""
        return check_int("a batch size", level, 1)

    @staticmethod
    def aggressiveness(level: int) -> float:
        """The samples per synchronisation: the batch itself."""
        return float(level)

    @staticmethod
    def label(level: int) -> str:
        """``"batch 512"``."""
        return f"batch {level}"
