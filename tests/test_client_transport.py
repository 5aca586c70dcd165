"""The client transport in real 2-rank gloo jobs against a real daemon: streaming, decisions applied at
the step they name on every rank, reports back, overflow accounting, and silence without init()."""

import logging
import re
import threading
import time

import pytest
from autobyte.protocol import autobyte_pb2 as pb

from tests.helpers.daemon import ThreadDaemon
from tests.helpers.dist import run_ranks
from tests.helpers.rpc import Client


def _train(rank, world, address, job, steps, sleep_s, buffer_samples=10_000, wait_decision_at=None):
    import autobyte
    import torch
    from autobyte.transport import session

    root_handlers = list(logging.getLogger().handlers)
    if address is not None:
        autobyte.init(daemon=address, job=job, buffer_samples=buffer_samples)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = autobyte.ScheduledOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        partition_bytes=8 << 10,
        credit_bytes=None,
    )
    configs = {}
    opt.add_step_callback(lambda m: configs.__setitem__(m.step, m.config.to_dict()))
    for step in range(steps):
        if wait_decision_at is not None and rank == 0 and step == wait_decision_at:
            # Hold rank 0 (and so the job) until the daemon's decision has arrived.
            deadline = time.monotonic() + 30
            while session._reporter.control._last_update_id == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        x = torch.randn(16, 32)
        model(x).sum().backward()
        if sleep_s:
            time.sleep(sleep_s)
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    metrics = [opt.last_step_metrics()]
    out = {
        "configs": [configs[s] for s in range(steps)],
        "threads": sorted(t.name for t in threading.enumerate()),
        "root_handlers_unchanged": list(logging.getLogger().handlers) == root_handlers,
        "last_step": metrics[-1].step,
        "collective_latency_s": opt.collective_latency_s,
    }
    if address is not None:
        reporter = session._reporter
        out.update(
            flushed=reporter.flush(20), dropped=reporter.dropped_total, acked=reporter.acked_seq
        )
        autobyte.shutdown()
    opt.close()
    return out


def propose_once_registered(
    client: Client, job: str, ranks: int, apply_at_step: int, partition_bytes, credit_bytes
) -> threading.Thread:
    """A started thread that proposes a decision for `job` once `ranks` of its ranks registered."""

    def propose():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            jobs = client.query.Status(pb.StatusRequest(), timeout=5).jobs
            if jobs and len(jobs[0].ranks) >= ranks:
                request = pb.ProposeConfigRequest(
                    job=job, apply_at_step=apply_at_step, reason="test"
                )
                for name, value in (
                    ("partition_bytes", partition_bytes),
                    ("credit_bytes", credit_bytes),
                ):
                    if value is not None:
                        setattr(request.config, name, value)
                client.control.ProposeConfig(request, timeout=5)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=propose)
    thread.start()
    return thread


def test_metrics_stream_and_decisions_apply_on_every_rank(thread_daemon):
    client = Client(thread_daemon.address)

    proposer = propose_once_registered(client, "t1", 2, 30, 16 << 10, 64 << 10)
    rank0, rank1 = run_ranks(
        _train, 2, thread_daemon.address, "t1", 60, 0.0, 10_000, 20, timeout_s=150
    )
    proposer.join()
    for result in (rank0, rank1):
        assert result["flushed"] and result["dropped"] == 0 and result["acked"] == 60, {
            k: v for k, v in result.items() if k != "configs"
        }
        assert result["root_handlers_unchanged"]
    # the decision named step 30: both ranks ran steps < 30 on the old and >= 30 on the new config
    for result in (rank0, rank1):
        assert result["configs"][29] == {"partition_bytes": 8 << 10, "credit_bytes": None}
        assert (
            result["configs"][30:] == [{"partition_bytes": 16 << 10, "credit_bytes": 64 << 10}] * 30
        )
    history = client.query.History(pb.HistoryRequest(job="t1", limit=1000), timeout=5)
    assert len(history.steps) == 120
    (decision,) = history.decisions
    assert (decision.state, decision.applied_at_step) == ("applied", 30)
    status = client.query.Status(pb.StatusRequest(), timeout=5).jobs[0]
    assert status.config.partition_bytes == 16 << 10
    client.close()
    # the per-collective cost measured at construction (the same on both ranks) is the job's
    from autobyted.storage.db import make_engine
    from autobyted.storage.sql import SqlStorage

    latency = rank0["collective_latency_s"]
    assert latency > 0 and rank1["collective_latency_s"] == latency
    assert SqlStorage(make_engine(thread_daemon.settings.db)).job_info(
        "t1"
    ).collective_latency_s == (latency)


