"""Real windows for the predictor: every candidate configuration of the tuner's grid, measured on the
testbed through the real scheduler, with each rank's own StepMetrics (what its reporter streams and
the daemon stores), per (model, condition) block.

    python -m benchmarks.record_windows --models mlp,vgg,resnet,transformer \\
        --conditions quiet rate=10gbit rate=300mbit cpu1=0.5 --rounds 2 --steps 5 --warmup 2 \\
        --out simulator/real-windows.json          # appends its blocks

A block runs, in one training process per rank on a fresh testbed with the condition applied
(`benchmarks.bench_conditions`' conditions and models), the tuner's candidate grid for that model
(`autobyted.tuner.grid.candidate_grid` of the shape the client registers) interleaved round by
round, odd rounds in reverse order, so that drift on the host hits every configuration alike. The
worker runs with `--full-metrics`: every StepMetrics of every measured step, with the host load the
real reporter adds. The dataset keeps rank 0's (the rank whose window the tuner reads) as plain
dicts, the registration shape, the commit, and the load average before and after each block.

`--emulated SCENARIO:RANKS:RATE ...` records the accelerator regime instead (the testbed's
emulated-accelerator ranks, benchmarks/testbed/emulated.py): the `[testbed] mode = "emulated"`
scenario's profile, device and byte scale on RANKS ranks, its links at RATE (Gbit/s in the model's
bytes, or a multiple of the rate at which a ring all-reduce of all gradients takes the compute:
`1x`), constant, with none of the scenario's other conditions. The tuner searches such a job around
the configuration the scheduler derives at `init` (autobyted/tuner/grid.py: TRUST_OCTAVES), not on
the absolute grid, so a block measures `sched:auto` (what it derived becomes the block's `default`,
the reference the tuner predicts from when the job starts) and `--configs` configurations: an
estimate of that start (`estimated_start`: this host's measured per-collective cost) and the rest
drawn, with a seed of the block's own, from the grid the tuner searches around it. Its windows carry each rank's CPU
flags (benchmarks/bench_emulated.py: a configuration whose training thread waited for a CPU is
marked `cpu_limited`, kept, and said).

    python -m benchmarks.record_windows \
        --emulated benchmarks/scenarios/emulated-gpt2-medium-8w.toml:4:0.5x ... \
        --rounds 2 --steps 4 --warmup 1 --configs 10

`simulator.real_windows` reads the dataset into the predictor's Windows (simulator/train_prior.py
trains the prior on them beside the simulator's; benchmarks/predictor_error.py measures the error).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench_conditions import (
    MODELS,
    REPO,
    Condition,
    _commit,
    _save,
    model_spec,
    worker_command,
)
from benchmarks.testbed.host import load_average
from benchmarks.testbed.train_worker import RunConfig
from simulator.real_windows import DATASET_PATH as DEFAULT_OUT
from simulator.real_windows import FORMAT, load_dataset


def model_shape(builder: str, model_args: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The JobShape the daemon builds from this model's registration: the client's own fingerprint
    function (autobyte.transport.session.model_fingerprint) on the model the worker trains."""
    from autobyte.convert import fingerprint_from_proto
    from autobyte.transport.session import model_fingerprint

    from autobyted.tuner.features import JobShape
    from benchmarks.testbed.models import build

    fingerprint = fingerprint_from_proto(
        model_fingerprint(build(builder, **model_args).model.parameters())
    )
    shape = dataclasses.asdict(JobShape.from_fingerprint(world_size, "gloo", fingerprint))
    # the per-collective latency is the cluster's, not the model's: a block's is this host's at its
    # rank count, filled when the dataset is read (simulator/real_windows.py block_shape)
    del shape["collective_latency_s"]
    return shape


def grid_labels(shape: dict[str, Any]) -> list[str]:
    from autobyted.tuner.features import JobShape
    from autobyted.tuner.grid import candidate_grid

    return [
        RunConfig("sched", c.partition_bytes, c.credit_bytes, c.tail_bytes).label
        for c in candidate_grid(JobShape(**shape))
    ]


@dataclasses.dataclass(frozen=True)
class EmulatedBlock:
    """One `--emulated SCENARIO:RANKS:RATE` block."""

    scenario_path: str
    ranks: int
    rate: str  # as given: Gbit/s or a multiple of the balanced rate ("1x")

    @classmethod
    def parse(cls, text: str) -> EmulatedBlock:
        path, _, rest = text.rpartition(":")
        path, _, ranks = path.rpartition(":")
        if not path or not ranks.isdigit() or int(ranks) < 2 or not rest:
            raise ValueError(
                f"--emulated {text!r}: expected SCENARIO.toml:RANKS:RATE, RANKS >= 2, RATE in "
                "Gbit/s or a multiple of the balanced rate (e.g. 1x)"
            )
        if not Path(path).is_file():
            raise ValueError(f"--emulated {text!r}: no scenario file {path}")
        return cls(path, int(ranks), rest)

    def scenario(self) -> Any:
        from benchmarks.harness.scenario import load_scenario

        scenario = load_scenario(self.scenario_path)
        if not scenario.emulated:
            raise ValueError(
                f"--emulated {self.scenario_path}: not an emulated scenario "
                '([testbed] mode = "emulated")'
            )
        return scenario

    def rate_gbit(self, scenario: Any) -> float:
        from benchmarks.bench_emulated import parse_rates

        return parse_rates(self.rate, scenario.profile, self.ranks, 0.0)[0]


