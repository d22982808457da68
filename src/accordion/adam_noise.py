"""Adam's second moment, corrected for the noise that compression adds.

With error feedback a compressed average is the true one plus the workers' mean of
``e_prev - e_now``, their residuals. Adam's first moment averages that noise away (the
residuals telescope), but its second moment ``v`` adds the noise's variance to the
gradient's: where compression errs, ``v`` grows and the step ``m / sqrt(v)`` shrinks.
On the character transformer that is what 2-bit quantisation costs: the same run with
``v`` fed the true average kept dense quality (``docs/dense-quality.md``).

A quantiser knows its noise: the rounding error of a block is a known multiple of the
block's scale squared, and every rank received every worker's scales
(:meth:`~accordion.compress.Compressor.residual_variance`). So Adam can use

    v_used = max(v - s, floor * v),   s = EMA_beta2(noise variance * c**2)

where ``v`` is Adam's own second moment (kept as it is), ``s`` the same moving average of
the noise variance, and ``c`` the factor by which clipping or a ``GradScaler`` scaled the
gradient after it was averaged. The floor keeps a coordinate whose noise hides its
gradient from taking an unbounded step. Every rank computes the same ``v_used``.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

from ._optim_hooks import closure_aware
from .compress.memory import ErrorFeedback
from .controller import Controller

#: ``floor``'s default: ``v_used`` at least a quarter of ``v`` (a step at most 2x Adam's).
DEFAULT_FLOOR = 0.25
#: The attribute that marks an optimizer as corrected (one correction per optimizer).
_HOOKED = "_accordion_noise_correction"
#: The attribute that marks an optimizer as exchanging its momentum (``MomentumExchange``).
_EXCHANGED = "_accordion_momentum_exchange"


def _check_state(state: Any) -> None:
    """``state`` must be a :class:`~accordion.controller.Controller`."""
    if not isinstance(state, Controller):
        raise TypeError(f"state must be an accordion Controller (AccordionState), "
                        f"got {type(state).__name__}")  # fmt: skip


def _check_optimizer(optimizer: Any) -> None:
    """``optimizer`` must be a ``torch.optim.Adam`` or ``AdamW`` whose update this
    correction models: no AMSGrad, no maximize, no L2 decay added to the gradient."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(f"optimizer must be a torch.optim.Adam or AdamW, "
                        f"got {type(optimizer).__name__}")  # fmt: skip
    decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay", False) for g in optimizer.param_groups
    )
    for i, group in enumerate(optimizer.param_groups):
        for option in ("amsgrad", "maximize"):
            if group.get(option):
                raise ValueError(f"optimizer param_groups[{i}] has {option}=True: the noise "
                                 "correction models Adam's plain second moment")  # fmt: skip
        if group.get("weight_decay") and not decoupled:
            raise ValueError(f"optimizer param_groups[{i}] adds weight_decay="
                             f"{group['weight_decay']} to the gradient (Adam's L2 decay): use "
                             "AdamW, whose decay leaves the second moment alone")  # fmt: skip


