"""The ``accordion`` argument parser: one subparser per subcommand, each from its module."""

from __future__ import annotations

import argparse

from .._version import __version__
from .cluster import _add_cluster
from .plan import _add_plan
from .train import _add_train_and_compare


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``accordion`` command."""
    parser = argparse.ArgumentParser(
        prog="accordion", description="Adaptive gradient compression for PyTorch DDP."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan(sub)
    _add_train_and_compare(sub)
    _add_cluster(sub)
    return parser
