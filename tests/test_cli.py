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