def test_without_init_nothing_is_sent_or_started():
    rank0, _ = run_ranks(_train, 2, None, None, 5, 0.0, timeout_s=90)
    assert not any(
        name.startswith(("autobyte-telemetry", "autobyte-control")) for name in rank0["threads"]
    )


def test_absent_daemon_never_stops_training_and_overflow_is_counted(tmp_path):
    from devtools.ports import free_port

    port = free_port()  # nothing listens here while the job runs
    results = run_ranks(_train_then_daemon, 2, port, str(tmp_path / "late.db"), timeout_s=150)
    for result in results:
        assert result["last_step"] == 79
        assert result["dropped"] == 80 - 25  # buffer of 25: the oldest were dropped and counted
        assert (
            result["flushed"] and result["acked"] == 80
        )  # the 25 newest arrive once a daemon is up
    assert results[0]["status_dropped"] == 2 * 55


def _train_then_daemon(rank, world, port, db_path):
    """Train with the daemon down, then start one and let the buffered samples drain."""
    import autobyte
    import torch
    import torch.distributed as dist
    from autobyte.transport import session

    autobyte.init(daemon=f"127.0.0.1:{port}", job="late", buffer_samples=25)
    model = torch.nn.Linear(8, 8)
    opt = autobyte.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(80):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    reporter = session._reporter
    daemon = None
    dist.barrier()
    if rank == 0:
        from autobyted.settings import Settings
        from tests.helpers.daemon import ThreadDaemon

        daemon = ThreadDaemon(f"sqlite:///{db_path}")
        daemon.settings = Settings(listen=f"127.0.0.1:{port}", db=f"sqlite:///{db_path}")
        from autobyted.app import Daemon

        daemon.daemon = Daemon(daemon.settings)
        daemon.start()
    flushed = reporter.flush(30)
    dist.barrier()
    out = {
        "last_step": opt.last_step_metrics().step,
        "dropped": reporter.dropped_total,
        "flushed": flushed,
        "acked": reporter.acked_seq,
    }
    if rank == 0:  # both ranks' counts came with batches they saw acknowledged: stored
        client = Client(daemon.address)
        out["status_dropped"] = (
            client.query.Status(pb.StatusRequest(), timeout=5).jobs[0].dropped_total
        )
        client.close()
    dist.barrier()
    autobyte.shutdown()
    opt.close()
    if daemon is not None:
        daemon.stop()
    return out


def _rejected_sample_worker(rank, world, address):
    import dataclasses

    import autobyte
    import torch
    from autobyte.transport import session

    autobyte.init(daemon=address, job="rejects")
    model = torch.nn.Linear(8, 8)
    opt = autobyte.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    reporter = session._reporter
    for step in range(20):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 10:
            assert reporter.flush(20)
            # a broken measurement (NaN) reaches the buffer: the client drops it before sending (the
            # daemon would refuse the whole batch), counts it, and carries on streaming the rest
            reporter.on_step(dataclasses.replace(opt.last_step_metrics(), step_time_s=float("nan")))
    opt.synchronize()
    flushed = reporter.flush(20)
    out = {"flushed": flushed, "dropped": reporter.dropped_total, "acked": reporter.acked_seq}
    autobyte.shutdown()
    opt.close()
    return out


def test_invalid_samples_are_dropped_and_streaming_goes_on(thread_daemon):
    (result,) = run_ranks(_rejected_sample_worker, 1, thread_daemon.address, timeout_s=90)
    assert result["flushed"] and result["acked"] == 21
    assert result["dropped"] == 1
    client = Client(thread_daemon.address)
    stored = client.query.History(pb.HistoryRequest(job="rejects"), timeout=5).steps
    client.close()
    assert len(stored) == 21 - result["dropped"]
    assert all(s.step_time_s == s.step_time_s for s in stored)  # no NaN got in


