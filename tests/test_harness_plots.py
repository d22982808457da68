"""Tests of accordion.harness.plots on a small synthetic results.json structure."""

from __future__ import annotations

import copy
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib import colors as mcolors  # noqa: E402

import accordion  # noqa: E402
from accordion.harness import plots  # noqa: E402

LAYERS = ("conv1.weight", "conv2.weight", "fc.weight")
EPOCHS = 6
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXPECTED_SIZE = (round(plots.FIGSIZE[0] * plots.DPI), round(plots.FIGSIZE[1] * plots.DPI))

# Accordion with interval 2 and one lr decay before epoch 4: epochs 0-2 mild (start and
# the epoch-0 check), the epoch-2 check makes conv1 and conv2 aggressive for epoch 3, the
# decay makes everything mild for epoch 4, the epoch-4 check keeps conv1 mild only.
MILD_EPOCHS = {
    "conv1.weight": {0, 1, 2, 4, 5},
    "conv2.weight": {0, 1, 2, 4},
    "fc.weight": {0, 1, 2, 3, 4},
}
RATIOS = {  # check epoch -> layer -> ratio (None: infinite)
    0: {"conv1.weight": None, "conv2.weight": None, "fc.weight": None},
    2: {"conv1.weight": 0.34, "conv2.weight": 0.1, "fc.weight": 0.7},
    4: {"conv1.weight": 0.6, "conv2.weight": 0.2, "fc.weight": 0.05},
}


def _checks(eta: float = 0.5, infinite_later: bool = False) -> list[dict]:
    checks = []
    norms = dict.fromkeys(LAYERS, 3.0)
    for epoch, layer_ratios in RATIOS.items():
        layers = {}
        for layer, ratio in layer_ratios.items():
            if infinite_later and epoch == 2 and layer == "conv2.weight":
                ratio = None  # old norm 0: an infinite ratio after the first check
            old = None if epoch == 0 else norms[layer]
            new = norms[layer] * (1 - (ratio or 0.0))
            layers[layer] = {
                "old_norm": old,
                "new_norm": new,
                "ratio": ratio,
                "critical": ratio is None or ratio >= eta,
            }
            norms[layer] = new
        checks.append({"epoch": epoch, "lr_will_decay": False, "layers": layers})
    return checks


def _run(
    strategy: str, seed: int, mild=None, aggressive=None, per_step_floats=1000.0, offset=0.0
) -> dict:
    accordion = strategy.startswith("accordion:")
    records, floats = [], 0.0
    for epoch in range(EPOCHS):
        levels = {}
        if accordion:
            levels = {
                layer: mild if epoch in MILD_EPOCHS[layer] else aggressive for layer in LAYERS
            }
            floats += per_step_floats * (1.0 if epoch in MILD_EPOCHS["fc.weight"] else 0.3)
        else:
            floats += per_step_floats
        records.append(
            {
                "epoch": epoch,
                "train_loss": 2.0 / (epoch + 1) + 0.01 * seed,
                "test_metric": 50.0 + 6.0 * epoch + 1.5 * seed + offset,
                "floats": floats,
                "bytes": 4.0 * floats,
                "train_time_s": 0.5 * (epoch + 1),
                "lr": 0.1 if epoch < 4 else 0.01,
                "levels": levels,
            }
        )
    return {
        "strategy": strategy,
        "seed": seed,
        "epochs": records,
        "checks": _checks(infinite_later=strategy.startswith("accordion:topk"))
        if accordion
        else [],
        "mild": mild,
        "aggressive": aggressive,
    }


def _results(runs: list[dict]) -> dict:
    config = {
        "task": "mnist1d",
        "workers": 4,
        "epochs": EPOCHS,
        "decay_epochs": [4],
        "metric": "accuracy",
        "eta": 0.5,
        "interval": 2,
    }
    # through JSON, as plots will see it: tuples become lists, None becomes null
    return json.loads(json.dumps({"config": config, "runs": runs}))


