"""`autobyte.query.Client` against a real autobyted: the records the CLI shows, and one error type."""

import pytest
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.query import Client, DaemonError
from autobyte.records import BestRecord, DecisionRecord, HistoryStep, JobRecord
from autobyte.types import Config

from devtools.ports import free_port
from tests.helpers.rpc import Client as RawClient
from tests.helpers.rpc import sample


def _stream_job(address: str, job: str, steps: int = 30) -> None:
    """A job whose first half ran the baseline (none/inf) and second half 1 MiB partitions,
    faster, past the tuner's warm-up."""
    raw = RawClient(address)
    session = raw.register(job=job).session_id
    samples = [sample(s, step_time_s=0.05) for s in range(1, steps + 1)]
    for s in samples[steps // 2 :]:
        s.config.partition_bytes, s.step_time_s = 1 << 20, 0.04
    raw.stream([pb.MetricsBatch(job=job, rank=0, session_id=session, samples=samples)])
    raw.close()


def test_the_client_returns_the_records_of_status_history_best_and_control(thread_daemon):
    _stream_job(thread_daemon.address, "gpt2-finetune")
    client = Client(thread_daemon.address)

    status = client.status()
    assert status.daemon_version
    (job,) = status.jobs
    assert isinstance(job, JobRecord) and job.job == "gpt2-finetune" and job.world_size == 2
    assert job.config == Config(1 << 20, None) and job.steps == 30

    assert client.resolve("gpt2") == "gpt2-finetune"  # a unique prefix
    history = client.history("gpt2-finetune", steps=True)
    # the daemon's tuner may already have decided a trial from these steps (it runs beside the
    # query): nobody else has decided anything yet
    assert all(d.source == "tuner" for d in history.decisions) and len(history.steps) == 30
    assert all(isinstance(s, HistoryStep) and s.rank == 0 for s in history.steps)
    assert [s.config for s in history.steps[-2:]] == [Config(1 << 20, None)] * 2
    assert client.history("gpt2-finetune").steps == ()  # steps only when asked for

    best = client.best("gpt2-finetune")
    assert isinstance(best, BestRecord) and best.found and best.config == Config(1 << 20, None)
    assert best.median_step_time_s == pytest.approx(0.04)

    decision = client.propose("gpt2-finetune", Config(4 << 20, 16 << 20), reason="pin it")
    assert isinstance(decision, DecisionRecord)
    assert decision.config == Config(4 << 20, 16 << 20) and decision.reason == "pin it"
    (stored,) = [d for d in client.history("gpt2-finetune").decisions if d.source != "tuner"]
    assert stored.decision_id == decision.decision_id and stored.source == "operator"
    # the proposal paused the tuner for the job; resuming hands it back
    resumed = client.set_tuning("gpt2-finetune", paused=False)
    assert resumed is None or not resumed.paused


def test_every_failure_is_one_error_type_whose_kind_says_which(thread_daemon):
    _stream_job(thread_daemon.address, "job-a", steps=4)
    _stream_job(thread_daemon.address, "job-b", steps=4)
    with pytest.raises(DaemonError, match="cannot reach autobyted") as unreachable:
        Client(f"127.0.0.1:{free_port()}", timeout_s=2).status()
    assert unreachable.value.kind == "unreachable"
    with pytest.raises(DaemonError, match="must look like HOST:PORT") as bad_address:
        Client("nohost")
    assert bad_address.value.kind == "usage"
    client = Client(thread_daemon.address)
    with pytest.raises(DaemonError, match="unknown job 'nope'") as unknown:
        client.history("nope")
    assert unknown.value.kind == "error" and "NOT_FOUND" in str(unknown.value)
    with pytest.raises(DaemonError, match="ambiguous: it starts 2 jobs") as ambiguous:
        client.resolve("job-")
    assert ambiguous.value.kind == "usage"
    with pytest.raises(ValueError, match="kind 'other'"):
        DaemonError("x", "other")
