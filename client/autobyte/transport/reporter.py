"""The metrics stream of one rank: the send loop that registers, streams the samples of its buffer
(transport/sample_buffer.py: seq/ack bookkeeping) and fails over between daemons
(transport/endpoints.py); the control plane (transport/control.py) rides on its connection.

The training thread only appends to a bounded buffer (a few µs); everything that touches the network
runs on background threads with timeouts, reconnects with backoff and jitter, and keeps the last good
configuration when the daemon is slow, down or wrong.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
import warnings
from typing import Any

import grpc

from autobyte import __version__
from autobyte.channel import RETRY_AFTER_KEY, auth_metadata
from autobyte.convert import (
    config_to_proto,
    memory_to_proto,
    metrics_to_proto,
    shard_layout_to_proto,
)
from autobyte.hostload import HostLoadSampler
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.protocol import autobyte_pb2_grpc as pb_grpc
from autobyte.tcplinks import LinkSampler
from autobyte.transport.control import RPC_TIMEOUT_S, Control
from autobyte.transport.endpoints import DaemonEndpoints, release_call
from autobyte.transport.place import RankPlace
from autobyte.transport.sample_buffer import SampleBuffer
from autobyte.types import Config, StepMetrics, check_metrics

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

MAX_BATCH_SAMPLES = 500
BACKOFF_INITIAL_S = 0.2
BACKOFF_MAX_S = 10.0
# A registration refused for a reason that retrying will not fix soon (wrong token, another model or
# world size under this job id, a rank held by a live process) is tried again this rarely.
REFUSED_RETRY_S = 30.0
# No daemon reached for this long: the user is warned once (warnings.warn, shown by default).
UNREACHABLE_WARN_S = 120.0
# Bounds of the wait a daemon may ask for with RESOURCE_EXHAUSTED.
RETRY_AFTER_MAX_S = 60.0

# Registration refusals that the next attempt would meet as well, with what the user can do.
PERMANENT_REFUSALS = {
    grpc.StatusCode.UNAUTHENTICATED: "give this process the daemon's token (autobyte.init(token=...) or "
    "AUTOBYTE_TOKEN)",
    grpc.StatusCode.PERMISSION_DENIED: "give this process the daemon's token (autobyte.init(token=...) or "
    "AUTOBYTE_TOKEN)",
    grpc.StatusCode.FAILED_PRECONDITION: "run this job under a new job id (autobyte.init(job=...) or "
    "AUTOBYTE_JOB)",
    grpc.StatusCode.ALREADY_EXISTS: "use a new job id, or let the process that holds this rank end (it "
    "is taken over once it finished or has been silent long enough)",
    grpc.StatusCode.INVALID_ARGUMENT: "fix the registration as the reason says",
    grpc.StatusCode.UNIMPLEMENTED: "point AUTOBYTE_DAEMON at an autobyted of a matching version",
}


def warn_user(message: str) -> None:
    """What a user must act on and would otherwise never see: a warning, beside the log."""
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    log.debug("warned: %s", message)


def _retry_after_s(error: grpc.RpcError) -> float | None:
    """The wait a RESOURCE_EXHAUSTED answer asks for (trailing metadata `retry-after-ms`), else None."""
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    try:
        metadata = dict(error.trailing_metadata() or ())
        return min(RETRY_AFTER_MAX_S, max(0.0, int(metadata[RETRY_AFTER_KEY]) / 1e3))
    except (KeyError, TypeError, ValueError):
        return None


class Reporter:
    """Per-process connection to the daemon for one (job, rank)."""

    def __init__(
        self,
        address: str,
        job: str,
        rank: int | None,
        world_size: int | None,
        token: str | None,
        buffer_samples: int,
        tls_ca: str | None = None,
        flush_interval_s: float = 1.0,
        tune: bool = True,
    ) -> None:
        self.job, self.rank, self.world_size = job, rank, world_size
        # Daemons sharing one database, any of which serves this rank; the send loop moves to the
        # next when one fails.
        self.endpoints = DaemonEndpoints(address, tls_ca)
        self.tune = tune
        self.place: RankPlace | None = None  # known once a ScheduledOptimizer is attached
        self._metadata = auth_metadata(token)
        self._instance_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # The scheduler leaves StepMetrics.host_load and the link figures at 0 (unknown); the
        # reporter's samplers (autobyte.hostload, autobyte.tcplinks) supply them, kept beside each
        # buffered sample.
        self._buffer = SampleBuffer(buffer_samples)
        self._host_load = HostLoadSampler()
        self._links = LinkSampler()
        self._addresses: dict[str, int] = {}  # each rank's address -> its rank (the link's peer)
        self._flush_interval_s = flush_interval_s
        self._send_due = 0.0
        self._flush_requested = False
        self._cond = self._buffer.cond  # also guards the stream state below
        self._generation = 0  # bumped at every registration: one live request iterator at a time
        self._yielded = 0  # batches handed to the current stream
        # Shutdown: the last batch carries final=True; the daemon then marks this rank finished.
        self._final_requested = False
        self._final_at: int | None = None  # the final batch's number in the current stream
        self._final_acked = False
        self._warned_refusals: set[grpc.StatusCode] = set()
        self._unreachable_since: float | None = None
        self._warned_unreachable = False
        self._refused = False
        # CPU seconds the background threads spent on this reporter's own work (conversion, acks);
        # gRPC's internal threads are not counted.
        self.background_cpu_s = 0.0
        self._closed = threading.Event()
        self._optimizer = None
        self._fingerprint: pb.ModelFingerprint | None = None
        self._backend = "unknown"
        self._engine = "scheduler"
        self._initial_config = Config()
        self.connected = threading.Event()
        self._threads: list[threading.Thread] = []
        self.control = Control(self)  # decisions in, applied configurations out

    # ------------------------------------------------------------------ training thread
    def attach(
        self, optimizer, place: RankPlace, fingerprint: pb.ModelFingerprint, backend: str
    ) -> None:
        """Stream `optimizer`'s steps from now on (`autobyte.transport.session` says where this rank
        sits and what the model is)."""
        if self._optimizer is not None:
            if self._optimizer is not optimizer:
                log.warning(
                    "autobyte reports one ScheduledOptimizer per process; ignoring another one"
                )
            return
        self._optimizer = optimizer
        self.control.attach(optimizer)
        self.place = place
        self.rank, self.world_size = self.place.rank, self.place.world_size
        self._fingerprint = fingerprint
        self._backend = backend
        self._engine = optimizer.engine_name  # autobyte.types.ENGINES
        self._initial_config = optimizer.config
        optimizer.add_step_callback(self.on_step)
        self.endpoints.start_at(self.place.rank)
        self._threads = [
            threading.Thread(target=self._send_loop, name="autobyte-telemetry", daemon=True)
        ]
        if self.place.dp_rank == 0:  # every data-parallel group's leader decides for its group
            self._threads.append(
                threading.Thread(
                    target=self.control.watch_loop, name="autobyte-control", daemon=True
                )
            )
        for thread in self._threads:
            thread.start()
        # the job's other ranks on this host are the job's CPU, not others' load
        self._host_load.exclude(getattr(optimizer, "local_job_pids", ()))
        self._host_load.start()
        self._addresses = dict(getattr(optimizer, "rank_addresses", None) or {})
        if len(self._addresses) > 1:  # a link to name needs two hosts
            self._links.start()

    def on_step(self, metrics: StepMetrics) -> None:
        """Step callback (training thread): buffer the sample and note a decision that took effect."""
        if self._closed.is_set():
            return
        with self._cond:
            context = (self._host_load.value, self._links.value)
            if self._buffer.append(metrics, context) >= MAX_BATCH_SAMPLES:
                self._cond.notify()
        self.control.on_step(metrics)

    # ------------------------------------------------------------------ background threads
    def _add_link(self, sample: pb.StepMetrics, link: tuple[float, str, str]) -> None:
        """This rank's most queued link when the step ended (autobyte.tcplinks), its far end as
        1 + that rank; nothing where it is unknown or the peer is not one of the job's ranks."""
        queue_s, _local, peer = link
        rank = self._addresses.get(peer)
        if rank is not None and rank != self.rank and sample.link_peer == 0:
            sample.link_queue_s = queue_s
            sample.link_peer = rank + 1

    def backoff(self, attempt: int) -> None:
        delay = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** min(attempt, 10))
        self._closed.wait(delay * random.uniform(0.5, 1.0))

    @property
    def optimizer(self):
        """The ScheduledOptimizer whose steps this reporter streams (None before attach)."""
        return self._optimizer

    @property
    def metadata(self) -> tuple:
        """The call metadata (the daemon's token) of every RPC."""
        return self._metadata

    @property
    def closed(self) -> threading.Event:
        """Set once close() began: every background loop ends."""
        return self._closed

    @property
    def addresses(self) -> list[str]:
        return self.endpoints.addresses

    @property
    def failovers(self) -> int:
        return self.endpoints.failovers

    @property
    def address(self) -> str:
        """The daemon this rank uses now."""
        return self.endpoints.address

    def channel(self) -> grpc.Channel:
        """The channel to the daemon in use."""
        return self.endpoints.channel()

    def _fail_over(self, why: str) -> bool:
        """Move to the next daemon of the list (send loop); the control stream follows. False when
        there is only one."""
        if not self.endpoints.fail_over(why):
            return False
        self.control.cancel_watch()
        return True

    def _sharded(self, method: str, what: str) -> Any:
        """What an FSDP2 job (autobyte.fsdp) tells its registration: its memory budget
        (`memory_limits`), its groups (`shard_layout`), computed at each registration (after the
        first step its forward order is known). A scheduler job has neither: None. The
        registration goes on without it where it fails: the ranks still check their budget, the
        daemon still measures."""
        fn = getattr(self._optimizer, method, None)
        if fn is None:
            return None
        try:
            return fn()
        except Exception:
            log.warning("autobyte: cannot tell autobyted %s", what, exc_info=True)
            return None

    def _register(self, stub) -> tuple[str, int]:
        response = stub.Register(
            pb.RegisterRequest(
                job=self.job,
                rank=self.rank,
                world_size=self.world_size,
                backend=self._backend,
                engine=self._engine,
                model=self._fingerprint,
                config=config_to_proto(self._initial_config),
                client_version=__version__,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                instance_id=self._instance_id,
                data_parallel_rank=self.place.dp_rank,
                data_parallel_size=self.place.dp_size,
                data_parallel_leader=self.place.dp_leader,
                tuning_disabled=not self.tune,
                collective_latency_s=float(getattr(self._optimizer, "collective_latency_s", 0.0)),
                **memory_to_proto(self._sharded("memory_limits", "the memory budget")),
                **shard_layout_to_proto(self._sharded("shard_layout", "the job's FSDP2 groups")),
            ),
            timeout=RPC_TIMEOUT_S,
            metadata=self._metadata,
        )
        with self._cond:
            # A new stream starts from what the daemon holds; a request iterator of an earlier
            # stream that is still parked in gRPC sees the generation change and ends, unsent.
            self._generation += 1
            self._buffer.restart()
            self._yielded, self._final_at = 0, None
            self._cond.notify_all()
        self._ack(response.last_acked_seq)
        return response.session_id, self._generation

    def _batches(self, session_id: str, generation: int):
        """Request iterator of the metrics stream (runs on a gRPC thread). Sends a batch when
        MAX_BATCH_SAMPLES are waiting, when the oldest unsent sample is `flush_interval_s` old, or
        when flush() asks; one wake-up per step would cost the training job CPU and GIL time."""
        while True:
            goodbye = None
            with self._cond:
                while not self._closed.is_set() and generation == self._generation:
                    unsent = self._unsent_count()
                    if unsent >= MAX_BATCH_SAMPLES or (
                        unsent and (self._flush_requested or time.monotonic() >= self._send_due)
                    ):
                        break
                    if not unsent and self._final_requested and self._final_at is None:
                        break
                    self._cond.wait(
                        max(0.01, min(0.5, self._send_due - time.monotonic())) if unsent else 0.5
                    )
                if self._closed.is_set() or generation != self._generation:
                    return
                if not self._unsent_count():  # shutting down and everything is sent: say goodbye
                    self._yielded += 1
                    self._final_at = self._yielded
                    goodbye = pb.MetricsBatch(
                        job=self.job, rank=self.rank, session_id=session_id, final=True
                    )
                else:
                    pending, previous_sent, in_flight = self._buffer.take_unsent(MAX_BATCH_SAMPLES)
                    self._send_due = time.monotonic() + self._flush_interval_s
            if goodbye is not None:
                goodbye.dropped_total = self.dropped_total
                yield goodbye
                continue
            cpu0 = time.thread_time()
            batch = pb.MetricsBatch(job=self.job, rank=self.rank, session_id=session_id)
            now = time.time()
            for seq, metrics, (host_load, link) in pending:
                try:
                    check_metrics(metrics, now)
                except ValueError as error:  # a broken measurement: never worth a refused batch
                    if self._buffer.count_invalid(seq):
                        log.warning("dropping step %d's sample: %s", metrics.step, error)
                    continue
                sample = metrics_to_proto(metrics, seq)
                if not sample.host_load:
                    sample.host_load = host_load
                self._add_link(sample, link)
                batch.samples.append(sample)
            batch.dropped_total = self.dropped_total
            self.background_cpu_s += time.thread_time() - cpu0
            last = pending[-1][0]
            with self._cond:
                if self._final_requested and last == self._buffer.seq and batch.samples:
                    batch.final = True
                # The daemon acknowledges the highest seq it stored: make that ack cover the invalid
                # samples behind it, or those of a batch with nothing valid in it.
                if batch.samples and batch.samples[-1].seq != last:
                    self._buffer.cover(batch.samples[-1].seq, last)
                elif not batch.samples and in_flight:
                    self._buffer.cover(previous_sent, last)
            if batch.samples:
                with self._cond:
                    self._buffer.sent(last)
                    self._yielded += 1
                    if batch.final:
                        self._final_at = self._yielded
                yield batch
            elif not in_flight:
                self._ack(last)

    def _unsent_count(self) -> int:
        return self._buffer.unsent_count()

    def _send_loop(self) -> None:
        attempt = 0
        failed_in_a_row = 0  # daemons of the list that failed one after the other
        while not self._closed.is_set():
            channel = self.channel()
            telemetry = pb_grpc.TelemetryStub(channel)
            control = pb_grpc.ControlStub(channel)
            try:
                session_id, generation = self._register(telemetry)
            except grpc.RpcError as error:
                if self._closed.is_set():
                    break
                if error.code() in PERMANENT_REFUSALS:
                    self._unreachable_since = None  # a daemon answered: a refusal warns itself
                    self._refusal(error)
                    self._closed.wait(REFUSED_RETRY_S * random.uniform(0.8, 1.0))
                    continue
                log.debug(
                    "registration with %s failed: %s %s",
                    self.address,
                    error.code(),
                    error.details(),
                )
                self._unreachable_for(error)
                failed_in_a_row += 1
                if self._fail_over(error.code().name) and failed_in_a_row < len(self.addresses):
                    continue  # the next daemon at once; a back-off once every one of them failed
                failed_in_a_row = 0
                attempt += 1
                self.backoff(attempt)
                continue
            failed_in_a_row = 0
            self._unreachable_since = None
            log.debug("registered with %s as job %r rank %s", self.address, self.job, self.rank)
            if self._refused:
                self._refused = False
                log.warning(
                    "autobyted at %s accepted job %r rank %s after all; streaming resumes",
                    self.address,
                    self.job,
                    self.rank,
                )
            self.connected.set()
            attempt = 0
            acks = 0
            try:
                self.control.flush_reports(control)
                for ack in telemetry.StreamMetrics(
                    self._batches(session_id, generation), metadata=self._metadata
                ):
                    cpu0 = time.thread_time()
                    self.control.flush_reports(control)  # before the ack wakes flush()
                    acks += 1
                    with self._cond:
                        if self._final_at is not None and acks >= self._final_at:
                            self._final_acked = True
                    self._ack(ack.acked_seq)
                    self.background_cpu_s += time.thread_time() - cpu0
            except grpc.RpcError as error:
                release_call(error)
                wait_s = _retry_after_s(error)
                if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    self._drop_rejected(error.details())
                elif wait_s is not None:
                    # The daemon is overloaded and said for how long: keep every sample, wait that
                    # long (the refused batch was not stored; it is sent again after registering).
                    log.debug("autobyted is busy (%s); retrying in %.2fs", error.details(), wait_s)
                    self.connected.clear()
                    self._closed.wait(wait_s * random.uniform(1.0, 1.2))
                    attempt = 0
                    continue
                elif not self._closed.is_set():
                    log.debug(
                        "telemetry stream to %s ended: %s %s",
                        self.address,
                        error.code(),
                        error.details(),
                    )
                    # Whatever stored what was acknowledged, the next daemon knows it (one database):
                    # move on at once and resend from there.
                    if self._fail_over(error.code().name):
                        self.connected.clear()
                        continue
            except Exception:  # never let the thread die: the training job must not notice
                log.exception("unexpected error in the autobyte telemetry thread")
            self.connected.clear()
            attempt += 1
            self.backoff(attempt)

    def _unreachable_for(self, error: grpc.RpcError) -> None:
        """A failed registration: once no daemon was reached for UNREACHABLE_WARN_S, warn the user
        once (a warning Python shows without any logging configured)."""
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
        elif not self._warned_unreachable and now - self._unreachable_since >= UNREACHABLE_WARN_S:
            self._warned_unreachable = True
            warn_user(
                f"autobyte metrics are not reaching a daemon: no autobyted at "
                f"{', '.join(self.addresses)} answered for {now - self._unreachable_since:.0f}s "
                f"(last: {error.code().name}). Start one (autobyted start) or point "
                "AUTOBYTE_DAEMON at it; training goes on and retries."
            )

    def _refusal(self, error: grpc.RpcError) -> None:
        """One WARNING per kind of refusal, saying why and what to do; DEBUG for every retry."""
        code = error.code()
        self._refused = True
        if code in self._warned_refusals:
            log.debug(
                "autobyted refused job %r rank %s again: %s [%s]",
                self.job,
                self.rank,
                error.details(),
                code.name,
            )
            return
        self._warned_refusals.add(code)
        warn_user(
            f"autobyte metrics are not reaching autobyted at {self.address}: it refused job "
            f"{self.job!r} rank {self.rank} ({code.name}: {error.details()}). To fix: "
            f"{PERMANENT_REFUSALS[code]}. Training goes on."
        )
        log.warning(
            "autobyted at %s refused to register job %r rank %s: %s [%s]. To fix: %s. Training goes "
            "on; step metrics wait in a bounded buffer (the oldest are dropped and counted) and "
            "registration is retried every %.0fs.",
            self.address,
            self.job,
            self.rank,
            error.details(),
            code.name,
            PERMANENT_REFUSALS[code],
            REFUSED_RETRY_S,
        )

    def _ack(self, seq: int) -> None:
        self._buffer.ack(seq)

    def _drop_rejected(self, reason: str) -> None:
        """The daemon refused a batch; later batches are resent after registering."""
        rejected = self._buffer.drop_rejected()
        log.warning("autobyted rejected %d samples (%s); dropped them", rejected, reason)

    # ------------------------------------------------------------------ lifecycle
    @property
    def dropped_total(self) -> int:
        """Samples that never reached the daemon: buffer overflow plus invalid or refused ones."""
        return self._buffer.dropped_total

    @property
    def acked_seq(self) -> int:
        return self._buffer.acked_seq

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every buffered sample is acknowledged; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._flush_requested = True
            self._cond.notify_all()
            while self._buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._flush_requested = False
                    return False
                self._cond.wait(remaining)
            self._flush_requested = False
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Shut down within timeout_s: wait (bounded) for the optimizer's last updates so that the
        last step's metrics exist, send everything buffered with a final batch (the daemon then
        marks this rank finished), stop the threads. Never raises."""
        if self._closed.is_set():
            return
        deadline = time.monotonic() + max(0.0, timeout_s)
        if self._optimizer is not None:
            self._record_last_steps(timeout_s / 2)
            self._finish(deadline - time.monotonic())
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        self._host_load.stop(timeout_s=0.1)
        self._links.stop(timeout_s=0.1)
        self.control.cancel_watch()
        self.endpoints.close()
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))

    def _record_last_steps(self, timeout_s: float) -> None:
        """A step's metrics exist once its updates landed; without this the last step of a run
        (whose updates land after its step() returned) would never be reported."""
        if timeout_s <= 0:
            return
        try:
            self._optimizer.synchronize(timeout_s=timeout_s)
        except Exception as error:  # noqa: BLE001 - closed already (then its close() reported every step), failed, slow
            log.debug("not waiting for the optimizer's last updates: %s", error)

    def _finish(self, timeout_s: float) -> bool:
        """Send what is buffered plus the final batch; True once the daemon acknowledged it."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._final_requested = self._flush_requested = True
            self._cond.notify_all()
            # Wait for the daemon only while it can answer: a refused or unreachable daemon gets
            # the buffered samples' chance (a reconnect) but not a wait for a goodbye it cannot ack.
            while not self._refused and (
                self._buffer or (self.connected.is_set() and not self._final_acked)
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True
