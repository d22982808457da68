"""A ladder across compressors: each level names a registered compressor and its level.

``mixed`` is a compressor whose levels are other compressors' levels, written
``NAME/LEVEL`` (``"half/bf16"``, ``"powersgd/4"``, ``"topk/0.01"``) or ``"dense"``, so that
one Accordion ladder can run from half precision to low rank, say
``dense -> half/bf16 -> powersgd/16 -> powersgd/4``. Each tensor is sent by the part
compressor of its level; the parts are ordinary registered compressors, built on first
use with the shared options, and hold their own warm-start state (PowerSGD's ``Q``
stays with the tensor while it is at another compressor's level).

Error feedback carries across a change of compressor unchanged: the memory lives in the
:class:`~accordion.compress.reducer.Reducer`, which compensates each tensor before any
part sees it, so the residual of one compressor is sent by the next. A tensor at a level
whose compressor does not take its shape (a bias at a PowerSGD level), or at
``"dense"``, is averaged dense (:meth:`Mixed.pays` is false), as any compressor's tensor
at a level that does not pay.

Levels are ordered by what they send for a large fp32 matrix (1024 x 1024): the log2 of
dense's bytes over the level's, from the parts' own cost descriptions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from .base import Compressor, Dense, Result, compressor_class, register
from .transport import Exchange, parallel
from .wire import Message

#: The level that sends every tensor dense, as fp32.
DENSE_LEVEL = "dense"
#: What a level's bytes are measured on to order levels of different compressors:
#: a square fp32 matrix, large enough that the ratio of two levels hardly moves with it.
_REFERENCE_SHAPE = (1024, 1024)
_REFERENCE_ELEMENT_SIZE = 4


@functools.cache
def split_level(level: str) -> tuple[type[Compressor], Any]:
    """The part compressor's class and its level of a canonical mixed level
    (``"dense"`` gives ``(Dense, None)``)."""
    if level == DENSE_LEVEL:
        return Dense, None
    name, _, text = level.partition("/")
    cls = compressor_class(name)
    return cls, cls.parse_level(text)


@register
class Mixed(Compressor):
    """Levels of several compressors on one ladder; see the module docstring.

    Args:
        level: default level, ``"NAME/LEVEL"``, ``(NAME, LEVEL)`` or ``"dense"``.
        options: the shared options (``seed``, ``on_rank_change``) given to every part.
    """

    name = "mixed"
    title = "mixed ladder"
    default_levels = ("half/bf16", "powersgd/4")
    level_help = (
        "'dense' or NAME/LEVEL of another registered compressor, e.g. 'half/bf16', "
        "'powersgd/4', 'topk/0.01' (or a (NAME, LEVEL) pair)"
    )
    STATE_KEYS: ClassVar[frozenset[str]] = Compressor.STATE_KEYS | {"parts"}
    #: ``senders``: which part sent each key lately (older files lack it).
    OPTIONAL_STATE_KEYS: ClassVar[frozenset[str]] = frozenset({"senders"})

    def __init__(self, level: Any = "half/bf16", **options: Any):
        super().__init__(level)
        self._options = dict(options)
        self._parts: dict[str, Compressor] = {}
        self._noise = False  # what track_noise last said, for parts built later
        self._local_size = 1  # what set_local_size last said, likewise
        # per key: the part that sent it at its last exchange, and at the one before
        self._senders: dict[Hashable, tuple[str, str | None]] = {}

    @classmethod
    def _construct(cls, level: Any, options: Mapping[str, Any]) -> Mixed:
        return cls(cls.default_levels[0] if level is None else level, **options)

    # --- the level language ----------------------------------------------------------------

    @classmethod
    def check_level(cls, level: Any) -> str:
        """A level as its canonical text ``NAME/LEVEL`` (or ``"dense"``)."""
        if isinstance(level, str) and level.strip() == DENSE_LEVEL:
            return DENSE_LEVEL
        if isinstance(level, tuple) and len(level) == 2 and isinstance(level[0], str):
            name, part_level = level
            if name == DENSE_LEVEL and part_level is None:
                return DENSE_LEVEL
        elif isinstance(level, str):
            name, slash, part_level = level.strip().partition("/")
            if not slash:
                raise ValueError(f"a mixed level must be {cls.level_help}, got {level!r}")
        else:
            raise TypeError(f"a mixed level must be {cls.level_help}, got {level!r}")
        part = _part(name, level)
        if isinstance(level, str):
            part_level = part.parse_level(part_level)
        return f"{name}/{part.level_text(part.check_level(part_level))}"

    @classmethod
    def parse_level(cls, text: str) -> str:
        if not isinstance(text, str):
            raise TypeError(f"level text must be a str, got {text!r}")
        return cls.check_level(text)

    @classmethod
    def label(cls, level: Any) -> str:
        """The canonical text, ``"powersgd/4"``: a part's own label does not say its name."""
        return cls.check_level(level)

    @classmethod
    def aggressiveness(cls, level: Any) -> float:
        """log2 of dense's bytes over the level's for a 1024 x 1024 fp32 matrix (dense: 0)."""
        part, part_level = split_level(cls.check_level(level))
        shape, size = _REFERENCE_SHAPE, _REFERENCE_ELEMENT_SIZE
        sent = sum(m.nbytes for m in part.messages(shape, part_level, size))
        return math.log2(math.prod(shape) * size / sent)

    # --- the cost description --------------------------------------------------------------

    @classmethod
    def applies_to(cls, shape: Sequence[int]) -> bool:
        return True  # a part may take any tensor; pays() says which one takes this one

    @classmethod
    def applies_at(cls, shape: Sequence[int], level: Any) -> bool:
        """Whether the level's compressor takes ``shape`` (never at ``"dense"``)."""
        part, _ = split_level(cls.check_level(level))
        return part is not Dense and part.applies_to(shape)

    @classmethod
    def pays(cls, shape: Sequence[int], level: Any) -> bool:
        """Whether the level's compressor takes ``shape`` and its level pays for it."""
        part, part_level = split_level(cls.check_level(level))
        return cls.applies_at(shape, level) and part.pays(shape, part_level)

    @classmethod
    def paper_floats(cls, shape: tuple[int, ...], level: Any, world_size: int) -> int:
        part, part_level = _sender(shape, level)
        return part.paper_floats(shape, part_level, world_size)

    @classmethod
    def messages(cls, shape: tuple[int, ...], level: Any, element_size: int) -> list[Message]:
        part, part_level = _sender(shape, level)
        return part.messages(shape, part_level, element_size)

    @classmethod
    def level_warning(cls, shapes: Sequence[tuple[int, ...]], level: Any) -> str | None:
        part, part_level = split_level(cls.check_level(level))
        if part is Dense:
            return None
        return part.level_warning([s for s in shapes if part.applies_to(s)], part_level)

    # --- the math and state ----------------------------------------------------------------

    def part(self, name: str) -> Compressor:
        """The part compressor called ``name``, built on first use."""
        if name not in self._parts:
            self._parts[name] = compressor_class(name).build(None, **self._options)
            self._parts[name].track_noise(self._noise)
            self._parts[name].set_local_size(self._local_size)
        return self._parts[name]

    def set_local_size(self, local_size: int) -> None:
        """Every part's :meth:`Compressor.set_local_size`, those built later included."""
        self._local_size = local_size
        for part in self._parts.values():
            part.set_local_size(local_size)

    def track_noise(self, on: bool) -> None:
        """Every part's :meth:`Compressor.track_noise`, those built later included."""
        self._noise = on
        for part in self._parts.values():
            part.track_noise(on)

    def exchange(
        self,
        keys: Sequence[Hashable],
        tensors: Sequence[torch.Tensor],
        world_size: int,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Exchange[Result]:
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self.level(key).partition("/")[0], []).append(i)
        exchanges = []
        for name, ix in groups.items():
            part = self.part(name)
            for i in ix:
                part.set_level(split_level(self.level(keys[i]))[1], [keys[i]])
                last = self._senders.get(keys[i])
                self._senders[keys[i]] = (name, None if last is None else last[0])
            targets = None if out is None else [out[i] for i in ix]
            exchanges.append(
                part.exchange([keys[i] for i in ix], [tensors[i] for i in ix], world_size, targets)
            )
        replies = yield from parallel(*exchanges)
        results: Result = [None] * len(tensors)  # type: ignore[list-item]
        for ix, reply in zip(groups.values(), replies):
            for i, result in zip(ix, reply):
                results[i] = result
        return results

    def rename(self, old: Hashable, new: Hashable) -> None:
        super().rename(old, new)
        for part in self._parts.values():
            part.rename(old, new)
        if old in self._senders:
            self._senders[new] = self._senders.pop(old)

    def residual_variance(self, key: Hashable, previous: bool = False) -> torch.Tensor | None:
        """The residual variance of the part that sent ``key`` at that exchange."""
        senders = self._senders.get(key)
        if senders is None:
            return None
        last, before = senders
        if not previous:
            return self._parts[last].residual_variance(key)
        if before is None:
            return None
        # the part that sent it before: its own last exchange of the key, if it changed
        return self._parts[before].residual_variance(key, previous=before == last)

    def reset(self, keys: Iterable[Hashable]) -> None:
        keys = list(keys)
        for part in self._parts.values():
            part.reset(keys)

    def state_dict(self) -> dict[str, Any]:
        """Levels, each part's state under its name, and per key the parts that sent it at
        its last two exchanges (whose residual variances Adam's correction reads)."""
        state = super().state_dict()
        state["parts"] = {name: part.state_dict() for name, part in self._parts.items()}
        state["senders"] = {key: list(pair) for key, pair in self._senders.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        default, levels = self._checked_levels(state)
        parts = state["parts"]
        if not isinstance(parts, Mapping) or not all(_known(name) for name in parts):
            raise ValueError(f"mixed parts must map compressor names to states, got {parts!r}")
        senders = _checked_senders(state.get("senders", {}), parts)
        loaded = {}
        for name, part_state in parts.items():
            part = compressor_class(name).build(None, **self._options)
            part.track_noise(self._noise)
            part.set_local_size(self._local_size)
            part.load_state_dict(part_state)
            loaded[name] = part
        self.default_level, self._levels, self._parts = default, levels, loaded
        self._senders = senders

    def check_shapes(self, shapes: Mapping[Hashable, Sequence[int]]) -> None:
        super().check_shapes(shapes)
        for part in self._parts.values():
            part.check_shapes(shapes)


_Senders = dict[Hashable, tuple[str, str | None]]


def _checked_senders(saved: Any, parts: Mapping[str, Any]) -> _Senders:
    """A state's ``senders``: per key ``[last, before]``, names of its ``parts`` (``before``
    may be ``None``)."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"mixed senders must be a Mapping, got {type(saved).__name__}")
    out = {}
    for key, pair in saved.items():
        names = isinstance(pair, list | tuple) and len(pair) == 2 and all(
            isinstance(n, str) for n in (pair[0], pair[1] or ""))  # fmt: skip
        if not names or pair[0] not in parts or (pair[1] is not None and pair[1] not in parts):
            raise ValueError(f"mixed senders[{key!r}] must be [last, before], names of "
                             f"the parts {sorted(parts)} (before may be None), "
                             f"got {pair!r}")  # fmt: skip
        out[key] = (pair[0], pair[1])
    return out


def _part(name: str, level: Any) -> type[Compressor]:
    """The registered compressor ``name`` of a mixed ``level``: any but mixed and dense."""
    try:
        part = compressor_class(name)
    except (TypeError, ValueError):
        part = None
    if part is None or part.name in (Mixed.name, Dense.name):
        raise ValueError(f"a mixed level names a compressor other than mixed and dense, got "
                         f"{name!r} in {level!r}")  # fmt: skip
    return part


def _sender(shape: tuple[int, ...], level: Any) -> tuple[type[Compressor], Any]:
    """The class and level that send a tensor of ``shape`` at ``level``: the part, or
    ``Dense`` where the part does not take the shape."""
    part, part_level = split_level(Mixed.check_level(level))
    if part is not Dense and not part.applies_to(shape):
        return Dense, None
    return part, part_level


def _known(name: Any) -> bool:
    """Whether ``name`` is a registered compressor's."""
    try:
        compressor_class(name)
    except (TypeError, ValueError):
        return False
    return True
