"""Per-step measurements and the log of configurations in effect, turned into StepMetrics."""

from __future__ import annotations

import bisect
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

from autobyte.types import Config, StepMetrics

logger = logging.getLogger(__name__)


class StepTimings:
    """Raw measurements of one step, written by the thread that sees each event."""

    __slots__ = (
        "blocked_forward_s",
        "blocked_s",
        "bytes",
        "parts",
        "queue_s",
        "t_backward",
        "t_first_issue",
        "t_forward",
        "t_last_done",
        "t_step",
    )

    def __init__(self) -> None:
        self.t_forward = self.t_backward = self.t_step = None
        self.blocked_s = 0.0  # every wait for parameters in this step (exposed communication)
        self.blocked_forward_s = 0.0  # the part of it before the first gradient (the forward pass)
        self.bytes = 0
        self.parts = 0
        self.queue_s = 0.0
        self.t_first_issue = None
        self.t_last_done = 0.0


def compute_times(rec: StepTimings, t_step: float) -> tuple[float, float]:
    """(forward_s, backward_s) of a step: the spans from the first forward to the first gradient
    and from there to step(), each *without* the time it waited for parameters. Waits are
    communication (they are exposed_comm_s): counted in the compute figures, a bandwidth drop would
    read as a compute slowdown (the drift detector's compute signal is forward_s + backward_s)."""
    if rec.t_backward is None:
        return 0.0, 0.0
    forward_s = (
        max(0.0, rec.t_backward - rec.t_forward - rec.blocked_forward_s)
        if rec.t_forward is not None
        else 0.0
    )
    backward_s = max(0.0, t_step - rec.t_backward - (rec.blocked_s - rec.blocked_forward_s))
    return forward_s, backward_s


class StepLog:
    """Step records, the configuration log (rank 0's, on every rank) and the step callbacks.

    The configuration log holds (first step, config, decision id) entries; on rank 0 the training
    thread appends, on followers the decision receiver appends what rank 0 published.
    """

    def __init__(self, initial: Config) -> None:
        self.records: dict[int, StepTimings] = {}
        self.completed: collections.deque[int] = (
            collections.deque()
        )  # steps whose updates all landed
        self.initial = (initial, 0)
        self.config_log: list[tuple[int, Config, int]] = []
        self.config_steps: list[int] = []
        self.last_metrics: StepMetrics | None = None
        self.last_step_t = time.perf_counter()
        self.callbacks: list[Callable[[StepMetrics], Any]] = []

    def record(self, step: int) -> StepTimings:
        rec = self.records.get(step)
        if rec is None:
            rec = self.records.setdefault(step, StepTimings())
        return rec

    def log_config(self, step: int, config: Config, decision_id: int) -> None:
        self.config_log.append((step, config, decision_id))
        self.config_steps.append(step)

    def current(self) -> tuple[Config, int]:
        if self.config_log:
            _, config, decision_id = self.config_log[-1]
            return config, decision_id
        return self.initial

    def config_at(self, step: int) -> tuple[Config, int]:
        k = bisect.bisect_right(self.config_steps, step) - 1
        if k < 0:
            return self.initial
        _, config, decision_id = self.config_log[k]
        return config, decision_id

    def drain(self) -> None:
        """Turn the records of completed steps into StepMetrics and call the callbacks (training thread)."""
        completed = self.completed
        while completed:
            s = completed.popleft()
            rec = self.records.pop(s, None)
            if rec is None:
                continue
            config, decision_id = self.config_at(s)
            t_step = rec.t_step or time.perf_counter()
            span = rec.t_last_done - rec.t_first_issue if rec.t_first_issue is not None else 0.0
            forward_s, backward_s = compute_times(rec, t_step)
            metrics = StepMetrics(
                step=s,
                wall_time_s=time.time(),
                step_time_s=t_step - self.last_step_t,
                forward_s=forward_s,
                backward_s=backward_s,
                exposed_comm_s=rec.blocked_s,
                queueing_delay_s=rec.queue_s / rec.parts if rec.parts else 0.0,
                bytes_reduced=rec.bytes,
                partitions=rec.parts,
                bandwidth_bytes_per_s=rec.bytes / span if span > 0 else 0.0,
                config=config,
                decision_id=decision_id,
            )
            self.last_step_t = t_step
            self.last_metrics = metrics
            k = bisect.bisect_right(self.config_steps, s) - 1
            if k > 0:  # entries before the one in effect at a finished step are history
                del self.config_log[:k]
                del self.config_steps[:k]
            for fn in self.callbacks:
                try:
                    fn(metrics)
                except Exception:
                    logger.warning("a step callback raised; ignored", exc_info=True)
