"""Specification of accordion.costmodel (alpha-beta model) and accordion.plan.make_plan.

Expected numbers are worked out by hand in each test (see the comments).
"""

from __future__ import annotations

import math

import pytest

from accordion.compress import OneRoundPowerSGD, PowerSGD
from accordion.costmodel import (
    TensorCost,
    allgather_time,
    allreduce_time,
    choose_dense,
    fit_link,
    overlapped_step,
    parse_bandwidth,
    parse_latency,
)
from accordion.models import get_model
from accordion.plan import comm_time_per_step, make_plan

TEN_GBIT = 1.25e9  # bytes/s
FIFTY_US = 5e-5  # s


@pytest.fixture(scope="module")
def resnet18_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of the CIFAR-10 ResNet-18 (built once for the module)."""
    return [tuple(p.shape) for p in get_model("resnet18", num_classes=10).parameters()]


@pytest.fixture(scope="module")
def resnet18_plan(resnet18_shapes: list[tuple[int, ...]]):
    """The default plan: PowerSGD ranks 2 and 1, 4 workers, 29,400 steps, 10 Gbit, 50 us."""
    return make_plan(resnet18_shapes, "powersgd", [2, 1], 4, 29_400, TEN_GBIT, FIFTY_US)


# -------------------------------------------------------------------------- parse_bandwidth


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("10Gbit", 1.25e9),  # 10e9 bits / 8
        ("100mbit", 12.5e6),  # 100e6 bits / 8
        ("1GB/s", 1e9),
        ("1Gbps", 1.25e8),
        ("500kbit", 62_500.0),
        ("2MB/s", 2e6),
        (" 2.5 Gbit ", 3.125e8),
        ("1e1Gbit", 1.25e9),
    ],
)
def test_parse_bandwidth_converts_rates_to_bytes_per_second(text: str, bytes_per_s: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s, rel=1e-12)


@pytest.mark.parametrize("text", ["10GBIT", "10gbit", "10GbIt", "10gBiT"])
def test_parse_bandwidth_units_are_case_insensitive(text: str) -> None:
    assert parse_bandwidth(text) == pytest.approx(1.25e9, rel=1e-12)


def test_parse_bandwidth_uppercase_b_means_bytes_and_lowercase_b_bits() -> None:
    assert parse_bandwidth("1GB/s") == pytest.approx(1e9, rel=1e-12)
    assert parse_bandwidth("1gB/S") == pytest.approx(1e9, rel=1e-12)
    assert parse_bandwidth("1GBps") == pytest.approx(1e9, rel=1e-12)
    assert parse_bandwidth("1Gb/s") == pytest.approx(1.25e8, rel=1e-12)
    assert parse_bandwidth("1gbps") == pytest.approx(1.25e8, rel=1e-12)


@pytest.mark.parametrize("text", ["fast", "10", "-1Gbit", "Gbit", "10 furlongs", "", "1.2.3Gbit"])
def test_parse_bandwidth_rejects_malformed_text_naming_the_allowed_units(text: str) -> None:
    with pytest.raises(ValueError, match="bandwidth") as info:
        parse_bandwidth(text)
    message = str(info.value)
    for unit in ("gbit", "mbit", "B/s", "b/s", "bps"):
        assert unit in message


@pytest.mark.parametrize("text", ["0Gbit", "0.0MB/s", "1e999Gbit"])
def test_parse_bandwidth_rejects_zero_and_infinite_rates(text: str) -> None:
    with pytest.raises(ValueError, match="positive and finite"):
        parse_bandwidth(text)


@pytest.mark.parametrize("value", [10, 1.25e9, None, b"10Gbit"])
def test_parse_bandwidth_rejects_non_str_with_type_error(value: object) -> None:
    with pytest.raises(TypeError, match="bandwidth must be a str"):
        parse_bandwidth(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["0Gbit", 10])
def test_parse_bandwidth_zero_or_non_str_errors_also_name_the_allowed_units(
    value: object,
) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        parse_bandwidth(value)  # type: ignore[arg-type]
    assert "gbit" in str(info.value) and "B/s" in str(info.value)


# ---------------------------------------------------------------------------- parse_latency


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("50us", 5e-5),
        ("1ms", 1e-3),
        ("2s", 2.0),
        ("100ns", 1e-7),
        ("1.5MS", 1.5e-3),
        ("0ms", 0.0),
    ],
)
def test_parse_latency_converts_to_seconds(text: str, seconds: float) -> None:
    assert parse_latency(text) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize("text", ["0", " 0 "])
def test_parse_latency_accepts_a_bare_zero(text: str) -> None:
    assert parse_latency(text) == 0.0


@pytest.mark.parametrize("text", ["50", "fast", "-1ms", "1 parsec", "", "1min"])
def test_parse_latency_rejects_malformed_text_naming_the_allowed_units(text: str) -> None:
    with pytest.raises(ValueError, match="latency") as info:
        parse_latency(text)
    message = str(info.value)
    for unit in ("'ns'", "'us'", "'ms'", "'s'"):
        assert unit in message


def test_parse_latency_rejects_an_infinite_latency() -> None:
    with pytest.raises(ValueError, match="finite"):
        parse_latency("1e999s")


@pytest.mark.parametrize("value", [0, 5e-5, None])
def test_parse_latency_rejects_non_str_with_type_error(value: object) -> None:
    with pytest.raises(TypeError, match="latency must be a str"):
        parse_latency(value)  # type: ignore[arg-type]


# ------------------------------------------------------------------ alpha-beta collectives


def test_allreduce_time_is_two_w_minus_one_latencies_plus_ring_bandwidth_term() -> None:
    # W = 4, S = 1e6 B, B = 1e9 B/s, a = 1e-5 s:
    # 2 * 3 * 1e-5 + 2 * 3 / 4 * 1e6 / 1e9 = 6e-5 + 1.5e-3 = 1.56e-3
    assert allreduce_time(1e6, 4, 1e9, 1e-5) == pytest.approx(1.56e-3, rel=1e-12)


def test_allreduce_time_without_latency_is_pure_bandwidth() -> None:
    # W = 2: 2 * 1 / 2 * 1000 / 100 = 10 s
    assert allreduce_time(1000, 2, 100.0, 0.0) == pytest.approx(10.0, rel=1e-12)


def test_allgather_time_is_w_minus_one_latencies_plus_w_minus_one_chunks() -> None:
    # W = 4, s = 1e6 B, B = 1e9 B/s, a = 1e-5 s: 3 * 1e-5 + 3 * 1e6 / 1e9 = 3.03e-3
    assert allgather_time(1e6, 4, 1e9, 1e-5) == pytest.approx(3.03e-3, rel=1e-12)


@pytest.mark.parametrize("fn", [allreduce_time, allgather_time])
def test_one_worker_communicates_in_zero_time(fn) -> None:
    assert fn(1e9, 1, 1.0, 1.0) == 0.0


@pytest.mark.parametrize("fn", [allreduce_time, allgather_time])
def test_zero_bytes_take_zero_time(fn) -> None:
    assert fn(0, 8, 1e9, 1e-3) == 0.0


@pytest.mark.parametrize("fn", [allreduce_time, allgather_time])
@pytest.mark.parametrize("world_size", [0, -1])
def test_collective_time_rejects_a_world_size_below_one(fn, world_size: object) -> None:
    with pytest.raises(ValueError, match="world_size"):
        fn(1e6, world_size, 1e9, 0.0)


@pytest.mark.parametrize("fn", [allreduce_time, allgather_time])
@pytest.mark.parametrize("world_size", [True, 1.5])
def test_collective_time_rejects_a_non_int_world_size(fn, world_size: object) -> None:
    with pytest.raises(TypeError, match="world_size"):
        fn(1e6, world_size, 1e9, 0.0)


@pytest.mark.parametrize("fn", [allreduce_time, allgather_time])
@pytest.mark.parametrize("bandwidth", [0.0, -1e9, math.nan])
def test_collective_time_rejects_non_positive_bandwidth(fn, bandwidth: float) -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        fn(1e6, 4, bandwidth, 0.0)


@pytest.mark.parametrize("fn", [allreduce_time, allgather_time])
@pytest.mark.parametrize("latency", [-1e-6, math.nan])
def test_collective_time_rejects_negative_latency(fn, latency: float) -> None:
    with pytest.raises(ValueError, match="latency"):
        fn(1e6, 4, 1e9, latency)


# ------------------------------------------------------------------- comm_time_per_step


def test_powersgd_step_time_is_one_allreduce_each_for_dense_p_and_q() -> None:
    # shapes [4, 6] (compressed, rank 1) and [4] (dense); W = 2, B = 1000 B/s, a = 0.5 s.
    # each all-reduce costs 2 * 1 * 0.5 + 2 * 1 / 2 * bytes / 1000 = 1 + bytes / 1000
    # dense 4 elems = 16 B -> 1.016; P 4 * 1 = 16 B -> 1.016; Q 6 * 1 = 24 B -> 1.024
    assert comm_time_per_step([(4, 6), (4,)], "powersgd", 1, 2, 1000.0, 0.5) == pytest.approx(
        3.056, rel=1e-12
    )


def test_topk_step_time_is_dense_allreduce_plus_allgathers_of_values_and_indices() -> None:
    # shapes [10, 10] (top-k 10% -> 10 entries) and [4] (dense); W = 2, B = 1000, a = 0.5.
    # dense: 1 + 16 / 1000 = 1.016; each all-gather: 1 * 0.5 + 1 * 40 / 1000 = 0.54
    # (values 10 * 4 B, int32 indices 10 * 4 B)
    assert comm_time_per_step([(10, 10), (4,)], "topk", 0.1, 2, 1000.0, 0.5) == pytest.approx(
        2.096, rel=1e-12
    )


# -------------------------------------------------------------------------------- make_plan


def test_plan_first_row_is_dense_with_compression_ratio_one(resnet18_plan) -> None:
    dense = resnet18_plan[0]
    assert dense.label == "dense"
    assert dense.compressor == "dense"
    assert dense.level is None
    assert dense.compression_ratio == 1.0
    assert dense.floats_per_step == 11_173_962


def test_plan_has_one_row_per_level_after_dense(resnet18_plan) -> None:
    assert [row.label for row in resnet18_plan] == ["dense", "rank 2", "rank 1"]
    assert [row.level for row in resnet18_plan] == [None, 2, 1]


def test_plan_resnet18_rank1_row_sends_45935_floats_per_step(resnet18_plan) -> None:
    rank1 = resnet18_plan[2]
    assert rank1.compressor == "powersgd"
    assert rank1.floats_per_step == 45_935


def test_plan_resnet18_rank2_row_sends_82260_floats_per_step(resnet18_plan) -> None:
    assert resnet18_plan[1].floats_per_step == 82_260


def test_plan_floats_total_is_floats_per_step_times_steps(resnet18_plan) -> None:
    assert [row.floats_total for row in resnet18_plan] == [
        11_173_962 * 29_400,
        82_260 * 29_400,
        45_935 * 29_400,
    ]
    assert resnet18_plan[2].floats_total == 1_350_489_000


def test_plan_compression_ratio_is_dense_floats_over_level_floats(resnet18_plan) -> None:
    assert resnet18_plan[1].compression_ratio == pytest.approx(11_173_962 / 82_260, rel=1e-12)
    assert resnet18_plan[2].compression_ratio == pytest.approx(11_173_962 / 45_935, rel=1e-12)


def test_plan_dense_bytes_and_time_follow_the_ring_allreduce(resnet18_plan) -> None:
    dense = resnet18_plan[0]
    # 2 * 3 / 4 * 11,173,962 * 4 B = 67,043,772 B
    assert dense.bytes_per_step == 67_043_772.0
    # 2 * 3 * 50e-6 + 67,043,772 / 1.25e9 = 3e-4 + 0.0536350176
    assert dense.comm_time_per_step_s == pytest.approx(0.0539350176, rel=1e-12)


def test_plan_comm_time_rank1_below_rank2_below_dense_on_10gbit(resnet18_plan) -> None:
    dense, rank2, rank1 = (row.comm_time_per_step_s for row in resnet18_plan)
    assert 0 < rank1 < rank2 < dense


def test_plan_topk_rows_are_labelled_by_fraction(resnet18_shapes) -> None:
    rows = make_plan(resnet18_shapes, "topk", [0.99, 0.1], 4, 10, TEN_GBIT, FIFTY_US)
    assert [row.label for row in rows] == ["dense", "top-k 0.99", "top-k 0.1"]
    assert rows[2].floats_per_step == 8_941_010
    assert rows[2].floats_total == 89_410_100


def test_plan_as_dict_is_plain_and_json_ready(resnet18_plan) -> None:
    assert resnet18_plan[2].as_dict() == {
        "label": "rank 1",
        "compressor": "powersgd",
        "level": 1,
        "floats_per_step": 45_935,
        "floats_total": 1_350_489_000,
        "bytes_per_step": resnet18_plan[2].bytes_per_step,
        "compression_ratio": resnet18_plan[2].compression_ratio,
        "bytes_vs_dense": resnet18_plan[2].bytes_per_step / resnet18_plan[0].bytes_per_step,
        "comm_time_per_step_s": resnet18_plan[2].comm_time_per_step_s,
    }


def test_plan_rank1_bytes_per_step_are_ring_allreduce_of_the_paper_floats(resnet18_plan) -> None:
    # 2 * 3 / 4 * 45,935 * 4 B = 275,610 B
    assert resnet18_plan[2].bytes_per_step == pytest.approx(275_610.0, rel=1e-12)


@pytest.mark.parametrize("compressor", ["foo", "dense", "PowerSGD"])
def test_make_plan_rejects_unknown_compressor(resnet18_shapes, compressor: str) -> None:
    with pytest.raises(ValueError, match="compressor"):
        make_plan(resnet18_shapes, compressor, [1], 4, 10, TEN_GBIT, FIFTY_US)


@pytest.mark.parametrize(
    ("steps", "error"), [(-1, ValueError), (True, TypeError), (2.5, TypeError)]
)
def test_make_plan_rejects_steps_that_are_not_a_non_negative_int(
    resnet18_shapes, steps, error
) -> None:
    # the architecture issue: a wrong type is a TypeError, a bad value a ValueError
    with pytest.raises(error, match="steps"):
        make_plan(resnet18_shapes, "powersgd", [1], 4, steps, TEN_GBIT, FIFTY_US)


@pytest.mark.parametrize(("world_size", "error"), [(0, ValueError), (True, TypeError)])
def test_make_plan_rejects_invalid_world_size(resnet18_shapes, world_size, error) -> None:
    with pytest.raises(error, match="world_size"):
        make_plan(resnet18_shapes, "powersgd", [1], world_size, 10, TEN_GBIT, FIFTY_US)


# --- the cost model that decides -------------------------------------------------------


def test_fit_link_recovers_the_bandwidth_and_latency_that_generated_the_times():
    bandwidth, latency, world = 12.5e6, 200e-6, 4
    sizes = [4096, 262144, 1048576, 4194304]
    times = [allreduce_time(s, world, bandwidth, latency) for s in sizes]
    fitted_bandwidth, fitted_latency = fit_link(sizes, times, world)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=1e-9)
    assert fitted_latency == pytest.approx(latency, rel=1e-9)


def test_fit_link_takes_a_negative_fitted_latency_as_zero():
    sizes = [1000, 2000, 3000]
    times = [0.9e-3, 2.1e-3, 3.0e-3]  # a line through (0, -0.05 ms): noise on a fast link
    bandwidth, latency = fit_link(sizes, times, 2)
    assert latency == 0.0
    assert bandwidth == pytest.approx(sum(s * s for s in sizes) / sum(
        s * t for s, t in zip(sizes, times)), rel=1e-9)  # fmt: skip


@pytest.mark.parametrize(
    "sizes,times,world,match",
    [
        ([1000, 1000], [1e-3, 2e-3], 2, "two distinct sizes"),
        ([1000, 2000], [1e-3], 2, "same length"),
        ([1000, 2000], [2e-3, 1e-3], 2, "do not grow"),
        ([1000, 2000], [1e-3, float("nan")], 2, "positive and finite"),
        ([1000, 2000], [1e-3, 2e-3], 1, "world_size must be >= 2"),
    ],
)
def test_fit_link_rejects_inputs_it_cannot_fit(sizes, times, world, match):
    with pytest.raises(ValueError, match=match):
        fit_link(sizes, times, world)


def cost(key, dense_s, compressed_s, compute_s):
    return TensorCost(key, (4, 4), dense_s, compressed_s, compute_s)


def test_a_tensor_whose_compression_costs_more_than_it_saves_is_sent_dense():
    costs = [cost("pays", 10e-3, 1e-3, 2e-3), cost("costs", 1e-3, 0.2e-3, 2e-3)]
    assert choose_dense(costs, world_size=4, latency=0.0) == ["costs"]


def test_everything_is_dense_when_the_savings_do_not_cover_the_extra_collective():
    costs = [cost("a", 1.0e-3, 0.1e-3, 0.4e-3)]  # saves 0.5 ms
    # one more sequential all-reduce per bucket on 4 workers: 6 latencies of 0.1 ms
    assert choose_dense(costs, world_size=4, latency=0.1e-3, buckets=1) == ["a"]
    assert choose_dense(costs, world_size=4, latency=0.05e-3, buckets=1) == []


def test_a_compressor_that_adds_no_collective_pays_no_extra_latency():
    costs = [cost("a", 1.0e-3, 0.1e-3, 0.4e-3)]  # saves 0.5 ms, less than 6 latencies
    assert choose_dense(costs, world_size=4, latency=0.1e-3, buckets=1, rounds=1) == ["a"]
    # one-round PowerSGD's factors travel in the dense all-reduce: it still pays
    assert OneRoundPowerSGD.extra_collectives == 0 and PowerSGD.extra_collectives == 1
    assert choose_dense(costs, world_size=4, latency=0.1e-3, buckets=1, rounds=0) == []


def test_choose_dense_rejects_a_bucket_count_below_one():
    with pytest.raises(ValueError, match="buckets must be an int >= 1, got 0"):
        choose_dense([], 2, 0.0, buckets=0)


def big(key, dense_s, compressed_s, compute_s):
    """A 4 MiB fp32 gradient: more than DDP's first bucket holds, so a bucket of its own."""
    return TensorCost(key, (1024, 1024), dense_s, compressed_s, compute_s)


