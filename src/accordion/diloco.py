"""DiLoCo (Douillard et al., 2023) on this library's parts: rare, compressed syncs.

Each worker takes ``sync_every`` (H) steps of its own inner optimiser with no gradient
traffic at all. Then the workers average the *pseudo-gradient*, what the parameters moved
since the last sync (``anchor - current``), and an outer optimiser (SGD with Nesterov
momentum, DiLoCo's lr 0.7 and momentum 0.9, by default) steps the anchor with it. The
average goes through an Accordion state (:class:`~accordion.controller.Controller`), so
the pseudo-gradients are compressed by the same compressors, ladders and rules as the
per-step hook, with error feedback carried from round to round, and counted in its
ledger; each round is one step of that state (``interval_unit="step"``), so its rule
decides per layer every ``interval`` rounds.

Example, one worker of ``torchrun --nproc-per-node 2``::

    net = Net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-3)
    state = accordion.Controller(net, "int", levels=(8, 4), interval=1, interval_unit="step")
    diloco = accordion.DiLoCo(net, inner, sync_every=50, state=state)
    for x, y in loader:
        inner.zero_grad()
        loss_fn(net(x), y).backward()
        inner.step()
        diloco.step()          # every 50th call: the compressed outer step

``model`` may also be a ``DistributedDataParallel`` replica (the hybrid setup): DDP
averages the gradients inside the replica at every step, over its own process group, and
DiLoCo averages the pseudo-gradients across the replicas, through a state over another
group, one rank per replica (e.g. world 4: DDP over ``{0, 1}`` and ``{2, 3}``, DiLoCo over
``{0, 2}`` and ``{1, 3}``). A state whose group shares a rank besides this one with DDP's
is refused: DDP keeps those ranks equal already, and there would be nothing to sync.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._optim_hooks import closure_aware
from ._validate import check_int, check_number, check_state_keys
from .controller import Controller
from .diloco_schedule import SyncSchedule
from .diloco_warmup import WarmupEnd, WarmupSteps

#: DiLoCo's outer optimiser: SGD with Nesterov momentum (the paper's lr and momentum).
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
_STATE_KEYS = frozenset({"inner_steps", "rounds", "anchor", "outer", "state", "warmup_state",
                         "warmup_end", "warmup_test"})  # fmt: skip
# files saved before rounds could grow, or before finish(), lack these
_OPTIONAL_KEYS = frozenset({"schedule", "synced_at"})
_DDP = nn.parallel.DistributedDataParallel
#: Inner steps per window of the warm-up's norm test, by default.
WARMUP_WINDOW = 25


def default_outer_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum, lr :data:`OUTER_LR`, momentum :data:`OUTER_MOMENTUM`."""
    return torch.optim.SGD(params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)


