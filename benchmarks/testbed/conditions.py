"""Testbed conditions besides the link rate: a CPU quota per rank (cgroup), busy and traffic processes.

`benchmarks.testbed.Testbed` uses these to take CPU from a rank and to put competing TCP traffic on
a rank's link (`set_cpu_share`, `set_busy`, `set_flows`, or the same changes in a `Trace`); this
module holds the mechanics and their cleanup:

- `CpuCgroups`: one cgroup of the `cpu` controller per rank, ``<cpu root>/<testbed name>/r<rank>``
  (cgroup v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``, or v2 ``cpu.max`` where the unified
  hierarchy has the cpu controller). A rank's process (all its threads: compute, gloo, the
  scheduler's) is attached at launch; a share of 0.5 lets the whole process use half a core. The
  default period is 10 ms, so a throttled rank stalls for at most a few ms at a time, as it would
  when time-sharing a core with a neighbour, instead of 50 ms with the kernel's 100 ms default.
- `ConditionProcess`: a process the testbed started for a condition (a busy loop, a traffic source
  or sink; see `benchmarks.testbed.traffic`), in a namespace of its own testbed, in its own process group.
  Its CPU time is read from /proc before it is stopped, so the condition's own cost is reported.

Cleanup: `CpuCgroups.close()` moves any task left to the controller's root and removes the
directories; `cleanup_stale_cgroups()` does the same for testbeds whose owning pid is gone
(`python -m benchmarks.testbed --cleanup-stale`). Processes live inside the testbed's namespaces,
so the namespace cleanup kills them even after a SIGKILL of the harness.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

CGROUP_V1_CPU = pathlib.Path("/sys/fs/cgroup/cpu")
CGROUP_V2_CANDIDATES = (pathlib.Path("/sys/fs/cgroup"), pathlib.Path("/sys/fs/cgroup/unified"))
DEFAULT_PERIOD_US = 10_000
TRAFFIC_SCRIPT = pathlib.Path(__file__).with_name("traffic.py")
BUSY_LOOP = "while True:\n    pass\n"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class ConditionError(RuntimeError):
    """A condition could not be applied (no cpu controller, a process did not start)."""


def cpu_controller() -> tuple[pathlib.Path, int] | None:
    """(root directory, cgroup version) of a writable cpu controller, or None."""
    if (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists() and os.access(CGROUP_V1_CPU, os.W_OK):
        return CGROUP_V1_CPU, 1
    for root in CGROUP_V2_CANDIDATES:
        controllers = root / "cgroup.controllers"
        try:
            if "cpu" in controllers.read_text().split() and os.access(root, os.W_OK):
                return root, 2
        except OSError:
            continue
    return None


def _write(path: pathlib.Path, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


def _tasks(group: pathlib.Path) -> list[int]:
    try:
        return [int(x) for x in (group / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _remove_group(group: pathlib.Path, root: pathlib.Path, wait_s: float = 5.0) -> bool:
    """Move the group's tasks to the root, then rmdir (children first); retries while tasks exit."""
    if not group.is_dir():
        return True
    for child in [p for p in group.iterdir() if p.is_dir()]:
        _remove_group(child, root, wait_s)
    deadline = time.monotonic() + wait_s
    while True:
        for pid in _tasks(group):
            try:
                _write(root / "cgroup.procs", str(pid))
            except OSError:
                pass  # exited meanwhile, or a zombie that goes away with its parent's wait
        try:
            group.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                logger.error("could not remove cgroup %s (tasks %s)", group, _tasks(group))
                return False
            time.sleep(0.05)


