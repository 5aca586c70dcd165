"""The CLI against an unreachable daemon, against bad input, and what its tables show."""

import csv
import io
import json
import re

import pytest
from autobyte.protocol import autobyte_pb2 as pb

from devtools.ports import free_port
from tests.helpers.cli import run_cli
from tests.helpers.listeners import foreign_grpc_server, http1_server, http2_404_server
from tests.helpers.rpc import Client, batch, sample


@pytest.mark.parametrize("command", [["status"], ["history", "job-1"], ["best", "job-1"]])
def test_unreachable_daemon_is_one_line(command):
    result = run_cli(*command, "--daemon", f"127.0.0.1:{free_port()}")
    assert result.returncode == 3
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach autobyted" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_daemon_address_from_environment():
    port = free_port()
    result = run_cli("status", env={"AUTOBYTE_DAEMON": f"127.0.0.1:{port}"})
    assert result.returncode == 3 and f"127.0.0.1:{port}" in result.stderr


def test_a_list_of_daemons_is_asked_in_order_until_one_answers(thread_daemon):
    dead = f"127.0.0.1:{free_port()}"
    result = run_cli("status", "--format", "json", "--daemon", f"{dead}, {thread_daemon.address}")
    assert result.returncode == 0 and json.loads(result.stdout)["jobs"] == [], result.stderr
    both_dead = run_cli("status", env={"AUTOBYTE_DAEMON": f"{dead},127.0.0.1:{free_port()}"})
    assert (
        both_dead.returncode == 3
        and dead in both_dead.stderr
        and len(both_dead.stderr.splitlines()) == 1
    )
    malformed = run_cli("status", "--daemon", f"{thread_daemon.address},nohost")
    assert malformed.returncode == 2 and "'nohost' must look like HOST:PORT" in malformed.stderr


@pytest.mark.parametrize(
    "address, problem",
    [
        ("localhost:99999", "port 99999 is out of range (a port is 1 to 65535)"),
        ("localhost:0", "port 0 is out of range (a port is 1 to 65535)"),
        (
            "localhost:http",
            "must look like HOST:PORT, e.g. 127.0.0.1:7077 (its port 'http' is not a number)",
        ),
        ("localhost", "must look like HOST:PORT, e.g. 127.0.0.1:7077 (it has no port)"),
        (":7077", "must look like HOST:PORT, e.g. 127.0.0.1:7077 (it has no host)"),
    ],
)
def test_a_bad_daemon_address_says_what_is_wrong_with_it(address, problem):
    result = run_cli("status", "--daemon", address)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"autobyte: daemon address {address!r}: {problem}\n" or (
        result.stderr == f"autobyte: daemon address {address!r} {problem}\n"
    ), result.stderr
    if "out of range" in problem:
        assert "must look like" not in result.stderr  # it does look like HOST:PORT


@pytest.mark.parametrize(
    "listener, why",
    [
        # the issue's case: an HTTP/2 server that answers 404 (gRPC said "Received http2 header
        # with status: 404 [UNIMPLEMENTED]", exit 1, no address)
        (http2_404_server, "it speaks HTTP/2 but not gRPC (it answered HTTP status 404)"),
        (
            foreign_grpc_server,
            "it does not serve autobyte's Query.Status (Method not found! [UNIMPLEMENTED])",
        ),
        (http1_server, "it does not speak HTTP/2, as a gRPC server does (an HTTP/1.x server?)"),
    ],
)
@pytest.mark.parametrize("command", [["status"], ["history", "job-1"], ["best", "job-1"]])
def test_a_service_that_is_not_autobyted_is_named_as_such(listener, why, command):
    with listener() as address:
        result = run_cli(*command, "--daemon", address)
    assert result.returncode == 3 and result.stdout == "", result.stderr
    assert result.stderr == (
        f"autobyte: the service at {address} is not autobyted: {why}; "
        "set --daemon / AUTOBYTE_DAEMON to autobyted's HOST:PORT\n"
    )


def test_after_a_service_that_is_not_autobyted_the_next_daemon_is_asked(thread_daemon):
    dead = f"127.0.0.1:{free_port()}"
    with foreign_grpc_server() as foreign:
        answered = run_cli(
            "status", "--format", "json", "--daemon", f"{foreign},{thread_daemon.address}"
        )
        none_answered = run_cli("status", "--daemon", f"{foreign},{dead}")
    assert answered.returncode == 0 and json.loads(answered.stdout)["jobs"] == [], answered.stderr
    assert none_answered.returncode == 3 and len(none_answered.stderr.splitlines()) == 1
    assert none_answered.stderr.startswith(
        f"autobyte: the service at {foreign} is not autobyted: it does not serve autobyte's "
    )
    assert (
        f"; cannot reach autobyted at {dead} (unavailable); is it running?" in none_answered.stderr
    )


