"""Two autobyted processes on one PostgreSQL, a real 2-rank gloo job whose ranks stream to different
daemons, and a SIGKILL of the daemon that tunes the job: training never stalls, every step of both
ranks is stored exactly once, the tuner lease moves to the survivor, and a decision made after the
kill reaches both ranks at the same step."""

import json
import signal
import subprocess
import time

import pytest
import sqlalchemy as sa
from autobyte.protocol import autobyte_pb2 as pb

from devtools.ports import free_port
from tests.helpers.daemon import start_daemon_process, stop_process
from tests.helpers.dist import kill_launch
from tests.helpers.rpc import Client
from tests.helpers.trainer import start_mlp_trainer

STEPS = 600
JOB = "failover"
LEASE_S = 3.0


def query(engine, sql: str, **params):
    with engine.connect() as connection:
        return connection.execute(sa.text(sql), params).all()


def wait_for(predicate, timeout_s: float, what: str, trainer: subprocess.Popen):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        assert trainer.poll() is None, f"training ended before {what}: {trainer.stdout.read()}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(300)
def test_sigkill_of_one_of_two_daemons_during_training(tmp_path, pg_url):
    config = tmp_path / "autobyted.toml"
    config.write_text(
        f'[autobyted]\ntuner = "auto"\ntuner_lease_s = {LEASE_S}\ndecision_poll_s = 0.2\n'
    )
    ports = [free_port(), free_port()]
    daemons = {}
    for (
        port
    ) in ports:  # every daemon migrates the empty database at start: one does, the other waits
        daemons[port] = start_daemon_process(pg_url, port, "--config", str(config))
    addresses = ",".join(f"127.0.0.1:{port}" for port in ports)  # rank r starts with daemon r mod 2
    trainer = start_mlp_trainer(addresses, JOB, STEPS, tmp_path)
    engine = sa.create_engine(pg_url)
    try:

        def streaming():
            rows = query(
                engine,
                "select s.rank, count(*) from step_metrics s join jobs j on j.id = s.job_id "
                "where j.name = :job group by s.rank",
                job=JOB,
            )
            return len(rows) == 2 and min(count for _, count in rows) >= 60

        wait_for(streaming, 120, "both ranks streaming", trainer)
        holder = wait_for(
            lambda: query(engine, "select holder from leases where name = :n", n=f"tuner:{JOB}"),
            30,
            "a daemon tuning the job",
            trainer,
        )[0][0]
        killed_port = next(p for p in ports if daemons[p].pid == int(holder.split(":")[1]))
        survivor_port = next(p for p in ports if p != killed_port)
        stop_process(daemons[killed_port], signal.SIGKILL)
        killed_at = time.monotonic()
        taken = wait_for(
            lambda: (
                (
                    h := query(
                        engine, "select holder from leases where name = :n", n=f"tuner:{JOB}"
                    )[0][0]
                )
                != holder
                and h
            ),
            LEASE_S + 10,
            "the survivor to take the lease over",
            trainer,
        )
        assert int(taken.split(":")[1]) == daemons[survivor_port].pid
        taken_after_s = time.monotonic() - killed_at
        survivor = Client(f"127.0.0.1:{survivor_port}")
        try:
            (status,) = survivor.query.Status(pb.StatusRequest(), timeout=10).jobs
            decision = survivor.control.ProposeConfig(
                pb.ProposeConfigRequest(
                    job=JOB,
                    config=pb.Config(partition_bytes=128 << 10, credit_bytes=512 << 10),
                    apply_at_step=status.steps + 30,
                    reason="after the kill",
                ),
                timeout=10,
            )
        finally:
            survivor.close()
        assert decision.apply_at_step < STEPS - 50, "the job ran too fast for this test"
        assert trainer.wait(180) == 0, trainer.stdout.read()
    finally:
        kill_launch(trainer)
        for proc in daemons.values():
            stop_process(proc, signal.SIGKILL)
    try:
        for rank in (0, 1):
            steps = [
                s
                for (s,) in query(
                    engine,
                    "select s.step from step_metrics s join jobs j on j.id = s.job_id "
                    "where j.name = :job and s.rank = :rank order by s.step",
                    job=JOB,
                    rank=rank,
                )
            ]
            assert steps == list(range(STEPS)), (
                f"rank {rank}: {len(steps)} samples, {len(set(steps))} distinct"
            )
        # the decision made after the kill took effect on both ranks at the same step
        switched = dict(
            query(
                engine,
                "select s.rank, min(s.step) from step_metrics s join jobs j on j.id = s.job_id "
                "where j.name = :job and s.decision_id = :d group by s.rank",
                job=JOB,
                d=decision.decision_id,
            )
        )
        assert set(switched) == {0, 1} and switched[0] == switched[1] >= decision.apply_at_step, (
            switched
        )
        reported = {
            rank
            for (rank,) in query(
                engine,
                "select rank from configurations where decision_id = :d",
                d=decision.decision_id,
            )
        }
        assert reported == {0, 1}
    finally:
        engine.dispose()
    for rank in (0, 1):
        report = json.loads((tmp_path / f"r{rank}.json").read_text())
        assert report["flushed"] and report["dropped"] == 0 and report["acked_seq"] == STEPS
        assert (
            report["daemon"] == f"127.0.0.1:{survivor_port}"
        )  # the rank on the killed daemon moved
        assert report["failovers"] == (1 if ports[rank % 2] == killed_port else 0), report
        gaps = [b - a for a, b in zip(report["step_ends"], report["step_ends"][1:])]
        print(
            f"rank {rank}: daemon {ports[rank % 2]}{' (killed)' if ports[rank % 2] == killed_port else ''}, "
            f"longest step {max(gaps):.3f}s, lease taken over {taken_after_s:.1f}s after the kill"
        )
        assert max(gaps) < 1.0, (
            f"rank {rank} stalled {max(gaps):.2f}s (lease taken over after {taken_after_s:.1f}s)"
        )
