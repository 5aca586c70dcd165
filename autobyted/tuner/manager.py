"""The daemon's side of the tuner: every job's search on one worker thread, retraining on another.

- Samples come from storage, read incrementally by row id (every rank's, merged per step into one
  job-level sample by tuner.ranks: the straggler's compute, the best bandwidth estimate), never
  from the ingest path itself: the ingest writer only *wakes* the worker with the names of the jobs it just wrote, and a
  slow poll catches jobs written by another daemon sharing the database. Nothing here runs on the
  asyncio event loop; decisions go out through the daemon's own decision path (`decide`, the
  coroutine that stores a decision and wakes the job's control streams, run on the loop via
  run_coroutine_threadsafe), so they land at the same step on every rank and show in history.
- Several daemons on one database: a job is tuned by the daemon that holds its tuner lease (a row
  in the database with an expiry, records.tuner_lease). The holder renews it every third of
  `lease_s`; a daemon that dies or stalls loses it once it expires and another daemon takes the job
  over, measuring it afresh. Its decisions are stored only while it holds the lease (fencing), and a
  daemon that stops gives its leases back at once.
- A failure in one job's tuning is logged, shown as state "error" for that job, and the job is
  looked at again after a back-off; ingestion and serving never depend on this thread.
- The predictor starts from the newest model in the database (a restarted daemon keeps what it
  learned) or else the shipped prior; the trainer thread retrains it from every job's measured
  windows at most every `retrain_interval_s` when new windows came in, with bounded cost
  (predictor.MAX_ONLINE_PAIRS rows, ONLINE_ROUNDS trees per member, one thread), and stores it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable

from autobyte.types import Config

from autobyted.errors import FailedPrecondition, NotFound
from autobyted.storage.base import BaseStorage
from autobyted.storage.records import (
    DecisionRecord,
    JobInfo,
    TunerStatusRecord,
    WindowRecord,
    tuner_lease,
)
from autobyted.tuner.eligible import not_tuned
from autobyted.tuner.features import Context, JobShape
from autobyted.tuner.params import TunerParams
from autobyted.tuner.predictor import Ensemble, Predictor, Window, load_prior, train_online
from autobyted.tuner.ranks import RankMerger
from autobyted.tuner.search import JobTuner, TunerSink
from autobyted.tuner.shard_schedule import JobSchedule
from autobyted.tuner.sharded import ShardTuner

log = logging.getLogger(__name__)

# decide(job, config, apply_at_step, reason, predicted_step_time_s, source=, state=, lease_holder=)
#   -> DecisionRecord
DecideFn = Callable[..., DecisionRecord]
MODES = ("auto", "observe", "off")
MAX_WINDOWS = 20_000  # a retraining reads at most the newest this many windows (bounded cost)
MAX_KNOWN_WINDOWS = (
    5_000  # a job's tuner opens with the earlier jobs' windows of its shape among these
)


class StorageSink(TunerSink):
    """A JobTuner's effects, into storage and the decision path."""

    def __init__(
        self,
        job: str,
        storage: BaseStorage,
        decide: DecideFn,
        on_window: Callable[[], None],
        holder: str,
    ) -> None:
        self.job, self.storage, self._decide, self._on_window = job, storage, decide, on_window
        self.holder = holder
        self.status: TunerStatusRecord | None = None

    def decide(self, config, apply_at_step, reason, predicted_step_time_s, kind):
        try:
            record = self._decide(
                self.job,
                config,
                apply_at_step,
                reason,
                predicted_step_time_s,
                source="tuner",
                state="recommended" if kind == "recommend" else "pending",
                lease_holder=self.holder,
            )
        except (
            FailedPrecondition
        ):  # an operator paused the tuner meanwhile, or this daemon lost the lease
            return None
        return record.decision_id

    def close_decision(self, decision_id, measured_step_time_s, state):
        self.storage.close_decision(decision_id, measured_step_time_s, state)

    def record_window(self, window: Window) -> None:
        self.storage.add_window(
            WindowRecord(
                self.job,
                window.segment,
                window.config,
                window.step_time_s,
                window.samples,
                window.context.to_json(),
                window.created_at_s,
            )
        )
        self._on_window()

    def publish(self, status: TunerStatusRecord) -> None:
        self.status = status  # written by the manager once per cycle


