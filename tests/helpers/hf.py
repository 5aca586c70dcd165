"""The Hugging Face drop-in tests' launch: a 2-rank torchrun of a worker script against a real
daemon, each rank's results read from OUT_DIR/rank{r}.json."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.daemon import ThreadDaemon
from tests.helpers.dist import run_launch, torchrun_argv
from tests.helpers.paths import ROOT

EXTRA = "the Hugging Face drop-ins are an optional extra: pip install 'autobyte[hf]' (scripts/setup.sh installs it)"


def require_hf() -> None:
    """Skip the calling module where transformers or accelerate is not installed."""
    pytest.importorskip("transformers", reason=EXTRA)
    pytest.importorskip("accelerate", reason=EXTRA)


def hf_env(out: Path) -> dict[str, str]:
    """The environment of a Hugging Face job: offline, its temporary files in `out`, the
    checkout's client on the path, no daemon or FSDP setting of the caller's."""
    env = dict(
        os.environ,
        TMPDIR=str(out),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "client"), str(ROOT)]),
    )
    for name in ("AUTOBYTE_DAEMON", "AUTOBYTE_JOB", "ACCELERATE_USE_FSDP"):
        env.pop(name, None)
    return env


@contextlib.contextmanager
def hf_launch(worker: str, out: Path, timeout_s: float) -> Iterator[tuple[list[dict], str, str]]:
    """Run tests/<worker> on 2 gloo ranks under torch.distributed.run, streaming to a real daemon
    (its SQLite file in `out`): yields (each rank's results, the daemon's address, the launch's
    output) while the daemon still runs."""
    daemon = ThreadDaemon(f"sqlite:///{out / 'autobyted.db'}").start()
    try:
        job = run_launch(
            torchrun_argv(str(ROOT / "tests" / worker), str(out), daemon.address),
            env=hf_env(out),
            cwd=out,
            timeout_s=timeout_s,
        )
        assert job.returncode == 0, job.stderr[-4000:]
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
        yield ranks, daemon.address, job.stdout + job.stderr
    finally:
        daemon.stop()
