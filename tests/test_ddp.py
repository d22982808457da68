"""The Accordion DDP hook in real gloo processes (2 and 4 workers)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.ddp import AccordionState, accordion_hook
from accordion.policy import PaperRule
from distributed import run_processes


class Net(nn.Module):
    """A small MLP: three weight matrices (compressed) and three biases (dense)."""

    def __init__(self, width: int = 32, unused: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(20, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, 4)
        self.spare = nn.Linear(width, 4) if unused else None

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def batch(rank: int, step: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(16, 20, generator=gen)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float() * torch.ones(16, 4)
    return x.to(dtype), y.to(dtype)


def train(model, optimizer, rank, steps, start=0, dtype=torch.float32):
    losses = []
    for step in range(start, start + steps):
        x, y = batch(rank, step, dtype)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


# --- dense level == plain DDP ---------------------------------------------------------


def _dense_matches_ddp(rank, world_size):
    torch.manual_seed(0)
    net_hook, net_plain = Net(), Net()
    net_plain.load_state_dict(net_hook.state_dict())
    hooked, plain = DDP(net_hook), DDP(net_plain)
    hooked.register_comm_hook(AccordionState(net_hook, compressor="dense"), accordion_hook)
    opt_h = torch.optim.SGD(hooked.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    train(hooked, opt_h, rank, 6)
    train(plain, opt_p, rank, 6)
    # bitwise: both divide the same buffer by the world size and sum it in one gloo
    # all-reduce, the same operations in the same order on the same machine
    for a, b in zip(params_of(net_hook), params_of(net_plain)):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("world_size", [2, 4])
def test_dense_level_leaves_parameters_bitwise_equal_to_plain_ddp(world_size):
    run_processes(_dense_matches_ddp, world_size)


def _all_1d_matches_ddp(rank, world_size):
    class Affine(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(20))
            self.shift = nn.Parameter(torch.zeros(20))

        def forward(self, x):
            return (x * self.scale + self.shift)[:, :4]

    torch.manual_seed(0)
    net_hook, net_plain = Affine(), Affine()
    hooked, plain = DDP(net_hook), DDP(net_plain)
    hooked.register_comm_hook(AccordionState(net_hook, "powersgd", 2, 1), accordion_hook)
    train(hooked, torch.optim.SGD(hooked.parameters(), lr=0.1), rank, 4)
    train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), rank, 4)
    for a, b in zip(params_of(net_hook), params_of(net_plain)):
        assert torch.equal(a, b)  # bitwise: the same division and all-reduce as DDP's


def test_a_model_of_only_1d_parameters_is_averaged_dense_like_plain_ddp():
    run_processes(_all_1d_matches_ddp, 2)


# --- static PowerSGD against PyTorch's hook --------------------------------------------


def _powersgd_against_torch(rank, world_size, out_dir):
    results = {}
    for which in ("accordion", "torch"):
        torch.manual_seed(0)
        net = Net(width=64)
        model = DDP(net)
        if which == "accordion":
            state = AccordionState(net, "powersgd", mild=2, aggressive=2)
            model.register_comm_hook(state, accordion_hook)
        else:
            state = torch_powersgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=2,
                start_powerSGD_iter=2,
                min_compression_rate=0,
                use_error_feedback=True,
                warm_start=True,
            )
            model.register_comm_hook(state, torch_powersgd.powerSGD_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = train(model, optimizer, rank, 60)
        results[which] = sum(losses[-10:]) / 10
        results[which + "_first"] = losses[0]
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def test_static_powersgd_trains_to_within_10_percent_of_pytorchs_powersgd_hook(tmp_path):
    run_processes(_powersgd_against_torch, 2, str(tmp_path))
    results = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert results["accordion"] < 0.5 * results["accordion_first"]  # it did train
    assert abs(results["accordion"] - results["torch"]) <= 0.10 * results["torch"]


# --- every rank agrees on the levels ----------------------------------------------------


def _levels_agree(rank, world_size, out_dir, statistic):
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    state = AccordionState(
        net, "powersgd", mild=4, aggressive=1, interval=1, rule=PaperRule(0.3), statistic=statistic
    )
    model.register_comm_hook(state, accordion_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[4], gamma=0.1)
    seen = []
    for epoch in range(7):
        for step in range(3):
            train(model, optimizer, rank, 1, start=epoch * 3 + step)
            everyone = [None] * world_size
            dist.all_gather_object(everyone, state.levels())
            assert all(levels == everyone[0] for levels in everyone), everyone
            seen.append(everyone[0])
        scheduler.step()
        state.end_epoch(optimizer)
    torch.save({"seen": seen, "checks": state.stats()["checks"]}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.parametrize("world_size,statistic", [(4, "rank0"), (2, "mean")])
def test_every_rank_holds_the_same_levels_at_every_step(tmp_path, world_size, statistic):
    run_processes(_levels_agree, world_size, str(tmp_path), statistic)
    record = torch.load(tmp_path / "rank0.pt", weights_only=False)
    levels = [set(step.values()) for step in record["seen"]]
    assert 1 in set().union(*levels), "no layer ever switched to the aggressive level"
    # the 4th scheduler.step() (after epoch 3) lowers the lr: epoch 4's steps are all mild
    assert all(lv == {4} for lv in levels[12:15])
    assert levels[9:12] != [{4}] * 3  # while before the decay some layer was aggressive


# --- resume ----------------------------------------------------------------------------


def _make_adaptive(rank):
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    state = AccordionState(net, "powersgd", mild=4, aggressive=1, interval=2, rule=PaperRule(0.3))
    model.register_comm_hook(state, accordion_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return net, model, state, optimizer


def _run_epochs(model, state, optimizer, rank, first, last):
    for epoch in range(first, last):
        train(model, optimizer, rank, 4, start=4 * epoch)
        state.end_epoch(optimizer)


def _straight(rank, world_size, out_dir):
    net, model, state, optimizer = _make_adaptive(rank)
    _run_epochs(model, state, optimizer, rank, 0, 6)
    torch.save(params_of(net), f"{out_dir}/straight{rank}.pt")


def _first_half(rank, world_size, out_dir):
    net, model, state, optimizer = _make_adaptive(rank)
    _run_epochs(model, state, optimizer, rank, 0, 3)
    torch.save(
        {"model": net.state_dict(), "optimizer": optimizer.state_dict()},
        f"{out_dir}/train{rank}.pt",
    )
    torch.save(state.state_dict(), f"{out_dir}/accordion-rank{rank}.pt")


def _second_half(rank, world_size, out_dir):
    net, model, state, optimizer = _make_adaptive(rank)
    checkpoint = torch.load(f"{out_dir}/train{rank}.pt", weights_only=True)
    net.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    state.load_state_dict(torch.load(f"{out_dir}/accordion-rank{rank}.pt", weights_only=True))
    _run_epochs(model, state, optimizer, rank, 3, 6)
    torch.save(params_of(net), f"{out_dir}/resumed{rank}.pt")


def test_resume_from_a_checkpoint_gives_the_same_parameters_as_training_straight(tmp_path):
    run_processes(_straight, 2, str(tmp_path))
    run_processes(_first_half, 2, str(tmp_path))
    run_processes(_second_half, 2, str(tmp_path))
    straight = torch.load(tmp_path / "straight0.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed0.pt", weights_only=True)
    for a, b in zip(straight, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# --- unused parameters, lazy binding, precision ------------------------------------------


def _unused_parameters(rank, world_size):
    torch.manual_seed(0)
    net = Net(unused=True)
    model = DDP(net, find_unused_parameters=True)
    state = AccordionState(net, "powersgd", mild=2, aggressive=1, interval=1)
    model.register_comm_hook(state, accordion_hook)
    before = params_of(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        train(model, optimizer, rank, 2, start=2 * epoch)
        state.end_epoch(optimizer)
    after = params_of(net)
    names = [n for n, _ in net.named_parameters()]
    for name, a, b in zip(names, before, after):
        if name.startswith("spare"):
            assert torch.equal(a, b)
        else:
            assert not torch.equal(a, b)


def test_unused_parameters_with_find_unused_parameters_train_and_stay_put():
    run_processes(_unused_parameters, 2)


def _lazy_binding(rank, world_size):
    torch.manual_seed(0)
    state = AccordionState(None, "topk", mild=0.5, aggressive=0.1, interval=1)
    net = Net()
    model = DDP(net)
    model.register_comm_hook(state, accordion_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    train(model, optimizer, rank, 2)
    assert set(state.levels()) == {"#0", "#2", "#4"} or all(
        k.startswith("#") for k in state.levels()
    )
    state.end_epoch(optimizer)
    state.bind_module(model)  # e.g. from a Lightning callback's setup
    assert set(state.levels()) == {"fc1.weight", "fc2.weight", "fc3.weight"}
    train(model, optimizer, rank, 2, start=2)
    json.dumps(state.stats())


def test_a_state_built_before_wrapping_binds_lazily_and_takes_names_later():
    run_processes(_lazy_binding, 2)


def _low_precision(rank, world_size, dtype_name):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    net = Net().to(dtype)
    model = DDP(net)
    state = AccordionState(net, "powersgd", mild=2, aggressive=1, interval=1)
    model.register_comm_hook(state, accordion_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(2):
        losses = train(model, optimizer, rank, 3, start=3 * epoch, dtype=dtype)
        state.end_epoch(optimizer)
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert all(p.dtype == dtype for p in net.parameters())
    assert losses[-1] == losses[-1]  # not NaN


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_half_precision_gradients_are_compressed_and_stay_finite(dtype_name):
    run_processes(_low_precision, 2, dtype_name)


# --- without DDP --------------------------------------------------------------------------


def _without_ddp(rank, world_size):
    torch.manual_seed(0)
    net_hook, net_loop = Net(), Net()
    net_loop.load_state_dict(net_hook.state_dict())
    hooked = DDP(net_hook)
    hooked.register_comm_hook(AccordionState(net_hook, "powersgd", 2, 2), accordion_hook)
    loop_state = AccordionState(net_loop, "powersgd", 2, 2)
    opt_h = torch.optim.SGD(hooked.parameters(), lr=0.1)
    opt_l = torch.optim.SGD(net_loop.parameters(), lr=0.1)
    train(hooked, opt_h, rank, 3)
    for step in range(3):
        x, y = batch(rank, step)
        opt_l.zero_grad()
        nn.functional.mse_loss(net_loop(x), y).backward()
        loop_state.reduce_gradients()
        opt_l.step()
    for a, b in zip(params_of(net_hook), params_of(net_loop)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_reduce_gradients_without_ddp_matches_the_hook():
    run_processes(_without_ddp, 2)


# --- the cost model (auto mode) ------------------------------------------------------------


def _calibrate_agrees(rank, world_size, out):
    torch.manual_seed(0)
    net = Net(width=64)
    model = DDP(net)
    state = AccordionState(net, "powersgd", mild=2, aggressive=1)
    model.register_comm_hook(state, accordion_hook)
    report = state.calibrate()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(report, f)


def test_calibrate_measures_the_link_and_every_rank_takes_the_same_decisions(tmp_path):
    run_processes(_calibrate_agrees, 2, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0] == reports[1]
    report = reports[0]
    assert report["bandwidth"] > 1e6  # loopback: far more than 1 MB/s
    assert report["latency"] >= 0.0
    assert len(report["link_samples"]) >= 2
    assert set(report["tensors"]) == {"fc1.weight", "fc2.weight", "fc3.weight"}


def _all_dense_matches_ddp(rank, world_size):
    torch.manual_seed(0)
    net_hook, net_plain = Net(), Net()
    net_plain.load_state_dict(net_hook.state_dict())
    hooked, plain = DDP(net_hook), DDP(net_plain)
    state = AccordionState(net_hook, "powersgd", mild=2, aggressive=1, interval=1)
    state.calibrate(bandwidth=1e15, latency=0.0)  # free transfer: every tensor dense
    assert state.dense_keys == ["fc1.weight", "fc2.weight", "fc3.weight"]
    hooked.register_comm_hook(state, accordion_hook)
    opt_h = torch.optim.SGD(hooked.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        train(hooked, opt_h, rank, 3, start=3 * epoch)
        train(plain, opt_p, rank, 3, start=3 * epoch)
        state.end_epoch(next_lr=0.1)
    # bitwise: both divide the same buffer by the world size and sum it in one gloo
    # all-reduce, the same operations in the same order on the same machine
    for a, b in zip(params_of(net_hook), params_of(net_plain)):
        assert torch.equal(a, b), (a - b).abs().max()


def test_auto_mode_sending_everything_dense_is_bitwise_plain_ddp():
    run_processes(_all_dense_matches_ddp, 2)
