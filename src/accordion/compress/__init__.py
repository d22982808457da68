"""Gradient compression in three composable parts, as in GRACE.

* compressors (``Dense``, ``PowerSGD``, ``TopK``): what is sent, at a level per tensor
  that may change at any step;
* memories (``ErrorFeedback``, ``NoMemory``): what was not sent, added to the next step;
* transports (``TorchTransport``, ``SimulatedTransport``): who carries the collectives.

``Reducer`` combines a compressor and a memory into "average these gradients".

Example, four workers simulated in one process::

    import torch
    from accordion.compress import PowerSGD, Reducer, SimulatedTransport

    world = SimulatedTransport(4)
    reducers = [Reducer(PowerSGD(rank=2)) for _ in range(4)]
    grads = [[torch.randn(64, 32)] for _ in range(4)]          # worker w's tensors
    world.run([r.exchange(["w"], g, 4) for r, g in zip(reducers, grads)])
    # every grads[w][0] now holds the same rank-2 estimate of the average
"""

from .compressors import Compressor, Dense, PowerSGD, TopK, orthogonalize_
from .memory import ErrorFeedback, NoMemory
from .reducer import Reducer
from .transport import (
    AllGather,
    AllReduce,
    Exchange,
    SimulatedTransport,
    TorchTransport,
    collective_bytes,
    parallel,
)

__all__ = [
    "AllGather",
    "AllReduce",
    "Compressor",
    "Dense",
    "ErrorFeedback",
    "Exchange",
    "NoMemory",
    "PowerSGD",
    "Reducer",
    "SimulatedTransport",
    "TopK",
    "TorchTransport",
    "collective_bytes",
    "make_compressor",
    "orthogonalize_",
    "parallel",
]


def make_compressor(name: str, level=None) -> Compressor:
    """Build a compressor by name: ``"dense"``, ``"powersgd"`` (level: rank, default 2) or
    ``"topk"`` (level: fraction, default 0.1)."""
    if not isinstance(name, str):
        raise TypeError(f"compressor must be a str, got {type(name).__name__}")
    if name == "dense":
        if level is not None:
            raise ValueError(f"level must be None for compressor 'dense', got {level!r}")
        return Dense()
    if name == "powersgd":
        return PowerSGD(2 if level is None else level)
    if name == "topk":
        return TopK(0.1 if level is None else level)
    raise ValueError(f"compressor must be one of 'dense', 'powersgd', 'topk', got {name!r}")
