"""The compressor contract, the registry of compressors, and ``Dense``.

The contract has three parts, each in its own module, which :class:`Compressor` combines:

* the level language (``levels.py``, :class:`~accordion.compress.levels.LevelLanguage`):
  how a level is parsed, checked, written, labelled and ordered, and the default levels;
* the cost description (``cost.py``, :class:`~accordion.compress.cost.CostDescription`):
  which tensors it applies to, what one costs at a level in the paper's floats and in
  messages on the wire, whether a level pays for a shape, warnings about a level and the
  break-even of a model;
* the math and state (here): how to build one (:meth:`Compressor.build`), the level of
  each tensor, the exchange, and the state a checkpoint keeps.

A compressor's ``exchange(keys, tensors, world_size)`` is a generator that yields
communication phases to a transport (see ``transport.py``) and returns, for each input
tensor, ``(average, residual)``:

* ``average`` -- this step's estimate of the mean of the tensor over all workers;
* ``residual`` -- the part of the local input that was not sent (for error feedback),
  or ``None`` when everything was sent.

Given ``out``, each average is written into ``out[i]`` and returned as it. The input
tensors are *owned by the exchange*: it may overwrite them (the residuals are usually
the inputs, modified in place). All inputs of one call share a dtype and a device. A
compressor holds a level per key and any warm-start state; error-feedback memory lives
in ``memory.py``.

Registering the class (:func:`register`) makes it available to the hook, the
accounting, the plan, the command line and the harness by its name; none of them
branches on it.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from .._validate import check_state_keys
from .cost import REFERENCE_ELEMENT_SIZE, CostDescription, check_shape
from .levels import LevelLanguage
from .transport import AllReduce, Exchange
from .wire import Message

__all__ = [
    "REFERENCE_ELEMENT_SIZE",
    "COLLECTIVES",
    "RANK_CHANGE_POLICIES",
    "SHARED_OPTIONS",
    "Compressor",
    "Dense",
    "check_shape",
    "compressing_names",
    "compressor_class",
    "compressor_names",
    "into",
    "register",
    "sent_as",
]

Result = list[tuple[torch.Tensor, torch.Tensor | None]]

#: The values of the shared option ``on_rank_change``: what a level change does to a
#: compressor's warm-start state (``"reuse"``: keep what still fits; ``"redraw"``: draw
#: it again from the shared seed).
RANK_CHANGE_POLICIES = ("redraw", "reuse")
#: The values of the shared option ``collective``: how a quantiser's payloads travel
#: (``"auto"``: whichever of the two sends fewer bytes at the exchange's world size;
#: ``"all_gather"``; ``"two_phase"``: the compressed all-reduce of ``two_phase.py``).
COLLECTIVES = ("auto", "all_gather", "two_phase")
#: The options :meth:`Compressor.build` takes for every compressor, each using those it
#: has: ``seed`` (an int shared by all workers for random state), ``on_rank_change``
#: (one of :data:`RANK_CHANGE_POLICIES`) and ``collective`` (one of :data:`COLLECTIVES`).
SHARED_OPTIONS = ("seed", "on_rank_change", "collective")


class Compressor(LevelLanguage, CostDescription):
    """A gradient compressor with a level per tensor that may change at any step.

    Subclasses set ``name``, ``default_levels`` (the default ``(mild, aggressive)``) and
    ``level_help`` (what a level is, for error messages), and implement ``check_level``,
    ``exchange``, ``paper_floats`` and ``messages``; the others have defaults. A class
    whose constructor takes shared options (:data:`SHARED_OPTIONS`) overrides
    :meth:`_construct` to pass them on.
    """

    #: The keys of :meth:`state_dict` (subclasses with more state add theirs), and keys
    #: that older checkpoints may lack.
    STATE_KEYS: ClassVar[frozenset[str]] = frozenset({"kind", "default_level", "levels"})
    OPTIONAL_STATE_KEYS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, level: Any = None):
        self.default_level = self.check_level(level)
        self._levels: dict[Hashable, Any] = {}

    @property
    def kind(self) -> str:
        """The registry name (kept for callers of the first API)."""
        return self.name

    @classmethod
    def build(cls, level: Any = None, **options: Any) -> Compressor:
        """A new compressor of this class at default level ``level`` (the class's own
        default when ``None``; ``Dense`` has one level and ignores it).

        ``options`` are shared ones (:data:`SHARED_OPTIONS`: ``seed``,
        ``on_rank_change``), which every class accepts and each uses those it has; any
        other is a ``TypeError`` naming it and the allowed ones. The one way to build a
        compressor from its registry name's class (:func:`compressor_class`).
        """
        unknown = sorted(set(options) - set(SHARED_OPTIONS))
        if unknown:
            raise TypeError(
                f"compressor {cls.name!r} got unknown options {unknown}: the options are "
                f"{SHARED_OPTIONS} (each compressor uses those it has)"
            )
        return cls._construct(level, options)

    @classmethod
    def _construct(cls, level: Any, options: Mapping[str, Any]) -> Compressor:
        """:meth:`build`'s constructor call, ``options`` checked already: by default the
        level alone (the shared options unused)."""
        return cls() if level is None else cls(level)

    # --- levels per key -------------------------------------------------------------------

    def level(self, key: Hashable) -> Any:
        """The level used for ``key`` at the next exchange."""
        return self._levels.get(key, self.default_level)

    def set_level(self, level: Any, keys: Iterable[Hashable] | None = None) -> None:
        """Set the level of ``keys`` (of every tensor, and the default, when ``None``).

        Takes effect at the next exchange. Error-feedback memory is not touched.
        """
        level = self.check_level(level)
        if keys is None:
            self.default_level = level
            self._levels.clear()
        else:
            for key in list(keys):
                self._levels[key] = level

    @abstractmethod
    def exchange(
        self,
        keys: Sequence[Hashable],
        tensors: Sequence[torch.Tensor],
        world_size: int,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Exchange[Result]:
        """Average ``tensors`` over the workers; see the module docstring. With ``out``
        (tensors of the same shapes, not overlapping the inputs), the averages are
        written into them and returned as them."""

    def rename(self, old: Hashable, new: Hashable) -> None:
        """Move ``old``'s level and state to the key ``new``."""
        if old in self._levels:
            self._levels[new] = self._levels.pop(old)

    def track_noise(self, on: bool) -> None:  # noqa: B027 - optional: most have no noise model
        """Whether the next exchanges must record :meth:`residual_variance` (Adam's noise
        correction reads it); a compressor for which the record costs bytes on the wire
        sends them only while ``on``. Set by the :class:`Reducer` before each exchange."""

    def set_local_size(self, local_size: int) -> None:  # noqa: B027 - optional: most are flat
        """The workers a host of the next exchanges (ranks host after host; the
        transport's). A compressor with a hierarchical exchange (full precision inside a
        host, compressed across hosts) uses it; set by the :class:`Reducer`."""

    def reset(self, keys: Iterable[Hashable]) -> None:  # noqa: B027 - optional: no state by default
        """Forget warm-start state of ``keys`` (after a non-finite step). Levels stay."""

    def residual_variance(self, key: Hashable, previous: bool = False) -> torch.Tensor | None:
        """Per element of ``key``'s tensor, the expected square of its residual (what the
        last exchange did not send), summed over the workers: the same on every rank,
        computed from what they all received; with ``previous``, the exchange before the
        last. ``None`` where the compressor has no model of its error (the default), or
        the key was not sent through it. Adam's noise correction reads it
        (:class:`~accordion.adam_noise.AdamNoiseCorrection`)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Levels (and subclasses' factors) as tensors and plain values."""
        return {
            "kind": self.name,
            "default_level": self.default_level,
            "levels": dict(self._levels),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; anything else (another compressor, a missing or
        unknown key, a bad level) raises ``ValueError`` naming it and changes nothing."""
        self.default_level, self._levels = self._checked_levels(state)

    def _checked_levels(self, state: Any) -> tuple[Any, dict[Hashable, Any]]:
        """Validate a state's kind and keys (``STATE_KEYS``); return its levels."""
        # the kind first: another compressor's state is named as such, not by its keys
        if isinstance(state, Mapping) and state.get("kind") != self.name:
            raise ValueError(
                f"state is for compressor kind {state.get('kind')!r}, not {self.name!r}"
            )
        check_state_keys(state, self.STATE_KEYS, type(self).__name__, self.OPTIONAL_STATE_KEYS)
        levels = state["levels"]
        if not isinstance(levels, Mapping):
            raise ValueError(f"compressor levels must be a Mapping, got {type(levels).__name__}")
        default = _loaded_level(self, "default_level", state["default_level"])
        return default, {k: _loaded_level(self, f"levels[{k!r}]", v) for k, v in levels.items()}

    def check_shapes(self, shapes: Mapping[Hashable, Sequence[int]]) -> None:
        """Raise ``ValueError`` unless the state held for each key (its level, any
        factors) fits a tensor of ``shapes[key]`` (a loaded checkpoint's consistency)."""
        for key in self._levels:
            if key not in shapes or not self.applies_to(shapes[key]):
                raise ValueError(
                    f"compressor levels[{key!r}] is for no tensor that {self.name} compresses"
                )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.default_level!r})"


