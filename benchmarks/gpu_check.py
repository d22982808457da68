"""The GPU check: is the Accordion hook correct on CUDA (NCCL), and what does it cost there?

One process, world size 1, one device (``cuda:0``, NCCL; or the CPU with gloo). It prints
three tables, the checks (model, dtype, check, value, PASS/FAIL), the step times and the
two-phase exchange's compute rate, writes them as JSON with ``--json PATH``, and exits
with 1 when any check fails.

    PYTHONPATH=src .venv/bin/python benchmarks/gpu_check.py --json runs/gpu_check.json
    PYTHONPATH=src .venv/bin/python benchmarks/gpu_check.py --device cpu --quick   # ~30 s

**Correctness.** A small CNN (4-D, 2-D and 1-D gradients spread over several DDP
buckets) trains 8 steps under DDP with the hook (``state.register(DDP(net))``), for
PowerSGD 4/2/1, top-k 0.99/0.1/0.01 and half precision fp16/bf16, in fp32 and in bf16
(the model ``.to(torch.bfloat16)``). A rule that climbs one rung per epoch (epochs of 2
steps) makes every case visit every level of its ladder. A tensor hook on each parameter
copies its local gradient as autograd produces it, before DDP sees it: the exact input of
the exchange. The same inputs then go, step by step, through two references that run
the same controller without DDP, ``state.reduce_gradients()``:

* on the same device, over the process group: the DDP path (buckets, futures chained
  from completion callbacks, the bucket buffer written back) must give the loop path's
  result; both do the same arithmetic on the same device;
* on the CPU with no process group at all (``LocalTransport``; such a state is built
  before the group exists, and ``transport()`` keeps the transport it first chose): the
  device's arithmetic must give the CPU's.

With world size 1 the "average" is the compressed-decompressed gradient with error
feedback, so every step checks compression, decompression, the memory and (PowerSGD) the
warm start carried from the previous step. Both references decide levels too; each
epoch's levels must be the hook's. Errors are norm-wise, ``|out - ref| / |ref|`` per
tensor, the largest over tensors and steps. The correctness runs use IEEE fp32 matmuls
(no TF32) and bf16 matmuls reduced in fp32 (reduced-precision split-K, emulated with bf16
partial sums, alone drifted by 0.16 in 8 steps), so that the devices' compression
arithmetic differs by summation order only. Tolerances:

* fp32: 1e-3. Summation order moves the last bits (~1e-7 relative), but error feedback
  and the warm start carry each step's difference into the next and PowerSGD's
  Gram-Schmidt amplifies it: emulated on the CPU (every fp32 matmul of PowerSGD
  jittered by 1e-7 relative, 6 seeds), the hook and the reference drifted apart by up
  to 4e-5 in 8 steps, by 2e-4 with 1e-6 jitter;
* bf16: 5e-2. bf16 keeps 8 significant bits (one rounding: up to 2^-8 = 0.4%), so an
  order difference in an fp32 accumulator flips a bf16 result by one unit here and
  there, and error feedback grows that: the same emulation (jitter 3e-7 to 3e-6 before
  the bf16 rounding) drifted by 0.6e-2 to 1.3e-2 in 8 steps, whatever the jitter.

Either leaves a margin of 4x or more, and a stale, zeroed or unsynchronised gradient, or
a lost error-feedback memory, is off by ~1 (a hook whose memory updates were dropped
scored 1.08). The value also gives step 1's error, which carries nothing from before.

Top-k in bf16 runs at a static 0.99: bf16 magnitudes tie often, CPU and CUDA break ties
at the k-th value differently (both correct), and at 0.1 that alone moves the result by
~10% (measured with an emulated tie order); at 0.99 the tied entries are tiny (~1e-4).

The quantisers (int8, int4, nq2) on the device: per quantiser, a matrix of 300 x 1000
(40 x 1000 with ``--quick``; rows of 15 whole blocks and a partial one, scaled unevenly)
drawn on the CPU goes through ``encode`` and ``decode`` on the device and on the CPU; the
CPU's packed bytes are decoded on the device; and ``two_phase_exchange`` runs for 2
rounds (the owners' server errors carried from the first to the second) on one worker
(``LocalTransport``) and on four (``SimulatedTransport``), each worker with the matrix
and a vector of 1001. The device's codes, scales, residuals, decoded values, averages
and server errors must be the CPU's: ``"bitwise"`` where they are, else within
:data:`CODEC_TOLERANCE` = 1e-4 of the input's norm (``|device - CPU| / |input|``, the
worst tensor) with at most :data:`CODEC_FLIPS` = 0.1% of the code bytes or scales
different. The integer quantiser should be bitwise (a block's maximum is exact, the
division and products are IEEE); the RMS-scaled one sums squares in an order that
differs by device, which can round a block's fp16 scale the other way (one fp16 step,
2^-10) and re-code that block: ~1e-5 for a few blocks in 5,000. A wrong code or a lost
residual is off by the block's step (~1e-2 of the input) or more.

Streams and futures (CUDA): each case runs again with forward, backward and the
optimizer step inside ``torch.cuda.stream(side)``: its result must be the loop path's
for its own local gradients, and (cuDNN is made deterministic) the default stream run's.
In every run a copy of the gradients is taken on the current stream as soon as
``backward()`` returns, with no synchronisation: it must equal the gradients after
``torch.cuda.synchronize()`` (DDP must have waited on the hook's future, and the hook's
kernels must be ordered before that stream's later work), and they must be finite. A
hook whose work raced the stream would also leave stale gradients, which the references
catch.

**Speed.** ResNet-18 (``accordion.models``; CIFAR input 3x32x32, batch 128), a
ResNet-50-sized bottleneck network (defined here: torchvision is not needed; the CIFAR
layout, 23.5 M parameters), and a GPT-2-small-sized transformer (defined here: 12 layers,
d_model 768, 12 heads, sequence 512, vocabulary 50257, tied embedding; 124 M parameters;
batch 8), in fp32 with PyTorch's default precision settings, SGD with momentum. Per
configuration: dense DDP, our static PowerSGD rank 4, PyTorch's ``powerSGD_hook`` rank
4 (``start_powerSGD_iter=2``; ``min_compression_rate=1``: it compresses every matrix on
which rank 4 sends less than dense, which is every matrix of these models, as ours does;
error feedback and warm start), our Accordion 4/2/1 (the guarded rule, gathering
its statistic every step), PyTorch's ``bf16_compress_hook`` (on the CPU under another
name: DDP refuses it by name without NCCL) and our static int8 in two phases
(``AccordionState(net, "int", mild=8, aggressive=8, collective="two_phase")``; where the
state takes no ``collective``, ``"int"`` alone, which all-gathers at world size 1). At
world size 1 the collectives move nothing: the times are the hooks' compute and launch
overhead. The step time is
forward + backward with the hook + optimizer step, from CUDA events recorded at every
step boundary (so gaps where the GPU waits for Python count), median over ``--steps``
steps after ``--warmup``, in ``--reps`` rounds that interleave the configurations.
Rows of the checks table say that each of the three hooks did compress (floats sent
against dense: a hook that fell back to dense would make its timing moot).

**Two-phase compute.** In one process on the device, ``two_phase_exchange`` of
``--compute-numel`` fp32 elements a worker (25 M; 65,536 with ``--quick``) for W = 4
and 8 workers through a ``SimulatedTransport``: every worker's quantisation, the owners'
decoding, fp32 sum and re-quantisation, and every worker's decoding of the gathered
averages, one worker after the other (the collectives are the transport's copies of the
compressed bytes). The rate is GB/s of input, ``W x numel x 4`` bytes over the median
time of 10 exchanges (2 with ``--quick``) after one, next to ``copy_`` of one worker's
buffer (its 4 bytes an element read, over the time): what a worker's compute costs for
each byte of gradient, at any W.

**Budget** (H200, estimated; there was no GPU to measure it on): CUDA and NCCL start-up
~15 s; the correctness cases ~20 s (12 DDP runs of 8 steps of a tiny model and 18
replays through the references, a few ms per step: they are launch-bound); the codec
checks ~2 s; the compute table, 6 rows x 11 exchanges of W x 100 MB at >= 100 GB/s:
< 10 s; the speed part, 3 models x 6 configurations x 2 rounds x (5 + 30) steps at
<= 25 ms (ResNet-18), <= 60 ms (ResNet-50) and <= 120 ms (GPT-2, fp32 matmuls) per step:
2 x 35 x 6 x 0.2 s = 85 s, plus ~1 s to build each of the 36 models: under 3 minutes in
all. ``--budget``
(default 240 s) skips the speed configurations not started by then, and ``--timeout``
(default 290 s) ends a hung run with a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import inspect
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.compress import LocalTransport, SimulatedTransport, compressor_names
from accordion.compress.normalquant import NormalQuantizer
from accordion.compress.quantize import IntQuantizer
from accordion.compress.two_phase import two_phase_exchange
from accordion.ddp import AccordionState
from accordion.models import get_model
from accordion.policy import Ladder, Observation, Rule

#: Norm-wise relative error allowed against a reference, per dtype (see the docstring).
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
CHECK_STEPS = 8  # 4 epochs of 2 steps: the climbing rule visits every rung of a 3-level ladder
STEPS_PER_EPOCH = 2
LR = 0.05
SPEED_CONFIGS = ("dense DDP", "ours PowerSGD r4", "torch powerSGD_hook r4", "ours Accordion 4,2,1",
                 "torch bf16_compress_hook", "ours int8 two-phase")  # fmt: skip
#: The speed table's ratio columns: (configuration, the torch hook it is set against).
SPEED_RATIOS = (("ours PowerSGD r4", "torch powerSGD_hook r4"),
                ("ours Accordion 4,2,1", "torch powerSGD_hook r4"),
                ("ours int8 two-phase", "torch bf16_compress_hook"))  # fmt: skip
#: How "ours int8 two-phase" travels: in two phases where the state takes a ``collective``
#: (at world size 1 "auto" would all-gather, which sends nothing either; the two phases'
#: arithmetic is then still timed on the device by the compute table).
INT8_COLLECTIVE = ("two_phase" if "collective" in inspect.signature(AccordionState).parameters
                   else "auto")  # fmt: skip
#: The quantisers of the codec checks and the compute table: (class, bit width).
CODECS = ((IntQuantizer, 8), (IntQuantizer, 4), (NormalQuantizer, 2))
#: Largest difference allowed between a quantiser's device and CPU results, relative to
#: the input's norm (see the docstring); and the fraction of code bytes or scales that may
#: differ (a scale rounded across an fp16 boundary re-codes its block).
CODEC_TOLERANCE = 1e-4
CODEC_FLIPS = 1e-3
PASS, FAIL = "PASS", "FAIL"
#: Workers simulated on one device by the compute table.
COMPUTE_WORLDS = (4, 8)


# --- results -------------------------------------------------------------------------------


@dataclass
class Report:
    """The checks, the speed rows and the two-phase compute rows, as printed and as
    written to JSON."""

    checks: list[dict[str, Any]] = field(default_factory=list)
    speed: list[dict[str, Any]] = field(default_factory=list)
    compute: list[dict[str, Any]] = field(default_factory=list)

    def check(self, model: str, dtype: str, name: str, value: str, ok: bool) -> None:
        self.checks.append({"model": model, "dtype": dtype, "check": name, "value": value,
                            "status": PASS if ok else FAIL})  # fmt: skip

    @property
    def passed(self) -> bool:
        return all(row["status"] == PASS for row in self.checks)


def relative_error(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> float:
    """The largest ``|actual - expected| / |expected|`` over the tensors (Frobenius norms,
    in float64 on the CPU). A missing tensor, a shape mismatch or a non-finite value is
    ``inf``; a zero reference gives 0 when ``actual`` is zero too, else ``inf``."""
    if set(actual) != set(expected):
        return math.inf
    worst = 0.0
    for key, ref in expected.items():
        out = actual[key]
        if out.shape != ref.shape:
            return math.inf
        out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
        diff = torch.linalg.vector_norm(out - ref).item()
        scale = torch.linalg.vector_norm(ref).item()
        if not (math.isfinite(diff) and math.isfinite(scale)):
            return math.inf
        error = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        worst = max(worst, error)
    return worst


def within(error: float, tolerance: float) -> bool:
    """Whether a relative error passes: finite and at most ``tolerance``."""
    return math.isfinite(error) and error <= tolerance


def step_errors(actual: Sequence[Mapping], expected: Sequence[Mapping]) -> list[float]:
    """:func:`relative_error` per step; ``[inf]`` when the runs differ in length."""
    if len(actual) != len(expected) or not actual:
        return [math.inf]
    return [relative_error(a, e) for a, e in zip(actual, expected)]


def compare(actual: Sequence[Mapping], expected: Sequence[Mapping],
            tolerance: float) -> tuple[str, bool]:  # fmt: skip
    """A check's value and verdict: the worst step's error against ``tolerance``, and the
    first step's, which carries nothing from earlier steps (error feedback and the warm
    start carry differences on and amplify them)."""
    errors = step_errors(actual, expected)
    worst = max(errors)
    return f"{worst:.1e} (step 1: {errors[0]:.1e}; tol {tolerance:g})", within(worst, tolerance)


# --- the correctness runs ------------------------------------------------------------------


class ClimbRule(Rule):
    """Rung ``min(top, check index)`` for every layer: every case visits every level of its
    ladder whatever its gradients do (the default rule decides from the data)."""

    name = "gpu-check-climb"
    default_interval = 1

    def decide(self, observation: Observation, ladder: Ladder) -> dict[str, int]:
        rung = min(ladder.top, observation.index)
        self.history.append({"epoch": observation.index, "rung": rung})
        return dict.fromkeys(observation.grad_norms, rung)


class CheckNet(nn.Module):
    """Two conv layers (one with BatchNorm), pooling and two linear layers: 4-D, 2-D and
    1-D gradients, which a small ``bucket_cap_mb`` spreads over several DDP buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc1 = nn.Linear(32 * 16, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x))).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


