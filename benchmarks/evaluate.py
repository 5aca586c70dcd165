"""Evaluate policies on scenarios, side by side: simulator by default, namespace testbed with --testbed.

    python -m benchmarks.evaluate benchmarks/scenarios/*.toml --policy ddp grid-best bo-once oracle \
        --out results/

Writes a table to stdout, results.csv and results.json to --out, and one PNG per scenario
(throughput over time per policy, the bandwidth trace underneath). For every policy: throughput,
ratio to the per-phase oracle, ratio to the best static configuration (grid-best) and ratio to the
lower bound (perfect overlap of compute and communication). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import math
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.policies import (
    Policy,
    PolicyContext,
    RunSummary,
    default_grid,
    make_policy,
)
from benchmarks.scenario import GBIT, Scenario, load_scenario
from benchmarks.sim.engine import RunConfig, Simulator, StepRecord, lower_bound_step_s

logger = logging.getLogger(__name__)

REFERENCE_POLICIES = ("oracle", "grid-best")


@dataclasses.dataclass
class PolicyRun:
    policy: str
    steps: int
    elapsed_s: float
    end_times_s: list[float]
    chose: str
    mode: str = "sim"

    @property
    def throughput_steps_per_s(self) -> float:
        return self.steps / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _run_until_done(scenario: Scenario, sim: Simulator, policy: Policy) -> list[StepRecord]:
    sim.reset()
    config: RunConfig = policy.initial_config()
    records: list[StepRecord] = []
    step_limit = scenario.duration_steps
    time_limit = scenario.duration_s
    while True:
        if step_limit is not None and len(records) >= step_limit:
            break
        if time_limit is not None and sim.now_s >= time_limit:
            break
        record = sim.step(config)
        records.append(record)
        change = policy.observe(record)
        if change is not None:
            config = change
    return records


def simulate_static(scenario: Scenario, sim: Simulator, config: RunConfig) -> RunSummary:
    sim.reset()
    if scenario.duration_steps is not None:
        sim.run(config, steps=scenario.duration_steps)
    else:
        while sim.now_s < scenario.duration_s:
            sim.step(config)
    return RunSummary(sim.step_index, sim.now_s)


def policy_context(scenario: Scenario, sim: Simulator, horizon_s: float) -> PolicyContext:
    return PolicyContext(
        candidates=default_grid(), seed=scenario.seed,
        phases=tuple(scenario.phases(horizon_s)),
        evaluate_static=lambda config: simulate_static(scenario, sim, config),
        steady_step_s=lambda config, bw, factor: sim.steady_step_s(config, bw, factor))


def lower_bound_run(scenario: Scenario, sim: Simulator) -> RunSummary:
    """Steps and time if every step took max(compute, communication) at the bandwidth of its start."""
    t, steps = 0.0, 0
    cache: dict[tuple[float, float], float] = {}
    while True:
        if scenario.duration_steps is not None and steps >= scenario.duration_steps:
            break
        if scenario.duration_s is not None and t >= scenario.duration_s:
            break
        key = (scenario.bandwidth.at(t), scenario.compute.at(t))
        step_s = cache.get(key)
        if step_s is None:
            step_s = cache[key] = sim.lower_bound_step_s(t)
        t += step_s
        steps += 1
    return RunSummary(steps, t)


def simulate_scenario(scenario: Scenario, policy_names: Sequence[str]) -> dict[str, Any]:
    sim = scenario.make_simulator()
    lower = lower_bound_run(scenario, sim)
    horizon = scenario.duration_s if scenario.duration_s is not None else lower.elapsed_s * 4
    context = policy_context(scenario, sim, horizon)
    runs: dict[str, PolicyRun] = {}
    for name in dict.fromkeys([*policy_names, *REFERENCE_POLICIES]):
        policy = make_policy(name)
        policy.prepare(context)
        records = _run_until_done(scenario, sim, policy)
        elapsed = records[-1].end_s if records else 0.0
        runs[name] = PolicyRun(name, len(records), elapsed, [r.end_s for r in records],
                               policy.describe())
    return _summarise(scenario, policy_names, runs, lower, "sim")


def _summarise(scenario: Scenario, policy_names: Sequence[str], runs: dict[str, PolicyRun],
               lower: RunSummary, mode: str) -> dict[str, Any]:
    def ratio(a: float, b: float | None) -> float | None:
        return a / b if b else None

    oracle = runs.get("oracle")
    grid = runs.get("grid-best")
    oracle_tp = oracle.throughput_steps_per_s if oracle else None
    grid_tp = grid.throughput_steps_per_s if grid else None
    rows = []
    for name in policy_names:
        run = runs[name]
        tp = run.throughput_steps_per_s
        rows.append({
            "scenario": scenario.name, "mode": mode, "policy": name, "steps": run.steps,
            "elapsed_s": run.elapsed_s, "throughput_steps_per_s": tp,
            "samples_per_s": tp * scenario.profile.batch_size * scenario.workers,
            "ratio_to_oracle": ratio(tp, oracle_tp), "ratio_to_grid_best": ratio(tp, grid_tp),
            "ratio_to_lower_bound": ratio(tp, lower.throughput_steps_per_s), "chose": run.chose,
        })
    return {
        "scenario": scenario.name, "path": scenario.path, "mode": mode,
        "model": scenario.model, "workers": scenario.workers,
        "compute_s": scenario.profile.compute_s, "gradient_bytes": scenario.profile.total_param_bytes,
        "lower_bound_steps_per_s": lower.throughput_steps_per_s,
        "headroom_oracle_over_grid_best": ratio(oracle_tp or 0.0, grid_tp),
        "rows": rows, "_runs": runs,
    }


# ---- testbed ---------------------------------------------------------------------------------------

# Policies the testbed half can run today: fixed configurations (with the rate trace applied while
# the ranks train). bo-once and oracle need configuration changes decided while the ranks run, which
# the harness's worker does not accept yet (it takes a fixed --schedule); see README.
TESTBED_POLICIES = ("ddp", "static:", "grid-best")


def _testbed_label(config: RunConfig) -> str:
    from benchmarks.sim.engine import DDPConfig
    if isinstance(config, DDPConfig):
        return "ddp"
    from autobyte.types import format_bytes
    return f"sched:{format_bytes(config.partition_bytes, 'none')},{format_bytes(config.credit_bytes, 'none')}"


def testbed_scenario(scenario: Scenario, policy_names: Sequence[str]) -> dict[str, Any]:
    """Run fixed-configuration policies on the namespace testbed under the scenario's trace.

    The scenario's [testbed] table says which harness model to train (model, model_args, batch_size),
    how many steps (steps, default 200) and, for grid-best, which configurations to try (grid, a
    list of "sched:P,C" labels; default: a 6-point grid). Rates come from the bandwidth trace.
    """
    from benchmarks import testbed as harness

    options = scenario.testbed
    steps = int(options.get("steps", 200))
    workers = min(scenario.workers, int(options.get("max_workers", 2)))
    pairs = [(start, f"{bandwidth / GBIT * 1000:.0f}mbit")
             for start, _end, bandwidth, _factor in scenario.phases(
                 scenario.duration_s or math.inf)]
    trace = harness.Trace.from_times(pairs)
    grid_labels = list(options.get("grid", ["sched:none,none", "sched:1MiB,4MiB", "sched:4MiB,8MiB",
                                            "sched:4MiB,16MiB", "sched:16MiB,32MiB",
                                            "sched:16MiB,none"]))
    labels: dict[str, list[str]] = {}
    for name in dict.fromkeys([*policy_names, "grid-best"]):
        if name == "ddp":
            labels[name] = ["ddp"]
        elif name.startswith("static:"):
            labels[name] = [_testbed_label(make_policy(name).initial_config())]
        elif name == "grid-best":
            labels[name] = grid_labels
        else:
            raise NotImplementedError(
                f"policy {name!r} cannot run on the testbed yet: it changes configuration while "
                "the ranks train, and benchmarks/train_worker.py only takes a fixed --schedule; "
                "it needs an online control input (e.g. the autobyte daemon's control stream)")
    runs: dict[str, PolicyRun] = {}
    measured: dict[str, tuple[int, float, list[float]]] = {}
    initial_rate = pairs[0][1]
    for label in dict.fromkeys(label for group in labels.values() for label in group):
        with harness.Testbed(world_size=workers, rate=initial_rate) as bed:
            command = [sys.executable, "-m", "benchmarks.train_worker",
                       "--model", str(options.get("model", "mlp")),
                       "--model-args", json.dumps(options.get("model_args", {})),
                       "--batch-size", str(int(options.get("batch_size", 0))),
                       "--configs", label, "--steps", str(steps), "--warmup", "0",
                       "--rounds", "1", "--steps-events"]
            result = bed.run(command, trace=trace, timeout_s=float(options.get("timeout_s", 900)),
                             cwd=str(pathlib.Path(__file__).resolve().parent.parent))
        events = [e for e in result.ranks[0].events if e.get("event") == "step"]
        step_times = [float(e["step_time_s"]) for e in events]
        ends, total = [], 0.0
        for value in step_times:
            total += value
            ends.append(total)
        measured[label] = (len(step_times), total, ends)
    for name, group in labels.items():
        best = max(group, key=lambda lab: measured[lab][0] / measured[lab][1] if measured[lab][1] else 0)
        count, total, ends = measured[best]
        runs[name] = PolicyRun(name, count, total, ends, best, "testbed")
    # The lower bound on the testbed needs the measured compute time; use the simulator's.
    sim = scenario.make_simulator()
    lower = lower_bound_run(dataclasses.replace(scenario, duration_steps=steps, duration_s=None), sim)
    return _summarise(scenario, [p for p in policy_names], runs, lower, "testbed")


# ---- reports ---------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(results: Sequence[dict[str, Any]]) -> str:
    header = (f"{'scenario':<28} {'policy':<20} {'steps/s':>9} {'vs oracle':>9} {'vs grid':>8} "
              f"{'vs bound':>8}  chose")
    lines = [header, "-" * len(header)]
    for result in results:
        for row in result["rows"]:
            lines.append(f"{row['scenario']:<28} {row['policy']:<20} "
                         f"{_fmt(row['throughput_steps_per_s'], 3):>9} "
                         f"{_fmt(row['ratio_to_oracle']):>9} {_fmt(row['ratio_to_grid_best']):>8} "
                         f"{_fmt(row['ratio_to_lower_bound']):>8}  {row['chose']}")
        lines.append(f"{'':<28} {'(headroom oracle/grid-best)':<29}"
                     f"{_fmt(result['headroom_oracle_over_grid_best']):>9}    "
                     f"lower bound {_fmt(result['lower_bound_steps_per_s'])} steps/s")
    return "\n".join(lines)


def plot_scenario(result: dict[str, Any], scenario: Scenario, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs: dict[str, PolicyRun] = result["_runs"]
    end = max((run.elapsed_s for run in runs.values()), default=1.0) or 1.0
    bins = np.linspace(0.0, end, 61)
    width = bins[1] - bins[0]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6),
                                      gridspec_kw={"height_ratios": [3, 1]})
    for name in [row["policy"] for row in result["rows"]]:
        ends = np.asarray(runs[name].end_times_s)
        counts, _ = np.histogram(ends, bins=bins)
        top.step(bins[:-1], counts / width, where="post", label=name)
    times = np.linspace(0.0, end, 600)
    bound = [1.0 / lower_bound_step_s(scenario.profile, scenario.workers, scenario.bandwidth.at(t),
                                      scenario.compute.at(t)) for t in times]
    top.plot(times, bound, color="grey", linestyle=":", drawstyle="steps-post", label="lower bound")
    top.set_ylabel("throughput (steps/s)")
    top.set_title(f"{scenario.name}: {scenario.model}, {scenario.workers} workers ({result['mode']})")
    top.legend(fontsize=8, loc="best")
    bottom.plot(times, [scenario.bandwidth.at(t) / GBIT for t in times], color="black",
                drawstyle="steps-post")
    bottom.set_ylabel("bandwidth (Gbit/s)")
    bottom.set_xlabel("time (s)")
    if not scenario.compute.is_constant:
        twin = bottom.twinx()
        twin.plot(times, [scenario.compute.at(t) for t in times], color="tab:red",
                  drawstyle="steps-post")
        twin.set_ylabel("compute slowdown", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_outputs(results: Sequence[dict[str, Any]], scenarios: Sequence[Scenario],
                  out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [row for result in results for row in result["rows"]]
    with open(out / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    public = [{k: v for k, v in result.items() if not k.startswith("_")} for result in results]
    (out / "results.json").write_text(json.dumps({"scenarios": public}, indent=1) + "\n")
    for result, scenario in zip(results, scenarios):
        plot_scenario(result, scenario, out / f"{scenario.name}.png")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.evaluate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("scenarios", nargs="+", help="scenario TOML files")
    parser.add_argument("--policy", nargs="+", default=["ddp", "grid-best", "bo-once", "oracle"],
                        help="ddp, static:P,C (e.g. static:4MiB,16MiB), grid-best, bo-once, oracle")
    parser.add_argument("--testbed", action="store_true",
                        help="run on the namespace testbed (root) instead of the simulator")
    parser.add_argument("--out", default="results", help="directory for csv, json and png")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        for name in args.policy:
            make_policy(name)
        scenarios = [load_scenario(path) for path in args.scenarios]
    except ValueError as exc:
        parser.error(str(exc))
    results = []
    for scenario in scenarios:
        started = time.perf_counter()
        if args.testbed:
            result = testbed_scenario(scenario, args.policy)
        else:
            result = simulate_scenario(scenario, args.policy)
        logger.info("%s done in %.1f s", scenario.name, time.perf_counter() - started)
        results.append(result)
    print(format_table(results))
    write_outputs(results, scenarios, pathlib.Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
