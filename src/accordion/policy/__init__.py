"""The policy layer: which level each layer uses, and when that is decided.

* :class:`Ladder` -- a compressor's levels, mildest first; decisions are rung indices;
* :class:`Schedule` -- when decisions are made (every N epochs or steps) and
  :class:`DecayDetector` -- the learning-rate decay override;
* :class:`Rule` -- what is decided, from an :class:`Observation`; :class:`PaperRule` is
  Accordion's rule; :class:`GuardedRule` descends a ladder one rung at a time and steps
  back when a layer relapses; :class:`AuditRule` holds each layer at the most compressed
  rung whose error on an uncompressed audit step stays within a budget;
  :class:`AllocationRule` (L-GreCo) gives each layer the rung of the cheapest allocation
  whose summed squared error stays within one reference rung's, and
  :class:`RegimeAllocationRule` within a budget that the norm test sets per layer;
* :class:`Decider` -- the policy over time: the rungs in force, the schedule's position
  and the decays, from one ``end_epoch``/``end_step`` to the next (``policy.decider``).

Pure logic: plain values in and out, no ``torch.distributed``.
"""

import inspect
from typing import Any

from .allocation import AllocationRule, RegimeAllocationRule
from .audit import AuditRule
from .decider import Decider
from .guarded import GuardedRule
from .ladder import Ladder, LevelKind
from .rules import RULE_STATISTICS, Observation, PaperRule, Rule, check_eta, paper_check
from .schedule import UNITS, DecayDetector, Schedule

#: The rules by name, as strategies and checkpoints name them.
RULES: dict[str, type[Rule]] = {PaperRule.name: PaperRule, GuardedRule.name: GuardedRule,
                                 AuditRule.name: AuditRule,
                                 AllocationRule.name: AllocationRule,
                                 RegimeAllocationRule.name: RegimeAllocationRule}  # fmt: skip


def takes_eta(name: str) -> bool:
    """Whether the rule named ``name`` (see ``RULES``) has the norm test's threshold ``eta``."""
    return name in RULES and "eta" in inspect.signature(RULES[name]).parameters


def make_rule(name: str, eta: float | None = None, **options: Any) -> Rule:
    """A rule by its name (see ``RULES``), with the threshold ``eta`` if given (the norm
    rules' only) and the rule's own keyword ``options`` (``block=`` for the guarded
    rule, ``tau=`` for the audit rule, ``reference=`` for the allocation rule)."""
    if name not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {name!r}")
    if eta is not None and not takes_eta(name):
        raise ValueError(f"eta is the norm test's threshold; rule {name!r} has none, got "
                         f"eta={eta!r}")  # fmt: skip
    return RULES[name](**({} if eta is None else {"eta": eta}), **options)

__all__ = [
    "AllocationRule",
    "AuditRule",
    "RULES",
    "RULE_STATISTICS",
    "UNITS",
    "DecayDetector",
    "Decider",
    "GuardedRule",
    "Ladder",
    "LevelKind",
    "Observation",
    "PaperRule",
    "RegimeAllocationRule",
    "Rule",
    "Schedule",
    "check_eta",
    "make_rule",
    "takes_eta",
    "paper_check",
]
