"""The testbed's network namespaces as the system sees them: naming, listing, running `ip`,
and removing what runs killed with SIGKILL left behind (`--cleanup-stale`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Sequence

from benchmarks.testbed import conditions

NAME_PREFIX = "abtb"


class TestbedError(RuntimeError):
    """The testbed could not be set up, or a run failed (a rank exited non-zero or timed out)."""

    __test__ = False  # not a pytest test class


def _run_cmd(
    args: Sequence[str], check: bool = True, timeout: float = 30
) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise TestbedError(
            f"command failed ({proc.returncode}): {' '.join(args)}\n{proc.stderr.strip()}"
        )
    return proc


def list_namespaces() -> list[str]:
    out = _run_cmd(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_pids(ns: str) -> None:
    out = _run_cmd(["ip", "netns", "pids", ns], check=False).stdout
    for token in out.split():
        try:
            os.kill(int(token), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def cleanup_stale() -> list[str]:
    """Delete testbed namespaces and cgroups whose owning process (the pid in the name) no longer
    exists (processes inside the namespaces are killed first)."""
    removed = []
    pattern = re.compile(rf"^{NAME_PREFIX}-(\d+)-")

    def stale(name: str) -> bool:
        match = pattern.match(name)
        return bool(match) and not _pid_alive(int(match.group(1)))

    for ns in list_namespaces():
        if stale(ns):
            _kill_namespace_pids(ns)
            if _run_cmd(["ip", "netns", "del", ns], check=False).returncode == 0:
                removed.append(ns)
    removed += conditions.cleanup_stale_cgroups(pattern, stale)
    return removed
