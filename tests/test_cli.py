"""Specification of the ``accordion`` command line (accordion.cli)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from accordion.cli import main, parse_levels

ROOT = Path(__file__).resolve().parents[1]

LEVEL_KEYS = {
    "label",
    "compressor",
    "level",
    "floats_per_step",
    "floats_total",
    "bytes_per_step",
    "compression_ratio",
    "bytes_vs_dense",
    "comm_time_per_step_s",
}
#: The paper's compressor and ranks, which the plan's tests of the paper's figures name.
POWERSGD = ("--compressor", "powersgd")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    """Run ``accordion plan --json ARGV`` in-process and parse its one JSON object."""
    assert main(["plan", "--json", *argv]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


@pytest.fixture(scope="module")
def plan_help() -> str:
    """The text ``accordion plan --help`` prints (captured once for the module)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    assert info.value.code == 0
    return buffer.getvalue()


# ------------------------------------------------------------------------------ plan --json


def test_plan_json_lists_dense_rank2_rank1_with_paper_floats(capsys) -> None:
    result = run_json(capsys, *POWERSGD)
    levels = result["levels"]
    assert [entry["label"] for entry in levels] == ["dense", "rank 2", "rank 1"]
    assert [entry["level"] for entry in levels] == [None, 2, 1]
    assert [entry["floats_per_step"] for entry in levels] == [11_173_962, 82_260, 45_935]
    assert [entry["floats_total"] for entry in levels] == [
        11_173_962 * 29_400,
        82_260 * 29_400,
        45_935 * 29_400,
    ]


