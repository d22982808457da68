"""Transports: who carries the tensors that a compressor asks to exchange.

A compressor never calls ``torch.distributed`` itself. Its ``exchange`` is a generator
that *yields phases*: a phase is a list of collectives (:class:`AllReduce`,
:class:`AllGather`) to run together; the transport runs them and sends back one
result per collective. This keeps the communication in one place and lets the same
compressor code run

* across real processes (:class:`TorchTransport`, blocking ``run`` or ``run_async``
  that chains ``torch.futures`` so that a DDP hook overlaps the backward pass), and
* across ``N`` simulated workers inside one process (:class:`SimulatedTransport`), so
  that tests check multi-worker arithmetic without processes, and
* in a single process with no group at all (:class:`LocalTransport`).

An :class:`AllToAll` is the first phase of a two-phase compressed all-reduce
(``two_phase.py``): each worker sends row ``j`` of its tensor to worker ``j``.

Workers may share hosts: ``local_size`` workers a host, ranks host after host (as
``torchrun`` numbers them). An all-to-all or an all-gather then has a *scope*
(:data:`SCOPES`): ``"world"`` (every worker), ``"host"`` (the workers of this one's host,
by local rank) or ``"peers"`` (the workers of this one's local rank, one a host, by
host), so that a hierarchical exchange reduces inside a host and compresses across hosts.

A transport is the one source of the world size, this worker's rank and the group
(``world_size``, ``rank``, ``group``). :func:`open_transport` opens the controller's (on
a :func:`private_group`), :func:`group_transport` one over a group as it is;
``all_reduce`` and ``barrier`` serve measurements (``accordion.calibration``).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from .._validate import check_choice
from .wire import allgather_bytes, allreduce_bytes, alltoall_bytes, check_world_size

T = TypeVar("T")


@dataclass(frozen=True)
class AllReduce:
    """Sum ``tensor`` over all workers, in place. The result sent back is the tensor itself."""

    tensor: torch.Tensor


#: The scopes of a collective: every worker, the workers of one host, one worker a host.
SCOPES = ("world", "host", "peers")


@dataclass(frozen=True)
class AllGather:
    """Gather ``tensor`` (same shape on every worker) over ``scope``'s ``S`` workers (see
    :data:`SCOPES`). The result is a ``[S, *shape]`` tensor."""

    tensor: torch.Tensor
    scope: str = "world"


@dataclass(frozen=True)
class Broadcast:
    """Overwrite ``tensor`` on every worker with worker ``src``'s (a rank of the group).
    The result sent back is the tensor itself. Ranks agree on decisions through it."""

    tensor: torch.Tensor
    src: int = 0


@dataclass(frozen=True)
class AllToAll:
    """Send row ``j`` of ``tensor`` (``[S, ...]``, the same shape on every worker) to the
    ``j``-th worker of ``scope``'s ``S`` (see :data:`SCOPES`). The result is a new ``[S,
    ...]`` tensor whose row ``i`` is the ``i``-th worker's row for this worker."""

    tensor: torch.Tensor
    scope: str = "world"


def scope_members(scope: str, rank: int, world_size: int, local_size: int) -> list[int]:
    """The ranks of ``rank``'s ``scope`` among ``world_size`` workers, ``local_size`` a
    host (ranks host after host), in the order a scoped collective's rows follow."""
    host, local = divmod(rank, local_size)
    if scope == "host":
        return list(range(host * local_size, (host + 1) * local_size))
    if scope == "peers":
        return list(range(local, world_size, local_size))
    return list(range(world_size))


def workers_per_host(requested: Any, process_group: Any = None) -> int:
    """The workers a host of ``process_group`` (the default group for ``None``) for
    ``requested``: an int as given (it must divide the world size), or ``"auto"``: on the
    default group, ``torchrun``'s ``LOCAL_WORLD_SIZE`` where it is from 2 to half the world
    size and divides it (two hosts or more, alike), else 1 (every worker its own host)."""
    world = world_and_rank(process_group)[0]
    if requested != "auto":
        return check_local_size(requested, world)
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    local = int(text) if text.isdigit() else 1
    if process_group is None and 1 < local <= world // 2 and world % local == 0:
        return local
    return 1


