"""The controller: the parts of Accordion for one model, joined.

* a :class:`~accordion.params.ParameterTable` (stable keys per parameter),
* a :class:`~accordion.compress.Reducer` (compressor + error-feedback memory),
* a :class:`~accordion.statistic.Statistic` (whose gradient sums count, and how the ranks
  agree on their norms),
* a :class:`~accordion.policy.decider.Decider` (the ladder of levels, the schedule, the
  rule, the rungs and the learning-rate decays),
* a :class:`~accordion.accounting.Ledger` of what was sent, priced by
  :class:`~accordion.report.Costs`,
* a transport that carries every collective, the ranks' agreements included.

The world size is read when the transport opens, at the first exchange (or given as
``transport=``), not when the controller is built: one built before
``init_process_group`` averages over the group it finds then. Once the layers and the
world size are known, one ``RuntimeWarning`` names the rungs that would send at least as
many bytes as a dense ring all-reduce (``Compressor.messages`` under ring algorithms).

Adapters make one call per step, :meth:`Controller.reduce`: the DDP communication hook
(``accordion.ddp``), FSDP2's all-reduce hook (``accordion.fsdp``) and the loop without
DDP (:meth:`Controller.reduce_gradients`). The training loop tells it when an epoch or a
step ends; :meth:`Controller.state_dict` follows ``accordion.checkpoint.format``.
"""

# No `from __future__ import annotations`: a DDP hook's annotations are checked at run time.
import datetime
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._validate import check_choice
from .accounting import Ledger
from .agreement import agreed_rungs, agreement_device, check_agreement
from .audit import Audits, measured_step
from .calibration import calibrate
from .checkpoint import format as checkpoint_format
from .compress import (
    COLLECTIVES,
    ErrorFeedback,
    Exchange,
    Reducer,
    average_in_place,
    compressor_class,
)
from .compress.base import RANK_CHANGE_POLICIES
from .compress.transport import (
    check_process_group,
    check_timeout,
    check_workers_per_host,
    open_transport,
    world_and_rank,
)
from .compress.wire import Message, allreduce_bytes, ring_bytes
from .defaults import resolve
from .params import ParameterTable
from .policy import Rule, Schedule
from .policy.decider import Decider, ladder_of, rule_of
from .report import Costs, dense_floats, stats, useless_levels
from .statistic import STATISTICS, Layers, Statistic, make_statistic

__all__ = ["Controller", "STATISTICS"]


def _counter(name: str, doc: str) -> property:
    """A read-write property for the decider's counter ``name`` (``epoch``, ``step``)."""
    return property(lambda self: getattr(self.decider, name),
                    lambda self, value: setattr(self.decider, name, value), doc=doc)  # fmt: skip


def _check_levels(controller: "Controller", stacklevel: int) -> None:
    """Warn once of the layers some level of ``controller`` sends dense, and of the
    compressor's advice on a level, in one ``RuntimeWarning``
    (:func:`accordion.report.useless_levels`)."""
    controller._levels_checked = True
    message = useless_levels(controller.ladder, controller._layers())
    if message:
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
    if controller._transport is not None:  # else at the first exchange: opening it is collective
        _check_wire(controller, controller._transport.world_size, stacklevel + 1)


def _check_once(controller: "Controller", transport: Any, stacklevel: int) -> None:
    """At an exchange: the warnings not yet given, once every layer and the world size are
    known (the levels' at the first step's end when bound lazily)."""
    if not controller._levels_checked and controller.step > 0:
        _check_levels(controller, stacklevel)
    if not controller._wire_checked and controller._levels_checked:
        _check_wire(controller, transport.world_size, stacklevel)


