"""Accordion as a DDP communication hook: a thin adapter over the controller.

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

``levels=(4, 2, 1)`` gives a ladder of more than two levels, and ``rule=`` another
decision rule (see ``accordion.policy``). Without DDP (a hand-written loop, as the
paper's own code): call ``state.reduce_gradients()`` after ``backward()``; it averages
every ``p.grad`` of the module in place over the process group, with the same
compression, statistics and decisions as the hook.

Where a framework builds the DDP module, ``state.register(model)`` finds it (inside
``torch.compile`` too) and registers the hook; ``accordion.integrations`` does it for
Lightning, Accelerate and the Hugging Face Trainer. A state built without a module binds
parameters lazily from the buckets it sees and names them ``"#0"``, ``"#1"``, ... in
order of first appearance (the same order on every rank); ``state.bind_module(module)``
names them after the module's parameters.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook checks the
# hook's annotations at run time, and strings do not compare equal to the types.
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .compress import compressor_class, compressor_names
from .controller import Controller

if TYPE_CHECKING:
    from .momentum_exchange import MomentumExchange


def _default_levels() -> dict[str, tuple]:
    return {name: compressor_class(name).default_levels for name in compressor_names()}


#: Default (mild, aggressive) levels per registered compressor (read from the registry).
DEFAULT_LEVELS = _default_levels()


class AccordionState(Controller):
    """Everything the Accordion hook keeps between steps, per parameter: the controller
    (see :class:`accordion.controller.Controller` for the arguments) plus the DDP hook's
    work for one bucket, one :meth:`~accordion.controller.Controller.reduce` call."""

    #: The :class:`~accordion.MomentumExchange` built on this state, or ``None``: past its
    #: freeze the hook hands it the buckets, to average the momenta instead.
    momentum_exchange: "MomentumExchange | None" = None

    def register(self, model: nn.Module) -> DistributedDataParallel:
        """Register :func:`accordion_hook` on the DDP module inside ``model`` and return it.

        ``model`` is a ``DistributedDataParallel`` module or wraps one (``torch.compile``'s
        ``OptimizedModule``, or any wrapper keeping it as ``.module``), as returned by
        Accelerate's ``prepare`` or held by a Lightning or Hugging Face trainer. A state
        without a module is bound to the DDP module; a bound state must own every
        parameter DDP averages, else ``ValueError`` (the hook would compress another
        model's gradients with this one's state).

        DDP takes one comm hook, registered once. A DDP module that has one already is a
        ``ValueError``: naming the hook, or, for this state's own hook, saying that it is
        registered already (an error, not a no-op: two code paths each registering the
        hook, e.g. an integration and a hand-written call, would also duplicate what
        they set up around it). Nothing is changed when it raises.
        """
        ddp = find_ddp(model)
        if getattr(ddp, "_use_python_reducer", False):  # private: absent on older torch
            raise ValueError(_PYTHON_REDUCER)
        _check_no_hook(ddp, self)
        bound = self.params.module
        if bound is None:
            self.bind_module(ddp)
        else:
            _check_owns(bound, ddp)
        ddp.register_comm_hook(self, accordion_hook)
        return ddp

    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The hook's work for one bucket; see :func:`accordion_hook`."""
        if not isinstance(bucket, dist.GradBucket):
            raise TypeError(_NOT_A_BUCKET.format(type(bucket).__name__))
        momentum = self.momentum_exchange
        if momentum is not None and momentum.active:
            return momentum.reduce_bucket(bucket)
        buffer = bucket.buffer()  # the gradients are views of it: averaged in place
        keys = self.params.keys(bucket.parameters())
        exchange = self.reduce(keys, bucket.gradients(), bucket.is_last(), buffer=buffer)

        def unpack(fut: torch.futures.Future) -> torch.Tensor:
            fut.value()  # re-raises an error from the exchange
            return buffer

        return self.transport().run_async(exchange).then(unpack)


def check_state(state: object) -> AccordionState:
    """``state`` if it is an :class:`AccordionState`, else ``TypeError`` naming its type
    (the integrations' check of what they are given)."""
    if not isinstance(state, AccordionState):
        raise TypeError(
            f"state must be an accordion.ddp.AccordionState, got {type(state).__name__}"
        )
    return state


