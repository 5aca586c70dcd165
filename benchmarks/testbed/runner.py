"""What a testbed run collects and the threads that collect it: each rank's output, the trace
follower that applies changes on time or on rank 0's steps, and the link byte-counter monitor."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from benchmarks.testbed.namespaces import TestbedError
from benchmarks.testbed.traces import Change, RateChange, Trace

if TYPE_CHECKING:
    from benchmarks.testbed.bed import Testbed

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RankResult:
    """What one rank produced."""

    rank: int
    returncode: int | None
    events: list[dict[str, Any]]  # every JSON object the rank printed on stdout, in order
    stdout_other: list[str]  # stdout lines that were not JSON objects
    stderr_tail: str

    @property
    def results(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == "result"]


@dataclasses.dataclass
class RunResult:
    ranks: list[RankResult]
    # Every rate change applied: t_s (from the origin), wall_time, rate_bps, ranks, step, trigger.
    rate_log: list[dict[str, Any]]
    # Optional samples of every rank's egress and ingress byte counters: t_launch_s, t_s (from the
    # trace origin; None before it), wall_time, tx_bytes[rank], rx_bytes[rank], rates_bps[rank].
    link_samples: list[dict[str, Any]]
    origin_wall_time: float | None
    duration_s: float
    # Every condition change applied by the trace (cpu_share, busy, flows): t_s, wall_time, ranks,
    # step, trigger, and what it did; "stopped" lists the CPU seconds of the processes it ended.
    condition_log: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.returncode == 0 for r in self.ranks)


class _RankCollector:
    """Reads one rank's stdout (JSON lines) and stderr (tail) on two threads."""

    def __init__(self, rank: int, on_event: Callable[[int, dict[str, Any]], None] | None) -> None:
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self.other: list[str] = []
        self.stderr: collections.deque[str] = collections.deque(maxlen=200)
        self.listeners: list[Callable[[int, dict[str, Any]], None]] = [on_event] if on_event else []
        self.threads: list[threading.Thread] = []

    def attach(self, proc: subprocess.Popen) -> None:
        for target, stream in ((self._read_stdout, proc.stdout), (self._read_stderr, proc.stderr)):
            thread = threading.Thread(
                target=target, args=(stream,), daemon=True, name=f"testbed-rank{self.rank}"
            )
            thread.start()
            self.threads.append(thread)

    def _read_stdout(self, stream: Any) -> None:
        for line in stream:
            text = line.strip()
            event = None
            if text.startswith("{"):
                try:
                    event = json.loads(text)
                except json.JSONDecodeError:
                    event = None
            if isinstance(event, dict):
                self.events.append(event)
                for listener in self.listeners:
                    try:
                        listener(self.rank, event)
                    except Exception:
                        logger.exception("testbed event listener failed")
            elif text:
                self.other.append(text)

    def _read_stderr(self, stream: Any) -> None:
        for line in stream:
            self.stderr.append(line.rstrip("\n"))

    def join(self) -> None:
        for thread in self.threads:
            thread.join(10)

    def result(self, returncode: int | None) -> RankResult:
        return RankResult(self.rank, returncode, self.events, self.other, "\n".join(self.stderr))


class _TraceFollower(threading.Thread):
    """Applies a trace's changes when their time (from train_start) or rank 0's step comes."""

    def __init__(self, bed: Testbed, trace: Trace, launch_monotonic: float) -> None:
        super().__init__(daemon=True, name="testbed-trace")
        self.bed = bed
        self.pending = sorted(
            trace.changes, key=lambda c: (c.at_step is not None, c.at_s or 0, c.at_step or 0)
        )
        self.launch = launch_monotonic
        self.origin: float | None = None
        self.origin_wall_time: float | None = None
        self.step = -1
        self.log: list[dict[str, Any]] = []  # rate changes
        self.condition_log: list[dict[str, Any]] = []  # the other changes
        self._wake = threading.Condition()
        self._stopped = False

    def on_event(self, rank: int, event: dict[str, Any]) -> None:
        kind = event.get("event")
        with self._wake:
            if kind == "train_start" and self.origin is None:
                self.origin, self.origin_wall_time = time.monotonic(), time.time()
            elif kind == "step" and rank == 0 and isinstance(event.get("step"), int):
                self.step = max(self.step, event["step"])
            else:
                return
            self._wake.notify()

    def _due(self, change: Change) -> bool:
        if change.at_step is not None:
            return self.step >= change.at_step
        return self.origin is not None and self.elapsed() >= (change.at_s or 0.0)

    def elapsed(self) -> float:
        return time.monotonic() - (self.origin if self.origin is not None else self.launch)

    def run(self) -> None:
        while True:
            with self._wake:
                if self._stopped or not self.pending:
                    return
                due = [c for c in self.pending if self._due(c)]
                if not due:
                    self._wake.wait(0.005)
                    continue
                self.pending = [c for c in self.pending if c not in due]
                step, elapsed = self.step, self.elapsed()
            for change in due:
                try:
                    done = change.apply(self.bed)
                except (TestbedError, ValueError, OSError):
                    logger.exception("trace change failed: %s", change)
                    continue
                entry = {
                    "t_s": round(elapsed, 4),
                    "wall_time": time.time(),
                    **done,
                    "step": step,
                    "ranks": list(change.ranks) if change.ranks is not None else None,
                    "trigger": "step" if change.at_step is not None else "time",
                }
                (self.log if isinstance(change, RateChange) else self.condition_log).append(entry)

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self.is_alive():
            self.join(5)


class _LinkMonitor(threading.Thread):
    """Samples every rank's egress byte counter, for throughput-over-time plots."""

    def __init__(self, bed: Testbed, follower: _TraceFollower, interval_s: float) -> None:
        super().__init__(daemon=True, name="testbed-monitor")
        self.bed, self.follower, self.interval_s = bed, follower, interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            try:
                tx = [self.bed.link_tx_bytes(r) for r in range(self.bed.world_size)]
                rx = [self.bed.link_rx_bytes(r) for r in range(self.bed.world_size)]
            except (TestbedError, ValueError, subprocess.TimeoutExpired):
                return  # the testbed is being torn down
            origin = self.follower.origin
            now = time.monotonic()
            self.samples.append(
                {
                    "t_launch_s": round(now - self.follower.launch, 4),
                    "t_s": round(now - origin, 4) if origin is not None else None,
                    "wall_time": time.time(),
                    "tx_bytes": tx,
                    "rx_bytes": rx,
                    "rates_bps": list(self.bed.rates_bps),
                }
            )

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)