@dataclass(frozen=True)
class Case:
    """One correctness case: a compressor, its ladder and the model's dtype."""

    compressor: str
    levels: tuple[Any, ...]
    dtype: torch.dtype

    @property
    def model(self) -> str:
        return f"checknet, {self.compressor} {'/'.join(map(str, self.levels))}"

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]


def cases() -> list[Case]:
    """PowerSGD, top-k and (if registered) half precision, in fp32 and bf16."""
    found = [Case("powersgd", (4, 2, 1), torch.float32),
             Case("powersgd", (4, 2, 1), torch.bfloat16),
             Case("topk", (0.99, 0.1, 0.01), torch.float32),
             Case("topk", (0.99,), torch.bfloat16)]  # static in bf16: ties, see the docstring
    if "half" in compressor_names():
        found += [Case("half", ("fp16", "bf16"), torch.float32),
                  Case("half", ("fp16", "bf16"), torch.bfloat16)]  # fmt: skip
    return found


def make_state(net: nn.Module, case: Case) -> AccordionState:
    """An Accordion state for ``net``: the case's ladder (static if it has one level)."""
    if len(case.levels) == 1:
        level = case.levels[0]
        return AccordionState(net, case.compressor, mild=level, aggressive=level)
    return AccordionState(net, case.compressor, levels=case.levels, rule=ClimbRule())


