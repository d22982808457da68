"""Build one run on this rank from a validated config: device, data, batch controller,
model, DDP with the strategy's hook, optimiser, traffic count and logs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..adam_noise import AdamNoiseCorrection
from ..batch import BatchSizeController
from ..controller import Controller
from ..diloco import OUTER_LR, OUTER_MOMENTUM, WARMUP_WINDOW, DiLoCo
from ..diloco_streaming import StreamingDiLoCo
from ..models import get_model
from ..momentum_exchange import MomentumExchange
from ..policy import PaperRule
from .attach import attach_strategy
from .baselines import Traffic
from .config import TrainConfig
from .data import ClassificationData, LanguageData, SequenceData, load_task
from .loop import Run, epoch_steps, set_server_feedback, step_compute
from .records import Logger
from .strategies import Strategy, parse_strategy


def set_up(config: TrainConfig, rank: int, world: int, local_rank: int) -> Run:
    """Data, model, DDP, the strategy's hook, optimiser and logs of a validated config."""
    strategy = parse_strategy(config.strategy)
    if config.threads:
        torch.set_num_threads(config.threads)
    device = _device(local_rank)
    data = load_task(
        config.task, config.data_dir, train_samples=config.train_samples,
        test_samples=config.test_samples, seed=config.seed,
        synthetic_shape=tuple(config.synthetic_shape), bptt=config.bptt,
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
    state = attach_strategy(config, strategy, model, ddp)
    set_server_feedback(state, strategy)
    calibrates = state is not None and strategy.auto and world > 1  # one worker: no link
    compute_s = None
    if calibrates or config.measure_compute:  # the same on every rank: collective
        compute_s = step_compute(ddp, data, config, rank, world, device)
    if calibrates and state is not None:  # collective: the link and the compression costs
        state.calibrate(compute_s=compute_s)
    traffic = Traffic(strategy, model, state, world)
    optimizer = make_optimizer(config, model)
    correction = None
    if strategy.adam_noise and strategy.sync_every is None:
        correction = _correct_adam(config, optimizer, state)
    exchange = None
    if strategy.momentum_freeze is not None:  # after the correction, whose moment it holds
        steps = epoch_steps(data, config, world, config.batch_size)
        exchange = _exchange_momentum(config, strategy, optimizer, state, steps)
    logger = Logger(config.out if rank == 0 else None, config)
    diloco = None
    if strategy.sync_every is not None:
        streaming: dict[str, Any] = ({"fragments": strategy.fragments, "delay": strategy.delay,
                                      "mix": strategy.mix} if strategy.streams else {})  # fmt: skip
        kind = StreamingDiLoCo if strategy.streams else DiLoCo
        diloco = kind(model, optimizer, strategy.sync_every, state=state,
                      outer_optimizer=make_outer_optimizer(strategy),
                      warmup_steps=strategy.warmup_steps,
                      warmup_state=_warmup_state(strategy, model, config.seed),
                      warmup_eta=strategy.warmup_eta, warmup_window=_warmup_window(config),
                      warmup_sync_every=strategy.warmup_sync_every,
                      error_decay=strategy.error_decay, sync_growth=strategy.sync_growth,
                      min_sync_every=strategy.min_sync_every,
                      max_sync_every=strategy.max_sync_every, **streaming)  # fmt: skip
        traffic.diloco = diloco  # the rounds' and the warm-up's bytes
        if strategy.adam_noise:  # after DiLoCo's hook, which averages the warm-up's gradients
            correction = _correct_adam(config, optimizer, diloco.warmup_state)
    return Run(config, strategy, rank, world, device, data, controller, model, ddp, state,
               traffic, optimizer, logger, compute_s if config.measure_compute else None,
               diloco, correction, exchange)  # fmt: skip


def _correct_adam(config: TrainConfig, optimizer: torch.optim.Optimizer,
                  state: Controller | None) -> AdamNoiseCorrection:  # fmt: skip
    """Hook Adam's noise correction (the ``adam-noise`` suffix) onto ``optimizer``."""
    state = _check_adamw(config, state, "adam-noise corrects AdamW's second moment")
    return AdamNoiseCorrection(optimizer, state)


def _check_adamw(config: TrainConfig, state: Controller | None, what: str) -> Controller:
    """A suffix that hooks AdamW (``what`` it does) needs ``--optimizer adamw`` and a
    state: that state, else a ``ValueError``."""
    if config.optimizer != "adamw" or state is None:
        raise ValueError(f"strategy {config.strategy!r}: {what}: it needs --optimizer adamw, "
                         f"got {config.optimizer!r}")  # fmt: skip
    return state


def _exchange_momentum(config: TrainConfig, strategy: Strategy,
                       optimizer: torch.optim.Optimizer, state: Controller | None,
                       steps_per_epoch: int) -> MomentumExchange:  # fmt: skip
    """The ``momentum=P/LEVEL[/ETA]`` suffix: AdamW's momentum exchanged from P% of the
    run's optimizer steps on (at least one step in), or sooner when the norm test at ETA,
    over the run's check interval, finds the gradient calm."""
    state = _check_adamw(config, state, "momentum=P/LEVEL exchanges AdamW's momentum")
    total = config.epochs * steps_per_epoch
    freeze_at = max(1, round(total * strategy.momentum_freeze / 100))  # type: ignore[operator]
    return MomentumExchange(optimizer, state, freeze_at, strategy.momentum_level,
                            clip=config.clip, freeze_eta=strategy.momentum_eta,
                            window=_warmup_window(config))  # fmt: skip


def make_outer_optimizer(strategy: Strategy):
    """The outer Nesterov SGD of a DiLoCo strategy, at its ``lr=``/``momentum=`` options."""
    lr = OUTER_LR if strategy.outer_lr is None else strategy.outer_lr
    momentum = OUTER_MOMENTUM if strategy.outer_momentum is None else strategy.outer_momentum

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    return build


def _warmup_state(strategy: Strategy, model: nn.Module, seed: int) -> Controller | None:
    """The state averaging a DiLoCo warm-up's gradients: its ``warmup-with`` rung, one
    level of the mixed compressor (``None``, DiLoCo's dense default, without)."""
    if not strategy.warmup_steps or strategy.warmup_with is None:
        return None
    rung = strategy.warmup_with
    return Controller(model, "mixed", levels=(rung, rung), interval_unit="step", seed=seed)


def _warmup_window(config: TrainConfig) -> int:
    """The warm-up norm test's window: the run's check interval when it counts steps, else
    the library's default."""
    if config.interval_unit == "step" and config.interval:
        return config.interval
    return WARMUP_WINDOW


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def make_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """``config.optimizer`` over ``model``'s parameters at the schedule's first rate:
    SGD with ``momentum`` or AdamW with ``betas``, both with ``weight_decay``."""
    if config.optimizer == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=config.lr_at(0), betas=(config.betas[0], config.betas[1]),
            weight_decay=config.weight_decay,
        )  # fmt: skip
    return torch.optim.SGD(
        model.parameters(), lr=config.lr_at(0), momentum=config.momentum,
        weight_decay=config.weight_decay,
    )  # fmt: skip


