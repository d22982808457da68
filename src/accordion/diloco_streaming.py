"""Streaming DiLoCo (Douillard et al., 2025): DiLoCo's sync split into fragments of the
model that sync in turn, each overlapped with the inner steps that follow its start.

Plain DiLoCo sends every parameter's pseudo-gradient at once, every H steps: the link
idles between syncs and carries the whole model during them. Streaming DiLoCo splits the
parameters into F fragments and syncs one every H / F inner steps, in turn, so each
fragment still syncs every H steps and the peak traffic is 1 / F of DiLoCo's. With
``delay`` (tau) >= 1 a fragment's average starts tau inner steps before it is applied and
travels while the worker computes them; then the fragment's parameters become the outer
step's result mixed with the worker's own, ``(1 - mix) * outer + mix * local``.

The schedule is torchft's (``torchft.local_sgd.DiLoCo`` with ``model_fragments``,
``fragment_sync_delay`` and ``fragment_update_alpha``): after the warm-up, fragment
``k % F`` lands at the end of the k-th window of H / F steps (k from 0), and starts tau
steps before. With F = 1, tau = 0 and mix = 0 it is :class:`~accordion.diloco.DiLoCo`.

Example, one worker of ``torchrun --nproc-per-node 2`` (int2 fragments, 4 of them, each
synced every 40 steps, one every 10, each overlapped with 2 inner steps)::

    state = accordion.Controller(net, "int", levels=(2, 2), interval_unit="step")
    diloco = accordion.StreamingDiLoCo(net, inner, 40, fragments=4, delay=2, state=state)
    for x, y in loader:
        inner.zero_grad()
        loss_fn(net(x), y).backward()
        inner.step()
        diloco.step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._validate import check_int, check_number
from .diloco import _STATE_KEYS, DiLoCo


def fragment_gap(sync_every: int, fragments: int, delay: int) -> int:
    """The inner steps between two fragments' landings, ``sync_every / fragments``;
    ``ValueError`` unless ``fragments`` divides ``sync_every`` and ``delay`` is below the
    gap (a fragment lands before the next starts)."""
    if sync_every % fragments:
        raise ValueError(f"sync_every must be a multiple of the {fragments} fragments (one "
                         f"lands every sync_every / fragments steps), got sync_every="
                         f"{sync_every}")  # fmt: skip
    gap = sync_every // fragments
    if delay >= gap:
        raise ValueError(f"delay must be below sync_every / fragments = {gap} (a fragment "
                         f"lands before the next starts), got {delay}")  # fmt: skip
    return gap


def split_fragments(sizes: Sequence[int], count: int) -> list[list[int]]:
    """Split tensors of ``sizes`` elements, in order, into ``count`` contiguous fragments
    of about equal total size; returns each fragment's indices. Every fragment holds at
    least one tensor, so ``count`` must be in ``[1, len(sizes)]``."""
    count = check_int("fragments", count, 1)
    if count > len(sizes):
        raise ValueError(f"fragments must be at most the {len(sizes)} trainable parameters, "
                         f"got {count}")  # fmt: skip
    total, done = sum(sizes), 0
    out: list[list[int]] = [[] for _ in range(count)]
    k = 0
    for i, size in enumerate(sizes):
        behind = count - k - 1  # fragments still empty after this one
        if out[k] and behind and (done >= total * (k + 1) / count or len(sizes) - i == behind):
            k += 1
        out[k].append(i)
        done += size
    return out


@dataclass
class _Pending:
    """A fragment's average in flight: its pseudo-gradients (averaged in place once
    ``future`` is done) and the future (``None`` once waited for)."""

    fragment: int
    grads: list[torch.Tensor]
    future: Any


class StreamingDiLoCo(DiLoCo):
    """DiLoCo whose sync goes one fragment of the model at a time, each overlapped with
    the next ``delay`` inner steps.

    It takes :class:`~accordion.diloco.DiLoCo`'s arguments (``sync_every`` is H, the
    steps between two syncs of one fragment; the others as keywords), and three of its own.

    Args:
        fragments: F, an int >= 1: the trainable parameters, in the model's order, split
            into F contiguous groups of about equal size (:func:`split_fragments`); or F
            sequences of parameters that together hold each trainable parameter once (e.g.
            every F-th transformer block in each, the paper's strided pattern). H must be
            a multiple of F: one fragment lands every H / F steps.
        delay: tau, the inner steps between a fragment's start and its landing, an int in
            ``[0, H / F)`` (default 0: at once, no overlap). Its pseudo-gradient is taken
            at the start, and averaged while the worker takes those steps.
        mix: the weight of the worker's own parameters when a fragment lands, a float in
            ``[0, 1]`` (default 0: the outer step's result alone, torchft's default). With
            a delay, a mix above 0 keeps part of the tau steps' progress, which 0 drops.

    Each round (:attr:`rounds`, one step of ``state``: its rule decides every
    ``interval`` of them) is one sync of every fragment, at the end of the last one's.
    :meth:`synced` and :meth:`state_dict` first wait for a fragment in flight (it still
    lands at its step); call :meth:`wait` before ending the process group.
    """

    _state_keys = _STATE_KEYS | {"pending"}

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 sync_every: int, *, fragments: int | Sequence[Sequence[nn.Parameter]] = 2,
                 delay: int = 0, mix: float = 0.0, **kwargs: Any):  # fmt: skip
        if kwargs.get("sync_growth"):
            raise ValueError(f"sync_growth={kwargs['sync_growth']!r}: StreamingDiLoCo's "
                             "fragments land at a fixed gap, H / F; its rounds do not "
                             "change length")  # fmt: skip
        if kwargs.get("warmup_sync_every", 1) != 1:
            raise ValueError(f"warmup_sync_every={kwargs['warmup_sync_every']!r}: "
                             "StreamingDiLoCo syncs fragments, not whole rounds; its warm-up "
                             "averages every step (warmup_sync_every=1)")  # fmt: skip
        super().__init__(model, inner_optimizer, sync_every, **kwargs)
        #: Each fragment's indices into :attr:`params`.
        self.fragments = self._checked_fragments(fragments)
        self.delay = check_int("delay", delay, 0)
        #: Inner steps between two fragments' landings (H / F).
        self.gap = fragment_gap(self.sync_every, len(self.fragments), self.delay)
        self.mix = check_number("mix", mix, minimum=0, maximum=1)
        self._pending: _Pending | None = None

    def _checked_fragments(self, fragments: Any) -> list[list[int]]:
        """``fragments`` as index lists into :attr:`params`, each in the model's order."""
        if isinstance(fragments, int):  # a bool too: split_fragments refuses it
            return split_fragments([p.numel() for p in self.params], fragments)
        if not isinstance(fragments, Sequence) or isinstance(fragments, str):
            raise TypeError(f"fragments must be an int or a sequence of sequences of "
                            f"parameters, got {type(fragments).__name__}")  # fmt: skip
        where = {id(p): i for i, p in enumerate(self.params)}
        out = []
        for group in fragments:
            index = sorted(where.get(id(p), -1) for p in group)
            if not index or index[0] < 0:
                raise ValueError("fragments must each hold one or more of the model's "
                                 "trainable parameters, and nothing else")  # fmt: skip
            out.append(index)
        flat = sorted(i for index in out for i in index)
        if flat != list(range(len(self.params))):
            raise ValueError(f"fragments must hold each of the model's {len(self.params)} "
                             f"trainable parameters exactly once, got {len(flat)} entries "
                             f"covering {len(set(flat))}")  # fmt: skip
        return out

    @property
    def fragment_syncs(self) -> int:
        """Fragments landed so far."""
        return max(0, self.inner_steps - self.warmup_length) // self.gap

    def _round_step(self, t: int) -> bool:
        fragment = (t - 1) // self.gap % len(self.fragments)
        if t % self.gap == (self.gap - self.delay) % self.gap:
            self._start(fragment)
        if t % self.gap:
            return False
        self._land(fragment)
        return True

    def _start(self, fragment: int) -> None:
        """Take the fragment's pseudo-gradients and start averaging them (not blocking)."""
        keys, grads = self._pseudo_gradients(self.fragments[fragment])
        future = self.state.transport().run_async(self.state.reduce(keys, grads))
        self._pending = _Pending(fragment, grads, future)

    @torch.no_grad()
    def _land(self, fragment: int) -> None:
        """Wait for the fragment's average, step it, mix in the worker's own parameters;
        after the last fragment, end the round (one step of the state)."""
        self.wait()
        pending, self._pending = self._pending, None
        assert pending is not None and pending.fragment == fragment, "fragment out of turn"
        index = self.fragments[fragment]
        local = [self.params[i].detach().clone() for i in index] if self.mix else []
        self._outer_step(index, pending.grads)
        for i, mine in zip(index, local):
            self.params[i].lerp_(mine, self.mix)  # (1 - mix) * outer + mix * local
        if len(self.fragments) == 1 and not self.mix:  # the outer result alone: all equal
            self._synced_at = self.inner_steps
        if fragment == len(self.fragments) - 1:
            self.rounds += 1
            self.state.end_step(self.inner)

    def sync(self) -> None:
        """Every fragment at once now, as :class:`~accordion.diloco.DiLoCo` does, after a
        fragment in flight lands (collective)."""
        if self._pending is not None:
            self._land(self._pending.fragment)
        super().sync()

    def _derived_synced_at(self) -> int:
        """As :meth:`DiLoCo._derived_synced_at`; with fragments landing apart, or mixed
        with the worker's own, the replicas were last equal in the warm-up."""
        if len(self.fragments) > 1 or self.mix:
            return min(self.inner_steps, self.warmup_length)
        return super()._derived_synced_at()

    def wait(self) -> None:
        """Wait until a fragment in flight is averaged (it still lands at its step)."""
        pending = self._pending
        if pending is not None and pending.future is not None:
            pending.future.wait()
            pending.future = None

    @contextlib.contextmanager
    def synced(self) -> Iterator[None]:
        """As :meth:`DiLoCo.synced`, after waiting for a fragment in flight."""
        self.wait()
        with super().synced():
            yield

    def stats(self) -> dict[str, Any]:
        """:meth:`DiLoCo.stats` with ``fragments`` (F), ``fragment_syncs`` and ``delay``."""
        return {**super().stats(), "fragments": len(self.fragments),
                "fragment_syncs": self.fragment_syncs, "delay": self.delay}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """:meth:`DiLoCo.state_dict` with ``pending``: the fragment in flight and its
        averaged pseudo-gradients (``None`` when none is), waited for first."""
        self.wait()
        pending = self._pending
        saved = None if pending is None else {
            "fragment": pending.fragment, "grads": [g.clone() for g in pending.grads]}
        return {**super().state_dict(), "pending": saved}  # fmt: skip

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a bad entry is a ``ValueError`` and changes nothing."""
        pending = self._checked_pending(saved.get("pending") if isinstance(saved, Mapping)
                                        else None)  # fmt: skip
        self.wait()
        super().load_state_dict(saved)
        self._pending = pending

    def _checked_pending(self, entry: Any) -> _Pending | None:
        if entry is None:
            return None
        fragment = entry.get("fragment") if isinstance(entry, Mapping) else None
        if (isinstance(fragment, bool) or not isinstance(fragment, int)
                or not 0 <= fragment < len(self.fragments)):  # fmt: skip
            raise ValueError(f"pending must be None or hold a fragment in [0, "
                             f"{len(self.fragments)}), got {entry!r:.80}")  # fmt: skip
        shapes = [tuple(self.params[i].shape) for i in self.fragments[fragment]]
        grads = entry.get("grads")
        tensors = isinstance(grads, list | tuple) and all(isinstance(g, torch.Tensor)
                                                          for g in grads)  # fmt: skip
        if not tensors or [tuple(g.shape) for g in grads] != shapes:
            raise ValueError(f"pending grads must be {len(shapes)} tensors of shapes "
                             f"{shapes[:3]}..., fragment {fragment}'s parameters")  # fmt: skip
        return _Pending(fragment, [g.clone() for g in grads], None)


__all__ = ["StreamingDiLoCo", "fragment_gap", "split_fragments"]
