"""statistic="sharded": each layer's statistic summed on one rank, the layers dealt out."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.ddp import AccordionState
from accordion.fsdp import FSDPState
from accordion.statistics import shard_owners
from distributed import run_processes
from test_ddp import Net, batch


def test_layers_are_dealt_out_largest_first_to_the_least_loaded_rank():
    shapes = {"a": (10, 10), "b": (8, 8), "c": (6, 6), "d": (5, 5), "e": (2, 2)}
    # 100 -> 0, 64 -> 1, 36 -> 1 (64 < 100), 25 -> 0 (100 = 100: the lower rank), 4 -> 1
    assert shard_owners(shapes, 2) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}


def test_every_layer_has_one_owner_and_the_loads_stay_within_the_largest_layer():
    shapes = {f"w{i}": (i + 1, 7) for i in range(23)}
    owners = shard_owners(shapes, 4)
    assert set(owners) == set(shapes)
    loads = [sum(7 * (int(k[1:]) + 1) for k, r in owners.items() if r == rank) for rank in range(4)]
    assert max(loads) - min(loads) <= 23 * 7


def test_one_rank_owns_every_layer():
    assert set(shard_owners({"a": (3, 3), "b": (2, 2)}, 1).values()) == {0}


@pytest.mark.parametrize("world", [0, -1])
def test_a_world_size_below_one_is_a_value_error(world):
    with pytest.raises(ValueError, match="world_size"):
        shard_owners({"a": (3, 3)}, world)


def test_fsdp_refuses_the_sharded_statistic_naming_it():
    with pytest.raises(ValueError, match="sharded"):
        FSDPState(nn.Linear(4, 4), mesh=None, statistic="sharded")


def _sharded_run(rank, world_size, out_dir):
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)  # the local gradient, before any averaging
    model = DDP(net)
    state = AccordionState(net, "powersgd", levels=(4, 2, 1), statistic="sharded")
    state.register(model)
    seen = []
    decide = state.rule.decide

    def recording(observation, ladder):
        seen.append(dict(observation.grad_norms))
        return decide(observation, ladder)

    state.rule.decide = recording
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    local = []
    for epoch in range(3):
        sums = {}
        for step in range(3):
            x, y = batch(rank, 3 * epoch + step)
            reference.load_state_dict(net.state_dict())
            reference.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            for name, p in reference.named_parameters():
                if p.dim() >= 2:
                    sums[name] = sums.get(name, 0) + p.grad
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        local.append({k: float(v.norm()) for k, v in sums.items()})
        if epoch == 2:
            held = sorted(state.sums.keys_in(state.params.shapes))
        state.end_epoch(optimizer)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, local)
    torch.save({"seen": seen, "local": everyone, "held": held, "levels": state.levels()},
               f"{out_dir}/rank{rank}.pt")  # fmt: skip


def _resumed_run(rank, world_size, out_dir):
    """Two steps under "rank0", its checkpoint loaded by a default state, one more step."""
    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    old = AccordionState(net, "powersgd", levels=(4, 2, 1), statistic="rank0")
    old.register(ddp)
    for step in range(2):
        x, y = batch(rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
    keys = sorted(old.sums.keys_in(old.params.shapes))
    new = AccordionState(net, "powersgd", levels=(4, 2, 1))  # the default: "sharded"
    new.load_state_dict(old.state_dict())
    loaded = {"statistic": new.statistic, "norms": [float(v) for v in new.sums.norms(keys)],
              "old_norms": [float(v) for v in old.sums.norms(keys)], "keys": keys}  # fmt: skip
    ddp = DDP(net)
    new.register(ddp)
    x, y = batch(rank, 2)
    nn.functional.mse_loss(ddp(x), y).backward()
    loaded["held"] = sorted(new.sums.keys_in(new.params.shapes))
    torch.save(loaded, f"{out_dir}/rank{rank}.pt")


def _all_runs(rank, world_size, out_dir):
    # one pair of processes for all runs: starting them costs more than the training
    for name, run in (("bound", _sharded_run), ("lazy", _lazy_run), ("resumed", _resumed_run)):
        os.makedirs(f"{out_dir}/{name}", exist_ok=True)
        run(rank, world_size, f"{out_dir}/{name}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both ranks' records of a bound, a lazily bound and a resumed 2-process run."""
    out = tmp_path_factory.mktemp("sharded")
    run_processes(_all_runs, 2, str(out))
    return {name: [torch.load(out / name / f"rank{r}.pt", weights_only=False) for r in range(2)]
            for name in ("bound", "lazy", "resumed")}  # fmt: skip


