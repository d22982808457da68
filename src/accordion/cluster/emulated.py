"""An emulated multi-host cluster on one Linux machine: network namespaces and shaped links.

:class:`EmulatedCluster` builds ``hosts`` network namespaces, one per emulated host, and one
"switch" namespace holding a Linux bridge. Host ``i`` sees one interface, ``eth0``, with
address ``<subnet>.<i+1>/24``, the end of a veth pair whose other end is a port of the
bridge. Each host's link is limited in both directions with ``tc``: a token bucket
(``tbf``) at the link rate on the host's ``eth0`` (its upload) and on the bridge port (its
download), plus ``netem`` for the latency when one is asked for. Nothing is created in the
root namespace, so the machine's own networking is untouched.

:meth:`EmulatedCluster.run` starts one ``torchrun`` node per host (``--nnodes=hosts``,
one process per node, c10d rendezvous at host 0) with ``GLOO_SOCKET_IFNAME=eth0`` so that
gloo's traffic goes over the emulated links::

    with EmulatedCluster(hosts=2, bandwidth="100mbit") as cluster:
        print(cluster.measure_bandwidth())
        result = cluster.run("accordion", ["train", "--task", "mnist1d", "--epochs", "2"])
        print(result.stdout)

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and the ``ip`` and ``tc`` tools (iproute2).
The rate is what ``tbf`` counts: Ethernet frames without preamble or inter-frame gap, so
TCP payload moves at about 95% of it with a 1500-byte MTU.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import gzip
import json
import math
import numbers
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..costmodel import parse_bandwidth, parse_latency

NAMESPACE_PREFIX = "acc-"
"""Every namespace an :class:`EmulatedCluster` creates is named ``acc-<tag>-...``."""

MAX_HOSTS = 64
MIN_RATE_BITS = 8_000  # 1 kB/s: below it nothing useful runs
MAX_RATE_BITS = 100_000_000_000  # 100 Gbit/s; one CPU moves far less through veths anyway
MAX_DELAY_S = 10.0

_TOOL_PATH = "/usr/sbin:/sbin:/usr/bin:/bin:/usr/local/sbin:/usr/local/bin"
_COMMAND_TIMEOUT_S = 30.0
_MIN_BURST = 2 * 65536  # two 64 KiB GSO packets: tbf would split or drop larger packets
_MTU_FRAME = 1514  # bytes a full-size frame counts for in tbf (MTU + Ethernet header)
_TAG = re.compile(r"^[a-z0-9]{1,16}$")


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built here: not root, no ``ip``/``tc``, no namespaces,
    or a missing kernel feature. The message says what is needed."""


class ClusterRunError(RuntimeError):
    """A host of a :meth:`EmulatedCluster.run` exited with a non-zero status."""

    def __init__(self, message: str, result: ClusterRun) -> None:
        super().__init__(message)
        self.result = result


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


def _tool(name: str) -> str | None:
    # sbin is often missing from a non-login PATH although ip and tc live there
    return shutil.which(name) or shutil.which(name, path=_TOOL_PATH)


def check_requirements() -> tuple[str, str]:
    """Return the paths of ``ip`` and ``tc``; raise :class:`ClusterError` when this process
    is not root or either tool is missing."""
    if os.geteuid() != 0:
        raise ClusterError(
            "an emulated cluster needs root (network namespaces and tc need CAP_SYS_ADMIN "
            f"and CAP_NET_ADMIN); this process runs as uid {os.geteuid()}: run it with sudo "
            "or as root"
        )
    ip, tc = _tool("ip"), _tool("tc")
    missing = [name for name, path in (("ip", ip), ("tc", tc)) if path is None]
    if missing:
        raise ClusterError(
            f"an emulated cluster needs the {' and '.join(missing)} command"
            f"{'s' if len(missing) > 1 else ''} of iproute2, not found on PATH or in "
            "/usr/sbin, /sbin (install iproute2, e.g. apt-get install iproute2)"
        )
    assert ip is not None and tc is not None
    return ip, tc


def _kernel_hz() -> int:
    """CONFIG_HZ of the running kernel when its config is readable, else 100 (the least)."""
    release = os.uname().release
    for path, opener in (("/proc/config.gz", gzip.open), (f"/boot/config-{release}", open)):
        try:
            with opener(path, "rt") as f:
                match = re.search(r"^CONFIG_HZ=(\d+)$", f.read(), re.MULTILINE)
        except OSError:
            continue
        if match:
            return int(match.group(1))
    return 100


