"""What every phase of one job's search shares (tuner.phases): the job's clock, noise and
configuration in effect, the decisions it issued, the incumbent and the search under way (`Search`),
and the status they add up to. No phase logic lives here; no I/O but through the `TunerSink`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from autobyte.types import Config, StepMetrics, describe_speedup, speedup

from autobyted.storage.records import TunerStatusRecord
from autobyted.tuner.drift import robust_sigma
from autobyted.tuner.evidence import Carried, JobEvidence
from autobyted.tuner.features import JobShape, summarize
from autobyted.tuner.grid import candidate_grid, describe
from autobyted.tuner.measured import MeasuredWindow, PendingDecision
from autobyted.tuner.params import TunerParams
from autobyted.tuner.predictor import Prediction, Predictor, Window
from autobyted.tuner.sink import TunerSink


@dataclasses.dataclass
class Search:
    """One search, from its baseline to the configuration it settles on (tuner.transitions
    opens it): what its phases measured and concluded, which outlives any one phase."""

    retune_reason: str  # why it was opened ("" for the job's first search)
    window_steps: int  # the length of the measurement window in use (sized by step time)
    trials: list[MeasuredWindow] = dataclasses.field(default_factory=list)
    trials_planned: int = 0
    # context jumps (signal, direction) a check of the incumbent showed to be the configurations'
    cleared: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    # trials a check of the incumbent followed (their A-B-A)
    checked: list[MeasuredWindow] = dataclasses.field(default_factory=list)
    confirmed: bool = False  # the incumbent was measured again at the end of this search
    # what this model held at another world size, tried first (the job's first search only)
    carried: Carried | None = None

    def context_note(self) -> str:
        return f" ({self.retune_reason})" if self.retune_reason else ""


@dataclasses.dataclass
class Clock:
    """What the job's newest sample says; JobTuner writes it (`tick`), everything else reads."""

    newest_step: int = -1
    newest_wall_s: float = 0.0
    first_wall_s: float | None = None  # the job's first sample (the horizon's clock)
    step_s: float = 0.0  # recent step time (sizes windows in time)
    config: Config | None = None  # in effect, from the newest sample
    decision_in_effect: int | None = None

    def tick(self, m: StepMetrics) -> bool:
        """Take the sample in; True when the decision in effect changed with it."""
        self.newest_step = m.step
        self.newest_wall_s = m.wall_time_s
        if self.first_wall_s is None:
            self.first_wall_s = m.wall_time_s
        self.step_s = m.step_time_s if not self.step_s else 0.9 * self.step_s + 0.1 * m.step_time_s
        self.config = m.config
        changed = self.decision_in_effect is not None and m.decision_id != self.decision_in_effect
        self.decision_in_effect = m.decision_id
        return changed


class Noise:
    """The job's step-time noise (log units): a robust spread of every measured window's
    deviations from its own median, pooled over the recent windows (a 12-step window alone
    misjudges it by +-30%). Written when a window is measured (`learn`) only."""

    def __init__(self, sigma_floor: float) -> None:
        self.sigma_floor = sigma_floor
        self.sigma = sigma_floor
        self.residuals: list[float] = []  # log step time minus its window's median, recent windows

    def learn(self, samples: Sequence[StepMetrics]) -> None:
        self.residuals, self.sigma = self.after(samples)

    def after(self, samples: Sequence[StepMetrics]) -> tuple[list[float], float]:
        """(residuals, sigma) as `learn` would leave them after `samples`; nothing changes."""
        logs = [math.log(s.step_time_s) for s in samples]
        center = statistics.median(logs)
        residuals = [*self.residuals, *(x - center for x in logs)][-400:]
        return residuals, max(self.sigma_floor, robust_sigma(residuals))


