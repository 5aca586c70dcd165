"""A real autobyted (its own process, --tuner auto) tunes a real 2-rank gloo job to a better
configuration, through the real control path, without any operator."""

from __future__ import annotations

import json
import os
import statistics
import sys

import pytest
from autobyte.protocol import autobyte_pb2 as pb

from devtools.ports import free_port
from tests.helpers.daemon import start_daemon_process, stop_process
from tests.helpers.dist import run_launch
from tests.helpers.paths import ROOT
from tests.helpers.rpc import Client
from tests.helpers.wait import wait_for

pytestmark = pytest.mark.slow

# The tuner holds a fused configuration by step ~100 on a quiet machine (a trial, a check, hold
# best); the job runs on for 10 times that, so that its last 200 steps are far from the search
# even when the suite's load slows it.
STEPS = 1000


def test_a_real_daemon_tunes_a_real_two_rank_job(db_url, tmp_path):
    """The job starts with a clearly bad configuration: 4 KiB partitions of a 66k-parameter MLP, i.e.
    ~65 tiny all-reduces per step, each ~1 ms over loopback gloo. Any fused configuration is several
    times faster when the machine is quiet, and at least 1.5x under the suite's load."""
    port = free_port()
    daemon = start_daemon_process(db_url, port, "--tuner", "auto")
    try:
        env = {
            **os.environ,
            "AUTOBYTE_DAEMON": f"127.0.0.1:{port}",
            "AUTOBYTE_JOB": "e2e",
            "TMPDIR": str(tmp_path),
        }  # torchrun's torchelastic_* folder goes with the test
        job = run_launch(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                str(ROOT / "devtools" / "mlp_job.py"),
                "--steps",
                str(STEPS),
                "--width",
                "128",
                "--depth",
                "2",
                "--partition",
                "4KiB",
                "--credit",
                "none",
                "--out",
                str(tmp_path / "r{rank}.json"),
            ],
            env=env,
            timeout_s=300,
        )
        assert job.returncode == 0, job.stderr[-3000:]
        ranks = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1)]
        client = Client(f"127.0.0.1:{port}")
        history = client.query.History(
            pb.HistoryRequest(job="e2e", rank=0, limit=100_000), timeout=10
        )
        # every rank ended (its last batch says so): the tuner lets the job go at its next cycle
        status = wait_for(
            lambda: (
                (answer := client.query.Status(pb.StatusRequest(), timeout=10)).jobs
                and answer.jobs[0].tuner.state == "finished"
                and answer
            ),
            what="the tuner to let the finished job go",
            show=lambda: client.query.Status(pb.StatusRequest(), timeout=10).jobs,
        )
        client.close()
    finally:
        assert stop_process(daemon) == 0
    decisions = list(history.decisions)
    assert decisions and all(d.source == "tuner" for d in decisions)  # the tuner's own, no operator
    assert any(
        d.reason.startswith("trial") and d.HasField("measured_step_time_s") for d in decisions
    )
    assert all(d.HasField("predicted_step_time_s") for d in decisions)
    final = ranks[0]["config"]
    assert (
        final == ranks[1]["config"] and final["partition_bytes"] != 4096
    )  # the same on both ranks
    steps = {s.step: s for s in history.steps}
    bad = [
        s.step_time_s for s in steps.values() if s.config.partition_bytes == 4096 and 10 <= s.step
    ]
    last = [steps[i].step_time_s for i in range(STEPS - 200, STEPS) if i in steps]
    assert len(bad) >= 20 and len(last) >= 150
    # a fused configuration runs 2-3x faster on a quiet machine; under the suite's parallel load
    # CI measured 1.73-1.97x (the bad configuration's steps come from the job's first seconds, the
    # last ones from its end, under whatever else ran then): 1.5x is still far beyond the noise
    # of either median, and a job left at 4 KiB runs at 1x
    assert statistics.median(last) < statistics.median(bad) / 1.5
    # the client's host-load sampler (autobyte.hostload) reaches storage once its first second is over
    import sqlite3

    with sqlite3.connect(db_url.removeprefix("sqlite:///")) as conn:
        (loaded,) = conn.execute("select count(*) from step_metrics where host_load > 0").fetchone()
    assert loaded > 100
    (job_status,) = status.jobs
    # and says what it was doing then: a search takes a few seconds (samples arrive once a second)
    assert job_status.tuner.detail.startswith("finished: every rank ended (the tuner was: "), (
        job_status.tuner
    )
    assert job_status.tuner.baseline_step_time_s > 0
