"""Gradient compression in three composable parts, as in GRACE.

* compressors (``Dense``, ``PowerSGD``, ``OneRoundPowerSGD``, ``TopK``,
  ``HalfPrecision``, ``IntQuantizer``, ``NormalQuantizer``, ``SparseLoCo``, ``Mixed``:
  levels of several of them on one ladder): what is sent, at a level per tensor that
  may change at any step; each describes itself (levels, order, the tensors it applies
  to, floats and bytes) and is found by name in one registry;
* memories (``ErrorFeedback``, ``NoMemory``): what was not sent, added to the next step;
* transports (``TorchTransport``, ``SimulatedTransport``, ``LocalTransport``): who
  carries the collectives.

``Reducer`` combines a compressor and a memory into "average these gradients".

Example, four workers simulated in one process::

    import torch
    from accordion.compress import PowerSGD, Reducer, SimulatedTransport

    world = SimulatedTransport(4)
    reducers = [Reducer(PowerSGD(rank=2)) for _ in range(4)]
    grads = [[torch.randn(64, 32)] for _ in range(4)]          # worker w's tensors
    world.run([r.exchange(["w"], g, 4) for r, g in zip(reducers, grads)])
    # every grads[w][0] now holds the same rank-2 estimate of the average

A compressor class is the compressor contract in three parts: its level language
(``levels.py``: parse, check, text, label, order, default levels), its cost description
(``cost.py``: the tensors it applies to, floats, messages and bytes, whether a level
pays, warnings, the break-even) and its math and state (``base.py``: ``build``, levels
per tensor, the exchange, ``state_dict``). A new compressor is one file: a
:class:`Compressor` subclass decorated with :func:`register`, imported below.
"""

from typing import Any

# Registration order is the order in which the registry lists the compressors.
# ruff: noqa: I001
from .base import (
    COLLECTIVES,
    RANK_CHANGE_POLICIES,
    SHARED_OPTIONS,
    Compressor,
    Dense,
    compressing_names,
    compressor_class,
    compressor_names,
    register,
    sent_as,
)
from .powersgd import PowerSGD, orthogonalize_
from .topk import TopK
from .half import HalfPrecision
from .powersgd1 import OneRoundPowerSGD
from .mixed import Mixed
from .quantize import IntQuantizer
from .normalquant import NormalQuantizer
from .sparseloco import SparseLoCo
from .cost import BreakEvenDescription, CostDescription
from .levels import LevelLanguage
from .memory import ErrorFeedback, NoMemory
from .reducer import Reducer, average_in_place
from .transport import (
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Exchange,
    LocalTransport,
    SimulatedTransport,
    TorchTransport,
    collective_bytes,
    parallel,
)

__all__ = [
    "COLLECTIVES",
    "RANK_CHANGE_POLICIES",
    "SHARED_OPTIONS",
    "AllGather",
    "AllReduce",
    "AllToAll",
    "Broadcast",
    "BreakEvenDescription",
    "Compressor",
    "CostDescription",
    "Dense",
    "ErrorFeedback",
    "Exchange",
    "HalfPrecision",
    "IntQuantizer",
    "LevelLanguage",
    "LocalTransport",
    "Mixed",
    "NoMemory",
    "NormalQuantizer",
    "OneRoundPowerSGD",
    "PowerSGD",
    "Reducer",
    "average_in_place",
    "SimulatedTransport",
    "SparseLoCo",
    "TopK",
    "TorchTransport",
    "collective_bytes",
    "compressing_names",
    "compressor_class",
    "compressor_names",
    "make_compressor",
    "orthogonalize_",
    "parallel",
    "register",
    "sent_as",
]


def make_compressor(name: str, level: Any = None, **options: Any) -> Compressor:
    """Build the registered compressor ``name`` at ``level`` (its default mild level when
    ``None``) with the shared ``options`` (``seed``, ``on_rank_change``, ``collective``):
    its class's :meth:`Compressor.build`. A level that is not one of the compressor's (any but
    ``None`` for ``dense``) is a ``ValueError``."""
    cls = compressor_class(name)
    if level is not None:
        cls.check_level(level)  # build would check it too, but Dense ignores its level
    return cls.build(level, **options)
