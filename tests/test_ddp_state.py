"""AccordionState in one process (no process group): validation, decisions, stats, checkpoints."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from accordion.accounting import paper_floats
from accordion.costmodel import TensorCost, choose_dense, overlapped_step
from accordion.ddp import AccordionState
from accordion.policy import PaperRule


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def step(net, state, scale: float = 1.0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    net.zero_grad()
    (scale * net(torch.randn(5, 8, generator=gen))).pow(2).sum().backward()
    state.reduce_gradients()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"compressor": "qsgd"}, "compressor must be one of"),
        ({"compressor": "powersgd", "mild": 1, "aggressive": 2}, "aggressive must compress"),
        ({"compressor": "topk", "mild": 0.1, "aggressive": 0.5}, "aggressive must compress"),
        ({"compressor": "powersgd", "mild": 0}, "rank must be an int >= 1"),
        ({"compressor": "topk", "mild": 1.5}, r"fraction must be a number in \(0, 1\]"),
        ({"statistic": "median"}, "statistic must be one of"),
        ({"interval_unit": "hour"}, "interval_unit must be one of"),
        ({"interval": 0}, "interval"),
        ({"eta": -1.0}, "eta"),
        ({"on_rank_change": "keep"}, "on_rank_change"),
    ],
)
def test_state_rejects_bad_arguments_with_a_clear_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AccordionState(make_net(), **kwargs)


def test_state_rejects_a_model_that_is_not_a_module():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        AccordionState("resnet18")


def test_reduce_gradients_needs_parameters_when_no_module_is_bound():
    with pytest.raises(ValueError, match="parameters must be given"):
        AccordionState(None).reduce_gradients()


def test_training_starts_at_the_mild_level_for_compressed_parameters_only():
    state = AccordionState(make_net(), "powersgd", mild=4, aggressive=1)
    assert state.levels() == {"0.weight": 4, "2.weight": 4}


def test_stats_count_paper_floats_per_step_and_are_json_serialisable():
    net = make_net()
    state = AccordionState(net, "powersgd", mild=2, aggressive=1)
    for i in range(3):
        step(net, state, seed=i)
    stats = json.loads(json.dumps(state.stats()))
    assert stats["layers"]["0.weight"]["floats"] == 3 * paper_floats((16, 8), "powersgd", 2, 1)
    assert stats["layers"]["0.bias"]["floats"] == 3 * 16
    assert stats["layers"]["0.bias"]["level"] is None
    assert stats["total_floats"] == sum(v["floats"] for v in stats["layers"].values())


def test_a_learning_rate_decay_makes_every_layer_mild_until_the_next_check():
    net = make_net()
    state = AccordionState(net, "powersgd", mild=4, aggressive=1, interval=2, rule=PaperRule(10.0))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for epoch in range(3):
        step(net, state, seed=epoch)
        state.end_epoch(optimizer)
    assert set(state.levels().values()) == {1}  # eta=10: the check at epoch 2 was calm
    for group in optimizer.param_groups:
        group["lr"] = 0.01
    step(net, state, seed=3)
    decisions = state.end_epoch(optimizer)
    assert all(decisions.values())
    assert set(state.levels().values()) == {4}


def test_an_explicit_next_lr_detects_a_decay_like_the_optimizer_does():
    net = make_net()
    state = AccordionState(net, "powersgd", mild=4, aggressive=1, interval=2, rule=PaperRule(10.0))
    for epoch, lr in enumerate([0.1, 0.1, 0.1, 0.01]):
        step(net, state, seed=epoch)
        state.end_epoch(next_lr=lr)
    assert set(state.levels().values()) == {4}


def test_a_calm_check_switches_layers_to_the_aggressive_level():
    net = make_net()
    state = AccordionState(net, "topk", mild=0.9, aggressive=0.1, interval=1, rule=PaperRule(10.0))
    step(net, state)
    state.end_epoch(next_lr=0.1)
    assert set(state.levels().values()) == {0.9}  # epoch 0: critical
    step(net, state)
    state.end_epoch(next_lr=0.1)
    assert set(state.levels().values()) == {0.1}


def test_a_sharp_change_of_the_gradient_norm_keeps_a_layer_mild():
    net = make_net()
    state = AccordionState(net, "powersgd", mild=2, aggressive=1, interval=1, rule=PaperRule(0.5))
    step(net, state, scale=1.0)
    state.end_epoch(next_lr=0.1)
    step(net, state, scale=10.0)  # the gradient norm grows ~100x
    decisions = state.end_epoch(next_lr=0.1)
    assert decisions == {"0.weight": True, "2.weight": True}
    assert state.stats()["checks"][-1]["layers"]["0.weight"]["ratio"] > 0.5


def _paper_steps(net: nn.Module, interval: int) -> AccordionState:
    """The paper's rule at rank 2/1, deciding every ``interval`` steps, calm at eta 10."""
    rule = PaperRule(10.0)
    return AccordionState(net, "powersgd", 2, 1, interval=interval, rule=rule, interval_unit="step")


