"""The batch-size controller: the global batch in force and what follows from it
(accumulation, learning rate, floats sent, checkpoints); a :class:`~.decider.BatchDecider`
chooses the batch of each next epoch."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._validate import check_bool, check_choice, check_int, check_state_keys
from .decider import MODES, BatchDecider
from .lr import LR_SCALINGS, LearningRate
from .state import STATE_KEYS, check_config, checked_values
from .statistic import check_grads

__all__ = ["MODES", "LR_SCALINGS", "BatchSizeController", "accumulation_loss_scale"]


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
        interval: epochs between two checks of the adaptive rule (paper: 10).
        eta: threshold on the relative change of the statistic (dimensionless, paper: 0.5).
        mode: ``"adaptive"`` (the paper rule on the statistic) or ``"fixed"`` (what the
            paper ran: ``small`` for epochs < ``fixed_switch_epoch``, then ``large``;
            statistic and learning-rate decays ignored).
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
        small, large = check_int("small", small, 1), check_int("large", large, 1)
        self._micro_batch = check_int("micro_batch", micro_batch, 1)
        self._world_size = check_int("world_size", world_size, 1)
        _check_batches(small, large, self._micro_batch, self._world_size)
        check_choice("mode", mode, MODES)  # before the learning rate's: the order of errors
        self._lr = LearningRate(small, lr_scaling, warmup_steps)
        self._decider = BatchDecider(small, large, interval=interval, eta=eta, mode=mode,
                                     fixed_switch_epoch=fixed_switch_epoch)  # fmt: skip
        self._batch_size = self._decider.first_batch
        self._last_epoch: int | None = None
        self.history: list[dict[str, int]] = []

    @property
    def small(self) -> int:
        """Global batch in critical regimes (samples per optimizer step)."""
        return self._decider.ladder.mildest

    @property
    def large(self) -> int:
        """Global batch outside critical regimes (samples per optimizer step)."""
        return self._decider.ladder.most_aggressive

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
        return self._decider.mode

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
        return self._lr.steps_since_switch

    @property
    def observed_steps(self) -> int:
        """Optimizer steps accumulated by :meth:`observe` in the current epoch."""
        return self._decider.gradient.steps

    @property
    def checks(self) -> list[dict[str, Any]]:
        """The paper rule's history: one record per check epoch (empty in fixed mode); the
        statistic of a check is ``record["layers"]["model"]["new_norm"]``."""
        return self._decider.rule.history

    @property
    def current_epoch(self) -> int:
        """The epoch under way: one after the last :meth:`end_epoch`, 0 before the first."""
        return 0 if self._last_epoch is None else self._last_epoch + 1

    def observe(self, grads: Sequence[torch.Tensor]) -> None:
        """Add one optimizer step's gradients to the statistic of the current epoch.

        Call once per optimizer step, after the last micro-batch's backward pass (and the
        all-reduce), with the global batch's averaged gradient tensors, in the same order
        every step: they are identical on every worker, so every worker reaches the same
        decision without a broadcast. Leave out steps a gradient scaler skips. The
        gradients are read, not changed. A no-op in fixed mode and outside check epochs
        (``epoch % interval != 0``, for the :attr:`current_epoch`); otherwise the epoch's
        first call allocates one buffer the size of the model (float64, float32 on devices
        without float64) on the gradients' device.

        Raises:
            TypeError: ``grads`` is not a non-empty sequence of floating-point tensors.
            ValueError: the number or shapes of the tensors differ from the epoch's first call.
        """
        check_grads(grads)
        self._decider.observe(self.current_epoch, grads)

    def statistic(self) -> float | None:
        """The norm of the mean per-step gradient observed so far this epoch, or None.

        ``|| sum over steps of the gradient ||_2 / steps`` over the whole model, in gradient
        units, comparable across batch sizes (``accordion.batch.statistic``); NaN when a
        gradient observed was not finite. Synchronises with the gradients' device."""
        return self._decider.gradient.statistic()

    def end_epoch(self, epoch: int, lr_will_decay: bool = False) -> int:
        """Record the end of ``epoch`` and return the global batch size for the next epoch.

        Adaptive mode: at a check epoch the paper rule on :meth:`statistic` decides,
        ``small`` if critical, else ``large``; a learning-rate decay makes it ``small``
        until the next check. Fixed mode: ``large`` iff ``epoch + 1 >= fixed_switch_epoch``
        (see ``BatchDecider``). A change of batch restarts :attr:`steps_since_switch`.

        Args:
            epoch: the epoch that just ended (0-based), greater than the last one given.
            lr_will_decay: True when the next epoch's learning rate is lower than this one's.

        Returns:
            The global batch of the next epoch (samples per optimizer step).

        Raises:
            TypeError: an argument of the wrong type.
            ValueError: ``epoch`` not after the last one, a check epoch in adaptive mode
                without any :meth:`observe` call (they accumulate only in
                :attr:`current_epoch`, so epochs skipped before a check lose its statistic),
                or a statistic that is not finite.
        """
        epoch = check_int("epoch", epoch, 0)
        check_bool("lr_will_decay", lr_will_decay)
        if self._last_epoch is not None and epoch <= self._last_epoch:
            raise ValueError(
                f"epoch must be greater than the last epoch given ({self._last_epoch}): "
                f"epochs are given in increasing order, got {epoch}"
            )
        new_batch = self._decider.decide(epoch, lr_will_decay, self.current_epoch)
        self._last_epoch = epoch
        if new_batch != self._batch_size:
            self._lr.switch(self._batch_size, new_batch)
            self._batch_size = new_batch
        self.history.append({"epoch": epoch, "batch_size": new_batch})
        return new_batch

    def step(self) -> None:
        """Count one optimizer step (call after each ``optimizer.step()``), for the warm-up."""
        self._lr.steps_since_switch += 1

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
        return self._lr.factor(self._batch_size, steps_since_switch)

    def floats_per_epoch(self, model_floats_per_step: int, samples_per_epoch: int) -> int:
        """Floats sent per worker in one epoch with the batch in force:
        ``model_floats_per_step * (samples_per_epoch // batch_size)``, one all-reduce per
        optimizer step (global batch), none per micro-batch, the incomplete tail dropped.

        Args:
            model_floats_per_step: floats one worker sends per optimizer step (>= 0), e.g.
                the model's parameter count for a dense all-reduce.
            samples_per_epoch: training samples in one epoch over all workers (>= 0).
        """
        floats = check_int("model_floats_per_step", model_floats_per_step, 0)
        samples = check_int("samples_per_epoch", samples_per_epoch, 0)
        return floats * (samples // self._batch_size)

    def check_resumable(self, micro_steps_done: int) -> int:
        """The optimizer steps that ``micro_steps_done`` micro-batches (forward/backward
        passes, an int >= 0) of one worker with the batch in force make, e.g. since the
        start of the epoch: ``micro_steps_done // accumulation_steps``.

        Raises:
            ValueError: ``micro_steps_done`` is not a multiple of :attr:`accumulation_steps`
                (a resume between the micro-batches of one step): the partly accumulated
                gradients are not in any checkpoint.
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

    def _config(self) -> dict[str, Any]:
        decider, lr = self._decider, self._lr
        return {"small": self.small, "large": self.large, "micro_batch": self._micro_batch,
                "world_size": self._world_size, "interval": decider.schedule.interval,
                "eta": decider.rule.eta, "mode": decider.mode, "lr_scaling": lr.scaling,
                "warmup_steps": lr.warmup_steps,
                "fixed_switch_epoch": decider.fixed_switch_epoch}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as tensors and plain values (``weights_only``-loadable).

        Keys: ``config`` (the constructor's arguments), ``batch_size`` (samples per step),
        ``last_epoch`` (int or None), ``steps_since_switch`` (steps), ``warmup_from`` (the
        lr factor a warm-up starts from, or None), ``accumulator`` (the statistic's sums, a
        list of tensors, or None), ``observed_steps`` (steps), ``detector`` (the decisions,
        :class:`~accordion.batch.state.Decisions`) and ``history``. Tensors are copies.
        """
        return {
            "config": self._config(),
            "batch_size": self._batch_size,
            "last_epoch": self._last_epoch,
            "steps_since_switch": self._lr.steps_since_switch,
            "warmup_from": self._lr.warmup_from,
            **self._decider.state_dict(),  # accumulator, observed_steps, detector
            "history": copy.deepcopy(self.history),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (of this version or an earlier one: the same
        layout), whose ``config`` must equal this controller's; nothing changes on an error.

        Raises:
            TypeError: a value has the wrong type.
            ValueError: ``state`` is not a Mapping, missing or unknown keys, a config field
                that differs (named), or invalid values.
        """
        check_state_keys(state, STATE_KEYS, "BatchSizeController")
        check_config(state["config"], self._config())
        batch_size, last_epoch, steps_since_switch, warmup_from, observed_steps, accumulator = (
            checked_values(state, self.small, self.large)
        )
        history = state["history"]
        if not isinstance(history, list):
            raise TypeError(f"state['history'] must be a list of records, got {history!r}")
        self._decider.load_state_dict(accumulator, observed_steps, state["detector"])
        self._batch_size, self._last_epoch = batch_size, last_epoch
        self._lr.steps_since_switch, self._lr.warmup_from = steps_since_switch, warmup_from
        self.history = copy.deepcopy(history)


def _check_batches(small: int, large: int, micro_batch: int, world_size: int) -> None:
    """Raise ``ValueError`` unless ``small < large`` and both are whole micro-batches per
    worker (multiples of ``micro_batch * world_size``)."""
    if large <= small:
        raise ValueError(
            f"small must be < large (global batch sizes, samples per optimizer step), "
            f"got small={small}, large={large}"
        )
    per_pass = micro_batch * world_size
    for name, value in (("small", small), ("large", large)):
        if value % per_pass:
            raise ValueError(
                f"{name} must be a multiple of micro_batch * world_size = "
                f"{micro_batch} * {world_size} = {per_pass} samples (a whole "
                f"number of micro-batches per worker), got {name}={value}"
            )