def _sgd_momentum(optimizer: torch.optim.Optimizer) -> float:
    """The largest momentum of an SGD optimiser's groups (0 for any other optimiser)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return 0.0
    return max(float(group.get("momentum", 0.0)) for group in optimizer.param_groups)


def _warn_stacked_momentum(inner: torch.optim.Optimizer, outer: torch.optim.Optimizer) -> None:
    """Warn when an outer SGD's momentum stacks on an inner SGD's: on MNIST-1D's CNNs the
    two together stalled training at chance (``docs/diloco.md``)."""
    inner_m, outer_m = _sgd_momentum(inner), _sgd_momentum(outer)
    if inner_m > 0 and outer_m > 0:
        warnings.warn(f"DiLoCo: the outer SGD's momentum {outer_m} stacks on the inner SGD's "
                      f"momentum {inner_m}; on MNIST-1D CNNs the two together stalled "
                      "training at chance (docs/diloco.md). With an inner SGD with momentum, "
                      "pass outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0), the "
                      "replicas' plain average (local SGD)", UserWarning, stacklevel=3)


class DiLoCo(WarmupSteps):
    """Inner steps without communication, and every ``sync_every`` of them an outer step
    on the averaged (compressed) pseudo-gradient.

    Args:
        model: the replica this worker trains: a plain ``nn.Module``, or a
            ``DistributedDataParallel`` one whose gradients DDP averages inside the
            replica at every step (the hybrid setup). DiLoCo then works on
            ``model.module``'s parameters, and ``state`` (and ``warmup_state``) must be
            given, over a group that shares no rank but this one with DDP's
            ``process_group``: one rank per replica, e.g. world 4 with DDP over
            ``new_group([0, 1])`` and ``new_group([2, 3])`` and the states over
            ``new_group([0, 2])`` and ``new_group([1, 3])`` (every rank creating every
            group, in the same order). Anything else is a ``ValueError`` naming both
            groups' ranks: DDP already keeps the shared ranks equal, nothing would be left
            to sync (``state=None``, the default group, shares them). The replica's
            ranks must stay equal through DDP (no ``no_sync()`` in the loop): a sync
            averages across replicas only, and does not make them equal again.
        inner_optimizer: the worker's own optimiser over ``model``'s parameters; its
            state (e.g. AdamW's moments) stays local, as in DiLoCo.
        sync_every: H, the inner steps per round (an int >= 1).
        state: the Accordion state that averages the pseudo-gradients, bound to
            ``model`` (or ``model.module`` for a DDP model) and counting steps
            (``interval_unit="step"``: one step per round). Default: a dense one,
            ``Controller(model, "dense", interval_unit="step")``, over the default group
            (refused for a DDP model: see ``model``).
        outer_optimizer: a callable building the outer optimiser from the parameters.
            Default: :func:`default_outer_optimizer`, for an inner AdamW. With an inner
            SGD with momentum pass ``lambda ps: torch.optim.SGD(ps, lr=1.0)``, the
            replicas' plain average (local SGD): an outer momentum on top of the inner
            one stalled MNIST-1D CNNs at chance, and is a ``UserWarning``
            (``docs/diloco.md``).
        warmup_steps: inner steps of data-parallel training before the first round (an
            int >= 0, default 0): each of them averages the gradients, through
            ``warmup_state``, before the inner step (a pre-hook on ``inner_optimizer``), so
            the replicas stay equal, and the rounds of H steps follow. Training's first
            steps are its most critical regime (Accordion's finding, and post-local SGD's,
            Lin et al. 2020): on ``charlm-tiny`` DiLoCo lost 2.5% of validation loss
            without them and none with 90 (2 seeds, ``docs/diloco.md``). A loop that clips
            gradients clips each worker's own before they are averaged.
        warmup_state: the Accordion state that averages those gradients, bound to
            ``model`` and counting steps (any compressor or ladder); for a DDP model over a
            group like ``state``'s, across the replicas. Default (with
            ``warmup_steps > 0``): a dense one over the default group (refused for a DDP
            model).
        warmup_eta: ``None`` (default): the warm-up is ``warmup_steps`` long. A float > 0:
            the rule ends it, at the first window of ``warmup_window`` steps whose averaged
            gradients' summed norm changed by less than ``warmup_eta`` (relative) from the
            window before's (the paper's norm test on the whole model,
            :class:`~accordion.diloco_warmup.WarmupEnd`); ``warmup_steps`` is then its
            longest. A window that ends at a higher inner learning rate than it began
            at (a learning-rate warm-up) is never calm. The paper's 0.5 is the usual value.
        warmup_window: inner steps per window of that test (an int >= 1, default
            :data:`WARMUP_WINDOW`, 25).
        warmup_sync_every: K, how often the warm-up syncs, an int >= 1. 1 (default): every
            step, its gradients averaged through ``warmup_state``. K > 1: the warm-up is
            rounds of K inner steps whose pseudo-gradients ``state`` averages, as the
            rounds after it (``warmup_state`` must then be ``None``), each landing as the
            replicas' plain average, without the outer optimiser (its Nesterov momentum
            on rounds of 2-4 AdamW steps lost 1.5-15.6 points on ``charlm-tiny``); the
            norm test reads each worker's own gradients, its window's norm agreed as the
            ranks' largest, and the first round after it also takes the steps since the
            warm-up's last sync. On ``charlm-tiny`` rounds of 4 kept DDP's quality at
            half the bytes of a per-step int2 warm-up (``docs/diloco.md``).
        error_decay: beta, the factor on ``state``'s error-feedback memory of a tensor
            before each of its syncs, a float in ``[0, 1]``: what a sync compresses is the
            pseudo-gradient plus beta times what the last one left unsent (SparseLoCo's
            decayed error feedback, Sarfi et al. 2025, used with a plain outer step).
            Default 1: plain error feedback.
        sync_growth: p, a finite float (default 0: every round is ``sync_every`` steps). A
            round that starts at inner learning rate ``lr`` takes ``sync_every * (peak /
            lr) ** p`` steps (rounded, within ``[min_sync_every, max_sync_every]``),
            ``peak`` the highest inner rate so far: with p > 0 rounds lengthen as the
            schedule decays (2 is the quadratic synchronisation rule of Gu et al., 2024),
            with p < 0 they shorten (:class:`~accordion.diloco_schedule.SyncSchedule`).
        min_sync_every: the shortest round with ``sync_growth``, an int in ``[1,
            sync_every]`` (default ``sync_every`` when p > 0, a quarter of it when p < 0).
        max_sync_every: the longest round with ``sync_growth``, an int >= ``sync_every``
            (default 4 times ``sync_every`` when p > 0, ``sync_every`` when p < 0).

    Every rank must call :meth:`step` after each inner ``optimizer.step()``; the outer
    step is collective, and so is each warm-up step.
    """

    _state_keys = _STATE_KEYS

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, sync_every: int,
                 *, state: Controller | None = None,
                 outer_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                 | None = None, warmup_steps: int = 0,
                 warmup_state: Controller | None = None, warmup_eta: float | None = None,
                 warmup_window: int = WARMUP_WINDOW, warmup_sync_every: int = 1,
                 error_decay: float = 1.0,
                 sync_growth: float = 0.0, min_sync_every: int | None = None,
                 max_sync_every: int | None = None):  # fmt: skip
        self.params = _checked_params(model, inner_optimizer)
        ddp = model if isinstance(model, _DDP) else None
        module = model if ddp is None else ddp.module
        self.inner = inner_optimizer
        #: H, the inner steps per round.
        self.sync_every = check_int("sync_every", sync_every, 1)
        #: How many inner steps each round takes (H, or H following the inner rate).
        self.schedule = SyncSchedule(self.sync_every, sync_growth, min_sync_every,
                                     max_sync_every)  # fmt: skip
        #: Inner steps before the first round: data-parallel, or short rounds.
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        #: K, the warm-up's inner steps per sync (1: it averages every step's gradients).
        self.warmup_sync_every = check_int("warmup_sync_every", warmup_sync_every, 1)
        _check_warmup_options(self.warmup_steps, self.warmup_sync_every, warmup_state,
                              warmup_eta)  # fmt: skip
        #: The Accordion state that averages the pseudo-gradients.
        self.state = _checked_state(state, module, "state", ddp)
        #: The one that averages the warm-up's gradients (``None`` without a per-step
        #: warm-up).
        self.warmup_state = (_checked_state(warmup_state, module, "warmup_state", ddp)
                             if self.warmup_steps and self.warmup_sync_every == 1
                             else None)  # fmt: skip
        #: The norm test that may end the warm-up early (``None``: a fixed warm-up).
        self.warmup_test = (None if warmup_eta is None
                            else WarmupEnd(self.params, warmup_eta, warmup_window))  # fmt: skip
        #: The inner step at which the test ended the warm-up (``None``: it has not).
        self.warmup_end: int | None = None
        if warmup_state is not None and warmup_state is self.state:
            raise ValueError("warmup_state must be another state than state: gradients and "
                             "pseudo-gradients need their own error feedback")  # fmt: skip
        #: The factor on the error-feedback memory before each sync (1: plain feedback).
        self.error_decay = check_number("error_decay", error_decay, minimum=0, maximum=1)
        build = default_outer_optimizer if outer_optimizer is None else outer_optimizer
        if not callable(build):
            raise TypeError(f"outer_optimizer must be a callable or None, got {build!r}")
        self.outer = build(self.params)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must return a torch.optim.Optimizer, "
                            f"got {type(self.outer).__name__}")  # fmt: skip
        _warn_stacked_momentum(inner_optimizer, self.outer)
        # fp32: H small steps summed in bf16 would round away
        self._anchor = [p.detach().float().clone() for p in self.params]
        #: Inner steps taken so far, and outer steps (rounds).
        self.inner_steps, self.rounds = 0, 0
        self._synced_at = 0  # the inner step at which the replicas were last equal
        if self.warmup_state is not None or self.warmup_test is not None:
            inner_optimizer.register_step_pre_hook(closure_aware(self._before_warmup_step))

    def step(self) -> bool:
        """Count one inner step; at the end of a round, sync (collective). Returns
        whether this call synced."""
        if self.schedule.growth:  # the schedule's rate: alike on every rank
            self.schedule.observe(self.inner.param_groups[0]["lr"])
        if self.in_warmup:
            return self._warmup_step()
        self.inner_steps += 1
        return self._round_step(self.inner_steps - self.warmup_length)

    def _round_step(self, t: int) -> bool:
        """After the ``t``-th inner step of the rounds (from 1): sync at a round's end."""
        if not self.schedule.due(t, self.inner.param_groups[0]["lr"]):
            return False
        self.sync()
        return True

    def sent(self) -> tuple[int, float]:
        """Floats (paper convention) and wire bytes this worker has sent: the rounds' and
        the warm-up's."""
        ledgers = [self.state.ledger] + ([] if self.warmup_state is None
                                         else [self.warmup_state.ledger])  # fmt: skip
        return (sum(ledger.total_floats for ledger in ledgers),
                sum(ledger.total_bytes for ledger in ledgers))  # fmt: skip

    @property
    def unsynced_steps(self) -> int:
        """Inner steps each worker has taken since the replicas were last equal (0 right
        after a sync or a warm-up step): what :meth:`finish` would still average in."""
        return self.inner_steps - self._synced_at

    def finish(self) -> bool:
        """The last outer step, after the loop: sync now (collective) unless no inner step
        was taken since the last sync, so that the final model holds every worker's last
        steps; without it a round cut short by the end of training is never averaged, and
        :meth:`synced` shows the sync before. Returns whether it synced."""
        if not self.unsynced_steps:
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """The outer step now: average the pseudo-gradients through :attr:`state`, move
        the parameters back to the anchor and step them with the outer optimiser."""
        self._sync(plain=False)

    @torch.no_grad()
    def _sync(self, plain: bool) -> None:
        """A sync; with ``plain`` the replicas' average lands as it is (no outer step)."""
        index = list(range(len(self.params)))
        keys, grads = self._pseudo_gradients(index)
        self.state.transport().run(self.state.reduce(keys, grads))
        self._outer_step(index, grads, plain)
        self.rounds += 1
        self._synced_at = self.inner_steps
        self.state.end_step(self.inner)  # the schedule that matters is the inner one

    def _pseudo_gradients(self, index: list[int]) -> tuple[list[str], list[torch.Tensor]]:
        """The keys and pseudo-gradients (``anchor - current``, a descent direction) of
        the parameters at ``index``, in tensors of their own; with ``error_decay`` below
        1 their error-feedback memory is decayed here, just before the sync adds it."""
        params = [self.params[i] for i in index]
        grads = [(self._anchor[i] - p.detach().float()).to(p.dtype)
                 for i, p in zip(index, params)]  # fmt: skip
        keys = self.state.params.keys(params)
        if self.error_decay != 1.0:
            for key in keys:  # the reducer adds the decayed memory to the pseudo-gradient
                memory = self.state.reducer.memory.get(key)
                if memory is not None:
                    memory.mul_(self.error_decay)
        return keys, grads

    @torch.no_grad()
    def _outer_step(self, index: list[int], averaged: list[torch.Tensor],
                    plain: bool = False) -> None:  # fmt: skip
        """Move the parameters at ``index`` back to their anchor, step them with the outer
        optimiser on their ``averaged`` pseudo-gradients (``plain``: subtract them, the
        replicas' average, the outer optimiser untouched), and make the result their new
        anchor; the others and every parameter's ``grad`` stay as they were."""
        if plain:
            for i, average in zip(index, averaged):
                self.params[i].copy_(self._anchor[i]).sub_(average)
                self._anchor[i].copy_(self.params[i])
            return
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None  # the outer optimiser steps only the parameters given a grad
        for i, average in zip(index, averaged):
            self.params[i].copy_(self._anchor[i])
            self.params[i].grad = average
        self.outer.step()
        for i in index:
            self._anchor[i].copy_(self.params[i])
        for p, grad in zip(self.params, saved):
            p.grad = grad  # the inner loop's gradients as they were

    @contextlib.contextmanager
    def synced(self) -> Iterator[None]:
        """Inside the block the parameters hold the last sync's values, the same on every
        rank (what to evaluate); the worker's own are put back after it."""
        own = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, anchor in zip(self.params, self._anchor):
                p.copy_(anchor)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, mine in zip(self.params, own):
                    p.copy_(mine)

    def stats(self) -> dict[str, Any]:
        """The state's ledger (:meth:`Controller.stats`; its ``dense_*`` figures are one
        dense sync per round) with ``rounds``, ``inner_steps``, the warm-up state's
        (``warmup``, ``None`` without one), the warm-up's steps so far
        (``warmup_steps_done``), the norm test's windows (``warmup_checks``, ``[]``
        without one), each round's inner steps with ``sync_growth`` (``round_lengths``,
        ``[]`` without) and :meth:`sent`'s totals (``sent_floats``, ``sent_bytes``)."""
        floats, nbytes = self.sent()
        warmup = None if self.warmup_state is None else self.warmup_state.stats()
        checks = [] if self.warmup_test is None else [dict(c) for c in self.warmup_test.checks]
        return {**self.state.stats(), "rounds": self.rounds, "inner_steps": self.inner_steps,
                "warmup": warmup, "warmup_steps_done": min(self.inner_steps, self.warmup_length),
                "warmup_checks": checks, "round_lengths": list(self.schedule.lengths),
                "sent_floats": floats, "sent_bytes": nbytes}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Counters, anchor, outer optimiser and Accordion states (the inner optimiser and
        the model are the caller's to save, as for any loop)."""
        return {"inner_steps": self.inner_steps, "rounds": self.rounds,
                "anchor": [a.clone() for a in self._anchor],
                "outer": self.outer.state_dict(), "state": self.state.state_dict(),
                "warmup_state": None if self.warmup_state is None
                else self.warmup_state.state_dict(), "warmup_end": self.warmup_end,
                "warmup_test": None if self.warmup_test is None
                else self.warmup_test.state_dict(),
                "schedule": self.schedule.state_dict() if self.schedule.growth
                else None, "synced_at": self._synced_at}  # fmt: skip

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a missing key, an anchor of other shapes, an outer
        optimiser state of other param groups or a bad Accordion state is a
        ``ValueError``, and leaves everything as it was."""
        check_state_keys(saved, self._state_keys, type(self).__name__, _OPTIONAL_KEYS)
        _check_saved(self, saved)
        _load(self, saved)

    def _derived_synced_at(self) -> int:
        """For a file saved before ``synced_at`` was: the last round's end with a fixed H
        (``rounds`` whole rounds after the warm-up), the schedule's last round start with
        growing rounds."""
        warmup = min(self.inner_steps, self.warmup_length)
        if self.schedule.growth:
            return warmup + self.schedule.state_dict()["start"]
        return min(self.inner_steps, warmup + self.rounds * self.sync_every)


def _load(diloco: DiLoCo, saved: Mapping[str, Any]) -> None:
    """Load a checked :meth:`DiLoCo.state_dict` into ``diloco``: its parts all or none
    (:func:`_load_all`), then the anchor and counters."""
    # torch's optimiser keeps the given tensors: stepping would change the caller's dict
    outer = copy.deepcopy(saved["outer"])
    parts: list[tuple[Any, Any]] = [(diloco.outer, outer), (diloco.state, saved["state"])]
    if diloco.warmup_state is not None:
        parts.append((diloco.warmup_state, saved["warmup_state"]))
    if diloco.warmup_test is not None:
        parts.append((diloco.warmup_test, saved["warmup_test"]))
    if diloco.schedule.growth:
        parts.append((diloco.schedule, saved["schedule"]))
    _load_all(parts)
    for mine, theirs in zip(diloco._anchor, saved["anchor"]):
        mine.copy_(theirs)
    diloco.inner_steps, diloco.rounds = saved["inner_steps"], saved["rounds"]
    diloco.warmup_end = saved["warmup_end"]
    diloco._synced_at = (saved["synced_at"] if "synced_at" in saved
                         else diloco._derived_synced_at())  # fmt: skip


def _check_warmup_options(steps: int, sync_every: int, state: Any, eta: Any) -> None:
    """Refuse warm-up options that need a warm-up (``steps >= 1``) without one, and a
    ``warmup_state`` for a warm-up of rounds, which go through ``state``."""
    for name, value, given in (("warmup_state", state, state is not None),
                               ("warmup_eta", eta, eta is not None),
                               ("warmup_sync_every", sync_every, sync_every != 1)):  # fmt: skip
        if given and not steps:
            raise ValueError(f"{name} needs warmup_steps >= 1 (the longest warm-up), got "
                             f"warmup_steps=0 with {name}={value!r:.60}")  # fmt: skip
    if sync_every > 1 and state is not None:
        raise ValueError(f"warmup_state must be None with warmup_sync_every={sync_every}: "
                         "a warm-up of rounds syncs through state")  # fmt: skip


def _check_saved(diloco: DiLoCo, saved: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``saved``'s anchor, counters, warm-up and schedule entries fit
    ``diloco`` (the states themselves are checked as they load)."""
    anchor, shapes = saved["anchor"], [tuple(a.shape) for a in diloco._anchor]
    if not isinstance(anchor, list | tuple) or [tuple(a.shape) for a in anchor] != shapes:
        raise ValueError(f"anchor must be {len(shapes)} tensors of shapes {shapes[:3]}..., "
                         "the model's parameters")  # fmt: skip
    for name in ("inner_steps", "rounds"):
        value = saved[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if (saved["warmup_state"] is None) != (diloco.warmup_state is None):
        wanted = "None" if diloco.warmup_state is None else "a state dict"
        got = type(saved["warmup_state"]).__name__
        raise ValueError(f"warmup_state must be {wanted} for a DiLoCo with warmup_steps="
                         f"{diloco.warmup_steps}, got {got}")  # fmt: skip
    test = diloco.warmup_test
    if (saved["warmup_test"] is None) != (test is None):
        raise ValueError(f"warmup_test must be {'None' if test is None else 'a state dict'} for "
                         f"a DiLoCo with warmup_eta={None if test is None else test.eta}, "
                         f"got {type(saved['warmup_test']).__name__}")  # fmt: skip
    end, top = saved["warmup_end"], diloco.warmup_steps if test else 0
    if end is not None and (isinstance(end, bool) or not isinstance(end, int)
                            or not 1 <= end <= top):  # fmt: skip
        raise ValueError(f"warmup_end must be None or an int in [1, {top}] (an early end "
                         f"needs warmup_eta), got {end!r}")  # fmt: skip
    synced_at = saved.get("synced_at", 0)
    if (isinstance(synced_at, bool) or not isinstance(synced_at, int)
            or not 0 <= synced_at <= saved["inner_steps"]):  # fmt: skip
        raise ValueError(f"synced_at must be an int in [0, inner_steps={saved['inner_steps']}],"
                         f" got {synced_at!r}")  # fmt: skip
    growth = diloco.schedule.growth
    if (saved.get("schedule") is None) != (not growth):
        raise ValueError(f"schedule must be {'a state dict' if growth else 'None'} for a "
                         f"DiLoCo with sync_growth={growth:g}: the state dict was saved "
                         "by one whose rounds change otherwise")  # fmt: skip


def _load_all(parts: list[tuple[Any, Any]]) -> None:
    """Load each ``(part, state)``, all or none: a failing load puts back what the others
    had loaded, and raises."""
    before = [copy.deepcopy(part.state_dict()) for part, _ in parts]
    loaded = []
    try:
        for part, theirs in parts:
            part.load_state_dict(theirs)  # raises on other groups, keys or shapes
            loaded.append(part)
    except Exception:
        for part, mine in zip(loaded, before):
            part.load_state_dict(mine)  # nothing changes on a bad entry
        raise


def _checked_params(model: Any, optimizer: Any) -> list[nn.Parameter]:
    if isinstance(model, _DDP):
        model = model.module  # the wrapped module's names, without "module."
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, p in model.named_parameters() if p.requires_grad
               and id(p) not in stepped]  # fmt: skip
    if missing:
        raise ValueError(f"inner_optimizer must step every trainable parameter of model; "
                         f"it lacks {missing[:5]}")  # fmt: skip
    return params


def _checked_state(state: Any, model: nn.Module, name: str = "state",
                   ddp: _DDP | None = None) -> Controller:  # fmt: skip
    """``state`` checked (or the default dense one built) for ``model``, the plain module
    (``ddp.module`` when the caller's model is ``ddp``)."""
    if state is not None:
        if not isinstance(state, Controller):
            raise TypeError(f"{name} must be an accordion Controller (or AccordionState) or "
                            f"None, got {type(state).__name__}")  # fmt: skip
        if state.interval_unit != "step":
            raise ValueError(f"{name} must count steps (interval_unit='step'): each round or "
                             f"step is one step of it; got {state.interval_unit!r}")  # fmt: skip
        if state.params.module is not model:
            bound = "model" if ddp is None else "model.module"
            raise ValueError(f"{name} must be bound to {bound} (Controller({bound}, ...)), so "
                             "that the gradients' keys are model's parameter names")  # fmt: skip
    if ddp is not None:
        _check_replica_groups(ddp, None if state is None else state.process_group, name)
    if state is None:
        return Controller(model, "dense", interval_unit="step")
    return state


def _ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (``None``: the default group's)."""
    return list(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))


def _check_replica_groups(ddp: _DDP, group: Any, name: str) -> None:
    """``ValueError`` unless ``group`` (a state's; ``None`` the default one) and DDP's
    share this rank alone: the ranks DDP averages at every step are equal already, and a
    sync over them too would have nothing to average (or do the same work twice)."""
    mine, replica, averaged = dist.get_rank(), _ranks(ddp.process_group), _ranks(group)
    shared = sorted(set(replica) & set(averaged) - {mine})
    if not shared:
        return
    origin = " (None: a dense Controller on the default group)" if group is None else ""
    raise ValueError(
        f"{name}{origin} averages over ranks {averaged}, and the DistributedDataParallel "
        f"model's process group over ranks {replica}: DDP already keeps ranks {shared} equal "
        f"to this one (rank {mine}) at every step, so the sync would have nothing to average "
        f"between them. Give {name}= a Controller(model.module, ..., interval_unit='step', "
        "process_group=cross) whose group holds one rank of each replica, e.g. for world 4 "
        "DDP over dist.new_group([0, 1]) and dist.new_group([2, 3]), and DiLoCo over "
        "dist.new_group([0, 2]) and dist.new_group([1, 3]), every rank creating every group "
        "in the same order"
    )


__all__ = ["DiLoCo", "default_outer_optimizer", "OUTER_LR", "OUTER_MOMENTUM", "WARMUP_WINDOW"]
