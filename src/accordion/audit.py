"""The fidelity audit's side of the controller: one step per period averaged dense, and
each rung's relative error on that true average.

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

from .compress import Exchange, Reducer, average_in_place
from .compress.memory import NoMemory
from .compress.transport import LocalTransport
from .policy import Ladder


class Audits:
    """Which step is its period's audit: the first step the controller reduces in a
    period that gathers the statistic, when the rule needs ``"audit"`` and holds no errors
    of the period yet (its ``pending``, checkpointed with the rule). Every bucket of that
    step is audited."""

    def __init__(self) -> None:
        #: The step being audited (a counter of the controller), or ``None``.
        self.step: int | None = None

    def due(self, rule: Any, adaptive: bool, collecting: bool, step: int) -> bool:
        """Whether step ``step`` (of a period that gathers when ``collecting``) is audited."""
        if "audit" not in rule.needs or not adaptive:
            return False
        if self.step == step:  # a later bucket of the audited step
            return True
        if collecting and not rule.pending:
            self.step = step
            return True
        return False


def relative_errors(ladder: Ladder, keys: Sequence[str], averages: Sequence[torch.Tensor],
                    options: dict[str, Any]) -> dict[str, list[float]]:  # fmt: skip
    """Per key, ``|C_r(g) - g| / |g|`` of its average ``g`` at each rung ``r`` of
    ``ladder`` (0 for a zero gradient; NaN where the rung sends it dense, as a level
    that does not pay for its shape does), the compressors built with ``options``."""
    errors: dict[str, list[float]] = {key: [] for key in keys}
    if not keys:
        return errors
    norms = [float(g.double().norm()) for g in averages]
    for level in ladder.levels:
        reducer = Reducer(ladder.compressor.build(level, **options), NoMemory())
        approximations = []
        for _ in range(2):  # the second pass is warm-started from the first
            approximations = [g.detach().clone() for g in averages]
            LocalTransport().run(reducer.exchange(list(keys), approximations, 1))
        for key, g, a, norm in zip(keys, averages, approximations, norms):
            if not reducer.sends_compressed(g, key):  # dense at this rung: not a choice
                errors[key].append(math.nan)
                continue
            gap = float((a.double() - g.double()).norm())
            errors[key].append(gap / norm if norm > 0 else 0.0)
    return errors


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
