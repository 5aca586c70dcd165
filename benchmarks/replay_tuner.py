"""The daemon's own tuner (JobTuner) replayed on real windows: what it tries and where it ends on
every block of the real dataset, with a prior that never saw the block's model.

Every block of `simulator/real-windows.json` is one condition held still (a model, a
rate, competing flows or a CPU quota on the 2-rank testbed) in which every candidate configuration
was measured (rank 0's own StepMetrics, 10-20 steps each). A replay job starts in the scheduler's
default configuration and runs `--steps` steps; each step is a recorded step of the configuration
in effect, drawn at random from that configuration's recorded steps (a stationary condition with the
testbed's real step-to-step noise and context signals); the tuner sees them in batches of 10, as
from a real rank, and its decisions apply at their step, as rank 0 applies them. The prior is
trained, per model, on the simulator plus the real windows of the *other* models
(`simulator.train_prior`, REAL_SHARE): the tuner meets each model as a new one.

Per block it reports what the issue asks of trials (how many, how many measured a gain, steps in
trials that lost) and what the search earned: the replay's total time against holding the default
and against holding the block's best configuration (the oracle of a still condition) for the same
steps, both from the recorded medians. `--seeds` repeats every block with other draws.

    python -m benchmarks.replay_tuner --out results/replay.json [--seeds 3] [--steps 400]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from autobyte.types import Config, StepMetrics

BATCH = 10


@dataclasses.dataclass
class Replay:
    """One block replayed: the decisions and what every step cost."""

    block: str
    seed: int
    steps_s: list[float]
    configs: list[Config]
    decision_ids: list[int]
    decisions: list[Any]
    detail: str
    median_s: dict[Config, float]
    mean_s: dict[Config, float]
    default: Config

    def summary(self) -> dict[str, Any]:
        # Holding a configuration costs its mean step (the replay draws steps from its recorded ones):
        # the replay's time against the default's and the best configuration's expected time.
        best = min(self.mean_s.values())
        default = self.mean_s[self.default]
        total = sum(self.steps_s)
        trials = [d for d in self.decisions if d.kind == "trial"]
        # A trial measured a gain when its configuration's recorded median beats the search's
        # incumbent (the configuration held before the trials, as trial_report counts on the
        # testbed); the steps of a losing trial are those run under its decision.
        gains, lost_steps = 0, 0
        incumbent = self.default
        for d in self.decisions:
            if d.kind != "trial":
                incumbent = (
                    d.config if d.kind in ("switch", "return", "rollback", "check") else incumbent
                )
                continue
            if self.median_s.get(d.config, math.inf) < self.median_s[incumbent]:
                gains += 1
            else:
                lost_steps += sum(1 for i in self.decision_ids if i == d.decision_id)
        final = self.configs[-1]
        return {
            "block": self.block,
            "seed": self.seed,
            "trials": len(trials),
            "gains": gains,
            "steps_in_lost_trials": lost_steps,
            "steps": len(self.steps_s),
            "vs_default": len(self.steps_s) * default / total,
            "vs_oracle": len(self.steps_s) * best / total,
            "final": final.short(),
            "final_vs_best": best / self.mean_s.get(final, math.inf),
            "default_vs_best": best / default,
            "detail": self.detail,
        }


def recorded_steps(block: dict[str, Any]) -> tuple[dict[Config, list[StepMetrics]], Config]:
    """Every configuration's recorded steps in a block (all rounds), and the scheduler's default
    configuration, which every block must have."""
    from simulator.adapter import SCHEDULER_DEFAULT
    from simulator.real_windows import block_job, metrics_from_dict

    recorded: dict[Config, list[StepMetrics]] = {}
    for item in block["windows"]:
        if item["metrics"]:
            recorded.setdefault(Config(*item["config"]), []).extend(
                metrics_from_dict(m) for m in item["metrics"]
            )
    default = Config(SCHEDULER_DEFAULT.partition_bytes, SCHEDULER_DEFAULT.credit_bytes)
    if default not in recorded:
        raise ValueError(
            f"block {block_job(block)} has no recorded steps of the default {default.short()}"
        )
    return recorded, default


def _medians(recorded: dict[Config, list[StepMetrics]]) -> dict[Config, float]:
    return {c: statistics.median(m.step_time_s for m in ms) for c, ms in recorded.items()}


def replay_block(
    block: dict[str, Any], predictor: Any, steps: int, seed: int, params: Any = None
) -> Replay:
    """Run a JobTuner against one block's recorded steps (module docstring)."""
    from autobyted.tuner.memory_sink import MemorySink
    from autobyted.tuner.params import TunerParams
    from autobyted.tuner.search import JobTuner
    from simulator.real_windows import block_job, block_shape

    recorded, default = recorded_steps(block)
    median_s = _medians(recorded)
    mean_s = {c: statistics.mean(m.step_time_s for m in ms) for c, ms in recorded.items()}
    shape = block_shape(block)
    sink = MemorySink("replay")
    tuner = JobTuner("replay", shape, predictor, sink, "auto", params or TunerParams())
    rng = random.Random(seed)
    config, decision_id, handled, wall = default, 0, 0, 1.8e9
    steps_s, configs, ids, buffer = [], [], [], []
    for step in range(steps):
        pending = [d for d in sink.decisions if d.decision_id > handled and d.kind != "recommend"]
        if pending and step >= pending[-1].apply_at_step:
            handled = pending[-1].decision_id
            if pending[-1].config in recorded:
                config, decision_id = pending[-1].config, pending[-1].decision_id
            else:  # outside the recorded grid (cannot happen with the tuner's own grid): refuse it
                sink.close_decision(handled, None, "refused")
        drawn = rng.choice(recorded[config])
        wall += drawn.step_time_s
        metrics = dataclasses.replace(
            drawn, step=step, wall_time_s=wall, decision_id=decision_id, config=config
        )
        steps_s.append(drawn.step_time_s)
        configs.append(config)
        ids.append(decision_id)
        buffer.append(metrics)
        if len(buffer) >= BATCH:
            tuner.observe(buffer)
            buffer = []
    return Replay(
        block_job(block),
        seed,
        steps_s,
        configs,
        ids,
        list(sink.decisions),
        tuner.detail,
        median_s,
        mean_s,
        default,
    )


