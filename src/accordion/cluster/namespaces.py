"""What this machine offers an emulated cluster: root, iproute2, and network namespaces.

The plumbing that both the network (:mod:`accordion.cluster.network`) and the runner
(:mod:`accordion.cluster.runner`) stand on: the requirement check, the list of namespaces
``ip netns`` knows, the processes inside a namespace, and killing them. Nothing here
creates a namespace.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

NAMESPACE_PREFIX = "acc-"
"""Every namespace an :class:`EmulatedCluster` creates is named ``acc-<tag>-...``."""

COMMAND_TIMEOUT_S = 30.0
"""Seconds one ``ip`` or ``tc`` command may take before it counts as hung."""

_TOOL_PATH = "/usr/sbin:/sbin:/usr/bin:/bin:/usr/local/sbin:/usr/local/bin"


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built here: not root, no ``ip``/``tc``, no namespaces,
    or a missing kernel feature. The message says what is needed."""


def find_tool(name: str) -> str | None:
    """The path of the command ``name`` on PATH or in the sbin folders, else ``None``."""
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
    ip, tc = find_tool("ip"), find_tool("tc")
    missing = [name for name, path in (("ip", ip), ("tc", tc)) if path is None]
    if missing:
        raise ClusterError(
            f"an emulated cluster needs the {' and '.join(missing)} command"
            f"{'s' if len(missing) > 1 else ''} of iproute2, not found on PATH or in "
            "/usr/sbin, /sbin (install iproute2, e.g. apt-get install iproute2)"
        )
    assert ip is not None and tc is not None
    return ip, tc


def list_namespaces() -> list[str]:
    """Names of the network namespaces that ``ip netns`` knows (any prefix)."""
    ip = find_tool("ip")
    if ip is None:
        return []
    proc = subprocess.run(
        [ip, "netns", "list"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )
    # lines read "name" or "name (id: 3)"
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def namespace_pids(ip: str, namespace: str) -> list[int]:
    """Process ids of every process inside network namespace ``namespace``."""
    proc = subprocess.run(
        [ip, "netns", "pids", namespace], capture_output=True, text=True,
        timeout=COMMAND_TIMEOUT_S,
    )  # fmt: skip
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_namespaces(
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
        for pid in [pid for ns in namespaces for pid in namespace_pids(ip, ns)]:
            _signal(pid, sig)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            # poll() reaps our children: an unreaped zombie would look alive to a signal 0
            if all(p.poll() is not None for p in procs) and not any(
                namespace_pids(ip, ns) for ns in namespaces
            ):
                return
            time.sleep(0.05)