def _check_wire(controller: "Controller", world_size: int, stacklevel: int) -> None:
    """Warn once, in one ``RuntimeWarning``, of every rung that would send at least as many
    wire bytes as a dense ring all-reduce at ``world_size`` workers, naming the layers
    (:func:`_wire_heavy_levels`)."""
    controller._wire_checked = True
    layers = controller._layers()
    element_sizes = controller.params.element_size
    message = _wire_heavy_levels(controller.ladder, layers.reducer,
                                {k: layers.shapes[k] for k in layers.compressed()},
                                {k: element_sizes.get(k, 4) for k in layers.compressed()},
                                world_size, controller.collective)  # fmt: skip
    if message:
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def _wire_heavy_levels(ladder: Any, reducer: Reducer, shapes: Mapping[str, tuple[int, ...]],
                       element_sizes: Mapping[str, int], world_size: int,
                       collective: str = "auto") -> str | None:  # fmt: skip
    """The warning, or ``None``, of the rungs of ``ladder`` at which some of the layers of
    ``shapes`` (key -> shape, gradients of ``element_sizes[key]`` bytes per value) would
    each send at least as many bytes per worker as a dense ring all-reduce of it at
    ``world_size`` workers (``Compressor.messages`` under ring algorithms,
    :func:`~accordion.compress.wire.ring_bytes`): an all-gather's bytes grow with the
    workers; with ``collective="all_gather"`` two-phase messages are all-gathered too.
    Layers a rung sends dense (``Compressor.pays``) are not counted; one worker sends
    nothing either way."""
    if world_size < 2:
        return None
    cls, heavy = ladder.compressor, []
    for level in dict.fromkeys(ladder.levels):
        keys = []
        for key, shape in shapes.items():
            if not (cls.applies_at(shape, level) and reducer.pays(shape, level)):
                continue  # sent dense at this rung: useless_levels says so
            size = element_sizes[key]
            dense = allreduce_bytes(math.prod(shape) * size, world_size)
            messages = [Message("allgather", m.slot, m.nbytes)
                        if collective == "all_gather" and m.op == "twophase" else m
                        for m in cls.messages(shape, level, size)]  # fmt: skip
            if ring_bytes(messages, world_size) >= dense:
                keys.append(key)
        if keys:
            more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
            heavy.append(f"{cls.label(level)} for {len(keys)} layer(s) "
                         f"({', '.join(map(repr, keys[:5]))}{more})")  # fmt: skip
    if not heavy:
        return None
    return (f"at {world_size} workers some rungs send at least as many bytes as a dense ring "
            f"all-reduce (their all-gathers grow with the workers): {'; '.join(heavy)}; "
            f"a compressor whose bytes stay flat in the workers (all-reduced, or quantised in "
            f"two phases) sends less (levels {list(ladder.levels)})")  # fmt: skip


