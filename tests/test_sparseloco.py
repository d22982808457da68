"""SparseLoCo's compressor: levels, the per-chunk selection, the residual, simulated
workers' averages, error feedback, the bytes on the wire, odd shapes, strategies, the
mixed ladder and the controller."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from accordion.accounting import wire_bytes
from accordion.compress import (
    ErrorFeedback,
    Mixed,
    NoMemory,
    Reducer,
    SimulatedTransport,
    SparseLoCo,
    TorchTransport,
    compressor_class,
    compressor_names,
    make_compressor,
)
from accordion.compress.quantize import dequantize, quantize
from accordion.compress.sparseloco import CHUNK
from accordion.compress.wire import allgather_bytes
from distributed import run_processes

WORKERS = 3


def worker_tensors(seed: int, shape, workers: int = WORKERS) -> list[torch.Tensor]:
    """Per-worker tensors of ``shape``: a common mean plus noise of varying magnitude."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(shape, generator=gen)
    return [common + (w + 1) * torch.randn(shape, generator=gen) for w in range(workers)]


def exchange_once(compressors, tensors):
    """One exchange of simulated workers (one compressor, one list of tensors each),
    straight through the compressors, on copies; returns the results and the transport."""
    world = SimulatedTransport(len(compressors))
    keys = [f"t{i}" for i in range(len(tensors[0]))]
    results = world.run([c.exchange(keys, [t.clone() for t in ts], len(compressors))
                         for c, ts in zip(compressors, tensors)])  # fmt: skip
    return results, world


def expected_positions(x: torch.Tensor, fraction: float) -> list[int]:
    """Flat positions a chunk-wise top-k keeps, computed here by sorting each chunk:
    per chunk of CHUNK elements, the floor(fraction * len) (>= 1) of largest magnitude."""
    flat = x.reshape(-1)
    kept = []
    for start in range(0, flat.numel(), CHUNK):
        chunk = flat[start : start + CHUNK]
        count = max(1, math.floor(fraction * chunk.numel()))
        order = torch.argsort(chunk.abs(), descending=True)[:count]
        kept.extend(start + int(i) for i in order)
    return sorted(kept)


def decoded_alone(x: torch.Tensor, fraction: float) -> torch.Tensor:
    """What one worker sends of ``x``, decoded: the average of a world of one."""
    results, _ = exchange_once([SparseLoCo(fraction)], [[x]])
    return results[0][0][0]


def sent_bytes(kept: int) -> int:
    """One worker's bytes for a tensor with ``kept`` entries kept: 2-bit values packed,
    int16 indices, one fp16 scale per 64 kept values."""
    return math.ceil(kept * 2 / 8) + 2 * kept + 2 * math.ceil(kept / 64)


# --- registry and levels ---------------------------------------------------------------------


def test_the_registry_name_sparseloco_is_the_class_after_the_others():
    assert compressor_class("sparseloco") is SparseLoCo
    names = compressor_names()
    assert names[:5] == ("dense", "powersgd", "topk", "half", "powersgd1")
    assert names.index("sparseloco") > names.index("int")
    assert SparseLoCo.title == "top-k with 2-bit values (SparseLoCo)"
    assert isinstance(make_compressor("sparseloco"), SparseLoCo)


def test_the_default_levels_are_3_and_1_percent_kept():
    assert SparseLoCo.default_levels == (0.03, 0.01)
    assert make_compressor("sparseloco").default_level == 0.03
    assert SparseLoCo().default_level == 0.03


def test_levels_read_write_and_label_as_top_k_int2():
    for fraction in (1.0, 0.1, 0.03, 0.01):
        assert SparseLoCo.parse_level(SparseLoCo.level_text(fraction)) == fraction
    assert SparseLoCo.parse_level(" 0.03 ") == 0.03
    assert SparseLoCo.check_level(1) == 1.0
    assert SparseLoCo.label(0.03) == "top-k 0.03 int2"


@pytest.mark.parametrize("level", ["0.1", None, True])
def test_a_level_that_is_not_a_number_is_a_type_error(level):
    with pytest.raises(TypeError, match=r"fraction must be a number in \(0, 1\]"):
        SparseLoCo.check_level(level)


