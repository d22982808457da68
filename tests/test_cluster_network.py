"""Specification of the emulated network's commands (accordion.cluster.network).

The ``ip`` and ``tc`` command lines are built by pure functions: these tests read them
without root, namespaces or processes.
"""

from __future__ import annotations

import os

import pytest

from accordion.cluster import ClusterError, EmulatedCluster
from accordion.cluster.network import (
    EmulatedNetwork,
    Link,
    link_ends,
    reset_command,
    shaping_commands,
    tbf_parameters,
    topology_commands,
)
from accordion.costmodel import parse_bandwidth

HOSTS = ["acc-t-h0", "acc-t-h1"]
SWITCH = "acc-t-sw"
RATE = parse_bandwidth("100mbit")  # 12.5e6 bytes/s


def test_link_ends_are_each_hosts_eth0_then_its_bridge_port_in_the_switch() -> None:
    assert link_ends(HOSTS, SWITCH) == [
        Link("acc-t-h0", "eth0"), Link("acc-t-h1", "eth0"),
        Link("acc-t-sw", "h0"), Link("acc-t-sw", "h1"),
    ]  # fmt: skip


def test_a_link_without_delay_is_one_tbf_root_at_the_rate() -> None:
    rate_bits, burst, limit = tbf_parameters(RATE, hz=250)
    commands = shaping_commands("tc", Link("acc-t-h0", "eth0"), RATE, 0.0, hz=250)
    assert commands == [
        ["tc", "-n", "acc-t-h0", "qdisc", "add", "dev", "eth0", "root", "handle", "1:",
         "tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "limit", str(limit)],
    ]  # fmt: skip
    assert rate_bits == 100_000_000


def test_a_link_with_delay_is_netem_at_half_the_delay_with_the_tbf_as_its_child() -> None:
    netem, tbf = shaping_commands("tc", Link("acc-t-sw", "h1"), RATE, 0.020, hz=250)
    assert netem[:10] == ["tc", "-n", "acc-t-sw", "qdisc", "add", "dev", "h1", "root",
                          "handle", "1:"]  # fmt: skip
    assert netem[10:13] == ["netem", "delay", "10000us"]  # 10 ms on each of the two hops
    # netem's queue holds a hop's delay of traffic, in full frames, twice, plus 1000
    assert netem[13:] == ["limit", str(1000 + 2 * 83)]  # 12.5e6 B/s * 10 ms / 1514 B
    assert tbf[7:11] == ["parent", "1:1", "handle", "10:"]
    assert tbf[11:] == shaping_commands("tc", Link("acc-t-sw", "h1"), RATE, 0.0, hz=250)[0][10:]


def test_the_delay_is_rounded_to_whole_microseconds_per_hop() -> None:
    netem, _ = shaping_commands("tc", Link("acc-t-h0", "eth0"), RATE, 3e-6, hz=100)
    assert netem[10:13] == ["netem", "delay", "2us"]


def test_reset_removes_the_root_qdisc_of_that_link_only() -> None:
    command = reset_command("/sbin/tc", Link("acc-t-sw", "h0"))
    assert command == ["/sbin/tc", "-n", "acc-t-sw", "qdisc", "del", "dev", "h0", "root"]


def test_the_topology_is_a_bridge_and_one_veth_per_host_with_its_address() -> None:
    commands = topology_commands("ip", SWITCH, HOSTS, ["10.9.8.1", "10.9.8.2"])
    assert commands[:3] == [
        ["ip", "-n", SWITCH, "link", "set", "lo", "up"],
        ["ip", "-n", SWITCH, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", SWITCH, "link", "set", "br0", "up"],
    ]
    assert commands[3:9] == [
        ["ip", "-n", "acc-t-h0", "link", "add", "eth0", "type", "veth", "peer", "name", "h0",
         "netns", SWITCH],
        ["ip", "-n", "acc-t-h0", "addr", "add", "10.9.8.1/24", "dev", "eth0"],
        ["ip", "-n", "acc-t-h0", "link", "set", "lo", "up"],
        ["ip", "-n", "acc-t-h0", "link", "set", "eth0", "up"],
        ["ip", "-n", SWITCH, "link", "set", "h0", "master", "br0"],
        ["ip", "-n", SWITCH, "link", "set", "h0", "up"],
    ]  # fmt: skip
    assert len(commands) == 3 + 6 * len(HOSTS)


def test_no_command_touches_the_root_namespace() -> None:
    network = EmulatedNetwork(3, "1gbit", "2ms", name="abc")
    commands = topology_commands(
        "ip", network.switch_namespace, network.host_namespaces, network.addresses
    )
    for link in network.links:
        commands += [reset_command("tc", link)]
        commands += shaping_commands("tc", link, network.bandwidth, network.delay, hz=100)
    for argv in commands:
        assert argv[1] == "-n" and argv[2] in network.namespaces, argv


def test_a_network_names_its_namespaces_addresses_and_links_without_creating_anything() -> None:
    network = EmulatedNetwork(2, "40mbit", name="abc", subnet="10.9.8")
    assert network.namespaces == ["acc-abc-h0", "acc-abc-h1", "acc-abc-sw"]
    assert network.addresses == ["10.9.8.1", "10.9.8.2"]
    assert network.links == link_ends(["acc-abc-h0", "acc-abc-h1"], "acc-abc-sw")
    assert (network.bandwidth, network.delay) == (pytest.approx(5e6), 0.0)
    assert not network.started and network.created == [] and network.ip == ""


def test_set_link_on_a_network_not_started_is_a_cluster_error_and_changes_nothing() -> None:
    network = EmulatedNetwork(2, "40mbit", name="abc")
    with pytest.raises(ClusterError, match="not started"):
        network.set_link("1gbit")
    assert network.bandwidth == pytest.approx(5e6)


def test_set_link_checks_its_arguments_before_the_state() -> None:
    network = EmulatedNetwork(2, "40mbit", name="abc")
    with pytest.raises(ValueError, match="bandwidth 'fast' is not a link rate"):
        network.set_link("fast")
    with pytest.raises(TypeError, match="delay must be a str"):
        network.set_link("1gbit", 0.001)


def test_the_cluster_shows_its_networks_names_and_rate() -> None:
    cluster = EmulatedCluster(2, "100mbit", "4ms", name="xyz", subnet="10.1.2")
    network = cluster.network
    assert cluster.host_namespaces == network.host_namespaces == ["acc-xyz-h0", "acc-xyz-h1"]
    assert cluster.addresses == network.addresses
    assert cluster.links == network.links
    assert (cluster.bandwidth, cluster.delay) == (network.bandwidth, network.delay)
    assert cluster.runner.network is network


def test_a_hosts_torchrun_node_runs_in_its_namespace_with_the_rendezvous_at_host_0() -> None:
    cluster = EmulatedCluster(2, "100mbit", name="xyz", subnet="10.1.2")
    command = cluster.torchrun_command(1, "accordion", ["plan"], port=29401, run_id="r")
    assert command[1:4] == ["netns", "exec", "acc-xyz-h1"]
    assert "--rdzv-endpoint=10.1.2.1:29401" in command
    assert "--local-addr=10.1.2.2" in command and "--rdzv-conf=is_host=false" in command
    assert command[-3:] == ["-m", "accordion", "plan"]
    with pytest.raises(ValueError, match="host must be from 0 to 1, got 2"):
        cluster.torchrun_command(2, "accordion")


def test_workers_per_host_start_that_many_processes_a_host_sharing_the_cores() -> None:
    cluster = EmulatedCluster(2, "100mbit", name="xyz", workers_per_host=2)
    command = cluster.torchrun_command(0, "accordion", ["plan"])
    assert "--nproc-per-node=2" in command and "--nnodes=2" in command
    environment = cluster.environment({})
    if "OMP_NUM_THREADS" not in os.environ:
        assert environment["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 4))


@pytest.mark.parametrize("workers", [0, -1])
def test_workers_per_host_below_1_is_a_value_error_naming_it(workers) -> None:
    with pytest.raises(ValueError, match="workers_per_host"):
        EmulatedCluster(2, "100mbit", workers_per_host=workers)
