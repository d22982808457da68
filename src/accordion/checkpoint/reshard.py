"""Accordion states saved by a job of one world size, for a job of another.

Levels, the rule's state and history, counters and the ledger are the same on every
rank, so they carry over from one saved rank. Error-feedback memories differ per rank:
what they hold is what the next steps still owe the model, and what the model receives
is their *average* over the ranks. The ``"sum"`` policy keeps that average: new rank
``r`` takes the sum of the memories of the old ranks ``i`` with ``i % new_world == r``,
times ``new_world / old_world``. The ``"drop"`` policy starts every memory at zero
(what was owed is lost: a small, one-time error). Either way a ``RuntimeWarning`` says
so. The statistic of the period in progress (the accumulated gradients) comes from the
old rank ``r`` (or rank 0, when ``r`` did not exist). Under ``statistic="sharded"`` the
layers are dealt out again for the new world size: a rank drops, at its first step, the
sums of layers it no longer owns, and a layer whose owner changed starts its sum anew.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._validate import check_choice, check_int

#: How memories follow a changed world size (see the module's docstring).
POLICIES = ("sum", "drop")


def old_ranks(rank: int, old_world: int, new_world: int) -> list[int]:
    """The ranks of the old job whose memories new rank ``rank`` takes (``i % new == r``)."""
    check_int("old_world", old_world, 1)
    check_int("new_world", new_world, 1)
    check_int("rank", rank, 0)
    if rank >= new_world:
        raise ValueError(f"rank must be < new_world ({new_world}), got {rank}")
    return [i for i in range(old_world) if i % new_world == rank]


def reshard(states: Mapping[int, Mapping[str, Any]], old_world: int, new_world: int, rank: int,
            policy: str = "sum") -> dict[str, Any]:  # fmt: skip
    """The state that new rank ``rank`` of a ``new_world``-rank job loads, from the
    ``AccordionState.state_dict()`` of old ranks: ``states`` maps each old rank of
    :func:`old_ranks` (and 0) to its state. See the module's docstring."""
    check_choice("policy", policy, POLICIES)
    mine = old_ranks(rank, old_world, new_world)
    missing = sorted({0, *mine} - set(states))
    if missing:
        raise ValueError(f"states must hold the old ranks {sorted({0, *mine})}, missing {missing}")
    base = copy.deepcopy(dict(states[rank if rank < old_world else 0]))
    memories = [_memory(states[i]) for i in mine]
    merged: dict[str, torch.Tensor] = {}
    if policy == "sum":
        scale = new_world / old_world
        for memory in memories:
            for key, tensor in memory.items():
                merged[key] = merged[key] + tensor if key in merged else tensor.clone()
        merged = {key: tensor * scale for key, tensor in merged.items()}
    base["reducer"]["memory"]["memory"] = merged
    base["world_size"], base["rank"] = new_world, rank
    warnings.warn(_message(policy, old_world, new_world, rank, mine), RuntimeWarning, stacklevel=2)
    return base


def _memory(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    try:
        memory = state["reducer"]["memory"]["memory"]
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"not an AccordionState.state_dict(): no reducer memory ({exc!r})"
        ) from None
    return dict(memory)


def _message(policy: str, old: int, new: int, rank: int, mine: Sequence[int]) -> str:
    if policy == "drop":
        what = "its error-feedback memories start at zero (what they owed is dropped)"
    elif mine:
        what = (f"its error-feedback memories are the sum of old ranks {list(mine)}'s, "
                f"times {new}/{old}, so their average over the ranks is kept")  # fmt: skip
    else:
        what = "no old rank maps to it, so its error-feedback memories start at zero"
    return f"the world size changed from {old} to {new}: on new rank {rank}, {what}"


__all__ = ["POLICIES", "old_ranks", "reshard"]