def estimated_start(shape: dict[str, Any], wire_rate_bps: float) -> Any:
    """The start the scheduler would derive for `shape` (wire bytes) on links of `wire_rate_bps`,
    with this host's measured gloo per-collective cost at that rank count (the calibration file
    benchmarks/sim_vs_emulated.py reads): the centre of the tuner's search, before the job says."""
    from autobyte.scheduler.start import CollectiveCost, derive

    from simulator.links import collective_cost_s

    ranks = int(shape["world_size"])
    per_byte = 2 * (ranks - 1) / ranks / (wire_rate_bps / 8)
    return derive(int(shape["parameter_bytes"]), CollectiveCost(collective_cost_s(ranks), per_byte))


def emulated_labels(
    shape: dict[str, Any], wire_rate_bps: float, count: int, seed: str
) -> list[str]:
    """`sched:auto` and `count` configurations: the estimated start and `count` - 1 drawn (seeded by
    `seed`) from the grid the tuner searches around it."""
    from autobyted.tuner.features import JobShape
    from autobyted.tuner.grid import candidate_grid

    start = estimated_start(shape, wire_rate_bps)
    grid = [c for c in candidate_grid(JobShape(**shape), starting=start) if c != start]
    drawn = random.Random(seed).sample(grid, min(len(grid), max(0, count - 1)))
    return ["sched:auto"] + [
        RunConfig("sched", c.partition_bytes, c.credit_bytes, c.tail_bytes).label
        for c in [start, *drawn]
    ]