def calibration_pairs(
    block: dict[str, Any], predictor: Any, top: int = 4
) -> list[tuple[float, float]]:
    """(predicted, measured) log ratio against the default of the `top` candidates the predictor
    ranks fastest in this block, seen from the default's recorded steps: the candidates a first
    search tries, and what they measured (medians of every recorded step)."""
    from autobyted.tuner.features import summarize
    from simulator.real_windows import block_shape

    recorded, default = recorded_steps(block)
    median = _medians(recorded)
    others = [c for c in median if c != default]
    prediction = predictor.predict(
        summarize(recorded[default], block_shape(block)), default, others
    )
    ranked = sorted(zip(others, (float(mu) for mu in prediction.mean)), key=lambda t: t[1])[:top]
    return [(mu, math.log(median[c] / median[default])) for c, mu in ranked]


def slope_through_origin(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope of measured on predicted through the origin, and the residual RMS."""
    sxx = sum(x * x for x, _ in pairs)
    slope = sum(x * y for x, y in pairs) / sxx if sxx > 0 else 1.0
    rms = math.sqrt(sum((y - slope * x) ** 2 for x, y in pairs) / len(pairs)) if pairs else 0.0
    return slope, rms


def run(
    dataset: pathlib.Path, steps: int, seeds: int, real_share: float, params: Any = None
) -> dict[str, Any]:
    from autobyted.tuner.predictor import Predictor
    from simulator import train_prior
    from simulator.real_windows import block_windows, load_dataset

    blocks = load_dataset(dataset)["blocks"]
    simulated = train_prior.generate_windows(train_prior.SEED)
    rows, calibration = [], []
    for model in sorted({b["model"] for b in blocks}):
        started = time.perf_counter()
        train = [w for b in blocks if b["model"] != model for w in block_windows(b)]
        predictor = Predictor(
            train_prior.train(real=train, real_share=real_share, simulated=simulated)
        )
        for block in (b for b in blocks if b["model"] == model):
            pairs = calibration_pairs(block, predictor)
            slope, rms = slope_through_origin(pairs)
            calibration.append(
                {
                    "block": f"{block['model']} {block['condition']}",
                    "pairs": pairs,
                    "slope": slope,
                    "rms": rms,
                }
            )
            for seed in range(seeds):
                rows.append(replay_block(block, predictor, steps, seed, params).summary())
        print(
            f"  model {model} left out: {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    slopes = [c["slope"] for c in calibration]
    everything = [pair for c in calibration for pair in c["pairs"]]
    return {
        "dataset": str(dataset),
        "steps": steps,
        "seeds": seeds,
        "real_share": real_share,
        "rows": rows,
        "pooled": pooled(rows),
        "calibration": {
            "blocks": calibration,
            "slope_mean": statistics.mean(slopes),
            "slope_sd": statistics.stdev(slopes) if len(slopes) > 1 else None,
            "pooled": slope_through_origin(everything),
            "within_rms": math.sqrt(statistics.mean(c["rms"] ** 2 for c in calibration)),
        },
    }


def pooled(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    trials = sum(r["trials"] for r in rows)
    gains = sum(r["gains"] for r in rows)
    return {
        "replays": len(rows),
        "trials": trials,
        "gains": gains,
        "gain_share": gains / trials if trials else None,
        "steps_in_lost_trials": sum(r["steps_in_lost_trials"] for r in rows),
        "steps": sum(r["steps"] for r in rows),
        "vs_default_median": statistics.median(r["vs_default"] for r in rows),
        "vs_default_min": min(r["vs_default"] for r in rows),
        "vs_oracle_median": statistics.median(r["vs_oracle"] for r in rows),
        "vs_oracle_min": min(r["vs_oracle"] for r in rows),
        "default_vs_best_median": statistics.median(r["default_vs_best"] for r in rows),
    }


def format_results(results: dict[str, Any]) -> str:
    header = (
        f"{'block':<44} {'seed':>4} {'trials':>6} {'gains':>5} {'lost st':>7} {'vs default':>10} "
        f"{'vs oracle':>9} {'default/best':>12}  final: detail"
    )
    lines = [header]
    for r in results["rows"]:
        block = r["block"].removeprefix("real:").rsplit(":", 1)[0]
        lines.append(
            f"{block:<44} {r['seed']:>4} {r['trials']:>6} {r['gains']:>5} {r['steps_in_lost_trials']:>7} "
            f"{r['vs_default']:>10.3f} {r['vs_oracle']:>9.3f} {r['default_vs_best']:>12.3f}  "
            f"{r['final']}: {r['detail'][:90]}"
        )
    c = results["calibration"]
    lines.append(
        "the first search's four candidates, measured against predicted log ratio (slope through 0, "
        "residual RMS) per block:"
    )
    for b in c["blocks"]:
        lines.append(
            f"  {b['block']:<28} slope {b['slope']:6.2f}  rms {b['rms']:.3f}  "
            + " ".join(f"{x:+.3f}->{y:+.3f}" for x, y in b["pairs"])
        )
    lines.append(
        f"slope over blocks: mean {c['slope_mean']:.2f} sd {c['slope_sd'] or 0:.2f}; pooled slope "
        f"{c['pooled'][0]:.2f} (rms {c['pooled'][1]:.3f}); within-block rms {c['within_rms']:.3f}"
    )
    p = results["pooled"]
    share = "-" if p["gain_share"] is None else f"{100 * p['gain_share']:.0f}%"
    lines.append(
        f"{p['replays']} replays of {results['steps']} steps: {p['trials']} trials, {p['gains']} measured a "
        f"gain ({share}); {p['steps_in_lost_trials']} of {p['steps']} steps in trials that lost"
    )
    lines.append(
        f"vs holding the default: median {p['vs_default_median']:.3f}, min {p['vs_default_min']:.3f}; "
        f"vs the block's best held: median {p['vs_oracle_median']:.3f}, min {p['vs_oracle_min']:.3f} "
        f"(the default held: median {p['default_vs_best_median']:.3f} of the best)"
    )
    return "\n".join(lines)


def tuner_params(assignments: Sequence[str]) -> Any:
    """TunerParams with NAME=VALUE overrides (the field's own type)."""
    from autobyted.tuner.params import TunerParams

    fields = {f.name: f for f in dataclasses.fields(TunerParams)}
    values: dict[str, Any] = {}
    for text in assignments:
        name, _, value = text.partition("=")
        if name not in fields or not value:
            raise ValueError(
                f"--param {text!r}: expected NAME=VALUE with NAME one of {', '.join(fields)}"
            )
        kind = type(getattr(TunerParams(), name))
        try:
            values[name] = kind(value)
        except ValueError:
            raise ValueError(f"--param {text!r}: {value!r} is not a {kind.__name__}") from None
    return TunerParams(**values)


def main(argv: Sequence[str] | None = None) -> int:
    from simulator import train_prior
    from simulator.real_windows import DATASET_PATH

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.replay_tuner", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--dataset", type=pathlib.Path, default=DATASET_PATH)
    parser.add_argument("--steps", type=int, default=400, help="steps per replay [400]")
    parser.add_argument("--seeds", type=int, default=1, help="replays per block, other draws [1]")
    parser.add_argument("--real-share", type=float, default=train_prior.REAL_SHARE)
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a TunerParams field set for the replay (e.g. gain_slope_prior_sd=1e-6: the "
        "model's gains taken as predicted); repeatable",
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=None, help="write the results as JSON here"
    )
    args = parser.parse_args(argv)
    if args.steps < BATCH or args.seeds < 1:
        parser.error(f"--steps must be at least {BATCH} and --seeds at least 1")
    try:
        params = tuner_params(args.param)
    except ValueError as exc:
        parser.error(str(exc))
    results = run(args.dataset, args.steps, args.seeds, args.real_share, params)
    results["params"] = dataclasses.asdict(params)
    text = format_results(results)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
