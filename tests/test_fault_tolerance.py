"""A worker SIGKILLed under ``torchrun --max-restarts``: the job resumes from the newest
complete checkpoint set and ends bitwise equal to an uninterrupted run (CPU, gloo).

The workers meet through a file rendezvous per restart attempt (``--checkpoint-dir``
gives ``DIR/.rendezvous``): with gloo's env:// rendezvous, restarts here often failed in
``connectFullMesh`` or hung in ``init_process_group``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

TRAIN = ["--epochs", "6", "--train-samples", "4000", "--test-samples", "500", "--threads", "1",
         "--no-progress", "--strategy", "accordion:powersgd:4,2,1", "--decay-epochs", "3",
         "--warmup-epochs", "0"]  # fmt: skip
LIMIT_S = 150


def _torchrun(checkpoints: Path, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", "2",
               "-m", "accordion", "train", *TRAIN,
               "--checkpoint-dir", str(checkpoints)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # its own session: on a timeout the whole tree is killed, workers included
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


def _wait(job: subprocess.Popen, log: Path) -> None:
    try:
        code = job.wait(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        for worker in _workers(job.pid):  # torchrun gives each worker a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        os.killpg(job.pid, signal.SIGKILL)
        tail = log.read_text()[-3000:]
        raise AssertionError(f"torchrun did not finish in {LIMIT_S} s:\n{tail}") from None
    assert code == 0, log.read_text()[-3000:]


def _workers(agent: int) -> list[int]:
    """The worker processes of torchrun's agent ``agent`` (its children)."""
    found = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


def _final(checkpoints: Path) -> dict:
    return torch.load(checkpoints / "step-00000006" / "rank-0.pt", weights_only=True)


def test_a_sigkilled_worker_restarts_from_the_newest_set_and_ends_bitwise_equal(tmp_path):
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    straight = _torchrun(straight_dir, tmp_path / "straight.log")
    _wait(straight, tmp_path / "straight.log")
    log = tmp_path / "killed.log"
    job = _torchrun(killed_dir, log)
    marker = killed_dir / "step-00000001" / "COMPLETE.json"
    deadline = time.monotonic() + LIMIT_S
    while not marker.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = _workers(job.pid)
    assert marker.exists() and len(workers) == 2, log.read_text()[-3000:]
    os.kill(workers[-1], signal.SIGKILL)  # during epoch 2: its set is not written yet
    _wait(job, log)
    assert "exitcode: -9" in log.read_text()  # torchrun saw the kill and restarted
    a, b = _final(straight_dir), _final(killed_dir)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["accordion"]["rungs"] == b["accordion"]["rungs"]
    assert a["extra"]["records"][-1]["test_metric"] == b["extra"]["records"][-1]["test_metric"]
