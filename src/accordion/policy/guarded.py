"""The guarded ladder rule: one rung at a time, back one rung when training reacts.

The paper's rule jumps from the mildest level to the most aggressive one as soon as a
layer's gradient norm settles, and finds out ``interval`` epochs later whether that was
safe. On MNIST-1D a PowerSGD switch from rank 4 to rank 1 at the peak learning rate
makes the workers' average error-feedback memory grow about 5x and the layer's gradient
norm jump by 60-80% within one epoch, while a switch to rank 2 leaves both close to
where they were, and the same switch to rank 1 after the first decay does no harm
(``benchmarks/switch_transient``, ``docs/design.md``). So this rule:

* descends **one rung** per check while a layer's norm is calm (the paper's test with
  ``eta``), and moves it **up one rung** when the norm changes by ``eta`` or more;
* keeps the **last rung for after the first decay** (``wait_for_decay``): before it, the
  learning rate is at its peak and the most aggressive level is what hurts;
* treats a layer whose norm grows by ``eta`` or more right after a descent as a
  **relapse**: it goes back up one rung, and that rung stays out of reach for ``block``
  checks (5), twice as long after each further relapse, and never past the next decay
  (it was too aggressive at this learning rate, or the norm moved for another reason:
  early in training it often does);
* counts a **decay** only when the learning rate falls to ``decay_drop`` times (or less)
  the rate at the previous decay or the peak since: a cosine or linear schedule, whose
  rate falls a little every epoch, is not in a critical regime at every check. A decay
  lifts the blocks; the norm test then sees the regime change as it happens.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from .._validate import check_bool, check_int
from .ladder import Ladder
from .rules import (
    Observation,
    Rule,
    _comparable,
    check_eta,
    check_rule_state,
    kept_norms,
    loaded_norms,
)
from .schedule import check_drop

#: The guarded rule's default decay threshold: a fall of the lr to half or less.
DEFAULT_DECAY_DROP = 0.5
#: Checks a first relapse keeps a layer off the rung that failed, by default.
DEFAULT_BLOCK = 5


class GuardedRule(Rule):
    """Descend the ladder one rung per calm check, keep the last rung for after the first
    learning-rate decay, and step back one rung (keeping off the rung that failed) when a
    layer's gradient norm grows right after a descent.

    Args:
        eta: threshold on the relative change of a layer's gradient norm between two
            checks (dimensionless, as the paper's ``eta``; default 0.5).
        decay_drop: a learning-rate decay is a fall to ``decay_drop`` times the rate at
            the previous decay (or the peak since) or less (a ratio in (0, 1), default 0.5).
        wait_for_decay: keep every layer off the last rung until the first decay (default
            True); with False the whole ladder is open from the start.
        block: how long a relapse keeps a layer off the rung that failed: ``k`` checks
            (an int >= 1, default 5), doubled at each further relapse of that layer
            before the next decay; ``None`` until the next decay.

    ``history`` holds one record per check::

        {"epoch": int, "lr_will_decay": bool, "decayed": bool,
         "layers": {name: {"old_norm", "new_norm", "ratio", "critical", "rung", "limit",
                           "relapse"}}}
    """

    name = "guarded"
    default_interval = 1  # it reacts within an epoch of a bad descent

    def __init__(
        self,
        eta: float = 0.5,
        decay_drop: float = DEFAULT_DECAY_DROP,
        wait_for_decay: bool = True,
        block: int | None = DEFAULT_BLOCK,
    ):
        super().__init__()
        self.eta = check_eta(eta)
        self.decay_drop = check_drop(decay_drop, "decay_drop")
        self.wait_for_decay = check_bool("wait_for_decay", wait_for_decay)
        self.block = None if block is None else check_int("block", block, 1)
        #: Norms remembered at the last check.
        self.norms: dict[str, float] = {}
        #: Per layer, the most aggressive rung allowed until the next decay (relapses).
        self.limits: dict[str, int] = {}
        #: Layers that descended at the last check (a growth now is a relapse).
        self.probation: set[str] = set()
        #: Learning-rate decays seen so far.
        self.decays = 0
        #: Per blocked layer, the number of checks (``len(history)``) at which its block
        #: lifts, and its relapses since the last decay (``block`` not ``None``).
        self.lifts: dict[str, int] = {}
        self.relapses: dict[str, int] = {}

    def decide(self, observation: Observation, ladder: Ladder) -> dict[str, int]:
        if observation.decayed:  # a new regime: what failed before may work now
            self.limits.clear()
            self.probation.clear()
            self.lifts.clear()
            self.relapses.clear()
            self.decays += 1
        for name in [n for n, at in self.lifts.items() if at <= len(self.history)]:
            del self.limits[name], self.lifts[name]
        rungs, layers = {}, {}
        for name, new in observation.grad_norms.items():
            rungs[name], layers[name] = self._layer(name, new, observation, ladder)
        self.norms = kept_norms(self.norms, observation)
        self.history.append(
            {"epoch": observation.index, "lr_will_decay": observation.lr_will_decay,
             "decayed": observation.decayed, "layers": layers}
        )  # fmt: skip
        return rungs

    def _floor(self, ladder: Ladder) -> int:
        """The most aggressive rung any layer may take now."""
        return ladder.top - 1 if self.wait_for_decay and self.decays == 0 else ladder.top

    def _layer(
        self, name: str, new: float, observation: Observation, ladder: Ladder
    ) -> tuple[int, dict[str, Any]]:
        """One layer's rung and its history record."""
        old = self.norms.get(name)
        # an old norm that is not finite (saved before the finite check) compares with nothing
        ratio = abs(old - new) / old if _comparable(old) else None
        current = observation.rungs.get(name, 0)
        limit = min(self.limits.get(name, ladder.top), self._floor(ladder))
        relapse = False
        if ratio is None:  # the first check: nothing to compare
            rung = 0
        elif ratio >= self.eta:
            # compression falling behind shows as a norm that grows, right after a descent
            assert old is not None  # a ratio comes only from an old norm
            relapse = name in self.probation and current > 0 and new > old
            if relapse:  # the last descent was one rung too far at this learning rate
                limit = self.limits[name] = current - 1
                self._schedule_lift(name)
            rung = max(current - 1, 0)
        else:
            rung = min(current + 1, limit)
        rung = min(rung, limit)
        if rung > current:
            self.probation.add(name)
        else:
            self.probation.discard(name)
        record = {"old_norm": old, "new_norm": new, "ratio": ratio, "critical": rung == 0,
                  "rung": rung, "limit": limit, "relapse": relapse}  # fmt: skip
        return rung, record

    def _schedule_lift(self, name: str) -> None:
        """With ``block``, lift ``name``'s new block after ``block * 2**(relapses - 1)``
        checks (this check counted)."""
        if self.block is None:
            return
        count = self.relapses[name] = self.relapses.get(name, 0) + 1
        self.lifts[name] = len(self.history) + 1 + self.block * 2 ** (count - 1)

    def config(self) -> dict[str, Any]:
        return {"eta": self.eta, "decay_drop": self.decay_drop,
                "wait_for_decay": self.wait_for_decay, "block": self.block}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {
            "norms": dict(self.norms),
            "limits": dict(self.limits),
            "probation": sorted(self.probation),
            "decays": self.decays,
            "lifts": dict(self.lifts),
            "relapses": dict(self.relapses),
            "history": copy.deepcopy(self.history),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` naming the bad entry (and nothing
        changed) for anything else."""
        try:
            norms, limits, probation, decays, lifts, relapses = _loaded(state)
            super().load_state_dict(state)
        except ValueError as exc:
            raise ValueError(f"state must come from GuardedRule.state_dict(): {exc}") from None
        self.norms, self.limits, self.probation, self.decays = norms, limits, probation, decays
        self.lifts, self.relapses = lifts, relapses


def _loaded(state: Any) -> tuple:
    """A state's norms, limits, probation, decays, lifts and relapses, checked."""
    # lifts and relapses: absent from states written before ``block``
    check_rule_state(state, "GuardedRule", _STATE_KEYS, frozenset({"lifts", "relapses"}))
    norms = loaded_norms(state["norms"], "GuardedRule")
    limits = _counts(state["limits"], "limits")
    probation = state["probation"]
    if isinstance(probation, str | Mapping) or not isinstance(probation, list | tuple | set):
        raise ValueError(f"probation must be a list of layers, got {probation!r}")
    decays = _count(state["decays"], "decays")
    lifts = _counts(state.get("lifts", {}), "lifts")
    relapses = _counts(state.get("relapses", {}), "relapses")
    if not set(lifts) <= set(limits):
        raise ValueError(f"lifts {sorted(set(lifts) - set(limits))} are of no block (limits)")
    return norms, limits, {str(k) for k in probation}, decays, lifts, relapses


_STATE_KEYS = frozenset({"norms", "limits", "probation", "decays", "history"})


def _count(value: Any, name: str) -> int:
    """A loaded count or rung: an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _counts(table: Any, name: str) -> dict[str, int]:
    """A loaded table of counts or rungs by layer."""
    if not isinstance(table, Mapping):
        raise ValueError(f"{name} must be a Mapping, got {type(table).__name__}")
    return {str(k): _count(v, f"{name}[{k!r}]") for k, v in table.items()}
