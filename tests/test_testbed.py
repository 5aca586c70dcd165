"""The namespace testbed: builds a shaped star, follows a rate trace, runs ranks, cleans up."""

from __future__ import annotations

import json
import statistics
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.testbed import (
    NAME_PREFIX, Testbed, TestbedError, Trace, format_rate, list_namespaces, parse_rate, parse_size)



def needs_netns(test):
    """Only the tests that build namespaces need root and iproute2; the pure ones run everywhere."""
    for mark in (pytest.mark.netns, pytest.mark.slow,
                 pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                    reason="builds network namespaces: needs root and iproute2 (ip, tc)")):
        test = mark(test)
    return test

REPO = Path(__file__).resolve().parents[1]

# Rank 1 streams bytes to rank 0 over TCP; rank 0 prints the received rate every `interval` seconds.
TRANSFER = textwrap.dedent("""
    import json, os, socket, sys, time
    rank, addr = int(os.environ["RANK"]), os.environ["MASTER_ADDR"]
    duration, interval = float(sys.argv[1]), float(sys.argv[2])
    if rank == 0:
        srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addr, 29600)); srv.listen(1)
        conn, _ = srv.accept()
        print(json.dumps({"event": "train_start"}), flush=True)
        t0 = last = time.monotonic(); got = 0; buf = bytearray(1 << 20)
        while True:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n; now = time.monotonic()
            if now - last >= interval:
                mbit = got * 8 / (now - last) / 1e6
                print(json.dumps({"event": "rate", "t": now - t0, "mbit": mbit}), flush=True)
                got, last = 0, now
    else:
        for _ in range(400):
            try:
                s = socket.create_connection((addr, 29600), timeout=5); break
            except OSError:
                time.sleep(0.025)
        data, end = b"x" * (1 << 20), time.monotonic() + duration
        while time.monotonic() < end:
            s.sendall(data)
        s.close()
""")


def _ours(bed_name: str) -> list[str]:
    return [ns for ns in list_namespaces() if ns.startswith(bed_name)]


def test_parse_rate() -> None:
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("300Mbit") == 300 * 10**6
    assert parse_rate(5e8) == 5 * 10**8
    with pytest.raises(ValueError):
        parse_rate("fast")


def test_format_rate_and_parse_size() -> None:
    assert [format_rate(r) for r in (10**9, 300 * 10**6, 64 * 10**3, 12)] == ["1gbit", "300mbit", "64kbit", "12bit"]
    assert parse_rate(format_rate(250 * 10**6)) == 250 * 10**6
    assert parse_size("512kb") == 512 << 10 and parse_size(65536) == 65536
    with pytest.raises(ValueError):
        parse_size("lots")


def test_traces_by_time_and_by_step() -> None:
    by_time = Trace.from_times([(1.5, "80mbit"), (3, "1gbit")], ranks=[1])
    assert [(c.at_s, c.rate_bps, c.ranks) for c in by_time.changes] == [(1.5, 80 * 10**6, (1,)),
                                                                         (3.0, 10**9, (1,))]
    both = by_time + Trace.from_steps([(7, "500mbit")])
    assert [c.at_step for c in both.changes] == [None, None, 7] and both.changes[-1].ranks is None


@needs_netns
def test_shapes_link_and_follows_a_rate_trace() -> None:
    with Testbed(world_size=2, rate="400mbit") as bed:
        assert len(_ours(bed.name)) == 3  # hub + 2 ranks
        result = bed.run([sys.executable, "-c", TRANSFER, "2.5", "0.25"],
                         trace=Trace.from_times([(1.25, "80mbit")]), timeout_s=30)
        name = bed.name
    assert _ours(name) == [], "namespaces left behind"
    assert [c["rate_bps"] for c in result.rate_log] == [80 * 10**6]
    rates = [(e["t"], e["mbit"]) for e in result.ranks[0].events if e.get("event") == "rate"]
    before = [m for t, m in rates if 0.2 < t <= 1.2]
    after = [m for t, m in rates if t > 1.6]
    assert before and after, rates
    assert 0.6 * 400 < sum(before) / len(before) < 1.1 * 400, rates
    assert 0.6 * 80 < sum(after) / len(after) < 1.15 * 80, rates


