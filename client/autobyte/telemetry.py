"""Client transport: streams each rank's step metrics to autobyted and applies its decisions.

The training thread only appends to a bounded buffer (a few µs); everything that touches the network
runs on background threads with timeouts, reconnects with backoff and jitter, and keeps the last good
configuration when the daemon is slow, down or wrong.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import itertools
import logging
import os
import random
import socket
import statistics
import threading
import time
import uuid
import warnings
import weakref
from typing import Any, NamedTuple

import grpc

from autobyte import __version__, jobid
from autobyte.channel import (RETRY_AFTER_KEY, auth_metadata, daemon_address, daemon_addresses, daemon_token,
                              open_channel)
from autobyte.convert import config_from_proto, config_to_proto, metrics_to_proto
from autobyte.hostload import HostLoadSampler
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.protocol import autobyte_pb2_grpc as pb_grpc
from autobyte.types import MAX_WORLD_SIZE, Config, StepMetrics, check_metrics

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

RPC_TIMEOUT_S = 5.0
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

_lock = threading.Lock()
_reporter: "Reporter | None" = None


def warn_user(message: str) -> None:
    """What a user must act on and would otherwise never see (STYLE 7): a warning, beside the log."""
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    log.debug("warned: %s", message)
_atexit_registered = False


def init(daemon: str | None = None, job: str | None = None, token: str | None = None, *,
         rank: int | None = None, world_size: int | None = None, buffer_samples: int = 10_000,
         tls_ca: str | None = None, flush_interval_s: float = 1.0, tune: bool = True) -> "Reporter":
    """Connect this process to autobyted. Every ScheduledOptimizer created afterwards (and any already
    created) streams its step metrics and accepts the daemon's configurations. Defaults come from
    AUTOBYTE_DAEMON, AUTOBYTE_JOB (else torchrun's --rdzv-id, else an id derived from the torchrun
    launch, the same on every rank: `autobyte.jobid`), AUTOBYTE_TOKEN, RANK and WORLD_SIZE;
    without RANK/WORLD_SIZE they come from the optimizer's process group. Never blocks on the network.
    `daemon` may list several daemons that share one database ("host1:7077,host2:7077"): a rank
    starts with the (rank mod N)-th and moves on to the next whenever the one it uses fails.
    `tune=False` keeps the daemon's tuner away from this job (it still records and shows it; an
    operator's `autobyte propose` still applies)."""
    global _reporter
    # torchrun's run id is "none" unless --rdzv-id is given: then one is derived from the launch
    job = jobid.job_id_for(job, os.environ)
    if rank is None and "RANK" in os.environ:
        rank = int(os.environ["RANK"])
    if world_size is None and "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
    if rank is not None and world_size is not None and (world_size < 1 or not 0 <= rank < world_size):
        raise ValueError(f"rank {rank} is not within world size {world_size}")
    if world_size is not None and world_size > MAX_WORLD_SIZE:
        raise ValueError(f"world size {world_size} exceeds autobyted's limit of {MAX_WORLD_SIZE}")
    if buffer_samples < 1:
        raise ValueError(f"buffer_samples={buffer_samples} must be positive")
    if not 0 < flush_interval_s <= 60:
        raise ValueError(f"flush_interval_s={flush_interval_s} must be in (0, 60] seconds")
    daemon_addresses(daemon)  # ValueError for a malformed address, before anything starts
    with _lock:
        if _reporter is not None:
            _reporter.close()
        _reporter = Reporter(daemon_address(daemon), job, rank, world_size, daemon_token(token),
                             buffer_samples, tls_ca, flush_interval_s, tune)
        for optimizer in list(_pending_optimizers):
            _reporter.attach(optimizer)
        global _atexit_registered
        if not _atexit_registered:
            atexit.register(shutdown)  # a short, bounded flush when the training script ends
            _atexit_registered = True
        return _reporter


def shutdown(timeout_s: float = 2.0) -> None:
    """Record the last steps, flush what can be flushed within timeout_s, tell the daemon this rank
    is finished, and stop the background threads. Runs at exit by itself; call it after the last
    `step()` (never concurrently with one). Never raises, never waits longer than timeout_s."""
    global _reporter
    with _lock:
        if _reporter is not None:
            _reporter.close(timeout_s)
            _reporter = None


