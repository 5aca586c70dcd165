"""The committed protocol code is what the pinned generator makes; the converters round-trip."""

import subprocess
import sys

import pytest
from autobyte.convert import (
    best_from_proto,
    best_to_proto,
    config_from_proto,
    config_to_proto,
    config_update_to_proto,
    decision_from_proto,
    decision_to_proto,
    fingerprint_from_proto,
    fingerprint_to_proto,
    history_step_from_proto,
    history_to_proto,
    job_status_from_proto,
    job_status_to_proto,
    metrics_from_proto,
    metrics_to_proto,
    registration_from_proto,
    tuner_status_from_proto,
    tuner_status_to_proto,
)
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.records import (
    BestRecord,
    CandidateRecord,
    DecisionRecord,
    Fingerprint,
    HistoryStep,
    JobRecord,
    Registration,
    TunerStatusRecord,
)
from autobyte.types import (
    MAX_CREDIT_BYTES,
    MAX_PARTITION_BYTES,
    MAX_PREFETCH,
    MAX_TAIL_BYTES,
    MIN_CREDIT_BYTES,
    MIN_PARTITION_BYTES,
    MIN_TAIL_BYTES,
    NO_LIMIT_BYTES,
    Config,
    StepMetrics,
    config_from_ints,
    config_to_ints,
)
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers.paths import ROOT


