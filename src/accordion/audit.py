"""The measurements rules ask of the controller: the fidelity audit (one step per period
averaged dense, and each rung's relative error on that true average) and L-GreCo's errors
(each rank's error-fed accumulator compressed at every rung, the squared errors summed).

Every rank holds the same average after the dense all-reduce, so the errors are computed
locally, with no traffic, and are the same everywhere. Each rung's compressor is built
fresh at each audit from the shared seed (nothing to checkpoint) and run twice on the
average, so that PowerSGD's second pass starts from its first pass's factors, as the
warm-started compressor of a real run does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .accounting import Ledger, paper_floats, wire_bytes
from .compress import Exchange, Reducer, average_in_place
from .compress.memory import NoMemory
from .compress.transport import AllReduce, LocalTransport
from .policy import Ladder

#: The rule statistics taken at one step per period (see :class:`Audits`).
MEASUREMENTS = frozenset({"audit", "errors"})


class Audits:
    """Which step is its period's measurement: the first step the controller reduces in a
    period that gathers the statistic, when the rule needs ``"audit"`` or ``"errors"`` and
    holds no errors of the period yet (its ``pending``, checkpointed with the rule). Every
    bucket of that step is measured."""

    def __init__(self) -> None:
        #: The step being audited (a counter of the controller), or ``None``.
        self.step: int | None = None

    def due(self, rule: Any, adaptive: bool, collecting: bool, step: int) -> bool:
        """Whether step ``step`` (of a period that gathers when ``collecting``) is audited."""
        if not rule.needs & MEASUREMENTS or not adaptive:
            return False
        if self.step == step:  # a later bucket of the audited step
            return True
        if collecting and not rule.pending:
            self.step = step
            return True
        return False


def measured_step(controller: Any, keys: Sequence[str], grads: Sequence[torch.Tensor],
                  buffer: torch.Tensor | None, world: int, compressed: Sequence[str],
                  options: dict[str, Any]) -> Exchange[Any]:  # fmt: skip
    """The exchange of a step ``controller``'s rule measures (see :class:`Audits`), over the
    ``compressed`` keys, the rungs' compressors built with ``options``: with ``"errors"``
    in the rule's needs L-GreCo's errors, the step compressed as usual
    (:func:`measured_exchange`); else the audit, the step averaged dense
    (:func:`audited_exchange`)."""
    rule, reducer, ladder = controller.rule, controller.reducer, controller.ladder
    if "errors" in rule.needs:
        _count_errors(controller.ledger, set(keys) & set(compressed), len(ladder), world)
        local = getattr(controller.transport(), "local_size", 1)  # the steps' layout
        return measured_exchange(keys, grads, reducer, world, rule.measured, compressed, ladder,
                                 options, local)  # fmt: skip
    reducer.noise.forget(keys)  # an audited step goes dense: no error to correct
    return audited_exchange(keys, grads, buffer, world, rule.measured, compressed, ladder,
                            options)  # fmt: skip


def _count_errors(ledger: Ledger, keys: set[str], rungs: int, world: int) -> None:
    """Add to ``ledger`` what L-GreCo's measurement sends: per key, one float64 squared
    error per rung, all-reduced (no step: the step is counted as usual)."""
    shape = (rungs,)
    floats = paper_floats(shape, "dense", None, world)
    nbytes = wire_bytes(shape, "dense", None, world, 8)
    for key in keys:
        ledger.add_extra(key, floats, nbytes)


def relative_errors(ladder: Ladder, keys: Sequence[str], averages: Sequence[torch.Tensor],
                    options: dict[str, Any]) -> dict[str, list[float]]:  # fmt: skip
    """Per key, ``|C_r(g) - g| / |g|`` of its average ``g`` at each rung ``r`` of
    ``ladder`` (0 for a zero gradient; NaN where the rung sends it dense, as a level
    that does not pay for its shape does), the compressors built with ``options``."""
    errors: dict[str, list[float]] = {key: [] for key in keys}
    norms = [float(g.double().norm()) for g in averages]
    for gaps in rung_gaps(ladder, keys, averages, options):
        for key, gap, norm in zip(keys, gaps, norms):
            errors[key].append(gap if math.isnan(gap) else gap / norm if norm > 0 else 0.0)
    return errors


def rung_gaps(ladder: Ladder, keys: Sequence[str], tensors: Sequence[torch.Tensor],
              options: dict[str, Any]) -> list[list[float]]:  # fmt: skip
    """Per rung, per key, ``|C_r(t) - t|`` of one worker's tensor ``t`` compressed alone
    at the rung (NaN where the rung sends it dense), nothing remembered."""
    rungs = []
    for level in ladder.levels:
        reducer = Reducer(ladder.compressor.build(level, **options), NoMemory())
        approximations = []
        for _ in range(2):  # the second pass is warm-started from the first
            approximations = [t.detach().clone() for t in tensors]
            LocalTransport().run(reducer.exchange(list(keys), approximations, 1))
        rungs.append([float((a.double() - t.double()).norm())
                      if reducer.sends_compressed(t, key) else math.nan
                      for key, t, a in zip(keys, tensors, approximations)])  # fmt: skip
    return rungs


def measured_exchange(keys: Sequence[str], grads: Sequence[torch.Tensor], reducer: Reducer,
                      world: int, measured: Any, chosen: Sequence[str], ladder: Ladder,
                      options: dict[str, Any], local_size: int = 1) -> Exchange[Any]:  # fmt: skip
    """Before ``reducer``'s own exchange of ``grads`` (``local_size`` workers a host): for
    the keys in ``chosen``, the squared error ``|C_r(a) - a|^2`` of this rank's error-fed
    accumulator ``a = g + e`` at every rung, summed over the ranks in one all-reduce,
    handed to ``measured`` with each rung's wire bytes (L-GreCo's measurement: a rung that
    sends a key dense costs its dense bytes and errs by 0)."""
    wanted = set(chosen)
    picked = [(k, g) for k, g in zip(keys, grads) if k in wanted]
    if picked:
        names = [k for k, _ in picked]
        owed = [reducer.memory.get(k) for k in names]
        accumulators = [g if e is None else g + e for (_, g), e in zip(picked, owed)]
        gaps = rung_gaps(ladder, names, accumulators, options)
        squares = torch.tensor([[0.0 if math.isnan(x) else x * x for x in row] for row in gaps],
                               dtype=torch.float64, device=picked[0][1].device)  # fmt: skip
        if world > 1:
            (squares,) = yield [AllReduce(squares)]
        sizes = [[_rung_bytes(ladder, level, g, math.isnan(row[i]))
                  for level, row in zip(ladder.levels, gaps)]
                 for i, (_, g) in enumerate(picked)]  # fmt: skip
        measured({k: squares[:, i].tolist() for i, k in enumerate(names)},
                 dict(zip(names, sizes)))  # fmt: skip
    return (yield from reducer.exchange(keys, grads, world, local_size))


def _rung_bytes(ladder: Ladder, level: Any, tensor: torch.Tensor, dense: bool) -> float:
    """The bytes one rank hands its collectives for ``tensor`` at ``level``."""
    if dense:
        return float(tensor.numel() * tensor.element_size())
    messages = ladder.compressor.messages(tuple(tensor.shape), level, tensor.element_size())
    return float(sum(m.nbytes for m in messages))


def audited_exchange(keys: Sequence[str], grads: Sequence[torch.Tensor],
                     buffer: torch.Tensor | None, world: int, measured: Any,
                     audited: Sequence[str], ladder: Ladder,
                     options: dict[str, Any]) -> Exchange[bool]:  # fmt: skip
    """Average ``grads`` dense in place (the flat ``buffer`` when given, which they are
    views of), then hand ``measured`` the errors of the keys in ``audited``. The
    error-feedback memories are left as they are: what they owe goes with a later step."""
    yield from average_in_place(grads, world, buffer)
    audited_set = set(audited)
    chosen = [i for i, k in enumerate(keys) if k in audited_set]
    measured(relative_errors(ladder, [keys[i] for i in chosen], [grads[i] for i in chosen],
                             options))  # fmt: skip
    return all(bool(torch.isfinite(g).all()) for g in grads)
