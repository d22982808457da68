"""One epoch of a run on this rank: its optimizer steps (with micro-batches accumulated
under ``no_sync()`` for a batch controller), the evaluation and the epoch's record.

Accordion's decisions come at each epoch's end (``interval_unit="epoch"``) or after every
optimizer step (``"step"``: ``AccordionState.end_step``, deciding at each window's end).
Sequence tasks (:class:`~.data.SequenceData`, ``charlm``) are trained and evaluated on the
cross-entropy over every position of their windows."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..adam_noise import AdamNoiseCorrection
from ..batch import BatchSizeController, accumulation_loss_scale
from ..calibration import measure_step_compute
from ..compress.mixed import Mixed
from ..compress.quantize import IntQuantizer
from ..controller import Controller
from ..ddp import AccordionState
from ..diloco import DiLoCo
from ..momentum_exchange import MomentumExchange
from .baselines import Traffic
from .config import TrainConfig
from .data import (
    ClassificationData,
    LanguageData,
    SequenceData,
    classification_batches,
    language_batches,
)
from .records import Logger
from .strategies import Strategy, two_phase_parts


@dataclass
class Run:
    """What one run trains with on this rank, built by :func:`accordion.harness.build.set_up`."""

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
    traffic: Traffic
    optimizer: torch.optim.Optimizer
    logger: Logger
    #: ``TrainConfig.measure_compute``'s measurement (s), else ``None``.
    compute_step_s: float | None = None
    #: A DiLoCo strategy's rounds (``state`` averages its pseudo-gradients), else ``None``.
    diloco: DiLoCo | None = None
    #: The ``adam-noise`` strategies' correction of AdamW's second moment, else ``None``.
    adam_noise: AdamNoiseCorrection | None = None
    #: The ``momentum=P/LEVEL`` strategies' exchange of AdamW's momentum, else ``None``.
    momentum: MomentumExchange | None = None


def set_server_feedback(state: Controller | None, strategy: Strategy) -> None:
    """The strategy's ``server-error=off``: ``server_feedback = False`` on the integer
    quantisers ``state`` sends with (a mixed compressor's parts); nothing otherwise."""
    if state is None or strategy.server_feedback:
        return
    compressor = state.compressor
    for name in two_phase_parts(strategy.compressor, strategy.levels):
        quantiser = compressor.part(name) if isinstance(compressor, Mixed) else compressor
        if isinstance(quantiser, IntQuantizer):  # nq is one too: two_phase_parts names these
            quantiser.server_feedback = False


def run_epoch(run: Run, epoch: int, train_time: float) -> tuple[dict[str, Any], float]:
    """Train and evaluate epoch ``epoch``; return its record and the training time so far (s)."""
    config, state, controller = run.config, run.state, run.controller
    set_server_feedback(state, run.strategy)  # a loaded checkpoint rebuilt the compressor
    levels = state.levels() if state is not None else {}
    batch = global_batch(config, run.strategy, controller)
    steps_per_epoch = max(1, epoch_steps(run.data, config, run.world, batch))
    if run.world > 1:
        dist.barrier()  # time the same span of work on every rank
    start = time.perf_counter()
    loss_sum, batches, step_times = train_epoch(
        run.ddp, run.data, config, run.optimizer, run.rank, run.world, epoch, steps_per_epoch,
        run.device, run.traffic, batch, controller, state=state, diloco=run.diloco,
        exchange=run.momentum,
    )  # fmt: skip
    if run.diloco is not None and run.strategy.final_sync and epoch == config.epochs - 1:
        run.diloco.finish()  # the last round, cut short by the end: averaged and scored
    train_time += time.perf_counter() - start
    next_lr = config.lr_at(epoch + 1)
    if state is not None and state.interval_unit == "epoch":
        state.end_epoch(next_lr=next_lr)
    if controller is not None:
        last_lr = config.lr_at(epoch + (steps_per_epoch - 1) / steps_per_epoch)
        controller.end_epoch(epoch, lr_will_decay=next_lr < last_lr)
    # DiLoCo: the model of the last sync, the same on every rank
    with contextlib.nullcontext() if run.diloco is None else run.diloco.synced():
        tested = evaluation(run.model, run.data, config, run.rank, run.world, run.device)
    loss = torch.tensor([loss_sum, batches], dtype=torch.float64)
    if run.world > 1:
        dist.all_reduce(loss)
    floats, nbytes = run.traffic.totals()
    record = {
        "epoch": epoch,
        "train_loss": loss[0].item() / max(loss[1].item(), 1.0),
        **tested,
        "floats": floats,
        "bytes": nbytes,
        "train_time_s": train_time,
        "lr": run.optimizer.param_groups[0]["lr"],
        "batch_size": batch,
        "levels": levels,
        "step_times_s": step_times,
    }
    if state is not None:  # what this process's transport handed to its collectives
        record["counted_bytes"] = state.transport().bytes_sent
    if config.measure_compute:
        record["compute_step_s"] = run.compute_step_s
    return record, train_time


def train_epoch(ddp, data, config, optimizer, rank, world, epoch, steps_per_epoch, device,
                traffic: Traffic, batch: int, controller, state: AccordionState | None = None,
                diloco: DiLoCo | None = None, exchange: MomentumExchange | None = None,
                ) -> tuple[float, int, list[float]]:  # fmt: skip
    """One epoch of optimizer steps on global batches of ``batch`` samples. With a batch
    controller, each rank's share is split into micro-batches whose gradients accumulate
    under ``no_sync()``: one all-reduce and one optimizer step per global batch. With a
    ``state`` counting steps (``interval_unit="step"``), ``state.end_step`` follows every
    optimizer step, given the next step's scheduled rate (collective at a window's end).
    With ``diloco``, backward runs under ``no_sync()`` (each rank's own gradient) and
    ``diloco.step()`` follows each optimizer step (collective at a round's end). With an
    ``exchange`` past its freeze, the state's DDP hook hands the buckets to it, which
    clips and averages the momenta instead, and the loop does not clip.

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
    for step, (x, y) in enumerate(train_batches(data, config, rank, world, epoch, batch)):
        lr = config.lr_at(epoch + step / steps_per_epoch) * lr_scale
        if controller is not None:
            lr *= controller.lr_factor()
        for group in optimizer.param_groups:
            group["lr"] = lr
        started = time.perf_counter()  # local clock only: timing must not change what is sent
        optimizer.zero_grad(set_to_none=True)
        x, y = x.to(device), y.to(device)
        local = diloco is not None and not language  # each rank's own gradient
        step_loss, hidden = _step_gradients(ddp, x, y, hidden, language, local, accumulation)
        exchanged = exchange is not None and exchange.active  # its hook clipped, then sent
        if config.clip is not None and not exchanged:
            # DDP averages inside backward, so this clips the averaged gradient
            nn.utils.clip_grad_norm_(ddp.parameters(), config.clip)
        if controller is not None:
            controller.observe([p.grad for p in params if p.grad is not None])
        optimizer.step()
        if controller is not None:
            controller.step()
        if diloco is not None:
            diloco.step()
        elif state is not None and state.interval_unit == "step":
            state.end_step(next_lr=config.lr_at(epoch + (step + 1) / steps_per_epoch))
        step_times.append(time.perf_counter() - started)
        traffic.step()
        loss_sum += step_loss
        count += 1
    return loss_sum, count, step_times


def _step_gradients(ddp: DDP, x, y, hidden, language: bool, local: bool,
                    accumulation: int) -> tuple[float, Any]:  # fmt: skip
    """Forward and backward of one step: DDP averages the gradients (over ``accumulation``
    micro-batches) unless ``local``, which keeps each rank's own under ``no_sync()``.
    Returns this rank's loss and a language task's hidden state (truncated BPTT)."""
    if language:
        if hidden is not None:
            hidden = tuple(h.detach() for h in hidden)  # truncated BPTT
        with ddp.no_sync() if local else contextlib.nullcontext():
            logits, hidden = ddp(x, hidden)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
        return loss.item(), hidden
    if local:
        return _accumulate(ddp, [x], [y], sync=False), hidden
    return _accumulate(ddp, x.chunk(accumulation), y.chunk(accumulation)), hidden


def _accumulate(ddp: DDP, xs, ys, sync: bool = True) -> float:
    """Forward/backward over micro-batches; only the last one synchronises (one all-reduce
    of the summed gradients), none without ``sync``. Returns the global-batch loss on
    this rank."""
    scale = accumulation_loss_scale(len(xs))
    total = 0.0
    for i, (x, y) in enumerate(zip(xs, ys)):
        last = sync and i == len(xs) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            loss = output_loss(ddp(x), y) * scale
            loss.backward()
        total += loss.item()
    return total


def step_compute(ddp: DDP, data, config: TrainConfig, rank: int, world: int, device):
    """Seconds of forward and backward per step (no communication) on the first global
    batch, for the cost model and ``measure_compute`` (collective: every rank calls it);
    ``None`` for ``wikitext2``, whose step carries a hidden state (the cost model then
    assumes no overlap). Sequence tasks (``charlm``) are measured on their sequence loss."""
    if isinstance(data, LanguageData):
        return None
    x, y = next(iter(train_batches(data, config, rank, world, 0, config.batch_size)))
    x, y = x.to(device), y.to(device)

    def step() -> None:
        output_loss(ddp(x), y).backward()

    return measure_step_compute(ddp, step, steps=5)


def output_loss(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean"):
    """Cross-entropy of logits ``[B, C]`` for labels ``[B]``, or of sequence logits
    ``[B, T, V]`` for targets ``[B, T]`` over all ``B * T`` positions (nats)."""
    return nn.functional.cross_entropy(
        output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction=reduction
    )


def evaluate(model: nn.Module, data, config: TrainConfig, rank: int, world: int, device):
    """Test accuracy (%) or perplexity; each rank evaluates a shard, then all-reduce.
    For sequence tasks: next-token accuracy (%) over every position."""
    return evaluation(model, data, config, rank, world, device)["test_metric"]


def evaluation(model: nn.Module, data, config: TrainConfig, rank: int, world: int,
               device) -> dict[str, float]:  # fmt: skip
    """The epoch record's test entries (collective: each rank evaluates a shard, then the
    sums are all-reduced): ``test_metric``, the accuracy (%) of a classification task or
    the perplexity of ``wikitext2``; for a sequence task (``charlm``) ``test_metric`` is the
    next-token accuracy (%) over every position of the validation windows, plus
    ``val_loss`` (mean cross-entropy, nats per token) and ``perplexity`` (its exp)."""
    model.eval()
    with torch.no_grad():
        if isinstance(data, LanguageData):
            totals = _stream_totals(model, data, config, rank, world, device)
        else:
            totals = _sample_totals(model, data, config, rank, world, device)
    if world > 1:
        dist.all_reduce(totals)
    model.train()
    count = max(totals[1].item(), 1.0)
    if isinstance(data, LanguageData):
        return {"test_metric": math.exp(min(totals[0].item() / count, 50.0))}
    tested = {"test_metric": 100.0 * totals[0].item() / count}
    if isinstance(data, SequenceData):
        tested["val_loss"] = totals[2].item() / count
        tested["perplexity"] = math.exp(min(tested["val_loss"], 50.0))
    return tested


def _stream_totals(model, data: LanguageData, config, rank, world, device) -> torch.Tensor:
    """This rank's (loss sum, tokens, 0) over its columns of the test stream."""
    totals = torch.zeros(3, dtype=torch.float64)
    hidden = None
    batches = language_batches(
        data.test, batch_size_per_rank=max(1, config.batch_size // world),
        rank=rank, world_size=world, bptt=config.bptt,
    )  # fmt: skip
    for x, y in batches:
        logits, hidden = model(x.to(device), hidden)
        loss = output_loss(logits, y.to(device), reduction="sum")
        totals += torch.tensor([loss.item(), y.numel(), 0.0], dtype=torch.float64)
    return totals


def _sample_totals(model, data: ClassificationData, config, rank, world, device) -> torch.Tensor:
    """This rank's (correct, predictions, loss sum) over its shard of the test samples;
    a sequence task's predictions are every position of its windows (the loss sum only
    for those: classification records no loss)."""
    totals = torch.zeros(3, dtype=torch.float64)
    sequence = isinstance(data, SequenceData)
    shard = dataclasses.replace(
        data, x_test=data.x_test[rank::world], y_test=data.y_test[rank::world]
    )
    batches = classification_batches(
        shard, global_batch=config.batch_size, rank=0, world_size=1, epoch=0,
        seed=config.seed, train=False,
    )  # fmt: skip
    for x, y in batches:
        output, y = model(x.to(device)), y.to(device)
        correct = (output.argmax(dim=-1) == y).sum().item()
        loss = output_loss(output, y, reduction="sum").item() if sequence else 0.0
        totals += torch.tensor([correct, y.numel(), loss], dtype=torch.float64)
    return totals


def train_batches(data, config: TrainConfig, rank: int, world: int, epoch: int, batch: int):
    """This rank's training batches of epoch ``epoch`` at a global batch of ``batch``."""
    if isinstance(data, LanguageData):
        return language_batches(
            data.train, batch_size_per_rank=batch // world, rank=rank,
            world_size=world, bptt=config.bptt,
        )  # fmt: skip
    return classification_batches(
        data, global_batch=batch, rank=rank, world_size=world, epoch=epoch, seed=config.seed,
    )  # fmt: skip


def epoch_steps(data, config: TrainConfig, world: int, batch: int) -> int:
    """Optimizer steps of one epoch at a global batch of ``batch`` samples."""
    if isinstance(data, LanguageData):
        columns = (batch // world) * world
        return math.ceil((data.train.numel() // columns - 1) / config.bptt)
    return data.x_train.shape[0] // batch


def global_batch(config: TrainConfig, strategy: Strategy, controller) -> int:
    """The global batch (samples) the next epoch trains at."""
    if controller is not None:
        return controller.batch_size
    return strategy.batch_small or config.batch_size
