"""One training run on every rank: data, model, optimiser, schedule, strategy, logs.

Everything that averages gradients goes through the library's public API
(``AccordionState`` + ``accordion_hook``) or, for the baselines, through plain DDP and
PyTorch's own ``powerSGD_hook``.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .._validate import check_choice, check_int, check_number
from ..accounting import paper_floats, wire_bytes
from ..batch import BatchSizeController, accumulation_loss_scale
from ..calibration import measure_step_compute
from ..checkpoint import Checkpointer
from ..compress import PowerSGD, compressor_class
from ..compress.powersgd import matrix_shape, powersgd_rank
from ..ddp import AccordionState, accordion_hook
from ..models import get_model
from ..policy import PaperRule, make_rule
from .data import (
    ClassificationData,
    LanguageData,
    classification_batches,
    language_batches,
    load_task,
)
from .strategies import TORCH_POWERSGD, Strategy, parse_strategy

#: PyTorch's powerSGD_hook settings used for the ``torch-powersgd:R`` baseline.
TORCH_POWERSGD_START_ITER = 2  # the smallest DDP allows with error feedback
TORCH_POWERSGD_MIN_COMPRESSION_RATE = 2.0  # PyTorch's default
#: How the learning rate follows the batch size (``TrainConfig.lr_scaling``).
LR_SCALINGS = ("linear", "sqrt")
#: The learning-rate schedules after warm-up (``TrainConfig.schedule``).
SCHEDULES = ("step", "cosine")


@dataclass
class TrainConfig:
    """Settings of one run. Learning rates are per optimizer step of the global batch.

    The schedule: linear warm-up from ``warmup_start_lr`` to ``lr`` over
    ``warmup_epochs`` (per step), then by ``schedule``: ``"step"``, ``lr`` multiplied by
    ``decay_factor`` at each of ``decay_epochs``; ``"cosine"``, a half cosine from ``lr``
    at the end of warm-up to ``min_lr_factor * lr`` at the end of training (``epochs``),
    ignoring ``decay_epochs``. See :meth:`lr_at`.
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
    momentum: float = 0.9
    weight_decay: float = 1e-4
    interval: int | None = None  # Accordion's check interval, epochs (None: the rule's)
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
    bptt: int = 30
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
        from ..controller import STATISTICS
        from ..models import MODEL_NAMES
        from .data import check_global_batch, check_task

        strategy = parse_strategy(self.strategy)
        if strategy.family == "torch-half" and strategy.mild == "bf16":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"strategy {self.strategy!r}: PyTorch's bf16_compress_hook needs CUDA "
                    "(and NCCL 2.10+); on CPU, static:half:bf16 is our hook's bf16 level"
                )
        if world is not None:
            check_int("world", world, 1)
        for name in ("epochs", "batch_size", "bptt", "checkpoint_every"):
            check_int(name, getattr(self, name), 1)
        if not isinstance(self.measure_compute, bool):
            raise TypeError(f"measure_compute must be a bool, got {self.measure_compute!r}")
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
        check_choice("on_rank_change", self.on_rank_change, (None, *PowerSGD.RANK_CHANGE_POLICIES))
        check_choice("lr_scaling", self.lr_scaling, LR_SCALINGS)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("statistic", self.statistic, STATISTICS)
        check_number("min_lr_factor", self.min_lr_factor, minimum=0, maximum=1)
        for name in ("batch_switch_epoch", "batch_warmup_steps"):
            check_int(name, getattr(self, name), 0)
        if self.clip is not None:
            check_number("clip", self.clip, minimum=0, strict=True)
        if self.model is not None:
            check_choice("model", self.model, MODEL_NAMES)
        train_size = check_task(
            self.task, self.data_dir, model=self.model, train_samples=self.train_samples,
            test_samples=self.test_samples, synthetic_shape=self.synthetic_shape,
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
        small, large = strategy.batch_small, strategy.batch_large
        if strategy.batch_mode in ("adaptive", "fixed") and large % small:
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
        return out


#: The paper's CIFAR schedule: 4 workers x 128, lr 0.1 warmed up to 0.4 over 5 epochs,
#: divided by 10 at epoch 150 and by 100 at 250, 300 epochs, checks every 10 epochs.
_CIFAR_SCHEDULE = dict(
    epochs=300, batch_size=512, lr=0.4, warmup_epochs=5, warmup_start_lr=0.1,
    decay_epochs=(150, 250), interval=10,
)  # fmt: skip

#: Named presets for the paper's full runs (meant for GPU machines).
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
}  # fmt: skip


