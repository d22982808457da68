"""Which signal says how long a local-SGD round may be on the MNIST-1D CNNs?

Local SGD with int2 syncs kept dense accuracy at H = 100 on six MNIST-1D workloads and
lost it on C, which needs H = 25 (``docs/diloco.md``). This probe asks whether the
replicas' disagreement over a round tells C from the others, so that a rule could choose
the base H. Two simulated workers train the workload's CNN with its SGD schedule, each on
its own half of every global batch (the harness's shards), and every H steps average
their parameters exactly (dense: the signal along the uncompressed trajectory; the
momentum buffers stay local, as in the harness). At each sync it records the round's

* ``spread``: ``|d0 - d1|^2 / |d0 + d1|^2``, d_i the worker's pseudo-gradient (its
  parameters' change over the round): 0 when the replicas moved alike, 1 when their
  moves were orthogonal and of one length;
* ``norm``: ``|(d0 + d1) / 2|``, and the learning rate at the round's start;
* ``replica_loss`` and ``penalty``: the replicas' mean loss on the first ``PROBE``
  training samples, and the average's loss there minus it (below 0: averaging helped);

and, at the end, the test accuracy of worker 0's parameters (the last sync's, plus the
steps after it). Everything goes to
``docs/results/round_drift_mnist1d.json``.

    PYTHONPATH=src .venv/bin/python benchmarks/rule_signals/round_drift.py [seeds]

The reported run: seeds 0 and 1, eight workloads, H = 25 and 100 (about 7 minutes on
one core). Neither signal tells C from the others: at H = 100 the spread at the peak
rate is 0.26-0.59 (C 0.27-0.28, among the lowest), and averaging lowered the probe loss
on every workload (by 9-32% of the replicas' on average; C the least). With exact syncs
C kept its accuracy at H = 100 (87.6% and 87.4%, H = 25: 87.1% and 88.1%): its loss in
the harness at H = 100 was the 2-bit syncs' (``docs/diloco.md``). Nor do they mark I,
which needs a sync every 25 steps at 4 bits where four other workloads need two in a
run: its spread at the peak rate at H = 100 is 0.50-0.51, mid-range, and averaging
lowered its probe loss by 15-19%, as elsewhere.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.utils import parameters_to_vector

from accordion.harness.config import TrainConfig
from accordion.harness.data import load_task
from accordion.harness.loop import epoch_steps, output_loss, train_batches
from accordion.models import get_model

WORKERS = 2
#: The workloads of docs/reproduction.md: TrainConfig fields over the defaults (A).
WORKLOADS = {
    "A": {},
    "B": {"train_samples": 8000, "epochs": 40, "schedule": "cosine", "warmup_epochs": 3},
    "C": {"train_samples": 2000, "batch_size": 64, "lr": 0.05, "epochs": 40,
          "decay_epochs": [20, 30], "warmup_epochs": 1},
    "E": {"train_samples": 6000, "batch_size": 96, "lr": 0.08, "epochs": 40,
          "warmup_epochs": 2, "decay_epochs": [28]},
    "F": {"train_samples": 5000, "batch_size": 80, "lr": 0.06, "epochs": 45,
          "warmup_epochs": 2, "decay_epochs": [25, 38], "decay_factor": 0.2},
    "G": {"train_samples": 3000, "batch_size": 48, "lr": 0.04, "epochs": 40,
          "warmup_epochs": 2, "schedule": "cosine", "min_lr_factor": 0.01},
    "H": {"train_samples": 2500, "batch_size": 40, "lr": 0.03, "epochs": 50,
          "warmup_epochs": 3, "decay_epochs": [30, 42]},
    "I": {"train_samples": 3500, "batch_size": 56, "lr": 0.07, "epochs": 36,
          "warmup_epochs": 1, "decay_epochs": [18, 27]},
}  # fmt: skip
SYNC_EVERY = (25, 100)
PROBE = 1024  # training samples whose loss the replicas and their average are scored on
OUT = Path(__file__).resolve().parents[2] / "docs" / "results" / "round_drift_mnist1d.json"


def flat(model: torch.nn.Module) -> torch.Tensor:
    """The parameters as one detached vector."""
    return parameters_to_vector(model.parameters()).detach()


def load_flat(model: torch.nn.Module, vector: torch.Tensor) -> None:
    """Copy ``vector`` into the parameters (each model keeps storage of its own:
    ``vector_to_parameters`` would make both replicas views of one tensor)."""
    params = list(model.parameters())
    with torch.no_grad():
        for p, part in zip(params, vector.split([p.numel() for p in params])):
            p.copy_(part.view_as(p))


def accuracy(model: torch.nn.Module, data) -> float:
    model.eval()
    with torch.no_grad():
        right = (model(data.x_test).argmax(1) == data.y_test).sum().item()
    model.train()
    return 100.0 * right / data.y_test.shape[0]


def run(config: TrainConfig, sync_every: int) -> dict:
    """One simulated local-SGD run: per-round records and the final accuracy."""
    data = load_task("mnist1d", train_samples=config.train_samples, seed=config.seed)
    torch.manual_seed(config.seed)
    models = [get_model(data.default_model, num_classes=data.num_classes)]
    models.append(get_model(data.default_model, num_classes=data.num_classes))
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=config.lr, momentum=config.momentum,
                                  weight_decay=config.weight_decay) for m in models]  # fmt: skip
    anchor, rounds, start_lr = flat(models[0]).clone(), [], None
    probe = (data.x_train[:PROBE], data.y_train[:PROBE])  # both workers' shards
    for t, (lr, batches) in enumerate(global_steps(data, config), start=1):
        start_lr = lr if start_lr is None else start_lr
        for model, optimizer, (x, y) in zip(models, optimizers, batches):
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            output_loss(model(x), y).backward()
            optimizer.step()
        if t % sync_every == 0:
            rounds.append(sync(models, anchor, t, start_lr, probe))
            anchor, start_lr = flat(models[0]).clone(), None
    return {"rounds": rounds, "accuracy": accuracy(models[0], data)}


def global_steps(data, config: TrainConfig):
    """Each step's scheduled rate and the workers' batches (the harness's shards)."""
    steps = epoch_steps(data, config, WORKERS, config.batch_size)
    for epoch in range(config.epochs):
        shards = [train_batches(data, config, w, WORKERS, epoch, config.batch_size)
                  for w in range(WORKERS)]  # fmt: skip
        for step, batches in enumerate(zip(*shards)):
            yield config.lr_at(epoch + step / steps), batches


def probe_loss(model: torch.nn.Module, probe) -> float:
    """The mean training loss on the probe samples (eval mode: no state changes)."""
    model.eval()
    with torch.no_grad():
        loss = float(output_loss(model(probe[0]), probe[1]))
    model.train()
    return loss


def sync(models: list[torch.nn.Module], anchor: torch.Tensor, t: int, lr: float,
         probe) -> dict:  # fmt: skip
    """Average the replicas exactly; the round's spread, norm, starting rate and what
    the average does to the probe loss."""
    moves = [anchor - flat(m) for m in models]
    total, gap = moves[0] + moves[1], moves[0] - moves[1]
    own = statistics.fmean(probe_loss(m, probe) for m in models)
    average = anchor - total / 2
    for model in models:
        load_flat(model, average)
    spread = float(gap.square().sum() / total.square().sum().clamp_min(1e-30))
    return {"step": t, "lr": lr, "spread": spread, "norm": float(total.norm() / 2),
            "replica_loss": own, "penalty": probe_loss(models[0], probe) - own}  # fmt: skip


def summary(rounds: list[dict], peak: float) -> dict:
    """Mean spread at the peak rate (rounds starting at >= 90% of it) and after the
    first decay (rounds starting below half of it)."""
    high = [r["spread"] for r in rounds if r["lr"] >= 0.9 * peak]
    low = [r["spread"] for r in rounds if r["lr"] < 0.5 * peak]
    return {"peak": statistics.fmean(high) if high else None,
            "decayed": statistics.fmean(low) if low else None}  # fmt: skip


def main(seeds: int = 2) -> None:
    torch.set_num_threads(1)
    results = []
    for name, options in WORKLOADS.items():
        for h in SYNC_EVERY:
            for seed in range(seeds):
                config = TrainConfig(seed=seed, **options)
                result = run(config, h)
                result |= {"workload": name, "sync_every": h, "seed": seed,
                           **summary(result["rounds"], config.lr)}  # fmt: skip
                results.append(result)
                print(f"{name} H={h:3d} seed {seed}: spread at the peak rate "
                      f"{result['peak']:.3f}, after the decay {result['decayed']:.3f}, "
                      f"accuracy {result['accuracy']:.2f}%", flush=True)  # fmt: skip
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
