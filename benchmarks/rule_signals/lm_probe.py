"""Why is Accordion's norm test blind on a character transformer with AdamW, and which
signal would see the quality PowerSGD loses there?

Two simulated workers train ``transformer-tiny`` on ``charlm`` (global batch 64 windows of
64 characters, 32 per worker, each a contiguous half of the batch; AdamW lr 3e-3, betas
(0.9, 0.95), weight decay 0.1, 5 % linear warm-up then cosine to 10 %; the averaged
gradient clipped to norm 1). One run per static level (dense, PowerSGD ranks, bf16, int8),
all from one seed and one data order. Per compressed tensor (>= 2-D) it records:

* shadows (dense run only): per level, a reducer with its own error-feedback memory fed
  the same local gradients every step, its output not applied; per step the relative
  error ``|g_hat - g_bar| / |g_bar|`` and cos(g_hat, g_bar) against the true average;
* audit (every run): the same two numbers for the step the run really applied (every
  step; a real system would see it every K = 25 steps, at each window's first step);
* the norm test: per window of 25 steps ``|G|`` (G = sum of rank 0's local gradients,
  raw, after the step's clip factor, and of the clipped applied updates) and
  ``r = | |G_t| - |G_t-1| | / |G_t-1|`` (critical when >= 0.5);
* AdamW state: ``|v|`` and ``|m|`` at each window's end (ratios to dense afterwards),
  and, in compressed runs, a shadow Adam state fed the true (clipped) average along the
  same trajectory: ``|v| / |v_shadow|`` and cos of the two update directions
  ``m_hat / (sqrt(v_hat) + eps)`` per step;
* validation loss and next-character accuracy every 50 steps.

Everything it prints goes to ``docs/results/rule_signals_lm.json``.

    PYTHONPATH=src .venv/bin/python benchmarks/rule_signals/lm_probe.py [steps] [seed]

The reported run: 500 steps, seed 0 (10 CPU-minutes on one thread; 14 minutes of wall
time on a shared 2-core machine).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from accordion.compress import Reducer, SimulatedTransport, make_compressor
from accordion.compress.memory import ErrorFeedback
from accordion.harness.data.charlm import load_charlm
from accordion.models import get_model

WORKERS, BATCH, BPTT, WINDOW, EVAL_EVERY, TEST = 2, 64, 64, 25, 50, 1024
LR, BETAS, WD, EPS, CLIP = 3e-3, (0.9, 0.95), 0.1, 1e-8, 1.0
SHADOW_LEVELS = [("powersgd", 1), ("powersgd", 2), ("powersgd", 4), ("powersgd", 16),
                 ("half", "bf16"), ("int", 8), ("int", 4)]  # fmt: skip
RUN_LEVELS = [None, ("powersgd", 2), ("powersgd", 4), ("powersgd", 16), ("half", "bf16"),
              ("int", 8)]  # fmt: skip
GROUPS = {"token": "embedding", "position": "embedding", "qkv": "attn_qkv",
          "proj": "attn_proj", "fc": "mlp_fc", "out": "mlp_out"}  # fmt: skip
OUT = Path(__file__).resolve().parents[2] / "docs" / "results" / "rule_signals_lm.json"


def label(level) -> str:
    return "dense" if level is None else f"{level[0]}-{level[1]}"


def group_of(key: str) -> str:
    return next(g for part, g in GROUPS.items() if part in key.split("."))


def lr_at(step: int, steps: int) -> float:
    warm = max(1, round(0.05 * steps))
    if step < warm:
        return LR * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def local_grads(model, params, x, y, idx):
    """Each worker's gradient on its contiguous half of the batch ``idx``, and the loss."""
    shard, grads, loss_sum = len(idx) // WORKERS, [], 0.0
    for w in range(WORKERS):
        part = idx[w * shard : (w + 1) * shard]
        model.zero_grad(set_to_none=True)
        logits = model(x[part])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[part].reshape(-1))
        loss.backward()
        loss_sum += float(loss.detach()) / WORKERS
        grads.append([p.grad.detach().clone() for p in params])
    return grads, loss_sum


