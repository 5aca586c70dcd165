"""The `autobyte` policy: the daemon's own tuner classes (autobyted.tuner) driven by the simulator.

What the tuner may see is fixed by construction. `MetricsAdapter` turns a simulator `StepRecord`
into the `autobyte.types.StepMetrics` a real rank would send, and the tuner's only inputs are those
StepMetrics plus registration info (`JobShape`: world size, backend, the model fingerprint). The
adapter reads the record's step, start/end time, step time, compute time, blocked time,
communication span, partition count, bytes and configuration; it never reads the scenario's true
`bandwidth_bytes_per_s` or `compute_factor`:

- bandwidth_bytes_per_s is the scheduler's own estimate, bytes / communication span (the real one
  is bytes / (last completion - first issue)), times log-normal noise (sigma 5%);
- step, forward and backward times get log-normal noise (sigma `noise`, default 3%) and, one step in
  a hundred, a 1.2-2x spike (a real rank sees GC pauses and neighbours' bursts);
- forward / backward split the record's compute time by the profile's forward share (the rank
  measures both);
- queueing delay is 0 and host load 0.0 = unknown: the simulator models neither.

Samples reach the tuner in batches every `flush_interval_s` of simulated time (the client batches
its samples for 1 s), and a decision takes effect at the first step at or after its apply_at_step
that the policy has not yet started: as in the real system, the tuner acts on a delayed view.
The policy's score (steps/s) is computed by benchmarks.evaluate from the simulator's true times.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from autobyte.types import Config, StepMetrics
from autobyted.storage.records import Fingerprint, TunerStatusRecord
from autobyted.tuner.features import JobShape
from autobyted.tuner.predictor import Ensemble, Predictor, Window, load_prior, train_online
from autobyted.tuner.search import JobTuner, TunerParams, TunerSink, describe
from benchmarks.policies import Policy, PolicyContext
from benchmarks.sim.engine import DDPConfig, RunConfig, StepRecord
from benchmarks.sim.profiles import ModelProfile

SCHEDULER_DEFAULT = Config(4 << 20, 16 << 20)  # ScheduledOptimizer's default configuration
T0 = 1.7e9  # wall clock of a simulated run's start (any plausible unix time)


def job_shape(profile: ModelProfile, workers: int, backend: str) -> JobShape:
    """Registration info of a simulated job (what autobyte.telemetry.model_fingerprint computes)."""
    sizes = sorted(b for layer in profile.layers for b in layer.param_bytes if b > 0)
    median = sizes[len(sizes) // 2] if sizes else 0
    fingerprint = Fingerprint(sum(sizes) // 4, sum(sizes), len(sizes), max(sizes, default=0), median, profile.name)
    return JobShape.from_fingerprint(workers, backend, fingerprint)


class MetricsAdapter:
    """StepRecord -> StepMetrics with measurement noise (see the module docstring)."""

    def __init__(self, forward_share: float, seed: int = 0, noise: float = 0.03,
                 bandwidth_noise: float = 0.05, spike_rate: float = 0.01) -> None:
        self.forward_share = forward_share
        self.rng = random.Random(seed)
        self.noise, self.bandwidth_noise, self.spike_rate = noise, bandwidth_noise, spike_rate

    def __call__(self, record: StepRecord, decision_id: int) -> StepMetrics:
        rng = self.rng
        spike = rng.uniform(1.2, 2.0) if rng.random() < self.spike_rate else 1.0
        factor = math.exp(rng.gauss(0.0, self.noise)) * spike
        compute = record.compute_s * math.exp(rng.gauss(0.0, self.noise))
        span = record.comm_span_s
        bandwidth = (record.bytes_reduced / span * math.exp(rng.gauss(0.0, self.bandwidth_noise))
                     if span > 0 else 0.0)
        config = record.config if isinstance(record.config, Config) else Config(None, None)
        return StepMetrics(step=record.step, wall_time_s=T0 + record.end_s, step_time_s=record.step_time_s * factor,
                           forward_s=compute * self.forward_share, backward_s=compute * (1 - self.forward_share),
                           exposed_comm_s=record.blocked_s * factor, queueing_delay_s=0.0,
                           bytes_reduced=record.bytes_reduced, partitions=record.partitions,
                           bandwidth_bytes_per_s=bandwidth, config=config, decision_id=decision_id,
                           host_load=0.0)


@dataclasses.dataclass
class SimDecision:
    decision_id: int
    config: Config
    apply_at_step: int
    reason: str
    kind: str
    predicted_step_time_s: float | None
    measured_step_time_s: float | None = None
    state: str = "pending"
    applied_at_step: int | None = None


class MemorySink(TunerSink):
    """Collects what the tuner would write to the daemon's storage."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.decisions: list[SimDecision] = []
        self.windows: list[Window] = []
        self.statuses: list[TunerStatusRecord] = []

    def decide(self, config, apply_at_step, reason, predicted_step_time_s, kind):
        decision = SimDecision(len(self.decisions) + 1, config, apply_at_step, reason, kind,
                               predicted_step_time_s, state="recommended" if kind == "recommend" else "pending")
        self.decisions.append(decision)
        return decision.decision_id

    def close_decision(self, decision_id, measured_step_time_s, state):
        decision = self.decisions[decision_id - 1]
        if measured_step_time_s is not None:
            decision.measured_step_time_s = measured_step_time_s
        if state is not None:
            decision.state = state

    def record_window(self, window):
        self.windows.append(window)

    def publish(self, status):
        self.statuses.append(status)


