"""Checkpoint formats of the Accordion state: the current one, and reading older ones.

Format 2 (the policy layer) keeps the reducer's, the rule's and the ladder's state apart.
Format 1 (before it) kept a ``RegimeDetector``'s state and ``mild``/``aggressive``; it is
read by converting it to format 2: the same memories, factors, levels and history.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FORMAT = 2
READABLE = (1, 2)

_KEYS = frozenset(
    "format world_size rank config shapes reducer accumulators rule rungs ledger epoch step "
    "last_lr".split()
)


def upgrade(state: Any) -> dict[str, Any]:
    """``state`` in the current format; ``ValueError`` for anything else."""
    version = state.get("format") if isinstance(state, Mapping) else None
    if version not in READABLE:
        raise ValueError(
            f"state must come from AccordionState.state_dict() (format {FORMAT}, or an "
            f"older format in {READABLE}), got format {version!r}"
        )
    try:
        state = dict(state) if version == FORMAT else _from_format_1(state)
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"the checkpoint (format {version}) is incomplete or malformed: {exc!r}"
        ) from None
    missing = sorted(_KEYS - set(state))
    if missing:
        raise ValueError(f"the checkpoint (format {version}) is missing keys {missing}")
    return state


#: (saved, current) statistics a checkpoint resumes across: "rank0" (the default before
#: "sharded") keeps every layer's sum on every rank, so each owner finds its own.
STATISTIC_UPGRADES = frozenset({("rank0", "sharded")})


def check_owner(state: Mapping[str, Any], world: int, rank: int, config: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless ``state`` was saved by this rank of a job of this world
    size, with this configuration (its statistic may be upgraded: :data:`STATISTIC_UPGRADES`)."""
    if state["world_size"] != world:
        raise ValueError(
            f"the checkpoint was saved with world size {state['world_size']}, "
            f"this job has {world}: Accordion state cannot be resharded"
        )
    if state["rank"] != rank:
        raise ValueError(f"this is rank {rank}'s state loader, got rank {state['rank']}'s file")
    for name, value in state["config"].items():
        current = config.get(name)
        upgrade = name == "statistic" and (value, current) in STATISTIC_UPGRADES
        if current != value and not upgrade:
            raise ValueError(
                f"the checkpoint's {name} is {value!r} but this state's is {current!r}"
            )


def _from_format_1(state: Mapping[str, Any]) -> dict[str, Any]:
    """Format 1 (``RegimeDetector`` state, two levels) as format 2."""
    config = state["config"]
    detector = state["detector"]
    if config["interval_unit"] == "step":  # a StepRegimeDetector wraps a RegimeDetector
        detector = detector["detector"]
    return {
        "format": FORMAT,
        "world_size": state["world_size"],
        "rank": state["rank"],
        "config": {
            "compressor": config["compressor"],
            "levels": [config["mild"], config["aggressive"]],
            "interval": config["interval"],
            "statistic": config["statistic"],
            "interval_unit": config["interval_unit"],
            "seed": config["seed"],
            "rule": {"name": "paper", "eta": config["eta"]},
        },
        "shapes": state["shapes"],
        "reducer": {
            "compressor": state["compressor"],
            "memory": state["memory"],
            "dense_keys": list(state.get("dense_keys", [])),
            "non_finite_steps": state["non_finite_steps"],
        },
        "accumulators": state["accumulators"],
        "rule": {"norms": detector["norms"], "history": detector["history"]},
        # critical layers were at the mild level (rung 0), the others at the aggressive (1)
        "rungs": {k: 0 if critical else 1 for k, critical in detector["critical"].items()},
        "ledger": state["ledger"],
        "epoch": state["epoch"],
        "step": state["step"],
        "last_lr": state["last_lr"],
    }
