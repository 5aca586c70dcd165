"""The tail window against its twin, from `benchmarks.profile_step` runs.

For every block (model @ rate) of one or more profile_step outputs: each configuration's median step,
x DDP, step / bound (max(compute, comm) measured beside it), step / compute (forward + backward +
update with no communication), the forward's wait for parameters; and for every configuration
with a tail window its *paired* ratio to its twin without one (same partition and credit),
taken round by round in the same processes (median over rounds), so drift hits both alike. Then
the simulator's prediction of every scheduler configuration (the checked-in testbed link
calibration and the model's profile) and its rank agreement (Kendall tau) with the measurement.

    python -m benchmarks.tail_report results/i20b/goals.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.calibrate_map import (
    DENSE,  # profile_step: embedding tables sent whole
    kendall_tau,
)
from benchmarks.testbed.train_worker import RunConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
PROFILES = REPO / "benchmarks" / "calibration" / "profiles"
TESTBED_CALIBRATION = REPO / "benchmarks" / "calibration" / "testbed.json"


def canonical(text: str) -> str:
    """A profile_step label in RunConfig's spelling, its "+dense" suffix kept."""
    dense = text.endswith(DENSE)
    return RunConfig.parse(text.removesuffix(DENSE)).label + (DENSE if dense else "")


def twin(label: str, labels: Sequence[str] = ()) -> str | None:
    """The label this one is paired with: the same configuration without its tail window; for a
    configuration without one, the same with row-sparse embeddings sent whole ("+dense") when that
    ran too (`labels`); None: it has no twin."""
    dense = label.endswith(DENSE)
    config = RunConfig.parse(label.removesuffix(DENSE))
    if config.tail_bytes is not None:
        return RunConfig(config.kind, config.partition_bytes, config.credit_bytes).label + (
            DENSE if dense else ""
        )
    if not dense and label + DENSE in labels:
        return label + DENSE
    return None


def per_round(results: Sequence[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """{label: {round: median step}} of rank 0's measured segments."""
    out: dict[str, dict[int, float]] = {}
    for item in results:
        if item.get("step_times_s"):
            out.setdefault(canonical(item["config"]), {})[item["round"]] = statistics.median(
                item["step_times_s"]
            )
    return out


def paired_ratio(rounds: dict[str, dict[int, float]], label: str, other: str) -> float | None:
    """Median over the rounds both ran of step(label) / step(other)."""
    common = sorted(set(rounds.get(label, {})) & set(rounds.get(other, {})))
    if not common:
        return None
    return statistics.median(rounds[label][r] / rounds[other][r] for r in common)


def simulated(model: str, rate_bytes_per_s: float, labels: Sequence[str]) -> dict[str, float]:
    """The simulator's steady step of each label (2 ranks, the testbed's link calibration), as the
    optimum map's calibration predicts a block."""
    from benchmarks.calibrate import link_model
    from benchmarks.calibrate_map import BlockInputs
    from simulator.profiles import ModelProfile

    link = link_model(json.loads(TESTBED_CALIBRATION.read_text()).get("link", {}))
    profile = ModelProfile.load(PROFILES / f"{model}.profile.json")
    return BlockInputs(profile, 2, rate_bytes_per_s, link).predict(labels)


def block_report(block: dict[str, Any], with_sim: bool = True) -> dict[str, Any]:
    from benchmarks.testbed import parse_rate

    summary = block["summary"]
    bound = summary["bound"]["step_s"]
    compute = summary["compute"]["step_s"]
    ddp = summary["ddp"]["step_s"]
    rounds = per_round(block["results"])
    labels = [k for k in summary if k.startswith("sched:")]
    rows = []
    for label in labels:
        row = summary[label]
        other = twin(label, labels)
        rows.append(
            {
                "config": label,
                "step_s": row["step_s"],
                "x_ddp": ddp / row["step_s"],
                "step_over_bound": row["step_s"] / bound,
                "step_over_compute": row["step_s"] / compute,
                "forward_wait_s": row.get("forward_wait_s"),
                "vs_twin": paired_ratio(rounds, label, other) if other else None,
                "twin": other,
            }
        )
    report = {
        "model": block["model"],
        "rate": block["rate"],
        "load": [block["load_before"], block["load_after"]],
        "ddp_s": ddp,
        "bound_s": bound,
        "compute_s": compute,
        "rows": rows,
    }
    best = min(rows, key=lambda r: r["step_s"])
    best_plain = min(
        (r for r in rows if RunConfig.parse(r["config"].removesuffix(DENSE)).tail_bytes is None),
        key=lambda r: r["step_s"],
    )
    report["best"], report["best_without_tail"] = best["config"], best_plain["config"]
    if with_sim:
        predicted = simulated(block["model"], parse_rate(block["rate"]) / 8, labels)
        report["simulated_s"] = predicted
        report["kendall_tau"] = kendall_tau({l: summary[l]["step_s"] for l in labels}, predicted)
        report["sim_best"] = min(predicted, key=predicted.get)
    return report


def format_report(report: dict[str, Any]) -> str:
    load = report["load"]
    first = [
        str(value).split()[0] if not isinstance(value, (list, tuple)) else value[0]
        for value in load
    ]
    lines = [
        (
            f"{report['model']} @ {report['rate']}  (load {first[0]} -> {first[1]}; DDP "
            f"{report['ddp_s'] * 1e3:.1f} ms, bound {report['bound_s'] * 1e3:.1f}, compute {report['compute_s'] * 1e3:.1f})"
        ),
        (
            f"{'configuration':24} {'step ms':>8} {'x DDP':>6} {'/bound':>7} {'/compute':>9} {'fwd wait':>9} "
            f"{'vs twin':>8} {'sim ms':>7}"
        ),
    ]
    for row in report["rows"]:
        wait = row["forward_wait_s"]
        vs = row["vs_twin"]
        sim = report.get("simulated_s", {}).get(row["config"])
        lines.append(
            f"{row['config']:24} {row['step_s'] * 1e3:8.1f} {row['x_ddp']:6.2f} {row['step_over_bound']:7.2f} "
            f"{row['step_over_compute']:9.2f} {'-' if wait is None else f'{wait * 1e3:.1f}':>9} "
            f"{'-' if vs is None else f'{vs:.3f}':>8} {'-' if sim is None else f'{sim * 1e3:.1f}':>7}"
        )
    tail = f"best {report['best']} (without a tail window: {report['best_without_tail']})"
    if "kendall_tau" in report:
        tail += f"; simulator's best {report['sim_best']}, Kendall tau {report['kendall_tau']:.2f}"
    lines.append(tail)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="profile_step --out files")
    parser.add_argument("--no-sim", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    reports = []
    for path in args.runs:
        for block in json.loads(pathlib.Path(path).read_text()):
            report = block_report(block, with_sim=not args.no_sim)
            reports.append(report)
            print(format_report(report) + "\n")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
