"""Two benchmark ranks on this host's loopback (gloo over `lo`), and the worker argv both pass on:
shared by benchmarks/bench_compile.py and benchmarks/bench_hf.py."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def worker_argv(module: str, args: argparse.Namespace, flags: Sequence[str]) -> list[str]:
    """`python -m MODULE --worker --flag value ...`, each flag's value taken from `args`."""
    argv = [sys.executable, "-m", module, "--worker"]
    for flag in flags:
        argv += [f"--{flag}", str(getattr(args, flag.replace("-", "_")))]
    return argv


def run_two_ranks(argv: list[str], env: Mapping[str, str], timeout_s: float) -> dict[str, Any]:
    """Runs `argv` as ranks 0 and 1 of a 2-rank gloo job on loopback; rank 0's result line."""
    from devtools.ports import free_port

    port = free_port()
    procs = []
    for rank in (0, 1):
        rank_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT / "client"), str(ROOT), os.environ.get("PYTHONPATH", "")]
            ),
            **env,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GLOO_SOCKET_IFNAME": "lo",
        }
        stdout = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen(argv, env=rank_env, cwd=ROOT, text=True, stdout=stdout))
    try:
        out, _ = procs[0].communicate(timeout=timeout_s)
        procs[1].wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if procs[0].returncode != 0:
        raise RuntimeError(f"rank 0 exited with {procs[0].returncode}")
    return next(json.loads(line) for line in out.splitlines() if '"event": "result"' in line)
