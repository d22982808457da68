"""The warning at bind of rungs that send at least as many bytes as a dense ring
all-reduce at the bound world size: from the transport's world size when it exists at
bind, else (a state built before ``init_process_group``) at the first exchange, once.

The world size comes from a transport given as ``transport=`` that only tells its size
(binding reads it; no exchange runs); ``test_bind_world_size.py`` has the late case, in
real gloo processes.
"""

from __future__ import annotations

import warnings

import pytest
from torch import nn

from accordion.controller import Controller

#: What the warning says, whatever its rungs.
HEAVY = "send at least as many bytes as a dense ring all-reduce"


class SizedTransport:
    """A transport of ``world_size`` workers that runs nothing: these tests only bind."""

    rank = 0

    def __init__(self, world_size: int):
        self.world_size = world_size

    def run(self, exchange):  # pragma: no cover - binding runs no exchange
        raise AssertionError("binding must run no exchange")

    run_async = run


def _heavy_warnings(build) -> list[str]:
    """The messages of the wire warnings ``build()`` issues."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught if HEAVY in str(w.message)]


def _bound(compressor: str, levels: tuple, world_size: int, **options) -> list[str]:
    """The wire warnings of a state on a 256 x 256 linear layer bound at ``world_size``."""
    return _heavy_warnings(lambda: Controller(nn.Linear(256, 256), compressor, levels=levels,
                                              transport=SizedTransport(world_size), **options))


def test_a_top_k_rung_heavier_than_dense_at_64_workers_is_named_with_its_layers():
    (message,) = _bound("topk", (0.1, 0.01), 64)
    assert "at 64 workers" in message
    assert "top-k 0.1 for 1 layer(s) ('weight')" in message
    assert "top-k 0.01" not in message.split("(levels")[0]  # 0.01 sends less than dense


def test_a_sparseloco_rung_heavier_than_dense_at_64_workers_is_named_with_its_layers():
    (message,) = _bound("sparseloco", (0.1, 0.03), 64)
    assert "top-k 0.1 int2 for 2 layer(s) ('weight', 'bias')" in message
    assert "top-k 0.03 int2" not in message.split("(levels")[0]


def test_a_mixed_ladder_names_only_its_rung_that_is_heavier_than_dense():
    (message,) = _bound("mixed", ("int/8", "topk/0.1"), 64)
    assert "topk/0.1 for 1 layer(s) ('weight')" in message
    assert "int/8 for" not in message


def test_rungs_that_send_less_than_dense_at_the_bound_world_size_are_not_warned_of():
    assert _bound("topk", (0.1, 0.01), 2) == []


def test_int8_at_64_workers_in_two_phases_is_not_warned_of():
    assert _bound("int", (8, 4), 64) == []


def test_int8_at_64_workers_all_gathered_is_warned_of():
    (message,) = _bound("int", (8, 4), 64, collective="all_gather")
    assert "int8 for 2 layer(s) ('weight', 'bias')" in message


def test_the_warning_is_given_once_binding_again_does_not_repeat_it():
    model, states = nn.Linear(256, 256), []
    first = _heavy_warnings(lambda: states.append(
        Controller(model, "topk", levels=(0.1, 0.01), transport=SizedTransport(64))))
    again = _heavy_warnings(lambda: states[0].bind_module(model))
    assert (len(first), again) == (1, [])


def test_a_state_without_a_transport_at_bind_does_not_warn_yet():
    # no process group: the transport opens at the first exchange, not at bind
    build = lambda: Controller(nn.Linear(256, 256), "topk", levels=(0.6, 0.1))  # noqa: E731
    assert _heavy_warnings(build) == []


# --- the collective argument: checked, handed to the compressor, checkpointed -------------


def test_collective_reaches_the_integer_quantiser():
    state = Controller(nn.Linear(2, 2), "int", levels=(8, 4), collective="two_phase")
    assert state.compressor.collective == "two_phase"


def test_collective_must_be_one_of_the_collectives():
    with pytest.raises(ValueError, match=r"collective must be one of \('auto', 'all_gather', "
                                         r"'two_phase'\), got 'ring'"):  # fmt: skip
        Controller(nn.Linear(2, 2), "int", levels=(8, 4), collective="ring")
    with pytest.raises(TypeError, match="collective must be one of"):
        Controller(nn.Linear(2, 2), "int", levels=(8, 4), collective=None)


def test_the_checkpoint_config_holds_the_collective_and_a_state_with_another_refuses_it():
    saved = Controller(nn.Linear(2, 2), "int", levels=(8, 4), collective="all_gather")
    assert saved.config()["collective"] == "all_gather"
    other = Controller(nn.Linear(2, 2), "int", levels=(8, 4), collective="two_phase")
    with pytest.raises(ValueError, match="the checkpoint's collective is 'all_gather' but this "
                                         "state's is 'two_phase'"):  # fmt: skip
        other.load_state_dict(saved.state_dict())


def test_a_checkpoint_written_before_the_collective_option_loads_as_auto():
    state = Controller(nn.Linear(2, 2), "int", levels=(8, 4))
    old = state.state_dict()
    old["config"] = {k: v for k, v in old["config"].items() if k != "collective"}
    Controller(nn.Linear(2, 2), "int", levels=(8, 4)).load_state_dict(old)  # no error
    with pytest.raises(ValueError, match="the checkpoint's collective is 'auto'"):
        Controller(nn.Linear(2, 2), "int", levels=(8, 4),
                   collective="all_gather").load_state_dict(old)  # fmt: skip
