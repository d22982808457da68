"""Every program in ``examples/`` runs as it stands, launched as its docstring says.

Each example is a real subprocess (``torchrun``, ``accelerate launch`` or ``python``) in
a session of its own, so that a hang is killed with all its workers. Its rank 0 prints

    levels: epoch 0: 4 | epoch 1: 4 | epoch 2: 2 | epoch 3: 1
    traffic: sent 60.8 kB, dense would send 434.7 kB (7.15x less, 373.9 kB saved)

(``accordion.summary.summarize``), and the checks parse both lines: a run whose hook
never ran records no traffic ("sent 0 B ... (nothing sent)") and no level below the
mildest, and fails them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT = 120  # s per launch: 5-50 s measured on 2 shared cores, most of it imports
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
#: ``accelerate launch`` with two CPU processes (docs/integrations.md); port 0: a free one.
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", "0"]  # fmt: skip
#: Set by launchers (or by other tests in this process): each launch sets its own.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "ACCELERATE_USE_CPU", "TORCHELASTIC_RUN_ID")  # fmt: skip
UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
TRAFFIC = re.compile(r"^traffic: sent ([\d.]+) (\w+), dense would send ([\d.]+) (\w+) "
                     r"\(([\d.]+)x less, [\d.]+ \w+ saved\)$", re.MULTILINE)  # fmt: skip
LEVELS = re.compile(r"^levels: (.+)$", re.MULTILINE)
#: gloo on torch 2.13 sometimes aborts a process while C++ statics are destroyed at exit,
#: after its work and output are done (``tests/distributed.py``); only that is forgiven.
TEARDOWN_ABORT = "terminate called without an active exception"


def run_example(command: list[str], tmp_path: Path, timeout: float = TIMEOUT) -> str:
    """Run ``command`` from the repository root with ``src`` importable, one thread per
    process and nothing fetched; return its stdout, or fail with its output's tail."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    path = [str(ROOT / "src"), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in path if p), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))  # fmt: skip
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    launch = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True, **pipes)
    try:
        out, err = launch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)  # the launcher and every worker it started
        out, err = launch.communicate()
        pytest.fail(f"{command[-1]} did not finish in {timeout} s:\n{out[-2000:]}{err[-3000:]}")
    if launch.returncode != 0 and aborted_at_exit(out, err):
        return out  # the summary is complete: the callers check it as for a clean exit
    assert launch.returncode == 0, f"exit {launch.returncode}:\n{out[-2000:]}\n{err[-3000:]}"
    return out


def aborted_at_exit(out: str, err: str) -> bool:
    """Whether a failed torchrun launch is only gloo's abort at exit: its message, the
    summary's traffic line on stdout, and no worker lost but to that abort (SIGABRT, -6)
    or to the SIGTERM (-15) torchrun then sends the others."""
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
    return (TEARDOWN_ABORT in err and bool(TRAFFIC.search(out)) and bool(codes)
            and set(codes) <= {"-6", "-15"})  # fmt: skip


def traffic(out: str) -> tuple[float, float]:
    """``(sent, dense)`` bytes from the one ``traffic:`` line, checked to be below dense."""
    lines = TRAFFIC.findall(out)
    assert len(lines) == 1, f"expected one traffic line that sent less than dense:\n{out}"
    sent, sent_unit, dense, dense_unit, ratio = lines[0]
    sent, dense = float(sent) * UNITS[sent_unit], float(dense) * UNITS[dense_unit]
    assert 0 < sent < dense
    assert float(ratio) == pytest.approx(dense / sent, rel=0.01)  # one decimal per figure
    return sent, dense


def levels(out: str, unit: str, ladder: tuple[str, ...]) -> list[list[str]]:
    """The levels of each period of the one ``levels:`` line, numbered from its first;
    checked to be ladder levels, the first period the mildest, and the ladder walked."""
    lines = LEVELS.findall(out)
    assert len(lines) == 1, out
    periods = [part.split(": ") for part in lines[0].split(" | ")]
    first = int(periods[0][0].removeprefix(f"{unit} "))
    assert [name for name, _ in periods] == [f"{unit} {first + i}" for i in range(len(periods))]
    used = [words.split(",") for _, words in periods]
    assert all(set(u) <= set(ladder) for u in used), lines[0]
    return used


def check_walked(used: list[list[str]], ladder: tuple[str, ...]) -> None:
    """The run starts at the mildest level and reaches the most aggressive one."""
    assert used[0] == [ladder[0]]
    assert any(ladder[-1] in u for u in used), used


def torchrun(script: str, *args: str, workers: int = 2) -> list[str]:
    return [*TORCHRUN, str(workers), str(EXAMPLES / script), *args]


def test_the_ddp_example_runs_under_torchrun_and_sends_less_than_dense(tmp_path):
    out = run_example(torchrun("ddp_hook.py"), tmp_path)
    traffic(out)
    used = levels(out, "epoch", ("4", "2", "1"))
    assert len(used) == 4
    check_walked(used, ("4", "2", "1"))


def test_the_manual_loop_example_averages_without_ddp_and_sends_less_than_dense(tmp_path):
    out = run_example(torchrun("manual_loop.py"), tmp_path)
    traffic(out)
    used = levels(out, "window", ("2", "1"))
    assert len(used) == 4
    check_walked(used, ("2", "1"))


