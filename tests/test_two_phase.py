"""The two-phase compressed all-reduce on simulated workers: its layout, its bytes (flat in
the workers, where an all-gather's grow), its error bound, error feedback with the server
error, the quantisers' choice of collective, and the server errors' checkpoint."""

from __future__ import annotations

import functools
import io
import math

import pytest
import torch

from accordion.compress import AllGather, AllToAll, IntQuantizer, SimulatedTransport
from accordion.compress.normalquant import NormalQuantizer
from accordion.compress.quantize import SCALE_BYTES, block_count, packed_bytes
from accordion.compress.two_phase import (
    ChunkLayout,
    ServerErrors,
    two_phase_bytes,
    two_phase_exchange,
)
from accordion.compress.wire import allgather_bytes
from two_phase_parts import IdentityCodec, int8_bound

BLOCK = 64


def worker_inputs(world_size: int, shapes, seed: int = 0) -> list[list[torch.Tensor]]:
    """Per worker, random tensors of ``shapes``, of a different scale on each worker."""
    gen = torch.Generator().manual_seed(seed)
    return [[(w + 1) * torch.randn(shape, generator=gen) for shape in shapes]
            for w in range(world_size)]  # fmt: skip


def true_mean(inputs: list[list[torch.Tensor]]) -> torch.Tensor:
    """The workers' flat inputs (each worker's tensors end to end), averaged in fp64."""
    flat = [torch.cat([t.reshape(-1) for t in ts]).double() for ts in inputs]
    return torch.stack(flat).mean(0)


def exchange(codec, inputs, bits: int, server_errors=None, second_bits=None):
    """One two-phase exchange of ``len(inputs)`` simulated workers on copies of
    ``inputs``; returns the results, the inputs after it (the residuals) and the transport."""
    world_size = len(inputs)
    world = SimulatedTransport(world_size)
    copies = [[t.clone() for t in ts] for ts in inputs]
    errors = server_errors or [None] * world_size
    results = world.run([two_phase_exchange(codec, ts, bits, world_size, e, second_bits)
                         for ts, e in zip(copies, errors)])  # fmt: skip
    return results, copies, world


# --- the layout and the bytes -----------------------------------------------------------


@pytest.mark.parametrize("numel", [1, 63, 64, 65, 4099, 2**16 + 3])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 64])
def test_chunks_are_whole_blocks_that_cover_every_element_with_less_than_a_block_each_spare(
    numel, world_size
):
    chunk = ChunkLayout(numel, world_size, BLOCK).chunk
    assert chunk % BLOCK == 0 and chunk > 0
    assert numel <= world_size * chunk < numel + world_size * BLOCK


def test_two_phase_bytes_are_zero_for_one_worker_or_no_elements():
    assert two_phase_bytes(4099, 8, 1, BLOCK) == 0
    assert two_phase_bytes(0, 8, 5, BLOCK) == 0
    assert two_phase_bytes(1, 8, 2, BLOCK) > 0


@pytest.mark.parametrize("codec,bits", [(IntQuantizer, 8), (IntQuantizer, 2),
                                        (NormalQuantizer, 2), (NormalQuantizer, 3)])  # fmt: skip
@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_bytes_handed_to_the_collectives_are_two_phase_bytes(codec, bits, world_size):
    inputs = worker_inputs(world_size, [(37, 5), (11,), ()])
    _, _, world = exchange(codec, inputs, bits)
    expected = two_phase_bytes(37 * 5 + 11 + 1, bits, world_size, BLOCK, SCALE_BYTES)
    assert world.bytes_sent == pytest.approx(expected, rel=1e-12)


def test_a_second_bit_width_is_counted_in_the_all_gather_phase():
    inputs = worker_inputs(4, [(1000,)])
    _, _, world = exchange(IntQuantizer, inputs, 8, second_bits=4)
    expected = two_phase_bytes(1000, 8, 4, BLOCK, SCALE_BYTES, second_bits=4)
    assert world.bytes_sent == pytest.approx(expected, rel=1e-12)
    assert expected < two_phase_bytes(1000, 8, 4, BLOCK, SCALE_BYTES)


