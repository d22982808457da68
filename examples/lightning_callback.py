"""Accordion in a PyTorch Lightning DDP fit, through ``AccordionCallback``.

Shows ``accordion.integrations.lightning.AccordionCallback``: it registers the hook on
the DDP module Lightning built (on any device: ``DDPStrategy(ddp_comm_hook=...)`` would
register it only on CUDA, and on CPU train dense without a word) and ends each epoch
in the state once every scheduler has stepped. The state is built without a model and
bound to the LightningModule when the fit starts, so its keys are the parameter names.
PowerSGD's rank walks down the ladder 4, 2, 1 over 4 epochs; rank 0 prints the levels
each epoch used and the bytes sent against dense DDP's.

Run it on CPU with two processes (Lightning reads torchrun's environment and starts
no processes of its own)::

    torchrun --standalone --nproc-per-node 2 examples/lightning_callback.py
"""

import logging

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accordion
from accordion import summarize
from accordion.integrations.lightning import AccordionCallback

EPOCHS, SAMPLES, BATCH = 4, 256, 32  # 4 steps per rank and epoch
FEATURES, CLASSES = 32, 8


class Net(pl.LightningModule):
    """A small MLP on synthetic samples labelled by a fixed random linear map."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64),
                                 nn.ReLU(), nn.Linear(64, CLASSES))  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)  # this rank's, for the print at the end
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        # a decay after 2 epochs: the default (guarded) rule opens the last rung only then
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        teacher = torch.randn(FEATURES, CLASSES, generator=gen)
        x = torch.randn(SAMPLES, FEATURES, generator=gen)
        # Lightning adds a DistributedSampler: each rank trains on its half
        return DataLoader(TensorDataset(x, (x @ teacher).argmax(dim=1)), batch_size=BATCH)


class LevelLog(pl.Callback):
    """The levels each epoch's steps use, read at its first batch: after
    AccordionCallback (earlier in the callback list) ended the previous epoch."""

    def __init__(self, state: accordion.AccordionState):
        self.state = state
        self.used: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.used.append(self.state.levels())


def main() -> None:
    for name in ("lightning.pytorch", "lightning.fabric"):  # no banners, once per rank
        logging.getLogger(name).setLevel(logging.WARNING)
    state = accordion.AccordionState(None, "powersgd", levels=(4, 2, 1))
    log = LevelLog(state)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=EPOCHS,
                         strategy=DDPStrategy(process_group_backend="gloo"),
                         callbacks=[AccordionCallback(state), log], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    trainer.fit(Net())
    if trainer.is_global_zero:
        print(f"loss: {trainer.callback_metrics['train_loss'].item():.3f}")
        print(summarize(state, log.used))
    dist.barrier()  # gloo: every rank gets here before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
