"""Specification of accordion.accounting: paper floats, wire bytes and the Ledger.

Expected numbers are worked out by hand in each test (see the comments), never by
calling the function under test a second time.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
import torch

from accordion.accounting import Ledger, paper_floats, wire_bytes
from accordion.compress import PowerSGD
from accordion.models import get_model

WORKERS = 4
STEPS = 29_400  # 98 steps/epoch x 300 epochs

# ResNet-18 (kuangliu CIFAR variant) by hand: the (n, m) matrix view of each of its 21
# tensors with >= 2 dims (conv [out, in, kh, kw] -> n = out, m = in*kh*kw), and the
# entries of its 1-D tensors (batch-norm weights and biases, linear bias), which always
# travel dense. 64+64 (bn1) + 8 blocks' bn pairs + 3 shortcut bn pairs + 10 (linear bias):
# 2*64 + 4*2*64 + 2*(2*128*2 + 128) + 2*(2*256*2 + 256) + 2*(2*512*2 + 512) + 10 = 9,610.
RESNET18_C10_VECTOR_ENTRIES = 9_610
RESNET18_C10_MATRICES = (
    [(64, 27)]  # conv1: 64 x 3*3*3
    + [(64, 576)] * 4  # layer1: 4 convs 64 x 64*3*3
    + [(128, 576)]  # layer2.0.conv1: 128 x 64*3*3
    + [(128, 1152)] * 3  # layer2 remaining convs: 128 x 128*3*3
    + [(128, 64)]  # layer2 shortcut 1x1
    + [(256, 1152)]  # layer3.0.conv1
    + [(256, 2304)] * 3
    + [(256, 128)]  # layer3 shortcut 1x1
    + [(512, 2304)]  # layer4.0.conv1
    + [(512, 4608)] * 3
    + [(512, 256)]  # layer4 shortcut 1x1
    + [(10, 512)]  # linear
)


def truncated_tenths(count: int, unit: int) -> Decimal:
    """``count`` in ``unit`` (1e6 for M, 1e9 for B), truncated to one decimal as the paper does."""
    return Decimal(count // (unit // 10)).scaleb(-1)


@pytest.fixture(scope="module")
def resnet18_shapes() -> dict[int, list[tuple[int, ...]]]:
    """Parameter shapes of ResNet-18 for CIFAR-10 and CIFAR-100 (each built once)."""
    return {
        classes: [tuple(p.shape) for p in get_model("resnet18", num_classes=classes).parameters()]
        for classes in (10, 100)
    }


def data_sent(shapes: list[tuple[int, ...]], kind: str, level: object) -> int:
    """Paper-convention floats per worker over the whole run (4 workers, 29,400 steps)."""
    return STEPS * sum(paper_floats(s, kind, level, WORKERS) for s in shapes)


# --------------------------------------------------------------------------- paper_floats


def test_dense_tensor_costs_its_numel_floats() -> None:
    assert paper_floats([64, 3, 3, 3], "dense", None, WORKERS) == 64 * 3 * 3 * 3 == 1_728
    assert paper_floats([10, 512], "dense", None, 1) == 5_120


def test_powersgd_tensor_costs_n_plus_m_times_rank_floats() -> None:
    # n = 64, m = 3*3*3 = 27: (64 + 27) * 2
    assert paper_floats([64, 3, 3, 3], "powersgd", 2, WORKERS) == 182


def test_powersgd_floats_do_not_depend_on_world_size() -> None:
    # the paper's convention has no ring factor: (10 + 512) * 4 for any W
    assert paper_floats([10, 512], "powersgd", 4, 1) == 2_088
    assert paper_floats([10, 512], "powersgd", 4, 64) == 2_088


def test_powersgd_rank_is_clamped_to_min_of_n_and_m() -> None:
    # The compressor's formula: [64, 27] at rank 100: r' = 27 -> (64 + 27) * 27
    assert PowerSGD.paper_floats((64, 3, 3, 3), 100, WORKERS) == 2_457
    # [10, 512] at rank 20: r' = n = 10 -> (10 + 512) * 10
    assert PowerSGD.paper_floats((10, 512), 20, WORKERS) == 5_220
    # [512, 4] (tall) at rank 8: r' = m = 4 -> (512 + 4) * 4
    assert PowerSGD.paper_floats((512, 4), 8, WORKERS) == 2_064
    # A clamped rank never pays ((n + m) min(n, m) >= n m), so the hook sends these
    # tensors dense and the accounting charges their numel: 1728, 5120 and 2048.
    assert paper_floats([64, 3, 3, 3], "powersgd", 100, WORKERS) == 1_728
    assert paper_floats([10, 512], "powersgd", 20, WORKERS) == 5_120
    assert paper_floats([512, 4], "powersgd", 8, WORKERS) == 2_048


def test_topk_tensor_costs_twice_floor_k_numel_times_workers() -> None:
    # numel 1728, k = floor(0.1 * 1728) = floor(172.8) = 172 -> 2 * 172 * 4
    assert paper_floats([64, 3, 3, 3], "topk", 0.1, WORKERS) == 1_376
    # same tensor, 8 workers -> 2 * 172 * 8
    assert paper_floats([64, 3, 3, 3], "topk", 0.1, 8) == 2_752


def test_topk_keeps_at_least_one_entry() -> None:
    # floor(0.001 * 50) = 0, raised to 1 -> 2 * 1 * 4
    assert paper_floats([10, 5], "topk", 0.001, WORKERS) == 8


def test_topk_of_an_empty_tensor_sends_nothing() -> None:
    assert paper_floats([0, 5], "topk", 0.5, WORKERS) == 0


@pytest.mark.parametrize(("kind", "level"), [("dense", None), ("powersgd", 2), ("topk", 0.1)])
def test_one_dimensional_tensor_is_always_counted_dense(kind: str, level: object) -> None:
    assert paper_floats([64], kind, level, WORKERS) == 64


@pytest.mark.parametrize(("kind", "level"), [("powersgd", 1), ("topk", 0.01)])
def test_scalar_tensor_is_counted_dense_as_one_float(kind: str, level: object) -> None:
    assert paper_floats([], kind, level, WORKERS) == 1


# ----------------------------------------------------------------------------- wire_bytes


def test_dense_wire_bytes_are_ring_allreduce_of_the_tensor() -> None:
    # S = 1000 * 4 bytes; 2 * (4 - 1) / 4 * 4000 = 6000
    assert wire_bytes([1000], "dense", None, 4) == 6_000.0


def test_powersgd_wire_bytes_are_ring_allreduce_of_the_factors() -> None:
    # (64 + 27) * 2 = 182 floats = 728 bytes; 2 * 3 / 4 * 728 = 1092
    assert wire_bytes([64, 3, 3, 3], "powersgd", 2, 4) == 1_092.0


def test_topk_wire_bytes_are_allgather_of_values_and_int32_indices() -> None:
    # k = 172; each entry is a 4-byte value + 4-byte int32 index; (4 - 1) * 172 * 8
    assert wire_bytes([64, 3, 3, 3], "topk", 0.1, 4) == 4_128.0


def test_topk_indices_stay_int32_up_to_2_pow_31_minus_1_entries() -> None:
    # numel = 2**31 - 1; k = floor(1e-9 * 2147483647) = 2; (4 - 1) * 2 * (4 + 4)
    assert wire_bytes([2**31 - 1, 1], "topk", 1e-9, 4) == 48.0


def test_topk_indices_are_int64_beyond_2_pow_31_minus_1_entries() -> None:
    # numel = 2**31; k = floor(2.147483648) = 2; (4 - 1) * 2 * (4 + 8)
    assert wire_bytes([2**16, 2**15], "topk", 1e-9, 4) == 72.0


@pytest.mark.parametrize(
    ("shape", "kind", "level"),
    [([1000], "dense", None), ([64, 3, 3, 3], "powersgd", 2), ([64, 3, 3, 3], "topk", 0.1)],
)
def test_a_single_worker_sends_zero_bytes(shape: list[int], kind: str, level: object) -> None:
    assert wire_bytes(shape, kind, level, 1) == 0.0


def test_element_size_two_halves_dense_bytes() -> None:
    # 2 * 3 / 4 * (1000 * 2) = 3000, half of the fp32 6000
    assert wire_bytes([1000], "dense", None, 4, element_size=2) == 3_000.0


def test_topk_element_size_two_shrinks_values_but_not_indices() -> None:
    # (4 - 1) * 172 * (2 + 4)
    assert wire_bytes([64, 3, 3, 3], "topk", 0.1, 4, element_size=2) == 3_096.0


def test_one_dimensional_tensor_goes_on_the_wire_dense_under_topk() -> None:
    # all-reduce, not all-gather: 2 * 3 / 4 * 64 * 4 = 384
    assert wire_bytes([64], "topk", 0.1, 4) == 384.0


# ---------------------------------------------------------- the paper's "Data Sent" column


def test_resnet18_per_step_rank1_floats_match_the_hand_sum_of_its_matrix_views(
    resnet18_shapes: dict[int, list[tuple[int, ...]]],
) -> None:
    # 9,610 dense entries + sum(n + m) = 9,610 + 36,325
    assert sum(n + m for n, m in RESNET18_C10_MATRICES) == 36_325
    per_step = sum(paper_floats(s, "powersgd", 1, WORKERS) for s in resnet18_shapes[10])
    assert per_step == RESNET18_C10_VECTOR_ENTRIES + 36_325 == 45_935


def test_resnet18_per_step_top10_floats_match_the_hand_sum_of_its_matrix_views(
    resnet18_shapes: dict[int, list[tuple[int, ...]]],
) -> None:
    # 10% of n*m floored is n*m // 10 (integer arithmetic, no float rounding)
    kept = sum(n * m // 10 for n, m in RESNET18_C10_MATRICES)
    assert kept == 1_116_425
    per_step = sum(paper_floats(s, "topk", 0.1, WORKERS) for s in resnet18_shapes[10])
    assert per_step == RESNET18_C10_VECTOR_ENTRIES + 2 * kept * WORKERS == 8_941_010


def test_cifar10_resnet18_rank1_data_sent_is_paper_1350_4_million(
    resnet18_shapes: dict[int, list[tuple[int, ...]]],
) -> None:
    sent = data_sent(resnet18_shapes[10], "powersgd", 1)
    assert sent == 45_935 * 29_400 == 1_350_489_000
    assert truncated_tenths(sent, 10**6) == Decimal("1350.4")


def test_cifar10_resnet18_rank2_data_sent_is_paper_2418_4_million(
    resnet18_shapes: dict[int, list[tuple[int, ...]]],
) -> None:
    sent = data_sent(resnet18_shapes[10], "powersgd", 2)
    # every matrix view has min(n, m) >= 2, so rank 2 doubles the compressed part
    assert sent == (9_610 + 2 * 36_325) * 29_400 == 2_418_444_000
    assert truncated_tenths(sent, 10**6) == Decimal("2418.4")


def test_cifar10_resnet18_top10_data_sent_is_paper_262_8_billion(
    resnet18_shapes: dict[int, list[tuple[int, ...]]],
) -> None:
    sent = data_sent(resnet18_shapes[10], "topk", 0.1)
    assert sent == 8_941_010 * 29_400 == 262_865_694_000
    assert truncated_tenths(sent, 10**9) == Decimal("262.8")


def test_cifar100_resnet18_rank2_data_sent_is_paper_2426_3_million(
    resnet18_shapes: dict[int, list[tuple[int, ...]]],
) -> None:
    # the linear layer grows to [100, 512] and its bias to [100]: 82,260 + 2*90 + 90 = 82,530
    sent = data_sent(resnet18_shapes[100], "powersgd", 2)
    assert sent == 82_530 * 29_400 == 2_426_382_000
    assert truncated_tenths(sent, 10**6) == Decimal("2426.3")


def test_paper_topk_99_percent_column_matches_sending_every_entry(
    resnet18_shapes: dict[int, list[tuple[int, ...]]],
) -> None:
    # ACCORDION.md quotes 2626.1 B for top-k 99%; level 0.99 gives 2599.8 B, but level 1.0
    # (every entry of the 11,164,352 compressible ones) gives the paper's figure:
    # (9,610 + 2 * 11,164,352 * 4) * 29,400 = 2,626,138,124,400.
    sent = data_sent(resnet18_shapes[10], "topk", 1.0)
    assert sent == 2_626_138_124_400
    assert truncated_tenths(sent, 10**9) == Decimal("2626.1")
    assert truncated_tenths(data_sent(resnet18_shapes[10], "topk", 0.99), 10**9) == Decimal(
        "2599.8"
    )


# --------------------------------------------------------------------------------- Ledger


def test_ledger_record_sums_floats_bytes_and_steps_per_layer() -> None:
    ledger = Ledger()
    ledger.record("conv", [64, 3, 3, 3], "powersgd", 2, WORKERS, steps=10)
    ledger.record("conv", [64, 3, 3, 3], "powersgd", 2, WORKERS, steps=5)
    ledger.record("bias", [64], "powersgd", 2, WORKERS, steps=15)
    # conv: 182 floats and 1092 bytes per step, 15 steps
    # bias: 64 floats and 2 * 3 / 4 * 256 = 384 bytes per step, 15 steps
    assert ledger.totals() == {
        "conv": {"floats": 2_730, "bytes": 16_380.0, "steps": 15},
        "bias": {"floats": 960, "bytes": 5_760.0, "steps": 15},
    }


def test_ledger_record_defaults_to_one_step() -> None:
    ledger = Ledger()
    ledger.record("w", [1000], "dense", None, WORKERS)
    assert ledger.totals() == {"w": {"floats": 1_000, "bytes": 6_000.0, "steps": 1}}


def test_ledger_totals_sum_over_layers() -> None:
    ledger = Ledger()
    ledger.record_all(
        [("conv", [64, 3, 3, 3], "topk", 0.1), ("bias", [64], "topk", 0.1)],
        WORKERS,
        steps=2,
    )
    # conv: 1376 floats, 4128 bytes; bias: 64 floats, 384 bytes; times 2 steps
    assert ledger.total_floats == 2 * (1_376 + 64) == 2_880
    assert ledger.total_bytes == 2 * (4_128.0 + 384.0) == 9_024.0


def test_empty_ledger_totals_are_zero() -> None:
    ledger = Ledger()
    assert ledger.total_floats == 0
    assert ledger.total_bytes == 0
    assert ledger.totals() == {}


def test_ledger_state_dict_round_trips_through_torch_save_weights_only(tmp_path) -> None:
    ledger = Ledger()
    ledger.record("conv", [64, 3, 3, 3], "powersgd", 2, WORKERS, steps=3)
    ledger.record("bias", [64], "powersgd", 2, WORKERS, steps=3)
    path = tmp_path / "ledger.pt"
    torch.save(ledger.state_dict(), path)

    restored = Ledger()
    restored.load_state_dict(torch.load(path, weights_only=True))

    assert restored.totals() == {
        "conv": {"floats": 546, "bytes": 3_276.0, "steps": 3},
        "bias": {"floats": 192, "bytes": 1_152.0, "steps": 3},
    }
    assert restored.total_floats == 738
    # and it keeps counting from where it was
    restored.record("bias", [64], "powersgd", 2, WORKERS)
    assert restored.totals()["bias"] == {"floats": 256, "bytes": 1_536.0, "steps": 4}


@pytest.mark.parametrize("state", [{}, {"layer": {}}, "layers", None, [("layers", {})]])
def test_ledger_load_state_dict_rejects_a_bad_dict(state: object) -> None:
    with pytest.raises(ValueError, match="layers"):
        Ledger().load_state_dict(state)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "state",
    [{"layers": {"conv": {"floats": 1}}}, {"layers": []}, {"layers": {"conv": 5}}],
)
def test_ledger_load_state_dict_rejects_malformed_layer_entries(state: object) -> None:
    with pytest.raises(ValueError):
        Ledger().load_state_dict(state)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("steps", "error"), [(-1, ValueError), (True, TypeError), (1.0, TypeError)]
)
def test_ledger_record_rejects_steps_that_are_not_a_non_negative_int(
    steps: object, error: type[Exception]
) -> None:
    # the architecture issue: a wrong type is a TypeError, a bad value a ValueError
    ledger = Ledger()
    with pytest.raises(error, match="steps"):
        ledger.record("w", [10], "dense", None, WORKERS, steps=steps)  # type: ignore[arg-type]
    assert ledger.totals() == {}


def test_ledger_record_that_fails_leaves_the_ledger_unchanged() -> None:
    ledger = Ledger()
    with pytest.raises(ValueError):
        ledger.record("w", [3, 3], "randk", 0.5, WORKERS)
    assert ledger.totals() == {}


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("fn", [paper_floats, wire_bytes])
@pytest.mark.parametrize("shape", [[3, 3], [3]])
def test_unknown_kind_is_rejected_naming_the_allowed_kinds(fn, shape: list[int]) -> None:
    with pytest.raises(ValueError, match="randk") as info:
        fn(shape, "randk", 0.5, WORKERS)
    message = str(info.value)
    for kind in ("dense", "powersgd", "topk"):
        assert kind in message


@pytest.mark.parametrize("fn", [paper_floats, wire_bytes])
@pytest.mark.parametrize(
    ("world_size", "error"),
    [(0, ValueError), (-2, ValueError), (True, TypeError), (1.5, TypeError)],
)
def test_world_size_must_be_an_int_of_at_least_one(fn, world_size: object, error: type) -> None:
    with pytest.raises(error, match="world_size"):
        fn([3, 3], "dense", None, world_size)


@pytest.mark.parametrize("fn", [paper_floats, wire_bytes])
@pytest.mark.parametrize("shape", [[-1, 3], [3, -3], [-5]])
def test_negative_shape_is_rejected(fn, shape: list[int]) -> None:
    with pytest.raises(ValueError, match="non-negative"):
        fn(shape, "dense", None, WORKERS)


def test_non_sequence_shape_is_rejected_with_type_error() -> None:
    with pytest.raises(TypeError, match="shape"):
        paper_floats(5, "dense", None, WORKERS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "level", "error"),
    [("powersgd", 0, ValueError), ("powersgd", 1.5, TypeError), ("topk", 1.5, ValueError)],
)
def test_accounting_rejects_levels_the_compressors_reject(kind, level, error) -> None:
    with pytest.raises(error):
        paper_floats([4, 4], kind, level, WORKERS)
    with pytest.raises(error):
        wire_bytes([4, 4], kind, level, WORKERS)
