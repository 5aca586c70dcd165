"""Did the tuner's trials pay? Read from a testbed run of the `autobyte` policy (the run stored by
`benchmarks.harness.evaluate --testbed --testbed-cache DIR`: every step's time and configuration, and the
daemon's decisions).

    python -m benchmarks.trial_report results/tb-cache-long/testbed-mlp-2w-long--policy-autobyte.json

A trial is a decision whose reason starts with "trial"; it runs from the step it applied at to the
step the next decision applied at. It measured a gain when its median step time (after its first
`--settle` steps) is below the incumbent's (the configuration the reason names, "faster than X"),
measured nearest the search: its last `--reference` steps before the search's first trial and its
re-measurements during the search (the tuner's checks), each without its first `--settle` steps. Steps spent
in trials that lost, and the time they cost over the incumbent, are summed. The goal: at
least half the trials measure a gain.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys
from collections.abc import Sequence
from typing import Any

_INCUMBENT = re.compile(r"faster than (\S+)")


def _label(config: str) -> str:
    """'sched:4MiB,16MiB' (the worker's spelling) or '4MiB/16MiB' -> '4MiB/16MiB' (the decisions')."""
    from autobyte.types import Config

    from autobyted.tuner.grid import describe
    from benchmarks.testbed.train_worker import RunConfig

    if config.startswith("sched:"):
        run = RunConfig.parse(config)
        return describe(Config(run.partition_bytes, run.credit_bytes))
    return config


def trials(series: dict[str, Any], settle: int = 2, reference: int = 20) -> list[dict[str, Any]]:
    times, configs = series["step_times_s"], [_label(c) for c in series["labels"]]
    since_switch, run = [], 0
    for i, config in enumerate(configs):
        run = run + 1 if i and configs[i - 1] == config else 0
        since_switch.append(run)
    decisions = sorted(
        (d for d in series.get("decisions", []) if d.get("applied_at_step")),
        key=lambda d: d["applied_at_step"],
    )
    # searches: from a "trial 1/..." to the first decision after it that is neither a trial nor a check
    # (or the next "trial 1/": a re-tune during a search starts another)
    searches, current = [], None
    for i, decision in enumerate(decisions):
        reason = decision["reason"]
        if reason.startswith("trial 1/") or (reason.startswith("trial") and current is None):
            current = {"start": decision["applied_at_step"], "trials": [], "checks": []}
            searches.append(current)
        if current is None:
            continue
        end = decisions[i + 1]["applied_at_step"] if i + 1 < len(decisions) else len(times)
        if reason.startswith("trial"):
            current["trials"].append((decision, end))
        elif reason.startswith("check"):  # the incumbent re-measured (its first `reference` steps)
            current["checks"].append(
                (decision["applied_at_step"], min(end, decision["applied_at_step"] + reference))
            )
        else:
            current["end"] = decision["applied_at_step"]
            current = None
    out = []
    for search in searches:
        for decision, end in search["trials"]:
            start = decision["applied_at_step"]
            match = _INCUMBENT.search(decision["reason"])
            incumbent = match.group(1) if match else ""
            # the incumbent as measured nearest the search: its last `reference` steps before it and
            # any re-measurement during it (the tuner's checks), first `settle` steps after a switch out
            before = [i for i in range(search["start"]) if configs[i] == incumbent][-reference:]
            during = [
                i
                for a, b in search["checks"]
                for i in range(a, min(b, len(times)))
                if configs[i] == incumbent
            ]
            ref = [times[i] for i in before + during if since_switch[i] >= settle]
            mine = [
                times[i]
                for i in range(start, min(end, len(times)))
                if configs[i] == decision["config"] and since_switch[i] >= settle
            ]
            if not ref or not mine:
                continue
            trial_s, incumbent_s = statistics.median(mine), statistics.median(ref)
            out.append(
                {
                    "decision_id": decision["decision_id"],
                    "config": decision["config"],
                    "incumbent": incumbent,
                    "steps": end - start,
                    "trial_step_s": trial_s,
                    "incumbent_step_s": incumbent_s,
                    "predicted_step_s": decision.get("predicted_step_time_s"),
                    "gain": trial_s < incumbent_s,
                    "cost_s": max(0.0, trial_s - incumbent_s) * (end - start),
                }
            )
    return out


def format_report(rows: Sequence[dict[str, Any]], total_steps: int) -> str:
    lines = [
        "| # | trial | vs | steps | predicted ms | measured ms | incumbent ms | measured / incumbent | gain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        predicted = "-" if r["predicted_step_s"] is None else f"{1e3 * r['predicted_step_s']:.1f}"
        lines.append(
            f"| {r['decision_id']} | {r['config']} | {r['incumbent']} | {r['steps']} | {predicted} | "
            f"{1e3 * r['trial_step_s']:.1f} | {1e3 * r['incumbent_step_s']:.1f} | "
            f"{r['trial_step_s'] / r['incumbent_step_s']:.3f} | "
            f"{'yes' if r['gain'] else 'no'} |"
        )
    won = sum(r["gain"] for r in rows)
    lost_steps = sum(r["steps"] for r in rows if not r["gain"])
    cost = sum(r["cost_s"] for r in rows)
    share = f"{won / len(rows):.0%}" if rows else "-"
    lines.append(
        f"\n{len(rows)} trials, {won} measured a gain ({share}; goal >= 50%); {lost_steps} of "
        f"{total_steps} steps in trials that lost, costing {cost:.1f} s over the incumbent"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.trial_report", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run", help="a cached autobyte testbed run (evaluate --testbed-cache DIR)")
    parser.add_argument("--settle", type=int, default=2)
    parser.add_argument("--reference", type=int, default=20)
    args = parser.parse_args(argv)
    path = pathlib.Path(args.run)
    try:
        series = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        parser.error(f"{path}: {error}")
    if "step_times_s" not in series or "labels" not in series:
        parser.error(f"{path}: not a cached testbed run (no step_times_s / labels)")
    print(format_report(trials(series, args.settle, args.reference), len(series["step_times_s"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