def test_unknown_job_is_a_clear_error(thread_daemon):
    result = run_cli("history", "nope", "--daemon", thread_daemon.address)
    assert result.returncode == 1
    assert "unknown job 'nope'" in result.stderr and "NOT_FOUND" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["propose", "job", "--partition", "0", "--credit", "1MiB"], "positive byte size"),
        # The CLI spells the special sizes none/unlimited, and so must its errors.
        (
            ["propose", "job", "--partition", "1e30", "--credit", "1MiB"],
            "use none for no partitioning",
        ),
        (
            ["propose", "job", "--partition", "1MiB", "--credit", "1e30"],
            "use unlimited for unlimited credit",
        ),
        (
            ["propose", "job", "--partition", "1MiB", "--credit", "4MiB", "--tail", "1e30"],
            "use none for no tail window",
        ),
        (
            [
                "propose",
                "job",
                "--partition",
                "1MiB",
                "--credit",
                "4MiB",
                "--forward-prefetch",
                "2",
            ],
            "not both",
        ),
        (["propose", "job", "--credit", "4MiB"], "give --partition and --credit"),
        (["propose", "job", "--forward-prefetch", "9"], "0<=x<=8"),
        (["history", "job", "--rank", "-1"], "--rank"),  # item 8: a negative rank is refused
        (["status", "--no-such-flag"], "No such option"),
        (["frobnicate"], "No such command"),
    ],
)
def test_usage_errors_have_their_own_exit_code(thread_daemon, args, message):
    """A usage error (2) is never mistaken for 'cannot reach the daemon' (3)."""
    result = run_cli(*args, "--daemon", thread_daemon.address)
    assert result.returncode == 2, result.stderr
    assert (
        message in result.stderr
        and "None" not in result.stderr
        and "Traceback" not in result.stderr
    )


def test_an_fsdp2_jobs_knobs_are_proposed_shown_and_kept_apart(thread_daemon, tmp_path):
    """`propose` sets FSDP2's knobs on an FSDP2 job (autobyte.fsdp), refuses the scheduler's there
    with the daemon's reason, and status and history show the knobs."""
    client = Client(thread_daemon.address)
    session = client.register(job="sharded", engine="fsdp2").session_id
    client.stream([pb.MetricsBatch(job="sharded", rank=0, session_id=session, samples=[sample(1)])])
    client.close()
    address = ("--daemon", thread_daemon.address)
    proposed = run_cli("propose", "sharded", "--forward-prefetch", "2", "--keep-gathered", *address)
    assert proposed.returncode == 0, proposed.stderr
    assert "forward_prefetch=2 backward_prefetch=as set reshard_after_forward=False" in (
        proposed.stdout
    )
    refused = run_cli("propose", "sharded", "--partition", "1MiB", "--credit", "4MiB", *address)
    assert refused.returncode == 1 and "this job runs fsdp2" in refused.stderr, refused.stderr
    status = json.loads(run_cli("status", "--format", "json", *address).stdout)
    (job,) = status["jobs"]
    assert job["engine"] == "fsdp2" and "no tuner" not in job["tuner"]["detail"], job["tuner"]
    history = run_cli("history", "sharded", "--format", "csv", *address)
    assert history.returncode == 0, history.stderr
    (row,) = csv.DictReader(io.StringIO(history.stdout))
    assert (row["forward_prefetch"], row["reshard_after_forward"]) == ("2", "False")
    table = run_cli("history", "sharded", "--steps", *address)
    assert "prefetch 2/= keep" in table.stdout, table.stdout
    # its steps ran as the script set FSDP2 up: that reads so, not as the scheduler's none/inf
    assert "prefetch =/=" in table.stdout and "none/inf" not in table.stdout, table.stdout
    status_table = run_cli("status", *address).stdout
    assert "prefetch =/=" in status_table and "none/inf" not in status_table, status_table
    drawn = run_cli("plot", "sharded", "--out", str(tmp_path / "sharded.png"), *address)
    assert drawn.returncode == 0 and (tmp_path / "sharded.png").stat().st_size > 0, drawn.stderr


