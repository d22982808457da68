"""``accordion plan``: what each compression level of a compressor would send for a model,
and the predicted communication time, without training (``--json`` for one object)."""

from __future__ import annotations

import argparse
import json
import math
import re
from typing import Any

from .._validate import check_choice
from ..compress import compressing_names, compressor_class
from ..costmodel import parse_bandwidth, parse_latency
from ..defaults import DEFAULT_COMPRESSOR, default_levels, resolve
from ..models.shapes import default_num_classes, named_shapes, plan_model_names, takes_classes
from ..plan import diloco_plan, layer_plan, make_plan, scaling_plan
from .break_even import _break_even, _break_even_line, _shows_break_even
from .plan_text import _print_plan, _print_scaling


def plan_compressors() -> tuple[str, ...]:
    """The compressors ``accordion plan --compressor`` takes: every registered one but dense
    (which the plan always shows)."""
    return compressing_names()


#: The compressor ``accordion plan`` weighs by default: the library's default ladder's
#: (:func:`accordion.defaults.default_levels`, ``int/8`` then ``int/4``).
PLAN_COMPRESSOR = DEFAULT_COMPRESSOR


PLAN_JSON_KEYS = """\
--json prints one object: model, num_classes (null for the language models), parameters,
tensors, compressed_tensors, workers, steps, compressor, bandwidth_bytes_per_s, latency_s,
and "levels": a list with one entry for dense and one per level, each with
  label                 "dense", or the compressor's name of the level: "rank R", "top-k K"
  compressor, level     the compressor kind and its level (null for dense)
  floats_per_step       floats one worker sends per step, paper convention
  floats_total          floats_per_step * steps
  bytes_per_step        bytes one worker puts on the wire per step (ring collectives;
                        the integer quantisers' two phases 2(W-1)/W of their payload)
  compression_ratio     dense floats_per_step / this level's floats_per_step (the paper's)
  bytes_vs_dense        this level's bytes_per_step / dense's, what the link carries
                        (null for one worker, where dense sends nothing)
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
With --sync-every H, also "sync_every": H and "diloco_levels": dense and each level for
DiLoCo syncing every H inner steps, the keys of "levels" per inner step (one sync's
figures / H; compression_ratio and bytes_vs_dense against dense every step).
"""


def parse_levels(text: str, compressor: str) -> list[Any]:
    """Parse ``--levels``: comma-separated levels as ``compressor`` reads them ("2,1" ranks
    for PowerSGD, "0.99,0.1" fractions for top-k); ``ValueError`` for anything else."""
    check_choice("compressor", compressor, plan_compressors())
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
    parser = args.parser
    if args.model not in plan_model_names():
        parser.error(
            f"argument --model: must be one of {', '.join(plan_model_names())}, got {args.model!r}"
        )
    if args.compressor is None:  # the library's rule (AccordionState's): one place
        given = None if args.levels is None else [item.strip() for item in args.levels.split(",")]
        args.compressor, chosen = resolve(None, None, None, given)
        args.levels = ",".join(chosen) if args.levels is None else args.levels
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
    if args.sync_every is not None and (args.sync_every < 1 or len(workers) * len(bandwidths) > 1):
        parser.error(f"argument --sync-every: must be an int >= 1, with one --workers and one "
                     f"--bandwidth value; got {args.sync_every} with --workers {args.workers!r} "
                     f"and --bandwidth {args.bandwidth!r}")  # fmt: skip
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
    """``accordion plan``: print the plan of the flags, as tables or ``--json``; 0."""
    levels, workers, bandwidths, latency = _plan_inputs(args)
    named = named_shapes(args.model, args.num_classes)
    shapes = [shape for _, shape in named]
    summary = _plan_summary(args, shapes, workers, bandwidths, latency)
    topk = _shows_break_even(args.compressor)
    if len(workers) * len(bandwidths) > 1:
        cells = scaling_plan(shapes, args.compressor, levels, workers, bandwidths, args.steps,
                             latency)  # fmt: skip
        if args.json:
            grid = [_grid_entry(cell, shapes, topk) for cell in cells]
            print(json.dumps({**summary, "grid": grid}))
        else:
            _print_scaling(args, summary, cells)
            if topk:
                print()
                for c in cells[:: len(bandwidths)]:  # the bytes do not depend on the link rate
                    print(_break_even_line(_break_even(shapes, c.workers, c.rows), c.rows))
        return 0
    rows = make_plan(shapes, args.compressor, levels, workers[0], args.steps, bandwidths[0],
                     latency)  # fmt: skip
    layer_rows = []
    if args.layers:
        layer_rows = layer_plan(named, args.compressor, levels, workers[0], bandwidths[0])
    diloco = [] if args.sync_every is None else diloco_plan(rows, args.sync_every)
    if args.json:
        extra: dict[str, Any] = {}
        if topk:
            extra["topk_break_even"] = _break_even(shapes, workers[0], rows)
        layers = {"layers": [r.as_dict() for r in layer_rows]} if args.layers else {}
        if diloco:
            extra.update(sync_every=args.sync_every, diloco_levels=[r.as_dict() for r in diloco])
        levels_out = [row.as_dict() for row in rows]
        print(json.dumps({**summary, "levels": levels_out, **extra, **layers}))
    else:
        _print_plan(args, summary, [*rows, *diloco], layer_rows)
        if topk:
            print(_break_even_line(_break_even(shapes, workers[0], rows), rows))
    return 0


def _add_plan(sub: Any) -> None:
    """The ``plan`` subcommand; the compressors and their default levels from the registry."""
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
    add("--num-classes", type=int, default=None,
        help="classes (default the model's: 1000 for resnet50, else 10; the language models "
        "lstm and transformer-1b ignore it)")  # fmt: skip
    add("--workers", default="4",
        help="data-parallel workers, or a comma-separated list such as 8,64,512 for a "
        "scaling grid (default %(default)s)")  # fmt: skip
    add("--steps", type=int, default=29400, help="optimizer steps (default %(default)s)")
    names = plan_compressors()
    ladder = ",".join(default_levels())
    add(
        "--compressor",
        default=None,
        help=f"{', '.join(names)} (default {PLAN_COMPRESSOR}, the library's default ladder "
        f"'{ladder}'; with --levels that name no compressor, such as '2,1', powersgd)",
    )
    defaults = ", ".join(f"{name} '{default_levels_text(name)}'" for name in names)
    add(
        "--levels",
        default=None,
        help="comma-separated levels, mildest first, as the compressor reads them (PowerSGD "
        f"ranks, top-k fractions, ...); default without --compressor '{ladder}', else the "
        f"compressor's own: {defaults}",
    )
    add(
        "--bandwidth",
        default="10Gbit",
        help="link rate, or a comma-separated list such as 10Gbit,25Gbit,100Gbit for a scaling "
        "grid (default %(default)s)",
    )
    add("--latency", default="50us", help="per-message latency (default %(default)s)")
    add(
        "--sync-every",
        type=int,
        default=None,
        metavar="H",
        help="also DiLoCo's rows, syncing every H inner steps: figures per inner step "
        "(--steps counts inner steps)",
    )
    add("--json", action="store_true", help="print one JSON object (keys below)")
    add("--layers", action="store_true", help="also per tensor: bytes and transfer time per step")
    plan.set_defaults(handler=_plan_command, parser=plan)
