"""Why does 2-bit quantisation cost the character transformer quality under AdamW? An
oracle test of Adam's second moment.

Two simulated workers train ``transformer-tiny`` for charlm-tiny's 896 steps
(``lm_probe.py``'s setup: global batch 64, AdamW 3e-3 with betas (0.9, 0.95) and decay
0.1, warm-up then cosine, clipping at 1), their gradients averaged by RMS-scaled 2-bit
quantisation (``nq``) with error feedback, and Adam written out so that its second moment
can be fed something else:

* ``dense``: the true average, plain AdamW;
* ``plain``: the quantised average, plain AdamW;
* ``oracle``: the quantised average for the first moment and the step, but ``v`` fed the
  true (clipped) average: what the noise does through ``v`` alone;
* ``corrected``: ``v_used = max(v - s, 0.25 v)`` with ``s`` the moving average of the
  noise variance that the scales predict (``accordion.AdamNoiseCorrection``'s rule).

It prints the validation loss and next-character accuracy of each, and the measured
noise over the predicted one; the JSON goes to ``docs/results/adam_noise_probe.json``.

    PYTHONPATH=src .venv/bin/python benchmarks/rule_signals/adam_noise_probe.py [seed ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lm_probe as probe
import numpy as np
import torch

from accordion.compress import ErrorFeedback, NormalQuantizer, Reducer, SimulatedTransport
from accordion.harness.data.charlm import load_charlm
from accordion.models import get_model

STEPS, BITS, FLOOR = 896, 2, 0.25
MODEL, TRAIN_SAMPLES = "transformer-tiny", 28672  # charlm-tiny's (momentum_probe.py: --small)
MODES = ("dense", "plain", "oracle", "corrected")
OUT = Path(__file__).resolve().parents[2] / "docs" / "results" / "adam_noise_probe.json"


def averaged(reducers, grads):
    """The quantised average of the two workers' ``grads`` and its predicted noise."""
    copies = [[g.clone() for g in gw] for gw in grads]
    keys = list(range(len(copies[0])))
    SimulatedTransport(2).run([r.exchange(keys, c, 2) for r, c in zip(reducers, copies)])
    reducer = reducers[0]
    noise = [reducer.noise.variance(k, reducer.compressor, True) for k in keys]
    return copies[0], [torch.zeros_like(c) if n is None else n for c, n in zip(copies[0], noise)]


def clip_factor(tensors) -> float:
    return min(1.0, probe.CLIP / (float(torch.cat([t.reshape(-1) for t in tensors]).norm()) + 1e-6))