@pytest.fixture
def results() -> dict:
    """2 strategies x 2 seeds, plus one accordion:topk run (two Accordion families)."""
    runs = [
        _run(strategy, seed, mild, aggressive, floats, offset)
        for strategy, mild, aggressive, floats, offset in (
            ("static:powersgd:4", 4, 4, 2.0e6, 0.0),
            ("accordion:powersgd:4,1", 4, 1, 2.0e6, -1.0),
        )
        for seed in (0, 1)
    ]
    runs.append(_run("accordion:topk:0.99,0.01", 0, 0.99, 0.01, 5.0e8, -4.0))
    return _results(runs)


@pytest.fixture
def single_family(results: dict) -> dict:
    single = copy.deepcopy(results)
    single["runs"] = [r for r in single["runs"] if not r["strategy"].startswith("accordion:topk")]
    return single


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert _png_size(path) == EXPECTED_SIZE


def test_plot_accuracy_writes_png_of_figure_size(results, tmp_path):
    path = plots.plot_accuracy(results, tmp_path / "acc.png")
    assert path == tmp_path / "acc.png"
    _assert_png(path)


def test_plot_accuracy_handles_perplexity_and_one_seed(results, tmp_path):
    results["config"]["metric"] = "perplexity"
    results["runs"] = [r for r in results["runs"] if r["seed"] == 0]
    _assert_png(plots.plot_accuracy(results, tmp_path / "ppl.png"))


def test_plot_data_sent_writes_png_with_log_scale_range(results, tmp_path):
    # the top-k run sends 250x more than the PowerSGD ones: the log-scale branch
    _assert_png(plots.plot_data_sent(results, tmp_path / "data.png"))


def test_plot_data_sent_writes_png_with_linear_range(single_family, tmp_path):
    _assert_png(plots.plot_data_sent(single_family, tmp_path / "data.png"))


def test_plot_levels_writes_png_for_default_accordion_run(results, tmp_path):
    _assert_png(plots.plot_levels(results, tmp_path / "levels.png"))


def test_plot_levels_accepts_family_prefix(results, tmp_path):
    _assert_png(plots.plot_levels(results, tmp_path / "levels.png", strategy="accordion:topk"))


def test_plot_levels_without_accordion_run_raises_naming_strategies(results, tmp_path):
    results["runs"] = [r for r in results["runs"] if not r["strategy"].startswith("accordion")]
    with pytest.raises(ValueError, match=r"static:powersgd:4"):
        plots.plot_levels(results, tmp_path / "levels.png")
    assert not (tmp_path / "levels.png").exists()


def test_plot_levels_rejects_non_accordion_strategy(results, tmp_path):
    with pytest.raises(ValueError, match="not an Accordion strategy"):
        plots.plot_levels(results, tmp_path / "levels.png", strategy="static:powersgd:4")


def test_plot_norm_ratios_writes_png(results, tmp_path):
    _assert_png(plots.plot_norm_ratios(results, tmp_path / "ratios.png"))


def test_plot_norm_ratios_survives_null_ratios_after_first_check(results, tmp_path):
    # the top-k run has an infinite (null) ratio at its epoch-2 check, besides epoch 0's
    run = next(r for r in results["runs"] if r["strategy"].startswith("accordion:topk"))
    assert run["checks"][1]["layers"]["conv2.weight"]["ratio"] is None
    path = plots.plot_norm_ratios(results, tmp_path / "ratios.png", "accordion:topk:0.99,0.01")
    _assert_png(path)


def test_plot_norm_ratios_survives_all_null_ratios(results, tmp_path):
    for run in results["runs"]:
        for check in run["checks"]:
            for entry in check["layers"].values():
                entry["ratio"] = None
    _assert_png(plots.plot_norm_ratios(results, tmp_path / "ratios.png"))


def test_plot_all_writes_single_family_file_names(single_family, tmp_path):
    written = plots.plot_all(single_family, tmp_path / "out")
    names = ["accuracy.png", "data_sent.png", "levels.png", "norm_ratios.png"]
    assert [p.name for p in written] == names
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(names)
    for path in written:
        _assert_png(path)


def test_plot_all_writes_one_levels_and_ratios_file_per_family(results, tmp_path):
    written = plots.plot_all(results, tmp_path)
    assert [p.name for p in written] == [
        "accuracy.png",
        "data_sent.png",
        "levels-powersgd.png",
        "levels-topk.png",
        "norm_ratios-powersgd.png",
        "norm_ratios-topk.png",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written)


