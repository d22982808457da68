"""When decisions are made: every N epochs or N optimizer steps, and learning-rate decays."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .._validate import check_bool, check_choice, check_int

UNITS = ("epoch", "step")


class Schedule:
    """Decision points every ``interval`` epochs or optimizer steps.

    * ``unit="epoch"`` (the paper): epochs ``0, interval, 2 interval, ...`` are checks;
      the statistic is gathered during a check epoch only, and the decision holds for the
      ``interval`` epochs that follow. The check's index is its epoch.
    * ``unit="step"``: each window of ``interval`` steps is compared with the previous
      one; the statistic is gathered during every step, and the check at the end of
      window ``w`` (after ``(w + 1) interval`` steps) has index ``w``.

    A learning-rate decay between checks makes every layer take the mildest rung at once,
    until the next check (the lr-decay override).
    """

    def __init__(self, interval: int = 10, unit: str = "epoch"):
        self.interval = check_int("interval", interval, 1)
        self.unit = check_choice("interval_unit", unit, UNITS)

    def collecting(self, epoch: int) -> bool:
        """Whether the statistic is gathered during epoch ``epoch`` (0-based)."""
        return self.unit == "step" or epoch % self.interval == 0

    def check_index(self, count: int) -> int | None:
        """The index of the check due when ``count`` ends (the epoch that just ended, or the
        number of steps done so far), or ``None`` when ``count`` is not a check point."""
        if count % self.interval:
            return None
        return count if self.unit == "epoch" else count // self.interval - 1

    def __repr__(self) -> str:
        return f"Schedule(interval={self.interval}, unit={self.unit!r})"


def check_drop(drop: Any, name: str = "drop") -> float:
    """Validate a decay threshold named ``name``: a float in (0, 1), a ratio of rates."""
    message = f"{name} must be a float in (0, 1) (a ratio of learning rates), got {drop!r}"
    if isinstance(drop, bool) or not isinstance(drop, numbers.Real):
        raise TypeError(message)
    number = float(drop)
    if not (math.isfinite(number) and 0 < number < 1):
        raise ValueError(message)
    return number


def check_lr(name: str, lr: Any) -> float:
    """A learning rate named ``name`` as a float: a finite number >= 0 or a 0-d tensor of
    one; ``TypeError`` (a str, a bool, ...) or ``ValueError`` (NaN, inf, < 0) otherwise."""
    message = f"{name} must be a finite number >= 0 (a learning rate), got {lr!r}"
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or lr.is_complex() or lr.dtype == torch.bool:
            raise TypeError(message)
        value = float(lr)  # a tensor lr (capturable optimizers): one sync, once per call
    elif isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        raise TypeError(message)
    else:
        value = float(lr)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(message)
    return value


class DecayDetector:
    """Notices learning-rate decays from the rate seen at each call.

    Args:
        drop: ``None`` (the paper): any fall of the rate since the last call is a decay.
            A ratio in (0, 1): a decay is a fall to ``drop`` times the reference rate or
            less, where the reference is the rate at the last decay, raised to any higher
            rate seen since (warm-up); a slowly falling cosine schedule then decays only
            each time its rate has halved (``drop=0.5``), not at every call.
    """

    def __init__(self, drop: float | None = None) -> None:
        self.drop = None if drop is None else check_drop(drop)
        #: The learning rate seen at the last call, or ``None``.
        self.last_lr: float | None = None
        #: The rate a fall is measured from (``drop`` not ``None``), or ``None``.
        self.reference: float | None = None

    @staticmethod
    def lr_of(optimizer: torch.optim.Optimizer | None, next_lr: Any) -> float | None:
        """``next_lr`` if given, else the optimizer's first group's rate, validated: a
        finite number >= 0 (a 0-d tensor too, as optimizers accept), else ``TypeError``
        or ``ValueError`` naming where it came from. Nothing is remembered here."""
        if next_lr is not None:
            return check_lr("next_lr", next_lr)
        if optimizer is None:
            return None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not optimizer.param_groups or "lr" not in optimizer.param_groups[0]:
            raise ValueError("optimizer.param_groups[0]['lr'] must exist: the optimizer has "
                             "no parameter group with a learning rate")  # fmt: skip
        return check_lr("optimizer.param_groups[0]['lr']", optimizer.param_groups[0]["lr"])

    def decay(self, lr: float | None, lr_will_decay: bool | None) -> bool:
        """Whether the rate decays now: ``lr_will_decay`` if given, else a fall of ``lr``
        as ``drop`` defines it. Remembers ``lr``."""
        if lr_will_decay is not None:
            decay = check_bool("lr_will_decay", lr_will_decay)
        elif lr is None:
            decay = False
        elif self.drop is None:
            decay = self.last_lr is not None and lr < self.last_lr
        else:
            decay = self.reference is not None and lr <= self.drop * self.reference
        if lr is not None:
            self.last_lr = lr
            if decay or self.reference is None or lr > self.reference:
                self.reference = lr
        return decay
