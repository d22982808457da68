"""The settings of one run (:class:`TrainConfig`), their checks and the paper's presets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from .._validate import check_bool, check_choice, check_int, check_number
from ..compress import RANK_CHANGE_POLICIES
from ..controller import STATISTICS
from ..models import MODEL_NAMES
from .data import check_global_batch, check_task
from .strategies import Strategy, parse_strategy

#: How the learning rate follows the batch size (``TrainConfig.lr_scaling``).
LR_SCALINGS = ("linear", "sqrt")
#: The learning-rate schedules after warm-up (``TrainConfig.schedule``).
SCHEDULES = ("step", "cosine")
#: The optimisers a run can train with (``TrainConfig.optimizer``).
OPTIMIZERS = ("sgd", "adamw")
#: What Accordion's ``interval`` counts (``TrainConfig.interval_unit``).
INTERVAL_UNITS = ("epoch", "step")


@dataclass
class TrainConfig:
    """Settings of one run. Learning rates are per optimizer step of the global batch.

    The schedule: linear warm-up from ``warmup_start_lr`` to ``lr`` over
    ``warmup_epochs`` (per step), then by ``schedule``: ``"step"``, ``lr`` multiplied by
    ``decay_factor`` at each of ``decay_epochs``; ``"cosine"``, a half cosine from ``lr``
    at the end of warm-up to ``min_lr_factor * lr`` at the end of training (``epochs``),
    ignoring ``decay_epochs``. See :meth:`lr_at`.

    ``optimizer``: ``"sgd"`` (with ``momentum``) or ``"adamw"`` (with ``betas``), both
    with ``weight_decay`` (AdamW's decoupled). ``interval_unit``: whether Accordion's
    ``interval`` counts epochs (its decisions at each epoch's end) or optimizer steps (at
    the end of each window of ``interval`` steps). Batch-size strategies always count
    epochs: with ``interval_unit="step"`` their controller checks every epoch.
    """

    task: str = "mnist1d"
    data_dir: str | None = None
    model: str | None = None
    strategy: str = "accordion:powersgd:4,1"
    epochs: int = 60
    batch_size: int = 128  # global, over all workers
    lr: float = 0.1
    warmup_epochs: float = 2.0
    warmup_start_lr: float | None = None  # default lr / 10
    decay_epochs: tuple[int, ...] = (30, 45)
    decay_factor: float = 0.1
    schedule: str = "step"  # after warm-up: "step" (decay_epochs) or "cosine"
    min_lr_factor: float = 0.0  # cosine: the final lr as a fraction of lr, in [0, 1]
    momentum: float = 0.9  # SGD only
    weight_decay: float = 1e-4
    optimizer: str = "sgd"  # "sgd" or "adamw"
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW only: its two averaging factors
    # Accordion's check interval, in interval_unit (None: the rule's)
    interval: int | None = None
    interval_unit: str = "epoch"  # "epoch" or "step"
    eta: float = 0.5
    # the paper's: the documented figures were measured so (the library's default: sharded)
    statistic: str = "rank0"
    on_rank_change: str | None = None  # PowerSGD's Q at a switch; None: the library default
    seed: int = 0
    train_samples: int | None = None
    test_samples: int | None = None
    synthetic_shape: tuple[int, ...] = (3, 32, 32)  # one sample of the synthetic task
    batch_switch_epoch: int = 20  # batch-fixed: first epoch at the large batch
    lr_scaling: str = "linear"  # learning rate vs batch size: "linear" or "sqrt"
    batch_warmup_steps: int = 5  # optimizer steps of warm-up after a switch to a larger batch
    bptt: int = 30  # tokens per window: LSTM truncated BPTT; charlm's characters per sample
    clip: float | None = None  # gradient-norm clipping (the LSTM preset uses 0.4)
    threads: int | None = None
    progress: bool = True
    out: str | None = None
    checkpoint_dir: str | None = None  # consistent checkpoint sets (accordion.checkpoint)
    checkpoint_every: int = 1  # epochs between checkpoint sets (and one after the last)
    #: Measure once before training the step's forward + backward without communication
    #: (collective: the maximum over the ranks) and put it, in seconds, in every epoch
    #: record as ``compute_step_s`` (``None`` for language tasks).
    measure_compute: bool = False

    def validate(self, world: int | None = None) -> None:
        """Raise ``TypeError`` (a setting of the wrong type) or ``ValueError`` naming the
        first bad setting, what it is and what is allowed. Reads and generates no data.

        With ``world`` (the number of workers) also check that ``batch_size`` and a batch
        strategy's sizes divide among the workers, as the run requires."""
        strategy = parse_strategy(self.strategy)
        if strategy.family == "torch-half" and strategy.mild == "bf16":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"strategy {self.strategy!r}: PyTorch's bf16_compress_hook needs CUDA "
                    "(and NCCL 2.10+); on CPU, static:half:bf16 is our hook's bf16 level"
                )
        if world is not None:
            check_int("world", world, 1)
        self._check_settings()
        self._check_task_and_batches(strategy, world)
        self._check_diloco(strategy)

    def _check_diloco(self, strategy: Strategy) -> None:
        """DiLoCo runs: a task whose step holds no hidden state."""
        if strategy.sync_every is None:
            return
        if self.task == "wikitext2":
            raise ValueError(f"strategy {strategy.text!r}: DiLoCo strategies support "
                             "classification and charlm tasks, not 'wikitext2'")  # fmt: skip

    def _check_settings(self) -> None:
        """The type and range of every setting that needs neither the task nor the world."""
        for name in ("epochs", "batch_size", "bptt", "checkpoint_every"):
            check_int(name, getattr(self, name), 1)
        check_bool("measure_compute", self.measure_compute)
        if self.checkpoint_dir is not None and not isinstance(self.checkpoint_dir, str):
            raise TypeError(f"checkpoint_dir must be a str or None, got {self.checkpoint_dir!r}")
        for name in ("interval", "threads", "train_samples", "test_samples"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        for name in ("lr", "eta", "decay_factor"):
            check_number(name, getattr(self, name), minimum=0, strict=True)
        for name in ("momentum", "weight_decay", "warmup_epochs"):
            check_number(name, getattr(self, name), minimum=0)
        for i, epoch in enumerate(self.decay_epochs):
            check_int(f"decay_epochs[{i}]", epoch, 0)
        check_choice("on_rank_change", self.on_rank_change, (None, *RANK_CHANGE_POLICIES))
        check_choice("lr_scaling", self.lr_scaling, LR_SCALINGS)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("statistic", self.statistic, STATISTICS)
        self._check_optimizer()
        check_number("min_lr_factor", self.min_lr_factor, minimum=0, maximum=1)
        for name in ("batch_switch_epoch", "batch_warmup_steps"):
            check_int(name, getattr(self, name), 0)
        if self.clip is not None:
            check_number("clip", self.clip, minimum=0, strict=True)
        if self.model is not None:
            check_choice("model", self.model, MODEL_NAMES)

    def _check_optimizer(self) -> None:
        """``optimizer``, ``betas`` and ``interval_unit``."""
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("interval_unit", self.interval_unit, INTERVAL_UNITS)
        betas = self.betas
        if not isinstance(betas, tuple | list):
            raise TypeError(f"betas must be a tuple of two numbers in [0, 1), got {betas!r}")
        if len(betas) != 2:
            raise ValueError(
                f"betas must be two numbers in [0, 1) (AdamW's averaging factors), got {betas!r}"
            )
        for i, beta in enumerate(betas):
            if check_number(f"betas[{i}]", beta, minimum=0) >= 1:
                raise ValueError(
                    f"betas[{i}] must be >= 0 and < 1 (an averaging factor), got {beta!r}"
                )

    def _check_task_and_batches(self, strategy: Strategy, world: int | None) -> None:
        """The task's settings, and that every global batch the run trains at splits among
        ``world`` workers (when given) and fits in the training set."""
        train_size = check_task(
            self.task, self.data_dir, model=self.model, train_samples=self.train_samples,
            test_samples=self.test_samples, synthetic_shape=self.synthetic_shape,
            bptt=self.bptt,
        )  # fmt: skip
        if strategy.batch_mode is not None and self.task == "wikitext2":
            raise ValueError(
                f"strategy {strategy.text!r}: batch-size strategies support classification "
                f"tasks, not {self.task!r}"
            )
        # (setting named in the message, global batch, whether an epoch trains at it)
        batches = [("batch_size", self.batch_size, strategy.batch_mode is None)] + [
            (f"strategy {strategy.text!r}: batch", size, True)
            for size in (strategy.batch_small, strategy.batch_large) if size is not None
        ]  # fmt: skip
        for what, size, trained in batches:
            check_global_batch(what, size, world, train_size if trained else None)
        if strategy.batch_mode not in ("adaptive", "fixed"):
            return
        small, large = strategy.batch_sizes()
        if large % small:
            raise ValueError(
                f"strategy {strategy.text!r}: LARGE ({large}) must be a multiple of SMALL "
                f"({small}): a large batch accumulates whole small ones"
            )

    def batch_lr_scale(self, batch: int) -> float:
        """Learning-rate multiplier for a global batch ``batch``: ``lr`` is the rate at
        ``batch_size``, scaled linearly (or by the square root) with the batch."""
        ratio = batch / self.batch_size
        return ratio if self.lr_scaling == "linear" else math.sqrt(ratio)

    def lr_at(self, epoch: float) -> float:
        """Learning rate at fractional epoch ``epoch`` (step ``s`` of epoch ``e`` is
        ``e + s / steps_per_epoch``).

        After warm-up, ``"step"``: ``lr * decay_factor ** (decays reached by
        floor(epoch))``; ``"cosine"``: ``lr * (m + (1 - m) * (1 + cos(pi t)) / 2)`` with
        ``m = min_lr_factor`` and ``t`` going from 0 at ``warmup_epochs`` to 1 at
        ``epochs`` (held at 1 beyond)."""
        if epoch < self.warmup_epochs:
            start = self.lr / 10 if self.warmup_start_lr is None else self.warmup_start_lr
            return start + (self.lr - start) * epoch / self.warmup_epochs
        if self.schedule == "cosine":
            span = self.epochs - self.warmup_epochs
            t = min(1.0, (epoch - self.warmup_epochs) / span) if span > 0 else 1.0
            m = self.min_lr_factor
            return self.lr * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * t)))
        decays = sum(1 for d in self.decay_epochs if math.floor(epoch) >= d)
        return self.lr * self.decay_factor**decays

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable settings."""
        out = dataclasses.asdict(self)
        out["decay_epochs"] = list(self.decay_epochs)
        out["synthetic_shape"] = list(self.synthetic_shape)
        out["betas"] = list(self.betas)
        return out


#: The paper's CIFAR schedule: 4 workers x 128, lr 0.1 warmed up to 0.4 over 5 epochs,
#: divided by 10 at epoch 150 and by 100 at 250, 300 epochs, checks every 10 epochs.
_CIFAR_SCHEDULE = dict(
    epochs=300, batch_size=512, lr=0.4, warmup_epochs=5, warmup_start_lr=0.1,
    decay_epochs=(150, 250), interval=10,
)  # fmt: skip

#: The character-level language model's schedule: AdamW, 2 epochs with 5 % of linear
#: warm-up then a cosine down to a tenth, Accordion deciding every 25 optimizer steps, a
#: global batch of 64 windows of 64 characters, 2,048 validation windows.
_CHARLM_SCHEDULE = dict(
    optimizer="adamw", lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, epochs=2,
    warmup_epochs=0.1, schedule="cosine", min_lr_factor=0.1, clip=1.0, interval_unit="step",
    interval=25, bptt=64, batch_size=64, test_samples=2048,
)  # fmt: skip

#: Named presets: the paper's full runs (meant for GPU machines), and the CPU-size
#: character-level language models ``charlm-tiny`` and ``charlm-small``.
PRESETS: dict[str, dict[str, Any]] = {
    "cifar10-resnet18": dict(task="cifar10", model="resnet18", **_CIFAR_SCHEDULE),
    "cifar100-resnet18": dict(task="cifar100", model="resnet18", **_CIFAR_SCHEDULE),
    "cifar10-vgg19bn": dict(task="cifar10", model="vgg19bn", **_CIFAR_SCHEDULE),
    "cifar10-senet18": dict(task="cifar10", model="senet18", **_CIFAR_SCHEDULE),
    "cifar100-densenet": dict(task="cifar100", model="densenet", **_CIFAR_SCHEDULE),
    # the paper gives no LSTM batch size; 20 sequences per worker is the usual setting
    "wikitext2-lstm": dict(
        task="wikitext2", model="lstm", epochs=90, batch_size=80, lr=2.5, warmup_epochs=0,
        decay_epochs=(60, 80), interval=5, clip=0.4, momentum=0.0, weight_decay=0.0,
    ),
    # CPU-size (minutes on 2 cores with 2 workers, docs/reproduction.md): a character-level
    # transformer with AdamW, where PowerSGD was seen to cost accuracy against dense
    "charlm-tiny": dict(
        task="charlm", model="transformer-tiny", train_samples=28672, **_CHARLM_SCHEDULE,
    ),
    "charlm-small": dict(
        task="charlm", model="transformer-small", train_samples=20480,
        **{**_CHARLM_SCHEDULE, "lr": 2e-3},
    ),
}  # fmt: skip