_pending_optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()


def on_optimizer_created(optimizer) -> None:
    """Called by ScheduledOptimizer's constructor; attaches it if init() was called."""
    _pending_optimizers.add(optimizer)
    reporter = _reporter
    if reporter is not None:
        reporter.attach(optimizer)


def model_fingerprint(parameters) -> pb.ModelFingerprint:
    sizes, digest = [], hashlib.sha256()
    count = 0
    for p in parameters:
        sizes.append(p.numel() * p.element_size())
        count += p.numel()
        digest.update(f"{tuple(p.shape)}:{p.dtype};".encode())
    return pb.ModelFingerprint(parameter_count=count, parameter_bytes=sum(sizes), tensor_count=len(sizes),
                               largest_tensor_bytes=max(sizes, default=0),
                               median_tensor_bytes=int(statistics.median(sizes)) if sizes else 0,
                               digest=digest.hexdigest()[:32])


def _retry_after_s(error: grpc.RpcError) -> float | None:
    """The wait a RESOURCE_EXHAUSTED answer asks for (trailing metadata `retry-after-ms`), else None."""
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    try:
        metadata = dict(error.trailing_metadata() or ())
        return min(RETRY_AFTER_MAX_S, max(0.0, int(metadata[RETRY_AFTER_KEY]) / 1e3))
    except (KeyError, TypeError, ValueError):
        return None


class RankPlace(NamedTuple):
    """Where a process sits: its job-wide rank (identity) and its place in its data-parallel group."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    dp_leader: int


def _place_of(optimizer, rank: int | None, world_size: int | None) -> RankPlace:
    """The job-wide rank and world size (the default group's) unless given (or set by RANK/
    WORLD_SIZE), and the rank within the optimizer's data-parallel group."""
    dp_rank = dp_size = dp_leader = None
    try:
        import torch.distributed as dist

        group = getattr(optimizer, "process_group", None)
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
            dp_rank, dp_size = dist.get_rank(group), dist.get_world_size(group)
            dp_leader = dist.get_global_rank(group, 0) if group is not None else 0
    except Exception:  # a transport that is not torch.distributed
        pass
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if dp_rank is None or dp_rank < 0:
        dp_rank, dp_size, dp_leader = rank, world_size, 0
    return RankPlace(rank, world_size, dp_rank, dp_size, dp_leader)


def _backend_of(optimizer) -> str:
    try:
        import torch.distributed as dist

        return str(dist.get_backend(getattr(optimizer, "process_group", None)))
    except Exception:  # not initialised, or a transport that is not torch.distributed
        return "unknown"


