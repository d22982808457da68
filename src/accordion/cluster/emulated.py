"""An emulated multi-host cluster on one Linux machine: an emulated network and a runner.

:class:`EmulatedCluster` joins the two parts and owns their lifecycle: an
:class:`~accordion.cluster.network.EmulatedNetwork` (``hosts`` network namespaces behind
a bridge, each link shaped with ``tc``) and a
:class:`~accordion.cluster.runner.TorchrunRunner` (one ``torchrun`` node per host, with
``GLOO_SOCKET_IFNAME=eth0`` so that gloo's traffic goes over the emulated links)::

    with EmulatedCluster(hosts=2, bandwidth="100mbit") as cluster:
        print(cluster.measure_bandwidth())
        result = cluster.run("accordion", ["train", "--task", "mnist1d", "--epochs", "2"])
        print(result.stdout)

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and the ``ip`` and ``tc`` tools (iproute2).
The rate is what ``tbf`` counts: Ethernet frames without preamble or inter-frame gap, so
TCP payload moves at about 95% of it with a 1500-byte MTU.

The names that lived here before the split are still importable from here.
"""

from __future__ import annotations

import atexit
import signal
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from .namespaces import NAMESPACE_PREFIX, ClusterError, check_requirements, list_namespaces
from .network import (
    MAX_DELAY_S,
    MAX_HOSTS,
    MAX_RATE_BITS,
    MIN_RATE_BITS,
    EmulatedNetwork,
    Link,
    remove_leftovers,
    tbf_parameters,
)
from .runner import ClusterRun, ClusterRunError, TorchrunRunner

__all__ = [
    "MAX_DELAY_S",
    "MAX_HOSTS",
    "MAX_RATE_BITS",
    "MIN_RATE_BITS",
    "NAMESPACE_PREFIX",
    "ClusterError",
    "ClusterRun",
    "ClusterRunError",
    "EmulatedCluster",
    "check_requirements",
    "list_namespaces",
    "remove_leftovers",
    "tbf_parameters",
]


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class EmulatedCluster:
    """``hosts`` emulated hosts joined by a switch over links of ``bandwidth`` each way.

    The arguments (``hosts``, ``bandwidth``, ``delay`` and the keywords ``name`` and
    ``subnet``) are :class:`EmulatedNetwork`'s: the hosts' addresses exist only inside the cluster's
    namespaces.

    The constructor only checks its arguments (``TypeError``/``ValueError``); entering the
    context builds the cluster (:class:`ClusterError` when that is impossible here) and
    leaving it tears everything down, also on exceptions, Ctrl-C and SIGTERM.
    ``network`` (an :class:`EmulatedNetwork`) and ``runner`` (a :class:`TorchrunRunner`
    on it, ``workers_per_host`` processes a host) are the two parts; the names below are
    theirs.
    """

    def __init__(self, hosts: int, bandwidth: str, delay: str = "0", *,
                 workers_per_host: int = 1, **network: Any) -> None:  # fmt: skip
        # the network's own signature checks the rest (name, subnet)
        self.network = EmulatedNetwork(hosts, bandwidth, delay, **network)
        self.runner = TorchrunRunner(self.network, workers_per_host)
        self._previous_sigterm: Any = None
        self._sigterm_installed = False
        self._atexit_registered = False

    # ------------------------------------------------------------------------ names

    @property
    def hosts(self) -> int:
        """Number of hosts."""
        return self.network.hosts

    @property
    def bandwidth(self) -> float:
        """Each host's link rate in each direction now, bytes/s."""
        return self.network.bandwidth

    @property
    def delay(self) -> float:
        """One-way host-to-host latency now, seconds."""
        return self.network.delay

    @property
    def subnet(self) -> str:
        """First three octets of the hosts' addresses."""
        return self.network.subnet

    @property
    def tag(self) -> str:
        """The tag in the namespace names (a random one may change at :meth:`start`)."""
        return self.network.tag

    @property
    def prefix(self) -> str:
        """Start of the names of every namespace of this cluster, ``acc-<tag>-``."""
        return self.network.prefix

    @property
    def switch_namespace(self) -> str:
        """Namespace of the bridge."""
        return self.network.switch_namespace

    @property
    def host_namespaces(self) -> list[str]:
        """Namespace of each host, host 0 first."""
        return self.network.host_namespaces

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this cluster: the hosts', then the switch's."""
        return self.network.namespaces

    @property
    def addresses(self) -> list[str]:
        """IPv4 address of each host's ``eth0``."""
        return self.network.addresses

    @property
    def links(self) -> list[Link]:
        """Both ends of every host's link, each shaped on its own."""
        return self.network.links

    # -------------------------------------------------------------------- lifecycle

    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Build the namespaces, bridge, links and shaping; on failure undo what was built
        and raise :class:`ClusterError`."""
        self.network.prepare()
        self._install_handlers()
        try:
            self.network.build()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill every process started in the cluster and delete its namespaces (which
        deletes the veths and the bridge). Idempotent; never raises for things already
        gone. Ctrl-C and SIGTERM are held back until it is done."""
        blocked = {signal.SIGINT, signal.SIGTERM}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            processes, self.runner.processes = self.runner.processes, []
            self.network.close(processes)
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

    # ------------------------------------------------------------ the parts' work

    def set_link(self, bandwidth: str, delay: str = "0") -> None:
        """Change every host's link; see :meth:`EmulatedNetwork.set_link`."""
        self.network.set_link(bandwidth, delay)

    def environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment of the hosts' processes; see :meth:`TorchrunRunner.environment`."""
        return self.runner.environment(env)

    def torchrun_command(
        self, host: int, target: str, args: Sequence[str] = (), *, module: bool = True,
        port: int = 29400, run_id: str = "accordion", python: str | None = None,
    ) -> list[str]:  # fmt: skip
        """Host ``host``'s torchrun node; see :meth:`TorchrunRunner.torchrun_command`."""
        return self.runner.torchrun_command(
            host, target, args, module=module, port=port, run_id=run_id, python=python
        )

    def run(self, target: str, args: Sequence[str] = (), **options: Any) -> ClusterRun:
        """Run ``target`` with ``args`` on every host as one torchrun job and wait for it:
        a :class:`ClusterRun`, :class:`ClusterRunError` when a host fails (with
        ``check``), ``TimeoutError`` past ``timeout`` seconds. ``options`` are those of
        :meth:`TorchrunRunner.run` (``module``, ``timeout``, ``env``, ``log_dir``,
        ``check``, ``echo``, ``python``)."""
        return self.runner.run(target, args, **options)

    def measure_bandwidth(
        self, mbytes: float = 4.0, repeats: int = 3, timeout: float | None = 120.0
    ) -> dict[str, Any]:
        """The all-reduce bus bandwidth over the links (bytes/s) and what it was measured
        on; see :meth:`TorchrunRunner.measure_bandwidth`."""
        return self.runner.measure_bandwidth(mbytes, repeats, timeout)
