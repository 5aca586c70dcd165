"""What the CLI says about finished jobs, resumes, sizes,
history and the tuner's status text (real daemons on real SQLite files)."""

import csv
import io
import json

import grpc
import pytest
from autobyte.cli import tuner_line
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.types import format_bytes, parse_bytes

from autobyted.storage.records import tuner_lease
from tests.helpers.cli import run_cli
from tests.helpers.daemon import ThreadDaemon
from tests.helpers.rpc import Client, batch, sample
from tests.helpers.wait import wait_for


def test_sizes_say_which_unit_is_which():
    """4MB is 10^6-based, 4MiB (and 4M) 2^20-based; a size is shown exactly (binary units first)."""
    assert parse_bytes("4MB") == 4_000_000 and parse_bytes("4mb") == 4_000_000
    assert parse_bytes("4MiB") == parse_bytes("4M") == 4 << 20
    assert parse_bytes("256KB") == 256_000 and parse_bytes("256KiB") == 256 << 10
    assert parse_bytes("1GB") == 10**9 and parse_bytes("1GiB") == 1 << 30
    assert format_bytes(4_000_000) == "4MB" and format_bytes(4 << 20) == "4MiB"
    assert (
        format_bytes(300_000) == "300KB"
        and format_bytes(256_000) == "250KiB"
        and format_bytes(3 * (1 << 20) + 1) == "3.0MiB"
    )
    help_text = run_cli("propose", "--help").stdout
    assert "KB/MB/GB powers of 10" in " ".join(help_text.split()), help_text


def test_propose_in_mb_is_stored_as_powers_of_ten(thread_daemon):
    client = Client(thread_daemon.address)
    client.register(job="sized")
    client.close()
    result = run_cli(
        "propose",
        "sized",
        "--partition",
        "4MB",
        "--credit",
        "16MiB",
        "--daemon",
        thread_daemon.address,
    )
    assert result.returncode == 0, result.stderr
    assert "partition=4MB credit=16MiB" in result.stdout, result.stdout
    (decision,) = json.loads(
        run_cli("history", "sized", "--format", "json", "--daemon", thread_daemon.address).stdout
    )["decisions"]
    assert decision["config"] == {"partition_bytes": 4_000_000, "credit_bytes": 16 << 20}