def check_workers_per_host(value: Any) -> int | str:
    """``value`` if it is ``"auto"`` or an int >= 1; else ``TypeError`` or ``ValueError``."""
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"workers_per_host must be 'auto' or an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"workers_per_host must be 'auto' or an int >= 1, got {value!r}")
    return value


def check_local_size(local_size: Any, world_size: int) -> int:
    """``local_size`` (workers a host) if it is an int >= 1 dividing ``world_size``; else
    ``TypeError`` or ``ValueError``."""
    if isinstance(local_size, bool) or not isinstance(local_size, int):
        raise TypeError(f"local_size must be an int, got {local_size!r}")
    if local_size < 1 or world_size % local_size:
        raise ValueError(f"local_size must be >= 1 and divide the world size {world_size} "
                         f"(workers a host, every host alike), got {local_size}")  # fmt: skip
    return local_size


Collective = AllReduce | AllGather | Broadcast | AllToAll
#: The type of a compressor's exchange: yields phases, receives their results, returns T.
Exchange = Generator[list[Collective], list[Any], T]


def collective_bytes(op: Collective, world_size: int) -> float:
    """Bytes one worker sends for ``op`` under ring algorithms (see ``accordion.accounting``),
    among ``world_size`` workers (for a scoped collective: its scope's)."""
    nbytes = op.tensor.numel() * op.tensor.element_size()
    if isinstance(op, AllReduce):
        return allreduce_bytes(nbytes, world_size)
    if isinstance(op, Broadcast):  # a ring broadcast: every worker but the last forwards it
        return nbytes if world_size > 1 else 0.0
    if isinstance(op, AllToAll):
        return alltoall_bytes(nbytes, world_size)
    return allgather_bytes(nbytes, world_size)


def parallel(*exchanges: Exchange[Any]) -> Exchange[tuple[Any, ...]]:
    """Run several exchanges in lockstep, merging their k-th phases into one phase.

    Returns the tuple of their return values. Merging lets, for example, a bucket's
    dense all-reduce travel in the same phase as PowerSGD's P factors.
    """
    results: list[Any] = [None] * len(exchanges)
    phases: dict[int, list[Collective]] = {}
    for i, ex in enumerate(exchanges):
        try:
            phases[i] = next(ex)
        except StopIteration as stop:
            results[i] = stop.value
    while phases:
        ops: list[Collective] = []
        spans = []
        for i, phase in phases.items():
            spans.append((i, len(ops), len(phase)))
            ops.extend(phase)
        replies = yield ops
        phases = {}
        for i, start, count in spans:
            try:
                phases[i] = exchanges[i].send(replies[start : start + count])
            except StopIteration as stop:
                results[i] = stop.value
    return tuple(results)


