"""The optimum map: a configuration grid's step times per (model, condition), measured on the testbed.

    python -m benchmarks.bench_conditions --models mlp,vgg \\
        --conditions quiet cpu1=0.5 busy1=1 flows1=1 rate1=300mbit rate=10gbit \\
        --rounds 3 --out benchmarks/calibration/optimum-map.json          # appends its blocks
    python -m benchmarks.bench_conditions --report benchmarks/calibration/optimum-map.json
    python -m benchmarks.bench_conditions --models mlp --mixed "quiet|flows1=1" \\
        --phase-steps 20 --cycles 6 --out results/mixed.json             # a mixed trace, measured

A condition is a `+`-joined list of settings (its text is its name):

    quiet            nothing besides the base rate (--rate, default 1gbit)
    rate=R           every link at R (e.g. 10gbit);   rateK=R   rank K's link only (a straggler)
    cpu=S / cpuK=S   a cgroup CPU quota of S cores on every rank / on rank K (a busy worker)
    busy=N / busyK=N N busy-loop processes in every rank's / rank K's namespace (a busy host:
                     on this 2-core machine they take CPU from every rank)
    flows=N/flowsK=N N competing TCP flows each way through every link / rank K's link
    dir=in|out|both  direction of those flows (default both)
    ranks=N          N ranks instead of 2 (more than 2 oversubscribe this 2-core machine)
    pin=1            rank r (with its busy loops and traffic sources) pinned to CPU r mod 2: one
                     "node" per core, so busy1=1 then shares rank 1's core only

Per block a fresh testbed with the condition applied runs, in one training process per rank, every
grid configuration and the probes interleaved round by round (as `bench_scheduler` does, so drift
hits all alike; odd rounds in reverse order, so that a load rising within a round does too): `compute` (no sync; every rank's own time is kept), `comm` (bare all-reduce of
all gradients), `lat`, `lat:256KiB`, `lat:2MiB` (all-reduces of 4 KiB, 256 KiB, 2 MiB back to back:
what one collective of that size costs under the condition). The block records the load average, the CPU time the condition's own processes used
(traffic sources and sinks), and every round's median per configuration. `--out` appends blocks to
a JSON file after each one, so a long map is measured in chunks (one command per model) under the
exclusive lock; `--report` prints the summary, the ratio matrix and the headroom table from it.

`--mixed "A|B"` measures a mixed trace directly: one run in which the condition switches A, B, A, B,
... every `--phase-steps` steps (a step-based trace), while the worker runs, cycle after cycle,
alternately the best static configuration and the per-phase best (both from the map, or given with
--static and --per-phase) — paired, interleaved — and reports the measured headroom.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import optimum
from benchmarks.testbed import Testbed, Trace, parse_rate, worker_cli
from benchmarks.testbed.host import load_average
from benchmarks.testbed.train_worker import LAT_PROBE_BYTES, RunConfig, lat_collectives

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    builder: str
    model_args: dict[str, Any]
    batch_size: int


# Sizes that put compute and communication of the same order at 1gbit on this 2-core machine.
MODELS = {
    "mlp": ModelSpec("mlp", {}, 512),  # 6.8M params in 16 tensors (few large ones)
    "vgg": ModelSpec("vgg", {}, 64),  # 3.6M params in 22 tensors
    # ResNet-50's 161 tensors at half width on 32x32 images: 5.9M params, 152 tensors < 1 MiB
    "resnet": ModelSpec("resnet50", {"width": 0.5, "image_size": 32, "classes": 10}, 32),
    "transformer": ModelSpec("transformer", {}, 16),  # 5.5M params in 57 tensors
}

# ≥ 8 configurations: DDP, no partitioning with unlimited credit, small partitions with a credit of
# two to four partitions (priority matters), large partitions with unlimited credit (few
# collectives: what wins when each collective is expensive).
DEFAULT_GRID = (
    "ddp",
    "sched:none,none",
    "sched:512KiB,1MiB",
    "sched:1MiB,2MiB",
    "sched:1MiB,4MiB",
    "sched:2MiB,8MiB",
    "sched:4MiB,8MiB",
    "sched:4MiB,none",
    "sched:16MiB,32MiB",
    "sched:16MiB,none",
)
PROBE_LABELS = ("compute", "comm", "lat", "lat:256KiB", "lat:2MiB")
# --probes-only adds the same collectives issued beside a compute step (CPU busy, as in training)
BUSY_PROBE_LABELS = ("latc", "latc:256KiB", "latc:2MiB")


@dataclasses.dataclass(frozen=True)
class Condition:
    """A testbed condition (see the module docstring for the text form)."""

    name: str
    rate: str | None = None
    rank_rates: tuple[tuple[int, str], ...] = ()
    cpu: tuple[tuple[int | None, float], ...] = ()
    busy: tuple[tuple[int | None, int], ...] = ()
    flows: tuple[tuple[int | None, int], ...] = ()
    direction: str = "both"
    ranks: int = 2
    pin: bool = False

    @classmethod
    def parse(cls, text: str) -> Condition:
        fields: dict[str, Any] = {"rank_rates": [], "cpu": [], "busy": [], "flows": []}
        for token in filter(None, text.strip().split("+")):
            if token == "quiet":
                continue
            match = re.fullmatch(r"([a-z]+)(\d*)=([\w.]+)", token)
            if not match:
                raise ValueError(
                    f"condition {text!r}: cannot read {token!r} (e.g. cpu1=0.5, "
                    "flows1=1, rate1=300mbit, busy=1, rate=10gbit, ranks=4)"
                )
            key, rank_text, value = match.groups()
            rank = int(rank_text) if rank_text else None
            if key == "rate":
                parse_rate(value)
                if rank is None:
                    fields["rate"] = value
                else:
                    fields["rank_rates"].append((rank, value))
            elif key == "cpu":
                fields["cpu"].append((rank, float(value)))
            elif key in ("busy", "flows"):
                fields[key].append((rank, int(value)))
            elif key == "dir" and rank is None and value in ("in", "out", "both"):
                fields["direction"] = value
            elif key == "ranks" and rank is None and int(value) >= 2:
                fields["ranks"] = int(value)
            elif key == "pin" and rank is None and value in ("0", "1"):
                fields["pin"] = value == "1"
            else:
                raise ValueError(f"condition {text!r}: unknown setting {token!r}")
        condition = cls(
            text.strip(), **{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        )
        for rank, _ in (*condition.rank_rates, *condition.cpu, *condition.busy, *condition.flows):
            if rank is not None and not 0 <= rank < condition.ranks:
                raise ValueError(f"condition {text!r}: rank {rank} not in [0, {condition.ranks})")
        return condition

    def cpus(self) -> list[int] | None:
        return sorted(os.sched_getaffinity(0)) if self.pin else None

    def base_rate(self, default: str) -> str:
        return self.rate or default

    def apply(self, bed: Testbed) -> None:
        for rank, rate in self.rank_rates:
            bed.set_rate(rate, [rank])
        for rank, share in self.cpu:
            bed.set_cpu_share(share, None if rank is None else [rank])
        for rank, count in self.busy:
            bed.set_busy(count, None if rank is None else [rank])
        for rank, count in self.flows:
            bed.set_flows(count, None if rank is None else [rank], self.direction)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def trace(self, at_step: int) -> Trace:
        """This condition's changes as a step-based trace (rates of the straggler links included;
        the base rate is the testbed's)."""
        changes = Trace()
        for rank, rate in self.rank_rates:
            changes += Trace.from_steps([(at_step, rate)], ranks=[rank])
        for rank, share in self.cpu:
            changes += Trace.cpu_share([(at_step, share)], None if rank is None else [rank], "step")
        for rank, count in self.busy:
            changes += Trace.busy([(at_step, count)], None if rank is None else [rank], "step")
        for rank, count in self.flows:
            changes += Trace.flows(
                [(at_step, count)], None if rank is None else [rank], self.direction, "step"
            )
        return changes

    def undo_trace(self, at_step: int, base_rate: str) -> Trace:
        """Step-based trace that lifts this condition (back to `base_rate` everywhere, quiet)."""
        changes = Trace()
        for rank, _ in self.rank_rates:
            changes += Trace.from_steps([(at_step, base_rate)], ranks=[rank])
        for rank, _ in self.cpu:
            changes += Trace.cpu_share([(at_step, None)], None if rank is None else [rank], "step")
        for rank, _ in self.busy:
            changes += Trace.busy([(at_step, 0)], None if rank is None else [rank], "step")
        for rank, _ in self.flows:
            changes += Trace.flows(
                [(at_step, 0)], None if rank is None else [rank], self.direction, "step"
            )
        return changes