@pytest.mark.parametrize("bits", [8, 2])
def test_two_phase_bytes_per_element_stay_flat_in_the_workers_while_all_gather_bytes_grow(bits):
    numel = 4099
    payload = packed_bytes(numel, bits) + SCALE_BYTES * block_count((numel,))  # one worker's
    for world_size in range(2, 9):
        inputs = [[t] for t in torch.randn(world_size, numel).unbind()]
        counted = {}
        for collective in ("two_phase", "all_gather"):
            world = SimulatedTransport(world_size)
            quantizers = [IntQuantizer(bits, collective) for _ in range(world_size)]
            world.run([q.exchange(["w"], [t.clone() for t in ts], world_size)
                       for q, ts in zip(quantizers, inputs)])  # fmt: skip
            counted[collective] = world.bytes_sent
        # two phases: 2 (W - 1) / W of the payload, at most W blocks of padding more
        padding = world_size * (packed_bytes(BLOCK, bits) + SCALE_BYTES)
        low = 2 * (world_size - 1) / world_size * payload
        assert low <= counted["two_phase"] <= low + 2 * padding
        assert counted["two_phase"] < 2 * (payload + padding)  # whatever W: flat
        assert counted["all_gather"] == allgather_bytes(payload, world_size)  # W - 1 payloads
    assert counted["all_gather"] > 3 * counted["two_phase"]  # at W = 8


# --- the arithmetic ---------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3, 7])
def test_a_lossless_codec_gives_the_dense_average_and_leaves_no_residual(world_size):
    shapes = [(3, 50), (17,), (), (0,), (4, 2, 3)]
    inputs = worker_inputs(world_size, shapes)
    results, residuals, _ = exchange(IdentityCodec, inputs, 32)
    mean = true_mean(inputs).float()
    for result in results:
        torch.testing.assert_close(result.average, mean, rtol=1e-6, atol=1e-6)
        assert not result.server_error.any()
    assert all(not t.any() for ts in residuals for t in ts)


@pytest.mark.parametrize("world_size", [3, 5])
@pytest.mark.parametrize("codec,bits", [(IntQuantizer, 4), (NormalQuantizer, 2)])
def test_each_input_is_left_holding_its_first_phase_residual(world_size, codec, bits):
    shapes = [(3, 50), (17,), (4, 2, 3)]
    inputs = worker_inputs(world_size, shapes)
    _, residuals, _ = exchange(codec, inputs, bits)
    chunk = ChunkLayout(sum(math.prod(s) for s in shapes), world_size, BLOCK).chunk
    for before, after in zip(inputs, residuals):
        flat = torch.cat([t.reshape(-1) for t in before])
        buffer = torch.nn.functional.pad(flat, (0, world_size * chunk - flat.numel()))
        codec.encode(buffer.view(world_size, chunk), bits)  # the owners' chunks, row by row
        assert torch.equal(torch.cat([t.reshape(-1) for t in after]), buffer[: flat.numel()])
        assert [t.shape for t in after] == [t.shape for t in before]
        assert buffer.abs().max() > 0  # lossy: something was left behind


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_an_int8_average_is_within_half_a_step_of_each_phase_of_the_true_mean(world_size):
    shapes = [(13, 70), (129,), (1,), (5, 3, 3)]
    inputs = worker_inputs(world_size, shapes, seed=world_size)
    results, _, _ = exchange(IntQuantizer, inputs, 8)
    mean = true_mean(inputs)
    bound = int8_bound([torch.cat([t.reshape(-1) for t in ts]) for ts in inputs])
    for result in results:
        error = (result.average.double() - mean).abs()
        assert (error <= bound).all(), (error / bound).max()
    assert (error > bound / 20).any()  # the bound is not slack by orders of magnitude


def test_every_simulated_worker_gets_bitwise_the_same_average():
    inputs = worker_inputs(5, [(300,), (7, 9)])
    for codec, bits in [(IntQuantizer, 8), (IntQuantizer, 2), (NormalQuantizer, 1)]:
        results, _, _ = exchange(codec, inputs, bits)
        assert all(torch.equal(r.average, results[0].average) for r in results)


def test_the_average_is_in_the_inputs_wide_dtype_and_float64_stays_float64():
    inputs = [[t.double()] for t in torch.randn(3, 200).unbind()]
    results, _, _ = exchange(IntQuantizer, inputs, 8)
    assert results[0].average.dtype == torch.float64
    inputs = [[t.half()] for t in torch.randn(3, 200).unbind()]
    results, _, _ = exchange(IntQuantizer, inputs, 8)
    assert results[0].average.dtype == torch.float32


