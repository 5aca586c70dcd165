"""The tuner's decision arithmetic, without state: whether one measured configuration beats another
(the one rule that the tuner's search and `autobyte best` both judge by, so that they never name
different winners), what a trial is worth (`trial_value`) and which trials pay (`paying`), how much
of the predicted gains a search's trials delivered (`gain_calibration`), and the sequential and
A-B-A tests on measured windows (`trial_beats_both`, `moved`, `unexplained_jump`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from autobyte.types import Config, describe_speedup

from autobyted.tuner.drift import Alarm, context_jump, window_shift
from autobyted.tuner.grid import describe
from autobyted.tuner.measured import MeasuredWindow
from autobyted.tuner.params import TunerParams

MEDIAN_SE = (
    1.253  # sqrt(pi/2): a median of n normal draws has a standard error of 1.253 sigma / sqrt(n)
)
SWITCH_STEPS = 2.0  # steps a trial loses to its two switches (in, and back or on): a step each


def beats(
    candidate_log_median: float,
    candidate_steps: int,
    reference_log_median: float,
    reference_steps: int,
    sigma: float,
    params: TunerParams = TunerParams(),
) -> bool:
    """The candidate's median step time (log) is below the reference's by more than min_gain and by
    z_switch standard errors of the difference (sigma: the spread of one step's log step time)."""
    gain = reference_log_median - candidate_log_median
    se = MEDIAN_SE * sigma * math.sqrt(1 / candidate_steps + 1 / reference_steps)
    return gain > max(math.log1p(params.min_gain), params.z_switch * se)


def beats_both(
    trial_log_median: float,
    trial_steps: int,
    before_log_median: float,
    after_log_median: float,
    incumbent_steps: int,
    sigma: float,
    params: TunerParams,
) -> bool:
    """The incumbent measured before and after a trial (the shorter window's `incumbent_steps`): if
    the trial beats both measurements by the switch margin, it beats the incumbent in any context in
    between; a context that moved less than the gain cannot explain the gain away (a 10x better
    configuration on a noisy host)."""
    se = MEDIAN_SE * sigma * math.sqrt(1 / trial_steps + 1 / incumbent_steps)
    margin = max(math.log1p(params.min_gain), params.z_switch * se)
    return trial_log_median < min(before_log_median, after_log_median) - margin


def step_time_move(
    before_log_median: float,
    before_steps: int,
    after_log_median: float,
    after_steps: int,
    sigma: float,
    params: TunerParams,
) -> float | None:
    """The log move of one configuration's median step time between two windows, when it is beyond
    min_gain and z_switch standard errors; None when the two windows agree."""
    se = MEDIAN_SE * sigma * math.sqrt(1 / after_steps + 1 / before_steps)
    moved = after_log_median - before_log_median
    if abs(moved) > max(math.log1p(params.min_gain), params.z_switch * se):
        return moved
    return None


def rolls_back(
    verified_log_median: float,
    verified_steps: int,
    incumbent_log_median: float,
    incumbent_steps: int,
    sigma: float,
    params: TunerParams,
) -> bool:
    """A switched-to winner's verification window is slower than the incumbent beyond half of
    min_gain and z_switch standard errors: the switch is rolled back."""
    se = MEDIAN_SE * sigma * math.sqrt(1 / verified_steps + 1 / incumbent_steps)
    return verified_log_median - incumbent_log_median > max(
        math.log1p(params.min_gain) / 2, params.z_switch * se
    )


def clearly_worse(
    step_times_s: Iterable[float], best_log_median: float, sigma: float, params: TunerParams
) -> bool:
    """Wald's SPRT on log step times against the best configuration measured (its log median):
    H0 mean = best_log_median, H1 = that + log(1 + clearly_worse), sigma = the job's pooled noise;
    True when H1 is accepted."""
    mu0 = best_log_median
    delta = math.log1p(params.clearly_worse)
    sigma2 = sigma * sigma
    low, high = mu0 - delta - 3 * sigma, mu0 + 2 * delta + 3 * sigma  # winsorized
    llr = sum(
        delta / sigma2 * (min(high, max(low, math.log(s))) - mu0 - delta / 2) for s in step_times_s
    )
    return llr >= math.log((1 - params.sprt_beta) / params.sprt_alpha)


def normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


@dataclasses.dataclass(frozen=True)
class TrialValue:
    """What trying one candidate is expected to bring (tuner/transitions.py's docstring: "when a trial pays")."""

    win_probability: float  # P(X < -log(1 + min_gain))
    value_steps: float  # expected steps saved over the horizon minus the trial's expected excess

    @property
    def pays(self) -> bool:
        return self.win_probability >= 0.5 and self.value_steps > 0


def gain_calibration(
    pairs: Sequence[tuple[float, float]], prior_sd: float, error_sd: float
) -> float:
    """How much of the gains the model predicts this search's trials delivered: the slope b of
    measured on predicted log ratio (each trial's, against the reference it was scored from),
    through the origin, with a Normal(1, prior_sd) prior and each trial's measurement off its
    b x prediction by Normal(0, error_sd) (a candidate's own error). Returns b's posterior mean,
    clipped at 0 (a model measured backwards says nothing of which way the untried go); 1 before
    any trial. Only the mean is used: the spread the untried are scored with already grows with
    this search's residuals (next_trial in tuner/transitions.py). The candidates a search
    tries are those predicted fastest, so their errors share a sign (a model optimistic about this job, and the winner's
    curse of trying the most optimistic predictions first); the untried candidates' predicted
    gains shrink by the same slope, and a search whose first trials measured none of what was
    predicted stops (no trial pays) instead of trying the rest of its list."""
    precision = 1.0 / prior_sd**2 + sum(x * x for x, _ in pairs) / error_sd**2
    mean = (1.0 / prior_sd**2 + sum(x * y for x, y in pairs) / error_sd**2) / precision
    return max(0.0, mean)


def trial_value(
    mean: float,
    spread: float,
    horizon_steps: float,
    trial_steps: float,
    cut_steps: float,
    min_gain: float,
    clearly_worse: float,
    switch_steps: float = SWITCH_STEPS,
) -> TrialValue:
    """The value of trying a candidate whose log step-time ratio X to the best measured
    configuration is Normal(mean, spread); E[e^X 1{X < g}] = e^(mean + spread^2 / 2) x
    Phi((g - mean - spread^2) / spread)."""
    sd = max(spread, 1e-6)
    gate = -math.log1p(min_gain)
    cut = math.log1p(clearly_worse)
    lognormal_mean = math.exp(mean + sd * sd / 2)

    def below(g: float) -> tuple[float, float]:
        """(P(X < g), E[e^X 1{X < g}])."""
        return normal_cdf((g - mean) / sd), lognormal_mean * normal_cdf((g - mean - sd * sd) / sd)

    p_win, e_win = below(gate)
    p_kept, e_kept = below(cut)  # not cut by the sequential test: the whole window is run
    gain_per_step = p_win - e_win  # E[(1 - e^X) 1{X < gate}]
    excess_kept = e_kept - p_kept  # E[(e^X - 1) 1{X < cut}]
    excess_cut = (lognormal_mean - e_kept) - (1 - p_kept)  # E[(e^X - 1) 1{X >= cut}]
    value = (
        horizon_steps * gain_per_step
        - trial_steps * excess_kept
        - cut_steps * excess_cut
        - switch_steps
    )
    return TrialValue(p_win, value)


Valued = tuple[
    Config, float, TrialValue
]  # (candidate, predicted mean log ratio, its trial's value)


def paying(
    scored: Sequence[tuple[Config, float, float]],
    horizon_steps: float,
    trial_steps: float,
    cut_steps: float,
    params: TunerParams,
) -> tuple[list[Valued], Valued | None]:
    """Of (candidate, mean, spread) predicted against a reference, the ones whose trial pays
    (trial_value), best value first; and the best of all (for the reason when none pays)."""
    valued = sorted(
        (
            (
                c,
                mu,
                trial_value(
                    mu,
                    sd,
                    horizon_steps,
                    trial_steps,
                    cut_steps,
                    params.min_gain,
                    params.clearly_worse,
                ),
            )
            for c, mu, sd in scored
        ),
        key=lambda t: -t[2].value_steps,
    )
    pays = [t for t in valued if t[2].pays]
    best = max(valued, key=lambda t: t[2].win_probability, default=None)
    return pays, best


def none_pays(best: Valued | None) -> str:
    """Why a search ends without (further) trials."""
    if best is None:
        return "no candidate left to try"
    config, mu, value = best
    return (
        f"no trial is likely to win more than it costs; the likeliest, {describe(config)}, "
        f"predicted {describe_speedup(math.exp(-mu), 'the incumbent')}, "
        f"{100 * value.win_probability:.0f}% likely to win"
    )


def trial_beats_both(
    trial: MeasuredWindow,
    before: MeasuredWindow,
    after: MeasuredWindow,
    sigma: float,
    params: TunerParams,
) -> bool:
    """The incumbent measured before and after a trial: if the trial beats both measurements by
    the switch margin, it beats the incumbent in any context in between; a context that moved
    less than the gain cannot explain the gain away (a 10x better configuration on a noisy host)."""
    return beats_both(
        trial.log_median,
        len(trial.samples),
        before.log_median,
        after.log_median,
        min(len(before.samples), len(after.samples)),
        sigma,
        params,
    )


def moved(
    before: MeasuredWindow, after: MeasuredWindow, sigma: float, params: TunerParams
) -> Alarm | None:
    """The same configuration measured twice: did its context (or its step time) move?"""
    shift = window_shift(before.samples, after.samples)
    if shift is not None:
        return shift
    move = step_time_move(
        before.log_median,
        len(before.samples),
        after.log_median,
        len(after.samples),
        sigma,
        params,
    )
    if move is not None:
        return Alarm(
            "step_time",
            1 if move > 0 else -1,
            move,
            "step time rise" if move > 0 else "step time drop",
        )
    return None


def unexplained_jump(
    incumbent: MeasuredWindow, trials: Sequence[MeasuredWindow], trial: MeasuredWindow
) -> Alarm | None:
    """The trial's context jump against the incumbent (drift.context_jump), unless the trial's
    context figures agree with those of another configuration measured in this search: then the
    jump is what configurations do to the figures, not the context moving (a 64 KiB partition's
    bandwidth estimate against a 4 MiB one's)."""
    jump = context_jump(incumbent.samples, trial.samples)
    if jump is None or any(context_jump(other.samples, trial.samples) is None for other in trials):
        return None
    return jump
