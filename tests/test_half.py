"""The half-precision compressor: registry, levels, accounting, workers, the DDP hook."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.accounting import paper_floats, wire_bytes
from accordion.compress import (
    ErrorFeedback,
    HalfPrecision,
    NoMemory,
    Reducer,
    SimulatedTransport,
    compressor_class,
    make_compressor,
)
from accordion.plan import make_plan
from distributed import run_processes

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
WORKERS = 4


def worker_grads(seed: int, size: int = 256, workers: int = WORKERS) -> list[torch.Tensor]:
    """Per-worker gradients: a small common mean plus larger noise that cancels out,
    as in training, where the noise between workers dominates their mean."""
    gen = torch.Generator().manual_seed(seed)
    common = 0.1 * torch.randn(size, generator=gen)
    noise = torch.randn(workers, size, generator=gen)
    noise -= noise.mean(dim=0)
    return [common + noise[w] for w in range(workers)]


def simulate(reducers, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One step of simulated workers (one tensor each); returns their averages."""
    inputs = [[g.clone()] for g in grads]
    world = SimulatedTransport(len(reducers))
    world.run([r.exchange(["g"], x, len(reducers)) for r, x in zip(reducers, inputs)])
    return [x[0] for x in inputs]


# --- registry and levels ------------------------------------------------------------------


def test_the_registry_name_half_is_the_half_precision_class():
    assert compressor_class("half") is HalfPrecision
    assert isinstance(make_compressor("half", "bf16"), HalfPrecision)
    assert make_compressor("half").default_level == "fp16"
    assert HalfPrecision.default_levels == ("fp16", "fp16")


def test_levels_are_exactly_fp16_and_bf16_with_text_and_labels_alike():
    for level in ("fp16", "bf16"):
        assert HalfPrecision.check_level(level) == level
        assert HalfPrecision.parse_level(f" {level} ") == level
        assert HalfPrecision.parse_level(HalfPrecision.level_text(level)) == level
        assert HalfPrecision.label(level) == level
    assert HalfPrecision.aggressiveness("fp16") == HalfPrecision.aggressiveness("bf16")


@pytest.mark.parametrize("level", [16, None, torch.float16, b"fp16"])
def test_a_level_that_is_not_a_str_is_a_type_error(level):
    with pytest.raises(TypeError, match="fp16"):
        HalfPrecision.check_level(level)


@pytest.mark.parametrize("level", ["fp32", "FP16", "float16", ""])
def test_an_unknown_level_is_a_value_error_naming_it_and_the_allowed_ones(level):
    with pytest.raises(ValueError, match=rf"\('fp16', 'bf16'\), got '{level}'"):
        HalfPrecision.check_level(level)
    with pytest.raises(ValueError):
        HalfPrecision(level)


@pytest.mark.parametrize("shape", [(), (7,), (32,), (16, 20), (8, 3, 3, 3)])
def test_it_applies_to_every_tensor_biases_and_scalars_included(shape):
    assert HalfPrecision.applies_to(shape)


# --- accounting ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(32,), (64, 20), (8, 3, 3, 3)])
@pytest.mark.parametrize("level", ["fp16", "bf16"])
def test_wire_bytes_are_an_all_reduce_of_2_bytes_per_element_half_of_dense(shape, level):
    numel = math.prod(shape)
    nbytes = wire_bytes(shape, "half", level, WORKERS, 4)
    assert nbytes == 2 * (WORKERS - 1) / WORKERS * (2 * numel)
    assert nbytes == wire_bytes(shape, "dense", None, WORKERS, 4) / 2
    assert wire_bytes(shape, "half", level, WORKERS, 2) == nbytes  # fp16 gradients: as much


def test_paper_floats_are_numel():
    for shape in [(32,), (64, 20), (8, 3, 3, 3)]:
        assert paper_floats(shape, "half", "fp16", WORKERS) == math.prod(shape)


