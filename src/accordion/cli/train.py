"""``accordion train`` (one strategy) and ``accordion compare`` (several, with the same
seeds, and the paper's table), on local workers or under torchrun."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# modules, not their functions: run_compare and run_distributed are looked up per call
from ..harness import compare as harness_compare
from ..harness import launch
from ..harness.strategies import FORMATS, strategy_compressors
from ..harness.train import train_run
from .run_config import (
    _check_writable,
    _config_arguments,
    _make_config,
    _preflight,
    _train_defaults,
)


def _train_worker(rank, world, local_rank, config):
    """One worker of ``accordion train``: its run, as a dict the launcher can send back."""
    return train_run(config, rank, world, local_rank).as_dict()


def _train_command(args: argparse.Namespace) -> int:
    """``accordion train``: check the flags, run the workers, print rank 0's summary; 0."""
    config = _make_config(args, args.parser, strategy=args.strategy)
    config.out = args.out
    config.checkpoint_dir, config.checkpoint_every = args.checkpoint_dir, args.checkpoint_every
    # only rank 0 writes the logs
    writes = not launch.in_torchrun() or int(os.environ["RANK"]) == 0
    _preflight(args, [config], "--strategy", args.out if writes else None)
    rendezvous = None
    if args.checkpoint_dir is not None:
        _check_writable(args.parser, "--checkpoint-dir", args.checkpoint_dir, "checkpoints")
        rendezvous = os.path.join(args.checkpoint_dir, ".rendezvous")
    result = launch.run_distributed(_train_worker, args.workers, config, rendezvous=rendezvous)
    if launch.in_torchrun() and int(os.environ["RANK"]) != 0:
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
    try:
        results = harness_compare.load_results(args.from_files)
    except (OSError, TypeError, ValueError) as exc:
        args.parser.error(f"argument --from: {exc}")
    _check_baseline(args, results["config"]["strategies"], "the strategies in the files")
    print(harness_compare.format_table(results))
    if args.baseline is not None:
        harness_compare.add_paired(results, args.baseline)
        print("\n" + harness_compare.format_paired(results))
    _print_against_dense(results)
    return 0


def _print_against_dense(results: dict) -> None:
    """The table against uncompressed training, when dense ran."""
    text = harness_compare.format_dense_table(results)
    if text is not None:
        print("\n" + text)


def _compare_command(args: argparse.Namespace) -> int:
    """``accordion compare``: run every strategy and seed, print the tables, write
    results.json and the plots to ``--out``; 0."""
    if args.from_files is not None:
        return _compare_from_files(args)
    config = _make_config(args, args.parser)
    _check_baseline(args, args.strategies, "--strategies")
    if args.seeds < 1:
        args.parser.error(f"argument --seeds: must be an int >= 1, got {args.seeds}")
    runs = [dataclasses.replace(config, strategy=text) for text in args.strategies]
    _preflight(args, runs, "--strategies", args.out)
    results = harness_compare.run_compare(
        config, args.strategies, args.seeds, args.workers, args.out, baseline=args.baseline
    )
    if launch.in_torchrun() and int(os.environ["RANK"]) != 0:
        return 0
    print(harness_compare.format_table(results))
    if args.baseline is not None:
        print("\n" + harness_compare.format_paired(results))
    _print_against_dense(results)
    written = [Path(args.out) / "results.json"]
    if not args.no_plots:
        # matplotlib (an optional extra, and slow to import) only when plots are drawn
        from ..harness.plots import plot_all

        written += plot_all(results, args.out)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _add_train_and_compare(sub: Any) -> None:
    """The ``train`` and ``compare`` subcommands: the run settings, then their own flags."""
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
