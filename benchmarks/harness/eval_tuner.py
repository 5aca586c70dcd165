"""The tuner's evaluation in the simulator: the issue's numbers per scenario and over all of them.

    python -m benchmarks.harness.eval_tuner benchmarks/scenarios/*.toml results/scenarios-gen/*.toml \
        --out results/eval-tuner [--jobs 2]

Per scenario it runs ddp, grid-best, bo-once, oracle and autobyte (benchmarks/harness/autobyte_policy.py:
the daemon's tuner, starting from the shipped prior, retraining online on its own windows) and
reports, from the simulator's true step times:
- autobyte / oracle, / bo-once, / ddp, / grid-best throughput;
- steps from each change of the scenario's conditions (and from the start) until a step is within
  5% of the oracle's settled step time for those conditions ("censored" if it never is before the
  next change);
- the share of steps run under a trial configuration more than 10% slower than the incumbent (the
  configuration held before the trial) would have been at that moment;
- trials, cut trials, re-tunes, rollbacks;
- trials that paid: a trial *measured a gain* when the median true step time of its
  steps after the transition (`TunerParams.transition_steps`) is below the median of what the
  incumbent (the configuration held before it) would have taken at those moments; the share of
  trials that did, and the steps spent in trials that did not (every step of such a trial).
Scenarios whose conditions never change (`--stationary`-generated) also give re-tunes per simulated
hour: every re-tune there is a false one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import pathlib
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.harness.evaluate import simulate_scenario
from benchmarks.harness.scenario import load_scenario

POLICIES = ("ddp", "grid-best", "bo-once", "oracle", "autobyte")


def _steady(sim, cache: dict, config, *conditions: float) -> float:
    """The simulator's steady step time of `config` under `conditions` (bandwidth, compute factor
    and, for scenarios with condition keys, competing flows and CPU share: Scenario.phases)."""
    key = (config, *conditions)
    if key not in cache:
        cache[key] = sim.steady_step_s(config, *conditions)
    return cache[key]


def _held_conditions(record, phases) -> tuple[float, ...]:
    """A step's conditions as the simulator takes them: the step's own bandwidth and compute
    factor, and the competing flows and CPU share of its phase where the scenario sets them."""
    extra = next((tuple(p[4:]) for p in phases if p[0] <= record.start_s < p[1]), ())
    return (record.bandwidth_bytes_per_s, record.compute_factor, *extra)


def _trial_payoff(policy, records, sim, cache, phases) -> tuple[int, int, int]:
    """(trials that measured a gain, trials that did not, steps spent in the latter), from the
    simulator's true step times: each trial's steps after its transition against the incumbent's
    steady step time under the same conditions, medians of both."""
    log = policy.config_log
    skip = policy.params.transition_steps
    by_step = {r.step: r for r in records}
    won = lost = lost_steps = 0
    held = policy.initial
    for index, (first, config, kind) in enumerate(log):
        last = records[-1].step + 1 if records else first
        end = log[index + 1][0] if index + 1 < len(log) else last
        if kind != "trial":
            held = config
            continue
        steps = [by_step[s] for s in range(first, end) if s in by_step]
        measured = steps[skip:] or steps
        if not measured:
            continue
        trial_s = statistics.median(r.step_time_s for r in measured)
        incumbent_s = statistics.median(
            _steady(sim, cache, held, *_held_conditions(r, phases)) for r in measured
        )
        if trial_s < incumbent_s:
            won += 1
        else:
            lost += 1
            lost_steps += len(steps)
    return won, lost, lost_steps


def evaluate_one(path: str) -> dict[str, Any]:
    from benchmarks.harness.policies import default_grid

    scenario = load_scenario(path)
    keep: dict[str, Any] = {}
    result = simulate_scenario(scenario, list(POLICIES), keep)
    rows = {row["policy"]: row for row in result["rows"]}
    policy, records = keep["autobyte"]
    sim = scenario.make_simulator()
    cache: dict = {}
    horizon = scenario.duration_s if scenario.duration_s is not None else records[-1].end_s
    phases = scenario.phases(horizon)
    grid = default_grid()
    oracle_step = {}
    for _start, _end, *conditions in phases:
        if tuple(conditions) not in oracle_step:
            oracle_step[tuple(conditions)] = min(_steady(sim, cache, c, *conditions) for c in grid)
    # steps from each change to within 5% of the oracle
    convergence = []
    index = 0
    for start, end, *conditions in phases:
        while index < len(records) and records[index].start_s < start:
            index += 1
        first = index
        target = 1.05 * oracle_step[tuple(conditions)]
        j = first
        while j < len(records) and records[j].start_s < end and records[j].step_time_s > target:
            j += 1
        censored = j >= len(records) or records[j].start_s >= end
        convergence.append({"at_s": start, "steps": j - first, "censored": censored})
    # trial steps > 10% slower than the incumbent would have been
    trial_steps = set(policy.trial_steps)
    log = policy.config_log
    slow = 0
    held = policy.initial
    k = 0
    for record in records:
        while k < len(log) and log[k][0] <= record.step:
            if log[k][2] != "trial":
                held = log[k][1]
            k += 1
        if record.step in trial_steps:
            incumbent = _steady(sim, cache, held, *_held_conditions(record, phases))
            if record.step_time_s > 1.10 * incumbent:
                slow += 1
    won, lost, lost_steps = _trial_payoff(policy, records, sim, cache, phases)
    stats = policy.tuner.stats if policy.tuner else {}
    elapsed_h = records[-1].end_s / 3600 if records else 0.0

    def ratio(other: str) -> float:
        return rows["autobyte"]["throughput_steps_per_s"] / rows[other]["throughput_steps_per_s"]

    return {
        "scenario": scenario.name,
        "steps": len(records),
        "changes": len(phases) - 1,
        "vs_oracle": ratio("oracle"),
        "vs_bo_once": ratio("bo-once"),
        "vs_ddp": ratio("ddp"),
        "vs_grid": ratio("grid-best"),
        "headroom": result["headroom_oracle_over_grid_best"],
        "convergence": convergence,
        "slow_trial_share": slow / max(1, len(records)),
        "trial_steps": len(trial_steps),
        "retunes_per_hour": stats.get("retunes", 0) / elapsed_h if elapsed_h else 0,
        "trials_won": won,
        "trials_lost": lost,
        "lost_trial_steps": lost_steps,
        "stats": stats,
        "retrains": policy.retrains,
        "chose": rows["autobyte"]["chose"],
        "decisions": [
            {
                "id": d.decision_id,
                "kind": d.kind,
                "at": d.apply_at_step,
                "reason": d.reason,
                "predicted_s": d.predicted_step_time_s,
                "measured_s": d.measured_step_time_s,
                "state": d.state,
            }
            for d in policy.sink.decisions
        ],
    }


def summarise(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        (
            f"{'scenario':<40} {'/oracle':>7} {'/bo-once':>8} {'/ddp':>6} {'/grid':>6} {'headroom':>8} "
            f"{'conv med':>8} {'slow%':>6} {'trials':>6} {'retunes':>7}"
        )
    ]
    conv_all, censored = [], 0
    for r in results:
        steps = [c["steps"] for c in r["convergence"][1:]] if len(r["convergence"]) > 1 else []
        conv_all += [c["steps"] for c in r["convergence"]]
        censored += sum(c["censored"] for c in r["convergence"])
        lines.append(
            f"{r['scenario'][:40]:<40} {r['vs_oracle']:7.3f} {r['vs_bo_once']:8.3f} {r['vs_ddp']:6.3f} "
            f"{r['vs_grid']:6.3f} {r['headroom']:8.3f} "
            f"{(statistics.median(steps) if steps else math.nan):8.0f} {100 * r['slow_trial_share']:6.2f} "
            f"{r['stats'].get('trials', 0):6d} {r['stats'].get('retunes', 0):7d}"
        )

    def col(key):
        return [r[key] for r in results]

    oracle, bo, ddp = col("vs_oracle"), col("vs_bo_once"), col("vs_ddp")
    lines += [
        "",
        f"scenarios {len(results)}",
        (
            f"autobyte/oracle   median {statistics.median(oracle):.3f}  worst {min(oracle):.3f}   "
            "(goal median >= 0.97, worst >= 0.93)"
        ),
        (
            f"autobyte/bo-once  median {statistics.median(bo):.3f}  max {max(bo):.3f}  min {min(bo):.3f}  "
            f"> 1.0 in {sum(v > 1.0 for v in bo)}/{len(bo)}   (goal > 1.0 everywhere)"
        ),
        (
            f"autobyte/ddp      median {statistics.median(ddp):.3f}  min {min(ddp):.3f}  "
            f">= 1.0 in {sum(v >= 1.0 for v in ddp)}/{len(ddp)}   (goal >= 1.0 everywhere)"
        ),
        (
            f"steps from a change (or the start) to within 5% of the oracle: median {statistics.median(conv_all):.0f}, "
            f"p90 {sorted(conv_all)[int(0.9 * (len(conv_all) - 1))]:.0f}, {censored}/{len(conv_all)} never within 5% "
            "before the next change (goal median <= 300)"
        ),
        (
            f"share of steps in trials > 10% slower than the incumbent: median "
            f"{100 * statistics.median(col('slow_trial_share')):.2f}%, max {100 * max(col('slow_trial_share')):.2f}% "
            "(goal <= 5%)"
        ),
    ]
    won, lost = sum(col("trials_won")), sum(col("trials_lost"))
    lines.append(
        f"trials that measured a gain: {won}/{won + lost} "
        f"({100 * won / max(1, won + lost):.0f}%, goal >= 50%); steps in trials that lost: "
        f"{sum(col('lost_trial_steps'))} of {sum(r['steps'] for r in results)}"
    )
    flat = [r for r in results if r["changes"] == 0]
    if flat:
        lines.append(
            f"stationary scenarios: {len(flat)}, re-tunes per simulated hour: median "
            f"{statistics.median(r['retunes_per_hour'] for r in flat):.2f}, max "
            f"{max(r['retunes_per_hour'] for r in flat):.2f} (goal <= 1)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenarios", nargs="+")
    parser.add_argument("--out", default="results/eval-tuner")
    parser.add_argument(
        "--jobs", type=int, default=1, help="scenarios evaluated in parallel processes"
    )
    args = parser.parse_args(argv)
    paths = sorted(p for p in args.scenarios if "testbed" not in pathlib.Path(p).name)
    if args.jobs > 1:
        with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(evaluate_one, paths))
    else:
        results = [evaluate_one(p) for p in paths]
    table = summarise(results)
    print(table)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tuner.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "tuner.txt").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
