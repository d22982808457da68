"""The harness's strategy strings, run settings and traffic count, without training.

The strategy parser asks the compressor registry for names, levels and their order, so a
compressor registered for a test (``fake``, whose levels are words) must work as the
built-in ones do.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pytest
import torch
from torch import nn

from accordion.compress import Compressor, compressor_class, compressor_names
from accordion.compress import base as compress_base
from accordion.compress.transport import SimulatedTransport
from accordion.compress.wire import Message
from accordion.harness import attach, baselines, compare
from accordion.harness.build import make_outer_optimizer
from accordion.harness.loop import set_server_feedback
from accordion.harness.strategies import FORMATS, parse_strategy, strategy_compressors
from accordion.harness.train import PRESETS, TrainConfig


class _Fake(Compressor):
    """A compressor whose levels are words: "light" < "medium" < "heavy" (for tests)."""

    name = "fake"
    default_levels = ("light", "heavy")
    level_help = "'light', 'medium' or 'heavy'"
    _ORDER = ("light", "medium", "heavy")

    @classmethod
    def check_level(cls, level: Any) -> str:
        if level not in cls._ORDER:
            raise ValueError(f"a fake level must be {cls.level_help}, got {level!r}")
        return level

    @classmethod
    def aggressiveness(cls, level: Any) -> float:
        return float(cls._ORDER.index(cls.check_level(level)))

    @classmethod
    def label(cls, level: Any) -> str:
        return f"fake {level}"

    @classmethod
    def paper_floats(cls, shape: tuple[int, ...], level: Any, world_size: int) -> int:
        return math.prod(shape) // (1 + cls._ORDER.index(level))

    @classmethod
    def messages(cls, shape: tuple[int, ...], level: Any, element_size: int) -> list[Message]:
        return [Message("allreduce", "fake", cls.paper_floats(shape, level, 1) * element_size)]

    def exchange(self, keys, tensors, world_size, out=None):  # pragma: no cover - not run
        raise NotImplementedError


@pytest.fixture
def fake(monkeypatch) -> type[Compressor]:
    """``fake`` registered for one test only."""
    monkeypatch.setitem(compress_base._REGISTRY, "fake", _Fake)
    return _Fake


# ------------------------------------------------------------------------------ strategies


def test_static_dense_and_torch_strategies_have_one_level_or_none():
    static = parse_strategy("static:powersgd:4")
    assert (static.levels, static.mild, static.aggressive) == ((4,), 4, 4)
    dense = parse_strategy("dense")
    assert (dense.levels, dense.mild, dense.aggressive) == ((), None, None)
    torch_hook = parse_strategy("torch-powersgd:2")
    assert (torch_hook.family, torch_hook.compressor, torch_hook.levels) == (
        "torch-powersgd",
        "powersgd",
        (2,),
    )
    topk = parse_strategy("static:topk:0.1:auto")
    assert (topk.levels, topk.auto) == ((0.1,), True)


@pytest.mark.parametrize(
    ("text", "levels"),
    [
        ("accordion:powersgd:4,1", (4, 1)),
        ("accordion:powersgd:4,2,1", (4, 2, 1)),
        ("accordion:powersgd:8,4,4,1", (8, 4, 4, 1)),  # a rung may repeat the one before
        ("accordion:topk:0.99,0.1,0.01", (0.99, 0.1, 0.01)),
        ("accordion:powersgd:2,2", (2, 2)),
    ],
)
def test_accordion_ladders_of_any_length_run_mildest_first(text, levels):
    strategy = parse_strategy(text)
    assert strategy.family == "accordion"
    assert strategy.levels == levels
    assert (strategy.mild, strategy.aggressive) == (levels[0], levels[-1])


def test_a_ladder_combines_with_a_batch_strategy_and_the_cost_model():
    strategy = parse_strategy("batch:64,512+accordion:powersgd:4,2,1:auto")
    assert (strategy.batch_mode, strategy.levels, strategy.auto) == ("adaptive", (4, 2, 1), True)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("accordion:powersgd:1,4", ["1,4", "rank 4 compresses less than rank 1", "integer rank"]),
        ("accordion:powersgd:4,1,2", ["4,1,2", "rank 2 compresses less than rank 1"]),
        ("accordion:topk:0.1,0.5", ["0.1,0.5", "top-k 0.5 compresses less than top-k 0.1"]),
    ],
)
def test_a_ladder_out_of_order_names_the_strategy_the_levels_and_the_rule(text, named):
    with pytest.raises(ValueError) as info:
        parse_strategy(text)
    message = str(info.value)
    assert f"strategy {text!r}" in message
    assert "MILD,...,AGGRESSIVE" in message and "at least as much" in message
    for part in named:
        assert part in message


@pytest.mark.parametrize("text", ["static:qsgd:2", "accordion:randk:2,1", "static:dense:1"])
def test_an_unknown_compressor_lists_the_registered_ones(text):
    with pytest.raises(ValueError, match="compressor must be one of") as info:
        parse_strategy(text)
    for name in strategy_compressors():
        assert name in str(info.value)
    assert "dense" not in strategy_compressors()
    assert set(strategy_compressors()) == set(compressor_names()) - {"dense"}


@pytest.mark.parametrize("text", ["accordion:powersgd:2", "static:powersgd:4,1", "accordion:x"])
def test_malformed_strategies_name_the_forms_with_the_ladder(text):
    with pytest.raises(ValueError, match="strategy") as info:
        parse_strategy(text)
    assert "accordion:COMPRESSOR:MILD,...,AGGRESSIVE" in str(info.value)
    assert "accordion:COMPRESSOR:MILD,...,AGGRESSIVE" in FORMATS


def test_a_bad_level_says_what_the_compressor_takes():
    with pytest.raises(ValueError, match=r"level '0\.5' must be an integer rank >= 1"):
        parse_strategy("static:powersgd:0.5")
    with pytest.raises(ValueError, match=r"level '2' must be a fraction in \(0, 1\]"):
        parse_strategy("static:topk:2")


def test_any_registered_compressor_parses_with_its_own_levels_and_order(fake):
    strategy = parse_strategy("accordion:fake:light,medium,heavy")
    assert (strategy.compressor, strategy.levels) == ("fake", ("light", "medium", "heavy"))
    assert parse_strategy("static:fake:medium").levels == ("medium",)
    with pytest.raises(ValueError, match="fake medium compresses less than fake heavy"):
        parse_strategy("accordion:fake:heavy,medium")
    with pytest.raises(ValueError, match="'light', 'medium' or 'heavy'"):
        parse_strategy("static:fake:huge")
    assert "fake" in strategy_compressors()


# ------------------------------------------------------------------------------ run settings


@pytest.mark.parametrize(
    ("setting", "error"),
    [
        ({"epochs": 0}, ValueError),
        ({"epochs": 2.5}, TypeError),
        ({"batch_size": True}, TypeError),
        ({"lr": 0.0}, ValueError),
        ({"lr": math.nan}, ValueError),
        ({"eta": "0.5"}, TypeError),
        ({"momentum": -0.1}, ValueError),
        ({"decay_epochs": (30, -1)}, ValueError),
        ({"decay_epochs": (30.0,)}, TypeError),
        ({"on_rank_change": "keep"}, ValueError),
        ({"lr_scaling": "cubic"}, ValueError),
        ({"lr_scaling": 2}, TypeError),
        ({"batch_warmup_steps": -1}, ValueError),
        ({"clip": 0.0}, ValueError),
        ({"strategy": "accordion:powersgd:1,4"}, ValueError),
    ],
)
def test_train_config_validate_names_the_bad_setting(setting, error):
    config = TrainConfig(**setting)
    name = next(iter(setting))
    with pytest.raises(error, match="strategy" if name == "strategy" else name):
        config.validate()


def test_train_config_defaults_and_presets_validate():
    TrainConfig().validate()
    for preset in PRESETS.values():
        TrainConfig(**preset).validate()


class _HookRecorder:
    def __init__(self):
        self.hooks = []

    def register_comm_hook(self, state, hook):
        self.hooks.append((state, hook))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("accordion:powersgd:4,2,1", {"levels": (4, 2, 1)}),
        ("static:powersgd:4", {"mild": 4, "aggressive": 4}),
        ("static:topk:0.1", {"mild": 0.1, "aggressive": 0.1}),
    ],
)
def test_attach_strategy_hands_the_ladder_to_the_accordion_state(monkeypatch, text, expected):
    made = []

    def fake_state(model, **kwargs):
        made.append(kwargs)
        return "state"

    monkeypatch.setattr(attach, "AccordionState", fake_state)
    ddp = _HookRecorder()
    config = TrainConfig(strategy=text)
    assert attach.attach_strategy(config, parse_strategy(text), nn.Linear(2, 2), ddp) == "state"
    (kwargs,) = made
    ladder = {k: kwargs[k] for k in ("levels", "mild", "aggressive") if k in kwargs}
    assert ladder == expected
    assert kwargs["compressor"] == parse_strategy(text).compressor
    assert ddp.hooks == [("state", attach.accordion_hook)]


def test_torch_powersgd_traffic_mimics_pytorchs_hook():
    # a 64x64 matrix pays at rank 1, a 2x64 one does not (2 * 64 <= 2 * (2 + 64)); the
    # first step is dense, as PyTorch's start_powerSGD_iter=2
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    traffic = baselines.Traffic(parse_strategy("torch-powersgd:1"), model, None, 4)
    traffic.step()
    assert traffic.floats == 64 * 64 + 64 + 2 * 64 + 2
    traffic.step()
    assert traffic.floats == (64 * 64 + 64 + 2 * 64 + 2) + ((64 + 64) * 1 + 64 + 2 * 64 + 2)
    dense = baselines.Traffic(parse_strategy("dense"), model, None, 4)
    dense.step()
    assert dense.totals()[0] == sum(p.numel() for p in model.parameters())
    assert dense.totals()[1] == pytest.approx(2 * 3 / 4 * 4 * dense.totals()[0])


def test_the_reference_is_the_mildest_static_level_of_the_same_compressor():
    rows = dict.fromkeys(
        [
            "dense", "static:powersgd:1", "static:powersgd:4", "static:powersgd:4:auto",
            "accordion:powersgd:2,1", "accordion:powersgd:4,2,1", "static:topk:0.01",
            "static:topk:0.99", "accordion:topk:0.5,0.01", "accordion:topk:0.01,0.01",
            "torch-powersgd:2",
        ]
    )  # fmt: skip
    expected = {
        "dense": "dense",
        "static:powersgd:1": "static:powersgd:4:auto",  # the mildest; equals: the last text
        "accordion:powersgd:2,1": "static:powersgd:4:auto",
        "accordion:powersgd:4,2,1": "static:powersgd:4",  # the static run of its mild level
        "static:topk:0.01": "static:topk:0.99",
        "accordion:topk:0.5,0.01": "static:topk:0.99",
        "accordion:topk:0.01,0.01": "static:topk:0.01",
        "torch-powersgd:2": "static:powersgd:4:auto",
    }
    assert {s: compare._reference(s, rows) for s in expected} == expected
    assert compare._reference("static:topk:0.1", {"static:topk:0.1": None, "dense": None}) == (
        "static:topk:0.1"
    )
    assert compare._reference("accordion:topk:0.5,0.1", {"dense": None}) is None


def test_train_config_is_a_plain_dataclass_of_defaults():
    # the command line reads its help defaults from these fields: each needs one
    for f in dataclasses.fields(TrainConfig):
        assert f.default is not dataclasses.MISSING, f.name


def test_an_accordion_strategy_names_its_rule_and_interval_in_any_order():
    a = parse_strategy("accordion:powersgd:4,2,1:guarded:every=2")
    b = parse_strategy("accordion:powersgd:4,2,1:every=2:guarded")
    expected = ("guarded", 2, (4, 2, 1))
    assert (a.rule, a.interval, a.levels) == (b.rule, b.interval, b.levels) == expected
    assert parse_strategy("accordion:topk:0.99,0.01:paper:auto").auto


@pytest.mark.parametrize(
    "text",
    ["accordion:powersgd:4,1:median", "accordion:powersgd:4,1:every=0",
     "accordion:powersgd:4,1:paper:paper", "static:powersgd:4:guarded",
     "static:powersgd:4:every=2", "accordion:powersgd:4,1:paper:block=2",
     "accordion:powersgd:4,1:block=0", "static:powersgd:4:block=2",
     "accordion:powersgd:4,1:paper:open", "static:powersgd:4:open",
     "accordion:powersgd:4,1:open:open"],
)  # fmt: skip
def test_a_bad_strategy_suffix_is_a_value_error_naming_the_strategy(text):
    with pytest.raises(ValueError, match="strategy"):
        parse_strategy(text)


def test_a_guarded_strategy_names_its_block():
    strategy = parse_strategy("accordion:powersgd:4,2,1:block=5")
    assert (strategy.rule, strategy.block) == (None, 5)
    assert parse_strategy("accordion:powersgd:4,2,1:guarded:block=3").block == 3


def _attached_rule(monkeypatch, text):
    """The rule ``attach_strategy`` hands ``AccordionState`` for strategy ``text``."""
    made = []
    monkeypatch.setattr(attach, "AccordionState", lambda model, **kwargs: made.append(kwargs))
    attach.attach_strategy(TrainConfig(strategy=text), parse_strategy(text), nn.Linear(2, 2),
                           _HookRecorder())  # fmt: skip
    (kwargs,) = made
    return kwargs["rule"]


def test_an_open_guarded_strategy_builds_a_rule_that_does_not_wait_for_a_decay(monkeypatch):
    text = "accordion:mixed:nq/3,nq/2,sparseloco/0.03:open:block=4"
    assert parse_strategy(text).open_ladder
    rule = _attached_rule(monkeypatch, text)
    assert (rule.name, rule.wait_for_decay) == ("guarded", False)
    assert rule.block == 4


def test_a_guarded_strategy_waits_for_a_decay_unless_open(monkeypatch):
    text = "accordion:mixed:nq/3,nq/2,sparseloco/0.03:guarded"
    assert _attached_rule(monkeypatch, text).wait_for_decay


@pytest.mark.parametrize(
    ("text", "rule", "block"),
    [("accordion:powersgd:4,2,1:block=3", "guarded", 3),
     ("accordion:powersgd:4,2,1:guarded:block=decay", "guarded", None),
     ("accordion:powersgd:4,1:paper", "paper", "none")],
)  # fmt: skip
def test_attach_strategy_builds_the_named_rule_with_its_block(monkeypatch, text, rule, block):
    built = _attached_rule(monkeypatch, text)
    assert built.name == rule
    assert getattr(built, "block", "none") == block


@pytest.mark.parametrize(("text", "level"), [("torch-fp16", "fp16"), ("torch-bf16", "bf16")])
def test_torch_half_strategies_name_pytorchs_cast_hooks(text, level):
    strategy = parse_strategy(text)
    assert (strategy.family, strategy.compressor, strategy.levels) == ("torch-half", "half",
                                                                       (level,))  # fmt: skip
    assert not strategy.uses_accordion_hook


def test_torch_fp16_traffic_is_every_tensor_at_half_the_dense_bytes():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    half = baselines.Traffic(parse_strategy("torch-fp16"), model, None, 4)
    dense = baselines.Traffic(parse_strategy("dense"), model, None, 4)
    for traffic in (half, dense):
        traffic.step()
    assert half.totals()[0] == dense.totals()[0]  # the paper counts floats, whatever width
    assert half.totals()[1] == pytest.approx(dense.totals()[1] / 2)


def test_attach_strategy_registers_pytorchs_fp16_compress_hook():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = _HookRecorder()
    config = TrainConfig(strategy="torch-fp16")
    strategy = parse_strategy("torch-fp16")
    assert attach.attach_strategy(config, strategy, nn.Linear(2, 2), ddp) is None
    assert ddp.hooks == [(None, default_hooks.fp16_compress_hook)]


def test_torch_bf16_on_a_machine_without_cuda_is_refused_before_training(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="bf16_compress_hook needs CUDA"):
        TrainConfig(strategy="torch-bf16").validate()


# --- DiLoCo -------------------------------------------------------------------------------


def test_diloco_h_is_a_dense_sync_every_h_steps_and_registers_no_hook():
    s = parse_strategy("diloco:25")
    assert (s.family, s.compressor, s.sync_every, s.uses_accordion_hook) == (
        "dense", "dense", 25, False
    )  # fmt: skip


def test_diloco_h_plus_a_compression_strategy_compresses_the_sync():
    s = parse_strategy("diloco:10+accordion:int:8,4:every=2")
    assert (s.family, s.compressor, s.levels, s.interval, s.sync_every) == (
        "accordion", "int", (8, 4), 2, 10
    )  # fmt: skip
    assert not s.uses_accordion_hook


def test_diloco_outer_lr_and_momentum_options_set_the_outer_nesterov_sgd():
    s = parse_strategy("diloco:10:lr=1.2:momentum=0.5+static:int:4")
    assert (s.sync_every, s.outer_lr, s.outer_momentum, s.levels) == (10, 1.2, 0.5, (4,))
    outer = make_outer_optimizer(s)([torch.nn.Parameter(torch.zeros(2))])
    group = outer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (1.2, 0.5, True)


def test_diloco_without_options_keeps_dilocos_outer_defaults_and_momentum_0_is_plain_sgd():
    default = make_outer_optimizer(parse_strategy("diloco:5"))([torch.nn.Parameter(torch.zeros(1))])
    assert (default.param_groups[0]["lr"], default.param_groups[0]["momentum"]) == (0.7, 0.9)
    plain = make_outer_optimizer(parse_strategy("diloco:5:momentum=0:lr=1"))(
        [torch.nn.Parameter(torch.zeros(1))]
    )  # fmt: skip
    assert (plain.param_groups[0]["momentum"], plain.param_groups[0]["nesterov"]) == (0, False)


@pytest.mark.parametrize("option", ["lr=0", "lr=-1", "lr=inf", "lr=x", "momentum=1",
                                    "momentum=-0.1", "lr", "beta=0.9", "lr=1:lr=2",
                                    "warmup=-1", "warmup=2.5", "warmup=4:warmup-with=int/3",
                                    "warmup=4:warmup-with=int4", "warmup=4:warmup-eta=0",
                                    "warmup=4:warmup-eta=nan", "warmup=4:warmup-eta=x",
                                    "fragments=0", "fragments=1.5", "delay=-1", "mix=1.5",
                                    "mix=x", "ef-decay=1.1", "ef-decay=-1", "final=2",
                                    "final=yes", "final=1:final=1"])
def test_a_bad_diloco_option_is_a_value_error_naming_the_allowed_ones(option):
    with pytest.raises(ValueError, match=re.escape("takes the options lr=... (the outer")):
        parse_strategy(f"diloco:5:{option}")


def test_diloco_final_1_asks_for_a_last_sync_and_none_is_the_default():
    assert parse_strategy("diloco:400:lr=1:momentum=0:final=1+static:int:4").final_sync is True
    assert parse_strategy("diloco:400:final=0").final_sync is False
    assert parse_strategy("diloco:400").final_sync is False


def test_diloco_warmup_options_set_the_data_parallel_steps_and_their_bits():
    s = parse_strategy("diloco:10:lr=0.35:warmup=90:warmup-with=powersgd/4+static:int:2")
    assert (s.sync_every, s.outer_lr, s.warmup_steps, s.warmup_with, s.levels) == (
        10, 0.35, 90, "powersgd/4", (2,)
    )  # fmt: skip
    plain = parse_strategy("diloco:10")
    assert (plain.warmup_steps, plain.warmup_with) == (0, None)


def test_diloco_warmup_with_without_a_warmup_is_a_value_error():
    with pytest.raises(ValueError, match="warmup-with needs warmup=N with N >= 1"):
        parse_strategy("diloco:10:warmup-with=int/4")


def test_diloco_warmup_eta_sets_the_norm_test_that_may_end_the_warmup_sooner():
    s = parse_strategy("diloco:10:warmup=180:warmup-eta=0.5:warmup-with=int/4+static:int:2")
    assert (s.warmup_steps, s.warmup_eta, s.warmup_with) == (180, 0.5, "int/4")
    assert parse_strategy("diloco:10:warmup=90").warmup_eta is None


def test_diloco_warmup_eta_without_a_warmup_is_a_value_error():
    with pytest.raises(ValueError, match="warmup-eta needs warmup=N with N >= 1"):
        parse_strategy("diloco:10:warmup-eta=0.5")


def test_diloco_fragments_delay_and_mix_stream_the_sync():
    s = parse_strategy("diloco:10:fragments=5:delay=1:mix=0.5+static:int:2")
    assert (s.sync_every, s.fragments, s.delay, s.mix, s.levels, s.streams) == (
        10, 5, 1, 0.5, (2,), True
    )  # fmt: skip
    plain = parse_strategy("diloco:10")
    assert (plain.fragments, plain.delay, plain.mix, plain.streams) == (1, 0, 0.0, False)


def test_diloco_ef_decay_sets_the_syncs_decayed_error_feedback():
    s = parse_strategy("diloco:10:lr=1:momentum=0:ef-decay=0.95+static:sparseloco:0.03")
    assert (s.error_decay, s.outer_momentum, s.compressor) == (0.95, 0.0, "sparseloco")
    assert parse_strategy("diloco:10").error_decay == 1.0


def test_diloco_grow_min_and_max_set_the_rounds_schedule():
    s = parse_strategy("diloco:12:lr=0.5:grow=2:max=60+static:int:2")
    assert (s.sync_growth, s.min_sync_every, s.max_sync_every) == (2.0, None, 60)
    s = parse_strategy("diloco:50:grow=-1:min=20")
    assert (s.sync_growth, s.min_sync_every, s.max_sync_every) == (-1.0, 20, None)
    assert parse_strategy("diloco:10").sync_growth == 0.0


@pytest.mark.parametrize("text, match", [
    ("diloco:10:min=5", "min=N and max=N bound the rounds of grow=P (P other than 0)"),
    ("diloco:10:grow=1:min=12", "the rounds' bounds must hold H = 10: min=12 <= H"),
    ("diloco:10:grow=1:max=5", "H = 10: min=None <= H <= max=5"),
    ("diloco:10:grow=1:fragments=2", "streamed fragments (fragments=, delay=, mix=) land at "
                                     "a fixed gap"),
    ("diloco:10:grow=nan", "grow=... (the power of peak lr / lr"),
])  # fmt: skip
def test_a_diloco_rounds_schedule_that_cannot_run_is_a_value_error_naming_it(text, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_strategy(text)


@pytest.mark.parametrize("text, match", [
    ("diloco:10:fragments=3", "(H=10, fragments=3, delay=0): sync_every must be a multiple "
                              "of the 3 fragments"),
    ("diloco:10:fragments=2:delay=5", "(H=10, fragments=2, delay=5): delay must be below "
                                      "sync_every / fragments = 5"),
    ("diloco:10:delay=10", "(H=10, fragments=1, delay=10): delay must be below "
                           "sync_every / fragments = 10"),
])  # fmt: skip
def test_a_streamed_diloco_schedule_that_cannot_run_is_a_value_error_naming_it(text, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_strategy(text)


@pytest.mark.parametrize(
    "text, match",
    [("diloco:0", "H, the inner steps per sync, an int >= 1; got '0'"),
     ("diloco:x+static:int:4", "an int >= 1; got 'x'"),
     ("diloco:5+torch-fp16", "combines with dense, a static or an accordion strategy"),
     ("diloco:5+static:int:4:auto", "(without :auto, :adam-noise or :momentum)")],
)  # fmt: skip
def test_a_malformed_diloco_strategy_is_a_value_error_naming_it(text, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_strategy(text)


def test_a_diloco_run_refuses_a_hidden_state_task():
    with pytest.raises(ValueError, match=re.escape("not 'wikitext2'")):
        TrainConfig(strategy="diloco:5", task="wikitext2").validate()


def test_a_diloco_run_takes_a_checkpoint_dir():
    TrainConfig(strategy="diloco:5", checkpoint_dir="ckpt").validate()


# --------------------------------------------------- the integer quantisers' exchange


@pytest.mark.parametrize(
    ("text", "collective"),
    [
        ("static:int:8:collective=all_gather", "all_gather"),
        ("static:nq:2:collective=two_phase", "two_phase"),
        ("accordion:mixed:int/8,int/4:collective=all_gather", "all_gather"),
        ("accordion:mixed:int/8,int/4:guarded:collective=auto:every=2", "auto"),
        ("static:int:4", "auto"),
    ],
)
def test_a_collective_suffix_picks_how_the_integer_payloads_travel(text, collective):
    assert parse_strategy(text).collective == collective


def test_server_error_off_turns_the_server_feedback_off_and_on_is_the_default():
    off = parse_strategy("static:int:4:collective=two_phase:server-error=off")
    assert off.server_feedback is False
    assert parse_strategy("accordion:mixed:int/8,nq/2:server-error=off").server_feedback is False
    assert parse_strategy("static:int:4").server_feedback is True


def test_the_collective_and_server_error_suffixes_reach_a_diloco_sync():
    strategy = parse_strategy("diloco:10+static:int:4:collective=all_gather:server-error=off")
    assert (strategy.sync_every, strategy.collective, strategy.server_feedback) == (
        10, "all_gather", False)  # fmt: skip


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("static:int:8:collective=ring", r"'collective=ring' is not a suffix.*all_gather"),
        ("static:int:8:server-error=maybe", r"'server-error=maybe' is not a suffix"),
        ("static:int:8:collective=auto:collective=two_phase", "repeats a suffix"),
        ("static:powersgd:4:collective=two_phase", r"collective= is an option of the integer"),
        ("accordion:mixed:half/bf16,powersgd/4:server-error=off",
         r"compressor must be one of int, nq"),
        ("torch-powersgd:4:collective=all_gather", "strategy must have one of the forms"),
    ],
)
def test_a_collective_or_server_error_suffix_that_cannot_apply_is_a_value_error(text, match):
    with pytest.raises(ValueError, match=match):
        parse_strategy(text)


def test_the_formats_list_the_collective_and_server_error_suffixes():
    assert any("collective=auto|all_gather|two_phase" in form for form in FORMATS)
    assert any("server-error=off" in form for form in FORMATS)


def test_make_state_hands_the_collective_to_the_state_and_its_quantisers():
    text = "accordion:mixed:int/8,int/4:collective=all_gather"
    state = attach.make_state(TrainConfig(strategy=text), parse_strategy(text),
                              nn.Linear(2, 2), "epoch")  # fmt: skip
    assert state.collective == "all_gather"
    assert state.config()["collective"] == "all_gather"
    assert state.compressor.part("int").collective == "all_gather"


def test_set_server_feedback_turns_it_off_on_every_integer_part_of_a_mixed_ladder():
    text = "accordion:mixed:int/8,nq/2:server-error=off"
    strategy = parse_strategy(text)
    state = attach.make_state(TrainConfig(strategy=text), strategy, nn.Linear(2, 2), "epoch")
    set_server_feedback(state, strategy)
    assert state.compressor.part("int").server_feedback is False
    assert state.compressor.part("nq").server_feedback is False


def test_set_server_feedback_leaves_a_state_without_the_suffix_as_it_is():
    text = "static:int:4"
    strategy = parse_strategy(text)
    state = attach.make_state(TrainConfig(strategy=text), strategy, nn.Linear(2, 2), "epoch")
    set_server_feedback(state, strategy)
    assert state.compressor.server_feedback is True


@pytest.mark.parametrize("feedback", [True, False])
def test_server_feedback_off_keeps_no_server_error_between_two_phase_exchanges(feedback):
    workers = [compressor_class("int").build(8, collective="two_phase") for _ in range(4)]
    for quantiser in workers:
        quantiser.server_feedback = feedback
    grads = [torch.randn(256, generator=torch.Generator().manual_seed(w)) for w in range(4)]
    SimulatedTransport(4).run([q.exchange(["w"], [g], 4) for q, g in zip(workers, grads)])
    kept = [len(q.state_dict()["server_error"]) for q in workers]
    assert kept == ([1] * 4 if feedback else [0] * 4)
