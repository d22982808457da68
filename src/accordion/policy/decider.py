"""The decider: the policy over time, from one end of a period to the next.

It holds the :class:`~.ladder.Ladder`, the :class:`~.rules.Rule`, the
:class:`~.schedule.Schedule`, the :class:`~.schedule.DecayDetector`, the rung each layer
is on and where the schedule stands (epochs and steps). :meth:`Decider.end` is the one
end of a period, for ``end_epoch`` and ``end_step`` alike. What it needs of the ranks
and of the controller (the agreement, the statistic, the compressor's levels) it asks
through a :class:`Host`, so that it stays plain logic.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .guarded import GuardedRule
from .ladder import Ladder
from .rules import Observation, Rule
from .schedule import DecayDetector, Schedule


class Host(Protocol):
    """What a :class:`Decider` asks of the controller that holds it."""

    #: Where a layer's statistic comes from, in words (for warnings): "rank 0", ...
    source: str

    def agree(self, call: str, counter: tuple[str, int], lr: float | None, decay: bool) -> None:
        """Raise on every rank unless all ranks give the same ``counter``, rate and decay."""

    def compressed(self) -> list[str]:
        """The layers that have a level, whose rungs are decided."""

    def applied(self) -> list[str]:
        """The layers the compressor applies to (those sent dense included)."""

    def statistics(self) -> tuple[dict[str, float], dict[str, float]]:
        """Per layer, the agreed gradient norm, and memory norm when the rule needs it."""

    def agreed_rungs(self, keys: list[str], rungs: dict[str, int]) -> dict[str, int]:
        """Rank 0's ``rungs`` of ``keys``, on every rank."""

    def set_level(self, level: Any, keys: list[str]) -> None:
        """Send ``keys`` at ``level`` from the next step on."""

    def checked(self) -> None:
        """A check used the statistic: the next period gathers it anew."""


