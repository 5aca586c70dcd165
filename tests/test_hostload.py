"""The host-load sampler: others' CPU counts, our own does not, unknown stays 0.0."""

import os
import time

from autobyte.hostload import MIN_KNOWN_LOAD, HostLoadSampler

from tests.helpers.wait import wait_for


def _write_stat(path, busy_ticks: int, idle_ticks: int) -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    path.write_text(f"cpu  {busy_ticks} 0 0 {idle_ticks} 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_others_cpu_share_is_measured_and_our_own_is_subtracted(tmp_path):
    stat = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")
    _write_stat(stat, 1000, 1000)
    sampler = HostLoadSampler(proc_stat=str(stat))
    assert sampler.value == 0.0 and sampler.start()
    try:
        cpu0 = sum(os.times()[:2])
        _spin(0.3)  # our own CPU: shows in the host's busy ticks, must not count as others'
        own_ticks = round((sum(os.times()[:2]) - cpu0) * hz)
        # over the interval: 4 s of host capacity, 1 s of it others' work, plus ours
        _write_stat(stat, 1000 + hz + own_ticks, 1000 + 3 * hz - own_ticks)
        assert abs(sampler.sample() - 0.25) < 0.03
        _write_stat(stat, 1000 + hz + own_ticks, 1000 + 7 * hz - own_ticks)  # an idle interval
        assert sampler.sample() == MIN_KNOWN_LOAD  # known and idle: never 0.0 (= unknown)
    finally:
        sampler.stop()


def test_the_real_proc_stat_gives_a_known_share():
    sampler = HostLoadSampler(interval_s=0.1)
    assert sampler.start()
    try:
        known = wait_for(
            lambda: sampler.value, timeout_s=10, what="the sampler thread's first sample"
        )
        assert MIN_KNOWN_LOAD <= known <= 1.0
    finally:
        sampler.stop()


def test_unreadable_proc_stat_means_unknown(tmp_path):
    sampler = HostLoadSampler(proc_stat=str(tmp_path / "missing"))
    assert sampler.start() is False
    assert sampler.value == 0.0
    sampler.stop()
