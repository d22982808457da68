"""Accordion with the Hugging Face ``Trainer``, through ``AccordionTrainerCallback``.

Shows ``accordion.integrations.transformers.AccordionTrainerCallback``: the Trainer has
no comm-hook option and wraps the model in DDP inside ``train()``, so the callback,
attached to the trainer, registers the hook on ``trainer.model_wrapped`` when training
begins and ends every optimizer step in the state. The model is a tiny GPT-2 built from
a config (nothing is downloaded), trained as a causal language model on random tokens.
The state checks every 2 steps; PowerSGD's rank walks down the ladder 4, 2, 1. Rank 0
prints the levels each step used and the bytes sent against dense DDP's.

Run it on CPU with two processes::

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py
"""

import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import accordion
from accordion import summarize
from accordion.integrations.transformers import AccordionTrainerCallback

STEPS, VOCAB, LENGTH = 8, 64, 16


class Tokens(Dataset):
    """Random token sequences, the same on every rank (the Trainer's sampler splits them)."""

    def __init__(self, size: int = 64):
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (size, LENGTH), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}  # the model shifts labels


class LevelLog(TrainerCallback):
    """The levels each optimizer step uses, read as it begins."""

    def __init__(self, state: accordion.AccordionState):
        self.state = state
        self.used: list[dict] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.used.append(self.state.levels())


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)  # fmt: skip
    return GPT2LMHeadModel(config)


def main(output_dir: str) -> None:
    model = tiny_gpt2()
    # the default ladder, int8 then int4: PowerSGD's low ranks cost transformers trained
    # with AdamW quality (docs/choosing.md). wait_for_decay=False: 8 steps see no
    # learning-rate decay, and the guarded rule would keep the last rung closed until one;
    # in real training keep it
    rule = accordion.GuardedRule(wait_for_decay=False)
    state = accordion.AccordionState(model, interval=2, interval_unit="step", rule=rule)
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, ddp_backend="gloo",
                             per_device_train_batch_size=4, max_steps=STEPS,
                             ddp_find_unused_parameters=False,  # every parameter is used
                             lr_scheduler_type="constant", learning_rate=1e-3,
                             report_to="none", save_strategy="no", logging_strategy="no",
                             disable_tqdm=True)  # fmt: skip
    log = LevelLog(state)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[log])
    AccordionTrainerCallback(state).attach(trainer)  # registers at on_train_begin
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"loss: {result.training_loss:.3f}")
        print(summarize(state, log.used))
    dist.barrier()  # gloo: every rank gets here before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    # the Trainer needs an output folder; with save_strategy="no" nothing is written there
    with tempfile.TemporaryDirectory(prefix="accordion-hf-") as folder:
        main(folder)