class Reporter:
    """Per-process connection to the daemon for one (job, rank)."""

    def __init__(self, address: str, job: str, rank: int | None, world_size: int | None, token: str | None,
                 buffer_samples: int, tls_ca: str | None = None, flush_interval_s: float = 1.0,
                 tune: bool = True) -> None:
        self.job, self.rank, self.world_size = job, rank, world_size
        # Daemons sharing one database, any of which serves this rank: the one in use is
        # addresses[_endpoint]; the send loop moves to the next when it fails (never the training thread).
        self.addresses = daemon_addresses(address)
        self._endpoint = 0
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        self.failovers = 0  # moves to another address after a failure
        self.tune = tune
        self.place: RankPlace | None = None  # known once a ScheduledOptimizer is attached
        self._metadata = auth_metadata(token)
        self._tls_ca = tls_ca
        self._instance_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # (seq, metrics, host load when the step ended): the scheduler leaves StepMetrics.host_load
        # at 0.0 (unknown); the reporter's sampler (autobyte.hostload) supplies it.
        self._buffer: collections.deque[tuple[int, StepMetrics, float]] = collections.deque()
        self._host_load = HostLoadSampler()
        self._capacity = buffer_samples
        self._flush_interval_s = flush_interval_s
        self._send_due = 0.0
        self._flush_requested = False
        self._cond = threading.Condition()
        self._seq = 0
        self._acked_seq = 0
        self._sent_seq = 0
        self._dropped_overflow = 0
        self._invalid = 0  # samples that failed check_metrics
        self._counted_invalid: set[int] = set()  # their seqs while buffered (each is counted once)
        self._rejected = 0  # samples in batches the daemon refused
        self._covers: dict[int, int] = {}  # ack of seq k also acknowledges everything up to covers[k]
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
        self._in_flight: collections.deque[int] = collections.deque()  # last seq of each unacked batch
        # CPU seconds the background threads spent on this reporter's own work (conversion, acks);
        # gRPC's internal threads are not counted.
        self.background_cpu_s = 0.0
        self._closed = threading.Event()
        self._optimizer = None
        self._fingerprint: pb.ModelFingerprint | None = None
        self._backend = "unknown"
        self._initial_config = Config()
        # Decisions: the control thread hands them to the scheduler; the step callback sees them land.
        self._last_update_id = 0
        self._decision_id = 0
        self._reports: collections.deque[pb.ReportConfigRequest] = collections.deque(maxlen=100)
        self.connected = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch_stream = None

    # ------------------------------------------------------------------ training thread
    def attach(self, optimizer) -> None:
        if self._optimizer is not None:
            if self._optimizer is not optimizer:
                log.warning("autobyte reports one ScheduledOptimizer per process; ignoring another one")
            return
        self._optimizer = optimizer
        self.place = _place_of(optimizer, self.rank, self.world_size)
        self.rank, self.world_size = self.place.rank, self.place.world_size
        self._fingerprint = model_fingerprint(optimizer.model.parameters())
        self._backend = _backend_of(optimizer)
        self._initial_config = optimizer.config
        optimizer.add_step_callback(self.on_step)
        self._endpoint = self.place.rank % len(self.addresses)  # ranks spread over the daemons
        self._threads = [threading.Thread(target=self._send_loop, name="autobyte-telemetry", daemon=True)]
        if self.place.dp_rank == 0:  # every data-parallel group's leader decides for its group
            self._threads.append(threading.Thread(target=self._watch_loop, name="autobyte-control", daemon=True))
        for thread in self._threads:
            thread.start()
        self._host_load.start()

    def on_step(self, metrics: StepMetrics) -> None:
        """Step callback (training thread): buffer the sample and note a decision that took effect."""
        if self._closed.is_set():
            return
        with self._cond:
            self._seq += 1
            if len(self._buffer) >= self._capacity:
                self._buffer.popleft()
                self._dropped_overflow += 1
            self._buffer.append((self._seq, metrics, self._host_load.value))
            if self._seq - self._sent_seq >= MAX_BATCH_SAMPLES:
                self._cond.notify()
        if metrics.decision_id != self._decision_id:  # a decision took effect at this step
            self._decision_id = metrics.decision_id
            self._reports.append(pb.ReportConfigRequest(job=self.job, rank=self.rank,
                                                        decision_id=metrics.decision_id,
                                                        config=config_to_proto(metrics.config),
                                                        applied_at_step=metrics.step))

    def _apply(self, decision_id: int, config: Config, apply_at_step: int) -> None:
        """Hand a decision to the scheduler (control thread); it takes effect at the step boundary
        it names, or the next one if that has passed. Rank 0 decides for every rank."""
        try:
            self._optimizer.reconfigure(partition_bytes=config.partition_bytes, credit_bytes=config.credit_bytes,
                                        decision_id=decision_id, at_step=apply_at_step)
        except Exception as error:  # keep the last good configuration
            log.warning("decision %d (%s) not applied: %s", decision_id, config.describe(), error)

    # ------------------------------------------------------------------ background threads
    def _backoff(self, attempt: int) -> None:
        delay = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** min(attempt, 10))
        self._closed.wait(delay * random.uniform(0.5, 1.0))

    @property
    def address(self) -> str:
        """The daemon this rank uses now."""
        return self.addresses[self._endpoint]

    def _channel(self) -> grpc.Channel:
        """The channel to the daemon in use (opened once per address, closed by close())."""
        address = self.address
        with self._channels_lock:
            if address not in self._channels:
                self._channels[address] = open_channel(address, self._tls_ca)
            return self._channels[address]

    def _fail_over(self, why: str) -> bool:
        """Move to the next daemon of the list (send loop); the control stream follows. False when
        there is only one."""
        if len(self.addresses) == 1:
            return False
        previous = self.address
        self._endpoint = (self._endpoint + 1) % len(self.addresses)
        self.failovers += 1
        log.debug("autobyted at %s failed (%s); moving to %s", previous, why, self.address)
        stream = self._watch_stream
        if stream is not None:
            stream.cancel()
        return True

    def _register(self, stub) -> tuple[str, int]:
        response = stub.Register(pb.RegisterRequest(
            job=self.job, rank=self.rank, world_size=self.world_size, backend=self._backend,
            model=self._fingerprint, config=config_to_proto(self._initial_config), client_version=__version__,
            hostname=socket.gethostname(), pid=os.getpid(), instance_id=self._instance_id,
            data_parallel_rank=self.place.dp_rank, data_parallel_size=self.place.dp_size,
            data_parallel_leader=self.place.dp_leader, tuning_disabled=not self.tune),
            timeout=RPC_TIMEOUT_S, metadata=self._metadata)
        with self._cond:
            # A new stream starts from what the daemon holds; a request iterator of an earlier
            # stream that is still parked in gRPC sees the generation change and ends, unsent.
            self._generation += 1
            self._covers.clear()
            self._in_flight.clear()
            self._sent_seq = self._acked_seq
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
                    if unsent >= MAX_BATCH_SAMPLES or (unsent and (self._flush_requested or
                                                                   time.monotonic() >= self._send_due)):
                        break
                    if not unsent and self._final_requested and self._final_at is None:
                        break
                    self._cond.wait(max(0.01, min(0.5, self._send_due - time.monotonic())) if unsent else 0.5)
                if self._closed.is_set() or generation != self._generation:
                    return
                if not self._unsent_count():  # shutting down and everything is sent: say goodbye
                    self._yielded += 1
                    self._final_at = self._yielded
                    goodbye = pb.MetricsBatch(job=self.job, rank=self.rank, session_id=session_id, final=True)
                else:
                    offset = max(0, self._sent_seq - self._buffer[0][0] + 1)
                    pending = list(itertools.islice(self._buffer, offset, offset + MAX_BATCH_SAMPLES))
                    previous_sent, in_flight = self._sent_seq, self._sent_seq > self._acked_seq
                    self._sent_seq = pending[-1][0]
                    self._send_due = time.monotonic() + self._flush_interval_s
            if goodbye is not None:
                goodbye.dropped_total = self.dropped_total
                yield goodbye
                continue
            cpu0 = time.thread_time()
            batch = pb.MetricsBatch(job=self.job, rank=self.rank, session_id=session_id)
            now = time.time()
            for seq, metrics, host_load in pending:
                try:
                    check_metrics(metrics, now)
                except ValueError as error:  # a broken measurement: never worth a refused batch
                    if seq not in self._counted_invalid:
                        self._counted_invalid.add(seq)
                        self._invalid += 1
                        log.warning("dropping step %d's sample: %s", metrics.step, error)
                    continue
                sample = metrics_to_proto(metrics, seq)
                if not sample.host_load:
                    sample.host_load = host_load
                batch.samples.append(sample)
            batch.dropped_total = self.dropped_total
            self.background_cpu_s += time.thread_time() - cpu0
            last = pending[-1][0]
            with self._cond:
                if self._final_requested and last == self._seq and batch.samples:
                    batch.final = True
                # The daemon acknowledges the highest seq it stored: make that ack cover the invalid
                # samples behind it, or those of a batch with nothing valid in it.
                if batch.samples and batch.samples[-1].seq != last:
                    self._covers[batch.samples[-1].seq] = last
                elif not batch.samples and in_flight:
                    self._covers[previous_sent] = last
            if batch.samples:
                with self._cond:
                    self._in_flight.append(last)
                    self._yielded += 1
                    if batch.final:
                        self._final_at = self._yielded
                yield batch
            elif not in_flight:
                self._ack(last)

    def _unsent_count(self) -> int:
        return self._buffer[-1][0] - self._sent_seq if self._buffer else 0

    def _send_loop(self) -> None:
        attempt = 0
        failed_in_a_row = 0  # daemons of the list that failed one after the other
        while not self._closed.is_set():
            channel = self._channel()
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
                log.debug("registration with %s failed: %s %s", self.address, error.code(), error.details())
                self._unreachable_for(error)
                failed_in_a_row += 1
                if self._fail_over(error.code().name) and failed_in_a_row < len(self.addresses):
                    continue  # the next daemon at once; a back-off once every one of them failed
                failed_in_a_row = 0
                attempt += 1
                self._backoff(attempt)
                continue
            failed_in_a_row = 0
            self._unreachable_since = None
            log.debug("registered with %s as job %r rank %s", self.address, self.job, self.rank)
            if self._refused:
                self._refused = False
                log.warning("autobyted at %s accepted job %r rank %s after all; streaming resumes",
                            self.address, self.job, self.rank)
            self.connected.set()
            attempt = 0
            acks = 0
            try:
                self._flush_reports(control)
                for ack in telemetry.StreamMetrics(self._batches(session_id, generation), metadata=self._metadata):
                    cpu0 = time.thread_time()
                    self._flush_reports(control)  # before the ack wakes flush()
                    acks += 1
                    with self._cond:
                        if self._final_at is not None and acks >= self._final_at:
                            self._final_acked = True
                    self._ack(ack.acked_seq)
                    self.background_cpu_s += time.thread_time() - cpu0
            except grpc.RpcError as error:
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
                    log.debug("telemetry stream to %s ended: %s %s", self.address, error.code(), error.details())
                    # Whatever stored what was acknowledged, the next daemon knows it (one database):
                    # move on at once and resend from there.
                    if self._fail_over(error.code().name):
                        self.connected.clear()
                        continue
            except Exception:  # never let the thread die: the training job must not notice
                log.exception("unexpected error in the autobyte telemetry thread")
            self.connected.clear()
            attempt += 1
            self._backoff(attempt)

    def _unreachable_for(self, error: grpc.RpcError) -> None:
        """A failed registration: once no daemon was reached for UNREACHABLE_WARN_S, warn the user
        once (a warning Python shows without any logging configured)."""
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
        elif not self._warned_unreachable and now - self._unreachable_since >= UNREACHABLE_WARN_S:
            self._warned_unreachable = True
            warn_user(f"autobyte metrics are not reaching a daemon: no autobyted at "
                      f"{', '.join(self.addresses)} answered for {now - self._unreachable_since:.0f}s "
                      f"(last: {error.code().name}). Start one (autobyted start) or point "
                      "AUTOBYTE_DAEMON at it; training goes on and retries.")

    def _refusal(self, error: grpc.RpcError) -> None:
        """One WARNING per kind of refusal, saying why and what to do; DEBUG for every retry."""
        code = error.code()
        self._refused = True
        if code in self._warned_refusals:
            log.debug("autobyted refused job %r rank %s again: %s [%s]", self.job, self.rank, error.details(),
                      code.name)
            return
        self._warned_refusals.add(code)
        warn_user(f"autobyte metrics are not reaching autobyted at {self.address}: it refused job "
                  f"{self.job!r} rank {self.rank} ({code.name}: {error.details()}). To fix: "
                  f"{PERMANENT_REFUSALS[code]}. Training goes on.")
        log.warning("autobyted at %s refused to register job %r rank %s: %s [%s]. To fix: %s. Training goes "
                    "on; step metrics wait in a bounded buffer (the oldest are dropped and counted) and "
                    "registration is retried every %.0fs.", self.address, self.job, self.rank, error.details(),
                    code.name, PERMANENT_REFUSALS[code], REFUSED_RETRY_S)

    def _ack(self, seq: int) -> None:
        with self._cond:
            while seq in self._covers:
                seq = max(seq, self._covers.pop(seq))
            self._acked_seq = max(self._acked_seq, seq)
            while self._buffer and self._buffer[0][0] <= self._acked_seq:
                self._buffer.popleft()
            while self._in_flight and self._in_flight[0] <= self._acked_seq:
                self._in_flight.popleft()
            if self._counted_invalid:
                self._counted_invalid = {s for s in self._counted_invalid if s > self._acked_seq}
            self._cond.notify_all()

    def _drop_rejected(self, reason: str) -> None:
        """The daemon refused a batch (acks come in order: the oldest unacknowledged one). Resending
        it would be refused again, so drop it, count it; later batches are resent after registering."""
        with self._cond:
            last = self._in_flight[0] if self._in_flight else self._acked_seq
            rejected = 0
            while self._buffer and self._buffer[0][0] <= last:
                self._buffer.popleft()
                rejected += 1
            self._rejected += rejected
            self._acked_seq = max(self._acked_seq, last)
            self._cond.notify_all()
        log.warning("autobyted rejected %d samples (%s); dropped them", rejected, reason)

    def _flush_reports(self, control) -> None:
        while self._reports:
            request = self._reports[0]
            try:
                control.ReportConfig(request, timeout=RPC_TIMEOUT_S, metadata=self._metadata)
            except grpc.RpcError as error:
                if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise  # transient: the send loop reconnects and tries again
                log.warning("autobyted refused the report of decision %d: %s", request.decision_id,
                            error.details())
            self._reports.popleft()

    def _watch_loop(self) -> None:
        attempt = 0
        while not self._closed.is_set():
            opened = time.monotonic()
            try:
                self.connected.wait(1.0)
                if not self.connected.is_set():
                    continue
                # The daemon the send loop registered with; _fail_over cancels this stream to follow.
                control = pb_grpc.ControlStub(self._channel())
                stream = control.WatchConfig(pb.WatchConfigRequest(job=self.job, rank=self.rank,
                                                                   after_decision_id=self._last_update_id),
                                             metadata=self._metadata)
                self._watch_stream = stream
                opened = time.monotonic()
                for update in stream:
                    attempt = 0
                    if update.decision_id <= self._last_update_id:
                        continue  # already handed over (a daemon replaying after a move): never twice
                    try:
                        config = config_from_proto(update.config)
                    except ValueError as error:
                        log.warning("ignoring decision %d from the daemon: %s", update.decision_id, error)
                        continue
                    self._last_update_id = update.decision_id
                    self._apply(update.decision_id, config, update.apply_at_step)
            except grpc.RpcError as error:
                if time.monotonic() - opened > 5.0:
                    attempt = 0  # it was a working stream that broke, not a failing one
                if not self._closed.is_set():
                    log.debug("control stream ended: %s %s", error.code(), error.details())
            except Exception:
                log.exception("unexpected error in the autobyte control thread")
            attempt += 1
            self._backoff(attempt)

    # ------------------------------------------------------------------ lifecycle
    @property
    def dropped_total(self) -> int:
        """Samples that never reached the daemon: buffer overflow plus invalid or refused ones."""
        return self._dropped_overflow + self._invalid + self._rejected

    @property
    def acked_seq(self) -> int:
        return self._acked_seq

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
        stream = self._watch_stream
        if stream is not None:
            stream.cancel()
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))

    def _record_last_steps(self, timeout_s: float) -> None:
        """A step's metrics exist once its updates landed; without this the last step of a run
        (whose updates land after its step() returned) would never be reported."""
        if timeout_s <= 0:
            return
        try:
            self._optimizer.synchronize(timeout_s=timeout_s)
        except Exception as error:  # closed already (then its close() reported every step), failed, slow
            log.debug("not waiting for the optimizer's last updates: %s", error)

    def _finish(self, timeout_s: float) -> bool:
        """Send what is buffered plus the final batch; True once the daemon acknowledged it."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._final_requested = self._flush_requested = True
            self._cond.notify_all()
            # Wait for the daemon only while it can answer: a refused or unreachable daemon gets
            # the buffered samples' chance (a reconnect) but not a wait for a goodbye it cannot ack.
            while not self._refused and (self._buffer or (self.connected.is_set() and not self._final_acked)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True