def check_net(dtype: torch.dtype) -> nn.Module:
    """The check model, seeded: every run of a case starts from the same weights."""
    torch.manual_seed(0)
    return CheckNet().to(dtype)


def check_batches(dtype: torch.dtype, device: torch.device, steps: int) -> list[tuple]:
    """One fixed batch per step, drawn on the CPU (the same on every device)."""
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        x = torch.randn(16, 3, 16, 16, generator=gen).to(dtype)
        y = torch.randint(0, 10, (16,), generator=gen)
        batches.append((x.to(device), y.to(device)))
    return batches


class Reference:
    """A CPU copy of a case's model and a state with no process group: built before the
    group exists, its transport is a ``LocalTransport`` for the whole run."""

    def __init__(self, case: Case):
        self.net = check_net(case.dtype)
        self.state = make_state(self.net, case)
        self.state.transport()  # chosen now, while no group exists, and kept


class GradTap:
    """Copies each parameter's local gradient as autograd produces it, before DDP's hook
    sees it (a tensor hook runs before the gradient is accumulated): the exact input of
    the exchange, to replay through the references."""

    def __init__(self, net: nn.Module):
        self.grads: dict[str, torch.Tensor] = {}
        self._handles = [p.register_hook(self._saver(n)) for n, p in net.named_parameters()]

    def _saver(self, name: str) -> Callable[[torch.Tensor], None]:
        def save(grad: torch.Tensor) -> None:
            self.grads[name] = grad.detach().clone()  # autograd may reuse the tensor

        return save

    def take(self) -> dict[str, torch.Tensor]:
        grads, self.grads = self.grads, {}
        return grads

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class Run:
    """What one run of a case recorded, per step: local gradients, averaged gradients,
    whether the copy taken when backward returned matched, non-finite entries; and the
    levels in force after each epoch."""

    raw: list[dict[str, torch.Tensor]] = field(default_factory=list)
    out: list[dict[str, torch.Tensor]] = field(default_factory=list)
    ready: list[bool] = field(default_factory=list)
    nonfinite: int = 0
    levels: list[dict[str, Any]] = field(default_factory=list)


def _grads(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in net.named_parameters()}


