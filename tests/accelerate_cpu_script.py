"""A small Accordion training run for ``accelerate launch`` on CPU (not a test module).

``tests/test_integration_accelerate.py`` launches it with the command that gives two
CPU processes::

    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 \\
        tests/accelerate_cpu_script.py

(``--cpu --num_processes 2`` starts one process). Each process prints one line,
``ACCORDION_RESULT {json}``, with what it saw: its rank, the number of processes, the
optimizer steps the state counted and the floats it sent against dense.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accordion.ddp import AccordionState
from accordion.integrations import accelerate as acc
from accordion.policy import GuardedRule

#: The prefix of the line each process prints.
PREFIX = "ACCORDION_RESULT "


def main() -> None:
    accelerator = Accelerator(cpu=True)  # gloo, from the launcher's environment
    torch.manual_seed(0)  # the same model and data on every rank
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    state = AccordionState(net, "powersgd", levels=(4, 2, 1), interval=2, interval_unit="step",
                           rule=GuardedRule(wait_for_decay=False))  # fmt: skip
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    model, optimizer, loader = accelerator.prepare(net, optimizer, DataLoader(data, 16))
    model = acc.register(accelerator, model, state)
    for x, y in loader:
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        acc.end_step(accelerator, state, optimizer)
    stats = state.stats()
    result = {"rank": accelerator.process_index, "processes": accelerator.num_processes,
              "steps": stats["step"], "total_floats": stats["total_floats"],
              "dense_floats": stats["dense_floats"]}  # fmt: skip
    os.write(1, f"{PREFIX}{json.dumps(result)}\n".encode())  # one write: lines do not interleave
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)  # gloo may abort in static destructors at exit (see tests/distributed.py)


if __name__ == "__main__":
    main()