@needs_netns
def test_gloo_all_reduce_between_namespaces() -> None:
    worker = textwrap.dedent("""
        import json, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.full((1000,), float(dist.get_rank() + 1))
        dist.all_reduce(t)
        print(json.dumps({"event": "result", "sum": t[0].item(), "ws": dist.get_world_size()}))
        dist.destroy_process_group()
    """)
    with Testbed(world_size=2, rate="1gbit") as bed:
        result = bed.run([sys.executable, "-c", worker], timeout_s=60, cwd=str(REPO))
    assert [r.results[0]["sum"] for r in result.ranks] == [3.0, 3.0]


@needs_netns
def test_cleans_up_when_a_worker_fails() -> None:
    # Rank 1 fails at once; rank 0 would wait forever. The run must fail fast, kill rank 0 and
    # leave nothing behind.
    worker = textwrap.dedent("""
        import json, os, sys, time
        print(json.dumps({"event": "pid", "pid": os.getpid()}), flush=True)
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(600)
    """)
    started = time.monotonic()
    with Testbed(world_size=2) as bed:
        with pytest.raises(TestbedError, match="a rank failed") as info:
            bed.run([sys.executable, "-c", worker], timeout_s=300, fail_grace_s=1.0)
        name = bed.name
    # failed fast: far sooner than the run's timeout (typically ~3 s; the margin absorbs a loaded machine)
    assert time.monotonic() - started < 120
    result = info.value.result
    assert result.ranks[1].returncode == 3
    pid0 = next(e["pid"] for e in result.ranks[0].events if e.get("event") == "pid")
    assert not _alive(pid0)
    assert _ours(name) == []


