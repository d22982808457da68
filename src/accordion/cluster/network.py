"""The emulated network: one namespace per host, a switch namespace, and shaped links.

:class:`EmulatedNetwork` builds ``hosts`` network namespaces, one per emulated host, and one
"switch" namespace holding a Linux bridge. Host ``i`` sees one interface, ``eth0``, with
address ``<subnet>.<i+1>/24``, the end of a veth pair whose other end is a port of the
bridge. Each host's link is limited in both directions with ``tc``: a token bucket
(``tbf``) at the link rate on the host's ``eth0`` (its upload) and on the bridge port (its
download), plus ``netem`` for the latency when one is asked for. Nothing is created in the
root namespace, so the machine's own networking is untouched.

The ``ip`` and ``tc`` command lines are built by pure functions (:func:`topology_commands`,
:func:`shaping_commands`, :func:`reset_command`), so what a network would run can be
checked without root; :class:`EmulatedNetwork` only runs them. The rate is what ``tbf``
counts: Ethernet frames without preamble or inter-frame gap, so TCP payload moves at about
95% of it with a 1500-byte MTU.
"""

from __future__ import annotations

import contextlib
import gzip
import math
import numbers
import os
import re
import secrets
import subprocess
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..costmodel import parse_bandwidth, parse_latency
from .namespaces import (
    COMMAND_TIMEOUT_S,
    NAMESPACE_PREFIX,
    ClusterError,
    check_requirements,
    kill_namespaces,
    list_namespaces,
)

MAX_HOSTS = 64
MIN_RATE_BITS = 8_000  # 1 kB/s: below it nothing useful runs
MAX_RATE_BITS = 100_000_000_000  # 100 Gbit/s; one CPU moves far less through veths anyway
MAX_DELAY_S = 10.0

_MIN_BURST = 2 * 65536  # two 64 KiB GSO packets: tbf would split or drop larger packets
_MTU_FRAME = 1514  # bytes a full-size frame counts for in tbf (MTU + Ethernet header)
_TAG = re.compile(r"^[a-z0-9]{1,16}$")


class Link(NamedTuple):
    """One end of a host's link, shaped on its own: a device in a namespace."""

    namespace: str
    device: str


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


def _parse_link(
    argument: str, value: Any, parse: Callable[[str], float], example: str, what: str
) -> float:
    """``value`` parsed by ``parse``; a TypeError or ValueError naming ``argument`` if it is not."""
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a str such as {example}, got {value!r}")
    try:
        return parse(value)
    except ValueError as exc:
        raise ValueError(f"{argument} {value!r} is not a {what}: {exc}") from None


def _check_bandwidth(bandwidth: Any) -> float:
    rate = _parse_link("bandwidth", bandwidth, parse_bandwidth, "'100mbit'", "link rate")
    if not MIN_RATE_BITS <= rate * 8 <= MAX_RATE_BITS:
        raise ValueError(
            f"bandwidth must be between 8kbit and 100gbit, got {bandwidth!r} ({rate * 8:g} bit/s)"
        )
    return rate


def _check_delay(delay: Any) -> float:
    seconds = _parse_link("delay", delay, parse_latency, "'1ms' or '0'", "latency")
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


# ------------------------------------------------------------------ the commands, pure


def link_ends(host_namespaces: Sequence[str], switch_namespace: str) -> list[Link]:
    """Both ends of every host's link: each host's ``eth0`` (its upload), then the bridge
    port ``h<i>`` in the switch (host ``i``'s download)."""
    ends = [Link(ns, "eth0") for ns in host_namespaces]
    return ends + [Link(switch_namespace, f"h{i}") for i in range(len(host_namespaces))]