def model_spec(model: str, args: argparse.Namespace) -> ModelSpec:
    spec = MODELS[model]
    return dataclasses.replace(spec, batch_size=args.batch_size) if args.batch_size else spec


def worker_command(spec: ModelSpec, labels: Sequence[str], args: argparse.Namespace) -> list[str]:
    return worker_cli.command(
        model=spec.builder,
        model_args=dict(spec.model_args),
        batch_size=spec.batch_size,
        rounds=args.rounds,
        steps=args.steps,
        warmup=args.warmup,
        threads=1,
        abba=True,
        configs=list(labels),
    )


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise_block(results_by_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """rows (median over rounds of each configuration's median step), per_round medians, ratios to
    DDP paired per round, and the probes (compute per rank, comm, per-collective latency)."""
    rank0 = results_by_rank[0]
    labels = list(dict.fromkeys(r["config"] for r in rank0))
    per_round: dict[str, list[float]] = {label: [] for label in labels}
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for result in rank0:
        per_round[result["config"]].append(result["median_step_s"])
        by_round.setdefault(result["round"], {})[result["config"]] = result
    rows = {}
    for label in labels:
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
            "median_step_s": statistics.median(per_round[label]),
            "ratio_vs_ddp": _median_or_none(ratios),
            "exposed_comm_s": _median_or_none(exposed),
            "rounds": len(per_round[label]),
        }
    compute_per_rank = [
        _median_or_none([r["median_step_s"] for r in results if r["config"] == "compute"])
        for results in results_by_rank
    ]
    collective_s = {}  # probe size in bytes -> seconds per collective
    collective_busy_s = {}  # the same beside a compute step
    for label in labels:
        if label.split(":")[0] not in ("lat", "latc"):
            continue
        config = RunConfig.parse(label)
        size = str(config.partition_bytes)
        if config.kind == "lat":
            collective_s[size] = rows[label]["median_step_s"] / lat_collectives(int(size))
        elif config.kind == "latc":
            collective_busy_s[size] = statistics.median(
                r["collective_s"] for r in rank0 if r["config"] == label and "collective_s" in r
            )
    probes = {
        "compute_s_per_rank": compute_per_rank,
        "compute_s": rows.get("compute", {}).get("median_step_s"),
        "comm_s": rows.get("comm", {}).get("median_step_s"),
        "collective_s": collective_s,
        "collective_busy_s": collective_busy_s,
        "lat_s_per_collective": collective_s.get(str(LAT_PROBE_BYTES)),
    }
    # compute + backward while all-reduces ran (the scheduler's own metrics), per configuration
    under_comm = {}
    for label in labels:
        mine = [r for r in rank0 if r["config"] == label and r.get("metrics_median")]
        if mine:
            under_comm[label] = statistics.median(
                r["metrics_median"]["forward_s"]
                + r["metrics_median"]["backward_s"]
                - (r.get("exposed_comm_s") or 0.0)
                for r in mine
            )
    probes["compute_under_comm_s"] = under_comm
    return {"rows": rows, "per_round": per_round, "probes": probes}