class TunerJob:
    """One job's state that lasts across phases, and the helpers every phase uses, by who writes
    it: the clock (JobTuner, `clock`), the noise (a measured window, `noise`), the status (`set`,
    from tuner.transitions only), and what the search remembers (the rest: tuner.transitions;
    `held` also by the watching phase, whose it is)."""

    def __init__(
        self,
        job: str,
        shape: JobShape,
        predictor: Predictor,
        sink: TunerSink,
        mode: str,
        params: TunerParams,
        known: Sequence[Window],
        first_segment: int,
    ) -> None:
        self.evidence = JobEvidence(job, shape, known, first_segment)
        self.job, self.shape, self.predictor, self.sink = job, shape, predictor, sink
        self.mode, self.params = mode, params
        self.phase = "warm-up"  # the name status shows (tuner.transitions.STATES; set there only)
        self.detail = f"warm-up (first {params.warmup_steps} steps)"
        self.first_segment = self.segment = first_segment
        self.clock = Clock()
        self.noise = Noise(params.sigma_floor)
        self.own_decision_ids: set[int] = set()
        self.pending: PendingDecision | None = None
        self.paused = False
        self.search = Search("", params.baseline_steps)  # the one under way (or the last)
        self.incumbent: MeasuredWindow | None = None  # what the last baseline measured
        self.starting: MeasuredWindow | None = None  # the job's first incumbent
        self.held: MeasuredWindow | None = None  # what a watching phase holds
        self.searched_once = False
        self.fruitless = 0  # re-tunes in a row that kept the configuration
        self.aborts = 0  # searches in a row that the context moved under
        self.candidates: tuple[Config, ...] = ()
        self.best_predicted_s = 0.0
        self.recommended: Config | None = None
        # Counters the benchmarks read (never steer anything).
        self.stats = {
            "trials": 0,
            "cut": 0,
            "switches": 0,
            "rollbacks": 0,
            "retunes": 0,
            "not_applied": 0,
        }

    @property
    def status(self) -> TunerStatusRecord:
        held = self.held or self.incumbent
        return TunerStatusRecord(
            mode=self.mode,
            state=self.phase,
            detail=self.detail,
            config=(
                self.recommended
                if self.mode == "observe" and self.recommended
                else held.config
                if held
                else self.config
            )
            or Config(),
            baseline_step_time_s=self.starting.median_s if self.starting else 0.0,
            measured_step_time_s=held.median_s if held else 0.0,
            predicted_step_time_s=self.best_predicted_s,
            trials_done=len(self.search.trials),
            trials_planned=self.search.trials_planned,
            paused=self.paused,
        )

    def set(self, phase: str, detail: str) -> None:
        """Name the phase and what it does; the status is published when either changed."""
        changed = (phase, detail) != (self.phase, self.detail)
        self.phase, self.detail = phase, detail
        if changed:
            self.sink.publish(self.status)

    def window(self, nominal: int, seconds: float) -> int:
        """Steps in a measurement window: `nominal`, fewer when steps are so long that the window
        would last more than `seconds` (a search must end before the context moves on), never
        fewer than the sequential test needs."""
        if self.step_s <= 0:
            return nominal
        return max(self.params.min_trial_steps + 2, min(nominal, math.ceil(seconds / self.step_s)))

    def horizon_steps(self, step_s: float) -> float:
        """Steps the winner of a search is expected to be held: the context's expected remaining
        lifetime (memoryless changes: the mean lifetime, from this job's own changes and
        `context_prior_s`), in steps of `step_s`."""
        first_wall_s = self.clock.first_wall_s
        elapsed_s = max(0.0, self.newest_wall_s - (first_wall_s or self.newest_wall_s))
        lifetime_s = (elapsed_s + self.params.context_prior_s) / (
            self.segment - self.first_segment + 1
        )
        return lifetime_s / max(step_s, 1e-6)

    def backoff(self) -> float:
        """The drift and rescore bars, raised by re-tunes in a row that kept the configuration."""
        return self.params.fruitless_backoff ** min(self.fruitless, self.params.fruitless_max)

    # What the newest sample says (written by JobTuner through `clock.tick` only).
    @property
    def config(self) -> Config | None:
        return self.clock.config

    @property
    def decision_in_effect(self) -> int | None:
        return self.clock.decision_in_effect

    @property
    def newest_step(self) -> int:
        return self.clock.newest_step

    @property
    def newest_wall_s(self) -> float:
        return self.clock.newest_wall_s

    @property
    def step_s(self) -> float:
        return self.clock.step_s

    @property
    def sigma(self) -> float:
        """The job's step-time noise (written by `learn_noise` only)."""
        return self.noise.sigma

    def learn_noise(self, samples: Sequence[StepMetrics]) -> None:
        self.noise.learn(samples)

    def noise_with(self, samples: Sequence[StepMetrics]) -> tuple[list[float], float]:
        return self.noise.after(samples)

    def decide(
        self, config: Config, reason: str, predicted_s: float | None, kind: str
    ) -> int | None:
        """Issue a decision a few steps ahead and wait for the job to apply it (the tuner skips
        samples while it is pending); None when the sink refused it (an operator's pause: the
        job is paused: tuner.transitions._switch)."""
        decision = self.sink.decide(
            config, self.newest_step + self.params.apply_lead_steps, reason, predicted_s, kind
        )
        if decision is None:
            return None
        self.own_decision_ids.add(decision)
        self.pending = PendingDecision(
            decision, config, self.newest_step + self.params.apply_lead_steps, self.newest_wall_s
        )
        return decision

    def record(self, measured: MeasuredWindow) -> None:
        """Store a measured window (the predictor's training data and the evidence of later jobs)."""
        if len(measured.samples) < self.params.min_trial_steps:
            return
        context = summarize(measured.samples, self.shape)
        self.sink.record_window(
            Window(
                self.job,
                self.segment,
                measured.config,
                context,
                measured.median_s,
                len(measured.samples),
                measured.samples[-1].wall_time_s,
            )
        )

    def plan(
        self,
        incumbent: MeasuredWindow,
        trials: Sequence[MeasuredWindow],
        sigma: float,
        extra: tuple[Config, ...] = (),
    ) -> tuple[tuple[Config, ...], Prediction]:
        """The candidates around `incumbent` and their predictions from its window: the model,
        corrected by this job's errors, combined with what earlier jobs measured here (`sigma`:
        the job's noise; `trials`: what this search measured besides the incumbent; `extra`:
        configurations outside the grid to score too, what this model ran at another size)."""
        starting = self.starting.config if self.starting is not None else incumbent.config
        grid = candidate_grid(self.shape, starting, around=incumbent.config)
        candidates = grid + tuple(c for c in extra if c not in grid)
        context = summarize(incumbent.samples, self.shape)
        prediction = self.evidence.with_known(
            self.evidence.corrected(
                self.predictor.predict(context, incumbent.config, candidates), incumbent.config
            ),
            incumbent,
            [incumbent, *trials],
            sigma,
        )
        return candidates, prediction

    def versus_incumbent(self, step_time_s: float, window: MeasuredWindow | None = None) -> str:
        """'1.12x faster than 4MiB/16MiB': a step time against the search's incumbent (as
        `window` is compared with it, where given: MeasuredWindow.against)."""
        assert self.incumbent is not None
        reference = self.incumbent.median_s if window is None else window.against(self.incumbent)
        return describe_speedup(speedup(reference, step_time_s), describe(self.incumbent.config))
