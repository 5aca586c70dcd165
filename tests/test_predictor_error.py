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


def test_each_block_is_scored_from_the_configuration_its_job_started_from():
    """Emulated blocks start from the derived configuration, not the constant default: the
    from-default errors are taken from each job's own reference."""
    from autobyted.tuner.predictor import Window
    from benchmarks.predictor_error import score, unchanged

    windows = [Window("cpu", 0, c, None, t, 4) for c, t in ((DEFAULT, 1.0), (A, 0.8))]
    windows += [Window("emu", 0, c, None, t, 4) for c, t in ((A, 1.0), (B, 1.25))]
    result = score(unchanged, windows, {"cpu": DEFAULT, "emu": A})
    # cpu from DEFAULT: A |1/0.8 - 1| = 0.25; emu from A: B |1/1.25 - 1| = 0.2
    assert sorted(result["_raw"]["from_default"]) == pytest.approx([0.2, 0.25])
    with pytest.raises(KeyError):
        score(unchanged, windows, {"cpu": DEFAULT})


def test_emulated_folds_leave_out_model_rank_count_and_rate_of_emulated_blocks_only():
    from benchmarks.predictor_error import folds, simulator_exclusion

    cpu = {"model": "resnet", "condition": "quiet", "world_size": 2}
    emulated = [
        {"model": m, "condition": c, "world_size": n, "emulated": {"byte_scale": 8}}
        for m, n, c in (("resnet50", 2, "rate=1x"), ("gpt2-medium", 4, "rate=2x"))
    ]
    blocks = [cpu, *emulated]
    got = {(kind, name): [held(b) for b in blocks] for kind, name, held in folds(blocks, True)}
    assert got == {
        ("model", "gpt2-medium"): [False, False, True],
        ("model", "resnet50"): [False, True, False],
        ("ranks", "2"): [False, True, False],  # the CPU block at 2 ranks stays in training
        ("ranks", "4"): [False, False, True],
        ("condition", "rate=1x"): [False, True, False],
        ("condition", "rate=2x"): [False, False, True],
    }
    assert [name for _, name, _ in folds(blocks)] == ["resnet"]  # the CPU regime's only
    # the emulated ranks run the simulator's own profile: left out of the simulated windows too
    assert simulator_exclusion("model", "resnet50", True) == ("resnet50",)
    assert simulator_exclusion("model", "gpt2-medium", True) == ()
    assert simulator_exclusion("model", "resnet", False) == ()
