"""Ranks that disagree on the step count, or die: a watchdog per rank that turns what would be a
hang (until the backend's timeout) into an error on every rank, naming each rank's step.

Each rank publishes, through the job's rendezvous store (the c10d store every rank shares), a
heartbeat and where it is: its step count (`step()` calls) and whether it is training or closing.
Only non-blocking counters are used (`store.add`), on a connection of its own, from a thread of its
own, so a slow or broken store never touches the training thread. The watchdog reads the other
ranks' entries every `period_s` and fails the scheduler (`Progress.fail`: the training thread raises
at once, wherever it waits) when the hang is certain:

* a rank closes (`close()`, the end of a `with` block) after n steps while another has called
  `step()` more (it waits for gradients that will never come) or closes after another number:
  the ranks called `step()` a different number of times (a rank skipped a batch or left its loop
  early);
* this rank waits in the scheduler and a peer's heartbeat stopped `dead_s` ago (killed, or its
  process hung outside Python), or the peer's scheduler failed (it says so: FAILED), or the store
  itself is gone (the launcher or rank 0 died).

When this rank fails first — mostly a backend error such as gloo's "connection reset by peer",
which names an address, not a rank — the watchdog publishes FAILED, keeps beating (so that its
peers know it is alive) and explains the failure (`Progress.explain`, which the raise waits for):
a peer whose heartbeat has been silent for `silence_s` is named as killed or crashed; a silent store
means the launcher or rank 0 died; peers that still beat, closed or failed themselves are alive.

Healthy ranks are never judged by timing alone: a peer that is only slow (a long evaluation, data
loading) keeps its heartbeat and is waited for, as DDP waits. `close()` waits (bounded) until
every rank closes at the same step count, so both sides of a mismatch raise, not only the one left
waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from autobyte.scheduler.progress import PeerError, Progress, SchedulerError

logger = logging.getLogger(__name__)

TRAINING, CLOSING, CLOSED, FAILED = 0, 1, 2, 3
_STATE_NAMES = {TRAINING: "training", CLOSING: "closing", CLOSED: "closed", FAILED: "failed"}


class RankPosition(NamedTuple):
    """Where one rank is: its `step()` count and state (TRAINING / CLOSING / CLOSED)."""

    rank: int
    step: int
    state: int

    def describe(self) -> str:
        return f"rank {self.rank} at step {self.step} ({_STATE_NAMES.get(self.state, '?')})"


def _encode(step: int, state: int) -> int:
    return step * 4 + state


def _decode(rank: int, value: int) -> RankPosition:
    return RankPosition(rank, value // 4, value % 4)


def mismatch(positions: list[RankPosition]) -> bool:
    """True when some rank closes after n steps while another has called step() more often, or
    closes after another number: a certain hang."""
    closing = [p for p in positions if p.state in (CLOSING, CLOSED)]
    if not closing:
        return False
    counts = {p.step for p in closing}
    if len(counts) > 1:
        return True
    (count,) = counts
    return any(p.step > count for p in positions)


def mismatch_message(positions: list[RankPosition]) -> str:
    where = ", ".join(p.describe() for p in sorted(positions))
    return (
        f"the ranks called step() a different number of times: {where}. Every rank must call "
        "step() (and close()) the same number of times; the likely cause is a rank that "
        "skipped a batch or a step() call, or left its training loop early (uneven data "
        "shards: give every rank the same number of batches, e.g. DistributedSampler with "
        "drop_last=True)"
    )


class PeerHealth:
    """The watchdog of one rank; `start()` runs it, `closing()`/`agree_on_close()`/`stop()` come
    from `close()`. Every store failure is its own problem: training never sees one."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        progress: Progress,
        step_count: Callable[[], int],
        *,
        period_s: float = 0.5,
        dead_s: float = 6.0,
        silence_s: float = 3.0,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.progress = progress
        self.step_count = step_count
        self.period_s = period_s
        self.dead_s = dead_s
        self.silence_s = silence_s  # after a failure: a peer this silent is named as dead
        self._published = 0  # our `where` counter's value
        self._beats = [-1] * world
        self._beat_changed = [time.monotonic()] * world
        self._stop = threading.Event()
        self._lock = threading.Lock()  # our `where` counter: the watchdog and close() update it
        self._store_failed_since: float | None = None
        self._beats_at_failure: list[int] | None = None

    @classmethod
    def for_group(
        cls,
        instance_id: int,
        rank: int,
        world: int,
        progress: Progress,
        step_count: Callable[[], int],
        timeout_s: float,
    ) -> PeerHealth | None:
        """A watchdog on the default store, or None (logged) where there is none to use."""
        try:
            import datetime

            import torch.distributed as dist
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store().clone()
            store.set_timeout(datetime.timedelta(seconds=min(timeout_s, 10.0)))
            store = dist.PrefixStore(f"autobyte/health/{instance_id:x}/", store)
        except Exception as error:  # noqa: BLE001 - no store: no watchdog, training goes on
            logger.info(
                "no rendezvous store to watch the other ranks (%s): a rank that stops or "
                "skips a step shows only as the backend's timeout",
                error,
            )
            return None
        return cls(store, rank, world, progress, step_count)

    # ------------------------------------------------------------------ the optimizer's calls

    def start(self, spawn: Callable[[str, Callable, tuple], None]) -> None:
        self._publish(TRAINING)
        self.progress.set_diagnosing(True)
        spawn("health", self._main, ())

    def closing(self, step: int) -> None:
        """close() began after `step` step() calls (published at once, not at the next beat)."""
        try:
            self._publish(CLOSING, step)
        except Exception as error:  # noqa: BLE001
            logger.debug("could not publish closing: %s", error)

    def agree_on_close(self, timeout_s: float) -> None:
        """Wait until every rank closes at our step count; SchedulerError if one disagrees. A store
        that stops answering ends the wait quietly (a peer that closed may have left with it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                positions = self.positions()
            except Exception as error:  # noqa: BLE001
                logger.debug("rendezvous store gone while closing: %s", error)
                return
            if mismatch(positions):
                raise PeerError(mismatch_message(positions))
            failed = [p for p in positions if p.state == FAILED]
            if failed:
                raise PeerError(
                    f"{failed_message(failed)} while rank {self.rank} closes at step "
                    f"{self.step_count()}"
                )
            if all(p.state != TRAINING for p in positions):
                return
            if time.monotonic() > deadline:
                where = ", ".join(p.describe() for p in positions)
                raise SchedulerError(
                    f"close() waited {timeout_s:.0f}s for every rank to close: {where}"
                )
            time.sleep(0.02)

    def stop(self, closed: bool) -> None:
        self._stop.set()
        self.progress.set_diagnosing(False)
        try:
            if closed:
                self._publish(CLOSED)
            elif self._published % 4 == TRAINING:  # a CLOSING count stays: peers see a mismatch
                self._publish(FAILED)
        except Exception as error:  # noqa: BLE001
            logger.debug("could not publish the end: %s", error)

    # ------------------------------------------------------------------ the store

    def _publish(self, state: int, step: int | None = None) -> None:
        with self._lock:
            value = _encode(self.step_count() if step is None else step, state)
            if value != self._published:
                self.store.add(f"where{self.rank}", value - self._published)
                self._published = value

    def positions(self) -> list[RankPosition]:
        """Every rank's position (ours as published)."""
        return [
            _decode(r, self._published if r == self.rank else self.store.add(f"where{r}", 0))
            for r in range(self.world)
        ]

    # ------------------------------------------------------------------ the watchdog thread

    def _main(self) -> None:
        while True:  # a beat at once, then every period: a rank killed early has beaten
            if self._stop.is_set():
                return
            try:
                self._beat()
            except Exception as error:  # noqa: BLE001 - the store's trouble, not training's
                now = time.monotonic()
                if self._store_failed_since is None:
                    self._store_failed_since = now
                    logger.debug("rendezvous store unreachable: %s", error)
                if self.progress.error is not None:
                    self.progress.explain(
                        f"the job's rendezvous store does not answer either ({error}): the "
                        "launcher or rank 0 (whichever hosts it) was likely killed or crashed; "
                        "restart the job from its last checkpoint"
                    )
                elif self._stuck(now) and now - self._store_failed_since > self.dead_s / 2:
                    silent_s = now - self._store_failed_since
                    self.progress.fail(
                        PeerError(
                            f"rank {self.rank} waits at step {self.step_count()} and the job's "
                            f"rendezvous store has not answered for {silent_s:.0f}s ({error}): the "
                            "launcher or rank 0 likely died"
                        )
                    )
                    return
            else:
                self._store_failed_since = None
            self._stop.wait(self.period_s)

    def _stuck(self, now: float) -> bool:
        since = self.progress.waiting_since
        return since is not None and now - since > self.dead_s / 2

    def _beat(self) -> None:
        failed = self.progress.error is not None
        with self._lock:
            if self._published % 4 == TRAINING:
                value = _encode(self.step_count(), FAILED if failed else TRAINING)
                if value != self._published:
                    self.store.add(f"where{self.rank}", value - self._published)
                    self._published = value
        self.store.add(f"beat{self.rank}", 1)  # also after a failure: we are alive
        now = time.monotonic()
        positions = self.positions()
        self._read_beats(now)
        if failed:
            if self.progress.diagnosis is None:
                self._diagnose(now, positions)
            return
        if mismatch(positions):
            self.progress.fail(PeerError(mismatch_message(positions)))
            return
        stuck = self._stuck(now)
        for r in range(self.world):
            if r == self.rank:
                continue
            if stuck and positions[r].state == FAILED:
                self.progress.fail(
                    PeerError(
                        f"{failed_message([positions[r]])} while rank {self.rank} waits at step "
                        f"{self.step_count()}"
                    )
                )
                return
            silent_s = now - self._beat_changed[r]
            if stuck and positions[r].state != CLOSED and silent_s > self.dead_s:
                self.progress.fail(
                    PeerError(
                        f"rank {r} stopped responding {silent_s:.0f}s ago (last seen "
                        f"{positions[r].describe()}) while rank {self.rank} waits at step "
                        f"{self.step_count()}: it was likely killed or crashed; restart the job from "
                        "its last checkpoint"
                    )
                )
                return

    def _read_beats(self, now: float) -> None:
        for r in range(self.world):
            if r != self.rank:
                beat = self.store.add(f"beat{r}", 0)
                if beat != self._beats[r]:
                    self._beats[r], self._beat_changed[r] = beat, now

    def _diagnose(self, now: float, positions: list[RankPosition]) -> None:
        """After this rank failed: name the peers whose heartbeat stopped (explain() once every
        peer is judged, or after `silence_s` + 1 s; "" when every peer is alive)."""
        failed_at = self.progress.failed_at or now
        if self._beats_at_failure is None:  # a count read after the failure: a later one is alive
            self._beats_at_failure = list(self._beats)
        dead, undecided = [], False
        for r in range(self.world):
            if r == self.rank or positions[r].state in (CLOSED, FAILED):
                continue  # it closed, or raised itself: alive
            if self._beats[r] > self._beats_at_failure[r]:
                continue  # beat since our failure: alive
            silent_s = now - self._beat_changed[r]
            if self._beats[r] > 0 and silent_s > self.silence_s:
                dead.append(
                    f"rank {r} stopped responding {silent_s:.0f}s ago (last seen "
                    f"{positions[r].describe()})"
                )
            else:
                undecided = True
        if undecided and now - failed_at < self.silence_s + 1.0:
            return
        self.progress.explain(
            f"{', '.join(dead)}: it was likely killed or crashed; restart the "
            "job from its last checkpoint"
            if dead
            else ""
        )


def failed_message(failed: list[RankPosition]) -> str:
    where = ", ".join(p.describe() for p in failed)
    return f"the scheduler of another rank failed ({where}; its log says why)"


def watchdog_for(
    group: Any,
    leader_global: int,
    is_leader: bool,
    rank: int,
    world: int,
    progress: Progress,
    step_count: Callable[[], int],
    timeout_s: float,
) -> PeerHealth | None:
    """Collective over `group` (rank 0 draws the instance's key, so that two ScheduledOptimizers of
    one job, or a restarted job on the same store, never read each other's entries). The key comes
    from the OS, not from `random`: a training script seeds that (Trainer's set_seed), so two
    instances would draw the same key, and drawing from it would move rank 0's random stream."""
    import secrets

    import torch
    import torch.distributed as dist

    token = torch.tensor([secrets.randbits(62) if is_leader else 0], dtype=torch.int64)
    dist.broadcast(token, src=leader_global, group=group)
    return PeerHealth.for_group(int(token.item()), rank, world, progress, step_count, timeout_s)
