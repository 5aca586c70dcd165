"""The native hot path's switches: check-build says whether it is built and active and why not, the
choice is collective over the data-parallel group, and the scheduler logs it once per process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.helpers.dist import run_ranks

AUTOBYTE = str(Path(sys.executable).parent / "autobyte")


def _check_build(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "AUTOBYTE_NATIVE"} | env
    result = subprocess.run(
        [AUTOBYTE, "check-build", "--format", "json"],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_check_build_says_built_and_active_or_why_not():
    """This checkout is set up by scripts/setup.sh, which compiles the extension: a missing build
    must fail here, not pass quietly on the Python path."""
    report = _check_build()
    assert report["native"] == {
        "built": True,
        "active": True,
        "reason": "",
        "built_for_torch": torch.__version__,
    }, report
    assert report["torch"] == {"installed": True, "version": torch.__version__}
    assert report["backends"]["gloo"] is True
    off = _check_build(AUTOBYTE_NATIVE="0")["native"]
    assert off["built"] is True and off["active"] is False
    assert off["reason"] == "disabled by AUTOBYTE_NATIVE=0"


def _mixed_worker(rank: int, world: int) -> dict:
    """Rank 1 cannot run the native path: both ranks must take the Python path (collective)."""
    from autobyte import ScheduledOptimizer

    os.environ["AUTOBYTE_NATIVE"] = "1" if rank == 0 else "0"
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("autobyte.scheduler.native")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    out = {}
    for k in range(2):  # two optimizers, one log line
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        with ScheduledOptimizer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), 4096, 8192
        ) as sched:
            for _ in range(3):
                F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
                sched.step()
            sched.synchronize()
            out[k] = (sched.hot_path, sched.hot_path_reason)
    out["lines"] = [line for line in lines if "hot path" in line]
    return out


@pytest.mark.slow
def test_native_choice_is_collective_and_logged_once():
    rank0, rank1 = run_ranks(_mixed_worker, 2, timeout_s=90)
    assert (
        rank0[0]
        == rank0[1]
        == (
            "python",
            ("another rank of the data-parallel group cannot run the native path (see its log)"),
        )
    )
    assert rank1[0] == rank1[1] == ("python", "disabled by AUTOBYTE_NATIVE=0")
    assert rank0["lines"] == [
        (
            "autobyte scheduler: Python hot path: another rank of the data-parallel "
            "group cannot run the native path (see its log)"
        )
    ]
    assert rank1["lines"] == ["autobyte scheduler: Python hot path: disabled by AUTOBYTE_NATIVE=0"]
