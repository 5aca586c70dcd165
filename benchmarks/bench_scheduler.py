"""Scheduler benchmark: DDP vs ScheduledOptimizer configurations, 2 ranks on the namespace testbed.

    python -m benchmarks.bench_scheduler [--rates 10gbit,1gbit,300mbit] [--models mlp,vgg]
        [--grid 1MiB:2MiB,4MiB:16MiB,...] [--rounds 3] [--steps 8] [--warmup 3] [--dispatch]
        [--out results/bench_scheduler.json]

For every (model, rate) one pair of ranks runs every configuration in one process, interleaved
round by round (compute-only, comm-only, DDP, the scheduler without partitioning and with unlimited
credit, and the (partition, credit) grid), so drift on a noisy machine hits all alike. The table
gives the median over rounds of each configuration's median step time, the median over rounds of the
per-round throughput ratio against DDP (higher is better), the median exposed communication, and
the lower bound max(compute, comm) with DDP's ratio to it. `--dispatch` also measures the
scheduler's own dispatch overhead per partition (see `measure_dispatch`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.testbed import Testbed, format_rate, parse_rate, worker_cli
from benchmarks.testbed.host import load_average

REPO = Path(__file__).resolve().parents[1]

# Batch sizes that put compute and communication of the same order at 1gbit on this 2-core machine
# (MLP 6.8M params: ≈240 ms compute vs ≈229 ms all-reduce; VGG-11/2: ≈137 ms vs ≈122 ms).
DEFAULT_BATCH = {"mlp": 512, "vgg": 64, "resnet50": 16, "bert": 8, "transformer": 16}


def scheduler_available() -> bool:
    try:
        import autobyte.scheduler  # noqa: F401
    except ImportError:
        return False
    return True


# (partition, credit) pairs measured by default: small partitions with a credit of 2-4 partitions
# (where priority matters) up to 4 MiB partitions with unlimited credit.
DEFAULT_GRID = "1MiB:2MiB,1MiB:4MiB,2MiB:4MiB,2MiB:8MiB,4MiB:8MiB,4MiB:16MiB,4MiB:none"


def config_labels(
    grid: Sequence[tuple[str, str]],
    with_sched: bool,
    shared: Sequence[tuple[str, str]] = (),
    python_twins: bool = False,
) -> list[str]:
    """Probes, DDP, the scheduler's grid, `shared:` twins (the scheduler with
    own_communicator=False: its collectives on the default group) of the `shared` pairs, and with
    `python_twins` a `py:` twin (the Python hot path) of every grid entry."""
    labels = ["compute", "comm", "ddp"]
    if with_sched:
        # grid entries are (P, C) or (P, C, T) with a tail window: --grid 1MiB:4MiB:8MiB
        pairs = [("none", "none")] + [entry for entry in grid if tuple(entry) != ("none", "none")]
        labels += [f"sched:{','.join(entry)}" for entry in pairs]
        labels += [f"shared:{','.join(entry)}" for entry in shared]
        if python_twins:
            labels += [f"py:{','.join(entry)}" for entry in pairs]
    return labels


def _twin(label: str) -> str:
    """The measured label of a grid entry (train_worker spells sizes its own way)."""
    from benchmarks.testbed.train_worker import RunConfig

    return RunConfig.parse(label).label


def parse_grid(args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.partitions or args.credits:
        return [
            (p, c)
            for p in (args.partitions or "none").split(",")
            for c in (args.credits or "none").split(",")
        ]
    return [tuple(pair.split(":")) for pair in args.grid.split(",")]  # type: ignore[misc]


def run_pair(
    bed: Testbed,
    model: str,
    batch_size: int,
    labels: list[str],
    args: argparse.Namespace,
    model_args: str = "",
    rounds: int | None = None,
    steps: int | None = None,
) -> list[dict[str, Any]]:
    """One 2-rank run of all configurations, interleaved; returns rank 0's result events."""
    command = worker_cli.command(
        model=model,
        batch_size=batch_size,
        rounds=rounds or args.rounds,
        steps=steps or args.steps,
        warmup=args.warmup,
        threads=args.threads,
        configs=list(labels),
        model_args=model_args or None,
        sched_group=args.sched_group,
    )
    result = bed.run(command, cwd=str(REPO), timeout_s=args.timeout)
    return result.ranks[0].results


