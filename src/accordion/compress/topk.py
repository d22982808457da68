"""Top-k sparsification: the largest entries by magnitude, values and indices gathered;
and top-k's break-even, the kept fraction above which its all-gathers send more bytes
than a dense ring all-reduce (:class:`BreakEven`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .._validate import check_int
from .base import Compressor, Result, into, register
from .cost import check_shape
from .transport import AllGather, Exchange
from .wire import Message, check_world_size

#: Bytes of an int32 index; top-k indices are int32 whenever the tensor has < 2**31 entries.
INT32_BYTES = 4
INT64_BYTES = 8


def check_fraction(fraction: Any) -> float:
    """Validate a top-k fraction (a real number in (0, 1]) and return it as a float."""
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise TypeError(f"fraction must be a number in (0, 1], got {fraction!r}")
    if math.isnan(fraction) or not 0.0 < float(fraction) <= 1.0:
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction}")
    return float(fraction)


def topk_count(numel: int, fraction: float) -> int:
    """Entries top-k keeps: ``floor(fraction * numel)``, at least 1 (0 for an empty tensor)."""
    if numel == 0:
        return 0
    return max(1, math.floor(fraction * numel))


def index_bytes(numel: int) -> int:
    """Bytes per top-k index: int32 when every flat index fits in it, else int64."""
    return INT32_BYTES if numel <= 2**31 - 1 else INT64_BYTES


@dataclass(frozen=True)
class BreakEven:
    """Where top-k stops paying for a model's tensors at ``workers`` workers
    (:meth:`TopK.break_even`).

    ``density`` is the fraction of entries kept above which top-k's two all-gathers (of
    ``value_bytes`` values and ``index_bytes`` indices per entry) put more bytes on the
    wire than one ring all-reduce of the same tensors dense; ``None`` when there is no such
    point (one worker sends nothing, or top-k compresses no tensor). ``paper_density`` is
    the same point in the paper's floats (``2 k W`` against ``numel``): ``1 / (2 W)``.
    """

    workers: int
    density: float | None
    paper_density: float | None
    value_bytes: int
    index_bytes: float

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the break-even."""
        return asdict(self)


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.3g}%"


