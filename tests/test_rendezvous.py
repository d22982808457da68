"""Under torchrun: ``accordion.checkpoint.init_process_group`` (a file rendezvous per
restart attempt) and the harness's torch threads per worker. The loop SIGKILLed three
times in a row under torchrun is ``checks/test_restart_loop.py``."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from accordion.checkpoint import init_process_group
from accordion.checkpoint.rendezvous import RENDEZVOUS_DIR, default_backend, store_path
from accordion.cli.parser import build_parser
from accordion.cli.run_config import _make_config
from accordion.compress.transport import group_timeout

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "run-a",
                "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2"}  # fmt: skip


@pytest.fixture
def torchrun_env(monkeypatch):
    """A one-worker torchrun environment, in its third attempt."""
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    return dict(TORCHRUN_ENV)


@pytest.fixture
def group_cleanup():
    """Destroys a process group a test initialised in this process, even if it failed."""
    yield
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# --- the store file of an attempt ------------------------------------------------------


def test_the_store_file_is_named_after_the_run_id_the_port_and_the_restart_count(tmp_path):
    path = store_path(tmp_path, TORCHRUN_ENV)
    assert path == tmp_path / RENDEZVOUS_DIR / "store-run-a-29500-2"


def test_each_restart_attempt_gets_a_store_file_of_its_own(tmp_path):
    paths = {store_path(tmp_path, {**TORCHRUN_ENV, "TORCHELASTIC_RESTART_COUNT": str(n)})
             for n in range(4)}  # fmt: skip
    assert len(paths) == 4


def test_a_relative_checkpoint_dir_gives_an_absolute_store_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # file://ckpt/... would read "ckpt" as a host
    expected = tmp_path / "ckpt" / RENDEZVOUS_DIR / "store-run-a-29500-2"
    assert store_path("ckpt", TORCHRUN_ENV) == expected


def test_outside_torchrun_a_value_error_names_the_missing_variables(tmp_path, monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    missing = "missing: RANK, TORCHELASTIC_RUN_ID, MASTER_PORT, TORCHELASTIC_RESTART_COUNT"
    with pytest.raises(ValueError, match=missing):
        init_process_group(tmp_path)
    assert not dist.is_initialized() and not (tmp_path / RENDEZVOUS_DIR).exists()


@pytest.mark.parametrize(
    "changed, match",
    [({"RANK": "one"}, "RANK must be an int >= 0, got 'one'"),
     ({"RANK": "2", "WORLD_SIZE": "2"}, "0 <= RANK < WORLD_SIZE, got RANK='2', WORLD_SIZE='2'"),
     ({"TORCHELASTIC_RESTART_COUNT": "-1"}, "TORCHELASTIC_RESTART_COUNT must be an int >= 0"),
     ({"TORCHELASTIC_RUN_ID": "a/b"}, "TORCHELASTIC_RUN_ID must not contain '/'")],
)  # fmt: skip
def test_a_malformed_torchrun_variable_is_a_value_error_naming_it(tmp_path, changed, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        store_path(tmp_path, {**TORCHRUN_ENV, **changed})


# --- arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [((3,), {}, TypeError, "checkpoint_dir must be a str or os.PathLike folder, got 3"),
     (("",), {}, ValueError, "checkpoint_dir must be a non-empty path, got ''"),
     (("FILE",), {}, ValueError, "checkpoint_dir must be a folder, got the file"),
     (("DIR", 3), {}, TypeError, "backend must be None or a str such as 'gloo', got 3"),
     (("DIR", "nosuch"), {}, ValueError, "available in this torch build (gloo"),
     (("DIR",), {"init_method": "env://"}, TypeError, "got init_method='env://'"),
     (("DIR",), {"rank": 1}, TypeError, "sets init_method, store, rank, world_size itself"),
     (("DIR",), {"timeout": 30}, TypeError, "timeout must be a datetime.timedelta, got 30"),
     (("DIR",), {"timeout": datetime.timedelta(0)}, ValueError,
      "timeout must be a positive datetime.timedelta")],
)  # fmt: skip
def test_a_bad_argument_is_refused_naming_it_before_any_group_starts(
    tmp_path, torchrun_env, args, kwargs, error, match
):
    (tmp_path / "FILE").write_text("")
    names = {"FILE": tmp_path / "FILE", "DIR": tmp_path / "ckpt"}
    args = tuple(names.get(a, a) if isinstance(a, str) else a for a in args)
    with pytest.raises(error, match=re.escape(match)):
        init_process_group(*args, **kwargs)
    assert not dist.is_initialized()


def test_the_default_backend_is_gloo_without_cuda_and_nccl_with_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_backend() == "nccl"


# --- one process: the group, its timeout, the earlier attempts' files ------------------


def test_the_group_gets_the_rank_world_size_and_the_timeout_given(
    tmp_path, torchrun_env, group_cleanup
):
    store = init_process_group(tmp_path, "gloo", timeout=datetime.timedelta(seconds=42))
    assert store == store_path(tmp_path) and store.is_file()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "gloo")
    assert group_timeout() == datetime.timedelta(seconds=42)


def test_rank_0_deletes_the_store_files_of_its_runs_earlier_attempts_only(
    tmp_path, torchrun_env, group_cleanup
):
    folder = tmp_path / RENDEZVOUS_DIR
    folder.mkdir()
    earlier = ["store-run-a-29400-0", "store-run-a-29450-1"]  # killed attempts: ports change
    others = ["store-run-b-29400-0",  # another run
              "store-run-a-1234-5678-0",  # run "run-a-1234"
              "store-run-a-29500-3"]  # fmt: skip
    for name in earlier + others:
        (folder / name).write_text("")
    init_process_group(tmp_path)
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted([*others, "store-run-a-29500-2"])


def test_a_clean_destroy_on_every_rank_deletes_the_attempts_store_file(
    tmp_path, torchrun_env, group_cleanup
):
    store = init_process_group(tmp_path)
    dist.barrier()
    dist.destroy_process_group()
    assert not store.exists()


_LINGERING = """
import ctypes, sys
import torch.distributed as dist
from accordion.checkpoint import init_process_group
init_process_group(sys.argv[1], "gloo")
store = dist.distributed_c10d._get_default_store()
ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))  # never freed, as by a stray cache
dist.barrier()
if sys.argv[2] == "destroy":
    dist.destroy_process_group()
