"""The storage contract, run against every backend: SQLAlchemy on a SQLite file and on a real
PostgreSQL server (a throwaway cluster, tests/conftest.py)."""

import dataclasses
import time

import pytest
from autobyte.types import Config, StepMetrics

from autobyted.best import PARAMS, best, best_in_latest_context
from autobyted.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from autobyted.storage.db import make_engine, migrate
from autobyted.storage.records import MemoryLimits, Registration, SampleBatch
from autobyted.storage.sql import SqlStorage
from tests.helpers.databases import DATABASES, database_url


@pytest.fixture(params=DATABASES)
def store(request, tmp_path):
    engine = make_engine(database_url(request, tmp_path))
    migrate(engine)
    yield SqlStorage(engine)
    engine.dispose()


def reg(rank=0, instance="a", job="j", world=2, engine="scheduler"):
    return Registration(
        job=job, rank=rank, world_size=world, backend="gloo", instance_id=instance, engine=engine
    )


def samples(first, last, **kw):
    return tuple(
        (seq, StepMetrics(step=seq - 1, wall_time_s=time.time(), step_time_s=0.1, **kw))
        for seq in range(first, last + 1)
    )


def test_register_and_append(store):
    session = store.register(reg(), 30).session_id
    assert store.append_samples([SampleBatch("j", 0, session, samples(1, 10))]) == [10]
    assert store.sample_count("j") == 10
    (job,) = store.jobs(30)
    assert (job.job, job.steps, job.ranks, job.state) == ("j", 10, (0,), "running")


def test_append_is_idempotent_per_seq(store):
    session = store.register(reg(), 30).session_id
    store.append_samples([SampleBatch("j", 0, session, samples(1, 10))])
    assert store.append_samples([SampleBatch("j", 0, session, samples(1, 12))]) == [12]
    assert store.sample_count("j") == 12


def test_stale_session_is_reported_not_stored(store):
    old = store.register(reg(), 30).session_id
    new = store.register(reg(), 30).session_id
    assert store.append_samples(
        [SampleBatch("j", 0, old, samples(1, 3)), SampleBatch("j", 0, new, samples(1, 2))]
    ) == [-1, 2]
    assert store.sample_count("j") == 2


def test_live_rank_cannot_be_taken_over_but_a_silent_one_can(store):
    store.register(reg(instance="a"), 30)
    with pytest.raises(AlreadyExists):
        store.register(reg(instance="b"), 30)
    assert store.register(reg(instance="b"), 0).last_acked_seq == 0


def test_world_size_is_fixed_per_job(store):
    store.register(reg(world=2), 30)
    with pytest.raises(FailedPrecondition):
        store.register(reg(rank=1, instance="b", world=3), 30)


def test_decisions(store):
    store.register(reg(), 30)
    first = store.add_decision("j", Config(1 << 20, None), 5, "first")
    second = store.add_decision("j", Config(None, 1 << 22), 9, "second")
    states = [(d.decision_id, d.state) for d in store.decisions("j")]
    assert states == [(first.decision_id, "superseded"), (second.decision_id, "pending")]
    store.record_applied_config("j", 0, second.decision_id, second.config, 9)
    (applied,) = store.decisions("j", first.decision_id)
    assert (applied.state, applied.applied_at_step) == ("applied", 9)
    assert store.jobs(30)[0].config == Config(None, 1 << 22)
    with pytest.raises(NotFound):
        store.record_applied_config("j", 0, 999, Config(), 1)


def test_unknown_job(store):
    for call in (
        lambda: store.history("x"),
        lambda: store.rank0_points("x"),
        lambda: best(store, "x"),
        lambda: store.decisions("x"),
        lambda: store.add_decision("x", Config(), 0, ""),
    ):
        with pytest.raises(NotFound, match="unknown job 'x'"):
            call()


def test_retention_downsamples_oldest(store):
    session = store.register(reg(), 30).session_id
    store.append_samples([SampleBatch("j", 0, session, samples(1, 1000))])
    removed = store.enforce_retention(max_raw_samples=500, keep_every=10)
    assert removed == 450  # the oldest 500 keep every 10th step
    assert store.sample_count("j") == 550
    kept = [r.step for r in store.history("j", limit=10_000)]
    assert kept[:3] == [0, 10, 20] and kept[-1] == 999


