"""Accordion's second lever: the global batch size, small in critical regimes, large elsewhere.

Agarwal et al. (MLSys 2021) also cut communication by taking fewer optimizer steps: one
all-reduce per *global* batch, so a batch 8x larger sends 8x fewer floats per epoch. They
train with the small batch (512) in critical regimes and the large one (4096) elsewhere,
deciding on the whole model's gradient. The paper released no code for it and its runs used
a fixed schedule (small for epochs 0-19, then large); :class:`BatchSizeController` offers
both (``mode="fixed"`` and ``mode="adaptive"``).

The adaptive mode is the policy layer's, as for compression levels: a
:class:`~accordion.policy.Ladder` of two :class:`BatchSizes`, the paper rule
(:class:`~accordion.policy.PaperRule`) on one "tensor" named ``"model"``, checked on an epoch
:class:`~accordion.policy.Schedule`. Only the statistic differs: the norm of the epoch's
*mean* per-step gradient, comparable across batch sizes (``accordion.batch.statistic``).

* ``controller`` -- :class:`BatchSizeController`, the batch in force and what follows from
  it, and :func:`accumulation_loss_scale`;
* ``decider`` -- ``BatchDecider``, which batch each next epoch trains with (fixed or the
  paper rule);
* ``levels`` -- :class:`BatchSizes`, global batch sizes as a ladder's levels;
* ``statistic`` -- ``MeanGradient``, the mean gradient of an epoch, summed in
  ``accordion.statistics.GradientSums``;
* ``lr`` -- ``LearningRate``, the learning-rate factor and its warm-up after a switch;
* ``state`` -- the checkpoint layout and its checks.

Gradient accumulation: a global batch of ``B`` samples on ``W`` workers with micro-batches of
``b`` samples is ``B // (b * W)`` forward/backward passes per worker, each loss multiplied by
:func:`accumulation_loss_scale`, then one optimizer step. The harness skips the all-reduce on
all but the last micro-batch (DDP's ``no_sync()``)::

    scale = accumulation_loss_scale(controller.accumulation_steps)
    for i, (x, y) in enumerate(micro_batches):
        last = (i + 1) % controller.accumulation_steps == 0
        with contextlib.nullcontext() if last else model.no_sync():
            (loss_fn(model(x), y) * scale).backward()
        if last:
            controller.observe([p.grad for p in model.parameters()])
            for group in optimizer.param_groups:
                group["lr"] = base_lr * controller.lr_factor()
            optimizer.step()
            optimizer.zero_grad()
            controller.step()
    batch_size = controller.end_epoch(epoch, lr_will_decay=...)

Pure logic and a few tensor additions: no ``torch.distributed``.
"""

from .controller import LR_SCALINGS, MODES, BatchSizeController, accumulation_loss_scale
from .levels import BatchSizes

__all__ = ["MODES", "LR_SCALINGS", "BatchSizeController", "BatchSizes", "accumulation_loss_scale"]
