"""gloo's cost of one all-reduce against its size at 2, 4 and 8 ranks on this host (loopback),
the per-collective cost the emulated testbed adds to every partition (docs/emulated.md).

Each rank runs back-to-back all-reduces of one size (as the scheduler issues its partitions: one
after another, no barrier between them), `--batch` of them timed together, `--rounds` times; a
size's cost is the median per collective over the rounds, on rank 0. A line latency + bytes x
per_byte is fitted to the sizes at each rank count (least squares), the two numbers
`autobyte.scheduler.start` measures at construction to derive its starting partition.

    python -m benchmarks.bench_collective --ranks 2,4,8 --out results/collective.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _rank(rank: int, world: int, port: int, sizes: Sequence[int], batch: int, rounds: int, out):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        costs = {}
        for size in sizes:
            tensor = torch.zeros(size // 4)
            for _ in range(3):
                dist.all_reduce(tensor)
            per_collective = []
            for _ in range(rounds):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(batch):
                    dist.all_reduce(tensor)
                per_collective.append((time.perf_counter() - start) / batch)
            costs[size] = statistics.median(per_collective)
        if rank == 0:
            out.put(costs)
    finally:
        dist.destroy_process_group()


def measure(world: int, sizes: Sequence[int], batch: int, rounds: int) -> dict[int, float]:
    """Seconds per all-reduce of each size at `world` gloo ranks on loopback (rank 0's)."""
    import torch.multiprocessing as mp

    from devtools.ports import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, sizes, batch, rounds, out))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        return out.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def fit(costs: dict[int, float]) -> tuple[float, float]:
    """(latency_s, seconds_per_byte): the least-squares line through the sizes' costs."""
    xs, ys = list(costs), list(costs.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def format_table(results: dict[int, dict[int, float]]) -> str:
    from autobyte.types import format_bytes

    worlds = sorted(results)
    sizes = sorted(next(iter(results.values())))
    lines = [
        "ms per all-reduce (gloo, loopback, back to back; median of rounds, rank 0)",
        f"{'size':>8} " + " ".join(f"{f'{w} ranks':>9}" for w in worlds),
    ]
    for size in sizes:
        lines.append(
            f"{format_bytes(size):>8} " + " ".join(f"{results[w][size] * 1e3:9.3f}" for w in worlds)
        )
    fits = {w: fit(results[w]) for w in worlds}
    lines.append(
        f"{'latency':>8} " + " ".join(f"{fits[w][0] * 1e3:9.3f}" for w in worlds) + "  (ms, fitted)"
    )
    lines.append(
        f"{'MB/s':>8} "
        + " ".join(f"{1 / fits[w][1] / 1e6 if fits[w][1] > 0 else 0:9.0f}" for w in worlds)
        + "  (bytes / per-byte cost, fitted)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--batch", type=int, default=10, help="all-reduces timed together")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="", help="write the results as JSON here")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.ranks.split(",") if w]
    if not worlds or min(worlds) < 2:
        raise SystemExit(f"--ranks needs rank counts of at least 2, got {args.ranks!r}")
    results = {w: measure(w, SIZES, args.batch, args.rounds) for w in worlds}
    print(format_table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({str(w): {str(s): c for s, c in r.items()} for w, r in results.items()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