def test_plot_all_shows_the_levels_of_the_default_rules_run(results, tmp_path, monkeypatch):
    paper = copy.deepcopy(next(r for r in results["runs"] if r["strategy"].startswith("acc")))
    paper["strategy"] = "accordion:powersgd:4,1:paper"
    results["runs"].insert(0, paper)  # the paper's rule's run comes first
    plotted = []
    monkeypatch.setattr(plots, "plot_levels", lambda res, path, strategy: plotted.append(
        strategy) or path)  # fmt: skip
    plots.plot_all(results, tmp_path)
    assert plotted == ["accordion:powersgd:4,1", "accordion:topk:0.99,0.01"]


def test_plot_all_without_accordion_writes_only_accuracy_and_data_sent(results, tmp_path):
    results["runs"] = [r for r in results["runs"] if r["strategy"] == "static:powersgd:4"]
    assert [p.name for p in plots.plot_all(results, tmp_path)] == ["accuracy.png", "data_sent.png"]


@pytest.mark.parametrize("bad", [{}, {"runs": []}, {"config": {}, "runs": None}])
def test_results_without_runs_raise_value_error(bad, tmp_path):
    for plot in (plots.plot_accuracy, plots.plot_data_sent, plots.plot_levels):
        with pytest.raises(ValueError, match="no runs"):
            plot(bad, tmp_path / "x.png")
    with pytest.raises(ValueError, match="no runs"):
        plots.plot_all(bad, tmp_path)


def test_missing_parent_directory_is_created(results, tmp_path):
    path = tmp_path / "a" / "b" / "acc.png"
    assert plots.plot_accuracy(results, str(path)) == path
    _assert_png(path)


def test_strategy_style_is_fixed_per_strategy_and_distinct():
    strategies = [
        "dense",
        "static:powersgd:4",
        "static:powersgd:1",
        "accordion:powersgd:4,1",
        "torch-powersgd:2",
        "static:topk:0.99",
        "static:topk:0.01",
        "accordion:topk:0.99,0.01",
    ]
    styles = [plots.strategy_style(s) for s in strategies]
    assert styles == [plots.strategy_style(s) for s in strategies]
    assert len({(s["color"], s["linestyle"]) for s in styles}) == len(strategies)


