"""Host CPU load for the step metrics, sampled off the training thread so a step only reads a float.

`StepMetrics.host_load` is the share of this host's CPU capacity that processes *outside this job*
used over the last sampling interval (default 1 s):

    host_load = (host busy CPU time - the job's CPU time on this host) / (interval x online cores)

in [0, 1]. "Busy" is every non-idle /proc/stat column (user, nice, system, irq, softirq, steal:
time a hypervisor gave to another guest is load from others too). The job's CPU time on this host
is this process's (all of its threads: the training thread, the scheduler's and the backend's),
that of the job's other ranks on this host (`exclude`: the scheduler and `autobyte.fsdp` learn
their pids at construction, `local_peer_pids`) and of these processes' children (data-loader
workers: the children the main thread started, /proc/PID/task/PID/children). The job's own ranks
are not "others" because their CPU moves with the job's configuration: smaller partitions mean
more collectives, more CPU in every co-located rank's backend threads, and a tuner that read that
as a neighbour's load leaving would distrust every trial that is faster for using less CPU. What
matters to the tuner is a *change* of this figure (a neighbour's job starting on the host), which
it detects against the job's own level.

0.0 means "unknown" (not Linux, sampler not started, first interval not over yet). A measured
value is reported as at least MIN_KNOWN_LOAD so that an idle host is never mistaken for unknown.

Cost: the training thread calls `value` (an attribute read, ~0.02 µs); the sampler thread reads
/proc/stat and two small /proc files per process of the job on this host once per interval: 60 µs
of CPU for one process alone, 0.7 ms with 7 co-located ranks of 2 children each (24 processes),
that is 0.07% of the interval. `python -m benchmarks.bench_tuner hostload` measures both.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

MIN_KNOWN_LOAD = 1e-3
PROC_STAT = "/proc/stat"
# /proc/stat "cpu" columns: user nice system idle iowait irq softirq steal guest guest_nice.
# guest and guest_nice are already included in user and nice.
_IDLE_COLUMNS = (3, 4)
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)
MAX_JOB_PROCESSES = 256  # processes of the job followed on one host (ranks and their children)


def _read_host_ticks(path: str) -> tuple[int, int]:
    """(busy ticks, total ticks) summed over all CPUs since boot."""
    with open(path, "rb") as handle:
        first = handle.readline().split()
    if not first or first[0] != b"cpu":
        raise ValueError(f"{path}: no aggregate 'cpu' line")
    values = [int(v) for v in first[1:9]] + [0] * max(0, 8 - len(first[1:9]))
    busy = sum(values[i] for i in _BUSY_COLUMNS)
    return busy, busy + sum(values[i] for i in _IDLE_COLUMNS)


def _process_ticks(pid: int) -> int | None:
    """utime + stime of process `pid` (all its threads), in clock ticks; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    try:
        return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), after "pid (comm)"
    except (IndexError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    """The children process `pid`'s main thread started (CONFIG_PROC_CHILDREN; [] without it)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as handle:
            return [int(c) for c in handle.read().split()]
    except (OSError, ValueError):
        return []


def job_processes(roots: Iterable[int]) -> list[int]:
    """`roots` and their descendants (through each main thread's children), at most
    MAX_JOB_PROCESSES."""
    seen: dict[int, None] = {}
    stack = list(roots)
    while stack and len(seen) < MAX_JOB_PROCESSES:
        pid = stack.pop()
        if pid not in seen:
            seen[pid] = None
            stack.extend(_children(pid))
    return list(seen)


def host_key() -> int:
    """Equal for processes that see each other's /proc: this boot of this host, this pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    digest = hashlib.sha256(f"{boot}:{namespace}".encode()).digest()
    return int.from_bytes(digest[:7], "big")  # fits an int64


def local_peer_pids(group: Any) -> tuple[int, ...]:
    """The pids of `group`'s other members on this host (collective: every member calls it, in
    the same order as its other collectives on `group`; a gloo group)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([host_key(), os.getpid()], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    key, pid = mine.tolist()
    return tuple(other for k, other in (t.tolist() for t in every) if k == key and other != pid)


class HostLoadSampler:
    """Background sampler of `host_load` (see the module docstring). The constructor starts nothing;
    `start()` starts one daemon thread, `stop()` ends it. `value` is safe to read from any thread."""

    def __init__(self, interval_s: float = 1.0, proc_stat: str = PROC_STAT) -> None:
        if not 0.05 <= interval_s <= 60:
            raise ValueError(f"interval_s={interval_s} must be within [0.05, 60] seconds")
        self.interval_s = interval_s
        self._path = proc_stat
        self._ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[int, int] | None = None  # the host's (busy, total) ticks
        self._roots: tuple[int, ...] = (os.getpid(),)  # the job's processes on this host
        self._job_ticks: dict[int, int] = {}  # each job process's CPU ticks at the last sample
        self.value = 0.0  # the figure a step reads; 0.0 = unknown

    def exclude(self, pids: Iterable[int]) -> None:
        """Count these processes (the job's other ranks on this host) and their children as the
        job's own, not as others' load, from the next interval on."""
        self._roots = tuple(dict.fromkeys((*self._roots, *(int(p) for p in pids))))

    def _job_delta(self) -> int:
        """CPU ticks the job's processes on this host used since the last sample (a process first
        seen now counts from now: its earlier ticks are not this interval's)."""
        now = {}
        for pid in job_processes(self._roots):
            ticks = _process_ticks(pid)
            if ticks is not None:
                now[pid] = ticks
        delta = sum(max(0, t - self._job_ticks[p]) for p, t in now.items() if p in self._job_ticks)
        self._job_ticks = now
        return delta

    def start(self) -> bool:
        """Start sampling; False (and `value` stays 0.0 = unknown) where /proc/stat is unreadable."""
        if self._thread is not None:
            return True
        try:
            self._last = _read_host_ticks(self._path)
            self._job_delta()
        except (OSError, ValueError) as error:
            log.debug("host load unknown: %s", error)
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="autobyte-hostload", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def sample(self) -> float:
        """Take one sample now (the sampler thread calls this every interval); returns `value`."""
        busy, total = _read_host_ticks(self._path)
        job = self._job_delta()
        if self._last is not None:
            last_busy, last_total = self._last
            if total > last_total:
                others = busy - last_busy - job
                self.value = min(1.0, max(MIN_KNOWN_LOAD, others / (total - last_total)))
        self._last = (busy, total)
        return self.value

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except (OSError, ValueError) as error:  # keep the last value; never disturb training
                log.debug("host load sample failed: %s", error)
