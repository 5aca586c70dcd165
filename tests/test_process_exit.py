"""Every way a training process ends, ends like the same script with DDP: its exit code, no C++
abort, every rank gone within 10 s, the last updates landed (`autobyte.scheduler.process_exit`).

The jobs are forked by tests/_exit_job.py (one torch import for many short 2-rank jobs, each ending
through the interpreter's real shutdown). The exit codes expected are the same script's with DDP,
measured with `python tests/_exit_job.py OUT end@ddp close@ddp ...` (every mode, torch 2.13, gloo):
they are the defaults of CPython and of the signals, which is why DDP gives them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests._exit_job import free_port
from tests.helpers.dist import run_launch, torchrun_argv
from tests.helpers.paths import ROOT

JOB = str(ROOT / "tests" / "_exit_job.py")

# mode -> (rank 0's exit code, rank 1's), as DDP gives them
DDP_CODES = {
    "end": (0, 0),
    "close": (0, 0),
    "with": (0, 0),
    "destroy": (0, 0),
    "destroy_only": (0, 0),
    "close_destroy": (0, 0),
    "exit3": (3, 3),
    "raise": (1, 1),
    "raise_in_with": (1, 1),
    "sigint_all": (-2, -2),
    "sigint_one": (1, -2),
    "sigterm_all": (-15, -15),
    "sigterm_one": (1, -15),
    "kill_one": (1, -9),
}
# Where the race to the interpreter's teardown was (an abort on most runs before the fix): several
# runs of each on the native hot path, one on the Python path; each other path once (native).
RACY = {"end": 3, "exit3": 2, "destroy_only": 2, "sigint_all": 2}
# The paths whose last update must have landed before the script's own atexit handlers run
# (a DDP step() returns with its update applied), and the DDP run they equal.
LANDED = {
    "end": "end",
    "close": "end",
    "with": "end",
    "destroy": "end",
    "destroy_only": "end",
    "close_destroy": "end",
    "exit3": "exit3",
}


def _run_jobs(out_dir, specs: list[str], env: dict | None = None) -> list[dict]:
    subprocess.run(
        [sys.executable, JOB, str(out_dir), *specs],
        check=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    with open(out_dir / "results.jsonl") as f:
        return [json.loads(line) for line in f]


def _states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _differences(a: dict, b: dict) -> str:
    """Which tensors differ, by how much at most (a missed update moves every element by about
    the learning rate; a different reduction order by an ulp)."""
    return ", ".join(
        f"{k}: max |diff| {(a[k] - b[k]).abs().max().item():.3g}"
        for k in a
        if k in b and not torch.equal(a[k], b[k])
    )


@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_every_ending_exits_like_ddp_with_no_abort_and_the_updates_landed(tmp_path, hot_path):
    runs = RACY if hot_path == "native" else dict.fromkeys(RACY, 1)
    racy = [f"{mode}*{n}" for mode, n in runs.items()]
    once = [mode for mode in DDP_CODES if mode not in RACY] if hot_path == "native" else []
    references = ["end@ddp", "exit3@ddp"] if hot_path == "native" else ["end@ddp"]
    rows = _run_jobs(
        tmp_path,
        [*racy, *once, *references],
        {"AUTOBYTE_NATIVE": "1" if hot_path == "native" else "0"},
    )
    jobs: dict[int, dict[int, dict]] = {}
    for row in rows:
        jobs.setdefault(row["job"], {})[row["rank"]] = row
    assert len(jobs) == sum(runs.values()) + len(once) + len(references)
    failures = []
    for job, ranks in sorted(jobs.items()):
        mode, ddp = ranks[0]["mode"], ranks[0]["ddp"]
        codes = (ranks[0]["code"], ranks[1]["code"])
        what = f"job {job} ({mode}{' ddp' if ddp else ''}): codes {codes}"
        if codes != DDP_CODES[mode]:
            failures.append(f"{what}, DDP gives {DDP_CODES[mode]}")
        for rank, row in ranks.items():
            if row["abort"] or row["hung"] or (row["gone_s"] is not None and row["gone_s"] > 10.0):
                failures.append(
                    f"{what}: rank {rank} abort={row['abort']} hung={row['hung']} gone "
                    f"{row['gone_s']} s after its end\n{row['stderr_tail']}"
                )
    assert not failures, "\n".join(failures)

    # The last step's update landed before the script's atexit handlers, on every rank: the
    # state_dict each saved there equals the same script's under DDP, to the bit.
    reference = {}
    for job, ranks in jobs.items():
        if ranks[0]["ddp"]:
            reference[ranks[0]["mode"]] = torch.load(tmp_path / f"r{job}-0.pt")
    checked = 0
    for job, ranks in jobs.items():
        mode = ranks[0]["mode"]
        if ranks[0]["ddp"] or LANDED.get(mode) not in reference:
            continue
        for rank in (0, 1):
            state = torch.load(tmp_path / f"r{job}-{rank}.pt")
            expected = reference[LANDED[mode]]
            assert _states_equal(state, expected), (
                f"job {job} ({mode}) rank {rank}: {_differences(state, expected)}\n"
                f"{ranks[rank]['stderr_tail']}"
            )
        checked += 1
    assert checked >= runs["end"]


def test_under_torchrun_a_failed_rank_fails_the_job_cleanly_and_an_ended_one_tells_the_daemon(
    tmp_path, thread_daemon
):
    """torchrun: a rank's exception makes the launcher SIGTERM the other; the job exits 1 with no
    C++ abort and within 10 s. A job that ends without close() exits 0 and the daemon has it
    finished, with every step."""
    from autobyte.protocol import autobyte_pb2 as pb

    from tests.helpers.rpc import Client

    def torchrun(mode: str, job: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "AUTOBYTE_DAEMON": thread_daemon.address, "AUTOBYTE_JOB": job}
        return run_launch(
            torchrun_argv(JOB, "--torchrun", mode, str(tmp_path)), env=env, timeout_s=120
        )

    ended = torchrun("end", "exit-end")
    assert ended.returncode == 0, ended.stderr[-3000:]
    failed = torchrun("raise_one", "exit-raise")
    assert failed.returncode == 1, failed.stderr[-3000:]
    for run in (ended, failed):
        assert "terminate called" not in run.stderr and "SIGABRT" not in run.stderr, run.stderr[
            -3000:
        ]
    assert "the script's own error on rank 1" in failed.stderr

    client = Client(thread_daemon.address)
    jobs = {job.job: job for job in client.query.Status(pb.StatusRequest(), timeout=5).jobs}
    client.close()
    assert jobs["exit-end"].state == "finished" and jobs["exit-end"].steps == 6


def _interrupted_in_the_hook_worker(rank: int, world: int) -> dict:
    """Ctrl-C that lands inside the scheduler's gradient hook (where the signal handler runs is
    only a matter of timing: made certain here by a trace function that raises KeyboardInterrupt,
    as the handler does, at the hook's hand-off of the first gradient of step 2)."""
    import autobyte
    from autobyte.scheduler.optimizer import ScheduledOptimizer
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = autobyte.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    hand_off = ScheduledOptimizer._hand_off.__code__

    def interrupt_at_hand_off(frame, event, arg):
        if event == "call" and frame.f_code is hand_off:
            sys.settrace(None)
            raise KeyboardInterrupt

    raised = None
    for step in range(3):
        loss = model(torch.randn(8, 16)).sum()
        if step == 2:
            sys.settrace(interrupt_at_hand_off)
        try:
            loss.backward()
        except BaseException as error:  # noqa: BLE001 - the test reports what came out
            raised = type(error).__name__
            break
        finally:
            sys.settrace(None)
        opt.step()
        opt.zero_grad()
    try:
        opt.step()
        after = None
    except Exception as error:  # noqa: BLE001 - the test reports what came out
        after = type(error).__name__
    opt.close()
    return {"raised": raised, "after": after}


