"""The simulator against the emulated-accelerator testbed: the same profile, ranks, rate and grid.

    python -m benchmarks.sim_vs_emulated results/emulated-resnet50.json [more.json ...]
    python -m benchmarks.sim_vs_emulated results/*.json --out results/sim-vs-emulated.json

Reads what `benchmarks.bench_emulated --out` wrote. For every (profile, ranks, rate, conditions)
block it simulates each measured configuration (DDP's bucket caps and the scheduler's grid; not the
two probes) with the block's scenario (benchmarks/harness/scenario.py) scaled to the block's rate, and
reports per block the median |error| of the step time and Kendall's tau between the measured and
the simulated step times over the grid. Two simulators:

- `scenario`: the scenario's profile and [link] as written (what the simulator assumes of a GPU
  cluster: the FLOP-derived compute, NCCL-like per-collective costs, the link's nominal rate);
- `probes`: the same, calibrated only by the block's two probes of the bound, which are no
  configuration of the grid: the compute scaled to the measured compute probe, and the link's rate
  to the one at which a bare ring all-reduce of all gradients takes the measured comm probe (TCP's
  and the shaper's share of the nominal rate, and gloo's own cost per byte on this host);
- `gloo`: `probes` with the link's per-collective costs of this testbed instead of the scenario's
  NCCL-like ones (benchmarks/calibration/optimum-map.report.json "constants": gloo over veth on
  this host, the cost of a collective behind a competing flow by message size). A collective's
  fixed cost is time, which the byte scale does not divide; the by-size tables are in wire bytes,
  so their sizes are multiplied by the byte scale into the model's.
- `gloo_n`: `gloo` with the per-collective cost measured at the block's rank count
  (benchmarks/calibration/gloo-collective.json, written by `benchmarks.bench_collective`: the
  fitted latency of a stream of all-reduces with the credit window's partitions in flight) in
  place of the 2-rank figure: at N ranks a collective is a ring of 2(N-1) hops through N processes
  that share the host's cores, which no per-hop constant of a 2-rank calibration carries. That
  cost overlaps the wire time (`LinkModel.fixed_overlaps_wire`): a hop waits for its processes to
  be scheduled while the shaped link drains the bytes of the other collectives in flight, so a
  collective holds the link for the larger of the two. Measured: the sum over-predicted 16 MiB
  partitions at 8 ranks by 42%.

Beside them, the testbed's own noise floor where the rows carry their rounds (`round_steps_s`): the
median |difference| between a block's first two rounds and the tau between them: no simulator can
rank a grid more consistently than the testbed repeats itself. The goals are judged in the blocks
whose rounds agree at tau >= NOISE_TAU_GOAL, over the rows not flagged CPU-limited (a flagged row
counts toward no goal; its prediction is still listed).

The profile's `optimizer_s` is left out in both: the emulated ranks do not wait it (their update runs
on the host, inside the compute probe). Goals: median <= 5%, tau >= 0.7 in every block.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.bench_emulated import rate_changes, scenario_at_rate
from benchmarks.harness.scenario import Scenario, load_scenario
from benchmarks.predictor_error import kendall
from simulator.engine import (
    DDPConfig,
    RunConfig,
    Simulator,
    dependency_bound_step_s,
)
from simulator.links import gloo_link, gloo_n_link

ERROR_GOAL = 0.05
TAU_GOAL = 0.7
NOISE_TAU_GOAL = 0.8  # the rounds' agreement a block needs to judge a simulator's tau on it
TRACE_HORIZON_S = 30.0  # simulated time over which a changing rate's mean step is taken
VARIANTS = ("scenario", "probes", "gloo", "gloo_n")


def simulator_config(label: str) -> RunConfig:
    """A grid label of bench_emulated (model bytes: ddp:25MiB, sched:4MiB,16MiB) as the simulator's."""
    from autobyte.types import Config

    from benchmarks.testbed.train_worker import RunConfig as WorkerConfig

    parsed = WorkerConfig.parse(label)
    if parsed.kind == "sched" and parsed.auto:
        raise ValueError(f"{label!r}: the derived sizes are the row's (row_config)")
    if parsed.kind == "ddp":
        return (
            DDPConfig()
            if parsed.partition_bytes is None
            else DDPConfig(bucket_bytes=parsed.partition_bytes)
        )
    if parsed.kind != "sched":
        raise ValueError(f"{label!r} is no configuration of the grid (ddp:SIZE or sched:P,C)")
    return Config(parsed.partition_bytes, parsed.credit_bytes, parsed.tail_bytes)


