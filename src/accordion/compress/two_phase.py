"""The two-phase compressed all-reduce: bytes per worker that stay flat as workers grow.

An all-gather of compressed payloads makes each worker receive the other ``W - 1``
payloads, so its bytes grow with the number of workers ``W``: past a few workers it
sends more than a dense ring all-reduce. The two-phase exchange (DeepSpeed's
``compressed_allreduce``, CGX, torchft's ``allreduce_quantized``) keeps them flat:

1. each worker compresses its flat buffer (the compensated gradients of one call, padded
   to ``W`` chunks of whole blocks) and sends chunk ``j`` to worker ``j``, the chunk's
   *owner*, in one :class:`~accordion.compress.transport.AllToAll`;
2. the owner decodes the ``W`` chunks it received, averages them in fp32 (worker 0
   first), adds its *server error* (what its previous second compression did not send),
   compresses the sum again (at ``second_bits``, by default the first's) and keeps what
   that did not send as its new server error;
3. every owner's compressed average is all-gathered and every worker decodes all ``W``
   of them: every rank, owners included, ends with the same values, bitwise.

Each worker sends ``W - 1`` chunks in each phase, about ``2 (W - 1) / W`` of its
compressed buffer in all (:func:`two_phase_bytes`), what a ring all-reduce of compressed
values would send, at any ``W``.

Workers that share a host (``local_size`` > 1, ranks host after host) first average the
buffer in full precision, each its ``1 / local_size`` shard (an all-to-all inside the
host); each shard is compressed across hosts, the two phases running among the workers of
one local rank; the results are all-gathered inside the host, still compressed. Only the
bytes across hosts are compressed: inside a host links are 10-100x faster.

Error feedback is two-level, as in 1-bit Adam: the *worker error* (the full-size residual
of the first compression) is left in the caller's input, as every compressor leaves its
residual; the server error (one chunk, ``1 / W`` of the buffer) is returned for the
caller to keep and pass back at the next exchange of the same layout. Without it the
second compression's error is never paid back and the average keeps a bias.

A codec is a block quantiser (:class:`BlockCodec`): the integer quantiser and the
RMS-scaled one (``quantize.py``, ``normalquant.py``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from .transport import AllGather, AllToAll, Exchange, check_local_size
from .wire import allgather_bytes, alltoall_bytes, check_world_size


class BlockCodec(Protocol):
    """What the two-phase exchange needs of a block quantiser: blocks of :attr:`block`
    consecutive elements (of one row) share one scale of :attr:`scale_dtype`."""

    block: ClassVar[int]
    scale_dtype: ClassVar[torch.dtype]

    @classmethod
    def encode(cls, m: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed codes (``uint8``, ``ceil(numel * bits / 8)`` bytes, row after row) and
        scales (one per block, row after row) of ``m``; ``m`` becomes its residual."""
        ...

    @classmethod
    def decode(cls, packed: torch.Tensor, scales: torch.Tensor, shape: Sequence[int],
               bits: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        """``[R, numel]`` in ``dtype`` from ``R`` rows of packed codes and scales."""
        ...

    @classmethod
    def error_factor(cls, bits: int) -> float:
        """An element's expected squared error over its block's squared scale."""
        ...


@dataclass(frozen=True)
class ChunkLayout:
    """How ``numel`` elements are cut among ``world_size`` owners: ``chunk`` elements
    each (whole blocks of ``block``), the last owners' chunks padded with zeros."""

    numel: int
    world_size: int
    block: int

    @property
    def chunk(self) -> int:
        """Elements per owner: ``ceil(numel / (W * block)) * block``."""
        per = self.world_size * self.block
        return -(-self.numel // per) * self.block

    def chunk_bytes(self, bits: int, scale_bytes: int) -> int:
        """Bytes of one chunk sent at ``bits`` bits: its packed codes and its scales."""
        return -(-self.chunk * bits // 8) + scale_bytes * (self.chunk // self.block)


def two_phase_bytes(numel: int, bits: int, world_size: int, block: int, scale_bytes: int = 2,
                    second_bits: int | None = None, variance: bool = False) -> float:  # fmt: skip
    """Bytes one worker sends to average ``numel`` elements through the two-phase exchange:
    ``W - 1`` of its ``W`` chunks at ``bits`` bits (the all-to-all), then its own chunk
    at ``second_bits`` to the ``W - 1`` others (a ring all-gather), with one more
    ``scale_bytes`` per block when the first phase's variance travels too (``variance``).
    0 for one worker or no elements."""
    world_size = check_world_size(world_size)
    layout = ChunkLayout(numel, world_size, block)
    if world_size == 1 or not numel:
        return 0.0
    second = bits if second_bits is None else second_bits
    extra = scale_bytes * (layout.chunk // block) if variance else 0
    first = alltoall_bytes(world_size * layout.chunk_bytes(bits, scale_bytes), world_size)
    return first + allgather_bytes(layout.chunk_bytes(second, scale_bytes) + extra, world_size)


@dataclass(frozen=True)
class TwoPhaseResult:
    """What :func:`two_phase_exchange` returns, all in the wide dtype (fp32 or wider).

    ``average``: the buffer's average over the workers (``numel`` elements, the same on
    every rank); ``server_error``: this owner's new server error (one chunk);
    ``shard_error``: with hosts of several workers, the new worker error of this worker's
    shard of its host's average (``W / local_size`` chunks), else ``None``;
    ``variance``: per element, the expected square of the average's error times ``W**2``
    (the workers' summed residual variance, the unit of
    :meth:`~accordion.compress.Compressor.residual_variance`), or ``None`` when not asked.
    """

    average: torch.Tensor
    server_error: torch.Tensor
    shard_error: torch.Tensor | None
    variance: torch.Tensor | None


def two_phase_exchange(
    codec: type[BlockCodec],
    tensors: Sequence[torch.Tensor],
    bits: int,
    world_size: int,
    server_error: torch.Tensor | None = None,
    second_bits: int | None = None,
    variance: bool = False,
    local_size: int = 1,
    shard_error: torch.Tensor | None = None,
) -> Exchange[TwoPhaseResult]:
    """Average ``tensors`` (this worker's compensated values, one dtype and device), laid
    end to end, over ``world_size`` workers in two phases (see the module). With
    ``local_size`` 1 each tensor becomes its residual (the worker error), in place; with
    hosts of ``local_size`` > 1 workers (see the module) the worker error is the shard's
    (``shard_error`` in, the result's out) and the tensors become 0. ``server_error`` (one
    chunk, or ``None`` for zeros) is this owner's from the last exchange of the same
    layout. With ``variance``, the owner also sends per block the RMS of the first-phase
    scales (one more scale per block), and the result has the variance."""
    world_size = check_world_size(world_size)
    local_size = check_local_size(local_size, world_size)
    second = bits if second_bits is None else second_bits
    n = sum(t.numel() for t in tensors)
    dtype = torch.promote_types(tensors[0].dtype, torch.float32) if tensors else torch.float32
    device = tensors[0].device if tensors else None
    chunk = ChunkLayout(n, world_size, codec.block).chunk
    hosts = world_size // local_size
    if not n:  # alike on every rank: nothing to send
        empty = torch.zeros(0, dtype=dtype, device=device)
        return TwoPhaseResult(empty, empty, None, None)
    _check_error("server_error", server_error, (chunk,), n, world_size)
    _check_error("shard_error", shard_error, (hosts * chunk,), n, world_size)
    buffer = _laid_out(tensors, world_size * chunk, dtype)
    work = buffer
    if local_size > 1:  # a full-precision reduce-scatter inside the host
        (received,) = yield [AllToAll(buffer.view(local_size, hosts * chunk), scope="host")]
        work = _mean_of_rows(received)
        if shard_error is not None:
            work.add_(shard_error)
    packed, scales = codec.encode(work.view(hosts, chunk), bits)  # work: its residual
    _give_back(tensors, buffer if local_size == 1 else None)  # the shard keeps it: 0
    scope = "peers" if local_size > 1 else "world"
    (received,) = yield [AllToAll(_payload(hosts, packed, scales), scope=scope)]
    total, sent = _owner_step(codec, received, chunk, (bits, second), dtype, server_error,
                              variance)  # fmt: skip
    (gathered,) = yield [AllGather(sent, scope)]
    if local_size > 1:  # every shard of the host, as sent: [local, hosts, bytes]
        (gathered,) = yield [AllGather(gathered, scope="host")]
        gathered = gathered.reshape(world_size, -1)
    second_scales = _scales(codec, gathered, chunk, second)
    average = codec.decode(gathered[:, : -(-chunk * second // 8)], second_scales, (chunk,),
                           second, dtype).reshape(-1)[:n]  # fmt: skip
    noise = None
    if variance:
        weight = codec.error_factor(bits) * world_size**2 / hosts  # the W**2 unit, per peer
        noise = _variance(codec, gathered, second_scales, weight, second, world_size)[:n]
    return TwoPhaseResult(average, total, work if local_size > 1 else None, noise)


def _owner_step(codec: type[BlockCodec], received: torch.Tensor, chunk: int,
                bits: tuple[int, int], dtype: torch.dtype, server_error: torch.Tensor | None,
                variance: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The owner's work between the phases: the average in ``dtype`` of the chunks it
    ``received`` (``[P, bytes]`` at ``bits[0]``) plus its ``server_error``, compressed at
    ``bits[1]``.
    Returns the new server error (one chunk) and the payload to all-gather (with each
    block's RMS of the first scales after it, when ``variance``)."""
    first, second = bits
    first_scales = _scales(codec, received, chunk, first)
    own = codec.decode(received[:, : -(-chunk * first // 8)], first_scales, (chunk,), first,
                       dtype)  # fmt: skip
    total = _mean_of_rows(own)
    if server_error is not None:
        total.add_(server_error)
    packed, scales = codec.encode(total.view(1, chunk), second)  # total: the server error
    extra = []
    if variance:  # one value per block: the RMS of the first scales, < fp16's max
        rms = first_scales.to(dtype).square().mean(0).sqrt_()
        extra.append(rms.to(codec.scale_dtype).view(torch.uint8))
    return total, torch.cat([_payload(1, packed, scales)[0], *extra])


def _laid_out(tensors: Sequence[torch.Tensor], size: int, dtype: torch.dtype) -> torch.Tensor:
    """``tensors`` end to end in a new buffer of ``size`` elements of ``dtype``, zeros after."""
    buffer = torch.zeros(size, dtype=dtype, device=tensors[0].device)
    torch.cat([t.reshape(-1) for t in tensors], out=buffer[: sum(t.numel() for t in tensors)])
    return buffer


def _give_back(tensors: Sequence[torch.Tensor], buffer: torch.Tensor | None) -> None:
    """Copy each tensor's part of ``buffer`` (laid out by :func:`_laid_out`) into it, or
    zeros for ``None``."""
    offset = 0
    for t in tensors:
        if buffer is None:
            t.zero_()
        else:
            t.copy_(buffer[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()


def _check_error(name: str, error: torch.Tensor | None, shape: tuple[int, ...], n: int,
                 world_size: int) -> None:  # fmt: skip
    if error is not None and error.shape != shape:
        raise ValueError(f"{name} must have {shape[0]} elements for {n} elements on "
                         f"{world_size} workers, got {tuple(error.shape)}")  # fmt: skip


def _mean_of_rows(rows: torch.Tensor) -> torch.Tensor:
    """The mean of ``rows`` (``[R, n]``), added row 0 first: a fixed order of additions,
    bitwise the same on every rank."""
    total = rows[0].clone()
    for r in range(1, rows.shape[0]):
        total.add_(rows[r])
    return total.div_(rows.shape[0])


def _payload(rows: int, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``rows`` rows of packed codes followed by their scales' bytes: ``[rows, bytes]``."""
    return torch.cat([packed.view(rows, -1), scales.view(rows, -1).view(torch.uint8)], dim=1)


def _scales(codec: type[BlockCodec], payload: torch.Tensor, chunk: int, bits: int) -> torch.Tensor:
    """The scales (``[R, chunk / block]``) in the rows of a :func:`_payload`."""
    start, count = -(-chunk * bits // 8), chunk // codec.block
    width = torch.tensor([], dtype=codec.scale_dtype).element_size()
    return payload[:, start : start + width * count].contiguous().view(codec.scale_dtype)


def _variance(codec: type[BlockCodec], gathered: torch.Tensor, second_scales: torch.Tensor,
              first_weight: float, second: int, world_size: int) -> torch.Tensor:  # fmt: skip
    """Per element of the padded buffer, ``W**2`` times the expected squared error of the
    average: the first phase's ``first_weight * rms**2`` (``rms``: the owners' RMS of the
    first scales; for ``P`` peers ``f_b W**2 / P``) and the second's ``W**2 f_b' s'**2``."""
    count = second_scales.shape[1]
    width = second_scales.element_size()
    rms = gathered[:, -width * count :].contiguous().view(codec.scale_dtype).float()
    after = codec.error_factor(second) * world_size**2 * second_scales.float().square()
    return (first_weight * rms.square() + after).reshape(-1).repeat_interleave(codec.block)


#: A two-phase call's layout: its keys, their element counts, the world size and the
#: workers a host.
Layout = tuple[tuple[Hashable, ...], tuple[int, ...], int, int]


class ServerErrors:
    """The server errors of one owner, one chunk per layout of a two-phase call (its keys
    in order, their element counts, the world size and the workers a host): what the
    owner's second compression did not send, added to its next average of the same
    layout. (With hosts of several workers, the shards' worker errors are kept alike.)

    A layout seen for the first time starts at zero and replaces the layouts that share a
    key with it: a call regrouped (a tensor's level changed, the buckets were rebuilt)
    loses its old server error, ``1 / W`` of the buffer's last rounding error. One from
    another world size or hosts of another size (a checkpoint resumed on more or fewer
    workers) is dropped with a warning: its chunks belonged to other owners.
    """

    def __init__(self) -> None:
        self._errors: dict[Layout, torch.Tensor] = {}

    def get(self, keys: Sequence[Hashable], numels: Sequence[int], world_size: int,
            local_size: int, chunk: int) -> torch.Tensor | None:  # fmt: skip
        """The server error of this layout (``chunk`` elements), or ``None`` (zeros)."""
        layout = (tuple(keys), tuple(numels), world_size, local_size)
        found = self._errors.get(layout)
        if found is not None and found.numel() == chunk:
            return found
        stale = [old for old in self._errors if set(old[0]) & set(layout[0])]
        worlds = sorted({old[2:] for old in stale if old[2:] != (world_size, local_size)})
        if worlds:
            kept = "; ".join(f"{w} workers ({n} a host)" for w, n in worlds)
            warnings.warn(
                f"two-phase server errors of {len(stale)} layout(s) dropped: kept on {kept}, "
                f"now {world_size} workers ({local_size} a host): their chunks belonged to "
                "other owners", RuntimeWarning, stacklevel=2,
            )
        for old in stale:
            del self._errors[old]
        return None

    def put(self, keys: Sequence[Hashable], numels: Sequence[int], world_size: int,
            local_size: int, error: torch.Tensor) -> None:  # fmt: skip
        """Keep ``error`` as this layout's server error."""
        self._errors[(tuple(keys), tuple(numels), world_size, local_size)] = error

    def reset(self, keys: Iterable[Hashable]) -> None:
        """Forget the server errors of layouts holding any of ``keys``."""
        gone = set(keys)
        self._errors = {k: v for k, v in self._errors.items() if not gone & set(k[0])}

    def rename(self, old: Hashable, new: Hashable) -> None:
        """Call the key ``old`` ``new`` in every layout."""
        renamed = {}
        for (keys, numels, world, local), error in self._errors.items():
            renamed[(tuple(new if k == old else k for k in keys), numels, world, local)] = error
        self._errors = renamed

    def state_dict(self) -> list[dict[str, Any]]:
        """Per layout its keys, element counts, world size, workers a host and error (a
        tensor)."""
        return [{"keys": list(keys), "numels": list(numels), "world_size": world,
                 "local_size": local, "error": error.clone()}
                for (keys, numels, world, local), error in self._errors.items()]  # fmt: skip

    def load_state_dict(self, entries: Any) -> None:
        """Restore a :meth:`state_dict`; a malformed entry is a ``ValueError`` naming it,
        and nothing changes."""
        loaded = {}
        if not isinstance(entries, list | tuple):
            raise ValueError(f"server_error must be a list, got {type(entries).__name__}")
        for i, entry in enumerate(entries):
            fields = entry if isinstance(entry, Mapping) else {}
            keys, numels = fields.get("keys"), fields.get("numels")
            world, error = fields.get("world_size"), fields.get("error")
            local = fields.get("local_size", 1)
            if not (isinstance(keys, list | tuple) and isinstance(numels, list | tuple)
                    and len(keys) == len(numels)
                    and all(type(n) is int and n >= 0 for n in numels)
                    and type(world) is int and world >= 1
                    and type(local) is int and local >= 1
                    and isinstance(error, torch.Tensor) and error.dim() == 1
                    and error.is_floating_point()):  # fmt: skip
                raise ValueError(f"server_error[{i}] must hold 'keys', 'numels' (as many "
                                 f"ints >= 0), 'world_size' and 'local_size' (ints >= 1) and "
                                 f"'error' (a 1-D float tensor), got {entry!r:.100}")  # fmt: skip
            loaded[(tuple(keys), tuple(numels), world, local)] = error.clone()
        self._errors = loaded

    def check_shapes(self, shapes: Mapping[Hashable, Sequence[int]]) -> None:
        """Raise ``ValueError`` unless every layout's keys are tensors of ``shapes`` with
        its element counts."""
        for keys, numels, *_ in self._errors:
            for key, n in zip(keys, numels):
                if key not in shapes or math.prod(shapes[key]) != n:
                    raise ValueError(f"a server error is for {key!r} of {n} elements, not a "
                                     f"tensor's: {shapes.get(key)}")  # fmt: skip


def hierarchical_bytes(
    numel: int, bits: int, world_size: int, local_size: int, block: int,
    scale_bytes: int = 2, element_size: int = 4,
) -> tuple[float, float]:  # fmt: skip
    """``(inside its host, across hosts)``: the bytes one worker sends to average ``numel``
    elements of ``element_size`` bytes through :func:`two_phase_exchange` with
    ``local_size`` workers a host: the full-precision all-to-all and the compressed
    all-gather inside the host; the two compressed phases among the hosts."""
    world_size = check_world_size(world_size)
    layout = ChunkLayout(numel, world_size, block)
    if not numel or world_size == 1:
        return 0.0, 0.0
    hosts = world_size // local_size
    packed = layout.chunk_bytes(bits, scale_bytes)
    inside = (alltoall_bytes(world_size * layout.chunk * element_size, local_size)
              + allgather_bytes(hosts * packed, local_size))  # fmt: skip
    across = alltoall_bytes(hosts * packed, hosts) + allgather_bytes(packed, hosts)
    return inside, across
