"""Accordion as a DDP communication hook.

Build the state once, register the hook, and tell the state when an epoch ends::

    from accordion.ddp import AccordionState, accordion_hook

    model = DistributedDataParallel(net)
    state = AccordionState(net, compressor="powersgd", mild=2, aggressive=1)
    model.register_comm_hook(state, accordion_hook)
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()      # the hook compresses and averages
            optimizer.step()
        scheduler.step()
        state.end_epoch(optimizer)               # after scheduler.step(): sees the new lr

Without DDP (a hand-written loop, as the paper's own code): call
``state.reduce_gradients()`` after ``backward()``; it averages every ``p.grad`` of the
module in place over the process group, with the same compression, statistics and
decisions as the hook.

The state may be built before the model is wrapped (PyTorch Lightning's
``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=accordion_hook)``, Hugging Face
Accelerate): without a module it binds parameters lazily from the buckets it sees and
names them ``"#0"``, ``"#1"``, ... in order of first appearance (the same order on every
rank); ``state.bind_module(module)`` names them after the module's parameters.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook checks the
# hook's annotations at run time, and strings do not compare equal to the types.
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .accounting import Ledger, is_compressible, paper_floats, wire_bytes
from .compress import (
    AllReduce,
    ErrorFeedback,
    PowerSGD,
    Reducer,
    SimulatedTransport,
    TorchTransport,
    make_compressor,
)
from .regime import RegimeDetector, StepRegimeDetector

#: Default (mild, aggressive) levels per compressor: the paper's ResNet-18 settings.
DEFAULT_LEVELS = {"dense": (None, None), "powersgd": (2, 1), "topk": (0.99, 0.1)}
STATISTICS = ("rank0", "mean")
INTERVAL_UNITS = ("epoch", "step")
CHECKPOINT_FORMAT = 1


_PRIVATE_GROUPS: dict[tuple[int, tuple[int, ...] | None], Any] = {}


def _private_group(process_group: Any) -> Any:
    """A process group with the ranks of ``process_group``, used only by Accordion states.

    Created once per set of ranks (``new_group`` is collective: every rank creates them
    in the same order, so the cache stays consistent across ranks).
    """
    ranks = None
    if process_group is not None:
        ranks = tuple(dist.get_process_group_ranks(process_group))
    # keyed by the default group too: a re-initialised job must not reuse stale groups
    key = (id(dist.group.WORLD), ranks)
    group = _PRIVATE_GROUPS.get(key)
    if group is None:
        group = dist.new_group(ranks=list(ranks) if ranks is not None else None)
        _PRIVATE_GROUPS[key] = group
    return group


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


class AccordionState:
    """Everything the Accordion hook keeps between steps, per parameter.

    Args:
        model: the module whose gradients are averaged (plain or DDP-wrapped), or ``None``
            to bind parameters lazily from the buckets (see the module docstring).
        compressor: ``"powersgd"``, ``"topk"`` or ``"dense"``.
        mild: level in critical regimes (PowerSGD rank, top-k fraction); the less
            compressed of the two. Default: rank 2 / top-k 0.99.
        aggressive: level elsewhere. Default: rank 1 / top-k 0.1. ``mild == aggressive``
            gives a static compressor (and skips the statistic).
        interval: how often the rule checks, in epochs (``interval_unit="epoch"``, the
            paper: 10 for CNNs, 5 for the LSTM) or in optimizer steps (``"step"``).
        eta: threshold on the relative change of a layer's gradient norm (paper: 0.5).
        statistic: ``"rank0"`` (the paper: rank 0's local gradient norms decide, every
            rank applies the same decision) or ``"mean"`` (norms averaged over ranks).
        interval_unit: ``"epoch"`` (call :meth:`end_epoch`) or ``"step"`` (call
            :meth:`end_step` after every optimizer step).
        process_group: the group to average over (default: the default group).
        seed: seed shared by all ranks for PowerSGD's initial factors.
        on_rank_change: PowerSGD's Q at a rank switch: ``"reuse"`` (default: keep the
            leading columns, append shared-seed ones) or ``"redraw"`` (the paper's
            scripts). The error-feedback memory is always kept.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        compressor: str = "powersgd",
        mild: Any = None,
        aggressive: Any = None,
        interval: int = 10,
        eta: float = 0.5,
        statistic: str = "rank0",
        interval_unit: str = "epoch",
        process_group: Any = None,
        seed: int = 0,
        on_rank_change: str = "reuse",
    ):
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
        if compressor not in DEFAULT_LEVELS:
            raise ValueError(
                f"compressor must be one of {tuple(DEFAULT_LEVELS)}, got {compressor!r}"
            )
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
        if interval_unit not in INTERVAL_UNITS:
            raise ValueError(
                f"interval_unit must be one of {INTERVAL_UNITS}, got {interval_unit!r}"
            )
        default_mild, default_aggressive = DEFAULT_LEVELS[compressor]
        mild = default_mild if mild is None else mild
        aggressive = default_aggressive if aggressive is None else aggressive
        if compressor == "powersgd":
            comp = PowerSGD(mild, seed=seed, on_rank_change=on_rank_change)
        else:
            comp = make_compressor(compressor, mild)
        aggressive = comp.check_level(aggressive)
        if compressor != "dense" and aggressive > mild:
            raise ValueError(
                f"aggressive must compress at least as much as mild: for {compressor} "
                f"aggressive <= mild, got mild={mild!r}, aggressive={aggressive!r}"
            )
        self.compressor_name = compressor
        self.mild = comp.default_level
        self.aggressive = aggressive
        self.statistic = statistic
        self.interval_unit = interval_unit
        self.process_group = process_group
        self.seed = seed
        self.reducer = Reducer(comp, ErrorFeedback())
        if interval_unit == "epoch":
            self.detector: RegimeDetector | StepRegimeDetector = RegimeDetector(interval, eta)
        else:
            self.detector = StepRegimeDetector(interval, eta)
        #: Epochs ended so far (the index of the current epoch).
        self.epoch = 0
        #: Optimizer steps (or hook iterations) seen so far.
        self.step = 0
        self.ledger = Ledger()
        self._last_lr: float | None = None
        self._names: dict[int, str] = {}  # id(parameter) -> key
        self._shapes: dict[str, tuple[int, ...]] = {}  # key -> shape, in binding order
        self._element_size: dict[str, int] = {}
        self._expected_shapes: dict[str, tuple[int, ...]] | None = None
        self._accumulators: dict[str, torch.Tensor] = {}
        self._costs: dict[tuple[str, Any, int], tuple[int, float]] = {}  # per-step cost cache
        self._transport: TorchTransport | None = None
        self._module: nn.Module | None = None
        #: The last :meth:`calibrate` report, or ``None``.
        self.calibration: dict[str, Any] | None = None
        if model is not None:
            self.bind_module(model)

    # --- binding --------------------------------------------------------------------------

    @property
    def adaptive(self) -> bool:
        """Whether levels switch (``mild != aggressive``)."""
        return self.mild != self.aggressive

    @property
    def compressor(self):
        """The compressor object (levels per parameter key)."""
        return self.reducer.compressor

    def bind_module(self, model: nn.Module) -> None:
        """Name parameters after ``model.named_parameters()`` (plain or DDP-wrapped).

        Parameters already bound lazily under ``"#i"`` keep their state under their new
        names.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        module = _unwrap(model)
        renamed = {}
        for name, param in module.named_parameters():
            old = self._names.get(id(param))
            if old is not None and old != name:
                renamed[old] = name
            self._names[id(param)] = name
            if name not in self._shapes:
                self._register(name, param)
        if renamed:
            self._rename(renamed)
        self._module = module
        self._check_expected()

    def _register(self, key: str, param: torch.Tensor) -> None:
        shape = tuple(param.shape)
        if self._expected_shapes is not None:
            expected = self._expected_shapes.get(key)
            if expected != shape:
                raise ValueError(
                    f"the loaded Accordion state does not match the model: parameter {key!r} "
                    f"has shape {shape}, the checkpoint {expected}"
                )
        self._shapes[key] = shape
        self._element_size[key] = param.element_size()

    def _rename(self, renamed: Mapping[str, str]) -> None:
        for old, new in renamed.items():
            self._shapes[new] = self._shapes.pop(old)
            self._element_size[new] = self._element_size.pop(old)
            if old in self._accumulators:
                self._accumulators[new] = self._accumulators.pop(old)
            if old in self.ledger.layers:
                self.ledger.layers[new] = self.ledger.layers.pop(old)
            self.reducer.rename(old, new)
        self._costs.clear()  # keyed by the old names

    def _check_expected(self) -> None:
        if self._expected_shapes is None or self._module is None:
            return
        if set(self._shapes) != set(self._expected_shapes):
            missing = sorted(set(self._expected_shapes) - set(self._shapes))[:5]
            extra = sorted(set(self._shapes) - set(self._expected_shapes))[:5]
            raise ValueError(
                "the loaded Accordion state does not match the model: "
                f"parameters only in the checkpoint {missing}, only in the model {extra}"
            )

    def _keys(self, params: Sequence[torch.Tensor]) -> list[str]:
        keys = []
        for param in params:
            key = self._names.get(id(param))
            if key is None:
                key = f"#{len(self._shapes)}"  # same on every rank: buckets are identical
                self._names[id(param)] = key
                self._register(key, param)
            keys.append(key)
        return keys

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def _world(self) -> tuple[int, TorchTransport | None]:
        """World size and transport; every rank must get here at the same point."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1, None
        if self._transport is None:
            # A private copy of the group: the hook's phases are issued from completion
            # callbacks, and on a shared group they could pair up wrongly with collectives
            # that DDP (e.g. find_unused_parameters) or the loop issue meanwhile.
            self._transport = TorchTransport(_private_group(self.process_group))
        return self._transport.world_size, self._transport

    # --- the per-step path ----------------------------------------------------------------

    def _collecting(self) -> bool:
        if not self.adaptive or not self._compressed_keys():
            return False
        if self.interval_unit == "epoch":
            return self.detector.needs_statistic(self.epoch)
        return True

    def _before_exchange(self, keys: Sequence[str], grads: Sequence[torch.Tensor], world: int):
        reducer = self.reducer
        if self._collecting():
            for key, grad in zip(keys, grads):
                if not reducer.compresses(grad, key):
                    continue
                acc = self._accumulators.get(key)
                if acc is None:
                    # fp32 sums: an epoch of fp16 gradients can overflow fp16
                    acc = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
                    self._accumulators[key] = acc
                acc.add_(grad)
        comp = reducer.compressor
        for key, grad in zip(keys, grads):
            dense = key in reducer.dense_keys
            level = None if dense else comp.level(key)
            cost = self._costs.get((key, level, world))
            if cost is None:
                kind = "dense" if dense else comp.kind
                shape, size = tuple(grad.shape), grad.element_size()
                cost = (
                    paper_floats(shape, kind, level, world),
                    wire_bytes(shape, kind, level, world, size),
                )
                self._costs[(key, level, world)] = cost
            self.ledger.add(key, *cost)

    def _compressed_keys(self) -> list[str]:
        """Keys that go through the compressor (compressible and not sent dense)."""
        if self.reducer.compressor.kind == "dense":
            return []
        dense = self.reducer.dense_keys
        return [k for k, s in self._shapes.items() if is_compressible(s) and k not in dense]

    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The hook's work for one bucket; see :func:`accordion_hook`."""
        keys = self._keys(bucket.parameters())
        grads = bucket.gradients()  # views into bucket.buffer(): written in place
        world, transport = self._world()
        self._before_exchange(keys, grads, world)
        if bucket.is_last() and self.interval_unit == "epoch":
            self.step += 1
        buffer = bucket.buffer()
        reducer = self.reducer
        if any(reducer.compresses(g, k) or reducer.memory.get(k) is not None
               for k, g in zip(keys, grads)):  # fmt: skip
            exchange = reducer.exchange(keys, grads, world)
        else:  # all dense: the bucket's flat buffer goes as it is, as in DDP's own hook
            exchange = _dense_buffer(buffer, world)
        if transport is None:
            SimulatedTransport(1).run([exchange])
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(buffer)
            return done

        def unpack(fut: torch.futures.Future) -> torch.Tensor:
            fut.value()  # re-raises an error from the exchange
            return buffer

        return transport.run_async(exchange).then(unpack)

    def reduce_gradients(self, parameters: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Average ``p.grad`` over the process group in place, with compression: the
        same work as the hook, for loops without DDP. Call it after ``backward()``.

        ``parameters`` defaults to the bound module's parameters; those without a
        gradient are skipped (the same set must have gradients on every rank).
        """
        if parameters is None:
            if self._module is None:
                raise ValueError(
                    "parameters must be given when no module is bound "
                    "(pass model= to AccordionState or call bind_module)"
                )
            parameters = self._module.parameters()
        params = [p for p in parameters if p.grad is not None]
        keys = self._keys(params)
        grads = [p.grad for p in params]
        world, transport = self._world()
        self._before_exchange(keys, grads, world)
        exchange = self.reducer.exchange(keys, grads, world)
        if transport is None:
            SimulatedTransport(1).run([exchange])
        else:
            transport.run(exchange)
        if self.interval_unit == "epoch":
            self.step += 1

    # --- the cost model -------------------------------------------------------------------

    def calibrate(
        self,
        bandwidth: float | None = None,
        latency: float | None = None,
        *,
        buckets: int | None = None,
        repeats: int = 5,
        compute_s: float | None = None,
    ) -> dict[str, Any]:
        """Measure what compression costs and saves, and send dense the tensors for which
        it does not pay (the ``auto`` mode). Call it on every rank once the module is bound
        and the process group initialised, before training.

        The link is measured with timed all-reduces over this state's group unless
        ``bandwidth`` (bytes/s) and ``latency`` (s) are given; the extra computation of
        compressing each tensor at the mild level is timed on this process. A tensor is
        sent dense when that computation takes longer than the transfer time it saves
        (see :func:`accordion.costmodel.choose_dense`); ``buckets`` (default: estimated
        from DDP's 25 MiB buckets) counts the extra sequential collectives compression
        adds. Times are maxima over the ranks, so every rank decides alike. Deciding at
        the mild level is conservative: the aggressive level costs about as much
        computation and saves more transfer.

        ``compute_s`` (seconds per step of forward and backward, e.g. from
        :func:`accordion.calibration.measure_step_compute`) lets the model count the
        transfer that hides behind computation: a step then takes the longer of the two,
        and compression is chosen only while the link is the bottleneck. Without it the
        transfer is assumed not to overlap at all, which favours compression.

        Returns a JSON-serialisable report (also in :meth:`stats` as ``"calibration"``):
        ``bandwidth`` (bytes/s), ``latency`` (s), ``link_samples`` ([bytes, s] pairs, empty
        when given), ``buckets``, ``step_compute_s`` (``compute_s``), ``dense_keys`` and,
        per compressible tensor, ``dense_s``, ``compressed_s``, ``compute_s`` and
        ``compress``.
        """
        from .calibration import measure_compute, measure_link
        from .costmodel import TensorCost, choose_dense, transfer_time

        if self._module is None and not self._shapes:
            raise ValueError("calibrate needs bound parameters: pass model= or call bind_module")
        if (bandwidth is None) != (latency is None):
            raise ValueError("bandwidth and latency must be given together, or neither")
        if bandwidth is not None:
            if isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float):
                raise TypeError(f"bandwidth must be a number of bytes/s, got {bandwidth!r}")
            if isinstance(latency, bool) or not isinstance(latency, int | float):
                raise TypeError(f"latency must be a number of seconds, got {latency!r}")
            if not (bandwidth > 0 and math.isfinite(bandwidth)):
                raise ValueError(f"bandwidth must be > 0 and finite bytes/s, got {bandwidth!r}")
            if not (latency >= 0 and math.isfinite(latency)):
                raise ValueError(f"latency must be >= 0 and finite seconds, got {latency!r}")
        for name, value in (("buckets", buckets), ("repeats", repeats)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if compute_s is not None:
            if isinstance(compute_s, bool) or not isinstance(compute_s, int | float):
                raise TypeError(f"compute_s must be a number of seconds, got {compute_s!r}")
            if not (compute_s >= 0 and math.isfinite(compute_s)):
                raise ValueError(f"compute_s must be >= 0 and finite seconds, got {compute_s!r}")
        world, transport = self._world()
        group = transport.group if transport is not None else None
        samples: list[list[float]] = []
        if bandwidth is None:
            if world == 1:
                raise ValueError("a single process has no link to measure: give bandwidth")
            link = measure_link(group)
            bandwidth, latency = link.bandwidth, link.latency
            samples = [[nbytes, seconds] for nbytes, seconds in link.samples]
        keys = [k for k, shape in self._shapes.items() if is_compressible(shape)]
        if buckets is None:
            total = sum(math.prod(s) * self._element_size[k] for k, s in self._shapes.items())
            buckets = 1 + math.ceil(total / (25 * 2**20))
        kind, mild = self.compressor.kind, self.mild
        costs = []
        if kind != "dense" and keys:

            def fresh():
                if kind == "powersgd":
                    return PowerSGD(mild, seed=self.seed)
                return make_compressor(kind, mild)

            dtype = torch.float16 if self._element_size[keys[0]] == 2 else torch.float32
            device = next(iter(self._module.parameters())).device if self._module else "cpu"
            compute = measure_compute(
                fresh, [self._shapes[k] for k in keys], dtype, device,
                repeats=repeats, group=group if world > 1 else None,
            )  # fmt: skip
            for key, extra_s in zip(keys, compute):
                shape, size = self._shapes[key], self._element_size[key]
                w = max(world, 2)  # a single process still gets a verdict for the model
                costs.append(
                    TensorCost(
                        key,
                        shape,
                        dense_s=transfer_time(shape, "dense", None, w, bandwidth, size),
                        compressed_s=transfer_time(shape, kind, mild, w, bandwidth, size),
                        compute_s=extra_s,
                    )  # fmt: skip
                )
        other = sum(
            transfer_time(shape, "dense", None, max(world, 2), bandwidth, self._element_size[k])
            for k, shape in self._shapes.items()
            if not is_compressible(shape)
        )
        dense = (
            choose_dense(costs, max(world, 2), latency, buckets, compute_s, other) if costs else []
        )
        self.set_dense(dense)
        self.calibration = {
            "bandwidth": float(bandwidth),
            "latency": float(latency),
            "link_samples": samples,
            "buckets": buckets,
            "step_compute_s": compute_s,
            "dense_keys": list(dense),
            "tensors": {
                c.key: {
                    "dense_s": c.dense_s,
                    "compressed_s": c.compressed_s,
                    "compute_s": c.compute_s,
                    "compress": c.key not in dense,
                }
                for c in costs
            },
        }
        return self.calibration

    def set_dense(self, keys: Iterable[str]) -> None:
        """Send these parameter keys dense from the next step on (and compress the others
        as usual). What their error-feedback memory owes goes with their next step."""
        if isinstance(keys, str):
            raise TypeError("keys must be an iterable of parameter keys, not a single str")
        keys = list(keys)
        unknown = [k for k in keys if k not in self._shapes]
        if unknown:
            raise ValueError(f"keys must be bound parameter keys, unknown: {unknown[:5]}")
        self.reducer.set_dense(keys)
        for key in keys:
            self._accumulators.pop(key, None)  # a dense tensor's level never matters

    @property
    def dense_keys(self) -> list[str]:
        """Keys sent dense by the cost model's choice (see :meth:`calibrate`)."""
        return [k for k in self._shapes if k in self.reducer.dense_keys]

    # --- decisions ------------------------------------------------------------------------

    @staticmethod
    def _lr(optimizer: torch.optim.Optimizer | None, next_lr: float | None) -> float | None:
        if next_lr is not None:
            if isinstance(next_lr, bool) or not isinstance(next_lr, int | float):
                raise TypeError(f"next_lr must be a float, got {next_lr!r}")
            if not math.isfinite(next_lr) or next_lr < 0:
                raise ValueError(f"next_lr must be a finite float >= 0, got {next_lr}")
            return float(next_lr)
        if optimizer is None:
            return None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        return float(optimizer.param_groups[0]["lr"])

    def _decay(self, lr: float | None, lr_will_decay: bool | None) -> bool:
        if lr_will_decay is not None:
            if not isinstance(lr_will_decay, bool):
                raise TypeError(f"lr_will_decay must be a bool, got {lr_will_decay!r}")
            decay = lr_will_decay
        else:
            decay = lr is not None and self._last_lr is not None and lr < self._last_lr
        if lr is not None:
            self._last_lr = lr
        return decay

    def _agreed_norms(self) -> dict[str, float]:
        """Norms of the accumulated local gradients, identical on every rank."""
        keys = [k for k in self._shapes if k in self._accumulators]
        if not keys:
            return {}
        accs = [self._accumulators[k] for k in keys]
        norms = torch.stack([torch.linalg.vector_norm(a) for a in accs]).double()
        world, transport = self._world()
        if world > 1:
            group = transport.group
            if self.statistic == "rank0":
                dist.broadcast(norms, src=dist.get_global_rank(group, 0), group=group)
            else:
                dist.all_reduce(norms, group=group)
                norms /= world
        return dict(zip(keys, norms.tolist()))

    def _apply(self, decisions: Mapping[str, bool]) -> None:
        comp = self.reducer.compressor
        mild = [k for k, critical in decisions.items() if critical]
        aggressive = [k for k, critical in decisions.items() if not critical]
        if mild:
            comp.set_level(self.mild, keys=mild)
        if aggressive:
            comp.set_level(self.aggressive, keys=aggressive)
        for acc in self._accumulators.values():
            acc.zero_()

    def end_epoch(
        self,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        next_lr: float | None = None,
        lr_will_decay: bool | None = None,
    ) -> dict[str, bool]:
        """End the current epoch: decide each layer's level for the next epochs.

        Call it on every rank after ``scheduler.step()``. A learning-rate decay is
        detected by comparing ``optimizer.param_groups[0]["lr"]`` (or ``next_lr``) with
        the value seen at the previous call; ``lr_will_decay`` overrides that. Collective:
        with ``statistic="rank0"`` rank 0's norms are broadcast, with ``"mean"`` averaged.

        Returns:
            Parameter key -> True (critical: mild level) or False (aggressive), for the
            compressed parameters; the levels take effect from the next step.
        """
        if self.interval_unit != "epoch":
            raise ValueError("end_epoch needs interval_unit='epoch'; this state counts steps")
        decay = self._decay(self._lr(optimizer, next_lr), lr_will_decay)
        if not self.adaptive or not self._compressed_keys():  # nothing has a level to pick
            self.epoch += 1
            return {}
        norms = self._agreed_norms() if self.detector.needs_statistic(self.epoch) else {}
        if self.detector.needs_statistic(self.epoch) and not norms:
            raise RuntimeError(
                f"no gradient reached the Accordion state during epoch {self.epoch}: "
                "is the hook registered (or reduce_gradients called) every step?"
            )
        decisions = self.detector.end_epoch(self.epoch, norms, decay)
        self._apply(decisions)
        self.epoch += 1
        return decisions

    def end_step(
        self,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        next_lr: float | None = None,
        lr_will_decay: bool | None = None,
    ) -> dict[str, bool] | None:
        """Count one optimizer step (``interval_unit="step"``); call it on every rank
        after ``optimizer.step()`` (and after ``scheduler.step()`` if it steps per
        iteration). At the end of each window of ``interval`` steps the rule decides, as
        :meth:`end_epoch` does per epoch. A learning-rate decay switches every layer to
        the mild level at once, until the end of the next window.

        Returns the decisions at a window end, else ``None``.
        """
        if self.interval_unit != "step":
            raise ValueError("end_step needs interval_unit='step'; this state counts epochs")
        decay = self._decay(self._lr(optimizer, next_lr), lr_will_decay)
        self.step += 1
        if not self.adaptive or not self._compressed_keys():
            return None
        if self.step % self.detector.interval_steps != 0:
            if decay:  # a decay makes every layer critical at once, not at the window end
                self.reducer.compressor.set_level(self.mild, keys=list(self.levels()))
            return None
        norms = self._agreed_norms()
        decisions = self.detector.end_window(norms, decay)
        self._apply(decisions)
        return decisions

    # --- statistics and checkpoints -------------------------------------------------------

    def levels(self) -> dict[str, Any]:
        """The level each bound compressible parameter will use at the next step
        (``None`` for those the cost model sends dense)."""
        comp, dense = self.reducer.compressor, self.reducer.dense_keys
        return {
            k: None if k in dense else comp.level(k)
            for k, s in self._shapes.items()
            if is_compressible(s)
        }

    def stats(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot for logging.

        ``layers`` maps each parameter key to its current ``level`` (``None`` when it is
        sent dense), ``shape``, ``floats`` (paper convention) and ``bytes`` (wire) sent so
        far by this rank; ``checks`` lists the detector's checks with, per layer, the old
        norm, new norm and ratio (``None`` for infinity) and the decision.
        """
        comp = self.reducer.compressor
        totals = self.ledger.totals()
        compressed = set(self._compressed_keys())
        layers = {}
        for key, shape in self._shapes.items():
            sent = totals.get(key, {"floats": 0, "bytes": 0.0})
            layers[key] = {
                "level": comp.level(key) if key in compressed else None,
                "shape": list(shape),
                "floats": sent["floats"],
                "bytes": sent["bytes"],
            }
        return {
            "compressor": self.compressor_name,
            "mild": self.mild,
            "aggressive": self.aggressive,
            "epoch": self.epoch,
            "step": self.step,
            "total_floats": self.ledger.total_floats,
            "total_bytes": self.ledger.total_bytes,
            "non_finite_steps": self.reducer.non_finite_steps,
            "dense_keys": self.dense_keys,
            "calibration": self.calibration,
            "layers": layers,
            "checks": self.detector.history,
        }

    def _config(self) -> dict[str, Any]:
        detector = self.detector
        interval = (
            detector.interval if isinstance(detector, RegimeDetector) else detector.interval_steps
        )
        return {
            "compressor": self.compressor_name,
            "mild": self.mild,
            "aggressive": self.aggressive,
            "interval": interval,
            "eta": detector.eta,
            "statistic": self.statistic,
            "interval_unit": self.interval_unit,
            "seed": self.seed,
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: tensors and plain values (``torch.load(weights_only=True)``).

        Error-feedback memories differ between ranks, so every rank saves its own file,
        e.g. ``torch.save(state.state_dict(), f"{dir}/accordion-rank{rank}.pt")``, and
        loads its own on resume with the same world size.
        """
        world = self._world_size()
        return {
            "format": CHECKPOINT_FORMAT,
            "world_size": world,
            "rank": dist.get_rank(self.process_group) if world > 1 else 0,
            "config": self._config(),
            "shapes": {k: list(s) for k, s in self._shapes.items()},
            "compressor": self.reducer.compressor.state_dict(),
            "memory": self.reducer.memory.state_dict(),
            "accumulators": {k: a.clone() for k, a in self._accumulators.items()},
            "detector": self.detector.state_dict(),
            "ledger": self.ledger.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "last_lr": self._last_lr,
            "non_finite_steps": self.reducer.non_finite_steps,
            "dense_keys": self.dense_keys,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by the same rank of a job with the same world
        size, model and configuration; anything else raises ``ValueError``."""
        if not isinstance(state, Mapping) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                f"state must come from AccordionState.state_dict() (format {CHECKPOINT_FORMAT})"
            )
        world = self._world_size()
        if state["world_size"] != world:
            raise ValueError(
                f"the checkpoint was saved with world size {state['world_size']}, "
                f"this job has {world}: Accordion state cannot be resharded"
            )
        rank = dist.get_rank(self.process_group) if world > 1 else 0
        if state["rank"] != rank:
            raise ValueError(f"this is rank {rank}'s state loader, got rank {state['rank']}'s file")
        mine = self._config()
        for name, value in state["config"].items():
            if mine.get(name) != value:
                raise ValueError(
                    f"the checkpoint's {name} is {value!r} but this state's is {mine.get(name)!r}"
                )
        expected = {k: tuple(s) for k, s in state["shapes"].items()}
        for key, shape in self._shapes.items():
            if expected.get(key) != shape:
                raise ValueError(
                    f"the loaded Accordion state does not match the model: parameter {key!r} "
                    f"has shape {shape}, the checkpoint {expected.get(key)}"
                )
        self._expected_shapes = expected
        self._check_expected()
        self.reducer.compressor.load_state_dict(state["compressor"])
        self.reducer.memory.load_state_dict(state["memory"])
        self._accumulators = {k: a.clone() for k, a in state["accumulators"].items()}
        self.detector.load_state_dict(state["detector"])
        self.ledger.load_state_dict(state["ledger"])
        self.epoch = int(state["epoch"])
        self.step = int(state["step"])
        self._last_lr = state["last_lr"]
        self.reducer.non_finite_steps = int(state["non_finite_steps"])
        # the cost model's choice is part of the training: resume it, do not re-measure
        self.reducer.set_dense(state.get("dense_keys", []))


def _dense_buffer(buffer: torch.Tensor, world: int):
    """An exchange averaging a flat bucket buffer in place (no copies)."""
    buffer.div_(world)
    yield [AllReduce(buffer)]
    return True


def accordion_hook(
    state: AccordionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: Accordion's adaptive compression of one gradient bucket.

    Each parameter's gradient is compressed at the level the state holds for it (tensors
    with fewer than 2 dimensions are averaged dense): all dense tensors of the bucket in
    one all-reduce, all PowerSGD P factors in one all-reduce and then all Q factors in
    another (top-k: one all-gather of values, one of indices), chained with futures so
    that communication overlaps the rest of the backward pass. Returns a future of the
    bucket's buffer holding the averaged gradients.

    Example::

        state = AccordionState(net, compressor="powersgd", mild=2, aggressive=1)
        ddp_model.register_comm_hook(state, accordion_hook)
    """
    return state.reduce_bucket(bucket)


__all__ = ["AccordionState", "accordion_hook", "DEFAULT_LEVELS"]
