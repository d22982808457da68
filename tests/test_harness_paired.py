"""Paired comparison of strategies by seed: accordion.harness.paired and
`accordion compare --baseline / --from`."""

from __future__ import annotations

import json
import math

import pytest

from accordion.cli import main
from accordion.harness import compare
from accordion.harness.compare import add_paired, format_paired, load_results, run_compare
from accordion.harness.paired import (
    check_baselines,
    final_by_seed,
    merge_results,
    pair_baselines,
    paired_difference,
    summarize_paired,
    t_quantile,
)
from accordion.harness.train import TrainConfig

BASE, OTHER, THIRD = "dense", "static:powersgd:2", "accordion:powersgd:2,1"


def _run(strategy: str, seed: int, metric: float, floats: float) -> dict:
    """A results.json run record: two epochs, the last one's metric and data count."""
    first = {"test_metric": 10.0, "floats": floats / 2, "bytes": 2 * floats, "train_time_s": 1.0}
    last = {"test_metric": metric, "floats": floats, "bytes": 4 * floats, "train_time_s": 2.0}
    return {"strategy": strategy, "seed": seed, "epochs": [first, last]}


def _results(runs: list[dict], **config) -> dict:
    strategies = sorted({r["strategy"] for r in runs})
    settings = {"task": "synthetic", "workers": 2, "seeds": 3, "epochs": 2, "lr": 0.1,
                "metric": "accuracy", "strategies": strategies}  # fmt: skip
    return {"config": {**settings, **config}, "runs": runs}


# ------------------------------------------------------------------- t quantiles


@pytest.mark.parametrize(
    ("probability", "df", "expected"),
    [(0.975, 7, 2.364624), (0.975, 1, 12.706205), (0.95, 10, 1.812461),
     (0.995, 30, 2.749996), (0.975, 1_000_000, 1.959966), (0.9, 3, 1.637744)],
)  # fmt: skip
def test_t_quantile_matches_the_tables(probability, df, expected):
    assert t_quantile(probability, df) == pytest.approx(expected, abs=1e-6)


def test_t_quantile_is_symmetric_about_zero():
    assert t_quantile(0.025, 7) == pytest.approx(-t_quantile(0.975, 7), rel=1e-12)
    assert t_quantile(0.5, 4) == 0.0


def test_t_quantile_agrees_with_scipy_where_scipy_is_installed():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 4, 9, 25, 59, 61, 200):
        for p in (0.6, 0.9, 0.975, 0.999):
            assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9)


@pytest.mark.parametrize(("probability", "df", "name"), [(1.0, 3, "probability"),
                         (0.0, 3, "probability"), (0.9, 0, "df")])  # fmt: skip
def test_t_quantile_rejects_arguments_outside_their_range_naming_them(probability, df, name):
    with pytest.raises(ValueError, match=name):
        t_quantile(probability, df)


# ------------------------------------------------------------------- paired differences


def test_paired_difference_gives_the_mean_and_student_t_interval_of_the_differences():
    result = paired_difference([1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0])
    sd = math.sqrt(5 / 3)
    half = 3.182446 * sd / 2  # t(0.975, 3) * sd / sqrt(4)
    assert result["n"] == 4
    assert result["mean"] == pytest.approx(2.5)
    assert result["sd"] == pytest.approx(sd)
    assert result["low"] == pytest.approx(2.5 - half, abs=1e-5)
    assert result["high"] == pytest.approx(2.5 + half, abs=1e-5)


def test_pairing_removes_the_spread_that_both_sequences_share():
    b = [50.0, 70.0, 90.0]
    result = paired_difference([x + 1.0 for x in b], b)
    assert result["mean"] == pytest.approx(1.0)
    assert result["low"] == pytest.approx(1.0) and result["high"] == pytest.approx(1.0)


def test_a_lower_confidence_gives_a_narrower_interval():
    a, b = [1.0, 3.0, 2.0, 5.0], [0.5, 1.0, 2.5, 1.0]
    wide, narrow = paired_difference(a, b, 0.99), paired_difference(a, b, 0.8)
    assert wide["low"] < narrow["low"] < narrow["high"] < wide["high"]


