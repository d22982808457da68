"""The compressor contract, the registry of compressors, and ``Dense``.

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

A compressor class also *describes itself*, so that nothing else branches on its name:
its ``name``, how a level is parsed, validated, ordered and labelled, which tensors it
applies to (``applies_to``), and what one tensor costs at a level, in the paper's floats
(``paper_floats``) and in messages on the wire (``messages``), and whether a level pays
for a shape at all (``pays``: it must send less than dense; a tensor at a level that does
not pay is averaged dense while it stays there). Registering the class (:func:`register`)
makes it available to the hook, the accounting, the plan, the command line and the
harness by its name.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from .transport import AllReduce, Exchange
from .wire import Message, ring_bytes

Result = list[tuple[torch.Tensor, torch.Tensor | None]]


#: Bytes per element at which :meth:`Compressor.pays` compares a level with dense: fp32,
#: what gradients are kept in (under AMP too), so the decision never depends on a dtype.
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


class Compressor(ABC):
    """A gradient compressor with a level per tensor that may change at any step.

    Subclasses set ``name``, ``default_levels`` (the default ``(mild, aggressive)``) and
    ``level_help`` (what a level is, for error messages), and implement ``check_level``,
    ``exchange``, ``paper_floats`` and ``messages``; the others have defaults.
    """

    #: The registry name ("powersgd"); also the accounting kind.
    name: ClassVar[str]
    #: Default (mild, aggressive) levels: the paper's ResNet-18 settings where it has them.
    default_levels: ClassVar[tuple[Any, Any]]
    #: What a level is, as error messages say it ("an integer rank >= 1").
    level_help: ClassVar[str]
    #: How a level is read from its text, before ``check_level`` (``int`` for ranks).
    level_type: ClassVar[Callable[[str], Any]] = str
    #: The compressor's name in prose ("PowerSGD").
    title: ClassVar[str] = ""
    #: The keys of :meth:`state_dict` (subclasses with more state add theirs), and keys
    #: that older checkpoints may lack.
    STATE_KEYS: ClassVar[frozenset[str]] = frozenset({"kind", "default_level", "levels"})
    OPTIONAL_STATE_KEYS: ClassVar[frozenset[str]] = frozenset()
    #: Collectives per bucket that compressing adds to the dense all-reduce, each paying
    #: the link's latency (PowerSGD's Q round); the cost model charges them.
    extra_collectives: ClassVar[int] = 1

    def __init__(self, level: Any = None):
        self.default_level = self.check_level(level)
        self._levels: dict[Hashable, Any] = {}

    @property
    def kind(self) -> str:
        """The registry name (kept for callers of the first API)."""
        return self.name

    # --- self-description (class level: no instance needed) ------------------------------

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

    @classmethod
    def applies_to(cls, shape: Sequence[int]) -> bool:
        """Whether tensors of this shape go through the compressor (else they go dense)."""
        return len(shape) >= 2

    @classmethod
    def pays(cls, shape: Sequence[int], level: Any) -> bool:
        """Whether ``level`` sends less than dense for a tensor of ``shape`` that the
        compressor applies to; where it does not, the tensor is averaged dense at that
        level (the reducer, the accounting and the plan all say so).

        Compares the bytes one worker hands its collectives (:meth:`messages`, before the
        ring factor) with the dense tensor's, both at :data:`REFERENCE_ELEMENT_SIZE`
        bytes per element: bytes, since the paper's floats do not see a float's width
        (half precision) and count top-k's indices only as floats; before the ring
        factor, since it must be a pure function of ``(shape, level)``, the same on every
        rank, at every world size and in the plan (top-k's all-gather grows with the
        workers besides: see :func:`accordion.plan.topk_break_even`). An empty tensor
        sends nothing either way: it pays. Override it for another rule (top-k does:
        a fraction is a choice of level, the same share of every tensor).
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
    @abstractmethod
    def paper_floats(cls, shape: tuple[int, ...], level: Any, world_size: int) -> int:
        """Floats one worker sends for one tensor it applies to, in the paper's convention."""

    @classmethod
    @abstractmethod
    def messages(cls, shape: tuple[int, ...], level: Any, element_size: int) -> list[Message]:
        """What one tensor it applies to adds to the collectives of one step."""

    @classmethod
    def wire_bytes(
        cls, shape: tuple[int, ...], level: Any, world_size: int, element_size: int
    ) -> float:
        """Bytes one worker puts on the wire for one tensor it applies to (ring algorithms)."""
        return ring_bytes(cls.messages(shape, level, element_size), world_size)

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

    def reset(self, keys: Iterable[Hashable]) -> None:  # noqa: B027 - optional: no state by default
        """Forget warm-start state of ``keys`` (after a non-finite step). Levels stay."""

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
        if not isinstance(state, Mapping) or state.get("kind") != self.name:
            got = state.get("kind") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"state is for compressor kind {got!r}, not {self.name!r}")
        missing = sorted(self.STATE_KEYS - set(state))
        unknown = sorted(set(state) - self.STATE_KEYS - self.OPTIONAL_STATE_KEYS, key=repr)
        if missing or unknown:
            raise ValueError(
                f"state is not a {type(self).__name__} state_dict: missing keys {missing}, "
                f"unknown keys {unknown}"
            )
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
        outputs, offset = [], 0
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
