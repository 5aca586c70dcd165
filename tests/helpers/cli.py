"""The `autobyte` CLI run as a process of this interpreter's install, as a user runs it."""

from __future__ import annotations

import os
import subprocess

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
