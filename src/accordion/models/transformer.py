"""A GPT-2-style decoder-only transformer; by default about 1.0 B parameters.

Used by ``accordion plan --model transformer-1b`` to predict traffic at data-centre scale:
the plan reads only parameter shapes, so it builds the model on the ``meta`` device (no
memory). Pre-norm blocks of causal self-attention and a 4x MLP, learned positions, and an
output head tied to the token embedding (as GPT-2). The defaults, 18 layers of width 2048
over GPT-2's 50,257-token vocabulary and 2,048 positions, give 1,013,573,632 parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT2_VOCAB_SIZE", "TRANSFORMER_1B_PARAMETERS", "Block", "Transformer"]

GPT2_VOCAB_SIZE = 50257
"""Vocabulary of GPT-2's byte-pair encoding."""

TRANSFORMER_1B_PARAMETERS = 1_013_573_632
"""Parameters of :class:`Transformer` with its defaults: ``12 d^2 + 13 d`` per layer times
18 layers, ``vocab * d`` token and ``context * d`` position embeddings, a final norm."""


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model: int, heads: int) -> None:
        """A block of width ``d_model`` with ``heads`` heads (``heads`` divides ``d_model``)."""
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model must be a multiple of heads, got {d_model} and {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """Map ``[batch, seq, d_model]`` to the same shape (causal attention)."""
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Transformer(nn.Module):
    """GPT-2-style language model; the defaults give the 1.0 B-parameter ``transformer-1b``."""

    def __init__(
        self,
        vocab_size: int = GPT2_VOCAB_SIZE,
        d_model: int = 2048,
        layers: int = 18,
        heads: int = 16,
        context: int = 2048,
    ) -> None:
        """Build ``layers`` blocks of width ``d_model`` over ``vocab_size`` tokens and
        ``context`` positions; the output head shares the token embedding's weight."""
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)

    def forward(self, tokens: Tensor) -> Tensor:
        """Map tokens ``[batch, seq]`` (``seq <= context``) to logits ``[batch, seq, vocab]``."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln(x), self.token.weight)  # tied head: no parameters of its own