def test_best_says_when_the_reference_ran_only_in_the_warm_up(thread_daemon):
    """The context's first configuration ran only in the warm-up: best names the fastest one
    measured past it and says the reference was not measured, instead of failing."""
    client = Client(thread_daemon.address)
    session = client.register().session_id
    samples = [sample(s, step_time_s=0.05) for s in range(1, 21)]
    for s in samples[8:]:
        s.config.partition_bytes, s.step_time_s = 1 << 20, 0.04
    client.stream([pb.MetricsBatch(job="job", rank=0, session_id=session, samples=samples)])
    client.close()
    best = run_cli("best", "job", "--daemon", thread_daemon.address)
    assert best.returncode == 0 and "Traceback" not in best.stderr, best.stderr
    assert "job: partition=1MiB" in best.stdout
    assert "none/inf not measured past the warm-up in this context" in best.stdout, best.stdout


@pytest.fixture
def quiet_daemon(db_url):
    """A daemon whose tuner is off: every decision in its history is the test's own (an `auto`
    tuner may decide on the test's samples between the test's steps)."""
    from tests.helpers.daemon import ThreadDaemon

    daemon = ThreadDaemon(db_url, tuner="off").start()
    yield daemon
    daemon.stop()


def test_history_and_best_agree_with_themselves(quiet_daemon):
    """The table shows the step a decision was applied at, the CSV carries it, reasons
    are whole, and `best` shows every configuration it compared and says when the baseline is missing."""
    thread_daemon = quiet_daemon
    client = Client(thread_daemon.address)
    session = client.register().session_id
    # past the tuner's warm-up (10 steps): 5 steps of the baseline, 15 of 1 MiB partitions
    samples = [sample(s, step_time_s=0.05) for s in range(1, 31)]
    for s in samples[15:]:
        s.config.partition_bytes, s.step_time_s = 1 << 20, 0.04
    client.stream([pb.MetricsBatch(job="job", rank=0, session_id=session, samples=samples)])
    reason = "operator switches to 1MiB partitions because the link got slower; " * 3
    proposal = pb.ProposeConfigRequest(job="job", apply_at_step=0, reason=reason.strip())
    proposal.config.partition_bytes = 1 << 20
    decision = client.control.ProposeConfig(proposal, timeout=5)
    client.control.ReportConfig(
        pb.ReportConfigRequest(
            job="job",
            rank=0,
            decision_id=decision.decision_id,
            applied_at_step=51,
            config=proposal.config,
        ),
        timeout=5,
    )
    client.close()

    table = run_cli("history", "job", "--daemon", thread_daemon.address)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), table.stdout
    header = next(i for i, line in enumerate(lines) if line.startswith("DECISION"))
    assert lines[header].split() == ["DECISION", "ASKED", "APPLIED", "PART/CREDIT", "STATE"]
    assert lines[header + 1].split()[:3] == [f"#{decision.decision_id}", "next", "51"]
    assert lines[header + 2].strip().startswith("by operator; step time predicted -, measured")
    # the reason's lines, up to the next decision's row, if any
    reason_lines = []
    for line in lines[header + 3 :]:
        if line.strip().startswith("#"):
            break
        reason_lines.append(line.strip())
    shown_reason = " ".join(reason_lines).removeprefix("reason: ")
    assert shown_reason == reason.strip()

    rows = list(
        csv.DictReader(
            io.StringIO(
                run_cli(
                    "history",
                    "job",
                    "--daemon",
                    thread_daemon.address,
                    "--format",
                    "csv",
                    "--steps",
                ).stdout
            )
        )
    )
    (decision_row,) = [row for row in rows if row["kind"] == "decision"]
    assert decision_row["applied_at_step"] == "51" and decision_row["reason"] == reason.strip()
    assert all(row["applied_at_step"] == "" for row in rows if row["kind"] == "step")

    best = run_cli("best", "job", "--daemon", thread_daemon.address)
    assert best.returncode == 0, best.stderr
    assert "2 configuration(s) compared" in best.stdout
    assert "none/inf" in best.stdout and "1MiB/inf" in best.stdout  # both compared ones are shown
    assert "no-scheduling baseline" in best.stdout
    as_json = json.loads(
        run_cli("best", "job", "--daemon", thread_daemon.address, "--format", "json").stdout
    )
    assert [c["config"]["partition_bytes"] for c in as_json["candidates"]] == [1 << 20, None]
    assert as_json["baseline_step_time_s"] == pytest.approx(0.05)