def test_history_filters(store):
    s0 = store.register(reg(0), 30).session_id
    s1 = store.register(reg(1, instance="b"), 30).session_id
    store.append_samples(
        [SampleBatch("j", 0, s0, samples(1, 5)), SampleBatch("j", 1, s1, samples(1, 5))]
    )
    assert {r.rank for r in store.history("j", rank=1)} == {1}
    assert len(store.history("j", limit=3)) == 3
    assert store.history("j", since_s=time.time() + 100) == []


def test_model_must_match_the_job(store):
    from autobyted.storage.records import Fingerprint

    store.register(
        Registration(
            job="j",
            rank=0,
            world_size=2,
            backend="gloo",
            instance_id="a",
            fingerprint=Fingerprint(digest="aaaa"),
        ),
        30,
    )
    with pytest.raises(FailedPrecondition, match="different model"):
        store.register(
            Registration(
                job="j",
                rank=1,
                world_size=2,
                backend="gloo",
                instance_id="b",
                fingerprint=Fingerprint(digest="bbbb"),
            ),
            30,
        )


def test_ranks_of_a_new_job_register_at_once(store):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(
                lambda rank: store.register(reg(rank=rank, instance=f"i{rank}", world=8), 30),
                range(8),
            )
        )
    assert len({r.session_id for r in results}) == 8
    assert store.jobs(30)[0].ranks == tuple(range(8))


def test_writer_survives_a_stream_that_went_away(store):
    from autobyted.ingest import IngestWriter

    session = store.register(reg(), 30).session_id
    writer = IngestWriter(store)
    gone = writer.submit(SampleBatch("j", 0, session, samples(1, 5)))
    assert gone.cancel()  # the client's stream was cancelled before the writer took the batch
    writer.start()
    try:
        assert writer.submit(SampleBatch("j", 0, session, samples(6, 8))).result(timeout=30) == 8
    finally:
        writer.close()
    assert store.sample_count("j") == 8  # the cancelled batch was written all the same


# ---------------------------------------------------------------------- what the tuner relies on


def test_samples_are_read_incrementally_with_every_field(store):
    from autobyte.types import StepMetrics

    s0 = store.register(reg(0), 30).session_id
    s1 = store.register(reg(1, instance="b"), 30).session_id
    store.append_samples(
        [
            SampleBatch(
                "j",
                0,
                s0,
                samples(
                    1,
                    5,
                    host_load=0.25,
                    bandwidth_bytes_per_s=1e8,
                    config=Config(1 << 20, 1 << 22),
                    decision_id=0,
                ),
            ),
            SampleBatch("j", 1, s1, samples(1, 5)),
        ]
    )
    first = store.samples_after("j", 0, rank=0, limit=3)
    assert [row.metrics.step for row in first] == [0, 1, 2] and {row.rank for row in first} == {0}
    assert isinstance(first[0].metrics, StepMetrics)
    assert (first[0].metrics.host_load, first[0].metrics.config) == (0.25, Config(1 << 20, 1 << 22))
    rest = store.samples_after("j", first[-1].row_id, rank=0)
    assert [row.metrics.step for row in rest] == [3, 4]
    assert len(store.samples_after("j", 0, rank=None)) == 10
    assert store.last_sample_row("j") == rest[-1].row_id
    assert store.last_sample_row("j", rank=None) >= rest[-1].row_id
    with pytest.raises(NotFound):
        store.samples_after("x", 0)