@dataclass
class RunResult:
    """What one run produced: per-epoch records and the detector's checks."""

    strategy: str
    seed: int
    epochs: list[dict[str, Any]] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    mild: Any = None
    aggressive: Any = None
    batch_checks: list[dict[str, Any]] = field(default_factory=list)
    #: The cost model's report (``AccordionState.calibrate``) for ``:auto`` strategies.
    calibration: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (the ``runs`` entries of ``results.json``)."""
        return dataclasses.asdict(self)


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _build_model(config: TrainConfig, data: ClassificationData | LanguageData) -> nn.Module:
    name = config.model or data.default_model
    if isinstance(data, LanguageData):
        return get_model(name, ntoken=data.vocab_size)
    return get_model(name, num_classes=data.num_classes)


class _Traffic:
    """Per-worker floats (paper convention) and wire bytes, for any strategy."""

    def __init__(self, strategy: Strategy, model: nn.Module, state, world: int):
        self.strategy, self.state, self.world = strategy, state, world
        params = [p for p in model.parameters() if p.requires_grad]
        self.shapes = [tuple(p.shape) for p in params]
        self.element_size = params[0].element_size() if params else 4
        self.steps = 0
        self.floats = 0
        self.bytes = 0.0

    def step(self) -> None:
        """Count one optimizer step's communication (the Accordion state counts its own)."""
        self.steps += 1
        if self.state is not None:
            return  # the Accordion state keeps its own ledger
        if self.strategy.family == "torch-half":  # every tensor of the bucket, halved
            kinds = [("half", self.strategy.mild)] * len(self.shapes)
        elif self.strategy.family == "dense" or self.steps < TORCH_POWERSGD_START_ITER:
            kinds = [("dense", None)] * len(self.shapes)
        else:
            kinds = [self._torch_kind(s) for s in self.shapes]
        for shape, (kind, level) in zip(self.shapes, kinds):
            self.floats += paper_floats(shape, kind, level, self.world)
            self.bytes += wire_bytes(shape, kind, level, self.world, self.element_size)

    def _torch_kind(self, shape) -> tuple[str, Any]:
        # PyTorch's hook only compresses matrices whose compression rate beats its minimum
        if not compressor_class(TORCH_POWERSGD).applies_to(shape):
            return "dense", None
        n, m = matrix_shape(shape)
        r = powersgd_rank(shape, self.strategy.mild)
        if n * m > (n + m) * r * TORCH_POWERSGD_MIN_COMPRESSION_RATE:
            return TORCH_POWERSGD, r
        return "dense", None

    def state_dict(self) -> dict[str, Any]:
        """The counts so far (plain values), for checkpoints."""
        return {"steps": self.steps, "floats": self.floats, "bytes": self.bytes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.floats, self.bytes = state["steps"], state["floats"], state["bytes"]

    def totals(self) -> tuple[int, float]:
        if self.state is not None:
            stats = self.state.ledger
            return stats.total_floats, stats.total_bytes
        return self.floats, self.bytes


def _attach_strategy(config: TrainConfig, strategy: Strategy, model: nn.Module, ddp: DDP):
    """Register the strategy's hook on ``ddp``; return its ``AccordionState`` (or ``None``)."""
    if strategy.uses_accordion_hook:
        if strategy.family == "accordion":
            ladder: dict[str, Any] = {"levels": strategy.levels}
        else:  # static: one level, mild == aggressive
            ladder = {"mild": strategy.mild, "aggressive": strategy.aggressive}
        rule = None  # the library's default rule, with eta
        if strategy.rule or strategy.block is not None:
            block = None if strategy.block == "decay" else strategy.block
            options = {} if strategy.block is None else {"block": block}
            rule = make_rule(strategy.rule or "guarded", config.eta, **options)
        state = AccordionState(
            model,
            compressor=strategy.compressor,
            **ladder,
            interval=strategy.interval or config.interval,  # None: the rule's default
            **({"rule": rule} if rule else {"eta": config.eta}),
            statistic=config.statistic,
            seed=config.seed,
            **({"on_rank_change": config.on_rank_change} if config.on_rank_change else {}),
        )
        ddp.register_comm_hook(state, accordion_hook)
        return state
    if strategy.family == "torch-half":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {"fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook}[strategy.mild]  # fmt: skip
        ddp.register_comm_hook(None, hook)
        return None
    if strategy.family == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

        torch_state = torch_psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=strategy.mild,
            start_powerSGD_iter=TORCH_POWERSGD_START_ITER,
            min_compression_rate=TORCH_POWERSGD_MIN_COMPRESSION_RATE,
            use_error_feedback=True,
            warm_start=True,
            random_seed=config.seed,
        )
        ddp.register_comm_hook(torch_state, torch_psgd.powerSGD_hook)
    return None


def _evaluate(model: nn.Module, data, config: TrainConfig, rank: int, world: int, device):
    """Test accuracy (%) or perplexity; each rank evaluates a shard, then all-reduce."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        if isinstance(data, LanguageData):
            hidden = None
            batches = language_batches(
                data.test, batch_size_per_rank=max(1, config.batch_size // world),
                rank=rank, world_size=world, bptt=config.bptt,
            )  # fmt: skip
            for x, y in batches:
                logits, hidden = model(x.to(device), hidden)
                loss = nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1), reduction="sum"
                )
                totals += torch.tensor([loss.item(), y.numel()], dtype=torch.float64)
        else:
            shard = dataclasses.replace(
                data, x_test=data.x_test[rank::world], y_test=data.y_test[rank::world]
            )
            batches = classification_batches(
                shard, global_batch=config.batch_size, rank=0, world_size=1, epoch=0,
                seed=config.seed, train=False,
            )  # fmt: skip
            for x, y in batches:
                pred = model(x.to(device)).argmax(dim=1)
                totals += torch.tensor(
                    [(pred == y.to(device)).sum().item(), y.numel()], dtype=torch.float64
                )
    if world > 1:
        dist.all_reduce(totals)
    model.train()
    if isinstance(data, LanguageData):
        return math.exp(min(totals[0].item() / max(totals[1].item(), 1.0), 50.0))
    return 100.0 * totals[0].item() / max(totals[1].item(), 1.0)


def _train_batches(data, config: TrainConfig, rank: int, world: int, epoch: int, batch: int):
    if isinstance(data, LanguageData):
        return language_batches(
            data.train, batch_size_per_rank=batch // world, rank=rank,
            world_size=world, bptt=config.bptt,
        )  # fmt: skip
    return classification_batches(
        data, global_batch=batch, rank=rank, world_size=world, epoch=epoch, seed=config.seed,
    )  # fmt: skip


def _steps_per_epoch(data, config: TrainConfig, world: int, batch: int) -> int:
    if isinstance(data, LanguageData):
        columns = (batch // world) * world
        return math.ceil((data.train.numel() // columns - 1) / config.bptt)
    return data.x_train.shape[0] // batch


def _batch_controller(config: TrainConfig, strategy: Strategy, data, world: int):
    """The batch-size controller of an adaptive or fixed batch strategy, else ``None``."""
    if strategy.batch_mode is None:
        return None
    if isinstance(data, LanguageData):
        raise ValueError(
            f"strategy {strategy.text!r}: batch-size strategies support classification tasks, "
            f"not {config.task!r}"
        )
    for size in (strategy.batch_small, strategy.batch_large):
        if size % world:
            raise ValueError(
                f"strategy {strategy.text!r}: batch {size} must be a multiple of the number "
                f"of workers ({world})"
            )
    if strategy.batch_mode == "static":
        return None
    return BatchSizeController(
        strategy.batch_small, strategy.batch_large, micro_batch=strategy.batch_small // world,
        world_size=world, interval=config.interval or PaperRule.default_interval,
        eta=config.eta, mode=strategy.batch_mode,
        fixed_switch_epoch=config.batch_switch_epoch, lr_scaling=config.lr_scaling,
        warmup_steps=config.batch_warmup_steps,
    )  # fmt: skip


def _global_batch(config: TrainConfig, strategy: Strategy, controller) -> int:
    if controller is not None:
        return controller.batch_size
    return strategy.batch_small or config.batch_size


class _Logger:
    """Rank 0's per-epoch logs: JSON lines, CSV, and TensorBoard when installed."""

    def __init__(self, out: str | None, config: TrainConfig):
        self.dir = Path(out) if out else None
        self.writer = None
        self.rows: list[dict[str, Any]] = []
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        self.jsonl = (self.dir / "metrics.jsonl").open("w")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir / "tensorboard"))
        except Exception:  # noqa: BLE001 - TensorBoard is optional
            self.writer = None

    def log(self, record: dict[str, Any]) -> None:
        self.rows.append(record)
        if self.dir is None:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for key in ("train_loss", "test_metric", "floats", "bytes", "train_time_s", "lr"):
                self.writer.add_scalar(key, record[key], record["epoch"])

    def close(self, checks: list[dict[str, Any]], calibration: dict[str, Any] | None) -> None:
        if self.dir is None:
            return
        if calibration is not None:
            (self.dir / "calibration.json").write_text(json.dumps(calibration, indent=1) + "\n")
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
        layers = sorted({k for row in self.rows for k in row["levels"]})
        scalars = ["epoch", "train_loss", "test_metric", "floats", "bytes", "train_time_s", "lr"]
        with (self.dir / "metrics.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(scalars + [f"level:{name}" for name in layers])
            for row in self.rows:
                writer.writerow([row[k] for k in scalars] + [row["levels"].get(n) for n in layers])
        (self.dir / "checks.json").write_text(json.dumps(checks, indent=1) + "\n")


@dataclass
class _Run:
    """What one run trains with on this rank, built by :func:`_set_up`."""

    config: TrainConfig
    strategy: Strategy
    rank: int
    world: int
    device: torch.device
    data: ClassificationData | LanguageData
    controller: BatchSizeController | None
    model: nn.Module
    ddp: DDP
    state: AccordionState | None
    traffic: _Traffic
    optimizer: torch.optim.Optimizer
    logger: _Logger
    #: ``TrainConfig.measure_compute``'s measurement (s), else ``None``.
    compute_step_s: float | None = None


def _set_up(config: TrainConfig, rank: int, world: int, local_rank: int) -> _Run:
    """Data, model, DDP, the strategy's hook, optimiser and logs of a validated config."""
    strategy = parse_strategy(config.strategy)
    if config.threads:
        torch.set_num_threads(config.threads)
    device = _device(local_rank)
    data = load_task(
        config.task, config.data_dir, train_samples=config.train_samples,
        test_samples=config.test_samples, seed=config.seed,
        synthetic_shape=tuple(config.synthetic_shape),
    )  # fmt: skip
    if config.batch_size % world:
        raise ValueError(
            f"batch_size ({config.batch_size}) must be a multiple of the number of workers "
            f"({world})"
        )
    controller = _batch_controller(config, strategy, data, world)
    torch.manual_seed(config.seed)  # identical initial weights on every rank
    model = _build_model(config, data).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = _attach_strategy(config, strategy, model, ddp)
    calibrates = state is not None and strategy.auto and world > 1  # one worker: no link
    compute_s = None
    if calibrates or config.measure_compute:  # the same on every rank: collective
        compute_s = _step_compute(ddp, data, config, rank, world, device)
    if calibrates:  # collective: the link and the compression costs
        state.calibrate(compute_s=compute_s)
    traffic = _Traffic(strategy, model, state, world)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr_at(0), momentum=config.momentum,
        weight_decay=config.weight_decay,
    )  # fmt: skip
    logger = _Logger(config.out if rank == 0 else None, config)
    return _Run(config, strategy, rank, world, device, data, controller, model, ddp, state,
                traffic, optimizer, logger,
                compute_s if config.measure_compute else None)  # fmt: skip


