"""The ``accordion`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .compress import compressing_names, compressor_class
from .costmodel import parse_bandwidth, parse_latency


def plan_compressors() -> tuple[str, ...]:
    """The compressors ``accordion plan --compressor`` takes: every registered one but dense
    (which the plan always shows)."""
    return compressing_names()


#: The compressor ``accordion plan`` weighs by default (the paper's).
PLAN_COMPRESSOR = "powersgd"

PLAN_JSON_KEYS = """\
--json prints one object: model, num_classes (null for the language models), parameters,
tensors, compressed_tensors, workers, steps, compressor, bandwidth_bytes_per_s, latency_s,
and "levels": a list with one entry for dense and one per level, each with
  label                 "dense", or the compressor's name of the level: "rank R", "top-k K"
  compressor, level     the compressor kind and its level (null for dense)
  floats_per_step       floats one worker sends per step, paper convention
  floats_total          floats_per_step * steps
  bytes_per_step        bytes one worker puts on the wire per step (ring collectives)
  compression_ratio     dense floats_per_step / this level's floats_per_step
  comm_time_per_step_s  predicted communication seconds per step (alpha-beta model)
With --layers, also "layers": one entry per parameter tensor, each with
  name, shape           the parameter's name and shape
  dense_bytes           bytes one worker sends for it per step, dense
  dense_time_s          their transfer time (bandwidth term: latency is per bucket)
  bytes, time_s         the same at each level, in the order of "levels" after dense
With --compressor topk, also "topk_break_even": where top-k stops paying, with
  workers               the worker count W
  density               the kept fraction above which top-k's all-gathers put more bytes
                        on the wire than a dense ring all-reduce: 2 e / (W (e + i)), so
                        1/W for fp32 values and int32 indices (null for one worker, or
                        when top-k compresses no tensor)
  paper_density         the same in the paper's floats (2 k W against numel): 1/(2W)
  value_bytes           bytes per value sent, e
  index_bytes           bytes per index sent, i (4: int32; 8 for tensors of >= 2**31)
  bytes_vs_dense        each level's bytes_per_step / dense's, in the order of "levels"
                        after dense (above 1: that level sends more than dense)
