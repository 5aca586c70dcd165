"""Spawn real torch.distributed (gloo) process groups for tests, and always clean them up."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from typing import Any

from devtools.ports import free_port


def _entry(
    fn: Callable,
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    results: Any,
    backend: str,
    environ: dict[str, str],
) -> None:
    # the caller's environment now (a forked rank has the fork server's, from its start)
    os.environ.clear()
    os.environ.update(environ)
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - teardown after a failure may fail too: the result below says what happened
                pass
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - any failure of the rank goes back to the test as its traceback
        results.put((rank, False, traceback.format_exc()))


def _rank_context():
    """Ranks are forked from one fork server per test session that has imported torch once
    (tests/helpers/_rank_preload.py), not spawned: each rank a process of its own that has not run
    any test's code, without a torch import of its own."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    # torch by name as well: the server imports from its working directory, where the repository's
    # tests package may not be found (then only the gc.freeze() is missed)
    ctx.set_forkserver_preload(["torch", "torch.distributed", "tests.helpers._rank_preload"])
    return ctx


def run_ranks(
    fn: Callable, world_size: int = 2, *args: Any, timeout_s: float = 120.0, backend: str = "gloo"
) -> list[Any]:
    """Run fn(rank, world_size, *args) in `world_size` gloo ranks, each a fresh process forked by
    the session's fork server (_rank_context), under the caller's environment; return their results.

    fn must be importable (module level). A rank's exception fails the call with its traceback; a
    rank that does not finish within timeout_s fails it too. Every process is killed on the way out.
    """
    ctx = _rank_context()
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, port, args, results, backend, environ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"ranks did not finish within {timeout_s}s "
                    f"(finished: {sorted(values)}; errors: {errors})"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        raise RuntimeError(
                            f"a rank died with exit code {dead[0].exitcode} "
                            f"(errors so far: {errors})"
                        ) from None
                continue
            if ok:
                values[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break  # the other ranks may be stuck waiting for this one
        if errors:
            raise AssertionError("\n".join(errors))
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors and len(values) == world_size else 0.1)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
    return [values[rank] for rank in range(world_size)]


# In the ranks' environment: every embedding (not only tables of 1 MiB and more) is reduced row-sparse
# (autobyte.scheduler.sparse_rows), so the equivalence tests' small models run through that path too.
SPARSE_ROWS_EVERYWHERE = {"AUTOBYTE_SPARSE_ROWS_MIN_BYTES": "0"}


def run_ranks_on(
    hot_path: str,
    fn: Callable,
    world_size: int = 2,
    *args: Any,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """run_ranks with the scheduler's hot path chosen for the ranks: "native" (the default where the
    extension is built) or "python" (AUTOBYTE_NATIVE=0 in their environment); `env`: more variables
    for the ranks' environment."""
    if hot_path not in ("native", "python"):
        raise ValueError(f"hot_path must be 'native' or 'python', got {hot_path!r}")
    extra = {"AUTOBYTE_NATIVE": "1" if hot_path == "native" else "0", **(env or {})}
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        return run_ranks(fn, world_size, *args, timeout_s=timeout_s)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def torchrun_argv(script: object, *args: str, nproc: int = 2) -> list[str]:
    """The command line of a `torch.distributed.run` launch of `script` on `nproc` local ranks,
    on a free rendezvous port."""
    import sys

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        str(script),
        *args,
    ]


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` now, children first (from every /proc/<pid>/stat's parent: torchrun
    starts each worker in a session of its own, out of reach of the launcher's process group)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    ppid = int(handle.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in parents.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def run_launch(
    argv: list[str], *, env: dict[str, str], timeout_s: float, cwd: object = None
) -> subprocess.CompletedProcess:
    """Run a launcher (torchrun and its workers) to its end within `timeout_s`. A launch that
    hangs fails the test with each worker's Python stacks (faulthandler on; the launcher stopped,
    then SIGABRT to each of its descendants in turn) and all of them killed: never an orphaned
    worker or a bare timeout."""
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    launcher = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = launcher.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_all([launcher.pid], signal.SIGSTOP)  # it would stop the workers at the first abort
        workers = _descendants(launcher.pid)
        try:
            for pid in workers:  # faulthandler: each worker's stacks to stderr, one at a time
                _signal_all([pid], signal.SIGABRT)
                time.sleep(0.5)
        finally:
            _signal_all([*workers, launcher.pid], signal.SIGKILL)
        out, err = launcher.communicate()
        raise AssertionError(
            f"{' '.join(map(str, argv[2:]))} did not end within {timeout_s:.0f} s; its stderr "
            f"with every process's stacks:\n{err[-12000:]}\nstdout:\n{out[-2000:]}"
        ) from None
    return subprocess.CompletedProcess(argv, launcher.returncode, out, err)


def kill_launch(launcher: subprocess.Popen) -> None:
    """Kill a launcher that is still running and every process below it (torchrun's workers run in
    sessions of their own: killing the launcher alone leaves them running), then reap it."""
    if launcher.poll() is None:
        _signal_all([*_descendants(launcher.pid), launcher.pid], signal.SIGKILL)
        launcher.wait()
