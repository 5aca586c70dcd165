"""SIGKILL and restart autobyted while a real 2-rank gloo job streams to it (SQLite and PostgreSQL)."""

import json
import signal
import sqlite3
import time

import pytest
import sqlalchemy as sa
from autobyte.protocol import autobyte_pb2 as pb

from devtools.ports import free_port
from tests.helpers.daemon import start_daemon_process, stop_process
from tests.helpers.databases import DATABASES, database_url
from tests.helpers.dist import kill_launch
from tests.helpers.rpc import Client
from tests.helpers.trainer import start_mlp_trainer

STEPS = 400


@pytest.fixture(params=DATABASES)
def db_url(request, tmp_path) -> str:
    return database_url(request, tmp_path)


def stored_steps(db_url: str, job: str, rank: int) -> list[int]:
    """Every stored step of one rank of a job, ascending, duplicates included."""
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as connection:
            return list(
                connection.scalars(
                    sa.text(
                        "select s.step from step_metrics s join jobs j on j.id = s.job_id "
                        "where j.name = :job and s.rank = :rank order by s.step"
                    ),
                    {"job": job, "rank": rank},
                )
            )
    finally:
        engine.dispose()


def steps_seen(address: str) -> int:
    client = Client(address)
    try:
        jobs = client.query.Status(pb.StatusRequest(), timeout=2).jobs
        return jobs[0].steps if jobs else 0
    except Exception:  # noqa: BLE001 - a daemon that is down or restarting has no steps yet
        return 0
    finally:
        client.close()


@pytest.mark.timeout(240)
def test_daemon_sigkill_and_restart_during_training(tmp_path, db_url):
    port = free_port()
    address = f"127.0.0.1:{port}"
    daemon = start_daemon_process(db_url, port)
    trainer = start_mlp_trainer(address, "reliability", STEPS, tmp_path)
    restarted = None
    try:
        deadline = time.monotonic() + 120
        while steps_seen(address) < 40:
            assert trainer.poll() is None, trainer.stdout.read()
            assert time.monotonic() < deadline, "training never reached step 40"
            time.sleep(0.2)
        stop_process(daemon, signal.SIGKILL)
        killed_at = time.monotonic()
        time.sleep(2.0)
        restarted = start_daemon_process(db_url, port)
        back_at = time.monotonic()
        assert trainer.wait(180) == 0, trainer.stdout.read()
    finally:
        kill_launch(trainer)
        if restarted is not None:
            assert stop_process(restarted) == 0
        stop_process(daemon, signal.SIGKILL)

    if db_url.startswith("sqlite"):
        with sqlite3.connect(db_url.removeprefix("sqlite:///")) as conn:
            assert conn.execute("pragma integrity_check").fetchone() == ("ok",)
    for rank in (0, 1):
        steps = stored_steps(db_url, "reliability", rank)
        # every step arrived exactly once: nothing acknowledged was lost, the outage's buffer arrived
        assert steps == list(range(STEPS)), f"rank {rank}: {len(steps)} samples"
    for rank in (0, 1):
        report = json.loads((tmp_path / f"r{rank}.json").read_text())
        assert report["flushed"] and report["dropped"] == 0 and report["acked_seq"] == STEPS
        # Never stalled: steps went on while no daemon existed (CLOCK_MONOTONIC is one clock for all
        # processes), and no pause between two steps lasted as long as the outage. Load only makes
        # steps slower, never as slow as a training job that waited for its daemon to come back.
        outage_s = back_at - killed_at
        during = [end for end in report["step_ends"] if killed_at < end < back_at]
        gaps = [b - a for a, b in zip(report["step_ends"], report["step_ends"][1:])]
        assert during, f"rank {rank}: no step finished during the {outage_s:.1f}s outage"
        assert max(gaps) < outage_s, (
            f"rank {rank} stalled for {max(gaps):.2f}s of a {outage_s:.1f}s outage"
        )
