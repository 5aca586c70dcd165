"""Host CPU load for the step metrics, sampled off the training thread so a step only reads a float.

`StepMetrics.host_load` is the share of this host's CPU capacity that *other* processes used over
the last sampling interval (default 1 s):

    host_load = (host busy CPU time - this process's CPU time) / (interval x online cores)

in [0, 1]. "Busy" is every non-idle /proc/stat column (user, nice, system, irq, softirq, steal:
time a hypervisor gave to another guest is load from others too); this process's CPU time counts
all of its threads (the training thread, the scheduler's and the backend's). The other ranks of the
same job on this host count as "others": what matters to the tuner is a *change* of this figure
(a neighbour's job starting on the host), which it detects against the job's own level.

0.0 means "unknown" (not Linux, sampler not started, first interval not over yet). A measured
value is reported as at least MIN_KNOWN_LOAD so that an idle host is never mistaken for unknown.

Cost: the training thread calls `value` (an attribute read, ~0.05 µs); the sampler thread reads
/proc/stat once per interval (~20-40 µs). `python -m benchmarks.bench_tuner hostload` measures both.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

MIN_KNOWN_LOAD = 1e-3
PROC_STAT = "/proc/stat"
# /proc/stat "cpu" columns: user nice system idle iowait irq softirq steal guest guest_nice.
# guest and guest_nice are already included in user and nice.
_IDLE_COLUMNS = (3, 4)
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def _read_host_ticks(path: str) -> tuple[int, int]:
    """(busy ticks, total ticks) summed over all CPUs since boot."""
    with open(path, "rb") as handle:
        first = handle.readline().split()
    if not first or first[0] != b"cpu":
        raise ValueError(f"{path}: no aggregate 'cpu' line")
    values = [int(v) for v in first[1:9]] + [0] * max(0, 8 - len(first[1:9]))
    busy = sum(values[i] for i in _BUSY_COLUMNS)
    return busy, busy + sum(values[i] for i in _IDLE_COLUMNS)


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


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
        self._last: tuple[int, int, float] | None = None
        self.value = 0.0  # the figure a step reads; 0.0 = unknown

    def start(self) -> bool:
        """Start sampling; False (and `value` stays 0.0 = unknown) where /proc/stat is unreadable."""
        if self._thread is not None:
            return True
        try:
            self._last = (*_read_host_ticks(self._path), _own_cpu_s())
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
        busy, total, own = _read_host_ticks(self._path) + (_own_cpu_s(),)
        if self._last is not None:
            last_busy, last_total, last_own = self._last
            total_s = (total - last_total) / self._ticks_per_s
            if total_s > 0:
                others_s = (busy - last_busy) / self._ticks_per_s - (own - last_own)
                self.value = min(1.0, max(MIN_KNOWN_LOAD, others_s / total_s))
        self._last = (busy, total, own)
        return self.value

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except (OSError, ValueError) as error:  # keep the last value; never disturb training
                log.debug("host load sample failed: %s", error)