def fidelity(est, true, index):
    """Per compressed tensor, (relative error, cosine) of ``est`` against ``true``."""
    out = []
    for i in index:
        a, b = est[i].reshape(-1), true[i].reshape(-1)
        out.append((float((a - b).norm() / b.norm()), float(F.cosine_similarity(a, b, dim=0))))
    return out


def shadow_average(reducers, transport, grads):
    """Worker 0's average from one shadow reducer per worker, fed copies of ``grads``."""
    copies = [[g.clone() for g in gw] for gw in grads]
    transport.run([r.exchange(list(range(len(gw))), c, WORKERS)
                   for r, c, gw in zip(reducers, copies, grads)])  # fmt: skip
    return copies[0]


def shadow_step(shadows, transport, grads, true, index):
    """Feed every shadow reducer pair copies of the local gradients; their fidelity."""
    return {name: fidelity(shadow_average(reducers, transport, grads), true, index)
            for name, reducers in shadows.items()}  # fmt: skip


def adam_direction(m, v, step):
    """AdamW's update direction (without lr and decay) from its moments after ``step``."""
    bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    return (m / bc1) / ((v / bc2).sqrt() + EPS)


def shadow_adam(state, params, true, coef, opt, step, index):
    """Advance the shadow Adam state with the clipped true average ``true * coef``;
    per compressed tensor, cos(run's direction, shadow's) and |v_run| / |v_shadow|."""
    cos, vratio = [], []
    for i, p in enumerate(params):
        m, v = state.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
        g = true[i] * coef
        m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
        v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
        if i in index:
            s = opt.state[p]
            a = adam_direction(s["exp_avg"], s["exp_avg_sq"], step).reshape(-1)
            b = adam_direction(m, v, step).reshape(-1)
            cos.append(float(F.cosine_similarity(a, b, dim=0)))
            vratio.append(float(s["exp_avg_sq"].norm() / v.norm()))
    return cos, vratio


@torch.no_grad()
def evaluate(model, xt, yt):
    loss, correct = 0.0, 0
    for s in range(0, len(xt), 256):
        logits = model(xt[s : s + 256])
        loss += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                      yt[s : s + 256].reshape(-1), reduction="sum"))  # fmt: skip
        correct += int((logits.argmax(-1) == yt[s : s + 256]).sum())
    return loss / yt.numel(), 100.0 * correct / yt.numel()


def make_reducers(level, seed):
    return [Reducer(make_compressor(level[0], level[1], seed=seed) if level[0] == "powersgd"
                    else make_compressor(level[0], level[1]), ErrorFeedback())
            for _ in range(WORKERS)]  # fmt: skip


def new_record(keys):
    return {"keys": keys, "steps": [], "windows": [], "eval": []}


def step_record(rec, true, delivered, coef, loss, index, extra):
    """Per-step figures: loss, clip factor, the audit, the shadows' and Adam's signals."""
    row = {"loss": loss, "clip": coef, "audit": fidelity(delivered, true, index), **extra}
    rec["steps"].append(row)


def window_end(rec, acc, opt, params, index):
    """Close a window: |G| raw, clipped, applied per tensor, and |v|, |m| per tensor."""
    row = {kind: [float(acc[kind][j].norm()) for j in range(len(index))] for kind in acc}
    row["v"] = [float(opt.state[params[i]]["exp_avg_sq"].norm()) for i in index]
    row["m"] = [float(opt.state[params[i]]["exp_avg"].norm()) for i in index]
    rec["windows"].append(row)


