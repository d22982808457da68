"""Does 1-bit Adam's freeze of the second moment let the character transformer take 1-bit
``nq`` after a 2-bit start, and keep dense quality?

1-bit Adam (Tang et al., 2021) freezes Adam's ``v`` after a warm-up, so that the update
is linear in the gradient and error feedback compensates compression as under SGD. Here
two simulated workers train charlm-tiny's 896 steps with ``adam_noise_probe.py``'s loop
(Adam written out, the noise correction on while ``v`` moves), with ``v`` and the noise
estimate frozen from step ``FREEZE`` on. Modes, each against plain AdamW dense of the
same seed (``adam_noise_probe.py``'s ``dense``, and its ``corrected``, static 2-bit with
the correction, in ``docs/results/layer_allocation_probe.json``):

* ``dense-frozen``: dense, ``v`` frozen at ``FREEZE`` (what the freeze alone does);
* ``nq1-frozen``: 1-bit ``nq`` on every step, ``v`` frozen at ``FREEZE``;
* ``nq2to1-frozen``: 2-bit ``nq`` until ``FREEZE``, then 1 bit, ``v`` frozen there.

It prints the validation loss, the next-character accuracy, and the run's bytes over
static 2-bit's (the bits per element and the fp16 scale per block of 64: 2.25 and 1.25).

    PYTHONPATH=src:benchmarks/rule_signals .venv/bin/python \
        benchmarks/rule_signals/frozen_variance_probe.py [seed ...]
"""

from __future__ import annotations

from pathlib import Path

import adam_noise_probe as noise_probe

FREEZE = 200
MODES = ("dense-frozen", "nq1-frozen", "nq2to1-frozen")
BITS_COST = {2: 2.25, 1: 1.25}  # bits per element on the wire, the block scale included
OUT = Path(__file__).resolve().parents[2] / "docs" / "results" / "frozen_variance_probe.json"


def bits_from(start: int, switch: int | None):
    """A ``before_exchange`` that sets every tensor to ``start`` bits, then 1 bit from
    step ``switch`` (never when ``None``)."""

    def hook(step, reducers, grads):
        bits = {0: start, switch: 1}.get(step)
        if bits is not None:
            for reducer in reducers:
                reducer.compressor.set_level(bits, range(len(grads[0])))

    return hook


def run(mode: str, seed: int, data) -> dict:
    """One run of ``mode``; its bytes over static 2-bit's."""
    if mode == "dense-frozen":
        return noise_probe.train("dense", seed, data, freeze_at=FREEZE)
    start, switch = (1, None) if mode == "nq1-frozen" else (2, FREEZE)
    row = noise_probe.train("corrected", seed, data, before_exchange=bits_from(start, switch),
                            freeze_at=FREEZE)  # fmt: skip
    steps = noise_probe.STEPS
    first = steps if switch is None else switch
    cost = first * BITS_COST[start] + (steps - first) * BITS_COST[1]
    return {**row, "bytes_over_static2": cost / (steps * BITS_COST[2])}


if __name__ == "__main__":
    noise_probe.run_seeds(run, MODES, {"steps": noise_probe.STEPS, "freeze": FREEZE}, OUT)
