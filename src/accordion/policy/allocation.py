"""L-GreCo's per-layer allocation (Alimohammadi et al., MLSys 2024) as a rule: each layer
at its own rung, the fewest bytes whose summed squared compression error stays within
that of one reference rung everywhere.

At the first step of every period the controller compresses each rank's error-fed
accumulator ``g + e`` of every layer at every rung, locally (nothing is sent but the
results), and all-reduces the squared errors ``|C_r(g + e) - (g + e)|^2`` summed over the
ranks, beside each rung's wire bytes (``needs = {"errors"}``; see
:func:`accordion.audit.measured_exchange`). At the check the rule solves the allocation
exactly, on the Pareto front of (bytes, error) built one layer at a time.

On the character transformer the squared norm of the gradient sits in a few tensors (the
tied token embedding held half of it), so within the error of 2-bit ``nq`` everywhere the
allocation sends about 1.5x fewer bytes by giving those tensors more bits and the block
matrices 1 bit (``docs/dense-quality.md``).
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from .._validate import check_int
from .ladder import Ladder
from .rules import (
    Observation,
    Rule,
    check_eta,
    check_rule_state,
    kept_norms,
    loaded_norms,
    paper_check,
)


class AllocationRule(Rule):
    """Per layer, a rung such that the layers' bytes are fewest while their summed squared
    error stays within the error of rung ``reference`` for every layer (L-GreCo).

    Args:
        reference: the rung whose uniform error is the budget (an index into the ladder,
            0 the mildest); rungs milder than it buy room for coarser ones elsewhere.

    ``history`` holds one record per check::

        {"index": int, "budget": float, "bytes": float, "reference_bytes": float,
         "layers": {name: int}}

    (bytes per rank per step, as the ladder's compressors send them.)
    """

    name = "lgreco"
    needs = frozenset({"errors"})
    decay_drop = 0.5  # measured, not scheduled: only a halving counts as a decay
    default_interval = 1

    def __init__(self, reference: int = 0):
        super().__init__()
        self.reference = check_int("reference", reference, minimum=0)
        #: Per layer, ``(squared errors, bytes)`` per rung, measured in the current period.
        self.pending: dict[str, tuple[list[float], list[float]]] = {}

    def measured(self, errors: Mapping[str, Sequence[float]],
                 sizes: Mapping[str, Sequence[float]]) -> None:  # fmt: skip
        """Take one measurement: per layer, the squared error and the bytes at each rung."""
        for name, values in errors.items():
            self.pending[str(name)] = ([float(v) for v in values],
                                       [float(b) for b in sizes[name]])  # fmt: skip

    def check_ladder(self, ladder: Ladder) -> None:
        """``ValueError`` unless ``reference`` is a rung of ``ladder``."""
        if self.reference >= len(ladder):
            raise ValueError(f"reference must be a rung of the ladder (0 to {ladder.top}), "
                             f"got {self.reference}")  # fmt: skip

    def decide(self, observation: Observation, ladder: Ladder) -> dict[str, int]:
        self.check_ladder(ladder)
        names = [n for n in observation.grad_norms if n in self.pending]
        rungs = {n: observation.rungs.get(n, 0) for n in observation.grad_norms}
        if names:
            choices = [list(zip(self.pending[n][1], self.pending[n][0]))[: len(ladder)]
                       for n in names]  # fmt: skip
            budget = sum(c[self._budget_rung(n, observation)][1] for n, c in zip(names, choices))
            cost, picked = cheapest_within(choices, budget)
            rungs.update(zip(names, picked))
            self.history.append({
                "index": observation.index, "budget": budget, "bytes": cost,
                "reference_bytes": sum(c[self.reference][0] for c in choices),
                "layers": dict(zip(names, picked)),
            })  # fmt: skip
        self.pending = {}
        return rungs

    def _budget_rung(self, name: str, observation: Observation) -> int:
        """The rung whose error layer ``name`` adds to the budget: the reference."""
        return self.reference

    def config(self) -> dict[str, Any]:
        return {"reference": self.reference}

    def state_dict(self) -> dict[str, Any]:
        return {"pending": {n: [list(e), list(b)] for n, (e, b) in self.pending.items()},
                "history": copy.deepcopy(self.history)}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` naming the bad entry (and nothing
        changed) for anything else."""
        check_rule_state(state, "AllocationRule", frozenset({"pending", "history"}))
        pending = _loaded_pending(state["pending"])
        super().load_state_dict(state)
        self.pending = pending


class RegimeAllocationRule(AllocationRule):
    """L-GreCo's allocation under a budget that Accordion's norm test sets: a layer in a
    critical regime (its summed gradient's norm changed by ``eta`` or more since the last
    check, or the learning rate decays: :class:`~.rules.PaperRule`'s test) adds its error
    at rung 0 to the budget, a calm layer its error at ``reference``. The allocation then
    spends that budget over the layers as :class:`AllocationRule` does.

    Args:
        reference: the rung whose error a calm layer adds to the budget.
        eta: the norm test's threshold (dimensionless, the paper's 0.5).

    ``history`` records as :class:`AllocationRule`'s, with ``"critical"``: the names of
    the layers judged critical at the check.
    """

    name = "lgreco-regime"
    decay_drop = 0.5  # as the guarded rule: on a cosine every check has a lower rate

    def __init__(self, reference: int = 0, eta: float = 0.5):
        super().__init__(reference)
        self.eta = check_eta(eta)
        #: Norms remembered at the last check, compared at the next one.
        self.norms: dict[str, float] = {}
        self._critical: dict[str, bool] = {}

    def decide(self, observation: Observation, ladder: Ladder) -> dict[str, int]:
        self._critical, _ = paper_check(observation.grad_norms, self.norms, self.eta,
                                        observation.lr_will_decay)  # fmt: skip
        self.norms = kept_norms(self.norms, observation)
        before = len(self.history)
        rungs = super().decide(observation, ladder)
        if len(self.history) > before:
            self.history[-1]["critical"] = sorted(n for n, c in self._critical.items() if c)
        return rungs

    def _budget_rung(self, name: str, observation: Observation) -> int:
        """Rung 0 for a critical layer, the reference for a calm one."""
        return 0 if self._critical.get(name, True) else self.reference

    def config(self) -> dict[str, Any]:
        return {"reference": self.reference, "eta": self.eta}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "norms": dict(self.norms)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` naming the bad entry (and nothing
        changed) for anything else."""
        check_rule_state(state, "RegimeAllocationRule", frozenset({"pending", "history", "norms"}))
        norms = loaded_norms(state["norms"], "RegimeAllocationRule")
        super().load_state_dict({k: v for k, v in state.items() if k != "norms"})
        self.norms = norms


def cheapest_within(choices: Sequence[Sequence[tuple[float, float]]],
                    budget: float) -> tuple[float, list[int]]:  # fmt: skip
    """One ``(bytes, error)`` option per item, the fewest summed bytes whose summed error
    is within ``budget``: ``(bytes, index chosen per item)``. Exact: the Pareto front of
    the partial sums, one item at a time (NaN errors are never chosen)."""
    front: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
    for options in choices:
        merged = sorted((b + cb, e + ce, picked + (i,)) for b, e, picked in front
                        for i, (cb, ce) in enumerate(options) if not math.isnan(ce))  # fmt: skip
        front, best = [], math.inf
        for b, e, picked in merged:  # ascending bytes: keep the strictly falling errors
            if e < best:
                front.append((b, e, picked))
                best = e
    within = [f for f in front if f[1] <= budget * (1 + 1e-9)]
    cost, _, picked = min(within, key=lambda f: f[0]) if within else front[-1]
    return cost, list(picked)


def _loaded_pending(pending: Any) -> dict[str, tuple[list[float], list[float]]]:
    """A state's measurements: per layer name, two equal-length lists of numbers >= 0."""
    if not isinstance(pending, Mapping):
        raise ValueError(f"AllocationRule pending must be a Mapping, got {type(pending).__name__}")
    checked = {}
    for name, entry in pending.items():
        ok = (isinstance(entry, (list, tuple)) and len(entry) == 2
              and all(isinstance(part, (list, tuple)) for part in entry)
              and len(entry[0]) == len(entry[1])
              and all(isinstance(v, numbers.Real) and not isinstance(v, bool) and not v < 0
                      for part in entry for v in part))  # fmt: skip
        if not ok:
            raise ValueError(f"AllocationRule pending[{name!r}] must be [errors, bytes], two "
                             f"lists of numbers >= 0 of one length, got {entry!r}")  # fmt: skip
        checked[str(name)] = ([float(v) for v in entry[0]], [float(v) for v in entry[1]])
    return checked
