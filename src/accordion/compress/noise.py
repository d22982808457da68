"""What a reducer's exchanges tell of the error of its averages: per key, whether the
last two exchanges sent it compressed, and the squared norm of its last average. With the
compressor's residual variances (:meth:`~accordion.compress.Compressor.residual_variance`)
it gives the expected square of each average's error, which Adam's noise correction
(:class:`~accordion.adam_noise.AdamNoiseCorrection`) subtracts from Adam's second moment."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .base import Compressor


class NoiseTracker:
    """Per key, what :meth:`variance` and :meth:`square` need; off until :attr:`on`."""

    def __init__(self) -> None:
        #: Whether exchanges are recorded (it costs a pass over the averages).
        self.on = False
        self._history: dict[Hashable, tuple[bool, bool]] = {}  # compressed now, before
        self._squares: dict[Hashable, torch.Tensor] = {}
        self._fresh: set[Hashable] = set()  # recorded since the last consume()
        self._world = 1

    def record(self, keys: Sequence[Hashable], averages: Sequence[torch.Tensor],
               compressed: Mapping[Hashable, Any], world_size: int) -> None:  # fmt: skip
        """After an exchange of ``keys`` whose ``compressed`` ones went through the
        compressor: shift their history and keep their averages' squared norms."""
        self._world = world_size
        for key, average in zip(keys, averages):
            self._history[key] = (key in compressed, self._history.get(key, (False, False))[0])
            self._squares[key] = average.detach().float().square().sum()
            self._fresh.add(key)

    def consume(self) -> None:
        """Mark every record read: until its next exchange a key has no variance and no
        square, so that a step without an exchange (DiLoCo's after its warm-up) is not
        corrected for an old one's noise."""
        self._fresh.clear()

    def forget(self, keys: Iterable[Hashable]) -> None:
        """``keys`` were averaged dense outside the reducer (an audited step)."""
        for key in keys:
            self._history[key] = (False, self._history.get(key, (False, False))[0])
            self._squares.pop(key, None)

    def variance(
        self, key: Hashable, compressor: Compressor, feedback: bool
    ) -> torch.Tensor | None:
        """Per element of ``key``'s tensor, the expected square of the error of its last
        average: with error feedback (``feedback``) the average is off by the workers'
        mean of ``e_prev - e_now``, so ``(V_now + V_prev) / W**2`` for residuals
        independent between workers and steps (``V``: their summed variance); without it
        ``V_now / W**2``. ``None`` where the last exchange sent it dense or the compressor
        has no model of its error."""
        now, before = self._history.get(key, (False, False))
        current = compressor.residual_variance(key) if now and key in self._fresh else None
        if current is None:
            return None
        previous = None
        if before and feedback:
            previous = compressor.residual_variance(key, previous=True)
        total = current if previous is None else current + previous
        return total / self._world**2

    def square(self, key: Hashable) -> torch.Tensor | None:
        """The squared norm of ``key``'s last average as the exchange wrote it (0-d),
        before clipping or a ``GradScaler`` scaled it; ``None`` if not recorded since
        the last :meth:`consume`."""
        return self._squares.get(key) if key in self._fresh else None

    def state_dict(self) -> dict[str, Any]:
        """Per key whether its last two exchanges sent it compressed (what a resumed run
        needs: the squares and fresh marks are read by the step after each exchange)."""
        return {"history": {key: list(pair) for key, pair in self._history.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a bad entry is a ``ValueError`` and changes nothing."""
        history = state.get("history") if isinstance(state, Mapping) else None
        if not isinstance(history, Mapping):
            raise ValueError(f"noise state must be a Mapping with 'history', got {state!r:.80}")
        for key, pair in history.items():
            if (not isinstance(pair, list | tuple) or len(pair) != 2
                    or not all(isinstance(b, bool) for b in pair)):  # fmt: skip
                raise ValueError(f"noise history[{key!r}] must be [now, before] bools, "
                                 f"got {pair!r}")  # fmt: skip
        self._history = {key: (pair[0], pair[1]) for key, pair in history.items()}
        self._squares, self._fresh = {}, set()

    def rename(self, old: Hashable, new: Hashable) -> None:
        """Move ``old``'s records to ``new``."""
        if old in self._history:
            self._history[new] = self._history.pop(old)
        if old in self._squares:
            self._squares[new] = self._squares.pop(old)
        if old in self._fresh:
            self._fresh.discard(old)
            self._fresh.add(new)
