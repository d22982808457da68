"""The ranks' agreement on where they are, before a decision at ``end_epoch``/``end_step``,
and on the decision itself (:func:`agreed_rungs`).

Every rank takes the same decision only if every rank asks at the same point: the same
epoch (or step), the same learning rate, the same decay. A rank that calls ``end_epoch``
once more than the others, or reads a different learning rate, would otherwise go on
with other levels than its peers, and the next step would fail inside the backend (or
hang). One small all-gather, before anything changes, turns that into an error on every
rank that names each rank's values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .compress.transport import AllGather, Broadcast, Exchange

#: What each call asks the training loop to do, quoted by the error.
HINTS = {
    "end_epoch": "every rank must call end_epoch once per epoch, after the same scheduler step",
    "end_step": "every rank must call end_step once per optimizer step, after the same "
    "scheduler step",
}


def check_agreement(
    transport: Any,
    call: str,
    counter: tuple[str, int],
    lr: float | None,
    decay: bool,
    device: torch.device | None = None,
) -> None:
    """Raise ``RuntimeError`` on every rank unless all ranks of ``transport`` give the same
    ``counter`` (its name and value), learning rate and decay flag. One all-gather of four
    float64 values; nothing with a single worker.

    ``call`` names the caller (``"end_epoch"``) in the message.
    """
    if transport.world_size == 1:
        return
    name, value = counter
    # lr None is sent as a flag (a NaN would not compare equal to itself)
    local = torch.tensor(
        [float(value), 0.0 if lr is None else float(lr), float(lr is None), float(decay)],
        dtype=torch.float64,
        device=device,
    )
    rows = transport.run(_gathered(AllGather(local))).cpu().tolist()
    if all(row == rows[0] for row in rows):
        return
    raise RuntimeError(disagreement_message(call, name, rows))


def disagreement_message(call: str, name: str, rows: Sequence[Sequence[float]]) -> str:
    """The error for ranks whose ``[counter, lr, lr is None, decay]`` rows differ."""
    counters = [int(row[0]) for row in rows]
    lrs = [None if row[2] else row[1] for row in rows]
    decays = [bool(row[3]) for row in rows]
    hint = HINTS.get(call, f"every rank must call {call} at the same point")
    return (
        f"ranks disagree at {call}: {name} {counters}, next lr {lrs}, decay {decays} "
        f"(per rank of the group): {hint}; this state was left unchanged"
    )


def agreement_device(transport: Any, hint: torch.device | None) -> torch.device | None:
    """Where the agreement's tensor must live: ``hint`` (the gradients' device) if known,
    else CUDA for an NCCL-only group (it cannot carry CPU tensors), else the CPU."""
    if hint is not None:
        return hint
    group = getattr(transport, "group", None)
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return None
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def agreed_rungs(transport: Any, keys: Sequence[str], rungs: Mapping[str, int],
                 device: torch.device | None = None) -> tuple[dict[str, int], bool]:  # fmt: skip
    """Rank 0's ``rungs`` of ``keys`` on every rank of ``transport`` (one broadcast; none
    with a single worker), and whether this rank's differed from them (a rule that read
    something besides its observation): ranks that sent different collectives would
    fail or hang at the next step."""
    if transport.world_size == 1:
        return dict(rungs), False
    local = torch.tensor([rungs.get(k, -1) for k in keys], dtype=torch.int64, device=device)
    agreed = local.clone()
    transport.run(_single(Broadcast(agreed, 0)))
    differed = not torch.equal(agreed, local)
    return {k: int(r) for k, r in zip(keys, agreed.tolist()) if r >= 0}, differed


def _single(op: Broadcast) -> Exchange[None]:
    """An exchange of one collective."""
    yield [op]


def _gathered(op: AllGather) -> Exchange[torch.Tensor]:
    """An exchange of one all-gather that returns its ``[W, *shape]`` result."""
    replies = yield [op]
    return replies[0]