def _flat(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads.values()])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hook(case: Case, device: torch.device, side_stream: bool = False) -> Run:
    """Train the case's model for :data:`CHECK_STEPS` steps under DDP with the hook,
    optionally with forward, backward and step on a side CUDA stream."""
    net = check_net(case.dtype).to(device)
    state = make_state(net, case)
    ids = [device.index] if device.type == "cuda" else None
    ddp = state.register(DDP(net, device_ids=ids, bucket_cap_mb=0.25))
    tap, run = GradTap(net), Run()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    stream = torch.cuda.Stream(device) if side_stream else None
    for step, (x, y) in enumerate(check_batches(case.dtype, device, CHECK_STEPS)):
        optimizer.zero_grad(set_to_none=True)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))  # the batch is ready
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            F.cross_entropy(ddp(x).float(), y).backward()
            ready = _flat(_grads(net))  # queued as backward returns, no synchronisation
            optimizer.step()
        _sync(device)
        out = _grads(net)
        run.ready.append(torch.equal(ready, _flat(out)))
        run.nonfinite += sum(int((~torch.isfinite(g)).sum()) for g in out.values())
        run.raw.append({k: v.cpu() for k, v in tap.take().items()})
        run.out.append({k: v.cpu() for k, v in out.items()})
        if (step + 1) % STEPS_PER_EPOCH == 0:
            state.end_epoch(next_lr=LR)
            run.levels.append(state.levels())
    tap.remove()
    return run


def replay(net: nn.Module, state: AccordionState, run: Run, device: torch.device) -> Run:
    """Feed a hook run's local gradients through ``state.reduce_gradients()`` (no DDP),
    with the same epochs; returns the averaged gradients and levels."""
    replayed = Run()
    params = dict(net.named_parameters())
    for step, raw in enumerate(run.raw):
        for name, p in params.items():
            p.grad = raw[name].to(device, copy=True)
        state.reduce_gradients()
        _sync(device)
        replayed.out.append({k: v.cpu() for k, v in _grads(net).items()})
        if (step + 1) % STEPS_PER_EPOCH == 0:
            state.end_epoch(next_lr=LR)
            replayed.levels.append(state.levels())
    return replayed


def _levels_text(levels: list[dict[str, Any]]) -> str:
    """Each epoch's levels after its end, e.g. ``"4 > 2 > 1 > 1"``."""
    return " > ".join("/".join(sorted({str(v) for v in lv.values()})) for lv in levels) or "-"


def check_case(case: Case, device: torch.device, reference: Reference, report: Report) -> None:
    """Every check of one case: the hook against both references, levels, readiness,
    finiteness, and (CUDA) the side-stream run."""
    tol, where = TOLERANCE[case.dtype], device.type

    def add(name: str, value: str, ok: bool) -> None:
        report.check(case.model, case.dtype_name, name, value, ok)

    run = run_hook(case, device)
    loop_net = check_net(case.dtype).to(device)
    loop = replay(loop_net, make_state(loop_net, case), run, device)
    if not isinstance(reference.state.transport(), LocalTransport):
        raise RuntimeError("the CPU reference must have been built before the process group")
    cpu = replay(reference.net, reference.state, run, torch.device("cpu"))
    add(f"= loop path on {where} (reduce_gradients)", *compare(run.out, loop.out, tol))
    add("= CPU reference, no process group", *compare(run.out, cpu.out, tol))
    agree = run.levels == loop.levels == cpu.levels and len(run.levels) > 0
    add("levels per epoch = both references", _levels_text(run.levels), agree)
    moved = max(step_errors(run.out, run.raw))
    add("compressed (differs from local grads)", f"{moved:.2e}", moved > 0 and math.isfinite(moved))
    add("ready when backward returns", f"{run.ready.count(False)}/{len(run.ready)} steps differ",
        all(run.ready))  # fmt: skip
    add(f"finite after {'synchronize' if where == 'cuda' else 'backward'}",
        f"{run.nonfinite} non-finite", run.nonfinite == 0)  # fmt: skip
    if device.type == "cuda":
        check_side_stream(case, device, run, add)


def check_side_stream(case: Case, device: torch.device, run: Run, add: Callable) -> None:
    """The case again with forward, backward and step on a side stream: its result must be
    the loop path's for its own local gradients, and the default stream's run's."""
    tol = TOLERANCE[case.dtype]
    side = run_hook(case, device, side_stream=True)
    loop_net = check_net(case.dtype).to(device)
    loop = replay(loop_net, make_state(loop_net, case), side, device)
    add("side stream: = loop path", *compare(side.out, loop.out, tol))
    # deterministic cuDNN: the same local gradients as the default stream's run, so the
    # same result (a difference here with the row above passing is in forward/backward)
    add("side stream = default stream", *compare(side.out, run.out, tol))
    add("side stream: ready when backward returns",
        f"{side.ready.count(False)}/{len(side.ready)} steps differ", all(side.ready))
    add("side stream: finite", f"{side.nonfinite} non-finite", side.nonfinite == 0)


@contextlib.contextmanager
def strict_numerics() -> Iterator[None]:
    """IEEE fp32 matmuls (no TF32) and bf16 matmuls reduced in fp32 (no reduced-precision
    split-K), the compressors' own arithmetic; deterministic cuDNN, so that the
    side-stream run gets the default stream's local gradients. Restored after.
    Convolutions may still use TF32: that changes only the local gradients, which every
    reference is given as they are."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (torch.get_float32_matmul_precision(), cudnn.deterministic, cudnn.benchmark,
             matmul.allow_bf16_reduced_precision_reduction)  # fmt: skip
    try:
        torch.set_float32_matmul_precision("highest")
        cudnn.deterministic, cudnn.benchmark = True, False
        matmul.allow_bf16_reduced_precision_reduction = False
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        cudnn.deterministic, cudnn.benchmark = saved[1:3]
        matmul.allow_bf16_reduced_precision_reduction = saved[3]


def run_checks(device: torch.device, references: Mapping[Case, Reference], report: Report) -> None:
    """Run every case; an exception fails the case's row instead of ending the run."""
    with strict_numerics():
        for case, reference in references.items():
            try:
                check_case(case, device, reference, report)
            except Exception as exc:  # noqa: BLE001 - reported as a failed check
                report.check(case.model, case.dtype_name, "runs without error",
                             f"{type(exc).__name__}: {exc}"[:200], False)  # fmt: skip


# --- the quantisers on the device ----------------------------------------------------------