def train(level, steps, seed, data, shadows_on):
    """One run at static ``level`` (``None``: dense); returns its record."""
    torch.manual_seed(seed)
    model = get_model("transformer-tiny", ntoken=70)
    names, params = zip(*model.named_parameters())
    index = [i for i, p in enumerate(params) if p.dim() >= 2]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    transport = SimulatedTransport(WORKERS)
    reducers = make_reducers(level, seed) if level else None
    shadows = {label(lv): make_reducers(lv, seed) for lv in SHADOW_LEVELS} if shadows_on else {}
    perm = torch.from_numpy(np.random.RandomState(seed).permutation(len(data.x_train)))
    rec, adam_state, acc = new_record([names[i] for i in index]), {}, {}
    for step in range(steps):
        if step % WINDOW == 0:
            acc = {k: [torch.zeros_like(params[i]) for i in index] for k in ("raw", "clip", "app")}
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps)
        idx = perm[step * BATCH : (step + 1) * BATCH]
        grads, loss = local_grads(model, params, data.x_train, data.y_train, idx)
        true = [(a + b) / WORKERS for a, b in zip(*grads)]
        local0 = [grads[0][i].clone() for i in index]
        extra = {"shadow": shadow_step(shadows, transport, grads, true, index)}
        if reducers:
            transport.run([r.exchange(list(range(len(params))), g, WORKERS)
                           for r, g in zip(reducers, grads)])  # fmt: skip
        delivered = grads[0] if reducers else true
        coef = min(1.0, CLIP / (float(torch.cat([d.reshape(-1) for d in delivered]).norm()) + 1e-6))
        for p, d in zip(params, delivered):
            p.grad = d * coef
        opt.step()
        if reducers:
            tcoef = min(1.0, CLIP / (float(torch.cat([t.reshape(-1) for t in true]).norm()) + 1e-6))
            cos, vr = shadow_adam(adam_state, params, true, tcoef, opt, step + 1, index)
            extra.update(adam_cos=cos, adam_vratio=vr)
        step_record(rec, true, delivered, coef, loss, index, extra)
        for j, i in enumerate(index):
            acc["raw"][j] += local0[j]
            acc["clip"][j] += local0[j] * coef
            acc["app"][j] += delivered[i] * coef
        if (step + 1) % WINDOW == 0:
            window_end(rec, acc, opt, params, index)
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == steps:
            rec["eval"].append([step + 1, *evaluate(model, data.x_test, data.y_test)])
    return rec


def by_group(values, keys):
    """Mean over the tensors of each layer group of per-tensor ``values``."""
    out: dict[str, list[float]] = {}
    for v, k in zip(values, keys):
        out.setdefault(group_of(k), []).append(v)
    return {g: float(np.mean(vs)) for g, vs in out.items()}


def fidelity_windows(rows, keys, steps):
    """Per window and per group, the mean (relative error, cosine) of per-step ``rows``
    (each a list of per-tensor pairs); ``steps`` picks which steps count."""
    windows = []
    for start in range(0, len(rows), WINDOW):
        picked = [rows[s] for s in range(start, min(start + WINDOW, len(rows))) if s in steps]
        err = np.mean([[e for e, _ in r] for r in picked], axis=0)
        cos = np.mean([[c for _, c in r] for r in picked], axis=0)
        windows.append({"err": by_group(err, keys), "cos": by_group(cos, keys),
                        "err_all": float(err.mean()), "cos_all": float(cos.mean())})  # fmt: skip
    return windows


def phases(windows):
    """Early (first 2 windows) vs later means of each per-group figure."""
    out = {}
    for name, part in (("early", windows[:2]), ("later", windows[2:])):
        if not part:
            continue
        out[name] = {m: {g: float(np.mean([w[m][g] for w in part])) for g in part[0][m]}
                     for m in ("err", "cos")}  # fmt: skip
    return out


