"""Profile of one extra partition: where its end-to-end cost goes, piece by piece.

    python -m benchmarks.studies.profile_partition [--where loopback,testbed] [--rate 10gbit]
        [--sizes 16KiB,64KiB] [--count 300] [--out results/profile_partition.json]

Two gloo ranks (on loopback, or in the namespace testbed at --rate) measure, per partition size:

- `cpp serial`: all-reduces issued and waited for one at a time from C++ (`_native.issue_loop`,
  no Python, no GIL): the backend + wire round trip, the floor of one collective in isolation.
- `cpp window 8`: the same with 8 in flight: the per-collective cost when they are pipelined.
- `py serial`: `dist.all_reduce(async_op=True)` + `wait()` from Python: what the Python issue and
  wait add to the floor; `launch` is the issue call alone.
- `gil hand-off`: the delay from the backend's completion (stamped in C++ on gloo's thread) to a
  Python future callback, with the main thread idle in `wait()` and with it busy in Python (as the
  training thread is in a forward pass): the GIL hand-offs the Python path's completion and update
  threads pay, and the native path avoids (its completion callback is C++).
- CPU per collective: this process's CPU (all threads) and the whole machine's (/proc/stat,
  both ranks plus the kernel's network work) divided by the count — on this 2-core machine a
  collective's CPU is taken from the backward pass running beside it.
- `scheduler trace`: the native engine's per-partition timestamps (AUTOBYTE_TRACE_PARTITIONS=1)
  while training the dispatch probe's MLP (0.3M params, batch 32) with 16 KiB partitions: ready →
  launch (heap, credit, scheduler thread wake-up), the launch call, launch → reduced (gloo + wire).

Rank 0 prints one JSON object per measurement; the harness prints a table per place.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.testbed.host import load_average, machine_busy_s

REPO = Path(__file__).resolve().parents[2]


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _measure(name: str, size: int, count: int, body) -> dict[str, Any]:
    import torch.distributed as dist

    dist.barrier()
    cpu0, busy0, t0 = time.process_time(), machine_busy_s(), time.perf_counter()
    per = body()
    wall, cpu, busy = time.perf_counter() - t0, time.process_time() - cpu0, machine_busy_s() - busy0
    out = {
        "event": "result",
        "name": name,
        "bytes": size,
        "count": count,
        "wall_us_per": wall / count * 1e6,
        "cpu_us_per": cpu / count * 1e6,
        "machine_cpu_us_per": busy / count * 1e6,
    }
    for key, values in per.items():
        out[key + "_us_median"] = statistics.median(values) * 1e6 if values else None
        out[key + "_us_mean"] = statistics.fmean(values) * 1e6 if values else None
        out[key + "_us_p90"] = (
            sorted(values)[int(0.9 * (len(values) - 1))] * 1e6 if values else None
        )
    return out


def _busy_python(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from autobyte.native_status import load
    from autobyte.types import parse_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    native, why = load()
    if native is None:
        raise SystemExit(f"the native extension is needed for the C++ probes: {why}")
    group = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    count = args.count
    for size in [parse_bytes(s) for s in args.sizes.split(",")]:
        t = torch.ones(size // 4)

        def cpp(window: int) -> dict[str, list[float]]:
            times = native.issue_loop(group, t, count, window)  # noqa: B023 - the probes run within this iteration
            return {"latency": [b - a for a, b in times]}

        def py_serial() -> dict[str, list[float]]:
            launch, latency = [], []
            for _ in range(count):
                a = time.perf_counter()
                work = dist.all_reduce(t, group=group, async_op=True)  # noqa: B023 - the probes run within this iteration
                b = time.perf_counter()
                work.wait()
                launch.append(b - a)
                latency.append(time.perf_counter() - a)
            return {"launch": launch, "latency": latency}

        few = max(20, count // 5)

        def handoff(busy_s: float) -> dict[str, list[float]]:
            stamper = native.CompletionStamper()
            got: list[float] = []
            for _ in range(few):  # noqa: B023 - the probes run within this iteration
                work = dist.all_reduce(t, group=group, async_op=True)  # noqa: B023 - the probes run within this iteration
                index = stamper.watch(work)
                seen: list[float] = []
                fut = work.get_future().then(lambda f: seen.append(time.perf_counter()))  # noqa: B023 - the callback runs before fut.wait() returns
                if busy_s:
                    _busy_python(busy_s)  # the GIL is held by Python code meanwhile
                fut.wait()
                got.append(seen[0] - stamper.times()[index])
            return {"handoff": got}

        probes = [
            ("cpp serial", lambda: cpp(1)),
            ("cpp window 8", lambda: cpp(8)),
            ("py serial", py_serial),
            ("gil hand-off, idle", lambda: handoff(0.0)),
            ("gil hand-off, busy 2ms", lambda: handoff(0.002)),
        ]
        for name, body in probes:
            result = _measure(name, size, few if "hand-off" in name else count, body)
            if rank == 0:
                _emit(result)
    _trace(args, rank)
    dist.destroy_process_group()


def _trace(args: argparse.Namespace, rank: int) -> None:
    """The native engine's per-partition timestamps in a real training loop (16 KiB partitions)."""
    import torch
    from autobyte import ScheduledOptimizer

    from benchmarks.testbed.models import build

    os.environ["AUTOBYTE_TRACE_PARTITIONS"] = "1"
    for partition in (None, 16 << 10):
        torch.manual_seed(0)
        work = build("mlp", in_features=256, hidden=256, depth=4)
        gen = torch.Generator().manual_seed(rank)
        batch = work.make_batch(32, gen)
        sched = ScheduledOptimizer(
            work.model,
            torch.optim.SGD(work.model.parameters(), lr=0.01),
            partition_bytes=partition,
            credit_bytes=None,
        )
        steps = []
        with sched:
            for k in range(args.trace_steps + 3):
                a = time.perf_counter()
                work.loss_fn(work.model(batch[0]), batch[1]).backward()
                sched.step()
                if k >= 3:
                    steps.append(time.perf_counter() - a)
            sched.synchronize()
            records = (
                sched.engine.dispatcher.engine.take_trace() if sched.hot_path == "native" else []
            )
        records = [r for r in records if r[0] >= 3]
        if rank == 0:
            _emit(
                {
                    "event": "result",
                    "name": "scheduler trace",
                    "partition_bytes": partition,
                    "hot_path": sched.hot_path,
                    "step_ms_median": statistics.median(steps) * 1e3,
                    "partitions_per_step": len(records) / max(1, args.trace_steps),
                    "ready_to_launch_us_median": _med([r[4] - r[3] for r in records]),
                    "launch_us_median": _med([r[5] - r[4] for r in records]),
                    "in_flight_us_median": _med([r[6] - r[5] for r in records if r[6] > 0]),
                    "done_gap_us_median": _med(_gaps(sorted(r[6] for r in records if r[6] > 0))),
                }
            )