With a list of --workers or of --bandwidth values, workers and bandwidth_bytes_per_s are
lists, and "grid" replaces "levels" and "topk_break_even": one entry per worker count
and link rate, worker counts outermost, each with workers, bandwidth_bytes_per_s, levels
and (for top-k) topk_break_even as above.
"""


def parse_levels(text: str, compressor: str) -> list[Any]:
    """Parse ``--levels``: comma-separated levels as ``compressor`` reads them ("2,1" ranks
    for PowerSGD, "0.99,0.1" fractions for top-k); ``ValueError`` for anything else."""
    if compressor not in plan_compressors():
        raise ValueError(f"compressor must be one of {plan_compressors()}, got {compressor!r}")
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ValueError(f"levels must be a comma-separated list such as '2,1', got {text!r}")
    cls = compressor_class(compressor)
    levels: list[Any] = []
    for item in items:
        try:
            levels.append(cls.parse_level(item))
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"levels for {compressor} must each be {cls.level_help}, got {item!r} in "
                f"{text!r} ({exc})"
            ) from None
    return levels


def default_levels_text(compressor: str) -> str:
    """The ``--levels`` of ``compressor`` when none are given: its default (mild, aggressive)."""
    cls = compressor_class(compressor)
    return ",".join(cls.level_text(level) for level in cls.default_levels)


def _human(count: float) -> str:
    # Paper units: millions below ten billion, billions above; 3 decimals so that the
    # paper's one-decimal figures (which are truncated, not rounded) can be read off.
    return f"{count / 1e6:,.3f} M" if count < 1e10 else f"{count / 1e9:,.3f} B"


def _bytes(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _plan_list(parser: argparse.ArgumentParser, flag: str, text: str, parse, allowed: str):
    """The comma-separated values of ``flag``, each read by ``parse``; a usage error (exit
    2) naming the flag, the value and what is allowed for an empty or unreadable item."""
    items = [item.strip() for item in text.split(",")]
    values = []
    for item in items:
        try:
            values.append(parse(item))
        except (TypeError, ValueError) as exc:
            where = f" in {text!r}" if len(items) > 1 else ""
            parser.error(f"argument {flag}: must be {allowed}, got {item!r}{where} ({exc})")
    return values


def _worker_count(text: str) -> int:
    """One ``--workers`` item: an int >= 1."""
    if not re.fullmatch(r"[0-9]+", text):
        raise ValueError("not an int")
    if int(text) < 1:
        raise ValueError("below 1")
    return int(text)


_WORKERS_HELP = "an int >= 1, or a comma-separated list of them such as '8,64,512'"
_BANDWIDTHS_HELP = (
    "a link rate such as '10Gbit', or a comma-separated list of them such as '10Gbit,100Gbit'"
)


def _plan_inputs(args: argparse.Namespace) -> tuple[list[Any], list[int], list[float], float]:
    """The checked ``plan`` arguments: (levels, worker counts, bandwidths in bytes/s,
    latency in s); usage errors exit 2. Also resolves ``args.num_classes`` to the model's."""
    from .models.shapes import default_num_classes, plan_model_names

    parser = args.parser
    if args.model not in plan_model_names():
        parser.error(
            f"argument --model: must be one of {', '.join(plan_model_names())}, got {args.model!r}"
        )
    if args.compressor not in plan_compressors():
        parser.error(
            f"argument --compressor: must be one of {', '.join(plan_compressors())}, "
            f"got {args.compressor!r}"
        )
    if args.levels is None:
        args.levels = default_levels_text(args.compressor)
    try:
        levels = parse_levels(args.levels, args.compressor)
    except (TypeError, ValueError) as exc:
        parser.error(f"argument --levels: {exc}")
    if args.num_classes is None:
        args.num_classes = default_num_classes(args.model)
    for flag, value, least in (("--steps", args.steps, 0), ("--num-classes", args.num_classes, 1)):
        if value < least:
            parser.error(f"argument {flag}: must be an int >= {least}, got {value}")
    workers = _plan_list(parser, "--workers", args.workers, _worker_count, _WORKERS_HELP)
    bandwidths = _plan_list(parser, "--bandwidth", args.bandwidth, parse_bandwidth,
                            _BANDWIDTHS_HELP)  # fmt: skip
    if args.layers and len(workers) * len(bandwidths) > 1:
        parser.error(
            "argument --layers: needs one --workers and one --bandwidth value, got "
            f"--workers {args.workers!r} and --bandwidth {args.bandwidth!r}"
        )
    try:
        latency = parse_latency(args.latency)
    except ValueError as exc:
        parser.error(f"argument --latency: {exc}")
    return levels, workers, bandwidths, latency


def _plan_summary(args, shapes, workers: list[int], bandwidths: list[float], latency: float):
    """The run settings of a plan, as ``--json`` prints them (lists for a grid)."""
    from .models.shapes import takes_classes

    grid = len(workers) * len(bandwidths) > 1
    return {
        "model": args.model,
        "num_classes": args.num_classes if takes_classes(args.model) else None,
        "parameters": sum(math.prod(s) for s in shapes),
        "tensors": len(shapes),
        "compressed_tensors": sum(compressor_class(args.compressor).applies_to(s) for s in shapes),
        "workers": workers if grid else workers[0],
        "steps": args.steps,
        "compressor": args.compressor,
        "bandwidth_bytes_per_s": bandwidths if grid else bandwidths[0],
        "latency_s": latency,
    }


def _break_even(shapes, workers: int, rows) -> dict[str, Any]:
    """``topk_break_even`` of ``--json``: where top-k stops paying, and each level's bytes
    against dense's (null where dense sends nothing)."""
    from .plan import topk_break_even

    dense = rows[0].bytes_per_step
    ratios = [row.bytes_per_step / dense if dense else None for row in rows[1:]]
    return {**topk_break_even(shapes, workers).as_dict(), "bytes_vs_dense": ratios}


def _grid_entry(cell, shapes, topk: bool) -> dict[str, Any]:
    """One entry of ``--json``'s "grid": a worker count, a link rate and the plan there."""
    entry = {
        "workers": cell.workers,
        "bandwidth_bytes_per_s": cell.bandwidth,
        "levels": [row.as_dict() for row in cell.rows],
    }
    if topk:
        entry["topk_break_even"] = _break_even(shapes, cell.workers, cell.rows)
    return entry