@dataclasses.dataclass
class _JobState:
    tuner: JobTuner | ShardTuner
    sink: StorageSink
    ranks: RankMerger
    last_row: int = 0
    last_sample_s: float = 0.0
    written: TunerStatusRecord | None = None


class TunerManager:
    """Constructed with its parts; `start()` starts its two threads, `close()` stops them."""

    def __init__(
        self,
        storage: BaseStorage,
        decide: DecideFn,
        mode: str = "auto",
        params: TunerParams = TunerParams(),
        poll_interval_s: float = 5.0,
        retrain_interval_s: float = 60.0,
        idle_after_s: float = 30.0,
        error_backoff_s: float = 30.0,
        prior: Ensemble | None = None,
        clock: Callable[[], float] = time.monotonic,
        holder: str | None = None,
        lease_s: float = 15.0,
    ) -> None:
        if mode not in ("auto", "observe"):
            raise ValueError(f"the tuner manager runs in auto or observe mode, not {mode!r}")
        if not lease_s > 0:
            raise ValueError(f"lease_s={lease_s!r} must be positive")
        # Who holds this daemon's leases: unique among the daemons sharing the database.
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.lease_s = lease_s
        self._lease_retry_at: dict[str, float] = {}  # jobs another daemon tunes: when to ask again
        self._renewed_at: dict[
            str, float
        ] = {}  # jobs this daemon tunes: when their lease was renewed
        self.storage, self._decide, self.mode, self.params = storage, decide, mode, params
        self.poll_interval_s, self.retrain_interval_s = poll_interval_s, retrain_interval_s
        self.idle_after_s, self.error_backoff_s = idle_after_s, error_backoff_s
        self._prior = prior
        self._clock = clock
        self._jobs: dict[str, _JobState] = {}
        self._skip_until: dict[str, float] = {}
        self._wake = threading.Event()
        self._train_wake = threading.Event()
        self._stopping = threading.Event()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.predictor: Predictor | None = None
        self.base: Ensemble | None = None
        self.new_windows = 0
        self.cycle_cpu_s: list[
            float
        ] = []  # CPU of cycles that issued a decision (bench_tuner reads it)
        self.cycles = 0
        # Per job, the cycles that looked at it (whatever they found: another daemon's lease, an
        # opted-out or paused job, nothing new): what a caller waits on to know the tuner has seen
        # what it stored.
        self.cycles_of: dict[str, int] = {}
        self._started_wall_s = time.time()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._started_wall_s = time.time()
        self._threads = [
            threading.Thread(target=self._run, name="autobyted-tuner", daemon=True),
            threading.Thread(target=self._train_loop, name="autobyted-trainer", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._train_wake.set()
        for thread in self._threads:
            thread.join(timeout_s)
        for job in list(self._renewed_at):  # another daemon takes these jobs over at once
            self._let_go(job)

    def notify(self, jobs: Iterable[str]) -> None:
        """Thread-safe and cheap: the ingest writer calls it with the jobs it just stored samples of."""
        with self._lock:
            self._pending.update(jobs)
        self._wake.set()

    # ------------------------------------------------------------------ predictor
    def _load_predictor(self) -> None:
        prior = self._prior or load_prior()
        self.base = prior
        ensemble = prior
        try:
            stored = self.storage.latest_model()
            if stored is not None:
                candidate = Ensemble.from_bytes(stored.model)
                if candidate.meta.get("base") == prior.digest:
                    ensemble = candidate
                    log.info(
                        "predictor loaded from the database", extra={"examples": stored.examples}
                    )
                else:
                    log.info(
                        "stored predictor was trained on another prior; retraining from the windows"
                    )
                    self.new_windows += 1
                    self._train_wake.set()
        except Exception as error:  # noqa: BLE001 - an unreadable model is not worth a dead tuner
            log.warning("cannot load the stored predictor (%s); using the prior", error)
        self.predictor = Predictor(ensemble)

    def retrain_now(self) -> bool:
        """Retrain from every stored window (the trainer thread's work; callable for tests and
        benchmarks). True when a new model was stored."""
        assert self.base is not None and self.predictor is not None
        self.new_windows = 0
        trained = train_online(self.base, self._stored_windows(MAX_WINDOWS))
        if trained is None:
            return False
        self.predictor.swap(trained)
        self.storage.save_model(
            "online", trained.to_bytes(), trained.meta["examples"], trained.meta["note"]
        )
        log.info(
            "predictor retrained",
            extra={"pairs": trained.meta["examples"], "jobs": trained.meta["jobs"]},
        )
        return True

    def _train_loop(self) -> None:
        last = self._clock()
        while not self._stopping.is_set():
            self._train_wake.wait(self.retrain_interval_s)
            self._train_wake.clear()
            if self._stopping.is_set() or self.predictor is None:
                continue
            if not self.new_windows or self._clock() - last < self.retrain_interval_s * 0.5:
                continue
            last = self._clock()
            try:
                self.retrain_now()
            except Exception:
                log.exception("retraining the predictor failed; keeping the current one")

    def _stored_windows(self, limit: int) -> list[Window]:
        """The newest `limit` stored windows (unreadable ones skipped, logged)."""
        windows = []
        for record in self.storage.windows(limit=limit, newest=True):
            try:
                windows.append(
                    Window(
                        record.job,
                        record.segment,
                        record.config,
                        Context.from_json(record.context),
                        record.step_time_s,
                        record.samples,
                        record.created_at_s,
                    )
                )
            except (ValueError, TypeError, KeyError) as error:
                log.warning("skipping an unreadable window %d: %s", record.window_id, error)
        return windows

    def _window_recorded(self) -> None:
        self.new_windows += 1

    # ------------------------------------------------------------------ the worker
    def _run(self) -> None:
        try:
            self._load_predictor()
        except Exception:
            log.exception("the tuner cannot load its prior; tuning is off for this daemon run")
            return
        next_poll = 0.0
        while not self._stopping.is_set():
            # Held leases are renewed at least every third of their duration.
            self._wake.wait(min(self.poll_interval_s, self.lease_s / 3))
            self._wake.clear()
            if self._stopping.is_set():
                break
            with self._lock:
                jobs, self._pending = self._pending, set()
            now = self._clock()
            if now >= next_poll:
                next_poll = now + self.poll_interval_s
                try:
                    jobs |= set(self.storage.active_jobs(self.idle_after_s))
                except Exception as error:  # noqa: BLE001 - the database is unreachable: the known jobs are still tuned
                    log.warning("tuner cannot list active jobs: %s", error)
                jobs |= set(self._jobs)
            for job in sorted(jobs):
                if self._stopping.is_set():
                    break
                self.cycle(job)

    def cycle(self, job: str) -> None:
        """Look at one job: new samples through its search, pause/resume, idle, errors. Counted in
        cycles_of unless the job is in its error back-off or another daemon's lease is not asked
        for again yet."""
        now = self._clock()
        if self._skip_until.get(job, 0.0) > now:
            return
        if job not in self._renewed_at and self._lease_retry_at.get(job, 0.0) > time.monotonic():
            return
        try:
            self._look(job, now)
        finally:
            self.cycles_of[job] = self.cycles_of.get(job, 0) + 1

    def _look(self, job: str, now: float) -> None:
        cpu0 = time.thread_time()
        try:
            if not self._hold(job):
                return
        except Exception as error:  # noqa: BLE001 - the database is unreachable: try again later
            log.warning("tuner cannot take or renew the lease of job %s: %s", job, error)
            self._lease_retry_at[job] = time.monotonic() + self.lease_s / 3
            return
        state = self._jobs.get(job)
        try:
            if state is None:
                state = self._open(job)
                if state is None:  # opted out or finished: nothing to hold
                    self._let_go(job)
                    return
            stored = self.storage.tuner_status(job)
            if stored is not None and stored.paused and not state.tuner.paused:
                state.tuner.pause("an operator decided or paused it")
            elif stored is not None and not stored.paused and state.tuner.paused:
                state.tuner.resume()
            rows = self.storage.samples_after(
                job, state.last_row, rank=None, limit=5_000 * state.ranks.world_size
            )
            decisions_before = len(state.tuner.own_decision_ids)
            if rows:
                state.last_row = rows[-1].row_id
                state.last_sample_s = now
                for row in rows:
                    state.ranks.add(row.rank, row.metrics)
                state.tuner.observe(state.ranks.pop_ready())
            # Every rank said goodbye (its last batch carries final): the job is let go at once.
            finished = (
                len(rows) < 5_000 * state.ranks.world_size  # else more rows wait to be read
                and self.storage.job_info(job).finished_at_s is not None
            )
            if finished or (not rows and now - state.last_sample_s > self.idle_after_s):
                # A finished job (every rank said goodbye; storage expired what was pending) is
                # let go at once and says so; a silent one after idle_after_s.
                last = state.sink.status or state.tuner.status  # what status showed last
                said = (
                    f"finished: every rank ended (the tuner was: {last.detail})"
                    if finished
                    else f"idle: no steps for {self.idle_after_s:.0f} s (was: {last.detail})"
                )
                self._write(
                    job,
                    state,
                    dataclasses.replace(
                        last, state="finished" if finished else "idle", detail=said
                    ),
                )
                del self._jobs[job]
                self._let_go(job)
                return
            self._write(job, state, state.sink.status or state.tuner.status)
            if len(state.tuner.own_decision_ids) > decisions_before:
                self.cycle_cpu_s.append(time.thread_time() - cpu0)
            self.cycles += 1
        except NotFound:
            self._jobs.pop(job, None)  # deleted meanwhile
            self._let_go(job)
        except Exception as error:
            log.exception(
                "tuning job %s failed; it is looked at again in %.0f s", job, self.error_backoff_s
            )
            self._jobs.pop(job, None)
            self._let_go(job)
            self._skip_until[job] = now + self.error_backoff_s
            try:
                self.storage.save_tuner_status(
                    job,
                    TunerStatusRecord(
                        mode=self.mode,
                        state="error",
                        detail=f"error: {type(error).__name__}: {error}"[:500],
                        updated_at_s=time.time(),
                    ),
                )
            except Exception:  # noqa: BLE001, S110 - best effort: the failure is logged above
                pass

    def _hold(self, job: str) -> bool:
        """True while this daemon holds the job's tuner lease: taken when free or expired, renewed
        every third of its duration. A lease lost (this daemon stalled past its expiry and another
        took the job) drops the job's state: the new holder tunes it. Real time (the lease expires
        in the database's), whatever clock the search runs on."""
        now = time.monotonic()
        held = job in self._renewed_at
        if held and now - self._renewed_at[job] < self.lease_s / 3:
            return True
        if self.storage.acquire_lease(tuner_lease(job), self.holder, self.lease_s):
            if not held:
                log.info("tuning job %s (lease taken)", job)
            self._renewed_at[job] = now
            self._lease_retry_at.pop(job, None)
            return True
        if held:
            log.warning(
                "lost the tuner lease of job %s to another daemon; it tunes the job now", job
            )
            self._jobs.pop(job, None)
            del self._renewed_at[job]
        self._lease_retry_at[job] = now + min(self.poll_interval_s, self.lease_s / 3)
        return False

    def _let_go(self, job: str) -> None:
        self._renewed_at.pop(job, None)
        try:
            self.storage.release_lease(tuner_lease(job), self.holder)
        except Exception as error:  # noqa: BLE001 - it expires by itself
            log.warning("cannot release the tuner lease of job %s: %s", job, error)

    def _open(self, job: str) -> _JobState | None:
        info = self.storage.job_info(job)
        if info.finished_at_s is not None:
            previous = self.storage.tuner_status(job)
            if previous is not None and previous.state == "finished":
                return None  # said so when its last rank ended (cycle); a new run registers afresh
        status = not_tuned(info.tuning_disabled, info.engine)
        if status is not None:
            previous = self.storage.tuner_status(job)
            if previous is None or (previous.state, previous.mode) != (status.state, status.mode):
                self.storage.save_tuner_status(job, status)
            return None
        sink = StorageSink(job, self.storage, self._decide, self._window_recorded, self.holder)
        tuner: JobTuner | ShardTuner
        if info.engine == "fsdp2":  # measured, ordered by its schedule's model (tuner.sharded)
            known = self._held_by_earlier(job, info)
            schedule = None
            if info.shard_layout is not None:
                schedule = JobSchedule(
                    info.shard_layout, info.world_size, info.backend, info.collective_latency_s
                )
            tuner = ShardTuner(job, sink, self.mode, self.params, info.memory, known, schedule)
            return self._track(job, info, tuner, sink)
        assert self.predictor is not None
        shape = JobShape.from_info(info)
        # What earlier jobs of this shape measured (the search uses it where the context matches),
        # and of this model at other rank counts (what they held is tried first).
        known = [
            w for w in self._stored_windows(MAX_KNOWN_WINDOWS) if w.context.shape.same_model(shape)
        ]
        tuner = JobTuner(
            job,
            shape,
            self.predictor,
            sink,
            self.mode,
            self.params,
            known=known,
            first_segment=self.storage.next_window_segment(job),
        )
        return self._track(job, info, tuner, sink)

    def _held_by_earlier(self, job: str, info: JobInfo) -> tuple[Config, str] | None:
        """What the latest other FSDP2 job of the same model (fingerprint) and backend held,
        measured (its tuner's configuration: held, kept for want of headroom, or in effect when it
        ended), with that job's name: the new job's search measures it first (tuner.sharded). A
        job at the same world size is preferred; else one at another (a job restarted at another
        rank count: what keeps the link busy moves little with the ranks). None when no such job
        held anything but its script's own settings."""
        if not info.fingerprint.digest:
            return None
        found: dict[bool, tuple[float, Config, str]] = {}  # same world size -> the latest
        for record in self.storage.jobs(running_within_s=self.idle_after_s):
            status = record.tuner
            same = record.world_size == info.world_size
            if (
                record.job == job
                or record.engine != "fsdp2"
                or record.backend != info.backend
                or status is None
                or status.measured_step_time_s <= 0
                or status.config == Config()
                or (same in found and record.last_seen_s <= found[same][0])
            ):
                continue
            if self.storage.job_info(record.job).fingerprint == info.fingerprint:
                found[same] = (record.last_seen_s, status.config, record.job)
        best = found.get(True) or found.get(False)
        return None if best is None else (best[1], best[2])

    def _track(
        self, job: str, info: JobInfo, tuner: JobTuner | ShardTuner, sink: StorageSink
    ) -> _JobState:
        # A job that registered while this tuner runs and that no tuner has looked at yet is read
        # from its first sample; one that was running before (a daemon restart, a job the tuner let
        # go as idle, a job taken over from another daemon) from its newest: it is measured afresh,
        # not replayed from its history.
        previous = self.storage.tuner_status(job)
        fresh = info.created_at_s >= self._started_wall_s and (
            previous is None or not previous.mode
        )
        state = _JobState(
            tuner,
            sink,
            RankMerger(max(1, info.world_size)),
            last_row=0 if fresh else self.storage.last_sample_row(job, rank=None),
            last_sample_s=self._clock(),
        )
        self._jobs[job] = state
        return state

    def _write(self, job: str, state: _JobState, status: TunerStatusRecord) -> None:
        if status != state.written:
            self.storage.save_tuner_status(
                job, dataclasses.replace(status, updated_at_s=time.time())
            )
            state.written = status