def test_propose_to_a_finished_job_is_refused(thread_daemon):
    """A job whose every rank sent its last batch would never apply a decision: refused, saying so."""
    client = Client(thread_daemon.address)
    sessions = [
        client.register(job="done", rank=rank, instance=f"i-{rank}").session_id for rank in (0, 1)
    ]
    for rank, session in enumerate(sessions):
        finished = batch(session, range(1, 11), job="done", rank=rank)
        finished.final = True
        client.stream([finished])
    proposal = pb.ProposeConfigRequest(job="done", config=pb.Config(partition_bytes=1 << 20))
    with pytest.raises(grpc.RpcError) as refused:
        client.control.ProposeConfig(proposal, timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "job 'done' finished" in refused.value.details()
    client.close()
    result = run_cli(
        "propose",
        "done",
        "--partition",
        "1MiB",
        "--credit",
        "4MiB",
        "--daemon",
        thread_daemon.address,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert "job 'done' finished" in result.stderr and "FAILED_PRECONDITION" in result.stderr
    assert "Traceback" not in result.stderr
    history = json.loads(
        run_cli("history", "done", "--format", "json", "--daemon", thread_daemon.address).stdout
    )
    assert history["decisions"] == []  # nothing pending forever
    status = json.loads(
        run_cli("status", "--format", "json", "--daemon", thread_daemon.address).stdout
    )
    assert (
        status["jobs"][0]["state"] == "finished" and status["jobs"][0]["tuner"]["paused"] is False
    )


def _tuner_status(address: str, job: str) -> dict:
    data = json.loads(run_cli("status", "--format", "json", "--daemon", address).stdout)
    return next(j for j in data["jobs"] if j["job"] == job)["tuner"]


def _wait_for(predicate, timeout_s: float = 60.0, show=lambda: ""):
    return wait_for(predicate, timeout_s, "the tuner's state", show)


def test_resume_says_what_comes_next_not_the_old_pause(db_url):
    """After `tune --resume` neither the CLI's answer nor `status` repeats the pause's reason, and a
    tuner that has not seen the job's configuration yet (a daemon restarted while the job was paused)
    does not claim to measure none/inf."""
    first = ThreadDaemon(db_url, tuner="auto").start()
    try:
        client = Client(first.address)
        session = client.register(job="paused-job").session_id
        config = pb.Config(partition_bytes=4 << 20, credit_bytes=16 << 20)
        client.stream(
            [
                pb.MetricsBatch(
                    job="paused-job",
                    rank=0,
                    session_id=session,
                    samples=[sample(seq, step_time_s=0.1, config=config) for seq in range(1, 41)],
                )
            ]
        )
        client.close()
        proposed = run_cli(
            "propose",
            "paused-job",
            "--partition",
            "1MiB",
            "--credit",
            "4MiB",
            "--daemon",
            first.address,
        )
        assert proposed.returncode == 0, proposed.stderr
        _wait_for(lambda: _tuner_status(first.address, "paused-job")["detail"].startswith("paused"))
    finally:
        first.stop()
    second = ThreadDaemon(db_url, tuner="auto").start()  # opens the job at its newest step, paused
    try:
        address = second.address
        storage = second.storage()

        def opened_paused() -> bool:  # this daemon's tuner holds the job, and found it paused
            lease = storage.lease(tuner_lease("paused-job"))
            return (
                lease is not None
                and lease.holder == second.daemon.daemon_id
                and _tuner_status(address, "paused-job")["state"] == "paused"
            )

        _wait_for(
            opened_paused,
            show=lambda: (
                storage.lease(tuner_lease("paused-job")),
                _tuner_status(address, "paused-job"),
            ),
        )
        resumed = run_cli("tune", "paused-job", "--resume", "--daemon", address)
        assert resumed.returncode == 0, resumed.stderr
        assert "tuner resumed" in resumed.stdout and "paused:" not in resumed.stdout, resumed.stdout
        after = _wait_for(
            lambda: (
                t
                if (t := _tuner_status(address, "paused-job"))["detail"].startswith("resumed")
                else None
            ),
            show=lambda: _tuner_status(address, "paused-job"),
        )
        assert after["paused"] is False
        assert (
            "none/inf" not in after["detail"] and "the configuration in effect" in after["detail"]
        ), after
        table = run_cli("status", "--daemon", address).stdout
        assert "paused:" not in table and "none/inf" not in table.split("tuner:")[1], table
    finally:
        second.stop()


def test_history_shows_decisions_first_and_steps_on_request(db_url):
    # the tuner off: with 30 steps stored it may decide a trial of its own before the operator's
    # proposal pauses it, and this test counts the decisions it made itself
    thread_daemon = ThreadDaemon(db_url, tuner="off").start()
    try:
        _history_shows_decisions_first(thread_daemon)
    finally:
        thread_daemon.stop()


def _history_shows_decisions_first(thread_daemon) -> None:
    client = Client(thread_daemon.address)
    session = client.register(job="h").session_id
    client.stream([batch(session, range(1, 31), job="h")])
    proposal = pb.ProposeConfigRequest(
        job="h", config=pb.Config(partition_bytes=1 << 20), reason="try 1MiB"
    )
    decision = client.control.ProposeConfig(proposal, timeout=10)
    client.close()
    address = ("--daemon", thread_daemon.address)

    table = run_cli("history", "h", *address)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == "h: 1 decision(s), oldest first; its steps: `autobyte history h --steps`"
    assert lines[1].split() == ["DECISION", "ASKED", "APPLIED", "PART/CREDIT", "STATE"]
    assert lines[2].startswith(f"#{decision.decision_id}") and "reason: try 1MiB" in table.stdout
    assert "STEP_MS" not in table.stdout

    with_steps = run_cli("history", "h", "--steps", "--limit", "5", *address).stdout.splitlines()
    header = next(i for i, line in enumerate(with_steps) if line.startswith("STEP "))
    assert header > 2 and with_steps[1].startswith("DECISION")  # decisions, then steps
    assert [line.split()[0] for line in with_steps[header + 1 :]] == ["25", "26", "27", "28", "29"]

    as_json = json.loads(run_cli("history", "h", "--format", "json", *address).stdout)
    assert set(as_json) == {"job", "decisions"} and as_json["decisions"][0]["reason"] == "try 1MiB"
    as_json = json.loads(run_cli("history", "h", "--format", "json", "--steps", *address).stdout)
    assert list(as_json) == ["job", "decisions", "steps"] and len(as_json["steps"]) == 30

    rows = list(
        csv.DictReader(io.StringIO(run_cli("history", "h", "--format", "csv", *address).stdout))
    )
    assert [row["kind"] for row in rows] == ["decision"]
    rows = list(
        csv.DictReader(
            io.StringIO(run_cli("history", "h", "--format", "csv", "--steps", *address).stdout)
        )
    )
    assert [row["kind"] for row in rows] == ["decision"] + ["step"] * 30


def test_tuner_status_text_is_wrapped_never_cut():
    detail = (
        "holding 16MiB/64MiB: measured 1.31x faster than 64KiB/64KiB "
        "(after bandwidth drop during the search, host load rise)"
    )
    lines = tuner_line(pb.TunerStatus(state="holding", detail=detail)).splitlines()
    assert len(lines) == 2 and all(len(line) <= 80 for line in lines), lines
    assert lines[0].startswith("  tuner: holding") and lines[1].startswith("    ")
    assert " ".join(line.strip() for line in lines) == f"tuner: {detail}"


def test_every_printed_job_id_is_taken_back_whole_or_by_a_unique_prefix(thread_daemon):
    """`status` prints a 36-character id whole within 80 columns; every command takes it back, or a
    prefix of it that starts no other job (as git does); an ambiguous prefix lists the candidates."""
    long_ids = ["0b5e6c7a-1d2e-4f3a-9b8c-7d6e5f4a3b2c", "0b5e6c7a-ffff-4f3a-9b8c-7d6e5f4a3b2c"]
    client = Client(thread_daemon.address)
    for job in long_ids:
        session = client.register(job=job).session_id
        client.stream(
            [
                pb.MetricsBatch(
                    job=job,
                    rank=0,
                    session_id=session,
                    samples=[sample(s, step_time_s=0.05) for s in range(1, 6)],
                )
            ]
        )
    client.close()
    address = ("--daemon", thread_daemon.address)
    table = run_cli("status", *address).stdout
    assert all(job in table.splitlines() for job in long_ids), table  # whole, on a line of its own
    assert max(len(line) for line in table.splitlines()) <= 80, table
    for command in (["history"], ["best"], ["tune", "--pause"]):
        whole = run_cli(command[0], long_ids[1], *command[1:], *address)
        assert whole.returncode == 0, whole.stderr
        prefix = run_cli(command[0], "0b5e6c7a-f", *command[1:], *address)
        assert prefix.returncode == 0 and long_ids[1] in prefix.stdout, prefix.stderr
        ambiguous = run_cli(command[0], "0b5e", *command[1:], *address)
        assert ambiguous.returncode == 2 and "ambiguous" in ambiguous.stderr, ambiguous.stderr
        assert all(job in ambiguous.stderr for job in long_ids)


def test_a_finished_job_leaves_no_decision_pending_and_its_tuner_says_finished(db_url):
    """The tuner's trial decision is pending when the job ends: every rank's goodbye expires it (stored:
    a daemon restarted on the same database shows it so), and the tuner's line says finished."""
    daemon = ThreadDaemon(db_url, tuner="auto").start()
    try:
        client = Client(daemon.address)
        session = client.register(job="ends").session_id
        samples = [
            sample(
                seq,
                step_time_s=0.1,
                bandwidth_bytes_per_s=1e8,
                config=pb.Config(partition_bytes=4 << 20, credit_bytes=16 << 20),
            )
            for seq in range(1, 61)
        ]
        client.stream([pb.MetricsBatch(job="ends", rank=0, session_id=session, samples=samples)])
        wait_for(
            lambda: (
                client.query.History(pb.HistoryRequest(job="ends", limit=1), timeout=10).decisions
            ),
            30,
            "the tuner's first decision",
        )
        assert (
            client.query.History(pb.HistoryRequest(job="ends", limit=1), timeout=10)
            .decisions[-1]
            .state
            == "pending"
        )
        client.stream([pb.MetricsBatch(job="ends", rank=0, session_id=session, final=True)])
        tuner = _wait_for(
            lambda: (t := _tuner_status(daemon.address, "ends"))["state"] == "finished" and t,
            show=lambda: _tuner_status(daemon.address, "ends"),
        )
        assert tuner["detail"].startswith("finished: every rank ended"), tuner
        client.close()
    finally:
        daemon.stop()
    restarted = ThreadDaemon(db_url, tuner="auto").start()
    try:
        states = [
            d["state"]
            for d in json.loads(
                run_cli("history", "ends", "--format", "json", "--daemon", restarted.address).stdout
            )["decisions"]
        ]
        assert states and "pending" not in states and states[-1] == "expired", states
        table = run_cli("status", "--daemon", restarted.address).stdout
        assert "tuner: finished" in table and "idle: no steps" not in table, table
    finally:
        restarted.stop()


def test_history_folds_the_ranks_of_a_step_and_names_the_one_whose_compute_lags(db_url):
    """At 8 ranks `history --steps` is one row per step, not eight: the slowest step time, the
    spread of the exposed communication, and the rank whose compute lags (here rank 5, 1.5x)."""
    thread_daemon = ThreadDaemon(db_url, tuner="off").start()
    try:
        client = Client(thread_daemon.address)
        for rank in range(8):
            session = client.register(
                job="wide", rank=rank, world_size=8, instance=f"i-{rank}"
            ).session_id
            slow = rank == 5
            client.stream(
                [
                    batch(
                        session,
                        range(1, 4),
                        job="wide",
                        rank=rank,
                        backward_s=0.03 if slow else 0.02,
                        exposed_comm_s=0.001 if slow else 0.011,
                    )
                ]
            )
        client.close()
        address = ("--daemon", thread_daemon.address)
        out = run_cli("history", "wide", "--steps", *address)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("STEP "))
        assert lines[header].split() == [
            "STEP", "RANKS", "TIME", "STEP_MS", "EXPOSED_MS", "SLOWEST", "PART/CREDIT",
        ]  # fmt: skip
        rows = [line.split() for line in lines[header + 1 :]]
        assert [row[0] for row in rows] == ["0", "1", "2"]
        assert all(row[1] == "8" and row[4] == "1.0-11.0" for row in rows), rows
        assert all(row[5:8] == ["rank", "5", "+33%"] for row in rows), rows
        # one rank's own records, as before
        one = run_cli("history", "wide", "--steps", "--rank", "5", *address).stdout
        assert "RANK " in one and "SLOWEST" not in one
    finally:
        thread_daemon.stop()
