"""Integer quantisation: each worker sends its tensors as 8-, 4- or 2-bit integers with
one fp16 scale per block, and the workers average what they receive, in two phases or
in one all-gather (see :class:`IntQuantizer`).

Blocks are per row: a tensor is seen as ``[rows, cols]`` (:func:`block_layout`: its
first dimension by all the others, so that a block never spans two output channels of
a convolution; a 1-D tensor or a scalar is one row), each row is cut into blocks of
:data:`BLOCK` consecutive elements, the last block of a row possibly shorter. A block
``x`` is sent as its scale ``s``, ``max |x| / q`` with ``q = 2**(bits - 1) - 1``
rounded up to fp16 (so that no integer is clipped and a non-zero block never gets
scale 0), and the integers ``round(x / s)`` in ``[-q, q]`` (round half to even): each
element is off by at most ``s / 2``. A block of zeros has scale 0 and sends zeros.

Wire format of one exchange call: one ``uint8`` payload, each tensor's integers packed
into its own whole bytes in call order (8 bits: one per byte; 4 bits: two per byte, the
first in the low nibble; 2 bits: four per byte, the first in the lowest bits), each
stored as ``integer + 2**(bits - 1)`` (codes ``1 .. 2**bits - 1``); and one ``float16``
tensor of the tensors' scales, row-major per tensor, in call order. The two travel in
one phase of two all-gathers. In two phases (``two_phase.py``) the call's tensors are
laid end to end and cut into one chunk per worker, each chunk's packed integers and
scales travelling as one row of bytes, in an all-to-all and then an all-gather: about
``2 (W - 1) / W`` of the packed integers and scales per worker, flat in ``W``
(:meth:`IntQuantizer.messages`), where the all-gather sends ``W - 1`` times them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from .._validate import check_choice, check_int
from .base import COLLECTIVES, REFERENCE_ELEMENT_SIZE, Compressor, Result, check_shape, register
from .transport import AllGather, Exchange, parallel
from .two_phase import ServerErrors, hierarchical_bytes, two_phase_bytes, two_phase_exchange
from .wire import Message, allgather_bytes

#: Elements per block (of one row) that share one scale.
BLOCK = 64
#: The bit widths (levels), mildest first.
BITS = (8, 4, 2)
#: Bytes of one scale on the wire (fp16).
SCALE_BYTES = 2
#: The dtype scales travel in.
SCALE_DTYPE = torch.float16


def block_layout(shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of the blocks' view of a tensor of ``shape``: its first dimension
    by the product of the others for >= 2 dimensions (a matrix's own rows; a
    convolution's output channels), one row for a 1-D tensor or a scalar. Rows never
    share a block. Rows of the last dimension alone would cut a 3 x 3 convolution into
    blocks of 3: ResNet-18 would send 1.69 bytes per element at 8 bits, not 1.03."""
    numel = math.prod(shape)
    if len(shape) < 2:
        return 1, numel
    rows = shape[0]
    return rows, (numel // rows if rows else 0)


def padded_numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape`` with each row padded to whole blocks: what the
    two-phase exchange sends of it, :func:`block_count` times :data:`BLOCK`."""
    return block_count(shape) * BLOCK


def block_count(shape: Sequence[int]) -> int:
    """Blocks (hence scales) of a tensor of ``shape``: ``rows * ceil(cols / BLOCK)``."""
    rows, cols = block_layout(shape)
    return rows * -(-cols // BLOCK)


def max_int(bits: int) -> int:
    """The largest integer sent at ``bits`` bits: ``2**(bits - 1) - 1`` (symmetric range)."""
    return 2 ** (bits - 1) - 1


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` integers of ``bits`` bits packed: ``ceil(numel * bits / 8)``."""
    return -(-numel * bits // 8)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` (integers in ``[-max_int(bits), max_int(bits)]``, any integer dtype)
    packed into a flat ``uint8`` tensor of :func:`packed_bytes` bytes (see the module)."""
    per = 8 // bits
    codes = (values.reshape(-1).to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8)
    if per == 1:
        return codes
    pad = -codes.numel() % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    codes = codes.view(-1, per)
    packed = codes[:, 0].clone()
    for j in range(1, per):
        packed |= codes[:, j] << (bits * j)
    return packed


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The ``numel`` integers (``int8``) packed in the last dimension of ``packed`` (a
    ``uint8`` tensor of ``[..., packed_bytes(numel, bits)]``): ``[..., numel]``."""
    per = 8 // bits
    if per == 1:
        codes = packed
    else:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = ((packed.unsqueeze(-1) >> shifts) & (2**bits - 1)).flatten(-2)
    return (codes[..., :numel].to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)


def _blocked(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` (``[..., numel]`` of a tensor of ``shape``) as ``[..., rows, blocks per row,
    BLOCK]``, each row padded with zeros to whole blocks (a view where it needs none)."""
    rows, cols = block_layout(shape)
    t = t.reshape(*t.shape[:-1], rows, cols)
    pad = -cols % BLOCK
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    return t.view(*t.shape[:-1], (cols + pad) // BLOCK, BLOCK)


def _unblocked(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The inverse of :func:`_blocked`: ``[..., numel]``, the padding dropped."""
    rows, cols = block_layout(shape)
    t = t.reshape(*t.shape[:-3], rows, -1)[..., :cols]
    return t.reshape(*t.shape[:-2], rows * cols)


def _round_up_to_fp16(exact: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 at or above each (non-negative) entry of ``exact``: inf above
    65504, 0 only for 0."""
    scales = exact.to(SCALE_DTYPE)
    below = scales.to(exact.dtype) < exact
    up = (scales.view(torch.int16) + 1).view(SCALE_DTYPE)  # the next fp16 up (x >= 0)
    return torch.where(below, up, scales)


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The integers (``int8``, flat, ``x.numel()``) and the fp16 scales (flat, one per
    block: :func:`block_count`) that send ``x`` at ``bits`` bits; computed in fp32 (or
    ``x``'s dtype, if wider). A block of zeros has scale 0 and integers 0."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    blocks = _blocked(x.detach().reshape(-1).to(dtype), x.shape)
    q = max_int(bits)
    scales = _round_up_to_fp16(blocks.abs().amax(dim=-1, keepdim=True) / q)
    wide = scales.to(dtype)
    values = torch.where(wide > 0, blocks / wide, 0.0).round_().clamp_(-q, q)
    return _unblocked(values.to(torch.int8), x.shape), scales.reshape(-1)


def dequantize(values: torch.Tensor, scales: torch.Tensor, shape: Sequence[int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """``values * scale`` in ``dtype``: integers ``[..., numel]`` and scales
    ``[..., blocks]`` of a tensor of ``shape`` (leading dimensions: workers, say), flat."""
    blocks = _blocked(values.to(dtype), shape)
    return _unblocked(blocks * scales.to(dtype).view(*blocks.shape[:-1], 1), shape)


@register
class IntQuantizer(Compressor):
    """Integer quantisation with per-row blocks of :data:`BLOCK` elements, each with one
    fp16 scale; the level is the bit width, 8, 4 or 2 (see the module for the format).

    Each worker quantises its compensated input ``M``. Then, per bit width of a call:

    * **two phases** (``two_phase.py``, the default past two workers): the call's tensors
      end to end are cut into ``W`` chunks, one per owner; the owners average what they
      receive in fp32, quantise the average again (adding their *server error*, what the
      last such quantisation did not send, checkpointed with the compressor) and all of
      them are all-gathered. Each worker sends about ``2 (W - 1) / W`` of its quantised
      payload, flat in ``W``: ``(b / 8 + 2 / 64) / 4`` of a dense fp32 ring all-reduce's.
    * **one all-gather** of the packed integers and the scales of all tensors: every
      worker dequantises the ``W`` payloads, worker 0 first, and averages them. Each
      worker's bytes grow with ``W - 1``; at two workers it sends what two phases send,
      with one quantisation less.

    ``collective`` picks one (``"auto"``: whichever sends fewer bytes at the exchange's
    world size, the all-gather at ties). Either way every rank computes bitwise the same
    average, returned in the inputs' dtype. The residual is the local quantisation error
    ``M - dequant(quant(M))``, which error feedback sends with the next step.

    It applies to every tensor, biases and scalars included, and pays for every one
    (:meth:`Compressor.pays`: at most 3 bytes per element against fp32's 4, for a scalar
    at 8 bits). A scale overflows fp16 beyond 65504 (a block's ``max |M|`` above
    ``65504 q``): the step is then non-finite, as half precision's overflow is, and the
    :class:`Reducer` resets the memory.

    Args:
        bits: default level, 8, 4 or 2 bits per element.
        collective: ``"auto"`` (default), ``"all_gather"`` or ``"two_phase"``.
    """

    name = "int"
    default_levels = (8, 4)
    level_help = "a bit width: 8, 4 or 2"
    level_type = int
    title = "integer quantisation"
    #: The bit widths (levels) of the class, mildest first.
    bit_widths: ClassVar[tuple[int, ...]] = BITS
    #: Elements per block sharing one scale, and the scales' dtype (the two-phase codec).
    block: ClassVar[int] = BLOCK
    scale_dtype: ClassVar[torch.dtype] = SCALE_DTYPE
    #: ``variance``: the residual variances Adam's noise correction reads; ``server_error``
    #: and ``shard_error``: the two-phase exchange's (older files lack them).
    OPTIONAL_STATE_KEYS: ClassVar[frozenset[str]] = frozenset(
        {"variance", "server_error", "shard_error"})
    #: False: the two-phase owners drop their server error each step (an ablation: the
    #: second quantisation's error is never paid back).
    server_feedback: bool = True

    def __init__(self, bits: int = 8, collective: str = "auto"):
        super().__init__(bits)
        #: How payloads travel: ``"auto"``, ``"all_gather"`` or ``"two_phase"`` (the class).
        self.collective = check_choice("collective", collective, COLLECTIVES)
        self._server = ServerErrors()  # the owner's second-compression errors
        self._shards = ServerErrors()  # with hosts of several workers: the shards' errors
        self._noise = False  # whether the two-phase exchange sends the variance
        self._local_size = 1  # workers a host, as the transport says
        self._variance = ResidualVariances()

    @classmethod
    def error_factor(cls, bits: int) -> float:
        """The expected square of one element's rounding error over its block's squared
        scale: 1/12, the variance of a uniform error over one step (the scale)."""
        return 1 / 12

    def residual_variance(self, key: Hashable, previous: bool = False) -> torch.Tensor | None:
        """Per element, ``error_factor(bits) * scale**2`` of its block summed over the
        workers, from the scales every rank received (see :class:`Compressor`)."""
        return self._variance.get(key, previous)

    @classmethod
    def _construct(cls, level: Any, options: Mapping[str, Any]) -> IntQuantizer:
        """The shared option ``collective`` goes to the constructor."""
        mine = {"collective": options["collective"]} if "collective" in options else {}
        return cls(**mine) if level is None else cls(level, **mine)

    def track_noise(self, on: bool) -> None:
        """While ``on``, two-phase owners send each block's first-phase scale RMS too."""
        self._noise = bool(on)

    def set_local_size(self, local_size: int) -> None:
        """Exchange across hosts of ``local_size`` workers each: a full-precision average
        inside a host, two compressed phases across hosts (see :func:`two_phase_exchange`)."""
        self._local_size = check_int("local_size", local_size, 1)

    def reset(self, keys: Iterable[Hashable]) -> None:
        """Forget the residual variances, server and shard errors of ``keys`` (their
        memory was reset)."""
        keys = list(keys)
        for errors in (self._variance, self._server, self._shards):
            errors.reset(keys)

    def rename(self, old: Hashable, new: Hashable) -> None:
        super().rename(old, new)
        for errors in (self._variance, self._server, self._shards):
            errors.rename(old, new)

    def state_dict(self) -> dict[str, Any]:
        """Levels; per key the residual variances of its last two exchanges, so that a
        resumed run corrects Adam for the same noise (:meth:`residual_variance`); and the
        two-phase server errors this rank owns (and its shards' errors, with hosts of
        several workers)."""
        return {**super().state_dict(), "variance": self._variance.state_dict(),
                "server_error": self._server.state_dict(),
                "shard_error": self._shards.state_dict()}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        default, levels = self._checked_levels(state)
        variance, server, shards = ResidualVariances(), ServerErrors(), ServerErrors()
        variance.load_state_dict(state.get("variance", {}))
        server.load_state_dict(state.get("server_error", []))
        shards.load_state_dict(state.get("shard_error", []))
        self.default_level, self._levels, self._variance = default, levels, variance
        self._server, self._shards = server, shards

    def check_shapes(self, shapes: Mapping[Hashable, Sequence[int]]) -> None:
        """:meth:`Compressor.check_shapes`, and each key's residual variances, server and
        shard errors fit its tensor."""
        super().check_shapes(shapes)
        for errors in (self._variance, self._server, self._shards):
            errors.check_shapes(shapes)

    @classmethod
    def check_level(cls, level: Any) -> int:
        """A bit width: an int, one of the class's :attr:`bit_widths`."""
        if isinstance(level, bool) or not isinstance(level, numbers.Integral):
            raise TypeError(f"an {cls.title} level must be {cls.level_help} (an int), "
                            f"got {level!r}")  # fmt: skip
        if int(level) not in cls.bit_widths:
            raise ValueError(
                f"an {cls.title} level must be one of {cls.bit_widths} bits, got {level!r}"
            )
        return int(level)

    @classmethod
    def label(cls, level: Any) -> str:
        return f"int{cls.check_level(level)}"

    @classmethod
    def aggressiveness(cls, level: Any) -> float:
        return 32 / cls.check_level(level)  # fewer bits compress more

    @classmethod
    def applies_to(cls, shape: Sequence[int]) -> bool:
        return True  # any tensor can be quantised: biases and scalars too

    @classmethod
    def paper_floats(cls, shape: tuple[int, ...], level: Any, world_size: int) -> int:
        """``ceil(numel * bits / 32) + blocks``: the packed integers as 32-bit floats'
        worth of bits, and each fp16 scale as one float (the paper has no quantiser; as
        for dense, the collective's factor of ``world_size`` is not counted: the wire
        bytes carry it)."""
        bits = cls.check_level(level)
        return -(-math.prod(shape) * bits // 32) + block_count(shape)

    @classmethod
    def messages(cls, shape: tuple[int, ...], level: Any, element_size: int) -> list[Message]:
        """One share of the two-phase exchange (the default ``"auto"`` collective): the
        packed integers of its rows padded to whole blocks (:func:`padded_numel`), and
        the scales, 2 bytes per block, whatever ``element_size``; the wire carries ``2 (W -
        1) / W`` of them at any ``W`` (:func:`~accordion.compress.wire.ring_bytes`).

        It gives ``gathered``, the payload of the all-gather, unpadded: ``"auto"`` picks
        the fewer bytes (the all-gather at two workers). Not counted: the
        padding of a call's last chunks (under one block per worker per call), the
        variance that :meth:`track_noise` adds (2 bytes a block of the all-gather), and a
        compressor built with ``collective="all_gather"``, which sends ``W - 1`` times the
        payload (the ledger prices the class, not the instance)."""
        bits = cls.check_level(level)
        scales = SCALE_BYTES * block_count(shape)
        return [Message("twophase", "codes", packed_bytes(padded_numel(shape), bits) + scales,
                        gathered=packed_bytes(math.prod(shape), bits) + scales)]

    @classmethod
    def pays(cls, shape: Sequence[int], level: Any) -> bool:
        """Whether the unpadded payload (the all-gather's) is below dense fp32: for every
        tensor (3 bytes against 4 for a scalar at 8 bits); row padding is in the bytes."""
        bits = cls.check_level(level)
        numel = math.prod(check_shape(shape))
        sent = packed_bytes(numel, bits) + SCALE_BYTES * block_count(shape)
        return numel == 0 or sent < numel * REFERENCE_ELEMENT_SIZE

    def exchange(
        self,
        keys: Sequence[Hashable],
        tensors: Sequence[torch.Tensor],
        world_size: int,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Exchange[Result]:
        """Quantise ``tensors`` (each becomes its residual) and average them over the
        workers, each bit width's tensors in two phases or in one all-gather (see the
        class); the collectives of all of them travel in the same phases."""
        if not tensors:
            return []
        widths: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            widths.setdefault(self.level(key), []).append(i)
        spans, exchanges, gathered = [], [], []
        for bits, ix in widths.items():
            shapes = [tensors[i].shape for i in ix]
            payload = _payload_bytes(shapes, bits)  # the all-gather's: rows unpadded
            if self.two_phase_pays([padded_numel(s) for s in shapes], bits, world_size, payload):
                spans.append(ix)
                exchanges.append(self._two_phase(keys, tensors, ix, bits, world_size, out))
            else:
                gathered.extend(ix)
        if gathered:
            spans.append(gathered)
            exchanges.append(_all_gather(type(self), [keys[i] for i in gathered],
                                         [tensors[i] for i in gathered],
                                         [self.level(keys[i]) for i in gathered],
                                         self._variance,
                                         None if out is None else [out[i] for i in gathered]))
        replies = yield from parallel(*exchanges)
        results: Result = [None] * len(tensors)  # type: ignore[list-item]
        for ix, reply in zip(spans, replies):
            for i, result in zip(ix, reply):
                results[i] = result
        return results

    def two_phase_pays(self, numels: Sequence[int], bits: int, world_size: int,
                       gathered: float | None = None) -> bool:  # fmt: skip
        """Whether tensors of ``numels`` elements (rows in whole blocks) at ``bits`` bits go
        in two phases at ``world_size`` workers: as :attr:`collective` says, or for "auto"
        where that sends fewer bytes (across hosts, with hosts) than an all-gather of
        ``gathered`` bytes each (default ``numels``' payload): from 3 workers on."""
        if self.collective != "auto":
            return self.collective == "two_phase"
        total, hosts = sum(numels), self._hosts(world_size)
        if hosts < world_size:
            phases = hierarchical_bytes(total, bits, world_size, self._local_size, BLOCK)[1]
        else:
            phases = two_phase_bytes(total, bits, world_size, BLOCK, SCALE_BYTES,
                                     variance=self._noise)  # fmt: skip
        payload = _payload_bytes([(n,) for n in numels], bits) if gathered is None else gathered
        return phases < allgather_bytes(payload, world_size)

    def _hosts(self, world_size: int) -> int:
        """The hosts the exchange runs across: ``world_size`` workers of ``local_size`` a
        host where that makes two hosts or more, else every worker its own."""
        local = self._local_size
        if 1 < local < world_size and world_size % local == 0:
            return world_size // local
        return world_size

    def _two_phase(self, keys: Sequence[Hashable], tensors: Sequence[torch.Tensor],
                   ix: Sequence[int], bits: int, world_size: int,
                   out: Sequence[torch.Tensor] | None) -> Exchange[Result]:  # fmt: skip
        """The tensors ``ix`` (one bit width) averaged by :func:`two_phase_exchange`, each
        row padded to whole blocks, so that the exchange's blocks are the tensors' own (a
        block of zeros, a row never updated, stays zeros: ``nq`` has no zero code)."""
        part, part_keys = [tensors[i] for i in ix], [keys[i] for i in ix]
        rows = [_blocked(m.reshape(-1), m.shape).reshape(-1) for m in part]  # views if unpadded
        numels = [r.numel() for r in rows]
        hosts = self._hosts(world_size)
        local = world_size // hosts
        chunk = -(-sum(numels) // (world_size * BLOCK)) * BLOCK
        layout = (part_keys, numels, world_size, local)
        keep = self.server_feedback  # off: no server error kept nor added (the ablation)
        error = self._server.get(*layout, chunk) if keep else None
        shard = self._shards.get(*layout, hosts * chunk)  # flat: drops stale shard errors
        result = yield from two_phase_exchange(type(self), rows, bits, world_size, error,
                                               variance=self._noise, local_size=local,
                                               shard_error=shard)  # fmt: skip
        if keep:
            self._server.put(*layout, result.server_error)
        if result.shard_error is not None:
            self._shards.put(*layout, result.shard_error)
        results: Result = []
        offset = 0
        for i, m, r in zip(ix, part, rows):
            n = r.numel()
            if r.data_ptr() != m.data_ptr() or n != m.numel():  # padded: a copy
                m.copy_(_unblocked(r, m.shape).view(m.shape))
            average = _unblocked(result.average[offset : offset + n], m.shape).view(m.shape)
            if result.variance is not None:  # uniform in each block: its first element
                self._variance.record_blocks_of(keys[i], result.variance[offset : offset + n]
                                                .view(-1, BLOCK)[:, 0], tuple(m.shape))  # fmt: skip
            average = average.to(m.dtype) if out is None else out[i].copy_(average)
            results.append((average, m))
            offset += n
        return results

    @classmethod
    def encode(cls, m: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed integers (``uint8``, :func:`packed_bytes`) and the fp16 scales
        (:func:`block_count`) that send ``m`` at ``bits`` bits; ``m`` becomes its residual,
        ``m`` less what is sent (in place)."""
        values, s = quantize(m, bits)
        m.sub_(dequantize(values, s, m.shape, wide_dtype(m.dtype)).view(m.shape))
        return pack(values, bits), s

    @classmethod
    def decode(cls, packed: torch.Tensor, scales: torch.Tensor, shape: Sequence[int],
               bits: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        """The tensors that ``packed`` (``[W, packed_bytes]``) and ``scales`` (``[W,
        blocks]``) send, one row per worker: ``[W, numel]`` in ``dtype``."""
        return dequantize(unpack(packed, bits, math.prod(shape)), scales, shape, dtype)


def _all_gather(codec: type[IntQuantizer], keys: Sequence[Hashable],
                tensors: Sequence[torch.Tensor], bits: Sequence[int],
                variances: ResidualVariances,
                out: Sequence[torch.Tensor] | None) -> Exchange[Result]:  # fmt: skip
    """``tensors`` (each at its ``bits``; each becomes its residual) averaged from one
    all-gather of their packed integers and one of their scales, every worker's payload
    decoded and added worker 0 first; their residual variances recorded in ``variances``."""
    payload, scales = [], []
    for m, b in zip(tensors, bits):
        packed, s = codec.encode(m, b)
        payload.append(packed)
        scales.append(s)
    sent, sent_scales = torch.cat(payload), torch.cat(scales)
    if sent.numel() or sent_scales.numel():
        gathered, gathered_scales = yield [AllGather(sent), AllGather(sent_scales)]
    else:  # only empty tensors: nothing to send (alike on every rank)
        gathered, gathered_scales = sent.unsqueeze(0), sent_scales.unsqueeze(0)
    results: Result = []
    offset = scale_offset = 0
    for i, (m, b) in enumerate(zip(tensors, bits)):
        nbytes, nscales = packed_bytes(m.numel(), b), block_count(m.shape)
        own = gathered_scales[:, scale_offset : scale_offset + nscales]
        each = codec.decode(gathered[:, offset : offset + nbytes], own, m.shape, b,
                            wide_dtype(m.dtype))  # fmt: skip
        variances.record_blocks(keys[i], own, codec.error_factor(b), tuple(m.shape))
        average = _mean_of_workers(each).view(m.shape)
        average = average.to(m.dtype) if out is None else out[i].copy_(average)
        results.append((average, m))
        offset, scale_offset = offset + nbytes, scale_offset + nscales
    return results


def _payload_bytes(shapes: Sequence[Sequence[int]], bits: int) -> int:
    """Bytes of tensors of ``shapes`` quantised at ``bits`` bits: packed codes and scales."""
    return sum(packed_bytes(math.prod(s), bits) + SCALE_BYTES * block_count(s) for s in shapes)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a dequantised average is summed in: fp32, or ``dtype`` if wider."""
    return torch.promote_types(dtype, torch.float32)


def _mean_of_workers(each: torch.Tensor) -> torch.Tensor:
    """``sum(each[w] for w in range(W)) / W`` of ``[W, n]``, added worker 0 first (an
    order of additions fixed by the workers' ranks, the same on every rank)."""
    total = each[0].clone()
    for w in range(1, each.shape[0]):
        total.add_(each[w])
    return total.div_(each.shape[0])


class ResidualVariances:
    """Per key, the workers' summed residual variance per block of its tensor, at its last
    exchange and the one before, and the tensor's shape: what
    :meth:`IntQuantizer.residual_variance` answers from (Adam's noise correction)."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, tuple[torch.Tensor, torch.Tensor | None,
                                            tuple[int, ...]]] = {}  # fmt: skip

    def get(self, key: Hashable, previous: bool = False) -> torch.Tensor | None:
        """Per element of ``key``'s tensor (its shape), its block's variance; ``None``
        where none was recorded."""
        entry = self._entries.get(key)
        blocks = None if entry is None else entry[1] if previous else entry[0]
        if entry is None or blocks is None:
            return None
        shape = entry[2]
        per = _blocked(torch.zeros(math.prod(shape), dtype=blocks.dtype, device=blocks.device),
                       shape)  # fmt: skip
        per += blocks.view(*per.shape[:-1], 1)
        return _unblocked(per, shape).view(shape)

    def record_blocks(self, key: Hashable, scales: torch.Tensor, factor: float,
                      shape: tuple[int, ...]) -> None:  # fmt: skip
        """Keep ``factor * sum_w scales[w]**2`` per block (``scales``: ``[W, blocks]``,
        every worker's for ``key``), and the last record as the previous."""
        self._keep(key, scales.to(torch.float32).square().sum(0).mul_(factor), shape)

    def record_blocks_of(self, key: Hashable, blocks: torch.Tensor,
                         shape: tuple[int, ...]) -> None:  # fmt: skip
        """Keep a summed variance given per block of the tensor (:func:`block_count`)."""
        self._keep(key, blocks.to(torch.float32).clone(), shape)

    def _keep(self, key: Hashable, blocks: torch.Tensor, shape: tuple[int, ...]) -> None:
        last = self._entries.get(key)
        self._entries[key] = (blocks, None if last is None else last[0], shape)

    def reset(self, keys: Iterable[Hashable]) -> None:
        """Forget ``keys``' records."""
        for key in keys:
            self._entries.pop(key, None)

    def rename(self, old: Hashable, new: Hashable) -> None:
        """Move ``old``'s records to ``new``."""
        if old in self._entries:
            self._entries[new] = self._entries.pop(old)

    def state_dict(self) -> dict[Hashable, dict[str, Any]]:
        """Per key ``now``, ``before`` (tensors, or ``None``) and ``shape``."""
        return {key: {"now": now.clone(), "before": None if before is None
                      else before.clone(), "shape": list(shape)}
                for key, (now, before, shape) in self._entries.items()}  # fmt: skip

    def load_state_dict(self, saved: Any) -> None:
        """Restore a :meth:`state_dict`: per key a 1-D float tensor of one entry per
        block (``now``), another like it or ``None`` (``before``) and the tensor's
        ``shape``; anything else is a ``ValueError`` and changes nothing."""
        if not isinstance(saved, Mapping):
            raise ValueError(f"compressor variance must be a Mapping, got {type(saved).__name__}")
        out = {}
        for key, entry in saved.items():
            fields = entry if isinstance(entry, Mapping) else {}
            now, before, shape = fields.get("now"), fields.get("before"), fields.get("shape")
            if not (isinstance(now, torch.Tensor) and now.dim() == 1 and now.is_floating_point()
                    and (before is None or (isinstance(before, torch.Tensor)
                                            and before.shape == now.shape))
                    and isinstance(shape, list | tuple)
                    and all(type(n) is int and n >= 0 for n in shape)):  # fmt: skip
                raise ValueError(f"compressor variance[{key!r}] must hold 'now' (a 1-D float "
                                 f"tensor, one entry per block), 'before' (None or the same) "
                                 f"and 'shape' (ints), got {entry!r:.80}")  # fmt: skip
            out[key] = (now.clone(), None if before is None else before.clone(), tuple(shape))
        self._entries = out

    def check_shapes(self, shapes: Mapping[Hashable, Sequence[int]]) -> None:
        """Raise ``ValueError`` unless each key's records fit its tensor: its shape, one
        entry per block of it."""
        for key, (now, _, shape) in self._entries.items():
            if key not in shapes or tuple(shapes[key]) != shape:
                raise ValueError(f"compressor variance[{key!r}] is for shape {shape}, not a "
                                 f"tensor's: {shapes.get(key)}")  # fmt: skip
            blocks = block_count(shape)
            if now.numel() != blocks:
                raise ValueError(f"compressor variance[{key!r}] has {now.numel()} blocks; a "
                                 f"tensor of shape {shape} has {blocks}")  # fmt: skip
