"""Strategy strings of the harness: what averages the gradients in a run.

``dense``                             plain DDP all-reduce (the baseline)
``static:COMPRESSOR:LEVEL``           our hook, the compressor at one level throughout
``accordion:COMPRESSOR:MILD,...,AGG`` our hook, Accordion switching along a ladder of
                                      levels, from the mildest to the most aggressive
``torch-powersgd:R``                  PyTorch's own ``powerSGD_hook`` at rank R (outside
                                      baseline)
``torch-fp16``, ``torch-bf16``        PyTorch's own ``fp16_compress_hook`` /
                                      ``bf16_compress_hook`` (what users try first)

``COMPRESSOR`` is any registered compressor but ``dense`` (see
:func:`accordion.compress.compressor_names`), and a level is written as that compressor
reads it (:meth:`~accordion.compress.Compressor.parse_level`): a PowerSGD rank
(``static:powersgd:4``), a top-k fraction (``static:topk:0.1``), ... An Accordion ladder
has two or more levels, each compressing at least as much as the one before
(``accordion:powersgd:4,1``, ``accordion:powersgd:4,2,1``).

An ``:adam-noise`` suffix on a static or Accordion strategy (``static:nq:2:adam-noise``,
``--optimizer adamw``) corrects AdamW's second moment for the compression noise of the
averages (:class:`accordion.AdamNoiseCorrection`). A ``:momentum=P/LEVEL`` suffix on a
static strategy (``static:nq:2:adam-noise:momentum=22/1``) exchanges AdamW's momentum at
``LEVEL`` instead of the gradient from P% of the run's steps on, its second moment frozen
(:class:`accordion.MomentumExchange`); ``momentum=P/LEVEL/ETA`` lets Accordion's norm test
(threshold ETA, over the run's check interval) freeze sooner.

A ``:auto`` suffix on a static or Accordion strategy (``accordion:powersgd:4,1:auto``)
turns the cost model on: before training the hook measures the link and the cost of
compressing each tensor, and sends dense those for which compression does not pay.

On a static or Accordion strategy whose compressor is an integer quantiser (``int``,
``nq``, or a ``mixed`` ladder with such rungs: :func:`two_phase_compressors`),
``collective=all_gather|two_phase|auto`` picks how their payloads travel (the state's
``collective``; default ``auto``, whichever sends fewer bytes), e.g.
``static:int:8:collective=all_gather``, ``accordion:mixed:int/8,int/4:collective=two_phase``;
``server-error=off`` makes the two-phase owners drop their server error each step
(``IntQuantizer.server_feedback = False``, an ablation), e.g.
``static:int:4:collective=two_phase:server-error=off``.

An Accordion strategy may also name its rule and its check interval (epochs, or steps
with ``--interval-unit step``), in any
order after the levels: ``accordion:powersgd:4,2,1:guarded:every=2`` (rules:
:data:`accordion.policy.RULES`; without a name the library's default rule, without
``every=N`` the run's ``--interval``), and for the guarded rule how many checks a
relapse blocks a rung (``block=N``, or ``block=decay`` for until the next decay:
:class:`~accordion.policy.GuardedRule`'s ``block``) and whether its last rung is open
before the first decay (``open``: ``wait_for_decay=False``), for the audit rule its error
budget (``tau=0.3``: :class:`~accordion.policy.AuditRule`), e.g.
``accordion:mixed:half/bf16,int/8,int/4,powersgd/4:audit:tau=0.3``, and for L-GreCo's
allocation the rung whose uniform error is the budget (``ref=N``:
:class:`~accordion.policy.AllocationRule`; ``lgreco-regime`` spends a budget the norm
test sets, :class:`~accordion.policy.RegimeAllocationRule`), e.g.
``accordion:mixed:nq/4,nq/3,nq/2,nq/1:lgreco:ref=2``.

Batch-size strategies (Accordion's second lever), dense communication by default:

``static-batch:B``                  global batch B throughout
``batch:SMALL,LARGE``               Accordion's rule picks SMALL or LARGE each interval
``batch-fixed:SMALL,LARGE``         SMALL for the first epochs, then LARGE (what the paper ran)

A batch strategy combines with a compression strategy through ``+``, e.g.
``batch:64,512+accordion:powersgd:4,1``.

Rare syncs (:class:`accordion.DiLoCo`): ``diloco:H`` takes H inner steps on each worker
without communication, then averages the pseudo-gradient dense for an outer Nesterov
step; ``diloco:H+<static or accordion strategy>`` compresses that average, e.g.
``diloco:25+static:int:4`` (each round is one step of the state: ``every=N`` counts rounds).
``lr=X`` and ``momentum=M`` after H set the outer Nesterov SGD's learning rate and
momentum (default DiLoCo's 0.7 and 0.9), e.g. ``diloco:10:lr=1.0:momentum=0.8+static:int:4``;
``warmup=N`` trains the first N steps data-parallel (gradients averaged every step, dense,
or compressed by ``warmup-with=NAME/LEVEL``, e.g. ``int/4`` or ``powersgd/4``) before the
first round; ``warmup-eta=X`` lets the paper's norm test end it sooner, at the first
window (the run's ``interval`` steps; 25 when it counts epochs) whose gradient norm
changed by less than X. ``warmup-every=K`` makes the warm-up rounds of K steps instead of
data-parallel steps, compressed as the rounds after it and landing as the replicas' plain
average (the norm test then reads each worker's own gradients), e.g.
``diloco:15:lr=0.5:warmup=180:warmup-eta=0.5:warmup-every=4+static:int:2``.
``fragments=F`` streams the sync (:class:`accordion.StreamingDiLoCo`):
F fragments of the model in turn, one every H / F steps (H a multiple of F); ``delay=T``
overlaps each with the next T inner steps (T < H / F), and ``mix=A`` keeps A of the
worker's own parameters when it lands, e.g. ``diloco:10:fragments=2:delay=1+static:int:2``.
``ef-decay=B`` decays the syncs' error-feedback memory by B before each (SparseLoCo's),
e.g. ``diloco:10:lr=1:momentum=0:ef-decay=0.95+static:sparseloco:0.03``; ``adam-noise``
corrects the inner AdamW for the compressed warm-up's noise
(``diloco:10:warmup=180:warmup-with=nq/2:adam-noise+static:nq:1``). ``grow=P`` makes a
round that starts at inner rate lr H (peak lr / lr) ** P steps long, within ``min=N`` and
``max=N`` (:class:`accordion.diloco_schedule.SyncSchedule`): longer as the rate decays with
P > 0, e.g. ``diloco:12:grow=2:max=60+static:int:2``, shorter with P < 0, e.g.
``diloco:50:grow=-1:min=20+static:int:2``. ``final=1`` adds one last sync after the last
inner step (:meth:`accordion.DiLoCo.finish`), so the scored model holds every worker's
steps; without it (``final=0``, the default) the model scored is the last round's end.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..compress import COLLECTIVES, Compressor, compressing_names, compressor_class
from ..compress.mixed import Mixed, split_level
from ..diloco_streaming import fragment_gap
from ..policy import RULES, Ladder
from ..policy.audit import check_tau

FORMATS = (
    "dense",
    "static:COMPRESSOR:LEVEL",
    "accordion:COMPRESSOR:MILD,...,AGGRESSIVE",
    "<static or accordion strategy>:auto",
    "<static or accordion strategy>:adam-noise",
    "<static or accordion strategy>:collective=auto|all_gather|two_phase",
    "<static or accordion strategy>:server-error=off",
    "static:COMPRESSOR:LEVEL[:adam-noise]:momentum=P/LEVEL[/ETA]",
    "accordion:COMPRESSOR:LEVELS[:RULE][:every=N][:block=N|decay][:open]",
    "torch-powersgd:R",
    "torch-fp16",
    "torch-bf16",
    "static-batch:B",
    "batch:SMALL,LARGE",
    "batch-fixed:SMALL,LARGE",
    "<batch strategy>+<compression strategy>",
    "diloco:H[:lr=X][:momentum=M][:warmup=N][:warmup-with=NAME/LEVEL][:warmup-eta=X]"
    "[:warmup-every=K][:fragments=F][:delay=T][:mix=A][:ef-decay=B][:grow=P][:min=N]"
    "[:max=N][:final=1][:adam-noise]",
    "diloco:H[:OPTIONS]+<static or accordion strategy>",
)
BATCH_MODES = {"static-batch": "static", "batch": "adaptive", "batch-fixed": "fixed"}
#: The compressor of PyTorch's own hook, the ``torch-powersgd:R`` baseline.
TORCH_POWERSGD = "powersgd"
#: PyTorch's cast-to-half hooks, by strategy name: the level of our ``half`` compressor
#: that sends the same bytes (the ``torch-half`` family).
TORCH_HALF = {"torch-fp16": "fp16", "torch-bf16": "bf16"}


def strategy_compressors() -> tuple[str, ...]:
    """The compressors a static or Accordion strategy may name: every registered one but
    ``dense`` (which is its own strategy)."""
    return compressing_names()


def two_phase_compressors() -> tuple[str, ...]:
    """The compressors with a two-phase exchange (a ``server_feedback`` switch), which
    ``collective=`` and ``server-error=`` apply to."""
    return tuple(n for n in compressing_names() if hasattr(compressor_class(n), "server_feedback"))


def two_phase_parts(compressor: str, levels: tuple[Any, ...]) -> tuple[str, ...]:
    """The names of the compressors with a two-phase exchange that ``compressor`` at
    ``levels`` sends with: itself, or a mixed ladder's parts (mildest first)."""
    if compressor != Mixed.name:
        return (compressor,) if compressor in two_phase_compressors() else ()
    names = (split_level(level)[0].name for level in levels)
    return tuple(dict.fromkeys(n for n in names if n in two_phase_compressors()))


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy string.

    ``family`` is "dense", "static", "accordion", "torch-powersgd" or "torch-half"
    (PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook``); ``compressor`` is
    "dense" or a registered compressor's name; ``levels`` is the ladder, mildest first
    (one level for static strategies and PyTorch's hook, none for dense). ``mild`` and
    ``aggressive`` are its first and last levels (``None`` for dense).
    """

    text: str
    family: str
    compressor: str
    levels: tuple[Any, ...] = ()
    batch_mode: str | None = None  # None, "static", "adaptive" or "fixed"
    batch_small: int | None = None  # global batch sizes
    batch_large: int | None = None
    auto: bool = False  # the cost model sends dense what compression cannot pay for
    rule: str | None = None  # Accordion's rule by name (None: the library's default)
    interval: int | None = None  # Accordion's check interval, epochs (None: the run's)
    block: int | str | None = None  # the guarded rule's block: checks, "decay" or None (default)
    open_ladder: bool = False  # the guarded rule: last rung open from the start, no decay wait
    tau: float | None = None  # the audit rule's error budget (None: its default)
    reference: int | None = None  # the allocation rule's budget rung (None: its default, 0)
    sync_every: int | None = None  # DiLoCo's H, inner steps per sync (None: every step, DDP)
    outer_lr: float | None = None  # DiLoCo's outer learning rate (None: its default, 0.7)
    outer_momentum: float | None = None  # its Nesterov momentum (None: the default, 0.9)
    warmup_steps: int = 0  # DiLoCo's data-parallel steps before the first round
    warmup_with: str | None = None  # their compressor, a mixed rung "int/4" (None: dense)
    warmup_eta: float | None = None  # the norm test that may end it sooner (None: fixed)
    warmup_sync_every: int = 1  # the warm-up's steps per sync (1: data-parallel; K: rounds)
    fragments: int = 1  # Streaming DiLoCo's fragments, synced in turn (1: all at once)
    delay: int = 0  # inner steps each fragment's average overlaps
    mix: float = 0.0  # the worker's own share of a fragment's parameters when it lands
    error_decay: float = 1.0  # the factor on the syncs' error-feedback memory (1: plain)
    adam_noise: bool = False  # AdamW's second moment corrected for compression noise
    momentum_freeze: int | None = None  # AdamW's momentum exchanged from P% of the run on
    momentum_level: Any = None  # the compressor's level for the momenta then
    momentum_eta: float | None = None  # the norm test that may freeze sooner (None: at P%)
    sync_growth: float = 0.0  # DiLoCo's rounds scale by (peak lr / lr) ** this (0: fixed H)
    min_sync_every: int | None = None  # the shortest round then (None: the schedule's default)
    max_sync_every: int | None = None  # the longest (None: the schedule's default)
    final_sync: bool = False  # DiLoCo: one last sync after training (DiLoCo.finish)
    collective: str = "auto"  # how integer quantisers' payloads travel (the state's collective)
    server_feedback: bool = True  # False: two-phase owners drop their server error (ablation)

    @property
    def streams(self) -> bool:
        """Whether the DiLoCo sync is streamed (:class:`accordion.StreamingDiLoCo`)."""
        return self.fragments > 1 or self.delay > 0 or self.mix > 0

    @property
    def mild(self) -> Any:
        """The mildest level (the first rung), ``None`` for dense."""
        return self.levels[0] if self.levels else None

    @property
    def aggressive(self) -> Any:
        """The most aggressive level (the last rung), ``None`` for dense."""
        return self.levels[-1] if self.levels else None

    @property
    def uses_accordion_hook(self) -> bool:
        """Whether the run registers our hook (static and Accordion strategies, not DiLoCo)."""
        return self.family in ("static", "accordion") and self.sync_every is None

    def batch_sizes(self) -> tuple[int, int]:
        """``(SMALL, LARGE)``, the global batch sizes of a batch-size strategy (one with a
        ``batch_mode``); ``ValueError`` for a strategy without them."""
        if self.batch_small is None or self.batch_large is None:
            raise ValueError(f"strategy {self.text!r} has no batch sizes")
        return self.batch_small, self.batch_large


def _level(cls: type[Compressor], text: str, whole: str) -> Any:
    try:
        return cls.parse_level(text)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"strategy {whole!r}: level {text!r} must be {cls.level_help} ({exc})"
        ) from None


def _ladder(cls: type[Compressor], items: list[str], whole: str) -> tuple[Any, ...]:
    """The levels of ``items``, checked to run from the mildest to the most aggressive
    (equal rungs allowed) by the library's own :class:`~accordion.policy.Ladder`."""
    levels = tuple(_level(cls, item, whole) for item in items)
    try:
        return Ladder(cls, levels).levels
    except ValueError as exc:
        raise ValueError(
            f"strategy {whole!r}: the levels {','.join(items)} (MILD,...,AGGRESSIVE, each "
            f"{cls.level_help}): {exc}"
        ) from None


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
    if first.startswith("diloco:"):
        return _parse_diloco(first, rest if plus else "dense", text)
    batch = _parse_batch(first, text)
    if batch is not None:
        comm = _parse_communication(rest, text) if plus else Strategy(text, "dense", "dense")
        if comm.momentum_freeze is not None:  # the momenta would be exchanged per micro-batch
            raise ValueError(f"strategy {text!r}: momentum=P/LEVEL does not combine with a "
                             "batch strategy")  # fmt: skip
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


def _parse_diloco(first: str, rest: str, whole: str) -> Strategy:
    """``diloco:H[:OPTIONS]`` and ``diloco:H[:OPTIONS]+<dense, static or accordion
    strategy>``, the options those of :data:`_DILOCO_OPTIONS`."""
    _, h, *options = first.split(":")
    if not (h.isdigit() and int(h) >= 1):
        raise ValueError(f"strategy {whole!r}: diloco:H takes H, the inner steps per sync, "
                         f"an int >= 1; got {h!r}")  # fmt: skip
    found = _diloco_options(options, whole)
    comm = _parse_communication(rest, whole)
    if (comm.family not in ("dense", "static", "accordion") or comm.auto or comm.adam_noise
            or comm.momentum_freeze is not None):  # fmt: skip
        raise ValueError(f"strategy {whole!r}: diloco:H combines with dense, a static or an "
                         "accordion strategy (without :auto, :adam-noise or "
                         ":momentum)")  # fmt: skip
    _check_streaming(int(h), found.get("fragments", 1), found.get("delay", 0), whole)
    _check_growth(int(h), found, whole)
    return dataclasses.replace(comm, text=whole, sync_every=int(h), **found)


def _check_streaming(h: int, fragments: int, delay: int, whole: str) -> None:
    """One fragment lands every H / F steps, and lands before the next one starts
    (:func:`accordion.diloco_streaming.fragment_gap`, checked before any worker starts)."""
    try:
        fragment_gap(h, fragments, delay)
    except ValueError as exc:
        raise ValueError(f"strategy {whole!r} (H={h}, fragments={fragments}, delay={delay}): "
                         f"{exc}") from None


def _check_growth(h: int, found: dict[str, Any], whole: str) -> None:
    """``min=``/``max=`` need ``grow=`` and bound H (``min <= H <= max``); streamed rounds
    do not change length."""
    grow = found.get("sync_growth", 0.0)
    low, top = found.get("min_sync_every"), found.get("max_sync_every")
    if (low is not None or top is not None) and not grow:
        raise ValueError(f"strategy {whole!r}: min=N and max=N bound the rounds of grow=P "
                         "(P other than 0)")  # fmt: skip
    if (low is not None and low > h) or (top is not None and top < h):
        raise ValueError(f"strategy {whole!r}: the rounds' bounds must hold H = {h}: "
                         f"min={low} <= H <= max={top}")  # fmt: skip
    short_warmup = found.get("warmup_sync_every", 1) > 1
    for option, changes in (("grow=", grow), ("warmup-every=", short_warmup)):
        if changes and any(k in found for k in ("fragments", "delay", "mix")):
            raise ValueError(f"strategy {whole!r}: {option} changes whole rounds; streamed "
                             "fragments (fragments=, delay=, mix=) land at a fixed "
                             "gap")  # fmt: skip


#: DiLoCo's options after H: name -> (Strategy field, parse, what is allowed).
_DILOCO_OPTIONS = {
    "lr": ("outer_lr", float, "the outer learning rate, > 0"),
    "momentum": ("outer_momentum", float, "its Nesterov momentum, in [0, 1)"),
    "warmup": ("warmup_steps", int, "data-parallel steps before the rounds, an int >= 0"),
    "warmup-with": ("warmup_with", str, "the warm-up's compressor and level, NAME/LEVEL "
                    "as a mixed ladder's rung reads it: int/4, powersgd/4, half/bf16"),
    "warmup-eta": ("warmup_eta", float, "the norm test's threshold that may end the warm-up "
                   "sooner, > 0"),
    "warmup-every": ("warmup_sync_every", int, "the warm-up's inner steps per sync, an int "
                     ">= 1 (1: every step's gradients; K: rounds of K, compressed as the "
                     "rounds after it)"),
    "fragments": ("fragments", int, "fragments synced in turn, an int >= 1 dividing H"),
    "delay": ("delay", int, "inner steps each fragment's average overlaps, an int in "
              "[0, H / fragments)"),
    "mix": ("mix", float, "the worker's own share when a fragment lands, in [0, 1]"),
    "ef-decay": ("error_decay", float, "the factor on the error-feedback memory before each "
                 "sync, in [0, 1] (SparseLoCo's decayed error feedback)"),
    "grow": ("sync_growth", float, "the power of peak lr / lr that scales a round's length, "
             "finite (> 0 longer as the rate decays, < 0 shorter)"),
    "min": ("min_sync_every", int, "the shortest round with grow=, an int in [1, H]"),
    "max": ("max_sync_every", int, "the longest round with grow=, an int >= H"),
    "final": ("final_sync", int, "1: one last sync after the last inner step, so the "
              "scored model holds every step; 0: none, the last round's end (default)"),
}


def _diloco_value(key: str, text: str) -> float | int | str | None:
    """The value of ``key=text``, or ``None`` if it is not one that key allows."""
    try:
        if key == "warmup-with":  # canonical NAME/LEVEL, or dense
            return Mixed.parse_level(text)
        value = _DILOCO_OPTIONS[key][1](text)
    except (TypeError, ValueError):
        return None
    positive = lambda v: math.isfinite(v) and v > 0  # noqa: E731 - one of the table's checks
    ok = {"lr": positive, "momentum": lambda v: 0 <= v < 1, "warmup": lambda v: v >= 0,
          "warmup-eta": positive, "warmup-every": lambda v: v >= 1,
          "fragments": lambda v: v >= 1, "delay": lambda v: v >= 0,
          "mix": lambda v: 0 <= v <= 1, "ef-decay": lambda v: 0 <= v <= 1,
          "grow": math.isfinite, "min": lambda v: v >= 1, "max": lambda v: v >= 1,
          "final": lambda v: v in (0, 1)}[key]  # fmt: skip
    return value if ok(value) else None


def _diloco_options(options: list[str], whole: str) -> dict[str, Any]:
    """The ``key=value`` options of ``diloco:H`` (:data:`_DILOCO_OPTIONS`), each once."""
    found: dict[str, Any] = {}
    for option in options:
        if option == "adam-noise" and "adam_noise" not in found:  # the warm-up's AdamW
            found["adam_noise"] = True
            continue
        key, eq, text = option.partition("=")
        value = _diloco_value(key, text) if eq and key in _DILOCO_OPTIONS else None
        if value is None or _DILOCO_OPTIONS[key][0] in found:
            allowed = "; ".join(f"{k}=... ({v[2]})" for k, v in _DILOCO_OPTIONS.items())
            raise ValueError(f"strategy {whole!r}: diloco:H takes the options {allowed}; "
                             f"adam-noise; each once; got {option!r}")  # fmt: skip
        found[_DILOCO_OPTIONS[key][0]] = value
    if "final_sync" in found:
        found["final_sync"] = bool(found["final_sync"])
    for name, option in (("warmup_with", "warmup-with"), ("warmup_eta", "warmup-eta"),
                         ("warmup_sync_every", "warmup-every")):  # fmt: skip
        if name in found and not found.get("warmup_steps"):
            raise ValueError(f"strategy {whole!r}: {option} needs warmup=N with N >= 1")
    if found.get("warmup_sync_every", 1) > 1 and "warmup_with" in found:
        raise ValueError(f"strategy {whole!r}: warmup-every=K > 1 makes the warm-up rounds, "
                         "compressed as the rounds after it: it takes no warmup-with")  # fmt: skip
    if "adam_noise" in found and "warmup_with" not in found:
        raise ValueError(f"strategy {whole!r}: adam-noise corrects the warm-up's AdamW for "
                         "its compression: it needs warmup-with=NAME/LEVEL")  # fmt: skip
    return found


def _malformed(whole: str) -> ValueError:
    return ValueError(
        f"strategy must have one of the forms {', '.join(FORMATS)}, with COMPRESSOR one of "
        f"{', '.join(strategy_compressors())}; got {whole!r}"
    )


def _parse_communication(text: str, whole: str) -> Strategy:
    parts = text.strip().split(":")
    if parts == ["dense"]:
        return Strategy(text, "dense", "dense")
    if len(parts) == 1 and parts[0] in TORCH_HALF:
        return Strategy(text, "torch-half", "half", (TORCH_HALF[parts[0]],))
    if len(parts) == 2 and parts[0] == "torch-powersgd":
        rank = _level(compressor_class(TORCH_POWERSGD), parts[1], text)
        return Strategy(text, "torch-powersgd", TORCH_POWERSGD, (rank,))
    options = _options(parts[3:], text)
    parts = parts[:3]
    if len(parts) != 3 or parts[0] not in ("static", "accordion"):
        raise _malformed(whole)
    family, compressor, levels = parts
    if compressor not in strategy_compressors():
        raise ValueError(
            f"strategy {text!r}: compressor must be one of {', '.join(strategy_compressors())}"
            f", got {compressor!r}"
        )
    cls = compressor_class(compressor)
    items = levels.split(",")
    if family == "static":
        if len(items) != 1:
            raise _malformed(whole)
        if set(options) - {"auto", "adam_noise", "momentum_freeze", "collective",
                           "server_feedback"}:  # fmt: skip
            raise ValueError(
                f"strategy {text!r}: a rule, interval, block or open needs an accordion strategy"
            )
        if "momentum_freeze" in options:
            freeze, level, eta = options["momentum_freeze"]
            options.update(momentum_freeze=freeze, momentum_level=_level(cls, level, text),
                           momentum_eta=eta)  # fmt: skip
        level = _level(cls, items[0], text)
        _check_two_phase(compressor, (level,), options, text)
        return Strategy(text, "static", compressor, (level,), **options)
    if "momentum_freeze" in options:
        raise ValueError(f"strategy {text!r}: momentum=P/LEVEL needs a static strategy")
    if len(items) < 2:
        raise _malformed(whole)
    for key, suffix in (("block", "block=N"), ("open_ladder", "open")):
        if key in options and options.get("rule", "guarded") != "guarded":
            raise ValueError(f"strategy {text!r}: {suffix} is an option of the guarded rule")
    if "tau" in options and options.get("rule") != "audit":
        raise ValueError(f"strategy {text!r}: tau=X is an option of the audit rule")
    if "reference" in options and options.get("rule") not in ("lgreco", "lgreco-regime"):
        raise ValueError(f"strategy {text!r}: ref=N is an option of the lgreco rules")
    if options.get("reference", 0) >= len(items):
        raise ValueError(f"strategy {text!r}: ref={options['reference']} must be a rung of "
                         f"the ladder, 0 to {len(items) - 1}")  # fmt: skip
    ladder = _ladder(cls, items, text)
    _check_two_phase(compressor, ladder, options, text)
    return Strategy(text, "accordion", compressor, ladder, **options)


def _check_two_phase(compressor: str, levels: tuple[Any, ...], options: dict[str, Any],
                     whole: str) -> None:  # fmt: skip
    """``collective=`` and ``server-error=`` need a compressor with a two-phase exchange
    (:func:`two_phase_parts`): elsewhere they would change nothing."""
    given = [s for k, s in (("collective", "collective="), ("server_feedback", "server-error="))
             if k in options]  # fmt: skip
    if given and not two_phase_parts(compressor, levels):
        what = "is an option" if len(given) == 1 else "are options"
        raise ValueError(f"strategy {whole!r}: {' and '.join(given)} {what} of the integer "
                         f"quantisers' exchange: the compressor must be one of "
                         f"{', '.join(two_phase_compressors())}, or {Mixed.name} with such "
                         f"rungs; got {compressor!r}")  # fmt: skip


def _is_budget(value: str) -> bool:
    """Whether ``value`` is an audit budget (the audit rule's own check: in (0, 1])."""
    try:
        check_tau(float(value))
    except ValueError:
        return False
    return True


def _freeze(value: str) -> tuple[int, str, float | None] | None:
    """``P/LEVEL[/ETA]`` as ``(P, LEVEL, ETA or None)``, P an int percent in [1, 99] and
    ETA a finite number > 0 (the level is the compressor's to check); else ``None``."""
    parts = value.split("/")
    if len(parts) not in (2, 3):
        return None
    percent, level = parts[:2]
    eta = _positive(parts[2]) if len(parts) == 3 else None
    if not percent.isdigit() or not 1 <= int(percent) <= 99 or not level:
        return None
    return None if len(parts) == 3 and eta is None else (int(percent), level, eta)


def _positive(text: str) -> float | None:
    """``text`` as a finite float > 0, else ``None``."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value < math.inf else None


def _options(items: list[str], whole: str) -> dict[str, Any]:
    """The suffixes after the levels: ``auto``, ``adam-noise``, a rule name, ``every=N``,
    ``block=N``, ``open``, ``tau=X``, ``ref=N``, ``momentum=P/LEVEL[/ETA]``,
    ``collective=C``, ``server-error=on|off``, each at most once."""
    counts = {"every": "interval", "block": "block"}  # suffix -> Strategy field
    options: dict[str, Any] = {}
    for item in items:
        name, _, value = item.partition("=")
        parsed: Any
        if item == "auto":
            key, parsed = "auto", True
        elif item == "adam-noise":
            key, parsed = "adam_noise", True
        elif item == "open":
            key, parsed = "open_ladder", True
        elif item in RULES:
            key, parsed = "rule", item
        elif name in counts and value.isdigit() and int(value) >= 1:
            key, parsed = counts[name], int(value)
        elif item == "block=decay":
            key, parsed = "block", "decay"
        elif name == "tau" and _is_budget(value):
            key, parsed = "tau", float(value)
        elif name == "ref" and value.isdigit():
            key, parsed = "reference", int(value)
        elif name == "momentum" and _freeze(value) is not None:
            key, parsed = "momentum_freeze", _freeze(value)
        elif name == "collective" and value in COLLECTIVES:
            key, parsed = "collective", value
        elif name == "server-error" and value in ("on", "off"):
            key, parsed = "server_feedback", value == "on"
        else:
            raise ValueError(
                f"strategy {whole!r}: {item!r} is not a suffix: use auto, adam-noise, a rule "
                f"({', '.join(RULES)}), every=N (N >= 1 epochs), block=N (N >= 1 checks), "
                "block=decay, open, tau=X (0 < X <= 1), ref=N (N >= 0, a rung), "
                "momentum=P/LEVEL[/ETA] (1 <= P <= 99, percent of the run's steps; ETA > 0), "
                f"collective=C (C one of {', '.join(COLLECTIVES)}) or server-error=off"
            )
        if key in options:
            raise ValueError(f"strategy {whole!r}: {item!r} repeats a suffix")
        options[key] = parsed
    return options
