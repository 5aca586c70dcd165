"""The predictor's error where it matters: on real (testbed) windows left out of its training.

    python -m benchmarks.predictor_error [--dataset benchmarks/calibration/real-windows.json] \\
        [--real-share 0.25 0.5 0.75] [--out results/predictor-error.json]

Folds: every model of the dataset left out in turn (its real blocks; none of the simulator's
profiles is one of the dataset's models: its MLP, VGG-16, ResNet-50 and BERT differ in size from the
testbed's mlp, vgg, resnet and transformer), then every condition left out in turn (its blocks on
every model). For each fold two priors are trained with `simulator/train_prior.py`'s own
code: **before**, the simulator's windows only (what shipped until the real dataset existed), and
**after**, the simulator's plus the real windows of the other blocks at the given share of the
weight. Both then predict the left-out blocks as the tuner does: from a window of a reference
configuration (its context and step time), the step time of every other configuration of the grid
measured in the same round.

Reported per fold and pooled over the folds of a kind (every block is left out once per kind):
- error = |predicted / measured - 1| of the step time, median and p90, two ways: from the
  scheduler's default configuration (what the tuner has when a job starts) and from every
  configuration of the round as the reference (what it has later, mid-search);
- Kendall tau-b between predicted and measured step times over the grid within each (block,
  round), reference = the default, median over the blocks;
- the noise floor: the same error and tau between the two rounds of a block (how well the testbed
  agrees with itself; no predictor can be judged below it).
When the dataset holds blocks recorded with windows of different lengths (`--steps`), the pooled
errors (at the first share) and the noise floor are also given per window length: a window of
more steps is a less noisy measurement, both as the reference and as the truth.
Goals (issue 19): median <= 5%, p90 <= 15%, tau >= 0.6.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from autobyte.types import Config

REPO = pathlib.Path(__file__).resolve().parents[1]


def kendall(a: Sequence[float], b: Sequence[float]) -> float:
    from benchmarks.calibrate_map import kendall_tau

    return kendall_tau(dict(enumerate(a)), dict(enumerate(b)))


def _groups(windows: Sequence[Any]) -> dict[tuple[str, int], dict[Config, Any]]:
    out: dict[tuple[str, int], dict[Config, Any]] = defaultdict(dict)
    for window in windows:
        out[(window.job, window.segment)][window.config] = window
    return out


def evaluate(ensemble: Any, windows: Sequence[Any], default: Config) -> dict[str, Any]:
    """Errors and rank agreement of `ensemble` on held-out windows (see the module docstring)."""
    from autobyted.tuner.predictor import Predictor

    predictor = Predictor(ensemble)
    from_default, from_any, taus = [], [], []
    for by_config in _groups(windows).values():
        configs = list(by_config)
        for reference in configs:
            ref = by_config[reference]
            prediction = predictor.predict(ref.context, reference, configs)
            predicted = [prediction.step_time_s(ref.step_time_s, i) for i in range(len(configs))]
            errors = [abs(p / by_config[c].step_time_s - 1.0) for p, c in zip(predicted, configs) if c != reference]
            from_any += errors
            if reference == default:
                from_default += errors
                taus.append(kendall(predicted, [by_config[c].step_time_s for c in configs]))
    return summary(from_default, from_any, taus)


def _quantiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p90": None, "n": 0}
    return {"median": float(np.median(values)), "p90": float(np.quantile(values, 0.9)), "n": len(values)}


def summary(from_default: Sequence[float], from_any: Sequence[float], taus: Sequence[float]) -> dict[str, Any]:
    return {"from_default": _quantiles(from_default), "from_any": _quantiles(from_any),
            "tau_median": float(np.median(taus)) if taus else None, "tau_min": min(taus) if taus else None,
            "blocks": len(taus), "_raw": {"from_default": list(from_default), "from_any": list(from_any),
                                          "taus": list(taus)}}


def noise_floor(windows: Sequence[Any]) -> dict[str, Any]:
    """Round against round of the same block: |t(round a) / t(round b) - 1| per configuration, and
    the tau between the two rounds' orders."""
    by_block: dict[str, dict[int, dict[Config, float]]] = defaultdict(lambda: defaultdict(dict))
    for window in windows:
        by_block[window.job][window.segment][window.config] = window.step_time_s
    errors, taus = [], []
    for rounds in by_block.values():
        keys = sorted(rounds)
        for a, b in zip(keys, keys[1:]):
            common = [c for c in rounds[a] if c in rounds[b]]
            errors += [abs(rounds[a][c] / rounds[b][c] - 1.0) for c in common]
            taus.append(kendall([rounds[a][c] for c in common], [rounds[b][c] for c in common]))
    return summary(errors, errors, taus)