def test_generated_code_is_fresh():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_stale_check_detects_an_edit(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    committed = tmp_path / "autobyte" / "protocol"
    committed.mkdir(parents=True)
    for path in (ROOT / "client" / "autobyte" / "protocol").glob("*_pb2*"):
        (committed / path.name).write_text(path.read_text())
    monkeypatch.setattr(gen, "SOURCE_ROOT", tmp_path)
    assert gen.main(["--check"]) == 0
    stale = committed / "autobyte_pb2.py"
    stale.write_text(stale.read_text() + "\n# hand edit\n")
    assert gen.main(["--check"]) == 1


scheduler_configs = st.builds(
    Config,
    st.one_of(st.none(), st.integers(MIN_PARTITION_BYTES, MAX_PARTITION_BYTES)),
    st.one_of(st.none(), st.integers(MIN_CREDIT_BYTES, MAX_CREDIT_BYTES)),
    st.one_of(st.none(), st.integers(MIN_TAIL_BYTES, MAX_TAIL_BYTES)),
)
fsdp_configs = st.builds(
    Config,
    forward_prefetch=st.one_of(st.none(), st.integers(0, MAX_PREFETCH)),
    backward_prefetch=st.one_of(st.none(), st.integers(1, MAX_PREFETCH)),
    reshard_after_forward=st.one_of(st.none(), st.booleans()),
)
configs = st.one_of(scheduler_configs, fsdp_configs)
floats = st.floats(0, 1e6, allow_nan=False)


@given(configs)
def test_config_round_trip(config):
    assert config_from_proto(config_to_proto(config)) == config


@given(scheduler_configs)
def test_config_int_encoding_round_trip(config):
    """The one None <-> -1 encoding (order-channel frames, the native engine)."""
    encoded = config_to_ints(config)
    assert all(type(value) is int for value in encoded)
    assert (encoded[0] == NO_LIMIT_BYTES) == (config.partition_bytes is None)
    assert (encoded[1] == NO_LIMIT_BYTES) == (config.credit_bytes is None)
    assert (encoded[2] == NO_LIMIT_BYTES) == (config.tail_bytes is None)
    assert config_from_ints(*encoded) == config


def test_a_config_without_a_tail_window_is_the_message_an_old_peer_sends_and_reads():
    """tail_bytes is optional on the wire: a configuration without it encodes to the same bytes as
    before the field existed, and a message without it reads as no tail window."""
    old = pb.Config(partition_bytes=4 << 20, credit_bytes=16 << 20)
    assert config_to_proto(Config(4 << 20, 16 << 20)).SerializeToString() == old.SerializeToString()
    assert (
        config_from_proto(old) == Config(4 << 20, 16 << 20)
        and config_from_proto(old).tail_bytes is None
    )
    assert Config(4 << 20, 16 << 20).to_dict() == {
        "partition_bytes": 4 << 20,
        "credit_bytes": 16 << 20,
    }
    with_tail = Config(1 << 20, 4 << 20, 8 << 20)
    assert config_from_proto(config_to_proto(with_tail)) == with_tail
    assert with_tail.to_dict()["tail_bytes"] == 8 << 20
    assert with_tail.short() == "1MiB/4MiB tail 8MiB"
    assert "tail=8MiB" in with_tail.describe()


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8MiB", True, MIN_TAIL_BYTES - 1, MAX_TAIL_BYTES + 1])
def test_config_rejects_bad_tail_windows(bad):
    with pytest.raises(ValueError, match="tail_bytes"):
        Config(4 << 20, 16 << 20, bad)
    if isinstance(bad, int) and not isinstance(bad, bool):  # what a peer can put on the wire
        with pytest.raises(ValueError, match="tail_bytes"):
            config_from_proto(pb.Config(tail_bytes=bad))


@given(
    st.integers(1, 2**40),
    st.builds(
        StepMetrics,
        step=st.integers(0, 2**40),
        wall_time_s=floats,
        step_time_s=floats,
        exposed_comm_s=floats,
        bytes_reduced=st.integers(0, 2**50),
        partitions=st.integers(0, 2**30),
        config=configs,
        decision_id=st.integers(0, 2**40),
        host_load=st.floats(0, 1),
    ),
)
def test_metrics_round_trip(seq, metrics):
    assert metrics_from_proto(metrics_to_proto(metrics, seq)) == (seq, metrics)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4MiB", True, 1 << 40, MIN_PARTITION_BYTES - 1])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="partition_bytes"):
        Config(partition_bytes=bad)


# ---------------------------------------------------------------- the daemon's values <-> messages
optional_floats = st.one_of(st.none(), floats)
texts = st.text(max_size=20)
decisions = st.builds(
    DecisionRecord,
    decision_id=st.integers(1, 2**40),
    job=texts,
    config=configs,
    apply_at_step=st.integers(0, 2**40),
    reason=texts,
    created_at_s=floats,
    state=st.sampled_from(["pending", "applied", "superseded", "expired", "recommended"]),
    predicted_step_time_s=optional_floats,
    measured_step_time_s=optional_floats,
    applied_at_step=st.one_of(st.none(), st.integers(0, 2**40)),
    source=st.sampled_from(["operator", "tuner"]),
)
tuner_states = st.builds(
    TunerStatusRecord,
    mode=texts,
    state=texts,
    detail=texts,
    config=configs,
    baseline_step_time_s=floats,
    measured_step_time_s=floats,
    predicted_step_time_s=floats,
    trials_done=st.integers(0, 1000),
    trials_planned=st.integers(0, 1000),
    paused=st.booleans(),
    updated_at_s=floats,
)


@given(decisions)
def test_decision_round_trip(record):
    assert decision_from_proto(decision_to_proto(record)) == record


def test_decision_unset_optionals_read_as_none():
    record = decision_from_proto(pb.Decision(decision_id=3, job="j", predicted_step_time_s=0.0))
    assert record.predicted_step_time_s == 0.0  # set to zero is not unset
    assert record.measured_step_time_s is None and record.applied_at_step is None
    assert record.source == "operator" and record.config == Config()


@given(decisions)
def test_config_update_carries_the_decision(record):
    update = config_update_to_proto(record)
    assert (update.job, update.decision_id, update.apply_at_step, update.reason) == (
        record.job,
        record.decision_id,
        record.apply_at_step,
        record.reason,
    )
    assert config_from_proto(update.config) == record.config


@given(tuner_states, st.booleans())
def test_tuner_status_round_trip(record, known):
    message = tuner_status_to_proto(record, known=known)
    assert message.known == known and message.HasField("config")
    assert tuner_status_from_proto(message) == record
    assert not tuner_status_to_proto(record, with_config=False).HasField("config")


@given(
    st.builds(
        JobRecord,
        job=texts,
        state=st.sampled_from(["running", "idle", "finished"]),
        world_size=st.integers(1, 64),
        backend=texts,
        steps=st.integers(0, 2**40),
        config=configs,
        ranks=st.lists(st.integers(0, 63), max_size=8).map(tuple),
        recent_step_time_s=floats,
        last_seen_s=floats,
        dropped_total=st.integers(0, 2**40),
        last_decision=st.one_of(st.none(), decisions),
        tuner=tuner_states,
    ),
    st.booleans(),
)
def test_job_status_round_trip(job, known):
    message = job_status_to_proto(job, tuner_status_to_proto(job.tuner, known=known))
    assert message.has_last_decision == (job.last_decision is not None)
    assert message.recent_steps_per_s == (
        1.0 / job.recent_step_time_s if job.recent_step_time_s else 0.0
    )
    assert job_status_from_proto(message) == job


history_steps = st.builds(
    HistoryStep,
    step=st.integers(0, 2**40),
    rank=st.integers(0, 64),
    wall_time_s=floats,
    step_time_s=floats,
    exposed_comm_s=floats,
    bytes_reduced=st.integers(0, 2**50),
    config=configs,
)


@given(st.lists(history_steps, max_size=5), st.lists(decisions, max_size=3))
def test_history_round_trip(steps, records):
    message = history_to_proto("job-a", steps, records)
    assert message.job == "job-a"
    assert [history_step_from_proto(s) for s in message.steps] == steps
    assert [decision_from_proto(d) for d in message.decisions] == records


@given(
    st.builds(
        BestRecord,
        job=texts,
        found=st.booleans(),
        config=configs,
        median_step_time_s=floats,
        samples=st.integers(0, 2**40),
        baseline_step_time_s=floats,
        evidence=texts,
        candidates=st.lists(
            st.builds(
                CandidateRecord,
                config=configs,
                median_step_time_s=floats,
                samples=st.integers(0, 2**40),
            ),
            max_size=4,
        ).map(tuple),
    )
)
def test_best_round_trip(best):
    assert best_from_proto(best_to_proto(best)) == best


@given(
    st.builds(
        Fingerprint,
        parameter_count=st.integers(0, 2**40),
        parameter_bytes=st.integers(0, 2**50),
        tensor_count=st.integers(0, 2**30),
        largest_tensor_bytes=st.integers(0, 2**40),
        median_tensor_bytes=st.integers(0, 2**40),
        digest=texts,
    )
)
def test_fingerprint_round_trip(fingerprint):
    assert fingerprint_from_proto(fingerprint_to_proto(fingerprint)) == fingerprint


def test_registration_from_request():
    fingerprint = Fingerprint(10, 40, 2, 32, 8, "abc")
    request = pb.RegisterRequest(
        job="j",
        rank=1,
        world_size=2,
        model=fingerprint_to_proto(fingerprint),
        config=config_to_proto(Config(4096, None)),
        hostname="h",
        pid=7,
        instance_id="i",
        tuning_disabled=True,
    )
    assert registration_from_proto(request) == Registration(
        job="j",
        rank=1,
        world_size=2,
        backend="unknown",
        instance_id="i",
        fingerprint=fingerprint,
        config=Config(4096, None),
        hostname="h",
        pid=7,
        tuning_disabled=True,
    )
    with pytest.raises(ValueError, match="partition_bytes"):
        registration_from_proto(pb.RegisterRequest(job="j", config=pb.Config(partition_bytes=1)))


def test_a_job_registers_its_engine_and_configurations_of_its_engine_only():
    """An old client's registration (no engine) is the scheduler's; FSDP2's knobs travel as
    optional fields; a configuration never mixes the engines' knobs, on the wire or in code."""
    assert registration_from_proto(pb.RegisterRequest(job="j")).engine == "scheduler"
    fsdp = Config(forward_prefetch=0, backward_prefetch=2, reshard_after_forward=False)
    request = pb.RegisterRequest(job="j", engine="fsdp2", config=config_to_proto(fsdp))
    assert registration_from_proto(request).config == fsdp
    assert config_to_proto(fsdp).HasField("reshard_after_forward")  # False is not "as set"
    assert fsdp.short() == "prefetch 0/2 keep" and Config(backward_prefetch=1).short() == (
        "prefetch =/1"
    )
    assert fsdp.to_dict() == {
        "partition_bytes": None,
        "credit_bytes": None,
        "forward_prefetch": 0,
        "backward_prefetch": 2,
        "reshard_after_forward": False,
    }
    with pytest.raises(ValueError, match="this job runs fsdp2"):
        registration_from_proto(
            pb.RegisterRequest(job="j", engine="fsdp2", config=pb.Config(partition_bytes=4096))
        )
    with pytest.raises(ValueError, match="engine 'ddp' is not one of scheduler, fsdp2"):
        registration_from_proto(pb.RegisterRequest(job="j", engine="ddp"))
    with pytest.raises(ValueError, match="mixes the scheduler's"):
        config_from_proto(pb.Config(credit_bytes=4096, forward_prefetch=1))
    for bad in (-1, 9):
        with pytest.raises(ValueError, match="forward_prefetch"):
            config_from_proto(pb.Config(forward_prefetch=bad))
    with pytest.raises(ValueError, match="backward_prefetch"):
        Config(backward_prefetch=0)
    with pytest.raises(ValueError, match="reshard_after_forward"):
        Config(reshard_after_forward="yes")
