"""accordion.summary.summarize: the levels line, the traffic line and its argument checks."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from accordion.ddp import AccordionState
from accordion.summary import summarize
from distributed import run_processes


def make_state(**options) -> AccordionState:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    return AccordionState(net, **{"compressor": "powersgd", "levels": (4, 2, 1), **options})


def test_the_levels_line_shows_each_periods_distinct_levels_mildest_first_and_dense():
    state = make_state()
    used = [
        {"0.weight": 4, "2.weight": 4},
        {"0.weight": 1, "2.weight": 2},  # shown mildest first, whatever the layer order
        {"0.weight": 1, "2.weight": None},  # None: the cost model sends it dense
    ]
    first = summarize(state, used).splitlines()[0]
    assert first == "levels: epoch 0: 4 | epoch 1: 2,1 | epoch 2: 1,dense"


def test_without_snapshots_the_levels_line_shows_the_levels_in_force_now():
    assert summarize(make_state()).splitlines()[0] == "levels: now: 4"


def test_unit_and_first_name_and_number_the_periods():
    state = make_state(interval_unit="step")
    used = [{"0.weight": 4}, {"0.weight": 2}]
    assert summarize(state, used).startswith("levels: step 0: 4 | step 1: 2\n")
    assert summarize(state, used, unit="window", first=3).startswith(
        "levels: window 3: 4 | window 4: 2\n"
    )


def test_a_state_that_sent_nothing_says_so():
    assert summarize(make_state()).splitlines()[1] == (
        "traffic: sent 0 B, dense would send 0 B (nothing sent)"
    )


def test_bytes_are_shown_in_decimal_units():
    state = make_state()
    state.ledger.add("0.weight", 10, 1_500.0, steps=1)  # one process: dense sends nothing
    assert summarize(state).splitlines()[1] == (
        "traffic: sent 1.5 kB, dense would send 0 B (dense sends nothing)"
    )
    state.ledger.add("0.weight", 10, 2_498_500.0, steps=1)
    assert "sent 2.5 MB" in summarize(state)


def _two_ranks(rank, world_size, out):
    for compressor, levels in (("powersgd", (4, 2, 1)), ("topk", (0.99, 0.5))):
        state = make_state(compressor=compressor, levels=levels)
        net = state.params.module
        for step in range(3):
            gen = torch.Generator().manual_seed(10 * rank + step)
            net.zero_grad()
            net(torch.randn(4, 8, generator=gen)).pow(2).sum().backward()
            state.reduce_gradients()
        if rank == 0:
            torch.save((summarize(state), state.ledger.total_bytes), f"{out}/{compressor}.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("summary")
    run_processes(_two_ranks, 2, str(out), timeout=60)
    return {name: torch.load(out / f"{name}.pt") for name in ("powersgd", "topk")}


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * 1000 ** ["B", "kB", "MB", "GB", "TB"].index(unit)


def test_the_traffic_line_prices_dense_at_the_groups_world_size(two_ranks):
    text, sent = two_ranks["powersgd"]
    # 3 steps of 8*16+16 + 16*8+8 floats, 4 bytes each, ring factor 2 (W-1)/W = 1 at W=2
    dense = 3 * (8 * 16 + 16 + 16 * 8 + 8) * 4
    line = text.splitlines()[1]
    match = re.fullmatch(r"traffic: sent (\S+ k?B), dense would send (\S+ k?B) "
                         r"\((\d+\.\d\d)x less, (\S+ k?B) saved\)", line)  # fmt: skip
    assert match, line
    assert 0 < sent < dense
    assert _bytes(match[1]) == pytest.approx(sent, abs=50)  # "2.6 kB": one decimal
    assert _bytes(match[2]) == pytest.approx(dense, abs=50)
    assert float(match[3]) == pytest.approx(dense / sent, abs=0.005)
    assert _bytes(match[4]) == pytest.approx(dense - sent, abs=50)


def test_a_level_that_sends_more_than_dense_is_shown_as_more(two_ranks):
    text, sent = two_ranks["topk"]  # top-k 99% all-gathers values and indices
    ratio = re.search(r"\((\d+\.\d\d)x more\)", text.splitlines()[1])
    assert ratio and float(ratio[1]) == pytest.approx(sent / 3360, abs=0.005)


@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        ((object(),), {}, TypeError, "state must be an accordion Controller"),
        ((None, {"0.weight": 4}), {}, TypeError, "levels must be a sequence"),
        ((None, "4"), {}, TypeError, "levels must be a sequence"),
        ((None, [4]), {}, TypeError, r"levels\[0\] must be a mapping"),
        ((None, [{"0.weight": 3}]), {}, ValueError, r"levels\[0\]\['0.weight'\] must be None"),
        ((None,), {"unit": 1}, TypeError, "unit must be a str"),
        ((None,), {"unit": " "}, ValueError, "unit must name the period"),
        ((None,), {"first": -1}, ValueError, "first must be an int >= 0"),
        ((None,), {"first": 1.0}, TypeError, "first must be an int >= 0"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(args, kwargs, error, match):
    state = make_state()
    args = tuple(state if a is None else a for a in args)
    with pytest.raises(error, match=match):
        summarize(*args, **kwargs)
