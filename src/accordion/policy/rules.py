"""Rules: what each layer's rung should be, from what was observed since the last check.

A rule is a small object with one method, :meth:`Rule.decide`, given an
:class:`Observation` (identical on every rank) and the :class:`~.ladder.Ladder`, returning
a rung per layer. It may keep history and state (``state_dict`` / ``load_state_dict``),
but never talks to other ranks: the controller agrees the statistics first. A new rule
is one file: subclass :class:`Rule` and pass an instance as ``AccordionState(rule=...)``.
"""

from __future__ import annotations

import copy
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeGuard

from .._validate import check_state_keys
from .ladder import Ladder

#: Statistics a rule may ask for beyond the paper's gradient norms: ``"memory_norms"``
#: (in the observation), ``"audit"`` (the first step of each period averaged dense and
#: each rung's error on it handed to the rule's ``measured``; the rule keeps them in
#: ``pending`` until its check: see :class:`~.audit.AuditRule`) and ``"errors"`` (at
#: that step each rank's error-fed accumulator compressed at every rung, the squared
#: errors summed over the ranks and each rung's bytes handed to ``measured``: see
#: :class:`~.allocation.AllocationRule`).
RULE_STATISTICS = frozenset({"memory_norms", "audit", "errors"})


@dataclass(frozen=True)
class Observation:
    """What a rule sees at a check; every value is the same on every rank.

    Attributes:
        index: the check's epoch (``unit="epoch"``) or window index (``unit="step"``).
        unit: ``"epoch"`` or ``"step"``.
        lr_will_decay: whether the learning rate decays at this check.
        grad_norms: per compressed layer, the L2 norm of its local gradient summed over the
            steps since the last check (before compression, error feedback, momentum and
            weight decay): the paper's statistic.
        memory_norms: per compressed layer, the L2 norm of its error-feedback memory now
            (what compression still owes); filled when the rule ``needs`` it.
        rungs: per layer, the rung it was at until now (0 is the mildest).
        decayed: whether the learning rate decayed since the last check (this one
            included), as the rule's ``decay_drop`` counts decays.
        kept_out: layers left out of ``grad_norms`` because their statistic is not
            finite (every gradient of the period was, or the sum overflowed): they keep
            their rung, and a rule should keep what it remembers of them for the next
            check.
    """

    index: int
    unit: str
    lr_will_decay: bool
    grad_norms: Mapping[str, float]
    memory_norms: Mapping[str, float] = field(default_factory=dict)
    rungs: Mapping[str, int] = field(default_factory=dict)
    decayed: bool = False
    kept_out: frozenset[str] = frozenset()


