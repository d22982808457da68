"""Accordion with Hugging Face Accelerate.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only PyTorch's own
hook types, so the hook goes on the model that ``accelerator.prepare`` returns::

    from accordion.ddp import AccordionState
    from accordion.integrations import accelerate as acc

    accelerator = Accelerator()
    state = AccordionState(net, "powersgd", levels=(4, 2, 1), interval=50, interval_unit="step")
    model, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, scheduler)
    model = acc.register(accelerator, model, state)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model, batch))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        acc.end_step(accelerator, state, optimizer)  # counts only real optimizer steps

``register`` also makes ``accelerator.save_state(dir)`` write this rank's Accordion state
to ``dir/accordion-rank{r}.pt`` and ``accelerator.load_state(dir)`` read it back. The
same script runs under ``accelerate launch`` and ``torchrun``, and, with one process
(nothing to communicate), uncompressed: ``register`` then warns and changes nothing,
and ``end_step``/``end_epoch`` do nothing. On CPU, two processes come from
``accelerate launch --multi_gpu --num_processes 2 train.py`` with ``Accelerator(cpu=True)``
in the script (``--cpu --num_processes 2`` starts one; see ``docs/integrations.md``).

Accelerate is imported only by these functions (``pip install torch-accordion[integrations]``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

from .._validate import check_bool
from ..checkpoint.sets import atomic_save
from ..ddp import AccordionState, check_state, find_ddp
from ..momentum_exchange import checkpoint_state, load_checkpoint_state

#: Name of a rank's Accordion state file inside a checkpoint folder.
STATE_FILE = "accordion-rank{rank}.pt"
#: Name of a rank's file of the state's :class:`~accordion.MomentumExchange` (and its
#: noise correction) inside a checkpoint folder, when the state has one.
MOMENTUM_FILE = "accordion-momentum-rank{rank}.pt"

_INSTALL = "pip install torch-accordion[integrations]"


def _accelerate():
    try:
        import accelerate
    except ImportError as exc:
        raise ImportError(
            f"accordion.integrations.accelerate needs Hugging Face Accelerate: {_INSTALL}"
        ) from exc
    return accelerate


def _check_accelerator(accelerator: Any) -> None:
    if not isinstance(accelerator, _accelerate().Accelerator):
        raise TypeError(
            f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}"
        )


def state_path(folder: str | os.PathLike, rank: int) -> str:
    """The file holding rank ``rank``'s Accordion state in checkpoint folder ``folder``."""
    return os.path.join(os.fspath(folder), STATE_FILE.format(rank=rank))


def save_rank_state(state: AccordionState, folder: str | os.PathLike, rank: int) -> str:
    """Write ``state.state_dict()`` to :func:`state_path` (creating ``folder``), and the
    state's momentum exchange, if it has one, to :data:`MOMENTUM_FILE`; return the state's
    path. Every rank calls it: error-feedback memories differ between ranks."""
    os.makedirs(folder, exist_ok=True)
    path = state_path(folder, rank)
    atomic_save(state.state_dict(), path)  # a kill mid-save leaves the old file whole
    exchange = state.momentum_exchange
    if exchange is not None:  # its held moments and memory: a resume needs them too
        atomic_save(checkpoint_state(exchange), _momentum_path(folder, rank))
    return path


def _momentum_path(folder: str | os.PathLike, rank: int) -> str:
    return os.path.join(os.fspath(folder), MOMENTUM_FILE.format(rank=rank))


