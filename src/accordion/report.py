"""What the controller tells about itself: the cost of each step, its statistics, and
the levels that do not pay.

* :class:`Costs` -- per step, the paper-convention floats and wire bytes of each
  gradient at its level, cached per level (for the :class:`~accordion.accounting.Ledger`);
* :func:`stats` -- the JSON-serialisable snapshot of ``Controller.stats()``;
* :func:`dense_floats` -- what the ledger would count had every step been sent dense;
* :func:`useless_levels` -- the warning of layers a ladder level sends dense.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .accounting import Ledger, paper_floats, wire_bytes
from .compress import Dense, Reducer
from .statistic import Layers


class Costs:
    """Paper floats and wire bytes of one step of a gradient, cached per key, level and
    world size (the accounting's arithmetic is not free, and a step repeats it)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, Any, int], tuple[int, float]] = {}
        #: The device of the last gradients recorded, or ``None``.
        self.device: torch.device | None = None

    def record(self, ledger: Ledger, keys: Sequence[str], grads: Sequence[torch.Tensor],
               world: int, reducer: Reducer, name: str, dense: bool = False) -> None:  # fmt: skip
        """Add one step of ``grads`` (of ``keys``) to ``ledger``, at their levels (every
        one dense with ``dense``: an audited step)."""
        if grads:
            self.device = grads[0].device
        for key, grad in zip(keys, grads):
            ledger.add(key, *self.of(key, grad, world, reducer, name, dense))

    def of(self, key: str, grad: torch.Tensor, world: int, reducer: Reducer,
           name: str, dense: bool = False) -> tuple[int, float]:  # fmt: skip
        """The floats and bytes of ``key``'s gradient ``grad`` this step over ``world``
        ranks: dense for a dense key (or with ``dense``), else at its level of the
        compressor ``name`` (dense at a level that does not pay for its shape: the
        accounting's rule)."""
        dense = dense or key in reducer.dense_keys
        level = None if dense else reducer.compressor.level(key)
        cost = self._cache.get((key, level, world))
        if cost is None:
            kind = Dense.name if dense else name
            shape, size = tuple(grad.shape), grad.element_size()
            cost = (paper_floats(shape, kind, level, world),
                    wire_bytes(shape, kind, level, world, size))  # fmt: skip
            self._cache[(key, level, world)] = cost
        return cost

    def clear(self) -> None:
        """Forget every cached cost (keys were renamed, or a checkpoint loaded)."""
        self._cache.clear()


def dense_floats(ledger: Ledger, shapes: Mapping[str, Sequence[int]], world: int) -> int:
    """Paper-convention floats that the steps ``ledger`` recorded would have sent
    uncompressed over ``world`` ranks (every step of every layer of ``shapes`` dense)."""
    return sum(t.steps * paper_floats(shapes[k], Dense.name, None, world)
               for k, t in ledger.layers.items() if k in shapes)  # fmt: skip


def stats(controller: Any, compressed: Sequence[str]) -> dict[str, Any]:
    """``controller.stats()``, a JSON-serialisable snapshot for logging.

    ``layers`` maps each parameter key to its current ``level`` (``None`` when it is
    sent dense: not in ``compressed``), ``shape``, ``floats`` (paper convention) and
    ``bytes`` (wire) sent so far by this rank; ``checks`` is the rule's history (the
    paper rule: per check and layer, the old norm, new norm, ratio (``None`` for
    infinity) and the decision); ``dense_floats`` is what ``total_floats`` would be
    uncompressed; ``non_finite_steps`` counts the exchanges whose average held an inf or
    NaN, and ``statistic_skipped_steps`` per layer the local gradients left out of the
    statistic because they did (a host sync: it reads device counters).
    """
    comp = controller.reducer.compressor
    totals = controller.ledger.totals()
    compressed_set = set(compressed)
    layers = {}
    for key, shape in controller.params.shapes.items():
        sent = totals.get(key, {"floats": 0, "bytes": 0.0})
        layers[key] = {
            "level": comp.level(key) if key in compressed_set else None,
            "shape": list(shape),
            "floats": sent["floats"],
            "bytes": sent["bytes"],
        }
    return {
        "compressor": controller.compressor_name,
        "mild": controller.mild,
        "aggressive": controller.aggressive,
        "ladder": list(controller.ladder.levels),
        "epoch": controller.epoch,
        "step": controller.step,
        "total_floats": controller.ledger.total_floats,
        "total_bytes": controller.ledger.total_bytes,
        "dense_floats": controller.dense_floats(),
        "non_finite_steps": controller.reducer.non_finite_steps,
        "statistic_skipped_steps": controller.sums.skipped_steps(),
        "dense_keys": controller.dense_keys,
        "calibration": controller.calibration,
        "layers": layers,
        "checks": controller.rule.history,
    }


def useless_levels(ladder: Any, layers: Layers) -> str | None:
    """The warning, or ``None``, of the layers with a level that go dense at some level
    of ``ladder`` because it would send at least as much as dense for them
    (``Compressor.pays``), naming them and those levels, and of the compressor's own
    advice on a level (``level_warning``: e.g. a PowerSGD rank that sends more than dense
    for every layer, so choose a lower rank)."""
    reducer, shapes = layers.reducer, {k: layers.shapes[k] for k in layers.compressed()}
    cls, levels = ladder.compressor, list(dict.fromkeys(ladder.levels))
    dense_at = {
        k: [lv for lv in levels if cls.applies_at(s, lv) and not reducer.pays(s, lv)]
        for k, s in shapes.items()
    }
    dense_at = {k: lv for k, lv in dense_at.items() if lv}
    parts = []
    if dense_at:
        named = []
        for key, dense_levels in dense_at.items():
            size = "x".join(map(str, shapes[key]))
            named.append(f"{key!r} ({size}) at {' and '.join(map(cls.label, dense_levels))}")
        more = f" and {len(named) - 5} more" if len(named) > 5 else ""
        parts.append(f"{len(named)} layer(s) send at least as much as dense at some levels "
                     f"and go dense there: {', '.join(named[:5])}{more}")  # fmt: skip
    for level in levels:
        message = cls.level_warning(list(shapes.values()), level)
        if message:
            parts.append(message)
    if not parts:
        return None
    return f"{'; '.join(parts)} (levels {list(ladder.levels)})"


__all__ = ["Costs", "dense_floats", "stats", "useless_levels"]
