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

ROOT = Path(__file__).resolve().parents[2]


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


def paired_parser(description: str, **defaults: int) -> argparse.ArgumentParser:
    """The flags every two-rank paired benchmark takes (bench_hf, bench_clip); `defaults` overrides
    batch_size, partition, credit."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--rates", default="", help="testbed link rates (root), e.g. 1gbit; empty: loopback"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=defaults.get("batch_size", 8))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--partition", type=int, default=defaults.get("partition", 1 << 20))
    parser.add_argument("--credit", type=int, default=defaults.get("credit", 4 << 20))
    parser.add_argument("--timeout", type=float, default=defaults.get("timeout", 900))
    parser.add_argument("--out", default="", help="write the raw results + table as JSON here")
    return parser


def check_at_least_one(
    parser: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]
) -> None:
    for name in names:
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )


def run_blocks(
    args: argparse.Namespace, argv: list[str], env: Mapping[str, str]
) -> list[tuple[str, dict[str, Any]]]:
    """(link, rank 0's result) for each of `--rates` on the namespace testbed, or loopback."""
    rates = [r for r in args.rates.split(",") if r]
    if not rates:
        return [("loopback", run_two_ranks(argv, env, args.timeout))]
    from benchmarks.testbed import Testbed

    blocks = []
    for rate in rates:
        with Testbed(world_size=2, rate=rate) as bed:
            result = bed.run(
                lambda rank: argv,
                cwd=str(ROOT),
                timeout_s=args.timeout,
                env={**env, "LOCAL_WORLD_SIZE": "2"},
            )
        blocks.append((rate, result.ranks[0].results[-1]))
    return blocks


def report(args: argparse.Namespace, blocks: list, table: str) -> None:
    """Print the table; with `--out`, write it and the raw results as JSON."""
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps({"blocks": blocks, "table": table}, indent=1))
