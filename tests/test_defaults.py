"""The default ladder of ``AccordionState(net)``: integer quantisation, 8 then 4 bits,
half precision for a rung past its break-even at the run's world size."""

import pytest
import torch
from torch import nn

from accordion import AccordionState
from accordion.compress.quantize import IntQuantizer
from accordion.defaults import default_levels, resolve


def _net(dtype=torch.float32):
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(dtype)


def test_the_default_state_is_the_int8_int4_ladder_of_the_mixed_compressor():
    state = AccordionState(_net())
    assert state.compressor_name == "mixed"
    assert state.ladder.levels == ("int/8", "int/4")
    assert state.adaptive


def test_the_default_sends_every_tensor_at_int8_until_its_first_check():
    state = AccordionState(_net())
    assert set(state.levels().values()) == {"int/8"}


@pytest.mark.parametrize(
    "world_size,levels",
    [
        (2, ("int/8", "int/4")),
        (7, ("int/8", "int/4")),
        (8, ("half/bf16", "int/4")),
        (15, ("half/bf16", "int/4")),
        (16, ("half/bf16", "half/bf16")),
    ],
)
def test_a_rung_past_its_break_even_is_replaced_by_half_precision(world_size, levels):
    assert default_levels(world_size) == levels


def test_every_default_rung_sends_fewer_bytes_than_a_dense_ring_all_reduce():
    shape = (4096, 1024)
    for world_size in range(2, 40):
        for level in default_levels(world_size):
            if level.startswith("int/"):
                bits = int(level.split("/")[1])
                sent = IntQuantizer.wire_bytes(shape, bits, world_size, 4)
                dense = 2 * (world_size - 1) / world_size * 4096 * 1024 * 4
                assert sent < dense, (world_size, level)


def test_the_break_even_follows_the_width_of_the_gradients():
    # bf16 gradients halve dense's bytes, so int8's all-gathers stop paying at 3.9 workers
    assert default_levels(4, element_size=2) == ("half/bf16", "int/4")
    assert AccordionState(_net(torch.bfloat16)).ladder.levels == ("int/8", "int/4")  # 1 worker


def test_levels_given_without_a_compressor_are_powersgd_ranks_as_before():
    state = AccordionState(_net(), levels=(4, 2, 1))
    assert (state.compressor_name, state.ladder.levels) == ("powersgd", (4, 2, 1))
    state = AccordionState(_net(), mild=4, aggressive=1)
    assert (state.compressor_name, state.ladder.levels) == ("powersgd", (4, 1))


def test_levels_that_name_their_compressors_need_no_compressor():
    state = AccordionState(_net(), levels=("half/bf16", "int/4"))
    assert (state.compressor_name, state.ladder.levels) == ("mixed", ("half/bf16", "int/4"))


def test_a_named_compressor_keeps_its_own_default_levels():
    assert resolve("powersgd", _net(), None, None) == ("powersgd", None)
    assert AccordionState(_net(), "powersgd").ladder.levels == (2, 1)


def test_a_bad_on_rank_change_is_refused_whatever_the_compressor():
    with pytest.raises(ValueError, match="on_rank_change must be one of"):
        AccordionState(_net(), "int", on_rank_change="keep")
