"""The tuner inside a real daemon: operator control, observe mode, opt-out, and bad inputs that must
leave the tuner and the daemon healthy. (The end-to-end tuning of a real 2-rank job is in
tests/test_tuner_e2e.py.)"""

from __future__ import annotations

import contextlib
import sqlite3

import grpc
import pytest
from autobyte.protocol import autobyte_pb2 as pb

from tests.helpers.daemon import ThreadDaemon
from tests.helpers.rpc import Client, SyntheticJob
from tests.helpers.wait import wait_for

MIB = 1 << 20


@contextlib.contextmanager
def job_on_daemon(db_url, tuner, **register):
    """A real daemon with the given --tuner mode and one synthetic job registered with it."""
    daemon = ThreadDaemon(db_url, tuner=tuner).start()
    client = Client(daemon.address)
    try:
        yield daemon, SyntheticJob(client, **register)
    finally:
        client.close()
        daemon.stop()


@pytest.fixture
def daemon(db_url):
    d = ThreadDaemon(db_url, tuner="auto", tuner_idle_s=3.0).start()
    yield d
    d.stop()


def test_operator_proposal_pauses_the_tuner_until_resumed(daemon):
    client = Client(daemon.address)
    job = SyntheticJob(client)
    job.steps(40, bandwidth_bytes_per_s=1e8)
    first = wait_for(lambda: job.history().decisions, what="the tuner's first decision")
    assert first[0].source == "tuner" and first[0].reason.startswith("trial 1/")
    proposal = client.control.ProposeConfig(
        pb.ProposeConfigRequest(
            job="job", config=pb.Config(partition_bytes=MIB), reason="operator"
        ),
        timeout=10,
    )
    assert proposal.source == "operator"
    tuner = wait_for(lambda: (t := job.tuner()).state == "paused" and t, what="paused")
    assert tuner.paused and "--resume" in tuner.detail
    before = len(job.history().decisions)
    job.steps(200, bandwidth_bytes_per_s=1e8)
    daemon.wait_tuner_looked("job")
    assert len(job.history().decisions) == before  # the operator's word stands
    resumed = client.control.SetTuning(pb.SetTuningRequest(job="job", paused=False), timeout=10)
    assert not resumed.paused
    job.steps(30, bandwidth_bytes_per_s=1e8)
    wait_for(lambda: job.tuner().state not in ("paused",), what="the tuner to resume")
    with pytest.raises(grpc.RpcError) as info:
        client.control.SetTuning(pb.SetTuningRequest(job="nope", paused=True), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    client.close()


def test_observe_mode_records_recommendations_and_pushes_nothing(db_url):
    with job_on_daemon(db_url, "observe") as (_daemon, job):
        watch = job.client.control.WatchConfig(pb.WatchConfigRequest(job="job", rank=0), timeout=6)
        job.steps(60, bandwidth_bytes_per_s=1e8)
        tuner = wait_for(lambda: (t := job.tuner()).state == "observing" and t, what="observing")
        assert tuner.mode == "observe" and tuner.detail.startswith("observe:")
        decisions = job.history().decisions
        assert all(d.state == "recommended" and d.source == "tuner" for d in decisions)
        with pytest.raises(grpc.RpcError) as info:  # nothing was pushed to the job
            next(iter(watch))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_job_that_opted_out_is_never_tuned(daemon):
    client = Client(daemon.address)
    job = SyntheticJob(client, tuning_disabled=True)
    job.steps(80, bandwidth_bytes_per_s=1e8)
    tuner = wait_for(lambda: (t := job.tuner()).state == "off" and t, what="off")
    assert tuner.mode == "opted out" and "tune=False" in tuner.detail
    daemon.wait_tuner_looked("job")  # it has seen all 80 steps
    assert list(job.history().decisions) == []
    client.close()


def test_tuner_off_shows_off(db_url):
    with job_on_daemon(db_url, "off") as (daemon, job):
        job.steps(60)
        assert (job.tuner().mode, job.tuner().state) == ("off", "off")
        assert daemon.daemon.tuner is None


def test_a_job_that_vanishes_mid_trial_and_a_rank_that_never_applies_leave_the_daemon_healthy(
    daemon,
):
    client = Client(daemon.address)
    gone = SyntheticJob(client, job="gone")
    gone.steps(40, bandwidth_bytes_per_s=1e8)
    wait_for(lambda: gone.tuner().state == "exploring", what="a trial")
    # "gone" sends nothing more: after tuner_idle_s the tuner lets it go
    stubborn = SyntheticJob(client, job="stubborn", instance="i-1")
    stubborn.steps(40, bandwidth_bytes_per_s=1e8)
    wait_for(lambda: stubborn.history().decisions, what="a decision for stubborn")
    for _ in range(10):  # 40 more seconds of its clock, still on the old configuration
        stubborn.steps(40, bandwidth_bytes_per_s=1e8)
    tuner = wait_for(
        lambda: "was not applied" in (t := stubborn.tuner()).detail and t, what="given up"
    )
    assert tuner.state == "holding"
    idle = wait_for(lambda: (t := gone.tuner()).state == "idle" and t, timeout_s=30, what="idle")
    assert idle.detail.startswith("idle: no steps")
    # the daemon still ingests and answers
    stubborn.steps(5)
    assert client.query.Status(pb.StatusRequest(), timeout=10).jobs
    client.close()


def test_a_failing_tuner_never_stops_ingestion(daemon, db_url):
    client = Client(daemon.address)
    job = SyntheticJob(client)
    with sqlite3.connect(db_url.removeprefix("sqlite:///")) as connection:
        connection.execute("drop table tuner_windows")  # the tuner's writes now fail
    job.steps(60, bandwidth_bytes_per_s=1e8)
    tuner = wait_for(lambda: (t := job.tuner()).state == "error" and t, what="error state")
    assert "tuner_windows" in tuner.detail or "database" in tuner.detail
    job.steps(100)  # ingestion goes on
    assert job.history().steps[-1].step == job.seq - 1
    client.close()


def test_the_predictor_is_retrained_from_every_job_and_survives_a_restart(db_url):
    import random

    from autobyte.types import Config

    from autobyted.storage.db import make_engine, migrate
    from autobyted.storage.records import Registration, WindowRecord
    from autobyted.storage.sql import SqlStorage
    from autobyted.tuner.features import summarize
    from autobyted.tuner.manager import TunerManager
    from tests.helpers.tuner import SHAPE
    from tests.helpers.tuner import sample as tuner_sample

    engine = make_engine(db_url)
    migrate(engine)
    storage = SqlStorage(engine)
    rng = random.Random(0)
    for job in ("a", "b"):
        storage.register(
            Registration(job=job, rank=0, world_size=2, backend="gloo", instance_id=job), 30
        )
        for config, step_s in ((Config(4 * MIB, 16 * MIB), 0.1), (Config(MIB, 4 * MIB), 0.07)):
            samples = [tuner_sample(i, config, 0, step_s, 1e8, rng) for i in range(15)]
            storage.add_window(
                WindowRecord(job, 0, config, step_s, 15, summarize(samples, SHAPE).to_json())
            )

    def no_decisions(*args, **kwargs):
        raise AssertionError("not deciding here")

    first = TunerManager(storage, no_decisions)
    first._load_predictor()
    assert first.predictor.ensemble.meta["kind"] == "prior"
    assert first.retrain_now()
    trained = first.predictor.ensemble
    assert (
        trained.meta["kind"] == "online"
        and trained.meta["jobs"] == 2
        and trained.meta["examples"] == 4
    )
    restarted = TunerManager(storage, no_decisions)  # a new daemon on the same database
    restarted._load_predictor()
    assert restarted.predictor.ensemble.digest == trained.digest
    # a model trained on top of another prior (an upgraded daemon) is not used; it is retrained
    storage.save_model(
        "online", trained.to_bytes().replace(trained.meta["base"].encode(), b"0" * 16), 4
    )
    upgraded = TunerManager(storage, no_decisions)
    upgraded._load_predictor()
    assert upgraded.predictor.ensemble.meta["kind"] == "prior" and upgraded.new_windows


def test_an_fsdp2_job_starts_from_what_the_latest_job_of_its_model_held(db_url):
    """The daemon learns across FSDP2 jobs: a new job's search measures first what the latest other
    job of the same model (fingerprint) and backend held, at its world size if one ran there
    (tuner.sharded)."""
    from autobyte.records import Fingerprint, Registration, TunerStatusRecord
    from autobyte.types import Config

    from autobyted.storage.db import make_engine, migrate
    from autobyted.storage.sql import SqlStorage
    from autobyted.tuner.manager import TunerManager

    engine = make_engine(db_url)
    migrate(engine)
    storage = SqlStorage(engine)
    model, other = Fingerprint(10, 40, 2, 32, 8, "model"), Fingerprint(10, 40, 2, 32, 8, "other")
    held = Config(forward_prefetch=1, reshard_after_forward=False)
    earlier = [  # (job, fingerprint, world size, what its tuner held)
        ("first", model, 2, Config(forward_prefetch=2)),
        ("other-model", other, 2, Config(forward_prefetch=3)),
        ("other-size", model, 4, Config(backward_prefetch=3)),
        ("latest", model, 2, held),
        ("never-tuned", model, 2, None),
    ]
    for job, fingerprint, world, config in [*earlier, ("new", model, 2, None)]:
        storage.register(Registration(job, 0, world, "gloo", job, fingerprint, engine="fsdp2"), 30)
        if config is not None:
            status = TunerStatusRecord("auto", "holding", "holding", config, 0.1, 0.08)
            storage.save_tuner_status(job, status)

    def no_decisions(*args, **kwargs):
        raise AssertionError("not deciding here")

    manager = TunerManager(storage, no_decisions)
    assert manager._held_by_earlier("new", storage.job_info("new")) == (held, "latest")
    assert manager._open("new").tuner._known == (held, "latest")
    # restarted at a rank count no earlier job of the model ran: the latest at another one
    storage.register(Registration("at-8", 0, 8, "gloo", "at-8", model, engine="fsdp2"), 30)
    assert manager._held_by_earlier("at-8", storage.job_info("at-8")) == (held, "latest")
    # a job of a model no earlier job ran starts from its own settings
    storage.register(Registration("alone", 0, 2, "gloo", "alone", other, engine="fsdp2"), 30)
    storage.save_tuner_status("other-model", TunerStatusRecord("auto", "baseline", "baseline"))
    assert manager._held_by_earlier("alone", storage.job_info("alone")) is None
