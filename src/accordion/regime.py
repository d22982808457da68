"""The detectors of versions before issue 23, kept as thin shims over the policy layer.

Accordion's rule is :class:`accordion.policy.PaperRule` (per tensor, critical when the norm
of its summed gradient changes by ``eta`` or more between two checks, or when the learning
rate decays) and its timing an :class:`accordion.policy.Schedule`; callers with norms of
their own use those two, as :class:`accordion.batch.BatchSizeController` does. What is
left here is the per-name bookkeeping of the old interface (the decision in force, names
seen between checks, the decay override) so that its importers keep working; its state
has the layout of :mod:`accordion.batch.state` (``Decisions``), which BatchSizeController
checkpoints hold under ``"detector"``. To be removed with its last importers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._validate import check_bool, check_int, check_state_keys
from .batch.state import Decisions, check_norms, load_decisions
from .policy.rules import PaperRule
from .policy.schedule import Schedule

__all__ = ["RegimeDetector", "StepRegimeDetector"]

_STEP_STATE_KEYS = frozenset({"interval_steps", "windows", "detector"})


class RegimeDetector:
    """The paper rule per tensor, checked every ``interval`` epochs (epochs ``0, interval,
    ...``); between checks the decision stands, and a learning-rate decay makes every
    tensor critical until the next check. A check compares with the last check that ran.

    Args:
        interval: epochs between two checks (>= 1; paper: 10).
        eta: threshold on the relative change of a norm (dimensionless, paper: 0.5).

    ``history`` is the rule's: one record per check, as :class:`~accordion.policy.PaperRule`.
    """

    def __init__(self, interval: int = 10, eta: float = 0.5) -> None:
        self._schedule = Schedule(interval, "epoch")
        self._rule = PaperRule(eta)
        self._last_epoch: int | None = None
        self._critical: dict[str, bool] = {}
        self._decay_override = False

    interval = property(lambda self: self._schedule.interval, doc="Epochs between two checks.")
    eta = property(lambda self: self._rule.eta, doc="Threshold on a norm's relative change.")
    last_epoch = property(lambda self: self._last_epoch, doc="The last epoch given, or None.")
    decay_override = property(lambda self: self._decay_override, doc="A decay is in force.")
    history = property(lambda self: self._rule.history, doc="One record per check.")

    @property
    def critical(self) -> dict[str, bool]:
        """The decision in force, tensor name -> critical (a copy; empty before any call)."""
        return dict(self._critical)

    def needs_statistic(self, epoch: int) -> bool:
        """Whether :meth:`end_epoch` of ``epoch`` (>= 0) uses the norms (a check epoch)."""
        return self._schedule.check_index(check_int("epoch", epoch, 0)) is not None

    def end_epoch(
        self, epoch: int, norms: Mapping[str, float], lr_will_decay: bool = False
    ) -> dict[str, bool]:
        """Record the end of ``epoch`` (after the last one given) with each tensor's norm
        (a float >= 0; ignored but checked outside check epochs) and return tensor name ->
        critical for the epochs that follow: at a check, exactly the names in ``norms``;
        between checks, the decision in force plus new names, critical.

        Raises:
            TypeError: an argument of the wrong type.
            ValueError: ``epoch`` not after the last one, a negative or non-finite norm, or
                empty ``norms`` at a check epoch.
        """
        epoch = check_int("epoch", epoch, 0)
        checked = check_norms(norms)
        lr_will_decay = check_bool("lr_will_decay", lr_will_decay)
        if self._last_epoch is not None and epoch <= self._last_epoch:
            raise ValueError(
                f"epoch must be greater than the last epoch given ({self._last_epoch}): "
                f"epochs are given in increasing order, got {epoch}"
            )
        is_check = self._schedule.check_index(epoch) is not None
        if is_check and not checked:
            # an empty check would forget every tensor: almost surely a skipped accumulation
            raise ValueError(
                f"norms must name at least one tensor at a check epoch "
                f"(epoch % interval == 0, interval={self.interval}), got {{}} at epoch {epoch}"
            )
        self._last_epoch = epoch
        if is_check:
            self._critical = self._rule.critical(epoch, checked, lr_will_decay)
            self._decay_override = lr_will_decay
        else:
            for name in checked:
                # a tensor never seen has no history to judge it by: be careful with it
                self._critical.setdefault(name, True)
            if lr_will_decay:
                self._critical = dict.fromkeys(self._critical, True)
                self._decay_override = True
        return dict(self._critical)

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (a deep copy), in the layout of ``Decisions.state``."""
        decisions = Decisions(self._last_epoch, self._rule.norms, self._critical,
                              self._decay_override, self._rule.history)  # fmt: skip
        return decisions.state(self.interval, self.eta)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same ``interval`` and ``eta``; nothing
        changes when it raises (see ``accordion.batch.state.load_decisions``)."""
        decisions = load_decisions(state, self.interval, self.eta, "RegimeDetector")
        rule = PaperRule(self.eta)
        rule.load_state_dict({"norms": decisions.norms, "history": decisions.history})
        self._rule, self._last_epoch = rule, decisions.last_epoch
        self._critical, self._decay_override = decisions.critical, decisions.decay_override


class StepRegimeDetector:
    """The paper rule on windows of ``interval_steps`` optimizer steps: each window is a
    check epoch of a :class:`RegimeDetector` with ``interval=1``, whose ``"epoch"`` in the
    history is the 0-based window index.

    Args:
        interval_steps: optimizer steps per window (>= 1).
        eta: threshold on the relative change of a norm (dimensionless, paper: 0.5).
    """

    def __init__(self, interval_steps: int, eta: float = 0.5) -> None:
        self._interval_steps = check_int("interval_steps", interval_steps, 1)
        self._detector = RegimeDetector(interval=1, eta=eta)
        self._windows = 0  # windows ended so far, i.e. the index of the next window

    interval_steps = property(lambda self: self._interval_steps, doc="Steps per window.")
    eta = property(lambda self: self._detector.eta, doc="Threshold on a norm's relative change.")
    windows = property(lambda self: self._windows, doc="Windows ended so far.")
    critical = property(lambda self: self._detector.critical, doc="The decision in force.")
    history = property(lambda self: self._detector.history, doc="One record per window.")

    def needs_statistic(self, step: int) -> bool:
        """Always True (``step`` >= 0 is validated): every window is compared with the last."""
        check_int("step", step, 0)
        return True

    def window_ends(self, step: int) -> bool:
        """Whether 0-based optimizer step ``step`` is the last of its window."""
        return (check_int("step", step, 0) + 1) % self._interval_steps == 0

    def end_window(
        self, norms: Mapping[str, float], lr_will_decay: bool = False
    ) -> dict[str, bool]:
        """End the current window with each tensor's norm of the gradient summed over its
        steps (at least one) and return tensor name -> critical for the next window."""
        decision = self._detector.end_epoch(self._windows, norms, lr_will_decay)
        self._windows += 1
        return decision

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values: ``interval_steps``, ``windows`` and the inner ``detector``'s."""
        return {
            "interval_steps": self._interval_steps,
            "windows": self._windows,
            "detector": self._detector.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same ``interval_steps`` and ``eta``.

        Raises:
            TypeError: a value has the wrong type.
            ValueError: not a Mapping, missing or unknown keys, a different
                ``interval_steps`` or ``eta``, or a window count that disagrees.
        """
        check_state_keys(state, _STEP_STATE_KEYS, "StepRegimeDetector")
        if state["interval_steps"] != self._interval_steps:
            raise ValueError(
                f"state['interval_steps'] is {state['interval_steps']!r} steps but this "
                f"detector's interval_steps is {self._interval_steps}: build the detector "
                f"with the same interval_steps"
            )
        windows = check_int("state['windows']", state["windows"], 0)
        # load into a fresh detector first, so that a bad state leaves this one untouched
        detector = RegimeDetector(interval=1, eta=self._detector.eta)
        detector.load_state_dict(state["detector"])
        # window w is the inner detector's epoch w, so the two counters must agree
        last = detector.last_epoch
        if windows != (0 if last is None else last + 1):
            raise ValueError(
                f"state['windows'] is {windows} but state['detector']['last_epoch'] is "
                f"{last!r}: expected windows == last_epoch + 1 (0 when None)"
            )
        self._detector = detector
        self._windows = windows