def codec_inputs(workers: int, rows: int, seed: int) -> list[list[torch.Tensor]]:
    """Per worker a matrix of ``rows`` x 1000 (rows of 15 whole blocks and one of 40
    elements) and a vector of 1001, drawn on the CPU: Gaussian values whose rows differ
    in scale (by ``exp`` of a Gaussian), so that the blocks' scales spread."""
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for _ in range(workers):
        matrix = torch.randn(rows, 1000, generator=gen) * torch.randn(rows, 1, generator=gen).exp()
        inputs.append([matrix, torch.randn(1001, generator=gen)])
    return inputs


def codec_roundtrip(codec: type[IntQuantizer], bits: int,
                    x: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
    """``codec.encode`` of a copy of ``x`` and ``codec.decode`` of what it sends, on
    ``x``'s device: the packed codes, the scales, the residual and the decoded values."""
    residual = x.clone()
    packed, scales = codec.encode(residual, bits)
    decoded = codec.decode(packed.unsqueeze(0), scales.unsqueeze(0), x.shape, bits, torch.float32)
    return {"codes": packed, "scales": scales, "residual": residual,
            "decoded": decoded.view(x.shape)}  # fmt: skip


def codec_two_phase(codec: type[IntQuantizer], bits: int,
                    inputs: Sequence[Sequence[torch.Tensor]],
                    rounds: int = 2) -> dict[str, torch.Tensor]:  # fmt: skip
    """``rounds`` two-phase exchanges of copies of ``inputs`` (per worker its tensors, on
    one device), each owner's server error passed on to the next round; one worker runs
    on a ``LocalTransport``, more on a ``SimulatedTransport``. Worker 0's average and
    residuals, and every owner's last server error."""
    world = len(inputs)
    transport = LocalTransport() if world == 1 else SimulatedTransport(world)
    errors: list[torch.Tensor | None] = [None] * world
    out: dict[str, torch.Tensor] = {}
    for r in range(rounds):
        copies = [[t.clone() for t in tensors] for tensors in inputs]
        exchanges = [two_phase_exchange(codec, tensors, bits, world, errors[w])
                     for w, tensors in enumerate(copies)]  # fmt: skip
        results = ([transport.run(exchanges[0])] if world == 1
                   else transport.run(exchanges))  # fmt: skip
        errors = [result.server_error for result in results]
        out[f"average {r + 1}"] = results[0].average
        out |= {f"residual {r + 1}.{i}": t for i, t in enumerate(copies[0])}
    return out | {f"server error {w}": e for w, e in enumerate(errors)}


def codec_difference(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                     norm: float) -> tuple[float, dict[str, float]]:  # fmt: skip
    """How far a device's results are from the CPU's: the largest ``|actual - expected|``
    over the float tensors divided by ``norm`` (the input's norm; float64 on the CPU),
    and per ``uint8`` or ``float16`` tensor (codes, scales) the fraction of its entries
    that differ. A missing tensor, a shape or dtype mismatch or a non-finite value is
    ``inf``."""
    if set(actual) != set(expected):
        return math.inf, {}
    worst, flips = 0.0, {}
    for key, ref in expected.items():
        out = actual[key].detach().cpu()
        if out.shape != ref.shape or out.dtype != ref.dtype:
            return math.inf, flips
        if ref.dtype in (torch.uint8, torch.float16):  # wire bytes: compared entry by entry
            differ = (out.view(torch.uint8) != ref.view(torch.uint8)).sum().item()
            flips[key] = differ / max(ref.view(torch.uint8).numel(), 1)
            continue
        diff = torch.linalg.vector_norm(out.double() - ref.double()).item()
        worst = max(worst, diff / norm if math.isfinite(diff) else math.inf)
    return worst, flips


def codec_verdict(error: float, flips: Mapping[str, float]) -> tuple[str, bool]:
    """A codec check's value and verdict: ``"bitwise"`` where nothing differs, else the
    error (against :data:`CODEC_TOLERANCE`) and the fractions of codes and scales that
    differ (against :data:`CODEC_FLIPS`)."""
    ok = within(error, CODEC_TOLERANCE) and all(f <= CODEC_FLIPS for f in flips.values())
    if error == 0 and not any(flips.values()):
        return "bitwise", ok
    parts = [f"{error:.1e} of |input| (tol {CODEC_TOLERANCE:g})"]
    parts += [f"{key} {f:.1e} differ" for key, f in flips.items() if f]
    return "; ".join(parts), ok


def _on(device: torch.device, nested: Any) -> Any:
    """``nested`` (tensors in lists) copied to ``device``."""
    if isinstance(nested, torch.Tensor):
        return nested.to(device, copy=True)
    return [_on(device, item) for item in nested]


def check_codec(codec: type[IntQuantizer], bits: int, device: torch.device, rows: int,
                report: Report) -> None:  # fmt: skip
    """One quantiser's device results against the CPU's: encode and decode, the CPU's
    bytes decoded on the device, and the two-phase exchange on one and four workers."""
    where, model = device.type, f"codec {codec.label(bits)}"

    def add(name: str, actual: Mapping, expected: Mapping, norm: float) -> None:
        report.check(model, "fp32", name, *codec_verdict(*codec_difference(actual, expected,
                                                                            norm)))  # fmt: skip

    (matrix, vector), *_ = inputs = codec_inputs(4, rows, seed=3)
    norm = torch.linalg.vector_norm(matrix.double()).item()
    cpu = codec_roundtrip(codec, bits, matrix)
    add(f"encode+decode on {where} = CPU", codec_roundtrip(codec, bits, matrix.to(device)), cpu,
        norm)  # fmt: skip
    sent = codec.decode(cpu["codes"].to(device).unsqueeze(0), cpu["scales"].to(device).unsqueeze(0),
                        matrix.shape, bits, torch.float32)  # fmt: skip
    add(f"CPU's bytes decoded on {where} = CPU", {"decoded": sent.view(matrix.shape)},
        {"decoded": cpu["decoded"]}, norm)  # fmt: skip
    norm = torch.linalg.vector_norm(torch.cat([matrix.reshape(-1), vector]).double()).item()
    for world, transport in ((1, "LocalTransport"), (4, "SimulatedTransport")):
        add(f"two-phase W={world} ({transport}, 2 rounds) on {where} = CPU",
            codec_two_phase(codec, bits, _on(device, inputs[:world])),
            codec_two_phase(codec, bits, inputs[:world]), norm)  # fmt: skip


def run_codec_checks(device: torch.device, quick: bool, report: Report) -> None:
    """:func:`check_codec` for every quantiser of :data:`CODECS`; an exception fails the
    quantiser's row instead of ending the run."""
    for codec, bits in CODECS:
        try:
            check_codec(codec, bits, device, 40 if quick else 300, report)
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            report.check(f"codec {codec.label(bits)}", "fp32", "runs without error",
                         f"{type(exc).__name__}: {exc}"[:200], False)  # fmt: skip


# --- the two-phase compute on one device ---------------------------------------------------


def _median_s(run: Callable[[], Any], before: Callable[[], Any], device: torch.device,
              warmup: int, reps: int) -> float:  # fmt: skip
    """Median seconds of ``run()`` (synchronised), ``before()`` untimed ahead of each."""
    times = []
    for i in range(warmup + reps):
        before()
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_two_phase(codec: type[IntQuantizer], bits: int, world: int, numel: int,
                   device: torch.device, warmup: int, reps: int) -> float:  # fmt: skip
    """Median seconds of one two-phase exchange of ``numel`` fp32 elements per worker,
    ``world`` workers simulated on ``device`` (every worker's arithmetic, one after the
    other; the collectives are the ``SimulatedTransport``'s copies)."""
    gen = torch.Generator(device=device).manual_seed(4)
    sources = [torch.randn(numel, generator=gen, device=device) for _ in range(world)]
    inputs = [torch.empty_like(s) for s in sources]

    def restore() -> None:  # each exchange leaves its residual in its input
        for x, s in zip(inputs, sources):
            x.copy_(s)

    def exchange() -> None:
        SimulatedTransport(world).run([two_phase_exchange(codec, [x], bits, world)
                                       for x in inputs])  # fmt: skip

    return _median_s(exchange, restore, device, warmup, reps)


def time_copy(numel: int, device: torch.device, warmup: int, reps: int) -> float:
    """Median seconds of ``copy_`` of ``numel`` fp32 elements on ``device``."""
    source = torch.randn(numel, device=device)
    target = torch.empty_like(source)
    return _median_s(lambda: target.copy_(source), lambda: None, device, warmup, reps)


def run_compute(device: torch.device, args: argparse.Namespace, report: Report) -> None:
    """The compute table: every quantiser of :data:`CODECS` at :data:`COMPUTE_WORLDS`
    workers, in GB/s of fp32 input, next to ``copy_``'s."""
    numel, warmup, reps = args.compute_numel, 1, args.compute_reps
    copy_s = time_copy(numel, device, warmup, max(reps, 5))
    copy_rate = numel * 4 / copy_s / 1e9
    for codec, bits in CODECS:
        for world in COMPUTE_WORLDS:
            label = codec.label(bits)
            try:
                seconds = time_two_phase(codec, bits, world, numel, device, warmup, reps)
            except Exception as exc:  # noqa: BLE001 - reported as a failed check
                report.check(f"two-phase {label}", "fp32", f"W={world} compute runs without "
                             "error", f"{type(exc).__name__}: {exc}"[:200], False)  # fmt: skip
                continue
            rate = world * numel * 4 / seconds / 1e9
            report.compute.append({"codec": label, "world_size": world, "numel": numel,
                                   "ms": seconds * 1e3, "gb_per_s": rate,
                                   "copy_gb_per_s": copy_rate})  # fmt: skip


# --- the speed runs ------------------------------------------------------------------------


class Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 reduce, 3x3, 1x1 expand (x4), each with BatchNorm."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int):
        super().__init__()
        out = planes * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(in_planes, planes, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(),
            nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(),
            nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out),
        )  # fmt: skip
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != out:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, out, 1, stride, bias=False),
                                          nn.BatchNorm2d(out))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class BottleneckResNet(nn.Module):
    """ResNet-50 in the CIFAR layout (3x3 stem, no max-pool): blocks (3, 4, 6, 3) of
    width 64 give 23.5 M parameters in 161 tensors, like torchvision's 25.6 M."""

    def __init__(self, blocks: Sequence[int] = (3, 4, 6, 3), width: int = 64, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                   nn.BatchNorm2d(width), nn.ReLU()]  # fmt: skip
        in_planes = width
        for stage, count in enumerate(blocks):
            planes = width * 2**stage
            for i in range(count):
                layers.append(Bottleneck(in_planes, planes, 2 if i == 0 and stage > 0 else 1))
                in_planes = planes * Bottleneck.expansion
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.linear = nn.Linear(in_planes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.features(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: token and position embeddings, pre-norm blocks with causal
    self-attention and a GELU MLP (``nn.TransformerEncoderLayer``), a final LayerNorm and
    an output layer tied to the token embedding. The defaults are GPT-2 small's sizes."""

    def __init__(self, vocab: int = 50257, width: int = 768, heads: int = 12, layers: int = 12,
                 seq: int = 512):  # fmt: skip
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)  # fmt: skip
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        self._mask: torch.Tensor | None = None  # not a buffer: DDP would broadcast it

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        if self._mask is None or self._mask.shape[0] != seq or self._mask.device != idx.device:
            self._mask = nn.Transformer.generate_square_subsequent_mask(seq, device=idx.device)
        h = self.tok(idx) + self.pos(torch.arange(seq, device=idx.device))
        return self.head(self.norm(self.blocks(h, mask=self._mask, is_causal=True)))


@dataclass(frozen=True)
class SpeedModel:
    """A model of the speed table: its builder and one fixed batch."""

    name: str
    size: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]


