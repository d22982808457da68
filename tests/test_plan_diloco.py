"""``accordion plan --sync-every H``: DiLoCo's rows, per inner step of a run that syncs
every H of them (:func:`accordion.plan.diloco_plan`)."""

from __future__ import annotations

import json

import pytest

from accordion.cli import main
from accordion.models.shapes import named_shapes
from accordion.plan import diloco_plan, make_plan

ARGS = ["--model", "transformer-tiny", "--compressor", "int", "--levels", "8,4",
        "--workers", "2", "--steps", "900"]  # fmt: skip


@pytest.fixture(scope="module")
def rows():
    shapes = [shape for _, shape in named_shapes("transformer-tiny")]
    return make_plan(shapes, "int", [8, 4], 2, 900, 12.5e6, 50e-6)


def test_diloco_rows_are_one_syncs_figures_divided_by_h(rows) -> None:
    diloco = diloco_plan(rows, 10)
    assert [r.label for r in diloco] == ["DiLoCo H=10, dense", "DiLoCo H=10, int8",
                                         "DiLoCo H=10, int4"]  # fmt: skip
    for step, inner in zip(rows, diloco):
        assert inner.bytes_per_step == pytest.approx(step.bytes_per_step / 10)
        assert inner.floats_total == pytest.approx(step.floats_total / 10)
        assert inner.comm_time_per_step_s == pytest.approx(step.comm_time_per_step_s / 10)


def test_diloco_ratios_are_against_dense_every_step_so_h_multiplies_them(rows) -> None:
    diloco = diloco_plan(rows, 25)
    for step, inner in zip(rows, diloco):
        assert inner.compression_ratio == pytest.approx(25 * step.compression_ratio)
    assert diloco[0].compression_ratio == pytest.approx(25.0)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (2.5, TypeError)])
def test_diloco_plan_refuses_an_h_that_is_not_an_int_of_at_least_1(rows, bad, error) -> None:
    with pytest.raises(error, match="sync_every"):
        diloco_plan(rows, bad)


def test_plan_sync_every_prints_diloco_rows_after_the_per_step_ones(capsys) -> None:
    assert main(["plan", *ARGS, "--sync-every", "10"]) == 0
    lines = capsys.readouterr().out.splitlines()
    labels = [line.split("  ")[0] for line in lines]
    assert labels.index("int4") < labels.index("DiLoCo H=10, dense")
    assert "DiLoCo H=10, int4" in labels


def test_plan_json_sync_every_adds_diloco_levels_with_the_levels_keys(capsys) -> None:
    assert main(["plan", "--json", *ARGS, "--sync-every", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sync_every"] == 10
    assert [set(r) for r in out["diloco_levels"]] == [set(r) for r in out["levels"]]
    assert out["diloco_levels"][2]["bytes_per_step"] == pytest.approx(
        out["levels"][2]["bytes_per_step"] / 10
    )  # fmt: skip


def test_plan_without_sync_every_has_no_diloco_rows(capsys) -> None:
    assert main(["plan", "--json", *ARGS]) == 0
    assert "diloco_levels" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("extra", [["--sync-every", "0"],
                                   ["--sync-every", "5", "--workers", "2,4"]])
def test_plan_sync_every_below_1_or_with_a_grid_is_a_usage_error(capsys, extra) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *ARGS, *extra])
    assert exit_info.value.code == 2
    assert "argument --sync-every: must be an int >= 1" in capsys.readouterr().err