class Decider:
    """Which rung each layer is on, and when and how that changes.

    Args:
        ladder: the levels, mildest first.
        rule: decides the rungs at each check.
        schedule: when the checks are (every ``interval`` epochs or steps).
    """

    def __init__(self, ladder: Ladder, rule: Rule, schedule: Schedule):
        rule.check_ladder(ladder)  # before the first check, not at it
        self.ladder, self.rule, self.schedule = ladder, rule, schedule
        #: Learning-rate decays, as the rule's ``decay_drop`` counts them.
        self.detector = DecayDetector(rule.decay_drop)
        #: The decision in force: per layer, its rung (0 is the mildest).
        self.rungs: dict[str, int] = {}
        #: Whether the rate decayed since the last check (``Observation.decayed``).
        self.decayed = False
        #: Epochs ended so far (the index of the current epoch).
        self.epoch = 0
        #: Optimizer steps (or hook iterations) seen so far.
        self.step = 0
        #: Whether a gradient came through since the last end of a period.
        self.observed = False
        self._warned_idle = False  # the "hook never ran" warning is given once
        self._warned_no_lr = False  # the "decays cannot be seen" warning is given once

    def end(self, optimizer: Any, next_lr: Any, lr_will_decay: bool | None,
            host: Host) -> dict[str, bool] | None:  # fmt: skip
        """End the current epoch or step (the schedule's unit): once every rank agrees on
        where it is, decide the rungs when a check is due, or put every layer on rung 0
        at a learning-rate decay between checks.

        Returns, per layer with a level, whether it is critical (on rung 0): at every
        epoch (``{}`` when nothing has a level to pick), at a step only when a check
        decided (else ``None``).
        """
        unit = self.schedule.unit
        call = f"end_{unit}"
        counter = (unit, self.epoch if unit == "epoch" else self.step)
        decay = self._agreed_decay(call, counter, optimizer, next_lr, lr_will_decay, host)
        self._warn_if_idle(call)
        self._warn_if_blind(call, optimizer, next_lr, lr_will_decay)
        if unit == "step":
            self.step += 1
        active = self.ladder.adaptive and bool(host.compressed())  # anything to pick?
        index = None
        if active:
            index = self.schedule.check_index(self.epoch if unit == "epoch" else self.step)
        if index is not None:
            self._check(index, decay, self._period(), host)
        elif active and decay:  # every layer critical at once, until the next check
            self._override(host)
        if unit == "epoch":
            self.epoch += 1
            return self.critical() if active else {}
        return None if index is None else self.critical()

    def restore(self, rungs: dict[str, int], counters: Sequence[Any]) -> None:
        """Go on from a checkpoint's ``rungs`` and ``counters`` (epoch, step, last rate,
        decay reference, decayed, observed), checked by ``accordion.checkpoint.format``."""
        self.rungs = rungs
        (self.epoch, self.step, self.detector.last_lr, self.detector.reference, self.decayed,
         self.observed) = counters  # fmt: skip

    def rename(self, renamed: Mapping[str, str]) -> None:
        """Move the rungs of lazily named layers to their names (``{old: new}``)."""
        for old, new in renamed.items():
            if old in self.rungs:
                self.rungs[new] = self.rungs.pop(old)

    def critical(self) -> dict[str, bool]:
        """Per layer of the decision in force: whether it is at the mildest rung."""
        return {key: rung == 0 for key, rung in self.rungs.items()}

    def set_rungs(self, rungs: Mapping[str, int], host: Host, keep: bool = False) -> None:
        """Apply ``rungs``: the decision in force, unless ``keep`` (a mid-window override)."""
        by_rung: dict[int, list[str]] = {}
        for key, rung in rungs.items():
            by_rung.setdefault(rung, []).append(key)
        for rung in sorted(by_rung):
            host.set_level(self.ladder[rung], by_rung[rung])
        if not keep:
            self.rungs = dict(rungs)

    def _period(self) -> str:
        """The period that ends, in words."""
        if self.schedule.unit == "epoch":
            return f"epoch {self.epoch}"
        return f"the step window ending at step {self.step}"

    def _override(self, host: Host) -> None:
        """The learning-rate decay override: every layer on rung 0 until the next check
        (an epoch's becomes the decision in force; a step's keeps it for the check)."""
        if self.schedule.unit == "epoch":
            self.set_rungs(dict.fromkeys(self.rungs, 0), host)
        else:
            self.set_rungs(dict.fromkeys(host.applied(), 0), host, keep=True)
        self.decayed = True

    def _agreed_decay(self, call: str, counter: tuple[str, int], optimizer: Any,
                      next_lr: Any, lr_will_decay: bool | None, host: Host) -> bool:  # fmt: skip
        """Whether the rate decays at this ``call``, once every rank has shown the same
        ``counter``, learning rate and decay (see ``accordion.agreement``).

        Ranks that disagree would pick different levels and fail (or hang) at the next
        step; they raise here instead, every one of them, and the state stays as it was:
        the detector's memory of the rate is restored when the agreement fails.
        """
        lr = DecayDetector.lr_of(optimizer, next_lr)
        detector = self.detector
        saved = (detector.last_lr, detector.reference)
        decay = detector.decay(lr, lr_will_decay)
        try:
            host.agree(call, counter, lr, decay)
        except BaseException:
            detector.last_lr, detector.reference = saved  # a failed call changes nothing
            raise
        return decay

    def _warn_if_idle(self, call: str) -> None:
        """Warn once when no gradient came through this state since the last ``call``."""
        if not self.observed and not self._warned_idle:
            self._warned_idle = True
            warnings.warn(
                f"{call}: no gradient passed through this Accordion state since the last "
                "call, so training averaged gradients without it. Likely causes: the hook "
                "was never registered (model.register_comm_hook(state, accordion_hook)), "
                "or a framework skipped it (PyTorch Lightning's DDPStrategy registers comm "
                "hooks only on CUDA; register the hook on its DDP module yourself), or a "
                "loop without DDP does not call state.reduce_gradients() after backward()",
                RuntimeWarning,
                stacklevel=4,
            )
        self.observed = False

    def _warn_if_blind(self, call: str, optimizer: Any, next_lr: Any, lr_will_decay: Any) -> None:
        """Warn once when an adaptive state's ``call`` gets no learning rate: the decays
        that make every layer critical (and open the guarded rule's last rung) go unseen."""
        given = (optimizer, next_lr, lr_will_decay)
        if self._warned_no_lr or not self.ladder.adaptive or any(g is not None for g in given):
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
            stacklevel=4,
        )

    def _check(self, index: int, decay: bool, period: str, host: Host) -> None:
        """One decision of the rule, from statistics agreed by every rank."""
        grad_norms, memory_norms = host.statistics()
        if not grad_norms:
            raise RuntimeError(
                f"no gradient reached the Accordion state during {period}: "
                "is the hook registered (or reduce_gradients called) every step?"
            )
        decayed = decay or self.decayed
        kept_out = self._kept_out(grad_norms, memory_norms, period, host)
        usable = {k: v for k, v in grad_norms.items() if k not in kept_out}
        observation = Observation(index, self.schedule.unit, decay, usable,
                                  {k: v for k, v in memory_norms.items() if k in usable},
                                  dict(self.rungs), decayed, frozenset(kept_out))  # fmt: skip
        rungs = self._decided(observation, usable)
        # a layer without a statistic keeps its rung (the mildest after a decay, as all)
        kept = {k: 0 if decayed else self.rungs.get(k, 0) for k in kept_out}
        merged = {k: rungs[k] if k in rungs else kept[k] for k in grad_norms
                  if k in rungs or k in kept}  # fmt: skip
        self.set_rungs(host.agreed_rungs(list(grad_norms), merged), host)
        host.checked()
        self.decayed = False

    def _decided(self, observation: Observation, usable: Mapping[str, float]) -> dict[str, int]:
        """The rule's rungs for ``observation``, checked: a Mapping of layers it was shown
        to rungs of the ladder."""
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
        return {k: self.ladder.check_rung(k, r) for k, r in rungs.items()}

    def _kept_out(self, grad_norms: Mapping[str, float], memory_norms: Mapping[str, float],
                  period: str, host: Host) -> list[str]:  # fmt: skip
        """The layers whose agreed statistic is not finite, with a ``RuntimeWarning``: the
        check leaves their rung as it is rather than stop the training."""
        finite = math.isfinite
        kept_out = [k for k, v in grad_norms.items()
                    if not (finite(v) and finite(memory_norms.get(k, 0.0)))]  # fmt: skip
        if kept_out:
            warnings.warn(
                f"{period}: the gradient statistic of {len(kept_out)} layer(s), e.g. "
                f"{kept_out[:3]}, is not finite (every gradient of theirs in the period was "
                f"non-finite on {host.source}, or their sum overflowed): they keep their rung "
                "for this check",
                RuntimeWarning,
                stacklevel=5,
            )
        return kept_out