def test_the_adamw_example_sends_the_momenta_at_1_bit_after_its_freeze(tmp_path):
    out = run_example(torchrun("adamw_momentum.py"), tmp_path)
    sent, dense = traffic(out)
    assert levels(out, "window", ("2",)) == [["2"]] * 4  # the gradients' level
    assert "momentum: 1 bit from step 8 of 24" in out
    # 2-bit nq (an fp16 scale per 64 values) sends at most 14.22x less than fp32: the rest
    # is the 16 steps of 1-bit momenta (8 steps at 2 bits and 16 at 1 bit: 20.2x)
    assert dense / sent > 14.3


def test_the_lightning_example_registers_the_hook_from_its_callback_and_compresses(tmp_path):
    pytest.importorskip("lightning.pytorch")
    out = run_example(torchrun("lightning_callback.py"), tmp_path)
    traffic(out)
    used = levels(out, "epoch", ("4", "2", "1"))
    assert len(used) == 4
    check_walked(used, ("4", "2", "1"))


def test_the_accelerate_example_runs_two_compressing_processes_under_accelerate_launch(
    tmp_path,
):
    pytest.importorskip("accelerate")
    out = run_example([*ACCELERATE, str(EXAMPLES / "accelerate_loop.py")], tmp_path)
    # with one process (a wrong launch) register would warn and the hook never run
    sent, dense = traffic(out)
    used = levels(out, "epoch", ("4", "2", "1"))
    assert len(used) == 4
    check_walked(used, ("4", "2", "1"))
    # 4 epochs of 4 optimizer steps (8 micro-batches, accumulated by 2), 27,168 B each
    assert dense == pytest.approx(16 * 27_168, rel=0.001)


def test_the_hf_trainer_example_compresses_a_tiny_gpt2_under_torchrun(tmp_path):
    pytest.importorskip("transformers")
    out = run_example(torchrun("hf_trainer.py"), tmp_path)
    traffic(out)
    used = levels(out, "step", ("int/8", "int/4"))  # AccordionState(model)'s default
    assert len(used) == 8  # max_steps
    check_walked(used, ("int/8", "int/4"))


def test_the_compiled_example_compresses_under_torch_compile(tmp_path):
    out = run_example(torchrun("compiled.py"), tmp_path)
    traffic(out)
    used = levels(out, "epoch", ("4", "2", "1"))
    assert len(used) == 4
    check_walked(used, ("4", "2", "1"))


def test_the_fsdp_example_compresses_across_replicas_in_four_processes(tmp_path):
    out = run_example(torchrun("fsdp_hsdp.py", workers=4), tmp_path)
    traffic(out)
    used = levels(out, "epoch", ("4", "2", "1"))
    assert len(used) == 4
    check_walked(used, ("4", "2", "1"))


def test_the_restartable_example_resumes_from_its_checkpoints_when_launched_again(tmp_path):
    folder = str(tmp_path / "ckpt")
    restartable = ["--max-restarts", "3", str(EXAMPLES / "restartable.py"), folder]
    first = run_example([*TORCHRUN, "2", *restartable], tmp_path)
    assert "attempt 0: fresh start" in first
    assert levels(first, "epoch", ("4", "2", "1")) == [["4"], ["4"]]
    sent, dense = traffic(first)
    again = run_example([*TORCHRUN, "2", *restartable, "--epochs", "4"], tmp_path)
    assert "attempt 0: resumed from step 2" in again
    # only epochs 2 and 3 ran again, on the levels the checkpoint held
    used = levels(again, "epoch", ("4", "2", "1"))
    assert len(used) == 2 and "1" in used[-1]
    # the ledger came back with the rest: the traffic is the whole run's
    sent_again, dense_again = traffic(again)
    assert sent_again > sent and dense_again == pytest.approx(2 * dense, rel=0.001)


def test_the_cost_model_example_plans_and_calibrates_in_one_process(tmp_path):
    out = run_example([sys.executable, str(EXAMPLES / "cost_model.py")], tmp_path)
    plan = dict(re.findall(r"^  plan (.+?): ([\d.]+) MB", out, re.MULTILINE))
    assert list(plan) == ["dense", "rank 4", "rank 1"]
    assert float(plan["dense"]) > float(plan["rank 4"]) > float(plan["rank 1"]) > 0
    assert re.search(r"^traffic: rank 1 would send [\d.]+ MB per step, dense would send "
                     r"[\d.]+ MB \([\d.]+x less\)$", out, re.MULTILINE), out  # fmt: skip
    layers = re.findall(r"^  layer (\S+) ", out, re.MULTILINE)
    assert layers == [f"{i}.{kind}" for i in (0, 2, 4) for kind in ("weight", "bias")]
    chosen = dict(re.findall(r"^calibrate at (.+?): compressed (\d) of 3", out, re.MULTILINE))
    # on a slow link compression always pays; at 1 Tbit/s its computation never does
    assert chosen["10 Mbit/s"] == "3" and chosen["1 Tbit/s"] == "0"


def test_only_gloos_abort_at_exit_after_a_complete_summary_is_forgiven():
    summary = "traffic: sent 15.6 kB, dense would send 126.3 kB (8.12x less, 110.8 kB saved)\n"
    report = f"{TEARDOWN_ABORT}\n  exitcode  : -15 (pid: 2)\n  exitcode  : -6 (pid: 1)\n"
    assert aborted_at_exit(summary, report)
    assert not aborted_at_exit("loss: 0.9\n", report)  # the work did not finish
    assert not aborted_at_exit(summary, report.replace("-6", "1"))  # a worker failed
    assert not aborted_at_exit(summary, report.replace(TEARDOWN_ABORT, "Traceback"))