def tbf_parameters(rate_bytes: float, hz: int | None = None) -> tuple[int, int, int]:
    """``(rate in bit/s, burst in bytes, limit in bytes)`` for a ``tbf`` at ``rate_bytes``
    bytes/s: the bucket holds at least one timer tick of traffic (rate/HZ) and two 64 KiB
    GSO packets; the queue holds the bucket plus 50 ms at the rate (at least 1 MiB) so
    that TCP is slowed by queueing rather than drops."""
    hz = _kernel_hz() if hz is None else hz
    rate_bits = round(rate_bytes * 8)
    burst = max(math.ceil(rate_bytes / hz), _MIN_BURST)
    limit = burst + max(math.ceil(rate_bytes * 0.05), 1 << 20)
    return rate_bits, burst, limit


def _check_bandwidth(bandwidth: Any) -> float:
    if not isinstance(bandwidth, str):
        raise TypeError(f"bandwidth must be a str such as '100mbit', got {bandwidth!r}")
    try:
        rate = parse_bandwidth(bandwidth)
    except ValueError as exc:
        raise ValueError(f"bandwidth {bandwidth!r} is not a link rate: {exc}") from None
    if not MIN_RATE_BITS <= rate * 8 <= MAX_RATE_BITS:
        raise ValueError(
            f"bandwidth must be between 8kbit and 100gbit, got {bandwidth!r} ({rate * 8:g} bit/s)"
        )
    return rate


def _check_delay(delay: Any) -> float:
    if not isinstance(delay, str):
        raise TypeError(f"delay must be a str such as '1ms' or '0', got {delay!r}")
    try:
        seconds = parse_latency(delay)
    except ValueError as exc:
        raise ValueError(f"delay {delay!r} is not a latency: {exc}") from None
    if seconds != 0 and not 2e-6 <= seconds <= MAX_DELAY_S:
        raise ValueError(
            f"delay must be '0' or between 2us and {MAX_DELAY_S:g}s (netem's resolution is "
            f"1us and the delay is split over two hops), got {delay!r}"
        )
    return seconds


def _check_subnet(subnet: Any) -> str:
    if not isinstance(subnet, str):
        raise TypeError(f"subnet must be a str of three octets such as '10.213.0', got {subnet!r}")
    parts = subnet.split(".")
    if len(parts) != 3 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
        raise ValueError(
            f"subnet must be three octets 0-255 such as '10.213.0' (hosts get .1, .2, ...), "
            f"got {subnet!r}"
        )
    return ".".join(str(int(p)) for p in parts)


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


def list_namespaces() -> list[str]:
    """Names of the network namespaces that ``ip netns`` knows (any prefix)."""
    ip = _tool("ip")
    if ip is None:
        return []
    proc = subprocess.run(
        [ip, "netns", "list"], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S
    )
    # lines read "name" or "name (id: 3)"
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _namespace_pids(ip: str, namespace: str) -> list[int]:
    proc = subprocess.run(
        [ip, "netns", "pids", namespace], capture_output=True, text=True,
        timeout=_COMMAND_TIMEOUT_S,
    )  # fmt: skip
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_namespaces(
    ip: str, namespaces: Sequence[str], procs: Sequence[subprocess.Popen] = ()
) -> None:
    """SIGTERM the process groups of ``procs`` and every process in ``namespaces``, then
    SIGKILL what is left after 2 s. torchrun starts its workers in sessions of their own,
    so killing a process group misses them; ``ip netns pids`` finds every process by its
    namespace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                _signal(proc.pid, sig, group=True)
        for pid in [pid for ns in namespaces for pid in _namespace_pids(ip, ns)]:
            _signal(pid, sig)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            # poll() reaps our children: an unreaped zombie would look alive to a signal 0
            if all(p.poll() is not None for p in procs) and not any(
                _namespace_pids(ip, ns) for ns in namespaces
            ):
                return
            time.sleep(0.05)


def remove_leftovers(prefix: str = NAMESPACE_PREFIX) -> list[str]:
    """Kill the processes in, and delete, every network namespace whose name starts with
    ``prefix`` (default ``acc-``: those of crashed or killed clusters); return their names.
    ``prefix`` must start with ``acc-`` so that no one else's namespaces are touched."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str starting with {NAMESPACE_PREFIX!r}, got {prefix!r}")
    if not prefix.startswith(NAMESPACE_PREFIX):
        raise ValueError(f"prefix must start with {NAMESPACE_PREFIX!r}, got {prefix!r}")
    ip, _ = check_requirements()
    names = [name for name in list_namespaces() if name.startswith(prefix)]
    _kill_namespaces(ip, names)
    for name in names:
        subprocess.run([ip, "netns", "del", name], capture_output=True, timeout=_COMMAND_TIMEOUT_S)
    return names


