"""Does a language model's first DiLoCo rounds say whether it needs a warm-up?

DiLoCo with int2 rounds every 15 steps and no warm-up (``diloco:15:lr=0.5+static:int:2``)
kept DDP's quality on the held-out charlm-J and lost 2.2-3.4% of validation loss on
charlm-tiny (2 and 4 epochs) and charlm-small (8 paired seeds each, ``docs/diloco.md``);
on charlm-heldout it was within 1% by its mean only. A warm-up of short rounds rescues
those, at 0.79x of the bytes where none is needed. This probe asks whether the first
rounds already tell the workloads apart, so that a rule could start without a warm-up
and fall back to one only where it is needed.

Two simulated workers train the workload's transformer with its AdamW schedule and
clipping (each its own gradient, as DiLoCo's inner steps), each on its half of every
global batch (the harness's shards). Every ``H`` = 15 steps their pseudo-gradients are
averaged exactly (fp32 DiLoCo: the signal along the uncompressed trajectory; fp32
DiLoCo without a warm-up lost quality on charlm-tiny too) and DiLoCo's outer step (SGD,
Nesterov momentum 0.9, lr 0.5) moves the shared parameters; the AdamW states stay local.
At each round it records

* ``spread``: ``|d0 - d1|^2 / |d0 + d1|^2`` of the workers' pseudo-gradients;
* ``penalty``: the plain average's loss on ``PROBE`` training windows minus the
  replicas' mean loss there, relative to the latter (below 0: averaging helped), and
  ``outer_penalty``: the same for the parameters after the outer step;
* ``relative_norm``: ``|mean d| / |parameters|``; ``turn``: cos of this round's mean
  pseudo-gradient with the last one's.

for the first ``ROUNDS`` rounds. Everything goes to ``docs/results/lm_round_drift.json``.

    PYTHONPATH=src .venv/bin/python benchmarks/rule_signals/lm_round_drift.py [seeds] [workload ...]

(Named workloads only, their records to ``lm_round_drift-<names>.json``.)

The reported runs: seeds 0 and 1, the first five workloads (about 15 minutes on one
core), then charlm-tiny-ramp alone. Over the first 10 rounds spread, the outer step's
penalty and turn separate J from charlm-tiny and charlm-small, but J's spread lags by
about two rounds, in step with its slower learning-rate ramp; charlm-tiny with J's ramp
still needs the warm-up (8 seeds in the harness) and moves those signals part of the way
to J's (``docs/diloco.md``, "Does a run say early whether it needs a warm-up?").
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from round_drift import WORKERS, flat, global_steps, load_flat
from round_drift import probe_loss as mean_loss
from torch import nn

from accordion.harness.build import _build_model, make_optimizer
from accordion.harness.config import PRESETS, TrainConfig
from accordion.harness.data import load_task
from accordion.harness.loop import epoch_steps, output_loss

SYNC_EVERY, ROUNDS, PROBE = 15, 20, 256
HELDOUT = dict(
    task="charlm", model="transformer-small", bptt=128, train_samples=2048, test_samples=1024,
    batch_size=32, epochs=8, optimizer="adamw", lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01,
    warmup_epochs=0.8, schedule="cosine", min_lr_factor=0.0, clip=0.5,
)  # fmt: skip
J = dict(
    task="charlm", model="transformer-tiny", bptt=96, batch_size=48, train_samples=20000,
    test_samples=2048, epochs=3, optimizer="adamw", lr=2e-3, betas=(0.9, 0.95),
    weight_decay=0.1, warmup_epochs=0.2, schedule="cosine", min_lr_factor=0.1, clip=1.0,
)  # fmt: skip
#: The workloads, and whether DiLoCo without a warm-up kept DDP's quality (8 seeds).
WORKLOADS = {
    "charlm-tiny": (PRESETS["charlm-tiny"], "lost 2.63%"),
    "charlm-tiny-4epochs": ({**PRESETS["charlm-tiny"], "epochs": 4}, "lost 2.23%"),
    "charlm-small": (PRESETS["charlm-small"], "lost 3.39%"),
    "charlm-heldout": (HELDOUT, "within 1% by the mean (+0.98%)"),
    "charlm-J": (J, "kept (-0.01%)"),
    # added after the first five ran: charlm-tiny with J's slower ramp (90 steps)
    "charlm-tiny-ramp": ({**PRESETS["charlm-tiny"], "warmup_epochs": 0.2}, "see docs/diloco.md"),
}
OUT = Path(__file__).resolve().parents[2] / "docs" / "results" / "lm_round_drift.json"


def inner_step(model, optimizer, x, y, lr: float, clip: float | None) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    output_loss(model(x), y).backward()
    if clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


class Outer:
    """DiLoCo's outer step on a flat copy of the shared parameters."""

    def __init__(self, anchor: torch.Tensor):
        self.anchor = nn.Parameter(anchor.clone())
        self.optimizer = torch.optim.SGD([self.anchor], lr=0.5, momentum=0.9, nesterov=True)

    def step(self, delta: torch.Tensor) -> torch.Tensor:
        self.anchor.grad = delta.clone()
        self.optimizer.step()
        return self.anchor.detach().clone()