def topology_commands(
    ip: str, switch_namespace: str, host_namespaces: Sequence[str], addresses: Sequence[str]
) -> list[list[str]]:
    """The ``ip`` commands, in order, that join existing namespaces into the network: the
    bridge ``br0`` in the switch, and per host a veth pair from its ``eth0`` (with its
    address) to a bridge port ``h<i>``. Every command runs inside a namespace (``-n``)."""
    sw = switch_namespace
    commands = [
        [ip, "-n", sw, "link", "set", "lo", "up"],
        [ip, "-n", sw, "link", "add", "br0", "type", "bridge"],
        [ip, "-n", sw, "link", "set", "br0", "up"],
    ]
    for i, (namespace, address) in enumerate(zip(host_namespaces, addresses)):
        port = f"h{i}"
        # created inside the host namespace with its peer put straight into the
        # switch's: no interface ever exists in the root namespace
        commands += [
            [ip, "-n", namespace, "link", "add", "eth0", "type", "veth", "peer", "name", port,
             "netns", sw],
            [ip, "-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0"],
            [ip, "-n", namespace, "link", "set", "lo", "up"],
            [ip, "-n", namespace, "link", "set", "eth0", "up"],
            [ip, "-n", sw, "link", "set", port, "master", "br0"],
            [ip, "-n", sw, "link", "set", port, "up"],
        ]  # fmt: skip
    return commands


def reset_command(tc: str, link: Link) -> list[str]:
    """The ``tc`` command that removes ``link``'s root qdisc (it fails, harmlessly, on a
    fresh veth, whose ``noqueue`` root cannot be deleted)."""
    return [tc, "-n", link.namespace, "qdisc", "del", "dev", link.device, "root"]


def shaping_commands(
    tc: str, link: Link, bandwidth: float, delay: float, hz: int | None = None
) -> list[list[str]]:
    """The ``tc`` commands that shape ``link`` (after :func:`reset_command`) to
    ``bandwidth`` bytes/s with half of the one-way host-to-host ``delay`` (seconds) on
    this hop: a ``tbf`` root, or, with a delay, a ``netem`` root whose child is the
    ``tbf``. ``hz`` is the kernel's timer rate (read from its config when ``None``)."""
    rate_bits, burst, limit = tbf_parameters(bandwidth, hz)
    tbf = ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "limit", str(limit)]
    hop_us = round(delay / 2 * 1e6)
    base = [tc, "-n", link.namespace, "qdisc", "add", "dev", link.device]
    if hop_us == 0:
        return [[*base, "root", "handle", "1:", *tbf]]
    # netem holds every packet of one delay's worth of traffic, counted in packets
    netem_limit = 1000 + 2 * math.ceil(bandwidth * delay / 2 / _MTU_FRAME)
    # the netem wiki's order: netem delays, its child tbf sets the rate
    return [
        [*base, "root", "handle", "1:", "netem", "delay", f"{hop_us}us", "limit",
         str(netem_limit)],
        [*base, "parent", "1:1", "handle", "10:", *tbf],
    ]  # fmt: skip


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
    kill_namespaces(ip, names)
    for name in names:
        subprocess.run([ip, "netns", "del", name], capture_output=True, timeout=COMMAND_TIMEOUT_S)
    return names


# ------------------------------------------------------------------------ the network