def test_a_big_early_gradient_hides_its_transfer_behind_the_rest_of_the_backward_pass():
    # 30 ms of computation: 10 forward, 20 backward; "early" (last in parameter order) is
    # ready halfway through the backward pass and its 5 ms go out while it goes on
    costs = [cost("late", 0.1e-3, 0.02e-3, 0.5e-3), big("early", 5e-3, 0.5e-3, 1e-3)]
    assert overlapped_step(costs, set(), 30e-3) == pytest.approx(30.1e-3)
    # compressing it only adds computation: nothing is compressed
    assert choose_dense(costs, 4, 0.0, compute_s=30e-3) == ["late", "early"]
    # without the overlap, its 3.5 ms saving would be taken
    assert choose_dense(costs, 4, 0.0) == ["late"]


def test_the_last_bucket_hides_nothing_so_a_one_bucket_model_compresses_what_pays():
    # both gradients share DDP's first bucket: it is sent when the backward pass ends
    costs = [cost("a", 5e-3, 1e-3, 0.2e-3), cost("b", 1e-3, 0.2e-3, 0.2e-3)]
    assert overlapped_step(costs, set(), 11e-3) == pytest.approx(17e-3)
    assert overlapped_step(costs, {"a", "b"}, 11e-3) == pytest.approx(12.6e-3)
    assert choose_dense(costs, 4, 0.0, compute_s=11e-3) == []