def _steady_worker(
    rank,
    world,
    address,
    steps,
    flush_interval_s=0.05,
    job="steady",
    step_sleep_s=0.01,
    capture_logs=False,
):
    import autobyte
    import torch
    from autobyte.transport import session

    logs = _capture_autobyte_logs() if capture_logs else None
    autobyte.init(daemon=address, job=job, flush_interval_s=flush_interval_s)
    model = torch.nn.Linear(8, 8)
    opt = autobyte.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(step_sleep_s)
    opt.synchronize()
    reporter = session._reporter
    out = {
        "flushed": reporter.flush(60),
        "dropped": reporter.dropped_total,
        "acked": reporter.acked_seq,
    }
    if logs is not None:
        out["records"] = list(logs.records)
    autobyte.shutdown()
    opt.close()
    return out


def test_quick_daemon_restarts_lose_and_duplicate_nothing(tmp_path):
    """Reconnects within a flush interval once let a stale request iterator swallow batches."""
    import sqlite3

    from autobyted.app import Daemon
    from autobyted.settings import Settings
    from devtools.ports import free_port

    port, db = free_port(), f"sqlite:///{tmp_path / 'restarts.db'}"

    def daemon() -> ThreadDaemon:
        d = ThreadDaemon(db)
        d.settings = Settings(listen=f"127.0.0.1:{port}", db=db)
        d.daemon = Daemon(d.settings)
        return d.start()

    current = [daemon()]
    stop = threading.Event()

    def restarter():
        while not stop.wait(1.0):
            current[0].stop()
            current[0] = daemon()

    thread = threading.Thread(target=restarter)
    thread.start()
    try:
        (result,) = run_ranks(_steady_worker, 1, f"127.0.0.1:{port}", 500, timeout_s=120)
    finally:
        stop.set()
        thread.join()
        current[0].stop()
    assert result["flushed"] and result["dropped"] == 0 and result["acked"] == 500
    with sqlite3.connect(db.removeprefix("sqlite:///")) as conn:
        steps = [s for (s,) in conn.execute("select step from step_metrics order by step")]
    assert steps == list(range(500))


def _grouped_worker(rank, world, address, groups):
    """Trains in groups of steps; each group's samples go out as exactly one batch (flush())."""
    import autobyte
    import torch
    from autobyte.transport import session

    autobyte.init(daemon=address, job="groups", flush_interval_s=60)  # no time-based batches
    model = torch.nn.Linear(8, 8)
    opt = autobyte.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    reporter = session._reporter
    flushed = []
    for size in groups:
        for _ in range(size):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()  # every step of the group has its metrics
        flushed.append(reporter.flush(30))
    out = {"flushed": flushed, "dropped": reporter.dropped_total, "acked": reporter.acked_seq}
    autobyte.shutdown()
    opt.close()
    return out


def test_refused_batches_are_dropped_once_and_accounted(db_url):
    """A daemon that refuses some batches (here: more than 5 samples) costs exactly those samples.
    Batches are made by flush() (one per group of steps), so which ones are refused does not depend
    on how fast the machine is: the first batch (1 sample) goes out at once, 12 are refused, 3 pass."""
    import sqlite3

    daemon = ThreadDaemon(db_url, max_samples_per_batch=5).start()
    try:
        (result,) = run_ranks(_grouped_worker, 1, daemon.address, [1, 12, 3], timeout_s=120)
    finally:
        daemon.stop()
    with sqlite3.connect(db_url.removeprefix("sqlite:///")) as conn:
        steps = [s for (s,) in conn.execute("select step from step_metrics order by step")]
    assert result["flushed"] == [True, True, True] and result["acked"] == 16
    assert result["dropped"] == 12
    assert steps == [0, 13, 14, 15]


def _opted_out_worker(rank, world, address):
    import autobyte
    import torch

    reporter = autobyte.init(daemon=address, job="opted-out", tune=False)
    model = torch.nn.Linear(8, 8)
    opt = autobyte.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(5):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    flushed = reporter.flush(20)
    autobyte.shutdown()
    opt.close()
    return flushed


def test_init_tune_false_reaches_the_daemon_through_the_registration(thread_daemon):
    (flushed,) = run_ranks(_opted_out_worker, 1, thread_daemon.address, timeout_s=90)
    assert flushed
    from autobyted.storage.db import make_engine
    from autobyted.storage.sql import SqlStorage

    assert SqlStorage(make_engine(thread_daemon.settings.db)).job_info("opted-out").tuning_disabled


