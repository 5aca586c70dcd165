"""Facts about the benchmark host that runs and reports need: its load average, the CPU time the
hypervisor took from it, a free local port."""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

from devtools.ports import free_port  # noqa: F401  (the one copy; re-exported for the benchmarks)


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as a report records them ("0.52 0.61 0.70")."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_jiffies(stat: pathlib.Path = pathlib.Path("/proc/stat")) -> tuple[int, int] | None:
    """(all CPU time, the part stolen by the hypervisor) since boot, in jiffies, from /proc/stat's
    first line (user nice system idle iowait irq softirq steal ...); None where it cannot be read."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
        values = [int(v) for v in fields[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    return (sum(values), values[7]) if len(values) == 8 else None


class HostWatch:
    """The host around one run: the load average at its start and end, and the share of CPU time
    the hypervisor stole in between (a VM whose host is oversubscribed runs the same code slower:
    a run measured under 25% steal cannot be compared with one under none)."""

    def __init__(self) -> None:
        self.started_utc = time.strftime("%H:%M:%S", time.gmtime())
        self.load_start = load_average()
        self.start = cpu_jiffies()

    def report(self) -> dict[str, Any]:
        end = cpu_jiffies()
        steal = None
        if self.start is not None and end is not None and end[0] > self.start[0]:
            steal = (end[1] - self.start[1]) / (end[0] - self.start[0])
        return {
            "started_utc": self.started_utc,
            "load_start": self.load_start,
            "load_end": load_average(),
            "steal_share": steal,
        }

    @staticmethod
    def describe(report: dict[str, Any] | None) -> str:
        """One line: "02:45:37 UTC, load 1.90 -> 4.08, CPU steal 12%"."""
        if not report:
            return "not recorded"
        steal = report.get("steal_share")
        stolen = "CPU steal unknown" if steal is None else f"CPU steal {100 * steal:.0f}%"
        return (
            f"{report.get('started_utc', '?')} UTC, load {report.get('load_start', '?').split()[0]} -> "
            f"{report.get('load_end', '?').split()[0]}, {stolen}"
        )
