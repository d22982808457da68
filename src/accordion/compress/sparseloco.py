"""SparseLoCo's compressor: chunk-wise top-k sparsification with 2-bit values.

The compressor that SparseLoCo (Sarfi et al., 2025, "Communication Efficient LLM
Pre-training with SparseLoCo") applies to DiLoCo's pseudo-gradients, under error
feedback: each tensor is flattened and cut into chunks of :data:`CHUNK` consecutive
elements (the last chunk possibly shorter); each chunk keeps its ``floor(fraction *
len(chunk))`` (>= 1) entries of largest magnitude; the kept values are sent as 2-bit
integers with fp16 scales, their positions as int16 indices into their chunk. What a
worker does not send (the unkept entries, and the kept ones' quantisation error) is its
residual, which the :class:`~accordion.compress.reducer.Reducer`'s error feedback adds to
its next input.

The 2-bit quantiser is the library's symmetric one (``quantize.py``): levels -1, 0 and
+1 times one fp16 scale per block of :data:`~accordion.compress.quantize.BLOCK` (64)
consecutive kept values, the scale being the block's largest magnitude rounded up to
fp16. It is *not* SparseLoCo's own 2-bit quantiser, which picks its levels from the
values' statistics; with this one a kept value below half of its block's largest
magnitude is sent as 0 and stays, whole, in the residual.

Wire format of one exchange call, per tensor in call order, each kind concatenated over
the tensors into one payload and the three all-gathered in one phase:

* ``values``: ``uint8``, the tensor's ``K`` kept values quantised as one row (blocks of
  64 consecutive kept values) and packed four to a byte (:func:`~accordion.compress.
  quantize.pack`), ``ceil(K / 4)`` bytes;
* ``indices``: each kept value's position inside its chunk as an ``int16``, ``2 K`` bytes,
  travelling as their ``uint8`` bytes (gloo all-gathers no ``int16``);
* ``scales``: ``float16``, one per block of the kept values, ``2 ceil(K / 64)`` bytes.

Kept values are in chunk order and, within a chunk, in ascending position, so that the
payload is a fixed function of the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from .base import Compressor, Result, register
from .quantize import (
    SCALE_BYTES,
    block_count,
    dequantize,
    pack,
    packed_bytes,
    quantize,
    unpack,
    wide_dtype,
)
from .topk import check_fraction, topk_count
from .transport import AllGather, Exchange
from .wire import Message

#: Elements per chunk: each chunk keeps its own top-k; a position in it (< 4096 <= 32767)
#: fits an int16 index.
CHUNK = 4096
#: Bits per kept value on the wire.
BITS = 2
#: The dtype of the indices on the wire, and its bytes.
INDEX_DTYPE = torch.int16
INDEX_BYTES = 2


def kept_count(numel: int, fraction: float) -> int:
    """Entries kept of a tensor of ``numel``: ``topk_count`` of each chunk, summed."""
    full, rest = divmod(numel, CHUNK)
    return full * topk_count(CHUNK, fraction) + topk_count(rest, fraction)


def wire_bytes_per_kind(numel: int, fraction: float) -> tuple[int, int, int]:
    """Bytes of ``(values, indices, scales)`` that one worker sends for a tensor of
    ``numel`` entries at ``fraction``: ``ceil(K / 4)``, ``2 K`` and ``2 ceil(K / 64)``
    for ``K`` = :func:`kept_count` entries kept."""
    k = kept_count(numel, fraction)
    return packed_bytes(k, BITS), INDEX_BYTES * k, SCALE_BYTES * block_count((k,))


def chunk_starts(numel: int, fraction: float, device: torch.device) -> torch.Tensor:
    """The flat position of the chunk of each kept entry, in payload order (``int64``,
    :func:`kept_count` of them): a kept entry's flat position is this plus its index."""
    full, rest = divmod(numel, CHUNK)
    starts = torch.arange(full, device=device).mul_(CHUNK)
    head = starts.repeat_interleave(topk_count(CHUNK, fraction))
    tail = torch.full((topk_count(rest, fraction),), full * CHUNK, device=device)
    return torch.cat([head, tail.to(head.dtype)])


