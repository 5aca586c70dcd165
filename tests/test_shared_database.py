"""Several autobyted on one PostgreSQL database: any daemon serves any job (a rank may move between
them), their answers agree, a decision reaches a rank whichever daemon it watches, and one daemon at
a time tunes a job (a lease in the database, handed over when its holder stops). The SIGKILL of a
daemon under a real 2-rank job is tests/test_failover.py."""

from __future__ import annotations

import time

import grpc
import pytest
from autobyte.protocol import autobyte_pb2 as pb

from tests.helpers.daemon import ThreadDaemon
from tests.helpers.rpc import Client, SyntheticJob, batch
from tests.helpers.wait import wait_for

POLL_S = 0.2
LEASE_S = 3.0


@pytest.fixture
def daemons(pg_url):
    """Two daemons started at the same moment on one empty database (both migrate it: one does,
    the other waits for it), each with its own clients."""
    pair = [
        ThreadDaemon(
            pg_url, tuner="auto", tuner_idle_s=5.0, tuner_lease_s=LEASE_S, decision_poll_s=POLL_S
        ).start(wait=False)
        for _ in range(2)
    ]
    clients = []
    try:
        for daemon in pair:
            daemon.wait_ready()
            clients.append(Client(daemon.address))
        yield pair, clients
    finally:
        for client in clients:
            client.close()
        for daemon in pair:
            daemon.stop()


def answers(client: Client, job: str) -> tuple:
    status = [
        (j.job, j.state, j.steps, tuple(j.ranks), j.world_size)
        for j in client.query.Status(pb.StatusRequest(), timeout=10).jobs
    ]
    history = client.query.History(pb.HistoryRequest(job=job, limit=1000), timeout=10)
    best = client.query.Best(pb.BestRequest(job=job), timeout=10)
    return (
        status,
        [(s.step, s.rank, s.step_time_s) for s in history.steps],
        [(d.decision_id, d.state) for d in history.decisions],
        (best.found, best.median_step_time_s),
    )


def test_a_rank_moves_between_daemons_and_every_daemon_answers_the_same(daemons):
    (a, _b), (on_a, on_b) = daemons
    session = on_a.register(job="job", rank=0, instance="rank0").session_id
    assert on_a.stream([batch(session, range(1, 51))]) == [50]
    # the daemon went away for this rank: it registers with the other one, which knows what is stored
    moved = on_b.register(job="job", rank=0, instance="rank0")
    assert moved.last_acked_seq == 50
    assert on_b.stream([batch(moved.session_id, range(41, 81))]) == [
        80
    ]  # 41-50 resent: not stored twice
    with pytest.raises(grpc.RpcError) as info:  # the old session is over, on every daemon
        on_a.stream([batch(session, [81])])
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    rank1 = on_a.register(job="job", rank=1, instance="rank1").session_id
    on_a.stream([batch(rank1, range(1, 81), rank=1)])
    assert a.storage().sample_count("job") == 160
    assert sorted(r.step for r in a.storage().history("job", rank=0, limit=1000)) == list(range(80))
    assert answers(on_a, "job") == answers(on_b, "job")
    assert answers(on_a, "job")[0] == [("job", "running", 80, (0, 1), 2)]


def test_a_decision_reaches_the_watchers_of_every_daemon(daemons):
    (a, b), (on_a, on_b) = daemons
    for client, rank in ((on_a, 0), (on_b, 1)):
        client.register(job="job", rank=rank, instance=f"rank{rank}")
    watch_a = on_a.control.WatchConfig(pb.WatchConfigRequest(job="job", rank=0), timeout=20)
    watch_b = on_b.control.WatchConfig(pb.WatchConfigRequest(job="job", rank=1), timeout=20)
    for daemon in (a, b):  # both streams are open: a decision reaches them only through the hubs
        wait_for(
            lambda d=daemon: "job" in d.daemon.hub.watched_jobs(), what="the control stream to open"
        )
    for proposer, partition in ((on_b, 1 << 20), (on_a, 2 << 20)):
        started = time.monotonic()
        decision = proposer.control.ProposeConfig(
            pb.ProposeConfigRequest(
                job="job",
                config=pb.Config(partition_bytes=partition),
                apply_at_step=100,
                reason="operator",
            ),
            timeout=10,
        )
        for watch in (watch_a, watch_b):
            update = next(watch)
            assert (update.decision_id, update.config.partition_bytes) == (
                decision.decision_id,
                partition,
            )
        # the other daemon's watcher heard of it within a poll or two, not at some later event
        assert time.monotonic() - started < 10 * POLL_S + 1.0
    watch_a.cancel()
    watch_b.cancel()
    # a watcher that reconnects to the other daemon after the last decision it saw gets nothing again
    rewatch = on_b.control.WatchConfig(
        pb.WatchConfigRequest(job="job", rank=0, after_decision_id=decision.decision_id), timeout=1
    )
    with pytest.raises(grpc.RpcError) as info:
        next(rewatch)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_one_daemon_tunes_a_job_and_hands_it_over_when_it_stops(daemons):
    (a, b), (on_a, on_b) = daemons
    by_id = {a.daemon.daemon_id: (a, on_a), b.daemon.daemon_id: (b, on_b)}
    job = SyntheticJob(on_a)
    job.steps(40, bandwidth_bytes_per_s=1e8)
    first = wait_for(lambda: job.history().decisions, what="the tuner's first decision")
    assert first[0].source == "tuner"
    holder = a.storage().lease("tuner:job").holder
    tuning, _tuning_client = by_id[holder]
    other, other_client = next(v for k, v in by_id.items() if k != holder)
    assert "job" in tuning.daemon.tuner._jobs and "job" not in other.daemon.tuner._jobs
    for _ in range(3):  # more steps: still one tuner, the other keeps out
        job.steps(20, bandwidth_bytes_per_s=1e8)
        other.wait_tuner_looked("job", cycles=1)  # it asked for the lease again and was refused
        assert "job" not in other.daemon.tuner._jobs
    before = max(d.decision_id for d in job.history().decisions)
    tuning.stop()  # gives its lease back: the other takes the job over at once, from its newest steps
    job.client = other_client
    job.session = other_client.register(job="job", rank=0, world_size=2).session_id
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not [
        d for d in job.history().decisions if d.decision_id > before
    ]:
        job.steps(10, bandwidth_bytes_per_s=1e8)
        time.sleep(0.1)
    assert [d for d in job.history().decisions if d.decision_id > before], (
        "the survivor never decided"
    )
    assert other.storage().lease("tuner:job").holder == other.daemon.daemon_id
    assert "job" in other.daemon.tuner._jobs
