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

`simulator.real_windows` reads the dataset into the predictor's Windows (simulator/train_prior.py
trains the prior on them beside the simulator's; benchmarks/predictor_error.py measures the error).
"""

from __future__ import annotations

import argparse
import dataclasses
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
    return dataclasses.asdict(JobShape.from_fingerprint(world_size, "gloo", fingerprint))


def grid_labels(shape: dict[str, Any]) -> list[str]:
    from autobyted.tuner.features import JobShape
    from autobyted.tuner.grid import candidate_grid

    return [
        RunConfig("sched", c.partition_bytes, c.credit_bytes, c.tail_bytes).label
        for c in candidate_grid(JobShape(**shape))
    ]


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
    windows = []
    for item in result.ranks[0].results:
        if item.get("kind") != "sched":
            continue
        config = [
            item["partition_bytes"],
            item["credit_bytes"],
        ]  # [P, C] or [P, C, T] with a tail window
        if item.get("tail_bytes") is not None:
            config.append(item["tail_bytes"])
        windows.append(
            {
                "round": item["round"],
                "config": config,
                "step_times_s": item["step_times_s"],
                "metrics": item.get("metrics", []),
            }
        )
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
        "load": load,
        "load_after": load_average(),
        "wall_s": round(time.time() - started, 1),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "windows": windows,
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
    args = parser.parse_args(argv)
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
    for model in args.models.split(","):
        for text in args.conditions:
            block = measure_block(model, Condition.parse(text), args)
            block["commit"] = chunk["commit"]
            data["blocks"].append(block)
            chunk.update(load_after=load_average(), wall_s=round(time.time() - chunk["started"], 1))
            _save(out, data)
            steps = [
                statistics.median(w["step_times_s"]) for w in block["windows"] if w["step_times_s"]
            ]
            print(
                f"{model} {text}: {len(block['windows'])} windows, step {min(steps):.3f}-{max(steps):.3f} s, "
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