def _images(batch: int, pixels: int) -> Callable[[torch.device], tuple]:
    def make(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(batch, 3, pixels, pixels, generator=gen)
        return x.to(device), torch.randint(0, 10, (batch,), generator=gen).to(device)

    return make


def _tokens(batch: int, seq: int, vocab: int) -> Callable[[torch.device], tuple]:
    def make(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(2)
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)
        return idx[:, :-1], idx[:, 1:]  # predict the next token

    return make


def speed_models(quick: bool) -> list[SpeedModel]:
    """ResNet-18, ResNet-50-sized, GPT-2-small-sized; tiny versions with ``quick``."""
    if quick:  # seconds on two CPU cores, the same code paths
        return [
            SpeedModel("resnet18", "batch 4, 3x16x16", lambda: get_model("resnet18"),
                       _images(4, 16)),
            SpeedModel("resnet50-like", "(1,1,1,1) blocks, width 8, batch 4, 3x16x16",
                       lambda: BottleneckResNet((1, 1, 1, 1), 8), _images(4, 16)),
            SpeedModel("gpt2-small-like", "2 layers, d 64, 4 heads, vocab 512, batch 2x32",
                       lambda: GPT(512, 64, 4, 2, 32), _tokens(2, 32, 512)),
        ]  # fmt: skip
    return [
        SpeedModel("resnet18", "batch 128, 3x32x32", lambda: get_model("resnet18"),
                   _images(128, 32)),
        SpeedModel("resnet50-like", "(3,4,6,3) blocks, width 64, batch 128, 3x32x32",
                   lambda: BottleneckResNet(), _images(128, 32)),
        SpeedModel("gpt2-small-like", "12 layers, d 768, 12 heads, vocab 50257, batch 8x512",
                   lambda: GPT(), _tokens(8, 512, 50257)),
    ]  # fmt: skip


def net_is_cuda(net: nn.Module) -> bool:
    """Whether ``net``'s parameters are on a CUDA device."""
    return next(net.parameters()).is_cuda


def _bf16_on_gloo(process_group, bucket):  # noqa: ANN001, ANN202 - DDP checks annotations' values
    """PyTorch's ``bf16_compress_hook``, unchanged, under a name that DDP lets gloo run."""
    return torch_default.bf16_compress_hook(process_group, bucket)


def attach(config: str, net: nn.Module, ddp: DDP) -> Callable[[], float | None]:
    """Register ``config``'s hook; returns how to read its compression afterwards (dense
    floats over floats sent; ``None`` for dense DDP)."""
    if config == "dense DDP":
        return lambda: None
    if config == "torch powerSGD_hook r4":
        state = torch_psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
            min_compression_rate=1, use_error_feedback=True, warm_start=True,
        )  # fmt: skip
        ddp.register_comm_hook(state, torch_psgd.powerSGD_hook)
        return lambda: float(state.compression_stats()[0])
    if config == "torch bf16_compress_hook":
        # DDP refuses the hook by its name on a build without NCCL; gloo runs it under another
        hook = torch_default.bf16_compress_hook if net_is_cuda(net) else _bf16_on_gloo
        ddp.register_comm_hook(None, hook)  # None: the default group
        return lambda: 2.0  # it casts every fp32 bucket to bf16: 2 bytes a value for 4
    if config == "ours PowerSGD r4":
        ours = AccordionState(net, "powersgd", mild=4, aggressive=4)
    elif config == "ours Accordion 4,2,1":
        ours = AccordionState(net, "powersgd", levels=(4, 2, 1))
    elif config == "ours int8 two-phase":
        collective = {} if INT8_COLLECTIVE == "auto" else {"collective": INT8_COLLECTIVE}
        ours = AccordionState(net, "int", mild=8, aggressive=8, **collective)
    else:
        raise ValueError(f"unknown configuration {config!r}")
    ours.register(ddp)

    def compression() -> float:
        stats = ours.stats()
        return stats["dense_floats"] / max(stats["total_floats"], 1)

    return compression


