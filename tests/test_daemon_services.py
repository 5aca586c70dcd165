"""Telemetry, control and query through a real gRPC server on a real SQLite file and on a real
PostgreSQL server (every test here runs on both)."""

import json
import math
import threading
import time
import urllib.request

import grpc
import pytest
from autobyte.protocol import autobyte_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools.ports import free_port
from tests.helpers.daemon import ThreadDaemon
from tests.helpers.databases import DATABASES, database_url
from tests.helpers.rpc import Client, batch, sample


@pytest.fixture(params=DATABASES)
def db_url(request, tmp_path) -> str:
    return database_url(request, tmp_path)


@pytest.fixture
def client(thread_daemon):
    c = Client(thread_daemon.address)
    yield c
    c.close()


def storage_of(daemon: ThreadDaemon):
    return daemon.storage()


def test_stream_is_acknowledged_and_stored(client, thread_daemon):
    session = client.register().session_id
    acks = client.stream([batch(session, range(1, 51)), batch(session, range(51, 101))])
    assert acks == [50, 100]
    store = storage_of(thread_daemon)
    assert store.sample_count("job") == 100
    history = client.query.History(pb.HistoryRequest(job="job", limit=10), timeout=10)
    assert [s.step for s in history.steps] == list(range(90, 100))
    status = client.query.Status(pb.StatusRequest(), timeout=10)
    (job,) = status.jobs
    assert (job.job, job.state, job.steps, job.world_size) == ("job", "running", 100, 2)


def test_resent_samples_are_not_duplicated(client, thread_daemon):
    session = client.register().session_id
    assert client.stream([batch(session, range(1, 11))]) == [10]
    again = client.register()  # same instance re-registers, e.g. after a reconnect
    assert again.last_acked_seq == 10
    assert client.stream([batch(again.session_id, range(5, 16))]) == [15]
    assert storage_of(thread_daemon).sample_count("job") == 15


def test_stale_session_is_refused(client):
    first = client.register().session_id
    client.register()  # supersedes `first`
    with pytest.raises(grpc.RpcError) as info:
        client.stream([batch(first, [1])])
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "register again" in info.value.details()


def test_duplicate_rank_registration(client):
    client.register(instance="a")
    with pytest.raises(grpc.RpcError) as info:
        client.register(instance="b")
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "held by a live process" in info.value.details()


def test_world_size_mismatch(client):
    client.register(world_size=2)
    with pytest.raises(grpc.RpcError) as info:
        client.register(rank=1, world_size=4, instance="other")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("call", ["history", "best", "watch", "propose", "report"])
def test_unknown_job_is_not_found(client, call):
    requests = {
        "history": lambda: client.query.History(pb.HistoryRequest(job="nope"), timeout=10),
        "best": lambda: client.query.Best(pb.BestRequest(job="nope"), timeout=10),
        "watch": lambda: next(
            iter(client.control.WatchConfig(pb.WatchConfigRequest(job="nope"), timeout=10))
        ),
        "propose": lambda: client.control.ProposeConfig(
            pb.ProposeConfigRequest(job="nope"), timeout=10
        ),
        "report": lambda: client.control.ReportConfig(
            pb.ReportConfigRequest(job="nope"), timeout=10
        ),
    }
    with pytest.raises(grpc.RpcError) as info:
        requests[call]()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown job 'nope'" in info.value.details()


def test_oversized_message_is_refused(client, thread_daemon):
    session = client.register().session_id
    huge = batch(session, range(1, 9001))
    padded = pb.MetricsBatch(job="job", rank=0, session_id=session, samples=list(huge.samples) * 8)
    assert padded.ByteSize() > thread_daemon.settings.max_message_bytes
    with pytest.raises(grpc.RpcError) as info:
        client.stream([padded])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert storage_of(thread_daemon).sample_count("job") == 0


def test_stream_that_stops_midway_loses_nothing_acked(client, thread_daemon):
    session = client.register().session_id
    gate = threading.Event()

    def batches():
        yield batch(session, range(1, 21))
        gate.wait(10)
        raise RuntimeError("client died")  # the stream breaks off mid-way

    call = client.telemetry.StreamMetrics(batches(), timeout=30)
    first = next(call)
    assert first.acked_seq == 20
    gate.set()
    with pytest.raises(grpc.RpcError):
        list(call)
    assert storage_of(thread_daemon).sample_count("job") == 20
    # the daemon keeps serving
    assert client.register().last_acked_seq == 20


