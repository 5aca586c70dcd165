"""The README's quick start runs, cleans up after itself and says what to look at next."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.cli import run_shell
from tests.helpers.paths import ROOT


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quickstart_runs_cleans_up_and_points_onwards():
    # The loopback variant (the testbed variant as root is the README's; it takes ~2.5 min)
    env = {
        **os.environ,
        "QUICKSTART_STEPS": "40",
        "QUICKSTART_TESTBED": "0",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("QUICKSTART_KEEP", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    work = re.search(r"with sqlite:///(\S+)/autobyte\.db", out).group(1)
    assert not os.path.exists(work), f"{work} left behind"
    assert "$ autobyte status" in out and "quickstart" in out
    status_table = out.split("$ autobyte status")[1]
    assert re.search(r"quickstart\s+finished\s+2/2\s+40\s", status_table), (
        status_table
    )  # every step, finished
    assert "\n  tuner: " in status_table  # the tuner's line under the job
    assert "What to look at next:" in out and "temporary folder is removed" in out
    # The CLI as a newcomer types it next: the activate line the quick start printed, then the
    # commands by name, in a shell whose PATH does not hold the virtual environment.
    activate = re.search(r"^  (\. \S+/activate) ", out, re.MULTILINE).group(1)
    shell = run_shell(
        f"{activate}\nautobyte --help\nautobyted --help\ntorchrun --help", cwd=os.getcwd()
    )
    assert shell.returncode == 0, shell.stdout
    assert "autobyte: what the daemon sees" in shell.stdout and "Usage: autobyted" in shell.stdout
