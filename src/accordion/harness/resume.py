"""Checkpoint sets of a run: resume from the newest complete one, refusing another run's,
and save one after an epoch (both collective)."""

from __future__ import annotations

import sys
from typing import Any

from ..checkpoint import Checkpointer, Restored
from .config import TrainConfig
from .loop import Run
from .records import RunResult

#: Settings that may change between a checkpoint and the run resuming from it.
_RESUMABLE_CHANGES = ("epochs", "out", "progress", "threads", "checkpoint_dir",
                      "checkpoint_every", "measure_compute")  # fmt: skip


def resume(run: Run, saver: Checkpointer | None, result: RunResult) -> tuple[int, float]:
    """Restore the newest complete checkpoint set, if any: the first epoch to train and
    the training time so far (s) (collective)."""
    if saver is None:
        return 0, 0.0
    if run.diloco is not None:  # each rank's own replica: restored from its own file below
        restored = saver.load_latest(batch=run.controller)
    else:
        restored = saver.load_latest(model=run.model, optimizer=run.optimizer,
                                     accordion=run.state, batch=run.controller)  # fmt: skip
    if restored is None:
        return 0, 0.0
    extra = restored.extra
    check_same_run(run.config, extra["config"], restored.path)
    if run.diloco is not None:
        _load_replica(run, extra, restored)
    if run.adam_noise is not None:  # the strategy, in the config, says it was saved
        run.adam_noise.load_state_dict(extra["adam_noise"])
    if run.momentum is not None:  # after the correction: a restored freeze removes it
        run.momentum.load_state_dict(extra["momentum"])
    if run.rank == 0:  # stderr: stdout holds the run's result
        print(f"resumed from {restored.path} (step {restored.step}: {restored.step} of "
              f"{run.config.epochs} epochs done)", file=sys.stderr, flush=True)  # fmt: skip
    run.traffic.load_state_dict(extra["traffic"])
    for record in extra["records"]:  # the logs hold every epoch, the resumed ones too
        result.epochs.append(record)
        run.logger.log(record)
    return restored.step, extra["train_time"]


def check_same_run(config: TrainConfig, saved: dict[str, Any], path) -> None:
    """Raise ``ValueError`` when ``config`` trains another run than the checkpoint's."""
    now = config.to_dict()
    # a setting newer than the checkpoint did not exist then: it was what its default is now
    saved = {**{k: v for k, v in TrainConfig().to_dict().items() if k not in saved}, **saved}
    # a cosine schedule spans the whole run: more epochs would change the rates so far
    free = [k for k in _RESUMABLE_CHANGES if k != "epochs" or config.schedule != "cosine"]
    changed = sorted(k for k in set(now) | set(saved) if k not in free
                     and now.get(k) != saved.get(k))  # fmt: skip
    if changed:
        pairs = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:5])
        raise ValueError(
            f"the checkpoint set {path} is of another run ({pairs}): resume with the same "
            "settings, or give another --checkpoint-dir"
        )


def save(run: Run, saver: Checkpointer, done: int, result: RunResult, train_time: float):
    """Write the checkpoint set after ``done`` epochs (collective)."""
    extra = {"records": result.epochs, "train_time": train_time,
             "traffic": run.traffic.state_dict(), "config": run.config.to_dict()}  # fmt: skip
    if run.adam_noise is not None:
        extra["adam_noise"] = run.adam_noise.state_dict()
    if run.momentum is not None:
        extra["momentum"] = run.momentum.state_dict()
    if run.diloco is not None:  # the replicas differ between syncs: every rank saves its own
        extra["replica"] = {"model": run.model.state_dict(),
                            "optimizer": run.optimizer.state_dict(),
                            "diloco": run.diloco.state_dict()}  # fmt: skip
        saver.save(done, batch=run.controller, extra=extra)
        return
    saver.save(done, model=run.model, optimizer=run.optimizer, accordion=run.state,
               batch=run.controller, extra=extra)  # fmt: skip


def _load_replica(run: Run, extra: dict[str, Any], restored: Restored) -> None:
    """A DiLoCo run's model, inner optimiser and rounds, from this rank's own file."""
    assert run.diloco is not None  # called for DiLoCo runs only
    if restored.saved_world_size != run.world:
        raise ValueError(
            f"the checkpoint set {restored.path} was saved by {restored.saved_world_size} workers: "
            f"a DiLoCo run resumes only on as many (its replicas differ between syncs), got "
            f"{run.world}"
        )
    replica = extra.get("replica")
    if replica is None:
        raise ValueError(f"the checkpoint set {restored.path} holds no DiLoCo replica: it is "
                         "not a DiLoCo run's")  # fmt: skip
    run.diloco.load_state_dict(replica["diloco"])  # checks everything before it changes
    run.model.load_state_dict(replica["model"])
    run.optimizer.load_state_dict(replica["optimizer"])