def row_config(row: dict[str, Any], byte_scale: float) -> RunConfig:
    """A measured row's configuration; `sched:auto` as the sizes the scheduler derived in that
    run (on the wire, so multiplied by the byte scale into the model's)."""
    from autobyte.types import Config

    derived = row.get("derived_wire_bytes")
    if derived:
        partition, credit = (None if b is None else round(b * byte_scale) for b in derived)
        return Config(partition, credit)
    return simulator_config(row["config"])


def block_simulator(scenario: Scenario, block: dict[str, Any], variant: str) -> Simulator:
    """The block's scenario at its rate and ranks as `variant` (see the module docstring)."""
    if variant not in VARIANTS:
        raise ValueError(f"simulator variant {variant!r}: use one of {VARIANTS}")
    calibrate = variant != "scenario"
    at_rate = scenario_at_rate(scenario, block["rate_gbit"])
    profile = dataclasses.replace(at_rate.profile, optimizer_s=0.0)
    bandwidth = at_rate.bandwidth
    ranks = block["ranks"]
    if calibrate:
        if not block.get("compute_s") or not block.get("comm_s"):
            raise ValueError(
                f"block {ranks} ranks at {block['rate_gbit']:.3g} Gbit/s has no probes"
            )
        profile = profile.with_compute_s(block["compute_s"])
        wire_factor = 2 * (ranks - 1) / ranks
        # the rate the bare all-reduce ran at, as a share of the rate the job's links were set to
        measured_bps = wire_factor * profile.total_param_bytes / block["comm_s"]
        nominal_bps = statistics.fmean([bandwidth.at(t) for t in range(int(TRACE_HORIZON_S))])
        bandwidth = bandwidth.scaled(measured_bps / nominal_bps)
    link = {
        "gloo": lambda: gloo_link(at_rate.link, scenario.byte_scale),
        "gloo_n": lambda: gloo_n_link(at_rate.link, scenario.byte_scale, ranks),
    }.get(variant, lambda: at_rate.link)()
    return Simulator(
        profile,
        ranks,
        bandwidth,
        link,
        flows_trace=at_rate.flows,
        cpu_share_trace=at_rate.cpu_share,
    )


def simulated_step_s(sim: Simulator, config: RunConfig, changing: bool) -> float:
    """Steady step under constant conditions; under a changing rate the mean over the horizon."""
    if not changing:
        flows = sim.flows_trace.at(0.0) if sim.flows_trace is not None else 0.0
        share = sim.cpu_share_trace.at(0.0) if sim.cpu_share_trace is not None else 1.0
        return sim.steady_step_s(config, sim.bandwidth.at(0.0), 1.0, flows, share, steps=8)
    sim.reset()
    records = sim.run(config, until_s=TRACE_HORIZON_S)
    return statistics.fmean(record.step_time_s for record in records[2:] or records)