def test_operator_decision_pauses_the_tuner_and_refuses_its_decisions(store):
    from autobyted.storage.records import TunerStatusRecord

    store.register(reg(), 30)
    trial = store.add_decision("j", Config(1 << 20, None), 5, "trial 1/3", 0.1, source="tuner")
    assert trial.source == "tuner" and trial.predicted_step_time_s == 0.1
    store.save_tuner_status(
        "j", TunerStatusRecord(mode="auto", state="exploring", detail="exploring 1/3")
    )
    store.add_decision("j", Config(None, None), 9, "operator")
    assert store.tuner_status("j").paused
    with pytest.raises(FailedPrecondition, match="--resume"):
        store.add_decision("j", Config(4 << 20, None), 12, "trial 2/3", source="tuner")
    # saving the tuner's view keeps the operator's pause; only a resume ends it
    store.save_tuner_status(
        "j", TunerStatusRecord(mode="auto", state="paused", detail="paused by operator")
    )
    assert store.tuner_status("j").paused
    assert not store.set_tuning_paused("j", False).paused
    store.add_decision("j", Config(4 << 20, None), 12, "trial 2/3", source="tuner")
    assert [d.source for d in store.decisions("j")] == ["tuner", "operator", "tuner"]
    (job,) = store.jobs(30)
    assert job.tuner.state == "paused" and job.tuner.mode == "auto"


def test_recommendations_are_stored_not_pending(store):
    store.register(reg(), 30)
    pending = store.add_decision("j", Config(1 << 20, None), 5, "operator")
    store.set_tuning_paused("j", False)
    store.add_decision(
        "j", Config(4 << 20, None), 0, "observe", source="tuner", state="recommended"
    )
    assert [d.state for d in store.decisions("j")] == [
        "pending",
        "recommended",
    ]  # nothing superseded
    store.close_decision(pending.decision_id, 0.123, "rolled_back")
    (first, _) = store.decisions("j")
    assert (first.measured_step_time_s, first.state) == (0.123, "rolled_back")
    with pytest.raises(ValueError):
        store.add_decision("j", Config(), 0, "x", state="applied")


def test_windows_and_models(store):
    from autobyted.storage.records import WindowRecord

    store.register(reg(job="a"), 30)
    store.register(reg(job="b"), 30)
    first = store.add_window(WindowRecord("a", 0, Config(1 << 20, None), 0.1, 20, '{"x": 1}'))
    store.add_window(WindowRecord("b", 2, Config(), 0.2, 15, "{}"))
    assert [(w.job, w.segment, w.samples) for w in store.windows()] == [("a", 0, 20), ("b", 2, 15)]
    assert [w.job for w in store.windows(after_window_id=first)] == ["b"]
    assert [w.job for w in store.windows(limit=1, newest=True)] == ["b"]
    # a new tuner of a job numbers its segments past the stored ones (two runs of one job name)
    assert (
        store.next_window_segment("a"),
        store.next_window_segment("b"),
        store.next_window_segment("c"),
    ) == (1, 3, 0)
    assert store.latest_model() is None
    for index in range(5):
        store.save_model("online", bytes([index]) * 10, examples=index, keep=3)
    latest = store.latest_model()
    assert (latest.model, latest.examples) == (bytes([4]) * 10, 4)


def test_job_info_and_opt_out(store):
    from autobyted.storage.records import Fingerprint

    store.register(
        Registration(
            job="j",
            rank=0,
            world_size=2,
            backend="gloo",
            instance_id="a",
            fingerprint=Fingerprint(10, 40, 2, 32, 8, "d"),
            tuning_disabled=True,
        ),
        30,
    )
    info = store.job_info("j")
    assert (info.world_size, info.backend, info.fingerprint.tensor_count, info.tuning_disabled) == (
        2,
        "gloo",
        2,
        True,
    )
    assert store.active_jobs(30) == ["j"] and store.active_jobs(-1) == []


def test_final_batches_finish_a_job_and_free_its_ranks(store):
    """A job is `finished` once every rank it knows sent its final batch; a finished
    rank is free for a new process at once (no liveness wait)."""
    sessions = [store.register(reg(rank=r), 30).session_id for r in (0, 1)]
    store.append_samples([SampleBatch("j", 0, sessions[0], samples(1, 5), final=True)])
    assert store.jobs(30)[0].state == "running"  # rank 1 still runs
    store.append_samples([SampleBatch("j", 1, sessions[1], (), final=True)])
    assert store.jobs(30)[0].state == "finished"
    assert store.register(reg(rank=1, instance="b"), 30).last_acked_seq == 0  # taken over at once
    assert store.jobs(30)[0].state == "running"


