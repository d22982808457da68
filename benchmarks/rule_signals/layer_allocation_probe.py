"""Does L-GreCo's per-layer allocation keep the character transformer's quality under
AdamW, where it saves bytes?

``layer_allocation.py`` found that an allocation of ``nq`` bit widths within uniform 2-bit's
summed *absolute* squared error (L-GreCo's budget) sends 1.4-1.7x fewer bytes, by putting
almost every block matrix at 1 bit, and that within the *relative* budget nothing is saved.
This probe runs the allocation. Two simulated workers train charlm-tiny's 896 steps with
``adam_noise_probe.py``'s loop (Adam written out, the noise correction on). At the first
step of every window of 25, each worker compresses its error-fed accumulator
``g + e`` of every tensor at each width (one shot, nothing applied); the two workers'
squared errors are summed, and each tensor takes the width of the cheapest allocation
whose summed error is within that of 2 bits everywhere (``layer_allocation.allocate``).

Modes, each against ``dense`` of the same seed: ``corrected`` (static 2-bit, the best
static level on charlm-tiny) and ``lgreco`` (the allocation). It prints the validation
loss, the next-character accuracy, and the bytes of the run over uniform 2-bit's.

    PYTHONPATH=src:benchmarks/rule_signals .venv/bin/python \
        benchmarks/rule_signals/layer_allocation_probe.py [seed ...]
"""

from __future__ import annotations

from pathlib import Path

import adam_noise_probe as noise_probe
import layer_allocation as study

from accordion.audit import rung_gaps
from accordion.compress import compressor_class
from accordion.policy import Ladder

OUT = Path(__file__).resolve().parents[2] / "docs" / "results" / "layer_allocation_probe.json"
#: The widths as a ladder: what L-GreCo's measurement compresses each accumulator at.
LADDER = Ladder(compressor_class("nq"), study.BITS)


class Allocator:
    """The ``before_exchange`` of ``adam_noise_probe.train``: L-GreCo's allocation per
    window, and the bytes sent, per step, summed."""

    def __init__(self, shapes):
        self.shapes = shapes
        self.sizes = [[study.nq_bytes(s, b) for b in study.BITS] for s in shapes]
        self.bits = [study.REFERENCE] * len(shapes)
        self.sent = self.uniform = 0
        self.history: list[list[int]] = []

    def __call__(self, step, reducers, grads):
        if step % study.WINDOW == 0:
            errors = [[0.0] * len(study.BITS) for _ in self.shapes]
            keys = [str(k) for k in range(len(self.shapes))]
            for reducer, local in zip(reducers, grads):
                owed = [reducer.memory.get(k) for k in range(len(local))]
                accumulators = [g if e is None else g + e for g, e in zip(local, owed)]
                # |C(a) - a| per width and tensor, one shot, nothing remembered
                for j, gaps in enumerate(rung_gaps(LADDER, keys, accumulators, {})):
                    for k, gap in enumerate(gaps):
                        errors[k][j] += gap * gap
            budget = sum(row[study.BITS.index(study.REFERENCE)] for row in errors)
            _, _, picked = study.allocate(self.sizes, errors, budget)
            self.bits = [study.BITS[i] for i in picked]
            self.history.append(self.bits)
            for reducer in reducers:
                for k, b in enumerate(self.bits):
                    reducer.compressor.set_level(b, [k])
        ref = study.BITS.index(study.REFERENCE)
        self.sent += sum(row[study.BITS.index(b)] for row, b in zip(self.sizes, self.bits))
        self.uniform += sum(row[ref] for row in self.sizes)


def run(mode: str, seed: int, data) -> dict:
    """One run; with ``lgreco`` the allocation's bytes over uniform 2-bit's and widths."""
    if mode != "lgreco":
        return noise_probe.train(mode, seed, data)
    # the shapes only: train() seeds the generator again before it builds its own model
    shapes = [tuple(p.shape) for p in noise_probe.get_model(
        "transformer-tiny", ntoken=len(data.vocabulary)).parameters()]  # fmt: skip
    allocator = Allocator(shapes)
    row = noise_probe.train("corrected", seed, data, before_exchange=allocator)
    return {**row, "bytes_over_uniform2": allocator.sent / allocator.uniform,
            "bits": allocator.history}  # fmt: skip


if __name__ == "__main__":
    noise_probe.run_seeds(run, ("dense", "corrected", "lgreco"),
                          {"steps": noise_probe.STEPS, "window": study.WINDOW}, OUT,
                          lambda row: {k: v for k, v in row.items() if k != "bits"})  # fmt: skip