def test_best_says_when_the_baseline_was_not_measured(thread_daemon):
    client = Client(thread_daemon.address)
    session = client.register().session_id
    scheduled = batch(session, range(1, 21))
    for s in scheduled.samples:
        s.config.partition_bytes, s.config.credit_bytes = 1 << 20, 4 << 20
    client.stream([scheduled])
    client.close()
    best = run_cli("best", "job", "--daemon", thread_daemon.address)
    assert "no-scheduling baseline: not measured" in best.stdout, best.stdout
    as_json = json.loads(
        run_cli("best", "job", "--daemon", thread_daemon.address, "--format", "json").stdout
    )
    assert as_json["baseline_step_time_s"] is None and len(as_json["candidates"]) == 1


def test_status_history_and_tune_show_the_tuner(db_url):
    """`autobyte status` shows the tuner's state under each job (table within 80 columns, JSON with
    every earlier field plus `tuner`); `history` lists decisions with who made them, predicted and
    measured step time and the reason; `tune --pause/--resume` and `propose` pause the tuner."""
    import json
    import time

    from autobyte.protocol import autobyte_pb2 as pb

    from tests.helpers.daemon import ThreadDaemon
    from tests.helpers.rpc import Client, sample

    daemon = ThreadDaemon(db_url, tuner="auto").start()
    try:
        client = Client(daemon.address)
        session = client.register(job="cli-job").session_id
        samples = [
            sample(
                seq,
                step_time_s=0.1,
                bandwidth_bytes_per_s=1e8,
                config=pb.Config(partition_bytes=4 << 20, credit_bytes=16 << 20),
            )
            for seq in range(1, 61)
        ]
        client.stream([pb.MetricsBatch(job="cli-job", rank=0, session_id=session, samples=samples)])
        deadline = time.monotonic() + 20
        while (
            time.monotonic() < deadline
            and not client.query.History(
                pb.HistoryRequest(job="cli-job", limit=1), timeout=10
            ).decisions
        ):
            time.sleep(0.1)
        client.close()
        address = ("--daemon", daemon.address)
        table = run_cli("status", *address)
        assert table.returncode == 0 and "  tuner: exploring 1/" in table.stdout, table.stdout
        assert max(len(line) for line in table.stdout.splitlines()) <= 80
        data = json.loads(run_cli("status", *address, "--format", "json").stdout)["jobs"][0]
        assert {"job", "state", "config", "last_decision", "recent_step_time_s"} <= set(data)
        assert data["tuner"]["state"] == "exploring" and data["tuner"]["mode"] == "auto"
        assert data["last_decision"]["source"] == "tuner"
        history = run_cli("history", "cli-job", *address)
        assert re.search(r"by tuner; step time predicted \d+\.\d ms", history.stdout), (
            history.stdout
        )
        assert "reason: trial 1/" in history.stdout, history.stdout
        decisions = json.loads(run_cli("history", "cli-job", *address, "--format", "json").stdout)[
            "decisions"
        ]
        assert decisions[0]["source"] == "tuner" and decisions[0]["predicted_step_time_s"] > 0
        proposed = run_cli(
            "propose", "cli-job", "--partition", "1MiB", "--credit", "4MiB", *address
        )
        assert proposed.returncode == 0 and "autobyte tune cli-job --resume" in proposed.stdout
        tailed = run_cli(
            "propose",
            "cli-job",
            "--partition",
            "1MiB",
            "--credit",
            "4MiB",
            "--tail",
            "8MiB",
            *address,
        )
        assert tailed.returncode == 0 and "tail=8MiB" in tailed.stdout, tailed.stdout
        last = json.loads(run_cli("history", "cli-job", *address, "--format", "json").stdout)[
            "decisions"
        ][-1]
        assert last["config"] == {
            "partition_bytes": 1 << 20,
            "credit_bytes": 4 << 20,
            "tail_bytes": 8 << 20,
        }
        rows = list(
            csv.DictReader(
                io.StringIO(run_cli("history", "cli-job", *address, "--format", "csv").stdout)
            )
        )
        assert rows[-1]["tail_bytes"] == str(8 << 20) and rows[0]["tail_bytes"] == "", rows
        assert "1MiB/4MiB tail 8MiB" in run_cli("history", "cli-job", *address).stdout
        paused = json.loads(run_cli("status", *address, "--format", "json").stdout)["jobs"][0][
            "tuner"
        ]
        assert paused["paused"] is True
        resumed = run_cli("tune", "cli-job", "--resume", *address)
        assert resumed.returncode == 0 and "tuner resumed" in resumed.stdout
        assert (
            json.loads(run_cli("status", *address, "--format", "json").stdout)["jobs"][0]["tuner"][
                "paused"
            ]
            is False
        )
        missing = run_cli("tune", "nope", "--pause", *address)
        assert missing.returncode == 1 and "unknown job 'nope'" in missing.stderr
    finally:
        daemon.stop()
