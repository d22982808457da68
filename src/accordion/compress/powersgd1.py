"""PowerSGD in one round: both factors in a single all-reduce, each projected on the
other side's basis from the step before.

PowerSGD's P must be summed over the workers before ``Q = M^T P`` can be computed, so
every step pays two sequential all-reduce rounds. Where a round costs more than its
bytes (small models, many workers, a high-latency link), that second round is most of
the step's communication time. This compressor sends the same ``(n + m) r`` floats in
one round: with orthonormal bases ``P̂`` (``n x r``) and ``Q̂`` (``m x r``) from the
previous step, every worker sends ``M Q̂`` and ``P̂^T M`` together; their averages give

    M̂ = M Q̂ Q̂^T + P̂ P̂^T M - P̂ (P̂^T M Q̂) Q̂^T = M - (I - P̂ P̂^T) M (I - Q̂ Q̂^T),

the average projected on the span of both bases (rank up to ``2 r``), and the next
bases are ``orth(M Q̂)`` and ``orth(M^T P̂)``: two interleaved power iterations, each
advancing half a step per step. The approximation is an orthogonal projection, so the
residual kept by error feedback is never larger than the input. It is the idea of
ACP-SGD (Zhang et al., ICDCS 2023), which alternates P and Q steps to need one round,
sent here as both halves at once so that a step carries PowerSGD's bytes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .base import Result, register
from .powersgd import (
    PowerSGD,
    _batched,
    _loaded_factors,
    check_factor_shapes,
    check_rank,
    matrix_shape,
    orthogonalize_,
    powersgd_rank,
)
from .transport import AllReduce, Exchange
from .wire import Message


@register
class OneRoundPowerSGD(PowerSGD):
    """Rank-``r`` low-rank compression in one all-reduce round per step (see the module
    docstring): PowerSGD's bytes, ``(n + m) r'`` floats per tensor, in half its rounds.

    Levels, seeds and ``on_rank_change`` are PowerSGD's. Both warm-start bases are
    drawn from ``seed`` and the tensor's key, identically on every worker.
    """

    name = "powersgd1"
    title = "one-round PowerSGD"
    STATE_KEYS = PowerSGD.STATE_KEYS | {"p"}
    extra_collectives = 0  # its factors travel in the dense tensors' all-reduce
    #: Ranks below this lost accuracy against PowerSGD in our measurements: the stale
    #: bases lag behind what error feedback hands them (docs/hook.md).
    LOW_RANK = 4

    def __init__(self, rank: int = 2, seed: int = 0, on_rank_change: str = "reuse"):
        super().__init__(rank, seed, on_rank_change)
        self._p: dict[Hashable, torch.Tensor] = {}

    @classmethod
    def level_warning(cls, shapes: Sequence[tuple[int, ...]], level: Any) -> str | None:
        """PowerSGD's warning, or one for a rank below :attr:`LOW_RANK`."""
        message = super().level_warning(shapes, level)
        if message is None and level < cls.LOW_RANK:
            message = (
                f"one-round PowerSGD at rank {level} can lose accuracy against PowerSGD at "
                f"the same rank (its bases are a step stale; see docs/hook.md): prefer "
                f"rank >= {cls.LOW_RANK}, or compressor='powersgd'"
            )
        return message

    @classmethod
    def messages(cls, shape: tuple[int, ...], level: Any, element_size: int) -> list[Message]:
        """``M Q̂`` (``n r'``) and ``P̂^T M`` (``m r'``) in the bucket's one all-reduce,
        together with its dense tensors (a phase's all-reduces go out as one call)."""
        n, m = matrix_shape(shape)
        r = powersgd_rank(shape, check_rank(level))
        return [Message("allreduce", "dense", (n + m) * r * element_size)]

    def exchange(
        self,
        keys: Sequence[Hashable],
        tensors: Sequence[torch.Tensor],
        world_size: int,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Exchange[Result]:
        if not tensors:
            return []
        flat, plan = self._project_both(keys, tensors)
        yield [AllReduce(flat)]
        flat.div_(world_size)
        return self._reconstruct_both(keys, tensors, plan, out)

    def _basis(self, keys, ix, side: str, size: int, r: int, dtype, device) -> torch.Tensor:
        """The orthonormal bases (transposed, ``[b, r, size]``) of side ``"P"`` or ``"Q"``
        for the tensors ``ix``: last step's factors, or the shared seed's."""
        stored = self._p if side == "P" else self._q
        bases, seeds = [], []
        for i in ix:
            seed_key = keys[i] if side == "Q" else ("P", keys[i])  # P: its own seed stream
            seed = self.initial_q(seed_key, size, r, dtype, device)
            bases.append(self._warm(stored.get(keys[i]), keys[i], seed).t())
            seeds.append(seed.t())
        basis, seeds_t = torch.stack(bases), torch.stack(seeds)
        # A column that collapsed to zero (a zero gradient) would stay zero: restart it.
        alive = torch.linalg.vector_norm(basis, dim=2, keepdim=True) > 0
        basis = torch.where(alive, basis, seeds_t)
        return orthogonalize_(basis.transpose(1, 2)).transpose(1, 2)

    def _project_both(self, keys, tensors):
        """``(M Q̂)^T`` and ``P̂^T M`` of every tensor into one flat buffer, grouped by
        ``(n, m, r')``; returns it and the plan per group."""
        dtype, device = tensors[0].dtype, tensors[0].device
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, (key, t) in enumerate(zip(keys, tensors)):
            n, m = matrix_shape(t.shape)
            groups.setdefault((n, m, powersgd_rank(t.shape, self.level(key))), []).append(i)
        flat = torch.empty(
            sum(len(ix) * (n + m) * r for (n, m, r), ix in groups.items()),
            dtype=dtype, device=device,
        )  # fmt: skip
        plan, offset = [], 0
        for (n, m, r), ix in groups.items():
            b = len(ix)
            mb = _batched([tensors[i] for i in ix], n, m)
            qt = self._basis(keys, ix, "Q", m, r, dtype, device)  # Q̂^T, [b, r, m]
            pt = self._basis(keys, ix, "P", n, r, dtype, device)  # P̂^T, [b, r, n]
            a = flat[offset : offset + b * r * n].view(b, r, n)  # (M Q̂)^T
            offset += b * r * n
            c = flat[offset : offset + b * r * m].view(b, r, m)  # P̂^T M
            offset += b * r * m
            torch.bmm(qt, mb.transpose(1, 2), out=a)
            torch.bmm(pt, mb, out=c)
            plan.append((ix, mb, qt, pt, a, c))
        return flat, plan

    def _reconstruct_both(self, keys, tensors, plan, out) -> Result:
        """The averages ``M̂`` (into ``out`` when given), the residuals ``M - M̂`` in place
        of the inputs, and the next step's factors of every key."""
        results: Result = [None] * len(tensors)  # type: ignore[list-item]
        for ix, mb, qt, pt, a, c in plan:
            n, m = mb.shape[1:]
            # P̂^T M (I - Q̂ Q̂^T): the part of P̂^T M that M Q̂ Q̂^T does not hold already
            rest = c - torch.bmm(torch.bmm(c, qt.transpose(1, 2)), qt)
            for j, i in enumerate(ix):
                dest = out[i].view(n, m) if out is not None and out[i].is_contiguous() else None
                approx = torch.mm(a[j].t(), qt[j], out=dest)
                approx.addmm_(pt[j].t(), rest[j])
                if out is not None and dest is None:
                    out[i].copy_(approx.view(out[i].shape))
                mb[j].sub_(approx)  # the inputs are ours: M becomes the residual in place
                average = out[i] if out is not None else approx.view(tensors[i].shape)
                results[i] = (average, mb[j].view(tensors[i].shape))
                self._p[keys[i]] = a[j].t()  # next P̂ = orth(M Q̂), orthogonalised when used
                self._q[keys[i]] = c[j].t()  # next Q̂ = orth(M^T P̂)
                self._q_level[keys[i]] = self.level(keys[i])
        return results

    def rename(self, old: Hashable, new: Hashable) -> None:
        super().rename(old, new)
        if old in self._p:
            self._p[new] = self._p.pop(old)

    def reset(self, keys: Iterable[Hashable]) -> None:
        """Drop both bases of ``keys``; the next exchange redraws them from the seed."""
        keys = list(keys)
        super().reset(keys)
        for key in keys:
            self._p.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["p"] = {key: p.clone() for key, p in self._p.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`: everything is checked (``ValueError`` naming the
        bad entry) before anything changes."""
        p = state.get("p") if isinstance(state, Mapping) else None
        q_level = state.get("q_level") if isinstance(state, Mapping) else None
        checked = None
        if p is not None:
            if not isinstance(p, Mapping) or not isinstance(q_level, Mapping) \
                    or set(p) != set(q_level):  # fmt: skip
                raise ValueError("compressor p must be a Mapping with the keys of q_level")
            checked, _ = _loaded_factors(p, q_level)
        super().load_state_dict(state)  # checks the rest (and that "p" is there)
        self._p = checked if checked is not None else {}

    def check_shapes(self, shapes: Mapping[Hashable, Sequence[int]]) -> None:
        """Also raise ``ValueError`` unless each basis P is ``n x r'`` for its tensor."""
        super().check_shapes(shapes)
        check_factor_shapes(self, "p", self._p, shapes, side=0)
