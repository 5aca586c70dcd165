"""The real `autobyted` process: start, status on an empty daemon, clean shutdown, refusals."""

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import time

import pytest

from devtools.ports import free_port
from tests.helpers.cli import run_cli
from tests.helpers.daemon import start_daemon_process, stop_process
from tests.helpers.paths import BIN


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
        tables = {
            row[0] for row in conn.execute("select name from sqlite_master where type='table'")
        }
        (mode,) = conn.execute("pragma journal_mode").fetchone()
    assert {
        "jobs",
        "ranks",
        "step_metrics",
        "decisions",
        "configurations",
        "alembic_version",
    } <= tables
    assert mode == "wal"


def test_refuses_a_foreign_database(tmp_path):
    path = tmp_path / "foreign.db"
    with sqlite3.connect(path) as conn:
        conn.execute("create table invoices (id integer primary key)")
    result = subprocess.run(
        [
            str(BIN / "autobyted"),
            "start",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--db",
            f"sqlite:///{path}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 3
    assert "did not create" in result.stderr and "Traceback" not in result.stderr
    with sqlite3.connect(path) as conn:
        tables = {
            row[0] for row in conn.execute("select name from sqlite_master where type='table'")
        }
    assert tables == {"invoices"}  # untouched


def test_refuses_beyond_loopback_without_token(tmp_path):
    result = subprocess.run(
        [
            str(BIN / "autobyted"),
            "start",
            "--listen",
            "0.0.0.0:0",
            "--db",
            f"sqlite:///{tmp_path}/x.db",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(BIN)},
        check=False,
    )
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
        version = subprocess.run(
            [str(BIN / command), "--version"], capture_output=True, text=True, check=False
        )
        assert version.returncode == 0 and "0." in version.stdout
        help_text = subprocess.run(
            [str(BIN / command), "--help"], capture_output=True, text=True, check=False
        )
        assert help_text.returncode == 0 and "Usage" in help_text.stdout
        # Name the exit codes
        assert "Exit codes" in help_text.stdout
    # The daemon now chooses configurations itself; its help says so and how to turn it off
    daemon_help = subprocess.run(
        [str(BIN / "autobyted"), "--help"], capture_output=True, text=True, check=False
    ).stdout
    assert "predictor" in daemon_help and "does not choose configurations" not in daemon_help
    start_help = subprocess.run(
        [str(BIN / "autobyted"), "start", "--help"], capture_output=True, text=True, check=False
    ).stdout
    assert "--tuner [auto|observe|off]" in start_help


def test_port_in_use_is_one_line_and_creates_nothing(daemon_process, tmp_path):
    """The address is checked before the database is created or migrated."""
    db = tmp_path / "never.db"
    result = subprocess.run(
        [
            str(BIN / "autobyted"),
            "start",
            "--listen",
            daemon_process.address,
            "--db",
            f"sqlite:///{db}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 4, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"autobyted: cannot listen on {daemon_process.address}: address already in use"
    ], result.stderr
    assert not list(tmp_path.glob("never.db*"))  # no database, no lock file


def test_metrics_port_in_use_creates_nothing(daemon_process, tmp_path):
    result = subprocess.run(
        [
            str(BIN / "autobyted"),
            "start",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--metrics-listen",
            daemon_process.address.rpartition(":")[2],
            "--db",
            f"sqlite:///{tmp_path}/never.db",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 4 and "cannot listen on 127.0.0.1:" in result.stderr, result.stderr
    assert not list(tmp_path.glob("never.db*"))


def test_second_daemon_on_one_sqlite_file_is_refused(db_url):
    """One SQLite file, one daemon; the lock dies with its holder, even on SIGKILL."""
    first_port = free_port()
    first = start_daemon_process(db_url, first_port)
    second = None
    try:
        refused = subprocess.run(
            [
                str(BIN / "autobyted"),
                "start",
                "--listen",
                f"127.0.0.1:{free_port()}",
                "--db",
                db_url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert refused.returncode == 5, refused.stderr
        (line,) = refused.stderr.strip().splitlines()
        assert "in use by another autobyted" in line and f"pid {first.pid}" in line
        assert f"127.0.0.1:{first_port}" in line
        assert run_cli("status", "--daemon", f"127.0.0.1:{first_port}").returncode == 0  # untouched
        stop_process(first, signal.SIGKILL)
        second = start_daemon_process(db_url, free_port())  # a crashed holder leaves no stale lock
    finally:
        stop_process(first, signal.SIGKILL)
        if second is not None:
            assert stop_process(second) == 0


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.parametrize(
    "url",
    [
        "postgresql://alice:hunter2@127.0.0.1:1/autobyte",
        "postgresql://alice:hunter2@127.0.0.1:notaport/autobyte",
        "nosuchdialect://alice:hunter2@127.0.0.1/autobyte",
    ],
)
def test_database_password_never_echoed(tmp_path, url, how):
    """A bad --db URL is reported without its password."""
    args = [
        str(BIN / "autobyted"),
        "start",
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--log-format",
        "text",
    ]
    env = dict(os.environ)
    if how == "flag":
        args += ["--db", url]
    else:
        env["AUTOBYTED_DB"] = url
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert result.returncode == 3, result.stderr
    assert "hunter2" not in result.stdout + result.stderr
    assert "alice:***@" in result.stderr and "Traceback" not in result.stderr


def test_malformed_database_is_reported_not_unreachable(tmp_path):
    """Part of the file overwritten; the daemon starts (the schema pages are intact),
    a query fails: the daemon logs it and the CLI shows the daemon's message, not 'cannot reach'."""
    from autobyte.types import StepMetrics

    from autobyted.storage.db import make_engine, migrate
    from autobyted.storage.records import Registration, SampleBatch
    from autobyted.storage.sql import SqlStorage

    path = tmp_path / "hurt.db"
    engine = make_engine(f"sqlite:///{path}")
    migrate(engine)
    storage = SqlStorage(engine)
    session = storage.register(
        Registration(job="hurt", rank=0, world_size=1, backend="gloo", instance_id="i"), 30.0
    ).session_id
    now = time.time()
    storage.append_samples(
        [
            SampleBatch(
                "hurt",
                0,
                session,
                tuple(
                    (i + 1, StepMetrics(step=i, wall_time_s=now, step_time_s=0.1))
                    for i in range(3000)
                ),
            )
        ]
    )
    engine.dispose()
    with sqlite3.connect(path) as conn:
        conn.execute("pragma wal_checkpoint(TRUNCATE)")
    size = path.stat().st_size
    with open(path, "r+b") as handle:  # the second half of the file: step_metrics' pages
        handle.seek(size // 2)
        handle.write(b"\xde\xad\xbe\xef" * ((size - size // 2) // 4))
    port = free_port()
    proc = start_daemon_process(f"sqlite:///{path}", port)
    try:
        for command in (["status"], ["history", "hurt"]):
            result = run_cli(*command, "--daemon", f"127.0.0.1:{port}")
            assert result.returncode == 1, result.stderr
            assert "malformed" in result.stderr and "INTERNAL" in result.stderr, result.stderr
            assert "cannot reach" not in result.stderr
    finally:
        stop_process(proc)
    log = proc.stdout.read()
    assert re.search(r"ERROR autobyted\S*: (Status|History) failed: .*malformed", log), log


def test_insecure_listening_is_logged_loudly(tmp_path):
    """--insecure beyond loopback starts, and says so. Run in a network namespace of
    its own (unshare -n), so that 0.0.0.0 means nothing but that namespace's loopback."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private network namespace")
    proc = subprocess.Popen(
        [
            "unshare",
            "-n",
            str(BIN / "autobyted"),
            "start",
            "--listen",
            "0.0.0.0:7077",
            "--token",
            "t0k",
            "--insecure",
            "--db",
            f"sqlite:///{tmp_path}/x.db",
            "--log-format",
            "text",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "autobyted listening" in line:
                break
    finally:
        stop_process(proc)
    text = "".join(lines)
    assert re.search(
        r"WARNING autobyted: INSECURE: listening on 0.0.0.0:7077 .*without TLS", text
    ), text
    assert "t0k" not in text
    refused = subprocess.run(
        [
            str(BIN / "autobyted"),
            "start",
            "--listen",
            "0.0.0.0:7077",
            "--token",
            "t0k",
            "--db",
            f"sqlite:///{tmp_path}/y.db",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2 and "without TLS" in refused.stderr


def test_sqlite_synchronous_setting(tmp_path):
    """The durability the proto promises is the one configured."""
    from autobyted.storage.db import make_engine

    for setting, pragma in (("normal", 1), ("full", 2)):
        engine = make_engine(f"sqlite:///{tmp_path}/{setting}.db", setting)
        with engine.connect() as connection:
            assert connection.exec_driver_sql("pragma synchronous").scalar() == pragma
        engine.dispose()


def test_unusable_database_exits_3(tmp_path):
    result = subprocess.run(
        [
            str(BIN / "autobyted"),
            "start",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--db",
            f"sqlite:///{tmp_path}/missing/dir/x.db",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 3, result.stderr
    assert "cannot open or migrate database" in result.stderr and "Traceback" not in result.stderr
