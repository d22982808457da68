"""PyTorch Lightning: :class:`AccordionCallback` runs Accordion inside ``Trainer.fit``.

Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers a comm hook
only on CUDA, so on CPU (gloo) a job given the hook that way trains dense without a word.
The callback registers the hook itself, on any device, and tells the state when epochs
(or optimizer steps) end::

    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy

    from accordion.ddp import AccordionState
    from accordion.integrations.lightning import AccordionCallback

    state = AccordionState(None, compressor="powersgd", levels=(4, 2, 1))
    trainer = Trainer(
        strategy=DDPStrategy(process_group_backend="gloo"),  # or "ddp" on CUDA
        accelerator="cpu", devices=2, max_epochs=30,
        callbacks=[AccordionCallback(state)],
    )
    trainer.fit(module)          # checkpoints carry every rank's Accordion state
    print(state.stats()["total_floats"], state.dense_floats())

What it does, and why there:

* ``setup`` (stage ``"fit"``) checks the strategy and binds an unbound state to the
  LightningModule, so that keys are the module's parameter names.
* ``on_fit_start`` registers the hook on ``trainer.strategy.model``: Lightning builds the
  ``DistributedDataParallel`` module in ``strategy.setup``, between ``setup`` and
  ``on_fit_start``, and the first backward comes later.
* Epochs (``interval_unit="epoch"``) are ended at the start of the next epoch's first
  batch, and the last one in ``on_train_end``: every scheduler has stepped by then,
  ``ReduceLROnPlateau`` included, which Lightning steps after ``on_train_epoch_end``. So
  ``end_epoch`` reads the learning rate the next epoch trains with and sees a decay at the
  epoch where it takes effect. Steps (``"step"``) are ended the same way, from
  ``trainer.global_step``: once per optimizer step, not per micro-batch under gradient
  accumulation, after per-step schedulers.
* Checkpoints: Accordion's state differs per rank (error-feedback memories) while
  Lightning writes the checkpoint from rank 0. The callback's ``state_dict`` gathers every
  rank's state (on CPU) into rank 0's checkpoint; on resume each rank picks its own and
  loads it in ``on_fit_start``, on the strategy's device. Lightning calls ``state_dict`` on
  every rank (``trainer.save_checkpoint`` must be called on all of them), so the gather is
  safe; rank 0 holds all ranks' memories (world size x model size, on CPU) while it saves.
  A :class:`~accordion.MomentumExchange` on the state goes into each rank's entry too
  (with its noise correction), and is loaded after the state.

Behaviour by strategy: ``DDPStrategy`` (``"ddp"``, ``"ddp_spawn"``, ...) works on any
device. A single device (``SingleDeviceStrategy``) has nothing to communicate: the callback
warns once and does nothing. FSDP, DeepSpeed and other strategies raise ``TypeError``
(FSDP2's hybrid sharding is in ``accordion.fsdp``). A comm hook already registered by
other means is an error, except ``DDPStrategy(ddp_comm_hook=accordion_hook,
ddp_comm_state=state)`` with the callback's own state, which is then left as Lightning
registered it (on CUDA) or registered by the callback (elsewhere). Under ``"ddp_spawn"``
the state lives in the worker processes: the launching process's copy is not updated.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .._validate import check_choice
from ..compress.transport import world_and_rank
from ..ddp import AccordionState, accordion_hook, check_state, find_ddp
from ..momentum_exchange import checkpoint_state, load_checkpoint_state
from ..policy import UNITS

_INSTALL = (
    "accordion.integrations.lightning needs PyTorch Lightning: "
    "pip install torch-accordion[integrations] (or pip install lightning)"
)


def _import_lightning():
    """``lightning.pytorch``, else the older ``pytorch_lightning`` package."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # only a missing package falls through: a broken install shows its own error
            if exc.name not in {name, name.split(".")[0]}:
                raise
    raise ImportError(_INSTALL)


pl: Any = _import_lightning()  # Any: so that mypy takes pl.Callback as a base class
_strategies = importlib.import_module(f"{pl.__name__}.strategies")
_DDP = _strategies.DDPStrategy
_SINGLE = _strategies.SingleDeviceStrategy
_DEEPSPEED = getattr(_strategies, "DeepSpeedStrategy", None)  # a DDPStrategy subclass

#: Version of the callback's checkpoint entry (``state_dict``).
FORMAT = 1