def test_a_tuner_decision_made_after_every_rank_finished_is_stored_expired(store):
    """The tuner reads a job's last steps after its final batches arrived (which expired what was
    pending then): what it decides from them no process will apply, so it is kept expired, never
    pending; an operator's decision is refused (test above); a new run decides afresh."""
    sessions = [store.register(reg(rank=r), 30).session_id for r in (0, 1)]
    before = store.add_decision("j", Config(1 << 20, None), 40, "trial 1", source="tuner")
    store.append_samples(
        [SampleBatch("j", r, sessions[r], samples(1, 30), final=True) for r in (0, 1)]
    )
    late = store.add_decision("j", Config(4 << 20, None), 60, "trial 2", source="tuner")
    assert late.state == "expired"
    assert [(d.decision_id, d.state) for d in store.decisions("j")] == [
        (before.decision_id, "expired"),
        (late.decision_id, "expired"),
    ]
    store.register(reg(instance="run-2"), 30)  # a new run
    assert (
        store.add_decision("j", Config(None, None), 5, "run 2", source="tuner").state == "pending"
    )


@pytest.mark.parametrize("how", ["finished", "silent"])
def test_a_new_run_expires_the_pending_decisions_of_the_old_one(store, how):
    """A new process on rank 0 starts a new run (steps count from 0 again): a decision
    still pending for the old run expires, a decision made afterwards is pending for the new run."""
    session = store.register(reg(), 30).session_id
    store.append_samples([SampleBatch("j", 0, session, samples(1, 30))])
    old = store.add_decision("j", Config(1 << 20, None), 500, "for run 1")
    session = store.register(
        reg(), 30
    ).session_id  # the same process again (daemon restart): same run
    assert store.decisions("j")[0].state == "pending"
    store.append_samples([SampleBatch("j", 0, session, (), final=how == "finished")])
    liveness_s = 30 if how == "finished" else 0.0  # a silent rank is taken over after liveness_s
    store.register(reg(instance="run-2"), liveness_s)
    assert [(d.decision_id, d.state) for d in store.decisions("j")] == [
        (old.decision_id, "expired")
    ]
    assert store.jobs(30)[0].steps == 0  # the new run's steps
    new = store.add_decision("j", Config(None, 4 << 20), 10, "for run 2")
    assert [d.state for d in store.decisions("j")] == [
        "expired",
        "pending",
    ] and new.decision_id > old.decision_id
    store.register(reg(rank=1, instance="run-2b"), 30)  # another rank joining is not a new run
    assert store.decisions("j")[-1].state == "pending"


# ---------------------------------------------------------------------- several daemons, one database


def test_leases_are_exclusive_renewed_and_taken_over_once_expired(store):
    assert store.lease("tuner:j") is None
    assert store.acquire_lease("tuner:j", "daemon-a", 30)
    assert not store.acquire_lease("tuner:j", "daemon-b", 30)  # held: refused
    first = store.lease("tuner:j")
    assert first.holder == "daemon-a" and 25 < first.expires_in_s <= 30
    assert store.acquire_lease("tuner:j", "daemon-a", 60)  # the holder renews
    renewed = store.lease("tuner:j")
    assert renewed.expires_in_s > 55 and renewed.acquired_at_s == first.acquired_at_s
    assert store.acquire_lease("other", "daemon-b", 30)  # leases are independent
    assert store.acquire_lease("tuner:j", "daemon-a", 30)
    # daemon-a stops renewing (it died): daemon-b, seen on a clock driven past the expiry, takes over
    # once it expired and not a second before
    clock_s = [time.time()]
    driven = SqlStorage(store._engine, lease_clock=lambda: clock_s[0])
    clock_s[0] += 25
    assert not driven.acquire_lease("tuner:j", "daemon-b", 30)
    assert driven.lease("tuner:j").expires_in_s < 6
    clock_s[0] += 10
    assert driven.acquire_lease("tuner:j", "daemon-b", 30)
    taken = store.lease("tuner:j")
    assert taken.holder == "daemon-b" and taken.acquired_at_s > first.acquired_at_s
    assert not store.acquire_lease("tuner:j", "daemon-a", 30)
    store.release_lease("tuner:j", "daemon-a")  # not the holder: nothing happens
    assert store.lease("tuner:j").holder == "daemon-b"
    store.release_lease("tuner:j", "daemon-b")  # a clean stop hands it over at once
    assert store.acquire_lease("tuner:j", "daemon-a", 30)
    with pytest.raises(ValueError):
        store.acquire_lease("tuner:j", "daemon-a", 0)


