"""Checkpoint formats of the Accordion state: the current one, and reading older ones.

Format 2 (the policy layer) keeps the reducer's, the rule's and the ladder's state apart.
Format 1 (before it) kept a ``RegimeDetector``'s state and ``mild``/``aggressive``; it is
read by converting it to format 2: the same memories, factors, levels and history.

The schema is :data:`ENTRIES`; :func:`upgrade`, :func:`check_entries` and
:func:`check_owner` check a file as a whole, :func:`loaded_parts` loads its entries into
new objects (each loader raises ``ValueError`` naming the entry, via :func:`entry`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from .._validate import check_bool, check_int, check_number, check_state_keys
from ..accounting import Ledger
from ..compress import Reducer
from ..statistics import GradientSums

FORMAT = 2
READABLE = (1, 2)

#: The top-level entries of ``AccordionState.state_dict()``, in the order it writes them.
ENTRIES = tuple(
    "format world_size rank config shapes reducer accumulators rule rungs ledger epoch step "
    "last_lr decay_reference decayed observed".split()
)
#: The entries older files lack: those written before the guarded rule the last three,
#: those before the idle flag was saved the last one. Their loaders give the defaults.
OPTIONAL = frozenset({"decay_reference", "decayed", "observed"})
#: The entries every readable file has (after :func:`upgrade`).
REQUIRED = frozenset(ENTRIES) - OPTIONAL


def upgrade(state: Any) -> dict[str, Any]:
    """``state`` in the current format; ``ValueError`` for anything else."""
    version = state.get("format") if isinstance(state, Mapping) else None
    if version not in READABLE:
        raise ValueError(
            f"state must come from AccordionState.state_dict() (format {FORMAT}, or an "
            f"older format in {READABLE}), got format {version!r}"
        )
    try:
        state = dict(state) if version == FORMAT else _from_format_1(state)
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"the checkpoint (format {version}) is incomplete or malformed: {exc!r}"
        ) from None
    missing = sorted(REQUIRED - set(state))
    if missing:
        raise ValueError(f"the checkpoint (format {version}) is missing keys {missing}")
    return state


#: (saved, current) statistics a checkpoint resumes across: "rank0" (the default before
#: "sharded") keeps every layer's sum on every rank, so each owner finds its own.
STATISTIC_UPGRADES = frozenset({("rank0", "sharded")})


def check_owner(state: Mapping[str, Any], world: int, rank: int, config: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless ``state`` was saved by this rank of a job of this world
    size, with this configuration (its statistic may be upgraded: :data:`STATISTIC_UPGRADES`)."""
    if state["world_size"] != world:
        raise ValueError(
            f"the checkpoint was saved with world size {state['world_size']}, "
            f"this job has {world}: Accordion state cannot be resharded"
        )
    if state["rank"] != rank:
        raise ValueError(f"this is rank {rank}'s state loader, got rank {state['rank']}'s file")
    for name, value in state["config"].items():
        current = config.get(name)
        upgrade = name == "statistic" and (value, current) in STATISTIC_UPGRADES
        if current != value and not upgrade:
            raise ValueError(
                f"the checkpoint's {name} is {value!r} but this state's is {current!r}"
            )


def _from_format_1(state: Mapping[str, Any]) -> dict[str, Any]:
    """Format 1 (``RegimeDetector`` state, two levels) as format 2."""
    config = state["config"]
    detector = state["detector"]
    if config["interval_unit"] == "step":  # a StepRegimeDetector wraps a RegimeDetector
        detector = detector["detector"]
    return {
        "format": FORMAT,
        "world_size": state["world_size"],
        "rank": state["rank"],
        "config": {
            "compressor": config["compressor"],
            "levels": [config["mild"], config["aggressive"]],
            "interval": config["interval"],
            "statistic": config["statistic"],
            "interval_unit": config["interval_unit"],
            "seed": config["seed"],
            "rule": {"name": "paper", "eta": config["eta"]},
        },
        "shapes": state["shapes"],
        "reducer": {
            "compressor": state["compressor"],
            "memory": state["memory"],
            "dense_keys": list(state.get("dense_keys", [])),
            "non_finite_steps": state["non_finite_steps"],
        },
        "accumulators": state["accumulators"],
        "rule": {"norms": detector["norms"], "history": detector["history"]},
        # critical layers were at the mild level (rung 0), the others at the aggressive (1)
        "rungs": {k: 0 if critical else 1 for k, critical in detector["critical"].items()},
        "ledger": state["ledger"],
        "epoch": state["epoch"],
        "step": state["step"],
        "last_lr": state["last_lr"],
    }


