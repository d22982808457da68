"""AccordionState.register: finding the DDP module, and refusing a model it was not built for."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.ddp import AccordionState, find_ddp
from distributed import run_processes


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _step(model: nn.Module) -> None:
    model(torch.randn(4, 8)).sum().backward()


def _register_through_compile(rank, world_size):
    net = _net()
    state = AccordionState(net, compressor="powersgd", levels=(2, 1))
    wrapped = torch.compile(DDP(net))  # compiled lazily: building it compiles nothing
    ddp = state.register(wrapped)
    assert isinstance(ddp, DDP) and ddp.module is net
    _step(ddp)
    assert state.ledger.total_floats < state.dense_floats()


def test_register_finds_the_ddp_module_inside_torch_compile_and_the_hook_runs():
    run_processes(_register_through_compile, 2)


def _register_binds_an_unbound_state(rank, world_size):
    state = AccordionState(compressor="powersgd", levels=(2, 1))
    ddp = state.register(DDP(_net()))
    _step(ddp)
    assert list(state.levels()) == ["0.weight", "2.weight"]


def test_register_binds_an_unbound_state_to_the_ddp_module():
    run_processes(_register_binds_an_unbound_state, 2)


def _register_refuses_another_model(rank, world_size):
    state = AccordionState(_net(), compressor="powersgd", levels=(2, 1))
    with pytest.raises(ValueError, match="does not own"):
        state.register(DDP(_net()))


def test_register_refuses_a_model_whose_parameters_the_state_does_not_own():
    run_processes(_register_refuses_another_model, 2)


def _hook_refuses_another_model(rank, world_size):
    state = AccordionState(_net(), compressor="powersgd", levels=(2, 1))
    from accordion.ddp import accordion_hook

    ddp = DDP(_net())
    ddp.register_comm_hook(state, accordion_hook)  # around register's check
    with pytest.raises(Exception, match="belongs to no parameter of the bound module"):
        _step(ddp)


def test_the_hook_refuses_buckets_of_a_model_the_state_was_not_built_for():
    run_processes(_hook_refuses_another_model, 2)


def _register_refuses_python_reducer(rank, world_size):
    import torch._dynamo

    net = _net()
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        ddp = DDP(net)  # DDP reads the mode here
    state = AccordionState(net, compressor="powersgd", levels=(2, 1))
    with pytest.raises(ValueError, match="python_reducer"):
        state.register(ddp)


def test_register_refuses_a_ddp_built_for_compiled_autograd_python_reducer():
    run_processes(_register_refuses_python_reducer, 2)


def _register_twice(rank, world_size):
    net = _net()
    state = AccordionState(net, compressor="powersgd", levels=(2, 1))
    ddp = state.register(DDP(net))
    with pytest.raises(ValueError, match="already registered on this DDP module"):
        state.register(ddp)
    assert len(ddp._comm_hooks) == 1
    _step(ddp)  # the first registration stands
    assert 0 < state.ledger.total_floats < state.dense_floats()


def test_registering_the_same_state_twice_says_it_is_already_registered():
    run_processes(_register_twice, 2)


def _register_over(rank, world_size, other):
    """Register Accordion on a DDP module that has ``other`` hook: refused, naming it."""
    ddp = DDP(_net())
    if other == "allreduce_hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
        named = r"already has a comm hook \(allreduce_hook\)"
    else:  # a built-in (C++) hook is not in _comm_hooks
        ddp._register_builtin_comm_hook(torch.distributed.BuiltinCommHookType.ALLREDUCE)
        named = r"already has a comm hook \(.*ALLREDUCE\)"
    state = AccordionState(compressor="powersgd", levels=(2, 1))
    with pytest.raises(ValueError, match=named):
        state.register(ddp)
    assert state.params.module is None  # not bound to a module it does not run on


def test_registering_on_a_ddp_module_with_another_hook_names_that_hook():
    run_processes(_register_over, 2, "allreduce_hook")


def test_registering_on_a_ddp_module_with_a_builtin_hook_names_that_hook():
    run_processes(_register_over, 2, "builtin")


def _register_over_another_state(rank, world_size):
    net = _net()
    ddp = AccordionState(net, compressor="powersgd", levels=(2, 1)).register(DDP(net))
    state = AccordionState(net, compressor="powersgd", levels=(4, 1))
    with pytest.raises(ValueError, match="accordion_hook with another AccordionState"):
        state.register(ddp)


def test_registering_over_another_accordion_state_says_so():
    run_processes(_register_over_another_state, 2)


def test_find_ddp_raises_type_error_naming_the_model_when_there_is_no_ddp():
    with pytest.raises(TypeError, match="Sequential"):
        find_ddp(_net())


def test_register_raises_type_error_for_a_model_without_ddp_and_changes_nothing():
    net = _net()
    state = AccordionState(compressor="powersgd", levels=(2, 1))
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        state.register(net)
    assert state.params.module is None


def test_the_hook_raises_a_clear_error_for_a_per_parameter_call_of_compiled_autograd():
    net = _net()
    state = AccordionState(net, compressor="powersgd", levels=(2, 1))
    from accordion.ddp import accordion_hook

    param = next(net.parameters())
    with pytest.raises(TypeError, match="python_reducer"):
        accordion_hook(state, (torch.zeros_like(param), param))
