"""torch.compile under the scheduler: compiled scheduled vs compiled DDP vs eager scheduled vs eager
DDP step time on a tiny GPT-2-style LM, 2 gloo ranks, paired side by side in one run.

Each rank builds the four variants once (a compiled variant compiles in its first steps and never
again: the recompile counts say so), then runs `--rounds` rounds; in each round every variant runs
`--warmup` unmeasured and `--steps` measured steps, in turn, so that load on a shared machine hits
all four alike. A window's step time is its wall time (the scheduled variants synchronize at the
end of the window: their `step()` returns before the updates land) over its steps; the table shows
the median over rounds. Loopback by default; `--rates 10gbit,1gbit` runs on the namespace testbed
(root). Known trade-off: called from compiled code, the root pre-hook waits for every update before
the graph runs (`autobyte.scheduler.compiled`), so the compiled forward does not overlap the
previous step's communication the way the eager one does.

    python -m benchmarks.bench_compile --rounds 5 --steps 20
    python -m benchmarks.bench_compile --rates 10gbit,1gbit
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.testbed import loopback

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("eager_ddp", "compiled_ddp", "eager_sched", "compiled_sched")


# ---------------------------------------------------------------------- one rank


def _dynamo_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"], counters["stats"]["unique_graphs"]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from autobyte import ScheduledOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.testbed.models import build

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    runs: dict[str, Any] = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        workload = build("tiny_gpt", vocab=args.vocab, hidden=args.hidden, layers=args.layers)
        model = workload.model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if variant.endswith("ddp"):
            wrapped = DDP(model)
            sched = None
        else:
            wrapped = model
            sched = ScheduledOptimizer(
                model, opt, partition_bytes=args.partition, credit_bytes=args.credit
            )
        runs[variant] = {
            "workload": workload,
            "model": torch.compile(wrapped) if variant.startswith("compiled") else wrapped,
            "opt": opt,
            "sched": sched,
            "frames": [0, 0],
            "times": [],
        }

    def one_step(run: dict[str, Any]) -> None:
        inputs, targets = run["workload"].make_batch(args.batch_size, gen)
        loss = run["workload"].loss_fn(run["model"](inputs), targets)
        if run["sched"] is None:
            run["opt"].zero_grad(set_to_none=True)
            loss.backward()
            run["opt"].step()
        else:
            loss.backward()
            run["sched"].step()
            run["sched"].zero_grad(set_to_none=True)

    def window(run: dict[str, Any], steps: int) -> float:
        frames0 = _dynamo_counts()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            one_step(run)
        if run["sched"] is not None:
            run["sched"].synchronize()
        elapsed = time.perf_counter() - t0
        frames1 = _dynamo_counts()
        run["frames"][0] += frames1[0] - frames0[0]
        run["frames"][1] += frames1[1] - frames0[1]
        return elapsed / steps

    first_compile: dict[str, list[int]] = {}
    for variant, run in runs.items():  # the first steps compile: not measured, counted apart
        window(run, args.warmup)
        first_compile[variant] = list(run["frames"])
        run["frames"] = [0, 0]
    for _ in range(args.rounds):
        for variant, run in runs.items():
            window(run, args.warmup)
            run["times"].append(window(run, args.steps))
    for run in runs.values():
        if run["sched"] is not None:
            run["sched"].close()
    if rank == 0:
        print(
            json.dumps(
                {
                    "event": "result",
                    "variants": {
                        variant: {
                            "step_s": run["times"],
                            "median_step_s": statistics.median(run["times"]),
                            "first_steps_frames_graphs": first_compile[variant],
                            "later_frames_graphs": run["frames"],
                        }
                        for variant, run in runs.items()
                    },
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


# ---------------------------------------------------------------------- the launcher


def worker_argv(args: argparse.Namespace) -> list[str]:
    return loopback.worker_argv(
        "benchmarks.bench_compile",
        args,
        (
            "rounds",
            "steps",
            "warmup",
            "batch-size",
            "threads",
            "partition",
            "credit",
            "vocab",
            "hidden",
            "layers",
        ),
    )


def run_loopback(args: argparse.Namespace) -> dict[str, Any]:
    return loopback.run_two_ranks(
        worker_argv(args), {"OMP_NUM_THREADS": str(args.threads)}, args.timeout
    )


def run_testbed(args: argparse.Namespace, rate: str) -> dict[str, Any]:
    from benchmarks.testbed import Testbed

    with Testbed(world_size=2, rate=rate) as bed:
        result = bed.run(
            lambda rank: worker_argv(args),
            cwd=str(ROOT),
            timeout_s=args.timeout,
            env={"OMP_NUM_THREADS": str(args.threads)},
        )
    return result.ranks[0].results[-1]


def format_table(blocks: list[tuple[str, dict[str, Any]]]) -> str:
    header = (
        "| link | variant | median step (ms) | vs eager DDP | vs compiled DDP | frames, "
        "graphs in the first steps | after them |"
    )
    lines = [header, "|---|---|---:|---:|---:|---|---|"]
    for link, result in blocks:
        variants = result["variants"]
        eager_ddp = variants["eager_ddp"]["median_step_s"]
        compiled_ddp = variants["compiled_ddp"]["median_step_s"]
        for variant in VARIANTS:
            got = variants[variant]
            step = got["median_step_s"]
            lines.append(
                f"| {link} | {variant} | {step * 1e3:.2f} | {step / eager_ddp:.2f}x | "
                f"{step / compiled_ddp:.2f}x | {got['first_steps_frames_graphs']} | "
                f"{got['later_frames_graphs']} |"
            )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--rates", default="", help="testbed link rates (root), e.g. 10gbit,1gbit; empty: loopback"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--partition", type=int, default=64 << 10)
    parser.add_argument("--credit", type=int, default=256 << 10)
    parser.add_argument(
        "--vocab",
        type=int,
        default=512,
        help="tiny_gpt's size (a larger one is communication-bound: --vocab 8192 --hidden 256)",
    )
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default="", help="write the raw results + table as JSON here")
    args = parser.parse_args(argv)
    for name in ("rounds", "steps", "warmup", "batch_size", "threads", "vocab", "hidden", "layers"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rates = [r for r in args.rates.split(",") if r]
    blocks = (
        [(rate, run_testbed(args, rate)) for rate in rates]
        if rates
        else [("loopback", run_loopback(args))]
    )
    table = format_table(blocks)
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps({"blocks": blocks, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
