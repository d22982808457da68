"""The integer quantiser: levels, packing, per-block scales, simulated workers' averages,
error feedback, the bytes on the wire, strategies and the controller."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from accordion.accounting import wire_bytes
from accordion.compress import (
    ErrorFeedback,
    IntQuantizer,
    NoMemory,
    Reducer,
    SimulatedTransport,
    compressor_class,
    compressor_names,
    make_compressor,
)
from accordion.compress.quantize import (
    BLOCK,
    block_count,
    dequantize,
    max_int,
    pack,
    quantize,
    unpack,
)
from accordion.compress.two_phase import two_phase_bytes
from accordion.compress.wire import allgather_bytes, allreduce_bytes

WORKERS = 3
BITS = (8, 4, 2)
# fp16's smallest subnormal: a scale rounded up to fp16 is off by less than this or 2**-10
HALF_TINY = 2.0**-24


def worker_tensors(seed: int, shape, workers: int = WORKERS) -> list[torch.Tensor]:
    """Per-worker tensors of ``shape``: a common mean plus noise of varying magnitude."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(shape, generator=gen)
    return [common + (w + 1) * torch.randn(shape, generator=gen) for w in range(workers)]


def exchange_once(compressors, tensors):
    """One exchange of simulated workers (one compressor, one list of tensors each),
    straight through the compressors; returns the results and the transport."""
    world = SimulatedTransport(len(compressors))
    keys = [f"t{i}" for i in range(len(tensors[0]))]
    results = world.run([c.exchange(keys, [t.clone() for t in ts], len(compressors))
                         for c, ts in zip(compressors, tensors)])  # fmt: skip
    return results, world


