"""RMS-scaled quantisation (``nq``): levels, the bit packing, the Gaussian grid, simulated
and real workers' averages, error feedback, the bytes, strategies and a ladder across
compressors."""

from __future__ import annotations

import math

import pytest
import torch

from accordion.accounting import wire_bytes
from accordion.compress import (
    ErrorFeedback,
    Mixed,
    NormalQuantizer,
    Reducer,
    SimulatedTransport,
    TorchTransport,
    compressor_class,
    compressor_names,
    make_compressor,
)
from accordion.compress.normalquant import (
    STEPS,
    pack_codes,
    rms_dequantize,
    rms_quantize,
    unpack_codes,
)
from accordion.compress.quantize import block_count
from distributed import run_processes

BITS = (4, 3, 2, 1)
# Max (1960): the mean squared error of the optimal uniform quantiser of a unit Gaussian
GAUSSIAN_MSE = {4: 0.01154, 3: 0.03744, 2: 0.1188, 1: 0.3634}


def decoded(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What one worker sends of ``x`` at ``bits``, decoded."""
    codes, scales = rms_quantize(x, bits)
    return rms_dequantize(codes, scales, x.shape, bits).view(x.shape)


def exchange(compressors, tensors):
    """One exchange of simulated workers on copies of ``tensors`` (a list per worker)."""
    world = SimulatedTransport(len(compressors))
    keys = [f"t{i}" for i in range(len(tensors[0]))]
    results = world.run([c.exchange(keys, [t.clone() for t in ts], len(compressors))
                         for c, ts in zip(compressors, tensors)])  # fmt: skip
    return results, world


# --- registry and levels ---------------------------------------------------------------------


def test_the_registry_name_nq_is_the_rms_scaled_quantiser_with_levels_3_and_2():
    assert compressor_class("nq") is NormalQuantizer
    assert compressor_names().index("nq") > compressor_names().index("int")
    assert NormalQuantizer.default_levels == (3, 2)
    assert make_compressor("nq").default_level == 3
    assert [NormalQuantizer.label(b) for b in BITS] == ["nq4", "nq3", "nq2", "nq1"]
    assert [NormalQuantizer.parse_level(f" {b} ") for b in BITS] == list(BITS)


def test_fewer_bits_are_more_aggressive():
    assert [NormalQuantizer.aggressiveness(b) for b in BITS] == [8.0, 32 / 3, 16.0, 32.0]


@pytest.mark.parametrize("level", [True, 2.0, "2", None])
def test_a_level_that_is_not_an_int_is_a_type_error_naming_the_widths(level):
    with pytest.raises(TypeError, match="4, 3, 2 or 1"):
        NormalQuantizer.check_level(level)


@pytest.mark.parametrize("level", [8, 0, 5, -2])
def test_another_bit_width_is_a_value_error_naming_it_and_the_allowed_ones(level):
    with pytest.raises(ValueError, match=rf"\(4, 3, 2, 1\) bits, got {level}"):
        NormalQuantizer.check_level(level)
    with pytest.raises(ValueError):
        NormalQuantizer(level)


# --- packing and the grid --------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("count", [1, 7, 8, 9, 130])
def test_codes_pack_into_ceil_n_bits_over_8_bytes_and_unpack_unchanged(bits, count):
    codes = torch.randint(0, 2**bits, (count,), generator=torch.Generator().manual_seed(count))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(count * bits / 8)
    assert torch.equal(unpack_codes(packed.unsqueeze(0), bits, count)[0], codes.to(torch.int16))


def test_three_bit_codes_straddle_bytes_lowest_bit_first():
    packed = pack_codes(torch.tensor([5, 3, 6]), 3)  # 101, 011, 110: stream 101 110 011
    assert packed.tolist() == [0b10011101, 0b1]


@pytest.mark.parametrize("bits", BITS)
def test_on_gaussian_blocks_the_error_is_maxs_optimum(bits):
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(bits))
    mse = float((decoded(x, bits) - x).square().mean() / x.square().mean())
    assert mse == pytest.approx(GAUSSIAN_MSE[bits], rel=0.08)


def test_two_bits_use_all_four_levels_symmetric_about_zero_and_none_is_zero():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    codes, scales = rms_quantize(x, 2)
    assert set(codes.tolist()) == {0, 1, 2, 3}
    rms = x.square().mean(-1).sqrt()
    assert torch.allclose(scales.float(), rms, rtol=2**-10)
    levels = decoded(x, 2) / (scales.float().unsqueeze(1) * STEPS[2])
    assert set(levels.unique().tolist()) == {-1.5, -0.5, 0.5, 1.5}


def test_the_last_short_block_of_a_row_is_scaled_by_its_own_elements_only():
    x = torch.cat([torch.full((1, 64), 0.01), torch.full((1, 1), 3.0)], dim=1)  # 65 in a row
    _, scales = rms_quantize(x, 4)
    assert scales.tolist() == pytest.approx([0.01, 3.0], rel=2**-10)


def test_zeros_send_zeros_and_no_nan():
    codes, scales = rms_quantize(torch.zeros(3, 70), 2)
    assert torch.count_nonzero(scales) == 0
    assert torch.count_nonzero(rms_dequantize(codes, scales, (3, 70), 2)) == 0


# --- the exchange ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(5, 200), (100,), (), (6, 4, 3, 3), (0,)])
def test_the_all_gathered_average_is_the_mean_of_what_each_worker_sends(bits, shape):
    gen = torch.Generator().manual_seed(bits)
    tensors = [[torch.randn(shape, generator=gen)] for _ in range(3)]
    quantizers = [NormalQuantizer(bits, collective="all_gather") for _ in range(3)]
    results, world = exchange(quantizers, tensors)
    expected = sum(decoded(t[0], bits) for t in tensors) / 3
    for (average, residual), t in zip((r[0] for r in results), tensors):
        torch.testing.assert_close(average, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(residual + decoded(t[0], bits), t[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(results[0][0][0], results[2][0][0])


@pytest.mark.parametrize("bits", BITS)
def test_the_bytes_are_packed_codes_and_two_per_scale_in_two_phases(bits):
    (message,) = NormalQuantizer.messages((10, 100), bits, 4)
    assert message.op == "twophase"
    assert message.nbytes == math.ceil(1280 * bits / 8) + 2 * block_count((10, 100))  # rows padded
    assert message.gathered == math.ceil(1000 * bits / 8) + 2 * block_count((10, 100))


@pytest.mark.parametrize("bits", BITS)
def test_the_bytes_sent_by_3_workers_are_what_the_accounting_says(bits):
    shape = (6, 64)  # 384 = 3 workers * 2 blocks of 64: no chunk padding
    gen = torch.Generator().manual_seed(bits)
    tensors = [[torch.randn(shape, generator=gen)] for _ in range(3)]
    _, world = exchange([NormalQuantizer(bits) for _ in range(3)], tensors)
    assert world.bytes_sent == wire_bytes(shape, "nq", bits, 3, 4)


def test_with_error_feedback_the_running_mean_of_one_bit_converges_to_the_true_mean():
    gen = torch.Generator().manual_seed(3)
    truth = [torch.randn(20, 64, generator=gen) for _ in range(2)]
    reducers = [Reducer(NormalQuantizer(1), ErrorFeedback()) for _ in range(2)]
    total = torch.zeros(20, 64)
    for _ in range(1000):
        grads = [[t.clone()] for t in truth]
        SimulatedTransport(2).run([r.exchange(["g"], g, 2) for r, g in zip(reducers, grads)])
        total += grads[0][0]
    # the error of the running mean is the memory over the steps: bounded, so it shrinks
    assert float((total / 1000 - (truth[0] + truth[1]) / 2).abs().max()) < 0.03


def test_nq2_sends_0_07x_dense_at_every_worker_count_from_2_to_1024():
    shape = (4096, 1024)
    for workers in (2, 3, 8, 64, 512, 1024):
        ratio = wire_bytes(shape, "nq", 2, workers, 4) / wire_bytes(shape, "dense", None,
                                                                    workers, 4)  # fmt: skip
        assert ratio == pytest.approx((2 / 8 + 2 / 64) / 4, rel=1e-12)
    assert NormalQuantizer.break_even([(1000, 512)], 8) is None


# --- ladders across compressors and strategies -----------------------------------------------


def test_a_mixed_ladder_orders_nq2_beyond_int4_and_carries_the_residual_across():
    ladder = Mixed("int/4")
    assert Mixed.aggressiveness("nq/2") > Mixed.aggressiveness("int/4")
    assert Mixed.aggressiveness("nq/3") > Mixed.aggressiveness("int/4")
    reducer = Reducer(ladder, ErrorFeedback())
    grad = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    sent = []
    for level in ("int/4", "nq/2"):
        ladder.set_level(level)
        g = [grad.clone()]
        SimulatedTransport(1).run([reducer.exchange(["w"], g, 1)])
        sent.append(g[0])
    # what int4 left unsent went out with nq2's step: sent plus memory is all the input
    torch.testing.assert_close(sent[0] + sent[1] + reducer.memory.get("w"), 2 * grad)


def test_static_nq_and_a_ladder_from_int_to_nq_parse_as_strategies():
    from accordion.harness.strategies import parse_strategy

    assert parse_strategy("static:nq:3").mild == 3
    ladder = parse_strategy("accordion:mixed:int/4,nq/2")
    assert (ladder.compressor, ladder.mild, ladder.aggressive) == ("mixed", "int/4", "nq/2")


def _nq_in_processes(rank: int, world_size: int, out_dir: str) -> None:
    reducer = Reducer(NormalQuantizer(3))
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(rank)) for s in SHAPES]
    TorchTransport().run(reducer.exchange(list(range(len(SHAPES))), grads, world_size))
    torch.save(grads, f"{out_dir}/rank{rank}.pt")


SHAPES = [(9, 70), (7,), (4, 3, 3, 3)]


def test_gloo_processes_average_what_simulated_workers_average(tmp_path):
    run_processes(_nq_in_processes, 2, str(tmp_path))
    inputs = [[torch.randn(s, generator=torch.Generator().manual_seed(r)) for s in SHAPES]
              for r in range(2)]  # fmt: skip
    expected, _ = exchange([NormalQuantizer(3) for _ in range(2)], inputs)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for g, (average, _) in zip(got, expected[rank]):
            # two transports, two processes' thread counts: a tolerance, not bitwise
            torch.testing.assert_close(g, average, rtol=1e-6, atol=1e-7)