def _plan_command(args: argparse.Namespace) -> int:
    from .models.shapes import named_shapes
    from .plan import layer_plan, make_plan, scaling_plan

    levels, workers, bandwidths, latency = _plan_inputs(args)
    named = named_shapes(args.model, args.num_classes)
    shapes = [shape for _, shape in named]
    summary = _plan_summary(args, shapes, workers, bandwidths, latency)
    topk = args.compressor == "topk"
    if len(workers) * len(bandwidths) > 1:
        cells = scaling_plan(shapes, args.compressor, levels, workers, bandwidths, args.steps,
                             latency)  # fmt: skip
        if args.json:
            grid = [_grid_entry(cell, shapes, topk) for cell in cells]
            print(json.dumps({**summary, "grid": grid}))
        else:
            _print_scaling(args, summary, cells, shapes)
        return 0
    rows = make_plan(shapes, args.compressor, levels, workers[0], args.steps, bandwidths[0],
                     latency)  # fmt: skip
    layer_rows = []
    if args.layers:
        layer_rows = layer_plan(named, args.compressor, levels, workers[0], bandwidths[0])
    if args.json:
        extra = {"topk_break_even": _break_even(shapes, workers[0], rows)} if topk else {}
        layers = {"layers": [r.as_dict() for r in layer_rows]} if args.layers else {}
        levels_out = [row.as_dict() for row in rows]
        print(json.dumps({**summary, "levels": levels_out, **extra, **layers}))
    else:
        _print_plan(args, summary, rows, layer_rows)
        if topk:
            print(_break_even_line(_break_even(shapes, workers[0], rows), rows))
    return 0


def _plan_header(args: argparse.Namespace, summary: dict[str, Any]) -> str:
    """The plan's first line: the model, its size, the workers and the steps."""
    classes = "" if summary["num_classes"] is None else f", {summary['num_classes']} classes"
    workers = summary["workers"]
    workers = ", ".join(map(str, workers)) if isinstance(workers, list) else str(workers)
    return (
        f"accordion plan: {args.model}{classes}, {summary['parameters']:,} parameters in "
        f"{summary['tensors']} tensors ({summary['compressed_tensors']} compressible), "
        f"{workers} workers, {args.steps:,} steps"
    )


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.3g}%"


def _break_even_line(entry: dict[str, Any], rows) -> str:
    """The plain form of ``topk_break_even``: the density, the formula, each level's bytes."""
    w = entry["workers"]
    head = f"top-k break-even at {w} worker{'s' if w != 1 else ''}: "
    if entry["density"] is None:
        why = "one worker sends nothing" if w == 1 else "top-k compresses no tensor"
        return head + f"none ({why})"
    density, paper = entry["density"], entry["paper_density"]
    # the common case reads as the rule it is: 1/W of the entries
    exact = f"1/{w} = " if math.isclose(density * w, 1.0) else ""
    value, index = entry["value_bytes"], entry["index_bytes"]
    ratios = [f"{ratio:.3g}x" for ratio in entry["bytes_vs_dense"]]
    levels = ", ".join(f"{row.label} {ratio}" for row, ratio in zip(rows[1:], ratios))
    return (
        f"{head}density {exact}{_percent(density)} of the entries kept (paper floats: "
        f"1/{2 * w} = {_percent(paper)})\n  above it, all-gathering {value}-byte values + "
        f"{index:g}-byte indices sends more than a dense ring all-reduce; bytes against "
        f"dense: {levels}"
    )