def test_step_intervals_decide_at_the_end_of_each_window():
    net = make_net()
    state = _paper_steps(net, interval=3)
    results = []
    for i in range(6):
        step(net, state, seed=i)
        results.append(state.end_step(next_lr=0.1))
    assert [r is not None for r in results] == [False, False, True, False, False, True]
    assert set(state.levels().values()) == {1}


def test_a_decay_inside_a_step_window_makes_layers_mild_at_once():
    net = make_net()
    state = _paper_steps(net, interval=2)
    for i in range(4):
        step(net, state, seed=i)
        state.end_step(next_lr=0.1)
    assert set(state.levels().values()) == {1}
    step(net, state, seed=4)
    state.end_step(next_lr=0.01)  # mid-window
    assert set(state.levels().values()) == {2}


def test_end_epoch_and_end_step_refuse_the_other_interval_unit():
    with pytest.raises(ValueError, match="interval_unit='epoch'"):
        AccordionState(make_net(), interval_unit="step").end_epoch()
    with pytest.raises(ValueError, match="interval_unit='step'"):
        AccordionState(make_net()).end_step()


def test_state_dict_round_trips_through_a_weights_only_load(tmp_path):
    net = make_net()
    state = AccordionState(net, "powersgd", mild=2, aggressive=1, interval=1)
    for epoch in range(3):
        step(net, state, seed=epoch)
        state.end_epoch(next_lr=0.1)
    torch.save(state.state_dict(), tmp_path / "accordion-rank0.pt")
    other = AccordionState(make_net(), "powersgd", mild=2, aggressive=1, interval=1)
    other.load_state_dict(torch.load(tmp_path / "accordion-rank0.pt", weights_only=True))
    assert other.levels() == state.levels()
    assert other.epoch == 3
    assert other.stats() == state.stats()


def _saved(compressor="powersgd", **kwargs):
    net = make_net()
    state = AccordionState(net, compressor, **kwargs)
    step(net, state)
    return state.state_dict()


def test_loading_a_state_from_another_world_size_is_an_error():
    saved = _saved()
    saved["world_size"] = 4
    with pytest.raises(ValueError, match="world size 4"):
        AccordionState(make_net(), "powersgd").load_state_dict(saved)


def test_loading_a_state_of_another_compressor_is_an_error():
    with pytest.raises(ValueError, match="compressor"):
        AccordionState(make_net(), "topk").load_state_dict(_saved("powersgd"))


def test_loading_a_state_of_another_model_is_an_error():
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    with pytest.raises(ValueError, match="does not match the model"):
        AccordionState(other, "powersgd").load_state_dict(_saved())


def test_binding_a_module_later_moves_lazily_bound_state_to_the_names():
    net = make_net()
    state = AccordionState(None, "powersgd", mild=2, aggressive=1)
    for _ in range(2):
        net.zero_grad()
        net(torch.randn(5, 8)).pow(2).sum().backward()
        state.reduce_gradients(net.parameters())
    memory = state.reducer.memory.get("#0").clone()
    floats = state.stats()["layers"]["#0"]["floats"]
    state.bind_module(net)
    assert torch.equal(state.reducer.memory.get("0.weight"), memory)
    assert state.stats()["layers"]["0.weight"]["floats"] == floats
    assert not any(key.startswith("#") for key in state.stats()["layers"])


# --- the cost model's choice (auto mode) ----------------------------------------------


def test_calibrate_on_a_slow_link_compresses_every_matrix():
    state = AccordionState(make_net(), "powersgd", mild=2, aggressive=1)
    report = state.calibrate(bandwidth=1e3, latency=0.0)  # 1 kB/s: every byte counts
    assert state.dense_keys == []
    assert report["dense_keys"] == []
    assert set(report["tensors"]) == {"0.weight", "2.weight"}
    assert all(t["compress"] for t in report["tensors"].values())


def test_calibrate_on_a_fast_link_sends_every_matrix_dense_and_counts_dense_floats():
    state = AccordionState(make_net(), "powersgd", mild=2, aggressive=1)
    state.calibrate(bandwidth=1e15, latency=0.0)  # transfer is free: compression cannot pay
    assert state.dense_keys == ["0.weight", "2.weight"]
    assert state.levels() == {"0.weight": None, "2.weight": None}
    step(state._module, state)
    dense = sum(paper_floats(tuple(p.shape), "dense", None, 1) for p in state._module.parameters())
    assert state.ledger.total_floats == dense
    assert state.stats()["layers"]["0.weight"]["level"] is None


