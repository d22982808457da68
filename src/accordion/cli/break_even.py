"""The break-even that ``accordion plan`` adds to a plan where the compressor's cost
description has one (:meth:`accordion.compress.Compressor.break_even`; top-k's: the kept
fraction above which its all-gathers send more bytes than a dense ring all-reduce).

The compressor describes its break-even and writes it for people; this module only
asks it, so that the command line branches on no compressor's name.
"""

from __future__ import annotations

from typing import Any

from ..compress import compressor_class
from ..plan import break_even


def _shows_break_even(compressor: str) -> bool:
    """Whether the plan of ``compressor`` includes a break-even: whether its cost
    description has one (a compressor that has one describes it for every model, an
    empty one included)."""
    return break_even((), compressor, 1) is not None


def _break_even(shapes, workers: int, rows) -> dict[str, Any]:
    """The break-even of ``--json``: where the levels' compressor (``rows[1:]``) stops
    paying, and each level's bytes against dense's (null where dense sends nothing)."""
    described = break_even(shapes, rows[-1].compressor, workers)
    if described is None:  # callers ask only where _shows_break_even
        raise ValueError(f"compressor {rows[-1].compressor!r} describes no break-even")
    dense = rows[0].bytes_per_step
    ratios = [row.bytes_per_step / dense if dense else None for row in rows[1:]]
    return {**described.as_dict(), "bytes_vs_dense": ratios}


def _break_even_line(entry: dict[str, Any], rows) -> str:
    """The plain form of a break-even ``entry`` (of :func:`_break_even`), as the levels'
    compressor writes it."""
    cls = compressor_class(rows[-1].compressor)
    return cls.break_even_text(entry, [row.label for row in rows[1:]])
