"""Accordion with the Hugging Face ``Trainer``.

The Trainer has no comm-hook option and wraps the model in DDP lazily, inside
``train()``. :class:`AccordionTrainerCallback` registers the hook at ``on_train_begin``,
the first event after the wrapping, on the trainer's ``model_wrapped``; it needs the
trainer for that (callbacks receive only the unwrapped model), hence ``attach``::

    from accordion.ddp import AccordionState
    from accordion.integrations.transformers import AccordionTrainerCallback

    state = AccordionState(model, interval=50, interval_unit="step")  # int8, then int4
    trainer = Trainer(model=model, args=args, train_dataset=data)
    AccordionTrainerCallback(state).attach(trainer)   # adds itself to trainer's callbacks
    trainer.train()

It ends each optimizer step (``interval_unit="step"``, natural with the Trainer's per-step
schedulers) or epoch (``"epoch"``) in the state, and saves this rank's state into each
checkpoint folder (``checkpoint-N/accordion-rank{r}.pt``), which a resumed run loads.

transformers is imported with this module (``pip install torch-accordion[integrations]``),
never by ``import accordion``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from .._validate import check_bool
from ..ddp import AccordionState, check_state, find_ddp
from .accelerate import load_rank_state, save_rank_state, state_path

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:
    raise ImportError(
        "accordion.integrations.transformers needs Hugging Face transformers: "
        "pip install torch-accordion[integrations]"
    ) from exc


class AccordionTrainerCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` running Accordion in a Trainer's DDP training.

    Args:
        state: the :class:`~accordion.ddp.AccordionState`, built from the unwrapped model
            (its keys are then the parameter names).
        trainer: the ``Trainer``; or call :meth:`attach` once the trainer exists.
        checkpoint: save this rank's state on every checkpoint (``on_save``) and load it
            when training resumes from one.

    What it does, per event (on every rank):

    * ``on_train_begin`` (after the Trainer wrapped the model): registers the hook on the
      DDP module inside ``trainer.model_wrapped`` (DDP, or ``torch.compile`` of it with
      ``torch_compile=True``); on resume, loads the state (see :meth:`resume_folder`).
      With one process there is no DDP and nothing to communicate: it warns and stays
      idle, so the script also runs alone. A distributed Trainer without DDP (FSDP,
      DeepSpeed) raises ``TypeError``.
    * ``on_step_end`` (after ``optimizer.step()`` and the per-step ``scheduler.step()``):
      ``state.end_step(optimizer)`` when ``interval_unit="step"``, except for a step the
      gradient scaler skipped, which the scheduler does not count either.
    * ``on_epoch_end``: ``state.end_epoch(optimizer)`` when ``interval_unit="epoch"``; the
      rate read is that of the next epoch's first step.
    * ``on_save``: writes ``{output_dir}/checkpoint-{global_step}/accordion-rank{r}.pt``
      (the Trainer's own folder; hyper-parameter search's per-trial folders are not
      supported).
    """

    def __init__(self, state: AccordionState, trainer: Any = None, *, checkpoint: bool = True):
        check_state(state)
        self.accordion_state = state
        self.checkpoint = check_bool("checkpoint", checkpoint)
        self.trainer: Any = None  # a transformers.Trainer, once attached
        self._ddp: Any = None  # the DDP module the hook is on; a second train() reuses it
        self._active = False
        if trainer is not None:
            self.attach(trainer)

    def attach(self, trainer: Any) -> AccordionTrainerCallback:
        """Give the callback its trainer (where it finds the DDP module and the
        accelerator) and add it to the trainer's callbacks unless it is there. Returns
        the callback."""
        if not isinstance(trainer, Trainer):
            raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return self

    def resume_folder(self, args: Any, global_step: int) -> str:
        """The checkpoint folder a run resumed at ``global_step`` came from: the Trainer
        does not tell callbacks, so ``args.resume_from_checkpoint`` when it is a folder
        holding this rank's file (set it when resuming from outside ``output_dir``), else
        ``{output_dir}/checkpoint-{global_step}``, where ``resume_from_checkpoint=True``
        and the Trainer's own checkpoints are."""
        given = args.resume_from_checkpoint
        if isinstance(given, str) and os.path.isfile(state_path(given, args.process_index)):
            return given
        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")

    def on_train_begin(self, args, state, control, **kwargs):
        """Register the hook on the wrapped model; on resume, load the Accordion state."""
        if self.trainer is None:
            raise RuntimeError(
                "AccordionTrainerCallback needs its trainer to find the DDP module: "
                "AccordionTrainerCallback(state, trainer) or callback.attach(trainer)"
            )
        if args.world_size == 1:
            warnings.warn(
                "one process: the Trainer built no DistributedDataParallel and there is "
                "nothing to communicate, so the Accordion hook is not registered and "
                "training runs uncompressed",
                UserWarning,
                stacklevel=2,
            )
            self._active = False
            return
        self._register(self.trainer.model_wrapped)
        self._active = True
        # a fresh train() starts at step 0; a larger step is one loaded from a checkpoint
        if self.checkpoint and state.global_step > 0:
            folder = self.resume_folder(args, state.global_step)
            load_rank_state(self.accordion_state, folder, args.process_index)

    def _register(self, wrapped: Any) -> None:
        try:
            ddp = find_ddp(wrapped)
        except TypeError:
            raise TypeError(
                f"the Trainer's wrapped model is a {type(wrapped).__name__}, not "
                "DistributedDataParallel: Accordion's hook needs DDP (not FSDP or "
                "DeepSpeed; for FSDP2's hybrid sharding see accordion.fsdp)"
            ) from None
        if ddp is not self._ddp:  # train() called again on the same Trainer keeps its DDP
            self.accordion_state.register(ddp)
            self._ddp = ddp

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        """End an optimizer step in the state (``interval_unit="step"``)."""
        if not self._active or self.accordion_state.interval_unit != "step":
            return
        if self.trainer.accelerator.optimizer_step_was_skipped:
            return
        self.accordion_state.end_step(optimizer)

    def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
        """End an epoch in the state (``interval_unit="epoch"``)."""
        if self._active and self.accordion_state.interval_unit == "epoch":
            self.accordion_state.end_epoch(optimizer)

    def on_save(self, args, state, control, **kwargs):
        """Write this rank's state into the checkpoint folder the Trainer just wrote."""
        if self._active and self.checkpoint:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            save_rank_state(self.accordion_state, folder, args.process_index)


__all__ = ["AccordionTrainerCallback"]