class StepHooks:
    """A pre- and a post-hook on an optimizer's step, marked on it by an attribute (one
    object of a kind per optimizer), and their removal."""

    optimizer: torch.optim.Optimizer
    _attribute: str

    def _hook(self, attribute: str) -> None:
        self._attribute = attribute
        step = self.optimizer
        self._handles: list[Any] = [step.register_step_pre_hook(closure_aware(self._before)),
                                    step.register_step_post_hook(self._after)]  # fmt: skip
        setattr(self.optimizer, attribute, self)

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before each step."""

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """After each step."""

    def _params(self) -> list[torch.Tensor]:
        """Every parameter of the optimizer, in its order."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _per_param(self, name: str, values: Any) -> dict[torch.Tensor, torch.Tensor]:
        """``values``, a list of one tensor (of the parameter's shape) or ``None`` per
        parameter, as a dict of the tensors' clones; else ``ValueError`` naming ``name``."""
        params = self._params()
        if not isinstance(values, list) or len(values) != len(params):
            raise ValueError(f"{name} must be a list of {len(params)} entries, one per "
                             "parameter of the optimizer")  # fmt: skip
        for i, (p, v) in enumerate(zip(params, values)):
            if v is not None and (not isinstance(v, torch.Tensor) or v.shape != p.shape):
                raise ValueError(f"{name}[{i}] must be None or a tensor of shape "
                                 f"{tuple(p.shape)}, got {v!r:.80}")  # fmt: skip
        return {p: v.clone() for p, v in zip(params, values) if v is not None}

    def remove(self) -> None:
        """Unhook: the optimizer steps as plain Adam from now on."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if getattr(self.optimizer, self._attribute, None) is self:
            setattr(self.optimizer, self._attribute, None)


def noise_of(state: Controller, param: torch.Tensor) -> tuple[torch.Tensor | None,
                                                             torch.Tensor | None]:  # fmt: skip
    """``(variance, square)`` of ``param``'s last averaged gradient under ``state``: per
    element the expected square of its compression error (``None`` where it went dense or
    its compressor has no model of its error: :meth:`NoiseTracker.variance`), and its
    squared norm as averaged (``None`` if unknown)."""
    key = state.params.key_of(param)
    if key is None:
        return None, None
    reducer = state.reducer
    feedback = isinstance(reducer.memory, ErrorFeedback)
    return reducer.noise.variance(key, reducer.compressor, feedback), reducer.noise.square(key)


class AdamNoiseCorrection(StepHooks):
    """Correct ``optimizer``'s second moment for the compression noise of ``state``'s
    averages (see the module), through the optimizer's step hooks.

    Before each step, per parameter whose last average has a known error variance
    (:func:`noise_of`; a quantiser's, ``"int"`` or ``"nq"``, also as a rung of
    ``"mixed"``), Adam's ``exp_avg_sq`` is set so that its own update yields ``v_used``;
    after the step it is set back to the plain moving average, which goes on as Adam
    keeps it. Other parameters (dense, or sent by a compressor without an error model)
    are left alone: with nothing compressed the optimizer steps exactly as without it.

    Args:
        optimizer: a ``torch.optim.AdamW`` (or ``Adam`` without L2 decay), not AMSGrad.
        state: the :class:`~accordion.controller.Controller` (``AccordionState``) that
            averages the optimizer's gradients; its noise tracking is turned on.
        floor: ``v_used >= floor * v``, a number in (0, 1] (default 0.25).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, state: Controller,
                 floor: float = DEFAULT_FLOOR):  # fmt: skip
        _check_optimizer(optimizer)
        _check_state(state)
        if isinstance(floor, bool) or not isinstance(floor, numbers.Real) or not 0 < floor <= 1:
            raise ValueError(f"floor must be a number in (0, 1], got {floor!r}")
        if getattr(optimizer, _HOOKED, None) is not None:  # two would subtract the noise twice
            raise ValueError("optimizer has an AdamNoiseCorrection already: remove() it first")
        if getattr(optimizer, _EXCHANGED, None) is not None:
            raise ValueError("optimizer has a MomentumExchange already: create the "
                             "AdamNoiseCorrection first, so that the freeze holds "
                             "its moment")  # fmt: skip
        self.optimizer: torch.optim.Optimizer = optimizer
        self.state: Controller = state
        self.floor: float = float(floor)
        state.reducer.noise.on = True  # a loaded checkpoint's reducer keeps it on
        self._noise: dict[torch.Tensor, torch.Tensor] = {}  # per parameter: s
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: Optimizer steps at which some parameter's second moment was corrected.
        self.corrected_steps: int = 0
        self._hook(_HOOKED)

    def used(self, param: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The second moment Adam would use for ``param`` whose plain one is ``v``:
        ``max(v - s, floor * v)`` with the noise average ``s`` so far (``v`` without one)."""
        s = self._noise.get(param)
        return v if s is None else torch.maximum(v - s.to(v.dtype), v * self.floor)

    def _noises(self) -> tuple[list[tuple[torch.Tensor, dict, torch.Tensor]], float]:
        """``(parameter, group, variance)`` of each parameter with a known error, and
        ``c**2``: the squared norm of the gradients now over that of the averages."""
        noisy, recorded = [], []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                variance, square = noise_of(self.state, p)
                if square is not None:  # clipping scales every averaged gradient alike
                    recorded.append((grad, square))
                if variance is not None:
                    noisy.append((p, group, variance))
        if not noisy or not recorded:  # nothing to correct: no pass over the gradients
            return noisy, 1.0
        total = float(torch.stack([square for _, square in recorded]).sum())
        now = torch.stack([g.detach().float().square().sum() for g, _ in recorded]).sum()
        return noisy, float(now) / total if total > 0 else 1.0

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        noisy, scale = self._noises()
        self.state.reducer.noise.consume()  # one exchange's noise corrects one step
        for p, group, variance in noisy:
            beta2 = group["betas"][1]
            s = self._noise.get(p)
            if s is None:
                s = self._noise[p] = torch.zeros_like(p, dtype=variance.dtype)
            s.mul_(beta2).add_(variance, alpha=(1 - beta2) * scale)
            v = optimizer.state.get(p, {}).get("exp_avg_sq")
            if v is None:  # Adam's first step creates it: nothing to correct yet
                continue
            g2 = p.grad.detach().square().to(v.dtype)  # type: ignore[union-attr]
            plain = v * beta2 + g2 * (1 - beta2)  # what Adam's update will make of v
            used = self.used(p, plain)
            v.copy_((used - g2 * (1 - beta2)) / beta2)  # so that Adam's update gives `used`
            self._pending.append((v, plain))
        if self._pending:
            self.corrected_steps += 1

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for v, plain in self._pending:
            v.copy_(plain)  # Adam's own moving average goes on uncorrected
        self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        """The noise averages ``s`` in the optimizer's parameter order (``None`` where a
        parameter has none), the floor and the count of corrected steps."""
        return {"noise": [self._noise.get(p) for p in self._params()], "floor": self.floor,
                "corrected_steps": self.corrected_steps}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same optimizer's parameters; anything else
        is a ``ValueError`` naming it, and changes nothing."""
        noise = state.get("noise") if isinstance(state, Mapping) else None
        self._noise = self._per_param("noise", noise)
        self.corrected_steps = int(state.get("corrected_steps", 0))