class _Records(logging.Handler):
    """Keeps (time, level, message) of every record of the `autobyte` logger tree."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[float, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.created, record.levelname, record.getMessage()))


def _capture_autobyte_logs() -> _Records:
    handler = _Records()
    logger = logging.getLogger("autobyte")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    return handler


def _refused_worker(rank, world, address):
    """Two refusals that retrying does not fix: a wrong token, a job registered with another world size."""
    import autobyte
    import torch
    from autobyte.transport import reporter as reporter_module
    from autobyte.transport import session

    reporter_module.REFUSED_RETRY_S = 0.3  # retry often here, to see that retries stay quiet
    logs = _capture_autobyte_logs()
    model = torch.nn.Linear(8, 8)
    opt = autobyte.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out = {}
    for case, kwargs in (
        ("token", {"job": "guarded", "token": "wrong"}),
        ("world", {"job": "sized", "token": "t0k"}),
    ):
        del logs.records[:]
        autobyte.init(daemon=address, **kwargs)
        for _ in range(10):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.15)  # 1.5 s of training: several registration attempts
        reporter = session._reporter
        out[case] = {
            "records": [(level, message) for _, level, message in logs.records],
            "acked": reporter.acked_seq,
            "buffered": reporter.buffered,
        }
        autobyte.shutdown()
    opt.close()
    return out


def test_a_permanent_refusal_is_one_warning_that_says_what_to_do(db_url):
    """Wrong token, world-size mismatch: one WARNING each (why, what to do), then quiet
    retries; training goes on and the samples wait in the buffer."""
    daemon = ThreadDaemon(db_url, token="t0k").start()
    try:
        Client(daemon.address, "t0k").register(job="sized", world_size=4)
        (result,) = run_ranks(_refused_worker, 1, daemon.address, timeout_s=120)
    finally:
        daemon.stop()
    for case, code, advice in (
        ("token", "UNAUTHENTICATED", "AUTOBYTE_TOKEN"),
        ("world", "FAILED_PRECONDITION", "new job id"),
    ):
        records = result[case]["records"]
        warnings = [message for level, message in records if level == "WARNING"]
        assert len(warnings) == 1, records
        assert code in warnings[0] and advice in warnings[0] and "retried every" in warnings[0]
        retries = [
            message for level, message in records if level == "DEBUG" and "refused" in message
        ]
        assert len(retries) >= 2, records  # it did retry, quietly
        assert result[case]["acked"] == 0 and result[case]["buffered"] > 0


def test_the_client_waits_as_long_as_a_busy_daemon_asks_and_loses_nothing(db_url):
    """The writer's queue fills while the database is locked; refused batches come
    with `retry-after-ms`; the client waits that long before registering again, keeps its samples,
    and every step arrives exactly once."""
    import sqlite3

    steps = 150
    # A stream has one batch at the writer at a time: the queue fills with the batches of several
    # streams, here both ranks' (1 row: the second rank's batch always waits for the first's).
    daemon = ThreadDaemon(db_url, ingest_queue_rows=1).start()
    path = db_url.removeprefix("sqlite:///")
    client = Client(daemon.address)

    def lock_the_database_for_a_while():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            jobs = client.query.Status(pb.StatusRequest(), timeout=5).jobs
            if jobs and jobs[0].steps >= 20:
                break
            time.sleep(0.05)
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        time.sleep(2.5)
        blocker.rollback()
        blocker.close()

    locker = threading.Thread(target=lock_the_database_for_a_while)
    locker.start()
    try:
        results = run_ranks(
            _steady_worker, 2, daemon.address, steps, 0.05, "busy", 0.02, True, timeout_s=150
        )
    finally:
        locker.join()
        client.close()
        daemon.stop()
    waits = []
    for rank, result in enumerate(results):
        assert result["flushed"] and result["dropped"] == 0 and result["acked"] == steps
        with sqlite3.connect(path) as conn:
            stored = [
                s
                for (s,) in conn.execute(
                    "select step from step_metrics where rank = ? order by step", (rank,)
                )
            ]
        assert stored == list(range(steps))
        records = result["records"]
        registrations = [t for t, _, message in records if message.startswith("registered with")]
        for refused_at, wait_s in [
            (t, float(m.group(1)))
            for t, level, message in records
            if (m := re.search(r"retrying in (\d+\.\d+)s", message))
        ]:
            waits.append(wait_s)
            assert wait_s >= 0.2
            next_registration = min(t for t in registrations if t > refused_at)
            assert (
                next_registration - refused_at >= wait_s - 0.01
            )  # it waited as long as it was asked
    assert waits, [
        r["records"] for r in results
    ]  # the daemon pushed back and the client read its hint


def _one_run(rank, world, address, job, steps, hold_for_decision_at=None):
    """A run that ends without synchronize(): shutdown() must still report its last step."""
    import autobyte
    import torch
    from autobyte.transport import session

    autobyte.init(daemon=address, job=job)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = autobyte.ScheduledOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        partition_bytes=8 << 10,
        credit_bytes=None,
    )
    configs = []
    opt.add_step_callback(lambda m: configs.append((m.step, m.config.to_dict())))
    reporter = session._reporter
    for step in range(steps):
        if step == hold_for_decision_at:
            deadline = time.monotonic() + 30
            while reporter.control._last_update_id == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    autobyte.shutdown(timeout_s=10)  # no synchronize(), no flush(): the exit path does both
    acked = reporter.acked_seq
    opt.close()
    return {"configs": configs, "acked": acked, "received": reporter.control._last_update_id}


def test_a_new_run_never_gets_the_old_runs_decision_and_a_finished_job_says_so(thread_daemon):
    """Run 1 gets a decision for step 25 but stops at step 19. Run 1's exit path records its last
    step and tells the daemon it finished (status says `finished` at once), and the decision it never
    reached expires with it: a finished job leaves nothing pending. Run 2 of the same job takes rank
    0 over at once (rank 0 finished) and starts counting steps from 0: the old decision is never
    applied at ITS step 25."""
    client = Client(thread_daemon.address)

    proposer = propose_once_registered(client, "rerun", 1, 25, 16 << 10, None)
    (first,) = run_ranks(_one_run, 1, thread_daemon.address, "rerun", 20, 10, timeout_s=120)
    proposer.join()
    assert first["received"] == 1 and first["acked"] == 20
    (job,) = client.query.Status(pb.StatusRequest(), timeout=5).jobs
    assert job.state == "finished" and job.steps == 20
    history = client.query.History(pb.HistoryRequest(job="rerun"), timeout=5)
    assert [s.step for s in history.steps] == list(
        range(20)
    )  # the last step too, without synchronize()
    assert [d.state for d in history.decisions] == ["expired"]

    (second,) = run_ranks(_one_run, 1, thread_daemon.address, "rerun", 40, timeout_s=120)
    assert second["acked"] == 40 and second["received"] == 0
    assert {config["partition_bytes"] for _, config in second["configs"]} == {
        8 << 10
    }  # never switched
    history = client.query.History(pb.HistoryRequest(job="rerun"), timeout=5)
    assert [d.state for d in history.decisions] == ["expired"]
    (job,) = client.query.Status(pb.StatusRequest(), timeout=5).jobs
    assert job.state == "finished" and job.steps == 40
    client.close()


def _train_dp_groups(rank, world, address, job, steps):
    import autobyte
    import torch
    import torch.distributed as dist
    from autobyte.transport import session

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    autobyte.init(daemon=address, job=job)
    torch.manual_seed(rank // 2)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = autobyte.ScheduledOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        partition_bytes=8 << 10,
        credit_bytes=None,
        process_group=groups[rank // 2],
    )
    configs = {}
    opt.add_step_callback(lambda m: configs.__setitem__(m.step, m.config.to_dict()))
    for step in range(steps):
        if step == steps // 2 and rank % 2 == 0:
            # each group's leader holds its group until the daemon's decision has arrived
            deadline = time.monotonic() + 30
            while session._reporter.control._last_update_id == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        model(torch.randn(16, 32)).sum().backward()
        opt.step()
    opt.synchronize()
    place = session._reporter.place
    autobyte.shutdown()
    opt.close()
    return {"configs": [configs[s] for s in range(steps)], "place": tuple(place)}


def test_data_parallel_groups_report_their_place_and_every_leader_gets_decisions(thread_daemon):
    """4 ranks as 2 data-parallel groups of 2 in one job: every process registers under its own
    job-wide rank with its data-parallel rank beside it, and a decision reaches both groups' leaders
    and lands at the step it names on all 4 ranks."""
    client = Client(thread_daemon.address)
    steps, at = 40, 30
    proposer = propose_once_registered(client, "dp-job", 4, at, 64 << 10, None)
    results = run_ranks(_train_dp_groups, 4, thread_daemon.address, "dp-job", steps, timeout_s=150)
    proposer.join()
    assert [r["place"] for r in results] == [
        (0, 4, 0, 2, 0),
        (1, 4, 1, 2, 0),
        (2, 4, 0, 2, 2),
        (3, 4, 1, 2, 2),
    ]
    for r in results:
        before, after = r["configs"][:at], r["configs"][at:]
        assert all(c == {"partition_bytes": 8 << 10, "credit_bytes": None} for c in before)
        assert all(c == {"partition_bytes": 64 << 10, "credit_bytes": None} for c in after)
    job = client.query.Status(pb.StatusRequest(), timeout=5).jobs[0]
    assert list(job.ranks) == [0, 1, 2, 3] and job.world_size == 4


def test_daemon_lists_are_parsed_and_a_malformed_one_is_refused_before_anything_starts(monkeypatch):
    import autobyte
    from autobyte.channel import daemon_addresses
    from autobyte.transport import session

    assert daemon_addresses("h1:7077, h2:7078,") == ("h1:7077", "h2:7078")
    monkeypatch.setenv("AUTOBYTE_DAEMON", "h1:7077,[::1]:7078")
    assert daemon_addresses() == ("h1:7077", "[::1]:7078")
    for bad in ("h1:7077,h2", ",", "h:port"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            daemon_addresses(bad)
    for port in (0, 65536, 99999):  # the shape is right: the port is not
        with pytest.raises(ValueError, match=f"'h:{port}': port {port} is out of range"):
            daemon_addresses(f"h:{port}")
    before = session._reporter
    with pytest.raises(ValueError, match="'oops' must look like HOST:PORT"):
        autobyte.init(daemon="h1:7077,oops", job="j")
    assert session._reporter is before  # nothing was started


def test_a_malformed_daemon_environment_warns_once_and_training_goes_on(monkeypatch):
    import warnings

    import autobyte
    from autobyte.transport import session

    before = session._reporter
    for bad in ("localhost", ":::", "http://x"):
        monkeypatch.setenv("AUTOBYTE_DAEMON", bad)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert autobyte.init(job="j") is None
            assert autobyte.init(job="j") is None  # a second init() does not repeat it
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1 and f"AUTOBYTE_DAEMON={bad!r} is not usable" in messages[0], (
            messages
        )
        assert "training goes on" in messages[0]
    assert session._reporter is before  # nothing was started


def _calls_left_worker(rank, world, address):
    import gc

    import autobyte
    import grpc
    import torch
    from autobyte.transport import session

    gc.disable()  # what survives close() below is held or in a cycle: never collected here
    try:
        reporter = autobyte.init(daemon=address, job="calls-left")
        model = torch.nn.Linear(8, 2)
        with autobyte.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1)) as opt:
            for _ in range(5):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
        deadline = time.monotonic() + 30
        while reporter.control._watch_stream is None and time.monotonic() < deadline:
            time.sleep(0.02)  # the watch stream is open (the call close() cancels)
        watched = reporter.control._watch_stream is not None
        flushed = reporter.flush(20)
        threads = list(reporter._threads)
        autobyte.shutdown(timeout_s=10)
        for thread in threads:
            thread.join(10)
        calls = [
            type(o).__name__ for o in gc.get_objects() if isinstance(o, grpc._channel._Rendezvous)
        ]
        return {
            "watched": watched,
            "flushed": flushed,
            "alive": [t.name for t in threads if t.is_alive()],
            "calls": calls,
            "reporter_gone": session._reporter is None,
        }
    finally:
        gc.enable()


def test_closed_reporter_leaves_no_grpc_call_for_interpreter_shutdown(thread_daemon):
    """A call still alive (or in a reference cycle) after shutdown() is collected during
    interpreter shutdown, where its __del__ can wait forever on a lock of a daemon thread the
    shutdown stopped: a rank that wrote its results and never exited (seen under torchrun)."""
    (result,) = run_ranks(_calls_left_worker, 1, thread_daemon.address, timeout_s=90)
    assert result["watched"] and result["flushed"] and result["reporter_gone"], result
    assert result["alive"] == [], result
    assert result["calls"] == [], result