_NOT_A_BUCKET = (
    "accordion_hook needs a dist.GradBucket, got {}: DDP calls comm hooks per parameter "
    "when built with torch._dynamo.config.optimize_ddp = 'python_reducer' (for compiled "
    "autograd), which Accordion does not support (its exchanges run outside the compiled "
    "graph). Keep optimize_ddp at its default ('ddp_optimizer'): torch.compile(ddp_model) "
    "works with the hook"
)
_PYTHON_REDUCER = (
    "this DDP module was built with torch._dynamo.config.optimize_ddp = 'python_reducer' "
    "(compiled autograd): DDP would call comm hooks per parameter, which Accordion does "
    "not support. Build DDP with optimize_ddp at its default ('ddp_optimizer'): "
    "torch.compile(ddp_model) works with the hook"
)


def find_ddp(model: nn.Module) -> DistributedDataParallel:
    """The ``DistributedDataParallel`` module that is ``model`` or that ``model`` wraps
    (through ``torch.compile``'s ``_orig_mod`` or a ``.module`` attribute)."""
    seen = model
    for _ in range(8):  # wrappers nest a few deep at most
        if isinstance(seen, DistributedDataParallel):
            return seen
        inner = getattr(seen, "_orig_mod", None)  # not `or`: an empty Sequential is falsy
        if inner is None:
            inner = getattr(seen, "module", None)
        if not isinstance(inner, nn.Module):
            break
        seen = inner
    raise TypeError(
        "model must be a DistributedDataParallel module or wrap one (torch.compile, "
        f"Accelerate), got {type(model).__name__}: wrap it in DDP first, or let the "
        "framework do it and register from its callback (accordion.integrations)"
    )


def _check_no_hook(ddp: DistributedDataParallel, state: "AccordionState") -> None:
    """Raise ``ValueError`` when ``ddp`` has a comm hook already (torch would raise a bare
    ``RuntimeError`` "... can only be called once"), naming it."""
    hooks = list(getattr(ddp, "_comm_hooks", None) or ())  # private: absent on older torch
    if any(hook is accordion_hook and st is state for hook, st in hooks):
        raise ValueError(
            "this AccordionState is already registered on this DDP module (its hook is "
            "there): DDP takes one comm hook, registered once, so register it once per "
            "DDP module"
        )
    if hooks:
        hook, other = hooks[0]
        name = getattr(hook, "__qualname__", None) or repr(hook)
        if hook is accordion_hook:
            name += f" with another {type(other).__name__}"
    else:
        name = _logged_hook(ddp)  # a built-in hook (C++) is not in _comm_hooks
    if name:
        raise ValueError(
            f"this DDP module already has a comm hook ({name}); DDP takes one. Remove "
            "the other hook (or build a new DDP module) to use Accordion's"
        )


def _logged_hook(ddp: DistributedDataParallel) -> str | None:
    """The name of the comm hook DDP's logging data records (built-in ones included),
    or ``None``; private API, so absent or failing means: not known."""
    logging_data = getattr(ddp, "_get_ddp_logging_data", None)
    if logging_data is None:
        return None
    try:
        name = logging_data().get("comm_hook")
    except (AssertionError, RuntimeError, AttributeError):  # no logger, or another torch
        return None
    return name or None


def _check_owns(bound: nn.Module, ddp: DistributedDataParallel) -> None:
    """Raise ``ValueError`` when ``ddp`` averages parameters that ``bound`` does not own."""
    owned = {id(p) for p in bound.parameters()}
    foreign = [n for n, p in ddp.module.named_parameters() if p.requires_grad
               and id(p) not in owned]  # fmt: skip
    if foreign:
        raise ValueError(
            f"the hook is registered on a model whose parameters the state's bound module "
            f"({type(bound).__name__}) does not own, e.g. {foreign[:3]}: build the "
            "AccordionState from the model that DDP wraps"
        )


def accordion_hook(
    state: AccordionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: Accordion's adaptive compression of one gradient bucket.

    Each parameter's gradient is compressed at the level the state holds for it (tensors
    the compressor does not apply to, e.g. PowerSGD's biases, are averaged dense): all
    dense tensors of the bucket in one all-reduce, all PowerSGD P factors in one
    all-reduce and then all Q factors in another (top-k: one all-gather of values, one of
    indices), chained with futures so that communication overlaps the rest of the
    backward pass. Returns a future of the bucket's buffer holding the averaged gradients.

    Example::

        state = AccordionState(net, compressor="powersgd", mild=2, aggressive=1)
        ddp_model.register_comm_hook(state, accordion_hook)
    """
    return state.reduce_bucket(bucket)


__all__ = ["AccordionState", "accordion_hook", "check_state", "find_ddp", "DEFAULT_LEVELS"]
