"""The statistics a rule decides from, gathered on this rank: the paper's gradient sums.

Non-finite gradients: a step whose gradient of a layer holds an inf or NaN (an AMP
overflow that ``GradScaler`` skips, say) adds nothing to that layer's sum and is counted
as skipped, on this rank. The test runs on the device (no host sync in the DDP hook);
the counts are read at the check. A layer whose every step of a period was skipped has
no statistic for that period (:meth:`GradientSums.valid`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ._validate import check_int, check_state_keys, check_tensor_shapes

#: The keys of a :meth:`GradientSums.state_dict`; a plain map of tensors is the sums alone
#: (checkpoints written before the count of skipped steps).
STATE_KEYS = frozenset({"sums", "steps", "skipped", "skipped_total"})


def shard_owners(shapes: Mapping[str, Sequence[int]], world_size: int) -> dict[str, int]:
    """Which rank keeps each layer's sum under ``statistic="sharded"``: the layers dealt
    out largest first, each to the rank holding the fewest elements so far (ties: the
    lower rank; layers of one size: in ``shapes``' order). The same on every rank,
    given the same ``shapes`` in the same order."""
    check_int("world_size", world_size, 1)
    sizes = {key: math.prod(shape) for key, shape in shapes.items()}
    load = [0] * world_size
    owners: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: -sizes[k]):  # stable: ties keep their order
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[key] = rank
        load[rank] += sizes[key]
    return owners


class GradientSums:
    """Per layer, the local gradient summed over the steps since the last check, in fp32
    (an epoch of fp16 gradients can overflow fp16): the paper's ``D_e``.

    A gradient that is not finite is left out of the sum and counted as skipped (see the
    module docstring).
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._steps: dict[str, int] = {}  # gradients offered since the last check (host)
        # per key, on the gradients' device: [skipped since the last check, skipped ever]
        self._skipped: dict[str, torch.Tensor] = {}

    def add(self, key: str, grad: torch.Tensor) -> None:
        """Add one step's gradient of ``key``, unless it holds an inf or NaN: then add
        nothing and count the step as skipped (no host sync: all on the device)."""
        grad = grad.detach()
        acc = self._sums.get(key)
        if acc is None:
            acc = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
            self._sums[key] = acc
        finite = torch.isfinite(grad).all()
        acc.add_(torch.where(finite, grad, 0))  # one bad step must not poison the period
        skipped = self._skipped.get(key)
        if skipped is None:
            skipped = self._skipped[key] = torch.zeros(2, dtype=torch.int64, device=acc.device)
        skipped.add_(~finite)  # broadcast: both counters
        self._steps[key] = self._steps.get(key, 0) + 1

    def __contains__(self, key: object) -> bool:
        return key in self._sums

    def keys_in(self, order: Iterable[str]) -> list[str]:
        """The keys with a sum, in the order of ``order``."""
        return [k for k in order if k in self._sums]

    def norms(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """The L2 norm of each key's sum (0-d tensors, on the gradients' device)."""
        return [torch.linalg.vector_norm(self._sums[k]) for k in keys]

    def valid(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """Per key, whether its sum is a statistic of the period (0-d bool tensors, on the
        device): false when the period had gradients of it and every one was skipped."""
        flags = []
        for key in keys:
            steps, skipped = self._steps.get(key, 0), self._skipped.get(key)
            if steps == 0 or skipped is None:
                flags.append(torch.ones((), dtype=torch.bool, device=self._sums[key].device))
            else:
                flags.append(skipped[0] < steps)
        return flags

    def skipped_steps(self) -> dict[str, int]:
        """Per key, the gradients left out of the statistic because they were not finite,
        over the whole run (reads the device counters: a host sync)."""
        keys = [k for k in self._skipped]
        if not keys:
            return {}
        totals = torch.stack([self._skipped[k][1] for k in keys]).tolist()
        return {k: int(n) for k, n in zip(keys, totals) if n}

    @property
    def device(self) -> torch.device | None:
        """The device of the sums, or ``None`` before the first one."""
        return next(iter(self._sums.values())).device if self._sums else None

    def zero(self) -> None:
        """Start a new period: every sum back to 0 (the buffers are kept), and the period's
        counts of steps and skipped steps too (the run's count of skipped steps stays)."""
        for acc in self._sums.values():
            acc.zero_()
        for skipped in self._skipped.values():
            skipped[0].zero_()
        self._steps.clear()

    def forget(self, key: str) -> None:
        """Drop ``key``'s sum (a layer sent dense has no level to decide)."""
        self._sums.pop(key, None)
        self._steps.pop(key, None)
        self._skipped.pop(key, None)

    def rename(self, old: str, new: str) -> None:
        """Move ``old``'s sum and counts to ``new``."""
        tables: tuple[dict[str, Any], ...] = (self._sums, self._steps, self._skipped)
        for table in tables:
            if old in table:
                table[new] = table.pop(old)

    def check_shapes(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Raise ``ValueError`` unless every sum belongs to a key of ``shapes`` and has
        its shape (a loaded checkpoint's consistency)."""
        check_tensor_shapes("accumulators", self._sums, shapes, owner="parameter")

    def state_dict(self) -> dict[str, Any]:
        """The sums (cloned), and per key the period's steps and skipped steps and the
        run's skipped steps (plain ints: a host sync)."""
        keys = list(self._skipped)
        counts = torch.stack([self._skipped[k] for k in keys]).tolist() if keys else []
        return {
            "sums": {k: a.clone() for k, a in self._sums.items()},
            "steps": dict(self._steps),
            "skipped": {k: int(c[0]) for k, c in zip(keys, counts)},
            "skipped_total": {k: int(c[1]) for k, c in zip(keys, counts)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (or the plain map of sums of checkpoints written
        before the counts); raises ``ValueError`` naming the bad entry, and changes
        nothing, for anything else."""
        if not isinstance(state, Mapping):
            raise ValueError(f"accumulators must be a Mapping, got {type(state).__name__}")
        if all(isinstance(t, torch.Tensor) for t in state.values()):
            state = {"sums": state, "steps": {}, "skipped": {}, "skipped_total": {}}
        check_state_keys(state, STATE_KEYS, "GradientSums")
        sums = _tensors(state["sums"])
        counts = {name: _counts(name, state[name], sums) for name in sorted(STATE_KEYS - {"sums"})}
        steps, total = counts["steps"], counts["skipped_total"]
        for key, skipped in counts["skipped"].items():
            if skipped > steps.get(key, 0) or skipped > total.get(key, 0):
                raise ValueError(
                    f"accumulators skipped[{key!r}] = {skipped} exceeds its steps or "
                    "skipped_total"
                )
        self._sums = sums
        self._steps = dict(counts["steps"])
        self._skipped = {}
        for key in counts["skipped"].keys() | counts["skipped_total"].keys():
            pair = [counts["skipped"].get(key, 0), counts["skipped_total"].get(key, 0)]
            self._skipped[key] = torch.tensor(pair, dtype=torch.int64, device=sums[key].device)


def _tensors(sums: Any) -> dict[str, torch.Tensor]:
    """The loaded sums, cloned: floating-point tensors keyed by str."""
    if not isinstance(sums, Mapping):
        raise ValueError(f"accumulators sums must be a Mapping, got {type(sums).__name__}")
    for key, acc in sums.items():
        if not isinstance(key, str):
            raise ValueError(f"accumulators keys must be parameter keys (str), got {key!r}")
        if not isinstance(acc, torch.Tensor) or not acc.is_floating_point():
            raise ValueError(
                f"accumulators[{key!r}] must be a floating-point tensor, got {acc!r:.80}"
            )
    # Non-finite values are accepted: versions before the finite check could save them,
    # and the next check leaves such a layer's rung as it is and starts it anew.
    return {k: a.clone() for k, a in sums.items()}


def _counts(name: str, counts: Any, sums: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """One loaded table of counts: ints >= 0 for keys with a sum."""
    if not isinstance(counts, Mapping):
        raise ValueError(f"accumulators {name} must be a Mapping, got {type(counts).__name__}")
    checked = {}
    for key, value in counts.items():
        if key not in sums:
            raise ValueError(f"accumulators {name}[{key!r}] is for a key without a sum")
        try:
            checked[key] = check_int(f"accumulators {name}[{key!r}]", value, 0)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
    return checked
