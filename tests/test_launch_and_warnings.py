"""Bare `autobyte.init()` under plain torchrun trains (a job id derived from the launch, the same on
every rank), and metrics that do not reach a daemon are a warning the user sees without any
logging configured."""

from __future__ import annotations

import json
import os
import time

import pytest

from devtools.ports import free_port
from tests.helpers.daemon import ThreadDaemon
from tests.helpers.dist import run_launch, run_ranks, torchrun_argv
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_bare_init_under_torchrun_derives_one_job_id_for_the_launch(db_url, tmp_path):
    daemon = ThreadDaemon(db_url).start()
    try:
        env = {
            k: v for k, v in os.environ.items() if k not in ("AUTOBYTE_JOB", "TORCHELASTIC_RUN_ID")
        }
        env.update(
            AUTOBYTE_DAEMON=daemon.address,
            TMPDIR=str(tmp_path),
            PYTHONPATH=os.pathsep.join([str(ROOT / "client"), str(ROOT)]),
        )
        ids = []
        for launch in range(2):
            out = tmp_path / f"launch{launch}-r{{rank}}.json"
            job = run_launch(
                torchrun_argv(ROOT / "tests" / "_bare_init_job.py", str(out)),
                env=env,
                timeout_s=180,
            )
            assert job.returncode == 0, job.stderr[-3000:]
            ranks = [
                json.loads(out.with_name(out.name.format(rank=r)).read_text()) for r in range(2)
            ]
            assert ranks[0]["job"] == ranks[1]["job"], ranks
            assert ranks[0]["job"].startswith("torchrun-"), ranks
            assert all(r["flushed"] for r in ranks), ranks  # the daemon took every rank's steps
            ids.append(ranks[0]["job"])
        assert ids[0] != ids[1], "two launches are two jobs"
        storage = daemon.storage()
        for job_id in ids:
            assert storage.sample_count(job_id) >= 2 * 20, job_id
    finally:
        daemon.stop()


def _warning_worker(rank, world, refusing_address, nobody_address):
    import warnings

    import autobyte
    import torch
    from autobyte.transport import reporter

    reporter.REFUSED_RETRY_S = 0.3
    reporter.UNREACHABLE_WARN_S = 1.0  # minutes in production: a second here
    model = torch.nn.Linear(8, 8)
    opt = autobyte.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out = {}
    for case, kwargs in (
        ("token", {"daemon": refusing_address, "job": "guarded"}),
        ("unreachable", {"daemon": nobody_address, "job": "lonely"}),
    ):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            autobyte.init(**kwargs)  # no token: the daemon wants one
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                time.sleep(0.1)
                if seen and time.monotonic() > deadline - 17:
                    break  # a few more attempts after the first warning: still one warning
            autobyte.shutdown()
        out[case] = [
            (w.category.__name__, str(w.message)) for w in seen if "autobyte" in str(w.message)
        ]
    opt.close()
    return out


@pytest.mark.timeout(120)
def test_metrics_not_reaching_a_daemon_warn_once_without_logging_configured(db_url):
    daemon = ThreadDaemon(db_url, token="t0k").start()
    try:
        (got,) = run_ranks(
            _warning_worker, 1, daemon.address, f"127.0.0.1:{free_port()}", timeout_s=100
        )
    finally:
        daemon.stop()
    assert len(got["token"]) == 1, got
    category, message = got["token"][0]
    assert category == "RuntimeWarning" and "UNAUTHENTICATED" in message
    assert "AUTOBYTE_TOKEN" in message
    assert len(got["unreachable"]) == 1, got
    assert "not reaching a daemon" in got["unreachable"][0][1]
    assert "AUTOBYTE_DAEMON" in got["unreachable"][0][1]
