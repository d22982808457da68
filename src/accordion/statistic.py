"""The statistic a rule decides from: whose gradient sums count, and how the ranks agree.

One class per kind, named as ``statistic=`` names it:

* :class:`Rank0Statistic` (``"rank0"``, the paper): every rank sums every layer, rank 0's
  norms are everyone's (one ``Broadcast``);
* :class:`MeanStatistic` (``"mean"``): every rank sums every layer, the norms are
  averaged over the ranks that have one (one ``AllReduce``);
* :class:`ShardedStatistic` (``"sharded"``, the default): each layer is summed on one
  rank only (:func:`~accordion.statistics.shard_owners`), whose norms everyone gets (one
  ``AllReduce``, the other ranks adding 0);
* :class:`ShardCombined`: FSDP's, the norms of each rank's shard of a parameter
  combined into the whole parameter's over the shard group.

A statistic gathers with :meth:`Statistic.observe` and agrees with
:meth:`Statistic.agreement`, an exchange of phases (``accordion.compress.transport``),
so that the agreement runs on real process groups and on ``SimulatedTransport`` alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._validate import check_choice
from .compress import AllReduce, Broadcast, Exchange, Reducer
from .statistics import GradientSums, shard_owners

#: The statistics by name, as ``statistic=`` and checkpoints name them.
STATISTICS = ("rank0", "mean", "sharded")

#: Agreed norms: per layer its gradient norm, and its memory norm when asked for.
Norms = tuple[dict[str, float], dict[str, float]]


@dataclass(frozen=True)
class Layers:
    """What a statistic is told of the layers at a call.

    Attributes:
        shapes: every bound parameter's shape, in binding order (the same on every rank).
        reducer: says which gradients have a level (``compresses``), which shapes the
            compressor applies to, which keys go dense and what each memory owes.
        complete: whether every layer is known (a module is bound, or a step ended);
            until then a sharded statistic cannot deal the layers out.
    """

    shapes: Mapping[str, tuple[int, ...]]
    reducer: Reducer
    complete: bool = True

    def compressed(self) -> list[str]:
        """Keys that have a level: the compressor applies to them and they are not in
        ``dense_keys`` (the rule decides their rung)."""
        applies, dense = self.reducer.compressor.applies_to, self.reducer.dense_keys
        return [k for k, s in self.shapes.items() if applies(s) and k not in dense]

    def levels(self) -> dict[str, Any]:
        """Per key the compressor applies to, its level at the next step (``None`` for
        those sent dense)."""
        comp, dense = self.reducer.compressor, self.reducer.dense_keys
        return {k: None if k in dense else comp.level(k)
                for k, s in self.shapes.items() if comp.applies_to(s)}  # fmt: skip


class Statistic:
    """The paper's gradient sums of this rank (:attr:`sums`) and the ranks' agreement on
    their norms. Subclasses say whose sums count (:meth:`observe`) and how the ranks
    agree (:meth:`agreement`)."""

    # class attributes, not ClassVar: ShardCombined takes its inner statistic's per instance
    #: The name ``statistic=`` and checkpoints give it.
    name: str = "statistic"
    #: Where a layer's statistic comes from, in words (for warnings).
    source: str = "this rank"

    def __init__(self) -> None:
        #: This rank's gradient sums since the last check.
        self.sums = GradientSums()

    def observe(self, keys: Sequence[str], grads: Sequence[torch.Tensor], layers: Layers,
                world_size: int, rank: int) -> None:  # fmt: skip
        """Add to the sums the gradients of ``keys`` that have a level."""
        compresses = layers.reducer.compresses
        for key, grad in zip(keys, grads):
            if compresses(grad, key):
                self.sums.add(key, grad)

    def agreement(self, layers: Layers, world_size: int, rank: int, with_memory: bool = False,
                  device: torch.device | None = None) -> Exchange[Norms]:  # fmt: skip
        """The exchange that agrees the norms of the sums (and of the memories, with
        ``with_memory``) over ``world_size`` ranks; this rank is ``rank``. A layer whose
        every gradient of the period was left out (non-finite) has a NaN norm."""
        keys = self.sums.keys_in(layers.shapes)
        if not keys:
            return {}, {}
        grads = self.sums.norms(keys)
        valid = torch.stack(self.sums.valid(keys)).double()
        norms = torch.stack(grads).double()
        mean = self._averaged(world_size)
        # averaged, a rank without a statistic adds 0 and is not counted
        norms = norms * valid if mean else norms.masked_fill(valid == 0, math.nan)
        parts = [norms, valid]
        if with_memory:
            memory = layers.reducer.memory
            parts.append(torch.stack([_norm(memory.get(k), grads[0]) for k in keys]).double())
        values = torch.cat(parts)
        if world_size > 1:
            yield [self._collective(values)]
        n = len(keys)
        if mean:
            values[:n] /= values[n : 2 * n]  # 0 / 0 = NaN: no rank has a statistic
            values[2 * n :] /= world_size
        flat = values.tolist()
        return dict(zip(keys, flat[:n])), dict(zip(keys, flat[2 * n :])) if with_memory else {}

    def agree(self, transport: Any, layers: Layers, with_memory: bool = False,
              device: torch.device | None = None) -> Norms:  # fmt: skip
        """:meth:`agreement` run on ``transport``, whose world size and rank it uses."""
        exchange = self.agreement(layers, transport.world_size, transport.rank, with_memory,
                                  device)  # fmt: skip
        return transport.run(exchange)

    def rename(self, renamed: Mapping[str, str]) -> None:
        """Move the sums of lazily named keys to their names (``{old: new}``)."""
        for old, new in renamed.items():
            self.sums.rename(old, new)

    def forget(self, key: str) -> None:
        """Drop ``key``'s sum (a layer sent dense has no level to decide)."""
        self.sums.forget(key)

    def restart(self, sums: GradientSums) -> None:
        """Go on from ``sums`` (a loaded checkpoint's)."""
        self.sums = sums

    def _averaged(self, world_size: int) -> bool:
        """Whether the agreed norms are the mean over the ranks (else one rank's)."""
        return False

    def _collective(self, values: torch.Tensor):
        """The collective that makes ``values`` everyone's."""
        raise NotImplementedError