def _mark(device: torch.device) -> Any:
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed_ms(start: Any, end: Any) -> float:
    if isinstance(start, float):
        return (end - start) * 1e3
    return start.elapsed_time(end)


def time_config(spec: SpeedModel, config: str, device: torch.device, warmup: int,
                steps: int) -> tuple[float, float | None]:  # fmt: skip
    """Median ms per training step of ``config`` on ``spec``, and its compression."""
    torch.manual_seed(0)
    with torch.device(device):  # built in place: GPT-2's 124 M parameters initialise fast
        net = spec.build()
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(net, device_ids=ids)
    compression = attach(config, net, ddp)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = spec.batch(device)
    marks = []
    for i in range(warmup + steps):
        if i >= warmup:  # a mark at every step boundary: the steps' times add up to the run's
            marks.append(_mark(device))
        optimizer.zero_grad(set_to_none=True)
        out = ddp(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        optimizer.step()
    marks.append(_mark(device))
    _sync(device)
    times = [_elapsed_ms(a, b) for a, b in zip(marks, marks[1:])]
    result = statistics.median(times), compression()
    del ddp, net, optimizer, out, compression
    gc.collect()  # DDP and its hook state hold each other: free GPT-2's buffers now
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run_speed(device: torch.device, args: argparse.Namespace, report: Report,
              deadline: float) -> None:  # fmt: skip
    """Time every configuration on every model, ``args.reps`` interleaved rounds each."""
    for spec in speed_models(args.quick):
        medians: dict[str, list[float]] = {c: [] for c in SPEED_CONFIGS}
        compression: dict[str, float | None] = {}
        failed: set[str] = set()
        for _ in range(args.reps):
            for config in SPEED_CONFIGS:
                if time.monotonic() > deadline or config in failed:
                    continue  # the row says "skipped"
                try:
                    ms, compression[config] = time_config(spec, config, device, args.warmup,
                                                          args.steps)  # fmt: skip
                    medians[config].append(ms)
                except Exception as exc:  # noqa: BLE001 - reported as a failed check
                    report.check(spec.name, "fp32", f"{config} runs without error",
                                 f"{type(exc).__name__}: {exc}"[:200], False)  # fmt: skip
                    failed.add(config)  # the other configurations still run
        _speed_rows(spec, medians, compression, report)


def _speed_rows(spec: SpeedModel, medians: Mapping[str, list[float]],
                compression: Mapping[str, float | None], report: Report) -> None:  # fmt: skip
    """One JSON row per configuration, and a check that each hook did compress (a hook that
    fell back to dense, e.g. before ``start_powerSGD_iter``, would make the timing moot)."""
    ms = {c: statistics.median(v) if v else None for c, v in medians.items()}
    torch_ms = ms["torch powerSGD_hook r4"]
    for config in SPEED_CONFIGS:
        ratio = ms[config] / torch_ms if ms[config] is not None and torch_ms else None
        report.speed.append({"model": spec.name, "size": spec.size, "dtype": "fp32",
                             "config": config, "ms_per_step": ms[config],
                             "ms_per_round": list(medians[config]), "vs_torch": ratio,
                             "compression": compression.get(config),
                             "skipped": not medians[config]})  # fmt: skip
        if config == "ours int8 two-phase":
            report.speed[-1]["collective"] = INT8_COLLECTIVE
        rate = compression.get(config)
        if config != "dense DDP" and ms[config] is not None:  # else the timing is moot
            report.check(spec.name, "fp32", f"{config} compresses",
                         f"{rate or 0:.1f}x fewer floats than dense", (rate or 0) > 1)  # fmt: skip


# --- the run -------------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (pastes into the docs as it is)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "skipped" if value is None else f"{value:.1f}"


def print_report(report: Report, meta: Mapping[str, Any]) -> None:
    """The checks table, then the speed table (one row per model)."""
    print(f"Checks: {meta['device_name']}, {meta['backend']}, world size 1, torch "
          f"{meta['torch']}")  # fmt: skip
    print(_table(["model", "dtype", "check", "value", "status"],
                 [[r["model"], r["dtype"], r["check"], r["value"], r["status"]]
                  for r in report.checks]))  # fmt: skip
    print(f"\nSpeed: ms per step (forward, backward with the hook, SGD step), median of "
          f"{meta['steps']} steps after {meta['warmup']}, {meta['reps']} interleaved round(s)")
    by_model: dict[str, dict[str, dict]] = {}
    for row in report.speed:
        by_model.setdefault(row["model"], {})[row["config"]] = row
    rows = []
    for model, configs in by_model.items():
        ms = {c: configs[c]["ms_per_step"] for c in SPEED_CONFIGS}
        ratios = [ms[ours] / ms[theirs] if ms[ours] is not None and ms[theirs] else None
                  for ours, theirs in SPEED_RATIOS]  # fmt: skip
        rows.append([model, "fp32", *(_ms(ms[c]) for c in SPEED_CONFIGS),
                     *("-" if r is None else f"{r:.2f}x" for r in ratios)])  # fmt: skip
    print(_table(["model", "dtype", *SPEED_CONFIGS,
                  *(f"{ours} / {theirs}" for ours, theirs in SPEED_RATIOS)], rows))  # fmt: skip
    for model, configs in by_model.items():
        print(f"  {model}: {next(iter(configs.values()))['size']}")
    print(f"  ours int8 two-phase: collective={INT8_COLLECTIVE!r}")
    if report.compute:
        numel = report.compute[0]["numel"]
        print(f"\nTwo-phase compute on one {meta['device']}: W workers simulated in one process "
              f"(quantise, decode, fp32 sum, re-quantise, decode; the collectives are copies), "
              f"{numel:,} fp32 elements a worker; GB/s of input (W x {numel:,} x 4 bytes over "
              f"the time), median of {meta['compute_reps']} after 1")  # fmt: skip
        print(_table(["codec", "W", "ms per exchange", "GB/s input", "copy_ GB/s", "/ copy_"],
                     [[r["codec"], r["world_size"], f"{r['ms']:.1f}", f"{r['gb_per_s']:.2f}",
                       f"{r['copy_gb_per_s']:.2f}", f"{r['gb_per_s'] / r['copy_gb_per_s']:.3f}x"]
                      for r in report.compute]))  # fmt: skip
    failed = sum(r["status"] == FAIL for r in report.checks)
    print(f"\n{len(report.checks) - failed} of {len(report.checks)} checks passed "
          f"in {meta['elapsed_s']:.0f} s")  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny speed models, few steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (30; quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (5; quick 3)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved rounds (2; quick 1)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--budget", type=float, default=240.0,
                        help="seconds after which speed configurations not started are skipped")
    parser.add_argument("--timeout", type=float, default=290.0,
                        help="seconds after which a hung run is ended with a traceback")
    parser.add_argument("--compute-numel", type=int, default=None,
                        help="fp32 elements a worker in the two-phase compute table "
                             "(25,000,000; quick 65,536)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not cuda:
        parser.error("--device cuda, but CUDA is not available (use --device cpu)")
    quick = args.quick
    args.steps = args.steps or (3 if quick else 30)
    # the torch hook compresses from its 3rd step (start_powerSGD_iter=2): warm-up covers it
    args.warmup = max(3, args.warmup if args.warmup is not None else (3 if quick else 5))
    args.reps = args.reps or (1 if quick else 2)
    if args.compute_numel is None:
        args.compute_numel = 65_536 if quick else 25_000_000
    args.compute_reps = 2 if quick else 10
    if args.compute_numel < 1:
        parser.error(f"--compute-numel must be at least 1, got {args.compute_numel}")
    return args


def _meta(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {"device": str(device), "device_name": name or "cpu", "torch": torch.__version__,
            "backend": "nccl" if device.type == "cuda" else "gloo", "quick": args.quick,
            "steps": args.steps, "warmup": args.warmup, "reps": args.reps,
            "compute_numel": args.compute_numel, "compute_reps": args.compute_reps,
            "python": platform.python_version()}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout, exit=True)  # a hang must not eat the GPU
    start = time.monotonic()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    report = Report()
    # Before the process group exists: these states keep a LocalTransport (no group).
    references = {case: Reference(case) for case in cases()}
    with tempfile.TemporaryDirectory() as tmp:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=120))  # fmt: skip
        try:
            run_checks(device, references, report)
            run_codec_checks(device, args.quick, report)
            run_compute(device, args, report)
            run_speed(device, args, report, deadline=start + args.budget)
        finally:
            dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    meta = {**_meta(args, device), "elapsed_s": time.monotonic() - start}
    print_report(report, meta)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "passed": report.passed, "checks": report.checks,
                       "speed": report.speed, "compute": report.compute}, f,
                      indent=1)  # fmt: skip
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
