"""benchmarks/two_phase_bench.py end to end (--quick: 65,536 elements on 2 and 4 gloo
processes, about 30 s on two cores): the two-phase exchange's bytes per worker stay flat
in the workers, as a dense ring all-reduce's do, while the all-gather's grow."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "two_phase_bench.py"
NUMEL = 65_536


def _load_script():
    """The script as a module (benchmarks/ is no package); main() does not run on import."""
    spec = importlib.util.spec_from_file_location("two_phase_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_script()


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[tuple[int, str], dict]:
    """The ``--quick`` run's rows by (workers, method)."""
    out = tmp_path_factory.mktemp("two_phase_bench") / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--timeout", "150"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| M | W | method | bytes / worker | vs dense |" in proc.stdout  # the table
    report = json.loads(out.read_text())
    assert report["meta"]["workers"] == [2, 4] and report["meta"]["numel"] == [NUMEL]
    return {(r["workers"], r["method"]): r for r in report["rows"]}


def _payload(codec: str) -> int:
    """Bytes of one worker's compressed buffer: packed codes and one fp16 scale a block."""
    _, bits = bench.CODECS[codec]
    return math.ceil(NUMEL * bits / 8) + 2 * math.ceil(NUMEL / 64)


def test_every_method_has_bytes_a_time_and_an_error_at_every_worker_count(rows) -> None:
    methods = [bench.DENSE] + [bench.method_name(c, k) for c in bench.CODECS
                               for k in bench.COLLECTIVES]  # fmt: skip
    assert set(rows) == {(w, m) for w in (2, 4) for m in methods}
    for key, row in rows.items():
        assert row["bytes_per_worker"] > 0 and row["ms"] > 0, key
        assert math.isfinite(row["error"]), key
    assert rows[(4, bench.DENSE)]["bytes_per_worker"] == 2 * 3 / 4 * NUMEL * 4  # a ring's
    assert rows[(4, bench.DENSE)]["error"] < 1e-6


def test_two_phase_bytes_per_worker_are_flat_in_workers_and_the_all_gathers_grow(rows) -> None:
    for codec in bench.CODECS:
        payload = _payload(codec)
        two = {w: rows[(w, bench.method_name(codec, "two_phase"))] for w in (2, 4)}
        gather = {w: rows[(w, bench.method_name(codec, "all_gather"))] for w in (2, 4)}
        for w in (2, 4):
            padding = w * 2 * (64 + 2)  # under one block (of 8 bits at most) an owner a phase
            assert (
                2 * (w - 1) / w * payload
                <= two[w]["bytes_per_worker"]
                <= (2 * (w - 1) / w * payload + padding)
            ), (codec, w)  # an all-reduce's share
            assert gather[w]["bytes_per_worker"] == (w - 1) * payload, (codec, w)
        # against a dense ring all-reduce: two phases a constant fraction, the all-gather W/2x
        assert two[4]["vs_dense"] == pytest.approx(two[2]["vs_dense"], rel=1e-2), codec
        assert gather[4]["vs_dense"] == pytest.approx(2 * gather[2]["vs_dense"]), codec
        assert two[4]["bytes_per_worker"] < gather[4]["bytes_per_worker"], codec


def test_int8_averages_are_close_to_the_dense_mean_in_either_collective(rows) -> None:
    for w in (2, 4):
        for collective in bench.COLLECTIVES:
            assert rows[(w, bench.method_name("int8", collective))]["error"] < 2e-2


@pytest.mark.parametrize("flag", [["--workers", "0"], ["--numel", "0"], ["--iters", "0"],
                                  ["--warmup", "-1"], ["--timeout", "0"]])  # fmt: skip
def test_a_count_below_its_minimum_is_refused(flag) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(flag)
