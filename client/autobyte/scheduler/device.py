"""Ordering between the scheduler's threads on the device: a no-op on CPU, CUDA streams and events on
a GPU.

On CPU every operation is complete when it returns, and gloo completes a work's future when the data is
reduced. On CUDA neither holds:
* NCCL completes a work's future when the collective is *enqueued*: credit returned there would let
  the whole step's bytes in flight at once. `watch()` polls `work.is_completed()` (a CUDA event
  query) on a thread of its own and reports completion in issue order.
* The gradient copy runs on the backward pass's stream; the collective must be ordered after it:
  the copy records an event, the dispatch thread's stream waits for it before issuing.
* The update thread runs on a stream of its own (`work.wait()` there makes only that stream wait for
  the collective, never the default stream that the next forward runs on); each update batch
  records an event, and a read of a parameter makes the reader's current stream wait for it, once
  per parameter and step — an asynchronous wait, no host synchronisation.
Untested here (no GPU): this path is exercised by tests/test_scheduler_cuda.py where a GPU exists.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


class DeviceSync:
    """CPU: nothing to order."""

    cuda = False

    def after_grad_copy(self, i: int) -> None:
        pass

    def issue_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def before_issue(self, params: Sequence[int]) -> None:
        pass

    def watch(self, work: Any, done: Callable[[BaseException | None], None]) -> None:
        def callback(future: Any) -> None:
            try:
                future.value()
            except BaseException as error:  # noqa: BLE001 - handed to done(), which surfaces it in the training thread
                done(error)
                return
            done(None)

        work.get_future().add_done_callback(callback)

    def update_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_update(self, idxs: Sequence[int]) -> None:
        pass

    def before_read(self, idxs: Sequence[int], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class CudaSync(DeviceSync):
    cuda = True

    def __init__(self, device: torch.device, n: int) -> None:
        self.device = device
        self.issue_stream = torch.cuda.Stream(device)
        self.update_stream = torch.cuda.Stream(device)
        self.grad_events: list[Any] = [None] * n
        self.ready_events: list[Any] = [None] * n
        self.waited_step = [-1] * n
        self._inflight: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._poller = threading.Thread(target=self._poll, name="autobyte-completion", daemon=True)
        self._poller.start()

    def after_grad_copy(self, i: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.grad_events[i] = event

    def issue_context(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.issue_stream)

    def before_issue(self, params: Sequence[int]) -> None:
        stream = torch.cuda.current_stream(self.device)
        for i in params:
            event = self.grad_events[i]
            if event is not None:
                stream.wait_event(event)

    def watch(self, work: Any, done: Callable[[BaseException | None], None]) -> None:
        with self._cond:
            self._inflight.append((work, done))
            self._cond.notify()

    def _poll(self) -> None:
        pause = 20e-6
        while True:
            with self._cond:
                while not self._inflight and not self._closed:
                    self._cond.wait()
                if self._closed and not self._inflight:
                    return
                work, done = self._inflight[0]
            try:
                finished = work.is_completed()
            except BaseException as error:  # noqa: BLE001 - handed to done(), which surfaces it in the training thread
                with self._cond:
                    self._inflight.popleft()
                done(error)
                continue
            if finished:
                with self._cond:
                    self._inflight.popleft()
                done(None)
                pause = 20e-6
            else:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)

    def update_context(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.update_stream)

    def after_update(self, idxs: Sequence[int]) -> None:
        event = torch.cuda.Event()
        event.record(self.update_stream)
        for i in idxs:
            self.ready_events[i] = event

    def before_read(self, idxs: Sequence[int], step: int) -> None:
        stream = None
        last = None
        for i in idxs:
            if self.waited_step[i] == step:
                continue
            self.waited_step[i] = step
            event = self.ready_events[i]
            if event is not None and event is not last:
                if stream is None:
                    stream = torch.cuda.current_stream(self.device)
                stream.wait_event(event)
                last = event

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def make(device: torch.device, n: int) -> DeviceSync:
    return CudaSync(device, n) if device.type == "cuda" else DeviceSync()
