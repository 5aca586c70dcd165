"""The tuner's constants (`TunerParams`) and how each was chosen."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TunerParams:
    """The tuner's constants. None was fitted to a scenario; each follows from a cost or a test:

    - warmup_steps 10: the scheduler records first-use order and allocates in the first steps.
    - transition_steps 2: the first step after a switch still waits on the previous step's
      all-reduces (cross-iteration overlap), the second may still be planned under the old one.
    - baseline_steps 20 / rebaseline_steps 12 / trial_steps 16: the standard error of a median of
      n log step times is 1.25 sigma/sqrt(n); at the 2-4% noise measured on the testbed, 16 steps
      resolve ~3% differences at 2.5 standard errors.
    - trial_window_s 30 / baseline_window_s 60: with long steps (seconds each) a window is cut to
      about that much time (at least min_trial_steps + 2 steps): a search has to end before the
      context moves on, and a few slow steps still resolve the large differences worth a switch.
    - min_gain 2%: below that a switch does not pay for its transition steps within a few minutes,
      and it is the testbed's run-to-run spread of a configuration's median.
    - z_switch 2.5: a switch needs a difference of 2.5 standard errors (~0.6% one-sided error).
    - kappa 1: optimism of the bound of observe mode's recommendations and of the re-scoring while
      holding (one spread of the ensemble); trials are chosen by their value (verdict.trial_value).
    - context_prior_s 600: the prior mean lifetime of a context (one pseudo-change) in the
      estimate of how long a search's winner will be held (tuner/transitions.py, "when a trial pays"): until
      a job shows its own changes, a context is taken to last ten minutes, about three times what
      a full search takes (baseline + 4 trials + confirm + verify at 60/30 s windows), so that a
      job's own first minutes decide, and a prior an order of magnitude off moves the horizon by
      only a few times its own error after the first change.
    - clearly_worse 10%, sprt_alpha 1%, sprt_beta 10%: the early cut's alternative hypothesis and
      error rates (Wald's thresholds log((1 - beta) / alpha)).
    - max_trials 4: the issue's "never more than a few"; each costs ~20 steps.
    - fruitless_backoff 1.5, fruitless_max 4: after k re-tunes in a row that kept the configuration
      (or that the context moved under), the drift test's reference value and threshold grow by
      1.5^k (at most ~5x): a host whose load wanders (a shared machine) stops costing trials, a
      large change still re-tunes, later.
    - rescore_s 60: while holding, the predictor re-scores the candidates in the current context
      once a minute (a few ms), so that a drift too gradual for the CUSUM still re-opens the search
      when it makes another configuration clearly (twice min_gain) better.
    - max_aborts 2: after two searches in a row that the context moved under, the tuner holds what
      is in effect and waits for the drift detector (with the raised bar) instead of searching on.
    - apply_lead_steps 2: decisions name a step slightly ahead of the newest one seen; a rank that
      is further ahead applies at its next boundary (the scheduler does).
    - gain_slope_prior_sd 1.0, gain_error_sd 0.08: the gain calibration of a search
      (search.gain_calibration: measured = slope x predicted log ratio of its trials, a prior
      slope of 1). On the real windows, with a prior that never saw the block's model
      (benchmarks/replay_tuner.py), the first search's four candidates measured off slope x
      predicted by 0.082 RMS within a block (gain_error_sd); the slope pooled over the 17 blocks
      is 0.96 (the model is not optimistic on average) and the blocks' own slopes spread by
      more than 1 beyond their sampling error: a prior sd of 1 leaves one trial that measured
      none of a 15% predicted gain to cut the next predictions to about a quarter.
    - apply_timeout_s 30 and apply_timeout_steps 10: a decision not in effect in a sample taken 30 s
      (the job's clock) and 10 steps after the newest sample seen when deciding is given up; the
      client sends samples every second and applies a decision at its next step.
    """

    warmup_steps: int = 10
    transition_steps: int = 2
    baseline_steps: int = 20
    rebaseline_steps: int = 12
    trial_steps: int = 16
    min_trial_steps: int = 5
    max_trials: int = 4
    trial_window_s: float = 30.0
    baseline_window_s: float = 60.0
    min_gain: float = 0.02
    z_switch: float = 2.5
    kappa: float = 1.0
    clearly_worse: float = 0.10
    sprt_alpha: float = 0.01
    sprt_beta: float = 0.10
    sigma_floor: float = 0.01
    rescore_s: float = 60.0
    max_aborts: int = 2
    context_prior_s: float = 600.0
    fruitless_backoff: float = 1.5
    fruitless_max: int = 4
    apply_lead_steps: int = 2
    apply_timeout_s: float = 30.0
    apply_timeout_steps: int = 10
    gain_slope_prior_sd: float = 1.0
    gain_error_sd: float = 0.08