def test_a_bucket_goes_on_the_link_once_its_last_gradient_is_ready_and_the_link_is_free():
    costs = [big("first", 2e-3, 1e-3, 0.0), big("second", 8e-3, 1e-3, 0.0)]
    # forward 4 ms, backward 8: "second" is ready at 8 ms and holds the link until 16;
    # "first" is ready at 12 but waits for the link, then takes 2 ms
    assert overlapped_step(costs, set(), 12e-3) == pytest.approx(18e-3)
    # the extra collectives of compression and the dense-anyway tensors come last
    assert overlapped_step(costs, {"second"}, 12e-3, 1e-3, 0.5e-3) == pytest.approx(15.5e-3)


def test_with_computation_a_link_bound_step_compresses_until_the_link_stops_binding():
    # 58 ms of dense transfer against 11 ms of computation: compress the best saver first
    costs = [cost("big", 50e-3, 5e-3, 0.5e-3), cost("small", 8e-3, 1e-3, 0.5e-3)]
    # one bucket, sent at the end: none 69 ms; big alone 11.5 + 13; both 12 + 6 = 18 ms
    assert choose_dense(costs, 4, 0.0, compute_s=11e-3) == []
    # dense tensors of 20 ms keep the link the bottleneck whatever is compressed
    assert choose_dense(costs, 4, 0.0, compute_s=11e-3, other_s=20e-3) == []


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"compute_s": -1.0}, ValueError, "compute_s must be >= 0"),
        ({"compute_s": float("inf")}, ValueError, "compute_s must be >= 0 and finite"),
        ({"compute_s": "1ms"}, TypeError, "compute_s must be a number"),
        ({"compute_s": 0.0, "other_s": -1.0}, ValueError, "other_s must be >= 0"),
    ],
)
def test_choose_dense_rejects_bad_compute_and_other_times(kwargs, error, match):
    with pytest.raises(error, match=match):
        choose_dense([cost("a", 1e-3, 1e-4, 1e-4)], 2, 0.0, **kwargs)
