"""The predictor-error benchmark's rounds-averaged measure (benchmarks/predictor_error.py) on
hand-made predictions: averaging the rounds removes noise of opposite sign in the two rounds, not a
predictor's bias; the no-change baseline is scored the same way."""

from __future__ import annotations

import math

import pytest
from autobyte.types import Config

from benchmarks.predictor_error import averaged_over_rounds, pooled, summary

DEFAULT = Config(4 << 20, 16 << 20)
A, B = Config(1 << 20, 4 << 20), Config(16 << 20, None)


def logs(**times: float) -> dict[Config, float]:
    names = {"default": DEFAULT, "a": A, "b": B}
    return {names[k]: math.log(v) for k, v in times.items()}


def test_noise_of_opposite_sign_in_the_two_rounds_cancels():
    # the truth is default 1.0, a 0.9, b 1.2; each round measures +-10% on a; the predictor is exact
    rounds = {
        "job": [
            (logs(default=1.0, a=0.9, b=1.2), logs(default=1.0, a=0.9 * 1.1, b=1.2)),
            (logs(default=1.0, a=0.9, b=1.2), logs(default=1.0, a=0.9 / 1.1, b=1.2)),
        ]
    }
    errors, taus = averaged_over_rounds(rounds, DEFAULT)
    assert errors == pytest.approx([0.0, 0.0])  # the default itself is not scored
    assert taus == [pytest.approx(1.0)]


def test_a_predictors_bias_survives_the_averaging():
    # it predicts b 20% faster than measured in both rounds, and so the wrong order of a and b
    rounds = {
        "job": [
            (logs(default=1.0, a=0.9, b=0.8), logs(default=1.0, a=0.9, b=1.0)),
            (logs(default=1.0, a=0.9, b=0.8), logs(default=1.0, a=0.9, b=1.0)),
        ]
    }
    errors, taus = averaged_over_rounds(rounds, DEFAULT)
    assert sorted(errors) == pytest.approx([0.0, 0.2])
    assert taus[0] < 1.0


def test_a_block_seen_in_one_round_only_is_not_averaged_and_pooling_keeps_the_measure():
    one = {"job": [(logs(default=1.0, a=0.5), logs(default=1.0, a=1.0))]}
    assert averaged_over_rounds(one, DEFAULT) == ([], [])
    two = {
        "job": [
            (logs(default=1.0, a=1.0), logs(default=1.0, a=1.1)),
            (logs(default=1.0, a=1.0), logs(default=1.0, a=1.1)),
        ]
    }
    errors, taus = averaged_over_rounds(two, DEFAULT)
    fold = summary([0.1], [0.1], [1.0], errors, taus)
    both = pooled([fold, summary([0.3], [0.3], [0.0])])
    assert both["rounds_averaged"]["median"] == pytest.approx(1.0 - 1.0 / 1.1)
    assert both["from_default"]["n"] == 2 and both["rounds_averaged"]["n"] == 1


def test_the_no_change_baseline_scores_the_measured_spread_and_has_no_order():
    from autobyted.tuner.predictor import Window
    from benchmarks.predictor_error import score, unchanged

    # no predictor reads the context here: the baseline uses the reference's step time only
    windows = [
        Window("b", r, c, None, t, 10)
        for r in (0, 1)
        for c, t in ((DEFAULT, 1.0), (A, 0.8), (B, 1.25))
    ]
    result = score(unchanged, windows, DEFAULT)
    assert result["from_default"]["median"] == pytest.approx(
        0.225
    )  # |1/0.8 - 1| = 0.25, |1/1.25 - 1| = 0.2
    assert result["tau_median"] is None and result["rounds_averaged"]["tau_median"] is None
    assert result["rounds_averaged"]["n"] == 2


def test_the_stretch_factor_recovers_how_much_larger_the_measured_effects_are():
    import numpy as np

    from benchmarks.studies.predictor_learners import fit_stretch

    predicted = np.array([0.1, -0.2, 0.05, 0.3])
    assert fit_stretch(predicted, 0.4 * predicted, np.ones(4)) == pytest.approx(0.4)
    # a row of zero weight does not count; no signal at all leaves the prediction as it is
    assert fit_stretch(
        predicted, np.array([0.04, -0.08, 0.02, 9.0]), np.array([1.0, 1.0, 1.0, 0.0])
    ) == pytest.approx(0.4)
    assert fit_stretch(np.zeros(3), np.ones(3), np.ones(3)) == 1.0


def test_the_lookup_learns_each_configurations_median_ratio_and_predicts_from_any_reference():
    from autobyted.tuner.predictor import Window
    from benchmarks.studies.predictor_learners import config_lookup, lookup_predictor

    # a is 20% faster than the default in two rounds, 40% in a third (median: 0.8); b only measured once
    rows = [
        ("j1", 0, DEFAULT, 1.0),
        ("j1", 0, A, 0.8),
        ("j1", 1, DEFAULT, 2.0),
        ("j1", 1, A, 1.6),
        ("j2", 0, DEFAULT, 1.0),
        ("j2", 0, A, 0.6),
        ("j2", 0, B, 1.5),
        ("j2", 1, B, 9.0),
    ]
    table = config_lookup([Window(j, s, c, None, t, 10) for j, s, c, t in rows], DEFAULT)
    assert set(table) == {DEFAULT, A, B}  # j2's round 1 has no default: not used
    assert math.exp(table[A]) == pytest.approx(0.8) and math.exp(table[B]) == pytest.approx(1.5)
    predict = lookup_predictor(table)
    ref = Window("new", 0, A, None, 0.4, 10)
    assert predict(ref, A, [A, DEFAULT, B, Config(None, None)]) == pytest.approx(
        [0.4, 0.5, 0.75, 0.4]
    )


def test_the_in_job_split_keeps_the_default_and_tests_only_what_the_job_did_not_measure():
    from autobyted.tuner.predictor import Window
    from benchmarks.studies.predictor_learners import in_job_split

    configs = [DEFAULT, A, B, Config(1 << 20, None), Config(None, None)]
    windows = [Window("b", r, c, None, 1.0 + i, 10) for r in (0, 1) for i, c in enumerate(configs)]
    seen, test = in_job_split(windows, 3, DEFAULT, seed=1)
    assert (
        len(seen) == 3 and all(w.segment == 0 for w in seen) and DEFAULT in {w.config for w in seen}
    )
    unseen = set(configs) - {w.config for w in seen}
    assert {w.config for w in test} == unseen | {DEFAULT} and all(w.segment == 1 for w in test)
    assert in_job_split(windows, 3, DEFAULT, seed=1) == (
        seen,
        test,
    )  # the draw is fixed by the seed
    assert in_job_split([w for w in windows if w.segment == 0], 3, DEFAULT, seed=1) == (
        [],
        [],
    )  # one round
    assert in_job_split(windows, 6, DEFAULT, seed=1) == ([], [])  # fewer configurations than K
