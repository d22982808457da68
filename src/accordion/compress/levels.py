"""The level language of a compressor: the first part of the compressor contract.

A compressor's *level* is how hard it compresses a tensor at one step (a PowerSGD rank,
a top-k fraction, a half-precision dtype); the level of every tensor may change at any
step. :class:`LevelLanguage` says, at class level (no instance needed), what its levels
are: how one is read from text (:meth:`~LevelLanguage.parse_level`), validated
(:meth:`~LevelLanguage.check_level`), written back (:meth:`~LevelLanguage.level_text`),
labelled for people (:meth:`~LevelLanguage.label`), ordered
(:meth:`~LevelLanguage.aggressiveness`), and which two are the defaults
(``default_levels``). Accordion's ladders, the command line and the harness read levels
through it only, so that nothing else branches on a compressor's name.

The other parts are the cost (``cost.py``) and the math and state (``base.py``), which
:class:`~accordion.compress.Compressor` combines.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar


class LevelLanguage(ABC):
    """What a compressor's levels are, at class level.

    Subclasses set ``name``, ``default_levels`` and ``level_help`` and implement
    :meth:`check_level`; ``level_type`` (how a level's text is converted before the
    check), ``title`` and the other methods have defaults.
    """

    #: The registry name ("powersgd"); also the accounting kind and a ladder kind's name.
    name: ClassVar[str]
    #: Default (mild, aggressive) levels: the paper's ResNet-18 settings where it has them.
    default_levels: ClassVar[tuple[Any, Any]]
    #: What a level is, as error messages say it ("an integer rank >= 1").
    level_help: ClassVar[str]
    #: How a level is read from its text, before ``check_level`` (``int`` for ranks).
    level_type: ClassVar[Callable[[str], Any]] = str
    #: The compressor's name in prose ("PowerSGD").
    title: ClassVar[str] = ""

    @classmethod
    @abstractmethod
    def check_level(cls, level: Any) -> Any:
        """Validate a level and return it normalised; raise ``TypeError``/``ValueError``."""

    @classmethod
    def parse_level(cls, text: str) -> Any:
        """A level from its text form (command line, strategy strings)."""
        if not isinstance(text, str):
            raise TypeError(f"level text must be a str, got {text!r}")
        try:
            value = cls.level_type(text.strip())
        except (TypeError, ValueError):
            title = cls.title or cls.name
            raise ValueError(f"a {title} level must be {cls.level_help}, got {text!r}") from None
        return cls.check_level(value)

    @classmethod
    def level_text(cls, level: Any) -> str:
        """The text form of ``level``, which :meth:`parse_level` reads back."""
        return f"{level:g}" if isinstance(level, float) else str(level)

    @classmethod
    def label(cls, level: Any) -> str:
        """A human label of ``level`` for tables and plots ("rank 4")."""
        return cls.level_text(level)

    @classmethod
    def aggressiveness(cls, level: Any) -> float:
        """A number that orders levels: larger compresses more (equal: as much)."""
        return 0.0
