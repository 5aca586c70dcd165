"""What a loop that clips every step costs: `clip_grad_norm_` between backward and step (a read of
`.grad` waits for the reduced gradients: client/autobyte/scheduler/grad_reads.py) against the same
scheduler loop without clipping, with the scheduler's own `clip_grad_norm=` (no wait), and DDP +
`clip_grad_norm_`; 2 gloo ranks, paired side by side in one run.

Each round runs the variants in turn (so that load on a shared machine hits all alike), each from a
fresh model and optimizer (an MLP, SGD with momentum): `--warmup` unmeasured and `--steps` measured
steps. A window's step time is its wall time over its steps, the scheduler synchronized at both ends
(its `step()` returns before the updates land). The table shows the median over rounds and the
ratio to DDP + clip per round. Loopback by default; `--rates 1gbit` runs on the namespace testbed
(root). `--micro K` runs K micro-batches a step, every backward synchronising (accumulation
without `no_sync()`: one all-reduce of every gradient per micro-batch, for DDP and the scheduler).

    python -m benchmarks.bench_clip --rounds 7
    python -m benchmarks.bench_clip --rates 1gbit --rounds 7
    python -m benchmarks.bench_clip --rates 1gbit --rounds 5 --micro 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.testbed import loopback

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("ddp_clip", "sched_noclip", "sched_clip", "sched_ctor")
LABELS = {
    "ddp_clip": "DDP + clip_grad_norm_",
    "sched_noclip": "scheduler, no clipping",
    "sched_clip": "scheduler + clip_grad_norm_ (a read)",
    "sched_ctor": "scheduler, clip_grad_norm= (its own)",
}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from autobyte import ScheduledOptimizer
    from torch import nn

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = args.warmup + args.steps
    gen = torch.Generator().manual_seed(1 + rank)
    batches = [
        (
            torch.randn(args.batch_size, args.width, generator=gen),
            torch.randn(args.batch_size, 10, generator=gen),
        )
        for _ in range(total)
    ]

    def model() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(args.layers):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(args.width, 10))

    def run(variant: str) -> float:
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        sched = None
        if variant.startswith("sched"):
            clip = 1.0 if variant == "sched_ctor" else None
            sched = ScheduledOptimizer(net, opt, args.partition, args.credit, clip_grad_norm=clip)
        wrapped = net if sched is not None else nn.parallel.DistributedDataParallel(net)
        try:
            start = 0.0
            for i, (x, y) in enumerate(batches):
                if i == args.warmup:
                    if sched is not None:
                        sched.synchronize()
                    start = time.perf_counter()
                for _ in range(args.micro):  # each backward synchronises: no no_sync()
                    (nn.functional.mse_loss(wrapped(x), y) / args.micro).backward()
                if variant in ("ddp_clip", "sched_clip"):
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                (sched or opt).step()
                (sched or opt).zero_grad()
            if sched is not None:
                sched.synchronize()
            return (time.perf_counter() - start) / args.steps
        finally:
            if sched is not None:
                sched.close()

    rounds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            dist.barrier()
            rounds[variant].append(run(variant))
    if rank == 0:
        params = sum(p.numel() for p in model().parameters())
        print(json.dumps({"event": "result", "rounds": rounds, "params": params}), flush=True)
    dist.destroy_process_group()


def worker_argv(args: argparse.Namespace) -> list[str]:
    return loopback.worker_argv(
        "benchmarks.bench_clip",
        args,
        (
            "rounds",
            "steps",
            "warmup",
            "batch-size",
            "threads",
            "partition",
            "credit",
            "width",
            "layers",
            "micro",
        ),
    )


def _env(args: argparse.Namespace) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "client"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    }


def format_table(blocks: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [
        "| link | params | loop | median step (ms) | x DDP + clip (median of per-round ratios) | per-round ratios |",
        "|---|---:|---|---:|---:|---|",
    ]
    for link, result in blocks:
        ddp = result["rounds"]["ddp_clip"]
        for variant in VARIANTS:
            times = result["rounds"][variant]
            ratios = [d / t for d, t in zip(ddp, times)]  # > 1: faster than DDP + clip
            lines.append(
                f"| {link} | {result['params'] / 1e6:.1f}M | {LABELS[variant]} | "
                f"{statistics.median(times) * 1e3:.1f} | {statistics.median(ratios):.3f} | "
                f"{', '.join(f'{r:.3f}' for r in ratios)} |"
            )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = loopback.paired_parser(
        __doc__.split("\n")[0], batch_size=128, partition=4 << 20, credit=16 << 20, timeout=1200
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument(
        "--micro",
        type=int,
        default=1,
        help="micro-batches a step, every backward synchronising (accumulation without "
        "no_sync(): DDP all-reduces at each, and so does the scheduler)",
    )
    args = parser.parse_args(argv)
    loopback.check_at_least_one(
        parser,
        args,
        ("rounds", "steps", "warmup", "batch_size", "threads", "width", "layers", "micro"),
    )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    blocks = loopback.run_blocks(args, worker_argv(args), _env(args))
    loopback.report(args, blocks, format_table(blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
