"""The human form of ``accordion plan``: the tables of one plan and of a scaling grid."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def _human(count: float) -> str:
    # Paper units: millions below ten billion, billions above; 3 decimals so that the
    # paper's one-decimal figures (which are truncated, not rounded) can be read off.
    return f"{count / 1e6:,.3f} M" if count < 1e10 else f"{count / 1e9:,.3f} B"


def _bytes(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _versus(ratio: float | None) -> str:
    # bytes over dense's: 3 significant figures, so that 0.258x and 0.00215x both read
    return "-" if ratio is None else f"{ratio:.3g}x"


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


def _print_plan(args: argparse.Namespace, summary: dict[str, Any], rows, layer_rows) -> None:
    """The human form of the plan: a header, one row per level, then the tensors."""
    print(_plan_header(args, summary))
    print(
        f"link {args.bandwidth}, latency {args.latency}: alpha-beta model, ring collectives; "
        "floats per worker in the paper's convention; vs dense: wire bytes over dense's"
    )
    header = ("level", "floats/step", "floats total", "bytes/step", "vs dense", "comm ms/step")
    table = [
        (
            row.label,
            f"{row.floats_per_step:,.0f}",
            _human(row.floats_total),
            _bytes(row.bytes_per_step),
            _versus(row.bytes_vs_dense),
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


def _print_scaling(args: argparse.Namespace, summary: dict[str, Any], cells) -> None:
    """The human form of a grid: predicted communication ms per step of each level at each
    worker count and link rate, and the bytes per worker at each worker count, as bytes
    and against dense's; a star marks a figure above dense's."""
    print(_plan_header(args, summary))
    rates = [item.strip() for item in args.bandwidth.split(",")]
    print(
        f"links {', '.join(rates)}, latency {args.latency}: alpha-beta model, ring collectives "
        "(all-reduce and two-phase 2(W-1)a + 2(W-1)/W S/B, all-gather (W-1)a + (W-1) s/B); "
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
    for title, text in (("bytes/step per worker (ring collectives)",
                         lambda row: _bytes(row.bytes_per_step)),
                        ("bytes/step per worker against dense's",
                         lambda row: _versus(row.bytes_vs_dense))):  # fmt: skip
        print(f"\n{title}")
        _print_table(
            ("level", *(f"{c.workers} workers" for c in per_workers)),
            [(label, *(_marked(c.rows[j].bytes_per_step, c.rows[0].bytes_per_step,
                               text(c.rows[j])) for c in per_workers))
             for j, label in enumerate(labels)],
        )  # fmt: skip
