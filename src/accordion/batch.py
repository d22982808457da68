"""Accordion's second lever: the global batch size, small in critical regimes, large elsewhere.

Agarwal et al. (MLSys 2021) also cut communication by taking fewer optimizer steps: one
all-reduce per *global* batch, so a batch 8x larger sends 8x fewer floats per epoch. They
train with the small batch (512) in critical regimes and the large one (4096) elsewhere,
deciding on the whole model's gradient. The paper released no code for it and its runs used
a fixed schedule (small for epochs 0-19, then large); :class:`BatchSizeController` offers
both (``mode="fixed"`` and ``mode="adaptive"``).

The adaptive rule is :class:`accordion.regime.RegimeDetector`'s, applied to one "tensor"
named ``"model"``; only the statistic differs. The paper's statistic, the norm of the
gradient *summed* over an epoch's steps, grows with the number of steps: with a batch 8x
smaller there are 8x more steps, so the summed norm is about 8x larger and a switch of
batch size would look like a sharp change by itself. Here the sum is divided by the number
of steps: the statistic is the norm of the epoch's *mean* per-step gradient, whose
expectation does not depend on the batch size (only its noise does).

Gradient accumulation: a global batch of ``B`` samples on ``W`` workers with micro-batches of
``b`` samples is ``B // (b * W)`` forward/backward passes per worker, each loss multiplied by
:func:`accumulation_loss_scale`, then one optimizer step. The harness skips the all-reduce on
all but the last micro-batch (DDP's ``no_sync()``)::

    scale = accumulation_loss_scale(controller.accumulation_steps)
    for i, (x, y) in enumerate(micro_batches):
        last = (i + 1) % controller.accumulation_steps == 0
        with contextlib.nullcontext() if last else model.no_sync():
            (loss_fn(model(x), y) * scale).backward()
        if last:
            controller.observe([p.grad for p in model.parameters()])
            for group in optimizer.param_groups:
                group["lr"] = base_lr * controller.lr_factor()
            optimizer.step()
            optimizer.zero_grad()
            controller.step()
    batch_size = controller.end_epoch(epoch, lr_will_decay=...)

Pure logic and a few tensor additions: no ``torch.distributed``.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._validate import check_bool, check_choice, check_int, check_state_keys
from .regime import RegimeDetector

__all__ = ["MODES", "LR_SCALINGS", "BatchSizeController", "accumulation_loss_scale"]

#: Ways of choosing the batch: the detector's rule, or the paper's fixed switch epoch.
MODES = ("adaptive", "fixed")
#: Learning-rate scaling rules with the batch size: ``batch / small`` or its square root.
LR_SCALINGS = ("linear", "sqrt")

#: The name under which the whole model's statistic is given to the RegimeDetector.
_MODEL = "model"
_CONFIG_KEYS = (
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
_STATE_KEYS = frozenset(
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


def accumulation_loss_scale(accumulation_steps: int) -> float:
    """The factor on each micro-batch loss when accumulating ``accumulation_steps`` of them.

    ``1 / accumulation_steps``: with a mean-reduced loss, the accumulated gradient is then the
    gradient of the mean loss over the whole global batch, exactly as one backward pass on
    the concatenated batch (up to float rounding), provided the model has no batch-coupled
    layers (BatchNorm statistics are per micro-batch).

    Args:
        accumulation_steps: micro-batches per optimizer step on one worker (an int >= 1).
    """
    return 1.0 / check_int("accumulation_steps", accumulation_steps, 1)


class BatchSizeController:
    """Chooses the global batch size epoch by epoch: small when critical, large elsewhere.

    Training starts with ``small``. Per optimizer step the harness calls :meth:`observe`
    with the gradients, scales its learning rate by :meth:`lr_factor`, steps the optimizer,
    then calls :meth:`step`; at the end of each epoch :meth:`end_epoch` returns the global
    batch size of the next epoch.

    Momentum buffers and weight decay need no change across a switch: the optimizer still
    steps once per global batch with the batch-averaged gradient, and weight decay is applied
    once per optimizer step as for any batch size; the learning rate alone carries the
    scaling (:meth:`lr_factor`).

    Args:
        small: global batch in critical regimes, in samples per optimizer step over all
            workers (paper: 512).
        large: global batch elsewhere, in samples per optimizer step (paper: 4096); > small.
        micro_batch: samples per worker in one forward/backward pass (paper: 128).
        world_size: number of workers. ``small`` and ``large`` must be multiples of
            ``micro_batch * world_size``.
        interval: epochs between two checks of the adaptive rule (validated by the
            RegimeDetector; paper: 10).
        eta: threshold on the relative change of the statistic (dimensionless, paper: 0.5).
        mode: ``"adaptive"`` (the RegimeDetector's rule on the statistic) or ``"fixed"``
            (what the paper ran: ``small`` for epochs < ``fixed_switch_epoch``, then
            ``large``; statistic and learning-rate decays ignored).
        fixed_switch_epoch: first epoch of the large batch in fixed mode (epochs, >= 0; 0
            means the large batch from the start, without warm-up).
        lr_scaling: ``"linear"`` (learning rate x ``batch / small``) or ``"sqrt"``
            (x ``sqrt(batch / small)``).
        warmup_steps: optimizer steps over which the learning-rate factor rises linearly to
            its new value after a switch to the larger batch (>= 0; 0: at once).

    Attributes:
        history: one record per :meth:`end_epoch`, oldest first:
            ``{"epoch": int, "batch_size": int}`` where ``batch_size`` is the global batch
            decided for the epoch *after* ``epoch`` (samples per optimizer step).

    Example:
        >>> c = BatchSizeController(512, 4096, micro_batch=128, world_size=4, mode="fixed",
        ...                         fixed_switch_epoch=2)
        >>> c.batch_size, c.accumulation_steps
        (512, 1)
        >>> c.end_epoch(0), c.end_epoch(1), c.accumulation_steps, c.lr_factor()
        (512, 4096, 8, 8.0)
    """

    def __init__(
        self,
        small: int,
        large: int,
        *,
        micro_batch: int,
        world_size: int,
        interval: int = 10,
        eta: float = 0.5,
        mode: str = "adaptive",
        fixed_switch_epoch: int = 20,
        lr_scaling: str = "linear",
        warmup_steps: int = 0,
    ) -> None:
        self._small = check_int("small", small, 1)
        self._large = check_int("large", large, 1)
        self._micro_batch = check_int("micro_batch", micro_batch, 1)
        self._world_size = check_int("world_size", world_size, 1)
        if self._large <= self._small:
            raise ValueError(
                f"small must be < large (global batch sizes, samples per optimizer step), "
                f"got small={self._small}, large={self._large}"
            )
        per_pass = self._micro_batch * self._world_size
        for name, value in (("small", self._small), ("large", self._large)):
            if value % per_pass:
                raise ValueError(
                    f"{name} must be a multiple of micro_batch * world_size = "
                    f"{self._micro_batch} * {self._world_size} = {per_pass} samples (a whole "
                    f"number of micro-batches per worker), got {name}={value}"
                )
        self._mode = check_choice("mode", mode, MODES)
        self._lr_scaling = check_choice("lr_scaling", lr_scaling, LR_SCALINGS)
        self._warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self._fixed_switch_epoch = check_int("fixed_switch_epoch", fixed_switch_epoch, 0)
        # the rule lives in one place: interval and eta are validated (and used) there
        self._detector = RegimeDetector(interval=interval, eta=eta)

        fixed_large_at_once = self._mode == "fixed" and self._fixed_switch_epoch == 0
        self._batch_size = self._large if fixed_large_at_once else self._small
        self._last_epoch: int | None = None
        self._steps_since_switch = 0
        # the lr factor a warm-up starts from; None when no warm-up is in force
        self._warmup_from: float | None = None
        # running sum of the per-step gradients of the current epoch, one tensor per gradient
        self._accumulator: list[torch.Tensor] | None = None
        self._observed_steps = 0
        self.history: list[dict[str, int]] = []

    # ----------------------------------------------------------------------------- properties

    @property
    def small(self) -> int:
        """Global batch in critical regimes (samples per optimizer step)."""
        return self._small

    @property
    def large(self) -> int:
        """Global batch outside critical regimes (samples per optimizer step)."""
        return self._large

    @property
    def micro_batch(self) -> int:
        """Samples per worker in one forward/backward pass."""
        return self._micro_batch

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self._world_size

    @property
    def mode(self) -> str:
        """``"adaptive"`` or ``"fixed"``."""
        return self._mode

    @property
    def batch_size(self) -> int:
        """The global batch in force now (samples per optimizer step over all workers)."""
        return self._batch_size

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per worker per optimizer step for the batch in force."""
        return self._batch_size // (self._micro_batch * self._world_size)

    @property
    def steps_since_switch(self) -> int:
        """Optimizer steps counted by :meth:`step` since the last change of batch size."""
        return self._steps_since_switch

    @property
    def observed_steps(self) -> int:
        """Optimizer steps accumulated by :meth:`observe` in the current epoch."""
        return self._observed_steps

    @property
    def checks(self) -> list[dict[str, Any]]:
        """The RegimeDetector's history: one record per check epoch (empty in fixed mode).

        The statistic of a check is ``record["layers"]["model"]["new_norm"]``.
        """
        return self._detector.history

    @property
    def current_epoch(self) -> int:
        """The epoch under way: one after the last :meth:`end_epoch`, 0 before the first."""
        return 0 if self._last_epoch is None else self._last_epoch + 1

    # ------------------------------------------------------------------------------ statistic

    def _collecting(self) -> bool:
        return self._mode == "adaptive" and self._detector.needs_statistic(self.current_epoch)

    def observe(self, grads: Sequence[torch.Tensor]) -> None:
        """Add one optimizer step's gradients to the statistic of the current epoch.

        Call once per optimizer step, after the last micro-batch's backward pass (and the
        all-reduce), with the global batch's averaged gradient tensors, in the same order
        every step: averaged gradients are identical on every worker, so every worker
        reaches the same decision without a broadcast. Leave out steps skipped by a gradient
        scaler (non-finite gradients). The gradients are read, not changed.

        A no-op in fixed mode and in epochs whose statistic the rule does not use (not a
        check epoch, see :meth:`RegimeDetector.needs_statistic`); the current epoch is
        :attr:`current_epoch`. Otherwise the first call of the epoch allocates one buffer
        the size of the model (float64, float32 on devices without float64) on the
        gradients' device.

        Raises:
            TypeError: ``grads`` is not a non-empty sequence of floating-point tensors.
            ValueError: the number or shapes of the tensors differ from the epoch's first call.
        """
        if isinstance(grads, torch.Tensor) or not isinstance(grads, Sequence):
            raise TypeError(
                f"grads must be a sequence of gradient tensors (one per parameter), "
                f"got {type(grads).__name__}"
            )
        if not grads:
            raise TypeError("grads must name at least one gradient tensor, got an empty sequence")
        for i, g in enumerate(grads):
            if not isinstance(g, torch.Tensor) or not g.is_floating_point():
                raise TypeError(
                    f"grads[{i}] must be a floating-point tensor (pass only parameters that "
                    f"have a gradient), got {g!r:.80}"
                )
        if not self._collecting():
            return
        if self._accumulator is None:
            self._accumulator = [self._new_buffer(g) for g in grads]
        elif len(grads) != len(self._accumulator) or any(
            g.shape != a.shape for g, a in zip(grads, self._accumulator)
        ):
            raise ValueError(
                f"grads must have the same tensors every step of an epoch: expected shapes "
                f"{[tuple(a.shape) for a in self._accumulator]}, "
                f"got {[tuple(g.shape) for g in grads]}"
            )
        with torch.no_grad():
            for a, g in zip(self._accumulator, grads):
                # in-place add promotes g to the buffer's wider dtype without a temporary copy
                a.add_(g.detach())
        self._observed_steps += 1

    @staticmethod
    def _new_buffer(grad: torch.Tensor) -> torch.Tensor:
        # float64 keeps an epoch of additions exact enough; MPS has no float64
        dtype = torch.float32 if grad.device.type == "mps" else torch.float64
        return torch.zeros(grad.shape, dtype=dtype, device=grad.device)

    def statistic(self) -> float | None:
        """The norm of the mean per-step gradient observed so far this epoch, or None.

        ``|| sum over steps of the gradient ||_2 / steps`` over the whole model (all tensors
        as one vector), in gradient units; None when no step was observed this epoch.
        Dividing by the steps makes it comparable across batch sizes (module docstring).
        Synchronises with the gradients' device.
        """
        if self._accumulator is None or self._observed_steps == 0:
            return None
        norms = torch.stack([torch.linalg.vector_norm(a) for a in self._accumulator])
        return float(torch.linalg.vector_norm(norms)) / self._observed_steps

    # ------------------------------------------------------------------------------- decisions

    def end_epoch(self, epoch: int, lr_will_decay: bool = False) -> int:
        """Record the end of ``epoch`` and return the global batch size for the next epoch.

        Adaptive mode: at a check epoch the statistic (:meth:`statistic`) goes to the
        RegimeDetector under the name ``"model"``; critical means ``small``, otherwise
        ``large``. A learning-rate decay makes it ``small`` until the next check. Fixed
        mode: ``large`` iff ``epoch + 1 >= fixed_switch_epoch``. The accumulator is reset
        either way. A change of batch size restarts :attr:`steps_since_switch`.

        Args:
            epoch: the epoch that just ended (0-based), greater than the last one given.
            lr_will_decay: True when the next epoch's learning rate is lower than this one's.

        Returns:
            The global batch of the next epoch (samples per optimizer step).

        Raises:
            TypeError: an argument of the wrong type.
            ValueError: ``epoch`` not after the last one, or a check epoch in adaptive mode
                without any :meth:`observe` call (they accumulate only in
                :attr:`current_epoch`, so epochs skipped before a check lose its statistic).
        """
        epoch = check_int("epoch", epoch, 0)
        check_bool("lr_will_decay", lr_will_decay)
        if self._last_epoch is not None and epoch <= self._last_epoch:
            raise ValueError(
                f"epoch must be greater than the last epoch given ({self._last_epoch}): "
                f"epochs are given in increasing order, got {epoch}"
            )
        if self._mode == "fixed":
            new_batch = self._large if epoch + 1 >= self._fixed_switch_epoch else self._small
        else:
            new_batch = self._decide(epoch, lr_will_decay)
        self._last_epoch = epoch
        self._accumulator = None
        self._observed_steps = 0
        if new_batch != self._batch_size:
            self._switch(new_batch)
        self.history.append({"epoch": epoch, "batch_size": new_batch})
        return new_batch

    def _decide(self, epoch: int, lr_will_decay: bool) -> int:
        norms: dict[str, float] = {}
        if self._detector.needs_statistic(epoch):
            statistic = self.statistic()
            if statistic is None:
                raise ValueError(
                    f"epoch {epoch} is a check epoch (interval={self._detector.interval}) but "
                    f"no optimizer step was observed: call observe(grads) once per optimizer "
                    f"step during the epoch (it accumulates only in the epoch after the last "
                    f"end_epoch, here epoch {self.current_epoch})"
                )
            norms[_MODEL] = statistic
        decision = self._detector.end_epoch(epoch, norms, lr_will_decay)
        # no decision yet (first call at a non-check epoch): stay careful, as training starts
        return self._small if decision.get(_MODEL, True) else self._large

    def _switch(self, new_batch: int) -> None:
        current = self.lr_factor()
        # up: ramp from the factor in force now; down: drop at once (a smaller lr is safe)
        going_up = new_batch > self._batch_size and self._warmup_steps > 0
        self._warmup_from = current if going_up else None
        self._batch_size = new_batch
        self._steps_since_switch = 0

    # ---------------------------------------------------------------------------- learning rate

    def _target_factor(self) -> float:
        ratio = self._batch_size / self._small
        return ratio if self._lr_scaling == "linear" else math.sqrt(ratio)

    def step(self) -> None:
        """Count one optimizer step (call after each ``optimizer.step()``), for the warm-up."""
        self._steps_since_switch += 1

    def lr_factor(self, steps_since_switch: int | None = None) -> float:
        """The multiplier on the small-batch learning rate for the batch in force.

        ``batch / small`` (linear scaling) or ``sqrt(batch / small)``; after a switch to the
        larger batch it rises linearly from the factor in force before the switch to that
        value over ``warmup_steps`` optimizer steps (the full value from step
        ``warmup_steps`` on). After a switch to the smaller batch it drops at once.

        Args:
            steps_since_switch: optimizer steps since the last switch (an int >= 0); None
                uses the count kept by :meth:`step`.
        """
        if steps_since_switch is None:
            steps = self._steps_since_switch
        else:
            steps = check_int("steps_since_switch", steps_since_switch, 0)
        target = self._target_factor()
        if self._warmup_from is None or steps >= self._warmup_steps:
            return target
        return self._warmup_from + (target - self._warmup_from) * steps / self._warmup_steps

    # ------------------------------------------------------------------------------ accounting

    def floats_per_epoch(self, model_floats_per_step: int, samples_per_epoch: int) -> int:
        """Floats sent per worker in one epoch with the batch in force.

        ``model_floats_per_step * (samples_per_epoch // batch_size)``: one all-reduce per
        optimizer step (global batch), none per micro-batch; the incomplete tail batch is
        dropped.

        Args:
            model_floats_per_step: floats one worker sends per optimizer step (>= 0), e.g.
                the model's parameter count for a dense all-reduce.
            samples_per_epoch: training samples in one epoch over all workers (>= 0).
        """
        floats = check_int("model_floats_per_step", model_floats_per_step, 0)
        samples = check_int("samples_per_epoch", samples_per_epoch, 0)
        return floats * (samples // self._batch_size)

    def check_resumable(self, micro_steps_done: int) -> int:
        """Refuse to resume between the micro-batches of one optimizer step.

        Args:
            micro_steps_done: micro-batches (forward/backward passes) one worker has done
                with the batch in force, e.g. since the start of the epoch (an int >= 0).

        Returns:
            The optimizer steps those micro-batches make: ``micro_steps_done //
            accumulation_steps``.

        Raises:
            ValueError: ``micro_steps_done`` is not a multiple of :attr:`accumulation_steps`:
                the partly accumulated gradients are not in any checkpoint.
        """
        micro = check_int("micro_steps_done", micro_steps_done, 0)
        if micro % self.accumulation_steps:
            raise ValueError(
                f"resume in the middle of an accumulation window (micro_steps_done={micro}, "
                f"accumulation_steps={self.accumulation_steps}, {micro % self.accumulation_steps} "
                f"micro-batches into a window) is not supported; save at an optimizer-step "
                f"boundary"
            )
        return micro // self.accumulation_steps

    # ---------------------------------------------------------------------------- checkpoints

    def _config(self) -> dict[str, Any]:
        return {
            "small": self._small,
            "large": self._large,
            "micro_batch": self._micro_batch,
            "world_size": self._world_size,
            "interval": self._detector.interval,
            "eta": self._detector.eta,
            "mode": self._mode,
            "lr_scaling": self._lr_scaling,
            "warmup_steps": self._warmup_steps,
            "fixed_switch_epoch": self._fixed_switch_epoch,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as tensors and plain values (``weights_only``-loadable).

        Keys: ``config`` (the constructor's arguments), ``batch_size`` (samples per step),
        ``last_epoch`` (int or None), ``steps_since_switch`` (steps), ``warmup_from`` (the
        lr factor a warm-up starts from, or None), ``accumulator`` (list of tensors, or
        None), ``observed_steps`` (steps), ``detector`` (the RegimeDetector's state) and
        ``history``. Tensors are copies.
        """
        return {
            "config": self._config(),
            "batch_size": self._batch_size,
            "last_epoch": self._last_epoch,
            "steps_since_switch": self._steps_since_switch,
            "warmup_from": self._warmup_from,
            "accumulator": None
            if self._accumulator is None
            else [a.detach().clone() for a in self._accumulator],
            "observed_steps": self._observed_steps,
            "detector": self._detector.state_dict(),
            "history": copy.deepcopy(self.history),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`, whose ``config`` must equal this controller's.

        Nothing changes when it raises.

        Raises:
            TypeError: ``state`` is not a Mapping, or a value has the wrong type.
            ValueError: missing or unexpected keys, a config field that differs (named), or
                invalid values.
        """
        check_state_keys(state, _STATE_KEYS, "BatchSizeController")
        self._check_config(state["config"])
        batch_size, last_epoch, steps_since_switch, warmup_from, observed_steps, accumulator = (
            self._checked_values(state)
        )
        history = state["history"]
        if not isinstance(history, list):
            raise TypeError(f"state['history'] must be a list of records, got {history!r}")
        # load into a fresh detector first, so that a bad state leaves this one untouched
        detector = RegimeDetector(interval=self._detector.interval, eta=self._detector.eta)
        detector.load_state_dict(state["detector"])
        self._batch_size = int(batch_size)
        self._last_epoch = last_epoch
        self._steps_since_switch = steps_since_switch
        self._warmup_from = warmup_from
        self._accumulator = accumulator
        self._observed_steps = observed_steps
        self._detector = detector
        self.history = copy.deepcopy(history)

    def _check_config(self, config: Any) -> None:
        if not isinstance(config, Mapping):
            raise TypeError(f"state['config'] must be a Mapping, got {config!r}")
        mine = self._config()
        for key in _CONFIG_KEYS:
            if key not in config or config[key] != mine[key]:
                raise ValueError(
                    f"state['config']['{key}'] is {config.get(key, '<missing>')!r} but this "
                    f"controller's {key} is {mine[key]!r}: build the controller with the same "
                    f"{key}"
                )

    def _checked_values(self, state: Mapping[str, Any]) -> tuple:
        """The state's counters and accumulator, validated (copies: the state is not kept)."""
        batch_size = state["batch_size"]
        if batch_size not in (self._small, self._large) or isinstance(batch_size, bool):
            raise ValueError(
                f"state['batch_size'] must be small ({self._small}) or large ({self._large}), "
                f"got {batch_size!r}"
            )
        last_epoch = state["last_epoch"]
        if last_epoch is not None:
            last_epoch = check_int("state['last_epoch']", last_epoch, 0)
        steps_since_switch = check_int(
            "state['steps_since_switch']", state["steps_since_switch"], 0
        )
        warmup_from = state["warmup_from"]
        if warmup_from is not None:
            if isinstance(warmup_from, bool) or not isinstance(warmup_from, numbers.Real):
                raise TypeError(
                    f"state['warmup_from'] must be a float (an lr factor) or None, "
                    f"got {warmup_from!r}"
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
            accumulator = [a.detach().clone() for a in accumulator]
        return batch_size, last_epoch, steps_since_switch, warmup_from, observed_steps, accumulator