@pytest.mark.parametrize("level", [0, 0.0, 1.5, -0.1, float("nan")])
def test_a_fraction_outside_0_1_is_a_value_error(level):
    with pytest.raises(ValueError, match=r"fraction must be a number in \(0, 1\]"):
        SparseLoCo.check_level(level)
    with pytest.raises(ValueError):
        SparseLoCo(level)


def test_a_smaller_fraction_is_more_aggressive():
    order = [SparseLoCo.aggressiveness(f) for f in (1.0, 0.1, 0.03, 0.01)]
    assert order == sorted(order) and len(set(order)) == 4


# --- the selection and the residual ----------------------------------------------------------


def test_each_chunk_keeps_its_largest_entries_floor_fraction_times_its_length():
    n = 2 * CHUNK + 100  # two full chunks and a short one
    gen = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    x = (torch.randperm(n, generator=gen) + 1).float() * signs  # distinct magnitudes
    exchange = SparseLoCo(0.01).exchange(["x"], [x.clone()], 1)
    values, index_bytes, scales = (op.tensor for op in next(exchange))
    assert (values.dtype, index_bytes.dtype, scales.dtype) == (torch.uint8,) * 2 + (torch.float16,)
    indices = index_bytes.view(torch.int16)  # int16 travels as its bytes (gloo has no int16)
    counts = (40, 40, 1)  # floor(0.01 * 4096), twice, and max(1, floor(0.01 * 100))
    assert indices.numel() == sum(counts)
    starts = torch.tensor([0] * 40 + [CHUNK] * 40 + [2 * CHUNK])
    assert sorted((indices.long() + starts).tolist()) == expected_positions(x, 0.01)
    for chunk, part in enumerate(torch.split(indices.long(), counts)):
        assert torch.equal(part, part.sort().values)  # ascending within each chunk
        assert (part < min(CHUNK, n - chunk * CHUNK)).all()  # positions inside the chunk


def test_the_residual_plus_the_sent_values_is_the_input():
    x = torch.randn(5, 3000, generator=torch.Generator().manual_seed(1))
    results, _ = exchange_once([SparseLoCo(0.05)], [[x]])
    sent, residual = results[0][0]  # one worker: the average is what it sent, decoded
    kept = torch.zeros(x.numel(), dtype=torch.bool)
    kept[expected_positions(x, 0.05)] = True
    kept = kept.view(x.shape)
    assert torch.equal(residual[~kept], x[~kept])  # not sent: owed in full
    assert (sent[~kept] == 0).all()
    torch.testing.assert_close(residual[kept] + sent[kept], x[kept], rtol=0, atol=1e-6)
    # what was sent is the library's 2-bit quantiser applied to the kept values in order
    codes, scales = quantize(x[kept], 2)
    assert torch.equal(sent[kept], dequantize(codes, scales, (codes.numel(),)))
    assert residual[kept].abs().max() > 0  # 2 bits: the kept values are not sent exactly


# --- simulated workers -----------------------------------------------------------------------


def test_the_average_of_3_workers_is_bitwise_alike_and_the_mean_of_their_contributions():
    shapes = [(16, 600), (130,), (4, 3, 3, 3)]
    tensors = [[t for t in (worker_tensors(10 + i, s)[w] for i, s in enumerate(shapes))]
               for w in range(WORKERS)]  # fmt: skip
    results, _ = exchange_once([SparseLoCo(0.1) for _ in range(WORKERS)], tensors)
    for i, shape in enumerate(shapes):
        contributions = [decoded_alone(ts[i], 0.1) for ts in tensors]
        average = results[0][i][0]
        assert average.shape == shape and average.dtype == torch.float32
        assert torch.equal(average, sum(contributions[1:], contributions[0]) / WORKERS)
        for other in results[1:]:
            assert torch.equal(other[i][0], average)  # bitwise alike on every worker
        mean = torch.stack([ts[i] for ts in tensors]).mean(dim=0)
        assert not torch.allclose(average, mean, atol=1e-3)  # it really was compressed