@needs_netns
def test_cleans_up_on_sigterm_of_the_harness() -> None:
    # A harness process holding a testbed with two sleeping ranks gets SIGTERM: its handler must
    # kill the ranks and delete the namespaces before the process exits.
    harness = textwrap.dedent("""
        import json, sys, threading
        from benchmarks.testbed import Testbed
        lock = threading.Lock()  # on_event runs on one reader thread per rank
        worker = ("import json, os, time; "
                  "print(json.dumps({'event': 'pid', 'pid': os.getpid()}), flush=True); "
                  "time.sleep(600)")
        def report(rank, event):
            with lock:
                print(json.dumps({"rank": rank, **event}), flush=True)
        with Testbed(world_size=2) as bed:
            print(json.dumps({"name": bed.name}), flush=True)
            bed.run([sys.executable, "-c", worker], on_event=report, timeout_s=120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", harness], cwd=str(REPO), stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        name, pids = None, []
        for line in proc.stdout:  # skip anything that is not ours (warnings, other events)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if not isinstance(message, dict):
                continue
            name = message.get("name", name)
            if message.get("event") == "pid":
                pids.append(message["pid"])
            if name and len(pids) == 2:
                break
        assert name and len(pids) == 2, (name, pids)
        assert len(_ours(name)) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()  # SIGKILL leaves the namespaces: remove those of dead harnesses
            proc.wait()
            subprocess.run([sys.executable, "-m", "benchmarks.testbed", "--cleanup-stale"], cwd=str(REPO),
                           capture_output=True, timeout=60)
    assert _ours(name) == []
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
    assert not [ns for ns in list_namespaces() if ns.startswith(f"{NAME_PREFIX}-{proc.pid}-")]


@needs_netns
def test_train_worker_under_a_step_trace_with_online_reconfiguration(tmp_path: Path) -> None:
    # The evaluation runner's path: real ranks train with the scheduler, a step-based trace lowers
    # the rate, and a policy in this process reconfigures rank 0 through the control file.
    control = tmp_path / "control.jsonl"
    control.touch()

    def policy(rank: int, event: dict) -> None:
        if rank == 0 and event.get("event") == "step" and event["step"] == 2:
            with control.open("a") as f:
                f.write(json.dumps({"partition_bytes": 0}) + "\n")  # rejected; training goes on
                f.write(json.dumps({"partition_bytes": 1 << 20, "credit_bytes": 4 << 20}) + "\n")

    command = [sys.executable, "-m", "benchmarks.train_worker", "--model", "mlp",
               "--model-args", json.dumps({"in_features": 64, "hidden": 256, "depth": 2}),
               "--batch-size", "16", "--configs", "sched:none,none", "--steps", "8",
               "--warmup", "0", "--steps-events", "--control", str(control)]
    with Testbed(world_size=2, rate="1gbit") as bed:
        result = bed.run(command, trace=Trace.from_steps([(3, "500mbit")]), on_event=policy,
                         cwd=str(REPO), timeout_s=120)
        assert bed.rates_bps == [500 * 10**6] * 2
    assert [(c["trigger"], c["rate_bps"]) for c in result.rate_log] == [("step", 500 * 10**6)]
    events = result.ranks[0].events
    steps = [e for e in events if e.get("event") == "step"]
    assert [e["step"] for e in steps] == list(range(1, 9))
    assert steps[0]["config"] == "sched:none,none" and steps[-1]["config"] == "sched:1MiB,4MiB"
    assert [e["event"] for e in events if e["event"].startswith("reconfigure")] == [
        "reconfigure_rejected", "reconfigure"]
    for rank in result.ranks:
        (summary,) = rank.results
        assert len(summary["step_times_s"]) == 8


@needs_netns
def test_train_worker_pairs_the_native_and_python_hot_paths() -> None:
    # bench_scheduler --python-twins: `py:` configurations run the same scheduler with native=False
    # in the same ranks, so native-vs-Python ratios are paired within a run.
    command = [sys.executable, "-m", "benchmarks.train_worker", "--model", "mlp",
               "--model-args", json.dumps({"in_features": 64, "hidden": 256, "depth": 2}),
               "--batch-size", "16", "--configs", "sched:64KiB,none", "py:64KiB,none",
               "--rounds", "1", "--steps", "3", "--warmup", "1"]
    with Testbed(world_size=2, rate="10gbit") as bed:
        result = bed.run(command, cwd=str(REPO), timeout_s=120)
    for rank in result.ranks:
        paths = {r["config"]: r["hot_path"] for r in rank.results}
        assert paths == {"sched:64KiB,none": "native", "py:64KiB,none": "python"}, paths
        assert all(r["dispatch"]["partitions"] > 0 for r in rank.results)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False



@needs_netns
def test_cross_iteration_overlap_exposes_less_communication_than_ddp(tmp_path: Path) -> None:
    """On a shaped link where compute ≈ communication (the 6.8M MLP, batch 512, 1gbit), the scheduler
    exposes less communication than DDP. Like with like: for both, exposed communication is the
    median step time minus the median step time of the same model without gradient sync, all three
    measured the same way by the same worker in one run. benchmarks/README.md measured 206 ms for
    DDP and 95-112 ms for sched:1MiB,2MiB here (0.46-0.54 of DDP's); the test asks for at most 0.8."""
    command = [sys.executable, "-m", "benchmarks.train_worker", "--model", "mlp", "--batch-size", "512",
               "--configs", "compute", "ddp", "sched:1MiB,2MiB", "--rounds", "2", "--steps", "4",
               "--warmup", "2"]
    with Testbed(world_size=2, rate="1gbit") as bed:
        result = bed.run(command, cwd=str(REPO), timeout_s=180)
    summaries = result.ranks[0].results
    median = {label: statistics.median(r["median_step_s"] for r in summaries if r["config"] == label)
              for label in ("compute", "ddp", "sched:1MiB,2MiB")}
    ddp_exposed = median["ddp"] - median["compute"]
    ours_exposed = median["sched:1MiB,2MiB"] - median["compute"]
    assert ddp_exposed > 0.05, median  # the link really is a bottleneck here
    assert ours_exposed < 0.8 * ddp_exposed, median
