"""Per-parameter progress shared by the training thread and the scheduler's threads.

`produced[i]` is the last step whose gradient of parameter i is in the flat buffer (written by the
training/autograd thread); `param_step[i]` the number of updates applied to it (written by the update
thread under `cond`). A parameter may be read in step s once `param_step[i] >= s`. The first error of
any thread is kept here and raised in the training thread; while a watchdog runs (`health`), the
raise waits (bounded) for its diagnosis of the failure: which rank died, or that every rank answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence


class SchedulerError(RuntimeError):
    """A failure in the scheduler's hooks or threads, raised in the training thread."""


class PeerError(SchedulerError):
    """Another rank disagrees on the step count, failed or died: the watchdog's finding, which
    names the ranks itself (no diagnosis is waited for)."""


DIAGNOSIS_WAIT_S = 6.0  # the longest a raise waits for the watchdog's diagnosis


logger = logging.getLogger(__name__)


class Progress:
    def __init__(self, n: int, rank: int, timeout_s: float) -> None:
        self.n = n
        self.rank = rank
        self.timeout_s = timeout_s
        self.produced = [-1] * n
        self.produced_t = [0.0] * n
        self.produced_count = 0  # gradients produced in the step in progress
        self.param_step = [0] * n
        self.updated_through = 0  # every parameter has its updates of steps < this
        self.reduced_step = [
            0
        ] * n  # parameters handed back in .grad: slices reduced for steps < this
        self.reduced_through = 0  # every slice of every step < this is reduced
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.waiting_since: float | None = None  # the training thread waits in the scheduler since
        self.failed_at: float | None = None  # time.monotonic() of the first error
        self.diagnosing = False  # a watchdog runs and will explain a failure (`health`)
        self.diagnosis: str | None = None  # its explanation ("": every rank still answers)

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
                self.failed_at = time.monotonic()
                logger.error("autobyte scheduler failed on rank %d: %r", self.rank, error)
            self.cond.notify_all()

    def set_diagnosing(self, diagnosing: bool) -> None:
        with self.cond:
            self.diagnosing = diagnosing
            self.cond.notify_all()

    def explain(self, diagnosis: str) -> None:
        """The watchdog's account of the failure (once): who died, or "" when every rank answers."""
        with self.cond:
            if self.diagnosis is None:
                self.diagnosis = diagnosis
                self.cond.notify_all()

    def raise_if_failed(self) -> None:
        error = self.error
        if error is None:
            return
        if self.diagnosing and self.diagnosis is None and not isinstance(error, PeerError):
            # a backend error ("connection reset by peer") says nothing of who died: the watchdog
            # tells within seconds (a peer whose heartbeat stopped), bounded
            deadline = time.monotonic() + DIAGNOSIS_WAIT_S
            with self.cond:
                while self.diagnosis is None and self.diagnosing:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self.cond.wait(remaining)
        diagnosis = f"{self.diagnosis}; " if self.diagnosis else ""
        raise SchedulerError(f"the gradient scheduler failed: {diagnosis}{error!r}") from error

    def ready(self, idxs: Sequence[int], s: int) -> bool:
        ps = self.param_step
        for i in idxs:
            if ps[i] < s:
                return False
        return True

    def _wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Wait on `cond` until done() (checked under the lock), a thread's error, or the timeout."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            self.waiting_since = time.monotonic()
            try:
                while not done():
                    self.raise_if_failed()
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise SchedulerError(f"timed out after {timeout_s}s waiting for {what}")
                    self.cond.wait(min(remaining, 1.0))
            finally:
                self.waiting_since = None

    def wait_params(self, idxs: Sequence[int], s: int) -> float:
        """Wait until the parameters have their updates of steps < s; returns the seconds blocked."""
        if self.ready(idxs, s):
            return 0.0
        t0 = time.perf_counter()
        self._wait(lambda: self.ready(idxs, s), self.timeout_s, f"the updates of step {s - 1}")
        return time.perf_counter() - t0

    def wait_updated_through(self, target: int, timeout_s: float) -> None:
        """Wait until every update of steps < target has landed (synchronize())."""
        if self.updated_through < target:
            self._wait(
                lambda: self.updated_through >= target,
                timeout_s,
                f"step {target - 1}'s updates (synchronize)",
            )

    def wait_step_reduced(self, s: int) -> None:
        """Wait until every slice of step s is reduced (a read of a gradient: `grad_reads`)."""
        if self.reduced_through <= s:
            self._wait(
                lambda: self.reduced_through > s,
                self.timeout_s,
                f"the reduced gradients of step {s}",
            )

    def wait_reduced(self, idxs: Sequence[int], s: int) -> None:
        """Wait until the slices of the parameters are reduced for step s (reduced_step > s)."""
        rs = self.reduced_step
        if not all(rs[i] > s for i in idxs):
            self._wait(
                lambda: all(rs[i] > s for i in idxs),
                self.timeout_s,
                f"the reduced gradients of step {s}",
            )