class Rank0Statistic(Statistic):
    """The paper's statistic: rank 0's sums decide every layer (every rank keeps a
    model-size sum)."""

    name = "rank0"
    source = "rank 0"

    def _collective(self, values: torch.Tensor):
        return Broadcast(values, 0)


class MeanStatistic(Statistic):
    """The statistics averaged over the ranks that have one."""

    name = "mean"
    source = "every rank"

    def _averaged(self, world_size: int) -> bool:
        return world_size > 1

    def _collective(self, values: torch.Tensor):
        return AllReduce(values)


class ShardedStatistic(Rank0Statistic):
    """Each layer's statistic is one rank's, as in the paper, but the layers are dealt
    out over the ranks (:func:`~accordion.statistics.shard_owners`), so that each keeps
    about ``1 / world_size`` of the sums. With one rank it is rank 0's."""

    name = "sharded"
    source = "the rank that sums it"

    def __init__(self) -> None:
        super().__init__()
        self._owners: dict[str, int] | None = None  # which rank sums each layer

    def owners(self, layers: Layers, world_size: int, rank: int,
               check: bool = False) -> dict[str, int] | None:  # fmt: skip
        """The rank that sums each layer the compressor applies to; ``None`` with one
        rank, or while the layers are not all known (``layers.complete``: until then
        every rank sums every layer) unless at a ``check``, where the layers seen are all
        there are. Dealing them out drops the sums this rank does not own."""
        if world_size == 1:
            return None
        if self._owners is None:
            if not layers.complete and not check:
                return None
            applies = layers.reducer.compressor.applies_to
            shapes = {k: s for k, s in layers.shapes.items() if applies(s)}
            self._owners = shard_owners(shapes, world_size)
            for key in self.sums.keys_in(layers.shapes):
                if self._owners.get(key, rank) != rank:
                    self.sums.forget(key)  # summed before the layers were dealt out
        return self._owners

    def observe(self, keys: Sequence[str], grads: Sequence[torch.Tensor], layers: Layers,
                world_size: int, rank: int) -> None:  # fmt: skip
        """Add to the sums the gradients of ``keys`` that have a level and that this rank
        owns (every one, while the layers are not dealt out)."""
        owners = self.owners(layers, world_size, rank)
        if owners is None:
            return super().observe(keys, grads, layers, world_size, rank)
        compresses = layers.reducer.compresses
        for key, grad in zip(keys, grads):
            if compresses(grad, key) and owners.get(key, rank) == rank:
                self.sums.add(key, grad)

    def agreement(self, layers: Layers, world_size: int, rank: int, with_memory: bool = False,
                  device: torch.device | None = None) -> Exchange[Norms]:  # fmt: skip
        """Each layer's norms from the rank that sums it, the others adding 0, in one
        all-reduce. A layer no rank has a sum of (no gradient yet) is left out; one whose
        owner skipped every gradient of the period has a NaN norm."""
        owners = self.owners(layers, world_size, rank, check=True)
        if owners is None:
            return (yield from super().agreement(layers, world_size, rank, with_memory, device))
        keys = [k for k in layers.compressed() if k in owners]
        if not keys:
            return {}, {}
        n = len(keys)
        values = torch.zeros((4 if with_memory else 3) * n, dtype=torch.float64, device=device)
        mine = [i for i, k in enumerate(keys) if owners[k] == rank and k in self.sums]
        if mine:
            ix = torch.tensor(mine, device=device)
            mine_keys = [keys[i] for i in mine]
            valid = torch.stack(self.sums.valid(mine_keys)).double()
            norms = torch.stack(self.sums.norms(mine_keys)).double()
            values[ix] = norms.masked_fill(valid == 0, 0.0)
            values[ix + n], values[ix + 2 * n] = valid, 1.0
            if with_memory:
                like, memory = norms[0], layers.reducer.memory
                values[ix + 3 * n] = torch.stack([_norm(memory.get(k), like) for k in mine_keys])
        yield [AllReduce(values)]
        flat = values.tolist()
        present = [i for i in range(n) if flat[2 * n + i]]
        grad_norms = {keys[i]: flat[i] if flat[n + i] else math.nan for i in present}
        if not with_memory:
            return grad_norms, {}
        return grad_norms, {keys[i]: flat[3 * n + i] for i in present}

    def rename(self, renamed: Mapping[str, str]) -> None:
        """Move the sums to their names, and deal the layers out again over them."""
        super().rename(renamed)
        if renamed:
            self._owners = None

    def restart(self, sums: GradientSums) -> None:
        """Go on from ``sums``, dealt out again (dropping the sums this rank does not own)."""
        super().restart(sums)
        self._owners = None