def _med(values: list[float]) -> float | None:
    return statistics.median(values) * 1e6 if values else None


def _gaps(times: list[float]) -> list[float]:
    """Spacing of consecutive completions (within a burst): the per-collective throughput cost."""
    return [b - a for a, b in itertools.pairwise(times) if b - a < 0.01]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_command(args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "benchmarks.studies.profile_partition",
        "--worker",
        "--sizes",
        args.sizes,
        "--count",
        str(args.count),
        "--trace-steps",
        str(args.trace_steps),
    ]


def run_loopback(args: argparse.Namespace) -> list[dict[str, Any]]:
    port = _free_port()
    procs = []
    try:
        for rank in range(2):
            env = os.environ | {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONUNBUFFERED": "1",
            }
            procs.append(
                subprocess.Popen(
                    _worker_command(args),
                    cwd=REPO,
                    env=env,
                    text=True,
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                )
            )
        out, _ = procs[0].communicate(timeout=args.timeout)
        for proc in procs[1:]:
            proc.wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"a loopback rank failed: {[proc.returncode for proc in procs]}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def run_testbed(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.testbed import Testbed, parse_rate

    with Testbed(world_size=2, rate=parse_rate(args.rate)) as bed:
        result = bed.run(lambda rank: _worker_command(args), cwd=str(REPO), timeout_s=args.timeout)
    return result.ranks[0].results


def format_block(where: str, results: list[dict[str, Any]]) -> str:
    lines = [
        f"{where}: per collective, µs (medians, hand-off also mean/p90; CPU = total / count)",
        (
            f"{'probe':<24} {'bytes':>7} {'latency':>8} {'launch':>7} {'hand-off':>8} {'mean/p90':>11} "
            f"{'wall/op':>8} {'cpu/op':>7} {'machine cpu/op':>14}"
        ),
    ]

    def f(value: Any) -> str:
        return "-" if value is None else f"{value:.0f}"

    for r in results:
        if r["name"] == "scheduler trace":
            continue
        lines.append(
            f"{r['name']:<24} {r['bytes']:>7} {f(r.get('latency_us_median')):>8} "
            f"{f(r.get('launch_us_median')):>7} {f(r.get('handoff_us_median')):>8} "
            f"{f(r.get('handoff_us_mean')) + '/' + f(r.get('handoff_us_p90')):>11} "
            f"{f(r['wall_us_per']):>8} {f(r['cpu_us_per']):>7} {f(r['machine_cpu_us_per']):>14}"
        )
    lines.append(
        f"{'scheduler trace (native)':<24} {'part':>7} {'step ms':>8} {'parts':>6} "
        f"{'ready>launch':>12} {'launch':>7} {'in flight':>9} {'done gap':>8}"
    )
    for r in results:
        if r["name"] != "scheduler trace":
            continue
        lines.append(
            f"{'':<24} {r['partition_bytes']!s:>7} {r['step_ms_median']:8.1f} "
            f"{r['partitions_per_step']:6.0f} {f(r['ready_to_launch_us_median']):>12} "
            f"{f(r['launch_us_median']):>7} {f(r['in_flight_us_median']):>9} "
            f"{f(r['done_gap_us_median']):>8}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--where", default="loopback,testbed")
    parser.add_argument("--rate", default="10gbit")
    parser.add_argument("--sizes", default="16KiB,64KiB")
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--trace-steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default="")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    report: dict[str, Any] = {
        "command": " ".join(
            [
                "python -m benchmarks.studies.profile_partition",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "blocks": {},
    }
    for where in args.where.split(","):
        load = load_average()
        results = run_loopback(args) if where == "loopback" else run_testbed(args)
        label = where if where == "loopback" else f"testbed @ {args.rate}"
        report["blocks"][label] = {"load": load, "results": results}
        print(format_block(label, results) + f"\n(load average at start {load})\n", flush=True)
    report["load_after"] = load_average()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