class AutobytePolicy(Policy):
    """The daemon's tuner (autobyted.tuner.search.JobTuner) on simulated steps.

    `history`: windows of other jobs (a warm database); `prior`: the ensemble to start from (the
    shipped prior by default); retraining on top of it happens every `retrain_interval_s` of
    simulated time when new windows came in, as the daemon's trainer thread does."""

    name = "autobyte"

    def __init__(self, prior: Ensemble | None = None, history: Sequence[Window] = (), mode: str = "auto",
                 params: TunerParams = TunerParams(), seed: int = 0, flush_interval_s: float = 1.0,
                 retrain_interval_s: float = 60.0, initial: Config = SCHEDULER_DEFAULT,
                 noise: float = 0.03) -> None:
        self.prior = prior
        self.history = list(history)
        self.mode, self.params, self.seed = mode, params, seed
        self.flush_interval_s, self.retrain_interval_s = flush_interval_s, retrain_interval_s
        self.initial = initial
        self.noise = noise
        self.tuner: JobTuner | None = None
        self.sink = MemorySink("sim")
        self.retrains = 0

    def prepare(self, context: PolicyContext) -> None:
        if context.profile is None:
            raise RuntimeError("the autobyte policy needs the job's profile (registration info)")
        profile = context.profile
        shape = job_shape(profile, context.workers, context.backend)
        base = self.prior or load_prior()
        self.predictor = Predictor(base)
        if self.history:
            trained = train_online(base, self.history, seed=self.seed, now_s=T0)
            if trained is not None:
                self.predictor.swap(trained)
        self.base = base
        forward_share = profile.forward_s / profile.compute_s if profile.compute_s > 0 else 0.5
        self.adapter = MetricsAdapter(forward_share, seed=context.seed, noise=self.noise)
        self.sink = MemorySink(profile.name)
        self.tuner = JobTuner(f"sim-{profile.name}", shape, self.predictor, self.sink, self.mode, self.params)
        self.buffer: list[StepMetrics] = []
        self.next_flush_s = self.flush_interval_s
        self.next_retrain_s = self.retrain_interval_s
        self.windows_trained = 0
        self.current: Config = self.initial
        self.decision_in_effect = 0
        self.applied_through = 0  # decisions up to this id are handled
        self.trial_steps: list[int] = []  # steps run under a trial decision
        self.config_log: list[tuple[int, Config, str]] = []  # (first step, config, kind)

    def initial_config(self) -> RunConfig:
        return self.initial

    def observe(self, record: StepRecord) -> RunConfig | None:
        assert self.tuner is not None
        if isinstance(record.config, DDPConfig):
            raise RuntimeError("the tuner only drives the scheduler")
        self.buffer.append(self.adapter(record, self.decision_in_effect))
        kind = self._kind_in_effect()
        if kind == "trial":
            self.trial_steps.append(record.step)
        if record.end_s >= self.next_flush_s:
            self.next_flush_s = record.end_s + self.flush_interval_s
            self.tuner.observe(self.buffer)
            self.buffer = []
            if record.end_s >= self.next_retrain_s:
                self.next_retrain_s = record.end_s + self.retrain_interval_s
                self._retrain(record.end_s)
        pending = [d for d in self.sink.decisions if d.decision_id > self.applied_through and d.kind != "recommend"]
        if not pending:
            return None
        latest = pending[-1]  # a newer decision supersedes older pending ones
        if record.step + 1 < latest.apply_at_step:
            return None
        for decision in pending[:-1]:
            decision.state = "superseded"
        self.applied_through = latest.decision_id
        latest.state, latest.applied_at_step = "applied", record.step + 1
        self.decision_in_effect = latest.decision_id
        self.config_log.append((record.step + 1, latest.config, latest.kind))
        if latest.config == self.current:
            return None
        self.current = latest.config
        return latest.config

    def _kind_in_effect(self) -> str:
        return self.config_log[-1][2] if self.config_log else "initial"

    def _retrain(self, now_s: float) -> None:
        windows = self.sink.windows
        if len(windows) <= self.windows_trained:
            return
        trained = train_online(self.base, self.history + windows, seed=self.seed, now_s=T0 + now_s)
        self.windows_trained = len(windows)
        if trained is not None:
            self.predictor.swap(trained)
            self.retrains += 1

    def describe(self) -> str:
        if self.tuner is None:
            return ""
        stats = self.tuner.stats
        return (f"{self.tuner.phase} {describe(self.current)}; {stats['trials']} trials ({stats['cut']} cut), "
                f"{stats['retunes']} re-tunes, {stats['rollbacks']} rollbacks")