class CpuCgroups:
    """A cpu cgroup per rank of one testbed. The constructor creates nothing; `create()` does."""

    def __init__(self, name: str, period_us: int = DEFAULT_PERIOD_US) -> None:
        found = cpu_controller()
        if found is None:
            raise ConditionError(
                "no writable cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 "
                "with 'cpu' in cgroup.controllers): cannot limit a rank's CPU"
            )
        if not 1000 <= period_us <= 1_000_000:
            raise ValueError(f"period_us={period_us} must be in [1000, 1000000]")
        self.root, self.version = found
        self.period_us = period_us
        self.base = self.root / name
        self.shares: dict[int, float | None] = {}

    def path(self, rank: int) -> pathlib.Path:
        return self.base / f"r{rank}"

    def create(self, ranks: Sequence[int]) -> None:
        self.base.mkdir(exist_ok=True)
        if self.version == 2:
            try:  # let the children use the cpu controller
                _write(self.base / "cgroup.subtree_control", "+cpu")
            except OSError as error:
                raise ConditionError(
                    f"cannot enable the cpu controller under {self.base}: {error}"
                ) from None
        for rank in ranks:
            self.path(rank).mkdir(exist_ok=True)
            self.shares.setdefault(rank, None)

    def attach(self, rank: int, pid: int) -> None:
        """Move a process (with every thread it has and will have) into the rank's group."""
        _write(self.path(rank) / "cgroup.procs", str(pid))

    def set_share(self, rank: int, share: float | None) -> None:
        """Limit the rank's group to `share` cores (None: no limit)."""
        if share is not None and not 0.01 <= share <= 64:
            raise ValueError(f"cpu share {share!r} must be in [0.01, 64] cores (or None)")
        group = self.path(rank)
        quota = -1 if share is None else max(1000, round(share * self.period_us))
        if self.version == 1:
            _write(group / "cpu.cfs_period_us", str(self.period_us))
            _write(group / "cpu.cfs_quota_us", str(quota))
        else:
            _write(group / "cpu.max", f"{'max' if quota < 0 else quota} {self.period_us}")
        self.shares[rank] = share

    def throttled(self, rank: int) -> dict[str, int]:
        """cpu.stat of the rank's group (nr_periods, nr_throttled, throttled time)."""
        out: dict[str, int] = {}
        try:
            for line in (self.path(rank) / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                out[key] = int(value)
        except (OSError, ValueError):
            pass
        return out

    def close(self) -> bool:
        return _remove_group(self.base, self.root)


def cleanup_stale_cgroups(
    name_pattern: re.Pattern[str], is_stale: Callable[[str], bool]
) -> list[str]:
    """Remove testbed cgroups (directories under the cpu root matching `name_pattern`) for which
    `is_stale(name)` holds."""
    found = cpu_controller()
    if found is None:
        return []
    root, _ = found
    removed = []
    for group in sorted(root.iterdir()):
        if (
            group.is_dir()
            and name_pattern.match(group.name)
            and is_stale(group.name)
            and _remove_group(group, root)
        ):
            removed.append(str(group))
    return removed


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime


@dataclasses.dataclass
class ConditionProcess:
    """A busy loop or traffic endpoint the testbed started in one of its namespaces."""

    kind: str  # busy | flow-source | flow-sink
    rank: int | None  # the rank whose condition it is (None: the testbed's traffic sink)
    proc: subprocess.Popen
    started_monotonic: float
    detail: dict[str, object] = dataclasses.field(default_factory=dict)
    cpu_s: float = 0.0
    wall_s: float = 0.0

    def stop(self, grace_s: float = 1.0) -> dict[str, object]:
        """Stop the process (its group); returns what it cost: CPU seconds over wall seconds."""
        if self.proc.poll() is None:
            self.cpu_s = process_cpu_s(self.proc.pid)
        self.wall_s = time.monotonic() - self.started_monotonic
        kill_group(self.proc, grace_s)
        return {
            "kind": self.kind,
            "rank": self.rank,
            "pid": self.proc.pid,
            "cpu_s": round(self.cpu_s, 3),
            "wall_s": round(self.wall_s, 3),
            **self.detail,
        }


def kill_group(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    """SIGTERM the process group (start_new_session: its id is the child's pid), then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def start_process(
    kind: str,
    rank: int | None,
    exec_prefix: Sequence[str],
    argv: Sequence[str],
    detail: dict[str, object] | None = None,
    ready_line: str | None = None,
    ready_timeout_s: float = 10.0,
) -> ConditionProcess:
    """Start `argv` under `exec_prefix` (``ip netns exec NS``) in its own session; with
    `ready_line`, wait until the process prints it."""
    proc = subprocess.Popen(
        [*exec_prefix, *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if ready_line else subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    item = ConditionProcess(kind, rank, proc, time.monotonic(), dict(detail or {}))
    if ready_line:
        import selectors

        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + ready_timeout_s
        line = ""
        while ready_line not in line:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None or not selector.select(left):
                kill_group(proc)
                raise ConditionError(
                    f"{kind} did not start ({' '.join(argv)}): exit "
                    f"{proc.poll()}, last line {line!r}"
                )
            line = proc.stdout.readline()
        selector.close()
    return item


def busy_argv() -> list[str]:
    return [sys.executable, "-c", BUSY_LOOP]


def sink_argv(bind: str, port: int) -> list[str]:
    return [sys.executable, str(TRAFFIC_SCRIPT), "sink", "--bind", bind, "--port", str(port)]


def source_argv(to: str, port: int, flows: int) -> list[str]:
    return [
        sys.executable,
        str(TRAFFIC_SCRIPT),
        "source",
        "--to",
        to,
        "--port",
        str(port),
        "--flows",
        str(flows),
    ]
