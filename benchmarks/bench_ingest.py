"""Ingest benchmark: samples/s through the real gRPC path into SQLite or PostgreSQL with one or several
daemons, ack latency, daemon RSS, CPU by process, and nothing lost.

    python -m benchmarks.bench_ingest [--streams 1,16,256] [--samples 200000] [--batch 500]
    python -m benchmarks.bench_ingest --db postgresql --daemons 1,2,4 --streams 16,256
    python -m benchmarks.bench_ingest --autobyted /other/venv/bin/autobyted   # compare two builds
    python -m benchmarks.bench_ingest --rss --samples 1000000 --streams 16

For every (build, daemons, streams) it starts that many real `autobyted` processes on free loopback
ports on a fresh database (a SQLite file, or a fresh database on PostgreSQL: `--db postgresql`
starts a throwaway cluster with durable settings, fsync on; `--db postgresql+psycopg://...` uses
yours), registers the streams (one rank each, stream i on daemon i mod N), builds every batch, and
then times the streaming from one grpc.aio client process: each stream keeps at most `--window`
batches unacknowledged; the ack latency of a batch is the time from handing it to gRPC to its ack.
Afterwards every acknowledged sample must be in the database, once. CPU seconds are counted for the
daemons, the PostgreSQL server (all its processes) and the client, beside the machine's cores: on a
small machine that says which part is the limit. Medians over --repeat runs, builds interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import psutil
import sqlalchemy as sa
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.protocol import autobyte_pb2_grpc as pb_grpc

from benchmarks.testbed.host import free_port

BIN = pathlib.Path(sys.executable).parent


def rss_mib(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / (1 << 20)
    except psutil.Error:
        return 0.0


def cpu_s(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def make_batch(job: str, session: str, first_seq: int, count: int) -> pb.MetricsBatch:
    now = time.time()
    return pb.MetricsBatch(
        job=job,
        rank=0,
        session_id=session,
        samples=[
            pb.StepMetrics(
                seq=seq,
                step=seq - 1,
                wall_time_s=now,
                step_time_s=0.05 + (seq % 7) * 1e-3,
                forward_s=0.01,
                backward_s=0.02,
                exposed_comm_s=0.004,
                queueing_delay_s=1e-4,
                bytes_reduced=27 << 20,
                partitions=26,
                bandwidth_bytes_per_s=1.1e8,
            )
            for seq in range(first_seq, first_seq + count)
        ],
    )


class Stream:
    """One registered rank streaming its prepared batches with at most `window` unacknowledged."""

    def __init__(self, channel: grpc.aio.Channel, job: str) -> None:
        self.telemetry = pb_grpc.TelemetryStub(channel)
        self.job = job
        self.batches: list[pb.MetricsBatch] = []
        self.acked = 0
        self.latencies_s: list[float] = []

    async def register(self, samples: int, batch: int) -> None:
        registered = await self.telemetry.Register(
            pb.RegisterRequest(
                job=self.job, rank=0, world_size=1, backend="bench", instance_id=f"bench-{self.job}"
            ),
            timeout=60,
        )
        self.batches = [
            make_batch(self.job, registered.session_id, first, min(batch, samples - first + 1))
            for first in range(1, samples + 1, batch)
        ]

    async def run(self, window: int) -> None:
        sent_at: list[float] = []
        free = asyncio.Semaphore(window)

        async def requests():
            for message in self.batches:
                await free.acquire()
                sent_at.append(time.perf_counter())
                yield message

        acks = 0
        async for ack in self.telemetry.StreamMetrics(requests()):
            self.latencies_s.append(time.perf_counter() - sent_at[acks])
            acks += 1
            self.acked = ack.acked_seq
            free.release()


class Database:
    """Fresh databases of one kind: SQLite files in a temp folder, or databases on PostgreSQL."""

    def __init__(self, kind: str, work: pathlib.Path) -> None:
        self.kind, self.work, self.cluster, self._count = kind, work, None, 0
        if kind == "postgresql":
            from devtools.pgcluster import PgCluster

            self.cluster = PgCluster.start(durable=True, settings=("max_connections=400",))

    def fresh(self) -> str:
        self._count += 1
        if self.kind == "sqlite":
            return f"sqlite:///{self.work / f'ingest-{self._count}.db'}"
        if self.cluster is not None:
            return self.cluster.create_database(f"ingest_{self._count}")
        engine = sa.create_engine(self.kind, isolation_level="AUTOCOMMIT")  # a server of yours
        name = f"autobyte_bench_{os.getpid()}_{self._count}"
        with engine.connect() as connection:
            connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
        engine.dispose()
        return (
            sa.engine.make_url(self.kind).set(database=name).render_as_string(hide_password=False)
        )

    def server_processes(self) -> list[psutil.Process]:
        if self.cluster is None:
            return []
        postmaster = psutil.Process(
            int((self.cluster.data / "postmaster.pid").read_text().split()[0])
        )
        return [postmaster, *postmaster.children(recursive=True)]

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()


def start_daemons(
    executable: str, db_url: str, count: int, work: pathlib.Path
) -> list[tuple[subprocess.Popen, str]]:
    config = work / "autobyted.toml"
    # Retention is part of what keeps memory and disk flat: keep it on at its default.
    config.write_text('[autobyted]\nlog_format = "text"\n')
    daemons = []
    try:
        for _ in range(count):
            address = f"127.0.0.1:{free_port()}"
            proc = subprocess.Popen(
                [
                    executable,
                    "start",
                    "--listen",
                    address,
                    "--db",
                    db_url,
                    "--log-level",
                    "WARNING",
                    "--config",
                    str(config),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            daemons.append((proc, address))
        for proc, address in daemons:
            _wait(address, proc)
    except BaseException:
        stop_daemons(daemons)
        raise
    return daemons


def stop_daemons(daemons) -> list[int]:
    for proc, _ in daemons:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    codes = []
    for proc, _ in daemons:
        try:
            codes.append(proc.wait(60))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return codes


def one_run(
    executable: str,
    db: Database,
    daemon_count: int,
    streams: int,
    total_samples: int,
    batch: int,
    window: int,
    work: pathlib.Path,
    watch_rss: bool,
) -> dict:
    db_url = db.fresh()
    daemons = start_daemons(executable, db_url, daemon_count, work)
    per_stream = max(1, total_samples // streams)
    prefix = f"s{streams}-{time.monotonic_ns()}"
    daemon_processes = [psutil.Process(proc.pid) for proc, _ in daemons]
    rss_log: list[tuple[float, float]] = []
    try:

        async def main():
            channels = [grpc.aio.insecure_channel(address) for _, address in daemons]
            try:
                runs = [
                    Stream(channels[i % len(channels)], f"{prefix}-{i}") for i in range(streams)
                ]
                await asyncio.gather(*(run.register(per_stream, batch) for run in runs))
                stop = asyncio.Event()

                async def watch():
                    t0 = time.perf_counter()
                    while not stop.is_set():
                        rss_log.append(
                            (
                                time.perf_counter() - t0,
                                max(rss_mib(p.pid) for p in daemon_processes),
                            )
                        )
                        await asyncio.sleep(1.0)

                watcher = asyncio.create_task(watch())
                cpu0 = (
                    cpu_s(daemon_processes),
                    cpu_s(db.server_processes()),
                    cpu_s([psutil.Process()]),
                    time.perf_counter(),
                )
                try:
                    await asyncio.gather(*(run.run(window) for run in runs))
                finally:
                    stop.set()
                    await watcher
                cpu1 = (
                    cpu_s(daemon_processes),
                    cpu_s(db.server_processes()),
                    cpu_s([psutil.Process()]),
                    time.perf_counter(),
                )
                return runs, [b - a for a, b in zip(cpu0, cpu1)]
            finally:
                for channel in channels:
                    await channel.close()

        runs, (daemon_cpu, server_cpu, client_cpu, elapsed) = asyncio.run(main())
    finally:
        codes = stop_daemons(daemons)
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as connection:
            rows = "from step_metrics s join jobs j on s.job_id = j.id where j.name like :prefix"
            stored = connection.execute(
                sa.text(f"select count(*) {rows}"), {"prefix": f"{prefix}-%"}
            ).scalar()
            distinct = connection.execute(
                sa.text(f"select count(*) from (select distinct s.job_id, s.step {rows}) d"),
                {"prefix": f"{prefix}-%"},
            ).scalar()
    finally:
        engine.dispose()
    if db.cluster is not None:
        db.cluster.drop_database(db_url)
    sent = per_stream * streams
    latencies = sorted(x for run in runs for x in run.latencies_s)
    rss = [r for _, r in rss_log]
    if watch_rss:
        print(
            f"\nRSS of the largest daemon over the run (t_s, MiB), {daemon_count} daemon(s), {streams} streams:"
        )
        for t, r in rss_log[:: max(1, len(rss_log) // 12)] + rss_log[-1:]:
            print(f"  {t:7.1f}  {r:7.1f}")
    return {
        "sent": sent,
        "elapsed_s": elapsed,
        "rate": sent / elapsed,
        "acked": sum(run.acked for run in runs),
        "stored": stored,
        "duplicates": stored - distinct,
        "lost": sent - distinct,
        "p50_ms": 1e3 * latencies[len(latencies) // 2],
        "p99_ms": 1e3 * latencies[int(len(latencies) * 0.99)],
        "rss_max": max(rss, default=0.0),
        "rss_end": rss[-1] if rss else 0.0,
        "daemon_cpu": daemon_cpu,
        "server_cpu": server_cpu,
        "client_cpu": client_cpu,
        "exit_codes": codes,
    }


def run(args) -> int:
    builds = args.autobyted or [str(BIN / "autobyted")]
    daemon_counts = [int(n) for n in args.daemons.split(",")]
    streams_list = [int(s) for s in args.streams.split(",")]
    if args.db == "sqlite" and max(daemon_counts) > 1:
        raise SystemExit("one SQLite file serves one daemon: use --db postgresql for --daemons > 1")
    work = pathlib.Path(tempfile.mkdtemp(prefix="autobyte-ingest-"))
    db = Database(args.db, work)
    results: dict[tuple, list[dict]] = {}
    failures = 0
    try:
        for _ in range(args.repeat):
            for daemons in daemon_counts:
                for streams in streams_list:
                    for build in builds:  # builds interleaved: the same conditions for each
                        r = one_run(
                            build,
                            db,
                            daemons,
                            streams,
                            args.samples,
                            args.batch,
                            args.window,
                            work,
                            args.rss,
                        )
                        failures += (
                            r["lost"] != 0
                            or r["duplicates"] != 0
                            or r["acked"] != r["sent"]
                            or any(r["exit_codes"])
                        )
                        results.setdefault((build, daemons, streams), []).append(r)
    finally:
        db.close()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nload: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores; db {args.db.split('://')[0]}"
        f"{' (throwaway cluster, fsync on)' if args.db == 'postgresql' else ''}; batch {args.batch} samples, "
        f"window {args.window} batches/stream; median of {args.repeat}"
    )
    header = (
        f"{'build':>8} {'daemons':>7} {'streams':>7} {'samples':>8} {'samples/s':>10} {'per daemon':>10} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'rssMax':>7} {'lost':>5} {'dup':>4} "
        f"{'cpu daemons':>11} {'cpu pg':>7} {'cpu client':>10}"
    )
    print(header)
    for (build, daemons, streams), runs in results.items():

        def med(key):
            return statistics.median(r[key] for r in runs)  # noqa: B023 - called within this iteration

        label = "this" if build == str(BIN / "autobyted") else f"#{builds.index(build)}"
        elapsed = med("elapsed_s")
        print(
            f"{label:>8} {daemons:>7} {streams:>7} {runs[0]['sent']:>8} {med('rate'):>10.0f} "
            f"{med('rate') / daemons:>10.0f} {med('p50_ms'):>7.1f} {med('p99_ms'):>7.1f} "
            f"{max(r['rss_max'] for r in runs):>7.1f} {sum(r['lost'] for r in runs):>5} "
            f"{sum(r['duplicates'] for r in runs):>4} {med('daemon_cpu') / elapsed:>10.2f}c "
            f"{med('server_cpu') / elapsed:>6.2f}c {med('client_cpu') / elapsed:>9.2f}c"
        )
    for index, build in enumerate(builds):
        print(f"  build #{index}: {build}")
    print(
        "  cpu columns: cores used on average over the timed part (all daemons together; the PostgreSQL "
        "server's processes; the client)"
    )
    return 1 if failures else 0


def _wait(address: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.QueryStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"autobyted exited with {proc.returncode}")
            try:
                stub.Status(pb.StatusRequest(), timeout=1)
                return
            except grpc.RpcError:
                time.sleep(0.1)
    raise SystemExit("autobyted did not start")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="1,16,256")
    parser.add_argument("--samples", type=int, default=200_000, help="samples per row of the table")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--window", type=int, default=2, help="unacknowledged batches per stream")
    parser.add_argument(
        "--db",
        default="sqlite",
        help="sqlite, postgresql (a throwaway cluster), or the "
        "SQLAlchemy URL of a PostgreSQL server whose user may create databases",
    )
    parser.add_argument(
        "--daemons", default="1", help="daemon counts to measure, e.g. 1,2,4 (PostgreSQL)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per row; the table shows medians"
    )
    parser.add_argument(
        "--autobyted",
        action="append",
        help="daemon executable to measure (repeat to compare builds; default: this one)",
    )
    parser.add_argument("--rss", action="store_true", help="print the daemon's RSS over the run")
    args = parser.parse_args()
    if args.db not in ("sqlite", "postgresql") and not args.db.startswith("postgresql"):
        parser.error(f"--db {args.db!r}: sqlite, postgresql or a postgresql+psycopg:// URL")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
