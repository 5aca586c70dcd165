"""benchmarks.testbed.host: the CPU time a hypervisor stole during a run, read from /proc/stat."""

from __future__ import annotations

from pathlib import Path

from benchmarks.testbed.host import HostWatch, cpu_jiffies


def test_cpu_jiffies_reads_all_time_and_steal_from_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 50 800 10 1 4 30 0 0\ncpu0 50 2 25 400 5 0 2 15 0 0\n")
    assert cpu_jiffies(stat) == (1000, 30)
    stat.write_text("cpu  100 5\n")  # too short (an old kernel, a container's fake): unknown
    assert cpu_jiffies(stat) is None
    assert cpu_jiffies(tmp_path / "missing") is None


def test_a_run_reports_its_load_and_steal_share() -> None:
    report = HostWatch().report()
    assert report["steal_share"] is None or 0.0 <= report["steal_share"] <= 1.0
    assert len(report["load_start"].split()) == 3
    line = HostWatch.describe({**report, "steal_share": 0.26})
    assert line.endswith("CPU steal 26%") and " UTC, load " in line
    assert HostWatch.describe(None) == "not recorded"