def test_with_error_feedback_the_running_mean_converges_to_the_true_mean():
    grads = worker_tensors(7, (8, 96))
    mean = torch.stack(grads).mean(dim=0)
    steps = 400
    error = {}
    for memory in (ErrorFeedback, NoMemory):
        reducers = [Reducer(SparseLoCo(0.1), memory()) for _ in range(WORKERS)]
        total = torch.zeros_like(mean)
        for _ in range(steps):
            inputs = [[g.clone()] for g in grads]
            SimulatedTransport(WORKERS).run(
                [r.exchange(["g"], x, WORKERS) for r, x in zip(reducers, inputs)]
            )
            total += inputs[0][0]
        error[memory] = (total / steps - mean).abs().max().item()
        if memory is ErrorFeedback:
            # sent_t = g + e_(t-1) - e_t: the running mean is off by the last memories / T
            owed = sum(r.memory.get("g").abs() for r in reducers) / WORKERS
            assert ((total / steps - mean).abs() <= owed / steps + 1e-5).all()
    assert error[ErrorFeedback] < 0.05 * error[NoMemory]  # without it, the error stays


# --- the bytes on the wire -------------------------------------------------------------------


def test_one_exchange_is_one_phase_of_three_all_gathers():
    compressor = SparseLoCo(0.1)
    compressor.set_level(0.5, keys=["b"])
    tensors = [torch.randn(6, 600), torch.randn(7), torch.randn(3, 3, 2, 2)]
    exchange = compressor.exchange(["a", "b", "c"], [t.clone() for t in tensors], 1)
    phase = next(exchange)
    kept = (360, 3, 3)  # floor(0.1 * 3600), floor(0.5 * 7), floor(0.1 * 36)
    assert [op.tensor.numel() for op in phase] == [
        sum(math.ceil(k / 4) for k in kept),
        2 * sum(kept),  # int16 indices, as bytes
        sum(math.ceil(k / 64) for k in kept),
    ]
    with pytest.raises(StopIteration) as stop:
        exchange.send([op.tensor.unsqueeze(0) for op in phase])
    assert [average.shape for average, _ in stop.value.value] == [t.shape for t in tensors]


def test_the_bytes_sent_are_what_messages_and_ring_accounting_say():
    shapes = [(32, 200), (100,), (5000,), (16, 3, 3, 3)]
    kept = [122 + 69, 3, 122 + 27, 12]  # per chunk floor(0.03 * len), chunks of 4096
    tensors = [[t[w] for t in (worker_tensors(i, s, 4) for i, s in enumerate(shapes))]
               for w in range(4)]  # fmt: skip
    _, world = exchange_once([SparseLoCo(0.03) for _ in range(4)], tensors)
    messages = [m for s in shapes for m in SparseLoCo.messages(s, 0.03, 4)]
    assert all(m.op == "allgather" for m in messages)
    assert {m.slot for m in messages} == {"values", "indices", "scales"}
    assert world.bytes_sent == sum(wire_bytes(s, "sparseloco", 0.03, 4, 4) for s in shapes)
    assert world.bytes_sent == allgather_bytes(sum(m.nbytes for m in messages), 4)
    assert world.bytes_sent == 3 * sum(sent_bytes(k) for k in kept)


def test_a_1024_square_matrix_at_3_percent_sends_under_a_40th_of_dense():
    kept = 256 * 122  # 256 chunks of 4096, floor(0.03 * 4096) = 122 each
    expected = kept // 4 + 2 * kept + 2 * (kept // 64)
    assert expected == 7808 + 62464 + 976 == 71248
    for element_size in (2, 4):
        nbytes = [m.nbytes for m in SparseLoCo.messages((1024, 1024), 0.03, element_size)]
        assert nbytes == [7808, 62464, 976]
    dense = 1024 * 1024 * 4
    assert expected < dense / 40  # about 1/59 of dense
    _, world = exchange_once([SparseLoCo(0.03) for _ in range(2)],
                             [[t] for t in worker_tensors(3, (1024, 1024), 2)])  # fmt: skip
    assert world.bytes_sent == expected  # an all-gather of two: each sends its own once
    assert SparseLoCo.paper_floats((1024, 1024), 0.03, 4) == (1952 + 15616 + 488) * 4