def sync(models, outer: Outer, last: torch.Tensor | None, probe) -> tuple[dict, torch.Tensor]:
    """Average the pseudo-gradients exactly, take the outer step; the round's signals."""
    anchor = outer.anchor.detach().clone()
    moves = [anchor - flat(m) for m in models]
    total, gap = moves[0] + moves[1], moves[0] - moves[1]
    mean = total / 2  # the averaged pseudo-gradient
    own = statistics.fmean(mean_loss(m, probe) for m in models)
    load_flat(models[0], anchor - mean)
    averaged = mean_loss(models[0], probe)
    shared = outer.step(mean)
    for model in models:
        load_flat(model, shared)
    after = mean_loss(models[0], probe)
    turn = None if last is None else float(torch.cosine_similarity(mean, last, dim=0))
    return {
        "spread": float(gap.square().sum() / total.square().sum().clamp_min(1e-30)),
        "penalty": (averaged - own) / own,
        "outer_penalty": (after - own) / own,
        "relative_norm": float(mean.norm() / anchor.norm()),
        "turn": turn,
        "replica_loss": own,
    }, mean


def run(config: TrainConfig) -> dict:
    """The first ``ROUNDS`` rounds of one simulated fp32 DiLoCo run."""
    data = load_task(config.task, train_samples=config.train_samples,
                     test_samples=config.test_samples, seed=config.seed,
                     bptt=config.bptt)  # fmt: skip
    torch.manual_seed(config.seed)
    models = [_build_model(config, data) for _ in range(WORKERS)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [make_optimizer(config, m) for m in models]
    outer, last, rounds = Outer(flat(models[0])), None, []
    probe = (data.x_train[:PROBE], data.y_train[:PROBE])
    for t, (lr, batches) in enumerate(global_steps(data, config), start=1):
        for model, optimizer, (x, y) in zip(models, optimizers, batches):
            inner_step(model, optimizer, x, y, lr, config.clip)
        if t % SYNC_EVERY == 0:
            record, last = sync(models, outer, last, probe)
            rounds.append({"step": t, "lr": lr, **record})
            if len(rounds) == ROUNDS:
                break
    return {
        "rounds": rounds,
        "steps_per_epoch": epoch_steps(data, config, WORKERS, config.batch_size),
    }


def summary(rounds: list[dict], first: int = 10) -> dict:
    """Each signal's mean over the first ``first`` rounds."""
    keys = ("spread", "penalty", "outer_penalty", "relative_norm", "turn")
    head = rounds[:first]
    return {k: statistics.fmean(r[k] for r in head if r[k] is not None) for k in keys}


def main(seeds: int = 2, names: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    results = []
    for name, (options, label) in WORKLOADS.items():
        if names and name not in names:
            continue
        for seed in range(seeds):
            config = TrainConfig(seed=seed, **options)
            result = run(config) | {"workload": name, "seed": seed, "no_warmup": label}
            result["first10"] = summary(result["rounds"])
            results.append(result)
            cells = ", ".join(f"{k} {v:+.4f}" for k, v in result["first10"].items())
            print(f"{name:20s} seed {seed} ({label}): {cells}", flush=True)
    out = OUT.with_name(f"{OUT.stem}-{'-'.join(names)}.json") if names else OUT
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, sys.argv[2:])
