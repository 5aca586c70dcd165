"""The namespace testbed: builds a shaped star, follows a rate trace, runs ranks, cleans up."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.testbed import (
    NAME_PREFIX,
    Testbed,
    TestbedError,
    Trace,
    format_rate,
    list_namespaces,
    parse_rate,
    parse_size,
    worker_cli,
)


def needs_netns(test):
    """Only the tests that build namespaces need root and iproute2; the pure ones run everywhere."""
    for mark in (
        pytest.mark.netns,
        pytest.mark.slow,
        pytest.mark.skipif(
            os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
            reason="builds network namespaces: needs root and iproute2 (ip, tc)",
        ),
    ):
        test = mark(test)
    return test


SMALL_MLP = {
    "model": "mlp",
    "model_args": {"in_features": 64, "hidden": 256, "depth": 2},
    "batch_size": 16,
}
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


def test_the_worker_command_is_built_and_checked_in_one_place() -> None:
    command = worker_cli.command(
        "--lr",
        "0.5",
        configs=["ddp", "sched:4MiB,16MiB"],
        model_args={"depth": 2},
        steps=3,
        steps_events=True,
        abba=False,
        max_seconds=None,
    )
    assert command[:3] == [sys.executable, "-m", "benchmarks.testbed.train_worker"]
    assert command[3:] == [
        "--lr",
        "0.5",
        "--configs",
        "ddp",
        "sched:4MiB,16MiB",
        "--model-args",
        '{"depth": 2}',
        "--steps",
        "3",
        "--steps-events",
    ]
    with pytest.raises(SystemExit):
        worker_cli.command(stepz=3)  # misspelt: refused where it is written
    with pytest.raises(SystemExit):
        worker_cli.command(optimizer="lbfgs")


def test_parse_rate() -> None:
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("300Mbit") == 300 * 10**6
    assert parse_rate(5e8) == 5 * 10**8
    with pytest.raises(ValueError):
        parse_rate("fast")


def test_format_rate_and_parse_size() -> None:
    assert [format_rate(r) for r in (10**9, 300 * 10**6, 64 * 10**3, 12)] == [
        "1gbit",
        "300mbit",
        "64kbit",
        "12bit",
    ]
    assert parse_rate(format_rate(250 * 10**6)) == 250 * 10**6
    assert parse_size("512kb") == 512 << 10 and parse_size(65536) == 65536
    with pytest.raises(ValueError):
        parse_size("lots")


def test_traces_by_time_and_by_step() -> None:
    by_time = Trace.from_times([(1.5, "80mbit"), (3, "1gbit")], ranks=[1])
    assert [(c.at_s, c.rate_bps, c.ranks) for c in by_time.changes] == [
        (1.5, 80 * 10**6, (1,)),
        (3.0, 10**9, (1,)),
    ]
    both = by_time + Trace.from_steps([(7, "500mbit")])
    assert [c.at_step for c in both.changes] == [None, None, 7] and both.changes[-1].ranks is None


@needs_netns
def test_shapes_link_and_follows_a_rate_trace() -> None:
    with Testbed(world_size=2, rate="400mbit") as bed:
        assert len(_ours(bed.name)) == 3  # hub + 2 ranks
        result = bed.run(
            [sys.executable, "-c", TRANSFER, "2.5", "0.25"],
            trace=Trace.from_times([(1.25, "80mbit")]),
            timeout_s=30,
        )
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
    proc = subprocess.Popen(
        [sys.executable, "-c", harness],
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
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
            subprocess.run(
                [sys.executable, "-m", "benchmarks.testbed", "--cleanup-stale"],
                cwd=str(REPO),
                capture_output=True,
                timeout=60,
                check=False,
            )
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

    command = worker_cli.command(
        **SMALL_MLP,
        configs=["sched:none,none"],
        steps=8,
        warmup=0,
        steps_events=True,
        control=control,
    )
    with Testbed(world_size=2, rate="1gbit") as bed:
        result = bed.run(
            command,
            trace=Trace.from_steps([(3, "500mbit")]),
            on_event=policy,
            cwd=str(REPO),
            timeout_s=120,
        )
        assert bed.rates_bps == [500 * 10**6] * 2
    assert [(c["trigger"], c["rate_bps"]) for c in result.rate_log] == [("step", 500 * 10**6)]
    events = result.ranks[0].events
    steps = [e for e in events if e.get("event") == "step"]
    assert [e["step"] for e in steps] == list(range(1, 9))
    assert steps[0]["config"] == "sched:none,none" and steps[-1]["config"] == "sched:1MiB,4MiB"
    assert [e["event"] for e in events if e["event"].startswith("reconfigure")] == [
        "reconfigure_rejected",
        "reconfigure",
    ]
    for rank in result.ranks:
        (summary,) = rank.results
        assert len(summary["step_times_s"]) == 8


@needs_netns
def test_train_worker_pairs_the_native_and_python_hot_paths() -> None:
    # bench_scheduler --python-twins: `py:` configurations run the same scheduler with native=False
    # in the same ranks, so native-vs-Python ratios are paired within a run.
    command = worker_cli.command(
        **SMALL_MLP,
        configs=["sched:64KiB,none", "py:64KiB,none"],
        rounds=1,
        steps=3,
        warmup=1,
    )
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


@pytest.mark.alone  # asserts on a measurement another test's load would distort
@needs_netns
def test_cross_iteration_overlap_exposes_less_communication_than_ddp(tmp_path: Path) -> None:
    """On a shaped link where compute ≈ communication (the 6.8M MLP, batch 512, 1gbit), the scheduler
    exposes less communication than DDP. Like with like: for both, exposed communication is the
    median step time minus the median step time of the same model without gradient sync, all three
    measured the same way by the same worker in one run. The scheduler benchmark measured 206 ms for
    DDP and 95-112 ms for sched:1MiB,2MiB here (0.46-0.54 of DDP's); the test asks for at most 0.8."""
    command = worker_cli.command(
        model="mlp",
        batch_size=512,
        configs=["compute", "ddp", "sched:1MiB,2MiB"],
        rounds=2,
        steps=4,
        warmup=2,
    )
    with Testbed(world_size=2, rate="1gbit") as bed:
        result = bed.run(command, cwd=str(REPO), timeout_s=180)
    summaries = result.ranks[0].results
    median = {
        label: statistics.median(r["median_step_s"] for r in summaries if r["config"] == label)
        for label in ("compute", "ddp", "sched:1MiB,2MiB")
    }
    ddp_exposed = median["ddp"] - median["compute"]
    ours_exposed = median["sched:1MiB,2MiB"] - median["compute"]
    assert ddp_exposed > 0.05, median  # the link really is a bottleneck here
    assert ours_exposed < 0.8 * ddp_exposed, median


# ---- conditions: CPU quota, competing traffic, busy processes ---------------------------------------

# Every rank burns CPU for `duration` seconds and prints its CPU rate (CPU seconds per wall second)
# every `interval` seconds, from train_start (the origin of a time-based trace).
CPU_RATE = textwrap.dedent("""
    import json, sys, time
    duration, interval = float(sys.argv[1]), float(sys.argv[2])
    print(json.dumps({"event": "train_start"}), flush=True)
    t0 = last = time.monotonic(); c_last = time.process_time()
    while time.monotonic() - t0 < duration:
        sum(range(5000))
        now = time.monotonic()
        if now - last >= interval:
            c = time.process_time()
            print(json.dumps({"event": "cpu", "t": now - t0, "rate": (c - c_last) / (now - last)}),
                  flush=True)
            last, c_last = now, c
""")

SLEEPER = (
    "import json, sys, time; print(json.dumps({'event': 'train_start'}), flush=True); "
    "time.sleep(float(sys.argv[1]))"
)


def _cgroup_dirs(bed_name: str) -> list[str]:
    from benchmarks.testbed.conditions import cpu_controller

    found = cpu_controller()
    return (
        [] if found is None else [p.name for p in found[0].iterdir() if p.name.startswith(bed_name)]
    )


@pytest.mark.alone  # asserts on a measurement another test's load would distort
@needs_netns
def test_cpu_share_trace_limits_one_rank_and_is_lifted() -> None:
    from benchmarks.testbed.conditions import cpu_controller

    if cpu_controller() is None:
        pytest.fail("no writable cgroup cpu controller: the busy-worker condition cannot run here")
    with Testbed(world_size=2, rate="1gbit") as bed:
        trace = Trace.cpu_share([(0.8, 0.2), (1.6, None)], ranks=[1])
        result = bed.run([sys.executable, "-c", CPU_RATE, "2.4", "0.2"], trace=trace, timeout_s=30)
        throttled = bed.cpu_throttled(1)
        assert bed.cpu_shares == [None, None]  # the trace's condition ended with the run
        name = bed.name
        assert _cgroup_dirs(name) == [name]
    assert _cgroup_dirs(name) == [], "cgroup left behind"
    assert [(c["condition"], c["cpu_share"]) for c in result.condition_log] == [
        ("cpu_share", 0.2),
        ("cpu_share", None),
    ]

    def rates(rank: int, start: float, end: float) -> list[float]:
        return [
            e["rate"]
            for e in result.ranks[rank].events
            if e.get("event") == "cpu" and start < e["t"] <= end
        ]

    limited = rates(1, 1.1, 1.6)
    assert limited and max(limited) < 0.3, result.ranks[1].events  # 0.2 cores + slack
    assert throttled.get("nr_throttled", 0) > 0, throttled
    # Outside the quota the same rank (and rank 0 throughout) ran faster than the quota allows.
    assert max(rates(1, 1.9, 2.4) + rates(1, 0.0, 0.8)) > 0.3, result.ranks[1].events
    # (rank 0 over its whole run, as the comment says: one 0.5 s window holds one or two samples, and
    # on a loaded host one of them can fall below 0.3 cores although nothing limits that rank)
    assert max(rates(0, 0.0, 2.4)) > 0.3, result.ranks[0].events


@needs_netns
def test_competing_flows_cross_the_rank_links_and_stop() -> None:
    # One flow out of rank 1 (its egress) and one into rank 0 (the hub's egress towards it), from
    # 0.4 s to 1.6 s. (In "both" directions at once on one link the second flow gets far less than
    # half at 100mbit: its ACKs wait behind the first one's data in tbf's queue.)
    rate = 200 * 10**6
    with Testbed(world_size=2, rate=rate) as bed:
        trace = Trace.flows([(0.4, 1), (1.6, 0)], ranks=[1], direction="out") + Trace.flows(
            [(0.4, 1), (1.6, 0)], ranks=[0], direction="in"
        )
        result = bed.run(
            [sys.executable, "-c", SLEEPER, "2.4"],
            trace=trace,
            timeout_s=30,
            monitor_interval_s=0.2,
        )
        assert [f[0] for f in bed.flows] == [0, 0]
        assert len(bed.condition_pids()) == 2  # only the sinks (traffic namespace, rank 0) are left
        name = bed.name
        assert f"{name}-tx" in _ours(name)
    assert _ours(name) == []
    started = [e for e in result.condition_log if e["flows"] == 1]
    stopped = [cost for e in result.condition_log if e["flows"] == 0 for cost in e["stopped"]]
    assert len(started) == 2 and len(stopped) == 2
    assert not any(_alive(cost["pid"]) for cost in stopped)
    assert all(cost["cpu_s"] >= 0 and cost["kind"] == "flow-source" for cost in stopped)

    def bit_rate(key: str, rank: int, start: float, end: float) -> float:
        inside = [
            s for s in result.link_samples if s["t_s"] is not None and start <= s["t_s"] <= end
        ]
        first, last = inside[0], inside[-1]
        return (last[key][rank] - first[key][rank]) * 8 / (last["t_s"] - first["t_s"])

    for key, rank in (("tx_bytes", 1), ("rx_bytes", 0)):
        assert bit_rate(key, rank, 0.8, 1.5) > 0.5 * rate, (key, result.link_samples)
        assert bit_rate(key, rank, 1.9, 2.4) < 0.02 * rate, (key, result.link_samples)  # stopped
    for key, rank in (("tx_bytes", 0), ("rx_bytes", 1)):  # carry only the flows' ACKs
        assert bit_rate(key, rank, 0.8, 1.5) < 0.05 * rate, (key, result.link_samples)


@needs_netns
def test_a_service_in_the_hub_stays_reachable_while_competing_flows_run() -> None:
    # The hub's service (autobyted in `evaluate --testbed --policy autobyte`) and the traffic
    # namespace the first flow creates have addresses of their own: with one address for both, a
    # rank's connections to the hub were refused from the moment its flows started.
    server = (
        "import socket, sys; s = socket.create_server((sys.argv[1], 7077)); print('listening', "
        "flush=True)\nwhile True:\n c, _ = s.accept(); c.sendall(b'hub'); c.close()"
    )
    client = (
        "import socket, sys; c = socket.create_connection((sys.argv[1], 7077), timeout=20); "
        "print(c.recv(3).decode())"
    )
    with Testbed(world_size=2, rate="100mbit") as bed:
        assert bed.hub_address not in {bed.traffic_address, bed.address(0), bed.address(1)}
        hub = bed.start_in_hub(
            [sys.executable, "-c", server, bed.hub_address], stdout=subprocess.PIPE
        )
        assert hub.stdout is not None and "listening" in hub.stdout.readline().decode()

        def ask_the_hub(rank: int) -> str:
            done = subprocess.run(
                [*bed.exec_args(rank), sys.executable, "-c", client, bed.hub_address],
                check=False,
                capture_output=True,
                text=True,
                timeout=60,
            )
            return done.stdout.strip() or done.stderr.strip().splitlines()[-1]

        def bridge_mac() -> str:
            out = subprocess.run(
                ["ip", "-n", bed.hub_ns, "-j", "link", "show", "br0"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            return json.loads(out)[0]["address"]

        assert ask_the_hub(1) == "hub"  # rank 1 has resolved the hub's MAC
        mac = bridge_mac()
        bed.set_flows(1, [1], direction="both")
        time.sleep(0.5)
        # The traffic port joining the bridge leaves its MAC (a bridge takes its lowest port's
        # otherwise: rank 1's cached one went nowhere, about one run of three).
        assert bridge_mac() == mac
        assert [ask_the_hub(rank) for rank in (1, 0)] == ["hub", "hub"]
        bed.set_flows(0)
        name = bed.name
    assert _ours(name) == []


@needs_netns
def test_conditions_end_with_a_failing_run() -> None:
    worker = textwrap.dedent("""
        import json, os, sys, time
        print(json.dumps({"event": "train_start"}), flush=True)
        time.sleep(0.8)
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(600)
    """)
    trace = (
        Trace.flows([(0.0, 1)], ranks=[1])
        + Trace.busy([(0.0, 1)], ranks=[0])
        + Trace.cpu_share([(0.0, 0.5)])
    )
    with Testbed(world_size=2, rate="100mbit") as bed:
        with pytest.raises(TestbedError, match="a rank failed") as info:
            bed.run([sys.executable, "-c", worker], trace=trace, timeout_s=60, fail_grace_s=0.5)
        log = info.value.result.condition_log
        assert {entry["condition"] for entry in log} == {"flows", "busy", "cpu_share"}
        # The run is over: its busy loop and flow sources are gone, the quota lifted.
        assert (bed.busy, bed.flows[1][0], bed.cpu_shares) == ([0, 0], 0, [None, None])
        stopped = [cost["pid"] for cost in bed.condition_costs]
        assert len(stopped) == 3 and not any(_alive(p) for p in stopped)
        name = bed.name
    assert _ours(name) == [] and _cgroup_dirs(name) == []


HARNESS_WITH_CONDITIONS = textwrap.dedent("""
    import json, sys
    from benchmarks.testbed import Testbed
    with Testbed(world_size=2, rate="100mbit") as bed:
        bed.set_cpu_share(0.5, [1])
        bed.set_busy(1, [0])
        bed.set_flows(1, [1])
        print(json.dumps({"name": bed.name, "pids": bed.condition_pids()}), flush=True)
        bed.run([sys.executable, "-c", "import time; time.sleep(600)"], timeout_s=120)
""")


def _start_harness() -> tuple[subprocess.Popen, str, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HARNESS_WITH_CONDITIONS],
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    for line in proc.stdout:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict) and "name" in message:
            return proc, message["name"], message["pids"]
    proc.kill()
    raise AssertionError("the harness did not report its testbed")


@needs_netns
@pytest.mark.parametrize("how", ["sigterm", "sigkill+cleanup-stale"])
def test_conditions_are_removed_when_the_harness_dies(how: str) -> None:
    proc, name, pids = _start_harness()
    try:
        assert len(pids) == 5  # busy loop, traffic sink, out and in sources, the rank's sink
        assert _cgroup_dirs(name) == [name] and len(_ours(name)) == 4  # hub, 2 ranks, traffic
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 128 + signal.SIGTERM
        else:
            proc.kill()
            proc.wait(30)
            assert _cgroup_dirs(name) == [name]  # nothing ran its cleanup
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.testbed", "--cleanup-stale"],
                cwd=str(REPO),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert f"{name}\n" in out.stdout, out  # its cgroup and namespaces
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(
            [sys.executable, "-m", "benchmarks.testbed", "--cleanup-stale"],
            cwd=str(REPO),
            capture_output=True,
            timeout=60,
            check=False,
        )
    assert _ours(name) == [] and _cgroup_dirs(name) == []
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


@needs_netns
def test_pinned_ranks_and_their_busy_loops_share_one_core() -> None:
    worker = (
        "import json, os; print(json.dumps({'event': 'result', "
        "'cpus': sorted(os.sched_getaffinity(0))}), flush=True)"
    )
    cpus = sorted(os.sched_getaffinity(0))
    with Testbed(world_size=2, pin_cpus=cpus) as bed:
        result = bed.run([sys.executable, "-c", worker], timeout_s=30)
        bed.set_busy(1, [1])
        (pid,) = bed.condition_pids()
        deadline = time.monotonic() + 5  # until `ip netns exec` has exec'd taskset, then python
        while sorted(os.sched_getaffinity(pid)) != [cpus[1 % len(cpus)]]:
            assert time.monotonic() < deadline, os.sched_getaffinity(pid)
            time.sleep(0.02)
    assert [r.results[0]["cpus"] for r in result.ranks] == [[cpus[0]], [cpus[1 % len(cpus)]]]


LINKS_WORKER = textwrap.dedent("""
    import json, time, torch, torch.distributed as dist
    from autobyte.tcplinks import LinkSampler, rank_addresses
    dist.init_process_group("gloo")
    addresses = rank_addresses(None)
    sampler = LinkSampler(0.5)
    sampler.start()
    buf, seen, end = torch.zeros(1 << 18), [], time.monotonic() + 7.0
    while time.monotonic() < end:
        dist.all_reduce(buf)
        time.sleep(0.02)
        if not seen or time.monotonic() - seen[-1][0] >= 0.5:
            seen.append((time.monotonic(), sampler.value))
    sampler.stop()
    print(json.dumps({"event": "result", "addresses": addresses, "links": [v for _, v in seen[4:]]}))
    dist.destroy_process_group()
""")


@needs_netns
def test_a_straggler_link_is_named_from_the_ranks_queued_sockets() -> None:
    """Four ranks in a ring all-reduce, rank 1's link at a quarter of the others': every rank's
    most queued socket (autobyte/tcplinks.py, from the kernel) names its peer by rank, the slow
    pairs share rank 1, and the daemon's rule (autobyted/tuner/stragglers.py) names rank 1's link."""
    from autobyte.types import StepMetrics

    from autobyted.tuner.ranks import merge_ranks
    from autobyted.tuner.stragglers import name_link

    with Testbed(world_size=4, rate="100mbit") as bed:
        bed.set_rate("25mbit", ranks=[1])
        result = bed.run(
            [sys.executable, "-c", LINKS_WORKER],
            timeout_s=120,
            cwd=str(REPO),
            env={"PYTHONPATH": f"{REPO}:{REPO / 'client'}"},
        )
        addresses = [bed.address(r) for r in range(4)]
    got = [r.results[0] for r in result.ranks]
    assert all(g["addresses"] == {a: r for r, a in enumerate(addresses)} for g in got), got
    steps = []
    for i in range(min(len(g["links"]) for g in got)):
        samples = [
            StepMetrics(
                step=i,
                wall_time_s=1.7e9 + i,
                step_time_s=1.0,
                link_queue_s=g["links"][i][0],
                link_peer=1 + addresses.index(g["links"][i][2]),
            )
            for g in got
        ]
        steps.append(merge_ranks(samples[0], dict(enumerate(samples[1:], start=1))))
    assert len(steps) >= 4, got
    assert name_link(steps).startswith("rank 1's link ("), (name_link(steps), got)
