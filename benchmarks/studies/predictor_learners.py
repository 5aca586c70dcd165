"""Other learners than the shipped recipe, on the same left-out real windows as predictor_error.

    python -m benchmarks.studies.predictor_learners [--dataset simulator/real-windows.json] \\
        [--out results/predictor-learners.json]

Every fold of `benchmarks/predictor_error.py` (a model left out, a condition left out) and its
scoring (`score`: from the default, from any reference, tau, rounds averaged). Learners, each
trained on the other blocks' real windows (and the simulator's, where it says so):

- shipped: the prior's own recipe (simulator + real windows at REAL_SHARE of the weight);
- simulator only: the prior before the real dataset existed;
- stretch x simulator: the simulator-only prior's log ratio times one factor k, fitted by weighted
  least squares on the real training pairs (a calibration of the simulator's effect sizes);
- simulator + online / shipped + online: the daemon's own runtime retraining (`train_online`, shallow
  trees on top) on the real training windows;
- stacked: a shallow xgboost on the real training pairs alone, the simulator-only prior's
  prediction one of its features;
- lookup per configuration: no features at all, each configuration's median log ratio to the
  default over the training blocks (the rounds' own pairs);
- predict no change (the baseline).
Beside them, the measurement's own noise: one window's first half against its second half
(median step times), the jitter no learner removes from a one-window prediction.

In the job (`--in-job K ...`, the model folds): what the daemon's predictor knows mid-search. For
each left-out block, the fold's shipped prior retrained online (`train_online`, as the daemon does)
on the block's own first round, K of its configurations (the default and K-1 drawn with a fixed
seed), then scored from the second round's default window on the configurations it did not see;
beside it, the same prior without the retraining and "no change" on the same windows.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from autobyte.types import Config

from benchmarks.predictor_error import (
    _pct,
    ensemble_predictor,
    folds,
    pooled,
    score,
    split,
    unchanged,
)

STACK_PARAMS = {
    "max_depth": 3,
    "eta": 0.1,
    "subsample": 0.8,
    "min_child_weight": 5.0,
    "lambda": 5.0,
    "nthread": 1,
    "seed": 0,
}
STACK_ROUNDS = 60

LogRatio = Callable[[np.ndarray], np.ndarray]


def fit_stretch(predicted: np.ndarray, measured: np.ndarray, weights: np.ndarray) -> float:
    """k minimising sum w (k p - y)^2: how much larger (k > 1) or smaller the measured effects are."""
    denominator = float(np.sum(weights * predicted * predicted))
    return float(np.sum(weights * predicted * measured)) / denominator if denominator > 0 else 1.0


def config_lookup(windows: Sequence[Any], default: Config) -> dict[Config, float]:
    """Median over (job, segment) of log(t(config) / t(default)), per configuration."""
    by_round: dict[tuple[str, int], dict[Config, float]] = defaultdict(dict)
    for window in windows:
        by_round[(window.job, window.segment)][window.config] = window.step_time_s
    ratios: dict[Config, list[float]] = defaultdict(list)
    for times in by_round.values():
        if default in times:
            for config, step in times.items():
                ratios[config].append(math.log(step / times[default]))
    return {config: float(np.median(values)) for config, values in ratios.items()}


def lookup_predictor(
    table: dict[Config, float],
) -> Callable[[Any, Config, list[Config]], list[float]]:
    """Predict from a reference window by the table's ratios (an unknown configuration: no change)."""

    def predict(ref: Any, reference: Config, configs: list[Config]) -> list[float]:
        base = table.get(reference, 0.0)
        return [ref.step_time_s * math.exp(table.get(c, base) - base) for c in configs]

    return predict


def model_predictor(log_ratio: LogRatio) -> Callable[[Any, Config, list[Config]], list[float]]:
    """Predict from a reference window with a function of the feature rows that is not an ensemble
    (those go through `ensemble_predictor`, as the tuner uses them); the reference: itself."""
    from autobyted.tuner.features import feature_matrix

    def predict(ref: Any, reference: Config, configs: list[Config]) -> list[float]:
        mean = np.asarray(
            log_ratio(feature_matrix(ref.context, reference, configs)), dtype=np.float64
        )
        return [
            ref.step_time_s
            if c == reference or not math.isfinite(m)
            else ref.step_time_s * math.exp(m)
            for m, c in zip(mean, configs)
        ]

    return predict