@register
class TopK(Compressor):
    """Top-k sparsification: per tensor keep the ``floor(fraction * numel)`` (>= 1) entries
    of largest magnitude, all-gather values and indices, scatter-add and divide by the
    world size (the average, not the sum). Indices travel as int32 when they fit.

    Values and indices cost ``k (4 + 4)`` bytes against ``4 numel`` dense (fp32), and
    the all-gather more with every worker (:meth:`break_even`): the
    paper's mild 99% sends about 8x dense at 4 workers. Unlike a PowerSGD rank, that is
    the same for every tensor, a choice of level rather than of a layer's shape, so top-k
    always compresses at its level (:meth:`pays` is true): the paper's top-k runs and its
    "Data Sent" columns stay reproducible.

    Args:
        fraction: default fraction of entries kept, a number in (0, 1].
    """

    name = "topk"
    default_levels = (0.99, 0.1)
    level_help = "a fraction in (0, 1]"
    level_type = float
    title = "top-k"

    def __init__(self, fraction: float = 0.1):
        super().__init__(fraction)

    @classmethod
    def pays(cls, shape: Sequence[int], level: Any) -> bool:
        """Always true: a fraction costs the same share of every tensor (see the class)."""
        check_shape(shape)
        cls.check_level(level)
        return True

    @classmethod
    def check_level(cls, level: Any) -> float:
        """A fraction: a real number in (0, 1]."""
        return check_fraction(level)

    @classmethod
    def label(cls, level: Any) -> str:
        return f"top-k {level:g}"

    @classmethod
    def aggressiveness(cls, level: Any) -> float:
        return -check_fraction(level)  # a smaller fraction sends less

    @classmethod
    def paper_floats(cls, shape: tuple[int, ...], level: Any, world_size: int) -> int:
        """``2 k W``: values and indices, times the workers of the all-gather."""
        return 2 * topk_count(math.prod(shape), check_fraction(level)) * world_size

    @classmethod
    def messages(cls, shape: tuple[int, ...], level: Any, element_size: int) -> list[Message]:
        """``k`` values, then ``k`` indices (int32 when they fit), each all-gathered."""
        numel = math.prod(shape)
        k = topk_count(numel, check_fraction(level))
        return [Message("allgather", "values", k * element_size),
                Message("allgather", "indices", k * index_bytes(numel))]  # fmt: skip

    @classmethod
    def break_even(
        cls, shapes: Sequence[Sequence[int]], world_size: int, element_size: int = 4
    ) -> BreakEven:
        """The density (kept fraction, in (0, 1]) at which top-k sends as many wire bytes
        as dense for the tensors of ``shapes`` it compresses, at ``world_size`` workers.

        Per tensor of ``N`` entries keeping ``k = d N``: top-k sends ``(W - 1) k (e + i)``
        bytes (all-gathers of ``e``-byte values and ``i``-byte indices), a ring all-reduce
        ``2 (W - 1) / W * N e``. Summed over the tensors they are equal at
        ``d = 2 e sum(N) / (W sum(N (e + i)))``: ``1 / W`` for fp32 values and int32
        indices.
        """
        check_world_size(world_size)
        check_int("element_size", element_size, 1)
        sizes = [math.prod(s) for s in shapes if cls.applies_to(tuple(s))]
        entries = sum(sizes)
        w = world_size
        if not entries:
            return BreakEven(w, None, None, element_size, float(INT32_BYTES))
        # the bytes per index weighted by entries: int64 only for tensors of >= 2**31 entries
        index = sum(n * index_bytes(n) for n in sizes) / entries
        density = None if w == 1 else 2 * element_size / (w * (element_size + index))
        return BreakEven(w, density, 1 / (2 * w), element_size, index)

    @classmethod
    def break_even_text(cls, entry: Mapping[str, Any], labels: Sequence[str]) -> str:
        """The density, the formula and each level's bytes against dense's."""
        w = entry["workers"]
        head = f"top-k break-even at {w} worker{'s' if w != 1 else ''}: "
        if entry["density"] is None:
            why = "one worker sends nothing" if w == 1 else "top-k compresses no tensor"
            return head + f"none ({why})"
        density, paper = entry["density"], entry["paper_density"]
        # the common case reads as the rule it is: 1/W of the entries
        exact = f"1/{w} = " if math.isclose(density * w, 1.0) else ""
        value, index = entry["value_bytes"], entry["index_bytes"]
        ratios = [f"{ratio:.3g}x" for ratio in entry["bytes_vs_dense"]]
        levels = ", ".join(f"{label} {ratio}" for label, ratio in zip(labels, ratios))
        return (
            f"{head}density {exact}{_percent(density)} of the entries kept (paper floats: "
            f"1/{2 * w} = {_percent(paper)})\n  above it, all-gathering {value}-byte values + "
            f"{index:g}-byte indices sends more than a dense ring all-reduce; bytes against "
            f"dense: {levels}"
        )

    def exchange(
        self,
        keys: Sequence[Hashable],
        tensors: Sequence[torch.Tensor],
        world_size: int,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Exchange[Result]:
        if not tensors:
            return []
        values, indices, counts, numels = [], [], [], []
        for key, t in zip(keys, tensors):
            flat = t.view(-1)
            k = topk_count(flat.numel(), self.level(key))
            _, idx = torch.topk(flat.abs(), k, sorted=False)
            values.append(flat[idx])
            flat[idx] = 0  # what is sent leaves the residual; the input is ours to modify
            indices.append(idx)
            counts.append(k)
            numels.append(flat.numel())
        index_dtype = torch.int32 if max(numels) <= 2**31 - 1 else torch.int64
        sent_values = torch.cat(values)
        sent_indices = torch.cat(indices).to(index_dtype)

        all_values, all_indices = yield [AllGather(sent_values), AllGather(sent_indices)]
        device = sent_values.device
        starts = torch.tensor([0, *numels[:-1]], device=device).cumsum(0)
        offsets = torch.repeat_interleave(starts, torch.tensor(counts, device=device))
        dense = torch.zeros(sum(numels), dtype=sent_values.dtype, device=device)
        dense.index_add_(0, (all_indices.long() + offsets).view(-1), all_values.view(-1))
        dense.div_(world_size)
        results: Result = []
        offset = 0
        for t in tensors:
            results.append((dense[offset : offset + t.numel()].view(t.shape), t))
            offset += t.numel()
        return into(results, out)