class SimulatedTransport:
    """``world_size`` workers simulated in one process, for tests and quick studies.

    ``run`` takes one exchange per worker (each worker's own compressor state and
    tensors) and steps them in lockstep, checking that every worker asks for the same
    collectives with the same shapes, as real processes must.
    """

    def __init__(self, world_size: int, local_size: int = 1):
        self.world_size = check_world_size(world_size)
        #: Workers a host (ranks host after host).
        self.local_size = check_local_size(local_size, self.world_size)
        #: Bytes each worker has sent so far (ring algorithms).
        self.bytes_sent = 0.0
        #: Of :attr:`bytes_sent`, per scope (:data:`SCOPES`; unscoped collectives: ``"world"``).
        self.bytes_by_scope = dict.fromkeys(SCOPES, 0.0)

    def run(self, exchanges: Sequence[Exchange[T]]) -> list[T]:
        """Run one exchange per worker to completion and return their results."""
        if len(exchanges) != self.world_size:
            raise ValueError(
                f"exchanges must hold one exchange per worker ({self.world_size}), "
                f"got {len(exchanges)}"
            )
        results: list[Any] = [None] * self.world_size
        phases: list[list[Collective] | None] = []
        for ex in exchanges:
            try:
                phases.append(next(ex))
            except StopIteration as stop:
                phases.append(None)
                results[len(phases) - 1] = stop.value
        while any(p is not None for p in phases):
            ready = [p for p in phases if p is not None]
            if len(ready) != len(phases):
                raise RuntimeError("workers disagree on the number of communication phases")
            replies = self._execute(ready)
            for w, ex in enumerate(exchanges):
                try:
                    phases[w] = ex.send(replies[w])
                except StopIteration as stop:
                    phases[w] = None
                    results[w] = stop.value
        return results

    def _execute(self, phases: list[list[Collective]]) -> list[list[Any]]:
        count = len(phases[0])
        if any(len(p) != count for p in phases):
            raise RuntimeError("workers disagree on the number of collectives in a phase")
        replies: list[list[Any]] = [[] for _ in phases]
        for j in range(count):
            ops = [p[j] for p in phases]
            kind, shape = type(ops[0]), ops[0].tensor.shape
            scope = getattr(ops[0], "scope", "world")
            if any(type(op) is not kind or op.tensor.shape != shape
                   or getattr(op, "scope", "world") != scope for op in ops):  # fmt: skip
                raise RuntimeError(
                    f"workers disagree on collective {j}: "
                    f"{[(type(op).__name__, tuple(op.tensor.shape)) for op in ops]}"
                )
            if kind in (AllToAll, AllGather):
                self._scoped(ops, scope, replies, j)
                continue
            sent = collective_bytes(ops[0], self.world_size)
            self.bytes_sent += sent
            self.bytes_by_scope["world"] += sent
            if kind is AllReduce:
                total = torch.stack([op.tensor for op in ops]).sum(dim=0)
                for w, op in enumerate(ops):
                    op.tensor.copy_(total)
                    replies[w].append(op.tensor)
            elif kind is Broadcast:
                broadcasts = cast("list[Broadcast]", ops)  # all of type kind, checked above
                if any(op.src != broadcasts[0].src for op in broadcasts):
                    raise RuntimeError(f"workers disagree on the source of broadcast {j}")
                source = ops[broadcasts[0].src].tensor.clone()
                for w, op in enumerate(ops):
                    op.tensor.copy_(source)
                    replies[w].append(op.tensor)
        return replies

    def _scoped(self, ops: Sequence[Collective], scope: str, replies: list[list[Any]],
                j: int) -> None:  # fmt: skip
        """Run all-to-all or all-gather ``j`` (``ops``, one a worker) within each of
        ``scope``'s groups of workers, appending each worker's result to ``replies``."""
        done: set[int] = set()
        for rank in range(self.world_size):
            if rank in done:
                continue
            members = scope_members(scope, rank, self.world_size, self.local_size)
            done.update(members)
            sent = torch.stack([ops[m].tensor for m in members])
            if isinstance(ops[0], AllToAll) and sent.shape[1:2] != (len(members),):
                raise RuntimeError(f"all-to-all {j} needs a leading dimension of "
                                   f"{len(members)}, got {tuple(ops[0].tensor.shape)}")  # fmt: skip
            for i, m in enumerate(members):
                replies[m].append(sent[:, i].clone() if isinstance(ops[0], AllToAll)
                                  else sent.clone())  # fmt: skip
        nbytes = collective_bytes(ops[0], len(members))
        self.bytes_sent += nbytes
        self.bytes_by_scope[scope] += nbytes


