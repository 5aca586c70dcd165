"""The CLI against an unreachable daemon and against bad input."""

import pytest

from conftest import free_port
from test_daemon_process import run_cli


@pytest.mark.parametrize("command", [["status"], ["history", "job-1"], ["best", "job-1"]])
def test_unreachable_daemon_is_one_line(command):
    result = run_cli(*command, "--daemon", f"127.0.0.1:{free_port()}")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach autobyted" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_daemon_address_from_environment():
    port = free_port()
    result = run_cli("status", env={"AUTOBYTE_DAEMON": f"127.0.0.1:{port}"})
    assert result.returncode == 2 and f"127.0.0.1:{port}" in result.stderr


def test_unknown_job_is_a_clear_error(thread_daemon):
    result = run_cli("history", "nope", "--daemon", thread_daemon.address)
    assert result.returncode == 1
    assert "unknown job 'nope'" in result.stderr and "NOT_FOUND" in result.stderr


def test_bad_propose_value_is_rejected_before_sending(thread_daemon):
    result = run_cli("propose", "job", "--partition", "0", "--credit", "1MiB", "--daemon", thread_daemon.address)
    assert result.returncode == 1 and "positive byte size" in result.stderr


def test_status_history_and_tune_show_the_tuner(db_url):
    """`autobyte status` shows the tuner's state under each job (table within 80 columns, JSON with
    every earlier field plus `tuner`); `history` lists decisions with who made them, predicted and
    measured step time and the reason; `tune --pause/--resume` and `propose` pause the tuner."""
    import json
    import time

    from autobyte.protocol import autobyte_pb2 as pb
    from conftest import ThreadDaemon
    from _grpc_util import Client, sample

    daemon = ThreadDaemon(db_url, tuner="auto").start()
    try:
        client = Client(daemon.address)
        session = client.register(job="cli-job").session_id
        samples = [sample(seq, step_time_s=0.1, bandwidth_bytes_per_s=1e8,
                          config=pb.Config(partition_bytes=4 << 20, credit_bytes=16 << 20)) for seq in range(1, 61)]
        client.stream([pb.MetricsBatch(job="cli-job", rank=0, session_id=session, samples=samples)])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not client.query.History(
                pb.HistoryRequest(job="cli-job", limit=1), timeout=10).decisions:
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
        assert "BY     STATE    PRED_MS" in history.stdout and "  trial 1/" in history.stdout, history.stdout
        decisions = json.loads(run_cli("history", "cli-job", *address, "--format", "json").stdout)["decisions"]
        assert decisions[0]["source"] == "tuner" and decisions[0]["predicted_step_time_s"] > 0
        proposed = run_cli("propose", "cli-job", "--partition", "1MiB", "--credit", "4MiB", *address)
        assert proposed.returncode == 0 and "autobyte tune cli-job --resume" in proposed.stdout
        paused = json.loads(run_cli("status", *address, "--format", "json").stdout)["jobs"][0]["tuner"]
        assert paused["paused"] is True
        resumed = run_cli("tune", "cli-job", "--resume", *address)
        assert resumed.returncode == 0 and "tuner resumed" in resumed.stdout
        assert json.loads(run_cli("status", *address, "--format", "json").stdout)["jobs"][0]["tuner"]["paused"] is False
        missing = run_cli("tune", "nope", "--pause", *address)
        assert missing.returncode == 1 and "unknown job 'nope'" in missing.stderr
    finally:
        daemon.stop()
