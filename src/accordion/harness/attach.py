"""Hook a strategy onto a DDP model: Accordion's through the library's public API
(``AccordionState`` + ``accordion_hook``), the baselines through PyTorch's own hooks."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..ddp import AccordionState, accordion_hook
from ..policy import make_rule, takes_eta
from .baselines import attach_torch_hook
from .config import TrainConfig
from .strategies import Strategy


def attach_strategy(
    config: TrainConfig, strategy: Strategy, model: nn.Module, ddp: DDP
) -> AccordionState | None:
    """Register the strategy's hook on ``ddp``; return its ``AccordionState`` (or ``None``).

    The state's interval counts ``config.interval_unit`` (epochs or optimizer steps): the
    loop then ends each epoch or each step on it (:mod:`accordion.harness.loop`). For a
    DiLoCo strategy nothing is registered: the state returned averages the pseudo-gradients
    (:class:`accordion.DiLoCo` ends a step on it per round)."""
    if strategy.sync_every is not None:  # DiLoCo: the state averages pseudo-gradients
        return make_state(config, strategy, model, "step")  # one step per round
    if not strategy.uses_accordion_hook:
        attach_torch_hook(strategy, ddp, config.seed)
        return None
    state = make_state(config, strategy, model, config.interval_unit)
    ddp.register_comm_hook(state, accordion_hook)
    return state


def make_state(config: TrainConfig, strategy: Strategy, model: nn.Module,
               interval_unit: str) -> AccordionState:  # fmt: skip
    """The strategy's ``AccordionState`` on ``model`` (not registered): its ladder, rule
    and interval (counting ``interval_unit``); a dense one for a dense strategy."""
    if strategy.family == "dense":
        return AccordionState(model, "dense", interval_unit=interval_unit, seed=config.seed)
    if strategy.family == "accordion":
        ladder: dict[str, Any] = {"levels": strategy.levels}
    else:  # static: one level, mild == aggressive
        ladder = {"mild": strategy.mild, "aggressive": strategy.aggressive}
    rule = None  # the library's default rule, with eta
    if strategy.rule or strategy.block is not None or strategy.open_ladder:
        block = None if strategy.block == "decay" else strategy.block
        options: dict[str, Any] = {} if strategy.block is None else {"block": block}
        if strategy.open_ladder:
            options["wait_for_decay"] = False
        if strategy.tau is not None:
            options["tau"] = strategy.tau
        if strategy.reference is not None:
            options["reference"] = strategy.reference
        name = strategy.rule or "guarded"
        rule = make_rule(name, config.eta if takes_eta(name) else None, **options)
    extra: dict[str, Any] = {"rule": rule} if rule else {"eta": config.eta}
    if config.on_rank_change:
        extra["on_rank_change"] = config.on_rank_change
    return AccordionState(
        model,
        compressor=strategy.compressor,
        **ladder,
        interval=strategy.interval or config.interval,  # None: the rule's default
        interval_unit=interval_unit,  # what the interval counts: epochs or steps
        statistic=config.statistic,
        seed=config.seed,
        collective=strategy.collective,  # how integer quantisers' payloads travel
        **extra,
    )