def test_one_pair_has_a_mean_but_no_interval():
    assert paired_difference([3.0], [1.0]) == {
        "n": 1, "mean": 2.0, "low": None, "high": None, "sd": None,
    }  # fmt: skip


def test_sequences_of_different_lengths_are_a_value_error_naming_both_lengths():
    with pytest.raises(ValueError, match="same length, got 2 and 3"):
        paired_difference([1.0, 2.0], [1.0, 2.0, 3.0])


@pytest.mark.parametrize(("a", "error", "name"), [([1.0, math.nan], ValueError, r"a\[1\]"),
                         ([1.0, "2"], TypeError, r"a\[1\]"), ("12", TypeError, "a must be"),
                         ([], ValueError, "at least one pair")])  # fmt: skip
def test_non_finite_or_non_numeric_values_are_rejected_naming_the_entry(a, error, name):
    with pytest.raises(error, match=name):
        paired_difference(a, [1.0] * len(a) if isinstance(a, list) else [1.0, 2.0])


@pytest.mark.parametrize("confidence", [0.0, 1.0, 1.5])
def test_a_confidence_outside_zero_to_one_is_a_value_error_naming_it(confidence):
    with pytest.raises(ValueError, match="confidence must be > 0 and < 1"):
        paired_difference([1.0, 2.0], [0.0, 1.0], confidence)


# ------------------------------------------------------------------- tables from results


def test_summarize_paired_pairs_only_the_seeds_both_strategies_ran():
    results = _results([_run(BASE, 0, 80.0, 1000), _run(BASE, 1, 82.0, 1000),
                        _run(OTHER, 1, 81.5, 100), _run(OTHER, 2, 70.0, 100)])  # fmt: skip
    [row] = summarize_paired(results, BASE)
    assert row["strategy"] == OTHER and row["baseline"] == BASE
    assert row["seeds"] == [1] and row["n"] == 1
    assert row["mean"] == pytest.approx(-0.5) and row["low"] is None
    assert row["values"] == [81.5] and row["baseline_values"] == [82.0]


def test_the_data_ratio_is_the_baselines_data_over_the_strategys():
    results = _results([_run(BASE, 0, 80.0, 1000), _run(OTHER, 0, 79.0, 250)])
    assert summarize_paired(results, BASE)[0]["data_ratio"] == pytest.approx(4.0)


def test_a_strategy_without_a_shared_seed_has_no_difference():
    results = _results([_run(BASE, 0, 80.0, 1000), _run(OTHER, 5, 79.0, 250)])
    [row] = summarize_paired(results, BASE)
    assert row["n"] == 0 and row["mean"] is None and row["data_ratio"] is None


def test_an_unknown_baseline_is_a_value_error_naming_it_and_the_strategies():
    results = _results([_run(BASE, 0, 80.0, 1000), _run(OTHER, 0, 79.0, 250)])
    with pytest.raises(ValueError, match=r"baseline must be one of \('dense', 'static"):
        summarize_paired(results, "static:topk:0.2")


def test_final_by_seed_reads_each_runs_last_test_metric():
    results = _results([_run(BASE, 0, 80.0, 1000), _run(BASE, 1, 82.0, 1000)])
    assert final_by_seed(results) == {BASE: {0: 80.0, 1: 82.0}}


def test_format_paired_prints_the_signed_mean_and_interval_per_strategy():
    runs = [_run(BASE, s, 80.0 + s, 1000) for s in range(3)]
    runs += [_run(OTHER, s, 80.0 + s + d, 500) for s, d in enumerate((-0.5, 0.1, 0.04))]
    results = _results(runs)
    add_paired(results, BASE)
    text = format_paired(results)
    # differences -0.5, 0.1, 0.04: sd 0.3305, t(0.975, 2) = 4.3027, half-width 0.821
    assert "-0.12 [-0.94, +0.70]" in text
    assert f"{OTHER}  " in text and "2.00x" in text and "(pp)" in text