# --- shapes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0,), (2, 0), (), (1,), (7,), (5, 4099), (8, 3, 3, 3)])
def test_empty_scalar_odd_sized_and_conv_shaped_tensors_work(shape):
    tensors = [[t] for t in worker_tensors(sum(shape) + 1, shape, 2)]
    results, world = exchange_once([SparseLoCo(0.03) for _ in range(2)], tensors)
    average, residual = results[0][0]
    assert average.shape == residual.shape == shape
    assert torch.isfinite(average).all() and torch.equal(average, results[1][0][0])
    contributions = [decoded_alone(ts[0], 0.03) for ts in tensors]
    assert torch.equal(average, (contributions[0] + contributions[1]) / 2)
    torch.testing.assert_close(residual + contributions[0], tensors[0][0], rtol=0, atol=1e-6)
    numel = math.prod(shape)
    assert world.bytes_sent == (0 if numel == 0 else allgather_bytes(
        sum(m.nbytes for m in SparseLoCo.messages(shape, 0.03, 4)), 2))  # fmt: skip


def test_it_applies_to_every_tensor_and_pays_for_all_but_one_element_ones():
    for shape in [(), (1,), (2,), (7,), (64, 32), (8, 3, 3, 3), (0,)]:
        assert SparseLoCo.applies_to(shape)
        assert SparseLoCo.pays(shape, 0.03) == (math.prod(shape) != 1), shape
    assert [m.nbytes for m in SparseLoCo.messages((), 0.03, 4)] == [1, 2, 2]  # 5 > 4


# --- strategies, the mixed ladder and the controller -----------------------------------------


def test_static_and_accordion_sparseloco_strategies_parse():
    from accordion.harness.strategies import parse_strategy

    strategy = parse_strategy("static:sparseloco:0.03")
    assert (strategy.family, strategy.compressor, strategy.mild) == ("static", "sparseloco", 0.03)
    ladder = parse_strategy("accordion:sparseloco:0.03,0.01")
    assert (ladder.mild, ladder.aggressive) == (0.03, 0.01)


def test_the_mixed_ladder_takes_a_sparseloco_rung():
    from accordion.harness.strategies import parse_strategy

    assert Mixed.check_level("sparseloco/0.030") == "sparseloco/0.03"
    strategy = parse_strategy("accordion:mixed:half/bf16,topk/0.1,sparseloco/0.03")
    assert strategy.levels == ("half/bf16", "topk/0.1", "sparseloco/0.03")
    assert Mixed.pays((64, 32), "sparseloco/0.03") and not Mixed.pays((), "sparseloco/0.03")


def test_the_controller_builds_with_sparseloco_levels_and_reduces_locally():
    from accordion.ddp import AccordionState

    net = nn.Linear(70, 3)
    state = AccordionState(net, compressor="sparseloco", levels=(0.1, 0.03))
    assert state.ladder.levels == (0.1, 0.03)
    assert isinstance(state.reducer.compressor, SparseLoCo)
    nn.functional.mse_loss(net(torch.randn(5, 70)), torch.zeros(5, 3)).backward()
    before = [p.grad.clone() for p in net.parameters()]
    state.reduce_gradients()  # one process: the average is the sent gradient, decoded
    keys = state.params.keys(list(net.parameters()))
    for key, p, g in zip(keys, net.parameters(), before):
        assert torch.count_nonzero(p.grad) <= max(1, math.floor(0.1 * g.numel()))
        owed = state.reducer.memory.get(key)
        torch.testing.assert_close(p.grad + owed, g, rtol=0, atol=1e-6)


# --- over real gloo processes ----------------------------------------------------------


def _gloo_tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)  # each rank its own, two chunks and a short one
    return [torch.randn(2 * CHUNK + 100, generator=g), torch.randn(7, 5, generator=g)]


def _exchange_over_gloo(rank: int, world: int, out: str) -> None:
    results = TorchTransport().run(
        SparseLoCo(0.05).exchange(["a", "b"], _gloo_tensors(rank), world)
    )  # fmt: skip
    gathered = [[torch.empty_like(avg) for _ in range(world)] for avg, _ in results]
    for (avg, _), slot in zip(results, gathered):
        dist.all_gather(slot, avg)
    if rank == 0:
        torch.save(gathered, out)


def test_over_gloo_every_rank_gets_bitwise_the_simulated_workers_average(tmp_path):
    out = tmp_path / "gloo.pt"
    run_processes(_exchange_over_gloo, 2, str(out))
    simulated, _ = exchange_once([SparseLoCo(0.05), SparseLoCo(0.05)],
                                 [_gloo_tensors(0), _gloo_tensors(1)])  # fmt: skip
    for tensor, per_rank in enumerate(torch.load(out)):
        for average in per_rank:
            assert torch.equal(average, simulated[0][tensor][0])
