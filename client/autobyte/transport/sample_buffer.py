"""A rank's samples not yet acknowledged by the daemon: a bounded buffer in seq order with its
send/ack bookkeeping. The training thread appends (a few µs); the send loop takes batches and
applies acks. Every method expects `cond` held unless it says it takes it."""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Any

from autobyte.types import StepMetrics


class SampleBuffer:
    def __init__(self, capacity: int) -> None:
        # Guards this buffer; the send loop keeps its own stream state under it too and waits on it.
        self.cond = threading.Condition()
        # (seq, metrics, what the reporter's samplers read when the step ended), oldest first.
        self._samples: collections.deque[tuple[int, StepMetrics, Any]] = collections.deque()
        self._capacity = capacity
        self.seq = 0  # the last appended
        self.acked_seq = 0  # everything up to it is stored by the daemon
        self.sent_seq = 0  # everything up to it was handed to the current stream
        self.dropped_overflow = 0
        self.invalid = 0  # samples that failed check_metrics
        self._counted_invalid: set[int] = set()  # their seqs while buffered (each is counted once)
        self.rejected = 0  # samples in batches the daemon refused
        self._covers: dict[
            int, int
        ] = {}  # ack of seq k also acknowledges everything up to covers[k]
        self._in_flight: collections.deque[int] = (
            collections.deque()
        )  # last seq of each unacked batch

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def dropped_total(self) -> int:
        """Samples that never reached the daemon: overflow plus invalid or refused ones."""
        return self.dropped_overflow + self.invalid + self.rejected

    def append(self, metrics: StepMetrics, context: Any) -> int:
        """Buffer a sample under the next seq (the oldest is dropped and counted when full); returns
        how many samples are unsent."""
        self.seq += 1
        if len(self._samples) >= self._capacity:
            self._samples.popleft()
            self.dropped_overflow += 1
        self._samples.append((self.seq, metrics, context))
        return self.seq - self.sent_seq

    def restart(self) -> None:
        """A new stream: it resends everything after what the daemon acknowledged."""
        self._covers.clear()
        self._in_flight.clear()
        self.sent_seq = self.acked_seq

    def unsent_count(self) -> int:
        return self._samples[-1][0] - self.sent_seq if self._samples else 0

    def take_unsent(self, limit: int) -> tuple[list[tuple[int, StepMetrics, Any]], int, bool]:
        """The next (at most `limit`) unsent samples, now counted as sent; with the seq sent before
        them and whether a batch sent before them is still unacknowledged."""
        offset = max(0, self.sent_seq - self._samples[0][0] + 1)
        pending = list(itertools.islice(self._samples, offset, offset + limit))
        previous_sent, in_flight = self.sent_seq, self.sent_seq > self.acked_seq
        self.sent_seq = pending[-1][0]
        return pending, previous_sent, in_flight

    def count_invalid(self, seq: int) -> bool:
        """Count a sample that failed check_metrics once, however often it is resent; True the first time."""
        if seq in self._counted_invalid:
            return False
        self._counted_invalid.add(seq)
        self.invalid += 1
        return True

    def cover(self, acked_seq: int, up_to_seq: int) -> None:
        """An ack of acked_seq will also acknowledge everything up to up_to_seq (samples left out of a batch)."""
        self._covers[acked_seq] = up_to_seq

    def sent(self, last_seq: int) -> None:
        """A batch ending at last_seq went out."""
        self._in_flight.append(last_seq)

    def ack(self, seq: int) -> None:
        """The daemon stored everything up to seq (takes cond)."""
        with self.cond:
            while seq in self._covers:
                seq = max(seq, self._covers.pop(seq))
            self.acked_seq = max(self.acked_seq, seq)
            while self._samples and self._samples[0][0] <= self.acked_seq:
                self._samples.popleft()
            while self._in_flight and self._in_flight[0] <= self.acked_seq:
                self._in_flight.popleft()
            if self._counted_invalid:
                self._counted_invalid = {s for s in self._counted_invalid if s > self.acked_seq}
            self.cond.notify_all()

    def drop_rejected(self) -> int:
        """The daemon refused the oldest unacknowledged batch (acks come in order): drop it and count
        it, since a resend would be refused again; returns how many samples (takes cond)."""
        with self.cond:
            last = self._in_flight[0] if self._in_flight else self.acked_seq
            rejected = 0
            while self._samples and self._samples[0][0] <= last:
                self._samples.popleft()
                rejected += 1
            self.rejected += rejected
            self.acked_seq = max(self.acked_seq, last)
            self.cond.notify_all()
        return rejected