def _print_plan(args: argparse.Namespace, summary: dict[str, Any], rows, layer_rows) -> None:
    """The human form of the plan: a header, one row per level, then the tensors."""
    print(_plan_header(args, summary))
    print(
        f"link {args.bandwidth}, latency {args.latency}: alpha-beta model, ring collectives; "
        "floats per worker in the paper's convention"
    )
    header = ("level", "floats/step", "floats total", "bytes/step", "ratio", "comm ms/step")
    table = [
        (
            row.label,
            f"{row.floats_per_step:,}",
            _human(row.floats_total),
            _bytes(row.bytes_per_step),
            f"{row.compression_ratio:.1f}x",
            f"{row.comm_time_per_step_s * 1e3:.3f}",
        )
        for row in rows
    ]
    _print_table(header, table)
    if layer_rows:
        print(f"\nper tensor: transfer ms/step at {args.bandwidth} (latency is paid per bucket)")
        labels = [row.label for row in rows[1:]]
        _print_table(
            ("tensor", "shape", "dense", *labels),
            [
                (
                    r.name,
                    "x".join(map(str, r.shape)),
                    f"{r.dense_time_s * 1e3:.3f}",
                    *(f"{t * 1e3:.3f}" for t in r.time_s),
                )
                for r in layer_rows
            ],
        )


def _print_table(header: Sequence[str], table: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in (header, *table)) for i in range(len(header))]
    for cells in (header, *table):
        # the label column reads left-aligned, the figures right-aligned
        padded = [
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        print("  ".join(padded))


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.1f}" if ms >= 10 else f"{ms:.2f}"


def _marked(value: float, dense: float, text: str) -> str:
    # a star where a level costs more than dense: the cells where compressing stops paying
    return text + ("*" if value > dense * (1 + 1e-12) else " ")


def _print_scaling(args: argparse.Namespace, summary: dict[str, Any], cells, shapes) -> None:
    """The human form of a grid: predicted communication ms per step of each level at each
    worker count and link rate, the bytes per worker at each worker count, and for top-k
    each worker count's break-even; a star marks a figure above dense's."""
    print(_plan_header(args, summary))
    rates = [item.strip() for item in args.bandwidth.split(",")]
    print(
        f"links {', '.join(rates)}, latency {args.latency}: alpha-beta model, ring collectives "
        "(all-reduce 2(W-1)a + 2(W-1)/W S/B, all-gather (W-1)a + (W-1) s/B); "
        "* more than dense"
    )
    labels = [row.label for row in cells[0].rows]
    print("\ncomm ms/step")
    _print_table(
        ("level", *(f"{c.workers} @ {rates[i % len(rates)]}" for i, c in enumerate(cells))),
        [
            (label, *(_marked(c.rows[j].comm_time_per_step_s, c.rows[0].comm_time_per_step_s,
                              _ms(c.rows[j].comm_time_per_step_s)) for c in cells))
            for j, label in enumerate(labels)
        ],
    )  # fmt: skip
    per_workers = cells[:: len(rates)]  # the bytes do not depend on the link rate
    print("\nbytes/step per worker (ring collectives)")
    _print_table(
        ("level", *(f"{c.workers} workers" for c in per_workers)),
        [
            (label, *(_marked(c.rows[j].bytes_per_step, c.rows[0].bytes_per_step,
                              _bytes(c.rows[j].bytes_per_step)) for c in per_workers))
            for j, label in enumerate(labels)
        ],
    )  # fmt: skip
    if args.compressor == "topk":
        print()
        for c in per_workers:
            print(_break_even_line(_break_even(shapes, c.workers, c.rows), c.rows))