def _epoch(run: _Run, epoch: int, train_time: float) -> tuple[dict[str, Any], float]:
    """Train and evaluate epoch ``epoch``; return its record and the training time so far."""
    config, state, controller = run.config, run.state, run.controller
    levels = state.levels() if state is not None else {}
    batch = _global_batch(config, run.strategy, controller)
    steps_per_epoch = max(1, _steps_per_epoch(run.data, config, run.world, batch))
    if run.world > 1:
        dist.barrier()  # time the same span of work on every rank
    start = time.perf_counter()
    loss_sum, batches, step_times = _train_epoch(
        run.ddp, run.data, config, run.optimizer, run.rank, run.world, epoch, steps_per_epoch,
        run.device, run.traffic, batch, controller,
    )  # fmt: skip
    train_time += time.perf_counter() - start
    next_lr = config.lr_at(epoch + 1)
    if state is not None:
        state.end_epoch(next_lr=next_lr)
    if controller is not None:
        last_lr = config.lr_at(epoch + (steps_per_epoch - 1) / steps_per_epoch)
        controller.end_epoch(epoch, lr_will_decay=next_lr < last_lr)
    metric = _evaluate(run.model, run.data, config, run.rank, run.world, run.device)
    loss = torch.tensor([loss_sum, batches], dtype=torch.float64)
    if run.world > 1:
        dist.all_reduce(loss)
    floats, nbytes = run.traffic.totals()
    record = {
        "epoch": epoch,
        "train_loss": loss[0].item() / max(loss[1].item(), 1.0),
        "test_metric": metric,
        "floats": floats,
        "bytes": nbytes,
        "train_time_s": train_time,
        "lr": run.optimizer.param_groups[0]["lr"],
        "batch_size": batch,
        "levels": levels,
        "step_times_s": step_times,
    }
    if config.measure_compute:
        record["compute_step_s"] = run.compute_step_s
    return record, train_time


