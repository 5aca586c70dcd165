"""The predictor's error where it matters: on real (testbed) windows left out of its training.

    python -m benchmarks.predictor_error [--dataset simulator/real-windows.json] \\
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
  agrees with itself; no predictor can be judged below it);
- from the default with the rounds averaged: per block, the geometric mean over its rounds of the
  prediction (each from that round's default window) against the geometric mean of the measured
  step times, and tau between the two. Both sides carry half the variance of one round, so a
  perfect predictor would score about the noise floor / sqrt(2) here (given beside it): how much of
  the error is the predictor's own rather than the testbed's;
- the baseline any predictor must beat: "no change" (every configuration as fast as the reference),
  scored the same ways on every block.
When the dataset holds blocks recorded with windows of different lengths (`--steps`), the pooled
errors (at the first share) and the noise floor are also given per window length: a window of
more steps is a less noisy measurement, both as the reference and as the truth.
Goals: median <= 5%, p90 <= 15%, tau >= 0.6.

`--emulated`: the same over the dataset's emulated-accelerator blocks (`record_windows --emulated`:
the regime of the tuner at scale, 2-8 ranks), left out by model, by rank count and by rate in turn;
the priors train on every other block, CPU and emulated. Each block's reference is the
configuration its job derived at start (`default` in the block), as the tuner's first prediction
is; a left-out model that is one of the simulator's named profiles (the emulated ranks run that very
profile) is left out of the simulated windows as well.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pathlib
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
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


def ensemble_predictor(ensemble: Any) -> Callable[[Any, Config, list[Config]], list[float]]:
    """`ensemble` predicting from a reference window as the tuner does (autobyted's Predictor)."""
    from autobyted.tuner.predictor import Predictor

    predictor = Predictor(ensemble)

    def predict(ref: Any, reference: Config, configs: list[Config]) -> list[float]:
        prediction = predictor.predict(ref.context, reference, configs)
        return [prediction.step_time_s(ref.step_time_s, i) for i in range(len(configs))]

    return predict


Default = Config | Mapping[str, Config]  # the reference: one for all blocks, or per block (job)


def _default_of(default: Default, job: str) -> Config:
    return default if isinstance(default, Config) else default[job]


def evaluate(ensemble: Any, windows: Sequence[Any], default: Default) -> dict[str, Any]:
    """Errors and rank agreement of `ensemble` on held-out windows (see the module docstring)."""
    return score(ensemble_predictor(ensemble), windows, default)


def unchanged(ref: Any, reference: Config, configs: list[Config]) -> list[float]:
    """The baseline a predictor must beat: every configuration as fast as the reference."""
    return [ref.step_time_s] * len(configs)


def score(
    predict: Callable[[Any, Config, list[Config]], list[float]],
    windows: Sequence[Any],
    default: Default,
) -> dict[str, Any]:
    """`predict(reference window, reference, configurations)` -> step times, scored on `windows`
    (`default`: the reference the tuner has when a job starts, per block where they differ)."""
    from_default, from_any, taus = [], [], []
    # per block, per round: the log step times predicted from the default and measured
    rounds: dict[str, list[tuple[dict[Config, float], dict[Config, float]]]] = defaultdict(list)
    for (job, _), by_config in _groups(windows).items():
        configs = list(by_config)
        for reference in configs:
            predicted = predict(by_config[reference], reference, configs)
            errors = [
                abs(p / by_config[c].step_time_s - 1.0)
                for p, c in zip(predicted, configs)
                if c != reference
            ]
            from_any += errors
            if reference == _default_of(default, job):
                from_default += errors
                taus += ordered_tau(predicted, [by_config[c].step_time_s for c in configs])
                rounds[job].append(
                    (
                        {c: math.log(p) for p, c in zip(predicted, configs)},
                        {c: math.log(by_config[c].step_time_s) for c in configs},
                    )
                )
    mean_errors, mean_taus = averaged_over_rounds(rounds, default)
    return summary(from_default, from_any, taus, mean_errors, mean_taus)


def averaged_over_rounds(
    rounds: dict[str, list[tuple[dict[Config, float], dict[Config, float]]]], default: Default
) -> tuple[list[float], list[float]]:
    """Errors and taus of the geometric means over each block's rounds (predicted from each
    round's default window; measured), over the configurations every round has."""
    errors, taus = [], []
    for job, per_round in rounds.items():
        if len(per_round) < 2:
            continue
        common = sorted(set.intersection(*(set(measured) for _, measured in per_round)), key=str)
        predicted = [float(np.mean([p[c] for p, _ in per_round])) for c in common]
        measured = [float(np.mean([m[c] for _, m in per_round])) for c in common]
        errors += [
            abs(math.exp(p - m) - 1.0)
            for p, m, c in zip(predicted, measured, common)
            if c != _default_of(default, job)
        ]
        taus += ordered_tau(predicted, measured)
    return errors, taus


def ordered_tau(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    """[tau] when the prediction orders the configurations; [] when it does not (the no-change
    baseline predicts one value for all)."""
    return [kendall(predicted, measured)] if len(set(predicted)) > 1 else []


def _quantiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p90": None, "n": 0}
    return {
        "median": float(np.median(values)),
        "p90": float(np.quantile(values, 0.9)),
        "n": len(values),
    }


def summary(
    from_default: Sequence[float],
    from_any: Sequence[float],
    taus: Sequence[float],
    mean_errors: Sequence[float] = (),
    mean_taus: Sequence[float] = (),
) -> dict[str, Any]:
    out = {
        "from_default": _quantiles(from_default),
        "from_any": _quantiles(from_any),
        "tau_median": float(np.median(taus)) if taus else None,
        "tau_min": min(taus) if taus else None,
        "blocks": len(taus),
        "_raw": {
            "from_default": list(from_default),
            "from_any": list(from_any),
            "taus": list(taus),
            "mean_errors": list(mean_errors),
            "mean_taus": list(mean_taus),
        },
    }
    if mean_errors:
        out["rounds_averaged"] = {
            **_quantiles(mean_errors),
            "tau_median": float(np.median(mean_taus)) if mean_taus else None,
        }
    return out


def noise_floor(windows: Sequence[Any]) -> dict[str, Any]:
    """Round against round of the same block: |t(round a) / t(round b) - 1| per configuration, and
    the tau between the two rounds' orders."""
    by_block: dict[str, dict[int, dict[Config, float]]] = defaultdict(lambda: defaultdict(dict))
    for window in windows:
        by_block[window.job][window.segment][window.config] = window.step_time_s
    errors, taus = [], []
    for rounds in by_block.values():
        keys = sorted(rounds)
        for a, b in itertools.pairwise(keys):
            common = [c for c in rounds[a] if c in rounds[b]]
            errors += [abs(rounds[a][c] / rounds[b][c] - 1.0) for c in common]
            taus.append(kendall([rounds[a][c] for c in common], [rounds[b][c] for c in common]))
    return summary(errors, errors, taus)


def pooled(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    raw = [r["_raw"] for r in results]
    return summary(
        *(
            [v for r in raw for v in r[key]]
            for key in ("from_default", "from_any", "taus", "mean_errors", "mean_taus")
        )
    )


def folds(
    blocks: Sequence[dict[str, Any]], emulated: bool = False
) -> list[tuple[str, str, Callable[[dict[str, Any]], bool]]]:
    """(kind, name, is_held_out(block)) for every model and every condition of the dataset's CPU
    testbed blocks; with `emulated`, of its emulated-accelerator blocks, and every rank count."""
    mine = [b for b in blocks if bool(b.get("emulated")) == emulated]

    def of(key: str, value: Any) -> Callable[[dict[str, Any]], bool]:
        return lambda b: bool(b.get("emulated")) == emulated and b[key] == value

    out = [("model", model, of("model", model)) for model in sorted({b["model"] for b in mine})]
    if emulated:
        out += [
            ("ranks", str(n), of("world_size", n)) for n in sorted({b["world_size"] for b in mine})
        ]
    conditions = sorted({b["condition"] for b in mine})
    if len(conditions) > 1:
        out += [("condition", c, of("condition", c)) for c in conditions]
    return out


def simulator_exclusion(kind: str, name: str, emulated: bool) -> tuple[str, ...]:
    """The simulator profiles a fold leaves out with its blocks: an emulated block's model is one of
    the simulator's named profiles (benchmarks/testbed/emulated.py runs the same profile), so a
    left-out emulated model leaves its profile out of the simulated windows too; the CPU testbed's
    models differ in size from every simulator profile."""
    from simulator.train_prior import NAMED_MODELS

    return (name,) if emulated and kind == "model" and name in NAMED_MODELS else ()


def split(
    blocks: Sequence[dict[str, Any]],
    per_block: Sequence[list[Any]],
    held_out: Callable[[dict[str, Any]], bool],
) -> tuple[list[Any], list[Any]]:
    """(the held-out blocks' windows, the other blocks' windows)."""
    test = [w for b, windows in zip(blocks, per_block) if held_out(b) for w in windows]
    train = [w for b, windows in zip(blocks, per_block) if not held_out(b) for w in windows]
    return test, train


KINDS = ("model", "ranks", "condition")


def run(
    dataset: pathlib.Path,
    shares: Sequence[float],
    seed: int | None = None,
    emulated: bool = False,
) -> dict[str, Any]:
    from simulator import train_prior
    from simulator.adapter import SCHEDULER_DEFAULT
    from simulator.real_windows import block_default, block_job, block_windows, load_dataset

    seed = train_prior.SEED if seed is None else seed

    data = load_dataset(dataset)
    blocks = data["blocks"]
    simulated: dict[tuple[str, ...], list[Any]] = {}
    before_priors: dict[tuple[str, ...], Any] = {}
    results: dict[str, Any] = {
        "dataset": str(dataset),
        "blocks": len(blocks),
        "seed": seed,
        "chunks": data.get("chunks", []),
        "shares": list(shares),
        "folds": [],
    }
    results["regime"] = "emulated" if emulated else "cpu"
    per_block = [block_windows(b) for b in blocks]  # read once, shared by every fold
    # the reference each block's job started from: the derived start (emulated), else the constant
    defaults = {block_job(b): block_default(b) or SCHEDULER_DEFAULT for b in blocks}
    all_windows = [
        w
        for b, windows in zip(blocks, per_block)
        if bool(b.get("emulated")) == emulated
        for w in windows
    ]
    results["regime_blocks"] = len({w.job for w in all_windows})
    results["noise_floor"] = noise_floor(all_windows)
    results["unchanged"] = score(unchanged, all_windows, defaults)
    # Blocks recorded with longer windows are less noisy: their floor and errors apart as well
    steps_of = {
        block_job(b): int(b["steps"]) for b in blocks if bool(b.get("emulated")) == emulated
    }
    lengths = sorted(set(steps_of.values()))
    if len(lengths) == 1:
        lengths = []  # one length: the pooled rows say it all
    if lengths:
        results["noise_floor_by_steps"] = {
            str(n): noise_floor([w for w in all_windows if steps_of[w.job] == n]) for n in lengths
        }
    for kind, name, held_out in folds(blocks, emulated):
        started = time.perf_counter()
        exclude = simulator_exclusion(kind, name, emulated)
        if exclude not in simulated:
            simulated[exclude] = train_prior.generate_windows(seed, exclude=exclude)
            before_priors[exclude] = train_prior.train(
                seed, exclude=exclude, real=[], simulated=simulated[exclude]
            )
        test, train = split(blocks, per_block, held_out)
        fold = {
            "kind": kind,
            "left_out": name,
            "test_windows": len(test),
            "train_windows": len(train),
            "before": evaluate(before_priors[exclude], test, defaults),
            "after": {},
        }
        for share in shares:
            # the share varied is the evaluated regime's; the other keeps the shipped prior's
            shares_of = (
                {"real_share": train_prior.REAL_SHARE, "emulated_share": share}
                if emulated
                else {"real_share": share}
            )
            after = train_prior.train(
                seed, exclude=exclude, real=train, simulated=simulated[exclude], **shares_of
            )
            fold["after"][str(share)] = evaluate(after, test, defaults)
            if share == shares[0]:
                fold["by_steps"] = {}
                for n in lengths:
                    subset = [w for w in test if steps_of[w.job] == n]
                    if subset:
                        fold["by_steps"][str(n)] = {
                            "before": evaluate(before_priors[exclude], subset, defaults),
                            "after": evaluate(after, subset, defaults),
                        }
        fold["seconds"] = round(time.perf_counter() - started, 1)
        results["folds"].append(fold)
        print(
            f"  fold {kind}={name}: {len(test)} windows left out, {fold['seconds']} s",
            file=sys.stderr,
            flush=True,
        )
    for kind in KINDS:
        mine = [f for f in results["folds"] if f["kind"] == kind]
        if mine:
            results[f"pooled_{kind}"] = {
                "before": pooled([f["before"] for f in mine]),
                "after": {str(s): pooled([f["after"][str(s)] for f in mine]) for s in shares},
            }
            by_steps = {}
            for n in lengths:
                parts = [f["by_steps"][str(n)] for f in mine if str(n) in f["by_steps"]]
                if parts:
                    by_steps[str(n)] = {
                        "before": pooled([p["before"] for p in parts]),
                        "after": pooled([p["after"] for p in parts]),
                    }
            if by_steps:
                results[f"pooled_{kind}_by_steps"] = by_steps
    return results


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _row(label: str, result: dict[str, Any]) -> str:
    d, a = result["from_default"], result["from_any"]
    tau = "-" if result["tau_median"] is None else f"{result['tau_median']:.2f}"
    return (
        f"| {label} | {_pct(d['median'])} | {_pct(d['p90'])} | {_pct(a['median'])} | {_pct(a['p90'])} | "
        f"{tau} | {d['n']} / {a['n']} |"
    )


def format_results(results: dict[str, Any]) -> str:
    lines = [
        "| left out | prior | median (from default) | p90 | median (from any) | p90 | tau (median) | pairs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fold in results["folds"]:
        name = f"{fold['kind']} {fold['left_out']}"
        lines.append(_row(f"{name} | before (simulator only)", fold["before"]))
        for share, value in fold["after"].items():
            lines.append(_row(f"{name} | after (real {float(share):.0%})", value))
    for kind in KINDS:
        item = results.get(f"pooled_{kind}")
        if item:
            lines.append(_row(f"**every {kind}, pooled** | before", item["before"]))
            for share, value in item["after"].items():
                lines.append(
                    _row(f"**every {kind}, pooled** | after (real {float(share):.0%})", value)
                )
    lines.append(_row("noise floor (round vs round) | -", results["noise_floor"]))
    lines.append(
        _row(
            "predict no change (the baseline: every configuration as fast as the reference) | -",
            results["unchanged"],
        )
    )
    share = f"{float(results['shares'][0]):.0%}"
    for kind in KINDS:
        for n, item in results.get(f"pooled_{kind}_by_steps", {}).items():
            lines.append(_row(f"every {kind}, pooled, {n}-step windows | before", item["before"]))
            lines.append(
                _row(
                    f"every {kind}, pooled, {n}-step windows | after (real {share})", item["after"]
                )
            )
    for n, item in results.get("noise_floor_by_steps", {}).items():
        lines.append(_row(f"noise floor, {n}-step windows | -", item))
    lines += [
        "",
        "From the default, each block's rounds averaged (geometric means of predicted and measured):",
        "| left out | prior | median | p90 | tau (median) |",
        "|---|---|---|---|---|",
    ]
    averaged = [(f"{f['kind']} {f['left_out']}", f["before"], f["after"]) for f in results["folds"]]
    averaged += [
        (
            f"**every {kind}, pooled**",
            results[f"pooled_{kind}"]["before"],
            results[f"pooled_{kind}"]["after"],
        )
        for kind in KINDS
        if results.get(f"pooled_{kind}")
    ]
    for name, before, after in averaged:
        lines.append(_averaged_row(f"{name} | before", before))
        for share, value in after.items():
            lines.append(_averaged_row(f"{name} | after (real {float(share):.0%})", value))
    lines.append(_averaged_row("predict no change | -", results["unchanged"]))
    floor = results["noise_floor"]
    lines.append(
        f"| a perfect predictor (noise floor / sqrt 2) | - | {_pct(_scaled(floor['from_default']['median']))} | "
        f"{_pct(_scaled(floor['from_default']['p90']))} | - |"
    )
    return "\n".join(lines)


def _scaled(value: float | None) -> float | None:
    return None if value is None else value / math.sqrt(2.0)


def _averaged_row(label: str, result: dict[str, Any]) -> str:
    item = result.get("rounds_averaged")
    if not item:
        return f"| {label} | - | - | - |"
    tau = "-" if item["tau_median"] is None else f"{item['tau_median']:.2f}"
    return f"| {label} | {_pct(item['median'])} | {_pct(item['p90'])} | {tau} |"


def _strip_raw(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_raw(v) for k, v in value.items() if k != "_raw"}
    if isinstance(value, list):
        return [_strip_raw(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    from simulator.real_windows import DATASET_PATH
    from simulator.train_prior import EMULATED_SHARE, REAL_SHARE, SEED

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.predictor_error", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--dataset", default=str(DATASET_PATH))
    parser.add_argument(
        "--real-share",
        type=float,
        nargs="+",
        default=None,
        help="the evaluated regime's share of the training weight (default: the shipped "
        "prior's, REAL_SHARE or with --emulated EMULATED_SHARE)",
    )
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--seed",
        type=int,
        default=SEED,
        help="the priors' seed (simulated contexts and ensembles; the shipped prior's by default)",
    )
    parser.add_argument(
        "--emulated",
        action="store_true",
        help="fold over the emulated-accelerator blocks (model, rank count, rate), not the CPU's",
    )
    args = parser.parse_args(argv)
    if args.real_share is None:
        args.real_share = [EMULATED_SHARE if args.emulated else REAL_SHARE]
    for share in args.real_share:
        if not 0.0 < share < 1.0:
            parser.error(f"--real-share {share}: must be between 0 and 1 (exclusive)")
    path = pathlib.Path(args.dataset)
    if not path.exists():
        parser.error(
            f"--dataset {path}: no such file (record one with python -m benchmarks.record_windows)"
        )
    results = run(path, args.real_share, args.seed, args.emulated)
    print(format_results(results))
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_strip_raw(results), indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