finite = st.floats(0, 1e3, allow_nan=False)
bad_value = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e20])
bad_field = st.sampled_from(
    [
        "step_time_s",
        "forward_s",
        "backward_s",
        "exposed_comm_s",
        "queueing_delay_s",
        "bandwidth_bytes_per_s",
    ]
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(good=st.integers(0, 30), position=st.integers(0, 30), field=bad_field, value=bad_value)
def test_a_bad_value_rejects_the_whole_batch(client, thread_daemon, good, position, field, value):
    job = f"prop-{time.monotonic_ns()}"
    session = client.register(job=job).session_id
    samples = [sample(s) for s in range(1, good + 2)]
    bad = samples[min(position, len(samples) - 1)]
    setattr(bad, field, value)
    with pytest.raises(grpc.RpcError) as info:
        client.stream([pb.MetricsBatch(job=job, rank=0, session_id=session, samples=samples)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
    assert storage_of(thread_daemon).sample_count(job) == 0


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    partition=st.integers(-(2**62), 2**62),
    credit=st.integers(-(2**62), 2**62),
    step=st.integers(-5, 2**40),
    seq_gap=st.booleans(),
)
def test_arbitrary_samples_never_crash_or_half_write(
    client, thread_daemon, partition, credit, step, seq_gap
):
    job = f"prop-{time.monotonic_ns()}"
    session = client.register(job=job).session_id
    message = sample(1, step=step)
    message.config.partition_bytes, message.config.credit_bytes = partition, credit
    samples = [sample(2), message] if not seq_gap else [message, sample(1)]
    try:
        acks = client.stream(
            [pb.MetricsBatch(job=job, rank=0, session_id=session, samples=samples)]
        )
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert storage_of(thread_daemon).sample_count(job) == 0
    else:
        assert acks and storage_of(thread_daemon).sample_count(job) == len(samples)
    assert client.query.Status(pb.StatusRequest(), timeout=10).daemon_version


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(job=st.text(max_size=300), rank=st.integers(-3, 10), world=st.integers(-2, 10))
def test_arbitrary_registrations_get_a_clear_status(client, job, rank, world):
    try:
        response = client.register(
            job=job, rank=rank, world_size=world, instance=f"h-{time.monotonic_ns()}"
        )
    except grpc.RpcError as error:
        assert error.code() in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.ALREADY_EXISTS,
        ), error.details()
        assert error.details()
    else:
        assert response.session_id and 0 <= rank < world and 0 < len(job) <= 255


def test_decisions_flow_to_watchers_and_reports_back(client):
    client.register()
    updates = client.control.WatchConfig(pb.WatchConfigRequest(job="job", rank=0), timeout=20)
    proposal = pb.ProposeConfigRequest(job="job", apply_at_step=7, reason="test")
    proposal.config.partition_bytes = 1 << 20
    decision = client.control.ProposeConfig(proposal, timeout=10)
    update = next(updates)
    assert (update.decision_id, update.apply_at_step, update.config.partition_bytes) == (
        decision.decision_id,
        7,
        1 << 20,
    )
    assert not update.config.HasField("credit_bytes")
    updates.cancel()
    report = pb.ReportConfigRequest(
        job="job", rank=0, decision_id=decision.decision_id, applied_at_step=7, config=update.config
    )
    client.control.ReportConfig(report, timeout=10)
    history = client.query.History(pb.HistoryRequest(job="job"), timeout=10)
    (stored,) = history.decisions
    assert (stored.state, stored.applied_at_step) == ("applied", 7)


def test_bad_proposal_is_invalid_argument(client):
    client.register()
    proposal = pb.ProposeConfigRequest(job="job")
    proposal.config.credit_bytes = 3
    with pytest.raises(grpc.RpcError) as info:
        client.control.ProposeConfig(proposal, timeout=10)
    assert (
        info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "credit_bytes=3" in info.value.details()
    )


def test_best_prefers_the_fastest_measured_configuration(client):
    session = client.register().session_id
    slow = [sample(s, step_time_s=0.1) for s in range(1, 21)]
    fast = [sample(s, step_time_s=0.05) for s in range(21, 41)]
    for s in fast:
        s.config.partition_bytes = 1 << 20
    client.stream([pb.MetricsBatch(job="job", rank=0, session_id=session, samples=slow + fast)])
    best = client.query.Best(pb.BestRequest(job="job"), timeout=10)
    assert (
        best.found
        and best.config.partition_bytes == 1 << 20
        and not best.config.HasField("credit_bytes")
    )
    assert best.median_step_time_s == pytest.approx(0.05)
    assert best.baseline_step_time_s == pytest.approx(0.1)
    assert "2.00x" in best.evidence


def test_token_is_required_for_every_service(db_url):
    daemon = ThreadDaemon(db_url, token="t0k").start()
    try:
        anonymous, wrong, right = (
            Client(daemon.address),
            Client(daemon.address, "bad"),
            Client(daemon.address, "t0k"),
        )
        for client, code in (
            (anonymous, grpc.StatusCode.UNAUTHENTICATED),
            (wrong, grpc.StatusCode.UNAUTHENTICATED),
        ):
            for call in (
                lambda c: c.register(),
                lambda c: c.query.Status(pb.StatusRequest(), timeout=5, metadata=c.metadata),
                lambda c: c.stream([batch("x", [1])]),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    call(client)
                assert info.value.code() == code
        session = right.register().session_id
        assert right.stream([batch(session, [1, 2])]) == [2]
    finally:
        daemon.stop()


def test_prometheus_endpoint(db_url):
    port = free_port()
    daemon = ThreadDaemon(db_url, metrics_listen=f"127.0.0.1:{port}").start()
    try:
        client = Client(daemon.address)
        session = client.register().session_id
        client.stream([batch(session, range(1, 31))])
        with pytest.raises(grpc.RpcError):
            client.stream([batch(session, [31], step_time_s=-1.0)])
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        daemon.stop()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["autobyted_samples_ingested_total"] == 30
    assert values["autobyted_samples_rejected_total"] == 1
    assert values['autobyted_jobs{state="running"}'] == 1
    assert "autobyted_streams_active" in text and "autobyted_decisions_total" in text


def test_status_json_shape(client, thread_daemon):
    from tests.helpers.cli import run_cli

    session = client.register().session_id
    client.stream([batch(session, range(1, 6))])
    result = run_cli("status", "--daemon", thread_daemon.address, "--format", "json")
    (job,) = json.loads(result.stdout)["jobs"]
    assert {"job", "state", "world_size", "steps", "config"} <= set(job)
    assert job["config"] == {"partition_bytes": None, "credit_bytes": None}
    long_job = "a-rather-long-job-name-for-the-table-0123456789"
    long_session = client.register(job=long_job, instance="wide").session_id
    wide = batch(long_session, range(1, 4), job=long_job)
    for sample_message in wide.samples:
        sample_message.config.partition_bytes, sample_message.config.credit_bytes = (
            64 << 10,
            256 << 10,
        )
    client.stream([wide])
    proposal = pb.ProposeConfigRequest(job=long_job, reason="x" * 200)
    proposal.config.partition_bytes = 3 << 20
    client.control.ProposeConfig(proposal, timeout=5)
    client.control.ProposeConfig(proposal, timeout=5)  # the first becomes "superseded"
    for args in (["status"], ["history", long_job]):
        table = run_cli(*args, "--daemon", thread_daemon.address)
        assert table.returncode == 0 and all(
            len(line) <= 80 for line in table.stdout.splitlines()
        ), table.stdout
    history = json.loads(
        run_cli(
            "history", "job", "--daemon", thread_daemon.address, "--format", "json", "--steps"
        ).stdout
    )
    assert set(history) == {"job", "steps", "decisions"}
    assert {"step", "rank", "step_time_s", "config"} <= set(history["steps"][0])
    csv_out = run_cli(
        "history", "job", "--daemon", thread_daemon.address, "--format", "csv", "--steps"
    ).stdout.splitlines()
    assert csv_out[0].startswith("kind,step,rank") and len(csv_out) == 6


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"memory_budget_bytes": 0}, "memory_budget_bytes must be positive"),
        ({"over_budget": [pb.Config(forward_prefetch=2)]}, "without a memory_budget_bytes"),
        (
            {"memory_budget_bytes": 9000, "over_budget": [pb.Config(partition_bytes=1 << 20)]},
            "this job runs fsdp2",
        ),
        (
            {"memory_budget_bytes": 9000, "over_budget": [pb.Config(forward_prefetch=1)] * 257},
            "more than 256",
        ),
    ],
)
def test_a_bad_memory_budget_is_refused_and_registers_nothing(client, thread_daemon, fields, says):
    job = f"mem-{time.monotonic_ns()}"
    with pytest.raises(grpc.RpcError) as info:
        client.register(job=job, engine="fsdp2", **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in info.value.details(), info.value.details()
    with pytest.raises(Exception, match="no job|not found|unknown"):  # nothing was stored
        storage_of(thread_daemon).job_info(job)


@pytest.mark.parametrize("value", [-1e-3, math.inf, math.nan, 61.0])
def test_a_bad_collective_latency_is_refused_and_registers_nothing(client, thread_daemon, value):
    job = f"lat-{time.monotonic_ns()}"
    with pytest.raises(grpc.RpcError) as info:
        client.register(job=job, collective_latency_s=value)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "collective_latency_s must be seconds in [0, 60]" in info.value.details()
    with pytest.raises(Exception, match="no job|not found|unknown"):  # nothing was stored
        storage_of(thread_daemon).job_info(job)


def test_the_per_collective_cost_is_rank_0s_and_reaches_the_predictors_shape(client, thread_daemon):
    from autobyted.tuner.features import JobShape

    job = f"lat-{time.monotonic_ns()}"
    storage = storage_of(thread_daemon)
    client.register(job=job, rank=1, instance="i-1", collective_latency_s=0.5)
    assert storage.job_info(job).collective_latency_s == 0.5  # the job's first registration
    client.register(job=job, rank=0, instance="i-0", collective_latency_s=0.0125)
    client.register(job=job, rank=1, instance="i-1", collective_latency_s=0.25)
    info = storage.job_info(job)
    assert info.collective_latency_s == 0.0125  # rank 0 decides, as for the configuration
    shape = JobShape.from_info(info)
    assert shape.collective_latency_s == 0.0125
    # a measurement of the cluster, not the model: another run's shape is the same shape
    other = JobShape.from_fingerprint(2, "gloo", info.fingerprint, 0.03)
    assert other == shape and other.same_model(shape)
    # an old client (the field absent): unknown, not zero seconds
    old = f"lat-old-{time.monotonic_ns()}"
    client.register(job=old)
    assert storage.job_info(old).collective_latency_s == 0.0


@pytest.mark.parametrize(
    ("layout", "engine", "says"),
    [
        ({}, "fsdp2", "names 1 to 100000 groups, got 0"),
        ({"group_bytes": [4096, -1]}, "fsdp2", "group_bytes[1] must be bytes in [0, 2**50)"),
        ({"group_bytes": [4096], "root_bytes": 1 << 50}, "fsdp2", "root_bytes must be bytes"),
        ({"group_bytes": [0, 0]}, "fsdp2", "groups hold no bytes"),
        ({"group_bytes": [1] * 100_001}, "fsdp2", "more than 100000 groups"),
        ({"group_bytes": [4096]}, "scheduler", "describes an fsdp2 job; this job runs scheduler"),
    ],
)
def test_a_bad_shard_layout_is_refused_and_registers_nothing(
    client, thread_daemon, layout, engine, says
):
    job = f"layout-{time.monotonic_ns()}"
    with pytest.raises(grpc.RpcError) as info:
        client.register(job=job, engine=engine, shard_layout=pb.ShardLayout(**layout))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in info.value.details(), info.value.details()
    with pytest.raises(Exception, match="no job|not found|unknown"):  # nothing was stored
        storage_of(thread_daemon).job_info(job)


def test_an_fsdp2_jobs_groups_are_rank_0s_and_kept_across_a_restart(client, thread_daemon):
    from autobyte.records import ShardLayout

    job = f"layout-{time.monotonic_ns()}"
    storage = storage_of(thread_daemon)
    first = pb.ShardLayout(group_bytes=[3, 5, 7], root_bytes=11, async_gathers=True)
    client.register(job=job, rank=1, instance="i-1", engine="fsdp2", shard_layout=first)
    assert storage.job_info(job).shard_layout == ShardLayout((3, 5, 7), 11, True)
    ordered = pb.ShardLayout(group_bytes=[5, 3, 7], root_bytes=11)  # after its first step
    client.register(job=job, rank=0, instance="i-0", engine="fsdp2", shard_layout=ordered)
    client.register(job=job, rank=1, instance="i-1", engine="fsdp2", shard_layout=first)
    assert storage.job_info(job).shard_layout == ShardLayout((5, 3, 7), 11, False)
    # the stored record, as another daemon on the database (or this one restarted) reads it
    from autobyted.storage.db import make_engine
    from autobyted.storage.sql import SqlStorage

    again = SqlStorage(make_engine(thread_daemon.settings.db)).job_info(job)
    assert again.shard_layout == ShardLayout((5, 3, 7), 11, False)
    old = f"layout-old-{time.monotonic_ns()}"  # a client before layouts: none
    client.register(job=old, engine="fsdp2")
    assert storage.job_info(old).shard_layout is None
