"""The decision hub (wakes a job's control streams when a decision is stored) and the daemon's
background loops: the poll for decisions other daemons stored, and sample retention."""

from __future__ import annotations

import asyncio
import logging

from autobyted.settings import Settings
from autobyted.storage.base import BaseStorage

log = logging.getLogger(__name__)


class DecisionHub:
    """Wakes WatchConfig streams of a job when a decision is stored: at once for this daemon's own
    decisions, within one poll (decision_poll_loop) for those of another daemon on the database."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Event]] = {}

    def watched_jobs(self) -> list[str]:
        return [job for job, waiters in self._waiters.items() if waiters]

    def subscribe(self, job: str) -> asyncio.Event:
        event = asyncio.Event()
        self._waiters.setdefault(job, set()).add(event)
        return event

    def unsubscribe(self, job: str, event: asyncio.Event) -> None:
        waiters = self._waiters.get(job)
        if waiters is not None:
            waiters.discard(event)
            if not waiters:
                del self._waiters[job]

    def publish(self, job: str) -> None:
        for event in self._waiters.get(job, ()):
            event.set()


RETENTION_LEASE = "retention"


async def retention_loop(
    storage: BaseStorage, settings: Settings, holder: str, interval_s: float = 60.0
) -> None:
    """Bound raw samples per job (downsampling the oldest) for as long as the daemon runs. Of the
    daemons sharing a database, the one holding the retention lease does it (kept while it runs)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            if not await asyncio.to_thread(
                storage.acquire_lease, RETENTION_LEASE, holder, 3 * interval_s
            ):
                continue
            removed = await asyncio.to_thread(
                storage.enforce_retention, settings.retention_raw_samples, settings.downsample_every
            )
            if removed:
                log.info("retention downsampled samples", extra={"removed": removed})
        except Exception as error:  # noqa: BLE001 - keep serving; the next round tries again
            log.warning("retention pass failed: %s", error)


async def decision_poll_loop(storage: BaseStorage, hub: DecisionHub, interval_s: float) -> None:
    """Every interval_s, wake the control streams of the watched jobs whose newest decision changed:
    decisions stored by another daemon on the same database reach this daemon's ranks within one
    interval (one indexed query per interval, however many streams). A job seen for the first time
    is woken too: a decision may have landed between its stream's first read and this poll."""
    known: dict[str, int] = {}
    while True:
        await asyncio.sleep(interval_s)
        jobs = hub.watched_jobs()
        known = {job: known[job] for job in jobs if job in known}
        if not jobs:
            continue
        try:
            newest = await asyncio.to_thread(storage.newest_decision_ids, jobs)
        except Exception as error:  # noqa: BLE001 - keep polling; the streams still see this daemon's own decisions
            log.warning("polling for decisions failed: %s", error)
            continue
        for job, decision_id in newest.items():
            if known.get(job) != decision_id:
                known[job] = decision_id
                hub.publish(job)