class EmulatedCluster:
    """``hosts`` emulated hosts joined by a switch over links of ``bandwidth`` each way.

    Args:
        hosts: number of hosts, 2 to 64.
        bandwidth: each host's link rate in each direction, e.g. ``"100mbit"``, ``"1gbit"``
            or ``"12.5MB/s"`` (see :func:`accordion.costmodel.parse_bandwidth`).
        delay: one-way host-to-host latency, e.g. ``"1ms"`` or ``"0"`` (none); half of it
            is added on each of the two hops (sender's uplink, receiver's downlink).
            Needs the kernel's ``netem`` qdisc.
        name: tag of the namespace names ``acc-<name>-h<i>`` and ``acc-<name>-sw``
            (lowercase letters and digits, at most 16); default a random one.
        subnet: first three octets of the hosts' addresses; host ``i`` gets
            ``<subnet>.<i+1>``. The addresses exist only inside the cluster's namespaces.

    The constructor only checks its arguments (``TypeError``/``ValueError``); entering the
    context builds the cluster (:class:`ClusterError` when that is impossible here) and
    leaving it tears everything down, also on exceptions, Ctrl-C and SIGTERM.
    """

    def __init__(
        self,
        hosts: int,
        bandwidth: str,
        delay: str = "0",
        name: str | None = None,
        subnet: str = "10.213.0",
    ) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, numbers.Integral):
            raise TypeError(f"hosts must be an int from 2 to {MAX_HOSTS}, got {hosts!r}")
        if not 2 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be an int from 2 to {MAX_HOSTS}, got {hosts!r}")
        self.hosts = int(hosts)
        self.bandwidth = _check_bandwidth(bandwidth)
        self.delay = _check_delay(delay)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {name!r}")
        if name is not None and not _TAG.match(name):
            raise ValueError(f"name must be 1 to 16 lowercase letters or digits, got {name!r}")
        self.subnet = _check_subnet(subnet)
        self._random_tag = name is None
        self.tag = name or secrets.token_hex(3)
        self._ip = self._tc = ""
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._runs = 0
        self._netem: bool | None = None
        self._previous_sigterm: Any = None
        self._sigterm_installed = False
        self._atexit_registered = False

    # ------------------------------------------------------------------------ names

    @property
    def prefix(self) -> str:
        """Start of the names of every namespace of this cluster, ``acc-<tag>-``."""
        return f"{NAMESPACE_PREFIX}{self.tag}-"

    @property
    def switch_namespace(self) -> str:
        """Namespace of the bridge."""
        return f"{self.prefix}sw"

    @property
    def host_namespaces(self) -> list[str]:
        """Namespace of each host, host 0 first."""
        return [f"{self.prefix}h{i}" for i in range(self.hosts)]

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this cluster: the hosts', then the switch's."""
        return [*self.host_namespaces, self.switch_namespace]

    @property
    def addresses(self) -> list[str]:
        """IPv4 address of each host's ``eth0``."""
        return [f"{self.subnet}.{i + 1}" for i in range(self.hosts)]

    # -------------------------------------------------------------------- lifecycle

    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Build the namespaces, bridge, links and shaping; on failure undo what was built
        and raise :class:`ClusterError`."""
        if self._created:
            raise ClusterError(f"cluster {self.tag} is already started")
        self._ip, self._tc = check_requirements()
        if self._random_tag:
            existing = list_namespaces()
            while any(n.startswith(self.prefix) for n in existing):
                self.tag = secrets.token_hex(3)
        self._install_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for namespace in [self.switch_namespace, *self.host_namespaces]:
            proc = subprocess.run(
                [self._ip, "netns", "add", namespace], capture_output=True, text=True,
                timeout=_COMMAND_TIMEOUT_S,
            )  # fmt: skip
            if proc.returncode != 0:
                raise ClusterError(
                    f"cannot create network namespace {namespace}: {proc.stderr.strip()}; "
                    "an emulated cluster needs CAP_SYS_ADMIN and CAP_NET_ADMIN (root on the "
                    "machine, or a privileged container)"
                )
            self._created.append(namespace)
        sw = self.switch_namespace
        self._ipcmd(sw, "link", "set", "lo", "up")
        self._ipcmd(sw, "link", "add", "br0", "type", "bridge")
        self._ipcmd(sw, "link", "set", "br0", "up")
        for i, (namespace, address) in enumerate(zip(self.host_namespaces, self.addresses)):
            port = f"h{i}"
            # created inside the host namespace with its peer put straight into the
            # switch's: no interface ever exists in the root namespace
            self._ipcmd(
                namespace, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                "netns", sw,
            )  # fmt: skip
            self._ipcmd(namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            self._ipcmd(namespace, "link", "set", "lo", "up")
            self._ipcmd(namespace, "link", "set", "eth0", "up")
            self._ipcmd(sw, "link", "set", port, "master", "br0")
            self._ipcmd(sw, "link", "set", port, "up")
        self._shape()

    def close(self) -> None:
        """Kill every process started in the cluster and delete its namespaces (which
        deletes the veths and the bridge). Idempotent; never raises for things already
        gone. Ctrl-C and SIGTERM are held back until it is done."""
        blocked = {signal.SIGINT, signal.SIGTERM}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            # each step goes on whatever the one before met: teardown must not stop halfway
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                if self._ip and (self._created or self._procs):
                    _kill_namespaces(self._ip, self._created, self._procs)
            for proc in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            self._procs = []
            for namespace in reversed(self._created):
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run(
                        [self._ip, "netns", "del", namespace], capture_output=True,
                        timeout=_COMMAND_TIMEOUT_S,
                    )  # fmt: skip
            self._created = []
        finally:
            self._restore_handlers()
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _install_handlers(self) -> None:
        if not self._atexit_registered:
            atexit.register(self.close)
            self._atexit_registered = True
        # Python's default for SIGTERM ends the process without unwinding, which would
        # leave the namespaces behind; raising SystemExit unwinds through __exit__
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
            self._sigterm_installed = True

    def _restore_handlers(self) -> None:
        if self._sigterm_installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._sigterm_installed = False
        if self._atexit_registered:
            atexit.unregister(self.close)
            self._atexit_registered = False

    # ------------------------------------------------------------------ shaping

    def _command(self, argv: list[str]) -> None:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
        if proc.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")

    def _ipcmd(self, namespace: str, *args: str) -> None:
        self._command([self._ip, "-n", namespace, *args])

    def _has_netem(self) -> bool:
        if self._netem is None:
            # try it on the switch's loopback: a failure there changes no link
            sw = self.switch_namespace
            proc = subprocess.run(
                [self._tc, "-n", sw, "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                 "1ms"],
                capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S,
            )  # fmt: skip
            self._netem = proc.returncode == 0
            if self._netem:
                self._command([self._tc, "-n", sw, "qdisc", "del", "dev", "lo", "root"])
        return self._netem

    def _links(self) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of every host's link."""
        ends = [(ns, "eth0") for ns in self.host_namespaces]
        return ends + [(self.switch_namespace, f"h{i}") for i in range(self.hosts)]

    def set_link(self, bandwidth: str, delay: str = "0") -> None:
        """Change every host's link to ``bandwidth`` each way and ``delay`` one-way
        host-to-host latency (same syntax as the constructor's). Raises
        :class:`ClusterError` if the cluster is not started, or if a delay is asked for
        and the kernel has no ``netem``; the links are unchanged then."""
        rate = _check_bandwidth(bandwidth)
        seconds = _check_delay(delay)
        if not self._created:
            raise ClusterError(f"cluster {self.tag} is not started (use it as a context manager)")
        self.bandwidth, self.delay = rate, seconds
        self._shape()

    def _shape(self) -> None:
        if self.delay > 0 and not self._has_netem():
            raise ClusterError(
                "a link delay needs the netem qdisc, which this kernel lacks "
                "(CONFIG_NET_SCH_NETEM, module sch_netem: try modprobe sch_netem); "
                "use delay '0' here"
            )
        rate_bits, burst, limit = tbf_parameters(self.bandwidth)
        tbf = ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "limit", str(limit)]
        hop_us = round(self.delay / 2 * 1e6)
        # netem holds every packet of one delay's worth of traffic, counted in packets
        netem_limit = 1000 + 2 * math.ceil(self.bandwidth * self.delay / 2 / _MTU_FRAME)
        for namespace, device in self._links():
            base = [self._tc, "-n", namespace, "qdisc"]
            # a veth starts with the noqueue root, which cannot be deleted: ignore that
            subprocess.run(
                [*base, "del", "dev", device, "root"], capture_output=True,
                timeout=_COMMAND_TIMEOUT_S,
            )  # fmt: skip
            if hop_us > 0:
                # the netem wiki's order: netem delays, its child tbf sets the rate
                self._command(
                    [*base, "add", "dev", device, "root", "handle", "1:", "netem", "delay",
                     f"{hop_us}us", "limit", str(netem_limit)]
                )  # fmt: skip
                self._command([*base, "add", "dev", device, "parent", "1:1", "handle", "10:",
                               *tbf])  # fmt: skip
            else:
                self._command([*base, "add", "dev", device, "root", "handle", "1:", *tbf])

    # ----------------------------------------------------------------------- runs

    def environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment of the processes :meth:`run` starts: this process's, then ``env``,
        with ``GLOO_SOCKET_IFNAME=eth0``, ``OMP_NUM_THREADS`` = cores // hosts (at least
        1) unless set, ``CUDA_VISIBLE_DEVICES`` empty unless set (NCCL would bypass the
        emulated links between processes of one machine) and this ``accordion``'s source
        directory first on ``PYTHONPATH``."""
        result = {**os.environ, **(env or {})}
        result["GLOO_SOCKET_IFNAME"] = "eth0"
        result.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.hosts)))
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
        if not 0 <= host < self.hosts:
            raise ValueError(f"host must be from 0 to {self.hosts - 1}, got {host!r}")
        return [
            self._ip or _tool("ip") or "ip", "netns", "exec", self.host_namespaces[host],
            python or sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.hosts}", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.addresses[0]}:{port}", f"--rdzv-id={run_id}",
            # torchrun guesses whether it hosts the rendezvous from the hostname, which
            # every namespace shares: say it, and which address to advertise
            f"--rdzv-conf=is_host={'true' if host == 0 else 'false'}",
            f"--local-addr={self.addresses[host]}", "--max-restarts=0",
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
        run_id = f"{self.tag}-{self._runs}"
        environment = self.environment(env)
        directory, temporary = _log_directory(log_dir)
        start = time.monotonic()
        procs: list[subprocess.Popen] = []
        try:
            for host in range(self.hosts):
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

    def _failure(self, target: str, result: ClusterRun, directory: Path) -> str:
        """The message of a run whose host ``result.failed_host`` failed first."""
        first, codes = result.failed_host, result.returncodes
        assert first is not None
        return (
            f"host {first} ({self.host_namespaces[first]}) of {target} exited with "
            f"status {codes[first]}, and the other hosts were stopped (exit statuses: "
            f"{codes}); the end of its stderr:\n"
            + _failure_excerpt(_read(directory / f"host{first}.err"))
        )

    def _check_run(self, target: Any, args: Any, timeout: Any) -> None:
        """Raise for a cluster not started or for bad arguments of :meth:`run`."""
        if not self._created:
            raise ClusterError(f"cluster {self.tag} is not started (use it as a context manager)")
        if not isinstance(target, str) or not target:
            raise TypeError(f"target must be a non-empty str, got {target!r}")
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise TypeError(f"args must be a sequence of str, got {args!r}")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0
        ):
            raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")

    def _start_host(
        self, host: int, command: list[str], directory: Path, environment: Mapping[str, str]
    ) -> subprocess.Popen:
        """Start host ``host``'s node with its output in ``directory``; :meth:`close`
        kills it should the run not."""
        with (
            open(directory / f"host{host}.out", "wb") as out,
            open(directory / f"host{host}.err", "wb") as err,
        ):
            proc = subprocess.Popen(
                command, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                env=environment, start_new_session=True,
            )  # fmt: skip
        self._procs.append(proc)
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
        _kill_namespaces(self._ip, self.host_namespaces, procs)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._procs = [p for p in self._procs if p.poll() is None]

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


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
