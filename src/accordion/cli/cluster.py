"""``accordion cluster``: an accordion command run on emulated hosts (network namespaces
with shaped links, one torchrun node each), or only a probe of their bandwidth."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..cluster import ClusterError, ClusterRunError, EmulatedCluster, remove_leftovers


def _cluster_inputs(args: argparse.Namespace) -> tuple[EmulatedCluster, list[str]]:
    """The checked ``cluster`` arguments: (an unstarted cluster, the accordion command)."""
    parser = args.parser
    command = list(args.accordion_args)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command and not args.probe:
        parser.error(
            "give --probe or the accordion command to run after --, e.g. "
            "-- train --task mnist1d --epochs 2"
        )
    subcommands = {"train", "compare", "plan"}
    if command and command[0] not in subcommands:
        parser.error(
            f"the command after -- must start with one of {', '.join(sorted(subcommands))}"
            f" (an accordion subcommand), got {command[0]!r}"
        )
    if args.bandwidth is None:
        parser.error("argument --bandwidth: required (each host's link rate, e.g. 100mbit)")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"argument --timeout: must be > 0 seconds, got {args.timeout}")
    try:
        cluster = EmulatedCluster(args.hosts, args.bandwidth, args.delay,
                                  workers_per_host=args.workers_per_host)  # fmt: skip
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if command[:1] in (["train"], ["compare"]) and not any(
        a == "--threads" or a.startswith("--threads=") for a in command
    ):
        # every host defaults to all the cores: share them instead
        workers = args.hosts * args.workers_per_host
        command += ["--threads", str(max(1, (os.cpu_count() or 1) // workers))]
    return cluster, command


def _print_probe(cluster: EmulatedCluster, args: argparse.Namespace) -> None:
    """Measure the cluster's all-reduce bandwidth and print it against the link rate."""
    probe = cluster.measure_bandwidth(timeout=args.timeout)
    measured = probe["bus_bandwidth_bytes_per_s"]
    print(
        f"all-reduce bus bandwidth {measured * 8 / 1e6:,.1f} Mbit/s on "
        f"{args.hosts} hosts ({measured / cluster.bandwidth:.0%} of the "
        f"{cluster.bandwidth * 8 / 1e6:,.1f} Mbit/s links), "
        f"{probe['bytes'] / 1e6:g} MB in {probe['seconds']:.3f} s",
        flush=True,
    )


def _cluster_command(args: argparse.Namespace) -> int:
    """``accordion cluster``: the command (or ``--probe``, ``--cleanup``) on the emulated
    hosts; host 0's exit status, 124 on a timeout, 130 on an interrupt."""
    parser = args.parser
    if args.cleanup:
        try:
            removed = remove_leftovers()
        except ClusterError as exc:
            parser.error(str(exc))
        print(f"removed {len(removed)} namespace(s)" + "".join(f" {n}" for n in removed))
        return 0
    cluster, command = _cluster_inputs(args)
    try:
        # start() undoes what it built when it fails; close() below on every other exit
        cluster.start()
    except ClusterError as exc:
        parser.error(str(exc))
    echoed = False
    try:
        if args.probe:
            _print_probe(cluster, args)
        if not command:
            return 0
        echoed = True
        result = cluster.run(
            "accordion", command, timeout=args.timeout, log_dir=args.log_dir, echo=True
        )
    except TimeoutError as exc:
        print(f"accordion cluster: {exc}", file=sys.stderr)
        return 124
    except ClusterRunError as exc:
        result = exc.result
        # host 0's stderr was echoed already; another host's is only in the message
        message = str(exc).split(";")[0] if echoed and result.failed_host == 0 else str(exc)
        print(f"accordion cluster: {message}", file=sys.stderr)
    except ClusterError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        print("accordion cluster: interrupted; removing the cluster", file=sys.stderr)
        return 130
    finally:
        cluster.close()
    # host 0's status, unless another host failed first and host 0 was stopped for it
    code = result.returncodes[0 if result.failed_host is None else result.failed_host]
    # a signal's negative code becomes the shell's 128 + signal
    return (code if code >= 0 else 128 - code) or (1 if result.failed_host is not None else 0)


def _add_cluster(sub: Any) -> None:
    """The ``cluster`` subcommand: an accordion command on emulated hosts."""
    cluster = sub.add_parser(
        "cluster",
        help="run an accordion command on an emulated multi-host cluster (root, Linux)",
        description="Builds HOSTS network namespaces joined by a bridge, with each host's "
        "link limited to BANDWIDTH each way (tc tbf; netem for --delay), runs "
        "'accordion ARGS' on every host as one node of a torchrun job over gloo, prints "
        "host 0's output, tears everything down and exits with host 0's status. train and "
        "compare get --threads cores/HOSTS unless given. Needs root and iproute2 (ip, tc).",
        epilog="example: accordion cluster --hosts 2 --bandwidth 100mbit --probe -- train "
        "--task mnist1d --epochs 2 --strategy dense",
    )
    add = cluster.add_argument
    add("--hosts", type=int, default=2, help="emulated hosts (default %(default)s)")
    add("--workers-per-host", type=int, default=1,
        help="processes a host runs, sharing its link (default %(default)s)")
    add("--bandwidth", default=None, help="each host's link rate, e.g. 100mbit")
    add("--delay", default="0", help="one-way host-to-host latency, e.g. 1ms (default 0)")
    add("--timeout", type=float, default=None, help="seconds before all hosts are killed "
        "(default: none)")  # fmt: skip
    add("--probe", action="store_true", help="first measure and print the all-reduce bandwidth")
    add("--log-dir", default=None, help="keep every host's stdout/stderr here")
    add("--cleanup", action="store_true",
        help="only remove the namespaces that crashed clusters left (acc-*)")  # fmt: skip
    add("accordion_args", nargs=argparse.REMAINDER, help="after --: the accordion command to run")
    cluster.set_defaults(handler=_cluster_command, parser=cluster)
