"""One training run on every rank (:func:`train_run`), and several in a row (:func:`run_many`).

Everything that averages gradients goes through the library's public API
(``AccordionState`` + ``accordion_hook``) or, for the baselines, through plain DDP and
PyTorch's own ``powerSGD_hook``. The parts, each a module of :mod:`accordion.harness`:

``config``     :class:`TrainConfig` (the settings, their checks, the schedule) and the presets
``data``       the tasks, in memory, and their rank-sharded batches
``attach``     the strategy's hook on the DDP model
``baselines``  PyTorch's own hooks, and every strategy's traffic count
``build``      a run's device, data, model, DDP, optimiser and logs, from a config
``loop``       one epoch: the optimizer steps, the evaluation, the epoch's record
``resume``     the checkpoint sets: resume and save
``records``    :class:`RunResult`, the per-epoch logs and the progress bar

The names other modules import from here (``TrainConfig``, ``PRESETS``, ``RunResult``, ...)
are re-exported from those modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..checkpoint import Checkpointer
from .baselines import TORCH_POWERSGD_MIN_COMPRESSION_RATE, TORCH_POWERSGD_START_ITER
from .build import set_up
from .config import LR_SCALINGS, PRESETS, SCHEDULES, TrainConfig
from .loop import Run, run_epoch
from .records import RunResult, progress_bar
from .resume import resume, save

__all__ = [
    "LR_SCALINGS",
    "PRESETS",
    "SCHEDULES",
    "TORCH_POWERSGD_MIN_COMPRESSION_RATE",
    "TORCH_POWERSGD_START_ITER",
    "RunResult",
    "TrainConfig",
    "run_many",
    "train_run",
]


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
    run = set_up(config, rank, world, local_rank)
    result = RunResult(config.strategy, config.seed, mild=run.strategy.mild,
                       aggressive=run.strategy.aggressive)  # fmt: skip
    saver = Checkpointer(config.checkpoint_dir) if config.checkpoint_dir else None
    start, train_time = resume(run, saver, result)
    bar = progress_bar(config) if rank == 0 else None
    if bar is not None:
        bar.update(start)
    for epoch in range(start, config.epochs):
        record, train_time = run_epoch(run, epoch, train_time)
        result.epochs.append(record)
        run.logger.log(record)
        if on_epoch is not None:
            on_epoch(record)
        done = epoch + 1
        if saver is not None and (done % config.checkpoint_every == 0 or done == config.epochs):
            save(run, saver, done, result, train_time)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(
                loss=f"{record['train_loss']:.3f}", test=f"{record['test_metric']:.2f}",
                sent=f"{record['floats'] / 1e6:.1f}M floats",
            )  # fmt: skip
    if bar is not None:
        bar.close()
    _add_decisions(result, run)
    run.logger.close(result.checks, result.calibration)
    return result


def _add_decisions(result: RunResult, run: Run) -> None:
    """What the run's state, batch controller, DiLoCo and momentum exchange decided."""
    state = run.state
    result.checks = state.stats()["checks"] if state is not None else []
    result.calibration = state.calibration if state is not None else None
    if run.controller is not None:
        result.batch_checks = run.controller.checks
    if run.diloco is not None:
        stats = run.diloco.stats()
        keys = ("rounds", "warmup_steps_done", "warmup_checks", "fragment_syncs")
        result.diloco = {k: stats[k] for k in keys if k in stats}  # fragment_syncs: streaming
        if stats.get("round_lengths"):  # rounds that grow
            result.diloco["round_lengths"] = stats["round_lengths"]
    if run.momentum is not None:
        exchange = run.momentum
        result.momentum = {"frozen_at": exchange.frozen_at, "steps": exchange.steps,
                           "clipped_steps": exchange.clipped_steps}  # fmt: skip


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