def _loaded_level(compressor: Compressor, name: str, level: Any) -> Any:
    """``level`` checked as a level of ``compressor``; ``ValueError`` naming ``name``."""
    try:
        return compressor.check_level(level)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"compressor {name}: {exc}") from None


_REGISTRY: dict[str, type[Compressor]] = {}


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: make a compressor available by its ``name`` everywhere."""
    if not (isinstance(cls, type) and issubclass(cls, Compressor)):
        raise TypeError(f"register takes a Compressor subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__}.name must be a non-empty str, got {name!r}")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"a compressor named {name!r} is registered already")
    _REGISTRY[name] = cls
    return cls


def compressor_names() -> tuple[str, ...]:
    """The names of the registered compressors, in registration order."""
    return tuple(_REGISTRY)


def compressing_names() -> tuple[str, ...]:
    """The registered compressors that compress something: every one but ``dense``."""
    return tuple(name for name, cls in _REGISTRY.items() if cls is not Dense)


def compressor_class(name: str) -> type[Compressor]:
    """The registered compressor class called ``name``; a clear error for any other."""
    if not isinstance(name, str):
        raise TypeError(f"compressor must be a str (one of {compressor_names()}), got {name!r}")
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"compressor must be one of {compressor_names()}, got {name!r}")
    return cls


#: ``sent_as``'s default: no level given, only ``applies_to`` decides.
_ANY_LEVEL: Any = object()


def sent_as(shape: Sequence[int], name: str, level: Any = _ANY_LEVEL) -> type[Compressor]:
    """The class that really sends a tensor of ``shape`` under compressor ``name``:
    the compressor when it applies to the shape (and, given ``level``, when that level
    pays for it: :meth:`Compressor.pays`), else :class:`Dense`."""
    cls = compressor_class(name)
    if not cls.applies_to(shape):
        return Dense
    return cls if level is _ANY_LEVEL or cls.pays(shape, level) else Dense


@register
class Dense(Compressor):
    """No compression: one all-reduce of all tensors, divided by the world size first.

    Dividing before the sum is what DDP's own all-reduce does, so results match it bitwise.
    It applies to no tensor: a tensor that no compressor takes is sent as Dense sends it.
    """

    name = "dense"
    default_levels = (None, None)
    level_help = "None (dense has a single level)"

    def __init__(self) -> None:
        super().__init__(None)

    @classmethod
    def _construct(cls, level: Any, options: Mapping[str, Any]) -> Dense:
        """``Dense()``: its one level is ``None``, whatever ``level`` says."""
        return cls()

    @classmethod
    def check_level(cls, level: Any) -> None:
        """Dense has a single level, ``None``."""
        if level is not None:
            raise ValueError(f"level must be None for Dense, got {level!r}")
        return None

    @classmethod
    def parse_level(cls, text: str) -> None:
        raise ValueError(f"dense takes no level, got {text!r}")

    @classmethod
    def label(cls, level: Any) -> str:
        return "dense"

    @classmethod
    def applies_to(cls, shape: Sequence[int]) -> bool:
        return False

    @classmethod
    def paper_floats(cls, shape: tuple[int, ...], level: Any, world_size: int) -> int:
        return math.prod(shape)

    @classmethod
    def messages(cls, shape: tuple[int, ...], level: Any, element_size: int) -> list[Message]:
        return [Message("allreduce", "dense", math.prod(shape) * element_size)]

    def exchange(
        self,
        keys: Sequence[Hashable],
        tensors: Sequence[torch.Tensor],
        world_size: int,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Exchange[Result]:
        if not tensors:
            return []
        flat = torch.cat([t.reshape(-1) for t in tensors])
        flat.div_(world_size)
        yield [AllReduce(flat)]
        outputs: Result = []
        offset = 0
        for t in tensors:
            outputs.append((flat[offset : offset + t.numel()].view(t.shape), None))
            offset += t.numel()
        return into(outputs, out)

    def __repr__(self) -> str:
        return "Dense()"


def into(results: Result, out: Sequence[torch.Tensor] | None) -> Result:
    """``results`` with each average copied into ``out`` (unchanged without ``out``)."""
    if out is None:
        return results
    return [(o.copy_(average), residual) for o, (average, residual) in zip(out, results)]