# ------------------------------------------------------------------- several baselines

TOPK_BASE, TOPK = "static:topk:0.1", "accordion:topk:0.1,0.01"
PSGD_BASE, PSGD = "static:powersgd:4", "accordion:powersgd:4,1"


def _two_families() -> dict:
    """Dense, two top-k and two PowerSGD strategies over seeds 0-2; each strategy's
    accuracy is its own offset plus the seed, its data fixed per strategy."""
    offset = {BASE: 0.0, TOPK_BASE: -1.0, PSGD_BASE: -2.0, TOPK: -1.5, PSGD: -2.25,
              "torch-powersgd:2": -3.0}  # fmt: skip
    floats = {BASE: 1000, TOPK_BASE: 100, PSGD_BASE: 50, TOPK: 25, PSGD: 10,
              "torch-powersgd:2": 40}  # fmt: skip
    order = [BASE, TOPK_BASE, TOPK, PSGD_BASE, PSGD, "torch-powersgd:2"]
    return _results([_run(s, seed, 80.0 + seed + offset[s], floats[s])
                     for s in order for seed in range(3)])  # fmt: skip


def test_each_strategy_is_paired_with_the_baseline_of_its_compressor():
    rows = {r["strategy"]: r for r in summarize_paired(_two_families(), [TOPK_BASE, PSGD_BASE])}
    assert rows[TOPK]["baseline"] == TOPK_BASE
    assert rows[TOPK]["mean"] == pytest.approx(-0.5) and rows[TOPK]["n"] == 3
    assert rows[TOPK]["data_ratio"] == pytest.approx(4.0)  # 100 / 25
    assert rows[PSGD]["baseline"] == PSGD_BASE
    assert rows[PSGD]["mean"] == pytest.approx(-0.25)
    assert rows[PSGD]["data_ratio"] == pytest.approx(5.0)  # 50 / 10
    assert rows[PSGD]["baseline_values"] == [78.0, 79.0, 80.0]
    # PyTorch's own hook compresses with PowerSGD too
    assert rows["torch-powersgd:2"]["baseline"] == PSGD_BASE
    assert rows["torch-powersgd:2"]["mean"] == pytest.approx(-1.0)


def test_a_mixed_ladder_is_paired_with_the_baseline_of_its_mild_rungs_compressor():
    pairs = pair_baselines(
        ["dense", "static:int:8", "accordion:mixed:int/8,int/4", "accordion:mixed:half/bf16,int/4",
         "static:powersgd:4"],
        ["static:powersgd:4", "static:int:8"],
    )  # fmt: skip
    assert pairs["accordion:mixed:int/8,int/4"] == "static:int:8"
    # no half-precision baseline: the first listed, as for any other compressor
    assert pairs["accordion:mixed:half/bf16,int/4"] == "static:powersgd:4"


def test_a_strategy_without_a_baseline_of_its_compressor_goes_to_the_first_listed():
    for first, second in ((TOPK_BASE, PSGD_BASE), (PSGD_BASE, TOPK_BASE)):
        rows = {r["strategy"]: r for r in summarize_paired(_two_families(), [first, second])}
        assert rows[BASE]["baseline"] == first  # dense: neither baseline is dense


def test_baselines_get_no_row_and_the_rows_follow_the_strategy_order():
    rows = summarize_paired(_two_families(), (PSGD_BASE, TOPK_BASE, BASE))
    assert [r["strategy"] for r in rows] == [TOPK, PSGD, "torch-powersgd:2"]
    assert [r["baseline"] for r in rows] == [TOPK_BASE, PSGD_BASE, PSGD_BASE]


def test_one_baseline_in_a_list_is_the_same_as_the_baseline_alone():
    results = _two_families()
    assert summarize_paired(results, [BASE]) == summarize_paired(results, BASE)
    assert all(r["baseline"] == BASE for r in summarize_paired(results, BASE))


