"""accordion: adaptive gradient compression for data-parallel PyTorch training.

Implements Accordion (Agarwal et al., MLSys 2021): compress mildly in critical learning
regimes and aggressively elsewhere. At the top level: the DDP hook (``AccordionState``,
``accordion_hook``), its base ``Controller``, the FSDP2 adapter ``FSDPState``, rare
compressed syncs ``DiLoCo`` and ``StreamingDiLoCo``, Adam's noise correction
``AdamNoiseCorrection``, its momentum exchange ``MomentumExchange``, the rules and policy
parts (``Rule``, ``PaperRule``, ``GuardedRule``, ``AuditRule``, ``AllocationRule``,
``Ladder``, ``Observation``, ``Schedule``), ``Checkpointer``, ``calibrate``, the plans
(``make_plan``, ``layer_plan``, ``scaling_plan``), ``compressor_names``,
``make_compressor``, ``summarize`` and ``__version__``. Modules:

* ``accordion.ddp`` -- Accordion as a DDP communication hook (``AccordionState``);
* ``accordion.fsdp`` -- Accordion across the replicas of FSDP2's hybrid sharding;
* ``accordion.diloco`` -- DiLoCo: inner steps alone, compressed outer steps;
* ``accordion.diloco_streaming`` -- Streaming DiLoCo: fragments synced in turn, overlapped;
* ``accordion.controller`` -- the parts of Accordion for one model, joined;
* ``accordion.adam_noise`` -- Adam's second moment corrected for compression noise;
* ``accordion.momentum_exchange`` -- Adam's momentum exchanged compressed, ``v`` frozen;
* ``accordion.compress`` -- compressors, error-feedback memory and transports;
* ``accordion.policy`` -- the rules, ladders and schedules of decisions (pure logic);
* ``accordion.statistic`` / ``accordion.statistics`` -- what a rule decides from;
* ``accordion.agreement`` -- the ranks' agreement on where they are and what they decide;
* ``accordion.audit`` -- the fidelity audit: a dense step per period and each rung's error;
* ``accordion.params`` -- stable names for the parameters, the same on every rank;
* ``accordion.report`` -- what the controller tells about itself (costs, statistics);
* ``accordion.summary`` -- two lines of what a run did: its levels and bytes against dense;
* ``accordion.accounting`` -- floats and bytes sent, per tensor and per layer;
* ``accordion.costmodel`` -- alpha-beta predictions of communication time;
* ``accordion.plan`` -- what a compressor would send for a model (``accordion plan``);
* ``accordion.calibration`` -- timings of the link and of compression for the cost model;
* ``accordion.checkpoint`` -- the state's checkpoint format and consistent checkpoint sets;
* ``accordion.batch`` -- the second lever: the global batch size per regime;
* ``accordion.models`` -- the paper's models;
* ``accordion.integrations`` -- Lightning, Accelerate and the Hugging Face ``Trainer``;
* ``accordion.cli`` -- the ``accordion`` command;
* ``accordion.cluster`` -- an emulated multi-host cluster and a link probe;
* ``accordion.harness`` -- the training harness (data, training, comparison, plots).

``import accordion`` imports neither the harness, the cluster nor any integration: the
subpackages ``batch``, ``cli``, ``integrations`` and ``models`` load on first attribute
access, and an integration only when its own module is imported.
"""

import importlib
from types import ModuleType

from ._version import __version__
from .adam_noise import AdamNoiseCorrection
from .calibration import calibrate
from .checkpoint import Checkpointer
from .compress import compressor_names, make_compressor
from .controller import Controller
from .ddp import AccordionState, accordion_hook
from .diloco import DiLoCo
from .diloco_streaming import StreamingDiLoCo
from .fsdp import FSDPState
from .momentum_exchange import MomentumExchange
from .plan import layer_plan, make_plan, scaling_plan
from .policy import (
    AllocationRule,
    AuditRule,
    GuardedRule,
    Ladder,
    Observation,
    PaperRule,
    Rule,
    Schedule,
)
from .summary import summarize

#: Subpackages loaded on first access (PEP 562): not needed by the hook, or heavier.
_LAZY_SUBMODULES = ("batch", "cli", "integrations", "models")

__all__ = [
    "AccordionState",
    "AdamNoiseCorrection",
    "AllocationRule",
    "AuditRule",
    "Checkpointer",
    "Controller",
    "DiLoCo",
    "FSDPState",
    "GuardedRule",
    "Ladder",
    "MomentumExchange",
    "Observation",
    "PaperRule",
    "Rule",
    "Schedule",
    "StreamingDiLoCo",
    "__version__",
    "accordion_hook",
    "calibrate",
    "compressor_names",
    "layer_plan",
    "make_compressor",
    "make_plan",
    "scaling_plan",
    "summarize",
]


def __getattr__(name: str) -> ModuleType:
    """Import a lazy subpackage (``accordion.integrations``, ...) on first access."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and the lazy subpackages, for completion."""
    return sorted({*globals(), *_LAZY_SUBMODULES})
