"""The host-load sampler: others' CPU counts; our own, our children's and the job's other ranks'
on this host do not; unknown stays 0.0."""

import os
import subprocess
import sys
import time

from autobyte.hostload import MIN_KNOWN_LOAD, HostLoadSampler, local_peer_pids

from tests.helpers.dist import run_ranks
from tests.helpers.wait import wait_for

# spins `S` seconds of its own CPU, then idles (killed by the test)
SPIN = (
    "import itertools, sys, time; e = time.process_time() + float(sys.argv[1]); "
    "any(time.process_time() > e for _ in itertools.count()); time.sleep(60)"
)


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


def _ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _orphan_spinner(seconds: float) -> int:
    """A process that is not a descendant of this one (its shell parent exits at once), spinning
    `seconds` of CPU: another process on the host, as far as the process tree tells."""
    started = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -c "{SPIN}" {seconds} >/dev/null 2>&1 & echo $!'],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return int(started.stdout.strip())


def _load_over(stat, hz: int, samplers, spinner: int, seconds: float) -> list[float]:
    """Each sampler's value over one interval of 4 s of host capacity in which others worked 1 s
    besides the spinner's and this process's CPU (all of it in the host's busy ticks)."""
    _write_stat(stat, 1000, 1000)
    for sampler in samplers:
        assert sampler.start()
    try:
        spinner_0, own_0 = _ticks(spinner), _ticks(os.getpid())
        wait_for(
            lambda: _ticks(spinner) - spinner_0 >= 0.9 * seconds * hz,
            timeout_s=20,
            what="the spinner's CPU",
        )
        busy = hz + (_ticks(spinner) - spinner_0) + (_ticks(os.getpid()) - own_0)
        _write_stat(stat, 1000 + busy, 1000 + 4 * hz - busy)
        return [sampler.sample() for sampler in samplers]
    finally:
        for sampler in samplers:
            sampler.stop()


def test_the_jobs_other_ranks_on_this_host_are_not_others_load(tmp_path):
    stat, hz = tmp_path / "stat", os.sysconf("SC_CLK_TCK")
    peer = _orphan_spinner(0.4)
    try:
        counted = HostLoadSampler(proc_stat=str(stat))
        excluded = HostLoadSampler(proc_stat=str(stat))
        excluded.exclude([peer])  # as the scheduler's pids of its co-located ranks
        as_others, as_job = _load_over(stat, hz, [counted, excluded], peer, 0.4)
    finally:
        os.kill(peer, 9)
    assert abs(as_job - 0.25) < 0.03  # only the 1 s of others' work
    assert as_others - as_job > 0.07  # the peer's ~0.4 s of 4 s counted when not excluded


def test_the_processes_children_are_the_jobs_own(tmp_path):
    stat, hz = tmp_path / "stat", os.sysconf("SC_CLK_TCK")
    child = subprocess.Popen([sys.executable, "-c", SPIN, "0.4"])  # a data-loader worker, say
    try:
        (value,) = _load_over(stat, hz, [HostLoadSampler(proc_stat=str(stat))], child.pid, 0.4)
    finally:
        child.kill()
        child.wait()
    assert abs(value - 0.25) < 0.03


def _peers(rank, world):
    import torch
    import torch.distributed as dist
    from autobyte import ScheduledOptimizer

    model = torch.nn.Linear(4, 4)
    scheduled = ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        return os.getpid(), local_peer_pids(dist.group.WORLD), scheduled.local_job_pids
    finally:
        scheduled.close()


def test_every_rank_learns_the_pids_of_its_co_located_ranks():
    (pid0, peers0, scheduled0), (pid1, peers1, scheduled1) = run_ranks(_peers, 2)
    assert peers0 == scheduled0 == (pid1,) and peers1 == scheduled1 == (pid0,)
