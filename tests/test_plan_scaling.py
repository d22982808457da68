"""Specification of the plan at scale: top-k's break-even, the shapes-only models
(resnet50, transformer-1b) and the ``accordion plan`` scaling grid (issue 14)."""

from __future__ import annotations

import contextlib
import io
import math
import re

import pytest
import torch

from accordion.accounting import paper_floats, wire_bytes
from accordion.cli import main
from accordion.compress import TopK
from accordion.models import MODEL_NAMES
from accordion.models.resnet50 import RESNET50_PARAMETERS, ResNet50
from accordion.models.shapes import SCALE_MODEL_NAMES, named_shapes, plan_model_names
from accordion.models.transformer import TRANSFORMER_1B_PARAMETERS, Transformer
from accordion.plan import make_plan, scaling_plan
from plan_parts import run_json, run_text

BREAK_EVEN_KEYS = {
    "workers", "density", "paper_density", "value_bytes", "index_bytes", "bytes_vs_dense",
}  # fmt: skip
SCALING_ARGS = ["--workers", "8,64,512", "--bandwidth", "10Gbit,100Gbit"]


@pytest.fixture(scope="module")
def json_epilog() -> str:
    """The ``--json`` key list of ``accordion plan --help``."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = buffer.getvalue()
    return text[text.index("--json prints one object") :]


@pytest.fixture(scope="module")
def resnet50_shapes() -> list[tuple[int, ...]]:
    return [shape for _, shape in named_shapes("resnet50")]


# ------------------------------------------------------------------------- the break-even


@pytest.mark.parametrize("workers", [2, 8, 64, 512])
def test_break_even_density_is_one_over_the_workers_for_fp32_and_int32(workers: int) -> None:
    entry = TopK.break_even([(1000, 512)], workers)
    assert entry.density == pytest.approx(1 / workers, rel=1e-12)
    assert (entry.value_bytes, entry.index_bytes) == (4, 4.0)


@pytest.mark.parametrize("workers", [8, 64, 512])
@pytest.mark.parametrize("element_size", [4, 2])
def test_topk_at_the_break_even_sends_the_dense_wire_bytes_within_rounding(
    workers: int, element_size: int
) -> None:
    shape = (2048, 1000)
    density = TopK.break_even([shape], workers, element_size).density
    dense = wire_bytes(shape, "dense", None, workers, element_size)
    topk = wire_bytes(shape, "topk", density, workers, element_size)
    # floor(d N) entries kept: at most one entry (its value and index, to W - 1 peers) short
    assert 0 <= dense - topk <= (workers - 1) * (element_size + 4)


def test_topk_just_above_the_break_even_sends_more_than_dense(resnet50_shapes) -> None:
    density = TopK.break_even(resnet50_shapes, 64).density
    dense, above = make_plan(resnet50_shapes, "topk", [density * 1.01], 64, 1, 1.25e9, 0.0)
    assert above.bytes_per_step > dense.bytes_per_step


def test_model_break_even_sends_the_dense_model_bytes_within_rounding(resnet50_shapes) -> None:
    density = TopK.break_even(resnet50_shapes, 512).density
    dense, topk = make_plan(resnet50_shapes, "topk", [density], 512, 1, 1.25e9, 0.0)
    compressed = sum(len(s) >= 2 for s in resnet50_shapes)
    assert 0 <= dense.bytes_per_step - topk.bytes_per_step <= compressed * 511 * 8


@pytest.mark.parametrize("workers", [4, 64])
def test_paper_break_even_is_one_over_twice_the_workers(workers: int) -> None:
    shape = (4096, 250)
    entry = TopK.break_even([shape], workers)
    assert entry.paper_density == pytest.approx(1 / (2 * workers), rel=1e-12)
    topk = paper_floats(shape, "topk", entry.paper_density, workers)
    assert topk == paper_floats(shape, "dense", None, workers)


def test_int64_indices_lower_the_break_even_to_two_thirds_over_the_workers() -> None:
    shape = (2**16, 2**15 + 1)  # more than 2**31 - 1 entries: the indices are int64
    entry = TopK.break_even([shape], 8)
    assert entry.index_bytes == 8
    assert entry.density == pytest.approx(2 / (3 * 8), rel=1e-12)
    dense = wire_bytes(shape, "dense", None, 8)
    assert 0 <= dense - wire_bytes(shape, "topk", entry.density, 8) <= 7 * 12


def test_break_even_is_none_for_one_worker() -> None:
    assert TopK.break_even([(10, 10)], 1).density is None


def test_break_even_is_none_when_topk_compresses_no_tensor() -> None:
    entry = TopK.break_even([(10,), (3,)], 8)
    assert (entry.density, entry.paper_density) == (None, None)


# ---------------------------------------------------------------------- the printed line


def test_plan_prints_the_topk_break_even_and_each_levels_bytes_against_dense(capsys) -> None:
    out = run_text(capsys, "--compressor", "topk", "--levels", "0.99,0.1", "--workers", "8")
    assert "top-k break-even at 8 workers: density 1/8 = 12.5% of the entries kept" in out
    assert "paper floats: 1/16 = 6.25%" in out
    # ResNet-18: the 0.99 level sends 7.91x dense's bytes, the 0.1 level 0.8x
    assert re.search(r"top-k 0\.99 7\.91x, top-k 0\.1 0\.8x", out)


def test_plan_prints_no_break_even_for_powersgd(capsys) -> None:
    assert "break-even" not in run_text(capsys, "--compressor", "powersgd", "--workers", "8")


def test_plan_json_topk_break_even_has_the_documented_keys(capsys, json_epilog: str) -> None:
    entry = run_json(capsys, "--compressor", "topk", "--workers", "8")["topk_break_even"]
    assert set(entry) == BREAK_EVEN_KEYS
    assert entry["density"] == pytest.approx(0.125)
    assert len(entry["bytes_vs_dense"]) == 2  # the default levels, 0.99 and 0.1
    for key in BREAK_EVEN_KEYS | {"topk_break_even"}:
        assert re.search(rf"\b{key}\b", json_epilog), key


def test_plan_json_has_no_break_even_for_powersgd(capsys) -> None:
    assert "topk_break_even" not in run_json(capsys, "--compressor", "powersgd", "--workers", "8")


# ---------------------------------------------------------------------------- the models


def test_resnet50_has_25_557_032_parameters_in_161_tensors() -> None:
    shapes = [shape for _, shape in named_shapes("resnet50")]
    assert sum(math.prod(s) for s in shapes) == RESNET50_PARAMETERS == 25_557_032
    assert len(shapes) == 161


def test_transformer_1b_has_1_013_573_632_parameters_in_220_tensors() -> None:
    named = dict(named_shapes("transformer-1b"))
    assert sum(math.prod(s) for s in named.values()) == TRANSFORMER_1B_PARAMETERS
    assert TRANSFORMER_1B_PARAMETERS == 1_013_573_632
    assert len(named) == 220
    assert named["token.weight"] == (50257, 2048)
    assert named["blocks.17.fc.weight"] == (8192, 2048)


def test_plan_model_names_add_resnet50_and_transformer_1b_to_the_trained_ones() -> None:
    assert SCALE_MODEL_NAMES == ("resnet50", "transformer-1b")
    assert plan_model_names() == (*MODEL_NAMES, *SCALE_MODEL_NAMES)


def test_plan_of_resnet50_defaults_to_1000_classes(capsys) -> None:
    result = run_json(capsys, "--model", "resnet50")
    assert (result["num_classes"], result["parameters"]) == (1000, 25_557_032)


def test_plan_of_transformer_1b_has_no_classes(capsys) -> None:
    result = run_json(capsys, "--model", "transformer-1b", "--workers", "8")
    assert result["num_classes"] is None
    assert result["parameters"] == 1_013_573_632


def test_small_resnet50_maps_images_to_logits() -> None:
    with torch.no_grad():
        logits = ResNet50(num_classes=7).eval()(torch.randn(1, 3, 64, 64))
    assert logits.shape == (1, 7)


def test_small_transformer_maps_tokens_to_vocabulary_logits() -> None:
    model = Transformer(vocab_size=50, d_model=16, layers=2, heads=4, context=12)
    assert model(torch.randint(0, 50, (2, 12))).shape == (2, 12, 50)


# ---------------------------------------------------------------------- the scaling grid


def test_scaling_grid_json_has_one_cell_per_worker_count_and_link(capsys) -> None:
    result = run_json(capsys, "--compressor", "topk", *SCALING_ARGS)
    assert result["workers"] == [8, 64, 512]
    assert result["bandwidth_bytes_per_s"] == [1.25e9, 1.25e10]
    cells = [(c["workers"], c["bandwidth_bytes_per_s"]) for c in result["grid"]]
    assert cells == [(w, b) for w in (8, 64, 512) for b in (1.25e9, 1.25e10)]
    assert "levels" not in result and "topk_break_even" in result["grid"][0]


def test_scaling_grid_cells_equal_the_single_plans(resnet50_shapes) -> None:
    cells = scaling_plan(resnet50_shapes, "powersgd", [4, 1], [8, 64], [1.25e9], 10, 5e-6)
    for cell in cells:
        single = make_plan(resnet50_shapes, "powersgd", [4, 1], cell.workers, 10, 1.25e9, 5e-6)
        assert list(cell.rows) == single


def test_scaling_grid_json_keys_are_documented(capsys, json_epilog: str) -> None:
    cell = run_json(capsys, *SCALING_ARGS)["grid"][0]
    for key in [*cell, "grid"]:
        assert re.search(rf"\b{key}\b", json_epilog), key


def test_scaling_table_stars_the_levels_that_cost_more_than_dense(capsys) -> None:
    out = run_text(capsys, "--compressor", "topk", "--levels", "0.1", *SCALING_ARGS)
    bytes_row = out[out.index("bytes/step per worker") :].splitlines()[3]
    # top-k 10% pays at 8 workers (break-even 12.5%), not at 64 or 512
    assert re.fullmatch(r"top-k 0\.1\s+\S+ MB \s+\S+ [MG]B\*\s+\S+ [MG]B\*", bytes_row)
    assert out.count("top-k break-even at") == 3


def test_scaling_plan_rejects_an_empty_list_of_workers() -> None:
    with pytest.raises(ValueError, match="workers must list at least one value"):
        scaling_plan([(4, 4)], "topk", [0.1], [], [1e9], 1, 0.0)


# ---------------------------------------------------------------------------- bad flags


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [
        (["--workers", "8,0"], "--workers", "'0'"),
        (["--workers", "8,,64"], "--workers", "'8,,64'"),
        (["--workers", "eight"], "--workers", "'eight'"),
        (["--workers", "8,-1"], "--workers", "'-1'"),
        (["--bandwidth", "10Gbit,fast"], "--bandwidth", "'fast'"),
        (["--bandwidth", "10Gbit,"], "--bandwidth", "'10Gbit,'"),
        (["--bandwidth", "10Gbit,0Gbit"], "--bandwidth", "'0Gbit'"),
        (["--workers", "8,64", "--layers"], "--layers", "'8,64'"),
        (["--model", "resnet5"], "--model", "resnet50"),
    ],
)
def test_a_bad_scaling_flag_is_a_usage_error_naming_it_and_its_value(
    capsys, argv: list[str], flag: str, value: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", *argv])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert f"argument {flag}:" in captured.err and value in captured.err
    assert captured.out == ""