def block_bound(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per element of ``x``, half the scale of its block (rows: first dim by the rest),
    the scale computed here independently: max |x| / q, rounded up to fp16."""
    flat = x.reshape(1, -1) if x.dim() < 2 else x.reshape(x.shape[0], -1)
    cols = flat.shape[1]
    padded = torch.nn.functional.pad(flat.abs(), (0, -cols % BLOCK))
    absmax = padded.view(flat.shape[0], -1, BLOCK).amax(dim=-1) / max_int(bits)
    scale = absmax * (1 + 2.0**-10) + HALF_TINY
    per = scale.repeat_interleave(BLOCK, dim=-1)[:, :cols]
    return (per / 2).reshape(x.shape)


# --- registry and levels ---------------------------------------------------------------------


def test_the_registry_name_int_is_the_integer_quantiser_after_the_first_five():
    assert compressor_class("int") is IntQuantizer
    names = compressor_names()
    assert names[:5] == ("dense", "powersgd", "topk", "half", "powersgd1")  # hues unchanged
    assert names.index("int") >= 5
    assert IntQuantizer.default_levels == (8, 4)
    assert make_compressor("int").default_level == 8
    assert IntQuantizer.title == "integer quantisation"


def test_levels_read_write_label_and_order_by_bit_width():
    for bits in BITS:
        assert IntQuantizer.check_level(bits) == bits
        assert IntQuantizer.parse_level(f" {bits} ") == bits
        assert IntQuantizer.parse_level(IntQuantizer.level_text(bits)) == bits
        assert IntQuantizer.label(bits) == f"int{bits}"
    assert IntQuantizer.parse_level("4") == 4
    assert [IntQuantizer.aggressiveness(b) for b in BITS] == [4.0, 8.0, 16.0]


@pytest.mark.parametrize("level", [True, 8.0, "8", None])
def test_a_level_that_is_not_an_int_is_a_type_error(level):
    with pytest.raises(TypeError, match="8, 4 or 2"):
        IntQuantizer.check_level(level)


@pytest.mark.parametrize("level", [3, 16, 0, -8])
def test_another_int_level_is_a_value_error_naming_it_and_the_allowed_ones(level):
    with pytest.raises(ValueError, match=rf"\(8, 4, 2\) bits, got {level}"):
        IntQuantizer.check_level(level)
    with pytest.raises(ValueError):
        IntQuantizer(level)


@pytest.mark.parametrize("text", ["8.0", "eight", "3"])
def test_a_level_text_that_is_not_a_bit_width_is_a_value_error(text):
    with pytest.raises(ValueError):
        IntQuantizer.parse_level(text)


@pytest.mark.parametrize("shape", [(), (7,), (64, 20), (8, 3, 3, 3)])
def test_it_applies_to_every_tensor_and_pays_for_it(shape):
    assert IntQuantizer.applies_to(shape)
    for bits in BITS:
        assert IntQuantizer.pays(shape, bits)


# --- packing and blocks ----------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("count", [1, 3, 5, 64, 131])
def test_packing_round_trips_every_representable_value_negatives_included(bits, count):
    q = max_int(bits)
    everything = torch.arange(-q, q + 1, dtype=torch.int8)
    gen = torch.Generator().manual_seed(count)
    values = torch.cat([everything, everything[torch.randint(0, 2 * q + 1, (count,),
                                                             generator=gen)]])  # fmt: skip
    packed = pack(values, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == math.ceil(values.numel() * bits / 8)
    assert torch.equal(unpack(packed, bits, values.numel()), values)


def test_four_and_two_bit_values_share_a_byte_first_value_in_the_low_bits():
    assert pack(torch.tensor([-7, 7], dtype=torch.int8), 4).tolist() == [1 | 15 << 4]
    assert pack(torch.tensor([-1, 0, 1, 1], dtype=torch.int8), 2).tolist() == [
        1 | 2 << 2 | 3 << 4 | 3 << 6
    ]


def test_blocks_are_64_elements_of_a_row_the_last_of_a_row_shorter():
    assert BLOCK == 64
    assert block_count((10, 200)) == 10 * 4  # 64 + 64 + 64 + 8 per row
    assert block_count((8, 3, 3, 3)) == 8  # rows: first dim by the rest (27)
    assert block_count((130,)) == 3 and block_count(()) == 1 and block_count((0, 5)) == 0
    x = torch.zeros(2, 70)
    x[0, 65] = 3.0  # only the second block of row 0 holds it
    _, scales = quantize(x, 8)
    assert scales.dtype == torch.float16
    assert scales.tolist() == [0.0, pytest.approx(3 / 127, rel=1e-3), 0.0, 0.0]


@pytest.mark.parametrize("bits", BITS)
def test_a_blocks_largest_magnitude_is_sent_as_the_largest_integer(bits):
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(bits))
    values, scales = quantize(x, bits)
    assert values.abs().max() == max_int(bits)
    per_block = torch.nn.functional.pad(values.view(4, 100).abs(), (0, 28)).view(4, 2, 64)
    assert (per_block.amax(dim=-1) == max_int(bits)).all()
    absmax = torch.nn.functional.pad(x.abs(), (0, 28)).view(4, 2, 64).amax(dim=-1).flatten()
    exact = absmax / max_int(bits)
    assert (scales.float() >= exact).all()  # rounded up to fp16: no integer is clipped
    assert (scales.float() <= exact * (1 + 2.0**-10)).all()


# --- simulated workers -----------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_the_all_gathered_average_of_3_workers_is_the_mean_within_half_a_scale_each(bits):
    shapes = [(16, 150), (130,), (4, 3, 3, 3)]
    tensors = [[t for t in (worker_tensors(10 * bits + i, s)[w] for i, s in enumerate(shapes))]
               for w in range(WORKERS)]  # fmt: skip
    quantizers = [IntQuantizer(bits, collective="all_gather") for _ in range(WORKERS)]
    results, _ = exchange_once(quantizers, tensors)
    for i in range(len(shapes)):
        each = torch.stack([ts[i] for ts in tensors])
        mean = each.mean(dim=0)
        bound = sum(block_bound(t, bits) for t in each) / WORKERS
        average = results[0][i][0]
        assert average.shape == shapes[i] and average.dtype == torch.float32
        assert ((average - mean).abs() <= bound * (1 + 1e-5) + 1e-6).all()
        assert not torch.allclose(average, mean, atol=1e-6)  # it really was quantised
        for other in results[1:]:
            assert torch.equal(other[i][0], average)  # bitwise alike on every worker


@pytest.mark.parametrize("bits", BITS)
def test_residual_plus_the_dequantised_sent_value_is_the_input(bits):
    x = torch.randn(6, 100, generator=torch.Generator().manual_seed(bits))
    results, _ = exchange_once([IntQuantizer(bits)], [[x]])
    average, residual = results[0][0]
    # one worker: the average is its dequantised payload
    values, scales = quantize(x, bits)
    assert torch.equal(average, dequantize(values, scales, x.shape).view(x.shape))
    torch.testing.assert_close(residual + average, x, rtol=0, atol=1e-6)
    assert (residual.abs() <= block_bound(x, bits) * (1 + 1e-5)).all()
    assert residual.abs().max() > 0


@pytest.mark.parametrize("bits", BITS)
def test_with_error_feedback_the_all_gathered_running_mean_converges_to_the_true_mean(bits):
    grads = worker_tensors(7, (8, 96))
    mean = torch.stack(grads).mean(dim=0)
    steps = 200
    error = {}
    for memory in (ErrorFeedback, NoMemory):
        reducers = [Reducer(IntQuantizer(bits, collective="all_gather"), memory())
                    for _ in range(WORKERS)]  # fmt: skip
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


def test_zero_tensors_and_blocks_of_zeros_give_zeros_and_no_nan():
    x = torch.randn(3, 200)
    x[1] = 0.0  # a row of zeros
    x[0, 64:128] = 0.0  # one block of zeros
    zero = torch.zeros(5, 70)
    for bits in BITS:
        results, _ = exchange_once([IntQuantizer(bits) for _ in range(2)], [[x, zero]] * 2)
        (average, residual), (zeros, zero_residual) = results[0]
        assert torch.isfinite(average).all() and torch.isfinite(residual).all()
        assert (average[1] == 0).all() and (average[0, 64:128] == 0).all()
        assert (zeros == 0).all() and (zero_residual == 0).all()
        _, scales = quantize(zero, bits)
        assert (scales == 0).all()


@pytest.mark.parametrize(
    "shape", [(5, 200), (100,), (), (6, 4, 3, 3), (1, 1), (3, 64), (0,), (2, 0)]
)
@pytest.mark.parametrize("bits", BITS)
def test_any_shape_works_odd_sizes_biases_scalars_conv_weights_and_empty(shape, bits):
    tensors = [[t] for t in worker_tensors(sum(shape) + bits, shape, 2)]
    results, world = exchange_once([IntQuantizer(bits) for _ in range(2)], tensors)
    average, residual = results[0][0]
    assert average.shape == residual.shape == shape
    mean = (tensors[0][0] + tensors[1][0]) / 2
    bound = (block_bound(tensors[0][0], bits) + block_bound(tensors[1][0], bits)) / 2
    assert ((average - mean).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    assert world.bytes_sent == wire_bytes(shape, "int", bits, 2, 4)


def test_tensors_at_different_levels_travel_in_one_phase_of_two_all_gathers():
    compressor = IntQuantizer(8)
    compressor.set_level(2, keys=["b"])
    tensors = [torch.randn(6, 70), torch.randn(7), torch.randn(3, 3, 2, 2)]
    exchange = compressor.exchange(["a", "b", "c"], [t.clone() for t in tensors], 1)
    values, scales = next(exchange)
    assert values.tensor.dtype == torch.uint8 and scales.tensor.dtype == torch.float16
    assert values.tensor.numel() == 6 * 70 + math.ceil(7 * 2 / 8) + 36
    assert scales.tensor.numel() == 6 * 2 + 1 + 3
    with pytest.raises(StopIteration) as stop:
        exchange.send([values.tensor.unsqueeze(0), scales.tensor.unsqueeze(0)])
    for t, (average, _), bits in zip(tensors, stop.value.value, (8, 2, 8)):
        assert ((average - t).abs() <= block_bound(t, bits) * (1 + 1e-5)).all()


@pytest.mark.parametrize("bits", BITS)
def test_the_bytes_sent_in_two_phases_are_what_messages_and_ring_accounting_say(bits):
    # whole blocks in every row and 1024 = 4 workers * 4 blocks of 64: no chunk padding
    shapes = [(8, 64), (256,), (4, 64)]
    tensors = [[t[w] for t in (worker_tensors(i, s, 4) for i, s in enumerate(shapes))]
               for w in range(4)]  # fmt: skip
    _, world = exchange_once([IntQuantizer(bits) for _ in range(4)], tensors)
    messages = [m for s in shapes for m in IntQuantizer.messages(s, bits, 4)]
    assert all(m.op == "twophase" for m in messages)
    assert world.bytes_sent == sum(wire_bytes(s, "int", bits, 4, 4) for s in shapes)
    assert world.bytes_sent == allreduce_bytes(sum(m.nbytes for m in messages), 4)
    assert world.bytes_sent == two_phase_bytes(1024, bits, 4, BLOCK)


def test_messages_are_one_two_phase_share_of_padded_rows_with_the_unpadded_all_gather():
    for element_size in (2, 4, 8):
        (message,) = IntQuantizer.messages((10, 100), 4, element_size)
        # rows of 100 go in two blocks, 128 elements: 10 x 64 bytes at 4 bits
        assert (message.op, message.slot, message.nbytes) == ("twophase", "codes", 640 + 2 * 20)
        assert message.gathered == 500 + 2 * 20
    (scalar,) = IntQuantizer.messages((), 8, 4)
    assert (scalar.nbytes, scalar.gathered) == (64 + 2, 1 + 2)
    assert IntQuantizer.pays((), 8)  # 3 bytes < 4 all-gathered
    assert IntQuantizer.paper_floats((10, 100), 4, 4) == 1000 * 4 // 32 + 20
    assert IntQuantizer.paper_floats((), 2, 4) == 1 + 1


@pytest.mark.parametrize("bits", BITS)
def test_the_wire_bytes_against_dense_are_flat_in_the_workers_from_2_to_1024(bits):
    shape = (4096, 1024)
    ratios = {wire_bytes(shape, "int", bits, w, 4) / wire_bytes(shape, "dense", None, w, 4)
              for w in (2, 3, 8, 64, 512, 1024)}  # fmt: skip
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-12)
    assert min(ratios) == pytest.approx((bits / 8 + 2 / 64) / 4, rel=1e-12)


def test_at_two_workers_the_accounting_is_the_all_gather_that_auto_chooses():
    shape = (16, 3, 3, 3)
    (message,) = IntQuantizer.messages(shape, 8, 4)
    assert wire_bytes(shape, "int", 8, 2, 4) == allgather_bytes(message.gathered, 2)
    assert wire_bytes(shape, "int", 8, 8, 4) == 2 * 7 / 8 * message.nbytes  # two phases
    assert not IntQuantizer(8).two_phase_pays([math.prod(shape)], 8, 2)


def test_the_integer_quantiser_has_no_break_even_its_bytes_being_flat_in_the_workers():
    assert IntQuantizer.break_even([(1000, 512), (512,)], 8) is None
    assert IntQuantizer.break_even([(1000, 512)], 1024, element_size=2) is None


def test_an_overflowing_scale_is_a_non_finite_step_that_resets_the_memory():
    reducers = [Reducer(IntQuantizer(2)) for _ in range(2)]

    def step(values):
        inputs = [[torch.tensor(v)] for v in values]
        SimulatedTransport(2).run([r.exchange(["g"], x, 2) for r, x in zip(reducers, inputs)])
        return inputs[0][0]

    step([[0.3, 1.0, -0.2], [0.1, 0.4, 0.9]])
    assert reducers[0].memory.get("g").abs().max() > 0
    with pytest.warns(RuntimeWarning, match="non-finite"):
        average = step([[1e5, 1.0, 1.0], [1.0, 1.0, 1.0]])  # 1e5 / 1 overflows fp16 scales
    assert not torch.isfinite(average).all()  # written back: a GradScaler skips the step
    assert reducers[0].non_finite_steps == 1
    assert torch.count_nonzero(reducers[0].memory.get("g")) == 0


# --- strategies, controller and state ------------------------------------------------------


def test_static_and_accordion_int_strategies_parse():
    from accordion.harness.strategies import parse_strategy

    strategy = parse_strategy("static:int:4")
    assert (strategy.family, strategy.compressor, strategy.mild) == ("static", "int", 4)
    assert parse_strategy("static:int:8").mild == 8
    ladder = parse_strategy("accordion:int:8,4")
    assert (ladder.mild, ladder.aggressive) == (8, 4)


def test_the_controller_builds_with_int_levels_8_and_4_and_averages_locally():
    from accordion.ddp import AccordionState

    net = nn.Linear(70, 3)
    state = AccordionState(net, compressor="int", levels=(8, 4))
    assert state.ladder.levels == (8, 4)
    assert isinstance(state.reducer.compressor, IntQuantizer)
    nn.functional.mse_loss(net(torch.randn(5, 70)), torch.zeros(5, 3)).backward()
    before = [p.grad.clone() for p in net.parameters()]
    state.reduce_gradients()  # one process: the average is the dequantised gradient
    for p, g in zip(net.parameters(), before):
        assert ((p.grad - g).abs() <= block_bound(g, 8) * (1 + 1e-5)).all()


def test_a_state_dict_round_trips_through_torch_save_weights_only():
    compressor = IntQuantizer(8)
    compressor.set_level(2, keys=["fc.weight"])
    buffer = io.BytesIO()
    torch.save(compressor.state_dict(), buffer)
    buffer.seek(0)
    restored = IntQuantizer(4)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.state_dict() == compressor.state_dict()
    assert (restored.level("fc.weight"), restored.level("other")) == (2, 8)
    bad = {**compressor.state_dict(), "default_level": 3}
    with pytest.raises(ValueError, match="default_level"):
        restored.load_state_dict(bad)
