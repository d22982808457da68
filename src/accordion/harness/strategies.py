"""Strategy strings of the harness: what averages the gradients in a run.

``dense``                           plain DDP all-reduce (the baseline)
``static:powersgd:R``               our hook, PowerSGD at rank R throughout
``static:topk:K``                   our hook, top-k keeping the fraction K throughout
``accordion:powersgd:MILD,AGG``     our hook, Accordion switching ranks MILD and AGG
``accordion:topk:MILD,AGG``         our hook, Accordion switching fractions MILD and AGG
``torch-powersgd:R``                PyTorch's own ``powerSGD_hook`` at rank R (outside baseline)

A ``:auto`` suffix on a static or Accordion strategy (``accordion:powersgd:4,1:auto``)
turns the cost model on: before training the hook measures the link and the cost of
compressing each tensor, and sends dense those for which compression does not pay.

Batch-size strategies (Accordion's second lever), dense communication by default:

``static-batch:B``                  global batch B throughout
``batch:SMALL,LARGE``               Accordion's rule picks SMALL or LARGE each interval
``batch-fixed:SMALL,LARGE``         SMALL for the first epochs, then LARGE (what the paper ran)

A batch strategy combines with a compression strategy through ``+``, e.g.
``batch:64,512+accordion:powersgd:4,1``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..accounting import check_fraction, check_rank

FORMATS = (
    "dense",
    "static:powersgd:R",
    "static:topk:K",
    "accordion:powersgd:MILD,AGGRESSIVE",
    "accordion:topk:MILD,AGGRESSIVE",
    "<static or accordion strategy>:auto",
    "torch-powersgd:R",
    "static-batch:B",
    "batch:SMALL,LARGE",
    "batch-fixed:SMALL,LARGE",
    "<batch strategy>+<compression strategy>",
)
BATCH_MODES = {"static-batch": "static", "batch": "adaptive", "batch-fixed": "fixed"}


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy string.

    ``family`` is "dense", "static", "accordion" or "torch-powersgd"; ``compressor`` is
    "dense", "powersgd" or "topk"; ``mild``/``aggressive`` are the levels (equal for
    static strategies, ``None`` for dense).
    """

    text: str
    family: str
    compressor: str
    mild: Any = None
    aggressive: Any = None
    batch_mode: str | None = None  # None, "static", "adaptive" or "fixed"
    batch_small: int | None = None  # global batch sizes
    batch_large: int | None = None
    auto: bool = False  # the cost model sends dense what compression cannot pay for

    @property
    def uses_accordion_hook(self) -> bool:
        """Whether the run registers our hook (static and Accordion strategies)."""
        return self.family in ("static", "accordion")


def _level(compressor: str, text: str, whole: str) -> Any:
    try:
        if compressor == "powersgd":
            return check_rank(int(text))
        return check_fraction(float(text))
    except (TypeError, ValueError) as exc:
        allowed = "an integer rank >= 1" if compressor == "powersgd" else "a fraction in (0, 1]"
        raise ValueError(f"strategy {whole!r}: level {text!r} must be {allowed} ({exc})") from None


def _batch_size(text: str, whole: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"strategy {whole!r}: batch size {text!r} must be an integer >= 1")
    return value


def _parse_batch(text: str, whole: str) -> tuple[str, int, int] | None:
    kind, _, sizes = text.partition(":")
    if kind not in BATCH_MODES:
        return None
    mode = BATCH_MODES[kind]
    items = sizes.split(",")
    if mode == "static":
        if len(items) != 1:
            raise ValueError(f"strategy {whole!r}: static-batch takes one size, static-batch:B")
        size = _batch_size(items[0], whole)
        return mode, size, size
    if len(items) != 2:
        raise ValueError(f"strategy {whole!r}: {kind} takes two sizes, {kind}:SMALL,LARGE")
    small, large = (_batch_size(item, whole) for item in items)
    if small >= large:
        raise ValueError(f"strategy {whole!r}: SMALL ({small}) must be < LARGE ({large})")
    return mode, small, large


def parse_strategy(text: str) -> Strategy:
    """Parse a strategy string; raises ``ValueError`` listing the formats if malformed."""
    if not isinstance(text, str):
        raise TypeError(f"strategy must be a str, got {type(text).__name__}")
    first, plus, rest = text.strip().partition("+")
    batch = _parse_batch(first, text)
    if batch is not None:
        comm = _parse_communication(rest, text) if plus else Strategy(text, "dense", "dense")
        mode, small, large = batch
        return dataclasses.replace(
            comm, text=text, batch_mode=mode, batch_small=small, batch_large=large
        )
    if plus:
        raise ValueError(
            f"strategy {text!r}: only a batch strategy combines with '+', "
            "e.g. batch:64,512+accordion:powersgd:4,1"
        )
    return _parse_communication(text, text)


def _parse_communication(text: str, whole: str) -> Strategy:
    parts = text.strip().split(":")
    bad = ValueError(f"strategy must have one of the forms {', '.join(FORMATS)}; got {whole!r}")
    if parts == ["dense"]:
        return Strategy(text, "dense", "dense")
    if len(parts) == 2 and parts[0] == "torch-powersgd":
        rank = _level("powersgd", parts[1], text)
        return Strategy(text, "torch-powersgd", "powersgd", rank, rank)
    auto = len(parts) == 4 and parts[3] == "auto"
    if auto:
        parts = parts[:3]
    if len(parts) != 3 or parts[0] not in ("static", "accordion"):
        raise bad
    family, compressor, levels = parts
    if compressor not in ("powersgd", "topk"):
        raise ValueError(
            f"strategy {text!r}: compressor must be 'powersgd' or 'topk', got {compressor!r}"
        )
    if family == "static":
        if "," in levels:
            raise bad
        level = _level(compressor, levels, text)
        return Strategy(text, "static", compressor, level, level, auto=auto)
    items = levels.split(",")
    if len(items) != 2:
        raise bad
    mild, aggressive = (_level(compressor, item, text) for item in items)
    if aggressive > mild:
        raise ValueError(
            f"strategy {text!r}: the aggressive level ({aggressive}) must compress at least as "
            f"much as the mild one ({mild}): MILD,AGGRESSIVE with AGGRESSIVE <= MILD"
        )
    return Strategy(text, "accordion", compressor, mild, aggressive, auto=auto)
