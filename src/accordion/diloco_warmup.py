"""When a DiLoCo warm-up may end: the paper's norm test on the averaged gradient.

Accordion's finding is that training's critical regime shows in how fast the gradient's
norm changes: a layer is critical while the norm of its gradients summed over a window
changes by ``eta`` or more (relative) from one window to the next. :class:`WarmupEnd`
applies that test to the whole model's averaged warm-up gradient, window by window, and
says when it first finds the model calm: DiLoCo then leaves data-parallel steps for its
rounds. A window that ends at a higher learning rate than it began at (a learning-rate
warm-up) is critical whatever its norms, as the paper holds a window with a decay
critical: the schedule is still moving the model into its regime. The test is on the
average that every rank applies, and each window's norm is agreed with one ``max``
all-reduce of one float, so every rank ends on the same step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._validate import check_int, check_number, check_state_keys

if TYPE_CHECKING:
    from .controller import Controller

_STATE_KEYS = frozenset({"sums", "steps", "checks", "first_lr"})


class WarmupEnd:
    """The norm test over windows of ``window`` warm-up steps.

    Args:
        params: the parameters whose averaged gradients are summed.
        eta: the threshold of the relative change of the window's norm (a float > 0; the
            paper's 0.5 is the usual value).
        window: warm-up steps per window (an int >= 1).
    """

    def __init__(self, params: Sequence[torch.Tensor], eta: float, window: int):
        self.eta = check_number("warmup_eta", eta, minimum=0.0, strict=True)
        self.window = check_int("warmup_window", window, 1)
        self._sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        self._steps = 0  # steps summed in the current window
        self._first_lr: float | None = None  # the learning rate of the window's first step
        #: One record per finished window: its last ``step``, ``norm``, ``ratio`` to the
        #: window before (``None`` for the first), whether its last step's learning rate
        #: was above its first step's (``lr_rose``) and whether it was ``calm``.
        self.checks: list[dict[str, Any]] = []

    def add(self, params: Sequence[torch.Tensor]) -> None:
        """Sum this step's averaged gradients into the window."""
        for total, p in zip(self._sums, params):
            if p.grad is not None:
                total.add_(p.grad.detach().float())

    def calm_after(self, step: int, transport: Any, lr: float) -> bool:
        """Count one step (``step``, the inner steps so far, taken at learning rate
        ``lr``); at a window's end, test it (collective: every rank must call this at
        every warm-up step). Returns whether this window was calm: its norm changed by
        less than ``eta`` from the last one's, and its last step's learning rate is not
        above its first step's."""
        self._steps += 1
        if self._first_lr is None:
            self._first_lr = float(lr)
        if self._steps < self.window:
            return False
        rose, self._first_lr = float(lr) > self._first_lr, None
        local = math.sqrt(sum(float(t.double().square().sum()) for t in self._sums))
        norm = float(transport.all_reduce(torch.tensor([local], dtype=torch.float64), "max"))
        for total in self._sums:
            total.zero_()
        self._steps = 0
        old = self.checks[-1]["norm"] if self.checks else None
        ratio = abs(old - norm) / old if old else None  # no old norm, or 0: critical
        calm = ratio is not None and ratio < self.eta and not rose
        self.checks.append({"step": step, "norm": norm, "ratio": ratio, "lr_rose": rose,
                            "calm": calm})  # fmt: skip
        return calm

    def state_dict(self) -> dict[str, Any]:
        """The window's sums, step count and first learning rate, and the checks so far."""
        return {"sums": [t.clone() for t in self._sums], "steps": self._steps,
                "first_lr": self._first_lr, "checks": [dict(c) for c in self.checks]}  # fmt: skip

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; sums of other shapes or a bad count is a
        ``ValueError`` and changes nothing."""
        check_state_keys(saved, _STATE_KEYS, "warmup_test")
        sums, shapes = saved["sums"], [tuple(t.shape) for t in self._sums]
        if not isinstance(sums, list | tuple) or [tuple(t.shape) for t in sums] != shapes:
            raise ValueError("warmup_test sums must be tensors of the parameters' shapes")
        steps = saved["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < self.window:
            raise ValueError(f"warmup_test steps must be an int in [0, {self.window}), "
                             f"got {steps!r}")  # fmt: skip
        if not isinstance(saved["checks"], list):
            raise ValueError(f"warmup_test checks must be a list, got {saved['checks']!r}")
        first_lr = saved["first_lr"]
        if (first_lr is None) != (steps == 0) or not isinstance(first_lr, float | None):
            raise ValueError(f"warmup_test first_lr must be a float inside a window (steps "
                             f"{steps}), None at its start, got {first_lr!r}")  # fmt: skip
        for mine, theirs in zip(self._sums, sums):
            mine.copy_(theirs)
        self._steps, self.checks = steps, [dict(c) for c in saved["checks"]]
        self._first_lr = first_lr


class WarmupSteps:
    """DiLoCo's warm-up, before its first round: data-parallel steps (each step's
    gradients averaged through ``warmup_state``, a pre-hook on the inner optimiser), or
    short rounds (``warmup_sync_every`` K > 1: a sync every K steps, landing as the
    replicas' plain average), and the norm test that may end it. A base of
    :class:`accordion.DiLoCo`, which sets the attributes below."""

    params: list[nn.Parameter]
    inner: torch.optim.Optimizer
    state: Controller
    warmup_state: Controller | None
    warmup_test: WarmupEnd | None
    warmup_steps: int
    warmup_sync_every: int
    warmup_end: int | None
    inner_steps: int
    _anchor: list[torch.Tensor]
    _synced_at: int

    @property
    def warmup_length(self) -> int:
        """The warm-up's inner steps: :attr:`warmup_end` once the test ended it, else
        ``warmup_steps``."""
        return self.warmup_steps if self.warmup_end is None else self.warmup_end

    @property
    def in_warmup(self) -> bool:
        """Whether the next inner step is a warm-up step."""
        return self.inner_steps < self.warmup_length

    def _sync(self, plain: bool) -> None:
        raise NotImplementedError  # DiLoCo's

    def _before_warmup_step(self, *_: Any) -> None:
        """The inner optimiser's pre-hook: in the warm-up, average the gradients (a
        per-step warm-up) and sum them into the norm test (each worker's own with short
        rounds)."""
        if not self.in_warmup:
            return
        if self.warmup_state is not None:
            self.warmup_state.reduce_gradients(self.params)  # collective
        if self.warmup_test is not None:
            self.warmup_test.add(self.params)

    def _warmup_step(self) -> bool:
        """Count one warm-up step: a data-parallel one (the replicas are equal: the next
        round starts here), or one of a short round, synced at its end; then let the norm
        test (if any) end the warm-up. Returns whether it synced."""
        self.inner_steps += 1
        synced = self.warmup_sync_every > 1 and self.inner_steps % self.warmup_sync_every == 0
        if synced:
            self._sync(plain=True)
        elif self.warmup_state is not None:
            self._synced_at = self.inner_steps
            self.warmup_state.end_step(self.inner)
            with torch.no_grad():
                for p, anchor in zip(self.params, self._anchor):
                    anchor.copy_(p)
        if self.warmup_test is not None:  # the test's transport and lr only with a test
            lr = self.inner.param_groups[0]["lr"]  # the schedule's, alike on every rank
            state = self.warmup_state if self.warmup_state is not None else self.state
            if self.warmup_test.calm_after(self.inner_steps, state.transport(), lr):
                self.warmup_end = self.inner_steps  # collective: one step on every rank
        return synced