def _train_defaults() -> dict[str, str]:
    """``TrainConfig``'s field defaults as the flags read them (``30,45``, ``0.1``): the one
    place the defaults of ``train`` and ``compare`` are written."""
    from .harness.train import TrainConfig

    shown = {}
    for f in dataclasses.fields(TrainConfig):
        value = f.default
        if isinstance(value, tuple):
            shown[f.name] = ",".join(str(v) for v in value)
        else:
            shown[f.name] = f"{value:g}" if isinstance(value, float) else str(value)
    return shown


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``train`` and ``compare``; None means "from the preset or default"."""
    from .controller import STATISTICS
    from .harness.data import TASKS
    from .harness.train import LR_SCALINGS, SCHEDULES
    from .models import MODEL_NAMES

    d = _train_defaults()
    tasks = ", ".join(f"{task} (default)" if task == d["task"] else task for task in TASKS)
    scalings = " or ".join(LR_SCALINGS)
    for flag, kind, text in (
        ("--preset", None, "a named configuration of the paper's runs (GPU scale)"),
        ("--task", None, tasks),
        ("--data-dir", None, "cifar10, cifar100, wikitext2: directory of their files "
         "(required); mnist1d: directory the generated dataset is cached in (created; "
         "default: $ACCORDION_CACHE, else no cache); synthetic: not allowed"),
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
        ("--momentum", float, f"SGD momentum (default {d['momentum']})"),
        ("--weight-decay", float, f"weight decay (default {d['weight_decay']})"),
        ("--interval", int, "Accordion check interval, epochs (default: the rule's, 1 for "
         "the guarded rule, 10 for the paper's)"),
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
        ("--bptt", int, f"LSTM truncated-BPTT length (default {d['bptt']})"),
        ("--clip", float, "gradient-norm clipping (LSTM preset: 0.4)"),
        ("--threads", int, "torch threads per worker (default cores/workers)"),
    ):  # fmt: skip
        parser.add_argument(flag, type=kind, default=None, help=text)
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
):
    """The ``TrainConfig`` of the flags (preset, then the flags given), not yet validated:
    see :func:`_preflight`."""
    from .harness.launch import default_threads
    from .harness.train import PRESETS, TrainConfig

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
    values["progress"] = not args.no_progress
    if values.get("threads") is None:
        values["threads"] = default_threads(args.workers)
    if strategy is not None:
        values["strategy"] = strategy
    return TrainConfig(**values)


def _world(args: argparse.Namespace) -> int:
    """The number of workers the run will have: torchrun's ``WORLD_SIZE``, else --workers."""
    from .harness.launch import in_torchrun

    return int(os.environ["WORLD_SIZE"]) if in_torchrun() else args.workers


def _preflight(
    args: argparse.Namespace, configs: Sequence[Any], strategy_flag: str, out: str | None
) -> None:
    """Every check that can fail before a worker starts, as a usage error (exit 2): each
    run's settings against the number of workers, the task's files, and the folders the
    run writes (``out``, and the MNIST-1D cache). Loads no data, so it takes no time."""
    from .harness.data import FILE_TASKS, find_task_files, mnist1d_cache_file

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
    elif task == "mnist1d" and data_dir is not None:
        if not mnist1d_cache_file(data_dir).is_file():
            _check_writable(parser, "--data-dir", data_dir, "the MNIST-1D cache")
    if out is not None:
        _check_writable(parser, "--out", out, "the logs")


def _config_error(parser: argparse.ArgumentParser, exc: Exception, strategy_flag: str) -> NoReturn:
    """The usage error of a ``TrainConfig.validate`` error, naming the flag of the setting
    that the message starts with (``strategy`` is ``strategy_flag``)."""
    from .harness.train import TrainConfig

    text = str(exc)
    name = re.match(r"[a-z_]*", text).group()
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


def _train_worker(rank, world, local_rank, config):
    from .harness.train import train_run

    return train_run(config, rank, world, local_rank).as_dict()


def _train_command(args: argparse.Namespace) -> int:
    from .harness.launch import in_torchrun, run_distributed

    config = _make_config(args, args.parser, strategy=args.strategy)
    config.out = args.out
    config.checkpoint_dir, config.checkpoint_every = args.checkpoint_dir, args.checkpoint_every
    # only rank 0 writes the logs
    writes = not in_torchrun() or int(os.environ["RANK"]) == 0
    _preflight(args, [config], "--strategy", args.out if writes else None)
    rendezvous = None
    if args.checkpoint_dir is not None:
        _check_writable(args.parser, "--checkpoint-dir", args.checkpoint_dir, "checkpoints")
        rendezvous = os.path.join(args.checkpoint_dir, ".rendezvous")
    result = run_distributed(_train_worker, args.workers, config, rendezvous=rendezvous)
    if in_torchrun() and int(os.environ["RANK"]) != 0:
        return 0
    last = result["epochs"][-1]
    print(
        f"{config.strategy}: test {last['test_metric']:.2f} after {config.epochs} epochs, "
        f"{last['floats']:,} floats sent per worker, "
        f"training loop {last['train_time_s']:.1f} s"
        + (f"; logs in {args.out}" if args.out else "")
    )
    return 0