def test_the_plan_has_dense_fp16_and_bf16_rows_at_half_the_dense_bytes():
    shapes = [(64, 20), (64,), (4, 64), (4,)]
    rows = make_plan(shapes, "half", ["fp16", "bf16"], WORKERS, 100, 1e9, 1e-5)
    assert [r.label for r in rows] == ["dense", "fp16", "bf16"]
    dense, fp16, bf16 = rows
    numel = sum(math.prod(s) for s in shapes)
    for row in (fp16, bf16):
        assert row.compressor == "half"
        assert row.floats_per_step == dense.floats_per_step == numel
        assert row.floats_total == 100 * numel
        assert row.compression_ratio == 1.0  # the paper's convention counts floats
        assert row.bytes_per_step == dense.bytes_per_step / 2
        assert row.comm_time_per_step_s < dense.comm_time_per_step_s


# --- simulated workers -----------------------------------------------------------------------


@pytest.mark.parametrize("level", ["fp16", "bf16"])
def test_the_average_of_4_workers_is_the_fp32_mean_within_half_precision(level):
    grads = worker_grads(1)
    averages = simulate([Reducer(HalfPrecision(level)) for _ in range(WORKERS)], grads)
    mean = torch.stack(grads).mean(dim=0)
    # each of W terms and the sum are rounded once: at most eps * mean |g| (eps = 2 u)
    bound = torch.finfo(DTYPES[level]).eps * torch.stack(grads).abs().mean(dim=0) + 2**-24
    for average in averages:
        assert average.dtype == torch.float32
        assert torch.equal(average, averages[0])
        assert ((average - mean).abs() <= bound).all()
        assert not torch.equal(average, mean)  # it really went through half precision


@pytest.mark.parametrize("level", ["fp16", "bf16"])
def test_the_average_is_the_sum_of_each_workers_cast_of_its_share(level):
    grads = worker_grads(2)
    averages = simulate([Reducer(HalfPrecision(level)) for _ in range(WORKERS)], grads)
    sent = torch.stack([(g / WORKERS).to(DTYPES[level]) for g in grads])
    assert torch.equal(averages[0], sent.sum(dim=0).float())


def test_tensors_of_one_call_at_different_levels_travel_in_one_all_reduce_per_dtype():
    compressor = HalfPrecision("fp16")
    compressor.set_level("bf16", keys=["b"])
    tensors = [torch.randn(6, 5), torch.randn(7), torch.randn(3)]
    exchange = compressor.exchange(["a", "b", "c"], [t.clone() for t in tensors], 1)
    phase = next(exchange)
    assert [(op.tensor.dtype, op.tensor.numel()) for op in phase] == [
        (torch.float16, 30 + 3),
        (torch.bfloat16, 7),
    ]
    with pytest.raises(StopIteration) as stop:
        exchange.send([op.tensor for op in phase])  # one worker: the sum is the share
    dtypes = [torch.float16, torch.bfloat16, torch.float16]
    for t, (average, _), dtype in zip(tensors, stop.value.value, dtypes):
        assert torch.equal(average, t.to(dtype).float())


def test_the_residual_is_the_local_rounding_error_and_error_feedback_keeps_it():
    grads = worker_grads(3)
    reducers = [Reducer(HalfPrecision("bf16")) for _ in range(WORKERS)]
    simulate(reducers, grads)
    for reducer, g in zip(reducers, grads):
        rounding = g - WORKERS * (g / WORKERS).to(torch.bfloat16).float()
        assert rounding.abs().max() > 0
        assert torch.equal(reducer.memory.get("g"), rounding)


@pytest.mark.parametrize("level", ["fp16", "bf16"])
def test_with_error_feedback_the_mean_over_steps_converges_to_the_true_mean_better(level):
    grads = worker_grads(4)
    mean = torch.stack(grads).mean(dim=0)
    error = {}
    for memory in (ErrorFeedback, NoMemory):
        reducers = [Reducer(HalfPrecision(level), memory()) for _ in range(WORKERS)]
        steps = [simulate(reducers, grads)[0] for _ in range(64)]
        error[memory] = (torch.stack(steps).mean(dim=0) - mean).abs().max().item()
    # without it every step repeats the same rounding; with it the rounding telescopes
    assert error[ErrorFeedback] < 0.35 * error[NoMemory]