class LocalTransport:
    """One worker, no process group: every collective's result is the worker's own
    tensor (an all-gather's is it with a leading dimension of 1; an all-to-all's, of
    leading dimension 1 already, is it). Nothing is sent."""

    world_size = 1
    #: One worker on one host.
    local_size = 1
    #: This worker's rank: 0, the only one.
    rank = 0
    #: Always 0: a single worker sends nothing.
    bytes_sent = 0.0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The reduction over one worker: ``tensor`` itself."""
        check_op(op)
        return tensor

    def barrier(self) -> None:
        """Nothing to wait for."""

    def run(self, exchange: Exchange[T]) -> T:
        """Run an exchange to completion and return its result."""
        reply: Any = None  # a generator's first send must be None, which send's type forbids
        while True:
            try:
                phase = exchange.send(reply)
            except StopIteration as stop:
                return stop.value
            reply = [op.tensor.unsqueeze(0) if isinstance(op, AllGather) else op.tensor
                     for op in phase]  # fmt: skip

    def run_async(self, exchange: Exchange[T]) -> torch.futures.Future:
        """Run an exchange now and return a completed future of its result."""
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(self.run(exchange))
        return done


class TorchTransport:
    """Runs exchanges over a real ``torch.distributed`` process group (gloo or NCCL).

    With ``local_size`` > 1 (workers a host, ranks of ``group`` host after host) it also
    creates the groups of every host and of every local rank, for scoped collectives
    (:data:`SCOPES`); creating it is then collective over ``group``'s ranks.
    """

    def __init__(self, group: Any = None, local_size: int = 1):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchTransport needs an initialised default process group: "
                "call torch.distributed.init_process_group first"
            )
        # torch >= 2.13 renamed all_gather_into_tensor to all_gather_single
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.group = group
        self.world_size = dist.get_world_size(group)
        #: This process's rank in ``group``.
        self.rank = dist.get_rank(group)
        #: Workers a host (ranks host after host).
        self.local_size = check_local_size(local_size, self.world_size)
        self._scopes = {"world": group}
        if self.local_size > 1:
            self._scopes.update(_scope_groups(group, self.rank, self.world_size, self.local_size))
        #: Bytes this worker has sent so far (ring algorithms).
        self.bytes_sent = 0.0
        #: Of :attr:`bytes_sent`, per scope (:data:`SCOPES`; unscoped collectives: ``"world"``).
        self.bytes_by_scope = dict.fromkeys(SCOPES, 0.0)
        self._lock = threading.Lock()
        self._queue: deque[tuple[Exchange[Any], torch.futures.Future]] = deque()
        self._busy = False
        self._threads = torch.get_num_threads()  # the caller's intra-op threads
        self._reduce_ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` in place over the group (``op`` ``"sum"`` or ``"max"``),
        blocking, outside the queue of exchanges: for measurements (``accordion.calibration``)
        taken while no exchange runs. Not counted in :attr:`bytes_sent`."""
        reduce_op = self._reduce_ops.get(op)
        if reduce_op is None:
            check_op(op)
        dist.all_reduce(tensor, op=reduce_op, group=self.group)
        return tensor

    def barrier(self) -> None:
        """Wait until every rank of the group gets here (for measurements)."""
        dist.barrier(group=self.group)

    def _issue(self, op: Collective) -> tuple[torch.futures.Future, Callable[[], Any]]:
        scope = getattr(op, "scope", "world")  # all-reduces and broadcasts span the world
        group = self._scopes.get(scope)
        if scope not in SCOPES or (group is None and scope != "world"):
            raise ValueError(f"scope must be one of {SCOPES} ('host' and 'peers' with "
                             f"local_size > 1), got {scope!r}")  # fmt: skip
        members = len(scope_members(scope, self.rank, self.world_size, self.local_size))
        sent = collective_bytes(op, members)
        self.bytes_sent += sent
        self.bytes_by_scope[scope] += sent
        if isinstance(op, AllReduce):
            work = dist.all_reduce(op.tensor, group=self.group, async_op=True)
            return work.get_future(), lambda: op.tensor
        if isinstance(op, Broadcast):
            src = dist.get_global_rank(self.group, op.src) if self.group is not None else op.src
            work = dist.broadcast(op.tensor, src=src, group=self.group, async_op=True)
            return work.get_future(), lambda: op.tensor
        if isinstance(op, AllToAll):
            received = torch.empty_like(op.tensor)
            work = dist.all_to_all_single(received, op.tensor.contiguous(), group=group,
                                          async_op=True)  # fmt: skip
            return work.get_future(), lambda: received
        # A flat output is what both the old and the new name of this collective accept.
        flat = op.tensor.new_empty(members * op.tensor.numel())
        # gloo wants the input flat as the output: a [hosts, bytes] payload would be refused
        work = self._all_gather(flat, op.tensor.reshape(-1), group=group, async_op=True)
        return work.get_future(), lambda: flat.view(members, *op.tensor.shape)

    def _issue_phase(self, phase: list[Collective]) -> tuple[list[torch.futures.Future], Callable]:
        """Issue a phase's collectives; all-reduces of one dtype and device share one call.

        Returns the futures and a function giving the per-collective results once they
        are done. Fewer, larger collectives pay the per-message latency once.
        """
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, op in enumerate(phase):
            if isinstance(op, AllReduce):
                groups.setdefault((op.tensor.dtype, op.tensor.device), []).append(i)
        futures, finishers = [], []
        coalesced = set()
        for ix in groups.values():
            if len(ix) < 2:
                continue
            tensors = [phase[i].tensor for i in ix]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            fut, _ = self._issue(AllReduce(flat))
            futures.append(fut)
            finishers.append((tensors, flat))
            coalesced.update(ix)
        singles = {}
        for i, op in enumerate(phase):
            if i not in coalesced:
                fut, result = self._issue(op)
                futures.append(fut)
                singles[i] = result

        def collect() -> list[Any]:
            for tensors, flat in finishers:
                offset = 0
                for t in tensors:
                    t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                    offset += t.numel()
            return [singles[i]() if i in singles else phase[i].tensor for i in range(len(phase))]

        return futures, collect

    def run(self, exchange: Exchange[T]) -> T:
        """Run an exchange to completion, blocking, and return its result.

        It waits its turn behind exchanges already started with :meth:`run_async`. A
        failed collective (the group's timeout, ranks asking for different sizes) raises
        :class:`CollectiveError`, naming the phase; :meth:`run_async`'s future holds it.
        """
        return self.run_async(exchange).wait()

    def run_async(self, exchange: Exchange[T]) -> torch.futures.Future:
        """Start an exchange and return a future of its result.

        Each phase's collectives are issued asynchronously and the next phase runs in
        their completion callback, so nothing blocks the caller (a DDP hook's backward).
        Exchanges run one after another in the order they were started: callbacks fire
        at different times on different ranks, and collectives issued from them in a
        free order would pair up wrongly across ranks (gloo and NCCL match collectives
        by issue order).
        """
        done: torch.futures.Future = torch.futures.Future()
        with self._lock:
            self._threads = torch.get_num_threads()
            self._queue.append((exchange, done))
            if self._busy:
                return done
            self._busy = True
        self._start_next()
        return done

    def _start_next(self) -> None:
        with self._lock:
            if not self._queue:
                self._busy = False
                return
            exchange, done = self._queue.popleft()
        self._drive(exchange, done)

    def _drive(self, exchange: Exchange[Any], done: torch.futures.Future) -> None:
        def finish(value: Any = None, error: BaseException | None = None) -> None:
            self._start_next()  # keep the link busy before running the caller's callbacks
            if error is None:
                done.set_result(value)
            else:
                done.set_exception(error)

        def advance(reply: Any, number: int) -> None:
            # Completion callbacks run on the backend's threads, whose OpenMP pools have
            # the machine's default size: without this, their kernels oversubscribe the
            # cores and reduce in a different order (results not reproducible).
            if torch.get_num_threads() != self._threads:
                torch.set_num_threads(self._threads)
            try:
                phase = exchange.send(reply)
            except StopIteration as stop:
                finish(stop.value)
                return
            except BaseException as exc:  # noqa: BLE001 - the compressor's own error
                finish(error=exc)
                return
            try:
                futures, collect = self._issue_phase(phase)
            except BaseException as exc:  # noqa: BLE001 - surfaced through the future
                finish(error=self._phase_error(number, phase, exc))
                return

            def on_phase_done(fut: torch.futures.Future) -> None:
                try:
                    for each in fut.wait():
                        each.wait()  # raises the collective's error, if any
                    reply = collect()
                except BaseException as exc:  # noqa: BLE001
                    finish(error=self._phase_error(number, phase, exc))
                    return
                advance(reply, number + 1)

            torch.futures.collect_all(futures).then(on_phase_done)

        advance(None, 1)

    def _phase_error(self, number: int, phase: list[Collective], exc: BaseException) -> Exception:
        """``exc`` (a collective's failure: a timeout, ranks asking for different sizes)
        wrapped in an error that says which phase of which rank failed, chained to it.
        A bare gloo or NCCL error names neither, and a hang that ends in a timeout is
        otherwise hard to trace back to the exchange that the ranks disagreed on."""
        try:
            rank = f"rank {dist.get_rank()}"
        except Exception:  # noqa: BLE001 - the group may be gone after a failure
            rank = "this rank"
        error = CollectiveError(
            f"Accordion's exchange phase {number} ({describe_phase(phase)}) failed on "
            f"{rank} (world size {self.world_size}): {exc}"
        )
        error.__cause__ = exc  # the future re-raises this object: keep the chain
        return error


