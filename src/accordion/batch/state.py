"""The layout of a :class:`~accordion.batch.BatchSizeController` checkpoint, and its checks.

A state holds the constructor's ``config``, the counters, the epoch's partial statistic
(``accumulator``, ``observed_steps``), the ``history``, and under ``"detector"`` the
decisions: the paper rule's norms and checks, and the decision in force, in the layout
that the ``RegimeDetector`` of versions before issue 23 wrote, so that their checkpoints
load as they are.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._validate import check_bool, check_int, check_state_keys

CONFIG_KEYS = (
    "small",
    "large",
    "micro_batch",
    "world_size",
    "interval",
    "eta",
    "mode",
    "lr_scaling",
    "warmup_steps",
    "fixed_switch_epoch",
)
STATE_KEYS = frozenset(
    {
        "config",
        "batch_size",
        "last_epoch",
        "steps_since_switch",
        "warmup_from",
        "accumulator",
        "observed_steps",
        "detector",
        "history",
    }
)
#: The keys of the ``"detector"`` entry.
DETECTOR_KEYS = frozenset(
    {"interval", "eta", "last_epoch", "norms", "critical", "decay_override", "history"}
)


def to_norm(name: str, value: Any) -> float:
    """Convert one gradient norm (float, int, numpy scalar or 0-d tensor) to a float >= 0."""
    what = f"norms[{name!r}] must be a finite float >= 0 (an L2 norm)"
    # float("1.5") would succeed, and True would pass as 1.0: both are caller mistakes
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{what}, got {value!r}")
    if isinstance(value, numbers.Real):
        norm = float(value)
    elif getattr(value, "ndim", None) == 0:
        # 0-d torch tensors and numpy arrays: float() reads the single value
        try:
            norm = float(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{what}, got {value!r}") from exc
    else:
        raise TypeError(f"{what} or a 0-d tensor, got {value!r}")
    if not (math.isfinite(norm) and norm >= 0):
        raise ValueError(f"{what}, got {norm!r}")
    return norm


def check_norms(norms: Any) -> dict[str, float]:
    """``norms`` as tensor name -> float >= 0 (:func:`to_norm`); ``TypeError`` for a
    value or a name of the wrong type, ``ValueError`` for a negative or non-finite norm."""
    if not isinstance(norms, Mapping):
        raise TypeError(
            f"norms must be a Mapping from tensor name (str) to gradient norm (float), "
            f"got {type(norms).__name__}"
        )
    checked: dict[str, float] = {}
    for name, value in norms.items():
        if not isinstance(name, str):
            raise TypeError(f"norms keys must be tensor names (str), got {name!r}")
        checked[name] = to_norm(name, value)
    return checked


@dataclass
class Decisions:
    """The ``"detector"`` entry of a state, checked.

    Attributes:
        last_epoch: the last epoch decided (None before any, and in fixed mode).
        norms: tensor name -> the norm remembered at the last check.
        critical: tensor name -> whether it is critical now (the decision in force).
        decay_override: whether a learning-rate decay made every tensor critical until
            the next check.
        history: the paper rule's records, one per check.
    """

    last_epoch: int | None
    norms: dict[str, float]
    critical: dict[str, bool]
    decay_override: bool
    history: list[dict[str, Any]]

    def state(self, interval: int, eta: float) -> dict[str, Any]:
        """The ``"detector"`` entry, for a schedule of ``interval`` epochs and ``eta`` (a
        deep copy)."""
        return {
            "interval": interval,
            "eta": eta,
            "last_epoch": self.last_epoch,
            "norms": dict(self.norms),
            "critical": dict(self.critical),
            "decay_override": self.decay_override,
            "history": copy.deepcopy(self.history),
        }


def load_decisions(state: Any, interval: int, eta: float, owner: str) -> Decisions:
    """A ``"detector"`` entry, checked (copies): its ``interval`` and ``eta`` must be these.

    Raises:
        TypeError: a value of the wrong type.
        ValueError: missing or unknown keys, a different ``interval`` or ``eta``, or
            invalid values.
    """
    check_state_keys(state, DETECTOR_KEYS, owner)
    if state["interval"] != interval:
        raise ValueError(
            f"state['interval'] is {state['interval']!r} epochs but this detector's "
            f"interval is {interval}: build the detector with the same interval"
        )
    if state["eta"] != eta:
        raise ValueError(
            f"state['eta'] is {state['eta']!r} but this detector's eta is {eta}: "
            f"build the detector with the same eta"
        )
    last_epoch = state["last_epoch"]
    if last_epoch is not None:
        last_epoch = check_int("state['last_epoch']", last_epoch, 0)
    norms = check_norms(state["norms"])
    critical = state["critical"]
    if not isinstance(critical, Mapping) or not all(
        isinstance(k, str) and isinstance(v, bool) for k, v in critical.items()
    ):
        raise TypeError(
            f"state['critical'] must be a Mapping from tensor name (str) to bool, got {critical!r}"
        )
    decay_override = check_bool("state['decay_override']", state["decay_override"])
    history = state["history"]
    if not isinstance(history, list):
        raise TypeError(f"state['history'] must be a list of check records, got {history!r}")
    return Decisions(last_epoch, norms, dict(critical), decay_override, copy.deepcopy(history))


def check_config(config: Any, mine: Mapping[str, Any]) -> None:
    """Raise unless ``config`` (a state's) equals ``mine`` on every key of ``CONFIG_KEYS``:
    ``TypeError`` if it is not a Mapping, ``ValueError`` naming the first field that differs."""
    if not isinstance(config, Mapping):
        raise TypeError(f"state['config'] must be a Mapping, got {config!r}")
    for key in CONFIG_KEYS:
        if key not in config or config[key] != mine[key]:
            raise ValueError(
                f"state['config']['{key}'] is {config.get(key, '<missing>')!r} but this "
                f"controller's {key} is {mine[key]!r}: build the controller with the same "
                f"{key}"
            )


def checked_values(state: Mapping[str, Any], small: int, large: int) -> tuple:
    """The state's counters and accumulator, validated (copies: the state is not kept):
    ``(batch_size, last_epoch, steps_since_switch, warmup_from, observed_steps,
    accumulator)``."""
    batch_size = state["batch_size"]
    if batch_size not in (small, large) or isinstance(batch_size, bool):
        raise ValueError(
            f"state['batch_size'] must be small ({small}) or large ({large}), got {batch_size!r}"
        )
    last_epoch = state["last_epoch"]
    if last_epoch is not None:
        last_epoch = check_int("state['last_epoch']", last_epoch, 0)
    steps_since_switch = check_int("state['steps_since_switch']", state["steps_since_switch"], 0)
    warmup_from = state["warmup_from"]
    if warmup_from is not None:
        if isinstance(warmup_from, bool) or not isinstance(warmup_from, numbers.Real):
            raise TypeError(
                f"state['warmup_from'] must be a float (an lr factor) or None, got {warmup_from!r}"
            )
        warmup_from = float(warmup_from)
    observed_steps = check_int("state['observed_steps']", state["observed_steps"], 0)
    accumulator = state["accumulator"]
    if accumulator is not None:
        if not isinstance(accumulator, (list, tuple)) or not all(
            isinstance(a, torch.Tensor) for a in accumulator
        ):
            raise TypeError(
                f"state['accumulator'] must be a list of tensors or None, "
                f"got {type(accumulator).__name__}"
            )
        for a in accumulator:
            if not a.is_floating_point():
                raise TypeError(
                    f"state['accumulator'] must hold floating-point tensors (gradient sums), "
                    f"got one of dtype {a.dtype}"
                )
        accumulator = [a.detach().clone() for a in accumulator]
    return (
        int(batch_size), last_epoch, steps_since_switch, warmup_from, observed_steps,
        accumulator,
    )  # fmt: skip