def test_only_the_lease_holder_makes_tuner_decisions(store):
    store.register(reg(), 30)
    with pytest.raises(FailedPrecondition, match="not held"):
        store.add_decision(
            "j", Config(1 << 20, None), 5, "trial", source="tuner", lease_holder="daemon-a"
        )
    assert store.acquire_lease("tuner:j", "daemon-a", 30)
    made = store.add_decision(
        "j", Config(1 << 20, None), 5, "trial", source="tuner", lease_holder="daemon-a"
    )
    with pytest.raises(FailedPrecondition, match="held by daemon-a"):
        store.add_decision(
            "j", Config(4 << 20, None), 9, "trial", source="tuner", lease_holder="daemon-b"
        )
    assert [d.decision_id for d in store.decisions("j")] == [made.decision_id]


def test_newest_decision_ids(store):
    store.register(reg(job="a"), 30)
    store.register(reg(job="b"), 30)
    assert store.newest_decision_ids(["a", "b", "unknown"]) == {"a": 0, "b": 0}
    first = store.add_decision("a", Config(1 << 20, None), 5, "x")
    second = store.add_decision("a", Config(2 << 20, None), 5, "y")
    assert store.newest_decision_ids(["a", "b"]) == {"a": second.decision_id, "b": 0}
    assert second.decision_id > first.decision_id
    assert store.newest_decision_ids([]) == {}


def test_two_writers_of_one_rank_never_store_a_sample_twice(pg_url):
    """Two daemons' writers (two engines) on one PostgreSQL store the same rank's resends at the same
    moment, and a re-registration moves the rank's session between them: each sample is stored once.
    (PostgreSQL only: a SQLite file serves one daemon, whose one writer thread stores every sample.)"""
    import concurrent.futures
    import threading

    engines = [make_engine(pg_url) for _ in range(2)]
    try:
        migrate(engines[0])
        store, other = (SqlStorage(engine) for engine in engines)
        session = store.register(reg(), 30).session_id

        gate = threading.Barrier(2)

        def resend(storage, first):  # the client resends from seq `first`; both daemons got it
            gate.wait(10)
            return storage.append_samples(
                [SampleBatch("j", 0, session, samples(first, first + 199))]
            )

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for first in range(1, 1001, 100):  # in order, as a client sends; each overlaps the last
                results = list(pool.map(lambda s, first=first: resend(s, first), (store, other)))
                assert results == [[first + 199]] * 2
        steps = sorted(r.step for r in store.history("j", limit=10_000))
        assert steps == list(range(1100)), "a sample was stored twice or lost"
        again = other.register(reg(), 30)  # the same process, now on the other daemon
        assert again.last_acked_seq == 1100
        assert store.append_samples([SampleBatch("j", 0, session, samples(1090, 1101))]) == [-1]
        assert other.append_samples(
            [SampleBatch("j", 0, again.session_id, samples(1090, 1101))]
        ) == [1101]
        assert store.sample_count("j") == 1101
    finally:
        for engine in engines:
            engine.dispose()