def _scope_groups(group: Any, rank: int, world_size: int, local_size: int) -> dict[str, Any]:
    """This rank's ``"host"`` and ``"peers"`` groups within ``group``, with ``group``'s
    timeout. Each is created by its members alone (``use_local_synchronization``): the
    hosts create theirs side by side, which a ``new_group`` over every rank would pair
    wrongly."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))
    timeout = group_timeout(group)
    return {scope: dist.new_group(
                ranks=[ranks[r] for r in scope_members(scope, rank, world_size, local_size)],
                timeout=timeout, use_local_synchronization=True)
            for scope in ("host", "peers")}  # fmt: skip


class CollectiveError(RuntimeError):
    """A collective of an exchange failed (see :meth:`TorchTransport.run`); the message
    names the phase and the rank, ``__cause__`` is the backend's error."""


def describe_phase(phase: Sequence[Collective]) -> str:
    """A phase in words, per kind of collective: ``"AllReduce of 3 tensors, 1,234
    elements; AllGather of 1 tensor, 10 elements"``."""
    kinds: dict[str, list[int]] = {}
    for op in phase:
        count = kinds.setdefault(type(op).__name__, [0, 0])
        count[0] += 1
        count[1] += op.tensor.numel()
    parts = [f"{kind} of {n} tensor{'' if n == 1 else 's'}, {numel:,} elements"
             for kind, (n, numel) in kinds.items()]  # fmt: skip
    return "; ".join(parts) or "no collectives"


