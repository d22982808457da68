"""PowerSGD (Vogels et al., 2019): rank-r factors, batched by shape, warm-started."""

from __future__ import annotations

import math
import zlib
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .._validate import check_int
from .base import Compressor, Result, check_shape, register
from .transport import AllReduce, Exchange
from .wire import Message


def check_rank(rank: Any) -> int:
    """Validate a PowerSGD rank (an int >= 1, not a bool) and return it as an int."""
    return check_int("rank", rank, 1)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The ``(n, m)`` matrix view PowerSGD uses: ``n = shape[0]``, ``m = numel / n``."""
    dims = check_shape(shape)
    if len(dims) < 2:
        raise ValueError(f"a matrix view needs a tensor with >= 2 dimensions, got shape {dims}")
    n = dims[0]
    return n, (math.prod(dims) // n if n else 0)


def powersgd_rank(shape: Sequence[int], rank: int) -> int:
    """The effective PowerSGD rank ``r' = min(n, m, rank)`` for a tensor of this shape."""
    n, m = matrix_shape(shape)
    return min(n, m, rank)


def orthogonalize_(p: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of each matrix in ``p`` (``[batch, n, r]``), in place.

    A zero column stays zero instead of becoming NaN. Half-precision inputs are
    orthogonalised in fp32, whose range the squared norms need.
    """
    work = p.float() if p.dtype in (torch.float16, torch.bfloat16) else p
    tiny = torch.finfo(work.dtype).tiny
    for i in range(work.shape[-1]):
        col = work[..., i : i + 1]
        col.div_(torch.linalg.vector_norm(col, dim=-2, keepdim=True).clamp_min(tiny))
        if i + 1 < work.shape[-1]:
            rest = work[..., i + 1 :]
            rest.sub_(col @ (col.transpose(-1, -2) @ rest))
    if work is not p:
        p.copy_(work)
    return p


def _batched(tensors: Sequence[torch.Tensor], n: int, m: int) -> torch.Tensor:
    """``tensors`` as one ``[b, n, m]`` batch: a view when they lie side by side in one
    buffer (as the Reducer lays them out), else a stacked copy."""
    first = tensors[0]
    step = n * m * first.element_size()
    adjacent = all(
        t.is_contiguous()
        and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and t.data_ptr() == first.data_ptr() + j * step
        for j, t in enumerate(tensors)
    )
    if adjacent:
        return first.as_strided((len(tensors), n, m), (n * m, m, 1))
    return torch.stack([t.reshape(n, m) for t in tensors])


def _stable_seed(seed: int, key: Hashable) -> int:
    # Python's hash() of a str differs between processes; crc32 of the repr does not.
    return (seed * 1_000_003 + zlib.crc32(repr(key).encode())) % (2**63 - 1)


@register
class PowerSGD(Compressor):
    """Rank-``r`` PowerSGD (Vogels et al., 2019) with one warm-started power iteration.

    Each tensor is viewed as an ``n x m`` matrix ``M`` (``n = shape[0]``) and sent as
    factors of rank ``r' = min(n, m, rank)``: ``P = M Q``, all-reduce P (sum),
    orthogonalise, ``Q = M^T P``, all-reduce Q and divide by the world size; the average
    is ``P Q^T`` and the residual ``M - P Q^T``. ``Q`` is warm-started from the previous
    step and initially drawn from ``seed`` and the tensor's key, identically on every
    worker (P is summed, so Q must agree everywhere). Tensors with the same ``(n, m, r')``
    go through one batched matmul, and all P (then all Q) factors of a call travel in one
    all-reduce. A rank change rebuilds Q as ``on_rank_change`` says; the error-feedback
    memory is kept. A Q column that became exactly zero (a zero
    gradient) is redrawn too, so that compression does not stall at zero forever.

    Args:
        rank: default rank, an int >= 1.
        seed: seed shared by all workers for the initial Q factors.
        on_rank_change: what a rank change does to the warm-start Q. ``"reuse"`` (the
            default): keep the leading columns when the rank shrinks, append fresh
            shared-seed columns when it grows. ``"redraw"`` (the paper's scripts): draw a
            new Q from the shared seed. Reusing gives a better first step after a switch
            (see ``benchmarks/switch_transient/RESULTS.md``).
    """

    name = "powersgd"
    default_levels = (2, 1)
    level_help = "an integer rank >= 1"
    level_type = int
    title = "PowerSGD"
    RANK_CHANGE_POLICIES = ("redraw", "reuse")

    def __init__(self, rank: int = 2, seed: int = 0, on_rank_change: str = "reuse"):
        super().__init__(rank)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if on_rank_change not in self.RANK_CHANGE_POLICIES:
            raise ValueError(
                f"on_rank_change must be one of {self.RANK_CHANGE_POLICIES}, got {on_rank_change!r}"
            )
        self.seed = seed
        self.on_rank_change = on_rank_change
        self._q: dict[Hashable, torch.Tensor] = {}
        self._q_level: dict[Hashable, int] = {}
        self._seed_q: dict[tuple[Hashable, int, int, torch.dtype, torch.device], torch.Tensor] = {}

    @classmethod
    def check_level(cls, level: Any) -> int:
        """A rank: an int >= 1."""
        return check_rank(level)

    @classmethod
    def label(cls, level: Any) -> str:
        return f"rank {level}"

    @classmethod
    def aggressiveness(cls, level: Any) -> float:
        return -float(check_rank(level))  # a lower rank sends less

    @classmethod
    def paper_floats(cls, shape: tuple[int, ...], level: Any, world_size: int) -> int:
        """``(n + m) r'``: the P and Q factors."""
        n, m = matrix_shape(shape)
        return (n + m) * powersgd_rank(shape, check_rank(level))

    @classmethod
    def messages(cls, shape: tuple[int, ...], level: Any, element_size: int) -> list[Message]:
        """P (``n r'``) in one all-reduce, then Q (``m r'``) in another."""
        n, m = matrix_shape(shape)
        r = powersgd_rank(shape, check_rank(level))
        return [Message("allreduce", "P", n * r * element_size),
                Message("allreduce", "Q", m * r * element_size)]  # fmt: skip

    def initial_q(
        self, key: Hashable, m: int, r: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The shared-seed ``m x r`` starting factor of ``key`` (same on every worker).

        Drawn one column at a time, so the first columns do not depend on ``r``.
        """
        cache_key = (key, m, r, dtype, device)
        q = self._seed_q.get(cache_key)
        if q is None:
            gen = torch.Generator().manual_seed(_stable_seed(self.seed, key))
            columns = [torch.randn(m, generator=gen) for _ in range(r)]
            q = torch.stack(columns, dim=1).to(device=device, dtype=dtype)
            self._seed_q[cache_key] = q
        return q

    def _start_q(self, key: Hashable, m: int, r: int, dtype, device) -> torch.Tensor:
        q = self._q.get(key)
        if q is None or q.shape[0] != m or q.dtype != dtype or q.device != device:
            return self.initial_q(key, m, r, dtype, device)
        if self._q_level.get(key) == self.level(key) and q.shape[1] == r:
            return q
        if self.on_rank_change == "redraw":
            return self.initial_q(key, m, r, dtype, device)
        if q.shape[1] >= r:  # shrink: the leading columns are the best-converged directions
            return q[:, :r]
        fresh = self.initial_q(key, m, r, dtype, device)[:, q.shape[1] :]
        return torch.cat([q, fresh], dim=1)

    def exchange(
        self,
        keys: Sequence[Hashable],
        tensors: Sequence[torch.Tensor],
        world_size: int,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Exchange[Result]:
        if not tensors:
            return []
        p_flat, q_flat, plan = self._project(keys, tensors)
        yield [AllReduce(p_flat)]
        for _, mb, p, q in plan:
            orthogonalize_(p.transpose(1, 2))
            torch.bmm(p, mb, out=q)  # Q^T = P^T M

        yield [AllReduce(q_flat)]
        q_flat.div_(world_size)
        return self._reconstruct(keys, tensors, plan, out)

    def _project(self, keys: Sequence[Hashable], tensors: Sequence[torch.Tensor]):
        """Group the tensors by ``(n, m, r')`` and compute every ``P^T = Q^T M^T`` into one
        flat buffer; returns it, the flat buffer for Q and the plan per group."""
        dtype, device = tensors[0].dtype, tensors[0].device
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, (key, t) in enumerate(zip(keys, tensors)):
            n, m = matrix_shape(t.shape)
            groups.setdefault((n, m, powersgd_rank(t.shape, self.level(key))), []).append(i)
        p_flat = torch.empty(
            sum(len(ix) * n * r for (n, _, r), ix in groups.items()), dtype=dtype, device=device
        )
        q_flat = torch.empty(
            sum(len(ix) * m * r for (_, m, r), ix in groups.items()), dtype=dtype, device=device
        )
        plan = []
        p_off = q_off = 0
        for (n, m, r), ix in groups.items():
            b = len(ix)
            mb = _batched([tensors[i] for i in ix], n, m)
            # Factors are kept transposed (P^T is r x n, Q^T is r x m): with r much smaller
            # than n and m, products shaped (r x n)(n x m) run ~9x faster on CPU than
            # (n x m)(m x r), which is a skinny matrix-vector-like product.
            qt_prev = torch.stack([self._start_q(keys[i], m, r, dtype, device).t() for i in ix])
            seeds = torch.stack([self.initial_q(keys[i], m, r, dtype, device).t() for i in ix])
            # A Q column that collapsed to zero would keep P at zero forever: restart it.
            alive = torch.linalg.vector_norm(qt_prev, dim=2, keepdim=True) > 0
            qt_prev = torch.where(alive, qt_prev, seeds)
            p = p_flat[p_off : p_off + b * n * r].view(b, r, n)  # P^T
            q = q_flat[q_off : q_off + b * m * r].view(b, r, m)  # Q^T
            torch.bmm(qt_prev, mb.transpose(1, 2), out=p)  # P^T = Q^T M^T
            plan.append((ix, mb, p, q))
            p_off += b * n * r
            q_off += b * m * r
        return p_flat, q_flat, plan

    def _reconstruct(self, keys, tensors, plan, out) -> Result:
        """The averages ``P Q^T`` (into ``out`` when given), the residuals ``M - P Q^T`` in
        place of the inputs, and the new warm-start Q of every key."""
        results: Result = [None] * len(tensors)  # type: ignore[list-item]
        for ix, mb, p, q in plan:
            n, m = mb.shape[1:]
            if out is None:
                approx = torch.bmm(p.transpose(1, 2), q)  # P Q^T
                mb.sub_(approx)  # the inputs are ours: M becomes the residual in place
                averages = [approx[j] for j in range(len(ix))]
            else:  # P Q^T straight into the caller's tensors: no temporary, no copy
                averages = []
                for j, i in enumerate(ix):
                    dest = out[i].view(n, m) if out[i].is_contiguous() else None
                    product = torch.mm(p[j].t(), q[j], out=dest)
                    if dest is None:
                        out[i].copy_(product.view(out[i].shape))
                    mb[j].sub_(product)
                    averages.append(out[i])
            for j, i in enumerate(ix):
                shape = tensors[i].shape
                results[i] = (averages[j].view(shape), mb[j].view(shape))
                self._q[keys[i]] = q[j].t()
                self._q_level[keys[i]] = self.level(keys[i])
        if out is not None:
            results = [(o, residual) for o, (_, residual) in zip(out, results)]
        return results

    def rename(self, old: Hashable, new: Hashable) -> None:
        super().rename(old, new)
        for table in (self._q, self._q_level):
            if old in table:
                table[new] = table.pop(old)

    def reset(self, keys: Iterable[Hashable]) -> None:
        """Drop the warm-start Q of ``keys``; the next exchange redraws it from the seed."""
        for key in keys:
            self._q.pop(key, None)
            self._q_level.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["seed"] = self.seed
        state["on_rank_change"] = self.on_rank_change
        state["q"] = {key: q.clone() for key, q in self._q.items()}
        state["q_level"] = dict(self._q_level)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.seed = int(state["seed"])
        self.on_rank_change = state.get("on_rank_change", self.on_rank_change)
        self._q = {key: q.clone() for key, q in state["q"].items()}
        self._q_level = {key: int(v) for key, v in state["q_level"].items()}
        self._seed_q.clear()