def test_plots_neither_import_pyplot_nor_touch_the_backend(results, tmp_path):
    # in a fresh interpreter: this one may have imported pyplot for other tests
    script = (
        "import json, sys, matplotlib\n"
        "before = matplotlib.rcParams._get('backend')\n"
        "from accordion.harness import plots\n"
        "plots.plot_accuracy(json.loads(sys.argv[1]), sys.argv[2])\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'\n"
        "assert matplotlib.rcParams._get('backend') == before, 'backend changed'\n"
    )
    src = str(Path(accordion.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    results["runs"] = results["runs"][:1]
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(results), str(tmp_path / "acc.png")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    _assert_png(tmp_path / "acc.png")


# ------------------------------------------------------------------ ladders and the registry

# the colours of the built-in families: each family's hue as the plots before the
# registry drew it, each level's shade from what it compresses (issue 23: no table of
# shades per compressor)
PINNED_STYLES = {
    "static:powersgd:4": "#2a7db8",
    "static:powersgd:1": "#6ba5cd",
    "static:powersgd:16": "#2077b4",
    "accordion:powersgd:4,1": "#d72c2d",
    "accordion:powersgd:2,1:auto": "#d93839",
    "torch-powersgd:2": "#a57fc8",
    "static:topk:0.99": "#4eaf4e",
    "static:topk:0.01": "#8ccb8c",
    "static:topk:0.1": "#74c074",
    "accordion:topk:0.99,0.01": "#ff8921",
    "static-batch:64": "#7f7f7f",
}


def test_strategy_style_keeps_the_colours_of_the_built_in_families():
    assert {s: plots.strategy_style(s)["color"] for s in PINNED_STYLES} == PINNED_STYLES
    # a ladder is shaded by its mildest rung, as a two-level one
    assert plots.strategy_style("accordion:powersgd:4,2,1") == plots.strategy_style(
        "accordion:powersgd:4,1"
    )


@pytest.mark.parametrize(
    "levels",
    [
        ("static:powersgd:8", "static:powersgd:4", "static:powersgd:2", "static:powersgd:1"),
        ("static:topk:0.99", "static:topk:0.5", "static:topk:0.1", "static:topk:0.01"),
        ("static:powersgd1:4", "static:powersgd1:2", "static:powersgd1:1"),
    ],
)
def test_a_level_that_compresses_more_is_a_lighter_shade_of_its_family(levels):
    # every compressor's levels are shaded from its own cost description: none needs a table
    lightness = [sum(mcolors.to_rgb(plots.strategy_style(s)["color"])) for s in levels]
    assert lightness == sorted(lightness) and len(set(lightness)) == len(levels)


def _ladder_results(strategy: str, ladder: tuple, per_epoch: list[dict]) -> dict:
    run = _run(strategy, 0, ladder[0], ladder[-1])
    for record, levels in zip(run["epochs"], per_epoch):
        record["levels"] = levels
    return _results([run])


def test_plot_levels_names_every_rung_of_a_longer_ladder(tmp_path):
    from accordion.compress import PowerSGD
    from accordion.harness.plots import levels as levels_plot

    rungs = [4, 4, 2, 1, 2, 4]  # per epoch; conv2 one rung more aggressive, fc missing
    per_epoch = [
        {"conv1.weight": r, "conv2.weight": max(1, r // 2), "fc.weight": None} for r in rungs
    ]
    results = _ladder_results("accordion:powersgd:4,2,1", (4, 2, 1), per_epoch)
    _assert_png(plots.plot_levels(results, tmp_path / "levels.png"))
    grid = [[r["levels"][layer] for r in results["runs"][0]["epochs"]] for layer in LAYERS]
    categories = levels_plot._categories(PowerSGD, (4, 2, 1), grid)
    assert [c[0] for c in categories] == [
        "mild (rank 4), critical", "intermediate (rank 2)", "aggressive (rank 1)",
    ]  # fmt: skip
    assert len({c[1] for c in categories}) == 3
    codes = levels_plot._codes(grid, categories)
    assert codes[0].tolist() == [0, 0, 1, 2, 1, 0] and set(codes[2].tolist()) == {3}


def test_a_compressor_with_word_levels_plots_without_changes(monkeypatch, tmp_path):
    from accordion.compress import base as compress_base
    from test_harness_strategies import _Fake

    monkeypatch.setitem(compress_base._REGISTRY, "fake", _Fake)
    words = ["light", "light", "medium", "heavy", "heavy", "light"]
    per_epoch = [dict.fromkeys(LAYERS, w) for w in words]
    results = _ladder_results("accordion:fake:light,medium,heavy", ("light", "heavy"), per_epoch)
    results["runs"].append(_run("static:fake:heavy", 0))
    results["runs"].append(_run("static:fake:light", 0))
    written = plots.plot_all(results, tmp_path)
    assert [p.name for p in written] == [
        "accuracy.png", "data_sent.png", "levels.png", "norm_ratios.png",
    ]  # fmt: skip
    for path in written:
        _assert_png(path)
    light, heavy = (plots.strategy_style(f"static:fake:{w}") for w in ("light", "heavy"))
    assert light["color"] != heavy["color"] and light["linestyle"] == "--"


def test_a_long_strategy_is_wrapped_at_its_commas_for_a_title():
    from accordion.harness.plots.common import TITLE_WIDTH, wrapped_strategy

    strategy = "accordion:mixed:nq/3,sparseloco/0.1,sparseloco/0.05,sparseloco/0.01:open"
    lines = wrapped_strategy(strategy).split("\n")
    assert len(lines) > 1
    assert all(len(line) <= TITLE_WIDTH for line in lines)
    assert "".join(lines) == strategy


def test_a_short_strategy_keeps_one_title_line():
    from accordion.harness.plots.common import wrapped_strategy

    assert wrapped_strategy("accordion:powersgd:4,2,1") == "accordion:powersgd:4,2,1"


def test_the_title_wrap_keeps_every_separator():
    from accordion.harness.plots.common import wrapped_strategy

    assert wrapped_strategy("a::b,,c") == "a::b,,c"