_PRIVATE_GROUPS: dict[tuple[int, tuple[int, ...] | None, timedelta | None], Any] = {}


def group_timeout(process_group: Any = None) -> timedelta | None:
    """The timeout that ``process_group`` (default: the default group) was created with,
    or ``None`` where the backend does not tell.

    ``torch.distributed`` keeps no public record of it: a group's backend (gloo, NCCL)
    carries it in its options (``options._timeout``, torch 2.x).
    """
    group = process_group if process_group is not None else dist.group.WORLD
    if group is None:  # no default group
        return None
    for device in getattr(group, "_device_types", ()):
        try:
            backend = group._get_backend(device)
        except (RuntimeError, ValueError, AttributeError):
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def world_and_rank(group: Any = None) -> tuple[int, int]:
    """``(world size, rank)`` of ``group`` (the default group by default); ``(1, 0)``
    when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_op(op: Any) -> str:
    """``op`` if it names a reduction of :meth:`TorchTransport.all_reduce`, else
    ``ValueError`` (``TypeError`` for a non-str)."""
    return check_choice("op", op, ("sum", "max"))


def check_process_group(group: Any) -> Any:
    """``group`` if it is ``None`` or a ``ProcessGroup``; else a ``TypeError`` now rather
    than a bare ``KeyError`` at the first backward."""
    if group is None or (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        return group
    raise TypeError(
        "process_group must be None (the default group) or a "
        f"torch.distributed.ProcessGroup (e.g. from dist.new_group), got "
        f"{type(group).__name__} {group!r:.60}"
    )


def check_timeout(timeout: Any) -> timedelta | None:
    """``timeout`` if it is ``None`` or a positive ``datetime.timedelta``; else
    ``TypeError`` or ``ValueError``."""
    if timeout is None:
        return None
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta or None, got {timeout!r}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return timeout


def group_transport(process_group: Any = None) -> TorchTransport | LocalTransport:
    """A :class:`TorchTransport` over ``process_group`` itself (the default group for
    ``None``), or a :class:`LocalTransport` when no process group is initialised."""
    if dist.is_available() and dist.is_initialized():
        return TorchTransport(process_group)
    return LocalTransport()


def open_transport(
    process_group: Any = None, timeout: timedelta | None = None, local_size: int | str = 1
) -> TorchTransport | LocalTransport:
    """Accordion's transport over the ranks of ``process_group``: a :class:`TorchTransport`
    on a :func:`private_group` of them, ``local_size`` workers a host (``"auto"``:
    :func:`workers_per_host`; collective: every rank must get here at the same point), or
    a :class:`LocalTransport` when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return LocalTransport()
    # A private copy of the group: the hook's phases are issued from completion
    # callbacks, and on a shared group they could pair up wrongly with collectives that
    # DDP (e.g. find_unused_parameters) or the loop issue. It inherits the group's
    # timeout (or ``timeout``), so that a rank that disagrees raises after it instead of
    # blocking for 30 minutes.
    local = workers_per_host(local_size, process_group)
    return TorchTransport(private_group(process_group, timeout), local)