def test_calibrate_rejects_half_a_link_and_bad_numbers():
    state = AccordionState(make_net())
    with pytest.raises(ValueError, match="bandwidth and latency must be given together"):
        state.calibrate(bandwidth=1e9)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        state.calibrate(bandwidth=0.0, latency=0.0)
    with pytest.raises(ValueError, match="latency must be >= 0"):
        state.calibrate(bandwidth=1e9, latency=-1.0)
    with pytest.raises(TypeError, match="bandwidth must be a number"):
        state.calibrate(bandwidth="1Gbit", latency=0.0)
    assert state.dense_keys == []  # nothing changed by the rejected calls


@pytest.mark.parametrize(
    "kwargs,error",
    [({"buckets": 0}, ValueError), ({"repeats": 0}, ValueError), ({"buckets": 1.5}, TypeError)],
)
def test_calibrate_rejects_bucket_and_repeat_counts_below_one(kwargs, error):
    # the architecture issue: a wrong type is a TypeError, a bad value a ValueError
    name = next(iter(kwargs))
    with pytest.raises(error, match=f"{name} must be an int >= 1"):
        AccordionState(make_net()).calibrate(bandwidth=1e6, latency=0.0, **kwargs)


def test_calibrate_without_a_process_group_needs_the_link_given():
    with pytest.raises(ValueError, match="no link to measure"):
        AccordionState(make_net()).calibrate()


def test_set_dense_rejects_unknown_keys_and_a_bare_string():
    state = AccordionState(make_net())
    with pytest.raises(ValueError, match="unknown"):
        state.set_dense(["nope.weight"])
    with pytest.raises(TypeError, match="not a single str"):
        state.set_dense("0.weight")


def test_an_adaptive_state_with_every_matrix_dense_ends_check_epochs_without_error():
    state = AccordionState(make_net(), "powersgd", mild=2, aggressive=1, interval=1)
    state.set_dense(["0.weight", "2.weight"])
    step(state._module, state)
    assert state.end_epoch(next_lr=0.1) == {}
    assert state.epoch == 1


def test_dense_keys_survive_a_checkpoint():
    state = AccordionState(make_net(), "powersgd", mild=2, aggressive=1)
    state.set_dense(["2.weight"])
    fresh = AccordionState(make_net(), "powersgd", mild=2, aggressive=1)
    fresh.load_state_dict(state.state_dict())
    assert fresh.dense_keys == ["2.weight"]


def test_calibrate_with_computation_decides_with_the_overlap_model():
    # no biases: nothing is dense anyway, so the model sees every tensor
    net = nn.Sequential(nn.Linear(20, 32, bias=False), nn.ReLU(),
                        nn.Linear(32, 1024, bias=False), nn.ReLU(),
                        nn.Linear(1024, 300, bias=False))  # fmt: skip
    state = AccordionState(net, "powersgd", mild=2, aggressive=1)
    report = state.calibrate(bandwidth=1e3, latency=0.0, compute_s=3600.0)
    shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
    costs = [TensorCost(k, shapes[k], t["dense_s"], t["compressed_s"], t["compute_s"])
             for k, t in report["tensors"].items()]  # fmt: skip
    # the 1.2 MB last layer fills DDP's first bucket and hides behind the backward pass
    assert overlapped_step(costs, set(), 3600.0) < overlapped_step(costs, set(), 0.0) + 3600.0
    assert report["dense_keys"] == choose_dense(costs, 2, 0.0, report["buckets"], 3600.0)
    assert report["step_compute_s"] == 3600.0


@pytest.mark.parametrize(
    "compute_s,error", [(-1.0, ValueError), (float("nan"), ValueError), ("1s", TypeError)]
)
def test_calibrate_rejects_a_bad_compute_time(compute_s, error):
    with pytest.raises(error, match="compute_s must be"):
        AccordionState(make_net()).calibrate(bandwidth=1e6, latency=0.0, compute_s=compute_s)


def test_end_epoch_warns_once_when_no_gradient_passed_through_the_state():
    state = AccordionState(make_net(), "powersgd", mild=2, aggressive=2)  # static: no check
    with pytest.warns(RuntimeWarning, match="no gradient passed through this Accordion state"):
        state.end_epoch(next_lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state.end_epoch(next_lr=0.1)  # once is enough


def test_the_idle_warning_names_the_lightning_cause_and_the_fix():
    state = AccordionState(make_net(), "powersgd", mild=2, aggressive=2, interval_unit="step")
    with pytest.warns(RuntimeWarning) as caught:
        state.end_step(next_lr=0.1)
    text = str(caught[0].message)
    assert "register_comm_hook(state, accordion_hook)" in text and "Lightning" in text


def test_end_epoch_does_not_warn_when_gradients_passed_through_the_state():
    net = make_net()
    state = AccordionState(net, "powersgd", mild=2, aggressive=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for epoch in range(2):
            step(net, state, seed=epoch)
            state.end_epoch(next_lr=0.1)
