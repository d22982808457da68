"""The ``accordion`` command line, one module per subcommand.

* ``plan.py``: ``accordion plan``, what each compression level would send for a model;
  ``plan_text.py`` its tables, ``break_even.py`` the break-even a compressor describes.
* ``train.py``: ``accordion train`` and ``accordion compare``, over the run settings of
  ``run_config.py`` (their shared flags, the ``TrainConfig`` those make, the checks that
  fail before a worker starts).
* ``cluster.py``: ``accordion cluster``, a command on emulated hosts.
* ``parser.py``: the parser that joins them; :func:`main` here runs it.

Importing this package loads no part of :mod:`accordion.harness`: the parser does, when
:func:`main` builds it (the ``train`` and ``compare`` flags come from the harness).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from .plan import (
    PLAN_COMPRESSOR,
    PLAN_JSON_KEYS,
    default_levels_text,
    parse_levels,
    plan_compressors,
)

__all__ = [
    "PLAN_COMPRESSOR",
    "PLAN_JSON_KEYS",
    "default_levels_text",
    "main",
    "parse_levels",
    "plan_compressors",
]

def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``accordion`` command; returns the exit status."""
    # the parser imports the harness: only once the command runs (see the module docstring)
    from .parser import build_parser

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