class EmulatedNetwork:
    """``hosts`` namespaces joined by a switch over links of ``bandwidth`` each way.

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
            ``<subnet>.<i+1>``. The addresses exist only inside the namespaces.

    The constructor only checks its arguments (``TypeError``/``ValueError``);
    :meth:`start` builds the network (:class:`ClusterError` when that is impossible here)
    and :meth:`close` deletes it. ``bandwidth`` (bytes/s) and ``delay`` (seconds) are the
    current link's; ``ip`` and ``tc`` the tools' paths once started, else ``""``.
    """

    def __init__(
        self,
        hosts: int,
        bandwidth: str,
        delay: str = "0",
        name: str | None = None,
        subnet: str = "10.213.0",
    ) -> None:
        # not check_int: its message says ">= 2", and the range here has a top; int in the
        # tuple as well: mypy takes int and numbers.Integral as disjoint (no code after)
        if isinstance(hosts, bool) or not isinstance(hosts, (int, numbers.Integral)):
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
        self.ip = self.tc = ""
        self._created: list[str] = []
        self._netem: bool | None = None

    # ------------------------------------------------------------------------ names

    @property
    def prefix(self) -> str:
        """Start of the names of every namespace of this network, ``acc-<tag>-``."""
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
        """Every namespace of this network: the hosts', then the switch's."""
        return [*self.host_namespaces, self.switch_namespace]

    @property
    def addresses(self) -> list[str]:
        """IPv4 address of each host's ``eth0``."""
        return [f"{self.subnet}.{i + 1}" for i in range(self.hosts)]

    @property
    def links(self) -> list[Link]:
        """Both ends of every host's link (see :func:`link_ends`)."""
        return link_ends(self.host_namespaces, self.switch_namespace)

    @property
    def created(self) -> list[str]:
        """The namespaces built so far and not yet deleted, in the order of creation."""
        return list(self._created)

    @property
    def started(self) -> bool:
        """Whether the network is built (its namespaces exist)."""
        return bool(self._created)

    # -------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """:meth:`prepare`, then :meth:`build`; on failure undo what was built and raise
        :class:`ClusterError`."""
        self.prepare()
        try:
            self.build()
        except BaseException:
            self.close()
            raise

    def prepare(self) -> None:
        """Check this machine (:func:`check_requirements`) and pick a tag no namespace has;
        builds nothing."""
        if self._created:
            raise ClusterError(f"cluster {self.tag} is already started")
        self.ip, self.tc = check_requirements()
        if self._random_tag:
            existing = list_namespaces()
            while any(n.startswith(self.prefix) for n in existing):
                self.tag = secrets.token_hex(3)

    def build(self) -> None:
        """Create the namespaces, the bridge and the links, and shape them; what was built
        before a failure is left for :meth:`close`."""
        for namespace in [self.switch_namespace, *self.host_namespaces]:
            proc = subprocess.run(
                [self.ip, "netns", "add", namespace], capture_output=True, text=True,
                timeout=COMMAND_TIMEOUT_S,
            )  # fmt: skip
            if proc.returncode != 0:
                raise ClusterError(
                    f"cannot create network namespace {namespace}: {proc.stderr.strip()}; "
                    "an emulated cluster needs CAP_SYS_ADMIN and CAP_NET_ADMIN (root on the "
                    "machine, or a privileged container)"
                )
            self._created.append(namespace)
        for argv in topology_commands(
            self.ip, self.switch_namespace, self.host_namespaces, self.addresses
        ):
            self._command(argv)
        self._shape()

    def close(self, procs: Sequence[subprocess.Popen] = ()) -> None:
        """Kill every process in the namespaces, and the process groups of ``procs``
        (started into them), wait for ``procs``, then delete the namespaces (which deletes
        the veths and the bridge). Idempotent; never raises for things already gone."""
        # each step goes on whatever the one before met: teardown must not stop halfway
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if self.ip and (self._created or procs):
                kill_namespaces(self.ip, self._created, procs)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for namespace in reversed(self._created):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    [self.ip, "netns", "del", namespace], capture_output=True,
                    timeout=COMMAND_TIMEOUT_S,
                )  # fmt: skip
        self._created = []

    # ---------------------------------------------------------------------- shaping

    def set_link(self, bandwidth: str, delay: str = "0") -> None:
        """Change every host's link to ``bandwidth`` each way and ``delay`` one-way
        host-to-host latency (same syntax as the constructor's). Raises
        :class:`ClusterError` if the network is not started, or if a delay is asked for
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
        hz = _kernel_hz()
        for link in self.links:
            # a veth starts with the noqueue root, which cannot be deleted: ignore that
            subprocess.run(
                reset_command(self.tc, link), capture_output=True, timeout=COMMAND_TIMEOUT_S
            )
            for argv in shaping_commands(self.tc, link, self.bandwidth, self.delay, hz):
                self._command(argv)

    def _command(self, argv: list[str]) -> None:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        if proc.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")

    def _has_netem(self) -> bool:
        if self._netem is None:
            # try it on the switch's loopback: a failure there changes no link
            sw = self.switch_namespace
            proc = subprocess.run(
                [self.tc, "-n", sw, "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                 "1ms"],
                capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
            )  # fmt: skip
            self._netem = proc.returncode == 0
            if self._netem:
                self._command([self.tc, "-n", sw, "qdisc", "del", "dev", "lo", "root"])
        return self._netem