def write(world: int, rank: int, config: Mapping[str, Any], params: Any, reducer: Reducer,
          sums: GradientSums, decider: Any, ledger: Ledger) -> dict[str, Any]:
    """The entries (:data:`ENTRIES`) of one rank's state: tensors and plain values, for
    ``torch.load(weights_only=True)``. ``params`` is the ``ParameterTable``, ``decider``
    the ``policy.Decider`` (rule, rungs, counters, decays, whether gradients came)."""
    detector = decider.detector
    return {
        "format": FORMAT,
        "world_size": world,
        "rank": rank,
        "config": config,
        "shapes": {k: list(s) for k, s in params.shapes.items()},
        "reducer": reducer.state_dict(),
        "accumulators": sums.state_dict(),
        "rule": decider.rule.state_dict(),
        "rungs": dict(decider.rungs),
        "ledger": ledger.state_dict(),
        "epoch": decider.epoch,
        "step": decider.step,
        "last_lr": detector.last_lr,
        "decay_reference": detector.reference,
        "decayed": decider.decayed,
        # a checkpoint taken mid-period (Lightning's, before the callback's end_epoch)
        # resumes knowing that gradients came through: no false idle warning
        "observed": decider.observed,
    }


# --- loading format 2, entry by entry -----------------------------------------------------


def read(state: Any, world: int, rank: int, config: Mapping[str, Any], params: Any,
         new_reducer: Callable[[], Reducer], ladder: Any, rule: Any) -> Parts:  # fmt: skip
    """The parts of ``state`` (any readable format) as new objects, for this ``rank`` of a
    job of ``world`` ranks with this ``config``: the checkpoint is checked as a whole,
    then ``params`` (a ``ParameterTable``) is told the shapes it expects (restored if a
    later entry fails), each entry is loaded (:func:`loaded_parts`) and last ``rule``'s
    state, in place (a rule checks all of it first). Anything wrong raises
    ``ValueError`` naming the entry; only ``rule`` and ``params`` change here."""
    state = upgrade(state)
    check_entries(state, config)
    check_owner(state, world, rank, config)
    shapes = entry("shapes", loaded_shapes, state["shapes"])
    previous = params.expected
    params.expect(shapes)  # the model first; restores itself when it raises
    try:
        parts = loaded_parts(state, shapes, new_reducer, ladder)
        entry("rule", rule.load_state_dict, state["rule"])  # checks all first
    except BaseException:
        params.expected = previous
        raise
    return parts


class Parts(NamedTuple):
    """The loaded parts of a checkpoint, as new objects (swapped in once all are loaded)."""

    reducer: Reducer
    sums: GradientSums
    ledger: Ledger
    rungs: dict[str, int]
    #: epoch, step, last_lr, decay_reference, decayed, observed
    counters: tuple[Any, ...]


def loaded_parts(state: Mapping[str, Any], shapes: Mapping[str, tuple],
                 new_reducer: Callable[[], Reducer], ladder: Any) -> Parts:  # fmt: skip
    """The reducer (a ``new_reducer()`` loaded), sums, ledger, rungs and counters of
    ``state``, each checked against the checkpoint's ``shapes`` and ``ladder``; a bad
    entry raises ``ValueError`` naming it."""
    reducer = entry("reducer", loaded_reducer, state["reducer"], shapes, new_reducer, ladder)
    sums = GradientSums()
    entry("accumulators", sums.load_state_dict, state["accumulators"])
    entry("accumulators", sums.check_shapes, shapes)
    ledger = entry("ledger", loaded_ledger, state["ledger"], shapes)
    rungs = entry("rungs", loaded_rungs, state["rungs"], shapes, ladder)
    # decay_reference and decayed are absent from files written before the guarded rule
    rates = [entry(key, loaded_rate, key, state.get(key))
             for key in ("last_lr", "decay_reference")]  # fmt: skip
    counters = (
        entry("epoch", check_int, "the checkpoint's epoch", state["epoch"], 0),
        entry("step", check_int, "the checkpoint's step", state["step"], 0),
        *rates,
        entry("decayed", check_bool, "the checkpoint's decayed", state.get("decayed", False)),
        # absent from older files: True, so that an unknown past raises no false alarm
        entry("observed", check_bool, "the checkpoint's observed",
              state.get("observed", True)),  # fmt: skip
    )
    return Parts(reducer, sums, ledger, rungs, counters)