def measure_emulated_block(block: EmulatedBlock, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.bench_emulated import _worker_command, summarise
    from benchmarks.harness.scenario import GBIT
    from benchmarks.testbed import Testbed

    scenario = block.scenario()
    workload = scenario.testbed_workload(block.ranks)
    shape = model_shape(workload.model, workload.model_args, block.ranks)
    rate_gbit = block.rate_gbit(scenario)
    wire_rate_bps = int(rate_gbit * GBIT * 8 / scenario.byte_scale)
    name = Path(block.scenario_path).stem
    labels = emulated_labels(
        shape, wire_rate_bps, args.configs, f"{name}:{block.ranks}:{block.rate}"
    )
    load = load_average()
    started = time.time()
    with Testbed(world_size=block.ranks, rate=wire_rate_bps) as bed:
        result = bed.run(
            [
                *_worker_command(
                    scenario, block.ranks, labels, args.rounds, args.steps, args.warmup
                ),
                "--full-metrics",
            ],
            cwd=str(REPO),
            timeout_s=args.timeout,
        )
    rows = summarise(labels, labels, [rank.results for rank in result.ranks], _cores(), "median")
    flags = {row["config"]: row["cpu_limited"] for row in rows}
    windows = _windows(result.ranks[0].results)
    by_label = {RunConfig.parse(label).label: label for label in labels}
    for window in windows:  # the label as given (sched:auto), its flags
        window["label"] = by_label.get(window["label"], window["label"])
        window["cpu_limited"] = flags.get(window["label"], [])
    derived = [w["config"] for w in windows if w["label"] == "sched:auto"]
    return {
        "model": scenario.profile.name,
        "builder": workload.model,
        "model_args": workload.model_args,
        "batch_size": workload.batch_size,
        "condition": f"rate={block.rate}",
        "condition_spec": {"rate_gbit": rate_gbit, "constant": True},
        "world_size": block.ranks,
        "rate": f"{wire_rate_bps}bit",
        "emulated": {
            "scenario": block.scenario_path,
            "byte_scale": scenario.byte_scale,
            "compute_s": scenario.profile.compute_s,
            "rate_gbit": rate_gbit,
            "wire_rate_bps": wire_rate_bps,
        },
        "shape": shape,
        "configs": labels,
        "default": derived[0] if derived else None,
        **_measured(load, started, args, windows),
    }


def _measured(
    load: Any, started: float, args: argparse.Namespace, windows: list[dict[str, Any]]
) -> dict[str, Any]:
    """What every block records of its run: the load before and after, the time, the plan, the
    windows."""
    return {
        "load": load,
        "load_after": load_average(),
        "wall_s": round(time.time() - started, 1),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "windows": windows,
    }


def _cores() -> int:
    import os

    return os.cpu_count() or 1


def _windows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's scheduler results as the dataset's windows ([P, C] or [P, C, T] with a tail)."""
    windows = []
    for item in results:
        if item.get("kind") != "sched" or not item.get("metrics"):
            continue
        config = [item["partition_bytes"], item["credit_bytes"]]
        if item.get("tail_bytes") is not None:
            config.append(item["tail_bytes"])
        windows.append(
            {
                "round": item["round"],
                "label": item["config"],
                "config": config,
                "step_times_s": item["step_times_s"],
                "metrics": item.get("metrics", []),
            }
        )
    return windows


def measure_block(model: str, condition: Condition, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.testbed import Testbed

    spec = model_spec(model, args)
    shape = model_shape(spec.builder, spec.model_args, condition.ranks)
    labels = grid_labels(shape)
    rate = condition.base_rate(args.rate)
    load = load_average()
    started = time.time()
    with Testbed(world_size=condition.ranks, rate=rate, pin_cpus=condition.cpus()) as bed:
        condition.apply(bed)
        result = bed.run(
            [*worker_command(spec, labels, args), "--full-metrics"],
            cwd=str(REPO),
            timeout_s=args.timeout,
        )
    windows = _windows(result.ranks[0].results)
    return {
        "model": model,
        "builder": spec.builder,
        "model_args": spec.model_args,
        "batch_size": spec.batch_size,
        "condition": condition.name,
        "condition_spec": condition.as_dict(),
        "world_size": condition.ranks,
        "rate": rate,
        "shape": shape,
        **_measured(load, started, args, windows),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.record_windows", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--models", default="mlp,vgg,resnet,transformer", help=f"from {sorted(MODELS)}"
    )
    parser.add_argument("--conditions", nargs="+", default=["quiet"])
    parser.add_argument("--rate", default="1gbit", help="base link rate")
    parser.add_argument("--batch-size", type=int, default=0, help="0: the model's map batch size")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="append blocks to this JSON file")
    parser.add_argument(
        "--emulated",
        nargs="+",
        default=[],
        metavar="SCENARIO:RANKS:RATE",
        help="record emulated-accelerator blocks instead of --models x --conditions",
    )
    parser.add_argument(
        "--configs", type=int, default=10, help="--emulated: configurations a block measures"
    )
    args = parser.parse_args(argv)
    try:
        args.emulated = [EmulatedBlock.parse(text) for text in args.emulated]
        for block in args.emulated:
            block.rate_gbit(block.scenario())
    except ValueError as error:
        parser.error(str(error))
    if args.configs < 2:
        parser.error(f"--configs {args.configs}: at least 2 (sched:auto and one to compare)")
    for model in args.models.split(","):
        if model not in MODELS:
            parser.error(f"unknown model {model!r}; choose from {sorted(MODELS)}")
    for text in args.conditions:
        try:
            Condition.parse(text)
        except ValueError as error:
            parser.error(str(error))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    given = list(argv) if argv is not None else sys.argv[1:]
    out = Path(args.out)
    data = _load_or_new(out)
    chunk = {
        "command": " ".join(["python -m benchmarks.record_windows", *given]),
        "load_before": load_average(),
        "started": time.time(),
        "commit": _commit(),
    }
    data["chunks"].append(chunk)
    jobs = (
        [(f"{b.scenario_path}:{b.ranks}:{b.rate}", b) for b in args.emulated]
        if args.emulated
        else [
            (f"{model} {text}", (model, text))
            for model in args.models.split(",")
            for text in args.conditions
        ]
    )
    for name, job in jobs:
        if isinstance(job, EmulatedBlock):
            block = measure_emulated_block(job, args)
        else:
            block = measure_block(job[0], Condition.parse(job[1]), args)
        block["commit"] = chunk["commit"]
        data["blocks"].append(block)
        chunk.update(load_after=load_average(), wall_s=round(time.time() - chunk["started"], 1))
        _save(out, data)
        steps = [
            statistics.median(w["step_times_s"]) for w in block["windows"] if w["step_times_s"]
        ]
        print(
            f"{name}: {len(block['windows'])} windows, step {min(steps):.3f}-{max(steps):.3f} s, "
            f"load {block['load']} -> {block['load_after']}, {block['wall_s']} s",
            flush=True,
        )
    return 0


def _load_or_new(path: Path) -> dict[str, Any]:
    try:
        return (
            load_dataset(path) if path.exists() else {"format": FORMAT, "chunks": [], "blocks": []}
        )
    except ValueError as error:
        raise SystemExit(str(error)) from None


if __name__ == "__main__":
    sys.exit(main())
