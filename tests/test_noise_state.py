"""The state Adam's noise correction reads, in checkpoints: the quantisers' residual
variances, the mixed ladder's senders and the reducer's noise history round-trip, files
saved before they existed still load, and a bad entry changes nothing."""

from __future__ import annotations

import pytest
import torch

from accordion.compress import Reducer
from accordion.compress.mixed import Mixed
from accordion.compress.normalquant import NormalQuantizer
from accordion.compress.quantize import IntQuantizer
from accordion.compress.transport import LocalTransport

SHAPES = {"w": (8, 100), "b": (8,)}


def _exchanged(compressor, steps: int = 2) -> Reducer:
    """A reducer that averaged SHAPES' tensors ``steps`` times, recording the noise."""
    reducer = Reducer(compressor)
    reducer.noise.on = True
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(shape, generator=g) for shape in SHAPES.values()]
        LocalTransport().run(reducer.exchange(list(SHAPES), grads, 1))
    return reducer


@pytest.mark.parametrize("compressor", [IntQuantizer(4), NormalQuantizer(2),
                                        Mixed("nq/2")])  # fmt: skip
def test_residual_variances_and_history_round_trip_through_a_state_dict(compressor):
    reducer = _exchanged(compressor)
    fresh = Reducer(type(compressor)(compressor.default_level))
    fresh.load_state_dict(reducer.state_dict())
    fresh.check_shapes(SHAPES)
    for previous in (False, True):
        want = reducer.compressor.residual_variance("w", previous=previous)
        assert want is not None and torch.equal(
            fresh.compressor.residual_variance("w", previous=previous), want)  # fmt: skip
    history = fresh.noise.state_dict()["history"]
    assert history == reducer.noise.state_dict()["history"] and history["w"] == [True, True]


def test_a_state_saved_before_the_noise_was_kept_still_loads_without_it():
    state = _exchanged(NormalQuantizer(2)).state_dict()
    del state["noise"], state["compressor"]["variance"]
    fresh = Reducer(NormalQuantizer(2))
    fresh.load_state_dict(state)
    assert fresh.compressor.residual_variance("w") is None
    assert fresh.noise.state_dict() == {"history": {}}


@pytest.mark.parametrize("where, bad, match", [
    ("variance", {"w": {"now": torch.ones(2, 2), "before": None, "shape": [8, 100]}},
     r"compressor variance\['w'\] must hold 'now' \(a 1-D float tensor"),
    ("variance", {"w": {"now": torch.ones(8), "before": torch.ones(3), "shape": [8, 100]}},
     r"'before' \(None or the same\)"),
    ("noise", {"history": {"w": [1, 0]}}, r"noise history\['w'\] must be \[now, before\] bools"),
    ("noise", [], "noise state must be a Mapping with 'history'"),
])  # fmt: skip
def test_a_bad_noise_entry_is_a_value_error_and_changes_nothing(where, bad, match):
    reducer = _exchanged(NormalQuantizer(2))
    before = reducer.compressor.residual_variance("w").clone()
    state = reducer.state_dict()
    if where == "variance":
        state["compressor"]["variance"] = bad
    else:
        state["noise"] = bad
    with pytest.raises(ValueError, match=match):
        reducer.load_state_dict(state)
    assert torch.equal(reducer.compressor.residual_variance("w"), before)
    assert reducer.noise.state_dict()["history"]["w"] == [True, True]


def test_variances_of_another_shape_or_block_count_fail_the_shape_check():
    state = _exchanged(IntQuantizer(4)).compressor.state_dict()
    wrong = IntQuantizer(4)
    wrong.load_state_dict(state)
    with pytest.raises(ValueError, match=r"is for shape \(8, 100\), not a tensor's: \(8, 99\)"):
        wrong.check_shapes({**SHAPES, "w": (8, 99)})
    state["variance"]["w"]["now"] = torch.ones(3)
    state["variance"]["w"]["before"] = torch.ones(3)
    wrong.load_state_dict(state)
    with pytest.raises(ValueError, match="has 3 blocks; a tensor of shape"):
        wrong.check_shapes(SHAPES)


def test_mixed_senders_must_name_its_parts():
    state = _exchanged(Mixed("nq/2")).compressor.state_dict()
    assert state["senders"]["w"] == ["nq", "nq"]
    state["senders"] = {"w": ["int", None]}
    with pytest.raises(ValueError, match=r"mixed senders\['w'\] must be \[last, before\], "
                                         r"names of the parts \['nq'\]"):  # fmt: skip
        Mixed("nq/2").load_state_dict(state)