def entry(name: str, load: Callable[..., Any], *args: Any) -> Any:
    """``load(*args)`` for the checkpoint's entry ``name``; any error in it becomes a
    ``ValueError`` that names the entry."""
    try:
        return load(*args)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError | IndexError) and exc.args else exc
        kind = "lacks the key" if isinstance(exc, KeyError) else "is malformed:"
        raise ValueError(f"the checkpoint's {name} {kind} {message!s}") from None


def check_entries(state: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for an unknown top-level entry, or a configuration whose keys
    are not this state's (values are compared by :func:`check_owner`)."""
    unknown = sorted(set(state) - set(ENTRIES), key=repr)
    if unknown:
        raise ValueError(f"the checkpoint has unknown entries {unknown}")
    saved = state["config"]
    if not isinstance(saved, Mapping):
        raise ValueError(f"the checkpoint's config must be a Mapping, got {saved!r:.80}")
    missing, extra = sorted(set(config) - set(saved)), sorted(set(saved) - set(config), key=repr)
    if missing or extra:
        raise ValueError(f"the checkpoint's config lacks keys {missing} and has unknown keys "
                         f"{extra}")  # fmt: skip


def loaded_shapes(shapes: Any) -> dict[str, tuple[int, ...]]:
    """The checkpoint's parameter shapes: key -> sequence of ints >= 0."""
    if not isinstance(shapes, Mapping):
        raise ValueError(f"shapes must be a Mapping, got {type(shapes).__name__}")
    checked = {}
    for key, shape in shapes.items():
        if not isinstance(key, str) or isinstance(shape, str | bytes) or not isinstance(
            shape, Sequence
        ) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"shapes[{key!r}] must be a list of ints >= 0, got {shape!r:.80}")
        checked[key] = tuple(shape)
    return checked


def loaded_reducer(state: Any, shapes: Mapping[str, tuple], new_reducer: Callable[[], Reducer],
                   ladder: Any) -> Reducer:  # fmt: skip
    """A ``new_reducer()`` loaded from ``state``, whose levels are all on ``ladder``."""
    reducer = new_reducer()
    reducer.load_state_dict(state)
    reducer.check_shapes(shapes)
    saved = reducer.compressor.state_dict()
    levels = {"default_level": saved["default_level"],
              **{f"levels[{k!r}]": v for k, v in saved["levels"].items()}}  # fmt: skip
    for name, level in levels.items():
        if level not in ladder.levels:
            raise ValueError(f"compressor {name} is {level!r}, which is not on this state's "
                             f"ladder {list(ladder.levels)}")  # fmt: skip
    return reducer


def loaded_rungs(rungs: Any, shapes: Mapping[str, tuple], ladder: Any) -> dict[str, int]:
    """The checkpoint's rungs: a rung of ``ladder`` for a parameter of ``shapes``."""
    if not isinstance(rungs, Mapping):
        raise ValueError(f"the checkpoint's rungs must be a Mapping, got {rungs!r:.80}")
    unknown = [k for k in rungs if k not in shapes]
    if unknown:
        raise ValueError(f"rungs {unknown[:5]} are for no parameter of shapes")
    return {k: ladder.check_rung(k, r) for k, r in rungs.items()}


def loaded_ledger(state: Any, shapes: Mapping[str, tuple]) -> Ledger:
    """The checkpoint's ledger: per parameter of ``shapes``, counts of floats, bytes and
    steps (numbers >= 0)."""
    check_state_keys(state, frozenset({"layers"}), "Ledger")
    for name, totals in state["layers"].items():
        if name not in shapes:
            raise ValueError(f"ledger layers[{name!r}] is for no parameter of shapes")
        if not isinstance(totals, Mapping) or set(totals) != {"floats", "bytes", "steps"}:
            raise ValueError(f"ledger layers[{name!r}] must hold exactly 'floats', 'bytes', "
                             f"'steps', got {totals!r:.80}")  # fmt: skip
        check_int(f"ledger layers[{name!r}]['floats']", totals["floats"], 0)
        check_int(f"ledger layers[{name!r}]['steps']", totals["steps"], 0)
        check_number(f"ledger layers[{name!r}]['bytes']", totals["bytes"], minimum=0)
    ledger = Ledger()
    ledger.load_state_dict(state)
    return ledger


def loaded_rate(key: str, rate: Any) -> float | None:
    """A learning rate remembered by the checkpoint: ``None`` or a finite number >= 0."""
    return None if rate is None else check_number(f"the checkpoint's {key}", rate, minimum=0)