class AccordionCallback(pl.Callback):
    """Run an :class:`~accordion.ddp.AccordionState` inside Lightning's ``Trainer.fit``.

    Args:
        state: the Accordion state (its ``interval_unit`` says whether epochs or optimizer
            steps are ended). An unbound state is bound to the LightningModule.
        unit: ``"epoch"`` or ``"step"``, if given: must be ``state.interval_unit`` (a
            check for readers of the training script; the state decides).

    Example::

        state = AccordionState(None, compressor="powersgd", levels=(4, 2, 1))
        trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2,
                          callbacks=[AccordionCallback(state)])
        trainer.fit(module)

    See the module's docstring for where each step happens and how checkpoints carry
    every rank's state.
    """

    def __init__(self, state: AccordionState, *, unit: str | None = None):
        check_state(state)
        if unit is not None:
            check_choice("unit", unit, UNITS)
            if unit != state.interval_unit:
                raise ValueError(
                    f"unit is {unit!r} but the state counts {state.interval_unit!r}s: build "
                    f"the state with interval_unit={unit!r}, or leave unit out"
                )
        self.state = state
        self.unit = state.interval_unit
        #: Whether this fit runs Accordion (False on a single device).
        self.active = False
        # the trainer's counter (current_epoch or global_step) minus the state's: 0 unless
        # the trainer resumed from a checkpoint that held no Accordion state
        self._offset: int | None = None
        self._loaded: dict[str, Any] | None = None  # this rank's state, until on_fit_start
        self._warned_single = False
        self._stage: str | None = None  # the trainer function of the current run

    # --- set-up -----------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Check the strategy and bind the state to the LightningModule (fitting only)."""
        self._stage = stage
        if stage != "fit":
            return
        self.active = self._check_strategy(trainer.strategy)
        self._offset, self._loaded = None, None
        if self.active and self.state.params.module is None:
            # named after the user's module, not after a wrapper's attribute path
            self.state.bind_module(pl_module)

    def _check_strategy(self, strategy: Any) -> bool:
        """Whether Accordion runs under ``strategy``; raises for strategies it cannot."""
        name = type(strategy).__name__
        if isinstance(strategy, _DDP) and not (_DEEPSPEED and isinstance(strategy, _DEEPSPEED)):
            _check_strategy_hook(strategy, self.state)
            return True
        if isinstance(strategy, _SINGLE):
            if not self._warned_single:
                self._warned_single = True
                warnings.warn(
                    f"AccordionCallback: {name} trains in one process, with no gradients to "
                    "communicate; Accordion does nothing in this fit. Use a DDP strategy "
                    "(strategy='ddp', devices >= 2) to compress",
                    UserWarning,
                    stacklevel=2,
                )
            return False
        raise TypeError(
            f"AccordionCallback needs Lightning's DDPStrategy (strategy='ddp', 'ddp_spawn', "
            f"...): Accordion is a DDP communication hook, and {name} does not use DDP's "
            "gradient all-reduce (FSDP2's hybrid sharding: see accordion.fsdp)"
        )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Load a resumed state and register the hook on the DDP module Lightning built."""
        if not self.active:
            return
        try:
            ddp = find_ddp(trainer.strategy.model)
        except TypeError:
            raise TypeError(
                f"AccordionCallback: {type(trainer.strategy).__name__} did not wrap the "
                f"model in DistributedDataParallel (got {type(trainer.strategy.model).__name__})"
            ) from None
        if self._loaded is not None:
            self._load(trainer)
        hooks = list(getattr(ddp, "_comm_hooks", ()))
        if any(hook is accordion_hook and st is self.state for hook, st in hooks):
            return  # DDPStrategy(ddp_comm_hook=accordion_hook, ddp_comm_state=state) on CUDA
        if hooks:
            raise ValueError(
                "AccordionCallback: the DDP module already has a comm hook "
                f"({_hook_name(hooks[0][0])}); DDP takes one. Remove the other hook "
                "(e.g. DDPStrategy(ddp_comm_hook=...)) to use Accordion"
            )
        self.state.register(ddp)

    def _load(self, trainer: Any) -> None:
        """Load this rank's state from the checkpoint; every rank raises if one fails."""
        loaded, self._loaded = self._loaded, None
        if loaded is None:  # called only with a state to load
            return
        error = None
        try:
            # gathered on CPU: the memories and factors belong on this rank's device
            device = trainer.strategy.root_device
            self.state.load_state_dict(_map_tensors(loaded["state"], device))
            offset = loaded["offset"]
            exchange, saved = self.state.momentum_exchange, loaded.get("momentum")
            if exchange is not None:  # a checkpoint without it warns, and it starts afresh
                load_checkpoint_state(exchange, _map_tensors(saved, device))
        except (ValueError, TypeError, KeyError) as exc:
            error = exc
        # a rank failing alone would leave the others waiting in their first collective
        if not trainer.strategy.reduce_boolean_decision(error is None, all=True):
            raise error or RuntimeError(
                "AccordionCallback: another rank could not load its Accordion state from "
                "the checkpoint (its error says why)"
            )
        self._offset = offset

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.active and self._offset is None:
            # no Accordion state came with the checkpoint: the state counts from here
            self._offset = self._trainer_count(trainer) - self._state_count()

    # --- ends of epochs and steps -----------------------------------------------------

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int):
        self._catch_up(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._catch_up(trainer)

    def _trainer_count(self, trainer: Any) -> int:
        return trainer.current_epoch if self.unit == "epoch" else trainer.global_step

    def _state_count(self) -> int:
        return self.state.epoch if self.unit == "epoch" else self.state.step

    def _catch_up(self, trainer: Any) -> None:
        """End the epochs (steps) the trainer finished and the state has not.

        Called before each batch and at the end of training: by then every scheduler has
        stepped, so the state reads the learning rate the next epoch (step) uses. Every
        rank sees the same counters, so the collective ``end_*`` calls match up.
        """
        if not self.active or self._offset is None:
            return
        behind = self._trainer_count(trainer) - self._offset - self._state_count()
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        for _ in range(behind):
            if self.unit == "epoch":
                self.state.end_epoch(optimizer)
            else:
                self.state.end_step(optimizer)

    # --- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every rank's Accordion state, gathered into rank 0's checkpoint.

        Collective when distributed (Lightning calls it on every rank while saving). Other
        ranks return a stub: only rank 0's checkpoint is written. ``{}`` (nothing saved)
        when the callback is inactive.
        """
        if not self.active:
            return {}
        exchange = self.state.momentum_exchange
        entry = {"state": _map_tensors(self.state.state_dict(), "cpu"), "offset": self._offset,
                 "momentum": None if exchange is None else _map_tensors(
                     checkpoint_state(exchange), "cpu")}  # fmt: skip
        world, rank = world_and_rank()
        if world == 1:
            return {"format": FORMAT, "world_size": 1, "ranks": [entry]}
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(entry, gathered, dst=0)
        return {"format": FORMAT, "world_size": world, "ranks": gathered}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Keep this rank's entry of a checkpoint's gathered states; it is loaded into the
        state in ``on_fit_start``, once the model is on its device."""
        if self._stage != "fit":
            return  # validate/test/predict: no gradients, nothing to resume
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != FORMAT:
            raise ValueError(
                f"not an AccordionCallback checkpoint entry (format {FORMAT}): {state_dict!r:.200}"
            )
        if not self.active:
            warnings.warn(
                "AccordionCallback is inactive in this fit (one process): the checkpoint's "
                "Accordion state is ignored",
                UserWarning,
                stacklevel=2,
            )
            return
        world, rank = world_and_rank()
        ranks = state_dict.get("ranks")
        if state_dict.get("world_size") != world or not isinstance(ranks, list):
            raise ValueError(
                f"the checkpoint's Accordion state was saved by {state_dict.get('world_size')} "
                f"processes, this job has {world}: error-feedback memories are per rank and "
                "cannot be resharded (resume with the same world size)"
            )
        self._loaded = ranks[rank]


def _check_strategy_hook(strategy: Any, state: AccordionState) -> None:
    """Refuse a ``DDPStrategy(ddp_comm_hook=...)`` other than Accordion's with this state:
    on CUDA Lightning would register it too, and DDP takes one hook (checked on every
    device, so that a CPU run finds the mistake before a CUDA run does)."""
    hook = getattr(strategy, "_ddp_comm_hook", None)
    ours = hook is accordion_hook and getattr(strategy, "_ddp_comm_state", None) is state
    if hook is None or ours:
        return
    raise ValueError(
        f"DDPStrategy got ddp_comm_hook={_hook_name(hook)} and AccordionCallback registers "
        "Accordion's hook: DDP takes one. Drop ddp_comm_hook (the callback registers the "
        "hook on every device), or pass ddp_comm_hook=accordion_hook with "
        "ddp_comm_state=<the callback's state>"
    )


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)


def _map_tensors(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device)
    if isinstance(obj, Mapping):
        return {k: _map_tensors(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, device) for v in obj)
    return obj


__all__ = ["AccordionCallback", "FORMAT"]
