"""The README's own pattern, as shipped in examples/train_mlp.py, trains under torchrun and streams
every step to a daemon (the example is what a new user copies: it must keep working)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from devtools.ports import free_port
from tests.helpers.daemon import ThreadDaemon
from tests.helpers.paths import ROOT


@pytest.mark.timeout(240)
def test_train_mlp_example_trains_and_streams_to_the_daemon(db_url, tmp_path):
    daemon = ThreadDaemon(db_url).start()
    try:
        env = dict(
            os.environ,
            AUTOBYTE_DAEMON=daemon.address,
            AUTOBYTE_JOB="example",
            TMPDIR=str(tmp_path),
            PYTHONPATH=os.pathsep.join([str(ROOT / "client"), str(ROOT)]),
        )
        job = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                str(ROOT / "examples" / "train_mlp.py"),
            ],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=200,
            check=False,
        )
        assert job.returncode == 0, job.stderr[-3000:]
        assert "autobyte job example: follow it with `autobyte history example`" in job.stdout, (
            job.stdout
        )
        assert (
            f"model saved to {tmp_path / 'mlp.pt'}" in job.stdout
        )  # TMPDIR, not the working directory
        state = torch.load(tmp_path / "mlp.pt")
        assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
        assert daemon.storage().sample_count("example") == 2 * 200  # every step of both ranks
    finally:
        daemon.stop()