def train_run(
    config: TrainConfig,
    rank: int,
    world: int,
    local_rank: int = 0,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
) -> RunResult:
    """Train one run on this rank (a process group must be initialised when world > 1).

    Returns the per-epoch records (identical on every rank, except for timing).
    """
    config.validate()
    run = _set_up(config, rank, world, local_rank)
    result = RunResult(config.strategy, config.seed, mild=run.strategy.mild,
                       aggressive=run.strategy.aggressive)  # fmt: skip
    saver = Checkpointer(config.checkpoint_dir) if config.checkpoint_dir else None
    start, train_time = _resume(run, saver, result)
    bar = _progress_bar(config) if rank == 0 else None
    if bar is not None:
        bar.update(start)
    for epoch in range(start, config.epochs):
        record, train_time = _epoch(run, epoch, train_time)
        result.epochs.append(record)
        run.logger.log(record)
        if on_epoch is not None:
            on_epoch(record)
        done = epoch + 1
        if saver is not None and (done % config.checkpoint_every == 0 or done == config.epochs):
            _save(run, saver, done, result, train_time)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(
                loss=f"{record['train_loss']:.3f}", test=f"{record['test_metric']:.2f}",
                sent=f"{record['floats'] / 1e6:.1f}M floats",
            )  # fmt: skip
    if bar is not None:
        bar.close()
    state = run.state
    result.checks = state.stats()["checks"] if state is not None else []
    result.calibration = state.calibration if state is not None else None
    if run.controller is not None:
        result.batch_checks = run.controller.checks
    run.logger.close(result.checks, result.calibration)
    return result


