"""1-bit Adam's own exchange: after a 2-bit start, compress Adam's *momentum* at 1 bit with
``v`` frozen, instead of the gradient. Does the character transformer keep dense quality?

``frozen_variance_probe.py`` froze ``v`` at step ``FREEZE`` and went on compressing the
gradient at 1 bit: +1.3% and +3.0% of validation loss. 1-bit Adam (Tang et al., 2021)
exchanges the momentum instead: each worker folds its own gradient into the shared
momentum, ``m_w = b1 * m + (1 - b1) * g_w``, the ``m_w`` are compressed with error feedback
and averaged, and every worker takes the average as ``m``. With ``v`` frozen the update is
linear in ``m``, so error feedback bounds the parameters' drift by one step's error on
``m``, smaller than the gradient's because the momentum averages the noise.

Modes (``adam_noise_probe.py``'s loop and its ``corrected`` 2-bit start until ``FREEZE``):

* ``momentum1``: from ``FREEZE`` on, ``v`` frozen, the momentum at 1-bit ``nq``;
* ``momentum2``: the same at 2 bits (what exchanging the momentum costs by itself);

and beside them, on the same machine, plain AdamW ``dense``, ``dense-frozen`` (``v`` frozen
at ``FREEZE``) and ``grad1`` (``frozen_variance_probe``'s ``nq2to1-frozen``: the gradient
at 1 bit after the freeze, the same bytes as ``momentum1``).

From ``FREEZE`` on there is no averaged gradient to clip with, so each worker scales its
gradient by the true average's clip factor: one scalar per step, an oracle here, and the
run counts the steps on which it binds. ``momentum1-rms`` is ``momentum1`` without the
oracle: the factor clips the root mean square of the workers' own gradient norms, one
scalar each that a real exchange can average, and larger than the average's norm by the
gradients' noise. The momentum exchange starts with empty error
feedback (the gradient's residual at the switch is one step's and is dropped).

    PYTHONPATH=src:benchmarks/rule_signals .venv/bin/python \
        benchmarks/rule_signals/momentum_probe.py [--small] [seed ...]

``--small`` runs the probe at charlm-small's size: ``transformer-small``, 20,480 windows,
640 steps, lr 2e-3, the freeze at step 143 (the same share of the run), with the rows
``SMALL_MODES``, into ``momentum_probe_small.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import adam_noise_probe as noise_probe
import frozen_variance_probe as frozen_probe
import lm_probe as probe
import torch

from accordion.compress import ErrorFeedback, NormalQuantizer, Reducer
from accordion.models import get_model

FREEZE, FLOOR = 200, noise_probe.FLOOR
MODES = ("dense", "dense-frozen", "grad1", "momentum1", "momentum2", "momentum1-rms")
SMALL_MODES = ("dense", "dense-frozen", "momentum1-rms")
BITS_COST = {2: 2.25, 1: 1.25}  # bits per element on the wire, the block scale included
OUT = Path(__file__).resolve().parents[2] / "docs" / "results" / "momentum_probe.json"


def moment_exchange(reducers, locals_):
    """The compressed average of the workers' momenta (worker 0's copy)."""
    average, _ = noise_probe.averaged(reducers, locals_)
    return average


def run(mode: str, seed: int, data) -> dict:
    """One run of ``mode``, the references by the probes they come from."""
    if mode == "dense":
        return noise_probe.train("dense", seed, data)
    if mode in ("dense-frozen", "grad1"):
        return frozen_probe.run({"grad1": "nq2to1-frozen"}.get(mode, mode), seed, data)
    return train(mode, seed, data)


def train(mode: str, seed: int, data) -> dict:
    """One run of ``mode``: the 2-bit corrected start, then momentum exchanged at 1 or 2 bits."""
    torch.manual_seed(seed)
    model = get_model(noise_probe.MODEL, ntoken=len(data.vocabulary))
    params, order = list(model.parameters()), noise_probe.sample_order(seed, len(data.x_train))
    grad_reducers = [Reducer(NormalQuantizer(2), ErrorFeedback()) for _ in range(2)]
    for r in grad_reducers:
        r.noise.on = True
    bits = 2 if mode == "momentum2" else 1
    m_reducers = [Reducer(NormalQuantizer(bits), ErrorFeedback()) for _ in range(2)]
    m, v, s = ([torch.zeros_like(p) for p in params] for _ in range(3))
    (b1, b2), clipped, after = probe.BETAS, 0, [0.0, 0.0]
    for step in range(noise_probe.STEPS):
        lr = probe.lr_at(step, noise_probe.STEPS)
        idx = order[step * probe.BATCH : (step + 1) * probe.BATCH]
        grads, _ = probe.local_grads(model, params, data.x_train, data.y_train, idx)
        with torch.no_grad():
            if step < FREEZE:
                first_moment(m, v, s, grads, grad_reducers)
            else:
                tcoef = clip_after_freeze(mode, grads)
                clipped += tcoef < 1
                locals_ = [[b1 * mi + (1 - b1) * g * tcoef for mi, g in zip(m, gw)] for gw in grads]
                new = moment_exchange(m_reducers, locals_)
                true = [(a + b) / 2 * tcoef for a, b in zip(*grads)]
                noise_probe.update_error(after, [(n - b1 * mi) / (1 - b1) for n, mi in zip(new, m)],
                                         true)  # fmt: skip
                for mi, n in zip(m, new):
                    mi.copy_(n)
            t, tv = step + 1, min(step + 1, FREEZE)
            for i, p in enumerate(params):
                used = torch.maximum(v[i] - s[i], FLOOR * v[i])
                p.mul_(1 - lr * probe.WD)
                p.sub_(lr * (m[i] / (1 - b1**t)) / ((used / (1 - b2**tv)).sqrt() + probe.EPS))
    loss, accuracy = probe.evaluate(model, data.x_test, data.y_test)
    cost = FREEZE * BITS_COST[2] + (noise_probe.STEPS - FREEZE) * BITS_COST[bits]
    return {"val_loss": loss, "accuracy": accuracy, "clipped_after_freeze": clipped,
            "update_error_after_freeze": noise_probe.relative(after),
            "bytes_over_static2": cost / (noise_probe.STEPS * BITS_COST[2])}  # fmt: skip


def clip_after_freeze(mode: str, grads) -> float:
    """The clip factor after the freeze: the true average's (an oracle), or for
    ``momentum1-rms`` the root mean square of the workers' own norms."""
    if mode != "momentum1-rms":
        return noise_probe.clip_factor([(a + b) / 2 for a, b in zip(*grads)])
    squares = [float(sum(g.square().sum() for g in gw)) for gw in grads]
    return min(1.0, probe.CLIP / ((sum(squares) / len(squares)) ** 0.5 + 1e-6))


def first_moment(m, v, s, grads, reducers) -> None:
    """``adam_noise_probe``'s ``corrected`` step before the freeze: the 2-bit average folded
    into ``m`` and ``v``, and its predicted noise into ``s``."""
    sent, noise = noise_probe.averaged(reducers, grads)
    coef = noise_probe.clip_factor(sent)
    for i, g in enumerate(sent):
        g = g * coef
        noise_probe.fold(m[i], (v[i], s[i]), g, g * g, noise[i], coef)


def use_small() -> None:
    """The probe at charlm-small's size (see the module)."""
    global FREEZE, OUT
    noise_probe.MODEL, noise_probe.TRAIN_SAMPLES = "transformer-small", 20480
    noise_probe.STEPS = 640
    probe.LR, FREEZE = 2e-3, 143
    frozen_probe.FREEZE = FREEZE
    OUT = OUT.with_name("momentum_probe_small.json")


if __name__ == "__main__":
    modes = MODES
    if "--small" in sys.argv:
        sys.argv.remove("--small")
        use_small()
        modes = SMALL_MODES
    report = {"steps": noise_probe.STEPS, "freeze": FREEZE, "model": noise_probe.MODEL}
    noise_probe.run_seeds(run, modes, report, OUT)