def test_no_elements_send_nothing_and_give_empty_results():
    world = SimulatedTransport(4)
    results = world.run([two_phase_exchange(IntQuantizer, [torch.zeros(0)], 8, 4)
                         for _ in range(4)])  # fmt: skip
    assert world.bytes_sent == 0
    assert all(r.average.shape == (0,) and r.server_error.shape == (0,) for r in results)


def test_a_server_error_of_the_wrong_size_is_a_value_error():
    exchange_ = two_phase_exchange(IntQuantizer, [torch.randn(1000)], 8, 4,
                                   server_error=torch.zeros(100))  # fmt: skip
    with pytest.raises(ValueError, match="server_error must have 256 elements"):
        next(exchange_)


# --- 64 simulated workers -----------------------------------------------------------------

WIDE = 64
WIDE_SHAPES = [(40, 200), (37,)]  # 8037 elements: 2 blocks per owner, the last ones padding


def test_sixty_four_simulated_workers_get_bitwise_the_same_int8_average():
    results, _, _ = exchange(IntQuantizer, worker_inputs(WIDE, WIDE_SHAPES), 8)
    assert all(torch.equal(r.average, results[0].average) for r in results)


def test_sixty_four_simulated_workers_average_within_the_int8_bound():
    inputs = worker_inputs(WIDE, WIDE_SHAPES)
    results, _, _ = exchange(IntQuantizer, inputs, 8)
    bound = int8_bound([torch.cat([t.reshape(-1) for t in ts]) for ts in inputs])
    assert ((results[0].average.double() - true_mean(inputs)).abs() <= bound).all()


def test_sixty_four_simulated_workers_send_two_phase_bytes():
    _, _, world = exchange(IntQuantizer, worker_inputs(WIDE, WIDE_SHAPES), 8)
    numel = sum(math.prod(s) for s in WIDE_SHAPES)
    assert world.bytes_sent == pytest.approx(two_phase_bytes(numel, 8, WIDE, BLOCK), rel=1e-12)


def test_sixty_four_simulated_workers_with_a_lossless_codec_get_the_dense_average():
    inputs = worker_inputs(WIDE, WIDE_SHAPES)
    results, _, _ = exchange(IdentityCodec, inputs, 32)
    torch.testing.assert_close(results[0].average, true_mean(inputs).float(),
                               rtol=1e-6, atol=1e-5)  # fmt: skip


# --- error feedback: the worker error and the server error ------------------------------


@functools.cache  # each run is shared by the two tests that read it
def time_averaged_errors(with_server_error: bool, steps=(10, 50, 200)) -> dict[int, float]:
    """Four simulated workers, each with a constant gradient of its own, exchanged at 2 bits
    (deterministic rounding) with error feedback on the workers (the input is the gradient
    plus the last residual) and, optionally, on the owners (the server error passed back):
    per number of steps, the largest error of the averages' time-average against the true
    mean."""
    world_size, numel = 4, 256
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(numel, generator=gen) for _ in range(world_size)]
    mean = torch.stack(grads).double().mean(0)
    world = SimulatedTransport(world_size)
    worker_errors = [torch.zeros(numel) for _ in range(world_size)]
    server_errors = [None] * world_size
    total = torch.zeros(numel, dtype=torch.float64)
    errors = {}
    for step in range(1, max(steps) + 1):
        inputs = [g + e for g, e in zip(grads, worker_errors)]
        results = world.run([two_phase_exchange(IntQuantizer, [x], 2, world_size, s)
                             for x, s in zip(inputs, server_errors)])  # fmt: skip
        worker_errors = inputs  # each input now holds its residual
        if with_server_error:
            server_errors = [r.server_error for r in results]
        total += results[0].average.double()
        if step in steps:
            errors[step] = (total / step - mean).abs().max().item()
    errors["scale"] = max(g.abs().max().item() for g in grads)
    return errors


def test_with_the_server_error_the_time_average_converges_to_the_true_mean():
    errors = time_averaged_errors(with_server_error=True)
    # the sum telescopes: T times the time-average's error is the last worker error's mean
    # and the last server error, each at most a couple of gradients' magnitude
    assert errors[200] <= 3 * errors["scale"] / 200
    assert errors[200] < errors[10] / 10
    assert errors[200] < errors[50] / 2


