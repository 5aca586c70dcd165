"""Shared fixtures: free ports, real daemons (in a thread or as a process), temp databases."""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _dist_util import free_port  # noqa: F401  (re-exported for the tests)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


class ThreadDaemon:
    """A real autobyted (gRPC server + SQLite) running on an event loop in a background thread."""

    def __init__(self, db_url: str, asyncio_debug: bool = False, **overrides) -> None:
        from autobyted.app import Daemon
        from autobyted.settings import Settings

        self.asyncio_debug = asyncio_debug  # asyncio logs every callback that blocks the loop > 0.1 s
        self.settings = Settings(listen="127.0.0.1:0", db=db_url, **overrides)
        self.daemon = Daemon(self.settings)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._engine = None

    def storage(self):
        """A storage of its own on the daemon's database, for the test to look at (closed by stop())."""
        from autobyted.storage.db import make_engine
        from autobyted.storage.sql import SqlStorage

        if self._engine is None:
            self._engine = make_engine(self.settings.db)
        return SqlStorage(self._engine)

    def _run(self) -> None:
        try:
            asyncio.run(self.daemon.run(ready=lambda port: self._ready.set(), install_signals=False),
                        debug=self.asyncio_debug)
        except BaseException as error:  # surfaced by start()
            self._error = error
            self._ready.set()

    def start(self, wait: bool = True) -> "ThreadDaemon":
        """Starts it and (wait=True) waits until it serves; `wait_ready()` waits for one started
        with wait=False (several daemons starting at once)."""
        self._thread.start()
        return self.wait_ready() if wait else self

    def wait_ready(self) -> "ThreadDaemon":
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"daemon failed to start: {self._error!r}")
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.daemon.port}"

    def stop(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
        if not self._thread.is_alive():
            return
        self.daemon.stop()
        self._thread.join(30)
        assert not self._thread.is_alive(), "daemon did not stop"


@pytest.fixture
def db_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'autobyte.db'}"


# ---------------------------------------------------------------------- PostgreSQL
# One throwaway cluster per test session (initdb/pg_ctl of the system's server, run as `postgres`
# when the suite runs as root), one fresh database per test. Started only when a test asks.


@pytest.fixture(scope="session")
def pg_cluster():
    from benchmarks.pgcluster import PgCluster, PgUnavailable

    try:
        cluster = PgCluster.start()
    except PgUnavailable as error:
        pytest.fail(f"{error}; the PostgreSQL tests need it", pytrace=False)
    atexit.register(cluster.stop)  # also when the session ends abnormally
    try:
        yield cluster
    finally:
        cluster.stop()
        atexit.unregister(cluster.stop)


@pytest.fixture
def pg_url(pg_cluster):
    url = pg_cluster.create_database()
    yield url
    pg_cluster.drop_database(url)


DATABASES = ["sqlite", "postgresql"]


def database_url(request, tmp_path) -> str:
    """For a fixture parametrized over DATABASES: a SQLite file or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'autobyte.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def thread_daemon(db_url):
    daemon = ThreadDaemon(db_url).start()
    yield daemon
    daemon.stop()



def start_mlp_trainer(daemon: str, job: str, steps: int, tmp_path) -> subprocess.Popen:
    """A 2-rank torchrun of examples/train_mlp.py streaming to `daemon` (one address or a list):
    64 KiB partitions, 256 KiB credit, 20 ms of sleep per step, per-rank results in tmp_path."""
    env = {**os.environ, "AUTOBYTE_DAEMON": daemon, "AUTOBYTE_JOB": job, "AUTOBYTE_FLUSH_TIMEOUT_S": "30",
           "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path)}  # torchrun's torchelastic_* folder goes with the test
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), str(ROOT / "examples" / "train_mlp.py"),
                             "--steps", str(steps), "--width", "256", "--depth", "2", "--partition", "64KiB",
                             "--credit", "256KiB", "--step-sleep-s", "0.02", "--out", str(tmp_path / "r{rank}.json")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

def start_daemon_process(db_url: str, port: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """`autobyted start` as a real process; waits until it answers Status."""
    proc = subprocess.Popen([str(BIN / "autobyted"), "start", "--listen", f"127.0.0.1:{port}", "--db", db_url,
                             "--log-format", "text", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    try:
        wait_until_serving(f"127.0.0.1:{port}", proc)
    except BaseException:
        stop_process(proc, signal.SIGKILL)  # never leave a daemon behind
        raise
    return proc


def wait_until_serving(address: str, proc: subprocess.Popen | None = None, timeout_s: float = 30.0) -> None:
    """Polls the standard health service (it needs no token) until it says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"autobyted exited with {proc.returncode}: {proc.stdout.read()}")
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"autobyted at {address} did not come up within {timeout_s}s")


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture
def daemon_process(db_url):
    port = free_port()
    proc = start_daemon_process(db_url, port)
    proc.address = f"127.0.0.1:{port}"
    yield proc
    stop_process(proc, signal.SIGKILL)