@pytest.mark.parametrize(
    ("engine", "tail", "plain"),
    [
        ("scheduler", Config(1 << 20, 4 << 20, 8 << 20), Config(1 << 20, 4 << 20)),
        (
            "fsdp2",
            Config(forward_prefetch=2, backward_prefetch=3, reshard_after_forward=False),
            Config(),
        ),
    ],
)
def test_a_tail_window_is_kept_in_every_record_that_holds_a_configuration(
    store, engine, tail, plain
):
    """Config.tail_bytes (migration 0005) and FSDP2's knobs (0006) in samples, the job, decisions,
    applied configurations, the tuner's status and windows, and `best`; a configuration without
    them reads back as it was written (NULL is no tail window, FSDP2's as the user set it)."""
    from autobyted.storage.records import TunerStatusRecord, WindowRecord

    s0 = store.register(reg(engine=engine), 30).session_id
    store.append_samples(
        [
            SampleBatch(
                "j",
                0,
                s0,
                samples(1, 12, config=tail)
                + tuple(
                    (
                        seq,
                        StepMetrics(
                            step=seq - 1, wall_time_s=time.time(), step_time_s=0.2, config=plain
                        ),
                    )
                    for seq in range(13, 25)
                ),
            )
        ]
    )
    configs = [row.metrics.config for row in store.samples_after("j", 0, rank=0)]
    assert configs[:12] == [tail] * 12 and configs[12:] == [plain] * 12
    assert store.jobs(30)[0].config == plain  # rank 0's newest
    decision = store.add_decision("j", tail, 30, "operator")
    assert store.decisions("j")[-1].config == tail
    store.record_applied_config("j", 0, decision.decision_id, tail, 30)
    assert store.jobs(30)[0].config == tail
    store.set_tuning_paused("j", False)
    store.save_tuner_status(
        "j", TunerStatusRecord(mode="auto", state="holding", detail="holding", config=tail)
    )
    assert store.tuner_status("j").config == tail
    store.add_window(WindowRecord("j", 0, tail, 0.1, 12, "{}"))
    assert store.windows()[-1].config == tail
    # every step compared (no warm-up): the twelve of each configuration
    best = best_in_latest_context(
        "j", store.rank0_points("j"), 3, dataclasses.replace(PARAMS, warmup_steps=0)
    )
    assert best.found and best.config == tail  # 0.1 s against plain's 0.2 s, told apart
    assert {c.config for c in best.candidates} == {tail, plain}
    assert store.jobs(30)[0].engine == engine == store.job_info("j").engine


def test_a_job_takes_only_its_engines_configurations(store):
    """A decision of the other engine's knobs is refused, naming the job's engine, and stores
    nothing; a registration of the job under another engine is refused."""
    store.register(reg(engine="fsdp2"), 30)
    with pytest.raises(InvalidArgument, match="this job runs fsdp2"):
        store.add_decision("j", Config(1 << 20, 4 << 20), 0, "operator")
    with pytest.raises(InvalidArgument, match="this job runs fsdp2"):
        store.add_decision("j", Config(tail_bytes=8 << 20), 0, "tuner", source="tuner")
    assert store.decisions("j") == []
    store.add_decision("j", Config(forward_prefetch=1), 0, "operator")
    store.register(reg(job="s"), 30)
    with pytest.raises(InvalidArgument, match="this job runs scheduler"):
        store.add_decision("s", Config(backward_prefetch=2), 0, "operator")
    with pytest.raises(FailedPrecondition, match="registered as a scheduler job, not fsdp2"):
        store.register(reg(job="s", rank=1, instance="b", engine="fsdp2"), 30)


def test_an_fsdp2_jobs_memory_budget_is_kept_and_no_decision_over_it_is_stored(store):
    """Rank 0's registration carries the budget and the configurations over it (migration 0007):
    the job keeps them, a decision of one is refused naming the budget and stores nothing, and
    rank 0's next registration replaces them (another rank's does not)."""
    keep = Config(reshard_after_forward=False)
    deeper = Config(forward_prefetch=3)
    limits = MemoryLimits(7_500, frozenset({keep, deeper}))
    store.register(dataclasses.replace(reg(engine="fsdp2"), memory=limits), 30)
    assert store.job_info("j").memory == limits
    for over in (keep, deeper):
        with pytest.raises(FailedPrecondition, match="memory budget of 7,500 bytes"):
            store.add_decision("j", over, 0, "operator")
    assert store.decisions("j") == []
    store.add_decision("j", Config(forward_prefetch=1), 0, "operator")
    # rank 1 says nothing of memory: rank 0's word stands
    store.register(reg(rank=1, instance="b", engine="fsdp2"), 30)
    assert store.job_info("j").memory == limits
    store.register(
        dataclasses.replace(reg(engine="fsdp2"), memory=MemoryLimits(9_000, frozenset({deeper}))),
        30,
    )
    assert store.job_info("j").memory == MemoryLimits(9_000, frozenset({deeper}))
    store.add_decision("j", keep, 0, "operator")
    store.register(reg(job="free", engine="fsdp2"), 30)
    assert store.job_info("free").memory is None