def test_a_repeated_baseline_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"baselines lists 'static:topk:0.1' twice"):
        summarize_paired(_two_families(), [TOPK_BASE, PSGD_BASE, TOPK_BASE])


def test_an_unknown_baseline_among_several_is_a_value_error_naming_it_and_the_strategies():
    with pytest.raises(ValueError, match=r"baseline must be one of \('dense', 'static:topk:0.1'"
                       r".*got 'static:topk:0.5'"):  # fmt: skip
        summarize_paired(_two_families(), [TOPK_BASE, "static:topk:0.5"])


@pytest.mark.parametrize(("baselines", "error", "match"), [
    (None, TypeError, "baselines must be a str or a sequence of str"),
    (b"dense", TypeError, "baselines must be a str or a sequence of str"),
    ({"dense": 1}, TypeError, "baselines must be a str or a sequence of str"),
    (["dense", 3], TypeError, r"baselines\[1\] must be a str, got 3"),
    ([], ValueError, "baselines must name at least one strategy"),
])  # fmt: skip
def test_baselines_of_the_wrong_type_or_none_at_all_are_rejected_naming_baselines(
    baselines, error, match
):
    with pytest.raises(error, match=match):
        summarize_paired(_two_families(), baselines)


def test_check_baselines_returns_the_baselines_as_a_list():
    assert check_baselines(BASE, [BASE, OTHER]) == [BASE]
    assert check_baselines((OTHER, BASE), [BASE, OTHER]) == [OTHER, BASE]


def test_add_paired_with_several_baselines_stores_them_and_each_rows_baseline():
    results = _two_families()
    paired = add_paired(results, [TOPK_BASE, PSGD_BASE])
    assert results["paired"] is paired
    assert set(paired) == {"baselines", "confidence", "metric", "rows"}
    assert paired["baselines"] == [TOPK_BASE, PSGD_BASE]
    assert [(r["strategy"], r["baseline"]) for r in paired["rows"]] == [
        (BASE, TOPK_BASE), (TOPK, TOPK_BASE), (PSGD, PSGD_BASE),
        ("torch-powersgd:2", PSGD_BASE),
    ]  # fmt: skip


def test_format_paired_with_several_baselines_has_a_baseline_column_and_says_how():
    results = _two_families()
    add_paired(results, [TOPK_BASE, PSGD_BASE])
    lines = format_paired(results).splitlines()
    assert lines[0].split()[:2] == ["strategy", "baseline"]
    body = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert list(body) == [BASE, TOPK, PSGD, "torch-powersgd:2"]
    assert body[TOPK][1] == TOPK_BASE and body[TOPK][-1] == "4.00x"
    assert body[PSGD][1] == PSGD_BASE and body[PSGD][-1] == "5.00x"
    assert body[BASE][1] == TOPK_BASE
    assert TOPK_BASE not in body and PSGD_BASE not in body
    footer = lines[-1]
    assert "paired with its baseline (same compressor, else the first)" in footer
    assert f"baselines {TOPK_BASE}, {PSGD_BASE}" in footer


def test_format_paired_with_one_baseline_keeps_todays_table():
    results = _two_families()
    add_paired(results, BASE)
    lines = format_paired(results).splitlines()
    assert lines[0].split()[:3] == ["strategy", "test", "accuracy"]
    assert lines[-1].startswith("paired with baseline dense by seed")


def test_run_compare_rejects_a_repeated_baseline_before_any_worker(tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "run_distributed", _no_workers)
    with pytest.raises(ValueError, match="baselines lists 'dense' twice"):
        run_compare(TrainConfig(epochs=2), [BASE, OTHER], seeds=1, workers=2, out=tmp_path,
                    baseline=[BASE, BASE])  # fmt: skip


# ------------------------------------------------------------------- merging results files