class Rule(ABC):
    """Decides a rung per layer at each check of the schedule."""

    #: A short name, saved in checkpoints so that a resumed job uses the same rule.
    name: ClassVar[str] = "rule"
    #: Statistics beyond ``grad_norms`` that :meth:`decide` reads (see ``RULE_STATISTICS``).
    needs: ClassVar[frozenset[str]] = frozenset()
    #: What counts as a learning-rate decay: ``None`` (the paper) any fall of the rate
    #: between two calls; a ratio ``f`` in (0, 1) a fall to ``f`` times the rate at the
    #: previous decay (or the peak since) or less.
    decay_drop: float | None = None
    #: The check interval a state uses with this rule when given none (epochs or steps).
    default_interval: ClassVar[int] = 10

    def __init__(self) -> None:
        #: One JSON-serialisable record per check, oldest first (``stats()["checks"]``).
        self.history: list[dict[str, Any]] = []

    @abstractmethod
    def decide(self, observation: Observation, ladder: Ladder) -> dict[str, int]:
        """The rung of every layer in ``observation.grad_norms`` until the next check."""

    def check_ladder(self, ladder: Ladder) -> None:
        """Raise ``ValueError`` if this rule cannot decide on ``ladder`` (any ladder here)."""
        return None  # every rule so far decides on any ladder; AllocationRule checks its rung

    def config(self) -> dict[str, Any]:
        """Settings that must match when a checkpoint is loaded (plain values)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values to resume from (the history, by default)."""
        return {"history": copy.deepcopy(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises ``ValueError`` and changes nothing if malformed."""
        history = state.get("history") if isinstance(state, Mapping) else None
        if not isinstance(history, list):
            raise ValueError(f"state must come from {type(self).__name__}.state_dict()")
        self.history = copy.deepcopy(history)


def check_eta(eta: Any) -> float:
    """Validate the paper's threshold (a finite float > 0) and return it."""
    if isinstance(eta, bool) or not isinstance(eta, numbers.Real):
        raise TypeError(f"eta must be a finite float > 0 (a relative change), got {eta!r}")
    number = float(eta)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"eta must be a finite float > 0 (a relative change), got {eta!r}")
    return number


def _comparable(old: float | None) -> TypeGuard[float]:
    """Whether a remembered norm can be compared with a new one (a relative change)."""
    return old is not None and old != 0 and math.isfinite(old)


def kept_norms(
    remembered: Mapping[str, float], observation: Observation
) -> dict[str, float]:
    """The norms to remember after ``observation``: its own, and the remembered norms of
    the layers it ``kept_out``."""
    kept = {k: v for k, v in remembered.items() if k in observation.kept_out}
    return {**kept, **observation.grad_norms}


def check_rule_state(
    state: Any, owner: str, required: frozenset[str], optional: frozenset[str] = frozenset()
) -> None:
    """Raise ``ValueError`` unless ``state`` is a Mapping with the ``required`` keys and
    no others than the ``optional`` ones (``owner.state_dict()``): the library's one key
    check, :func:`accordion._validate.check_state_keys`, in a rule's argument order."""
    check_state_keys(state, required, owner, optional)


def loaded_norms(norms: Any, owner: str) -> dict[str, float]:
    """A state's remembered norms: numbers >= 0 by layer name. An inf or NaN is kept
    (versions before the finite check could remember one); it compares with nothing."""
    if not isinstance(norms, Mapping):
        raise ValueError(f"{owner} norms must be a Mapping, got {type(norms).__name__}")
    checked = {}
    for name, value in norms.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
            raise ValueError(f"{owner} norms[{name!r}] must be a number >= 0, got {value!r}")
        checked[str(name)] = float(value)
    return checked


def paper_check(
    norms: Mapping[str, float], remembered: Mapping[str, float], eta: float, decay: bool
) -> tuple[dict[str, bool], dict[str, dict[str, Any]]]:
    """The paper's test: per layer, critical when ``|old - new| / old >= eta`` (infinite
    when no old norm or an old norm of 0) or the learning rate decays.

    Returns the decisions (name -> critical) and a JSON record per layer.
    """
    decision: dict[str, bool] = {}
    layers: dict[str, dict[str, Any]] = {}
    for name, new in norms.items():
        old = remembered.get(name)
        # ratio None stands for infinity, which is >= any eta; an old norm that is not
        # finite (saved by a version before the finite check) compares with nothing
        ratio = None if not _comparable(old) else abs(old - new) / old
        critical = decay or ratio is None or ratio >= eta
        decision[name] = critical
        layers[name] = {"old_norm": old, "new_norm": new, "ratio": ratio, "critical": critical}
    return decision, layers


class PaperRule(Rule):
    """Accordion's rule (Agarwal et al., 2021): a layer is critical while the norm of its
    summed gradient changes by ``eta`` or more between two checks, or when the learning
    rate decays. Critical layers take rung 0 (the mildest), the others the last rung.

    Args:
        eta: threshold on the relative change of a norm (dimensionless, paper: 0.5).

    ``history`` holds one record per check::

        {"epoch": int, "lr_will_decay": bool,
         "layers": {name: {"old_norm", "new_norm", "ratio", "critical"}}}
    """

    name = "paper"

    def __init__(self, eta: float = 0.5):
        super().__init__()
        self.eta = check_eta(eta)
        #: Norms remembered at the last check, compared at the next one.
        self.norms: dict[str, float] = {}

    def critical(self, index: int, norms: Mapping[str, float], decay: bool) -> dict[str, bool]:
        """Run one check on ``norms`` and return name -> critical; records the history."""
        decision, layers = paper_check(norms, self.norms, self.eta, decay)
        self.norms = dict(norms)
        self.history.append({"epoch": index, "lr_will_decay": decay, "layers": layers})
        return decision

    def decide(self, observation: Observation, ladder: Ladder) -> dict[str, int]:
        remembered = self.norms
        critical = self.critical(
            observation.index, observation.grad_norms, observation.lr_will_decay
        )
        self.norms = kept_norms(remembered, observation)
        return {name: 0 if crit else ladder.top for name, crit in critical.items()}

    def config(self) -> dict[str, Any]:
        return {"eta": self.eta}

    def state_dict(self) -> dict[str, Any]:
        return {"norms": dict(self.norms), "history": copy.deepcopy(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` naming the bad entry (and nothing
        changed) for anything else."""
        check_rule_state(state, "PaperRule", frozenset({"norms", "history"}))
        norms = loaded_norms(state["norms"], "PaperRule")
        super().load_state_dict(state)
        self.norms = norms