def _resume(run: _Run, saver: Checkpointer | None, result: RunResult) -> tuple[int, float]:
    """Restore the newest complete checkpoint set, if any: the first epoch to train and
    the training time so far (collective)."""
    if saver is None:
        return 0, 0.0
    restored = saver.load_latest(model=run.model, optimizer=run.optimizer,
                                 accordion=run.state, batch=run.controller)  # fmt: skip
    if restored is None:
        return 0, 0.0
    extra = restored.extra
    _check_same_run(run.config, extra["config"], restored.path)
    if run.rank == 0:  # stderr: stdout holds the run's result
        print(f"resumed from {restored.path} (step {restored.step}: {restored.step} of "
              f"{run.config.epochs} epochs done)", file=sys.stderr, flush=True)  # fmt: skip
    run.traffic.load_state_dict(extra["traffic"])
    for record in extra["records"]:  # the logs hold every epoch, the resumed ones too
        result.epochs.append(record)
        run.logger.log(record)
    return restored.step, extra["train_time"]


#: Settings that may change between a checkpoint and the run resuming from it.
_RESUMABLE_CHANGES = ("epochs", "out", "progress", "threads", "checkpoint_dir",
                      "checkpoint_every", "measure_compute")  # fmt: skip


def _check_same_run(config: TrainConfig, saved: dict[str, Any], path) -> None:
    """Raise ``ValueError`` when ``config`` trains another run than the checkpoint's."""
    now = config.to_dict()
    # a cosine schedule spans the whole run: more epochs would change the rates so far
    free = [k for k in _RESUMABLE_CHANGES if k != "epochs" or config.schedule != "cosine"]
    changed = sorted(k for k in set(now) | set(saved) if k not in free
                     and now.get(k) != saved.get(k))  # fmt: skip
    if changed:
        pairs = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:5])
        raise ValueError(
            f"the checkpoint set {path} is of another run ({pairs}): resume with the same "
            "settings, or give another --checkpoint-dir"
        )


