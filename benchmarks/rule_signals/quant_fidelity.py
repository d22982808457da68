"""How closely does each quantiser's error-feedback average follow the true average of the
character transformer's gradients?

Two simulated workers train ``transformer-tiny`` densely (``lm_probe.py``'s setup: AdamW
3e-3, warm-up then cosine over charlm-tiny's 896 steps, clipping at 1). Along that one
trajectory a shadow reducer per level, with its own error-feedback memory, is fed the
same local gradients at every step, its output not applied. Per step it records the
relative error ``|g_hat - g_bar| / |g_bar|`` of the shadow average against the true one,
averaged over the tensors of >= 2 dimensions; the JSON has its mean per 50 steps.

    PYTHONPATH=src .venv/bin/python benchmarks/rule_signals/quant_fidelity.py [steps] [seed]

The reported run: 300 steps, seed 0 (``docs/results/quant_fidelity_lm.json``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lm_probe as probe
import numpy as np
import torch

from accordion.compress import Reducer, SimulatedTransport, make_compressor
from accordion.compress.memory import ErrorFeedback
from accordion.harness.data.charlm import load_charlm
from accordion.models import get_model

LEVELS = [("int", 8), ("int", 4), ("int", 2), ("nq", 4), ("nq", 3), ("nq", 2), ("nq", 1)]
#: The schedule's length: charlm-tiny's 2 epochs, whatever the steps probed.
SCHEDULE_STEPS = 896
EVERY = 50
OUT = Path(__file__).resolve().parents[2] / "docs" / "results" / "quant_fidelity_lm.json"


def main(steps: int, seed: int) -> dict:
    """Train densely for ``steps``; per level, the shadow's mean error per 50 steps."""
    torch.manual_seed(seed)
    data = load_charlm(28672, 1024, probe.BPTT)
    model = get_model("transformer-tiny", ntoken=len(data.vocabulary))
    params = list(model.parameters())
    index = [i for i, p in enumerate(params) if p.dim() >= 2]
    opt = torch.optim.AdamW(params, lr=probe.LR, betas=probe.BETAS, eps=probe.EPS,
                            weight_decay=probe.WD)  # fmt: skip
    shadows = {f"{n}{b}": [Reducer(make_compressor(n, b), ErrorFeedback()) for _ in range(2)]
               for n, b in LEVELS}  # fmt: skip
    errors: dict[str, list[float]] = {name: [] for name in shadows}
    perm = torch.from_numpy(np.random.RandomState(seed).permutation(len(data.x_train)))
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = probe.lr_at(step, SCHEDULE_STEPS)
        idx = perm[step * probe.BATCH : (step + 1) * probe.BATCH]
        grads, _ = probe.local_grads(model, params, data.x_train, data.y_train, idx)
        true = [(a + b) / probe.WORKERS for a, b in zip(*grads)]
        transport = SimulatedTransport(probe.WORKERS)
        for name, pairs in probe.shadow_step(shadows, transport, grads, true, index).items():
            errors[name].append(float(np.mean([error for error, _ in pairs])))
        norm = float(torch.cat([t.reshape(-1) for t in true]).norm())
        for p, t in zip(params, true):
            p.grad = t * min(1.0, probe.CLIP / (norm + 1e-6))
        opt.step()
    return {name: [float(np.mean(e[s : s + EVERY])) for s in range(0, steps, EVERY)]
            for name, e in errors.items()}  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    start = time.perf_counter()
    windows = main(steps, seed)
    report = {"steps": steps, "seed": seed, "every": EVERY, "relative_error": windows,
              "seconds": time.perf_counter() - start}  # fmt: skip
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    for name, values in windows.items():
        print(f"{name:5s} " + " ".join(f"{v:.3f}" for v in values))
