"""Consistent checkpoint sets of a whole job: every rank's files, atomically, or nothing.

A set is one folder per step::

    DIR/step-00000012/rank-0.pt      # model, optimizer, scheduler (rank 0 only), and
    DIR/step-00000012/rank-1.pt      # per rank: Accordion state, batch controller, RNG
    DIR/step-00000012/COMPLETE.json  # written last, by rank 0, once every rank has written

Each file is written to a temporary name and renamed, and each is stamped with the
step, the world size, its rank and the job's run id. The marker is written only after
every rank reported its file written, so a set without it (a worker killed during a
save) is never loaded: :meth:`Checkpointer.load_latest` takes the newest set that has
its marker and every file it lists, and refuses a set whose stamps do not belong
together. A shared filesystem is assumed (every rank sees ``DIR``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._validate import check_choice, check_int
from ..compress.transport import world_and_rank
from .reshard import POLICIES, old_ranks, reshard

#: Version of a set's files.
SET_FORMAT = 1
MARKER = "COMPLETE.json"
_PREFIX = "step-"


@dataclass
class Restored:
    """What :meth:`Checkpointer.load_latest` restored."""

    #: The step (or epoch) the set was saved at.
    step: int
    #: The ``extra`` given to :meth:`Checkpointer.save` (plain values).
    extra: Any
    #: The set's folder.
    path: Path
    #: The world size of the job that saved it.
    saved_world_size: int


class Checkpointer:
    """Saves and finds consistent checkpoint sets of a distributed job (see the module).

    Args:
        directory: where the sets go (created; shared by every rank).
        keep: how many complete sets to keep (older ones are deleted after a save).
        world_change: what error-feedback memories do when the world size changed
            between save and load: ``"sum"`` (their average is kept) or ``"drop"``; see
            :mod:`accordion.checkpoint.reshard`.

    ``save`` and ``load_latest`` are collective: call them on every rank, at the same
    point. ``extra`` holds the loop's own position (epoch records, data position): plain
    values only (``torch.load(weights_only=True)`` reads the files).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2, world_change: str = "sum"):
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(f"directory must be a path, got {type(directory).__name__}")
        self.directory = Path(directory)
        self.keep = check_int("keep", keep, 1)
        self.world_change = check_choice("world_change", world_change, POLICIES)
        #: The job's id, stamped on every file: made at the first save, or loaded.
        self.run_id: str | None = None

    # --- saving -----------------------------------------------------------------------

    def save(self, step: int, *, model=None, optimizer=None, scheduler=None, accordion=None,
             batch=None, extra: Any = None) -> Path:  # fmt: skip
        """Write this rank's file of set ``step`` and, once every rank has, the marker.
        Returns the set's folder. Raises on every rank if any rank failed to write."""
        check_int("step", step, 0)
        world, rank = world_and_rank()
        if self.run_id is None:
            self.run_id = _agreed(uuid.uuid4().hex if rank == 0 else None)
        folder = self.directory / f"{_PREFIX}{step:08d}"
        if rank == 0:
            (folder / MARKER).unlink(missing_ok=True)  # rewriting a set: incomplete until done
        _barrier()
        error = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            payload = self._payload(step, world, rank, model, optimizer, scheduler, accordion,
                                    batch, extra)  # fmt: skip
            atomic_save(payload, folder / f"rank-{rank}.pt")
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = exc
        _raise_unless_all(error, f"saving checkpoint set {folder}")
        if rank == 0:
            marker = {"format": SET_FORMAT, "step": step, "world_size": world,
                      "run_id": self.run_id, "files": [f"rank-{r}.pt" for r in range(world)]}
            _atomic_write_text(folder / MARKER, json.dumps(marker, indent=1))  # fmt: skip
            self._prune(folder)
        _barrier()  # the set is complete on return, on every rank
        return folder

    def _payload(self, step, world, rank, model, optimizer, scheduler, accordion, batch, extra):
        payload: dict[str, Any] = {
            "format": SET_FORMAT, "step": step, "world_size": world, "rank": rank,
            "run_id": self.run_id, "extra": extra, "rng": _rng_state(),
            "accordion": None if accordion is None else accordion.state_dict(),
            "batch": None if batch is None else batch.state_dict(),
        }  # fmt: skip
        if rank == 0:  # identical on every DDP rank: written once
            for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
                payload[name] = None if obj is None else obj.state_dict()
        return payload

    def _prune(self, current: Path) -> None:
        """Delete complete sets beyond ``keep`` and every incomplete set but ``current``."""
        complete = [p for p in self._sets() if _marker(p) is not None]
        for path in complete[self.keep :]:
            shutil.rmtree(path, ignore_errors=True)
        for path in self._sets():
            if path != current and _marker(path) is None:
                shutil.rmtree(path, ignore_errors=True)

    # --- finding and loading ----------------------------------------------------------

    def _sets(self) -> list[Path]:
        """Set folders, newest step first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)
                 and p.name[len(_PREFIX):].isdigit()]  # fmt: skip
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]), reverse=True)

    def latest(self) -> Path | None:
        """The newest complete set: its marker is there and lists files that all exist."""
        for path in self._sets():
            marker = _marker(path)
            if marker is not None and all((path / f).is_file() for f in marker["files"]):
                return path
        return None

    def load_latest(self, *, model=None, optimizer=None, scheduler=None, accordion=None,
                    batch=None, map_location: Any = "cpu") -> Restored | None:  # fmt: skip
        """Restore the newest complete set into the objects given; ``None`` when there is
        none (a fresh start). Every rank loads the set rank 0 found; a set whose files do
        not belong together raises ``ValueError`` on every rank, before anything changes."""
        world, rank = world_and_rank()
        latest = self.latest() if rank == 0 else None
        found = _agreed(None if latest is None else str(latest))
        if found is None:
            return None
        path = Path(found)
        error, loaded = None, None
        try:
            loaded = self._read(path, world, rank, map_location)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = exc
        _raise_unless_all(error, f"loading checkpoint set {path}")
        assert loaded is not None  # else error was set, and raised above
        marker, own, first, accordion_state = loaded
        try:  # the Accordion state first: it checks everything before it changes anything
            _apply(first, own, model, optimizer, scheduler, accordion, accordion_state, batch)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = exc
        _raise_unless_all(error, f"restoring checkpoint set {path}")
        self.run_id = marker["run_id"]
        return Restored(marker["step"], own["extra"], path, marker["world_size"])

    def _read(self, path: Path, world: int, rank: int, map_location: Any):
        """This rank's files of set ``path``, checked: (marker, own file, rank 0's file,
        the Accordion state to load)."""
        marker = _marker(path)
        if marker is None:
            raise ValueError(f"{path} has no valid {MARKER}: the set is incomplete")
        saved = marker["world_size"]
        needed = sorted({0, rank if rank < saved else 0, *old_ranks(rank, saved, world)})
        files = {r: _load(path / f"rank-{r}.pt", map_location) for r in needed}
        for r, payload in files.items():
            _check_stamp(payload, marker, r, path)
        own = files[rank if rank < saved else 0]
        states = {r: p["accordion"] for r, p in files.items()}
        if own["accordion"] is None:
            state = None
        elif saved == world:
            state = own["accordion"]
        else:
            state = reshard(states, saved, world, rank, self.world_change)
        return marker, own, files[0], state


def _apply(first, own, model, optimizer, scheduler, accordion, accordion_state, batch) -> None:
    """Load every given object from the checked files (the Accordion state first)."""
    if accordion is not None:
        if accordion_state is None:
            raise ValueError("the checkpoint set holds no Accordion state")
        accordion.load_state_dict(accordion_state)
    for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
        if obj is not None:
            if first.get(name) is None:
                raise ValueError(f"the checkpoint set holds no {name} state")
            obj.load_state_dict(first[name])
    if batch is not None:
        if own["batch"] is None:
            raise ValueError("the checkpoint set holds no batch controller state")
        batch.load_state_dict(own["batch"])
    _set_rng_state(own["rng"])


def _check_stamp(payload: Any, marker: dict, rank: int, path: Path) -> None:
    """Raise ``ValueError`` unless ``payload`` is rank ``rank``'s file of ``marker``'s set."""
    stamp = {k: payload.get(k) for k in ("format", "step", "world_size", "rank", "run_id")} \
        if isinstance(payload, dict) else {}  # fmt: skip
    expected = {"format": SET_FORMAT, "step": marker["step"], "world_size": marker["world_size"],
                "rank": rank, "run_id": marker["run_id"]}  # fmt: skip
    if stamp != expected:
        wrong = {k: (stamp.get(k), v) for k, v in expected.items() if stamp.get(k) != v}
        raise ValueError(
            f"{path / f'rank-{rank}.pt'} does not belong to the set: (found, expected) "
            f"{wrong}; the set mixes files of different saves or runs"
        )


def _marker(path: Path) -> dict | None:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    keys = {"format", "step", "world_size", "run_id", "files"}
    if not isinstance(marker, dict) or not keys <= marker.keys():
        return None
    return marker


def _load(path: Path, map_location: Any) -> dict:
    if not path.is_file():
        raise ValueError(f"{path} is missing: the set is incomplete")
    return torch.load(path, map_location=map_location, weights_only=True)


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` through a temporary file and a rename: a reader (or a
    resume after a kill) finds the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # atomic on POSIX: a reader sees the old file or the new one


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _rng_state() -> dict[str, Any]:
    import numpy as np

    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple)  # a dict only for a bit generator other than MT19937
    kind, keys, pos, has_gauss, cached = legacy
    state = {"torch": torch.get_rng_state(), "python": _plain(random.getstate()),
             "numpy": [kind, torch.from_numpy(keys.copy()), pos, has_gauss, cached]}  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _plain(python_state: tuple) -> list:
    version, internal, gauss = python_state
    return [version, list(internal), gauss]


def _agreed(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if world_and_rank()[0] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if world_and_rank()[0] > 1:
        dist.barrier()


def _raise_unless_all(error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed: its own error, or one that repeats the
    failed ranks' messages (a ``ValueError`` when theirs were)."""
    world, rank = world_and_rank()
    mine = [] if error is None else [(rank, type(error).__name__, str(error))]
    failures = mine
    if world > 1:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        failures = [f for ranks in everyone for f in ranks]
    if error is not None:
        raise error
    if failures:
        kind = ValueError if all(f[1] == "ValueError" for f in failures) else RuntimeError
        told = "; ".join(f"rank {r}: {name}: {text}" for r, name, text in failures)
        raise kind(f"{what} failed on another rank: {told}")


__all__ = ["Checkpointer", "Restored", "SET_FORMAT", "MARKER", "atomic_save"]
