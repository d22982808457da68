"""Which global batch each next epoch trains with: the paper's fixed switch epoch, or the
paper rule on a ladder of two batch sizes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._validate import check_choice, check_int
from ..policy.ladder import Ladder
from ..policy.rules import Observation, PaperRule
from ..policy.schedule import Schedule
from .levels import BatchSizes
from .state import Decisions, load_decisions, to_norm
from .statistic import MeanGradient

#: Ways of choosing the batch: the paper rule, or the paper's fixed switch epoch.
MODES = ("adaptive", "fixed")
#: The name under which the whole model's statistic goes to the rule.
MODEL = "model"


class BatchDecider:
    """Decides the global batch of the epoch after each one.

    ``"adaptive"``: a :class:`~accordion.policy.Ladder` of the two :class:`BatchSizes`
    (rung 0 small), :class:`~accordion.policy.PaperRule` on the whole model's statistic
    (:class:`MeanGradient`, under the name ``"model"``), checked on an epoch
    :class:`~accordion.policy.Schedule`: critical means small. A learning-rate decay
    between checks makes it small until the next check; before the first check it is
    small. ``"fixed"``: large iff ``epoch + 1 >= fixed_switch_epoch``.

    Args:
        small, large: the two global batches (samples per optimizer step), small < large.
        interval: epochs between two checks (>= 1).
        eta: threshold on the relative change of the statistic (dimensionless, > 0).
        mode: ``"adaptive"`` or ``"fixed"``.
        fixed_switch_epoch: first epoch of the large batch in fixed mode (>= 0).
    """

    def __init__(
        self, small: int, large: int, *, interval: int, eta: float, mode: str,
        fixed_switch_epoch: int,
    ) -> None:  # fmt: skip
        self.mode = check_choice("mode", mode, MODES)
        self.fixed_switch_epoch = check_int("fixed_switch_epoch", fixed_switch_epoch, 0)
        self.ladder = Ladder(BatchSizes, (small, large))
        self.schedule = Schedule(interval, "epoch")
        self.rule = PaperRule(eta)
        self._last_epoch: int | None = None  # the last epoch decided by the rule
        # the rung in force; None before the first check: stay careful, as training starts
        self._rung: int | None = None
        self._decay_override = False  # a decay made it rung 0 until the next check
        #: The statistic of the epoch under way.
        self.gradient = MeanGradient()

    @property
    def first_batch(self) -> int:
        """The batch training starts with: small, or large in fixed mode from epoch 0."""
        at_once = self.mode == "fixed" and self.fixed_switch_epoch == 0
        return self.ladder.most_aggressive if at_once else self.ladder.mildest

    def observe(self, epoch: int, grads: Sequence[torch.Tensor]) -> None:
        """Add one step of epoch ``epoch`` to the statistic if the rule uses it (adaptive
        mode, a check epoch); ``grads`` are checked by the caller."""
        if self.mode == "adaptive" and self.schedule.collecting(epoch):
            self.gradient.add(grads)

    def decide(self, epoch: int, lr_will_decay: bool, gathered_in: int) -> int:
        """The batch of the epoch after ``epoch`` (checked by the caller), from the
        statistic gathered in epoch ``gathered_in`` (the one after the last decided, for
        messages); starts the statistic anew.

        Raises:
            ValueError: a check epoch without any step observed, or a statistic that is
                not finite; nothing changes then.
        """
        if self.mode == "fixed":
            rung = self.ladder.top if epoch + 1 >= self.fixed_switch_epoch else 0
        else:
            rung = self._adaptive_rung(epoch, lr_will_decay, gathered_in)
            self._last_epoch = epoch
        self.gradient = MeanGradient()
        return self.ladder[rung]

    def _adaptive_rung(self, epoch: int, lr_will_decay: bool, gathered_in: int) -> int:
        index = self.schedule.check_index(epoch)
        if index is not None:
            statistic = self.gradient.statistic()
            if statistic is None:
                raise ValueError(
                    f"epoch {epoch} is a check epoch (interval={self.schedule.interval}) but "
                    f"no optimizer step was observed: call observe(grads) once per optimizer "
                    f"step during the epoch (it accumulates only in the epoch after the last "
                    f"end_epoch, here epoch {gathered_in})"
                )
            norms = {MODEL: to_norm(MODEL, statistic)}  # refuses a statistic that is not finite
            observation = Observation(index, "epoch", lr_will_decay, norms)
            self._rung = self.rule.decide(observation, self.ladder)[MODEL]
            self._decay_override = lr_will_decay
        elif lr_will_decay:  # critical at once, until the next check
            self._rung = None if self._rung is None else 0
            self._decay_override = True
        return 0 if self._rung is None else self._rung

    def state_dict(self) -> dict[str, Any]:
        """The controller state's ``accumulator`` (the statistic's sums, a list of tensors,
        or None), ``observed_steps`` and ``detector`` (:class:`~.state.Decisions`)."""
        critical = {} if self._rung is None else {MODEL: self._rung == 0}
        decisions = Decisions(self._last_epoch, self.rule.norms, critical,
                              self._decay_override, self.rule.history)  # fmt: skip
        return {
            "accumulator": self.gradient.sums(),
            "observed_steps": self.gradient.steps,
            "detector": decisions.state(self.schedule.interval, self.rule.eta),
        }

    def load_state_dict(
        self, accumulator: list[torch.Tensor] | None, observed_steps: int, detector: Mapping
    ) -> None:
        """Restore :meth:`state_dict`'s entries, the first two checked by the caller;
        nothing changes when the ``detector`` entry is refused (``load_decisions``)."""
        decisions = load_decisions(detector, self.schedule.interval, self.rule.eta,
                                   "RegimeDetector")  # fmt: skip
        rule = PaperRule(self.rule.eta)
        rule.load_state_dict({"norms": decisions.norms, "history": decisions.history})
        gradient = MeanGradient(accumulator, observed_steps)
        critical = decisions.critical.get(MODEL)
        self._rung = None if critical is None else 0 if critical else self.ladder.top
        self._last_epoch, self._decay_override = decisions.last_epoch, decisions.decay_override
        self.rule, self.gradient = rule, gradient
