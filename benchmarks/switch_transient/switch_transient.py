"""Loss/accuracy transient of a PowerSGD rank switch (Accordion level switch), MNIST-1D.

N = 4 simulated workers, each with its own ``Reducer(PowerSGD(rank, seed, on_rank_change))``
(error feedback inside the reducer), exchanged with ``SimulatedTransport(4)``. The model
(``accordion.models.get_model("mnist1d-cnn")``) is shared: parameters are identical on all
workers, so the four shard gradients of a step are computed one after the other with one
model. One step = 4 shard gradients (32 samples each, disjoint shards of a global batch of
128) -> exchange -> one ``torch.optim.SGD`` step (momentum 0.9, weight decay 1e-4 applied
by the optimizer after the exchange). lr 0.1, linear warm-up over 2 epochs, x0.1 at
epochs 30 and 45, 60 epochs. Data: MNIST-1D generated offline with
``mnist1d.data.make_dataset`` (num_samples=20000 -> 16000 train / 4000 test; the first
4000 train samples are used; 31 steps per epoch). Nothing is downloaded.

A *variant* is a string ``RANK`` (no switch) or ``AtoB`` (rank A, switched to B after
``--switch-epoch`` epochs, i.e. at step ``switch_epoch * 31``), followed by optional
``:key=value`` fields:

* ``q=redraw|reuse``   PowerSGD ``on_rank_change`` (default ``redraw``, the paper's).
* ``mem=keep|zero|scaleF|flush``  what happens to the error-feedback memory at the
  switch: keep it (paper), zero it (drop what is owed), multiply it by F, or send it
  densely once (emulated: at the first step after the switch each worker's memory is
  taken out of the reducer and the worker-average of it is added to the compressed
  average, i.e. the owed gradient is sent uncompressed in that step). ``mem=off`` is a
  diagnostic, not a candidate: no error feedback at all from the switch on (the memory
  is zeroed before every step).
* ``mom=0.9``          SGD momentum (``mom=0`` with ``lr=1.0`` keeps lr/(1-momentum)).
* ``lr=0.1``           peak learning rate.

Per run the script records test accuracy/loss and full-train-set loss at the end of
every epoch and, in a window around each switch epoch (1 epoch before to 2 epochs
after), after every step for the first 10 steps after the switch and every 5 steps
otherwise. Every step it also records, over the compressed (>= 2-D) tensors: the norm
of the averaged gradient the optimizer receives, the norm of the true mean gradient
(the uncompressed average of the 4 shard gradients), their cosine, the norm of the
worker-average of the error-feedback memory (only this average affects the result:
P and Q are all-reduced, so per-worker deviations cancel) and the mean per-worker
memory norm.

Run (from the repository root)::

    cd /work/main
    PYTHONPATH=src .venv/bin/python benchmarks/switch_transient/switch_transient.py \
        --variants 4 1 4to1 4to1:q=reuse 4to1:mem=zero --switch-epochs 10 32 --seeds 0 1 2 \
        --json /tmp/switch_transient.json

``--json`` stores every run (series included); ``--load FILE...`` prints the tables of
stored runs without training (runs from several files are merged; ``--variants`` and
``--seeds`` filter them when given). ``--paired VARIANT`` adds per-seed differences to a
reference variant, ``--curve`` test accuracy per epoch, ``--series`` the mean
fine-grained series around the switch. ``--jobs 2`` runs two processes in parallel
(each uses one thread). A run takes 15-35 s on one CPU thread. Results and conclusions:
``RESULTS.md`` next to this file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from accordion.compress import PowerSGD, Reducer, SimulatedTransport
from accordion.models import get_model

WORKERS = 4
GLOBAL_BATCH = 128
N_TRAIN = 4000
EPOCHS = 60
DECAYS = (30, 45)
WARMUP_EPOCHS = 2
WEIGHT_DECAY = 1e-4
DATA_CACHE = "/tmp/switch_transient_mnist1d_20000.npz"


# --------------------------------------------------------------------------- data
def load_data():
    """MNIST-1D generated offline (never downloaded); cached in /tmp as .npz."""
    if os.path.exists(DATA_CACHE):
        d = np.load(DATA_CACHE)
        return d["x"], d["y"], d["x_test"], d["y_test"]
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = 20000  # train_split 0.8 -> 16000 train / 4000 test
    d = make_dataset(args)
    x, y = d["x"][:N_TRAIN], d["y"][:N_TRAIN]
    x_test, y_test = d["x_test"], d["y_test"]
    assert len(x) == N_TRAIN and len(x_test) >= 4000, (len(x), len(x_test))
    tmp = DATA_CACHE + f".{os.getpid()}.npz"
    np.savez(tmp, x=x, y=y, x_test=x_test, y_test=y_test)
    os.replace(tmp, DATA_CACHE)
    return x, y, x_test, y_test


# --------------------------------------------------------------------------- variants
def parse_variant(spec: str) -> dict:
    head, *fields = spec.split(":")
    if "to" in head:
        a, b = head.split("to")
        v = {"r_from": int(a), "r_to": int(b)}
    else:
        v = {"r_from": int(head), "r_to": None}
    v.update(q="redraw", mem="keep", mom=0.9, lr=0.1)
    for f in fields:
        k, val = f.split("=")
        if k not in ("q", "mem", "mom", "lr"):
            raise ValueError(f"unknown field {k!r} in variant {spec!r}")
        v[k] = float(val) if k in ("mom", "lr") else val
    if v["q"] not in PowerSGD.RANK_CHANGE_POLICIES:
        raise ValueError(f"q must be one of {PowerSGD.RANK_CHANGE_POLICIES}")
    if not (v["mem"] in ("keep", "zero", "flush", "off") or v["mem"].startswith("scale")):
        raise ValueError(f"bad mem policy {v['mem']!r}")
    return v


def canonical(spec: str) -> str:
    """A normalised name (defaults dropped) so equal variants share a table row."""
    v = parse_variant(spec)
    name = f"{v['r_from']}" if v["r_to"] is None else f"{v['r_from']}to{v['r_to']}"
    if v["r_to"] is not None:
        name += f":q={v['q']}:mem={v['mem']}"
    if v["mom"] != 0.9:
        name += f":mom={v['mom']:g}"
    if v["lr"] != 0.1:
        name += f":lr={v['lr']:g}"
    return name


# --------------------------------------------------------------------------- training
def lr_at(step: int, spe: int, peak: float) -> float:
    epoch = step / spe
    lr = peak * min(1.0, (step + 1) / (WARMUP_EPOCHS * spe))
    for d in DECAYS:
        if epoch >= d:
            lr *= 0.1
    return lr


@torch.no_grad()
def evaluate(model, x, y):
    out = model(x)
    return float(F.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def train_run(
    spec: str, seed: int, switch_epoch: int | None, windows: list[int], epochs: int = EPOCHS
) -> dict:
    torch.set_num_threads(1)
    v = parse_variant(spec)
    x, y, xt, yt = load_data()
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    xt, yt = torch.tensor(xt, dtype=torch.float32), torch.tensor(yt, dtype=torch.long)
    spe = len(x) // GLOBAL_BATCH  # 31, last partial batch dropped
    shard = GLOBAL_BATCH // WORKERS

    torch.manual_seed(seed)
    model = get_model("mnist1d-cnn")
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    comp_idx = [i for i, p in enumerate(params) if p.dim() >= 2]
    comp_keys = [names[i] for i in comp_idx]
    reducers = [
        Reducer(PowerSGD(v["r_from"], seed=seed, on_rank_change=v["q"])) for _ in range(WORKERS)
    ]
    transport = SimulatedTransport(WORKERS)
    opt = torch.optim.SGD(params, lr=v["lr"], momentum=v["mom"], weight_decay=WEIGHT_DECAY)
    rng = np.random.RandomState(seed)

    switch_step = None if (v["r_to"] is None or switch_epoch is None) else switch_epoch * spe
    fine = set()
    for e in windows:
        s = e * spe
        fine.update(range(s - spe, s + 2 * spe + 1, 5))
        fine.update(range(s, s + 11))
    evals = []  # (step, test_loss, test_acc, train_loss, train_acc)
    diag = {k: [] for k in ("out", "true", "cos", "mem_avg", "mem_w", "batch_loss")}
    flush_pending = None

    def record_eval(step):
        model.eval()
        tl, ta = evaluate(model, xt, yt)
        rl, ra = evaluate(model, x, y)
        model.train()
        evals.append((step, tl, ta, rl, ra))

    record_eval(0)
    step = 0
    for _ in range(epochs):
        perm = torch.from_numpy(rng.permutation(len(x)))
        for b in range(spe):
            if step == switch_step:
                for r in reducers:
                    r.compressor.set_level(v["r_to"])
                    mem = v["mem"]
                    if mem == "zero":
                        for k in comp_keys:
                            r.memory.update(k, None)
                    elif mem.startswith("scale"):
                        f = float(mem[5:])
                        for k in comp_keys:
                            m = r.memory.get(k)
                            if m is not None:
                                r.memory.update(k, m * f)
                if v["mem"] == "flush":  # take the owed gradient out; sent dense below
                    flush_pending = {}
                    for k in comp_keys:
                        ms = [r.memory.get(k) for r in reducers]
                        flush_pending[k] = torch.stack(
                            [
                                torch.zeros_like(params[names.index(k)]) if m is None else m
                                for m in ms
                            ]
                        ).mean(0)
                        for r in reducers:
                            r.memory.update(k, None)
            if v["mem"] == "off" and switch_step is not None and step >= switch_step:
                for r in reducers:  # no error feedback from the switch on (diagnostic)
                    for k in comp_keys:
                        r.memory.update(k, None)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, spe, v["lr"])
            idx = perm[b * GLOBAL_BATCH : (b + 1) * GLOBAL_BATCH]
            grads, loss_sum = [], 0.0
            for w in range(WORKERS):
                sl = idx[w * shard : (w + 1) * shard]
                model.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x[sl]), y[sl])
                loss.backward()
                loss_sum += float(loss.detach())
                grads.append([p.grad.detach().clone() for p in params])
            true_mean = [torch.stack([g[i] for g in grads]).mean(0) for i in range(len(params))]
            transport.run([reducers[w].exchange(names, grads[w], WORKERS) for w in range(WORKERS)])
            out = grads[0]  # identical on all workers after the exchange
            if flush_pending is not None:
                for k, m in flush_pending.items():
                    out[names.index(k)] += m
                flush_pending = None
            # diagnostics over compressed tensors
            o = torch.cat([out[i].reshape(-1) for i in comp_idx])
            t = torch.cat([true_mean[i].reshape(-1) for i in comp_idx])
            mem_avg, mem_w = [], []
            for k in comp_keys:
                ms = [r.memory.get(k) for r in reducers]
                ms = [torch.zeros_like(params[names.index(k)]) if m is None else m for m in ms]
                mem_avg.append(torch.stack(ms).mean(0).reshape(-1))
                mem_w.append(torch.stack([m.reshape(-1) for m in ms]))
            mem_avg = torch.cat(mem_avg)
            mem_w = torch.cat(mem_w, dim=1)
            diag["out"].append(float(o.norm()))
            diag["true"].append(float(t.norm()))
            diag["cos"].append(float(F.cosine_similarity(o, t, dim=0)))
            diag["mem_avg"].append(float(mem_avg.norm()))
            diag["mem_w"].append(float(mem_w.norm(dim=1).mean()))
            diag["batch_loss"].append(loss_sum / WORKERS)
            for p, g in zip(params, out):
                p.grad = g
            opt.step()
            step += 1
            if step in fine:
                record_eval(step)
        if not evals or evals[-1][0] != step:
            record_eval(step)
        if not math.isfinite(evals[-1][1]):
            break
    return {
        "spec": canonical(spec),
        "seed": seed,
        "switch_epoch": switch_epoch,
        "windows": windows,
        "spe": spe,
        "switch_step": switch_step,
        "evals": evals,
        "diag": diag,
        "bytes_sent": transport.bytes_sent,
    }


# --------------------------------------------------------------------------- summary
def acc_at(run, step):
    for s, _, a, _, _ in run["evals"]:
        if s == step:
            return a
    raise KeyError(step)


def summarize(run, switch_epoch):
    spe = run["spe"]
    s = switch_epoch * spe
    ev = {e[0]: e for e in run["evals"]}
    after = [ev[t] for t in sorted(ev) if s < t <= s + 2 * spe]
    d = run["diag"]
    pre = slice(s - spe, s)
    post = slice(s, s + 10)
    mean = lambda a, sl: float(np.mean(a[sl]))  # noqa: E731
    ratio = np.array(d["out"]) / np.maximum(np.array(d["true"]), 1e-12)
    return {
        "acc_pre": ev[s][2],
        "acc_10": float(np.mean([ev[t][2] for t in range(s + 1, s + 11)])),
        "acc_min2": min(e[2] for e in after),
        "acc_mean2": float(np.mean([e[2] for e in after])),
        "acc_1ep": ev[s + spe][2],
        "acc_5ep": ev[s + 5 * spe][2] if s + 5 * spe in ev else float("nan"),
        "acc_final": run["evals"][-1][2],
        "loss_pre": ev[s][3],
        "loss_max2": max(e[3] for e in after),
        "cos_pre": mean(d["cos"], pre),
        "cos_post": mean(d["cos"], post),
        "ratio_pre": float(np.mean(ratio[pre])),
        "ratio_post": float(np.mean(ratio[post])),
        "mem_pre": d["mem_avg"][s - 1],
        "mem_post": float(np.max(d["mem_avg"][s : s + 2 * spe])),
        "mem_1ep": d["mem_avg"][s + spe - 1],
    }


def ms(vals, pct=True):
    a = np.array(vals, dtype=float) * (100 if pct else 1)
    if len(a) == 1:
        return f"{a[0]:.1f}" if pct else f"{a[0]:.3g}"
    if pct:
        return f"{a.mean():.1f} ± {a.std(ddof=1):.1f}"
    return f"{a.mean():.3g} ± {a.std(ddof=1):.2g}"


def _at_switch(run, epoch):
    """Whether ``run`` switched after ``epoch`` (or is a no-switch run measured there)."""
    return run["switch_epoch"] == epoch or (run["switch_step"] is None and epoch in run["windows"])


def _by_spec(runs, epoch):
    """Variant -> its runs that belong to the switch after ``epoch``, in run order."""
    rows = {}
    for r in runs:
        if _at_switch(r, epoch):
            rows.setdefault(r["spec"], []).append(r)
    return rows


def print_tables(runs, switch_epochs):
    """Mean ± std over seeds of the transient metrics and diagnostics per variant."""
    for e in switch_epochs:
        rows = {spec: [summarize(r, e) for r in rs] for spec, rs in _by_spec(runs, e).items()}
        if not rows:
            continue
        print(f"\n### switch after epoch {e} (step {e * runs[0]['spe']})\n")
        cols = [
            ("acc_pre", True),
            ("acc_10", True),
            ("acc_min2", True),
            ("acc_mean2", True),
            ("acc_1ep", True),
            ("acc_5ep", True),
            ("acc_final", True),
        ]
        print(
            "| variant | n | test acc at switch % | mean, steps +1..+10 % | min, 2 ep after % "
            "| mean, 2 ep after % | +1 ep % | +5 ep % | final % | train loss at switch "
            "| max train loss, 2 ep after |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for spec, ss in rows.items():
            cells = [ms([x[c] for x in ss], p) for c, p in cols]
            cells += [ms([x[k] for x in ss], False) for k in ("loss_pre", "loss_max2")]
            print(f"| {spec} | {len(ss)} | " + " | ".join(cells) + " |")
        print(
            "\nDiagnostics (compressed tensors; pre = mean over the epoch before the switch, "
            "post = mean over the 10 steps after it):\n"
        )
        print(
            "| variant | cos(out, true) pre | cos post | norm ratio out/true pre | ratio post "
            "| avg-memory norm at switch | max over 2 ep after | after 1 ep |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for spec, ss in rows.items():
            keys = [
                "cos_pre",
                "cos_post",
                "ratio_pre",
                "ratio_post",
                "mem_pre",
                "mem_post",
                "mem_1ep",
            ]
            print(f"| {spec} | " + " | ".join(ms([x[k] for x in ss], False) for k in keys) + " |")


def print_series(runs, switch_epochs):
    """Mean over seeds of the fine-grained series around each switch."""
    for e in switch_epochs:
        rows = _by_spec(runs, e)
        if not rows:
            continue
        spe = next(iter(rows.values()))[0]["spe"]
        s = e * spe
        offs = [0, 1, 2, 5, 10, 19, 31, 44, 62, 93, 155]  # steps with an eval
        offs = [
            k
            for k in offs
            if all(any(x[0] == s + k for x in r["evals"]) for rs in rows.values() for r in rs)
        ]
        print(
            f"\n### series around the switch after epoch {e}: mean over seeds; step offset k "
            "= after k steps at the new level; diagnostics of step s+k-1 (k=1: the first "
            "step at the new level)\n"
        )
        print("| variant | quantity | " + " | ".join(f"+{k}" for k in offs) + " |")
        print("|---|---|" + "---|" * len(offs))
        for spec, rs in rows.items():
            evs = [{x[0]: x for x in r["evals"]} for r in rs]
            acc = [np.mean([ev[s + k][2] * 100 for ev in evs]) for k in offs]
            loss = [np.mean([ev[s + k][3] for ev in evs]) for k in offs]
            cos = [np.mean([r["diag"]["cos"][s + k - 1] for r in rs]) for k in offs]
            ratio = [
                np.mean(
                    [
                        r["diag"]["out"][s + k - 1] / max(r["diag"]["true"][s + k - 1], 1e-12)
                        for r in rs
                    ]
                )
                for k in offs
            ]
            mem = [np.mean([r["diag"]["mem_avg"][s + k - 1] for r in rs]) for k in offs]
            print(f"| {spec} | test acc % | " + " | ".join(f"{a:.1f}" for a in acc) + " |")
            for label, vals in (
                ("train loss", loss),
                ("cos(out,true)", cos),
                ("out/true norm", ratio),
                ("avg memory norm", mem),
            ):
                print(f"| | {label} | " + " | ".join(f"{a:.2f}" for a in vals) + " |")


def print_curve(runs, switch_epochs):
    """Mean ± std test accuracy at the end of selected epochs (whole run)."""
    for e in switch_epochs:
        rows = _by_spec(runs, e)
        if not rows:
            continue
        spe = next(iter(rows.values()))[0]["spe"]
        last = min(r["evals"][-1][0] for rs in rows.values() for r in rs) // spe
        picks = (e - 1, e, e + 1, e + 2, e + 3, e + 5, e + 10, 20, 29, 30, 31, 35, 45, last)
        marks = sorted({m for m in picks if 0 <= m <= last})
        print(f"\n### test accuracy % at the end of epoch (switch after epoch {e})\n")
        print("| variant | n | " + " | ".join(str(m) for m in marks) + " |")
        print("|---|---|" + "---|" * len(marks))
        for spec, rs in rows.items():
            cells = []
            for m in marks:
                vals = [ev[2] for r in rs for ev in r["evals"] if ev[0] == m * spe]
                cells.append(ms(vals) if len(vals) == len(rs) else "")
            print(f"| {spec} | {len(rs)} | " + " | ".join(cells) + " |")


def print_paired(runs, switch_epochs, ref):
    """Per-seed differences (percentage points) to the variant ``ref``, mean ± std."""
    ref = canonical(ref)
    for e in switch_epochs:
        by = {
            spec: {r["seed"]: summarize(r, e) for r in rs} for spec, rs in _by_spec(runs, e).items()
        }
        if ref not in by:
            continue
        keys = ("acc_10", "acc_min2", "acc_mean2", "acc_1ep", "acc_5ep", "acc_final")
        print(
            f"\n### paired difference to {ref} (same seeds), switch after epoch {e}, "
            "percentage points\n"
        )
        print(
            "| variant | n | mean, steps +1..+10 | min, 2 ep after | mean, 2 ep after | +1 ep "
            "| +5 ep | final |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for spec, d in by.items():
            seeds = sorted(set(d) & set(by[ref]))
            cells = []
            for k in keys:
                x = np.array([d[sd][k] - by[ref][sd][k] for sd in seeds]) * 100
                sd_ = x.std(ddof=1) if len(x) > 1 else 0.0
                cells.append(f"{x.mean():+.1f} ± {sd_:.1f}")
            print(f"| {spec} | {len(seeds)} | " + " | ".join(cells) + " |")


def _job(a):
    spec, seed, e, windows, epochs = a
    t0 = time.time()
    r = train_run(spec, seed, e, windows, epochs)
    print(
        f"  done {r['spec']} seed={seed} switch={e} final={r['evals'][-1][2]:.3f} "
        f"({time.time() - t0:.0f}s)",
        file=sys.stderr,
        flush=True,
    )
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["4", "1", "4to1", "4to1:q=reuse"])
    ap.add_argument("--switch-epochs", nargs="+", type=int, default=[10])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", help="write all runs (with series) to this file")
    ap.add_argument("--load", nargs="+", help="print tables from stored runs, no training")
    ap.add_argument(
        "--paired", metavar="VARIANT", help="also print per-seed differences to this variant"
    )
    ap.add_argument(
        "--curve",
        action="store_true",
        help="also print test accuracy at the end of selected epochs",
    )
    ap.add_argument(
        "--series",
        action="store_true",
        help="also print the mean fine-grained series around each switch",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)

    if args.load:
        runs = []
        for f in args.load:
            with open(f) as fh:
                runs += json.load(fh)
        wanted = {canonical(s) for s in args.variants} if "--variants" in sys.argv else None
        if wanted:
            runs = [r for r in runs if r["spec"] in wanted]
        if "--seeds" in sys.argv:
            runs = [r for r in runs if r["seed"] in args.seeds]
        # the same run may be stored in several files: keep one
        runs = list({(r["spec"], r["seed"], r["switch_epoch"]): r for r in runs}.values())
        print_tables(runs, args.switch_epochs)
        if args.paired:
            print_paired(runs, args.switch_epochs, args.paired)
        if args.curve:
            print_curve(runs, args.switch_epochs)
        if args.series:
            print_series(runs, args.switch_epochs)
        return

    load_data()  # generate/cache once before forking
    jobs = []
    for spec in args.variants:
        v = parse_variant(spec)
        for seed in args.seeds:
            if v["r_to"] is None:  # no switch: one run, fine windows at every switch epoch
                jobs.append((spec, seed, None, list(args.switch_epochs), args.epochs))
            else:
                for e in args.switch_epochs:
                    jobs.append((spec, seed, e, [e], args.epochs))
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as ex:
            runs = list(ex.map(_job, jobs))
    else:
        runs = [_job(j) for j in jobs]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(runs, fh)
    print_tables(runs, args.switch_epochs)
    if args.paired:
        print_paired(runs, args.switch_epochs, args.paired)
    if args.curve:
        print_curve(runs, args.switch_epochs)
    if args.series:
        print_series(runs, args.switch_epochs)


if __name__ == "__main__":
    main()
