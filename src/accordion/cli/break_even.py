"""The top-k break-even that ``accordion plan`` adds to a plan: the kept fraction above
which top-k's all-gathers send more bytes than a dense ring all-reduce.

The one place the command line asks which compressor it plans for (it belongs in the
compressor's own cost description, and is to move there).
"""

from __future__ import annotations

import math
from typing import Any

from ..plan import topk_break_even


def _shows_break_even(compressor: str) -> bool:
    """Whether the plan of ``compressor`` includes a break-even: top-k's only."""
    return compressor == "topk"


def _break_even(shapes, workers: int, rows) -> dict[str, Any]:
    """``topk_break_even`` of ``--json``: where top-k stops paying, and each level's bytes
    against dense's (null where dense sends nothing)."""
    dense = rows[0].bytes_per_step
    ratios = [row.bytes_per_step / dense if dense else None for row in rows[1:]]
    return {**topk_break_even(shapes, workers).as_dict(), "bytes_vs_dense": ratios}


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
