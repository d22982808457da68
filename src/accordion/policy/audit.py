"""The audit rule: each layer at the most compressed rung that still follows the true
average gradient, as measured on one uncompressed step per period.

Under AdamW and clipping the paper's norm test is blind on a character transformer
(``docs/dense-quality.md``): it measures how fast training changes, not how well a level
follows it. What separated the levels that kept dense quality from those that lost it was
the relative error of the compressed average against the true one, ``|g_hat - g| / |g|``
(kept: at most 0.30; lost: at least 0.46). The controller therefore sends the first step
of every period uncompressed (an *audit*), compresses that true average locally at every
rung of the ladder (no traffic: every rank holds the same average and gets the same
errors), and hands the errors to :meth:`AuditRule.measured`. At the check, each layer
takes the most compressed rung whose error stays within ``tau`` at the last two audits.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from .._validate import check_number
from .ladder import Ladder
from .rules import Observation, Rule, check_rule_state


def check_tau(tau: Any) -> float:
    """Validate the audit rule's error budget (a relative error in (0, 1]) and return it."""
    return check_number("tau", tau, minimum=0, strict=True, maximum=1)


class AuditRule(Rule):
    """Per layer, the most compressed rung whose relative error on the audited steps
    stays within ``tau``; rung 0 when none does.

    Args:
        tau: the error budget, ``|C(g) - g| / |g|`` of a layer's true average gradient
            ``g`` compressed at a rung (dimensionless; 0.3 from the signal study).

    The errors come from the controller (``needs = {"audit"}``): at the first step of
    every period it averages every gradient dense (its bytes are counted), then calls
    :meth:`measured`. A layer is judged on the larger of its last two audits' errors, so
    one lucky audit never sends it down. ``history`` holds one record per check::

        {"index": int, "layers": {name: {"errors": [float per rung], "rung": int}}}
    """

    name = "audit"
    needs = frozenset({"audit"})
    decay_drop = 0.5  # the audit measures; only a halving of the rate counts as a decay
    default_interval = 1

    def __init__(self, tau: float = 0.3):
        super().__init__()
        self.tau = check_tau(tau)
        #: Per layer, its errors at each rung at the audit of the current period.
        self.pending: dict[str, list[float]] = {}
        #: Per layer, its errors at the previous period's audit.
        self.previous: dict[str, list[float]] = {}

    def measured(self, errors: Mapping[str, Sequence[float]]) -> None:
        """Take an audit's errors: per layer, the relative error at each rung."""
        for name, values in errors.items():
            self.pending[str(name)] = [float(v) for v in values]

    def decide(self, observation: Observation, ladder: Ladder) -> dict[str, int]:
        rungs, layers = {}, {}
        for name in observation.grad_norms:
            now = self.pending.get(name)
            if now is None:  # not audited (the period had no step): keep the rung
                rungs[name] = observation.rungs.get(name, 0)
                continue
            before = self.previous.get(name, now)
            worst = [max(a, b) for a, b in zip(now, before)]
            rungs[name] = self._rung(worst, ladder)
            layers[name] = {"errors": now, "rung": rungs[name]}
        self.previous = {**self.previous, **self.pending}
        self.pending = {}
        self.history.append({"index": observation.index, "layers": layers})
        return rungs

    def _rung(self, errors: Sequence[float], ladder: Ladder) -> int:
        """The most compressed rung whose error is within the budget (0 if none)."""
        within = [r for r, e in enumerate(errors[: len(ladder)]) if e <= self.tau]
        return max(within, default=0)

    def config(self) -> dict[str, Any]:
        return {"tau": self.tau}

    def state_dict(self) -> dict[str, Any]:
        return {"pending": copy.deepcopy(self.pending), "previous": copy.deepcopy(self.previous),
                "history": copy.deepcopy(self.history)}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` naming the bad entry (and nothing
        changed) for anything else."""
        check_rule_state(state, "AuditRule", frozenset({"pending", "previous", "history"}))
        pending = _loaded_errors(state["pending"], "pending")
        previous = _loaded_errors(state["previous"], "previous")
        super().load_state_dict(state)
        self.pending, self.previous = pending, previous


def _loaded_errors(errors: Any, entry: str) -> dict[str, list[float]]:
    """A state's errors: per layer name, a list of numbers >= 0 (NaN kept: it compares
    with nothing, so its rung is never chosen)."""
    if not isinstance(errors, Mapping):
        raise ValueError(f"AuditRule {entry} must be a Mapping, got {type(errors).__name__}")
    checked = {}
    for name, values in errors.items():
        ok = isinstance(values, list) and all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) and not v < 0
            for v in values
        )
        if not ok:
            raise ValueError(f"AuditRule {entry}[{name!r}] must be a list of numbers >= 0, "
                             f"got {values!r}")  # fmt: skip
        checked[str(name)] = [float(v) for v in values]
    return checked