def test_without_the_server_error_a_bias_remains_that_more_steps_do_not_remove():
    errors = time_averaged_errors(with_server_error=False)
    assert errors[200] > 10 * time_averaged_errors(with_server_error=True)[200]
    assert errors[200] > 0.8 * errors[50]  # 1/T would have shrunk it 4x
    assert errors[200] > 0.05 * errors["scale"]


# --- which collective the quantisers pick -----------------------------------------------


def first_phase(quantizer, numels, world_size) -> set[type]:
    """The kinds of collective in the first phase of ``quantizer``'s exchange of tensors
    of ``numels`` elements at ``world_size`` workers."""
    tensors = [torch.randn(n) for n in numels]
    phase = next(quantizer.exchange(list(range(len(numels))), tensors, world_size))
    return {type(op) for op in phase}


def test_auto_picks_the_all_gather_at_two_workers():
    quantizer = IntQuantizer(8)
    assert not quantizer.two_phase_pays([100_000], 8, 2)
    assert first_phase(quantizer, [100_000], 2) == {AllGather}


@pytest.mark.parametrize("world_size", [3, 4, 8, 64])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_auto_picks_two_phases_for_a_large_tensor_from_three_workers(world_size, bits):
    quantizer = IntQuantizer(bits)
    assert quantizer.two_phase_pays([100_000], bits, world_size)
    assert first_phase(quantizer, [100_000], world_size) == {AllToAll}


def test_auto_picks_the_all_gather_for_one_tiny_tensor_on_many_workers():
    quantizer = IntQuantizer(8)
    assert not quantizer.two_phase_pays([10], 8, 64)
    assert first_phase(quantizer, [10], 64) == {AllGather}


def test_auto_picks_two_phases_for_the_normal_quantizer_from_three_workers():
    quantizer = NormalQuantizer(2)
    assert first_phase(quantizer, [100_000], 2) == {AllGather}
    assert first_phase(quantizer, [100_000], 3) == {AllToAll}


@pytest.mark.parametrize("world_size", [2, 64])
def test_collective_two_phase_is_honoured_whatever_the_bytes(world_size):
    assert first_phase(IntQuantizer(8, "two_phase"), [10], world_size) == {AllToAll}


@pytest.mark.parametrize("world_size", [3, 64])
def test_collective_all_gather_is_honoured_whatever_the_bytes(world_size):
    assert first_phase(IntQuantizer(8, "all_gather"), [100_000], world_size) == {AllGather}


def test_a_bad_collective_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="collective.*'ring'"):
        IntQuantizer(8, collective="ring")
    with pytest.raises(ValueError, match="collective.*'ring'"):
        NormalQuantizer(2, collective="ring")


# --- the server errors ------------------------------------------------------------------


def kept_errors() -> ServerErrors:
    server = ServerErrors()
    server.put(["a", "b"], [100, 28], 4, 1, torch.arange(64.0))
    server.put(["c"], [10], 3, 1, torch.full((64,), 0.5))
    return server


def test_server_errors_round_trip_through_a_state_dict_and_a_file():
    buffer = io.BytesIO()
    torch.save(kept_errors().state_dict(), buffer)
    buffer.seek(0)
    loaded = ServerErrors()
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(loaded.get(["a", "b"], [100, 28], 4, 1, 64), torch.arange(64.0))
    assert torch.equal(loaded.get(["c"], [10], 3, 1, 64), torch.full((64,), 0.5))


def test_a_server_errors_state_dict_holds_copies():
    server = kept_errors()
    state = server.state_dict()
    state[0]["error"].zero_()
    assert torch.equal(server.get(["a", "b"], [100, 28], 4, 1, 64), torch.arange(64.0))


@pytest.mark.parametrize("bad", [
    {"keys": ["x"], "numels": [1, 2], "world_size": 2, "error": torch.zeros(64)},
    {"keys": ["x"], "numels": [-1], "world_size": 2, "error": torch.zeros(64)},
    {"keys": ["x"], "numels": [64], "world_size": 0, "error": torch.zeros(64)},
    {"keys": ["x"], "numels": [64], "world_size": 2, "error": torch.zeros(64, dtype=torch.int64)},
    {"keys": ["x"], "numels": [64], "world_size": 2, "error": torch.zeros(2, 32)},
    {"keys": ["x"], "numels": [64], "world_size": 2},
    {"keys": ["x"], "numels": [64], "world_size": 2, "local_size": 0, "error": torch.zeros(64)},
    "not a mapping",
])  # fmt: skip
def test_a_malformed_server_error_entry_is_a_value_error_naming_it_and_changes_nothing(bad):
    server = kept_errors()
    good = server.state_dict()[1]
    with pytest.raises(ValueError, match=r"server_error\[1\]"):
        server.load_state_dict([good, bad])
    assert torch.equal(server.get(["a", "b"], [100, 28], 4, 1, 64), torch.arange(64.0))
    assert torch.equal(server.get(["c"], [10], 3, 1, 64), torch.full((64,), 0.5))


