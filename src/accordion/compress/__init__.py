"""Gradient compression in three composable parts, as in GRACE.

* compressors (``Dense``, ``PowerSGD``, ``OneRoundPowerSGD``, ``TopK``,
  ``HalfPrecision``): what is sent, at a
  level per tensor that may change at any step; each describes itself (levels, order,
  the tensors it applies to, floats and bytes) and is found by name in one registry;
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

A new compressor is one file: a :class:`Compressor` subclass decorated with
:func:`register`, imported below.
"""

from typing import Any

# Registration order is the order in which the registry lists the compressors.
# ruff: noqa: I001
from .base import (
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
from .memory import ErrorFeedback, NoMemory
from .reducer import Reducer
from .transport import (
    AllGather,
    AllReduce,
    Broadcast,
    Exchange,
    LocalTransport,
    SimulatedTransport,
    TorchTransport,
    collective_bytes,
    parallel,
)

__all__ = [
    "AllGather",
    "AllReduce",
    "Broadcast",
    "Compressor",
    "Dense",
    "ErrorFeedback",
    "Exchange",
    "HalfPrecision",
    "LocalTransport",
    "NoMemory",
    "OneRoundPowerSGD",
    "PowerSGD",
    "Reducer",
    "SimulatedTransport",
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
    """Build a registered compressor by name at ``level`` (its default mild level when
    ``None``); ``options`` go to its constructor (PowerSGD: ``seed``, ``on_rank_change``)."""
    cls = compressor_class(name)
    if cls is Dense:
        if level is not None:
            raise ValueError(f"level must be None for compressor 'dense', got {level!r}")
        if options:
            raise TypeError(f"compressor 'dense' takes no options, got {sorted(options)}")
        return Dense()
    try:
        return cls(**options) if level is None else cls(level, **options)
    except TypeError as exc:
        if options and "unexpected keyword" in str(exc):
            raise TypeError(
                f"compressor {name!r} does not take options {sorted(options)}"
            ) from None
        raise