def pooled(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    raw = [r["_raw"] for r in results]
    return summary([v for r in raw for v in r["from_default"]], [v for r in raw for v in r["from_any"]],
                   [v for r in raw for v in r["taus"]])


def folds(blocks: Sequence[dict[str, Any]]) -> list[tuple[str, str, Callable[[dict[str, Any]], bool]]]:
    """(kind, name, is_held_out(block)) for every model and every condition of the dataset."""
    out = []
    for model in sorted({b["model"] for b in blocks}):
        out.append(("model", model, lambda b, m=model: b["model"] == m))
    conditions = sorted({b["condition"] for b in blocks})
    if len(conditions) > 1:
        for condition in conditions:
            out.append(("condition", condition, lambda b, c=condition: b["condition"] == c))
    return out


def run(dataset: pathlib.Path, shares: Sequence[float], seed: int | None = None) -> dict[str, Any]:
    from simulator import train_prior
    from simulator.adapter import SCHEDULER_DEFAULT
    from simulator.real_windows import block_job, block_windows, load_dataset

    seed = train_prior.SEED if seed is None else seed

    data = load_dataset(dataset)
    blocks = data["blocks"]
    simulated: dict[tuple[str, ...], list[Any]] = {}
    before_priors: dict[tuple[str, ...], Any] = {}
    results: dict[str, Any] = {"dataset": str(dataset), "blocks": len(blocks), "seed": seed,
                               "chunks": data.get("chunks", []), "shares": list(shares), "folds": []}
    per_block = [block_windows(b) for b in blocks]  # read once, shared by every fold
    all_windows = [w for windows in per_block for w in windows]
    results["noise_floor"] = noise_floor(all_windows)
    # Blocks recorded with longer windows are less noisy: their floor and errors apart as well
    steps_of = {block_job(b): int(b["steps"]) for b in blocks}
    lengths = sorted(set(steps_of.values()))
    if len(lengths) == 1:
        lengths = []  # one length: the pooled rows say it all
    if lengths:
        results["noise_floor_by_steps"] = {str(n): noise_floor([w for w in all_windows if steps_of[w.job] == n])
                                           for n in lengths}
    for kind, name, held_out in folds(blocks):
        started = time.perf_counter()
        exclude: tuple[str, ...] = ()  # no simulator profile is of a dataset model (sizes differ)
        if exclude not in simulated:
            simulated[exclude] = train_prior.generate_windows(seed, exclude=exclude)
            before_priors[exclude] = train_prior.train(seed, exclude=exclude, real=[], simulated=simulated[exclude])
        test = [w for b, windows in zip(blocks, per_block) if held_out(b) for w in windows]
        train = [w for b, windows in zip(blocks, per_block) if not held_out(b) for w in windows]
        fold = {"kind": kind, "left_out": name, "test_windows": len(test), "train_windows": len(train),
                "before": evaluate(before_priors[exclude], test, SCHEDULER_DEFAULT), "after": {}}
        for share in shares:
            after = train_prior.train(seed, exclude=exclude, real=train, real_share=share, simulated=simulated[exclude])
            fold["after"][str(share)] = evaluate(after, test, SCHEDULER_DEFAULT)
            if share == shares[0]:
                fold["by_steps"] = {}
                for n in lengths:
                    subset = [w for w in test if steps_of[w.job] == n]
                    if subset:
                        fold["by_steps"][str(n)] = {
                            "before": evaluate(before_priors[exclude], subset, SCHEDULER_DEFAULT),
                            "after": evaluate(after, subset, SCHEDULER_DEFAULT)}
        fold["seconds"] = round(time.perf_counter() - started, 1)
        results["folds"].append(fold)
        print(f"  fold {kind}={name}: {len(test)} windows left out, {fold['seconds']} s", file=sys.stderr, flush=True)
    for kind in ("model", "condition"):
        mine = [f for f in results["folds"] if f["kind"] == kind]
        if mine:
            results[f"pooled_{kind}"] = {"before": pooled([f["before"] for f in mine]),
                                         "after": {str(s): pooled([f["after"][str(s)] for f in mine])
                                                   for s in shares}}
            by_steps = {}
            for n in lengths:
                parts = [f["by_steps"][str(n)] for f in mine if str(n) in f["by_steps"]]
                if parts:
                    by_steps[str(n)] = {"before": pooled([p["before"] for p in parts]),
                                        "after": pooled([p["after"] for p in parts])}
            if by_steps:
                results[f"pooled_{kind}_by_steps"] = by_steps
    return results


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _row(label: str, result: dict[str, Any]) -> str:
    d, a = result["from_default"], result["from_any"]
    tau = "-" if result["tau_median"] is None else f"{result['tau_median']:.2f}"
    return (f"| {label} | {_pct(d['median'])} | {_pct(d['p90'])} | {_pct(a['median'])} | {_pct(a['p90'])} | "
            f"{tau} | {d['n']} / {a['n']} |")


def format_results(results: dict[str, Any]) -> str:
    lines = ["| left out | prior | median (from default) | p90 | median (from any) | p90 | tau (median) | pairs |",
             "|---|---|---|---|---|---|---|---|"]
    for fold in results["folds"]:
        name = f"{fold['kind']} {fold['left_out']}"
        lines.append(_row(f"{name} | before (simulator only)", fold["before"]))
        for share, value in fold["after"].items():
            lines.append(_row(f"{name} | after (real {float(share):.0%})", value))
    for kind in ("model", "condition"):
        item = results.get(f"pooled_{kind}")
        if item:
            lines.append(_row(f"**every {kind}, pooled** | before", item["before"]))
            for share, value in item["after"].items():
                lines.append(_row(f"**every {kind}, pooled** | after (real {float(share):.0%})", value))
    lines.append(_row("noise floor (round vs round) | -", results["noise_floor"]))
    share = f"{float(results['shares'][0]):.0%}"
    for kind in ("model", "condition"):
        for n, item in results.get(f"pooled_{kind}_by_steps", {}).items():
            lines.append(_row(f"every {kind}, pooled, {n}-step windows | before", item["before"]))
            lines.append(_row(f"every {kind}, pooled, {n}-step windows | after (real {share})", item["after"]))
    for n, item in results.get("noise_floor_by_steps", {}).items():
        lines.append(_row(f"noise floor, {n}-step windows | -", item))
    return "\n".join(lines)


def _strip_raw(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_raw(v) for k, v in value.items() if k != "_raw"}
    if isinstance(value, list):
        return [_strip_raw(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    from simulator.real_windows import DATASET_PATH
    from simulator.train_prior import REAL_SHARE, SEED

    parser = argparse.ArgumentParser(prog="python -m benchmarks.predictor_error", description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default=str(DATASET_PATH))
    parser.add_argument("--real-share", type=float, nargs="+", default=[REAL_SHARE])
    parser.add_argument("--out", default="")
    parser.add_argument("--seed", type=int, default=SEED,
                        help="the priors' seed (simulated contexts and ensembles; the shipped prior's by default)")
    args = parser.parse_args(argv)
    for share in args.real_share:
        if not 0.0 < share < 1.0:
            parser.error(f"--real-share {share}: must be between 0 and 1 (exclusive)")
    path = pathlib.Path(args.dataset)
    if not path.exists():
        parser.error(f"--dataset {path}: no such file (record one with python -m benchmarks.record_windows)")
    results = run(path, args.real_share, args.seed)
    print(format_results(results))
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_strip_raw(results), indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
