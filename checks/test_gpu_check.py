"""benchmarks/gpu_check.py: end to end on the CPU (--quick), and its comparison function.

The GPU run itself needs a GPU; here the same script runs with gloo on the CPU, where
every check must pass and every speed row must have a time. The comparison that decides
PASS or FAIL is tested apart, so that a broken result is known to be reported as FAIL.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _load_script():
    """The script as a module (benchmarks/ is no package); main() does not run on import."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpu_check = _load_script()


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """The JSON report of ``--device cpu --quick`` (about 30 s on two cores)."""
    out = tmp_path_factory.mktemp("gpu_check") / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--json", str(out),
               "--timeout", "150"]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| model | dtype | check | value | status |" in proc.stdout  # the table was printed
    return json.loads(out.read_text())


def test_every_check_passes_on_the_cpu(report) -> None:
    assert report["passed"] is True
    failed = [row for row in report["checks"] if row["status"] != "PASS"]
    assert not failed, failed
    names = {(row["model"], row["check"]) for row in report["checks"]}
    for case in gpu_check.cases():  # every case ran its comparisons against both references
        assert (case.model, "= CPU reference, no process group") in names
        assert (case.model, "= loop path on cpu (reduce_gradients)") in names
    assert report["meta"]["backend"] == "gloo"


def test_every_quantiser_gives_the_cpus_result_bitwise_on_the_cpu(report) -> None:
    rows = {(row["model"], row["check"]): row for row in report["checks"]}
    for codec, bits in gpu_check.CODECS:
        model = f"codec {codec.label(bits)}"
        names = ["encode+decode on cpu = CPU", "CPU's bytes decoded on cpu = CPU",
                 "two-phase W=1 (LocalTransport, 2 rounds) on cpu = CPU",
                 "two-phase W=4 (SimulatedTransport, 2 rounds) on cpu = CPU"]  # fmt: skip
        for name in names:
            assert rows[(model, name)]["status"] == "PASS", (model, name)
            assert rows[(model, name)]["value"] == "bitwise", (model, name)  # the same device


def test_every_speed_row_has_a_time_and_a_ratio(report) -> None:
    rows = {(row["model"], row["config"]): row for row in report["speed"]}
    models = ["resnet18", "resnet50-like", "gpt2-small-like"]
    assert set(rows) == {(m, c) for m in models for c in gpu_check.SPEED_CONFIGS}
    assert {"torch bf16_compress_hook", "ours int8 two-phase"} <= set(gpu_check.SPEED_CONFIGS)
    for (model, config), row in rows.items():
        assert row["ms_per_step"] > 0 and not row["skipped"], (model, config)
        if config != "dense DDP":
            assert row["compression"] > 1, (model, config)  # the hook did compress
    assert rows[("resnet18", "torch powerSGD_hook r4")]["vs_torch"] == pytest.approx(1.0)
    assert rows[("resnet18", "torch bf16_compress_hook")]["compression"] == 2.0
    assert rows[("resnet18", "ours int8 two-phase")]["collective"] == gpu_check.INT8_COLLECTIVE


def test_the_state_takes_the_two_phase_collective() -> None:
    assert gpu_check.INT8_COLLECTIVE == "two_phase"  # else the speed row all-gathers


def test_every_quantiser_and_world_size_has_a_compute_rate_next_to_copy(report) -> None:
    rows = {(row["codec"], row["world_size"]): row for row in report["compute"]}
    labels = [codec.label(bits) for codec, bits in gpu_check.CODECS]
    assert set(rows) == {(c, w) for c in labels for w in gpu_check.COMPUTE_WORLDS}
    assert set(gpu_check.COMPUTE_WORLDS) == {4, 8}
    for key, row in rows.items():
        assert row["numel"] == 65_536 and row["ms"] > 0, key
        assert row["gb_per_s"] == pytest.approx(key[1] * 65_536 * 4 / row["ms"] / 1e6), key
        assert row["copy_gb_per_s"] > 0, key