def window_halves(blocks: Sequence[dict[str, Any]]) -> list[float]:
    """|median(first half) / median(second half) - 1| of every window of >= 4 steps."""
    out = []
    for block in blocks:
        for item in block["windows"]:
            steps = [m["step_time_s"] for m in item["metrics"]]
            if len(steps) >= 4:
                half = len(steps) // 2
                out.append(
                    abs(statistics.median(steps[:half]) / statistics.median(steps[half:]) - 1.0)
                )
    return out


def learners(
    train: Sequence[Any], simulated: Sequence[Any], before: Any, default: Config
) -> tuple[dict[str, Callable[[Any, Config, list[Config]], list[float]]], dict[str, float], Any]:
    """Every learner of the module docstring, trained on `train` (real) and `simulated` windows."""
    import xgboost as xgb

    from autobyted.tuner.predictor import train_online, training_pairs
    from simulator import train_prior

    shipped = train_prior.train(train_prior.SEED, real=train, simulated=simulated)
    pairs = training_pairs(train, now_s=0.0, half_life_s=None)
    simulator_says = before.predict(pairs.x)[0]
    k = fit_stretch(simulator_says, pairs.y, pairs.weights)
    stacked = xgb.train(
        STACK_PARAMS,
        xgb.DMatrix(
            np.column_stack([simulator_says, pairs.x]),
            label=pairs.y,
            weight=pairs.weights,
            missing=np.nan,
            nthread=1,
        ),
        num_boost_round=STACK_ROUNDS,
    )
    online_before = train_online(before, train, now_s=0.0)
    online_shipped = train_online(shipped, train, now_s=0.0)
    return (
        {
            "shipped": ensemble_predictor(shipped),
            "simulator only": ensemble_predictor(before),
            "stretch x simulator": model_predictor(lambda x: k * before.predict(x)[0]),
            "simulator + online": ensemble_predictor(online_before),
            "shipped + online": ensemble_predictor(online_shipped),
            "stacked": model_predictor(
                lambda x: stacked.inplace_predict(
                    np.column_stack([before.predict(x)[0], x]), missing=np.nan
                )
            ),
            "lookup per configuration": lookup_predictor(config_lookup(train, default)),
            "predict no change": unchanged,
        },
        {"stretch": k},
        shipped,
    )


def in_job_split(
    windows: Sequence[Any], k: int, default: Config, seed: int
) -> tuple[list[Any], list[Any]]:
    """(seen, test): seen = the first round's windows of the default and k-1 other configurations
    (drawn with `seed`); test = the second round's windows of the default and the unseen ones."""
    rounds = sorted({w.segment for w in windows})
    if len(rounds) < 2:
        return [], []
    first = {w.config: w for w in windows if w.segment == rounds[0]}
    others = sorted((c for c in first if c != default), key=str)
    if default not in first or len(others) < k:
        return [], []
    chosen = {default, *random.Random(seed).sample(others, k - 1)}
    seen = [first[c] for c in sorted(chosen, key=str)]
    test = [
        w
        for w in windows
        if w.segment == rounds[1] and (w.config == default or w.config not in chosen)
    ]
    return seen, test


def in_job(
    shipped: Any, blocks: Sequence[list[Any]], ks: Sequence[int], default: Config
) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """Per K: the scores of the retrained prior, the prior and no change on each block's unseen windows."""
    from autobyted.tuner.predictor import train_online

    out: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for k in ks:
        parts: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for index, windows in enumerate(blocks):
            seen, test = in_job_split(windows, k, default, seed=index)
            if not seen:
                continue
            retrained = train_online(shipped, seen, now_s=0.0) or shipped
            parts["shipped, retrained on the job's K"].append(
                score(ensemble_predictor(retrained), test, default)
            )
            parts["shipped"].append(score(ensemble_predictor(shipped), test, default))
            parts["predict no change"].append(score(unchanged, test, default))
        out[k] = parts
    return out


