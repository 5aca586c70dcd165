"""How a training process ends, many times over: run by tests/test_process_exit.py.

    python tests/_exit_job.py OUT_DIR SPEC...     SPEC: MODE[@ddp][*REPEATS], e.g. end*6 exit3@ddp
    python -m torch.distributed.run --nproc-per-node 2 tests/_exit_job.py --torchrun MODE OUT_DIR

The driver imports torch once and forks, for each job, the two ranks of a small gloo job
(an MLP with AdamW, 6 steps). Each forked rank runs the job at this script's top level and then
falls off its end, so it ends through the interpreter's real shutdown, as a script does. The
driver delivers the signals a mode names once both ranks are mid-training (at a random point of
the next `SIGNAL_JITTER_S`: a few steps of this job), waits for every rank
(at most `RANK_DEADLINE_S` after the job's end or the signal) and writes one JSON line per rank
to OUT_DIR/results.jsonl: exit status, seconds from the end or signal until gone, and whether the
rank's stderr holds a C++ abort. Each rank saves its final state_dict from an `atexit` handler
(the last thing a script's own code can see) to OUT_DIR/r{job}-{rank}.pt. Three jobs run at a time.

MODE is one of MODES; `@ddp` runs the same script with DistributedDataParallel instead. Under
torchrun (`--torchrun`) the ranks take their place from the launcher, and a set AUTOBYTE_DAEMON
streams the job to that daemon.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import random
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from devtools.ports import free_port

STEPS = 6
RANK_DEADLINE_S = 10.0
SIGNAL_JITTER_S = 0.05  # a signal lands this much (uniform) after both ranks are mid-training
MODES = {
    # mode: (where the job ends, signal, which ranks get it)
    "end": "the loop ends; nothing is closed",
    "close": "opt.close() after the loop",
    "with": "the loop inside `with ScheduledOptimizer(...)`",
    "destroy": "opt.synchronize(); dist.destroy_process_group()",
    "destroy_only": "dist.destroy_process_group() right after the last step()",
    "close_destroy": "opt.close(); dist.destroy_process_group()",
    "exit3": "sys.exit(3) after step 3",
    "raise": "an exception after step 3, outside any `with`",
    "raise_in_with": "an exception after step 3, inside the `with` block",
    "raise_one": "an exception after step 3 on rank 1 only (under torchrun: the others get SIGTERM)",
    "sigint_all": "SIGINT to both ranks mid-training (Ctrl-C)",
    "sigint_one": "SIGINT to rank 1 mid-training",
    "sigterm_all": "SIGTERM to both ranks mid-training",
    "sigterm_one": "SIGTERM to rank 1 mid-training (what torchrun sends when a rank fails)",
    "kill_one": "SIGKILL to rank 1 mid-training",
}
SIGNALLED = {
    "sigint_all": (signal.SIGINT, (0, 1)),
    "sigint_one": (signal.SIGINT, (1,)),
    "sigterm_all": (signal.SIGTERM, (0, 1)),
    "sigterm_one": (signal.SIGTERM, (1,)),
    "kill_one": (signal.SIGKILL, (1,)),
}


def job(
    mode: str, ddp: bool, rank: int, port: int | None, ready_fd: int | None, state_path: str
) -> None:
    """One rank's training script (`port` None: torchrun's environment)."""
    import autobyte

    if port is None:
        dist.init_process_group("gloo")
        if os.environ.get("AUTOBYTE_DAEMON"):
            autobyte.init()
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    atexit.register(lambda: torch.save(model.state_dict(), state_path))
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if ddp:
        model_call = nn.parallel.DistributedDataParallel(model)
        opt = base
    else:
        model_call = model
        opt = autobyte.ScheduledOptimizer(
            model, base, partition_bytes=8 << 10, credit_bytes=16 << 10
        )
    signalled = mode in SIGNALLED
    generator = torch.Generator().manual_seed(1 + rank)

    def train() -> None:
        for step in range(10**9 if signalled else STEPS):
            x = torch.randn(16, 64, generator=generator)
            y = torch.randint(0, 8, (16,), generator=generator)
            nn.functional.cross_entropy(model_call(x), y).backward()
            opt.step()
            opt.zero_grad()
            if signalled and step == 2 and ready_fd is not None:
                os.write(ready_fd, b"r")  # mid-training: the driver signals now
            if step == 3 and mode == "exit3":
                sys.exit(3)
            if step == 3 and (
                mode in ("raise", "raise_in_with") or (mode == "raise_one" and rank == 1)
            ):
                raise RuntimeError(f"the script's own error on rank {rank}")

    if mode == "with" or mode == "raise_in_with":
        with opt if not ddp else _nothing():
            train()
    else:
        train()
    if mode in ("close", "close_destroy") and not ddp:
        opt.close()
    if mode == "destroy" and not ddp:
        opt.synchronize()
    if mode in ("destroy", "destroy_only", "close_destroy"):
        dist.destroy_process_group()
    if ready_fd is not None:
        os.write(ready_fd, b"e")  # the script's end


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def drive(specs: list[tuple[str, bool]], out_dir: str, parallel: int = 3) -> tuple | None:
    """The parent: runs the jobs (mode, ddp), `parallel` at a time; returns None. A forked rank
    returns its job's arguments instead."""
    results = open(os.path.join(out_dir, "results.jsonl"), "a")  # noqa: SIM115 - appended to as each job ends; forked ranks return out of this loop
    # torch's optimizers import torch._dynamo when the first one is built (1.5 s of CPU): imported
    # here once, as a rank would have it by its first step, not again in each of them
    import torch._dynamo  # noqa: F401

    # torch's objects, imported once, out of every forked rank's garbage collections: each rank
    # would otherwise walk (and copy, page by page) all of them at its first collection and at its
    # interpreter's shutdown, seconds of CPU a rank; the shutdown itself is unchanged
    gc.freeze()
    for first in range(0, len(specs), parallel):
        jobs = {}
        for rep in range(first, min(len(specs), first + parallel)):
            mode, ddp = specs[rep]
            port = free_port()
            ranks = jobs[rep] = {}
            for rank in (0, 1):
                ready_r, ready_w = os.pipe()
                err_path = os.path.join(out_dir, f"r{rep}-{rank}.err")
                pid = os.fork()
                if pid == 0:
                    # as a script started from a terminal: Ctrl-C raises KeyboardInterrupt (a
                    # driver started in the background inherits SIGINT ignored)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    os.close(ready_r)
                    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(err, 2)
                    os.dup2(err, 1)
                    return (
                        mode,
                        ddp,
                        rank,
                        port,
                        ready_w,
                        os.path.join(out_dir, f"r{rep}-{rank}.pt"),
                    )
                os.close(ready_w)
                os.set_blocking(ready_r, False)
                ranks[rank] = {
                    "pid": pid,
                    "ready": ready_r,
                    "err": err_path,
                    "status": None,
                    "seen": b"",
                }
            ranks["signal"] = SIGNALLED.get(mode, (None, ()))
        t_end: dict[int, float] = {}
        fire_at: dict[int, float] = {}
        deadline = time.monotonic() + 120.0  # start-up and training on a busy machine
        while time.monotonic() < deadline:
            pending = False
            for rep, job_ranks in jobs.items():
                how, targets = job_ranks["signal"]
                marker = b"r" if how is not None else b"e"
                ranks = {rank: job_ranks[rank] for rank in (0, 1)}
                for r in ranks.values():
                    try:
                        r["seen"] += os.read(r["ready"], 16)
                    except BlockingIOError:
                        pass
                    if r["status"] is None:
                        pid, status = os.waitpid(r["pid"], os.WNOHANG)
                        if pid:
                            r["status"], r["gone"] = status, time.monotonic()
                if rep not in fire_at and all(
                    marker in r["seen"] or r["status"] is not None for r in ranks.values()
                ):
                    # a signal lands at a random point of the steps that follow (forward,
                    # backward, the hook, step(), zero_grad(), between steps)
                    fire_at[rep] = time.monotonic() + (
                        random.uniform(0.0, SIGNAL_JITTER_S) if targets else 0.0
                    )
                if rep in fire_at and rep not in t_end and time.monotonic() >= fire_at[rep]:
                    t_end[rep] = time.monotonic()
                    for rank in targets:
                        if ranks[rank]["status"] is None:
                            os.kill(ranks[rank]["pid"], how)
                waiting = any(r["status"] is None for r in ranks.values())
                if waiting and (
                    rep not in t_end or time.monotonic() - t_end[rep] <= RANK_DEADLINE_S
                ):
                    pending = True
            if not pending:
                break
            time.sleep(0.005)
        for rep, job_ranks in jobs.items():
            for rank in (0, 1):
                r = job_ranks[rank]
                hung = r["status"] is None
                if hung:
                    os.kill(r["pid"], signal.SIGKILL)
                    _, r["status"] = os.waitpid(r["pid"], 0)
                    r["gone"] = time.monotonic()
                status = r["status"]
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                with open(r["err"], errors="replace") as f:
                    err = f.read()
                results.write(
                    json.dumps(
                        {
                            "job": rep,
                            "mode": specs[rep][0],
                            "ddp": specs[rep][1],
                            "rank": rank,
                            "code": code,
                            "hung": hung,
                            "gone_s": round(r["gone"] - t_end[rep], 3) if rep in t_end else None,
                            "abort": "terminate called" in err or code == -signal.SIGABRT,
                            "stderr_tail": err[-1500:],
                        }
                    )
                    + "\n"
                )
                results.flush()
                os.close(r["ready"])
    return None


def parse_specs(args: list[str]) -> list[tuple[str, bool]]:
    specs = []
    for arg in args:
        name, _, repeats = arg.partition("*")
        mode, _, variant = name.partition("@")
        if mode not in MODES or variant not in ("", "ddp"):
            raise SystemExit(
                f"unknown job {arg!r}: MODE[@ddp][*REPEATS] with MODE one of {sorted(MODES)}"
            )
        specs += [(mode, variant == "ddp")] * int(repeats or 1)
    return specs


if __name__ == "__main__":
    if sys.argv[1] == "--torchrun":
        _mode, _out = sys.argv[2], sys.argv[3]
        _rank = int(os.environ["RANK"])
        _role = (_mode, False, _rank, None, None, os.path.join(_out, f"torchrun-{_rank}.pt"))
    else:
        _role = drive(parse_specs(sys.argv[2:]), sys.argv[1])
    if _role is not None:
        job(*_role)  # a rank: the script ends after this, through the interpreter's shutdown
