"""Every strategy paired with uncompressed training (dense), the paper's yardstick."""

from __future__ import annotations

import pytest

from accordion.harness.against_dense import against_dense, best_static, keeps_dense
from accordion.harness.compare import _text_table, format_dense_table


def run(strategy, seed, metric, nbytes, val_loss=None):
    last = {"test_metric": metric, "bytes": nbytes, "floats": nbytes / 4}
    if val_loss is not None:
        last["val_loss"] = val_loss
    return {"strategy": strategy, "seed": seed, "epochs": [last]}


def results(runs, metric="accuracy"):
    return {"config": {"metric": metric}, "runs": runs}


def test_without_a_dense_run_there_is_no_comparison():
    assert against_dense(results([run("static:powersgd:4", 0, 50.0, 10)])) is None


def test_each_strategy_is_paired_with_dense_by_seed_in_wire_bytes():
    summary = against_dense(results([
        run("dense", 0, 50.0, 1000), run("dense", 1, 52.0, 1000),
        run("static:half:bf16", 0, 49.9, 500), run("static:half:bf16", 1, 51.9, 500),
        run("static:powersgd:4", 0, 48.0, 100), run("static:powersgd:4", 1, 49.0, 100),
    ]))  # fmt: skip
    rows = {r["strategy"]: r for r in summary["rows"]}
    assert set(rows) == {"static:half:bf16", "static:powersgd:4"}
    assert rows["static:half:bf16"]["mean"] == pytest.approx(-0.1)
    assert rows["static:half:bf16"]["bytes_ratio"] == 2.0
    assert rows["static:powersgd:4"]["mean"] == pytest.approx(-2.5)
    assert rows["static:powersgd:4"]["bytes_ratio"] == 10.0
    assert [rows[s]["keeps_dense"] for s in sorted(rows)] == [True, False]
    assert summary["best_static"] == "static:half:bf16"


def test_only_seeds_both_ran_are_paired():
    summary = against_dense(results([
        run("dense", 0, 50.0, 10), run("static:topk:0.1", 0, 49.0, 5),
        run("static:topk:0.1", 1, 10.0, 5),
    ]))  # fmt: skip
    (row,) = summary["rows"]
    assert row["seeds"] == [0] and row["mean"] == -1.0 and row["low"] is None


def test_a_validation_loss_above_half_a_percent_fails_dense_quality_even_at_equal_accuracy():
    summary = against_dense(results([
        run("dense", 0, 47.0, 100, val_loss=2.00), run("dense", 1, 47.0, 100, val_loss=2.00),
        run("static:int:8", 0, 47.0, 25, val_loss=2.004),
        run("static:int:8", 1, 47.0, 25, val_loss=2.006),
        run("static:int:4", 0, 47.1, 12, val_loss=2.02),
        run("static:int:4", 1, 47.0, 12, val_loss=2.02),
    ]))  # fmt: skip
    rows = {r["strategy"]: r for r in summary["rows"]}
    assert rows["static:int:8"]["loss_percent"]["mean"] == pytest.approx(0.25)
    assert rows["static:int:8"]["keeps_dense"]
    assert rows["static:int:4"]["loss_percent"]["mean"] == pytest.approx(1.0)
    assert not rows["static:int:4"]["keeps_dense"]
    assert summary["best_static"] == "static:int:8"


def test_the_best_static_level_ignores_adaptive_strategies():
    rows = [
        {"strategy": "static:powersgd:4", "keeps_dense": True, "bytes_ratio": 5.0},
        {"strategy": "accordion:powersgd:4,1", "keeps_dense": True, "bytes_ratio": 9.0},
        {"strategy": "static:powersgd:1", "keeps_dense": False, "bytes_ratio": 20.0},
    ]
    assert best_static(rows) == "static:powersgd:4"
    assert best_static(rows[1:]) is None


def test_the_best_static_level_ignores_a_momentum_exchange_whose_level_changes():
    rows = [
        {"strategy": "static:nq:2:adam-noise", "keeps_dense": True, "bytes_ratio": 14.0},
        {"strategy": "static:nq:2:adam-noise:momentum=22/1", "keeps_dense": True,
         "bytes_ratio": 21.0},
    ]  # fmt: skip
    assert best_static(rows) == "static:nq:2:adam-noise"


def test_perplexity_keeps_dense_within_half_a_percent_of_dense_perplexity():
    assert keeps_dense({"mean": 0.4, "dense_mean": 100.0}, "perplexity")
    assert not keeps_dense({"mean": 0.6, "dense_mean": 100.0}, "perplexity")


def test_the_table_names_the_best_static_level_and_each_ratio_against_it():
    loaded = results([
        run("dense", 0, 50.0, 1000), run("dense", 1, 50.0, 1000),
        run("static:half:bf16", 0, 50.0, 500), run("static:half:bf16", 1, 50.1, 500),
        run("accordion:mixed:half/bf16,powersgd/4", 0, 49.9, 250),
        run("accordion:mixed:half/bf16,powersgd/4", 1, 50.0, 250),
    ])  # fmt: skip
    loaded["against_dense"] = against_dense(loaded)
    text = format_dense_table(loaded)
    assert "best static level that keeps dense: static:half:bf16" in text
    line = next(x for x in text.splitlines() if x.startswith("accordion:mixed"))
    assert "4.00x" in line and "2.00x" in line and "yes" in line
    assert format_dense_table(results([run("static:half:bf16", 0, 1.0, 1)])) is None
    assert _text_table(("a",), [("b",)]) == ["a", "b"]