def noise_floor(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The first two rounds of a block against each other (None where a row lacks two)."""
    pairs = [row.get("round_steps_s") or [] for row in rows]
    if len(rows) < 2 or any(len(p) < 2 for p in pairs):
        return {"median_abs_difference": None, "kendall_tau": None}
    first, second = [p[0] for p in pairs], [p[1] for p in pairs]
    return {
        "median_abs_difference": statistics.median(abs(b - a) / a for a, b in zip(first, second)),
        "kendall_tau": kendall(first, second),
    }


def compare_block(scenario: Scenario, block: dict[str, Any]) -> dict[str, Any]:
    rows = [
        row for row in block["rows"] if row["config"] not in ("compute", "comm") and row["step_s"]
    ]
    judged = [i for i, row in enumerate(rows) if not row.get("cpu_limited")]
    changing = rate_changes(scenario_at_rate(scenario, block["rate_gbit"]))
    out: dict[str, Any] = {
        "profile": scenario.profile.name,
        "ranks": block["ranks"],
        "rate_gbit": block["rate_gbit"],
        "conditions": block.get("conditions", "none"),
        "flagged": sum(1 for row in rows if row["cpu_limited"]),
        "configs": len(rows),
    }
    measured = [row["step_s"] for row in rows]
    for variant in VARIANTS:
        sim = block_simulator(scenario, block, variant)
        predicted = [
            simulated_step_s(sim, row_config(row, scenario.byte_scale), changing) for row in rows
        ]
        errors = [(p - m) / m for p, m in zip(predicted, measured)]
        out[variant] = {
            "predicted_s": dict(zip((row["config"] for row in rows), predicted)),
            "errors": dict(zip((row["config"] for row in rows), errors)),
            # over the rows not flagged CPU-limited
            "median_abs_error": statistics.median(abs(errors[i]) for i in judged)
            if judged
            else None,
            "kendall_tau": kendall([measured[i] for i in judged], [predicted[i] for i in judged])
            if len(judged) > 1
            else None,
            "bound_s": sim.lower_bound_step_s(0.0),
        }
    # the bound the data dependency leaves, on the probes' compute and rate (a free link)
    probes = block_simulator(scenario, block, "probes")
    out["dependency_bound_s"] = (
        None
        if changing
        else dependency_bound_step_s(probes.profile, probes.workers, probes.bandwidth.at(0.0))
    )
    out["noise_floor"] = noise_floor([rows[i] for i in judged])
    tau = out["noise_floor"]["kendall_tau"]
    out["judged"] = tau is not None and not math.isnan(tau) and tau >= NOISE_TAU_GOAL - 1e-9
    out["measured_s"] = dict(zip((row["config"] for row in rows), measured))
    out["measured_bound_s"] = block.get("bound_s")
    return out


def compare(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    blocks = []
    for report in reports:
        scenario = load_scenario(report["scenario"])
        blocks += [
            compare_block(scenario, block) for block in report["blocks"] if block["ranks"] > 1
        ]
    return blocks


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}" if value < 0 else f"{value:.1%}"


def _tau(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


def format_comparison(blocks: Sequence[dict[str, Any]]) -> str:
    short = {"scenario": "scen", "probes": "probes", "gloo": "gloo", "gloo_n": "gloo@N"}
    lines = [
        (
            "EMULATED arithmetic on the testbed vs the simulator (benchmarks/sim_vs_emulated.py); "
            f"goals: median |error| <= {ERROR_GOAL:.0%}, tau >= {TAU_GOAL}"
        ),
        (
            f"{'profile':12} {'ranks':>5} {'Gbit/s':>7} {'conditions':24} {'n':>2} {'flag':>4} "
            + " ".join(f"{'err ' + short[v]:>10} {'tau':>5}" for v in VARIANTS)
            + f" {'worst (gloo@N)':>24} {'rounds: diff':>12} {'tau':>5} {'judged':>6}"
        ),
    ]
    for b in blocks:
        worst = max(b["gloo_n"]["errors"].items(), key=lambda kv: abs(kv[1]), default=None)
        worst_text = f"{worst[0]} {_pct(worst[1])}" if worst else "-"
        lines.append(
            f"{b['profile'][:12]:12} {b['ranks']:>5} {b['rate_gbit']:>7.3g} "
            f"{b['conditions'][:24]:24} {b['configs']:>2} {b['flagged']:>4} "
            + " ".join(
                f"{_pct(b[v]['median_abs_error']):>10} {_tau(b[v]['kendall_tau']):>5}"
                for v in VARIANTS
            )
            + f" {worst_text:>24} {_pct(b['noise_floor']['median_abs_difference']):>12} "
            f"{_tau(b['noise_floor']['kendall_tau']):>5} {'yes' if b.get('judged') else 'no':>6}"
        )
    lines.append(
        "err, tau: median |simulated - measured| / measured and Kendall's tau over the block's grid "
        "(DDP's bucket caps, the scheduler's default as the sizes it derived, and its grid), rows "
        "flagged CPU-limited left out; worst: over every row; scen: the scenario's "
        "simulator as written; probes: compute and link rate from the block's compute and comm "
        "probes; gloo: probes and this testbed's per-collective costs at 2 ranks; gloo@N: gloo with "
        "the per-collective cost measured at the block's rank count, overlapping the wire time; "
        "rounds: the block's first two rounds against each other (the testbed's noise floor); "
        f"judged: the rounds agree at tau >= {NOISE_TAU_GOAL}; flag: rows measured with the CPU "
        "the limit"
    )
    return "\n".join(lines)


def write_json(out: str, data: Any) -> None:
    """`data` as JSON at `out` (its folder made); nothing where `out` is empty."""
    if out:
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "results", nargs="+", help="JSON files written by benchmarks.bench_emulated --out"
    )
    parser.add_argument("--out", default="", help="write the comparison as JSON here")
    args = parser.parse_args(argv)
    try:
        reports = [json.loads(pathlib.Path(path).read_text()) for path in args.results]
        blocks = compare(reports)
    except (OSError, ValueError, KeyError) as error:
        raise SystemExit(f"sim_vs_emulated: {error}") from None
    print(format_comparison(blocks))
    write_json(args.out, blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
