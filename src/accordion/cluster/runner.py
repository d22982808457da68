"""Running a command on every host of an emulated network: one torchrun node per host.

:class:`TorchrunRunner` starts one ``torchrun`` node per host of an
:class:`~accordion.cluster.network.EmulatedNetwork` (``--nnodes=hosts``, one process per
node, c10d rendezvous at host 0) with ``GLOO_SOCKET_IFNAME=eth0`` so that gloo's traffic
goes over the emulated links; it waits for them, kills them all on the first failure or
past a timeout, and copies host 0's output as it comes. Its outcome is a
:class:`ClusterRun`, or a :class:`ClusterRunError` that quotes the failed host's stderr.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import numbers
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .._validate import check_int
from .namespaces import ClusterError, find_tool, kill_namespaces
from .network import EmulatedNetwork


@dataclass
class ClusterRun:
    """What :meth:`EmulatedCluster.run` returns.

    ``returncodes[i]`` is host ``i``'s exit status (negative: killed by that signal);
    ``stdout`` and ``stderr`` are host 0's output; ``log_dir`` holds ``host<i>.out`` and
    ``host<i>.err`` for every host when a log directory was given (else ``None``);
    ``seconds`` is the wall time of the run; ``failed_host`` is the host that failed first
    (the others were stopped after it), ``None`` when every host succeeded.
    """

    returncodes: list[int]
    stdout: str
    stderr: str
    seconds: float
    log_dir: Path | None
    failed_host: int | None = None


class ClusterRunError(RuntimeError):
    """A host of a :meth:`EmulatedCluster.run` exited with a non-zero status."""

    def __init__(self, message: str, result: ClusterRun) -> None:
        super().__init__(message)
        self.result = result


def _tail(text: str, lines: int = 30, chars: int = 4000) -> str:
    return "\n".join(text.splitlines()[-lines:])[-chars:]


# torchrun's log line when a worker fails; after it come torchrun's own traceback and a
# summary, which would push the worker's error out of a short tail
_TORCHRUN_FAILED = re.compile(r"^E\d{4} .*failed \(exitcode: (-?\d+)\)", re.MULTILINE)


def _failure_excerpt(stderr: str) -> str:
    """The end of a failed host's stderr: the worker's part when torchrun's failure report
    can be found in it, else the whole tail."""
    match = _TORCHRUN_FAILED.search(stderr)
    if match is None:
        return _tail(stderr)
    return _tail(stderr[: match.start()]) + f"\n(torchrun: the worker exited with {match[1]})"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _log_directory(
    log_dir: str | os.PathLike[str] | None,
) -> tuple[Path, tempfile.TemporaryDirectory[str] | None]:
    """The directory of a run's logs (created), and the temporary directory that holds it
    when no ``log_dir`` is given (the caller cleans it up), else ``None``."""
    temporary = None
    if log_dir is None:
        temporary = tempfile.TemporaryDirectory(prefix="accordion-cluster-")
        directory = Path(temporary.name)
    else:
        directory = Path(log_dir)
    directory.mkdir(parents=True, exist_ok=True)
    return directory, temporary


def _pump(echoes: list[tuple[Any, TextIO, Any]]) -> None:
    for source, sink, decoder in echoes:
        # an incremental decoder: a read may end inside a multi-byte character
        text = decoder.decode(source.read())
        if text:
            sink.write(text)
            sink.flush()


class TorchrunRunner:
    """Runs commands as torchrun jobs over the hosts of ``network``, one node per host.

    ``processes`` are the host processes started and not yet seen to end: whoever tears
    the network down kills and reaps them (:meth:`EmulatedNetwork.close` takes them).
    """

    def __init__(self, network: EmulatedNetwork, workers_per_host: int = 1) -> None:
        self.network = network
        #: Processes a host runs (torchrun's ``--nproc-per-node``): they share its link,
        #: and talk to each other without crossing it.
        self.workers_per_host = check_int("workers_per_host", workers_per_host, 1)
        self.processes: list[subprocess.Popen] = []
        self._runs = 0

    def environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment of the processes :meth:`run` starts: this process's, then ``env``,
        with ``GLOO_SOCKET_IFNAME=eth0``, ``OMP_NUM_THREADS`` = cores // workers (at least
        1) unless set, ``CUDA_VISIBLE_DEVICES`` empty unless set (NCCL would bypass the
        emulated links between processes of one machine) and this ``accordion``'s source
        directory first on ``PYTHONPATH``."""
        result = {**os.environ, **(env or {})}
        result["GLOO_SOCKET_IFNAME"] = "eth0"
        workers = self.network.hosts * self.workers_per_host
        result.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        result.setdefault("CUDA_VISIBLE_DEVICES", "")
        source = str(Path(__file__).resolve().parents[2])
        paths = [p for p in result.get("PYTHONPATH", "").split(os.pathsep) if p]
        result["PYTHONPATH"] = os.pathsep.join([source, *(p for p in paths if p != source)])
        return result

    def torchrun_command(
        self, host: int, target: str, args: Sequence[str] = (), *, module: bool = True,
        port: int = 29400, run_id: str = "accordion", python: str | None = None,
    ) -> list[str]:  # fmt: skip
        """The command line that runs host ``host``'s torchrun node of ``target`` (a module
        with ``module=True``, else a script path) with ``args``."""
        network = self.network
        if not 0 <= host < network.hosts:
            raise ValueError(f"host must be from 0 to {network.hosts - 1}, got {host!r}")
        addresses = network.addresses
        return [
            network.ip or find_tool("ip") or "ip", "netns", "exec",
            network.host_namespaces[host],
            python or sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={network.hosts}", f"--nproc-per-node={self.workers_per_host}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={addresses[0]}:{port}", f"--rdzv-id={run_id}",
            # torchrun guesses whether it hosts the rendezvous from the hostname, which
            # every namespace shares: say it, and which address to advertise
            f"--rdzv-conf=is_host={'true' if host == 0 else 'false'}",
            f"--local-addr={addresses[host]}", "--max-restarts=0",
            *(["-m", target] if module else [target]), *args,
        ]  # fmt: skip

    def run(
        self,
        target: str,
        args: Sequence[str] = (),
        *,
        module: bool = True,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        check: bool = True,
        echo: bool = False,
        python: str | None = None,
    ) -> ClusterRun:
        """Run ``target`` (a module, or a script path with ``module=False``) with ``args``
        on every host as one node each of a torchrun job; wait for all of them.

        Host ``i``'s stdout and stderr go to ``host<i>.out`` / ``host<i>.err`` in
        ``log_dir`` (a temporary directory, removed afterwards, when ``None``); with
        ``echo`` host 0's are copied to this process's stdout and stderr as they come.
        As soon as one host fails the others are killed; then, with ``check``,
        :class:`ClusterRunError` (a RuntimeError) names it and quotes its stderr's tail.
        After ``timeout`` seconds every host's processes are killed and ``TimeoutError``
        is raised.
        """
        self._check_run(target, args, timeout)
        self._runs += 1
        # a fresh port and id per run: the previous run's sockets may linger in TIME_WAIT
        port = 29400 + self._runs % 1000
        run_id = f"{self.network.tag}-{self._runs}"
        environment = self.environment(env)
        directory, temporary = _log_directory(log_dir)
        start = time.monotonic()
        procs: list[subprocess.Popen] = []
        try:
            for host in range(self.network.hosts):
                command = self.torchrun_command(
                    host, target, args, module=module, port=port, run_id=run_id, python=python
                )
                procs.append(self._start_host(host, command, directory, environment))
            codes, first = self._wait(procs, directory, timeout, echo, start)
            result = ClusterRun(
                returncodes=codes,
                stdout=_read(directory / "host0.out"),
                stderr=_read(directory / "host0.err"),
                seconds=time.monotonic() - start,
                log_dir=None if temporary else directory,
                failed_host=first,
            )
            if check and first is not None:
                raise ClusterRunError(self._failure(target, result, directory), result)
            return result
        finally:
            self._stop(procs)
            if temporary:
                temporary.cleanup()

    def measure_bandwidth(
        self, mbytes: float = 4.0, repeats: int = 3, timeout: float | None = 120.0
    ) -> dict[str, Any]:
        """Run :mod:`accordion.cluster.netprobe` on every host and return its result:
        ``world_size``, ``bytes``, ``seconds`` (median all-reduce time) and
        ``bus_bandwidth_bytes_per_s`` (bytes/s, comparable with the link rate)."""
        result = self.run(
            "accordion.cluster.netprobe",
            ["--mbytes", str(mbytes), "--repeats", str(repeats)],
            timeout=timeout,
        )
        for line in reversed(result.stdout.splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(
            f"the bandwidth probe printed no result; host 0's stdout:\n{_tail(result.stdout)}"
        )

    def _failure(self, target: str, result: ClusterRun, directory: Path) -> str:
        """The message of a run whose host ``result.failed_host`` failed first."""
        first, codes = result.failed_host, result.returncodes
        assert first is not None
        return (
            f"host {first} ({self.network.host_namespaces[first]}) of {target} exited with "
            f"status {codes[first]}, and the other hosts were stopped (exit statuses: "
            f"{codes}); the end of its stderr:\n"
            + _failure_excerpt(_read(directory / f"host{first}.err"))
        )

    def _check_run(self, target: Any, args: Any, timeout: Any) -> None:
        """Raise for a network not started or for bad arguments of :meth:`run`."""
        if not self.network.started:
            raise ClusterError(
                f"cluster {self.network.tag} is not started (use it as a context manager)"
            )
        if not isinstance(target, str) or not target:
            raise TypeError(f"target must be a non-empty str, got {target!r}")
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise TypeError(f"args must be a sequence of str, got {args!r}")
        # not check_number: it would refuse an infinite timeout, which waits for ever here
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
            or not float(timeout) > 0
        ):
            raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")

    def _start_host(
        self, host: int, command: list[str], directory: Path, environment: Mapping[str, str]
    ) -> subprocess.Popen:
        """Start host ``host``'s node with its output in ``directory``; it joins
        :attr:`processes`, for the teardown to kill should the run not."""
        with (
            open(directory / f"host{host}.out", "wb") as out,
            open(directory / f"host{host}.err", "wb") as err,
        ):
            proc = subprocess.Popen(
                command, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                env=environment, start_new_session=True,
            )  # fmt: skip
        self.processes.append(proc)
        return proc

    def _wait(
        self, procs: list[subprocess.Popen], directory: Path, timeout: float | None,
        echo: bool, start: float,
    ) -> tuple[list[int], int | None]:  # fmt: skip
        """Wait for every host, or for the first failure (then stop the others); return the
        exit statuses and the host that failed first (``None`` if none did)."""
        echoes = []
        decoder = codecs.getincrementaldecoder("utf-8")
        if echo:
            echoes = [
                (open(directory / f"host0.{kind}", "rb"), sink, decoder("replace"))
                for kind, sink in (("out", sys.stdout), ("err", sys.stderr))
            ]
        try:
            first_failure: int | None = None
            while True:
                codes = [p.poll() for p in procs]
                _pump(echoes)
                if first_failure is None:
                    first_failure = next(
                        (i for i, c in enumerate(codes) if c is not None and c != 0), None
                    )
                if first_failure is not None or all(c is not None for c in codes):
                    break
                if timeout is not None and time.monotonic() - start > timeout:
                    self._stop(procs)
                    raise TimeoutError(
                        f"the cluster run did not finish within {timeout:g} s; all hosts' "
                        "processes were killed. The end of host 0's stderr:\n"
                        + _tail(_read(directory / "host0.err"))
                    )
                time.sleep(0.05)
            if first_failure is not None:
                self._stop(procs)
            _pump(echoes)
            # torchrun exits 1 on SIGTERM too: only the order tells the cause from the rest
            return [p.wait() for p in procs], first_failure
        finally:
            for f, _, _ in echoes:
                f.close()

    def _stop(self, procs: list[subprocess.Popen]) -> None:
        """Kill what is left of ``procs`` and every other process in the host namespaces."""
        kill_namespaces(self.network.ip, self.network.host_namespaces, procs)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.processes = [p for p in self.processes if p.poll() is None]
