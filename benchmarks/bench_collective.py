"""gloo's cost of one all-reduce against its size at 2, 4 and 8 ranks on this host (loopback),
the per-collective cost the emulated testbed adds to every partition (docs/emulated.md).

Each rank runs back-to-back all-reduces of one size (as the scheduler issues its partitions: one
after another, no barrier between them), `--batch` of them timed together, `--rounds` times; a
size's cost is the median per collective over the rounds, on rank 0. With `--in-flight K` the
all-reduces are asynchronous and up to K are outstanding (a new one is issued when the oldest
completes), as the scheduler's credit window keeps them (autobyte.scheduler.start's
CREDIT_PARTITIONS partitions of the derived start): gloo runs several collectives of one group on
its worker threads at once, so a partition's cost in a stream is less than one collective's alone.
A line latency + bytes x per_byte is fitted to the sizes at each rank count (least squares); at
one in flight those are the two numbers `autobyte.scheduler.start` measures at construction to
derive its starting partition, and the simulator's per-collective cost at N ranks
(benchmarks/sim_vs_emulated.py, benchmarks/calibration/gloo-collective.json).

    python -m benchmarks.bench_collective --ranks 2,4,8 --in-flight 1,4 --out results/collective.json

`--lone` measures instead what a rank registers as its job's per-collective cost when its
scheduler is built (autobyte.scheduler.start.measure_latency: the median of small all-reduces,
4 KB, one at a time, the slowest rank's) at each rank count, and adds it to `--out`'s
"lone_latency_s" (the file's other figures kept): the figure the predictor's training data gives a
job at that rank count on this host (simulator/links.py `lone_collective_s`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _stream(dist, tensors: Sequence[Any], in_flight: int) -> None:
    """All-reduce every tensor, at most `in_flight` outstanding, in order."""
    pending: collections.deque = collections.deque()
    for tensor in tensors:
        if len(pending) >= in_flight:
            pending.popleft().wait()
        pending.append(dist.all_reduce(tensor, async_op=True))
    while pending:
        pending.popleft().wait()


def _rank(
    rank: int,
    world: int,
    port: int,
    sizes: Sequence[int],
    batch: int,
    rounds: int,
    in_flights: Sequence[int],
    out,
):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        costs: dict[int, dict[int, float]] = {k: {} for k in in_flights}
        for size in sizes:
            # one buffer per outstanding collective, as partitions are distinct tensors
            tensors = [torch.zeros(size // 4) for _ in range(max(in_flights))]
            _stream(dist, tensors, len(tensors))
            for in_flight in in_flights:
                stream = [tensors[i % in_flight] for i in range(batch)]
                per_collective = []
                for _ in range(rounds):
                    dist.barrier()
                    start = time.perf_counter()
                    _stream(dist, stream, in_flight)
                    per_collective.append((time.perf_counter() - start) / batch)
                costs[in_flight][size] = statistics.median(per_collective)
        if rank == 0:
            out.put(costs)
    finally:
        dist.destroy_process_group()


def measure(
    world: int, sizes: Sequence[int], batch: int, rounds: int, in_flights: Sequence[int] = (1,)
) -> dict[int, dict[int, float]]:
    """Seconds per all-reduce of each size at `world` gloo ranks on loopback (rank 0's), by the
    number of collectives in flight."""
    import torch.multiprocessing as mp

    from devtools.ports import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank, args=(r, world, port, sizes, batch, rounds, tuple(in_flights), out)
        )
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


def _lone_rank(rank: int, world: int, port: int, rounds: int, out) -> None:
    import torch
    import torch.distributed as dist
    from autobyte.scheduler.start import measure_latency

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cpu = torch.device("cpu")
        figures = [measure_latency(None, cpu, torch.float32) for _ in range(rounds)]
        if rank == 0:
            out.put(statistics.median(figures))
    finally:
        dist.destroy_process_group()


def measure_lone(world: int, rounds: int) -> float:
    """The per-collective latency a job of `world` gloo ranks on loopback registers (the median
    over `rounds` measurements, each as a scheduler makes it at construction)."""
    import torch.multiprocessing as mp

    from devtools.ports import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_lone_rank, args=(r, world, port, rounds, out)) for r in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        return out.get(timeout=300)
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


def format_table(results: dict[int, dict[int, dict[int, float]]]) -> str:
    """results[world][in_flight][size] = seconds per all-reduce."""
    from autobyte.types import format_bytes

    worlds = sorted(results)
    columns = [(w, k) for w in worlds for k in sorted(results[w])]
    sizes = sorted(results[worlds[0]][columns[0][1]])
    lines = [
        (
            "ms per all-reduce (gloo, loopback, back to back; median of rounds, rank 0); "
            "W ranks / K in flight"
        ),
        f"{'size':>8} " + " ".join(f"{f'{w}r/{k}':>9}" for w, k in columns),
    ]
    for size in sizes:
        lines.append(
            f"{format_bytes(size):>8} "
            + " ".join(f"{results[w][k][size] * 1e3:9.3f}" for w, k in columns)
        )
    fits = {(w, k): fit(results[w][k]) for w, k in columns}
    lines.append(
        f"{'latency':>8} "
        + " ".join(f"{fits[c][0] * 1e3:9.3f}" for c in columns)
        + "  (ms, fitted)"
    )
    lines.append(
        f"{'MB/s':>8} "
        + " ".join(f"{1 / fits[c][1] / 1e6 if fits[c][1] > 0 else 0:9.0f}" for c in columns)
        + "  (bytes / per-byte cost, fitted)"
    )
    return "\n".join(lines)


def as_json(results: dict[int, dict[int, dict[int, float]]], load_before: float) -> dict[str, Any]:
    """By rank count and collectives in flight: the cost of each size and the fitted line."""
    return {
        "host_cpus": os.cpu_count(),
        "load_before": load_before,
        "ranks": {
            str(w): {
                str(k): {
                    "sizes_s": {str(size): cost for size, cost in costs.items()},
                    "latency_s": fit(costs)[0],
                    "seconds_per_byte": fit(costs)[1],
                }
                for k, costs in by_flight.items()
            }
            for w, by_flight in results.items()
        },
    }


def _counts(text: str, name: str, least: int) -> list[int]:
    try:
        counts = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < least:
        raise SystemExit(f"{name} needs numbers of at least {least}, got {text!r}")
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument(
        "--in-flight", default="1", help="collectives outstanding at once, e.g. 1,4 (default 1)"
    )
    parser.add_argument("--batch", type=int, default=20, help="all-reduces timed together")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="", help="write the results as JSON here")
    parser.add_argument(
        "--lone",
        action="store_true",
        help="measure the per-collective latency a job registers instead (module docstring), "
        "added to --out's figures",
    )
    args = parser.parse_args(argv)
    worlds = _counts(args.ranks, "--ranks", 2)
    in_flights = _counts(args.in_flight, "--in-flight", 1)
    load = os.getloadavg()[0]
    if args.lone:
        lone = {w: measure_lone(w, args.rounds) for w in worlds}
        print(
            "ms per small all-reduce as a scheduler measures it (median of rounds): "
            + ", ".join(f"{w} ranks {s * 1e3:.3f}" for w, s in lone.items())
        )
        if args.out:
            path = pathlib.Path(args.out)
            report = json.loads(path.read_text()) if path.exists() else {}
            report.setdefault("lone_latency_s", {}).update({str(w): s for w, s in lone.items()})
            report["lone_load_before"] = load
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        return 0
    results = {w: measure(w, SIZES, args.batch, args.rounds, in_flights) for w in worlds}
    print(format_table(results))
    if args.out:
        report = as_json(results, load)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
