"""Specification of the compressor contract in parts (issue 23): the level language
(``compress/levels.py``), the cost description (``compress/cost.py``) and the math and
state (``compress/base.py``), ``Compressor.build`` as the one constructor by name, the
break-even each compressor describes, and that nothing else names a compressor."""

from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path

import pytest

import accordion
from accordion.compress import (
    COLLECTIVES,
    RANK_CHANGE_POLICIES,
    SHARED_OPTIONS,
    Compressor,
    CostDescription,
    Dense,
    ErrorFeedback,
    LevelLanguage,
    OneRoundPowerSGD,
    PowerSGD,
    Reducer,
    TopK,
    compressing_names,
    compressor_class,
    compressor_names,
    make_compressor,
)
from accordion.compress.topk import BreakEven
from accordion.compress.wire import Message
from accordion.plan import break_even, make_plan
from accordion.policy import Ladder

SRC = Path(accordion.__file__).resolve().parent
LEVEL_METHODS = ("check_level", "parse_level", "level_text", "label", "aggressiveness")
COST_METHODS = (
    "applies_to", "paper_floats", "messages", "wire_bytes", "pays", "level_warning",
    "break_even", "break_even_text",
)  # fmt: skip
SHAPES = [(64, 32), (3, 3, 8, 8), (10,), (2048, 1000)]


# ------------------------------------------------------------------------ the two parts


@pytest.mark.parametrize("name", compressor_names())
def test_every_registered_compressor_implements_both_parts(name: str) -> None:
    cls = compressor_class(name)
    assert issubclass(cls, LevelLanguage) and issubclass(cls, CostDescription)
    assert not inspect.isabstract(cls)
    for level in cls.default_levels:
        assert cls.check_level(level) == level
        assert isinstance(cls.label(level), str) and isinstance(cls.level_text(level), str)
        assert isinstance(cls.aggressiveness(level), float)
        if cls is not Dense:  # dense has one level, which has no text to read
            assert cls.parse_level(cls.level_text(level)) == level
        for shape in SHAPES:
            assert isinstance(cls.applies_to(shape), bool)
            if not (cls.applies_to(shape) or cls is Dense):
                continue  # the costs are of the tensors it applies to (dense: of any)
            assert isinstance(cls.paper_floats(shape, level, 4), int)
            messages = cls.messages(shape, level, 4)
            assert all(isinstance(m, Message) for m in messages)
            assert cls.wire_bytes(shape, level, 4, 4) >= 0
            assert isinstance(cls.pays(shape, level), bool)
        warning = cls.level_warning(SHAPES, level)
        assert warning is None or isinstance(warning, str)


def test_each_part_is_defined_in_its_own_module_and_the_compressor_combines_them() -> None:
    for method in LEVEL_METHODS:
        assert method in vars(LevelLanguage) and method not in vars(Compressor), method
    for method in COST_METHODS:
        assert method in vars(CostDescription) and method not in vars(Compressor), method
    assert LevelLanguage.__module__ == "accordion.compress.levels"
    assert CostDescription.__module__ == "accordion.compress.cost"
    assert Compressor.__mro__[1:3] == (LevelLanguage, CostDescription)


def test_the_classmethods_keep_their_names_for_callers() -> None:
    assert PowerSGD.paper_floats((64, 32), 4, 2) == (64 + 32) * 4
    assert PowerSGD.parse_level(" 4 ") == 4 and TopK.parse_level("0.1") == 0.1
    assert PowerSGD.label(4) == "rank 4" and TopK.label(0.1) == "top-k 0.1"
    assert PowerSGD.aggressiveness(1) > PowerSGD.aggressiveness(4)
    assert not PowerSGD.pays((3, 64), 8) and TopK.pays((3, 64), 0.99)


def test_compressor_classes_stay_ladder_level_kinds() -> None:
    ladder = Ladder(PowerSGD, (4, 2, 1))
    assert ladder.levels == (4, 2, 1) and ladder.kind.name == "powersgd"
    with pytest.raises(ValueError, match="rank 4 compresses less than rank 2"):
        Ladder(PowerSGD, (2, 4))
    assert Ladder(TopK, (0.99, 0.1)).levels == (0.99, 0.1)


@pytest.mark.parametrize(
    "compressor,keys",
    [
        (Dense(), set()),
        (TopK(0.1), set()),
        (PowerSGD(2), {"seed", "on_rank_change", "q", "q_level"}),
        (OneRoundPowerSGD(2), {"seed", "on_rank_change", "q", "q_level", "p"}),
    ],
)
def test_a_compressors_state_dict_keys_are_unchanged(compressor, keys) -> None:
    assert set(compressor.state_dict()) == {"kind", "default_level", "levels"} | keys


# ------------------------------------------------------------------------------- build


@pytest.mark.parametrize("name", compressor_names())
def test_build_takes_the_shared_options_for_every_compressor(name: str) -> None:
    cls = compressor_class(name)
    built = cls.build(cls.default_levels[1], seed=3, on_rank_change="redraw")
    assert type(built) is cls
    assert built.default_level == cls.default_levels[1]
    assert type(cls.build()) is cls


def test_build_passes_the_options_a_compressor_has_and_its_level() -> None:
    built = PowerSGD.build(4, seed=7, on_rank_change="redraw")
    assert (built.default_level, built.seed, built.on_rank_change) == (4, 7, "redraw")
    one_round = OneRoundPowerSGD.build(None, seed=5)
    assert (one_round.default_level, one_round.seed, one_round.on_rank_change) == (2, 5, "reuse")
    assert PowerSGD.build().state_dict() == PowerSGD().state_dict()
    assert TopK.build(0.5, seed=7).state_dict() == TopK(0.5).state_dict()