def test_server_errors_that_are_not_a_list_are_a_value_error():
    with pytest.raises(ValueError, match="server_error must be a list"):
        ServerErrors().load_state_dict({"keys": ["a"]})


def test_a_server_error_kept_at_another_world_size_is_dropped_with_a_warning():
    server = kept_errors()
    kept = r"kept on 4 workers \(1 a host\), now 8 workers \(1 a host\)"
    with pytest.warns(RuntimeWarning, match=kept):
        assert server.get(["a", "b"], [100, 28], 8, 1, 64) is None
    assert server.get(["a", "b"], [100, 28], 4, 1, 64) is None  # gone, not kept aside
    assert server.get(["c"], [10], 3, 1, 64) is not None  # another layout's stays


def test_a_regrouped_call_starts_its_server_error_at_zero_without_a_warning(recwarn):
    server = kept_errors()
    assert server.get(["a"], [100], 4, 1, 64) is None
    assert server.get(["a", "b"], [100, 28], 4, 1, 64) is None  # replaced by the new layout
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_resetting_a_key_forgets_the_layouts_holding_it_only():
    server = kept_errors()
    server.reset(["b"])
    assert server.get(["a", "b"], [100, 28], 4, 1, 64) is None
    assert torch.equal(server.get(["c"], [10], 3, 1, 64), torch.full((64,), 0.5))


def test_renaming_a_key_moves_its_server_errors():
    server = kept_errors()
    server.rename("a", "z")
    assert torch.equal(server.get(["z", "b"], [100, 28], 4, 1, 64), torch.arange(64.0))
    assert server.get(["a", "b"], [100, 28], 4, 1, 64) is None


def quantizer_steps(quantizers, grads, residuals, world):
    """One exchange of ``quantizers`` (one per simulated worker) on ``grads`` plus
    ``residuals`` (updated in place); returns the averages."""
    inputs = [[g + e for g, e in zip(gs, es)] for gs, es in zip(grads, residuals)]
    results = world.run([q.exchange(["w", "b"], xs, world.world_size)
                         for q, xs in zip(quantizers, inputs)])  # fmt: skip
    for es, xs in zip(residuals, inputs):
        for e, x in zip(es, xs):
            e.copy_(x)
    return [torch.cat([r[0].reshape(-1) for r in result]) for result in results]


def test_an_int_quantizer_resumed_from_its_state_dict_continues_bitwise_identically():
    world = SimulatedTransport(3)
    grads = [worker_inputs(3, [(20, 30), (30,)], seed=step) for step in range(2)]
    quantizers = [IntQuantizer(2, "two_phase") for _ in range(3)]
    residuals = [[torch.zeros_like(g) for g in gs] for gs in grads[0]]
    quantizer_steps(quantizers, grads[0], residuals, world)
    states = []
    for q in quantizers:
        buffer = io.BytesIO()
        torch.save(q.state_dict(), buffer)
        buffer.seek(0)
        states.append(torch.load(buffer, weights_only=True))
    assert all(s["server_error"] and s["server_error"][0]["error"].any() for s in states)
    resumed = [IntQuantizer(2, "two_phase") for _ in range(3)]
    for q, state in zip(resumed, states):
        q.load_state_dict(state)
    fresh = [IntQuantizer(2, "two_phase") for _ in range(3)]
    expected = quantizer_steps(quantizers, grads[1], [[e.clone() for e in es] for es in residuals],
                               world)  # fmt: skip
    got = quantizer_steps(resumed, grads[1], [[e.clone() for e in es] for es in residuals], world)
    without = quantizer_steps(fresh, grads[1], residuals, world)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert not torch.equal(without[0], expected[0])  # the server error mattered
