"""Writes tests/data/batch-controller-v1.pt with the code of commit 43b224e, before issue 23
(a ``BatchSizeController`` whose state holds a ``RegimeDetector``'s).

Run it against that code: ``mkdir /tmp/old && git archive 43b224e src | tar -x -C
/tmp/old`` then ``PYTHONPATH=/tmp/old/src python tests/data/make_batch_fixture.py [OUT]``
(``OUT`` defaults to the fixture's own path).

An adaptive controller is driven through epochs 0-5 with deterministic fake gradients (a
fixed direction times a per-epoch scale, plus a little noise), two optimizer steps of
epoch 6 are observed, and its ``state_dict`` is saved with those steps' partial sum in
it. Then epochs 6-8 run on; the fixture keeps their gradients, the batch sizes they gave,
the learning-rate factor at each of their steps, and the controller's history, checks and
state at the end. The saved state has a learning-rate decay override in force (epoch 5);
epoch 6 switches to the large batch, and a warm-up follows. The state of a controller in
fixed mode after two epochs is kept too.

The tests compare the decisions exactly but the tensors and norms only up to rounding, as
another CPU's kernels may round differently. A decision taken from a ratio close to
``ETA`` could flip with that rounding, so the script asserts that every ratio of every
check keeps at least ``MARGIN`` (relative) away from it.
"""

import sys
from pathlib import Path

import torch
from fixture_checks import check_clear_of_threshold

from accordion.batch import BatchSizeController

ETA = 0.5
CONFIG = {"small": 8, "large": 32, "micro_batch": 2, "world_size": 2, "interval": 2,
          "eta": ETA, "warmup_steps": 6}  # fmt: skip
#: Per epoch: (scale of the gradient, optimizer steps, lr_will_decay).
EPOCHS = [(1.0, 4, False), (3.0, 4, False), (1.1, 4, False), (1.0, 1, False),
          (1.05, 1, False), (1.0, 1, True), (1.0, 4, False), (2.0, 1, False),
          (0.3, 1, False)]  # fmt: skip
#: Steps of epoch 6 observed before the state is saved.
SAVED_AFTER = 2
#: A controller in fixed mode, whose state is also kept after epochs 0 and 1.
FIXED = {**CONFIG, "mode": "fixed", "fixed_switch_epoch": 1}


def make_grads(gen, direction, scale):
    """One step's gradients: ``scale`` times the direction plus noise of 1 %."""
    return [scale * d + 0.01 * torch.randn(d.shape, generator=gen) for d in direction]


def main():
    gen = torch.Generator().manual_seed(0)
    direction = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
    ctrl = BatchSizeController(**CONFIG)
    decided, grads_after, lr_factors, saved = [], [], [], None
    for epoch, (scale, steps, decay) in enumerate(EPOCHS):
        for step in range(steps):
            if epoch == 6 and step == SAVED_AFTER:
                saved = ctrl.state_dict()
            grads = make_grads(gen, direction, scale)
            if saved is not None:
                grads_after.append(grads)
                lr_factors.append(ctrl.lr_factor())
            ctrl.observe(grads)
            ctrl.step()
        decided.append(ctrl.end_epoch(epoch, lr_will_decay=decay))
    check_clear_of_threshold(ctrl.checks, ETA)
    out = {
        "config": CONFIG,
        "epochs": EPOCHS,
        "saved_after": SAVED_AFTER,
        "checkpoint": saved,
        # the gradients of every step from the save on, in order
        "grads_after": grads_after,
        "after": {
            "decided": decided[6:],
            "history": ctrl.history,
            "checks": ctrl.checks,
            "lr_factors": lr_factors,
            "lr_factor": ctrl.lr_factor(),
            "state": ctrl.state_dict(),
        },
    }
    fixed = BatchSizeController(**FIXED)
    fixed.end_epoch(0)
    fixed.end_epoch(1, lr_will_decay=True)
    out["fixed"] = {"config": FIXED, "state": fixed.state_dict()}
    target = (
        Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "batch-controller-v1.pt"
    )
    torch.save(out, target)
    print(decided, saved["detector"]["decay_override"], saved["warmup_from"])


if __name__ == "__main__":
    main()