@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_ctrl_c_inside_the_gradient_hook_leaves_backward_as_keyboard_interrupt(hot_path):
    """An interrupt is the script's ending, not a scheduler failure: it leaves backward() as
    KeyboardInterrupt (exit status -2, as DDP's), and the scheduler refuses the broken step."""
    from tests.helpers.dist import run_ranks_on

    for got in run_ranks_on(hot_path, _interrupted_in_the_hook_worker, 2, timeout_s=60):
        assert got == {"raised": "KeyboardInterrupt", "after": "SchedulerError"}, got


@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_a_peer_dying_while_the_interpreter_finalizes_leaves_no_abort(tmp_path, hot_path):
    """Ctrl-C on a rank with collectives in flight, its peer dying while that rank's interpreter
    finalizes: the backend fails the collectives on its own threads then, and nothing of Python may
    be attached to them (a future's callback needs the GIL to be released, and a finalizing
    interpreter ends such a thread: SIGABRT). The rank exits -2, as DDP's."""
    job = str(ROOT / "tests" / "_late_peer_job.py")
    port = str(free_port())
    env = {**os.environ, "AUTOBYTE_NATIVE": "1" if hot_path == "native" else "0"}
    ranks = [
        subprocess.Popen(
            [sys.executable, job, str(rank), port, str(tmp_path)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [rank.communicate(timeout=90)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert (tmp_path / "finalizing").exists(), outputs[0][-3000:]
    assert "terminate called" not in outputs[0], outputs[0][-3000:]
    assert ranks[0].returncode == -2, outputs[0][-3000:]


def test_a_wait_that_times_out_as_the_collective_completes_is_no_failure():
    """The completion thread polls each collective with a short timeout. When the poll times out
    ("Operation timed out!") and the collective completes before the thread asks whether it has,
    the collective's own outcome counts: none if it succeeded (a rank once failed its job here
    with the poll's timeout as its error), its error if it failed. torch's Work, stood in for by
    the three calls the thread makes."""
    from autobyte.scheduler.dispatch import _outcome_after_timeout

    class CompletedAfterTheTimeout:
        def __init__(self, error=None):
            self.waits, self.error = 0, error

        def wait(self, timeout=None):
            self.waits += 1
            if self.waits == 1:
                raise RuntimeError("Operation timed out!")
            if self.error is not None:
                raise self.error
            return True

        def is_completed(self):
            return self.waits >= 1

    work = CompletedAfterTheTimeout()
    with pytest.raises(RuntimeError, match="timed out"):
        work.wait()
    assert work.is_completed() and _outcome_after_timeout(work) is None
    failed = CompletedAfterTheTimeout(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="timed out"):
        failed.wait()
    assert str(_outcome_after_timeout(failed)) == "Connection closed by peer"
