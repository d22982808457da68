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
    loop then ends each epoch or each step on it (:mod:`accordion.harness.loop`)."""
    if not strategy.uses_accordion_hook:
        attach_torch_hook(strategy, ddp, config.seed)
        return None
    if strategy.family == "accordion":
        ladder: dict[str, Any] = {"levels": strategy.levels}
    else:  # static: one level, mild == aggressive
        ladder = {"mild": strategy.mild, "aggressive": strategy.aggressive}
    rule = None  # the library's default rule, with eta
    if strategy.rule or strategy.block is not None:
        block = None if strategy.block == "decay" else strategy.block
        options: dict[str, Any] = {} if strategy.block is None else {"block": block}
        if strategy.tau is not None:
            options["tau"] = strategy.tau
        name = strategy.rule or "guarded"
        rule = make_rule(name, config.eta if takes_eta(name) else None, **options)
    state = AccordionState(
        model,
        compressor=strategy.compressor,
        **ladder,
        interval=strategy.interval or config.interval,  # None: the rule's default
        interval_unit=config.interval_unit,  # what the interval counts: epochs or steps
        **({"rule": rule} if rule else {"eta": config.eta}),
        statistic=config.statistic,
        seed=config.seed,
        **({"on_rank_change": config.on_rank_change} if config.on_rank_change else {}),
    )
    ddp.register_comm_hook(state, accordion_hook)
    return state
