"""The control plane of a rank that decides for its data-parallel group: watches the daemon's
decisions, hands them to the scheduler and reports the configuration that took effect."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Protocol

import grpc

from autobyte.convert import config_from_proto, config_to_proto
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.protocol import autobyte_pb2_grpc as pb_grpc
from autobyte.transport.endpoints import release_call
from autobyte.types import Config, StepMetrics

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

RPC_TIMEOUT_S = 5.0


class ControlLink(Protocol):
    """What the control plane uses of its rank's connection to the daemon (the Reporter's)."""

    job: str
    rank: int | None

    @property
    def metadata(self) -> tuple:
        """The call metadata (the daemon's token) of every RPC."""

    @property
    def closed(self) -> threading.Event:
        """Set at shutdown: the watch loop ends."""

    connected: threading.Event  # set while the rank is registered with the daemon in use

    def channel(self) -> grpc.Channel:
        """The channel to the daemon in use (the watch stream follows a fail-over)."""

    def backoff(self, attempt: int) -> None:
        """Wait before the attempt-th retry (returns early at shutdown)."""


class Control:
    """Decisions in (the watch stream, control thread), applied configurations out (reports sent by
    the reporter's send loop on its channel)."""

    def __init__(self, link: ControlLink) -> None:
        self._link = link
        # What the decisions go to (attach): a ScheduledOptimizer, or an FSDP2 job's report
        # (autobyte.fsdp); either takes them through apply_decision(config, decision_id, at_step).
        self._optimizer = None
        # Decisions: the control thread hands them to the scheduler; the step callback sees them land.
        self._last_update_id = 0
        self._decision_id = 0
        self._reports: collections.deque[pb.ReportConfigRequest] = collections.deque(maxlen=100)
        self._watch_stream = None

    def attach(self, optimizer) -> None:
        """Hand the daemon's decisions to `optimizer` (its apply_decision) from now on."""
        self._optimizer = optimizer

    def on_step(self, metrics: StepMetrics) -> None:
        """Step callback (training thread): note a decision that took effect."""
        if metrics.decision_id != self._decision_id:  # a decision took effect at this step
            self._decision_id = metrics.decision_id
            self._reports.append(
                pb.ReportConfigRequest(
                    job=self._link.job,
                    rank=self._link.rank,
                    decision_id=metrics.decision_id,
                    config=config_to_proto(metrics.config),
                    applied_at_step=metrics.step,
                )
            )

    def _apply(self, decision_id: int, config: Config, apply_at_step: int) -> None:
        """Hand a decision to the scheduler (control thread); it takes effect at the step boundary
        it names, or the next one if that has passed. Rank 0 decides for every rank."""
        try:
            self._optimizer.apply_decision(config, decision_id, apply_at_step)
        except Exception as error:  # noqa: BLE001 - keep the last good configuration
            log.warning("decision %d (%s) not applied: %s", decision_id, config.describe(), error)

    def flush_reports(self, control) -> None:
        while self._reports:
            request = self._reports[0]
            try:
                control.ReportConfig(request, timeout=RPC_TIMEOUT_S, metadata=self._link.metadata)
            except grpc.RpcError as error:
                if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise  # transient: the send loop reconnects and tries again
                log.warning(
                    "autobyted refused the report of decision %d: %s",
                    request.decision_id,
                    error.details(),
                )
            self._reports.popleft()

    def watch_loop(self) -> None:
        attempt = 0
        while not self._link.closed.is_set():
            opened = time.monotonic()
            try:
                self._link.connected.wait(1.0)
                if not self._link.connected.is_set():
                    continue
                # The daemon the send loop registered with; _fail_over cancels this stream to follow.
                control = pb_grpc.ControlStub(self._link.channel())
                stream = control.WatchConfig(
                    pb.WatchConfigRequest(
                        job=self._link.job,
                        rank=self._link.rank,
                        after_decision_id=self._last_update_id,
                    ),
                    metadata=self._link.metadata,
                )
                self._watch_stream = stream
                opened = time.monotonic()
                for update in stream:
                    attempt = 0
                    if update.decision_id <= self._last_update_id:
                        continue  # already handed over (a daemon replaying after a move): never twice
                    try:
                        config = config_from_proto(update.config)
                    except ValueError as error:
                        log.warning(
                            "ignoring decision %d from the daemon: %s", update.decision_id, error
                        )
                        continue
                    self._last_update_id = update.decision_id
                    self._apply(update.decision_id, config, update.apply_at_step)
            except grpc.RpcError as error:
                release_call(error)
                if time.monotonic() - opened > 5.0:
                    attempt = 0  # it was a working stream that broke, not a failing one
                if not self._link.closed.is_set():
                    log.debug("control stream ended: %s %s", error.code(), error.details())
            except Exception:
                log.exception("unexpected error in the autobyte control thread")
            finally:
                stream = self._watch_stream = None  # freed here, not at interpreter shutdown
            attempt += 1
            self._link.backoff(attempt)

    def cancel_watch(self) -> None:
        """End the watch stream (a move to another daemon, or shutdown); the watch loop reopens it
        unless closed."""
        stream = self._watch_stream
        if stream is not None:
            stream.cancel()
