"""The `autobyte` CLI run as a process of this interpreter's install, as a user runs it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers.paths import BIN


def run_cli(*args, env=None, timeout=60):
    return subprocess.run(
        [str(BIN / "autobyte"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


def newcomer_env(**extra: str) -> dict[str, str]:
    """The environment of a new shell: this one's, minus the virtual environment (its bin folder off
    PATH, no VIRTUAL_ENV), so that a command works only as the docs say to type it."""
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and Path(p) != BIN]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return {**env, "PATH": os.pathsep.join(path or ["/usr/bin", "/bin"]), **extra}


def run_shell(script: str, cwd, env=None, timeout=120) -> subprocess.CompletedProcess:
    """`script` typed into bash (stdout and stderr together, as a terminal shows them)."""
    return subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=cwd,
        env=env if env is not None else newcomer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