class Controller:
    """Accordion for one model: compression, statistics, decisions, accounting, checkpoints.

    Args:
        model: the module whose gradients are averaged (plain or DDP-wrapped), or ``None``
            to bind parameters lazily from the buckets.
        compressor: a registered compressor name (``accordion.compress.compressor_names()``).
            Default ``None``: without levels the default ladder, int8 -> int4 of ``"mixed"``;
            levels without it are PowerSGD ranks (:func:`accordion.defaults.resolve`).
        mild: level in critical regimes (PowerSGD rank, top-k fraction, ...). Default:
            the compressor's (rank 2 / top-k 0.99).
        aggressive: level elsewhere. Default: rank 1 / top-k 0.1. ``mild == aggressive``
            gives a static compressor (and skips the statistic).
        interval: how often the rule checks, in epochs (``interval_unit="epoch"``) or in
            optimizer steps (``"step"``). Default: the rule's ``default_interval``, 1 for
            the guarded rule, 10 for the paper's (which used 10 for CNNs, 5 for the LSTM).
        eta: the default rule's threshold on a layer's gradient norm's relative change (0.5).
        statistic: ``"sharded"`` (the default: each layer's statistic is one rank's, as
            in the paper, but each rank sums about ``1 / world_size`` of the layers),
            ``"rank0"`` (the paper: rank 0's decide every layer) or ``"mean"`` (averaged
            over ranks): see :mod:`accordion.statistic`; or a ``Statistic`` object.
        interval_unit: ``"epoch"`` (call :meth:`end_epoch`) or ``"step"`` (:meth:`end_step`).
        process_group: the group to average over, ``None`` (the default) or a ``ProcessGroup``.
        seed: seed shared by all ranks for the compressor's random state (PowerSGD's Q).
        on_rank_change: PowerSGD's Q at a rank switch: ``"reuse"`` (default) or
            ``"redraw"`` (the paper's scripts). Ignored by compressors without it.
        levels: the whole ladder instead of ``mild``/``aggressive``: two or more levels,
            mildest first, e.g. ``(4, 2, 1)``.
        rule: the :class:`~accordion.policy.Rule` that decides the rungs. Default
            ``GuardedRule(eta)`` (``docs/hook.md``); ``PaperRule()``, ``interval=10``: the paper's.
        timeout: how long Accordion's collectives wait for the other ranks before they raise
            (naming the exchange phase). Default: the group's (``init_process_group``'s).
        transport: the transport of every collective (``world_size``, ``rank``, ``run``,
            ``run_async``). Default: on a private copy of ``process_group``, at first use.
        collective: how ``int``/``nq`` send: ``"auto"`` (default: the fewer bytes),
            ``"all_gather"`` or ``"two_phase"`` (:mod:`accordion.compress.two_phase`).
        workers_per_host: they average in full precision, quantisers compress across hosts
            only; ``"auto"``: ``torchrun``'s ``LOCAL_WORLD_SIZE`` (:func:`workers_per_host`).
    """

    def __init__(self, model: nn.Module | None = None, compressor: str | None = None,
                 mild: Any = None, aggressive: Any = None, interval: int | None = None,
                 eta: float | None = None, statistic: str | Statistic = "sharded",
                 interval_unit: str = "epoch", process_group: Any = None, seed: int = 0,
                 on_rank_change: str = "reuse", levels: Sequence[Any] | None = None,
                 rule: Rule | None = None, timeout: datetime.timedelta | None = None,
                 transport: Any = None, collective: str = "auto",
                 workers_per_host: int | str = "auto"):  # fmt: skip
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
        self.process_group = group = check_process_group(process_group)
        compressor, levels = resolve(compressor, model, group, levels, mild, aggressive)
        cls = compressor_class(compressor)
        self._statistic = make_statistic(statistic)
        rule = rule_of(rule, eta)
        schedule = Schedule(rule.default_interval if interval is None else interval, interval_unit)
        #: The policy over time: ladder, schedule, rule, rungs, decays, epochs and steps.
        self.decider = Decider(ladder_of(cls, mild, aggressive, levels), rule, schedule)
        self.compressor_name = cls.name
        self.timeout = check_timeout(timeout)
        self.seed = seed
        check_choice("on_rank_change", on_rank_change, RANK_CHANGE_POLICIES)  # for every kind
        self.collective = check_choice("collective", collective, COLLECTIVES)  # integers' way
        self._options = {"seed": seed, "on_rank_change": on_rank_change, "collective": collective}
        self.workers_per_host = check_workers_per_host(workers_per_host)
        self.reducer = self._new_reducer()
        self.ledger = Ledger()
        self.params = ParameterTable()
        self._costs = Costs()  # the ledger's prices, per key and level
        self._levels_checked = self._wire_checked = False  # what is warned of once
        self._transport = _checked_transport(transport)
        self._audits = Audits()  # which step a rule that needs "audit" audits
        #: The last :meth:`calibrate` report, or ``None``.
        self.calibration: dict[str, Any] | None = None
        if model is not None:
            self.bind_module(model)

    def _new_compressor(self):
        return self.ladder.compressor.build(self.ladder.mildest, **self._options)

    def _new_reducer(self) -> Reducer:
        return Reducer(self._new_compressor(), ErrorFeedback())

    rule = property(lambda self: self.decider.rule, doc="The rule that decides the rungs.")
    ladder = property(lambda self: self.decider.ladder, doc="The levels, mildest first.")
    schedule = property(lambda self: self.decider.schedule, doc="When the rule checks.")
    statistic = property(lambda self: self._statistic.name, doc="The statistic's name.")
    sums = property(lambda self: self._statistic.sums, doc="This rank's gradient sums.")
    mild = property(lambda self: self.ladder.mildest, doc="The mildest level (rung 0).")
    aggressive = property(lambda self: self.ladder.most_aggressive, doc="The last rung's level.")
    adaptive = property(lambda self: self.ladder.adaptive, doc="Whether the levels differ.")
    compressor = property(lambda self: self.reducer.compressor, doc="The compressor object.")
    interval_unit = property(lambda self: self.schedule.unit, doc='"epoch" or "step".')
    _module = property(lambda self: self.params.module)
    epoch = _counter("epoch", "Epochs ended so far (the index of the current epoch).")
    step = _counter("step", "Optimizer steps (or hook iterations) seen so far.")

    def bind_module(self, model: nn.Module) -> None:
        """Name parameters after ``model.named_parameters()`` (plain or DDP-wrapped);
        those bound lazily under ``"#i"`` keep their state under their new names."""
        renamed = self.params.bind(model)
        self._statistic.rename(renamed)
        self.decider.rename(renamed)
        for old, new in renamed.items():
            if old in self.ledger.layers:
                self.ledger.layers[new] = self.ledger.layers.pop(old)
            self.reducer.rename(old, new)
        if renamed:
            self._costs.clear()  # keyed by the old names
        if not self._levels_checked:
            _check_levels(self, stacklevel=4)

    def transport(self) -> Any:
        """The transport of every collective; every rank must get here at the same point
        (the first creates it: :func:`~accordion.compress.transport.open_transport`)."""
        if self._transport is None:
            self._transport = open_transport(self.process_group, self.timeout,
                                             self.workers_per_host)  # fmt: skip
        return self._transport

    def _layers(self) -> Layers:
        """The layers now (all known once a module is bound or a step ended)."""
        return Layers(self.params.shapes, self.reducer, self.params.module is not None
                      or self.step > 0)  # fmt: skip

    def reduce(self, keys: Sequence[str], grads: Sequence[torch.Tensor], last: bool = True,
               buffer: torch.Tensor | None = None) -> Exchange[bool]:  # fmt: skip
        """One step's work on ``grads``, the gradients of ``keys``: add them to the
        statistic when the schedule gathers it and their cost to the ledger, count the
        step when ``last`` (the step's last call; ``end_step`` counts steps itself), and
        return the exchange averaging them in place, to run on :meth:`transport`.
        ``buffer``: the flat tensor ``grads`` are views of (a DDP bucket's), sent as it is
        in one all-reduce when every gradient goes dense and owes no memory."""
        transport = self.transport()
        world = transport.world_size
        audit = self._audits.due(self.rule, self.adaptive, self.schedule.collecting(self.epoch),
                                 self.step)  # fmt: skip
        dense = audit and "errors" not in self.rule.needs  # L-GreCo's: compressed as usual
        self._observe(keys, grads, transport, dense=dense)
        if last and self.interval_unit == "epoch":
            self.step += 1
        if audit:
            return measured_step(self, keys, grads, buffer, world, self._layers().compressed(),
                                 self._options)  # fmt: skip
        reducer = self.reducer
        if buffer is not None and not reducer.noise.on and not any(
            reducer.sends_compressed(g, k) or reducer.memory.get(k) is not None
            for k, g in zip(keys, grads)
        ):  # all dense: the bucket's flat buffer goes as it is, as in DDP's own hook
            return average_in_place(grads, world, buffer)
        return reducer.exchange(keys, grads, world, getattr(transport, "local_size", 1))

    def _observe(self, keys: Sequence[str], grads: Sequence[torch.Tensor], transport,
                 dense: bool = False) -> None:  # fmt: skip
        """Before an exchange: add ``grads`` to the statistic when the schedule gathers it,
        and their cost at the current levels (every one dense with ``dense``) to the ledger."""
        self.decider.observed = True
        _check_once(self, transport, stacklevel=6)
        world, layers = transport.world_size, self._layers()
        if self.adaptive and self.schedule.collecting(self.epoch) and layers.compressed():
            self._statistic.observe(keys, grads, layers, world, transport.rank)
        self._costs.record(self.ledger, keys, grads, world, self.reducer, self.compressor_name,
                           dense)  # fmt: skip

    def reduce_gradients(self, parameters: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Average ``p.grad`` over the process group in place, with compression: the
        same work as the hook, for loops without DDP. Call it after ``backward()``.

        ``parameters`` defaults to the bound module's parameters; those without a
        gradient are skipped (the same set must have gradients on every rank).
        """
        if parameters is None:
            if self.params.module is None:
                raise ValueError("parameters must be given when no module is bound "
                                 "(pass model= to AccordionState or call bind_module)")  # fmt: skip
            parameters = self.params.module.parameters()
        params = [p for p in parameters if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]  # all of params' (for the type)
        self.transport().run(self.reduce(self.params.keys(params), grads))

    calibrate = calibrate  # the function is the method: calibrate(controller, bandwidth, ...)

    def set_dense(self, keys: Iterable[str]) -> None:
        """Send these parameter keys dense from the next step on (and compress the others
        as usual). What their error-feedback memory owes goes with their next step."""
        if isinstance(keys, str):
            raise TypeError("keys must be an iterable of parameter keys, not a single str")
        keys = list(keys)
        unknown = [k for k in keys if k not in self.params.shapes]
        if unknown:
            raise ValueError(f"keys must be bound parameter keys, unknown: {unknown[:5]}")
        self.reducer.set_dense(keys)
        for key in keys:
            self._statistic.forget(key)  # a dense tensor's level never matters

    @property
    def dense_keys(self) -> list[str]:
        """Keys sent dense by the cost model's choice (see :meth:`calibrate`)."""
        return [k for k in self.params.shapes if k in self.reducer.dense_keys]

    def end_epoch(self, optimizer: torch.optim.Optimizer | None = None, *,
                  next_lr: float | None = None,
                  lr_will_decay: bool | None = None) -> dict[str, bool]:  # fmt: skip
        """End the current epoch: decide each layer's rung for the next epochs.

        Call it on every rank after ``scheduler.step()``. A learning-rate decay is
        detected by comparing ``optimizer.param_groups[0]["lr"]`` (or ``next_lr``) with
        the value seen at the previous call; ``lr_will_decay`` overrides that. Collective
        at a check: the statistics are agreed over the ranks (``statistic``).

        Returns:
            Parameter key -> True (critical: the mildest rung) or False, for the
            compressed parameters; :meth:`rungs` gives the rung indices. The levels take
            effect from the next step.
        """
        if self.interval_unit != "epoch":
            raise ValueError("end_epoch needs interval_unit='epoch'; this state counts steps")
        decision = self.decider.end(optimizer, next_lr, lr_will_decay, _Host(self))
        return {} if decision is None else decision  # None only at a step, never at an epoch

    def end_step(self, optimizer: torch.optim.Optimizer | None = None, *,
                  next_lr: float | None = None,
                  lr_will_decay: bool | None = None) -> dict[str, bool] | None:  # fmt: skip
        """Count one optimizer step (``interval_unit="step"``); call it on every rank
        after ``optimizer.step()`` (and after ``scheduler.step()`` if it steps per
        iteration). At the end of each window of ``interval`` steps the rule decides, as
        :meth:`end_epoch` does per epoch. A learning-rate decay switches every layer to
        the mildest rung at once, until the end of the next window.

        Returns the decisions (as :meth:`end_epoch`) at a window end, else ``None``.
        """
        if self.interval_unit != "step":
            raise ValueError("end_step needs interval_unit='step'; this state counts epochs")
        return self.decider.end(optimizer, next_lr, lr_will_decay, _Host(self))

    def critical(self) -> dict[str, bool]:
        """Per layer of the decision in force: whether it is at the mildest rung."""
        return self.decider.critical()

    def rungs(self) -> dict[str, int]:
        """Per layer of the decision in force: its rung (0 is the mildest)."""
        return dict(self.decider.rungs)

    def levels(self) -> dict[str, Any]:
        """The level each bound parameter that the compressor applies to will use at the
        next step (``None`` for those the cost model sends dense). A level that does not
        pay for the parameter's shape (``Compressor.pays``) sends it dense: the ledger and
        ``stats()`` count its dense floats."""
        return self._layers().levels()

    def dense_floats(self) -> int:
        """Paper-convention floats this rank would have sent uncompressed over the same
        steps (every recorded step of every layer dense): the reference for
        ``ledger.total_floats``."""
        return dense_floats(self.ledger, self.params.shapes, world_and_rank(self.process_group)[0])

    def stats(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot for logging: per layer its level, shape, floats
        and bytes sent so far, totals, counters, the calibration and the rule's history
        (see :func:`accordion.report.stats`; a host sync: it reads device counters)."""
        return stats(self, self._layers().compressed())

    def config(self) -> dict[str, Any]:
        """The settings a checkpoint must share with the state that loads it."""
        return {
            "compressor": self.compressor_name,
            "levels": list(self.ladder.levels),
            "interval": self.schedule.interval,
            "statistic": self.statistic,
            "interval_unit": self.interval_unit,
            "seed": self.seed,
            "collective": self.collective,
            "rule": {"name": self.rule.name, **self.rule.config()},
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (``accordion.checkpoint.format.ENTRIES``): tensors and plain
        values, for ``torch.load(weights_only=True)``. Error-feedback memories differ
        between ranks, so every rank saves its own file, e.g. ``torch.save(state.state_dict(),
        f"{dir}/accordion-rank{rank}.pt")``, and loads its own on resume."""
        world, rank = world_and_rank(self.process_group)
        return checkpoint_format.write(world, rank if world > 1 else 0, self.config(), self.params,
                                       self.reducer, self.sums, self.decider, self.ledger)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by the same rank of a job with the same world
        size, model and configuration (checkpoints of format 1, written before the policy
        layer, are read too); anything else raises ``ValueError`` naming the bad entry
        (a missing or unknown key, a shape, a level off the ladder, a type) and leaves
        this state as it was: every part is checked and loaded into a fresh object
        first, and swapped in at the end (see :func:`accordion.checkpoint.format.read`)."""
        world, rank = world_and_rank(self.process_group)
        parts = checkpoint_format.read(_with_collective(state), world, rank if world > 1 else 0,
                                       self.config(), self.params, self._new_reducer, self.ladder,
                                       self.rule)  # fmt: skip
        parts.reducer.noise.on = self.reducer.noise.on  # Adam's correction reads on
        self.reducer, self.ledger = parts.reducer, parts.ledger
        self._statistic.restart(parts.sums)  # "sharded": dealt out again at the next step
        self.decider.restore(parts.rungs, parts.counters)
        self._costs.clear()


class _Host:
    """The controller's side of a decision (:class:`accordion.policy.decider.Host`): the
    ranks' agreements over its transport, its statistic, its compressor's levels."""

    def __init__(self, controller: Controller):
        self._controller = controller
        self.source = controller._statistic.source

    def agree(self, call: str, counter: tuple[str, int], lr: float | None, decay: bool) -> None:
        """Every rank at the same ``counter``, rate and decay (``accordion.agreement``)."""
        transport = self._controller.transport()
        device = agreement_device(transport, self.device())
        check_agreement(transport, call, counter, lr, decay, device)

    def device(self) -> torch.device | None:
        """The device of the gradients seen so far (or of the bound module), if known."""
        controller = self._controller
        if controller.sums.device is not None:
            return controller.sums.device
        if controller._costs.device is not None:  # "sharded": a rank may sum no layer
            return controller._costs.device
        module = controller.params.module
        first = next(module.parameters(), None) if module is not None else None
        return None if first is None else first.device

    def compressed(self) -> list[str]:
        """The keys that have a level."""
        return self._controller._layers().compressed()

    def applied(self) -> list[str]:
        """The keys the compressor applies to, those sent dense included."""
        return list(self._controller._layers().levels())

    def statistics(self) -> tuple[dict[str, float], dict[str, float]]:
        """The statistic's norms (and the memories', when the rule needs them), agreed."""
        controller = self._controller
        with_memory = "memory_norms" in controller.rule.needs
        return controller._statistic.agree(controller.transport(), controller._layers(),
                                           with_memory, self.device())

    def agreed_rungs(self, keys: list[str], rungs: dict[str, int]) -> dict[str, int]:
        """Rank 0's decision, on every rank: a rule that decided otherwise elsewhere (it
        read something besides its observation) cannot make the ranks send different
        collectives."""
        controller = self._controller
        device = self.device()
        agreed, differed = agreed_rungs(controller.transport(), keys, rungs, device)
        if differed:
            warnings.warn(
                f"{type(controller.rule).__name__} decided differently on this rank than on "
                "rank 0; rank 0's decision applies (a rule must decide from its observation "
                "alone)",
                RuntimeWarning,
                stacklevel=5,
            )
        return agreed

    def set_level(self, level: Any, keys: list[str]) -> None:
        """``keys`` at ``level`` from the next step on."""
        self._controller.reducer.compressor.set_level(level, keys=keys)

    def checked(self) -> None:
        """A new period of the statistic."""
        self._controller.sums.zero()


def _with_collective(state: Any) -> Any:
    """``state`` in the current checkpoint format, its config's ``collective`` ``"auto"``
    (the default) when written before the option; a malformed one is left to the reader."""
    state = checkpoint_format.upgrade(state)
    config = state.get("config")
    if isinstance(config, Mapping) and "collective" not in config:
        state["config"] = {**config, "collective": "auto"}
    return state


def _checked_transport(transport: Any) -> Any:
    """``transport`` if it is ``None`` or has what a transport has, else ``TypeError``."""
    needed = ("world_size", "rank", "run", "run_async")
    if transport is None or all(hasattr(transport, name) for name in needed):
        return transport
    raise TypeError(f"transport must be None or a transport (with {', '.join(needed)}), "
                    f"got {type(transport).__name__}")  # fmt: skip
