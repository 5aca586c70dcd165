"""FSDP2's schedule in the simulator (autobyted/tuner/shard_schedule.py) against the emulated testbed.

    python -m benchmarks.sim_vs_fsdp results/fsdp-2r-1x-burst.json [more.json ...]

Reads what `benchmarks.bench_emulated --fsdp ... --out` wrote. For every FSDP2 block it simulates
each measured setting (`fsdp`: FSDP2 as built, its own all-gathers holding the thread on gloo;
`fsdp:F,B,R`: autobyte's asynchronous all-gathers; `,sync`: FSDP2's own) and, where the block has
a tuned run, each configuration the tuner measured (its decisions' measured step times). What the
simulator is given, none of it fitted to the rows it predicts:

- the profile's groups (one per transformer block) and compute, scaled to the block's compute probe;
- the link at the block's rate in the model's bytes, and gloo's reduce-scatter at twice an
  all-gather's bytes (docs/emulated.md);
- a per-collective cost: gloo's fitted latency at the block's rank count with one collective in
  flight (benchmarks/calibration/gloo-collective.json, `benchmarks.bench_collective`), added to
  the bytes' time (`simulated`) and, beside it, overlapping it (`overlapped`: a collective holds
  the link for the larger of the two, as the scheduler's simulator has it at N ranks). The first
  is slow where the lone latency hides under a shaped link's wire time, the second fast where it
  does not: the testbed lies between them.

Per block: each row's error, the median |error| and Kendall's tau between measured and simulated
steps. A block run with a burst above the links' own (`burst_for`: the 512 KiB of runs before it
was sized) moved its collectives faster than the rate; it is marked, and the simulator, which
models the rate, is not judged on it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from autobyted.tuner.shard_schedule import ShardedModel, ShardLink, simulate_step
from benchmarks.harness.scenario import GBIT, load_scenario
from benchmarks.predictor_error import kendall
from simulator.links import collective_cost_s

GLOO_RS_FACTOR = 2.0  # gloo's reduce-scatter moves an all-reduce's bytes (docs/emulated.md)
ERROR_GOAL = 0.05


def knobs(label: str) -> tuple[int | None, int | None, bool | None, bool]:
    """A bench_emulated FSDP2 label as (forward, backward, reshard, FSDP2's own all-gathers)."""
    from benchmarks.testbed.fsdp_replica import shard_config

    if label == "fsdp":
        return None, None, None, True
    spec = label.partition(":")[2]
    config = shard_config(spec)
    reshard = config.reshard_after_forward
    if isinstance(reshard, tuple):
        raise ValueError(f"{label!r}: per-group resharding is not a bench_emulated label")
    return config.forward_prefetch, config.backward_prefetch, reshard, spec.endswith(",sync")


def tuner_knobs(described: str) -> tuple[int | None, int | None, bool | None]:
    """A tuner decision's configuration as the CLI words it (`prefetch 1/= keep`)."""
    words = described.split()
    if not words or words[0] != "prefetch":
        raise ValueError(f"not an FSDP2 configuration: {described!r}")
    forward, _, backward = words[1].partition("/")
    reshard = {"keep": False, "reshard": True}.get(words[2]) if len(words) > 2 else None

    def depth(text: str) -> int | None:
        return None if text == "=" else int(text)

    return depth(forward), depth(backward), reshard


def compare_block(block: dict[str, Any], model: ShardedModel, tuned: list[dict[str, Any]]) -> dict:
    from benchmarks.testbed.bed import burst_for

    ranks = block["ranks"]
    rate = block["rate_gbit"] * GBIT
    fixed = collective_cost_s(ranks, in_flight=1)
    scaled = model.scaled(block["compute_s"] / model.compute_s)

    def link(sync: bool, overlap: bool = False) -> ShardLink:
        return ShardLink(
            rate, ranks, fixed, GLOO_RS_FACTOR, sync_all_gathers=sync, fixed_overlaps_wire=overlap
        )

    def both(knobs: tuple[int | None, int | None, bool | None], sync: bool) -> tuple[float, float]:
        return (
            simulate_step(scaled, link(sync), *knobs).step_s,
            simulate_step(scaled, link(sync, overlap=True), *knobs).step_s,
        )

    rows = []
    for row in block["rows"]:
        if row["config"] in ("compute", "agrs") or row.get("step_s") is None:
            continue
        forward, backward, reshard, sync = knobs(row["config"])
        sim = both((forward, backward, reshard), sync)
        rows.append(_row(row["config"], row["step_s"], sim, bool(row.get("cpu_limited"))))
    for run in tuned:
        if run["ranks"] != ranks or run["rate_gbit"] != block["rate_gbit"]:
            continue
        for decision in run["tuner"].get("decisions", []):
            measured = decision.get("measured_step_time_s")
            if not measured or not decision["config"].startswith("prefetch"):
                continue
            sim = both(tuner_knobs(decision["config"]), False)
            rows.append(_row(f"tuner: {decision['config']}", measured, sim, False))
    judged = [r for r in rows if not r["cpu_limited"]]
    burst = block.get("burst_bytes")
    kinder = burst is None or burst > burst_for(int(block["wire_rate_bps"]))
    return {
        "ranks": ranks,
        "rate_gbit": block["rate_gbit"],
        "burst_bytes": burst,
        "kinder_link": kinder,
        "collective_s": fixed,
        "rows": rows,
        "median_abs_error": statistics.median(abs(r["error"]) for r in judged) if judged else None,
        "overlapped_median_abs_error": (
            statistics.median(abs(r["overlapped_error"]) for r in judged) if judged else None
        ),
        "tau": kendall([r["measured_s"] for r in judged], [r["simulated_s"] for r in judged])
        if len(judged) > 2
        else None,
    }


def _row(
    config: str, measured: float, simulated: tuple[float, float], flagged: bool
) -> dict[str, Any]:
    return {
        "config": config,
        "measured_s": measured,
        "simulated_s": simulated[0],
        "error": simulated[0] / measured - 1.0,
        "overlapped_s": simulated[1],
        "overlapped_error": simulated[1] / measured - 1.0,
        "cpu_limited": flagged,
    }


def compare(report: dict[str, Any]) -> list[dict[str, Any]]:
    scenario = load_scenario(report["scenario"])
    model = ShardedModel.from_profile(scenario.profile)
    return [
        compare_block(block, model, report.get("tuned", []))
        for block in report["blocks"]
        if block.get("engine") == "fsdp2"
    ]


def format_block(result: dict[str, Any]) -> str:
    burst = result["burst_bytes"]
    head = (
        f"{result['ranks']} ranks, {result['rate_gbit']:.3g} Gbit/s, tbf burst "
        f"{'512 KiB (not recorded)' if burst is None else f'{burst / 1024:.0f} KiB'}"
        f"{' (kinder than the rate: not judged)' if result['kinder_link'] else ''}; "
        f"per collective {result['collective_s'] * 1e3:.2f} ms"
    )
    lines = [
        head,
        (
            f"{'configuration':30} {'measured ms':>12} {'simulated ms':>13} {'error':>8} "
            f"{'overlapped ms':>14} {'error':>8}"
        ),
    ]
    for row in result["rows"]:
        flag = " *" if row["cpu_limited"] else ""
        lines.append(
            f"{row['config']:30} {row['measured_s'] * 1e3:12.1f} {row['simulated_s'] * 1e3:13.1f} "
            f"{row['error'] * 100:+7.1f}% {row['overlapped_s'] * 1e3:14.1f} "
            f"{row['overlapped_error'] * 100:+7.1f}%{flag}"
        )
    median, tau = result["median_abs_error"], result["tau"]
    overlapped = result["overlapped_median_abs_error"]
    lines.append(
        f"median |error| {'-' if median is None else f'{median * 100:.1f}%'}, overlapped "
        f"{'-' if overlapped is None else f'{overlapped * 100:.1f}%'} (goal <= "
        f"{ERROR_GOAL * 100:.0f}%), Kendall tau {'-' if tau is None else f'{tau:.2f}'}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="bench_emulated --fsdp --out files")
    parser.add_argument("--out", default="", help="write the comparison as JSON here")
    args = parser.parse_args(argv)
    out = []
    for path in args.results:
        try:
            report = json.loads(pathlib.Path(path).read_text())
            results = compare(report)
        except (OSError, ValueError, KeyError) as error:
            raise SystemExit(f"sim_vs_fsdp: {path}: {error}") from None
        if not results:
            raise SystemExit(f"sim_vs_fsdp: {path} has no FSDP2 block (bench_emulated --fsdp)")
        for result in results:
            print(f"{path}: " + format_block(result) + "\n")
        out.append({"source": path, "blocks": results})
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
