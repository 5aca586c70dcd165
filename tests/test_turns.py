"""The suite's two-at-a-time lock (tests/helpers/turns.py), between real processes: an `alone`
test waits for the test beside it and keeps the next one out until it is done."""

from __future__ import annotations

import multiprocessing
import time

from tests.helpers.turns import Turns


def _hold(folder: str, alone: bool, seconds: float, started, log) -> None:
    turns = Turns(folder)
    with turns.hold(alone=alone):
        log.put(("in", alone, time.monotonic()))
        started.set()
        time.sleep(seconds)
        log.put(("out", alone, time.monotonic()))
    turns.close()


def _spawn(ctx, folder, alone, seconds, log):
    started = ctx.Event()
    process = ctx.Process(target=_hold, args=(folder, alone, seconds, started, log))
    process.start()
    return process, started


def _drain(log, count: int) -> list[tuple]:
    return sorted((log.get(timeout=30) for _ in range(count)), key=lambda event: event[2])


def test_an_alone_test_runs_with_no_other_and_is_not_starved(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    log = ctx.Queue()
    folder = str(tmp_path)
    shared_a, started_a = _spawn(ctx, folder, False, 1.0, log)
    assert started_a.wait(30)
    shared_b, started_b = _spawn(ctx, folder, False, 0.2, log)  # shared beside shared: at once
    assert started_b.wait(30)
    alone, _ = _spawn(ctx, folder, True, 1.0, log)
    time.sleep(0.3)  # the alone one is waiting at the shared lock, holding the turnstile
    late, _ = _spawn(ctx, folder, False, 0.1, log)  # must wait for the alone one to finish
    processes = [shared_a, shared_b, alone, late]
    try:
        events = _drain(log, 8)
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in processes] == [0, 0, 0, 0]
    # the two shared holders overlapped; the alone one entered after both left and left before
    # the late shared one entered
    kinds = [(what, alone_flag) for what, alone_flag, _ in events]
    assert kinds[:2] == [("in", False), ("in", False)], events
    alone_in = kinds.index(("in", True))
    alone_out = kinds.index(("out", True))
    assert alone_out == alone_in + 1, events  # nothing entered or left while it ran
    assert kinds[:alone_in].count(("out", False)) == 2, events
    assert kinds[alone_out + 1 :] == [("in", False), ("out", False)], events