def test_plan_json_prints_exactly_one_object_with_the_run_settings(capsys) -> None:
    assert main(["plan", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert {k: v for k, v in result.items() if k != "levels"} == {
        "model": "resnet18",
        "num_classes": 10,
        "parameters": 11_173_962,
        "tensors": 62,
        "compressed_tensors": 62,  # the integer quantiser takes every tensor
        "workers": 4,
        "steps": 29_400,
        "compressor": "mixed",
        "bandwidth_bytes_per_s": 1.25e9,
        "latency_s": pytest.approx(5e-5, rel=1e-12),
    }


def test_plan_json_level_entries_have_exactly_the_documented_keys(capsys) -> None:
    for entry in run_json(capsys)["levels"]:
        assert set(entry) == LEVEL_KEYS


def test_every_plan_json_key_is_documented_in_plan_help(capsys, plan_help: str) -> None:
    result = run_json(capsys)
    keys = set(result) | {key for entry in result["levels"] for key in entry}
    # the key list is the epilog after the options; match whole words, so that e.g. the
    # "--steps" option alone does not count as documenting the "steps" key
    epilog = plan_help[plan_help.index("--json prints one object") :]
    undocumented = sorted(key for key in keys if not re.search(rf"\b{key}\b", epilog))
    assert undocumented == []


def test_plan_layers_lists_every_tensor_with_documented_keys(capsys, plan_help: str) -> None:
    result = run_json(capsys, "--model", "mnist1d-cnn", "--levels", "4,1", "--layers")
    layers = result["layers"]
    assert [entry["name"] for entry in layers][:2] == ["conv1.weight", "conv1.bias"]
    epilog = plan_help[plan_help.index("--json prints one object") :]
    for key in {key for entry in layers for key in entry} | {"layers"}:
        assert re.search(rf"\b{key}\b", epilog), key
    # per-tensor bytes add up to the level rows' totals, dense and compressed
    dense, rank4, rank1 = result["levels"]
    assert sum(e["dense_bytes"] for e in layers) == pytest.approx(dense["bytes_per_step"])
    assert sum(e["bytes"][0] for e in layers) == pytest.approx(rank4["bytes_per_step"])
    assert sum(e["bytes"][1] for e in layers) == pytest.approx(rank1["bytes_per_step"])
    # transfer time is bytes over the link (10 Gbit/s by default)
    assert layers[0]["dense_time_s"] == pytest.approx(layers[0]["dense_bytes"] / 1.25e9)


def test_plan_layers_table_shows_a_row_per_tensor(capsys) -> None:
    assert main(["plan", "--model", "mnist1d-cnn", "--levels", "4,1", "--layers"]) == 0
    out = capsys.readouterr().out
    assert "per tensor: transfer ms/step at 10Gbit" in out
    assert re.search(r"^conv2\.weight\s+32x32x5\s", out, re.MULTILINE)


def test_plan_json_has_no_layers_without_the_flag(capsys) -> None:
    assert "layers" not in run_json(capsys)


def test_plan_json_honours_num_classes_workers_and_steps(capsys) -> None:
    result = run_json(capsys, *POWERSGD, "--num-classes", "100", "--workers", "8", "--steps", "10")
    # CIFAR-100 ResNet-18 at rank 2: linear [100, 512] adds 2 * 90 and its bias 90 floats
    assert result["levels"][1]["floats_per_step"] == 82_530
    assert result["levels"][1]["floats_total"] == 825_300
    assert result["parameters"] == 11_220_132
    assert result["workers"] == 8


# ------------------------------------------------------------------------ the human table


def test_plan_table_shows_the_three_rows_and_paper_rank1_figure(capsys) -> None:
    assert main(["plan", *POWERSGD, "--steps", "29400"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert {"dense", "rank 2", "rank 1"} <= set(rows)
    # 45,935 floats * 29,400 steps = 1,350,489,000 = 1,350.489 M (paper: 1350.4 M)
    assert "1,350.489 M" in rows["rank 1"]
    assert "45,935" in rows["rank 1"]
    # 82,260 * 29,400 = 2,418,444,000
    assert "2,418.444 M" in rows["rank 2"]
    # dense 11,173,962 * 29,400 = 328,514,482,800 >= 1e10, so in billions
    assert "328.514 B" in rows["dense"]


def test_plan_table_header_names_model_workers_and_steps(capsys) -> None:
    assert main(["plan", "--steps", "29400"]) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert "resnet18" in first_line
    assert "11,173,962 parameters" in first_line
    assert "4 workers" in first_line
    assert "29,400 steps" in first_line


# --------------------------------------------------------------------------------- top-k


def test_plan_topk_levels_are_fractions(capsys) -> None:
    result = run_json(capsys, "--compressor", "topk", "--levels", "0.99,0.1")
    levels = result["levels"]
    assert [entry["label"] for entry in levels] == ["dense", "top-k 0.99", "top-k 0.1"]
    assert [entry["level"] for entry in levels] == [None, 0.99, 0.1]
    # 9,610 dense entries + 2 * 1,116,425 kept entries * 4 workers
    assert levels[2]["floats_per_step"] == 8_941_010
    assert levels[2]["compressor"] == "topk"


def test_plan_topk_defaults_to_levels_099_and_01(capsys) -> None:
    result = run_json(capsys, "--compressor", "topk")
    assert [entry["level"] for entry in result["levels"]] == [None, 0.99, 0.1]


# ------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--model", "resnet1000"], "--model"),
        (["--compressor", "randk"], "--compressor"),
        (["--levels", "2.5"], "--levels"),
        (["--levels", "0"], "--levels"),
        (["--levels", "2,,1"], "--levels"),
        (["--compressor", "topk", "--levels", "1.5"], "--levels"),
        (["--compressor", "topk", "--levels", "0"], "--levels"),
        (["--compressor", "topk", "--levels", "0.5,nan"], "--levels"),
        (["--workers", "0"], "--workers"),
        (["--workers", "four"], "--workers"),
        (["--steps", "-1"], "--steps"),
        (["--num-classes", "0"], "--num-classes"),
        (["--bandwidth", "fast"], "--bandwidth"),
        (["--bandwidth", "0Gbit"], "--bandwidth"),
        (["--latency", "soon"], "--latency"),
    ],
)
def test_plan_usage_error_exits_2_naming_the_argument(capsys, argv: list[str], flag: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", *argv])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert f"argument {flag}" in captured.err
    assert captured.out == ""


def test_missing_subcommand_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "usage: accordion" in capsys.readouterr().err


# --------------------------------------------------------------------------- parse_levels


def test_parse_levels_reads_powersgd_ranks_in_order() -> None:
    assert parse_levels("2,1", "powersgd") == [2, 1]
    assert parse_levels(" 4 , 1 ", "powersgd") == [4, 1]


def test_parse_levels_reads_topk_fractions() -> None:
    assert parse_levels("0.99,0.1", "topk") == [0.99, 0.1]
    assert parse_levels("1", "topk") == [1.0]


@pytest.mark.parametrize("text", ["2.5", "0", "-1", "two", "", "2,", ","])
def test_parse_levels_rejects_bad_powersgd_ranks(text: str) -> None:
    with pytest.raises(ValueError):
        parse_levels(text, "powersgd")


@pytest.mark.parametrize("text", ["1.5", "0", "-0.1", "ten", "nan", "inf"])
def test_parse_levels_rejects_topk_fractions_outside_0_1(text: str) -> None:
    with pytest.raises(ValueError):
        parse_levels(text, "topk")


def test_parse_levels_rejects_unknown_compressor_naming_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="powersgd") as info:
        parse_levels("1", "randk")
    assert "topk" in str(info.value)


# ----------------------------------------------------------------------------- subprocess


def test_python_dash_m_accordion_plan_json_succeeds_in_a_subprocess() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "accordion", "plan", "--json", *POWERSGD],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert [entry["floats_per_step"] for entry in result["levels"]] == [11_173_962, 82_260, 45_935]


# ------------------------------------------------------------------ defaults and the registry


def _help(*argv: str) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(buffer.getvalue().split())  # argparse wraps lines: compare words


def test_train_and_compare_help_state_the_defaults_of_train_config(monkeypatch) -> None:
    import dataclasses

    from accordion.harness.train import TrainConfig

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for command in ("train", "compare"):
        text = _help(command)
        for flag, shown in (("epochs", "60"), ("decay_epochs", "30,45"), ("lr", "0.1"),
                            ("warmup_epochs", "2")):  # fmt: skip
            assert fields[flag].default is not None
            assert f"(default {shown})" in text, (command, flag)
        assert fields["interval"].default is None
        assert "(default: the rule's, 1 for the guarded rule, 10 for the paper's)" in " ".join(
            text.split()
        )
    # one place: a changed field default is what the help says
    monkeypatch.setattr(fields["epochs"], "default", 7)
    assert "epochs (default 7)" in _help("train")


def test_plan_help_lists_the_registered_compressors_with_their_default_levels() -> None:
    from accordion.compress import compressor_names

    text = _help("plan")
    for name in compressor_names():
        if name != "dense":
            assert name in text
    assert "powersgd '2,1'" in text and "topk '0.99,0.1'" in text


def test_parse_levels_reads_any_registered_compressors_levels(monkeypatch) -> None:
    from accordion.compress import base as compress_base
    from test_harness_strategies import _Fake

    monkeypatch.setitem(compress_base._REGISTRY, "fake", _Fake)
    assert parse_levels("light,heavy", "fake") == ["light", "heavy"]
    with pytest.raises(ValueError, match="'light', 'medium' or 'heavy'"):
        parse_levels("light,huge", "fake")
    with pytest.raises(ValueError, match="fake"):
        parse_levels("1", "dense")