def _save(run: _Run, saver: Checkpointer, done: int, result: RunResult, train_time: float):
    """Write the checkpoint set after ``done`` epochs (collective)."""
    extra = {"records": result.epochs, "train_time": train_time,
             "traffic": run.traffic.state_dict(), "config": run.config.to_dict()}  # fmt: skip
    saver.save(done, model=run.model, optimizer=run.optimizer, accordion=run.state,
               batch=run.controller, extra=extra)  # fmt: skip


def _progress_bar(config: TrainConfig):
    if not config.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        return None
    return tqdm(total=config.epochs, desc=config.strategy, unit="epoch", dynamic_ncols=True)


def _train_epoch(ddp, data, config, optimizer, rank, world, epoch, steps_per_epoch, device,
                 traffic: _Traffic, batch: int,
                 controller) -> tuple[float, int, list[float]]:  # fmt: skip
    """One epoch of optimizer steps on global batches of ``batch`` samples. With a batch
    controller, each rank's share is split into micro-batches whose gradients accumulate
    under ``no_sync()``: one all-reduce and one optimizer step per global batch.

    Returns this rank's loss sum, the number of steps and each step's wall time (s, from
    before ``zero_grad`` to after the optimizer's and the batch controller's steps; on
    CUDA, kernels still queued then are waited for, and counted, in the next step)."""
    ddp.train()
    loss_sum, count = 0.0, 0
    hidden = None
    language = isinstance(data, LanguageData)
    accumulation = controller.accumulation_steps if controller is not None else 1
    # lr is the rate at config.batch_size; the controller scales from its small batch on
    lr_scale = config.batch_lr_scale(controller.small if controller is not None else batch)
    params = [p for p in ddp.parameters() if p.requires_grad]
    step_times: list[float] = []
    for step, (x, y) in enumerate(_train_batches(data, config, rank, world, epoch, batch)):
        lr = config.lr_at(epoch + step / steps_per_epoch) * lr_scale
        if controller is not None:
            lr *= controller.lr_factor()
        for group in optimizer.param_groups:
            group["lr"] = lr
        started = time.perf_counter()  # local clock only: timing must not change what is sent
        optimizer.zero_grad(set_to_none=True)
        x, y = x.to(device), y.to(device)
        if language:
            if hidden is not None:
                hidden = tuple(h.detach() for h in hidden)  # truncated BPTT
            logits, hidden = ddp(x, hidden)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            step_loss = loss.item()
        else:
            step_loss = _accumulate(ddp, x.chunk(accumulation), y.chunk(accumulation))
        if config.clip is not None:
            # DDP averages inside backward, so this clips the averaged gradient
            nn.utils.clip_grad_norm_(ddp.parameters(), config.clip)
        if controller is not None:
            controller.observe([p.grad for p in params if p.grad is not None])
        optimizer.step()
        if controller is not None:
            controller.step()
        step_times.append(time.perf_counter() - started)
        traffic.step()
        loss_sum += step_loss
        count += 1
    return loss_sum, count, step_times


def _step_compute(ddp: DDP, data, config: TrainConfig, rank: int, world: int, device):
    """Seconds of forward and backward per step (no communication) on the first global
    batch, for the cost model and ``measure_compute`` (collective: every rank calls it);
    ``None`` for language tasks, whose step carries a hidden state (the cost model then
    assumes no overlap)."""
    if isinstance(data, LanguageData):
        return None
    x, y = next(iter(_train_batches(data, config, rank, world, 0, config.batch_size)))
    x, y = x.to(device), y.to(device)

    def step() -> None:
        nn.functional.cross_entropy(ddp(x), y).backward()

    return measure_step_compute(ddp, step, steps=5)


def _accumulate(ddp: DDP, xs, ys) -> float:
    """Forward/backward over micro-batches; only the last one synchronises (one all-reduce
    of the summed gradients). Returns the global-batch loss on this rank."""
    scale = accumulation_loss_scale(len(xs))
    total = 0.0
    for i, (x, y) in enumerate(zip(xs, ys)):
        sync = i == len(xs) - 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            loss = nn.functional.cross_entropy(ddp(x), y) * scale
            loss.backward()
        total += loss.item()
    return total


def run_many(
    configs: Iterable[TrainConfig],
    rank: int,
    world: int,
    local_rank: int = 0,
    progress: Callable[[TrainConfig, dict[str, Any]], None] | None = None,
) -> list[RunResult]:
    """Run several configurations one after another in the same processes."""
    results = []
    for config in configs:
        callback = (lambda record, c=config: progress(c, record)) if progress else None
        results.append(train_run(config, rank, world, local_rank, on_epoch=callback))
    return results