class ShardCombined(Statistic):
    """FSDP's statistic: ``inner``'s agreement over the replicas of each shard, then each
    parameter's norm combined from its shards' over ``shards`` (the transport of the
    shard group): the square root of the sum of the shards' squares, so that every rank
    decides from the whole parameter's norm, as under DDP.

    Its name, source and sums are ``inner``'s.
    """

    def __init__(self, inner: Statistic, shards: Any) -> None:
        if not isinstance(inner, Statistic):
            raise TypeError(f"inner must be an accordion.statistic.Statistic, got "
                            f"{type(inner).__name__}")  # fmt: skip
        self.inner = inner
        self.shards = shards  # a transport over the shard group
        self.name = inner.name
        self.source = inner.source

    @property
    def sums(self) -> GradientSums:  # type: ignore[override]
        """``inner``'s sums."""
        return self.inner.sums

    def observe(self, keys: Sequence[str], grads: Sequence[torch.Tensor], layers: Layers,
                world_size: int, rank: int) -> None:  # fmt: skip
        """``inner``'s observation."""
        self.inner.observe(keys, grads, layers, world_size, rank)

    def agreement(self, layers: Layers, world_size: int, rank: int, with_memory: bool = False,
                  device: torch.device | None = None) -> Exchange[Norms]:  # fmt: skip
        """``inner``'s agreement over the replicas (the shards are combined by
        :meth:`agree`, over the other transport)."""
        return self.inner.agreement(layers, world_size, rank, with_memory, device)

    def agree(self, transport: Any, layers: Layers, with_memory: bool = False,
              device: torch.device | None = None) -> Norms:  # fmt: skip
        """The replicas' agreed norms of each shard (over ``transport``), combined into the
        whole parameter's over the shard group."""
        grad_norms, memory_norms = self.inner.agree(transport, layers, with_memory, device)
        if self.shards.world_size == 1 or not grad_norms:
            return grad_norms, memory_norms
        return self.shards.run(self.combination(grad_norms, memory_norms, self.sums.device))

    @staticmethod
    def combination(grad_norms: Mapping[str, float], memory_norms: Mapping[str, float],
                    device: torch.device | None = None) -> Exchange[Norms]:  # fmt: skip
        """The exchange over the shard group that combines each shard's norms into the
        whole parameter's; every shard holds the same keys."""
        keys = list(grad_norms)
        squares = [grad_norms[k] ** 2 for k in keys] + [memory_norms[k] ** 2 for k in memory_norms]
        total = torch.tensor(squares, dtype=torch.float64, device=device)
        yield [AllReduce(total)]
        flat = total.sqrt().tolist()
        return dict(zip(keys, flat[: len(keys)])), dict(zip(memory_norms, flat[len(keys) :]))

    def rename(self, renamed: Mapping[str, str]) -> None:
        """``inner``'s renames."""
        self.inner.rename(renamed)

    def forget(self, key: str) -> None:
        """Drop ``key``'s sum from ``inner``."""
        self.inner.forget(key)

    def restart(self, sums: GradientSums) -> None:
        """``inner`` goes on from ``sums``."""
        self.inner.restart(sums)


#: The statistic classes by name.
KINDS: dict[str, type[Statistic]] = {
    cls.name: cls for cls in (Rank0Statistic, MeanStatistic, ShardedStatistic)
}


def make_statistic(statistic: str | Statistic) -> Statistic:
    """``statistic`` if it is a :class:`Statistic`, else a new one of the kind it names
    (one of :data:`STATISTICS`; ``TypeError`` or ``ValueError`` otherwise)."""
    if isinstance(statistic, Statistic):
        return statistic
    return KINDS[check_choice("statistic", statistic, STATISTICS)]()


def _norm(tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The L2 norm of ``tensor`` as ``like``'s dtype (0 for no tensor: no memory)."""
    if tensor is None:
        return torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.linalg.vector_norm(tensor).to(like.dtype)


__all__ = ["KINDS", "STATISTICS", "Layers", "MeanStatistic", "Rank0Statistic", "ShardCombined",
           "ShardedStatistic", "Statistic", "make_statistic"]  # fmt: skip
