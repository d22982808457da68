"""RMS-scaled quantisation: 4, 3, 2 or 1 bits per element on the Gaussian's optimal grid.

The integer quantiser (``quantize.py``) scales each block by its largest magnitude, so
that nothing is clipped; at 2 bits its grid is ``{-1, 0, +1} * max``, and in a block of
64 roughly Gaussian values about four fifths round to 0. This one scales each block by
its root mean square ``s`` instead and rounds onto the ``2**bits`` midpoints of a uniform
grid whose step is Max's (1960) optimal step for a unit Gaussian (:data:`STEPS`): at
2 bits the levels are ``+-0.50 s`` and ``+-1.49 s``, at 1 bit ``+-0.80 s`` (the sign and
the mean magnitude, as 1-bit Adam sends). Values beyond the outer levels are clipped to
them; error feedback sends what was clipped later. No level is 0, so every code is used.

On the gradients of the character transformer, with error feedback, the relative error
of the two workers' average at 2 bits was 0.46 against the integer quantiser's 1.1, and
at 3 bits 0.27, near the integer quantiser's 4 bits (0.14) (``docs/dense-quality.md``).

Blocks are the integer quantiser's (:func:`~accordion.compress.quantize.block_layout`:
per row, :data:`~accordion.compress.quantize.BLOCK` elements), and so is the wire
format but for the codes: a block ``x`` sends its RMS rounded up to fp16 and, per element,
the code ``c = clamp(floor(x / d), -2**(bits-1), 2**(bits-1) - 1) + 2**(bits-1)`` for the
step ``d = STEPS[bits] * s``, decoded as ``(c - 2**(bits-1) + 1/2) d``. Codes are packed
``bits`` at a time into whole bytes per tensor (:func:`pack_codes`, 3 bits too), so that
a tensor of ``n`` elements sends ``ceil(n * bits / 8)`` bytes and 2 bytes per block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from .base import register
from .quantize import (
    BLOCK,
    IntQuantizer,
    _blocked,
    _round_up_to_fp16,
    _unblocked,
    block_layout,
    wide_dtype,
)

#: Max's optimal step of a uniform quantiser with ``2**bits`` levels for a unit
#: Gaussian (J. Max, "Quantizing for minimum distortion", 1960, Table II), per bit width.
STEPS = {4: 0.3352, 3: 0.5860, 2: 0.9957, 1: 1.5958}
#: Max's mean squared error of that quantiser for a unit Gaussian, clipping included.
MSE = {4: 0.01154, 3: 0.03744, 2: 0.1188, 1: 0.3634}
#: The bit widths (levels), mildest first.
BITS = (4, 3, 2, 1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in ``[0, 2**bits)`` (any integer dtype, flat) packed ``bits`` at a time into
    ``ceil(n * bits / 8)`` bytes (``uint8``): code ``j``'s bit ``k`` is bit ``j * bits +
    k`` of the stream, the lowest bit of a byte first."""
    shifts = torch.arange(bits, device=codes.device)
    stream = ((codes.reshape(-1, 1).to(torch.int16) >> shifts) & 1).reshape(-1)
    pad = -stream.numel() % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = 2 ** torch.arange(8, device=codes.device, dtype=torch.int16)
    return (stream.view(-1, 8) * weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The ``numel`` codes (``int16``) that :func:`pack_codes` packed into the last
    dimension of ``packed``: ``[..., numel]``."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., : numel * bits]
    weights = 2 ** torch.arange(bits, device=packed.device, dtype=torch.int16)
    return (stream.view(*stream.shape[:-1], numel, bits).to(torch.int16) * weights).sum(-1)


def rms_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (``int16``, flat, in ``[0, 2**bits)``) and the fp16 scales (each
    block's RMS rounded up to fp16; 0 for a block of zeros) that send ``x``."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    blocks = _blocked(x.detach().reshape(-1).to(dtype), x.shape)
    # padding zeros are not the block's: mean over its real elements only
    count = torch.full((blocks.shape[-2], 1), BLOCK, dtype=dtype, device=x.device)
    if count.numel():
        count[-1] = block_layout(x.shape)[1] - (count.numel() - 1) * BLOCK  # a row's last
    rms = (blocks.square().sum(-1, keepdim=True) / count).sqrt_()
    scales = _round_up_to_fp16(rms)
    step = scales.to(dtype) * STEPS[bits]
    half = 2 ** (bits - 1)
    steps = torch.where(step > 0, blocks / step, 0.0).floor_().clamp_(-half, half - 1)
    return _unblocked((steps + half).to(torch.int16), x.shape), scales.reshape(-1)


def rms_dequantize(codes: torch.Tensor, scales: torch.Tensor, shape: Sequence[int],
                   bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """``(code - 2**(bits-1) + 1/2) * STEPS[bits] * scale`` in ``dtype``: codes ``[...,
    numel]`` and scales ``[..., blocks]`` of a tensor of ``shape``, flat."""
    levels = codes.to(dtype) - (2 ** (bits - 1) - 0.5)
    blocks = _blocked(levels, shape)
    step = scales.to(dtype).view(*blocks.shape[:-1], 1) * STEPS[bits]
    return _unblocked(blocks * step, shape)


@register
class NormalQuantizer(IntQuantizer):
    """RMS-scaled quantisation at 4, 3, 2 or 1 bits per element (see the module).

    The exchange (in two phases or one all-gather), the residual (the local quantisation
    error, clipping included), the bytes and the average (bitwise the same on every rank)
    are the integer quantiser's; only the grid differs.

    Args:
        bits: default level, 4, 3, 2 or 1 bits per element.
        collective: ``"auto"`` (default), ``"all_gather"`` or ``"two_phase"`` (see
            :class:`~accordion.compress.quantize.IntQuantizer`).
    """

    name = "nq"
    default_levels = (3, 2)
    level_help = "a bit width: 4, 3, 2 or 1"
    level_type = int
    title = "RMS-scaled quantisation"
    bit_widths: ClassVar[tuple[int, ...]] = BITS

    def __init__(self, bits: int = 3, collective: str = "auto"):
        super().__init__(bits, collective)

    @classmethod
    def label(cls, level: Any) -> str:
        return f"nq{cls.check_level(level)}"

    @classmethod
    def error_factor(cls, bits: int) -> float:
        """Max's mean squared error of the grid for a unit Gaussian (:data:`MSE`): the
        expected square of an element's error (clipping included) over its block's RMS."""
        return MSE[bits]

    @classmethod
    def encode(cls, m: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed codes (``ceil(numel * bits / 8)`` bytes) and fp16 scales that send
        ``m``; ``m`` becomes its residual (in place)."""
        codes, scales = rms_quantize(m, bits)
        sent = rms_dequantize(codes, scales, m.shape, bits, wide_dtype(m.dtype))
        m.sub_(sent.view(m.shape))
        return pack_codes(codes, bits), scales

    @classmethod
    def decode(cls, packed: torch.Tensor, scales: torch.Tensor, shape: Sequence[int],
               bits: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        """Each worker's tensor, ``[W, numel]`` in ``dtype``, from its row of the payload."""
        codes = unpack_codes(packed, bits, math.prod(shape))
        return rms_dequantize(codes, scales, shape, bits, dtype)
