"""A short account of what Accordion did in a run, for logs and examples.

:func:`summarize` turns a state and the levels recorded during the run into two lines
that read the same in every training framework::

    levels: epoch 0: 4 | epoch 1: 4 | epoch 2: 2 | epoch 3: 1
    traffic: sent 40.2 kB, dense would send 150.5 kB (3.74x less, 110.3 kB saved)

The traffic is this rank's wire bytes (``state.ledger``) against what the same steps
would have sent uncompressed over the state's process group (ring all-reduce bytes, as
the ledger counts them: ``accordion.accounting.wire_bytes``).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from ._validate import check_int
from .accounting import wire_bytes
from .compress.transport import world_and_rank
from .controller import Controller

__all__ = ["summarize"]

_UNITS = ("B", "kB", "MB", "GB", "TB")


def summarize(state: Controller, levels: Sequence[Mapping[str, Any]] = (),
              unit: str | None = None, first: int = 0) -> str:  # fmt: skip
    """Two lines, ``levels: ...`` and ``traffic: ...``, of what ``state`` did so far.

    Args:
        state: an :class:`~accordion.ddp.AccordionState` or
            :class:`~accordion.fsdp.FSDPState` (any :class:`~accordion.controller.Controller`).
        levels: ``state.levels()`` snapshots taken during the run, one per period, e.g.
            at the start of every epoch (the levels that epoch's steps use). Each period
            shows the distinct levels of its layers, mildest first, and ``dense`` for
            layers the cost model sent dense. Empty: the levels in force now, as ``now``.
        unit: what a period is called in the ``levels`` line; default
            ``state.interval_unit`` (``"epoch"`` or ``"step"``).
        first: the number of the first period of ``levels`` (a resumed run's first
            epoch, say); the traffic is the whole run's, as the ledger is checkpointed.

    Call it on the rank whose figures you want (the ledger is per rank), while the
    process group is still up: the dense figure is priced at its world size. It is
    local: no collective, so it may run on rank 0 alone.
    """
    if not isinstance(state, Controller):
        raise TypeError("state must be an accordion Controller (AccordionState, FSDPState), "
                        f"got {type(state).__name__}")  # fmt: skip
    if unit is None:
        unit = state.interval_unit
    elif not isinstance(unit, str):
        raise TypeError(f"unit must be a str or None, got {type(unit).__name__}")
    elif not unit.strip():
        raise ValueError(f"unit must name the period (e.g. 'epoch'), got {unit!r}")
    first = check_int("first", first, 0)
    periods = _checked_levels(state, levels)
    if periods:
        parts = [f"{unit} {first + i}: {_period(state, snapshot)}"
                 for i, snapshot in enumerate(periods)]  # fmt: skip
    else:
        parts = [f"now: {_period(state, state.levels())}"]
    return f"levels: {' | '.join(parts)}\ntraffic: {_traffic(state)}"


def _checked_levels(state: Controller, levels: Any) -> list[Mapping[str, Any]]:
    """``levels`` as a list of mappings whose values are ``None`` or ladder levels."""
    if isinstance(levels, str | bytes | Mapping) or not isinstance(levels, Sequence):
        raise TypeError("levels must be a sequence of state.levels() snapshots (mappings), "
                        f"got {type(levels).__name__}")  # fmt: skip
    ladder = state.ladder.levels
    for i, snapshot in enumerate(levels):
        if not isinstance(snapshot, Mapping):
            raise TypeError(f"levels[{i}] must be a mapping from state.levels(), "
                            f"got {type(snapshot).__name__}")  # fmt: skip
        for key, level in snapshot.items():
            if level is not None and level not in ladder:
                raise ValueError(f"levels[{i}][{key!r}] must be None or a level of the "
                                 f"state's ladder {list(ladder)}, got {level!r}")  # fmt: skip
    return list(levels)


def _period(state: Controller, snapshot: Mapping[str, Any]) -> str:
    """The distinct levels of one snapshot, mildest first, then ``dense`` if any."""
    used = set(snapshot.values())
    words = [_level_text(level) for level in dict.fromkeys(state.ladder.levels) if level in used]
    if None in used:
        words.append("dense")
    return ",".join(words) or "none"


def _level_text(level: Any) -> str:
    if isinstance(level, numbers.Real) and not isinstance(level, bool):
        return f"{level:g}"
    return str(level)


def _traffic(state: Controller) -> str:
    """``sent X, dense would send Y (...)`` from the ledger of ``state``."""
    world = world_and_rank(state.process_group)[0]
    shapes, sizes = state.params.shapes, state.params.element_size
    sent = float(state.ledger.total_bytes)
    dense = float(sum(t.steps * wire_bytes(shapes[k], "dense", None, world, sizes[k])
                      for k, t in state.ledger.layers.items() if k in shapes))  # fmt: skip
    if sent <= 0:
        verdict = "nothing sent"
    elif sent < dense:
        verdict = f"{dense / sent:.2f}x less, {_bytes_text(dense - sent)} saved"
    elif sent > dense:
        verdict = f"{sent / dense:.2f}x more" if dense > 0 else "dense sends nothing"
    else:
        verdict = "as much"
    return f"sent {_bytes_text(sent)}, dense would send {_bytes_text(dense)} ({verdict})"


def _bytes_text(nbytes: float) -> str:
    """``nbytes`` in decimal units: ``512 B``, ``40.2 kB``, ``1.5 MB``."""
    power = 0
    while nbytes >= 1000 and power < len(_UNITS) - 1:
        nbytes /= 1000
        power += 1
    return f"{nbytes:.0f} B" if power == 0 else f"{nbytes:.1f} {_UNITS[power]}"