def private_group(process_group: Any, timeout: timedelta | None = None) -> Any:
    """A process group with the ranks of ``process_group``, used only by Accordion.

    Its collectives time out after ``timeout``, by default ``process_group``'s own (the
    default group's, for ``None``): ``new_group`` would otherwise give it the backend's
    default (30 minutes for gloo), and a rank that disagrees would block the others for
    that long, whatever timeout the job set. Created once per set of ranks and timeout.
    A copy of the default group is created by every rank; a copy of a smaller group by its
    members alone (``use_local_synchronization``): ranks 0 and 2 may create ``{0, 2}``'s
    while ranks 1 and 3 create ``{1, 3}``'s, as the states of DiLoCo's replicas do, which
    a ``new_group`` collective over every rank would pair wrongly (the ranks hang).
    """
    if timeout is None:
        timeout = group_timeout(process_group)
    ranks = None
    if process_group is not None:
        ranks = tuple(dist.get_process_group_ranks(process_group))
    # keyed by the default group too: a re-initialised job must not reuse stale groups
    key = (id(dist.group.WORLD), ranks, timeout)
    group = _PRIVATE_GROUPS.get(key)
    if group is None:
        members = list(ranks) if ranks is not None else None
        local = members is not None and len(members) < dist.get_world_size()
        group = dist.new_group(ranks=members, timeout=timeout, use_local_synchronization=local)
        _PRIVATE_GROUPS[key] = group
    return group
