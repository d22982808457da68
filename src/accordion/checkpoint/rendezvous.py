"""A file rendezvous per restart attempt, for a loop restarted by ``torchrun``.

Under ``torchrun --standalone --max-restarts N`` with gloo, the default env://
rendezvous often fails after a worker was killed (``Gloo connectFullMesh failed ...
Connection refused``, or a hang in ``init_process_group``), plain DDP included: a
problem of torch and gloo, not of the training code. :func:`init_process_group` avoids
it: the workers of each restart attempt meet through a file of their own, which shares
nothing with the killed attempt's::

    CHECKPOINT_DIR/.rendezvous/store-<TORCHELASTIC_RUN_ID>-<MASTER_PORT>-<TORCHELASTIC_RESTART_COUNT>

The folder must be on a filesystem every rank sees (as the checkpoint sets are).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

#: The folder of the store files, inside the checkpoint folder.
RENDEZVOUS_DIR = ".rendezvous"
#: What names an attempt's store: the variables torchrun sets in every worker.
ATTEMPT_VARIABLES = ("TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
#: Every variable :func:`init_process_group` reads.
REQUIRED_VARIABLES = ("RANK", "WORLD_SIZE", *ATTEMPT_VARIABLES)
#: Arguments of ``torch.distributed.init_process_group`` that the rendezvous sets itself.
_SET_HERE = ("init_method", "store", "rank", "world_size")
_PREFIX = "store-"


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, ``"gloo"`` otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def store_path(checkpoint_dir: str | os.PathLike, environ: Mapping[str, str] | None = None) -> Path:
    """The absolute path of this restart attempt's store file (not created).

    ``environ`` defaults to ``os.environ``; it must hold :data:`REQUIRED_VARIABLES`
    (torchrun sets them), else ``ValueError`` names the missing ones.
    """
    folder = _checked_dir(checkpoint_dir) / RENDEZVOUS_DIR
    env = os.environ if environ is None else environ
    _check_environment(env)
    return folder / (_PREFIX + "-".join(env[k] for k in ATTEMPT_VARIABLES))


def init_process_group(
    checkpoint_dir: str | os.PathLike, backend: str | None = None, **kwargs: Any
) -> Path:
    """Initialise the default process group of a ``torchrun`` worker through a file
    rendezvous of this restart attempt; return the store file's path.

    Args:
        checkpoint_dir: the job's checkpoint folder (shared by every rank); the store
            files go in its ``.rendezvous`` folder (created).
        backend: ``None`` for :func:`default_backend` (nccl with CUDA, else gloo), or a
            backend name ``torch.distributed`` has, or a spec ``"cpu:gloo,cuda:nccl"``.
        **kwargs: passed to ``torch.distributed.init_process_group``, e.g. ``timeout``
            (a ``datetime.timedelta``), ``device_id``, ``pg_options``; not
            ``init_method``, ``store``, ``rank`` or ``world_size``, which come from here.

    The rank and world size come from ``RANK`` and ``WORLD_SIZE``, the attempt from
    ``TORCHELASTIC_RUN_ID``, ``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT``: outside
    ``torchrun`` any of them missing is a ``ValueError`` naming them (there is no restart
    attempt to keep apart: call ``torch.distributed.init_process_group`` yourself).
    Rank 0 then deletes the store files of this run's earlier attempts (their workers
    are stopped); at exit after ``destroy_process_group``, each rank deletes its own.

    Example, ``train.py``, run with
    ``torchrun --standalone --nproc-per-node 2 --max-restarts 3 train.py``::

        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from accordion.checkpoint import Checkpointer, init_process_group

        init_process_group("ckpt")  # gloo on CPU, nccl with CUDA
        torch.manual_seed(0)
        net = torch.nn.Linear(8, 2)
        model = DDP(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        saver = Checkpointer("ckpt")
        restored = saver.load_latest(model=net, optimizer=optimizer)
        for step in range(0 if restored is None else restored.step, 100):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            saver.save(step + 1, model=net, optimizer=optimizer)
        dist.barrier()  # gloo: every rank, before the group goes
        dist.destroy_process_group()
    """
    backend = _checked_backend(backend)
    _check_kwargs(kwargs)
    if dist.is_initialized():
        raise ValueError(
            "init_process_group: the default process group is already initialised; call "
            "it once per process, before any other torch.distributed call"
        )
    (store := store_path(checkpoint_dir)).parent.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=world, **kwargs)  # fmt: skip
    atexit.register(_remove_after_clean_destroy, store)
    if rank == 0:  # torchrun stops an attempt's workers on every node before the next starts
        _remove_earlier_attempts(store.parent, os.environ)
    return store


def _remove_after_clean_destroy(store: Path) -> None:
    """At exit, delete the attempt's store file if this rank destroyed its group.

    torch's FileStore deletes the file only once every rank's store object is freed, and
    a reference that outlives the group (a cycle, a library's cache) prevents that. After
    the barrier and ``destroy_process_group`` no rank reads the file again."""
    if dist.is_initialized():  # not destroyed: the next attempt's rank 0 removes the file
        return
    gc.collect()  # free a store in a cycle first: its destructor must not recreate the file
    store.unlink(missing_ok=True)


def _remove_earlier_attempts(folder: Path, env: Mapping[str, str]) -> list[Path]:
    """Delete the store files of this run id's attempts before this one; return them.
    Other runs' files are left alone: one of them may still be in use."""
    prefix = f"{_PREFIX}{env['TORCHELASTIC_RUN_ID']}-"
    current = int(env["TORCHELASTIC_RESTART_COUNT"])
    removed = []
    for path in folder.iterdir():
        if not path.name.startswith(prefix):
            continue
        port, _, count = path.name[len(prefix) :].partition("-")  # exactly <port>-<count>
        if port.isdigit() and count.isdigit() and int(count) < current:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _check_environment(env: Mapping[str, str]) -> None:
    missing = [k for k in REQUIRED_VARIABLES if not env.get(k)]
    if missing:
        raise ValueError(
            f"init_process_group needs torchrun's environment variables "
            f"{', '.join(REQUIRED_VARIABLES)}; missing: {', '.join(missing)}. Run the "
            "script under torchrun, or call torch.distributed.init_process_group yourself"
        )
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        if not env[name].isdigit():
            raise ValueError(f"environment variable {name} must be an int >= 0, got {env[name]!r}")
    if int(env["WORLD_SIZE"]) < 1 or int(env["RANK"]) >= int(env["WORLD_SIZE"]):
        raise ValueError(
            f"environment variables RANK and WORLD_SIZE must satisfy 0 <= RANK < WORLD_SIZE, "
            f"got RANK={env['RANK']!r}, WORLD_SIZE={env['WORLD_SIZE']!r}"
        )
    if any(c in env["TORCHELASTIC_RUN_ID"] for c in "/?#"):  # part of a file:// URL
        raise ValueError(
            "environment variable TORCHELASTIC_RUN_ID must not contain '/', '?' or '#', "
            f"got {env['TORCHELASTIC_RUN_ID']!r}"
        )


def _checked_dir(checkpoint_dir: Any) -> Path:
    if not isinstance(checkpoint_dir, str | os.PathLike):
        raise TypeError(
            f"checkpoint_dir must be a str or os.PathLike folder, got {checkpoint_dir!r}"
        )
    if os.fspath(checkpoint_dir) in ("", b""):
        raise ValueError(f"checkpoint_dir must be a non-empty path, got {checkpoint_dir!r}")
    path = Path(os.fsdecode(checkpoint_dir)).absolute()  # file://a/b would read "a" as a host
    if path.exists() and not path.is_dir():
        raise ValueError(f"checkpoint_dir must be a folder, got the file {str(path)!r}")
    if "?" in str(path) or "#" in str(path):  # the file:// URL would end there
        raise ValueError(f"checkpoint_dir must not contain '?' or '#', got {str(path)!r}")
    return path


def _checked_backend(backend: Any) -> str:
    if backend is None:
        return default_backend()
    if not isinstance(backend, str):
        raise TypeError(f"backend must be None or a str such as 'gloo', got {backend!r}")
    # registered third-party backends are in backend_list too
    known = dict.fromkeys(b for b in dist.Backend.backend_list if b != "undefined")
    available = [b for b in known if dist.is_backend_available(b)]
    parts = backend.split(",") if ":" in backend else [f":{backend}"]  # "cpu:gloo,cuda:nccl"
    if any(part.partition(":")[2].lower() not in available for part in parts):
        raise ValueError(
            f"backend must be None, one of the backends available in this torch build "
            f"({', '.join(available)}), or a device spec of them such as "
            f"'cpu:gloo,cuda:nccl'; got {backend!r}"
        )
    return backend


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    taken = [k for k in _SET_HERE if k in kwargs]
    if taken:
        raise TypeError(
            f"init_process_group sets {', '.join(_SET_HERE)} itself (from the environment "
            f"and checkpoint_dir); got {', '.join(f'{k}={kwargs[k]!r}' for k in taken)}"
        )
    timeout = kwargs.get("timeout")
    if timeout is None:
        return
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
    if timeout <= datetime.timedelta(0):
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")


__all__ = [
    "init_process_group",
    "store_path",
    "default_backend",
    "RENDEZVOUS_DIR",
    "REQUIRED_VARIABLES",
]
