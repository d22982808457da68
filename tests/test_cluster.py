"""Specification of the emulated cluster (accordion.cluster) and `accordion cluster`.

The argument and requirement checks run anywhere. The real ones build network namespaces
and are skipped unless this process is root with ``ip`` and ``tc`` and may create a
namespace.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import accordion.cluster.namespaces as namespaces_module
from accordion.cli import main
from accordion.cluster import (
    ClusterError,
    ClusterRunError,
    EmulatedCluster,
    bus_bandwidth,
    check_requirements,
    list_namespaces,
    remove_leftovers,
    tbf_parameters,
)
from accordion.costmodel import parse_bandwidth

TINY_TRAIN = [
    "train", "--task", "synthetic", "--synthetic-shape", "40", "--train-samples", "64",
    "--test-samples", "32", "--epochs", "2", "--batch-size", "32", "--no-progress",
    "--strategy", "static:powersgd:1", "--threads", "1",
]  # fmt: skip


# ------------------------------------------------------------------------ argument checks


@pytest.mark.parametrize("hosts", [1, 0, -2, 65])
def test_hosts_outside_2_to_64_is_a_value_error_naming_hosts(hosts) -> None:
    with pytest.raises(ValueError, match=rf"hosts must be an int from 2 to 64, got {hosts}"):
        EmulatedCluster(hosts, "100mbit")


@pytest.mark.parametrize("hosts", [2.0, True, "2", None])
def test_hosts_not_an_int_is_a_type_error_naming_hosts(hosts) -> None:
    with pytest.raises(TypeError, match="hosts must be an int"):
        EmulatedCluster(hosts, "100mbit")


@pytest.mark.parametrize("bandwidth", ["fast", "100", "100mb", "-5mbit", "0mbit", ""])
def test_a_bandwidth_that_is_no_rate_is_a_value_error_naming_it_and_the_units(bandwidth) -> None:
    with pytest.raises(ValueError) as info:
        EmulatedCluster(2, bandwidth)
    message = str(info.value)
    assert message.startswith(f"bandwidth {bandwidth!r}")
    assert "mbit" in message


@pytest.mark.parametrize("bandwidth", ["1kbit", "200gbit"])
def test_a_bandwidth_outside_8kbit_to_100gbit_is_a_value_error(bandwidth) -> None:
    with pytest.raises(ValueError, match=r"bandwidth must be between 8kbit and 100gbit"):
        EmulatedCluster(2, bandwidth)


def test_a_bandwidth_that_is_not_a_str_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="bandwidth must be a str"):
        EmulatedCluster(2, 100e6)


@pytest.mark.parametrize("delay", ["1", "soon", "1 hour", "-1ms"])
def test_a_delay_that_is_no_latency_is_a_value_error_naming_it(delay) -> None:
    with pytest.raises(ValueError, match=rf"^delay {delay!r} is not a latency: "):
        EmulatedCluster(2, "100mbit", delay)


@pytest.mark.parametrize("delay", ["1us", "20s"])
def test_a_delay_outside_2us_to_10s_is_a_value_error(delay) -> None:
    with pytest.raises(ValueError, match=r"delay must be '0' or between 2us and 10s"):
        EmulatedCluster(2, "100mbit", delay)


def test_a_delay_that_is_not_a_str_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="delay must be a str"):
        EmulatedCluster(2, "100mbit", 0.001)


@pytest.mark.parametrize("name", ["Upper", "with-dash", "x" * 17, ""])
def test_a_name_other_than_lowercase_letters_and_digits_is_a_value_error(name) -> None:
    with pytest.raises(ValueError, match="name must be 1 to 16 lowercase letters or digits"):
        EmulatedCluster(2, "100mbit", name=name)


@pytest.mark.parametrize("subnet", ["10.0", "10.0.0.0", "10.300.0", "a.b.c"])
def test_a_subnet_other_than_three_octets_is_a_value_error(subnet) -> None:
    with pytest.raises(ValueError, match="subnet must be three octets"):
        EmulatedCluster(2, "100mbit", subnet=subnet)


def test_the_constructor_names_namespaces_and_addresses_without_creating_anything() -> None:
    cluster = EmulatedCluster(3, "100mbit", name="abc", subnet="10.9.8")
    assert cluster.host_namespaces == ["acc-abc-h0", "acc-abc-h1", "acc-abc-h2"]
    assert cluster.switch_namespace == "acc-abc-sw"
    assert cluster.addresses == ["10.9.8.1", "10.9.8.2", "10.9.8.3"]
    assert cluster.bandwidth == pytest.approx(12.5e6)
    with pytest.raises(ClusterError, match="not started"):
        cluster.run("accordion.cluster.netprobe")


def test_tbf_gets_the_exact_rate_in_bits_a_bucket_of_one_tick_and_a_larger_queue() -> None:
    rate, burst, limit = tbf_parameters(parse_bandwidth("1gbit"), hz=250)
    assert rate == 1_000_000_000
    assert burst == 125e6 / 250  # one 4 ms tick at 125 MB/s
    assert limit == burst + 125e6 * 0.05
    # slow links still take two 64 KiB GSO packets per bucket
    assert tbf_parameters(parse_bandwidth("50mbit"), hz=1000)[:2] == (50_000_000, 131072)


def test_bus_bandwidth_is_the_ring_all_reduce_model() -> None:
    # 4 workers move 2 * 3/4 of the bytes over each link: 6 MB in 1 s
    assert bus_bandwidth(4e6, 1.0, 4) == pytest.approx(6e6)


# --------------------------------------------------------------------- requirement checks


def test_not_root_is_a_cluster_error_that_says_root_is_needed(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match=r"needs root .*uid 1000"):
        check_requirements()
    with pytest.raises(ClusterError, match="needs root"):
        EmulatedCluster(2, "100mbit").start()


def test_missing_tc_is_a_cluster_error_naming_tc_and_iproute2(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real_which = namespaces_module.shutil.which
    monkeypatch.setattr(
        namespaces_module.shutil,
        "which",
        lambda name, **kw: None if name == "tc" else real_which(name, **kw) or "/sbin/ip",
    )
    with pytest.raises(ClusterError, match=r"needs the tc command of iproute2"):
        with EmulatedCluster(2, "100mbit"):
            pass


def test_remove_leftovers_refuses_a_prefix_other_than_acc() -> None:
    with pytest.raises(ValueError, match="prefix must start with 'acc-'"):
        remove_leftovers("docker")


# --------------------------------------------------------------------------- CLI errors


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hosts", "1", "--bandwidth", "1gbit", "--probe"], "hosts must be an int from 2"),
        (["--bandwidth", "quick", "--probe"], "bandwidth 'quick' is not a link rate"),
        (["--bandwidth", "1gbit", "--delay", "late", "--probe"], "delay 'late'"),
        (["--probe"], "argument --bandwidth: required"),
        (["--bandwidth", "1gbit"], "give --probe or the accordion command"),
        (["--bandwidth", "1gbit", "--", "python", "x.py"], "must start with one of compare"),
        (["--bandwidth", "1gbit", "--timeout", "0", "--probe"], "argument --timeout"),
    ],
)
def test_cluster_cli_bad_arguments_exit_2_with_a_message(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as info:
        main(["cluster", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "accordion cluster: error:" in err and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv", [["--bandwidth", "1gbit", "--", *TINY_TRAIN], ["--cleanup"]], ids=["run", "cleanup"]
)
def test_cluster_cli_not_root_exits_2_saying_root_is_needed(capsys, monkeypatch, argv) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as info:
        main(["cluster", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "accordion cluster: error:" in err and "needs root" in err


# ----------------------------------------------------------------------------- real ones


@pytest.fixture(scope="module")
def namespaces_work() -> None:
    """Skip unless this process may build network namespaces and shape links."""
    try:
        ip, _ = check_requirements()
    except ClusterError as exc:
        pytest.skip(f"no emulated cluster here: {exc}")
    name = f"acc-probe{secrets.token_hex(3)}"
    proc = subprocess.run([ip, "netns", "add", name], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {proc.stderr.strip()}")
    subprocess.run([ip, "netns", "del", name], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def cluster(namespaces_work):
    """One 2-host cluster at 40 Mbit/s (5 MB/s) shared by the real tests."""
    with EmulatedCluster(2, "40mbit") as built:
        yield built


def _leftovers(prefix: str) -> tuple[list[str], list[str]]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30)
    return (
        [n for n in list_namespaces() if n.startswith(prefix)],
        [line for line in links.stdout.splitlines() if prefix in line],
    )


def test_a_4_mb_all_reduce_runs_at_the_link_rate_within_20_percent(cluster) -> None:
    probes = [cluster.measure_bandwidth(mbytes=4, repeats=3, timeout=60) for _ in range(2)]
    assert all(p["world_size"] == 2 and p["bytes"] == 4_000_000 for p in probes)
    # a busy CPU only slows a transfer down: the faster probe is the link's rate
    fastest = max(p["bus_bandwidth_bytes_per_s"] for p in probes)
    assert fastest == pytest.approx(5e6, rel=0.2)


def test_set_link_changes_the_measured_rate(cluster) -> None:
    try:
        cluster.set_link("200mbit")
        probe = cluster.measure_bandwidth(mbytes=4, repeats=3, timeout=60)
    finally:
        cluster.set_link("40mbit")
    assert probe["bus_bandwidth_bytes_per_s"] == pytest.approx(25e6, rel=0.2)


def test_a_2_host_training_run_completes_and_host_0_prints_the_result(cluster, tmp_path) -> None:
    result = cluster.run("accordion", TINY_TRAIN, timeout=120, log_dir=tmp_path)
    assert result.returncodes == [0, 0]
    assert result.stdout.count("static:powersgd:1: test") == 1
    # only rank 0 reports, and rank 0 is host 0
    assert "static:powersgd:1: test" not in (tmp_path / "host1.out").read_text()


def test_a_failing_host_kills_the_others_and_raises_with_its_stderr(cluster, tmp_path) -> None:
    script = tmp_path / "fail_on_host1.py"
    script.write_text(
        textwrap.dedent(f"""
            import socket, sys, time
            probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            probe.connect(("{cluster.addresses[0]}", 9))
            if probe.getsockname()[0] == "{cluster.addresses[1]}":
                sys.exit("host 1 fails on purpose")
            time.sleep(60)
        """)
    )
    with pytest.raises(ClusterRunError, match=r"host 1 .*status 1") as info:
        cluster.run(str(script), module=False, timeout=60)
    assert "host 1 fails on purpose" in str(info.value)
    assert info.value.result.returncodes[0] != 0  # killed, not left sleeping
    assert info.value.result.seconds < 30


def test_a_run_past_its_timeout_is_killed_and_raises_timeout_error(cluster, tmp_path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(TimeoutError, match="did not finish within 6 s"):
        cluster.run(str(script), module=False, timeout=6)
    pids = [
        subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        for ns in cluster.host_namespaces
    ]
    assert pids == ["", ""]


def test_nothing_is_left_after_the_with_block(namespaces_work) -> None:
    with EmulatedCluster(3, "1gbit") as built:
        prefix = built.prefix
        assert set(_leftovers(prefix)[0]) == set(built.namespaces)
    assert _leftovers(prefix) == ([], [])


def test_nothing_is_left_after_an_exception_in_the_with_block(namespaces_work) -> None:
    with pytest.raises(KeyError, match="inside"):
        with EmulatedCluster(2, "1gbit") as built:
            prefix = built.prefix
            raise KeyError("inside")
    assert _leftovers(prefix) == ([], [])
    built.close()  # idempotent: a second teardown finds nothing and says nothing


def test_remove_leftovers_deletes_namespaces_a_crashed_cluster_left(namespaces_work) -> None:
    prefix = f"acc-left{secrets.token_hex(3)}-"
    for name in ("h0", "sw"):
        subprocess.run(["ip", "netns", "add", prefix + name], check=True, timeout=30)
    assert sorted(remove_leftovers(prefix)) == [prefix + "h0", prefix + "sw"]
    assert _leftovers(prefix) == ([], [])


def test_cluster_cli_runs_the_command_on_3_hosts_prints_host_0_and_cleans_up(
    namespaces_work,
) -> None:
    before = set(list_namespaces())
    result = subprocess.run(
        [sys.executable, "-m", "accordion", "cluster", "--hosts", "3", "--bandwidth", "1gbit",
         "--timeout", "90", "--", "plan", "--model", "mnist1d-cnn", "--workers", "3", "--json"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert '"workers": 3' in result.stdout and result.stdout.count('"model"') == 1
    assert set(list_namespaces()) == before


ECHO_SERVER = """
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], 5000))
server.listen()
conn, _ = server.accept()
while data := conn.recv(64):
    conn.sendall(data)