# A hook that silently sends everything dense (the state's public set_dense), while the
# references compress: the comparisons must say FAIL. Run apart: it needs a process group.
SABOTAGE = """
import json, sys, tempfile, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import gpu_check as g
from accordion.ddp import AccordionState
register = AccordionState.register
def dense_hook(self, model):  # only the DDP hook's state is registered
    self.set_dense(list(self.levels()))
    return register(self, model)
AccordionState.register = dense_hook
case = g.cases()[0]
references, report = {case: g.Reference(case)}, g.Report()
with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    g.run_checks(torch.device("cpu"), references, report)
    dist.destroy_process_group()
print(json.dumps({"passed": report.passed, "checks": report.checks}))
"""


def test_a_hook_that_does_not_compress_is_reported_as_failing() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", SABOTAGE, str(SCRIPT.parent)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    status = {row["check"]: row["status"] for row in result["checks"]}
    assert result["passed"] is False
    assert status["= CPU reference, no process group"] == "FAIL"
    assert status["= loop path on cpu (reduce_gradients)"] == "FAIL"
    assert status["levels per epoch = both references"] == "FAIL"
    assert status["ready when backward returns"] == "PASS"  # only what is wrong fails


def _grads(scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": scale * torch.randn(8, 4, generator=gen), "b": torch.randn(8, generator=gen)}


def test_identical_results_pass_and_a_broken_one_fails() -> None:
    ref = _grads()
    assert gpu_check.relative_error(ref, _grads()) == 0.0
    tol = gpu_check.TOLERANCE[torch.float32]
    close = {k: v * (1 + tol / 10) for k, v in ref.items()}
    assert gpu_check.within(gpu_check.relative_error(close, ref), tol)
    broken = dict(ref, w=ref["w"].clone())
    broken["w"][0, 0] += 1.0  # one wrong entry
    assert not gpu_check.within(gpu_check.relative_error(broken, ref), tol)
    stale = dict(ref, w=torch.zeros_like(ref["w"]))  # a gradient never written
    assert gpu_check.relative_error(stale, ref) == pytest.approx(1.0)
    assert not gpu_check.within(gpu_check.relative_error(stale, ref), 2e-2)


def test_missing_mismatched_or_non_finite_results_fail() -> None:
    ref = _grads()
    assert gpu_check.relative_error({"w": ref["w"]}, ref) == math.inf
    assert gpu_check.relative_error(dict(ref, w=ref["w"].t()), ref) == math.inf
    nan = dict(ref, b=ref["b"].clone())
    nan["b"][3] = float("nan")
    assert not gpu_check.within(gpu_check.relative_error(nan, ref), 1e-4)
    zero = {"z": torch.zeros(3)}
    assert gpu_check.relative_error(zero, zero) == 0.0
    assert gpu_check.relative_error({"z": torch.ones(3)}, zero) == math.inf


def test_a_failed_check_makes_the_report_fail() -> None:
    report = gpu_check.Report()
    report.check("m", "fp32", "ok", "0", True)
    assert report.passed
    report.check("m", "fp32", "broken", "1.0", False)
    assert not report.passed
    assert [row["status"] for row in report.checks] == ["PASS", "FAIL"]


def _roundtrip() -> dict[str, torch.Tensor]:
    (matrix, _), *_ = gpu_check.codec_inputs(1, 8, seed=0)
    return gpu_check.codec_roundtrip(gpu_check.IntQuantizer, 8, matrix), matrix


def test_a_codec_result_within_rounding_passes_and_not_bitwise() -> None:
    ref, matrix = _roundtrip()
    norm = torch.linalg.vector_norm(matrix.double()).item()
    close = dict(ref, residual=ref["residual"] * (1 + 1e-6))
    value, ok = gpu_check.codec_verdict(*gpu_check.codec_difference(close, ref, norm))
    assert ok and value != "bitwise"
    assert gpu_check.codec_verdict(*gpu_check.codec_difference(ref, ref, norm)) == ("bitwise", True)


def test_wrong_codes_a_lost_residual_or_a_missing_result_fail() -> None:
    ref, matrix = _roundtrip()
    norm = torch.linalg.vector_norm(matrix.double()).item()
    flipped = dict(ref, codes=ref["codes"] ^ 1)  # every code one off: a packing bug
    lost = dict(ref, residual=torch.zeros_like(ref["residual"]))  # error feedback dropped
    for broken in (flipped, lost, {k: v for k, v in ref.items() if k != "scales"}):
        error, flips = gpu_check.codec_difference(broken, ref, norm)
        assert gpu_check.codec_verdict(error, flips)[1] is False
