"""The client's cost per training step, and what a slow, absent or misbehaving daemon adds.

    python -m benchmarks.bench_client [--calls 200000]           # hot-path microbenchmark
    python -m benchmarks.bench_client --training [--steps 300]   # 2-rank gloo job, offline vs streaming

The hot path is `Reporter.on_step`, which the training thread runs once per step: it numbers the
sample and appends it to a bounded buffer; conversion to protobuf and the network happen on a
background thread. Measured with the daemon up, absent (nothing listening: the buffer fills and
drops the oldest), and black-holed (a listener that accepts and never answers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from autobyte.transport import session
from autobyte.transport.reporter import Reporter
from autobyte.types import Config, StepMetrics

from benchmarks.testbed.host import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent


def _one_rank_optimizer():
    """A real ScheduledOptimizer in a 1-rank gloo group (the --training mode measures 2 ranks)."""
    import torch
    import torch.distributed as dist
    from autobyte.scheduler import ScheduledOptimizer

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    model = torch.nn.Linear(4, 4)
    return ScheduledOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        partition_bytes=1 << 20,
        credit_bytes=4 << 20,
    )


def time_on_step(address: str, calls: int) -> list[float]:
    reporter = Reporter(address, f"bench-{time.monotonic_ns()}", 0, 1, None, buffer_samples=10_000)
    optimizer = _one_rank_optimizer()
    session.attach(reporter, optimizer)  # as autobyte.init() attaches it: place, model, backend
    metrics = StepMetrics(
        step=0, wall_time_s=time.time(), step_time_s=0.05, config=Config(1 << 20, 4 << 20)
    )
    samples = []
    for i in range(calls):
        m = StepMetrics(
            step=i, wall_time_s=metrics.wall_time_s, step_time_s=0.05, config=metrics.config
        )
        t0 = time.perf_counter_ns()
        reporter.on_step(m)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        if i % 1000 == 999:
            time.sleep(0.001)  # a training step is never back-to-back; let the sender run
    reporter.close(1.0)
    optimizer.close()
    return samples


def black_hole() -> tuple[socket.socket, str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held = []

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)  # never read, never answer

    threading.Thread(target=accept, daemon=True).start()
    return listener, f"127.0.0.1:{listener.getsockname()[1]}"


def hot_path(calls: int) -> None:
    port = free_port()
    work = tempfile.mkdtemp(prefix="autobyte-client-")
    daemon = subprocess.Popen(
        [
            str(BIN / "autobyted"),
            "start",
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            f"sqlite:///{work}/c.db",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(2.0)
    hole, hole_address = black_hole()
    rows = []
    try:
        for name, address in (
            ("daemon up", f"127.0.0.1:{port}"),
            ("daemon absent", f"127.0.0.1:{free_port()}"),
            ("black hole", hole_address),
        ):
            us = sorted(time_on_step(address, calls))
            rows.append(
                (
                    name,
                    statistics.median(us),
                    us[int(len(us) * 0.99)],
                    us[int(len(us) * 0.999)],
                    us[-1],
                )
            )
    finally:
        hole.close()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nReporter.on_step per training step, {calls} calls each; load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'daemon':<14} {'median_us':>9} {'p99_us':>8} {'p99.9_us':>9} {'max_us':>8}")
    for r in rows:
        print(f"{r[0]:<14} {r[1]:>9.2f} {r[2]:>8.2f} {r[3]:>9.2f} {r[4]:>8.1f}")


def training(steps: int, repeats: int) -> None:
    port = free_port()
    work = pathlib.Path(tempfile.mkdtemp(prefix="autobyte-client-"))
    daemon = subprocess.Popen(
        [
            str(BIN / "autobyted"),
            "start",
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            f"sqlite:///{work}/c.db",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    results: dict[str, list[float]] = {"offline": [], "streaming": [], "absent": []}
    background: dict[str, list[float]] = {"streaming": [], "absent": []}
    absent = f"127.0.0.1:{free_port()}"  # nothing listens: the client retries with backoff
    try:
        time.sleep(2.0)
        for repeat in range(repeats):
            for mode, medians in results.items():  # interleaved, side by side
                out = work / f"{mode}-{repeat}-{{rank}}.json"
                env = {
                    **os.environ,
                    "AUTOBYTE_DAEMON": absent if mode == "absent" else f"127.0.0.1:{port}",
                    "AUTOBYTE_JOB": f"{mode}-{repeat}",
                    "OMP_NUM_THREADS": "1",
                    "AUTOBYTE_FLUSH_TIMEOUT_S": "0.5",
                }
                command = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    "2",
                    "--master-port",
                    str(free_port()),
                    str(ROOT / "devtools" / "mlp_job.py"),
                    "--steps",
                    str(steps),
                    "--width",
                    "512",
                    "--depth",
                    "3",
                    "--out",
                    str(out),
                ]
                if mode == "offline":
                    command.append("--offline")
                subprocess.run(command, env=env, check=True, capture_output=True)
                report = json.loads(pathlib.Path(str(out).format(rank=0)).read_text())
                ends = report["step_ends"][20:]
                medians.append(statistics.median(b - a for a, b in itertools.pairwise(ends)))
                if "telemetry_cpu_s" in report:
                    background[mode].append(report["telemetry_cpu_s"] / steps)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    offline = statistics.median(results["offline"])
    print(
        f"\n2-rank gloo MLP, {steps} steps x {repeats} interleaved repeats; load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'mode':<10} {'median_step_ms':>14}  runs")
    for mode, values in results.items():
        print(
            f"{mode:<10} {statistics.median(values) * 1e3:>14.3f}  "
            + " ".join(f"{v * 1e3:.2f}" for v in values)
        )
    for mode in ("streaming", "absent"):
        paired = [b - a for a, b in zip(results["offline"], results[mode])]
        print(
            f"{mode}: added per step {(statistics.median(results[mode]) - offline) * 1e6:+.0f} us "
            f"(median of paired differences {statistics.median(paired) * 1e6:+.0f} us); background CPU of "
            f"the client's own threads {statistics.median(background[mode]) * 1e6:.1f} us per step"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--training", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.training:
        training(args.steps, args.repeats)
    else:
        hot_path(args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