"""

ECHO_CLIENT = """
import socket, statistics, sys, time
for _ in range(100):
    try:
        conn = socket.create_connection((sys.argv[1], 5000), timeout=5)
        break
    except ConnectionRefusedError:
        time.sleep(0.05)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(5):
    start = time.perf_counter()
    conn.sendall(b"x")
    conn.recv(64)
    rtts.append(time.perf_counter() - start)
print(statistics.median(rtts))
"""


def _start_with_delay(delay: str) -> tuple[EmulatedCluster, ClusterError | None]:
    built = EmulatedCluster(2, "100mbit", delay)
    try:
        built.start()
    except ClusterError as exc:
        return built, exc
    return built, None


def test_a_delay_without_netem_is_a_cluster_error_that_leaves_nothing(namespaces_work) -> None:
    built, error = _start_with_delay("10ms")
    built.close()
    if error is None:
        pytest.skip("this kernel has netem")
    assert "needs the netem qdisc" in str(error)
    assert _leftovers(built.prefix) == ([], [])


def test_a_delay_is_the_one_way_latency_between_two_hosts(namespaces_work) -> None:
    built, error = _start_with_delay("20ms")
    if error is not None:
        built.close()
        pytest.skip(f"no delay here: {error}")
    with built:
        server = subprocess.Popen(
            ["ip", "netns", "exec", built.host_namespaces[1], sys.executable, "-c",
             ECHO_SERVER, built.addresses[1]],
        )  # fmt: skip
        client = subprocess.run(
            ["ip", "netns", "exec", built.host_namespaces[0], sys.executable, "-c",
             ECHO_CLIENT, built.addresses[1]],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        server.kill()
        server.wait(timeout=10)
    assert client.returncode == 0, client.stderr
    # a round trip crosses the delay twice
    assert 0.038 <= float(client.stdout) <= 0.08


def test_cluster_cli_exits_non_zero_when_the_command_fails_on_the_hosts(namespaces_work) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "accordion", "cluster", "--bandwidth", "1gbit", "--timeout", "90",
         "--", "plan", "--model", "no-such-model"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
    )  # fmt: skip
    assert result.returncode == 1
    assert "argument --model: must be one of" in result.stderr  # host 0's own error
    assert re.search(r"accordion cluster: host \d .*exited with status 1", result.stderr)