def test_each_rank_sums_its_own_layers_and_every_rank_sees_each_owners_norms(runs):
    records = runs["bound"]
    shapes = {"fc1.weight": (32, 20), "fc2.weight": (32, 32), "fc3.weight": (4, 32)}
    owners = shard_owners(shapes, 2)
    assert set(owners.values()) == {0, 1}  # both ranks hold a share
    for rank, record in enumerate(records):
        assert record["held"] == sorted(k for k, r in owners.items() if r == rank)
    assert records[0]["seen"] == records[1]["seen"]  # one observation on every rank
    assert records[0]["levels"] == records[1]["levels"]
    local = records[0]["local"]  # per rank, per epoch: the local sums' norms
    assert len(records[0]["seen"]) == 3
    for epoch, observed in enumerate(records[0]["seen"]):
        assert set(observed) == set(shapes)
        for key, norm in observed.items():
            assert norm == pytest.approx(local[owners[key]][epoch][key], rel=1e-5), (epoch, key)
        # the ranks' local gradients differ, so the owner is what made the number
        for key in shapes:
            other = local[1 - owners[key]][epoch][key]
            assert observed[key] != pytest.approx(other, rel=1e-3), (epoch, key)


def _lazy_run(rank, world_size, out_dir):
    from accordion.ddp import accordion_hook

    torch.manual_seed(0)
    model = DDP(Net())
    state = AccordionState(None, "powersgd", levels=(4, 2, 1), statistic="sharded")
    model.register_comm_hook(state, accordion_hook)  # keys "#0", "#1", ... from the buckets
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    held = []
    for epoch in range(3):
        for step in range(3):
            x, y = batch(rank, 3 * epoch + step)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        held.append(sorted(state.sums.keys_in(state.params.shapes)))
        state.end_epoch(optimizer)
    checks = [sorted(c["layers"]) for c in state.stats()["checks"]]
    record = {"held": held, "checks": checks, "levels": state.levels()}
    torch.save(record, f"{out_dir}/rank{rank}.pt")


def test_bound_lazily_the_layers_are_dealt_out_after_the_first_step(runs):
    records = runs["lazy"]
    held = [set(r["held"][-1]) for r in records]
    assert held[0] and held[1] and not held[0] & held[1]  # dealt out, disjoint
    assert len(held[0] | held[1]) == 3  # the three weight matrices
    assert records[0]["checks"] == records[1]["checks"] and len(records[0]["checks"]) == 3
    assert all(len(layers) == 3 for layers in records[0]["checks"])
    assert records[0]["levels"] == records[1]["levels"]


def test_a_rank0_checkpoint_resumes_under_the_default_each_owner_keeping_its_sums(runs):
    shapes = {"fc1.weight": (32, 20), "fc2.weight": (32, 32), "fc3.weight": (4, 32)}
    owners = shard_owners(shapes, 2)
    for rank, record in enumerate(runs["resumed"]):
        assert record["statistic"] == "sharded"
        assert record["keys"] == sorted(shapes)  # under "rank0" every rank summed all
        assert record["norms"] == record["old_norms"]  # the period's sums came through
        assert record["held"] == sorted(k for k, r in owners.items() if r == rank)


def test_a_sharded_checkpoint_is_refused_by_a_rank0_state_naming_the_statistic():
    net = Net()
    saved = AccordionState(net, "powersgd", levels=(4, 2, 1)).state_dict()
    state = AccordionState(net, "powersgd", levels=(4, 2, 1), statistic="rank0")
    with pytest.raises(ValueError, match="statistic is 'sharded' but this state's is 'rank0'"):
        state.load_state_dict(saved)
