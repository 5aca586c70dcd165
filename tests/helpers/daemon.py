"""A real autobyted for tests: in a background thread (ThreadDaemon) or as a process; stopping it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time

from tests.helpers.paths import BIN


class ThreadDaemon:
    """A real autobyted (gRPC server + SQLite) running on an event loop in a background thread."""

    def __init__(self, db_url: str, **overrides) -> None:
        from autobyted.app import Daemon
        from autobyted.settings import Settings

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
            asyncio.run(
                self.daemon.run(ready=lambda port: self._ready.set(), install_signals=False)
            )
        except BaseException as error:  # noqa: BLE001 - surfaced by start()
            self._error = error
            self._ready.set()

    def start(self, wait: bool = True) -> ThreadDaemon:
        """Starts it and (wait=True) waits until it serves; `wait_ready()` waits for one started
        with wait=False (several daemons starting at once)."""
        self._thread.start()
        return self.wait_ready() if wait else self

    def wait_ready(self) -> ThreadDaemon:
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"daemon failed to start: {self._error!r}")
        return self

    def wait_tuner_looked(self, job: str, cycles: int = 2, timeout_s: float = 20.0) -> None:
        """Returns once the tuner has looked at `job` `cycles` more times (TunerManager.cycles_of),
        waking it meanwhile as the ingest writer does. Two (the default) include a cycle begun
        after this call: the tuner has seen everything stored before it (a cycle in progress at
        the call may have read the job before the caller's last write)."""
        from tests.helpers.wait import wait_for

        tuner = self.daemon.tuner
        target = tuner.cycles_of.get(job, 0) + cycles

        def looked() -> bool:
            tuner.notify([job])
            return tuner.cycles_of.get(job, 0) >= target

        wait_for(
            looked,
            timeout_s,
            what=f"{cycles} tuner cycle(s) of job {job!r}",
            show=lambda: f"{tuner.cycles_of.get(job, 0)} of {target} cycles",
        )

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


def start_daemon_process(
    db_url: str, port: int, *extra: str, env: dict | None = None
) -> subprocess.Popen:
    """`autobyted start` as a real process; waits until it answers Status."""
    proc = subprocess.Popen(
        [
            str(BIN / "autobyted"),
            "start",
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            db_url,
            "--log-format",
            "text",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        wait_until_serving(f"127.0.0.1:{port}", proc)
    except BaseException:
        stop_process(proc, signal.SIGKILL)  # never leave a daemon behind
        raise
    return proc


def wait_until_serving(
    address: str, proc: subprocess.Popen | None = None, timeout_s: float = 30.0
) -> None:
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