def train(mode: str, seed: int, data, before_exchange=None, freeze_at=None) -> dict:
    """One run of ``mode``; its validation loss, accuracy and measured / predicted noise.
    ``before_exchange(step, reducers, grads)``, if given, runs before each step's exchange
    (``layer_allocation_probe.py`` sets each tensor's bits there); from step ``freeze_at``
    on, if given, Adam's ``v`` and the noise estimate stop updating (1-bit Adam's freeze,
    ``frozen_variance_probe.py``), and the row adds the relative error of the clipped
    gradient Adam takes in after it, against the clipped true average."""
    torch.manual_seed(seed)
    model = get_model(MODEL, ntoken=len(data.vocabulary))
    params = list(model.parameters())
    order = sample_order(seed, len(data.x_train))
    reducers = [Reducer(NormalQuantizer(BITS), ErrorFeedback()) for _ in range(2)]
    for r in reducers:
        r.noise.on = True
    m, v, s = ([torch.zeros_like(p) for p in params] for _ in range(3))
    (b1, b2), measured, predicted, after = probe.BETAS, 0.0, 0.0, [0.0, 0.0]
    for step in range(STEPS):
        lr = probe.lr_at(step, STEPS)
        idx = order[step * probe.BATCH : (step + 1) * probe.BATCH]
        grads, _ = probe.local_grads(model, params, data.x_train, data.y_train, idx)
        true = [(a + b) / 2 for a, b in zip(*grads)]
        if before_exchange is not None and mode != "dense":
            before_exchange(step, reducers, grads)
        sent, noise = (true, [torch.zeros_like(t) for t in true]) if mode == "dense" else \
            averaged(reducers, grads)  # fmt: skip
        measured += sum(float((a - t).square().sum()) for a, t in zip(sent, true))
        predicted += sum(float(x.sum()) for x in noise)
        coef, tcoef = clip_factor(sent), clip_factor(true)
        if freeze_at is not None and step >= freeze_at:  # the error Adam's step takes in
            update_error(after, [a * coef for a in sent], [t * tcoef for t in true])
        with torch.no_grad():
            for i, p in enumerate(params):
                g = sent[i] * coef
                second = (true[i] * tcoef) ** 2 if mode == "oracle" else g * g
                frozen = freeze_at is not None and step >= freeze_at
                fold(m[i], None if frozen else (v[i], s[i]), g, second, noise[i], coef)
                used = torch.maximum(v[i] - s[i], FLOOR * v[i]) if mode == "corrected" else v[i]
                t = step + 1
                tv = t if freeze_at is None else min(t, freeze_at)  # v's own step count
                p.mul_(1 - lr * probe.WD)
                p.sub_(lr * (m[i] / (1 - b1**t)) / ((used / (1 - b2**tv)).sqrt() + probe.EPS))
    loss, accuracy = probe.evaluate(model, data.x_test, data.y_test)
    ratio = measured / predicted if predicted else None
    row = {"val_loss": loss, "accuracy": accuracy, "noise_measured_over_predicted": ratio}
    return row if freeze_at is None else {**row, "update_error_after_freeze": relative(after)}


def fold(m, second_moments, g, second, noise, coef) -> None:
    """One tensor's Adam moments: ``g`` into ``m``; unless ``second_moments`` is ``None``
    (``v`` frozen), ``second`` into its ``v`` and the predicted ``noise`` (scaled by the
    clip ``coef`` squared) into its ``s``."""
    b1, b2 = probe.BETAS
    m.mul_(b1).add_(g, alpha=1 - b1)
    if second_moments is not None:
        v, s = second_moments
        v.mul_(b2).add_(second, alpha=1 - b2)
        s.mul_(b2).add_(noise, alpha=(1 - b2) * coef**2)


def sample_order(seed: int, n: int) -> torch.Tensor:
    """The probes' sample order over ``n`` windows: one seeded permutation per epoch."""
    return torch.cat([torch.from_numpy(np.random.RandomState(seed * 100 + e).permutation(n))
                      for e in range(STEPS * probe.BATCH // n + 1)])  # fmt: skip


def update_error(sums: list[float], got, want) -> None:
    """Add ``|got - want|^2`` and ``|want|^2``, summed over the tensors, to ``sums``."""
    sums[0] += sum(float((g - w).square().sum()) for g, w in zip(got, want))
    sums[1] += sum(float(w.square().sum()) for w in want)


def relative(sums: list[float]) -> float | None:
    """The relative error ``sqrt(sum |got - want|^2 / sum |want|^2)`` of ``update_error``'s sums."""
    return (sums[0] / sums[1]) ** 0.5 if sums[1] else None


def run_seeds(run, modes, report: dict, out: Path, shown=lambda row: row) -> None:
    """For each seed on the command line (default 0), each of ``modes`` by
    ``run(mode, seed, data)``: each row printed as ``shown(row)``, all written to ``out``
    after the settings in ``report``."""
    torch.set_num_threads(1)
    seeds = [int(a) for a in sys.argv[1:]] or [0]
    data = load_charlm(TRAIN_SAMPLES, 1024, probe.BPTT)
    report = {**report, "runs": []}
    for seed in seeds:
        for mode in modes:
            start = time.perf_counter()
            row = {"seed": seed, "mode": mode, **run(mode, seed, data),
                   "seconds": time.perf_counter() - start}  # fmt: skip
            report["runs"].append(row)
            print(json.dumps(shown(row)), flush=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    run_seeds(train, MODES, {"steps": STEPS, "bits": BITS, "floor": FLOOR}, OUT)
