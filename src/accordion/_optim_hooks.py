"""An optimizer step pre-hook that also works for steps given a closure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Before = Callable[[torch.optim.Optimizer, Any, Any], None]


def closure_aware(before: Before) -> Callable[[torch.optim.Optimizer, Any, Any], Any]:
    """A step pre-hook running ``before(optimizer, args, kwargs)`` before the step, or,
    for a step given a closure (Lightning's automatic optimization, ``step(closure)``),
    once the closure has run: its backward makes the gradients ``before`` reads."""

    def pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        # torch passes the step's own arguments: (optimizer, closure?) and kwargs
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            before(optimizer, args, kwargs)
            return None

        def backward_then_before() -> Any:
            loss = closure()
            before(optimizer, args, kwargs)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": backward_then_before}
        return (args[0], backward_then_before, *args[2:]), kwargs

    return pre_hook
