"""Validation of incoming samples and the writer thread that stores them in batched transactions."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time

from autobyte.convert import metrics_from_proto
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.types import check_metrics

from autobyted.errors import InvalidArgument, Overloaded, StorageError
from autobyted.storage.base import BaseStorage
from autobyted.storage.records import SampleBatch

log = logging.getLogger(__name__)


def check_text_fields(message) -> None:
    """InvalidArgument when a top-level string field holds a NUL character: no database stores one
    in a text column (PostgreSQL refuses it), so it is a bad request, never a database error."""
    for field, value in message.ListFields():
        if field.type == field.TYPE_STRING and any(
            "\x00" in text for text in (value if isinstance(value, str) else tuple(value))
        ):
            raise InvalidArgument(f"{field.name} must not contain NUL characters")


def validate_batch(batch: pb.MetricsBatch, max_samples: int) -> SampleBatch:
    """A clean SampleBatch, or InvalidArgument naming the first bad value. Nothing is stored
    from a batch with one bad sample."""
    check_text_fields(batch)
    if not batch.job:
        raise InvalidArgument("metrics batch without a job id")
    if not batch.session_id:
        raise InvalidArgument("metrics batch without a session id: call Register first")
    if len(batch.samples) > max_samples:
        raise InvalidArgument(
            f"batch of {len(batch.samples)} samples exceeds the limit of {max_samples}; "
            "send smaller batches"
        )
    if not 0 <= batch.dropped_total <= 1 << 50:
        raise InvalidArgument(f"dropped_total={batch.dropped_total} is outside [0, 2^50]")
    now = time.time()
    samples = []
    previous_seq = 0
    for index, message in enumerate(batch.samples):
        where = f"sample {index} (seq {message.seq}) of job {batch.job!r} rank {batch.rank}"
        if message.seq <= previous_seq:
            raise InvalidArgument(f"{where}: seq must start at 1 and increase within a batch")
        previous_seq = message.seq
        try:
            seq, metrics = metrics_from_proto(message)
            check_metrics(metrics, now)
        except ValueError as error:
            raise InvalidArgument(f"{where}: {error}") from None
        samples.append((seq, metrics))
    return SampleBatch(
        job=batch.job,
        rank=batch.rank,
        session_id=batch.session_id,
        samples=tuple(samples),
        dropped_total=batch.dropped_total,
        final=batch.final,
    )


# Bounds of the retry hint given with a refused batch.
RETRY_AFTER_MIN_MS = 200
RETRY_AFTER_MAX_MS = 10_000


class IngestWriter:
    """One thread owns sample writes: every batch waiting when it wakes goes into one transaction.
    `submit` returns a future of the stored high-water seq (-1: stale session). At most
    `max_queued_rows` samples wait; beyond that `submit` raises Overloaded with a retry hint (the
    time the writer needs to catch up), so a slow database pushes back instead of filling memory."""

    _STOP = object()

    def __init__(
        self,
        storage: BaseStorage,
        max_rows: int = 20_000,
        on_written=None,
        max_queued_rows: int = 200_000,
        on_jobs=None,
    ) -> None:
        self._storage = storage
        self._max_rows = max_rows
        self._max_queued_rows = max_queued_rows
        self._queue: queue.Queue = queue.Queue()
        self._queued_rows = 0
        self._count_lock = threading.Lock()
        self._rows_per_s: float | None = None  # smoothed write rate
        self._write_started: float | None = None  # monotonic start of the write in progress
        self._thread = threading.Thread(target=self._run, name="autobyted-writer", daemon=True)
        self._on_written = on_written
        self._on_jobs = on_jobs  # called with the names of the jobs a write stored samples of
        self._closed = False

    def start(self) -> None:
        self._thread.start()

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    def submit(self, batch: SampleBatch) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed:
            future.set_exception(StorageError("autobyted is shutting down; the client reconnects"))
            return future
        rows = len(batch.samples)
        with self._count_lock:
            if self._queued_rows and self._queued_rows + rows > self._max_queued_rows:
                raise Overloaded(
                    f"autobyted's write queue is full ({self._queued_rows} samples wait for "
                    "the database)",
                    self.retry_after_ms(),
                )
            self._queued_rows += rows
        self._queue.put((batch, future))
        return future

    def retry_after_ms(self) -> int:
        """How long the queue needs to drain: queued rows at the recent write rate, and at least as
        long as the write in progress has already taken (a stalled database)."""
        estimate_s = self._queued_rows / self._rows_per_s if self._rows_per_s else 1.0
        started = self._write_started
        if started is not None:
            estimate_s = max(estimate_s, time.monotonic() - started)
        return int(min(RETRY_AFTER_MAX_MS, max(RETRY_AFTER_MIN_MS, estimate_s * 1e3)))

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush everything submitted so far, then stop."""
        self._closed = True
        self._queue.put(self._STOP)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            item = self._queue.get()
            if item is self._STOP:
                break
            pending = [item]
            rows = len(item[0].samples)
            while rows < self._max_rows:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is self._STOP:
                    stopping = True
                    break
                pending.append(item)
                rows += len(item[0].samples)
            for _, future in pending:
                # From here a stream that goes away can no longer cancel its future. A batch whose
                # stream went away before is written all the same (a resend is deduplicated by seq).
                future.set_running_or_notify_cancel()
            try:
                self._write(pending)
            except Exception:  # never let the writer die: every stream of every job depends on it
                log.exception("unexpected error in the writer thread")

    def _write(self, pending) -> None:
        rows = sum(len(batch.samples) for batch, _ in pending)
        self._write_started = started = time.monotonic()
        try:
            acked = self._storage.append_samples([batch for batch, _ in pending])
        except Exception as error:  # noqa: BLE001 - the stream handlers report it; the writer keeps going
            log.error("writing %d batches failed: %s", len(pending), error)
            for _, future in pending:
                if not future.cancelled():
                    future.set_exception(error)
            return
        finally:
            self._write_started = None
            with self._count_lock:
                self._queued_rows -= rows
        if rows:
            rate = rows / max(time.monotonic() - started, 1e-3)
            self._rows_per_s = (
                rate if self._rows_per_s is None else 0.7 * self._rows_per_s + 0.3 * rate
            )
        for (_, future), seq in zip(pending, acked):
            if not future.cancelled():
                future.set_result(seq)
        if self._on_written is not None:
            self._on_written(sum(len(b.samples) for b, _ in pending))
        if self._on_jobs is not None:
            self._on_jobs({batch.job for batch, _ in pending})