def test_merge_results_joins_the_runs_and_counts_the_seeds():
    one = _results([_run(BASE, 0, 80.0, 1000), _run(OTHER, 0, 79.0, 250)], seeds=1)
    two = _results([_run(BASE, 1, 81.0, 1000), _run(OTHER, 1, 81.0, 250)], seeds=1, seed=1)
    merged = merge_results([one, two])
    assert merged["config"]["seeds"] == 2
    assert merged["config"]["strategies"] == [BASE, OTHER]
    assert summarize_paired(merged, BASE)[0]["seeds"] == [0, 1]


def test_merging_the_same_strategy_and_seed_twice_is_a_value_error():
    one = _results([_run(BASE, 0, 80.0, 1000)])
    with pytest.raises(ValueError, match="'dense' seed 0 is in results 0 and results 1"):
        merge_results([one, one])


def test_merging_runs_of_different_settings_is_a_value_error_naming_the_setting():
    one = _results([_run(BASE, 0, 80.0, 1000)])
    two = _results([_run(BASE, 1, 80.0, 1000)], epochs=5)
    with pytest.raises(ValueError, match="epochs=5"):
        merge_results([one, two])


def test_load_results_reads_files_and_adds_the_table_and_paired_rows(tmp_path):
    paths = []
    for seed in (0, 1):
        path = tmp_path / f"r{seed}.json"
        runs = [_run(BASE, seed, 80.0, 1000), _run(OTHER, seed, 79.0 + seed, 250)]
        path.write_text(json.dumps(_results(runs)))
        paths.append(path)
    results = load_results(paths, baseline=BASE)
    assert [row["strategy"] for row in results["table"]] == [BASE, OTHER]
    assert results["paired"]["baselines"] == [BASE]
    assert "baseline" not in results["paired"]
    assert results["paired"]["rows"][0]["values"] == [79.0, 80.0]


# ------------------------------------------------------------------- run_compare and the CLI


def _fake_distributed(fn, workers, configs):
    """Stands in for the workers: a run per config whose accuracy depends on its seed."""
    gain = {BASE: 0.0, OTHER: -0.25, THIRD: 0.5}
    floats = {BASE: 1000, OTHER: 100, THIRD: 200}
    return [_run(c.strategy, c.seed, 80.0 + c.seed + gain[c.strategy] * (1 + c.seed / 10),
                 floats[c.strategy]) for c in configs]  # fmt: skip


def test_run_compare_with_a_baseline_stores_the_paired_table_in_results_json(tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "run_distributed", _fake_distributed)
    run_compare(TrainConfig(epochs=2), [BASE, OTHER, THIRD], seeds=3, workers=2,
                out=tmp_path, baseline=BASE)  # fmt: skip
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["paired"]["baselines"] == [BASE]
    assert {row["baseline"] for row in saved["paired"]["rows"]} == {BASE}
    rows = {row["strategy"]: row for row in saved["paired"]["rows"]}
    assert set(rows) == {OTHER, THIRD}
    assert rows[OTHER]["seeds"] == [0, 1, 2] and rows[OTHER]["data_ratio"] == pytest.approx(10)
    assert rows[OTHER]["mean"] == pytest.approx(-0.275) and rows[THIRD]["high"] > 0.55


def _no_workers(*args, **kwargs):
    raise AssertionError("a worker was started")


