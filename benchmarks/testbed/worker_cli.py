"""The command line of the testbed's rank program (benchmarks/testbed/train_worker.py): its parser, and the
one builder of the command that runs it (`command`), for every harness that launches ranks. No
torch here: a harness builds commands without importing the rank program."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def command(*args: str, **options: Any) -> list[str]:
    """The command line that runs this program, for Testbed.run: [python, -m, this module, *args,
    then --option VALUE for each keyword] (model_args -> --model-args; True: the bare flag; a list
    or tuple: its values after one --option; a dict: JSON; None or False: left out). Checked here
    against the program's own parser, so a misspelt option fails where it is written."""
    argv = list(args)
    for name, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    parser().parse_args(argv)  # SystemExit naming a bad option or value
    return [sys.executable, "-m", "benchmarks.testbed.train_worker", *argv]


def parser() -> argparse.ArgumentParser:
    """The rank program's command line (benchmarks/testbed/train_worker.py's docstring says what runs)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.testbed.train_worker",
        description="One training rank for the testbed: runs a plan of (configuration, steps) "
        "segments, prints JSON.",
    )
    parser.add_argument("--model", default="mlp")
    parser.add_argument(
        "--model-args", default="", help="JSON keyword arguments for the model builder"
    )
    parser.add_argument("--batch-size", type=int, default=0, help="0: the model's default")
    parser.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="sgd")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--configs", nargs="*", default=["ddp"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--abba",
        action="store_true",
        help="reverse the configuration order in odd rounds (drift cancels)",
    )
    parser.add_argument("--steps", type=int, default=20, help="measured steps per segment / total")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps after each switch")
    parser.add_argument("--schedule", default="", help="JSON file of {at_step, config} changes")
    parser.add_argument(
        "--control",
        default="",
        help="rank 0 applies JSON configuration lines appended to this file",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=0.0,
        help="stop every rank at the same step once this long has passed since "
        "train_start on rank 0 (a 1-float broadcast per step on its own group)",
    )
    parser.add_argument(
        "--fsdp-budget",
        type=int,
        default=0,
        help="FSDP2 rows: autobyte.fsdp.attach's memory_budget_bytes (bytes of the replica's "
        "tensors, so the model's divided by the byte scale); 0: none, the job starts as built",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sched-group",
        action="store_true",
        help="give the scheduler its own gloo group instead of the default one",
    )
    parser.add_argument("--full-metrics", action="store_true", help="emit every StepMetrics")
    parser.add_argument(
        "--param-digest",
        action="store_true",
        help="each ddp/sched result carries a sha256 of its replica's parameters",
    )
    parser.add_argument(
        "--steps-events",
        action="store_true",
        help="rank 0 prints a step event per step (needed for step-based traces)",
    )
    return parser