def norm_test(windows, keys, kind):
    """Per window, per tensor ``|G|`` of ``kind`` and the ratio r; the flagged windows."""
    norms = np.array([w[kind] for w in windows])  # [windows, tensors]
    r = np.abs(norms[1:] - norms[:-1]) / norms[:-1]
    flagged = [[int(t + 1), keys[j]] for t, j in zip(*np.nonzero(r >= 0.5))]
    return {"norm_total": [float(np.sqrt((n**2).sum())) for n in norms],
            "r_by_group": [by_group(row, keys) for row in r],
            "r_max": [float(row.max()) for row in r],
            "flagged": flagged,
            "flagged_after_warmup": sum(1 for t, _ in flagged if t >= 2)}  # fmt: skip


def adam_summary(rec, dense, keys):
    """Per window and group: |v|, |m| against the dense run's at the same step, and (along
    the run's own trajectory) |v| / |v_shadow| and cos of the update directions."""
    out = {"v_vs_dense": [], "m_vs_dense": [], "v_vs_shadow": [], "dir_cos": []}
    for t, (w, d) in enumerate(zip(rec["windows"], dense["windows"])):
        out["v_vs_dense"].append(by_group(np.array(w["v"]) / np.array(d["v"]), keys))
        out["m_vs_dense"].append(by_group(np.array(w["m"]) / np.array(d["m"]), keys))
        rows = rec["steps"][t * WINDOW : (t + 1) * WINDOW]
        out["v_vs_shadow"].append(by_group(np.mean([r["adam_vratio"] for r in rows], 0), keys))
        out["dir_cos"].append(by_group(np.mean([r["adam_cos"] for r in rows], 0), keys))
    return out


def summarize(records, steps, seconds):
    """The JSON report: setup, shadows, audits, norm tests, Adam state, evaluations."""
    dense = records["dense"]
    keys, every, audit_steps = dense["keys"], set(range(steps)), set(range(0, steps, WINDOW))
    report = {"setup": {"steps": steps, "workers": WORKERS, "global_batch": BATCH, "bptt": BPTT,
                        "window": WINDOW, "lr": LR, "betas": BETAS, "weight_decay": WD,
                        "clip": CLIP, "warmup_steps": max(1, round(0.05 * steps)),
                        "test_windows": TEST, "keys": keys, "seconds": seconds}}  # fmt: skip
    shadow = {}
    for name in dense["steps"][0]["shadow"]:
        wins = fidelity_windows([r["shadow"][name] for r in dense["steps"]], keys, every)
        shadow[name] = {"windows": wins, "phases": phases(wins)}
    report["shadow_on_dense"] = shadow
    report["runs"] = {}
    for name, rec in records.items():
        audit = [r["audit"] for r in rec["steps"]]
        per_window = {f: [float(np.mean([r[f] for r in rec["steps"][s : s + WINDOW]]))
                          for s in range(0, steps, WINDOW)] for f in ("loss", "clip")}  # fmt: skip
        run = {"eval": rec["eval"],
               "norm_test": {k: norm_test(rec["windows"], keys, k) for k in ("raw", "clip", "app")},
               "train_loss_windows": per_window["loss"],
               "clip_factor_windows": per_window["clip"]}  # fmt: skip
        if name != "dense":
            wins = fidelity_windows(audit, keys, every)
            run["audit_every_step"] = {"windows": wins, "phases": phases(wins)}
            sampled = fidelity_windows(audit, keys, audit_steps)
            run["audit_every_K"] = [w["err_all"] for w in sampled]
            run["adam"] = adam_summary(rec, dense, keys)
        report["runs"][name] = run
    return report


def main(steps: int, seed: int) -> None:
    torch.set_num_threads(1)
    data = load_charlm(steps * BATCH, TEST, BPTT)
    records, started = {}, time.perf_counter()
    for level in RUN_LEVELS:
        t0 = time.perf_counter()
        records[label(level)] = train(level, steps, seed, data, shadows_on=level is None)
        final = records[label(level)]["eval"][-1]
        print(
            f"{label(level):14s} val loss {final[1]:.4f} acc {final[2]:.2f} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    report = summarize(records, steps, time.perf_counter() - started)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    main(*args, *[500, 0][len(args) :])