class HubDaemon:
    """A real autobyted (`--tuner auto`, a fresh SQLite file) inside a testbed's hub namespace, for
    `evaluate --testbed --policy autobyte`: the ranks stream to it over their shaped links and rank
    0 applies its decisions through the real control path. `env` is what the ranks need; `stop()`
    ends the daemon and returns what it decided (read from its database)."""

    PORT = 7077

    def __init__(self, bed, workdir, job: str, tuner: str = "auto", extra_args: Sequence[str] = ()) -> None:
        import secrets

        self.bed, self.workdir, self.job, self.tuner = bed, workdir, job, tuner
        self.extra_args = list(extra_args)
        self.token = secrets.token_hex(16)
        self.db_url = f"sqlite:///{workdir}/autobyted.db"
        self.log_path = workdir / "autobyted.log"
        self.proc = None

    @property
    def address(self) -> str:
        return f"{self.bed.hub_address}:{self.PORT}"

    @property
    def env(self) -> dict[str, str]:
        return {"AUTOBYTE_DAEMON": self.address, "AUTOBYTE_JOB": self.job, "AUTOBYTE_TOKEN": self.token}

    def start(self, timeout_s: float = 30.0) -> HubDaemon:
        import sys
        import time

        log = open(self.log_path, "w")
        self.proc = self.bed.start_in_hub(
            [sys.executable, "-m", "autobyted.app", "start", "--listen", self.address, "--db", self.db_url,
             "--token", self.token, "--insecure", "--tuner", self.tuner, "--log-format", "text", *self.extra_args], stdout=log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"autobyted exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            if "autobyted listening" in self.log_path.read_text():
                return self
            time.sleep(0.1)
        raise RuntimeError(f"autobyted did not come up in the hub namespace: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> dict:
        import signal

        from autobyted.storage.db import make_engine
        from autobyted.storage.sql import SqlStorage

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
        storage = SqlStorage(make_engine(self.db_url))
        try:
            decisions = storage.decisions(self.job)
            status = storage.tuner_status(self.job)
        except Exception as error:  # the job never registered: say so in the results
            return {"decisions": [], "applied": 0, "detail": f"no tuner record ({error})"}
        return {
            "decisions": [{"decision_id": d.decision_id, "config": describe(d.config), "reason": d.reason,
                           "source": d.source, "state": d.state, "apply_at_step": d.apply_at_step,
                           "applied_at_step": d.applied_at_step, "predicted_step_time_s": d.predicted_step_time_s,
                           "measured_step_time_s": d.measured_step_time_s} for d in decisions],
            "applied": sum(d.state in ("applied", "rolled_back") for d in decisions),
            "state": status.state if status else "", "detail": status.detail if status else "",
        }
