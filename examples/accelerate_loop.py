"""Accordion with Hugging Face Accelerate, with gradient accumulation.

Shows ``accordion.integrations.accelerate``: ``register`` puts the hook on the DDP
module that ``accelerator.prepare`` returned (Accelerate's own ``comm_hook`` option
takes only PyTorch's hooks), and ``end_epoch`` ends each epoch in the state. With
``gradient_accumulation_steps=2`` the gradients travel, compressed, on every second
micro-batch only. PowerSGD's rank walks down the ladder 4, 2, 1 over 4 epochs; the
main process prints the levels each epoch used and the bytes sent against dense DDP's.

Run it on CPU with two processes (``--cpu --num_processes 2`` would start one: on CPU
it takes ``--multi_gpu`` and ``Accelerator(cpu=True)``; port 0 picks a free one)::

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no --main_process_port 0 examples/accelerate_loop.py
"""

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accordion
from accordion import summarize
from accordion.integrations import accelerate as acc

EPOCHS, SAMPLES, BATCH = 4, 256, 16  # 8 micro-batches, 4 optimizer steps per rank and epoch
FEATURES, CLASSES = 32, 8


def dataset() -> TensorDataset:
    """Synthetic samples labelled by a fixed random linear map; the prepared loader
    gives each process its own share of them."""
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def main() -> None:
    # cpu=True: gloo on the CPU, from the launcher's environment
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, CLASSES))  # fmt: skip
    # built from the unprepared net, so that its keys are the parameter names
    state = accordion.AccordionState(net, "powersgd", levels=(4, 2, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    # stepped by hand once per epoch, not prepared: a prepared scheduler steps once per
    # process at each call, for schedules counted in optimizer steps
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    model = acc.register(accelerator, model, state)  # the hook, on the prepared DDP module
    used = []
    for _ in range(EPOCHS):
        used.append(state.levels())
        for x, y in loader:
            with accelerator.accumulate(model):  # no_sync on the first micro-batch of 2
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        scheduler.step()
        acc.end_epoch(accelerator, state, optimizer)
    if accelerator.is_main_process:
        print(f"loss: {loss.item():.3f}")
        print(summarize(state, used))
    accelerator.wait_for_everyone()  # gloo: every rank gets here before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
