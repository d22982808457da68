"""Paired comparisons of strategies run with the same seeds.

Two strategies trained with the same seed share their initial weights and data order, so
the per-seed difference of their final test metric is far less noisy than the difference
of two independent means. :func:`paired_difference` gives the mean of those differences
with a Student-t interval; :func:`summarize_paired` builds one row per strategy against a
baseline (with several, the one of the same compressor) from ``results.json`` (one file,
or several merged by :func:`merge_results`).

No torch here: the tables can be made from saved results on any machine (several
baselines import the strategy parser, and with it torch, to match compressors).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .._validate import check_choice, check_int, check_number

#: Config keys that may differ between merged results files (launch details, not the run).
MERGE_IGNORED_KEYS = frozenset(
    {"seed", "seeds", "strategies", "strategy", "out", "threads", "progress", "data_dir"}
)

# ------------------------------------------------------------------- the t distribution


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= c * d
        if abs(c * d - 1.0) < 1e-15:
            return h
    raise ArithmeticError(f"incomplete beta fraction did not converge (a={a}, b={b}, x={x})")


def _incomplete_beta(a: float, b: float, x: float, y: float) -> float:
    """The regularized incomplete beta function I_x(a, b) for x in [0, 1]; ``y`` is
    ``1 - x``, passed separately so that neither loses digits near 0 or 1."""
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log(y))  # fmt: skip
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, y) / b


def _upper_tail(t: float, df: int) -> float:
    """P(T > t) for t >= 0: I_x(df/2, 1/2) / 2 with x = df / (df + t^2)."""
    return 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t), t * t / (df + t * t))


def t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile of Student's t distribution with ``df`` degrees of
    freedom (e.g. ``t_quantile(0.975, 7)`` = 2.3646), to about 1e-9 relative.

    Bisection on the exact upper tail (the regularized incomplete beta function).
    ``probability`` must be in (0, 1); ``df`` an int >= 1.
    """
    p = check_number("probability", probability)
    if not 0.0 < p < 1.0:
        raise ValueError(f"probability must be > 0 and < 1, got {probability!r}")
    df = check_int("df", df, 1)
    if p == 0.5:
        return 0.0
    tail = 1.0 - p if p > 0.5 else p  # the upper tail P(T > |t|) to reach
    lo, hi = 0.0, 1.0
    while _upper_tail(hi, df) > tail:
        lo, hi = hi, 2.0 * hi
    while True:
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if _upper_tail(mid, df) > tail:
            lo = mid
        else:
            hi = mid
    return mid if p > 0.5 else -mid


# ------------------------------------------------------------------- paired differences


def _numbers(name: str, values: Any) -> list[float]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of numbers, got {values!r:.80}")
    return [check_number(f"{name}[{i}]", v) for i, v in enumerate(values)]


def paired_difference(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95
) -> dict[str, Any]:
    """Mean of the paired differences ``a[i] - b[i]`` with a Student-t interval.

    Args:
        a, b: equally long, non-empty sequences of finite numbers, paired by index (one
            entry per seed); the result is in their unit (e.g. percentage points of
            accuracy).
        confidence: the interval's coverage, in (0, 1).

    Returns:
        ``{"n", "mean", "low", "high", "sd"}``: the number of pairs, the mean difference,
        the interval ``mean -/+ t((1 + confidence) / 2, n - 1) * sd / sqrt(n)`` and the
        differences' sample standard deviation. With one pair, ``low``, ``high`` and
        ``sd`` are ``None`` (no spread to estimate).
    """
    xs, ys = _numbers("a", a), _numbers("b", b)
    if len(xs) != len(ys):
        raise ValueError(f"a and b must have the same length, got {len(xs)} and {len(ys)}")
    if not xs:
        raise ValueError("a and b must hold at least one pair, got empty sequences")
    level = check_number("confidence", confidence)
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence must be > 0 and < 1, got {confidence!r}")
    diffs = [x - y for x, y in zip(xs, ys)]
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n == 1:
        return {"n": 1, "mean": mean, "low": None, "high": None, "sd": None}
    sd = statistics.stdev(diffs)
    half = t_quantile((1.0 + level) / 2.0, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half, "sd": sd}


# ------------------------------------------------------------------- results.json