"""


def _run_lingering(tmp_path: Path, ending: str) -> Path:
    env = {**os.environ, **TORCHRUN_ENV, "RANK": "0", "WORLD_SIZE": "1",
           "PYTHONPATH": str(ROOT / "src")}  # fmt: skip
    subprocess.run([sys.executable, "-c", _LINGERING, str(tmp_path), ending], env=env,
                   check=True, timeout=60)  # fmt: skip
    return store_path(tmp_path, TORCHRUN_ENV)


def test_a_clean_destroy_deletes_the_store_file_even_if_a_store_reference_outlives_it(
    tmp_path,
):
    assert not _run_lingering(tmp_path, "destroy").exists()


def test_a_process_that_never_destroyed_its_group_leaves_its_store_file(tmp_path):
    # another rank may still be in the group: the next attempt's rank 0 deletes it
    assert _run_lingering(tmp_path, "exit").exists()


def test_a_second_call_is_a_value_error_and_leaves_the_group(tmp_path, torchrun_env, group_cleanup):
    init_process_group(tmp_path)
    with pytest.raises(ValueError, match="already initialised"):
        init_process_group(tmp_path)
    assert dist.get_world_size() == 1


# --- the harness's torch threads under torchrun ----------------------------------------


@pytest.mark.parametrize("cores", [2, 16])
def test_under_torchrun_a_worker_gets_the_threads_of_a_local_run_with_as_many_workers(
    monkeypatch, cores
):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    parser = build_parser()
    local = parser.parse_args(["train", "--workers", "2"])
    expected = _make_config(local, local.parser).threads
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    args = parser.parse_args(["train"])  # --workers 1: torchrun ignores it
    assert _make_config(args, args.parser).threads == expected == cores // 2


def test_under_torchrun_threads_given_are_kept(monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["train", "--threads", "3"])
    assert _make_config(args, args.parser).threads == 3
