"""The controller: one object that combines the parts of Accordion for one model.

* a :class:`~accordion.params.ParameterTable` (stable keys per parameter),
* a :class:`~accordion.compress.Reducer` (compressor + error-feedback memory),
* the policy: a :class:`~accordion.policy.Ladder` of levels, a
  :class:`~accordion.policy.Schedule` and a :class:`~accordion.policy.Rule`,
* a :class:`~accordion.accounting.Ledger` of what was sent,
* a transport that carries every collective, the ranks' agreement on statistics included.

Adapters drive it: the DDP communication hook (``accordion.ddp``) and the loop without
DDP (:meth:`Controller.reduce_gradients`) hand it gradients; the training loop tells it
when an epoch or a step ends.
"""

# No `from __future__ import annotations`: a DDP hook's annotations are checked at run time.
import datetime
import inspect
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint
from ._validate import check_bool, check_choice, check_int, check_number
from .accounting import Ledger, paper_floats, wire_bytes
from .compress import (
    AllReduce,
    Broadcast,
    Dense,
    ErrorFeedback,
    Exchange,
    LocalTransport,
    Reducer,
    TorchTransport,
    compressor_class,
)
from .compress.transport import private_group
from .params import ParameterTable
from .policy import DecayDetector, GuardedRule, Ladder, Observation, Rule, Schedule
from .statistics import GradientSums, shard_owners

STATISTICS = ("rank0", "mean", "sharded")


