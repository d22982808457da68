"""benchmarks/memory.py end to end on a tiny model: its JSON rows and accounted state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accordion.models import get_model

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["dense", "torch-psgd4", "ours-psgd4", "ours-accordion421",
           "ours-accordion421-rank0", "ours-topk0.01"]
OURS = [c for c in CONFIGS if c.startswith("ours-")]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """The benchmark's JSON for mnist1d-cnn, 2 steps, 1 repetition (one run per config)."""
    out = tmp_path_factory.mktemp("memory") / "memory.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--model", "mnist1d-cnn",
               "--steps", "2", "--steady-after", "1", "--reps", "1", "--timeout", "120",
               "--json", str(out)]  # fmt: skip
    # a hung worker is killed by the script's own --timeout; this one guards the script
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ours static PowerSGD r4" in proc.stdout  # the table was printed
    return json.loads(out.read_text())


def _rows(report: dict) -> dict[str, dict]:
    return {row["config"]: row for row in report["rows"]}


def _expected_memory_bytes() -> int:
    """fp32 error-feedback memory for every tensor our compressors compress (>= 2-D)."""
    return sum(p.numel() * 4 for p in get_model("mnist1d-cnn").parameters() if p.dim() >= 2)


def test_every_configuration_has_a_row_with_its_peak_rss(report) -> None:
    rows = _rows(report)
    assert list(rows) == CONFIGS
    for row in rows.values():
        assert len(row["peak_rss_mib"]) == 1  # --reps 1
        assert row["peak_rss_mib_min"] <= row["peak_rss_mib_median"] <= row["peak_rss_mib_max"]
        assert row["peak_rss_mib_median"] > 0
        assert isinstance(row["extra_mib"], float)
    assert rows["dense"]["extra_mib"] == 0.0
    assert rows["dense"]["state"] == {"unique": 0}
    assert set(report["goal"]) == {"ours-psgd4", "ours-accordion421", "ours-accordion421-rank0"}


def test_our_error_feedback_memory_is_exactly_the_compressed_parameters(report) -> None:
    expected = _expected_memory_bytes()
    rows = _rows(report)
    for config in OURS:
        for state in rows[config]["state_by_rank"]:
            assert state["memory"] == expected, config
            assert state["unique"] > 0
            # the memory lives in the buffers, one per set of tensors: nothing besides it
            assert state["buffers"] == state["memory"], config
        assert rows[config]["compressed_numel"] * 4 == expected


def test_factors_and_accumulators_are_accounted_where_they_exist(report) -> None:
    rows = _rows(report)
    assert rows["ours-psgd4"]["state"]["factors"] > 0  # warm-start Q
    assert rows["ours-topk0.01"]["state"]["factors"] == 0  # top-k keeps no factors
    assert rows["ours-psgd4"]["state"]["accumulators"] == 0  # static: no statistic
    assert rows["ours-accordion421"]["state"]["accumulators"] > 0
    # sharded (the default): each rank sums its own layers, together what one rank holds
    # under rank0
    whole = rows["ours-accordion421-rank0"]["state_by_rank"]
    shares = [s["accumulators"] for s in rows["ours-accordion421"]["state_by_rank"]]
    assert all(0 < share < whole[0]["accumulators"] for share in shares)
    assert sum(shares) == whole[0]["accumulators"]
    # PyTorch's hook sends dense for start_powerSGD_iter=2 steps: no state yet after 2
    assert set(rows["torch-psgd4"]["state"]) == {"memory", "factors", "unique"}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's clear_refs")
def test_the_steady_peak_after_the_first_steps_is_reported_and_below_the_whole_run_peak(
    report,
) -> None:
    rows = _rows(report)
    for config, row in rows.items():
        assert len(row["steady_peak_rss_mib"]) == 1, config
        assert 0 < row["steady_peak_rss_mib_median"] <= row["peak_rss_mib_median"], config
        assert isinstance(row["steady_extra_mib"], float), config
        # the whole run's peak includes the steps before the reset
        first_step = max(steps[0] for steps in row["peak_rss_mib_by_step"])
        assert row["peak_rss_mib_median"] >= first_step, config
    assert rows["dense"]["steady_extra_mib"] == 0.0