def _build_model(config: TrainConfig, data: ClassificationData | LanguageData) -> nn.Module:
    name = config.model or data.default_model
    if isinstance(data, LanguageData | SequenceData):
        return get_model(name, ntoken=data.vocab_size)
    return get_model(name, num_classes=data.num_classes)


def _batch_controller(config: TrainConfig, strategy: Strategy, data, world: int):
    """The batch-size controller of an adaptive or fixed batch strategy, else ``None``."""
    if strategy.batch_mode is None:
        return None
    if isinstance(data, LanguageData):
        raise ValueError(
            f"strategy {strategy.text!r}: batch-size strategies support classification tasks, "
            f"not {config.task!r}"
        )
    small, large = strategy.batch_sizes()
    for size in (small, large):
        if size % world:
            raise ValueError(
                f"strategy {strategy.text!r}: batch {size} must be a multiple of the number "
                f"of workers ({world})"
            )
    if strategy.batch_mode == "static":
        return None
    return BatchSizeController(
        small, large, micro_batch=small // world,
        world_size=world, interval=_batch_interval(config),
        eta=config.eta, mode=strategy.batch_mode,
        fixed_switch_epoch=config.batch_switch_epoch, lr_scaling=config.lr_scaling,
        warmup_steps=config.batch_warmup_steps,
    )  # fmt: skip


def _batch_interval(config: TrainConfig) -> int:
    """Epochs between the batch controller's checks: ``config.interval`` when it counts
    epochs, else (``interval_unit="step"``: the interval is the hook's, in steps) 1."""
    if config.interval_unit == "step":
        return 1
    return config.interval or PaperRule.default_interval