def final_metric(run: Mapping[str, Any]) -> float:
    """A run's final test metric: accuracy in % (or perplexity) after its last epoch."""
    return run["epochs"][-1]["test_metric"]


def data_sent(run: Mapping[str, Any]) -> float:
    """Floats a run sent per worker over the whole run (paper convention)."""
    return run["epochs"][-1]["floats"]


def final_by_seed(results: Mapping[str, Any]) -> dict[str, dict[Any, float]]:
    """Strategy -> {seed: final test metric} of ``results`` (``results.json`` loaded);
    strategies in order of first appearance."""
    finals: dict[str, dict[Any, float]] = {}
    for run in _runs(results):
        finals.setdefault(run["strategy"], {})[run.get("seed", 0)] = final_metric(run)
    return finals


def runs_by_strategy(results: Any) -> dict[str, dict[Any, Mapping[str, Any]]]:
    """The runs of ``results`` (checked enough to pair them), by strategy then seed."""
    by_strategy: dict[str, dict[Any, Mapping[str, Any]]] = {}
    for run in _runs(results):
        by_strategy.setdefault(run["strategy"], {})[run.get("seed", 0)] = run
    return by_strategy


def _runs(results: Any) -> list[Mapping[str, Any]]:
    """The runs of ``results``, checked enough to pair them."""
    if not isinstance(results, Mapping):
        raise TypeError(f"results must be a dict (results.json loaded), got {type(results)}")
    runs = results.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"results must have a non-empty 'runs' list, got {runs!r:.80}")
    for i, run in enumerate(runs):
        if (
            not isinstance(run, Mapping)
            or not isinstance(run.get("strategy"), str)
            or not (isinstance(run.get("epochs"), list) and run["epochs"])
        ):
            raise ValueError(
                f"results['runs'][{i}] must be a dict with a 'strategy' and a non-empty "
                f"'epochs' list, got {run!r:.80}"
            )
    return runs


def check_baselines(baselines: Any, allowed: Sequence[str]) -> list[str]:
    """``baselines`` (a strategy, or a non-empty sequence of distinct ones, each one of
    ``allowed``) as a list.

    ``TypeError`` naming ``baselines`` unless it is a str or a sequence of str;
    ``ValueError`` for an empty sequence, a repeated baseline, or one not in ``allowed``
    (naming it and the allowed strategies).
    """
    if isinstance(baselines, str):
        names = [baselines]
    elif isinstance(baselines, bytes | Mapping) or not isinstance(baselines, Sequence):
        raise TypeError(f"baselines must be a str or a sequence of str, got {baselines!r:.80}")
    else:
        names = list(baselines)
        for i, name in enumerate(names):
            if not isinstance(name, str):
                raise TypeError(f"baselines[{i}] must be a str, got {name!r:.80}")
        if not names:
            raise ValueError("baselines must name at least one strategy, got an empty sequence")
    for name in names:
        check_choice("baseline", name, list(allowed))
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"baselines lists {name!r} twice: each baseline may appear once")
    return names


def pair_baselines(strategies: Sequence[str], baselines: Sequence[str]) -> dict[str, str]:
    """Strategy -> the baseline it is compared with, for each of ``strategies`` that is
    not a baseline, in their order: the first of ``baselines`` with the same compressor
    (:func:`~accordion.harness.strategies.parse_strategy`'s ``.compressor``: "dense",
    "powersgd", "topk", ...; a ladder of the mixed compressor goes by its mild rung's,
    so ``accordion:mixed:int/8,int/4`` pairs with ``static:int:8``), else the first
    baseline.

    With one baseline no strategy is parsed (nor torch imported): all go to it.
    """
    names = list(baselines)
    others = [s for s in strategies if s not in names]
    if len(names) == 1:
        return {s: names[0] for s in others}
    by_compressor: dict[str, str] = {}
    for name in names:
        by_compressor.setdefault(_pairing_compressor(name), name)
    return {s: by_compressor.get(_pairing_compressor(s), names[0]) for s in others}


def _pairing_compressor(strategy: str) -> str:
    from .strategies import parse_strategy  # imports torch: only to tell families apart

    parsed = parse_strategy(strategy)
    if parsed.compressor == "mixed" and parsed.levels:  # its mild level is its first rung
        return str(parsed.levels[0]).split("/", 1)[0]
    return parsed.compressor


