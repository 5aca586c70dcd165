"""Ingest benchmark: samples/s through the real gRPC path into SQLite, daemon RSS, and nothing lost.

    python -m benchmarks.bench_ingest [--streams 1,16,256] [--samples 200000] [--batch 500]
    python -m benchmarks.bench_ingest --rss --samples 1000000 --streams 16

Starts a real `autobyted` process on a free loopback port with a fresh SQLite file, drives N
concurrent StreamMetrics streams (one registered rank each) from one grpc.aio client process, and
checks that every acknowledged sample is in the database. With --rss it samples the daemon's RSS
once a second and prints it over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time

import grpc

from autobyte.protocol import autobyte_pb2 as pb
from autobyte.protocol import autobyte_pb2_grpc as pb_grpc

BIN = pathlib.Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def make_batch(job: str, session: str, first_seq: int, count: int) -> pb.MetricsBatch:
    now = time.time()
    return pb.MetricsBatch(job=job, rank=0, session_id=session, samples=[
        pb.StepMetrics(seq=seq, step=seq - 1, wall_time_s=now, step_time_s=0.05 + (seq % 7) * 1e-3, forward_s=0.01,
                       backward_s=0.02, exposed_comm_s=0.004, queueing_delay_s=1e-4, bytes_reduced=27 << 20,
                       partitions=26, bandwidth_bytes_per_s=1.1e8)
        for seq in range(first_seq, first_seq + count)])


async def one_stream(address: str, job: str, samples: int, batch: int, acked: dict) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        telemetry = pb_grpc.TelemetryStub(channel)
        registered = await telemetry.Register(pb.RegisterRequest(job=job, rank=0, world_size=1, backend="bench",
                                                                 instance_id=f"bench-{job}"), timeout=60)

        async def batches():
            for first in range(1, samples + 1, batch):
                yield make_batch(job, registered.session_id, first, min(batch, samples - first + 1))

        async for ack in telemetry.StreamMetrics(batches()):
            acked[job] = ack.acked_seq


async def drive(address: str, streams: int, samples_per_stream: int, batch: int) -> tuple[float, dict]:
    acked: dict[str, int] = {}
    prefix = f"s{streams}-{time.monotonic_ns()}"
    start = time.perf_counter()
    await asyncio.gather(*(one_stream(address, f"{prefix}-{i}", samples_per_stream, batch, acked)
                           for i in range(streams)))
    return time.perf_counter() - start, acked


def run(streams_list: list[int], total_samples: int, batch: int, watch_rss: bool) -> int:
    work = pathlib.Path(tempfile.mkdtemp(prefix="autobyte-ingest-"))
    db = work / "ingest.db"
    port = free_port()
    address = f"127.0.0.1:{port}"
    daemon = subprocess.Popen([str(BIN / "autobyted"), "start", "--listen", address, "--db", f"sqlite:///{db}",
                               "--log-level", "WARNING", "--config", str(_config(work))],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    failures = 0
    try:
        _wait(address)
        for streams in streams_list:
            per_stream = max(1, total_samples // streams)
            rss_log: list[tuple[float, float]] = []
            stop = asyncio.Event()

            async def main():
                async def watch():
                    t0 = time.perf_counter()
                    while not stop.is_set():
                        rss_log.append((time.perf_counter() - t0, rss_mib(daemon.pid)))
                        await asyncio.sleep(1.0)
                watcher = asyncio.create_task(watch())
                try:
                    return await drive(address, streams, per_stream, batch)
                finally:
                    stop.set()
                    await watcher

            elapsed, acked = asyncio.run(main())
            sent = per_stream * streams
            with sqlite3.connect(db) as conn:
                stored = conn.execute("select count(*) from step_metrics s join jobs j on s.job_id = j.id "
                                      "where j.name like ?", (f"s{streams}-%",)).fetchone()[0]
            acked_total = sum(acked.values())
            lost = sent - stored
            failures += lost != 0 or acked_total != sent
            rss = [r for _, r in rss_log]
            rows.append((streams, sent, elapsed, sent / elapsed, acked_total, stored, lost,
                         rss[0] if rss else 0, max(rss) if rss else 0, rss[-1] if rss else 0))
            if watch_rss:
                print("\nRSS over the run (t_s, MiB):")
                step = max(1, len(rss_log) // 12)
                for t, r in rss_log[::step] + rss_log[-1:]:
                    print(f"  {t:7.1f}  {r:7.1f}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nload: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores; batch {batch} samples; "
          f"daemon exit {daemon.returncode}")
    print(f"{'streams':>7} {'samples':>9} {'seconds':>8} {'samples/s':>10} {'acked':>9} {'stored':>9} "
          f"{'lost':>5} {'rss0MiB':>8} {'rssMax':>7} {'rssEnd':>7}")
    for r in rows:
        print(f"{r[0]:>7} {r[1]:>9} {r[2]:>8.2f} {r[3]:>10.0f} {r[4]:>9} {r[5]:>9} {r[6]:>5} {r[7]:>8.1f} "
              f"{r[8]:>7.1f} {r[9]:>7.1f}")
    return 1 if failures or daemon.returncode else 0


def _config(work: pathlib.Path) -> pathlib.Path:
    path = work / "autobyted.toml"
    # Retention is part of what keeps memory and disk flat: keep it on at its default.
    path.write_text("[autobyted]\nlog_format = \"text\"\n")
    return path


def _wait(address: str) -> None:
    deadline = time.monotonic() + 30
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.QueryStub(channel)
        while time.monotonic() < deadline:
            try:
                stub.Status(pb.StatusRequest(), timeout=1)
                return
            except grpc.RpcError:
                time.sleep(0.1)
    raise SystemExit("autobyted did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,16,256")
    parser.add_argument("--samples", type=int, default=200_000, help="samples per row of the table")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rss", action="store_true", help="print the daemon's RSS over the run")
    args = parser.parse_args()
    return run([int(s) for s in args.streams.split(",")], args.samples, args.batch, args.rss)


if __name__ == "__main__":
    sys.exit(main())