class Controller:
    """Accordion for one model: compression, statistics, decisions, accounting, checkpoints.

    Args:
        model: the module whose gradients are averaged (plain or DDP-wrapped), or ``None``
            to bind parameters lazily from the buckets.
        compressor: a registered compressor name (``"powersgd"``, ``"topk"``, ``"half"``,
            ``"dense"``; see ``accordion.compress.compressor_names()``).
        mild: level in critical regimes (PowerSGD rank, top-k fraction, ...). Default:
            the compressor's (rank 2 / top-k 0.99).
        aggressive: level elsewhere. Default: rank 1 / top-k 0.1. ``mild == aggressive``
            gives a static compressor (and skips the statistic).
        interval: how often the rule checks, in epochs (``interval_unit="epoch"``) or in
            optimizer steps (``"step"``). Default: the rule's ``default_interval``, 1 for
            the guarded rule, 10 for the paper's (which used 10 for CNNs, 5 for the LSTM).
        eta: the default rule's threshold on the relative change of a layer's gradient
            norm (default 0.5); only with the default rule.
        statistic: ``"sharded"`` (the default: each layer's statistic is one rank's, as
            in the paper, but the layers are dealt out over the ranks, so that each keeps
            about ``1 / world_size`` of the sums: see
            :func:`~accordion.statistics.shard_owners`), ``"rank0"`` (the paper: rank 0's
            statistics decide every layer; every rank keeps a model-size sum) or
            ``"mean"`` (statistics averaged over ranks).
        interval_unit: ``"epoch"`` (call :meth:`end_epoch`) or ``"step"`` (call
            :meth:`end_step` after every optimizer step).
        process_group: the group to average over: ``None`` (the default group) or a
            ``torch.distributed.ProcessGroup``.
        seed: seed shared by all ranks for the compressor's random state (PowerSGD's Q).
        on_rank_change: PowerSGD's Q at a rank switch: ``"reuse"`` (default) or
            ``"redraw"`` (the paper's scripts). Ignored by compressors without it.
        levels: the whole ladder instead of ``mild``/``aggressive``: two or more levels,
            mildest first, e.g. ``(4, 2, 1)``.
        rule: the :class:`~accordion.policy.Rule` that decides the rungs. Default:
            ``GuardedRule(eta)``, which walks the ladder one rung at a time (see
            ``docs/hook.md``); ``rule=PaperRule()`` with ``interval=10`` is the paper's.
        timeout: how long Accordion's collectives wait for the other ranks before they
            raise, naming the exchange phase. Default: the process group's own timeout
            (as given to ``init_process_group``).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        compressor: str = "powersgd",
        mild: Any = None,
        aggressive: Any = None,
        interval: int | None = None,
        eta: float | None = None,
        statistic: str = "sharded",
        interval_unit: str = "epoch",
        process_group: Any = None,
        seed: int = 0,
        on_rank_change: str = "reuse",
        levels: Sequence[Any] | None = None,
        rule: Rule | None = None,
        timeout: datetime.timedelta | None = None,
    ):
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
        cls = compressor_class(compressor)
        self.statistic = check_choice("statistic", statistic, STATISTICS)
        self.rule = _rule(rule, eta)
        interval = self.rule.default_interval if interval is None else interval
        self.schedule = Schedule(interval, interval_unit)
        self.ladder = _ladder(cls, mild, aggressive, levels)
        self.compressor_name = cls.name
        self.process_group = _process_group(process_group)
        self.timeout = _timeout(timeout)
        self.seed = seed
        self._options = {"seed": seed, "on_rank_change": on_rank_change}
        self.reducer = Reducer(self._new_compressor(), ErrorFeedback())
        #: Epochs ended so far (the index of the current epoch).
        self.epoch = 0
        #: Optimizer steps (or hook iterations) seen so far.
        self.step = 0
        self.ledger = Ledger()
        self.params = ParameterTable()
        self._decay = DecayDetector(self.rule.decay_drop)
        self._decayed = False  # a decay since the last check (Observation.decayed)
        self._observed = False  # a gradient reached observe() since the last end_*()
        self._warned_idle = False  # the "hook never ran" warning is given once
        self._warned_no_lr = False  # the "decays cannot be seen" warning is given once
        self._levels_checked = False  # levels that compress nothing are warned of once
        self._rungs: dict[str, int] = {}  # the decision in force, per layer
        self.sums = GradientSums()
        self._owners: dict[str, int] | None = None  # "sharded": which rank sums each layer
        self._device: torch.device | None = None  # of the last gradients observed
        self._costs: dict[tuple[str, Any, int], tuple[int, float]] = {}  # per-step cost cache
        self._transport: TorchTransport | LocalTransport | None = None
        #: The last :meth:`calibrate` report, or ``None``.
        self.calibration: dict[str, Any] | None = None
        if model is not None:
            self.bind_module(model)

    def _new_compressor(self):
        cls = self.ladder.compressor
        if cls is Dense:
            return Dense()
        accepted = inspect.signature(cls).parameters
        options = {k: v for k, v in self._options.items() if k in accepted}
        return cls(self.ladder.mildest, **options)

    # --- properties of the configuration --------------------------------------------------

    @property
    def mild(self) -> Any:
        """The mildest level (rung 0)."""
        return self.ladder.mildest

    @property
    def aggressive(self) -> Any:
        """The most aggressive level (the last rung)."""
        return self.ladder.most_aggressive

    @property
    def adaptive(self) -> bool:
        """Whether levels switch (the ladder's levels differ)."""
        return self.ladder.adaptive

    @property
    def compressor(self):
        """The compressor object (levels per parameter key)."""
        return self.reducer.compressor

    @property
    def interval_unit(self) -> str:
        """``"epoch"`` or ``"step"``: what :attr:`Schedule.interval` counts."""
        return self.schedule.unit

    @property
    def _module(self) -> nn.Module | None:
        return self.params.module

    # --- binding --------------------------------------------------------------------------

    def bind_module(self, model: nn.Module) -> None:
        """Name parameters after ``model.named_parameters()`` (plain or DDP-wrapped).

        Parameters already bound lazily under ``"#i"`` keep their state under their new
        names.
        """
        renamed = self.params.bind(model)
        for old, new in renamed.items():
            self.sums.rename(old, new)
            if old in self.ledger.layers:
                self.ledger.layers[new] = self.ledger.layers.pop(old)
            if old in self._rungs:
                self._rungs[new] = self._rungs.pop(old)
            self.reducer.rename(old, new)
        if renamed:
            self._costs.clear()  # keyed by the old names
            self._owners = None  # dealt out again over the new names
        if not self._levels_checked:
            self._warn_of_useless_levels()

    def _warn_of_useless_levels(self) -> None:
        """Warn (once, in one ``RuntimeWarning``) of the layers that go dense at some
        ladder level because it would send at least as much as dense for them
        (``Compressor.pays``), naming them and those levels, and of the compressor's own
        advice on a level (``level_warning``: e.g. a PowerSGD rank that sends more than
        dense for every layer, so choose a lower rank)."""
        self._levels_checked = True
        cls, levels = self.ladder.compressor, list(dict.fromkeys(self.ladder.levels))
        shapes = {k: self.params.shapes[k] for k in self._compressed_keys()}
        dense_at = {k: [lv for lv in levels if not self.reducer.pays(s, lv)]
                    for k, s in shapes.items()}  # fmt: skip
        dense_at = {k: lv for k, lv in dense_at.items() if lv}
        parts = []
        if dense_at:
            named = []
            for key, dense_levels in dense_at.items():
                size = "x".join(map(str, shapes[key]))
                named.append(f"{key!r} ({size}) at {' and '.join(map(cls.label, dense_levels))}")
            more = f" and {len(named) - 5} more" if len(named) > 5 else ""
            parts.append(f"{len(named)} layer(s) send at least as much as dense at some levels "
                         f"and go dense there: {', '.join(named[:5])}{more}")  # fmt: skip
        for level in levels:
            message = cls.level_warning(list(shapes.values()), level)
            if message:
                parts.append(message)
        if parts:
            warnings.warn(f"{'; '.join(parts)} (levels {list(self.ladder.levels)})",
                          RuntimeWarning, stacklevel=4)  # fmt: skip

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def transport(self) -> TorchTransport | LocalTransport:
        """The transport of every collective; every rank must get here at the same point."""
        if self._transport is None:
            if dist.is_available() and dist.is_initialized():
                # A private copy of the group: the hook's phases are issued from completion
                # callbacks, and on a shared group they could pair up wrongly with
                # collectives that DDP (e.g. find_unused_parameters) or the loop issue.
                # It inherits the group's timeout (or the state's ``timeout``), so that a
                # rank that disagrees raises after it instead of blocking for 30 minutes.
                group = private_group(self.process_group, self.timeout)
                self._transport = TorchTransport(group)
            else:
                self._transport = LocalTransport()
        return self._transport

    # --- the per-step path ----------------------------------------------------------------

    def _collecting(self) -> bool:
        if not self.adaptive or not self._compressed_keys():
            return False
        return self.schedule.collecting(self.epoch)

    def observe(self, keys: Sequence[str], grads: Sequence[torch.Tensor], world: int) -> None:
        """Before an exchange: add ``grads`` to the statistic when the schedule gathers it,
        and their cost at the current levels to the ledger."""
        reducer = self.reducer
        self._observed = True
        if grads:
            self._device = grads[0].device
        if not self._levels_checked and self.step > 0:  # bound lazily: every layer seen now
            self._warn_of_useless_levels()
        if self._collecting():
            owners = self._shard_owners(world)
            rank = 0 if owners is None else self._rank(world)  # a host call: only if read
            for key, grad in zip(keys, grads):
                if reducer.compresses(grad, key) and (owners is None
                                                      or owners.get(key, rank) == rank):
                    self.sums.add(key, grad)
        for key, grad in zip(keys, grads):
            self.ledger.add(key, *self._cost(key, grad, world))

    def _cost(self, key: str, grad: torch.Tensor, world: int) -> tuple[int, float]:
        """Paper floats and wire bytes of ``key`` this step, cached per level: dense for a
        dense key, or at a level that does not pay for its shape (the accounting's rule)."""
        dense = key in self.reducer.dense_keys
        level = None if dense else self.reducer.compressor.level(key)
        cost = self._costs.get((key, level, world))
        if cost is None:
            name = Dense.name if dense else self.compressor_name
            shape, size = tuple(grad.shape), grad.element_size()
            cost = (paper_floats(shape, name, level, world),
                    wire_bytes(shape, name, level, world, size))  # fmt: skip
            self._costs[(key, level, world)] = cost
        return cost

    def _compressed_keys(self) -> list[str]:
        """Keys that have a level (the compressor applies to them and they are not in
        ``dense_keys``): the rule decides their rung, even for one whose level does not
        pay for its shape and so sends it dense (``Compressor.pays``)."""
        applies, dense = self.reducer.compressor.applies_to, self.reducer.dense_keys
        return [k for k, s in self.params.shapes.items() if applies(s) and k not in dense]

    def _rank(self, world: int) -> int:
        """This rank in ``process_group`` (0 for a world of one: no group to ask)."""
        return dist.get_rank(self.process_group) if world > 1 else 0

    def _shard_owners(self, world: int, check: bool = False) -> dict[str, int] | None:
        """Under ``"sharded"``, the rank that sums each layer the compressor applies to;
        ``None`` otherwise, or while the layers are not all known (bound lazily, before
        the first step ended: until then every rank sums every layer) unless at a
        ``check``, where the layers seen are all there are."""
        if self.statistic != "sharded" or world == 1:
            return None
        if self._owners is None:
            if self.params.module is None and self.step == 0 and not check:
                return None
            applies = self.reducer.compressor.applies_to
            shapes = {k: s for k, s in self.params.shapes.items() if applies(s)}
            self._owners = shard_owners(shapes, world)
            rank = self._rank(world)
            for key in self.sums.keys_in(self.params.shapes):
                if self._owners.get(key, rank) != rank:
                    self.sums.forget(key)  # summed before the layers were dealt out
        return self._owners

    def exchange(
        self, keys: Sequence[str], grads: Sequence[torch.Tensor], world: int
    ) -> Exchange[bool]:
        """The exchange averaging ``grads`` in place (see :class:`Reducer`)."""
        return self.reducer.exchange(keys, grads, world)

    def reduce_gradients(self, parameters: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Average ``p.grad`` over the process group in place, with compression: the
        same work as the hook, for loops without DDP. Call it after ``backward()``.

        ``parameters`` defaults to the bound module's parameters; those without a
        gradient are skipped (the same set must have gradients on every rank).
        """
        if parameters is None:
            if self.params.module is None:
                raise ValueError(
                    "parameters must be given when no module is bound "
                    "(pass model= to AccordionState or call bind_module)"
                )
            parameters = self.params.module.parameters()
        params = [p for p in parameters if p.grad is not None]
        keys = self.params.keys(params)
        grads = [p.grad for p in params]
        transport = self.transport()
        self.observe(keys, grads, transport.world_size)
        transport.run(self.exchange(keys, grads, transport.world_size))
        if self.interval_unit == "epoch":
            self.step += 1

    # --- the cost model -------------------------------------------------------------------

    def calibrate(self, bandwidth: float | None = None, latency: float | None = None, *,
                  buckets: int | None = None, repeats: int = 5,
                  compute_s: float | None = None) -> dict[str, Any]:  # fmt: skip
        """Measure what compression costs and saves, and send dense the tensors for which
        it does not pay (the ``auto`` mode); see :func:`accordion.calibration.calibrate`."""
        from .calibration import calibrate

        return calibrate(self, bandwidth, latency, buckets=buckets, repeats=repeats,
                         compute_s=compute_s)  # fmt: skip

    def set_dense(self, keys: Iterable[str]) -> None:
        """Send these parameter keys dense from the next step on (and compress the others
        as usual). What their error-feedback memory owes goes with their next step."""
        if isinstance(keys, str):
            raise TypeError("keys must be an iterable of parameter keys, not a single str")
        keys = list(keys)
        unknown = [k for k in keys if k not in self.params.shapes]
        if unknown:
            raise ValueError(f"keys must be bound parameter keys, unknown: {unknown[:5]}")
        self.reducer.set_dense(keys)
        for key in keys:
            self.sums.forget(key)  # a dense tensor's level never matters

    @property
    def dense_keys(self) -> list[str]:
        """Keys sent dense by the cost model's choice (see :meth:`calibrate`)."""
        return [k for k in self.params.shapes if k in self.reducer.dense_keys]

    # --- decisions ------------------------------------------------------------------------

    def end_epoch(
        self,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        next_lr: float | None = None,
        lr_will_decay: bool | None = None,
    ) -> dict[str, bool]:
        """End the current epoch: decide each layer's rung for the next epochs.

        Call it on every rank after ``scheduler.step()``. A learning-rate decay is
        detected by comparing ``optimizer.param_groups[0]["lr"]`` (or ``next_lr``) with
        the value seen at the previous call; ``lr_will_decay`` overrides that. Collective
        at a check: the statistics are agreed over the ranks (``statistic``).

        Returns:
            Parameter key -> True (critical: the mildest rung) or False, for the
            compressed parameters; :meth:`rungs` gives the rung indices. The levels take
            effect from the next step.
        """
        if self.interval_unit != "epoch":
            raise ValueError("end_epoch needs interval_unit='epoch'; this state counts steps")
        counter = ("epoch", self.epoch)
        decay = self._agreed_decay("end_epoch", counter, optimizer, next_lr, lr_will_decay)
        self._warn_if_idle("end_epoch")
        self._warn_if_blind("end_epoch", optimizer, next_lr, lr_will_decay)
        if not self.adaptive or not self._compressed_keys():  # nothing has a level to pick
            self.epoch += 1
            return {}
        index = self.schedule.check_index(self.epoch)
        if index is not None:
            self._check(index, decay, f"epoch {self.epoch}")
        elif decay:  # every layer critical at once, until the next check
            self._set_rungs(dict.fromkeys(self._rungs, 0))
            self._decayed = True
        self.epoch += 1
        return self.critical()

    def end_step(
        self,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        next_lr: float | None = None,
        lr_will_decay: bool | None = None,
    ) -> dict[str, bool] | None:
        """Count one optimizer step (``interval_unit="step"``); call it on every rank
        after ``optimizer.step()`` (and after ``scheduler.step()`` if it steps per
        iteration). At the end of each window of ``interval`` steps the rule decides, as
        :meth:`end_epoch` does per epoch. A learning-rate decay switches every layer to
        the mildest rung at once, until the end of the next window.

        Returns the decisions (as :meth:`end_epoch`) at a window end, else ``None``.
        """
        if self.interval_unit != "step":
            raise ValueError("end_step needs interval_unit='step'; this state counts epochs")
        counter = ("step", self.step)
        decay = self._agreed_decay("end_step", counter, optimizer, next_lr, lr_will_decay)
        self._warn_if_idle("end_step")
        self._warn_if_blind("end_step", optimizer, next_lr, lr_will_decay)
        self.step += 1
        if not self.adaptive or not self._compressed_keys():
            return None
        index = self.schedule.check_index(self.step)
        if index is None:
            if decay:  # a decay makes every layer critical at once, not at the window end
                self._set_rungs(dict.fromkeys(self.levels(), 0), keep=True)
                self._decayed = True
            return None
        self._check(index, decay, f"the step window ending at step {self.step}")
        return self.critical()

    def _warn_if_idle(self, call: str) -> None:
        """Warn once when no gradient came through this state since the last ``call``."""
        if not self._observed and not self._warned_idle:
            self._warned_idle = True
            warnings.warn(
                f"{call}: no gradient passed through this Accordion state since the last "
                "call, so training averaged gradients without it. Likely causes: the hook "
                "was never registered (model.register_comm_hook(state, accordion_hook)), "
                "or a framework skipped it (PyTorch Lightning's DDPStrategy registers comm "
                "hooks only on CUDA; register the hook on its DDP module yourself), or a "
                "loop without DDP does not call state.reduce_gradients() after backward()",
                RuntimeWarning,
                stacklevel=3,
            )
        self._observed = False

    def _warn_if_blind(self, call: str, optimizer: Any, next_lr: Any, lr_will_decay: Any) -> None:
        """Warn once when an adaptive state's ``call`` gets no learning rate: the decays
        that make every layer critical (and open the guarded rule's last rung) go unseen."""
        given = (optimizer, next_lr, lr_will_decay)
        if self._warned_no_lr or not self.adaptive or any(g is not None for g in given):
            return
        self._warned_no_lr = True
        waits = getattr(self.rule, "wait_for_decay", False)  # the guarded rule's
        warnings.warn(
            f"{call} was called without optimizer, next_lr= or lr_will_decay=, so Accordion "
            "cannot detect learning-rate decays: no decay will make the layers critical"
            + (", and the guarded rule keeps every layer off the last rung of the ladder "
               "until a first decay" if waits else "")
            + f". Pass the optimizer (state.{call}(optimizer), after scheduler.step()), "
            "next_lr=<the rate the next period trains with> or lr_will_decay=<bool>",
            RuntimeWarning,
            stacklevel=3,
        )

    def _check(self, index: int, decay: bool, period: str) -> None:
        """One decision of the rule, from statistics agreed by every rank."""
        grad_norms, memory_norms = self._agreed_statistics()
        if not grad_norms:
            raise RuntimeError(
                f"no gradient reached the Accordion state during {period}: "
                "is the hook registered (or reduce_gradients called) every step?"
            )
        decayed = decay or self._decayed
        kept_out = self._kept_out(grad_norms, memory_norms, period)
        usable = {k: v for k, v in grad_norms.items() if k not in kept_out}
        observation = Observation(index, self.interval_unit, decay, usable,
                                  {k: v for k, v in memory_norms.items() if k in usable},
                                  dict(self._rungs), decayed, frozenset(kept_out))  # fmt: skip
        rungs = self.rule.decide(observation, self.ladder)
        if not isinstance(rungs, Mapping):
            raise TypeError(
                f"{type(self.rule).__name__}.decide must return a Mapping, got {rungs!r}"
            )
        unknown = [k for k in rungs if k not in usable]
        if unknown:
            raise ValueError(
                f"{type(self.rule).__name__}.decide named unknown layers {unknown[:5]}"
            )
        rungs = {k: self.ladder.check_rung(k, r) for k, r in rungs.items()}
        # a layer without a statistic keeps its rung (the mildest after a decay, as all)
        kept = {k: 0 if decayed else self._rungs.get(k, 0) for k in kept_out}
        merged = {k: rungs[k] if k in rungs else kept[k] for k in grad_norms
                  if k in rungs or k in kept}  # fmt: skip
        self._set_rungs(self._agreed_rungs(list(grad_norms), merged))
        self.sums.zero()
        self._decayed = False

    def _kept_out(self, grad_norms: Mapping[str, float], memory_norms: Mapping[str, float],
                  period: str) -> list[str]:  # fmt: skip
        """The layers whose agreed statistic is not finite, with a ``RuntimeWarning``: the
        check leaves their rung as it is rather than stop the training."""
        finite = math.isfinite
        kept_out = [k for k, v in grad_norms.items()
                    if not (finite(v) and finite(memory_norms.get(k, 0.0)))]  # fmt: skip
        if kept_out:
            where = {"rank0": "rank 0", "mean": "every rank"}.get(self.statistic,
                                                                 "the rank that sums it")
            warnings.warn(
                f"{period}: the gradient statistic of {len(kept_out)} layer(s), e.g. "
                f"{kept_out[:3]}, is not finite (every gradient of theirs in the period was "
                f"non-finite on {where}, or their sum overflowed): they keep their rung "
                "for this check",
                RuntimeWarning,
                stacklevel=4,
            )
        return kept_out

    def _agreed_rungs(self, keys: list[str], rungs: dict[str, int]) -> dict[str, int]:
        """Rank 0's decision, on every rank: a rule that decided otherwise elsewhere (it
        read something besides its observation) cannot make the ranks send different
        collectives."""
        transport = self.transport()
        if transport.world_size == 1:
            return rungs
        device = self._gradient_device()
        local = torch.tensor([rungs.get(k, -1) for k in keys], dtype=torch.int64, device=device)
        agreed = local.clone()
        transport.run(_single(Broadcast(agreed, 0)))
        if not torch.equal(agreed, local):
            warnings.warn(
                f"{type(self.rule).__name__} decided differently on this rank than on rank 0; "
                "rank 0's decision applies (a rule must decide from its observation alone)",
                RuntimeWarning,
                stacklevel=4,
            )
        return {k: int(r) for k, r in zip(keys, agreed.tolist()) if r >= 0}

    def _set_rungs(self, rungs: Mapping[str, int], keep: bool = False) -> None:
        """Apply ``rungs``: the decision in force, unless ``keep`` (a mid-window override)."""
        comp = self.reducer.compressor
        by_rung: dict[int, list[str]] = {}
        for key, rung in rungs.items():
            by_rung.setdefault(rung, []).append(key)
        for rung in sorted(by_rung):
            comp.set_level(self.ladder[rung], keys=by_rung[rung])
        if not keep:
            self._rungs = dict(rungs)

    def _agreed_statistics(self) -> tuple[dict[str, float], dict[str, float]]:
        """Norms of the accumulated local gradients (and of the memories, when the rule
        needs them), identical on every rank: one collective through the transport.

        A layer whose gradients of the period were all non-finite (so left out of its
        sum) has no statistic: its norm is NaN when that is so on rank 0 (``"rank0"``)
        or on every rank (``"mean"``, which averages over the ranks that have one).
        """
        transport = self.transport()
        if self._shard_owners(transport.world_size, check=True) is not None:
            return self._sharded_statistics(transport)
        keys = self.sums.keys_in(self.params.shapes)
        if not keys:
            return {}, {}
        grads = self.sums.norms(keys)
        valid = torch.stack(self.sums.valid(keys)).double()
        norms = torch.stack(grads).double()
        mean = self.statistic == "mean" and transport.world_size > 1
        # with "mean", a rank without a statistic adds 0 and is not counted
        norms = norms * valid if mean else norms.masked_fill(valid == 0, math.nan)
        parts = [norms, valid]
        with_memory = "memory_norms" in self.rule.needs
        if with_memory:
            parts.append(torch.stack([_norm(self.reducer.memory.get(k), grads[0])
                                      for k in keys]).double())  # fmt: skip
        values = torch.cat(parts)
        if transport.world_size > 1:
            op = Broadcast(values, 0) if self.statistic == "rank0" else AllReduce(values)
            transport.run(_single(op))
        n = len(keys)
        if mean:
            values[:n] /= values[n : 2 * n]  # 0 / 0 = NaN: no rank has a statistic
            values[2 * n :] /= transport.world_size
        flat = values.tolist()
        grad_norms = dict(zip(keys, flat[:n]))
        return grad_norms, dict(zip(keys, flat[2 * n :])) if with_memory else {}

    def _sharded_statistics(self, transport) -> tuple[dict[str, float], dict[str, float]]:
        """``"sharded"``: each layer's norms from the rank that sums it, the others adding
        0, in one all-reduce. A layer no rank has a sum of (no gradient yet) is left out;
        one whose owner skipped every gradient of the period has a NaN norm."""
        owners, rank = self._owners, self._rank(transport.world_size)
        keys = [k for k in self._compressed_keys() if k in owners]
        if not keys:
            return {}, {}
        with_memory = "memory_norms" in self.rule.needs
        n, device = len(keys), self._gradient_device()
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
                like = norms[0]
                values[ix + 3 * n] = torch.stack([_norm(self.reducer.memory.get(k), like)
                                                  for k in mine_keys])  # fmt: skip
        transport.run(_single(AllReduce(values)))
        flat = values.tolist()
        present = [i for i in range(n) if flat[2 * n + i]]
        grad_norms = {keys[i]: flat[i] if flat[n + i] else math.nan for i in present}
        if not with_memory:
            return grad_norms, {}
        return grad_norms, {keys[i]: flat[3 * n + i] for i in present}

    def critical(self) -> dict[str, bool]:
        """Per layer of the decision in force: whether it is at the mildest rung."""
        return {key: rung == 0 for key, rung in self._rungs.items()}

    def rungs(self) -> dict[str, int]:
        """Per layer of the decision in force: its rung (0 is the mildest)."""
        return dict(self._rungs)

    # --- statistics and checkpoints -------------------------------------------------------

    def levels(self) -> dict[str, Any]:
        """The level each bound parameter that the compressor applies to will use at the
        next step (``None`` for those the cost model sends dense). A level that does not
        pay for the parameter's shape (``Compressor.pays``) sends it dense: the ledger and
        ``stats()`` count its dense floats."""
        comp, dense = self.reducer.compressor, self.reducer.dense_keys
        return {
            k: None if k in dense else comp.level(k)
            for k, s in self.params.shapes.items()
            if comp.applies_to(s)
        }

    def dense_floats(self) -> int:
        """Paper-convention floats this rank would have sent uncompressed over the same
        steps (every recorded step of every layer dense): the reference for
        ``ledger.total_floats``."""
        world, shapes = self._world_size(), self.params.shapes
        return sum(t.steps * paper_floats(shapes[k], Dense.name, None, world)
                   for k, t in self.ledger.layers.items() if k in shapes)  # fmt: skip

    def stats(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot for logging.

        ``layers`` maps each parameter key to its current ``level`` (``None`` when it is
        sent dense), ``shape``, ``floats`` (paper convention) and ``bytes`` (wire) sent so
        far by this rank; ``checks`` is the rule's history (the paper rule: per check and
        layer, the old norm, new norm, ratio (``None`` for infinity) and the decision);
        ``dense_floats`` is what ``total_floats`` would be uncompressed;
        ``non_finite_steps`` counts the exchanges whose average held an inf or NaN, and
        ``statistic_skipped_steps`` per layer the local gradients left out of the
        statistic because they did (a host sync: it reads device counters).
        """
        comp = self.reducer.compressor
        totals = self.ledger.totals()
        compressed = set(self._compressed_keys())
        layers = {}
        for key, shape in self.params.shapes.items():
            sent = totals.get(key, {"floats": 0, "bytes": 0.0})
            layers[key] = {
                "level": comp.level(key) if key in compressed else None,
                "shape": list(shape),
                "floats": sent["floats"],
                "bytes": sent["bytes"],
            }
        return {
            "compressor": self.compressor_name,
            "mild": self.mild,
            "aggressive": self.aggressive,
            "ladder": list(self.ladder.levels),
            "epoch": self.epoch,
            "step": self.step,
            "total_floats": self.ledger.total_floats,
            "total_bytes": self.ledger.total_bytes,
            "dense_floats": self.dense_floats(),
            "non_finite_steps": self.reducer.non_finite_steps,
            "statistic_skipped_steps": self.sums.skipped_steps(),
            "dense_keys": self.dense_keys,
            "calibration": self.calibration,
            "layers": layers,
            "checks": self.rule.history,
        }

    def config(self) -> dict[str, Any]:
        """The settings a checkpoint must share with the state that loads it."""
        return {
            "compressor": self.compressor_name,
            "levels": list(self.ladder.levels),
            "interval": self.schedule.interval,
            "statistic": self.statistic,
            "interval_unit": self.interval_unit,
            "seed": self.seed,
            "rule": {"name": self.rule.name, **self.rule.config()},
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: tensors and plain values (``torch.load(weights_only=True)``).

        Error-feedback memories differ between ranks, so every rank saves its own file,
        e.g. ``torch.save(state.state_dict(), f"{dir}/accordion-rank{rank}.pt")``, and
        loads its own on resume with the same world size.
        """
        world = self._world_size()
        return {
            "format": checkpoint.FORMAT,
            "world_size": world,
            "rank": self._rank(world),
            "config": self.config(),
            "shapes": {k: list(s) for k, s in self.params.shapes.items()},
            "reducer": self.reducer.state_dict(),
            "accumulators": self.sums.state_dict(),
            "rule": self.rule.state_dict(),
            "rungs": dict(self._rungs),
            "ledger": self.ledger.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "last_lr": self._decay.last_lr,
            "decay_reference": self._decay.reference,
            "decayed": self._decayed,
            # a checkpoint taken mid-period (Lightning's, before the callback's end_epoch)
            # resumes knowing that gradients came through: no false idle warning
            "observed": self._observed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by the same rank of a job with the same world
        size, model and configuration (checkpoints of format 1, written before the policy
        layer, are read too); anything else raises ``ValueError`` naming the bad entry
        (a missing or unknown key, a shape, a level off the ladder, a type) and leaves
        this state as it was: every part is checked and loaded into a fresh object
        first, and swapped in at the end."""
        state = checkpoint.upgrade(state)
        world = self._world_size()
        rank = self._rank(world)
        _check_entries(state, self.config())
        checkpoint.check_owner(state, world, rank, self.config())
        shapes = _entry("shapes", _loaded_shapes, state["shapes"])
        previous = self.params.expected
        self.params.expect(shapes)  # the model first; restores itself when it raises
        try:
            parts = self._loaded_parts(state, shapes)
            _entry("rule", self.rule.load_state_dict, state["rule"])  # checks all first
        except BaseException:
            self.params.expected = previous
            raise
        self.reducer, self.sums, self.ledger, self._rungs, counters = parts
        self._owners = None  # "sharded": dealt out again, dropping sums it does not own
        (self.epoch, self.step, self._decay.last_lr, self._decay.reference, self._decayed,
         self._observed) = counters  # fmt: skip
        self._costs.clear()

    def _loaded_parts(self, state: Mapping[str, Any], shapes: Mapping[str, tuple]) -> tuple:
        """The reducer, sums, ledger, rungs and counters of ``state``, as new objects,
        each checked against the checkpoint's ``shapes`` and this state's ladder."""
        reducer = _entry("reducer", self._loaded_reducer, state["reducer"], shapes)
        sums = GradientSums()
        _entry("accumulators", sums.load_state_dict, state["accumulators"])
        _entry("accumulators", sums.check_shapes, shapes)
        ledger = _entry("ledger", _loaded_ledger, state["ledger"], shapes)
        rungs = _entry("rungs", self._loaded_rungs, state["rungs"], shapes)
        # decay_reference and decayed are absent from files written before the guarded rule
        rates = [_entry(key, _loaded_rate, key, state.get(key))
                 for key in ("last_lr", "decay_reference")]  # fmt: skip
        counters = (
            _entry("epoch", check_int, "the checkpoint's epoch", state["epoch"], 0),
            _entry("step", check_int, "the checkpoint's step", state["step"], 0),
            *rates,
            _entry("decayed", check_bool, "the checkpoint's decayed", state.get("decayed", False)),
            # absent from older files: True, so that an unknown past raises no false alarm
            _entry("observed", check_bool, "the checkpoint's observed",
                   state.get("observed", True)),  # fmt: skip
        )
        return reducer, sums, ledger, rungs, counters

    def _loaded_reducer(self, state: Any, shapes: Mapping[str, tuple]) -> Reducer:
        """A new reducer from ``state``, whose levels are all on this state's ladder."""
        reducer = Reducer(self._new_compressor(), ErrorFeedback())
        reducer.load_state_dict(state)
        reducer.check_shapes(shapes)
        saved = reducer.compressor.state_dict()
        levels = {"default_level": saved["default_level"],
                  **{f"levels[{k!r}]": v for k, v in saved["levels"].items()}}  # fmt: skip
        for name, level in levels.items():
            if level not in self.ladder.levels:
                raise ValueError(f"compressor {name} is {level!r}, which is not on this state's "
                                 f"ladder {list(self.ladder.levels)}")  # fmt: skip
        return reducer

    def _loaded_rungs(self, rungs: Any, shapes: Mapping[str, tuple]) -> dict[str, int]:
        """The checkpoint's rungs: a rung of this ladder for a parameter of ``shapes``."""
        if not isinstance(rungs, Mapping):
            raise ValueError(f"the checkpoint's rungs must be a Mapping, got {rungs!r:.80}")
        unknown = [k for k in rungs if k not in shapes]
        if unknown:
            raise ValueError(f"rungs {unknown[:5]} are for no parameter of shapes")
        return {k: self.ladder.check_rung(k, r) for k, r in rungs.items()}

    def _agreed_decay(self, call: str, counter: tuple[str, int], optimizer: Any,
                      next_lr: Any, lr_will_decay: bool | None) -> bool:  # fmt: skip
        """Whether the rate decays at this ``call``, once every rank has shown the same
        ``counter``, learning rate and decay (one all-gather; see ``accordion.agreement``).

        Ranks that disagree would pick different levels and fail (or hang) at the next
        step; they raise here instead, every one of them, and the state stays as it was:
        the detector's memory of the rate is restored when the agreement fails.
        """
        from .agreement import agreement_device, check_agreement  # only this method uses it

        lr = DecayDetector.lr_of(optimizer, next_lr)
        detector = self._decay
        saved = (detector.last_lr, detector.reference)
        decay = detector.decay(lr, lr_will_decay)
        try:
            transport = self.transport()
            device = agreement_device(transport, self._gradient_device())
            check_agreement(transport, call, counter, lr, decay, device)
        except BaseException:
            detector.last_lr, detector.reference = saved  # a failed call changes nothing
            raise
        return decay

    def _gradient_device(self) -> torch.device | None:
        """The device of the gradients seen so far (or of the bound module), if known."""
        if self.sums.device is not None:
            return self.sums.device
        if self._device is not None:  # "sharded": a rank may sum no layer
            return self._device
        module = self.params.module
        first = next(module.parameters(), None) if module is not None else None
        return None if first is None else first.device


#: The top-level entries of :meth:`Controller.state_dict` (files written before the
#: guarded rule lack the last three, those before the idle flag was saved the last one).
_ENTRIES = frozenset(
    "format world_size rank config shapes reducer accumulators rule rungs ledger epoch step "
    "last_lr decay_reference decayed observed".split()
)


def _timeout(timeout: Any) -> datetime.timedelta | None:
    if timeout is None:
        return None
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta or None, got {timeout!r}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return timeout


def _process_group(group: Any) -> Any:
    """``group`` if it is ``None`` or a ``ProcessGroup``; else a ``TypeError`` now rather
    than a bare ``KeyError`` at the first backward."""
    if group is None or (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        return group
    raise TypeError(
        "process_group must be None (the default group) or a "
        f"torch.distributed.ProcessGroup (e.g. from dist.new_group), got "
        f"{type(group).__name__} {group!r:.60}"
    )


def _entry(name: str, load, *args: Any) -> Any:
    """``load(*args)`` for the checkpoint's entry ``name``; any error in it becomes a
    ``ValueError`` that names the entry."""
    try:
        return load(*args)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError | IndexError) and exc.args else exc
        kind = "lacks the key" if isinstance(exc, KeyError) else "is malformed:"
        raise ValueError(f"the checkpoint's {name} {kind} {message!s}") from None


def _check_entries(state: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for an unknown top-level entry, or a configuration whose keys
    are not this state's (values are compared by ``checkpoint.check_owner``)."""
    unknown = sorted(set(state) - _ENTRIES, key=repr)
    if unknown:
        raise ValueError(f"the checkpoint has unknown entries {unknown}")
    saved = state["config"]
    if not isinstance(saved, Mapping):
        raise ValueError(f"the checkpoint's config must be a Mapping, got {saved!r:.80}")
    missing, extra = sorted(set(config) - set(saved)), sorted(set(saved) - set(config), key=repr)
    if missing or extra:
        raise ValueError(f"the checkpoint's config lacks keys {missing} and has unknown keys "
                         f"{extra}")  # fmt: skip


def _loaded_shapes(shapes: Any) -> dict[str, tuple[int, ...]]:
    """The checkpoint's parameter shapes: key -> sequence of ints >= 0."""
    if not isinstance(shapes, Mapping):
        raise ValueError(f"shapes must be a Mapping, got {type(shapes).__name__}")
    checked = {}
    for key, shape in shapes.items():
        if not isinstance(key, str) or isinstance(shape, str | bytes) or not isinstance(
            shape, Sequence
        ) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"shapes[{key!r}] must be a list of ints >= 0, got {shape!r:.80}")
        checked[key] = tuple(shape)
    return checked


def _loaded_ledger(state: Any, shapes: Mapping[str, tuple]) -> Ledger:
    """The checkpoint's ledger: per parameter of ``shapes``, counts of floats, bytes and
    steps (numbers >= 0)."""
    if not isinstance(state, Mapping) or set(state) != {"layers"}:
        raise ValueError("ledger must be {'layers': {name: {'floats', 'bytes', 'steps'}}}")
    for name, totals in state["layers"].items():
        if name not in shapes:
            raise ValueError(f"ledger layers[{name!r}] is for no parameter of shapes")
        if not isinstance(totals, Mapping) or set(totals) != {"floats", "bytes", "steps"}:
            raise ValueError(f"ledger layers[{name!r}] must hold exactly 'floats', 'bytes', "
                             f"'steps', got {totals!r:.80}")  # fmt: skip
        check_int(f"ledger layers[{name!r}]['floats']", totals["floats"], 0)
        check_int(f"ledger layers[{name!r}]['steps']", totals["steps"], 0)
        check_number(f"ledger layers[{name!r}]['bytes']", totals["bytes"], minimum=0)
    ledger = Ledger()
    ledger.load_state_dict(state)
    return ledger


def _loaded_rate(key: str, rate: Any) -> float | None:
    """A learning rate remembered by the checkpoint: ``None`` or a finite number >= 0."""
    return None if rate is None else check_number(f"the checkpoint's {key}", rate, minimum=0)


def _ladder(cls, mild: Any, aggressive: Any, levels: Sequence[Any] | None) -> Ladder:
    """The ladder from ``levels``, or from ``mild``/``aggressive`` (or their defaults)."""
    if levels is not None:
        if mild is not None or aggressive is not None:
            raise ValueError("give levels or mild/aggressive, not both")
        return Ladder(cls, levels)
    default_mild, default_aggressive = cls.default_levels
    mild = default_mild if mild is None else mild
    aggressive = default_aggressive if aggressive is None else aggressive
    cls.check_level(mild)  # the mild level's own error comes first, as it is the first given
    return Ladder(cls, (mild, aggressive))


def _rule(rule: Rule | None, eta: float | None) -> Rule:
    if rule is None:
        return GuardedRule(0.5 if eta is None else eta)
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be an accordion.policy.Rule, got {type(rule).__name__}")
    if eta is not None:
        raise ValueError("eta is the default rule's threshold: with rule=, give it to the "
                         "rule, e.g. PaperRule(eta) or GuardedRule(eta)")  # fmt: skip
    return rule


def _norm(tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The L2 norm of ``tensor`` as ``like``'s dtype (0 for no tensor: no memory)."""
    if tensor is None:
        return torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.linalg.vector_norm(tensor).to(like.dtype)


def _single(op) -> Exchange[None]:
    """An exchange of one collective."""
    yield [op]