def _check_baseline(args: argparse.Namespace, strategies: Sequence[str], where: str) -> None:
    """A usage error (exit 2) unless ``--baseline`` is absent or names distinct
    strategies, each one of ``strategies``."""
    for i, baseline in enumerate(args.baseline or ()):
        if baseline not in strategies:
            args.parser.error(
                f"argument --baseline: must be one of {where} ({', '.join(strategies)}), "
                f"got {baseline!r}"
            )
        if baseline in args.baseline[:i]:
            args.parser.error(
                f"argument --baseline: {baseline!r} is given twice; each baseline may appear once"
            )


def _compare_from_files(args: argparse.Namespace) -> int:
    """``compare --from FILE...``: the tables of saved results.json files, no training."""
    from .harness.compare import add_paired, format_paired, format_table, load_results

    try:
        results = load_results(args.from_files)
    except (OSError, TypeError, ValueError) as exc:
        args.parser.error(f"argument --from: {exc}")
    _check_baseline(args, results["config"]["strategies"], "the strategies in the files")
    print(format_table(results))
    if args.baseline is not None:
        add_paired(results, args.baseline)
        print("\n" + format_paired(results))
    return 0


def _compare_command(args: argparse.Namespace) -> int:
    from .harness.compare import format_paired, format_table, run_compare
    from .harness.launch import in_torchrun

    if args.from_files is not None:
        return _compare_from_files(args)
    config = _make_config(args, args.parser)
    _check_baseline(args, args.strategies, "--strategies")
    if args.seeds < 1:
        args.parser.error(f"argument --seeds: must be an int >= 1, got {args.seeds}")
    runs = [dataclasses.replace(config, strategy=text) for text in args.strategies]
    _preflight(args, runs, "--strategies", args.out)
    results = run_compare(
        config, args.strategies, args.seeds, args.workers, args.out, baseline=args.baseline
    )
    if in_torchrun() and int(os.environ["RANK"]) != 0:
        return 0
    print(format_table(results))
    if args.baseline is not None:
        print("\n" + format_paired(results))
    written = [Path(args.out) / "results.json"]
    if not args.no_plots:
        from .harness.plots import plot_all

        written += plot_all(results, args.out)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _cluster_inputs(args: argparse.Namespace) -> tuple[Any, list[str]]:
    """The checked ``cluster`` arguments: (an unstarted cluster, the accordion command)."""
    from .cluster import EmulatedCluster

    parser = args.parser
    command = list(args.accordion_args)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command and not args.probe:
        parser.error(
            "give --probe or the accordion command to run after --, e.g. "
            "-- train --task mnist1d --epochs 2"
        )
    subcommands = {"train", "compare", "plan"}
    if command and command[0] not in subcommands:
        parser.error(
            f"the command after -- must start with one of {', '.join(sorted(subcommands))}"
            f" (an accordion subcommand), got {command[0]!r}"
        )
    if args.bandwidth is None:
        parser.error("argument --bandwidth: required (each host's link rate, e.g. 100mbit)")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"argument --timeout: must be > 0 seconds, got {args.timeout}")
    try:
        cluster = EmulatedCluster(args.hosts, args.bandwidth, args.delay)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if command[:1] in (["train"], ["compare"]) and not any(
        a == "--threads" or a.startswith("--threads=") for a in command
    ):
        # every host defaults to all the cores: share them instead
        command += ["--threads", str(max(1, (os.cpu_count() or 1) // args.hosts))]
    return cluster, command


def _print_probe(cluster: Any, args: argparse.Namespace) -> None:
    """Measure the cluster's all-reduce bandwidth and print it against the link rate."""
    probe = cluster.measure_bandwidth(timeout=args.timeout)
    measured = probe["bus_bandwidth_bytes_per_s"]
    print(
        f"all-reduce bus bandwidth {measured * 8 / 1e6:,.1f} Mbit/s on "
        f"{args.hosts} hosts ({measured / cluster.bandwidth:.0%} of the "
        f"{cluster.bandwidth * 8 / 1e6:,.1f} Mbit/s links), "
        f"{probe['bytes'] / 1e6:g} MB in {probe['seconds']:.3f} s",
        flush=True,
    )


def _cluster_command(args: argparse.Namespace) -> int:
    from .cluster import ClusterError, ClusterRunError, remove_leftovers

    parser = args.parser
    if args.cleanup:
        try:
            removed = remove_leftovers()
        except ClusterError as exc:
            parser.error(str(exc))
        print(f"removed {len(removed)} namespace(s)" + "".join(f" {n}" for n in removed))
        return 0
    cluster, command = _cluster_inputs(args)
    try:
        # start() undoes what it built when it fails; close() below on every other exit
        cluster.start()
    except ClusterError as exc:
        parser.error(str(exc))
    echoed = False
    try:
        if args.probe:
            _print_probe(cluster, args)
        if not command:
            return 0
        echoed = True
        result = cluster.run(
            "accordion", command, timeout=args.timeout, log_dir=args.log_dir, echo=True
        )
    except TimeoutError as exc:
        print(f"accordion cluster: {exc}", file=sys.stderr)
        return 124
    except ClusterRunError as exc:
        result = exc.result
        # host 0's stderr was echoed already; another host's is only in the message
        message = str(exc).split(";")[0] if echoed and result.failed_host == 0 else str(exc)
        print(f"accordion cluster: {message}", file=sys.stderr)
    except ClusterError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        print("accordion cluster: interrupted; removing the cluster", file=sys.stderr)
        return 130
    finally:
        cluster.close()
    # host 0's status, unless another host failed first and host 0 was stopped for it
    code = result.returncodes[0 if result.failed_host is None else result.failed_host]
    # a signal's negative code becomes the shell's 128 + signal
    return (code if code >= 0 else 128 - code) or (1 if result.failed_host is not None else 0)


def _add_plan(sub: Any) -> None:
    """The ``plan`` subcommand; the compressors and their default levels from the registry."""
    from .models.shapes import plan_model_names

    plan = sub.add_parser(
        "plan",
        help="predict what each compression level sends for a model",
        description="Floats, bytes and predicted time per step for dense and each level.",
        epilog=PLAN_JSON_KEYS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = plan.add_argument
    add(
        "--model",
        default="resnet18",
        help=f"model name: {', '.join(plan_model_names())} (default %(default)s); resnet50 "
        "(ImageNet) and transformer-1b (GPT-2-style, 18 x 2048) are known by their shapes only",
    )
    add(
        "--num-classes",
        type=int,
        default=None,
        help="classes (default the model's: 1000 for resnet50, else 10; the language models "
        "lstm and transformer-1b ignore it)",
    )
    add(
        "--workers",
        default="4",
        help="data-parallel workers, or a comma-separated list such as 8,64,512 for a "
        "scaling grid (default %(default)s)",
    )
    add("--steps", type=int, default=29400, help="optimizer steps (default %(default)s)")
    names = plan_compressors()
    add("--compressor", default=PLAN_COMPRESSOR, help=f"{', '.join(names)} (default %(default)s)")
    defaults = ", ".join(f"{name} '{default_levels_text(name)}'" for name in names)
    add(
        "--levels",
        default=None,
        help="comma-separated levels, mildest first, as the compressor reads them (PowerSGD "
        f"ranks, top-k fractions, ...); default the compressor's own: {defaults}",
    )
    add(
        "--bandwidth",
        default="10Gbit",
        help="link rate, or a comma-separated list such as 10Gbit,25Gbit,100Gbit for a scaling "
        "grid (default %(default)s)",
    )
    add("--latency", default="50us", help="per-message latency (default %(default)s)")
    add("--json", action="store_true", help="print one JSON object (keys below)")
    add("--layers", action="store_true", help="also per tensor: bytes and transfer time per step")
    plan.set_defaults(handler=_plan_command, parser=plan)


def _add_train_and_compare(sub: Any) -> None:
    """The ``train`` and ``compare`` subcommands: the run settings, then their own flags."""
    from .harness.strategies import FORMATS, strategy_compressors

    forms = f"{', '.join(FORMATS)}; COMPRESSOR one of {', '.join(strategy_compressors())}"
    train = sub.add_parser(
        "train",
        help="train one strategy (local workers or under torchrun)",
        description=f"Distributed training through the Accordion hook. Strategies: {forms}.",
    )
    _config_arguments(train)
    train.add_argument("--strategy", default=_train_defaults()["strategy"], help="see above")
    train.add_argument("--out", default=None, help="directory for metrics.jsonl / metrics.csv")
    train.add_argument(
        "--checkpoint-dir", default=None, metavar="DIR",
        help="write a consistent checkpoint set of every worker there, and resume from the "
        "newest complete one when it exists (see docs/fault-tolerance.md); under torchrun "
        "the workers also meet through a file rendezvous in DIR/.rendezvous, one per "
        "restart attempt (default: no checkpoints)",
    )  # fmt: skip
    train.add_argument(
        "--checkpoint-every", type=int, default=1, metavar="N",
        help="epochs between checkpoint sets; one is also written after the last epoch "
        "(default 1)",
    )  # fmt: skip
    train.set_defaults(handler=_train_command, parser=train)

    compare = sub.add_parser(
        "compare",
        help="run several strategies with the same seeds and print the paper's table",
        description="Runs every strategy with seeds 0..N-1, prints the table, writes "
        f"results.json and PNG plots to --out. Strategies: {forms}.",
    )
    _config_arguments(compare)
    source = compare.add_mutually_exclusive_group(required=True)
    source.add_argument("--strategies", nargs="+", help="space-separated")
    source.add_argument(
        "--from", dest="from_files", nargs="+", metavar="RESULTS_JSON", default=None,
        help="no training: print the tables of these results.json files, merged (runs of "
        "the same settings, each strategy and seed once)",
    )  # fmt: skip
    compare.add_argument(
        "--baseline", nargs="+", default=None, metavar="STRATEGY",
        help="also print each other strategy's final test metric minus its baseline's, "
        "paired by seed, with a 95%% Student-t interval, and the data ratio (baseline's "
        "data / this); with several baselines each strategy is paired with the one of the "
        "same compressor, else the first; stored in results.json under 'paired' "
        "(default: none)",
    )  # fmt: skip
    compare.add_argument("--seeds", type=int, default=1, help="seeds per strategy (default 1)")
    compare.add_argument("--out", default="runs/compare", help="output directory")
    compare.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    compare.set_defaults(handler=_compare_command, parser=compare)


def _add_cluster(sub: Any) -> None:
    """The ``cluster`` subcommand: an accordion command on emulated hosts."""
    cluster = sub.add_parser(
        "cluster",
        help="run an accordion command on an emulated multi-host cluster (root, Linux)",
        description="Builds HOSTS network namespaces joined by a bridge, with each host's "
        "link limited to BANDWIDTH each way (tc tbf; netem for --delay), runs "
        "'accordion ARGS' on every host as one node of a torchrun job over gloo, prints "
        "host 0's output, tears everything down and exits with host 0's status. train and "
        "compare get --threads cores/HOSTS unless given. Needs root and iproute2 (ip, tc).",
        epilog="example: accordion cluster --hosts 2 --bandwidth 100mbit --probe -- train "
        "--task mnist1d --epochs 2 --strategy dense",
    )
    add = cluster.add_argument
    add("--hosts", type=int, default=2, help="emulated hosts (default %(default)s)")
    add("--bandwidth", default=None, help="each host's link rate, e.g. 100mbit")
    add("--delay", default="0", help="one-way host-to-host latency, e.g. 1ms (default 0)")
    add("--timeout", type=float, default=None, help="seconds before all hosts are killed "
        "(default: none)")  # fmt: skip
    add("--probe", action="store_true", help="first measure and print the all-reduce bandwidth")
    add("--log-dir", default=None, help="keep every host's stdout/stderr here")
    add("--cleanup", action="store_true",
        help="only remove the namespaces that crashed clusters left (acc-*)")  # fmt: skip
    add("accordion_args", nargs=argparse.REMAINDER, help="after --: the accordion command to run")
    cluster.set_defaults(handler=_cluster_command, parser=cluster)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``accordion`` command."""
    parser = argparse.ArgumentParser(
        prog="accordion", description="Adaptive gradient compression for PyTorch DDP."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan(sub)
    _add_train_and_compare(sub)
    _add_cluster(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``accordion`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    status = args.handler(args)
    if args.command in ("train", "compare") and "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun, gloo's threads sometimes abort the process while C++ static
        # objects are destroyed at exit ("terminate called without an active exception"),
        # which torchrun reports as a failed job; the work is done, so skip that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
