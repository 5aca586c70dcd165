"""The `autobyte` policy: the daemon's own tuner classes (autobyted.tuner) driven by the simulator.

The tuner sees the simulator only through `simulator.adapter` (`MetricsAdapter`: a simulated
step as the StepMetrics a real rank would send, with measurement noise; `job_shape`: the job's
registration info), never the scenario's true bandwidth or compute factor.

Samples reach the tuner in batches every `flush_interval_s` of simulated time (the client batches
its samples for 1 s), and a decision takes effect at the first step at or after its apply_at_step
that the policy has not yet started: as in the real system, the tuner acts on a delayed view.
The policy's score (steps/s) is computed by benchmarks.harness.evaluate from the simulator's true times.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from autobyte.types import Config, StepMetrics

from autobyted.tuner.memory_sink import MemorySink
from autobyted.tuner.params import TunerParams
from autobyted.tuner.predictor import Ensemble, Predictor, Window, load_prior, train_online
from autobyted.tuner.search import JobTuner, describe
from benchmarks.harness.policy import Policy, PolicyContext
from simulator.adapter import SCHEDULER_DEFAULT, T0, MetricsAdapter, job_shape
from simulator.engine import DDPConfig, RunConfig, SimulatedStep


class AutobytePolicy(Policy):
    """The daemon's tuner (autobyted.tuner.search.JobTuner) on simulated steps.

    `history`: windows of other jobs (a warm database: the retraining's data, and the windows of
    this job's shape that the search reads); `prior`: the ensemble to start from (the shipped
    prior by default); retraining on top of it happens every `retrain_interval_s` of simulated
    time when new windows came in, as the daemon's trainer thread does. `job`: the job's id, unique
    as the daemon's are (default sim-<model>; runs whose windows meet in one history need their
    own: the training pairs and the search's memory are per job)."""

    name = "autobyte"

    def __init__(
        self,
        prior: Ensemble | None = None,
        history: Sequence[Window] = (),
        mode: str = "auto",
        params: TunerParams = TunerParams(),
        seed: int = 0,
        flush_interval_s: float = 1.0,
        retrain_interval_s: float = 60.0,
        initial: Config = SCHEDULER_DEFAULT,
        noise: float = 0.03,
        job: str | None = None,
    ) -> None:
        self.job = job
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
        shape = job_shape(profile, context.workers, context.backend, context.link)
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
        self.tuner = JobTuner(
            self.job or f"sim-{profile.name}",
            shape,
            self.predictor,
            self.sink,
            self.mode,
            self.params,
            known=self.history,
        )
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

    def observe(self, record: SimulatedStep) -> RunConfig | None:
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
        pending = [
            d
            for d in self.sink.decisions
            if d.decision_id > self.applied_through and d.kind != "recommend"
        ]
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
        return (
            f"{self.tuner.phase} {describe(self.current)}; {stats['trials']} trials ({stats['cut']} cut), "
            f"{stats['retunes']} re-tunes, {stats['rollbacks']} rollbacks"
        )


def _process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a running process (Linux /proc), None where it cannot be read."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class HubDaemon:
    """A real autobyted (`--tuner auto`, or `tuner="observe"`; a fresh SQLite file) inside a
    testbed's hub namespace, for `evaluate --testbed --policy autobyte` (or `observe:P,C`): the
    ranks stream to it over their shaped links and rank 0 applies its decisions through the real
    control path. `env` is what the ranks need; `stop()` ends the daemon and returns what it
    decided (read from its database) and the CPU seconds it used."""

    PORT = 7077

    def __init__(
        self,
        bed,
        workdir,
        job: str,
        tuner: str = "auto",
        extra_args: Sequence[str] = (),
        byte_scale: float = 1.0,
    ) -> None:
        import secrets

        self.bed, self.workdir, self.job, self.tuner = bed, workdir, job, tuner
        # an emulated job's ranks run sizes / byte_scale: its decisions read in the model's bytes
        self.byte_scale = byte_scale
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
        return {
            "AUTOBYTE_DAEMON": self.address,
            "AUTOBYTE_JOB": self.job,
            "AUTOBYTE_TOKEN": self.token,
        }

    def start(self, timeout_s: float = 30.0) -> HubDaemon:
        import sys
        import time

        log = open(self.log_path, "w")  # noqa: SIM115 - the daemon's output, open while it runs
        self.proc = self.bed.start_in_hub(
            [
                sys.executable,
                "-m",
                "autobyted.app",
                "start",
                "--listen",
                self.address,
                "--db",
                self.db_url,
                "--token",
                self.token,
                "--insecure",
                "--tuner",
                self.tuner,
                "--log-format",
                "text",
                *self.extra_args,
            ],
            stdout=log,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"autobyted exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}"
                )
            if "autobyted listening" in self.log_path.read_text():
                return self
            time.sleep(0.1)
        raise RuntimeError(
            f"autobyted did not come up in the hub namespace: {self.log_path.read_text()[-2000:]}"
        )

    def stop(self) -> dict:
        """End the daemon; `records` of the job it was started for."""
        import signal

        cpu_s = None
        if self.proc is not None and self.proc.poll() is None:
            cpu_s = _process_cpu_s(self.proc.pid)  # what the daemon cost the host, before it exits
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except Exception:  # noqa: BLE001 - not stopped within 30 s: killed
                self.proc.kill()
        return self.records(self.job, cpu_s)

    def records(self, job: str, cpu_s: float | None = None) -> dict:
        """What the daemon's database holds of `job`: its decisions (in the model's bytes), the
        tuner's last status, the samples each rank sent; the daemon may still run."""
        from autobyted.storage.db import make_engine
        from autobyted.storage.sql import SqlStorage
        from benchmarks.testbed.wire import model_config

        storage = SqlStorage(make_engine(self.db_url))
        try:
            decisions = storage.decisions(job)
            status = storage.tuner_status(job)
            rows = storage.samples_after(job, 0, rank=None, limit=10_000_000)
        except Exception as error:  # noqa: BLE001 - the job never registered: say so in the results
            return {
                "decisions": [],
                "applied": 0,
                "detail": f"no tuner record ({error})",
                "daemon_cpu_s": cpu_s,
            }
        # Config() reads as the job's engine's (an FSDP2 job's return to its own knobs: prefetch =/=)
        engine = Config.engine_of(d.config for d in decisions)
        return {
            "decisions": [
                {
                    "decision_id": d.decision_id,
                    "config": model_config(d.config, self.byte_scale).short(engine),
                    "reason": d.reason,
                    "source": d.source,
                    "state": d.state,
                    "apply_at_step": d.apply_at_step,
                    "applied_at_step": d.applied_at_step,
                    "predicted_step_time_s": d.predicted_step_time_s,
                    "measured_step_time_s": d.measured_step_time_s,
                }
                for d in decisions
            ],
            "applied": sum(d.state in ("applied", "rolled_back") for d in decisions),
            "mode": status.mode if status else "",
            "state": status.state if status else "",
            "detail": status.detail if status else "",
            "daemon_cpu_s": cpu_s,
            # A rank whose stream stopped shows here (the tuner's rank merge waits for it a while).
            "samples_by_rank": dict(sorted(Counter(row.rank for row in rows).items())),
        }
