"""Accordion across the replicas of FSDP2's hybrid sharding (HSDP).

Shows ``accordion.FSDPState``: 4 processes on a 2-D ``(replicate, shard)`` device mesh,
2 replicas of the model each sharded over 2 processes. FSDP2 shards over the *shard*
dimension only (``fully_shard(..., mesh=mesh["shard"])``) and reduce-scatters inside a
replica; the all-reduce across replicas, the slow link between hosts in a real cluster,
is Accordion's, compressed, from FSDP's all-reduce hook. PowerSGD's rank walks down the
ladder 4, 2, 1 over 4 epochs; rank 0 prints the levels each epoch used and the bytes
its shard sent across replicas against the dense all-reduce's.

Run it on CPU with four processes::

    torchrun --standalone --nproc-per-node 4 examples/fsdp_hsdp.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import accordion
from accordion import summarize

REPLICAS, SHARDS = 2, 2
EPOCHS, STEPS, BATCH = 4, 3, 16
FEATURES, OUTPUTS = 32, 16


def batch(rank: int, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic regression batch, different on each of the 4 ranks (FSDP is data
    parallel over all of them), from a fixed random linear map of unit variance."""
    teacher = torch.randn(FEATURES, OUTPUTS, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1000 * rank + 10 * epoch + step)
    x = torch.randn(BATCH, FEATURES, generator=gen)
    return x, x @ teacher / FEATURES**0.5


def sharded_model(mesh) -> nn.Module:
    """The model, each linear layer its own FSDP parameter group, sharded within a replica."""
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, OUTPUTS))  # fmt: skip
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer, mesh=mesh["shard"])  # the shard dimension only: not native HSDP
    fully_shard(net, mesh=mesh["shard"])
    return net


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    net = sharded_model(mesh)
    # registers the all-reduce hook of every FSDP module; each parameter's shard is a
    # block of its rows, a matrix that PowerSGD compresses
    state = accordion.FSDPState(net, mesh, compressor="powersgd", levels=(4, 2, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    # a decay after 2 epochs: the default (guarded) rule opens the last rung only then
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    used = []
    for epoch in range(EPOCHS):
        used.append(state.levels())
        for step in range(STEPS):
            x, y = batch(rank, epoch, step)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()  # reduce-scatter in the replica, Accordion across replicas
            optimizer.step()
        scheduler.step()
        state.end_epoch(optimizer)
    if rank == 0:
        print(f"loss: {loss.item():.3f}")
        print(summarize(state, used))
    dist.barrier()  # gloo: every rank gets here before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
