"""How many inner steps each DiLoCo round takes: a fixed H, or an H that follows the
inner learning rate.

The drift of H local steps between two syncs scales with the learning rate, so H is a
lever like the paper's batch size: a round that starts at inner learning rate ``lr`` may
take

    H(lr) = clamp(round(sync_every * (peak / lr) ** growth), min_sync_every, max_sync_every)

steps, ``peak`` the highest inner learning rate seen so far (so a learning-rate warm-up
counts as high). ``growth > 0`` lengthens the rounds as the schedule decays (``2`` is the
quadratic synchronisation rule of Gu et al., ICLR 2024, H proportional to ``1 / lr**2``);
``growth < 0`` shortens them; ``growth = 0`` is DiLoCo's fixed H. Every rank reads the
same schedule's rate, so every rank ends each round on the same step.

Measured on charlm-tiny at 4 epochs (``docs/diloco.md``, "H as a lever"): at the bytes of
a fixed H = 25, neither sign did better than the fixed H; rounds that lengthen late lost
most (the decayed phase is where frequent averaging closes DiLoCo's gap). On MNIST-1D
CNNs with SGD, plain averages (``docs/diloco.md``, "Rounds four times longer after the
decay"), ``growth=1`` on each workload's best fixed H with int2 syncs kept dense accuracy
at 1.50-1.71x fewer bytes than that H on five of seven workloads: there the decayed
phase is calm. Fixed rounds of 400 steps at 4 bits sent less still.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ._validate import check_int, check_number, check_state_keys

_STATE_KEYS = frozenset({"start", "length", "peak", "lengths"})
#: The default range of a round: up to this many times ``sync_every`` with ``growth > 0``,
#: down to ``sync_every`` over this with ``growth < 0``.
MAX_GROWTH = 4


class SyncSchedule:
    """The length of each DiLoCo round (see the module).

    Args:
        sync_every: H, the inner steps of a round at the peak rate (an int >= 1).
        growth: p, the power of ``peak / lr`` by which a round's length changes (a finite
            float; 0, the default: every round is ``sync_every`` steps). Above 0 rounds
            lengthen as the rate decays; below 0 they shorten.
        min_sync_every: the shortest round, an int in ``[1, sync_every]``; default
            ``sync_every`` with ``growth > 0``, ``sync_every / 4`` (rounded, at least 1)
            with ``growth < 0``.
        max_sync_every: the longest round, an int >= ``sync_every``; default
            :data:`MAX_GROWTH` times ``sync_every`` with ``growth > 0``, ``sync_every``
            with ``growth < 0``.
    """

    def __init__(self, sync_every: int, growth: float = 0.0, min_sync_every: int | None = None,
                 max_sync_every: int | None = None):  # fmt: skip
        self.sync_every = h = check_int("sync_every", sync_every, 1)
        self.growth = check_number("sync_growth", growth)
        for name, bound in (("min_sync_every", min_sync_every), ("max_sync_every", max_sync_every)):
            if bound is not None and not self.growth:
                raise ValueError(f"{name}={bound!r} needs sync_growth other than 0: without "
                                 "growth every round is sync_every steps")  # fmt: skip
        shrinks = self.growth < 0
        low = (max(1, round(h / MAX_GROWTH)) if shrinks else h) if min_sync_every is None \
            else min_sync_every  # fmt: skip
        high = (h if shrinks else MAX_GROWTH * h) if max_sync_every is None else max_sync_every
        #: The shortest and the longest round, in inner steps.
        self.min_sync_every = check_int("min_sync_every", low, 1)
        if self.min_sync_every > h:
            raise ValueError(f"min_sync_every must be an int in [1, sync_every={h}], got {low!r}")
        self.max_sync_every = check_int("max_sync_every", high, h)
        self._start = 0  # the rounds' inner step at which the current round began
        self._length: int | None = None  # its length, set by its first step's rate
        self._peak = 0.0
        #: Each round's length so far, in inner steps (with growth only).
        self.lengths: list[int] = []

    def length_at(self, lr: float) -> int:
        """The inner steps of a round that starts at inner learning rate ``lr``."""
        if not self.growth:
            return self.sync_every
        if lr <= 0:  # a schedule decayed to nothing: the far end of the range
            return self.max_sync_every if self.growth > 0 else self.min_sync_every
        changed = self.sync_every * (max(self._peak, lr) / lr) ** self.growth
        return min(self.max_sync_every, max(self.min_sync_every, round(changed)))

    def observe(self, lr: float) -> None:
        """Note an inner step's learning rate (every step, the warm-up's too)."""
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"the inner learning rate must be finite and >= 0, got {lr!r}")
        self._peak = max(self._peak, float(lr))

    def due(self, t: int, lr: float) -> bool:
        """Whether the ``t``-th inner step of the rounds (from 1), taken at ``lr``, ends a
        round; the first step of a round sets its length."""
        if not self.growth:
            return t % self.sync_every == 0  # DiLoCo's fixed H, stateless
        if self._length is None:
            self._length = self.length_at(lr)
        if t - self._start < self._length:
            return False
        self.lengths.append(self._length)
        self._start, self._length = t, None
        return True

    def state_dict(self) -> dict[str, Any]:
        """The current round's start and length, the peak rate and the rounds' lengths."""
        return {"start": self._start, "length": self._length, "peak": self._peak,
                "lengths": list(self.lengths)}  # fmt: skip

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a bad entry is a ``ValueError`` and changes nothing."""
        check_state_keys(saved, _STATE_KEYS, "SyncSchedule")
        start, length, peak, lengths = (saved[k] for k in ("start", "length", "peak", "lengths"))
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"schedule start must be an int >= 0, got {start!r}")
        low, top = self.min_sync_every, self.max_sync_every
        if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                                   or not low <= length <= top):  # fmt: skip
            raise ValueError(f"schedule length must be None or an int in [{low}, {top}], "
                             f"got {length!r}")  # fmt: skip
        if isinstance(peak, bool) or not isinstance(peak, int | float) or not peak >= 0:
            raise ValueError(f"schedule peak must be a number >= 0, got {peak!r}")
        if not isinstance(lengths, list) or not all(isinstance(n, int) for n in lengths):
            raise ValueError(f"schedule lengths must be a list of ints, got {lengths!r:.80}")
        self._start, self._length, self._peak = start, length, float(peak)
        self.lengths = list(lengths)


__all__ = ["SyncSchedule", "MAX_GROWTH"]