def test_dense_build_ignores_the_level() -> None:
    assert isinstance(Dense.build(), Dense) and isinstance(Dense.build(4, seed=1), Dense)


@pytest.mark.parametrize("name", compressor_names())
def test_build_refuses_an_unknown_option_naming_it_and_the_allowed_ones(name: str) -> None:
    with pytest.raises(TypeError, match=r"unknown options \['rank'\].*'seed', 'on_rank_change'"):
        compressor_class(name).build(None, rank=4)


def test_build_checks_the_level_and_the_options_values_its_compressor_uses() -> None:
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        PowerSGD.build(0)
    with pytest.raises(ValueError, match="on_rank_change"):
        PowerSGD.build(2, on_rank_change="keep")
    with pytest.raises(TypeError, match="fraction"):
        TopK.build("0.1")


def test_shared_options_and_their_values_need_no_compressor_name() -> None:
    assert SHARED_OPTIONS == ("seed", "on_rank_change", "collective")
    assert COLLECTIVES == ("auto", "all_gather", "two_phase")
    assert RANK_CHANGE_POLICIES == PowerSGD.RANK_CHANGE_POLICIES == ("redraw", "reuse")


def test_make_compressor_goes_through_build(monkeypatch) -> None:
    calls = []
    original = TopK.build.__func__
    monkeypatch.setattr(TopK, "build", classmethod(lambda c, *a, **k: calls.append((a, k))
                                                   or original(c, *a, **k)))  # fmt: skip
    assert make_compressor("topk", 0.5, seed=2).default_level == 0.5
    assert calls == [((0.5,), {"seed": 2})]
    assert make_compressor("powersgd", 4, seed=3).seed == 3
    with pytest.raises(ValueError, match="level must be None for Dense"):
        make_compressor("dense", 2)
    with pytest.raises(TypeError, match="unknown options"):
        make_compressor("half", "fp16", level_dtype="bf16")


# -------------------------------------------------------------------------- break-even


# top-k all-gathers, so its bytes grow with the workers; the quantisers' two phases do not
@pytest.mark.parametrize("name", [n for n in compressor_names() if n != "topk"])
def test_a_compressor_without_a_break_even_describes_none(name: str) -> None:
    assert compressor_class(name).break_even([(1000, 512)], 8) is None
    assert break_even([(1000, 512)], name, 8) is None


def test_topk_describes_its_break_even_for_every_model() -> None:
    described = TopK.break_even([(1000, 512)], 8)
    assert isinstance(described, BreakEven) and break_even([(1000, 512)], "topk", 8) == described
    assert described.as_dict() == {
        "workers": 8, "density": 0.125, "paper_density": 1 / 16, "value_bytes": 4,
        "index_bytes": 4.0,
    }  # fmt: skip
    empty = TopK.break_even((), 1)
    assert empty is not None and empty.density is None


def test_topk_writes_its_break_even_for_people() -> None:
    shapes = [(1000, 512)]
    rows = make_plan(shapes, "topk", [0.99, 0.1], 8, 1, 1.25e9, 0.0)
    entry = {
        **TopK.break_even(shapes, 8).as_dict(),
        "bytes_vs_dense": [r.bytes_per_step / rows[0].bytes_per_step for r in rows[1:]],
    }
    text = TopK.break_even_text(entry, [r.label for r in rows[1:]])
    assert text.startswith("top-k break-even at 8 workers: density 1/8 = 12.5% of the entries")
    assert "(paper floats: 1/16 = 6.25%)" in text and "top-k 0.1 0.8x" in text
    none = TopK.break_even_text({**TopK.break_even([(10,)], 8).as_dict(), "bytes_vs_dense": []},
                                [])  # fmt: skip
    assert none == "top-k break-even at 8 workers: none (top-k compresses no tensor)"


# ------------------------------------------------------------- state keys, one check


@pytest.mark.parametrize(
    "owner,load",
    [
        ("PowerSGD", PowerSGD(2).load_state_dict),
        ("ErrorFeedback", ErrorFeedback().load_state_dict),
        ("Reducer", Reducer(TopK(0.1)).load_state_dict),
    ],
)
def test_state_keys_are_checked_by_the_one_shared_check(owner, load) -> None:
    with pytest.raises(ValueError, match=rf"state must be a Mapping from {owner}.state_dict"):
        load([("kind", "powersgd")])
    state = {"kind": "powersgd", "extra": 1}
    with pytest.raises(ValueError, match=rf"state is not a {owner} state_dict: .*'extra'"):
        load(state)


def test_another_compressors_state_is_named_by_its_kind() -> None:
    with pytest.raises(ValueError, match="state is for compressor kind 'powersgd', not 'topk'"):
        TopK(0.1).load_state_dict(PowerSGD(2).state_dict())


# ------------------------------------------------------- no other module names one


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}  # fmt: skip


@pytest.mark.parametrize(
    "module",
    ["plan.py", "accounting.py", "costmodel.py", "harness/plots/style.py", "cli/break_even.py"],
)
def test_no_module_outside_a_compressors_own_file_branches_on_its_name(module: str) -> None:
    named = _string_constants(SRC / module) & set(compressing_names())
    assert named == set(), f"{module} names {sorted(named)}"


def test_accounting_no_longer_re_exports_compressor_internals() -> None:
    import accordion.accounting as accounting

    for name in ("check_rank", "matrix_shape", "powersgd_rank", "INT32_BYTES", "INT64_BYTES",
                 "check_fraction", "index_bytes", "topk_count"):  # fmt: skip
        assert not hasattr(accounting, name), name
    assert math.isclose(accounting.wire_bytes((64, 32), "dense", None, 2), 64 * 32 * 4)
