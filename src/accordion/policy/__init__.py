"""The policy layer: which level each layer uses, and when that is decided.

* :class:`Ladder` -- a compressor's levels, mildest first; decisions are rung indices;
* :class:`Schedule` -- when decisions are made (every N epochs or steps) and
  :class:`DecayDetector` -- the learning-rate decay override;
* :class:`Rule` -- what is decided, from an :class:`Observation`; :class:`PaperRule` is
  Accordion's rule.

Pure logic: plain values in and out, no ``torch.distributed``.
"""

from .ladder import Ladder
from .rules import RULE_STATISTICS, Observation, PaperRule, Rule, check_eta, paper_check
from .schedule import UNITS, DecayDetector, Schedule

__all__ = [
    "RULE_STATISTICS",
    "UNITS",
    "DecayDetector",
    "Ladder",
    "Observation",
    "PaperRule",
    "Rule",
    "Schedule",
    "check_eta",
    "paper_check",
]
