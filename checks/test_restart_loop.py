"""A hand-written loop (``tests/restart_loop.py``) under ``torchrun --max-restarts``,
SIGKILLed three times in a row (CPU, gloo): it resumes from ever newer checkpoint sets
through ``accordion.checkpoint.init_process_group``, ends bitwise equal to an
uninterrupted run and leaves no store file behind. About 40 s: a release check, apart
from ``make test``."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from accordion.checkpoint import Checkpointer
from accordion.checkpoint.rendezvous import RENDEZVOUS_DIR

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "restart_loop.py"
LIMIT_S = 120
KILLS = 3


# --- a hand-written loop under torchrun, killed three times ----------------------------


def _torchrun(checkpoints: Path, final: Path, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", str(KILLS), str(SCRIPT),
               str(checkpoints), str(final)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    # its own session: on a timeout the whole tree is killed, workers included
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


def _fail(job: subprocess.Popen, log: Path, what: str) -> None:
    if job.poll() is None:
        for worker in _workers(job.pid):  # torchrun gives each worker a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        os.killpg(job.pid, signal.SIGKILL)
    raise AssertionError(f"{what}:\n{log.read_text()[-3000:]}")


def _wait(job: subprocess.Popen, log: Path) -> None:
    try:
        code = job.wait(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        _fail(job, log, f"torchrun did not finish in {LIMIT_S} s")
    assert code == 0, log.read_text()[-3000:]


def _until(condition, job: subprocess.Popen, log: Path, deadline: float, what: str):
    """``condition()``'s first true value, polled every 20 ms until ``deadline``."""
    while not (value := condition()):
        if job.poll() is not None or time.monotonic() > deadline:
            _fail(job, log, f"never {what}")
        time.sleep(0.02)
    return value


def _workers(agent: int) -> list[int]:
    """The worker processes of torchrun's agent ``agent`` (its children)."""
    found = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


def _newest_step(checkpoints: Path) -> int:
    latest = Checkpointer(checkpoints).latest()  # reads the folder only: no group needed
    return -1 if latest is None else int(latest.name.removeprefix("step-"))


def _kill_three_times(job: subprocess.Popen, checkpoints: Path, log: Path) -> None:
    """SIGKILL a worker of each attempt once the attempt wrote a newer complete set."""
    deadline, seen = time.monotonic() + LIMIT_S, set()
    for kill in range(KILLS):
        pair = _until(lambda: _new_pair(job.pid, seen), job, log, deadline,
                      f"started attempt {kill}'s workers")  # fmt: skip
        # read before the attempt can have saved (its workers still import torch)
        floor = _newest_step(checkpoints)
        _until(lambda floor=floor: _newest_step(checkpoints) > floor, job, log, deadline,
               f"saw attempt {kill} write a set after step {floor}")  # fmt: skip
        os.kill(pair[kill % 2], signal.SIGKILL)  # pgrep sorts by pid: rank 0, 1, then 0
        seen.update(pair)


def _new_pair(agent: int, seen: set[int]) -> list[int] | None:
    """The agent's two workers when neither is one of ``seen`` (an earlier attempt's)."""
    pair = [pid for pid in _workers(agent) if pid not in seen]
    return pair if len(pair) == 2 else None


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """An uninterrupted run of ``restart_loop.py`` and one killed three times in a row:
    (the straight run's final weights, the killed run's, its log, its checkpoint folder)."""
    tmp = tmp_path_factory.mktemp("restart")
    straight = _torchrun(tmp / "straight", tmp / "straight.pt", tmp / "straight.log")
    log = tmp / "killed.log"
    job = _torchrun(tmp / "killed", tmp / "killed.pt", log)  # both at once: half the time
    _kill_three_times(job, tmp / "killed", log)
    _wait(job, log)
    _wait(straight, tmp / "straight.log")
    a = torch.load(tmp / "straight.pt", weights_only=True)
    b = torch.load(tmp / "killed.pt", weights_only=True)
    return a, b, log.read_text(), tmp / "killed"


def test_a_loop_killed_three_times_in_a_row_ends_bitwise_equal_to_an_uninterrupted_run(
    restarted,
):
    straight, killed, _, _ = restarted
    assert straight.keys() == killed.keys()
    assert all(torch.equal(straight[k], killed[k]) for k in straight)


def test_each_restart_attempt_resumed_from_a_newer_set_than_the_attempt_before(restarted):
    log = restarted[2]
    assert "attempt 0: fresh start" in log
    resumed = [int(m) for m in re.findall(r"attempt \d: resumed from step (\d+)", log)]
    assert re.findall(r"attempt (\d): resumed", log) == ["1", "2", "3"], log[-3000:]
    assert 0 < resumed[0] < resumed[1] < resumed[2], resumed


def test_a_restarted_job_leaves_no_store_file_behind(restarted):
    # the killed attempts' files: deleted by the last attempt's rank 0; its own: by destroy
    assert list((restarted[3] / RENDEZVOUS_DIR).iterdir()) == []
