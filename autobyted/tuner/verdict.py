"""Whether one measured configuration beats another: the one rule that the tuner's search (its
winner, against the incumbent) and `autobyte best` (the stored steps of a context, against the
configuration the context began with) both judge by, so that they never name different winners."""

from __future__ import annotations

import math

from autobyted.tuner.params import TunerParams

MEDIAN_SE = (
    1.253  # sqrt(pi/2): a median of n normal draws has a standard error of 1.253 sigma / sqrt(n)
)


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
