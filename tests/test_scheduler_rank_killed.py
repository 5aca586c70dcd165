"""A rank SIGKILLed mid-step: the other rank raises within seconds (not at the 300 s timeout),
naming the dead rank, leaves no scheduler thread behind and exits; and a `torchrun --max-restarts 1`
job whose worker dies once resumes from its checkpoint and completes, with the parameters of an
uninterrupted run resumed the same way, equal on both ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.ports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "_killed_rank_job.py"


def _env(tmp_path: Path, hot_path: str) -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "AUTOBYTE_NATIVE": "1" if hot_path == "native" else "0",
        "TMPDIR": str(tmp_path),
    }  # torchrun's torchelastic_* folder goes with the test


def _report(out: Path, rank: int) -> dict:
    path = out / f"r{rank}.json"
    assert path.exists(), f"rank {rank} wrote no report"
    return json.loads(path.read_text())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hot_path,killed", [("native", 1), ("python", 1), ("native", 0)])
def test_a_rank_killed_mid_step_makes_the_other_raise_within_seconds(tmp_path, hot_path, killed):
    survivor = 1 - killed
    port = free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = {
                **_env(tmp_path, hot_path),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
            }
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(JOB),
                        "--out",
                        str(tmp_path),
                        "--steps",
                        "100000",
                        "--kill-rank",
                        str(killed),
                        "--kill-step",
                        "15",
                        "--step-sleep-s",
                        "0.05",
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        assert procs[killed].wait(150) == -9, procs[killed].stdout.read()
        # exits on its own, well before the scheduler's 300 s timeout
        procs[survivor].wait(60)
        output = procs[survivor].stdout.read()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert procs[survivor].returncode == 0, output[-3000:]
    killed_at = json.loads((tmp_path / "killed.json").read_text())
    got = _report(tmp_path, survivor)
    assert not got["completed"], got
    assert got["step"] >= 15, got
    raised_after_s = got["raised_t"] - killed_at["t"]  # CLOCK_MONOTONIC: one clock per host
    assert raised_after_s < 30.0, (raised_after_s, got["error"])
    message = got["error"]
    assert f"rank {killed}" in message and "killed" in message, message
    assert got["threads_left"] == [], got  # nothing left blocked


def _torchrun(tmp_path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """One launch, in a session of its own: on a timeout the whole group goes (torchrun's workers
    would outlive a kill of torchrun alone)."""
    out.mkdir()
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.5",
        "--master-port",
        str(free_port()),
        str(JOB),
        "--out",
        str(out),
        "--steps",
        "20",
        "--checkpoint-every",
        "5",
        *extra,
    ]
    proc = subprocess.Popen(
        argv,
        env=_env(tmp_path, "native"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@pytest.mark.timeout(290)
def test_torchrun_restarts_a_killed_worker_and_the_job_resumes_from_its_checkpoint(tmp_path):
    killed = _torchrun(tmp_path, tmp_path / "killed", "--kill-rank", "1", "--kill-step", "12")
    assert killed.returncode == 0, killed.stderr[-4000:]
    died = json.loads((tmp_path / "killed" / "killed.json").read_text())
    assert died["rank"] == 1 and died["attempt"] == 0, died
    ranks = [_report(tmp_path / "killed", rank) for rank in (0, 1)]
    for got in ranks:
        assert got["completed"] and got["attempt"] == 1 and got["resumed_from"] == 10, got
        assert got["step"] == 19, got
        assert got["threads_left"] == [], got
    assert ranks[0]["digests"] == ranks[1]["digests"]

    uninterrupted = _torchrun(tmp_path, tmp_path / "uninterrupted")
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]
    reference = _report(tmp_path / "uninterrupted", 0)
    assert reference["completed"] and reference["attempt"] == 0, reference
    assert ranks[0]["digests"] == reference["digests"]