def test_an_fp16_overflow_is_a_non_finite_step_that_resets_the_memory():
    reducers = [Reducer(HalfPrecision("fp16")) for _ in range(2)]
    simulate(reducers, [torch.full((4,), 0.1), torch.full((4,), 0.3)])
    assert reducers[0].memory.get("g").abs().max() > 0
    with pytest.warns(RuntimeWarning, match="non-finite"):
        averages = simulate(reducers, [torch.full((4,), 1e6), torch.full((4,), 1e6)])
    assert torch.isinf(averages[0]).all()  # written back: a GradScaler skips the step
    assert torch.count_nonzero(reducers[0].memory.get("g")) == 0  # nothing non-finite kept
    assert reducers[0].non_finite_steps == 1


# --- 2 real gloo workers through the DDP hook -------------------------------------------------


class MLP(nn.Module):
    """A small MLP: three weight matrices and three biases, all sent in half precision."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _local_grads(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    net.zero_grad()
    nn.functional.mse_loss(net(x), y).backward()
    return [p.grad.detach().clone() for p in net.parameters()]


def _hook_checks(rank: int, world_size: int, level: str) -> None:
    from accordion.ddp import AccordionState, accordion_hook

    torch.manual_seed(0)
    net, reference = MLP(), MLP()
    reference.load_state_dict(net.state_dict())
    model = DDP(net)
    state = AccordionState(net, compressor="half", mild=level, aggressive=level)
    model.register_comm_hook(state, accordion_hook)
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(16, 20, generator=gen), torch.randn(16, 4, generator=gen)
    nn.functional.mse_loss(model(x), y).backward()
    local = _local_grads(reference, x, y)  # this rank's gradients, not averaged
    names = [name for name, _ in net.named_parameters()]
    differs = False
    for name, p, g in zip(names, net.parameters(), local):
        everyone = [torch.empty_like(g) for _ in range(world_size)]
        dist.all_gather(everyone, g)
        dense = sum(everyone) / world_size
        # the exact cast arithmetic: each rank's share cast to the level, summed in it
        halves = [(e / world_size).to(DTYPES[level]) for e in everyone]
        exact = (halves[0] + halves[1]).float()
        assert torch.equal(p.grad, exact), name
        bound = torch.finfo(DTYPES[level]).eps * sum(e.abs() for e in everyone) / world_size
        assert ((p.grad - dense).abs() <= bound + 2**-24).all(), name
        differs |= not torch.equal(p.grad, dense)
        grads = [torch.empty_like(p.grad) for _ in range(world_size)]
        dist.all_gather(grads, p.grad)
        assert all(torch.equal(other, grads[0]) for other in grads), name  # ranks agree
    assert differs, "no gradient differs from the fp32 average: the hook did not run"
    shapes = [tuple(p.shape) for p in net.parameters()]
    expected = sum(wire_bytes(s, "half", level, world_size, 4) for s in shapes)
    dense_bytes = sum(wire_bytes(s, "dense", None, world_size, 4) for s in shapes)
    assert state.ledger.total_bytes > 0
    assert state.ledger.total_bytes == expected == dense_bytes / 2
    assert state.ledger.total_floats == sum(math.prod(s) for s in shapes)
    assert set(state.ledger.layers) == set(names)  # biases included


@pytest.mark.parametrize("level", ["fp16", "bf16"])  # bf16 all-reduces over gloo too
def test_the_ddp_hook_averages_every_gradient_in_half_and_counts_2_bytes_per_element(level):
    run_processes(_hook_checks, 2, level)


# --- command line and harness ----------------------------------------------------------------


def test_accordion_plan_for_half_prints_rows_at_half_the_dense_bytes(capsys):
    from accordion.cli import main

    argv = ["plan", "--model", "resnet18", "--compressor", "half", "--levels", "fp16,bf16"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {row["label"]: row for row in result["levels"]}
    assert list(rows) == ["dense", "fp16", "bf16"]
    for label in ("fp16", "bf16"):
        assert rows[label]["compressor"] == "half"
        assert rows[label]["level"] == label
        assert rows[label]["floats_per_step"] == rows["dense"]["floats_per_step"]
        assert rows[label]["bytes_per_step"] == rows["dense"]["bytes_per_step"] / 2


def test_a_static_half_strategy_parses():
    from accordion.harness.strategies import parse_strategy

    strategy = parse_strategy("static:half:fp16")
    assert (strategy.family, strategy.compressor) == ("static", "half")
    assert (strategy.mild, strategy.aggressive) == ("fp16", "fp16")
    assert strategy.uses_accordion_hook