def summarize_paired(
    results: Mapping[str, Any], baselines: str | Sequence[str], confidence: float = 0.95
) -> list[dict[str, Any]]:
    """One row per strategy that is not one of ``baselines``, paired by seed with its
    baseline (see :func:`pair_baselines`: the first with the same compressor, else the
    first listed); rows in strategy order, baselines get none.

    ``baselines`` is a strategy or a sequence of distinct ones, each run in ``results``
    (:func:`check_baselines`). Only seeds run by both count. Each row: ``strategy``,
    ``baseline``, ``seeds`` (the paired seeds), ``n``, ``mean``, ``low``, ``high``,
    ``sd`` (of ``strategy - baseline`` in final test metric: percentage points of
    accuracy, or perplexity), ``confidence``, ``values`` and ``baseline_values`` (the
    final metrics per paired seed) and ``data_ratio``: the baseline's mean data sent over
    this strategy's on those seeds (above 1: this strategy sends less; ``None`` without
    seeds or when it sends nothing). Without a shared seed, ``mean``, ``low``, ``high``
    and ``sd`` are ``None``.
    """
    by_strategy = runs_by_strategy(results)
    names = check_baselines(baselines, list(by_strategy))
    rows = []
    for strategy, baseline in pair_baselines(list(by_strategy), names).items():
        runs, base_runs = by_strategy[strategy], by_strategy[baseline]
        seeds = [s for s in runs if s in base_runs]
        values = [final_metric(runs[s]) for s in seeds]
        base_values = [final_metric(base_runs[s]) for s in seeds]
        if seeds:
            stats = paired_difference(values, base_values, confidence)
        else:
            stats = {"n": 0, "mean": None, "low": None, "high": None, "sd": None}
        ours = statistics.fmean(data_sent(runs[s]) for s in seeds) if seeds else 0.0
        theirs = statistics.fmean(data_sent(base_runs[s]) for s in seeds) if seeds else 0.0
        rows.append({
            "strategy": strategy, "baseline": baseline, "seeds": seeds, **stats,
            "confidence": confidence, "values": values, "baseline_values": base_values,
            "data_ratio": theirs / ours if ours else None,
        })  # fmt: skip
    return rows


def merge_results(many: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several ``results.json`` (loaded) as one: their runs in order, the first config
    with ``seeds`` and ``strategies`` over all of them.

    ``ValueError`` when two files hold the same strategy and seed, or when their configs
    disagree on a setting other than :data:`MERGE_IGNORED_KEYS` (settings that one file
    lacks are not compared).
    """
    if isinstance(many, str | bytes | Mapping) or not isinstance(many, Sequence) or not many:
        raise TypeError(f"many must be a non-empty sequence of results dicts, got {many!r:.80}")
    config = dict(many[0].get("config", {})) if isinstance(many[0], Mapping) else {}
    runs: list[Mapping[str, Any]] = []
    seen: dict[tuple[str, Any], int] = {}
    for index, results in enumerate(many):
        other = results.get("config", {}) if isinstance(results, Mapping) else {}
        for key in sorted(set(config) & set(other) - MERGE_IGNORED_KEYS):
            if config[key] != other[key]:
                raise ValueError(
                    f"results {index} has {key}={other[key]!r} but results 0 has "
                    f"{key}={config[key]!r}: only runs of the same settings can be paired"
                )
        for run in _runs(results):
            key = (run["strategy"], run.get("seed", 0))
            if key in seen:
                raise ValueError(
                    f"strategy {key[0]!r} seed {key[1]!r} is in results {seen[key]} and "
                    f"results {index}: each run may appear once"
                )
            seen[key] = index
            runs.append(run)
    config["strategies"] = list(dict.fromkeys(run["strategy"] for run in runs))
    config["seeds"] = len({run.get("seed", 0) for run in runs})
    return {"config": config, "runs": runs}


__all__ = [
    "check_baselines",
    "data_sent",
    "final_by_seed",
    "final_metric",
    "merge_results",
    "pair_baselines",
    "paired_difference",
    "summarize_paired",
    "t_quantile",
]
