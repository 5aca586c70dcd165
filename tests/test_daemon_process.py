"""The real `autobyted` process: start, status on an empty daemon, clean shutdown, refusals."""

import json
import signal
import sqlite3
import subprocess

import pytest

from conftest import BIN, free_port, start_daemon_process, stop_process


def run_cli(*args, env=None, timeout=60):
    import os

    return subprocess.run([str(BIN / "autobyte"), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_start_status_and_clean_shutdown(db_url, sig):
    port = free_port()
    proc = start_daemon_process(db_url, port)
    try:
        table = run_cli("status", "--daemon", f"127.0.0.1:{port}")
        assert table.returncode == 0, table.stderr
        assert table.stdout.strip() == "no jobs yet"
        as_json = run_cli("status", "--daemon", f"127.0.0.1:{port}", "--format", "json")
        assert as_json.returncode == 0, as_json.stderr
        assert json.loads(as_json.stdout)["jobs"] == []
    finally:
        code = stop_process(proc, sig)
    output = proc.stdout.read()
    assert code == 0, output
    assert "autobyted stopped" in output


def test_database_is_migrated_on_start(db_url, daemon_process):
    path = db_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        tables = {row[0] for row in conn.execute("select name from sqlite_master where type='table'")}
        (mode,) = conn.execute("pragma journal_mode").fetchone()
    assert {"jobs", "ranks", "step_metrics", "decisions", "configurations", "alembic_version"} <= tables
    assert mode == "wal"


def test_refuses_a_foreign_database(tmp_path):
    path = tmp_path / "foreign.db"
    with sqlite3.connect(path) as conn:
        conn.execute("create table invoices (id integer primary key)")
    result = subprocess.run([str(BIN / "autobyted"), "start", "--listen", f"127.0.0.1:{free_port()}",
                             "--db", f"sqlite:///{path}"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert "did not create" in result.stderr and "Traceback" not in result.stderr
    with sqlite3.connect(path) as conn:
        tables = {row[0] for row in conn.execute("select name from sqlite_master where type='table'")}
    assert tables == {"invoices"}  # untouched


def test_refuses_beyond_loopback_without_token(tmp_path):
    result = subprocess.run([str(BIN / "autobyted"), "start", "--listen", "0.0.0.0:0",
                             "--db", f"sqlite:///{tmp_path}/x.db"], capture_output=True, text=True, timeout=60,
                            env={"PATH": str(BIN)})
    assert result.returncode == 2
    assert "without a token" in result.stderr and "Traceback" not in result.stderr


def test_token_guards_every_rpc(db_url):
    port = free_port()
    proc = start_daemon_process(db_url, port, env={"AUTOBYTE_TOKEN": "s3cret"})
    try:
        missing = run_cli("status", "--daemon", f"127.0.0.1:{port}", env={"AUTOBYTE_TOKEN": ""})
        assert missing.returncode == 1 and "missing token" in missing.stderr
        wrong = run_cli("status", "--daemon", f"127.0.0.1:{port}", "--token", "nope")
        assert wrong.returncode == 1 and "wrong token" in wrong.stderr
        right = run_cli("status", "--daemon", f"127.0.0.1:{port}", "--token", "s3cret")
        assert right.returncode == 0, right.stderr
    finally:
        assert stop_process(proc) == 0


def test_versions_and_help():
    for command in ("autobyte", "autobyted"):
        version = subprocess.run([str(BIN / command), "--version"], capture_output=True, text=True)
        assert version.returncode == 0 and "0." in version.stdout
        help_text = subprocess.run([str(BIN / command), "--help"], capture_output=True, text=True)
        assert help_text.returncode == 0 and "Usage" in help_text.stdout


def test_port_in_use_exits_4(daemon_process):
    result = subprocess.run([str(BIN / "autobyted"), "start", "--listen", daemon_process.address,
                             "--db", "sqlite:////tmp/unused-autobyte-port-test.db"], capture_output=True, text=True,
                            timeout=60)
    import os

    if os.path.exists("/tmp/unused-autobyte-port-test.db"):
        os.remove("/tmp/unused-autobyte-port-test.db")
    assert result.returncode == 4, result.stderr
    assert "cannot listen" in result.stderr and "Traceback" not in result.stderr


def test_unusable_database_exits_3(tmp_path):
    result = subprocess.run([str(BIN / "autobyted"), "start", "--listen", f"127.0.0.1:{free_port()}",
                             "--db", f"sqlite:///{tmp_path}/missing/dir/x.db"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 3, result.stderr
    assert "cannot open or migrate database" in result.stderr and "Traceback" not in result.stderr
