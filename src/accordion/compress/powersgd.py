"""PowerSGD (Vogels et al., 2019): rank-r factors, batched by shape, warm-started."""

from __future__ import annotations

import math
import zlib
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .._validate import check_int
from .base import RANK_CHANGE_POLICIES, Compressor, Result, register
from .cost import check_shape
from .transport import AllReduce, Exchange
from .wire import Message

#: The largest PowerSGD rank accepted. A rank ``r`` sends less than dense for an ``n x m``
#: matrix only if ``r < n m / (n + m)``, which is below ``min(n, m)``: a rank above 2**16
#: compresses only matrices with both sides above 65536 (over 2**32 entries). Anything
#: larger (``mild=10**9``) is a mistake, refused before it sends more than dense.
MAX_RANK = 2**16


def check_rank(rank: Any) -> int:
    """Validate a PowerSGD rank (an int in [1, ``MAX_RANK``], not a bool) and return it."""
    rank = check_int("rank", rank, 1)
    if rank > MAX_RANK:
        raise ValueError(
            f"rank must be an int >= 1 and <= {MAX_RANK} (a larger rank compresses no "
            f"tensor of under 2**32 entries: it sends more than dense), got {rank!r}"
        )
    return rank


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

    A tensor for which its rank sends at least as much as dense (``(n + m) r' >= n m``,
    e.g. a 3 x 64 matrix at rank 8: 201 floats against 192) is averaged dense by the
    :class:`Reducer` while it stays at that rank (:meth:`Compressor.pays`).

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
    level_help = f"an integer rank >= 1 (and <= {MAX_RANK})"
    STATE_KEYS = Compressor.STATE_KEYS | {"seed", "q", "q_level"}
    OPTIONAL_STATE_KEYS = frozenset({"on_rank_change"})  # absent in older checkpoints
    level_type = int
    title = "PowerSGD"
    RANK_CHANGE_POLICIES = RANK_CHANGE_POLICIES  # the shared option's values, kept here too

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
    def _construct(cls, level: Any, options: Mapping[str, Any]) -> PowerSGD:
        """Two shared options, ``seed`` and ``on_rank_change``, go to the constructor
        (``collective`` is a quantiser's: factors are always all-reduced)."""
        mine = {k: v for k, v in options.items() if k in ("seed", "on_rank_change")}
        return cls(**mine) if level is None else cls(level, **mine)

    @classmethod
    def check_level(cls, level: Any) -> int:
        """A rank: an int >= 1."""
        return check_rank(level)

    @classmethod
    def label(cls, level: Any) -> str:
        return f"rank {level}"

    @classmethod
    def level_warning(cls, shapes: Sequence[tuple[int, ...]], level: Any) -> str | None:
        """A warning when rank ``level`` sends at least as much as dense (``(n + m) r' >=
        n m``, see :meth:`pays`) for every one of ``shapes``: every tensor goes dense at
        that rank, so it compresses nothing."""
        rank = check_rank(level)
        shapes = [s for s in shapes if cls.applies_to(s)]
        if not shapes or any(cls.pays(s, rank) for s in shapes):
            return None
        widest = max(min(matrix_shape(s)) for s in shapes)
        return (
            f"PowerSGD rank {rank} sends at least as much as dense for every compressed "
            f"tensor of this model (their largest smaller side is {widest}; a rank r saves "
            "only while r < n m / (n + m)): choose a lower rank"
        )

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
        return self._warm(self._q.get(key), key, self.initial_q(key, m, r, dtype, device))

    def _warm(self, stored: torch.Tensor | None, key: Hashable, seed: torch.Tensor):
        """The factor to start from: ``stored`` (cut, or extended with ``seed``'s columns,
        after a rank change, as ``on_rank_change`` says) or ``seed`` (whose shape, dtype
        and device it must have)."""
        size, r = seed.shape
        if stored is None or stored.shape[0] != size or stored.dtype != seed.dtype \
                or stored.device != seed.device:  # fmt: skip
            return seed
        if self._q_level.get(key) == self.level(key) and stored.shape[1] == r:
            return stored
        if self.on_rank_change == "redraw":
            return seed
        if stored.shape[1] >= r:  # shrink: the leading columns are the best-converged directions
            return stored[:, :r]
        return torch.cat([stored, seed[:, stored.shape[1] :]], dim=1)

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
        tables: tuple[dict[Hashable, Any], ...] = (self._q, self._q_level)
        for table in tables:
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
        """Restore a :meth:`state_dict`: everything is checked (``ValueError`` naming the
        bad entry) before anything changes."""
        default, levels = self._checked_levels(state)
        seed = state["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"compressor seed must be an int, got {seed!r}")
        on_rank_change = state.get("on_rank_change", self.on_rank_change)
        if on_rank_change not in self.RANK_CHANGE_POLICIES:
            raise ValueError(f"compressor on_rank_change must be one of "
                             f"{self.RANK_CHANGE_POLICIES}, got {on_rank_change!r}")  # fmt: skip
        q, q_level = _loaded_factors(state["q"], state["q_level"])
        self.default_level, self._levels = default, levels
        self.seed, self.on_rank_change = seed, on_rank_change
        self._q, self._q_level = q, q_level
        self._seed_q.clear()

    def check_shapes(self, shapes: Mapping[Hashable, Sequence[int]]) -> None:
        """Also raise ``ValueError`` unless each warm-start Q is ``m x r'`` for its tensor
        (``r'`` the effective rank at the level Q was made at)."""
        super().check_shapes(shapes)
        check_factor_shapes(self, "q", self._q, shapes, side=1)


def check_factor_shapes(compressor: PowerSGD, name: str, factors, shapes, side: int) -> None:
    """Raise ``ValueError`` unless each of ``factors`` (key -> factor, kept at the rank of
    ``compressor._q_level``) is ``size x r'`` for its tensor of ``shapes``, ``size`` the
    matrix view's rows (``side=0``) or columns (``side=1``)."""
    for key, factor in factors.items():
        shape = shapes.get(key)
        if shape is None or not compressor.applies_to(shape):
            raise ValueError(
                f"compressor {name}[{key!r}] is for no tensor {compressor.title} compresses"
            )
        level = compressor._q_level[key]
        expected = (matrix_shape(shape)[side], powersgd_rank(shape, level))
        if tuple(factor.shape) != expected:
            raise ValueError(
                f"compressor {name}[{key!r}] has shape {tuple(factor.shape)}, but a tensor of "
                f"shape {tuple(shape)} at rank {level} needs {expected}"
            )


def _loaded_factors(q: Any, q_level: Any) -> tuple[dict[Hashable, torch.Tensor], dict]:
    """A checkpoint's warm-start factors, checked and cloned: finite floating-point
    matrices, each with the rank it was made at (``check_shapes`` checks their shapes)."""
    if not isinstance(q, Mapping) or not isinstance(q_level, Mapping):
        raise ValueError("compressor q and q_level must be Mappings keyed by tensor")
    if set(q) != set(q_level):
        raise ValueError(
            f"compressor q and q_level must have the same keys, got {sorted(q, key=repr)} "
            f"and {sorted(q_level, key=repr)}"
        )
    levels = {}
    for key, factor in q.items():
        if not (isinstance(factor, torch.Tensor) and factor.is_floating_point()
                and factor.dim() == 2):  # fmt: skip
            raise ValueError(f"compressor q[{key!r}] must be a 2-D floating-point tensor")
        if not bool(torch.isfinite(factor).all()):  # PowerSGD never keeps a non-finite Q
            raise ValueError(f"compressor q[{key!r}] holds an inf or NaN")
        try:
            levels[key] = check_rank(q_level[key])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"compressor q_level[{key!r}]: {exc}") from None
    return {k: f.clone() for k, f in q.items()}, levels