def run(dataset: pathlib.Path, in_job_ks: Sequence[int] = ()) -> dict[str, Any]:
    from simulator import train_prior
    from simulator.adapter import SCHEDULER_DEFAULT
    from simulator.real_windows import block_windows, load_dataset

    blocks = load_dataset(dataset)["blocks"]
    per_block = [block_windows(b) for b in blocks]
    simulated = train_prior.generate_windows(train_prior.SEED)
    before = train_prior.train(train_prior.SEED, real=[], simulated=simulated)
    halves = window_halves(blocks)
    results: dict[str, Any] = {
        "dataset": str(dataset),
        "blocks": len(blocks),
        "folds": [],
        "window_halves": {
            "median": float(np.median(halves)),
            "p90": float(np.quantile(halves, 0.9)),
            "n": len(halves),
        },
    }
    scored: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for kind, name, held_out in folds(blocks):
        started = time.perf_counter()
        test, train = split(blocks, per_block, held_out)
        predictors, fitted, shipped = learners(train, simulated, before, SCHEDULER_DEFAULT)
        for learner, predict in predictors.items():
            scored[kind][learner].append(score(predict, test, SCHEDULER_DEFAULT))
        if kind == "model" and in_job_ks:
            held = [windows for b, windows in zip(blocks, per_block) if held_out(b)]
            for k, parts in in_job(shipped, held, in_job_ks, SCHEDULER_DEFAULT).items():
                for learner, items in parts.items():
                    scored[f"in the job, K={k}"][learner] += items
        results["folds"].append(
            {
                "kind": kind,
                "left_out": name,
                **fitted,
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
        print(
            f"  fold {kind}={name}: stretch {fitted['stretch']:.2f}, "
            f"{time.perf_counter() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    for kind, by_learner in scored.items():
        results[f"pooled_{kind}"] = {
            learner: _summary(pooled(parts)) for learner, parts in by_learner.items()
        }
    return results


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    averaged = result.get("rounds_averaged", {})
    return {
        "one_round": {**result["from_default"], "tau": result["tau_median"]},
        "rounds_averaged": {
            "median": averaged.get("median"),
            "p90": averaged.get("p90"),
            "tau": averaged.get("tau_median"),
        },
        "from_any": result["from_any"],
    }


def format_results(results: dict[str, Any]) -> str:
    def tau(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        "| left out | learner | one round: median | p90 | tau | rounds averaged: median | p90 | tau | from any: median |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    kinds = [key[len("pooled_") :] for key in results if key.startswith("pooled_")]
    for kind in kinds:
        for learner, item in results[f"pooled_{kind}"].items():
            one, avg = item["one_round"], item["rounds_averaged"]
            where = f"every {kind}, pooled" if kind in ("model", "condition") else kind
            lines.append(
                f"| {where} | {learner} | {_pct(one['median'])} | {_pct(one['p90'])} | "
                f"{tau(one['tau'])} | {_pct(avg['median'])} | {_pct(avg['p90'])} | {tau(avg['tau'])} | "
                f"{_pct(item['from_any']['median'])} |"
            )
    halves = results["window_halves"]
    lines.append(
        f"\nOne window's halves against each other: median {_pct(halves['median'])}, "
        f"p90 {_pct(halves['p90'])} ({halves['n']} windows). Stretch factors fitted per fold: "
        + ", ".join(f"{f['left_out']} {f['stretch']:.2f}" for f in results["folds"])
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from simulator.real_windows import DATASET_PATH

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.predictor_learners", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--dataset", default=str(DATASET_PATH))
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--in-job",
        type=int,
        nargs="*",
        default=[],
        help="K configurations of the left-out block's first round the prior is retrained on",
    )
    args = parser.parse_args(argv)
    if any(k < 2 for k in args.in_job):
        parser.error(
            f"--in-job {args.in_job}: each K must be at least 2 (the default and one more)"
        )
    path = pathlib.Path(args.dataset)
    if not path.exists():
        parser.error(
            f"--dataset {path}: no such file (record one with python -m benchmarks.record_windows)"
        )
    results = run(path, args.in_job)
    print(format_results(results))
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