def select(flat: torch.Tensor, fraction: float) -> torch.Tensor:
    """The positions inside their chunk (``int64``) of the entries ``flat`` keeps: per
    chunk the ``topk_count`` of largest magnitude, chunk by chunk, ascending in each."""
    full, rest = divmod(flat.numel(), CHUNK)
    magnitude = flat.detach().abs()
    parts = []
    if full:
        chunks = magnitude[: full * CHUNK].view(full, CHUNK)
        picked = torch.topk(chunks, topk_count(CHUNK, fraction), dim=1, sorted=False).indices
        parts.append(picked.sort(dim=1).values.reshape(-1))  # sorted: a fixed payload order
    if rest:
        tail = torch.topk(magnitude[full * CHUNK :], topk_count(rest, fraction), sorted=False)
        parts.append(tail.indices.sort().values)
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=flat.device)
    return torch.cat(parts)


@register
class SparseLoCo(Compressor):
    """Chunk-wise top-k with 2-bit values, SparseLoCo's compressor (see the module).

    Each worker sends, per tensor, the ``floor(fraction * len)`` (>= 1) entries of largest
    magnitude of each chunk of :data:`CHUNK` elements, quantised to 2 bits with a fp16
    scale per 64 kept values, and their int16 positions in their chunks; its residual is
    its input minus what it sent (error feedback sends it later). Every worker decodes the
    ``W`` workers' payloads, worker 0 first, scatter-adds them into zeros in fp32 (or the
    inputs' dtype, if wider) and divides by ``W``, so that every rank computes bitwise the
    same average, returned in the inputs' dtype.

    About ``2.28 K`` bytes for ``K`` kept entries (a quarter byte of value, two of index
    and a 64th of a 2-byte scale each) against ``4 N`` dense: at 3% kept about 1.7% of
    dense's bytes per worker, before the all-gather's factor ``W - 1``. It applies to every
    tensor and pays for every one but a one-element tensor (5 bytes against 4). A scale
    overflows fp16 beyond 65504: the step is then non-finite and the :class:`Reducer`
    resets the memory, as for the integer quantiser.

    Args:
        fraction: default fraction of each chunk kept, a number in (0, 1].
    """

    name = "sparseloco"
    title = "top-k with 2-bit values (SparseLoCo)"
    default_levels = (0.03, 0.01)
    level_help = "a fraction in (0, 1]"
    level_type = float

    def __init__(self, fraction: float = 0.03):
        super().__init__(fraction)

    # --- the level language ----------------------------------------------------------------

    @classmethod
    def check_level(cls, level: Any) -> float:
        """A fraction of each chunk kept: a real number in (0, 1]."""
        return check_fraction(level)

    @classmethod
    def label(cls, level: Any) -> str:
        return f"top-k {check_fraction(level):g} int2"

    @classmethod
    def aggressiveness(cls, level: Any) -> float:
        return -check_fraction(level)  # a smaller fraction sends less

    # --- the cost description --------------------------------------------------------------

    @classmethod
    def applies_to(cls, shape: Sequence[int]) -> bool:
        return True  # any tensor can be sparsified; pays() leaves out the one-element ones

    @classmethod
    def pays(cls, shape: Sequence[int], level: Any) -> bool:
        """Whether the bytes one worker sends for ``shape`` (:meth:`messages`) are fewer
        than dense fp32's, 4 per element (the default rule, :meth:`Compressor.pays`):
        true for every tensor of two or more entries, false for a one-element tensor
        (1 + 2 + 2 bytes of value, index and scale against 4), which then goes dense."""
        return super().pays(shape, level)

    @classmethod
    def paper_floats(cls, shape: tuple[int, ...], level: Any, world_size: int) -> int:
        """``(ceil(2 K / 32) + ceil(16 K / 32) + ceil(K / 64)) W`` for ``K`` kept entries:
        the 2-bit values and the 16-bit indices as 32-bit floats' worth of bits, each fp16
        scale as one float, times the workers of the all-gather, as top-k counts its own."""
        k = kept_count(math.prod(shape), check_fraction(level))
        floats = -(-k * BITS // 32) + -(-k * 8 * INDEX_BYTES // 32) + block_count((k,))
        return floats * world_size

    @classmethod
    def messages(cls, shape: tuple[int, ...], level: Any, element_size: int) -> list[Message]:
        """Three all-gathers: the packed 2-bit values, ``ceil(K / 4)`` bytes; the int16
        indices, ``2 K``; the fp16 scales, ``2 ceil(K / 64)``; whatever ``element_size``."""
        values, indices, scales = wire_bytes_per_kind(math.prod(shape), check_fraction(level))
        return [Message("allgather", "values", values),
                Message("allgather", "indices", indices),
                Message("allgather", "scales", scales)]  # fmt: skip

    # --- the exchange ----------------------------------------------------------------------

    def exchange(
        self,
        keys: Sequence[Hashable],
        tensors: Sequence[torch.Tensor],
        world_size: int,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Exchange[Result]:
        """Sparsify and quantise ``tensors`` (each becomes its residual), all-gather the
        values, indices and scales in one phase, and average the workers' decoded tensors
        (see the class)."""
        if not tensors:
            return []
        fractions = [self.level(key) for key in keys]
        # each kept entry's chunk, the same for every worker's payload: computed once
        starts = [chunk_starts(m.numel(), f, m.device) for m, f in zip(tensors, fractions)]
        encoded = [_encode(m, f, s) for m, f, s in zip(tensors, fractions, starts)]
        sent = [torch.cat([e[j] for e in encoded]) for j in range(3)]
        if any(s.numel() for s in sent):
            gathered = yield [AllGather(s) for s in sent]
        else:  # only empty tensors: nothing to send (alike on every rank)
            gathered = [s.unsqueeze(0) for s in sent]
        results: Result = []
        offsets = [0, 0, 0]
        for i, (m, s, e) in enumerate(zip(tensors, starts, encoded)):
            sizes = [part.numel() for part in e[:3]]
            own = [g[:, o : o + n] for g, o, n in zip(gathered, offsets, sizes)]
            average = _decode(own, m.numel(), s, world_size, wide_dtype(m.dtype)).view(m.shape)
            average = average.to(m.dtype) if out is None else out[i].copy_(average)
            results.append((average, e[3]))
            offsets = [o + n for o, n in zip(offsets, sizes)]
        return results


def _encode(
    m: torch.Tensor, fraction: float, starts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed values, int16 indices as bytes, fp16 scales, residual)`` of one tensor
    ``m`` (``starts``: :func:`chunk_starts` of it); the residual is ``m`` itself (a copy
    where it is not contiguous) less what is sent."""
    flat = m.view(-1) if m.is_contiguous() else m.reshape(-1)
    local = select(flat, fraction)
    positions = local + starts
    codes, scales = quantize(flat[positions], BITS)
    sent = dequantize(codes, scales, (codes.numel(),), wide_dtype(m.dtype))
    flat[positions] -= sent.to(flat.dtype)  # the input is ours: it becomes the residual
    residual = m if m.is_contiguous() else flat.view(m.shape)
    # int16 sent as its bytes: gloo's all-gather takes uint8 but not int16
    return pack(codes, BITS), local.to(INDEX_DTYPE).view(torch.uint8), scales, residual


def _decode(
    gathered: Sequence[torch.Tensor], numel: int, starts: torch.Tensor, world_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The flat average over the workers of one tensor of ``numel`` entries from its rows
    of the gathered ``(values, indices, scales)`` (``starts``: its :func:`chunk_starts`),
    in ``dtype``."""
    packed, index_bytes, scales = gathered
    indices = index_bytes.contiguous().view(INDEX_DTYPE)  # [W, K]: the bytes sent, read back
    k = indices.shape[-1]
    values = dequantize(unpack(packed, BITS, k), scales, (k,), dtype)  # [W, k]
    positions = indices.long() + starts
    total = torch.zeros(numel, dtype=dtype, device=values.device)
    # one worker at a time, worker 0 first: a worker's positions are distinct, so each
    # index_add_ is deterministic and the order of additions is the same on every rank
    for w in range(values.shape[0]):
        total.index_add_(0, positions[w], values[w])
    return total.div_(world_size)