def _slim(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in ("metrics",)}


def measure_block(model: str, condition: Condition, args: argparse.Namespace) -> dict[str, Any]:
    spec = model_spec(model, args)
    labels = (
        [*PROBE_LABELS, *BUSY_PROBE_LABELS] if args.probes_only else [*PROBE_LABELS, *args.grid]
    )
    rate = condition.base_rate(args.rate)
    load = load_average()
    started = time.time()
    with Testbed(world_size=condition.ranks, rate=rate, pin_cpus=condition.cpus()) as bed:
        condition.apply(bed)
        before = _link_bytes(bed)
        result = bed.run(worker_command(spec, labels, args), cwd=str(REPO), timeout_s=args.timeout)
        after = _link_bytes(bed)
        condition_cpu = bed.condition_cpu_s()
        throttled = {
            r: bed.cpu_throttled(r) for r in range(condition.ranks) if bed.cpu_shares[r] is not None
        }
    wall = time.time() - started
    block = {
        "model": model,
        "builder": spec.builder,
        "model_args": spec.model_args,
        "batch_size": spec.batch_size,
        "condition": condition.name,
        "condition_spec": condition.as_dict(),
        "world_size": condition.ranks,
        "rate": rate,
        "load": load,
        "load_after": load_average(),
        "wall_s": round(wall, 1),
        "condition_cpu_s": condition_cpu,
        # the condition's own processes (traffic, busy loops) in cores, over the block
        "condition_cores": {k: round(v / wall, 4) for k, v in condition_cpu.items()},
        "cpu_throttled": throttled,
        # mean Mbit/s over the run of every rank link, out of the rank (tx) and into it (rx)
        "link_mbit": {
            key: [
                round((a - b) * 8 / (after["t"] - before["t"]) / 1e6, 1)
                for a, b in zip(after[key], before[key])
            ]
            for key in ("tx", "rx")
        },
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    block.update(summarise_block([rank.results for rank in result.ranks]))
    block["raw"] = [_slim(r) for r in result.ranks[0].results]
    return block


def _link_bytes(bed: Testbed) -> dict[str, Any]:
    return {
        "t": time.monotonic(),
        "tx": [bed.link_tx_bytes(r) for r in range(bed.world_size)],
        "rx": [bed.link_rx_bytes(r) for r in range(bed.world_size)],
    }


def format_block(block: dict[str, Any]) -> str:
    rows, probes = block["rows"], block["probes"]
    times = optimum.step_times(block)
    fastest = min(times.values(), default=1.0)
    lines = [
        (
            f"{block['model']} | {block['condition']} | {block['world_size']} ranks | "
            f"{block['rate']} | load {block['load']} -> {block['load_after']} | "
            f"{block['wall_s']:.0f} s"
        )
    ]
    for label in optimum.configs_of(block):
        row = rows[label]
        ratio = row["ratio_vs_ddp"]
        lines.append(
            f"  {label:<20} {row['median_step_s'] * 1e3:8.1f} ms  x DDP "
            f"{(f'{ratio:.2f}' if ratio else '-'):>5}  / best "
            f"{row['median_step_s'] / fastest:6.3f}"
        )
    compute = ", ".join(f"{c * 1e3:.0f}" for c in probes["compute_s_per_rank"] if c)
    lat = ", ".join(
        f"{int(size) >> 10} KiB {value * 1e3:.2f}" for size, value in probes["collective_s"].items()
    )
    lines.append(
        f"  probes: compute per rank {compute} ms, comm "
        f"{(probes['comm_s'] or 0) * 1e3:.0f} ms, per collective {lat} ms; "
        f"condition processes {block['condition_cores']} "
        f"cores; link Mbit/s tx {block['link_mbit']['tx']} rx {block['link_mbit']['rx']}"
    )
    busy = ", ".join(
        f"{int(size) >> 10} KiB {value * 1e3:.2f}"
        for size, value in probes.get("collective_busy_s", {}).items()
    )
    if busy:
        lines.append(f"  per collective beside compute: {busy} ms")
    if times:
        lines.append(f"  best: {optimum.best(times)}")
    return "\n".join(lines)


def _load(path: Path) -> dict[str, Any]:
    if path.exists():
        return json.loads(path.read_text())
    return {"format": "autobyte optimum map v1", "chunks": [], "blocks": []}


def _save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def report(path: Path, max_phases: int, limit: int | None) -> str:
    data = _load(path)
    blocks = optimum.latest_blocks(data)
    parts = ["commands:"] + [
        f"  {c['command']}  (load {c['load_before']} -> "
        f"{c.get('load_after')}, {c.get('wall_s', 0):.0f} s)"
        for c in data["chunks"]
    ]
    parts += [
        "",
        optimum.format_summary(blocks),
        "",
        optimum.format_ratio_matrix(blocks),
        optimum.format_headrooms(optimum.all_headrooms(blocks, max_phases), limit),
        "",
        (
            "one configuration for every condition of a model (step time / the condition's "
            "best: worst case and geometric mean over the conditions)"
        ),
        optimum.format_one_for_all(optimum.one_for_all(blocks)),
        "",
        "busy worker: a CPU quota or a busy process (which ranks does it slow?)",
        optimum.format_busy_worker(blocks),
    ]
    return "\n".join(parts)


# ---- mixed traces, measured directly -------------------------------------------------------------


def mixed_plan(
    static: str, per_phase: Sequence[str], phase_steps: int, cycles: int
) -> list[dict[str, Any]]:
    """Schedule of configurations: cycle k runs the static configuration (k even) or the per-phase
    best (k odd); every phase is its own segment under both, so both pay the same switches."""
    schedule = []
    phases = len(per_phase)
    for cycle in range(cycles):
        for phase in range(phases):
            at = (cycle * phases + phase) * phase_steps
            config = static if cycle % 2 == 0 else per_phase[phase]
            schedule.append({"at_step": at, "config": config})
    return schedule


def mixed_trace(
    conditions: Sequence[Condition],
    phase_steps: int,
    cycles: int,
    default_rate: str,
    offset_steps: int,
) -> Trace:
    """Condition of phase p from step offset + (k * phases + p) * phase_steps (steps count from 1
    in the worker's step events, so phase boundaries land between the schedule's segments). Where
    the conditions' base rates differ (`rate=R` in some), every phase start also sets every link
    to its condition's base rate (`default_rate` where it names none)."""
    trace = Trace()
    phases = len(conditions)
    rates_move = len({c.base_rate(default_rate) for c in conditions}) > 1
    for cycle in range(cycles):
        for phase, condition in enumerate(conditions):
            at = offset_steps + (cycle * phases + phase) * phase_steps
            if cycle == 0 and phase == 0:
                continue  # applied before the run starts
            rate = condition.base_rate(default_rate)
            if rates_move:
                trace += Trace.from_steps([(at, rate)])
            trace += conditions[phase - 1].undo_trace(at, rate)
            trace += condition.trace(at)
    return trace


def measure_mixed(
    model: str,
    conditions: Sequence[Condition],
    static: str,
    per_phase: Sequence[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    spec = model_spec(model, args)
    ranks = {c.ranks for c in conditions}
    if len(ranks) != 1:
        raise SystemExit("the conditions of a mixed trace must have the same number of ranks")
    if len({c.pin for c in conditions}) != 1:
        raise SystemExit("the conditions of a mixed trace must all pin ranks or none")
    base_rate = conditions[0].base_rate(args.rate)  # the others' rates: set by the trace
    steps = args.phase_steps * len(conditions) * args.cycles
    schedule = mixed_plan(static, per_phase, args.phase_steps, args.cycles)
    # step events count from 1: the trace switches when rank 0 reports the last step of a phase,
    # which is when the next segment (the next phase's configuration) begins
    trace = mixed_trace(conditions, args.phase_steps, args.cycles, args.rate, offset_steps=0)
    load = load_average()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="abmixed-") as tmp:
        schedule_path = Path(tmp) / "schedule.json"
        schedule_path.write_text(json.dumps(schedule))
        command = worker_cli.command(
            model=spec.builder,
            model_args=dict(spec.model_args),
            batch_size=spec.batch_size,
            threads=1,
            schedule=schedule_path,
            steps=steps,
        )
        with Testbed(world_size=ranks.pop(), rate=base_rate, pin_cpus=conditions[0].cpus()) as bed:
            conditions[0].apply(bed)
            result = bed.run(command, trace=trace, cwd=str(REPO), timeout_s=args.timeout)
            condition_cpu = bed.condition_cpu_s()
    segments = result.ranks[0].results
    phases = len(conditions)
    cycle_s: dict[str, list[float]] = {"static": [], "per_phase": []}
    phase_s: dict[str, list[list[float]]] = {"static": [], "per_phase": []}
    for cycle in range(args.cycles):
        mine = segments[cycle * phases : (cycle + 1) * phases]
        if len(mine) < phases:
            break
        # the first steps of a phase carry the switch (both policies alike): keep them
        kind = "static" if cycle % 2 == 0 else "per_phase"
        cycle_s[kind].append(sum(sum(s["step_times_s"]) for s in mine))
        phase_s[kind].append([sum(s["step_times_s"]) for s in mine])
    pairs = list(zip(cycle_s["static"][1:], cycle_s["per_phase"][1:]))  # cycle 0/1 warm up
    ratios = [a / b for a, b in pairs]
    return {
        "model": model,
        "conditions": [c.name for c in conditions],
        "phase_steps": args.phase_steps,
        "cycles": args.cycles,
        "static": static,
        "per_phase": list(per_phase),
        "load": load,
        "load_after": load_average(),
        "wall_s": round(time.time() - started, 1),
        "condition_cpu_s": condition_cpu,
        "cycle_s": cycle_s,
        "phase_s": phase_s,
        "paired_ratios": ratios,
        "headroom_measured": (statistics.median(ratios) - 1.0) if ratios else None,
        "condition_log": result.condition_log,
        "rate_log": result.rate_log,
    }


def _commit() -> str:
    """The checkout's commit (+ "-dirty" with uncommitted changes): which scheduler was measured."""
    import subprocess

    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            text=True,
            capture_output=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            text=True,
            capture_output=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{'-dirty' if dirty else ''}" if head else "unknown"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_conditions", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--models", default="mlp,vgg", help=f"from {sorted(MODELS)}")
    parser.add_argument("--conditions", nargs="+", default=["quiet"])
    parser.add_argument("--rate", default="1gbit", help="base link rate")
    parser.add_argument("--grid", nargs="+", default=list(DEFAULT_GRID))
    parser.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="0: the model's map batch size (smoke tests use a small one)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--out", default="", help="append blocks to this JSON file")
    parser.add_argument("--report", default="", help="print the tables of this map and exit")
    parser.add_argument(
        "--max-phases",
        type=int,
        default=2,
        help="--report: mixed traces of up to this many conditions",
    )
    parser.add_argument("--limit", type=int, default=0, help="--report: headroom rows shown")
    parser.add_argument(
        "--probes-only",
        action="store_true",
        help="measure only the probes (with the collectives beside compute, "
        "latc) per (model, condition), into the map's probe_blocks",
    )
    parser.add_argument(
        "--dispatch",
        action="store_true",
        help="also measure the scheduler's cost per partition (bench_scheduler's "
        "dispatch probe, 2 ranks at 10gbit) into the map",
    )
    parser.add_argument("--mixed", default="", help='"A|B": measure this mixed trace directly')
    parser.add_argument(
        "--map",
        default="benchmarks/calibration/optimum-map.json",
        help="--mixed: the map the static and per-phase choices come from",
    )
    parser.add_argument("--static", default="", help="--mixed: the static configuration")
    parser.add_argument("--per-phase", default="", help="--mixed: per-phase configurations, '|'")
    parser.add_argument("--phase-steps", type=int, default=20)
    parser.add_argument("--cycles", type=int, default=6, help="--mixed: even: half static")
    args = parser.parse_args(argv)
    for model in args.models.split(","):
        if model not in MODELS:
            parser.error(f"unknown model {model!r}; choose from {sorted(MODELS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(report(Path(args.report), args.max_phases, args.limit or None))
        return 0
    given = list(argv) if argv is not None else sys.argv[1:]
    command = " ".join(["python -m benchmarks.bench_conditions", *given])
    chunk = {
        "command": command,
        "load_before": load_average(),
        "started": time.time(),
        "commit": _commit(),
    }
    if args.mixed:
        conditions = [Condition.parse(text) for text in args.mixed.split("|")]
        model = args.models.split(",")[0]
        static, per_phase = args.static, args.per_phase.split("|") if args.per_phase else []
        if not static or not per_phase:
            blocks = {
                (b["model"], b["condition"]): b
                for b in optimum.latest_blocks(_load(Path(args.map)))
            }
            item = optimum.headroom([blocks[(model, c.name)] for c in conditions])
            static, per_phase = static or item["static"], per_phase or item["per_phase"]
            print(
                f"from the map: headroom {item['headroom'] * 100:.1f}% "
                f"(cv {item['headroom_cv'] * 100:.1f}%), static {static}, per phase "
                f"{' / '.join(per_phase)}"
            )
        result = measure_mixed(model, conditions, static, per_phase, args)
        result["command"] = command
        result["commit"] = chunk["commit"]
        print(
            json.dumps(
                {
                    k: result[k]
                    for k in (
                        "conditions",
                        "static",
                        "per_phase",
                        "paired_ratios",
                        "headroom_measured",
                        "load",
                        "load_after",
                        "wall_s",
                    )
                }
            )
        )
        if args.out:
            out = Path(args.out)
            data = json.loads(out.read_text()) if out.exists() else {"mixed": []}
            data.setdefault("mixed", []).append(result)
            _save(out, data)
        return 0
    conditions = [Condition.parse(text) for text in args.conditions]
    out = Path(args.out) if args.out else None
    data = _load(out) if out else None
    if data is not None:
        data["chunks"].append(chunk)
    if args.dispatch:
        from benchmarks.bench_scheduler import format_dispatch, measure_dispatch

        probe_args = argparse.Namespace(
            dispatch_partitions="16KiB,64KiB",
            dispatch_rate="10gbit",
            warmup=args.warmup,
            threads=1,
            sched_group=False,
            timeout=args.timeout,
        )
        with Testbed(world_size=2, rate="10gbit") as bed:
            dispatch = measure_dispatch(bed, probe_args)
        dispatch["load"] = chunk["load_before"]
        print(format_dispatch(dispatch), flush=True)
        if out is not None and data is not None:
            data["dispatch"] = dispatch
            _save(out, data)
    for model in args.models.split(","):
        for condition in conditions:
            block = measure_block(model, condition, args)
            block["commit"] = chunk["commit"]
            print(format_block(block), flush=True)
            if out is not None and data is not None:
                data.setdefault("probe_blocks" if args.probes_only else "blocks", []).append(block)
                chunk.update(load_after=load_average(), wall_s=time.time() - chunk["started"])
                _save(out, data)
    print(
        f"load average before {chunk['load_before']}, after {load_average()}; "
        f"{time.time() - chunk['started']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