def summarise(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration: median step, median paired ratio vs DDP, median exposed comm."""
    by_round: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in results:
        by_round[r["round"]][r["config"]] = r
    rows: dict[str, dict[str, Any]] = {}
    labels = list(dict.fromkeys(r["config"] for r in results))
    for label in labels:
        medians = [
            rounds[label]["median_step_s"] for rounds in by_round.values() if label in rounds
        ]
        ratios = [
            rounds["ddp"]["median_step_s"] / rounds[label]["median_step_s"]
            for rounds in by_round.values()
            if label in rounds and "ddp" in rounds
        ]
        exposed = [
            rounds[label]["exposed_comm_s"]
            for rounds in by_round.values()
            if label in rounds and rounds[label].get("exposed_comm_s") is not None
        ]
        rows[label] = {
            "median_step_s": statistics.median(medians),
            "ratio_vs_ddp": statistics.median(ratios) if ratios else None,
            "exposed_comm_s": statistics.median(exposed) if exposed else None,
            "rounds": len(medians),
        }
    # DDP has no exposed-comm probe of its own: its step time minus compute-only time is exposed.
    if "ddp" in rows and "compute" in rows:
        rows["ddp"]["exposed_comm_s"] = max(
            0.0, rows["ddp"]["median_step_s"] - rows["compute"]["median_step_s"]
        )
    return rows


def own_vs_shared(results: list[dict[str, Any]], kind: str = "shared") -> dict[str, float]:
    """Per `shared:` (or other `kind:`) configuration, the median over rounds of its step time over
    its `sched:` twin's (paired within a round)."""
    by_round: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in results:
        by_round[r["round"]][r["config"]] = r
    out = {}
    for label in dict.fromkeys(r["config"] for r in results):
        if not label.startswith(kind + ":"):
            continue
        own = "sched:" + label[len(kind) + 1 :]
        ratios = [
            rounds[label]["median_step_s"] / rounds[own]["median_step_s"]
            for rounds in by_round.values()
            if label in rounds and own in rounds
        ]
        if ratios:
            out[label] = statistics.median(ratios)
    return out


def format_table(blocks: list[dict[str, Any]]) -> str:
    lines = [
        (
            f"{'model':<11} {'rate':>8} {'configuration':<24} {'step ms':>9} {'x DDP':>7} "
            f"{'exposed ms':>10}"
        )
    ]
    lines.append("-" * len(lines[0]))
    for block in blocks:
        rows = block["rows"]
        for label, row in rows.items():
            if label in ("compute", "comm"):
                continue
            ratio = f"{row['ratio_vs_ddp']:.2f}" if row["ratio_vs_ddp"] is not None else "-"
            exposed = "-" if row["exposed_comm_s"] is None else f"{row['exposed_comm_s'] * 1e3:.1f}"
            lines.append(
                f"{block['model']:<11} {block['rate']:>8} {label:<24} "
                f"{row['median_step_s'] * 1e3:9.1f} {ratio:>7} {exposed:>10}"
            )
        if "compute" in rows and "comm" in rows and "ddp" in rows:
            bound = max(rows["compute"]["median_step_s"], rows["comm"]["median_step_s"])
            lines.append(
                f"{block['model']:<11} {block['rate']:>8} {'bound=max(compute,comm)':<24} "
                f"{bound * 1e3:9.1f} {rows['ddp']['median_step_s'] / bound:7.2f} "
                f"{'':>10}  (compute {rows['compute']['median_step_s'] * 1e3:.0f} ms, "
                f"comm {rows['comm']['median_step_s'] * 1e3:.0f} ms)"
            )
        for kind in ("sched", "py"):
            sched = {
                k: v for k, v in rows.items() if k.startswith(kind + ":") and v["ratio_vs_ddp"]
            }
            if sched:
                best = max(sched, key=lambda k: sched[k]["ratio_vs_ddp"])
                lines.append(
                    f"{block['model']:<11} {block['rate']:>8} {'best: ' + best:<24} "
                    f"{sched[best]['median_step_s'] * 1e3:9.1f} "
                    f"{sched[best]['ratio_vs_ddp']:7.2f}"
                )
        for label, ratio in block.get("own_vs_shared", {}).items():
            lines.append(
                f"{block['model']:<11} {block['rate']:>8} {'own/shared ' + label[7:]:<24} "
                f"{'':>9} {ratio:7.3f}  (paired step-time ratio shared / own group; "
                f">1: the own group is faster)"
            )
        for label, ratio in block.get("native_vs_python", {}).items():
            lines.append(
                f"{block['model']:<11} {block['rate']:>8} {'py/native ' + label[3:]:<24} "
                f"{'':>9} {ratio:7.3f}  (paired step-time ratio Python / native path; "
                f">1: native is faster)"
            )
        lines.append("")
    return "\n".join(lines)


def measure_dispatch(bed: Testbed, args: argparse.Namespace) -> dict[str, Any]:
    """The scheduler's own dispatch cost per partition, apart from the backend's launch cost.

    2 ranks on the testbed train a small MLP (0.3M parameters) with many small partitions. Reported:
    the scheduler's own measurement (`dispatch_stats()`: scheduler-thread time per partition
    excluding the backend's launch call, and the launch call itself), and an external estimate:
    the extra step time per extra partition against no partitioning (scheduler + backend + wire).
    """
    kinds = ["sched", "py"] if args.python_twins else ["sched"]
    partitions = args.dispatch_partitions.split(",")
    labels = [f"{kind}:{p},none" for kind in kinds for p in ["none", *partitions]]
    bare_labels = [f"lat:{p}" for p in partitions]  # the bare collectives of those sizes
    bed.set_rate(parse_rate(args.dispatch_rate))
    model_args = json.dumps({"in_features": 256, "hidden": 256, "depth": 4})
    results = run_pair(
        bed,
        "mlp",
        32,
        labels + bare_labels,
        args,
        model_args=model_args,
        rounds=args.dispatch_rounds,
        steps=10,
    )
    rows = summarise(results)
    from benchmarks.testbed.train_worker import RunConfig, lat_collectives

    bare = [
        rows[label]["median_step_s"] / lat_collectives(RunConfig.parse(label).partition_bytes)
        for label in bare_labels
    ]
    by_round: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in results:
        by_round[r["round"]][r["config"]] = r
    # what one bare collective of the probe's partition sizes costs (no scheduler, no compute)
    out: dict[str, Any] = {
        "rate": args.dispatch_rate,
        "configs": {},
        "bare_collective_s": statistics.median(bare),
    }
    for label in labels:
        kind = label.split(":")[0]
        base_label = f"{kind}:none,none"
        mine = [r for r in results if r["config"] == label]
        parts = statistics.median(r["metrics_median"]["partitions"] for r in mine)
        base_parts = statistics.median(
            r["metrics_median"]["partitions"] for r in results if r["config"] == base_label
        )
        sched_us = statistics.median(r["dispatch"]["scheduler_us_per_partition"] for r in mine)
        launch_us = statistics.median(
            r["dispatch"]["backend_launch_us_per_partition"] for r in mine
        )
        extra = parts - base_parts
        # paired within a round against the same path without partitioning, then the median
        per_round = [
            (rounds[label]["median_step_s"] - rounds[base_label]["median_step_s"]) / extra * 1e6
            for rounds in by_round.values()
            if label in rounds and base_label in rounds and extra > 0
        ]
        out["configs"][label] = {
            "hot_path": mine[0].get("hot_path"),
            "partitions_per_step": parts,
            "step_ms": rows[label]["median_step_s"] * 1e3,
            "scheduler_us_per_partition": sched_us,
            "backend_launch_us_per_partition": launch_us,
            "external_us_per_extra_partition": statistics.median(per_round)
            if extra > 0 and per_round
            else None,
        }
    return out


def format_dispatch(d: dict[str, Any]) -> str:
    lines = [
        (
            f"dispatch overhead (2 ranks @ {d['rate']}, MLP 0.3M params, batch 32; a bare "
            f"collective of these sizes: {d.get('bare_collective_s', 0) * 1e6:.0f} us)"
        ),
        (
            f"{'configuration':<22} {'path':>6} {'parts/step':>10} {'step ms':>8} {'sched us/part':>13} "
            f"{'launch us/part':>14} {'extra step us/part':>18}"
        ),
    ]
    for label, row in d["configs"].items():
        ext = row["external_us_per_extra_partition"]
        lines.append(
            f"{label:<22} {row.get('hot_path') or '-':>6} {row['partitions_per_step']:10.0f} "
            f"{row['step_ms']:8.1f} "
            f"{row['scheduler_us_per_partition']:13.1f} "
            f"{row['backend_launch_us_per_partition']:14.1f} "
            f"{(f'{ext:.0f}' if ext is not None else '-'):>18}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,vgg")
    parser.add_argument(
        "--rates",
        default="10gbit,1gbit,300mbit",
        help="link rates; the defaults are compute-bound, balanced, link-bound",
    )
    parser.add_argument(
        "--grid",
        default=DEFAULT_GRID,
        help="partition:credit pairs ('none': no partitioning / unlimited credit)",
    )
    parser.add_argument(
        "--partitions",
        default="",
        help="with --credits: measure their cross product instead of --grid",
    )
    parser.add_argument("--credits", default="")
    parser.add_argument(
        "--batch-sizes", default="", help="e.g. mlp=512,vgg=64 (defaults: balanced at 1gbit)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=8, help="measured steps per configuration per round"
    )
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps after each switch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--sched-group",
        action="store_true",
        help="scheduler on its own gloo group (default: the world group)",
    )
    parser.add_argument("--no-sched", action="store_true", help="DDP and probes only")
    parser.add_argument(
        "--shared",
        default="",
        help="partition:credit pairs also measured with own_communicator=False "
        "(collectives on the default group), paired with the same pairs on the "
        "scheduler's own group, e.g. 1MiB:2MiB,4MiB:none",
    )
    parser.add_argument(
        "--dispatch",
        action="store_true",
        help="also measure the scheduler's dispatch overhead per partition",
    )
    parser.add_argument("--dispatch-only", action="store_true")
    parser.add_argument("--dispatch-partitions", default="16KiB,64KiB")
    parser.add_argument("--dispatch-rate", default="10gbit")
    parser.add_argument("--dispatch-rounds", type=int, default=2)
    parser.add_argument(
        "--python-twins",
        action="store_true",
        help="also run every scheduler configuration on the Python hot path "
        "(py:P,C, native=False), paired with the native path in the same run",
    )
    parser.add_argument("--out", default="", help="write raw results + table as JSON here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with_sched = not args.no_sched and scheduler_available()
    if not args.no_sched and not with_sched:
        print("autobyte.scheduler is not importable: measuring DDP and the probes only", flush=True)
    batch = dict(DEFAULT_BATCH)
    for item in filter(None, args.batch_sizes.split(",")):
        name, value = item.split("=")
        batch[name] = int(value)
    given = list(argv) if argv is not None else sys.argv[1:]
    command = ["python -m benchmarks.bench_scheduler", *given]
    report: dict[str, Any] = {
        "command": " ".join(command),
        "load_before": load_average(),
        "blocks": [],
    }
    started = time.time()
    shared = [tuple(pair.split(":")) for pair in filter(None, args.shared.split(","))]
    grid = parse_grid(args)
    missing = [pair for pair in shared if pair not in grid and pair != ("none", "none")]
    grid += missing  # a shared: twin is always paired with the same configuration on its own group
    labels = [_twin(label) for label in config_labels(grid, with_sched, shared, args.python_twins)]
    rates = [parse_rate(r) for r in args.rates.split(",")]
    with Testbed(world_size=2, rate=rates[0]) as bed:
        if not args.dispatch_only:
            for model in args.models.split(","):
                for rate in rates:
                    bed.set_rate(rate)
                    load = load_average()
                    results = run_pair(bed, model, batch.get(model, 0), labels, args)
                    block = {
                        "model": model,
                        "rate": format_rate(rate),
                        "load": load,
                        "batch_size": batch.get(model),
                        "rows": summarise(results),
                        "own_vs_shared": own_vs_shared(results),
                        "native_vs_python": own_vs_shared(results, "py"),
                        "raw": results,
                    }
                    report["blocks"].append(block)
                    print(f"[{model} @ {format_rate(rate)} done, load {load}]", flush=True)
            report["table"] = format_table(report["blocks"])
            print()
            print(report["table"])
        if (args.dispatch or args.dispatch_only) and with_sched:
            report["dispatch"] = measure_dispatch(bed, args)
            print(format_dispatch(report["dispatch"]))
    report["load_after"] = load_average()
    report["wall_s"] = time.time() - started
    print(
        f"load average before {report['load_before']}, after {report['load_after']}; "
        f"{report['wall_s']:.0f} s"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
