"""Specifications of the compressors, the error-feedback memory and the simulated transport."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accordion.accounting import wire_bytes
from accordion.compress import (
    AllReduce,
    Dense,
    ErrorFeedback,
    NoMemory,
    OneRoundPowerSGD,
    PowerSGD,
    Reducer,
    SimulatedTransport,
    TopK,
    make_compressor,
    orthogonalize_,
)
from accordion.compress.topk import topk_count
from numerics import assert_equal_up_to_rounding


def sent_p(phase, n):
    """The P factor (n x r) carried by a PowerSGD first phase (stored transposed)."""
    return phase[0].tensor.view(-1, n).t()


def compress_once(comp, key, tensor):
    """One step of the compressor itself, one worker: the reducer would send a small
    matrix dense at a rank that does not pay for it (``Compressor.pays``)."""
    SimulatedTransport(1).run([comp.exchange([key], [tensor], 1)])


def run_workers(reducers, keys, grads_per_worker):
    """One step of simulated workers; grads are replaced in place by the averages."""
    world = SimulatedTransport(len(reducers))
    world.run([r.exchange(keys, g, len(reducers)) for r, g in zip(reducers, grads_per_worker)])
    return world


def low_rank(n, m, r, gen):
    return torch.randn(n, r, generator=gen) @ torch.randn(r, m, generator=gen)


# --- PowerSGD ---------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_powersgd_reproduces_a_low_rank_average_of_simulated_workers(rank):
    gen = torch.Generator().manual_seed(rank)
    workers = 4
    reducers = [Reducer(PowerSGD(rank)) for _ in range(workers)]
    average = low_rank(48, 20, rank, gen)
    for step in range(5):
        # each worker's matrix is full rank; only their average has rank <= r
        noise = [torch.randn(48, 20, generator=gen) for _ in range(workers)]
        mean_noise = sum(noise) / workers
        grads = [[average + n - mean_noise] for n in noise]
        run_workers(reducers, ["w"], grads)
        if step >= 3:
            for g in grads:
                assert torch.linalg.norm(g[0] - average) / torch.linalg.norm(average) < 1e-4


@pytest.mark.numerics
def test_powersgd_batches_same_shape_tensors_without_changing_results():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(16, 3, 3, 3, generator=gen) for _ in range(3)]
    batched = [g.clone() for g in grads]
    run_workers([Reducer(PowerSGD(2))], ["a", "b", "c"], [batched])
    for key, g in zip("abc", grads):
        alone = [g.clone()]
        run_workers([Reducer(PowerSGD(2))], [key], [alone])
        torch.testing.assert_close(alone[0], batched["abc".index(key)], rtol=1e-5, atol=1e-6)


def test_powersgd_initial_q_is_shared_by_workers_and_distinct_per_tensor():
    a, b = PowerSGD(2, seed=7), PowerSGD(2, seed=7)
    qa = a.initial_q("layer.weight", 10, 3, torch.float32, torch.device("cpu"))
    qb = b.initial_q("layer.weight", 10, 3, torch.float32, torch.device("cpu"))
    other = a.initial_q("other.weight", 10, 3, torch.float32, torch.device("cpu"))
    assert torch.equal(qa, qb)
    assert not torch.equal(qa, other)


def test_powersgd_initial_q_keeps_its_leading_columns_across_ranks():
    comp = PowerSGD(4)
    q4 = comp.initial_q(0, 12, 4, torch.float32, torch.device("cpu"))
    q1 = comp.initial_q(0, 12, 1, torch.float32, torch.device("cpu"))
    assert torch.equal(q4[:, :1], q1)


def test_powersgd_redraw_policy_redraws_q_from_the_shared_seed_at_a_rank_change():
    comp = PowerSGD(4, on_rank_change="redraw")
    compress_once(comp, "w", torch.randn(8, 6))
    assert comp._q["w"].shape == (6, 4)
    comp.set_level(2, keys=["w"])
    m = torch.randn(8, 6)
    expected_p = m @ comp.initial_q("w", 6, 2, torch.float32, torch.device("cpu"))
    captured = []
    ex = comp.exchange(["w"], [m.clone()], 1)
    phase = next(ex)
    captured.append(sent_p(phase, 8).clone())
    torch.testing.assert_close(captured[0], expected_p)


def test_powersgd_reuses_leading_q_columns_by_default_when_the_rank_shrinks():
    comp = PowerSGD(4)
    compress_once(comp, "w", torch.randn(8, 6))
    q4 = comp._q["w"].clone()
    comp.set_level(1)
    m = torch.randn(8, 6)
    phase = next(comp.exchange(["w"], [m.clone()], 1))
    torch.testing.assert_close(sent_p(phase, 8), m @ q4[:, :1])


def test_powersgd_reuse_policy_appends_seed_columns_when_the_rank_grows():
    comp = PowerSGD(1, on_rank_change="reuse")
    compress_once(comp, "w", torch.randn(8, 6))
    q1 = comp._q["w"].clone()
    comp.set_level(3)
    m = torch.randn(8, 6)
    seed_q = comp.initial_q("w", 6, 3, torch.float32, torch.device("cpu"))
    expected = m @ torch.cat([q1, seed_q[:, 1:]], dim=1)
    phase = next(comp.exchange(["w"], [m.clone()], 1))
    torch.testing.assert_close(sent_p(phase, 8), expected)


def test_powersgd_rejects_an_unknown_rank_change_policy():
    with pytest.raises(ValueError, match="on_rank_change"):
        PowerSGD(2, on_rank_change="keep")


def test_powersgd_rank_is_clamped_to_the_matrix_shape():
    comp = PowerSGD(8)
    compress_once(comp, "w", torch.randn(3, 5))
    assert comp._q["w"].shape == (5, 3)


def test_orthogonalize_yields_orthonormal_columns():
    p = torch.randn(2, 10, 3, dtype=torch.float64)
    orthogonalize_(p)
    eye = torch.eye(3, dtype=torch.float64).expand(2, 3, 3)
    torch.testing.assert_close(p.transpose(1, 2) @ p, eye)


def test_orthogonalize_turns_a_zero_column_into_zeros_not_nan():
    p = torch.randn(1, 6, 3)
    p[..., 1] = 0
    p[..., 2] = p[..., 0]  # linearly dependent: becomes (numerically) zero too
    orthogonalize_(p)
    assert torch.isfinite(p).all()
    assert torch.equal(p[..., 1], torch.zeros(1, 6))


# --- Top-k ------------------------------------------------------------------------------


def test_topk_keeps_exactly_the_largest_magnitude_entries():
    values = torch.randperm(40).float().sub(20).reshape(5, 8)  # distinct magnitudes but 0
    values[values == 0] = 0.5
    k = topk_count(40, 0.25)
    expected_idx = set(values.abs().flatten().topk(k).indices.tolist())
    grads = [values.clone()]
    reducer = Reducer(TopK(0.25))
    run_workers([reducer], ["w"], [grads])
    kept = set(torch.nonzero(grads[0].flatten()).flatten().tolist())
    assert kept == expected_idx
    assert torch.equal(grads[0].flatten()[list(kept)], values.flatten()[list(kept)])


def test_topk_count_is_floor_of_fraction_times_numel_and_at_least_one():
    assert topk_count(100, 0.1) == 10
    assert topk_count(105, 0.1) == 10
    assert topk_count(5, 0.1) == 1
    assert topk_count(7, 1.0) == 7


def test_topk_averages_rather_than_sums_over_workers():
    a = torch.zeros(4, 4)
    a[0, 0] = 8.0
    b = torch.zeros(4, 4)
    b[3, 3] = -4.0
    grads = [[a.clone()], [b.clone()]]
    run_workers([Reducer(TopK(1 / 16)), Reducer(TopK(1 / 16))], ["w"], grads)
    expected = (a + b) / 2
    assert torch.equal(grads[0][0], expected)
    assert torch.equal(grads[1][0], expected)


def test_topk_sends_indices_as_int32():
    comp = TopK(0.5)
    ex = comp.exchange(["w"], [torch.randn(4, 4)], 1)
    values, indices = next(ex)
    assert values.tensor.dtype == torch.float32
    assert indices.tensor.dtype == torch.int32


# --- Error feedback ---------------------------------------------------------------------


def compressor_strategy():
    return st.one_of(
        st.just(("dense", None)),
        st.tuples(st.just("powersgd"), st.integers(1, 4)),
        st.tuples(st.just("powersgd1"), st.integers(1, 4)),
        st.tuples(st.just("topk"), st.floats(0.01, 1.0)),
    )


@settings(max_examples=30, deadline=None)
@given(
    spec=compressor_strategy(),
    steps=st.integers(1, 6),
    shape=st.sampled_from([(6, 4), (3, 2, 2), (8,), (1, 5)]),
    seed=st.integers(0, 10_000),
)
def test_error_feedback_conserves_mass_on_a_single_worker(spec, steps, shape, seed):
    gen = torch.Generator().manual_seed(seed)
    reducer = Reducer(make_compressor(*spec))
    total_in = torch.zeros(shape, dtype=torch.float64)
    total_out = torch.zeros(shape, dtype=torch.float64)
    for _ in range(steps):
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        total_in += g
        grads = [g.clone()]
        run_workers([reducer], ["w"], [grads])
        total_out += grads[0]
    memory = reducer.memory.get("w")
    remainder = torch.zeros(shape, dtype=torch.float64) if memory is None else memory
    torch.testing.assert_close(total_out + remainder, total_in, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "compressor",
    [PowerSGD(1), OneRoundPowerSGD(1), TopK(0.1)],
    ids=["powersgd", "powersgd1", "topk"],
)
def test_error_feedback_conserves_the_workers_mean_over_steps(compressor):
    gen = torch.Generator().manual_seed(1)
    workers, shape = 3, (12, 10)
    reducers = [
        Reducer(make_compressor(compressor.kind, compressor.default_level)) for _ in range(workers)
    ]
    total_mean_in = torch.zeros(shape, dtype=torch.float64)
    total_out = torch.zeros(shape, dtype=torch.float64)
    for _ in range(5):
        grads = [[torch.randn(shape, generator=gen, dtype=torch.float64)] for _ in range(workers)]
        total_mean_in += sum(g[0] for g in grads) / workers
        run_workers(reducers, ["w"], grads)
        total_out += grads[0][0]
    mean_memory = sum(r.memory.get("w") for r in reducers) / workers
    torch.testing.assert_close(total_out + mean_memory, total_mean_in)


def test_level_change_keeps_the_error_feedback_memory():
    comp = PowerSGD(4)
    reducer = Reducer(comp)
    run_workers([reducer], ["w"], [[torch.randn(10, 10)]])
    before = reducer.memory.get("w").clone()
    comp.set_level(1)
    assert torch.equal(reducer.memory.get("w"), before)
    # the next step compresses grad + the memory built at rank 4
    g = torch.randn(10, 10)
    grads = [g.clone()]
    run_workers([reducer], ["w"], [grads])
    torch.testing.assert_close(grads[0] + reducer.memory.get("w"), g + before)


def test_no_memory_drops_what_is_not_sent():
    reducer = Reducer(TopK(0.1), memory=NoMemory())
    run_workers([reducer], ["w"], [[torch.randn(10, 10)]])
    assert reducer.memory.get("w") is None


def test_one_dimensional_tensors_are_averaged_dense_without_memory():
    reducers = [Reducer(PowerSGD(1)), Reducer(PowerSGD(1))]
    biases = [torch.randn(7), torch.randn(7)]
    expected = (biases[0] + biases[1]) / 2
    grads = [[b.clone()] for b in biases]
    run_workers(reducers, ["bias"], grads)
    torch.testing.assert_close(grads[0][0], expected)
    assert reducers[0].memory.get("bias") is None


def test_dense_matches_plain_averaging():
    grads = [[torch.randn(5, 5), torch.randn(3)] for _ in range(4)]
    expected = [sum(g[i] / 4 for g in grads) for i in range(2)]
    run_workers([Reducer(Dense()) for _ in range(4)], ["a", "b"], grads)
    for g in grads:
        torch.testing.assert_close(g[0], expected[0])
        torch.testing.assert_close(g[1], expected[1])


# --- Zero, low precision and non-finite gradients --------------------------------------


@pytest.mark.parametrize(
    "name,level", [("dense", None), ("powersgd", 2), ("powersgd1", 2), ("topk", 0.2)]
)
def test_zero_gradient_gives_zeros(name, level):
    grads = [[torch.zeros(6, 4)], [torch.zeros(6, 4)]]
    run_workers([Reducer(make_compressor(name, level)) for _ in range(2)], ["w"], grads)
    assert torch.equal(grads[0][0], torch.zeros(6, 4))


def test_powersgd_recovers_after_zero_gradients():
    gen = torch.Generator().manual_seed(3)
    reducer = Reducer(PowerSGD(1))
    for _ in range(2):
        run_workers([reducer], ["w"], [[torch.zeros(8, 8)]])
    target = low_rank(8, 8, 1, gen)
    grads = [target.clone()]
    run_workers([reducer], ["w"], [grads])
    torch.testing.assert_close(grads[0], target, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "name,level", [("dense", None), ("powersgd", 2), ("powersgd1", 2), ("topk", 0.3)]
)
def test_low_precision_inputs_keep_their_dtype_and_match_fp32(dtype, name, level):
    gen = torch.Generator().manual_seed(5)
    base = [[low_rank(16, 12, 2, gen)] for _ in range(2)]
    reference = [[g[0].clone()] for g in base]
    run_workers([Reducer(make_compressor(name, level)) for _ in range(2)], ["w"], reference)
    grads = [[g[0].to(dtype)] for g in base]
    run_workers([Reducer(make_compressor(name, level)) for _ in range(2)], ["w"], grads)
    assert grads[0][0].dtype == dtype
    assert torch.isfinite(grads[0][0]).all()
    scale = reference[0][0].abs().max()
    assert (grads[0][0].float() - reference[0][0]).abs().max() < 0.05 * scale


@pytest.mark.parametrize("name,level", [("powersgd", 2), ("powersgd1", 2), ("topk", 0.3)])
def test_non_finite_gradient_warns_and_resets_the_memory_to_zero(name, level):
    reducers = [Reducer(make_compressor(name, level)) for _ in range(2)]
    run_workers(reducers, ["w"], [[torch.randn(6, 6)], [torch.randn(6, 6)]])
    assert all(r.memory.get("w").abs().max() > 0 for r in reducers)
    bad = torch.randn(6, 6)
    bad[2, 3] = math.inf
    grads = [[bad], [torch.randn(6, 6)]]
    with pytest.warns(RuntimeWarning, match="non-finite.*reset to zero"):
        run_workers(reducers, ["w"], grads)
    for r, g in zip(reducers, grads):
        assert not torch.isfinite(g[0]).all()  # passed on, so a GradScaler skips the step
        assert torch.count_nonzero(r.memory.get("w")) == 0  # nothing non-finite is kept
        assert r.non_finite_steps == 1
    # and the next finite step is finite again
    grads = [[torch.randn(6, 6)], [torch.randn(6, 6)]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_workers(reducers, ["w"], grads)
    assert torch.isfinite(grads[0][0]).all()


@pytest.mark.numerics
@pytest.mark.parametrize("name,level", [("powersgd", 2), ("powersgd1", 2), ("topk", 0.3)])
def test_after_a_non_finite_step_error_feedback_restarts_as_from_zero(name, level):
    # the step after an overflow must be the first step of a fresh reducer; up to rounding,
    # since the reset reducer reuses its buffers where the fresh one allocates (the kernels
    # MKL picks depend on alignment)
    reducers = [Reducer(make_compressor(name, level)) for _ in range(2)]
    fresh = [Reducer(make_compressor(name, level)) for _ in range(2)]
    run_workers(reducers, ["w"], [[torch.randn(6, 6)], [torch.randn(6, 6)]])
    bad = torch.randn(6, 6)
    bad[0, 0] = math.nan
    with pytest.warns(RuntimeWarning, match="non-finite"):
        run_workers(reducers, ["w"], [[bad], [torch.randn(6, 6)]])
    grads = [torch.randn(6, 6), torch.randn(6, 6)]
    after = [[g.clone()] for g in grads]
    reference = [[g.clone()] for g in grads]
    run_workers(reducers, ["w"], after)
    run_workers(fresh, ["w"], reference)
    for got, want in zip(after, reference):
        assert_equal_up_to_rounding(got[0], want[0], terms=6)
    for r, f in zip(reducers, fresh):
        assert_equal_up_to_rounding(r.memory.get("w"), f.memory.get("w"), terms=6)
        assert r.non_finite_steps == 1


def _storage_of(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def test_the_memory_is_compensated_in_place_in_one_buffer_per_set_of_keys():
    # error feedback costs one model-size buffer: the next input is written over the memory
    reducer = Reducer(PowerSGD(2))
    shapes = {"a": (8, 6), "b": (8, 6), "c": (5, 7)}
    where = None
    for _ in range(4):
        grads = [torch.randn(s) for s in shapes.values()]
        SimulatedTransport(1).run([reducer.exchange(list(shapes), grads, 1)])
        memories = [reducer.memory.get(k) for k in shapes]
        now = [m.data_ptr() for m in memories]
        assert where is None or now == where  # the same place every step
        where = now
        (storage,) = {_storage_of(m) for m in memories}  # one flat buffer, all of it live
        assert storage[1] == sum(m.numel() * 4 for m in memories)


@pytest.mark.numerics
def test_the_reducer_matches_hand_written_error_feedback_over_several_steps():
    # the reducer lays inputs out in reused buffers and writes averages in place; the
    # numbers must be those of the plain recipe: M = g + e, compress M, e = M - sent (up
    # to rounding: another layout in memory may get another BLAS kernel)
    torch.manual_seed(0)
    keys = ["a", "bias", "b", "c"]
    shapes = [(8, 6), (8,), (8, 6), (4, 3, 2)]
    reducer, reference = Reducer(PowerSGD(2)), PowerSGD(2)
    memory = {k: torch.zeros(s) for k, s in zip(keys, shapes) if len(s) > 1}
    for step in range(4):
        grads = [torch.randn(s) for s in shapes]
        expected = [g.clone() for g in grads]
        matrices = [k for k in keys if k in memory]
        inputs = [expected[keys.index(k)] + memory[k] for k in matrices]
        (results,) = SimulatedTransport(1).run([reference.exchange(matrices, inputs, 1)])
        for k, (average, residual) in zip(matrices, results):
            expected[keys.index(k)] = average
            memory[k] = residual.clone()
        SimulatedTransport(1).run([reducer.exchange(keys, grads, 1)])
        for k, got, want in zip(keys, grads, expected):
            assert_equal_up_to_rounding(got, want, terms=4 * 8, msg=f"step {step}, {k}")


@pytest.mark.numerics
def test_powersgd_writes_averages_into_out_with_the_same_numbers():
    # the same numbers up to rounding: a preallocated out may get another BLAS kernel
    torch.manual_seed(1)
    inputs = [torch.randn(8, 6), torch.randn(8, 6), torch.randn(5, 7)]
    plain, into = PowerSGD(2), PowerSGD(2)
    (expected,) = SimulatedTransport(1).run([plain.exchange("abc", [t.clone() for t in inputs], 1)])
    out = [torch.empty_like(t) for t in inputs]
    (got,) = SimulatedTransport(1).run([into.exchange("abc", [t.clone() for t in inputs], 1, out)])
    for (want_avg, want_res), (avg, res), o in zip(expected, got, out):
        assert avg is o
        assert_equal_up_to_rounding(avg, want_avg, terms=8)
        assert_equal_up_to_rounding(res, want_res, terms=8)


# --- Transport and accounting ----------------------------------------------------------


def test_simulated_transport_counts_the_accounted_wire_bytes():
    shapes = [(32, 3, 3, 3), (32,), (10, 32)]
    world = run_workers(
        [Reducer(PowerSGD(2)) for _ in range(4)],
        ["a", "b", "c"],
        [[torch.randn(s) for s in shapes] for _ in range(4)],
    )
    expected = sum(wire_bytes(s, "powersgd", 2, 4) for s in shapes)
    assert world.bytes_sent == pytest.approx(expected)


def test_simulated_transport_rejects_workers_that_disagree_on_shapes():
    world = SimulatedTransport(2)

    def ask(shape):
        yield [AllReduce(torch.zeros(shape))]

    with pytest.raises(RuntimeError, match="disagree"):
        world.run([ask((3,)), ask((4,))])


# --- State and validation ---------------------------------------------------------------


def test_powersgd_and_memory_state_round_trip_through_weights_only_load(tmp_path):
    comp = PowerSGD(2)
    reducer = Reducer(comp)
    run_workers([reducer], ["w", 3], [[torch.randn(12, 10), torch.randn(8, 8)]])
    path = tmp_path / "state.pt"
    torch.save({"c": comp.state_dict(), "m": reducer.memory.state_dict()}, path)
    loaded = torch.load(path, weights_only=True)
    comp2, memory2 = PowerSGD(1), ErrorFeedback()
    comp2.load_state_dict(loaded["c"])
    memory2.load_state_dict(loaded["m"])
    assert comp2.default_level == 2
    assert torch.equal(comp2._q["w"], comp._q["w"])
    assert torch.equal(memory2.get(3), reducer.memory.get(3))


def test_loading_a_different_compressor_kind_is_an_error():
    with pytest.raises(ValueError, match="powersgd"):
        TopK(0.1).load_state_dict(PowerSGD(2).state_dict())


@pytest.mark.parametrize("bad", [0, -1])
def test_powersgd_rejects_rank_below_one(bad):
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        PowerSGD(bad)


@pytest.mark.parametrize("bad", [2.5, True, "2", None])
def test_powersgd_rejects_non_integer_ranks(bad):
    with pytest.raises(TypeError, match="rank must be an int >= 1"):
        PowerSGD(bad)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, math.nan])
def test_topk_rejects_fractions_outside_zero_one(bad):
    with pytest.raises(ValueError, match=r"fraction must be a number in \(0, 1\]"):
        TopK(bad)


@pytest.mark.parametrize("bad", ["0.1", True, None])
def test_topk_rejects_non_numeric_fractions(bad):
    with pytest.raises(TypeError, match="fraction"):
        TopK(bad)


def test_set_level_rejects_a_bad_level_and_keeps_the_old_one():
    comp = PowerSGD(2)
    with pytest.raises(ValueError):
        comp.set_level(0, keys=["w"])
    assert comp.level("w") == 2


def test_make_compressor_rejects_unknown_names():
    with pytest.raises(ValueError, match="'dense', 'powersgd', 'topk'"):
        make_compressor("qsgd")


def test_reducer_rejects_mismatched_keys_and_integer_gradients():
    reducer = Reducer(PowerSGD(1))
    with pytest.raises(ValueError, match="differ in length"):
        next(reducer.exchange(["a"], [], 1))
    with pytest.raises(TypeError, match="floating point"):
        next(reducer.exchange(["a"], [torch.ones(2, 2, dtype=torch.int64)], 1))
    with pytest.raises(TypeError, match="Compressor"):
        Reducer("powersgd")


def test_a_key_switched_to_dense_sends_what_its_memory_owes_and_then_forgets_it():
    torch.manual_seed(0)
    grad = torch.randn(8, 6)
    reducer = Reducer(PowerSGD(1))
    SimulatedTransport(1).run([reducer.exchange(["w"], [grad.clone()], 1)])
    owed = reducer.memory.get("w").clone()
    assert owed.abs().sum() > 0
    reducer.set_dense(["w"])
    second = torch.randn(8, 6)
    work = second.clone()
    SimulatedTransport(1).run([reducer.exchange(["w"], [work], 1)])
    torch.testing.assert_close(work, second + owed)  # one worker: the average is the input
    assert reducer.memory.get("w") is None


def test_rebuilt_sets_of_keys_keep_using_the_buffer_their_memory_lives_in():
    # DDP rebuilds its buckets after the first step: no second model-size buffer then
    reducer = Reducer(PowerSGD(2), ErrorFeedback())
    grads = {k: torch.randn(8, 6) for k in "abc"}
    world = SimulatedTransport(1)
    world.run([reducer.exchange(list("abc"), [grads[k].clone() for k in "abc"], 1)])
    first = {k: reducer.memory.get(k).data_ptr() for k in "abc"}
    for keys in (["a", "b"], ["c"], ["a", "b"], ["c"]):
        world.run([reducer.exchange(keys, [grads[k].clone() for k in keys], 1)])
    assert {k: reducer.memory.get(k).data_ptr() for k in "abc"} == first


@pytest.mark.numerics
@pytest.mark.parametrize("name,level", [("powersgd", 2), ("powersgd1", 2), ("topk", 0.3)])
def test_ranks_whose_memories_lie_in_other_orders_still_exchange_alike(name, level):
    # the order of the tensors in a collective must not follow addresses, which differ
    # between ranks (after a checkpoint is loaded, say); a pairing gone wrong mixes
    # tensors, far beyond the rounding that another layout in memory may change
    gen = torch.Generator().manual_seed(3)
    memories = [{k: torch.randn(8, 6, generator=gen) for k in "ab"} for _ in range(2)]
    grads = [[torch.randn(8, 6, generator=gen) for _ in "ab"] for _ in range(2)]
    laid_out = [Reducer(make_compressor(name, level)) for _ in range(2)]
    for rank, (reducer, order) in enumerate(zip(laid_out, ("ab", "ba"))):
        flat = torch.cat([memories[rank][k].reshape(-1) for k in order])
        for i, k in enumerate(order):  # rank 1's "b" lies before its "a"
            reducer.memory.update(k, flat[48 * i : 48 * (i + 1)].view(8, 6))
    apart = [Reducer(make_compressor(name, level)) for _ in range(2)]
    for reducer, memory in zip(apart, memories):
        for k, m in memory.items():
            reducer.memory.update(k, m.clone())
    got = [[g.clone() for g in rank] for rank in grads]
    want = [[g.clone() for g in rank] for rank in grads]
    run_workers(laid_out, list("ab"), got)
    run_workers(apart, list("ab"), want)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert_equal_up_to_rounding(a, b, terms=8)


def test_keys_move_out_of_a_buffer_that_holds_a_memory_no_more_so_that_it_is_freed():
    reducer = Reducer(PowerSGD(2), ErrorFeedback())
    grads = {k: torch.randn(8, 6) for k in "abc"}
    world = SimulatedTransport(1)
    world.run([reducer.exchange(list("abc"), [grads[k].clone() for k in "abc"], 1)])
    old = _storage_of(reducer.memory.get("a"))
    reducer.set_dense(["c"])  # c's memory goes with its next (dense) exchange
    world.run([reducer.exchange(list("abc"), [grads[k].clone() for k in "abc"], 1)])
    assert reducer.memory.get("c") is None
    world.run([reducer.exchange(["a", "b"], [grads[k].clone() for k in "ab"], 1)])
    new = {_storage_of(reducer.memory.get(k)) for k in "ab"}
    assert len(new) == 1 and old not in new
    assert next(iter(new))[1] == 2 * 8 * 6 * 4  # exactly a's and b's memory