def load_rank_state(state: AccordionState, folder: str | os.PathLike, rank: int) -> bool:
    """Load this rank's file from ``folder`` into ``state``, and its
    :data:`MOMENTUM_FILE` into the state's momentum exchange if it has one; ``False``
    (with a ``RuntimeWarning``) when the folder has no state file, e.g. a checkpoint
    written without Accordion: the state then starts afresh, from the mildest level."""
    path = state_path(folder, rank)
    if not os.path.isfile(path):
        warnings.warn(
            f"{path} does not exist: the checkpoint holds no Accordion state for rank "
            f"{rank}, so Accordion starts afresh (every layer at the mildest level)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    exchange = state.momentum_exchange
    if exchange is not None:
        _load_momentum(exchange, folder, rank)
    return True


def _load_momentum(exchange: Any, folder: str | os.PathLike, rank: int) -> None:
    """Load this rank's :data:`MOMENTUM_FILE` into ``exchange`` (its correction first);
    a ``RuntimeWarning`` when the folder has none: the exchange then starts afresh."""
    path = _momentum_path(folder, rank)
    saved = None
    if os.path.isfile(path):
        saved = torch.load(path, map_location="cpu", weights_only=True)
    load_checkpoint_state(exchange, saved, source=f"{folder} (rank {rank})")


def register(accelerator: Any, model: nn.Module, state: AccordionState, *, checkpoint: bool = True):
    """Register the Accordion hook on ``model`` as returned by ``accelerator.prepare`` and
    return ``model`` (the same object: keep using it).

    ``model`` is the ``DistributedDataParallel`` module that Accelerate built, or
    ``torch.compile``'s wrapper of it (an Accelerator with a dynamo backend). Build
    ``state`` from the unprepared model, so that its keys are the parameter names.

    With one process Accelerate builds no DDP and there is nothing to communicate: the
    model is returned unchanged with a ``UserWarning``, so that one script runs both alone
    and under ``accelerate launch`` / ``torchrun``. A distributed run whose model is not
    DDP (FSDP, DeepSpeed) raises ``TypeError``.

    ``checkpoint=True`` registers save/load pre-hooks: ``accelerator.save_state(dir)``
    then writes ``dir/accordion-rank{r}.pt`` on every rank and ``load_state(dir)`` reads it.
    """
    _check_accelerator(accelerator)
    check_state(state)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_bool("checkpoint", checkpoint)
    if accelerator.num_processes == 1:
        warnings.warn(
            "one process: Accelerate built no DistributedDataParallel and there is nothing "
            "to communicate, so the Accordion hook is not registered and training runs "
            "uncompressed (end_step/end_epoch do nothing). On CPU, `accelerate launch --cpu "
            "--num_processes 2` starts one process: launch with --multi_gpu and build "
            "Accelerator(cpu=True)",
            UserWarning,
            stacklevel=2,
        )
        return model
    try:
        find_ddp(model)
    except TypeError:
        raise TypeError(
            f"model must be what accelerator.prepare returned, a DistributedDataParallel "
            f"module (or torch.compile of one), got {type(model).__name__} with "
            f"distributed_type={accelerator.distributed_type}: Accordion's hook needs DDP "
            "(for FSDP2's hybrid sharding see accordion.fsdp)"
        ) from None
    state.register(model)
    if checkpoint:
        _register_checkpoint_hooks(accelerator, state)
    return model


def _register_checkpoint_hooks(accelerator: Any, state: AccordionState) -> None:
    rank = accelerator.process_index

    # Accelerate calls these pre-hooks on every process (save_state/load_state are
    # collective), which is what per-rank files need; its register_for_checkpointing
    # would save one state for all ranks, from the main process only.
    def save(models, weights, output_dir):
        save_rank_state(state, output_dir, rank)

    def load(models, input_dir):
        load_rank_state(state, input_dir, rank)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def _skips(accelerator: Any, state: AccordionState) -> bool:
    """Whether an end of step or epoch has nothing to tell ``state`` (one process)."""
    _check_accelerator(accelerator)
    check_state(state)
    return accelerator.num_processes == 1


def end_step(
    accelerator: Any,
    state: AccordionState,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    next_lr: float | None = None,
    lr_will_decay: bool | None = None,
) -> dict[str, bool] | None:
    """Count one optimizer step in ``state`` (``interval_unit="step"``): call it on every
    rank after ``optimizer.step()`` and ``scheduler.step()``, at every batch.

    Steps that Accelerate did not take are not counted, as ``AcceleratedScheduler`` does
    not count them: a micro-batch of gradient accumulation (``accelerator.sync_gradients``
    is False: DDP's ``no_sync``, the hook did not run), or a step that the gradient scaler
    skipped after an overflow (``accelerator.optimizer_step_was_skipped``). The learning
    rate is read from ``optimizer`` (``AcceleratedOptimizer`` is a ``torch.optim.Optimizer``
    passing its ``param_groups`` through) unless ``next_lr`` is given, and
    ``lr_will_decay`` overrides both (as in ``state.end_step``); with none of them no
    decay is detected, and the state warns once. Returns ``state.end_step``'s result, or
    ``None`` when the step is not counted or with one process.
    """
    if _skips(accelerator, state):
        return None
    if not accelerator.sync_gradients or accelerator.optimizer_step_was_skipped:
        return None
    return state.end_step(optimizer, next_lr=next_lr, lr_will_decay=lr_will_decay)


def end_epoch(
    accelerator: Any,
    state: AccordionState,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    next_lr: float | None = None,
    lr_will_decay: bool | None = None,
) -> dict[str, bool]:
    """End an epoch in ``state`` (``interval_unit="epoch"``): call it on every rank after
    the epoch's ``scheduler.step()``; the learning rate comes as in :func:`end_step`.
    Returns ``state.end_epoch``'s result (``{}`` with one process, where the state is not
    used)."""
    if _skips(accelerator, state):
        return {}
    return state.end_epoch(optimizer, next_lr=next_lr, lr_will_decay=lr_will_decay)


__all__ = [
    "register",
    "end_step",
    "end_epoch",
    "state_path",
    "save_rank_state",
    "load_rank_state",
    "STATE_FILE",
    "MOMENTUM_FILE",
]
