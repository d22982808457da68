"""Parts shared by the two-phase exchange's tests: a lossless codec and the int8 error bound."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: fp16's relative rounding step: a scale rounded up to fp16 is at most this much larger.
HALF_EPS = 2.0**-10


class IdentityCodec:
    """A lossless :class:`~accordion.compress.two_phase.BlockCodec`: the "packed codes" are
    the fp32 values' own bytes (so ``bits`` must be 32), every scale is 1 and the residual
    is 0. Through it the two-phase exchange must give a dense average."""

    block = 64
    scale_dtype = torch.float16

    @classmethod
    def encode(cls, m: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert bits == 32, bits
        packed = m.detach().float().reshape(-1).view(torch.uint8).clone()
        rows = m.shape[0] if m.dim() > 1 else 1
        scales = torch.ones(rows * -(-(m.numel() // rows) // cls.block), dtype=cls.scale_dtype)
        m.zero_()  # everything was sent
        return packed, scales

    @classmethod
    def decode(cls, packed: torch.Tensor, scales: torch.Tensor, shape: Sequence[int],
               bits: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        rows = packed.shape[0]
        return packed.contiguous().view(torch.float32).view(rows, math.prod(shape)).to(dtype)

    @classmethod
    def error_factor(cls, bits: int) -> float:
        return 0.0


def int8_bound(inputs: Sequence[torch.Tensor], block: int = 64) -> torch.Tensor:
    """Per element of the workers' flat ``inputs``, the most a two-phase int8 average may be
    off the true mean: half a first-phase step (each worker's block scale is at most
    ``max |x| / 127`` of its block, rounded up to fp16) plus half a second-phase step (the
    average's block is at most as large), from the largest magnitude of the element's
    block over the workers ``M``: ``M / 127``, with fp16's rounding up twice."""
    stacked = torch.stack([x.reshape(-1).float() for x in inputs])
    n = stacked.shape[1]
    padded = torch.nn.functional.pad(stacked.abs(), (0, -n % block))
    per_block = padded.view(len(inputs), -1, block).amax(dim=(0, 2))
    half_step = per_block / 127 / 2 * (1 + HALF_EPS) ** 2
    return (2 * half_step).repeat_interleave(block)[:n]
