"""The default ladder of ``AccordionState(net)``: integer quantisation, 8 then 4 bits, at
every world size (their two phases keep the bytes against dense flat in the workers)."""

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


def test_the_default_levels_are_int8_then_int4_with_no_half_precision_fallback():
    assert default_levels() == ("int/8", "int/4")


@pytest.mark.parametrize("element_size,bound", [(4, 0.27), (2, 0.53)])
@pytest.mark.parametrize("world_size", [2, 3, 8, 16, 64, 512, 1024])
def test_every_default_rung_sends_under_0_27x_fp32_or_0_53x_bf16_dense_at_any_world_size(
    world_size, element_size, bound
):
    # int8 is 1 + 2/64 bytes an element against 4 (fp32) or 2 (bf16), both with 2(W-1)/W
    shape = (4096, 1024)
    dense = 2 * (world_size - 1) / world_size * 4096 * 1024 * element_size
    for level in default_levels():
        bits = int(level.split("/")[1])
        assert IntQuantizer.wire_bytes(shape, bits, world_size, element_size) < bound * dense


def test_the_default_ladder_does_not_follow_the_width_of_the_gradients():
    assert AccordionState(_net(torch.bfloat16)).ladder.levels == ("int/8", "int/4")


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
