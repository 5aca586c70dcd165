"""A 2-rank torchrun of examples/train_mlp.py that streams its metrics to a daemon."""

from __future__ import annotations

import os
import subprocess
import sys

from devtools.ports import free_port
from tests.helpers.paths import ROOT


def start_mlp_trainer(daemon: str, job: str, steps: int, tmp_path) -> subprocess.Popen:
    """A 2-rank torchrun of examples/train_mlp.py streaming to `daemon` (one address or a list):
    64 KiB partitions, 256 KiB credit, 20 ms of sleep per step, per-rank results in tmp_path."""
    env = {
        **os.environ,
        "AUTOBYTE_DAEMON": daemon,
        "AUTOBYTE_JOB": job,
        "AUTOBYTE_FLUSH_TIMEOUT_S": "30",
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp_path),
    }  # torchrun's torchelastic_* folder goes with the test
    return subprocess.Popen(
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
            str(steps),
            "--width",
            "256",
            "--depth",
            "2",
            "--partition",
            "64KiB",
            "--credit",
            "256KiB",
            "--step-sleep-s",
            "0.02",
            "--out",
            str(tmp_path / "r{rank}.json"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