def ladder_of(kind: Any, mild: Any, aggressive: Any, levels: Sequence[Any] | None) -> Ladder:
    """The ladder from ``levels``, or from ``mild``/``aggressive`` (or ``kind``'s
    ``default_levels``)."""
    if levels is not None:
        if mild is not None or aggressive is not None:
            raise ValueError("give levels or mild/aggressive, not both")
        return Ladder(kind, levels)
    default_mild, default_aggressive = kind.default_levels
    mild = default_mild if mild is None else mild
    aggressive = default_aggressive if aggressive is None else aggressive
    kind.check_level(mild)  # the mild level's own error comes first, as it is the first given
    return Ladder(kind, (mild, aggressive))


def rule_of(rule: Rule | None, eta: float | None) -> Rule:
    """``rule``, or the default rule (``GuardedRule(eta)``, eta 0.5 by default)."""
    if rule is None:
        return GuardedRule(0.5 if eta is None else eta)
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be an accordion.policy.Rule, got {type(rule).__name__}")
    if eta is not None:
        raise ValueError("eta is the default rule's threshold: with rule=, give it to the "
                         "rule, e.g. PaperRule(eta) or GuardedRule(eta)")  # fmt: skip
    return rule


__all__ = ["Decider", "Host", "ladder_of", "rule_of"]