def test_run_compare_rejects_a_baseline_outside_the_strategies_before_any_worker(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(compare, "run_distributed", _no_workers)
    with pytest.raises(ValueError, match=r"baseline must be one of \('dense', 'static"):
        run_compare(TrainConfig(epochs=2), [BASE, OTHER], seeds=1, workers=2, out=tmp_path,
                    baseline="static:topk:0.2")  # fmt: skip


def test_the_cli_rejects_a_baseline_outside_the_strategies_naming_it(capsys, monkeypatch):
    monkeypatch.setattr(compare, "run_compare", _no_workers)
    with pytest.raises(SystemExit) as info:
        main(["compare", "--strategies", BASE, OTHER, "--baseline", "static:topk:0.2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--baseline" in err and "static:topk:0.2" in err and f"{BASE}, {OTHER}" in err


def test_compare_from_files_prints_both_tables_without_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(compare, "run_compare", _no_workers)
    path = tmp_path / "results.json"
    runs = [_run(BASE, 0, 80.0, 1000), _run(BASE, 1, 81.0, 1000),
            _run(OTHER, 0, 79.0, 500), _run(OTHER, 1, 80.5, 500)]  # fmt: skip
    path.write_text(json.dumps(_results(runs)))
    assert main(["compare", "--from", str(path), "--baseline", BASE]) == 0
    out = capsys.readouterr().out
    assert "less than mild" in out and "paired with baseline dense" in out
    assert "-0.75 [" in out and "2.00x" in out


def test_compare_from_files_takes_several_baselines(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(compare, "run_compare", _no_workers)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_two_families()))
    assert main(["compare", "--from", str(path), "--baseline", TOPK_BASE, PSGD_BASE]) == 0
    out = capsys.readouterr().out
    # the paper's table, the paired one, then every strategy against dense (which ran)
    table, paired, against = out.split("\n\n")
    assert "less than mild" in table
    assert against.startswith("strategy") and "against uncompressed training" in against
    header, *lines, footer = paired.strip().splitlines()
    assert header.split()[:2] == ["strategy", "baseline"]
    rows = {line.split()[0]: line.split()[1] for line in lines}
    assert rows == {BASE: TOPK_BASE, TOPK: TOPK_BASE, PSGD: PSGD_BASE,
                    "torch-powersgd:2": PSGD_BASE}  # fmt: skip
    assert "-0.50 [" in out and "paired with its baseline (same compressor" in footer


@pytest.mark.parametrize(("baselines", "message"), [
    ([TOPK_BASE, TOPK_BASE], "'static:topk:0.1' is given twice"),
    ([TOPK_BASE, "static:topk:0.5"], "got 'static:topk:0.5'"),
])  # fmt: skip
def test_compare_from_files_rejects_a_repeated_or_unknown_baseline(
    tmp_path, capsys, baselines, message
):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_two_families()))
    with pytest.raises(SystemExit) as info:
        main(["compare", "--from", str(path), "--baseline", *baselines])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--baseline" in err and message in err


def test_the_cli_rejects_a_second_baseline_outside_the_strategies_before_any_worker(
    capsys, monkeypatch
):
    monkeypatch.setattr(compare, "run_compare", _no_workers)
    with pytest.raises(SystemExit) as info:
        main(["compare", "--strategies", BASE, OTHER, "--baseline", BASE, "static:topk:0.2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "static:topk:0.2" in err and f"{BASE}, {OTHER}" in err


def test_compare_from_files_rejects_a_baseline_they_do_not_hold(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_results([_run(BASE, 0, 80.0, 1000)])))
    with pytest.raises(SystemExit) as info:
        main(["compare", "--from", str(path), "--baseline", OTHER])
    assert info.value.code == 2
    assert "--baseline" in capsys.readouterr().err


def test_compare_from_a_missing_file_is_a_usage_error_naming_from(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", "--from", str(tmp_path / "nowhere.json")])
    assert info.value.code == 2
    assert "--from" in capsys.readouterr().err


def test_compare_takes_strategies_or_from_but_not_both(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", "--strategies", BASE, "--from", str(tmp_path / "r.json")])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_real_compare_pairs_the_runs_it_trained_by_seed(tmp_path):
    tiny = TrainConfig(task="synthetic", synthetic_shape=(40,), train_samples=64,
                       test_samples=32, epochs=2, batch_size=32, threads=1,
                       progress=False)  # fmt: skip
    results = run_compare(tiny, [BASE, OTHER], seeds=2, workers=2, out=tmp_path, baseline=BASE)
    [row] = results["paired"]["rows"]
    finals = final_by_seed(results)
    assert row["seeds"] == [0, 1]
    assert row["values"] == [finals[OTHER][0], finals[OTHER][1]]
    assert row["baseline_values"] == [finals[BASE][0], finals[BASE][1]]
    assert row["data_ratio"] > 1
