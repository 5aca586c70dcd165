"""The tuner's state machine on scripted jobs: find, hold, no headroom, rollback, drift, operator,
observe mode, a job that never applies a decision, and broken samples."""

from __future__ import annotations

import dataclasses
import math

from autobyte.types import Config

from autobyted.tuner.memory_sink import MemorySink
from autobyted.tuner.params import TunerParams
from autobyted.tuner.search import JobTuner, gain_calibration, trial_value
from autobyted.tuner.verdict import unexplained_jump
from tests.helpers.tuner import BEST, SHAPE, START, ScriptedJob, better, predictor_for, sample

MIB = 1 << 20


def make(predictor, mode="auto", params=TunerParams()):
    sink = MemorySink("job")
    return JobTuner("job", SHAPE, predictor, sink, mode, params), sink


def states(sink):
    return [s.state for s in sink.statuses]


def test_finds_the_better_configuration_and_holds_it():
    tuner, sink = make(predictor_for(BEST, 0.3))
    job = ScriptedJob(better(BEST, 0.3))
    job.run(tuner, sink, 400)
    assert tuner.phase == "holding" and job.config == BEST
    assert states(sink)[:3] == ["baseline", "exploring", states(sink)[2]]
    trials = [d for d in sink.decisions if d.kind == "trial"]
    assert trials and trials[0].config == BEST  # the predictor's top candidate first
    assert all(d.measured_step_time_s is not None for d in trials)
    assert (
        trials[0].predicted_step_time_s < 0.1 and abs(trials[0].measured_step_time_s - 0.07) < 0.005
    )
    assert "holding 1MiB/4MiB" in tuner.detail and "1.4" in tuner.detail  # 0.1 / 0.07 = 1.43x
    status = tuner.status
    assert status.config == BEST and abs(status.baseline_step_time_s - 0.1) < 0.005
    assert abs(status.measured_step_time_s - 0.07) < 0.005


def test_no_headroom_when_nothing_beats_the_starting_configuration():
    # The predictor (trained on jobs where BEST was 30% faster) is wrong for this job: every other
    # configuration is 25% slower. Trials are cut early and the job is told there is no headroom.
    tuner, sink = make(predictor_for(BEST, 0.3))

    def landscape(config, step):
        return (0.1 if config == START else 0.125), 1e8

    job = ScriptedJob(landscape)
    job.run(tuner, sink, 500)
    assert tuner.phase == "no headroom" and job.config == START
    assert "no headroom: nothing beat the starting configuration 4MiB/16MiB" in tuner.detail
    trials = [d for d in sink.decisions if d.kind == "trial"]
    assert trials and all(d.state == "rolled_back" for d in trials)  # cut: clearly worse
    assert tuner.stats["cut"] == len(trials)
    assert sink.decisions[-1].kind == "return" and sink.decisions[-1].config == START
    # cut trials cost few steps: transition + the SPRT's minimum + delivery of one batch
    assert sum(c != START for c in job.configs) < len(trials) * 40
    job.run(tuner, sink, 300)  # and it stops exploring
    assert [d.kind for d in sink.decisions].count("trial") == len(trials)


def test_a_switch_that_measures_worse_than_the_incumbent_is_rolled_back():
    # BEST looks 30% faster while it is tried, and is 20% slower from then on (nothing else in the
    # job's context moves): the verification window catches it and the tuner rolls back.
    tuner, sink = make(predictor_for(BEST, 0.3), params=TunerParams(max_trials=2))
    state = {"switched_at": None}

    def landscape(config, step):
        if config == BEST:
            trial_window = state["switched_at"] is None or step < state["switched_at"] + 25
            if state["switched_at"] is None:
                state["switched_at"] = step
            return (0.07 if trial_window else 0.12), 1e8
        if config == START:
            return 0.1, 1e8
        return 0.13, 1e8

    job = ScriptedJob(landscape)
    job.run(tuner, sink, 200)
    # BEST won its trial (no other candidate is predicted to beat it), the incumbent measured again
    # had not moved (A-B-A), the switch back to BEST measured 20% slower than the incumbent: rolled
    # back, and the switch is marked rolled_back with its measurement
    kinds = [d.kind for d in sink.decisions]
    assert kinds == ["trial", "check", "switch", "rollback"], kinds
    assert sink.decisions[1].reason.startswith("confirm: measuring 4MiB/16MiB again")
    switch, rollback = sink.decisions[2:]
    assert switch.state == "rolled_back" and abs(switch.measured_step_time_s - 0.12) < 0.006
    assert rollback.config == START and rollback.reason.startswith("rollback: 1MiB/4MiB measured")
    assert tuner.stats["rollbacks"] == 1
    job.run(tuner, sink, 200)
    assert job.config == START and tuner.phase in ("no headroom", "holding")


def test_a_bandwidth_drop_reopens_the_search_and_noise_does_not():
    tuner, sink = make(predictor_for(BEST, 0.3))

    def landscape(config, step):
        if step < 700:
            return better(BEST, 0.3)(config, step)
        # the link got 4x slower: every configuration slower, the bandwidth estimate drops
        return (0.2 if config == BEST else 0.3), 2.5e7

    job = ScriptedJob(landscape, noise=0.03)
    job.run(tuner, sink, 690)
    assert tuner.phase == "holding" and tuner.stats["retunes"] == 0  # 3% noise: no false alarm
    before = len(sink.decisions)
    job.run(tuner, sink, 400)
    assert tuner.stats["retunes"] >= 1
    retune = next(s for s in sink.statuses[:] if s.state == "re-tuning")
    assert retune.detail.startswith("re-tuning after bandwidth drop")
    # a new context segment, measured afresh; BEST is still best there, so it is held again, and
    # the job is told at once that the new context has no headroom
    assert tuner.job.segment >= 1 and any(w.segment == tuner.job.segment for w in sink.windows)
    assert len(sink.decisions) >= before
    assert tuner.phase == "no headroom" and job.config == BEST
    assert tuner.detail.startswith("no headroom after bandwidth drop: 1MiB/4MiB stays"), (
        tuner.detail
    )
    assert abs(tuner.status.measured_step_time_s - 0.2) < 0.02


def test_a_re_tune_after_a_drift_alarm_starts_its_baseline_with_the_alarms_fresh_steps():
    from autobyted.tuner.phases.baseline import Baseline

    tuner, sink = make(predictor_for(BEST, 0.3))

    def landscape(config, step):
        if step < 700:
            return better(BEST, 0.3)(config, step)
        return (0.2 if config == BEST else 0.3), 2.5e7  # the link got 4x slower at step 700

    job = ScriptedJob(landscape, noise=0.03, batch=1)
    job.run(tuner, sink, 700)
    assert tuner.phase == "holding" and job.config == BEST
    while tuner.stats["retunes"] == 0 and job.step < 800:
        job.run(tuner, sink, 1)
    phase = tuner._phase
    assert isinstance(phase, Baseline) and tuner.phase == "re-tuning", tuner.detail
    seeded = [m.step for m in phase.window]
    # the alarm's steps after the change (the first of its blocks left out), no step from before
    # it, at most half the baseline's window: the baseline needs that many fewer steps
    assert 1 <= len(seeded) <= phase.search.window_steps // 2, seeded
    assert seeded == list(range(job.step - len(seeded), job.step)) and seeded[0] >= 700, seeded
    assert all(m.config == BEST for m in phase.window)


def test_operator_pause_stops_decisions_and_resume_restarts_from_the_operators_configuration():
    tuner, sink = make(predictor_for(BEST, 0.3))
    job = ScriptedJob(better(BEST, 0.3))
    job.run(tuner, sink, 25)
    tuner.pause("an operator decided")
    assert tuner.phase == "paused" and "--resume" in tuner.detail
    job.config, job.decision_id = Config(256 << 10, 256 << 10), 99  # the operator's decision #99
    count = len(sink.decisions)
    job.run(tuner, sink, 300)
    assert len(sink.decisions) == count
    tuner.resume()
    assert tuner.phase == "re-tuning" and tuner.job.starting is None
    assert tuner.detail.startswith("resumed after an operator's pause")
    job.run(tuner, sink, 400)
    assert tuner.job.starting.config == Config(
        256 << 10, 256 << 10
    )  # the operator's is the new start
    assert len(sink.decisions) > count and job.config == BEST


def test_a_refused_decision_pauses_the_tuner():
    tuner, sink = make(predictor_for(BEST, 0.3))
    sink.decide = lambda *args: None  # the storage refused: an operator paused the job meanwhile
    ScriptedJob(better(BEST, 0.3)).run(tuner, sink, 100)
    assert tuner.phase == "paused"


def test_observe_mode_recommends_and_never_switches():
    tuner, sink = make(predictor_for(BEST, 0.3), mode="observe")
    job = ScriptedJob(better(BEST, 0.3))
    job.run(tuner, sink, 300)
    assert {d.kind for d in sink.decisions} == {"recommend"} and set(job.configs) == {START}
    (recommendation,) = sink.decisions
    assert recommendation.config == BEST and recommendation.state == "recommended"
    assert recommendation.predicted_step_time_s < 0.1
    assert tuner.phase == "observing" and "recommends 1MiB/4MiB" in tuner.detail
    assert tuner.status.config == BEST


def test_a_job_that_never_applies_a_decision_is_left_alone():
    tuner, sink = make(predictor_for(BEST, 0.3))
    job = ScriptedJob(better(BEST, 0.3), applies=False)
    job.run(tuner, sink, 600)  # 60 s of the job's clock
    assert tuner.stats["not_applied"] == 1 and len(sink.decisions) == 1
    assert tuner.phase == "holding" and "was not applied by the job" in tuner.detail
    job.run(tuner, sink, 300)
    assert len(sink.decisions) == 1  # it stops exploring this job


def test_broken_samples_do_not_break_the_tuner():
    tuner, sink = make(predictor_for(BEST, 0.3))
    rng = __import__("random").Random(0)
    bad = [
        dataclasses.replace(
            sample(i, START, 0, 0.1, 1e8, rng),
            bandwidth_bytes_per_s=0.0,
            forward_s=0.0,
            backward_s=0.0,
            exposed_comm_s=0.0,
            bytes_reduced=0,
            partitions=0,
            step_time_s=0.0 if i % 7 == 0 else 0.1,
        )
        for i in range(200)
    ]
    tuner.observe(bad)
    tuner.observe(bad[:50])  # resent, out of order: ignored
    assert tuner.phase in ("exploring", "no headroom", "holding")
    assert all(
        math.isfinite(d.predicted_step_time_s) for d in sink.decisions if d.predicted_step_time_s
    )


def test_candidates_stay_inside_the_safe_limits_and_include_the_start():
    from autobyte.types import MAX_CREDIT_BYTES, MIN_PARTITION_BYTES

    from autobyted.storage.records import Fingerprint
    from autobyted.tuner.features import JobShape
    from autobyted.tuner.grid import candidate_grid

    odd = Config(256 * 1024, None)
    small = JobShape.from_fingerprint(
        2, "gloo", Fingerprint(750_000, 3_000_000, 4, 2_000_000, 500_000, "s")
    )
    grid = candidate_grid(small, odd)
    assert odd in grid and Config(None, None) in grid
    assert all((c.partition_bytes or MIN_PARTITION_BYTES) >= MIN_PARTITION_BYTES for c in grid)
    assert all((c.credit_bytes or 0) <= MAX_CREDIT_BYTES for c in grid)
    # partitions beyond the whole gradient all send one message: only one of them is kept
    assert {
        c.partition_bytes for c in grid if (c.partition_bytes or 0) >= small.parameter_bytes
    } == {4 * MIB}
    # the tail window is searched only when asked for; a job that starts with one keeps it
    assert all(c.tail_bytes is None for c in grid)
    tailed = candidate_grid(small, odd, tail_window=True)
    extra = [c for c in tailed if c.tail_bytes is not None]
    assert extra and set(tailed) - set(extra) == set(grid)
    assert all(c.tail_bytes == 2 * c.credit_bytes for c in extra)
    started = Config(1 * MIB, 4 * MIB, 8 * MIB)
    assert started in candidate_grid(small, started)


def test_the_search_is_local_to_where_it_starts_at_any_scale():
    """An emulated job (bytes / 128) starts at a partition below the absolute grid: its search
    gets neighbours on both sides, and nothing 32x away (its first trial once was)."""
    from autobyted.storage.records import Fingerprint
    from autobyted.tuner.features import JobShape
    from autobyted.tuner.grid import TRUST_OCTAVES, candidate_grid

    kib = 1024
    scaled = JobShape.from_fingerprint(
        4, "gloo", Fingerprint(2_800_000, 11_100_000, 292, 1_600_000, 32_000, "e")
    )
    start = Config(128 * kib, 512 * kib)
    grid = candidate_grid(scaled, start)
    partitions = {c.partition_bytes for c in grid}
    assert {8 * kib, 32 * kib, 256 * kib, 512 * kib, 1 * MIB, 2 * MIB} <= partitions
    assert 4 * MIB not in partitions and start in grid
    mean_tensor = scaled.parameter_bytes / scaled.tensor_count
    assert all(
        abs(math.log2((c.partition_bytes or mean_tensor) / start.partition_bytes)) <= TRUST_OCTAVES
        for c in grid
    )
    # a search from elsewhere (a later incumbent) is local to it, and keeps the start to return to
    moved = candidate_grid(scaled, start, around=Config(2 * MIB, 8 * MIB))
    assert 4 * MIB in {c.partition_bytes for c in moved} and start in moved
    # the tests' and the testbed's jobs (4 MiB / 16 MiB starts) keep the absolute grid whole
    testbed = JobShape.from_fingerprint(
        2, "gloo", Fingerprint(6_000_000, 24_000_000, 12, 8_000_000, 1_000_000, "d")
    )
    assert set(candidate_grid(testbed, Config(4 * MIB, 16 * MIB))) == set(
        candidate_grid(testbed)
    ) | {Config(4 * MIB, 16 * MIB)}


def test_fruitless_re_tunes_raise_the_bar():
    """A host whose load wanders (every 150 steps all configurations get 25% slower, then recover)
    re-opens the search at first; the re-tunes keep the configuration, so the bar rises and the tuner
    stops spending trials on it. A large change would still re-tune (shift_scale is at most ~5x)."""
    tuner, sink = make(predictor_for(START, 0.2))

    def landscape(config, step):
        slow = 1.25 if (step // 150) % 2 else 1.0
        return (0.1 if config == START else 0.12) * slow, 1e8

    job = ScriptedJob(landscape)
    job.run(tuner, sink, 900)
    early = tuner.stats["retunes"]
    assert early >= 2 and tuner.job.fruitless >= 2
    job.run(tuner, sink, 1500)
    assert tuner.stats["retunes"] - early <= 1
    assert job.config == START


def test_a_trend_during_the_search_is_not_taken_for_a_better_configuration():
    """All configurations are equal, but every step gets faster while the search runs (a bandwidth
    ramp): the trials look better than the earlier baseline. Measuring the incumbent again (A-B-A)
    shows the drift, and the search is repeated instead of switching."""
    tuner, sink = make(predictor_for(BEST, 0.3))

    def landscape(config, step):
        return 0.1 * (1 - 0.4 * min(1.0, max(0.0, (step - 40) / 120))), 1e8

    job = ScriptedJob(landscape)
    job.run(tuner, sink, 400)
    assert not [d for d in sink.decisions if d.kind == "switch"]
    confirms = [d for d in sink.decisions if d.reason.startswith("confirm")]
    assert confirms and any(
        s.detail.endswith(", during the search: measuring 4MiB/16MiB")
        for s in sink.statuses
        if s.state == "re-tuning"
    )


POOR = Config(64 * 1024, 64 * 1024)


def poor_start(config, step):
    """Tiny partitions: slow, and a quarter of the bandwidth estimate of the large ones (what the
    testbed measures: 64 KiB messages do not fill the link); large ones differ in host load."""
    if config.partition_bytes is not None and config.partition_bytes < MIB:
        return 0.25, 2.5e7, 0.0
    return (0.07, 1e8, 0.45) if config == BEST else (0.08, 1.125e8, 0.40)


def test_a_poor_start_is_left_after_one_short_look_back():
    """From 64KiB/64KiB the first trial is 3.6x faster and its bandwidth estimate 4x higher. A link
    4x faster could make 64KiB/64KiB as fast as 62.5 ms (drift.fastest_in_context: a quarter of
    its step; the 190 ms of communication it did not hide could all be hidden), so the trial's 70 ms does not
    prove the gain, and the start is measured again at once (a check, which then stands in for the
    search's A-B-A confirm): it ends at its early look, the trial beating both measurements, and
    the job holds the winner from about step 60."""
    tuner, sink = make(predictor_for(BEST, 0.3))
    job = ScriptedJob(poor_start, start=POOR, noise=0.0)
    job.run(tuner, sink, 300)
    kinds = [d.kind for d in sink.decisions]
    assert kinds == ["trial", "check", "switch"], [d.reason for d in sink.decisions]
    assert sink.decisions[1].reason.startswith(
        "check: bandwidth rise during trial 1? it could explain the trial's 70 ms (the incumbent "
        "at best 62 ms): measuring 64KiB/64KiB again"
    ), sink.decisions[1].reason
    look_back, switch = sink.decisions[1:]
    assert (
        switch.apply_at_step - look_back.apply_at_step
        <= TunerParams().min_trial_steps + TunerParams().transition_steps + 10
    )
    held_from = next(i for i in range(len(job.configs)) if all(c == BEST for c in job.configs[i:]))
    assert held_from <= 65 and tuner.phase == "holding"


def test_a_check_is_made_only_where_the_trials_context_could_explain_its_gain():
    """The same 4x jump of the bandwidth estimate beside a trial only 10% faster: a link 4x faster
    could make the incumbent that fast, so the check is worth its steps, and its reason says so."""
    from autobyted.tuner.drift import fastest_in_context

    def modest(config, step):
        if config == POOR:
            return 0.25, 2.5e7, 0.0
        return (0.225, 1e8, 0.0) if config == BEST else (0.3, 2.5e7, 0.0)

    tuner, sink = make(predictor_for(BEST, 0.3))
    ScriptedJob(modest, start=POOR, noise=0.0).run(tuner, sink, 200)
    checks = [d.reason for d in sink.decisions if d.reason.startswith("check:")]
    assert (
        checks and "could explain the trial's 225 ms (the incumbent at best 62 ms)" in checks[0]
    ), checks
    import random

    rng = random.Random(0)
    slow = [sample(i, POOR, 0, 0.25, 2.5e7, rng, 0.0) for i in range(10)]
    fast = [sample(i, BEST, 0, 0.07, 1e8, rng, 0.0) for i in range(10)]
    # a step is never shorter than its compute, its communication, nor its whole / the largest
    # speed-up: max(0.06, 0.19 / 4, 0.25 / 4)
    assert abs(fastest_in_context(slow, fast) - 0.0625) < 1e-9
    assert fastest_in_context(fast, slow) == 0.07  # a slower link makes nothing faster
    comm_bound = [sample(i, POOR, 0, 0.5, 2.5e7, rng, 0.0) for i in range(10)]
    assert abs(fastest_in_context(comm_bound, fast) - 0.5 / 4) < 1e-9


def test_a_context_jump_another_configuration_of_the_search_shows_too_is_not_checked():
    """Against the incumbent (64KiB/64KiB) a large configuration's bandwidth estimate jumps 4.5x; a
    configuration measured earlier in the search shows the same figures: the jump is what the
    configurations do, and no check follows. Against the incumbent alone, it is checked."""
    import random

    from autobyted.tuner.drift import context_jump
    from autobyted.tuner.measured import MeasuredWindow as _Measured

    rng = random.Random(3)

    def window(config):
        step_s, bandwidth, load = poor_start(config, 0)
        return _Measured(
            config, [sample(i, config, 0, step_s, bandwidth, rng, 0.01, load) for i in range(12)]
        )

    incumbent = window(POOR)
    other = window(Config(2 * MIB, 8 * MIB))
    assert context_jump(incumbent.samples, other.samples) is not None
    assert (
        unexplained_jump(incumbent, [], other) is not None
    )  # nothing else measured in this search yet
    trials = [window(BEST)]
    assert unexplained_jump(incumbent, trials, other) is None
    # a jump of the context itself (the link 4x faster) shows against every configuration measured
    step_s, bandwidth, load = poor_start(BEST, 0)
    moved = _Measured(
        other.config,
        [sample(i, other.config, 0, step_s / 2, bandwidth * 4, rng, 0.01, load) for i in range(12)],
    )
    assert unexplained_jump(incumbent, trials, moved) is not None


def test_the_predictors_errors_on_a_job_correct_its_next_predictions():
    """The predictor thinks BEST is 30% faster; on this job it is 20% slower. Once a trial measured
    that, the job's own measured errors correct what the predictor says about BEST (and, less, about
    configurations near it) before any retraining."""
    from autobyted.tuner.features import summarize

    tuner, sink = make(predictor_for(BEST, 0.3))

    def landscape(config, step):
        return 0.1 * (1.2 if config == BEST else 1.0), 1e8

    job = ScriptedJob(landscape)
    job.run(tuner, sink, 300)
    assert BEST in [d.config for d in sink.decisions if d.kind == "trial"]
    context = summarize(tuner.job.incumbent.samples, SHAPE)
    near, far = Config(1 * MIB, 2 * MIB), Config(None, 64 * MIB)
    raw = tuner.job.predictor.predict(context, START, [BEST, near, far])
    corrected = tuner.job.evidence.corrected(raw, START)
    assert raw.mean[0] < -0.1  # the model alone: 1MiB/4MiB is clearly faster
    measured = math.log(1.2)  # corrected: most of the way to what was measured
    assert corrected.mean[0] - raw.mean[0] > 0.6 * (measured - raw.mean[0])
    assert corrected.mean[1] - raw.mean[1] > 0.5 * (
        corrected.mean[0] - raw.mean[0]
    )  # a neighbour, too
    assert abs(corrected.mean[2] - raw.mean[2]) < abs(
        corrected.mean[1] - raw.mean[1]
    )  # far away, less


def test_what_a_search_learned_survives_a_bandwidth_jump_that_interrupts_it():
    """The predictor thinks BEST is 30% faster; on this job every other configuration is 20% slower.
    The link drops 4x while the tuner verifies its return to the start and comes back later. The
    jump (far beyond what a configuration explains) came after the trials, so their measured errors
    are kept: in the re-tunes that follow, BEST is no longer predicted faster and not tried again."""
    tuner, sink = make(predictor_for(BEST, 0.3))
    drop = {"from": None}

    def landscape(config, step):
        if drop["from"] is None and tuner.phase == "verifying":
            drop["from"] = step
        low = drop["from"] is not None and step < drop["from"] + 150
        return 0.1 * (1.0 if config == START else 1.2) * (3 if low else 1), (2.5e7 if low else 1e8)

    job = ScriptedJob(landscape)
    job.run(tuner, sink, 900)
    assert drop["from"] is not None and tuner.stats["retunes"] >= 2
    retunes = [s.detail for s in sink.statuses if s.state == "re-tuning"]
    assert any("bandwidth drop" in d for d in retunes) and any(
        "bandwidth rise" in d for d in retunes
    )
    best = [d for d in sink.decisions if d.kind == "trial" and d.config == BEST]
    assert "1MiB/4MiB predicted 1.2" in best[0].reason  # the predictor alone: 20+% faster
    assert len(best) == 1 and any(config == BEST for config, _error in tuner.job.evidence.errors)
    assert job.config == START


def test_a_trial_pays_only_when_it_is_likely_to_win_by_more_than_it_costs():
    # trial_value(mean, spread, horizon steps, trial steps, cut steps, min_gain, clearly_worse)
    sure = trial_value(-0.2, 0.02, 1000, 18, 7, 0.02, 0.10)
    assert sure.win_probability > 0.99 and sure.value_steps > 150 and sure.pays
    # predicted 1% faster: below min_gain, more likely rolled back than kept, however long the horizon
    marginal = trial_value(-0.01, 0.02, 1e6, 18, 7, 0.02, 0.10)
    assert marginal.win_probability < 0.5 and not marginal.pays
    # an uncertain coin flip pays over a long horizon, not when the context is about to move on
    coin = [trial_value(-0.021, 0.4, horizon, 18, 7, 0.02, 0.10) for horizon in (0, 1000)]
    assert all(c.win_probability >= 0.5 for c in coin)
    assert not coin[0].pays and coin[1].pays and coin[1].value_steps > coin[0].value_steps
    # predicted slower: never tried on its spread alone
    assert not trial_value(0.05, 0.3, 1e6, 18, 7, 0.02, 0.10).pays


def test_gain_calibration_shrinks_the_predicted_gains_to_what_trials_measured():
    prior_sd, error_sd = 0.5, 0.05
    assert gain_calibration([], prior_sd, error_sd) == 1.0  # no trial yet: as predicted
    # trials that measured what was predicted keep the slope at 1
    assert abs(gain_calibration([(-0.15, -0.15), (-0.12, -0.12)], prior_sd, error_sd) - 1.0) < 1e-9
    # one trial predicted 12% faster that measured the same: the untried gains shrink by half or more
    one = gain_calibration([(-0.12, 0.0)], prior_sd, error_sd)
    assert 0.2 < one < 0.5
    two = gain_calibration([(-0.12, 0.0), (-0.16, 0.01)], prior_sd, error_sd)
    assert two < one / 2
    # measured backwards: no direction is left (never a candidate predicted slower made "faster")
    assert gain_calibration([(-0.15, 0.2), (-0.15, 0.25)], prior_sd, error_sd) == 0.0
    # small predicted differences say little about the slope
    assert gain_calibration([(-0.005, 0.005)], prior_sd, error_sd) > 0.95


def test_a_search_whose_trials_measure_none_of_the_predicted_gain_stops_early():
    """The predictor learned that every octave of partition size below the start's is 6% faster (many
    candidates predicted 10-26% faster); on this job all configurations are equal. The first trial
    measures none of the predicted gain; the untried candidates' predicted gains shrink by what it
    measured, and the search ends with no headroom after one or two trials instead of trying all
    max_trials. Without the calibration (prior sd ~0) it tries them all."""
    predictor = predictor_for(None, 0.06)

    def flat(config, step):
        return 0.1, 1e8

    tuner, sink = make(predictor)
    ScriptedJob(flat).run(tuner, sink, 400)
    trials = [d for d in sink.decisions if d.kind == "trial"]
    assert trials and "1.2" in trials[0].reason  # the model alone: 20+% faster
    assert len(trials) <= 2 and tuner.phase == "no headroom"
    uncalibrated, sink = make(predictor, params=TunerParams(gain_slope_prior_sd=1e-6))
    ScriptedJob(flat).run(uncalibrated, sink, 400)
    assert len([d for d in sink.decisions if d.kind == "trial"]) == TunerParams().max_trials


def test_a_job_whose_context_changes_fast_gets_a_short_horizon():
    tuner, sink = make(predictor_for(BEST, 0.3))
    job = ScriptedJob(better(BEST, 0.3))
    job.run(tuner, sink, 50)
    long_lived = tuner.job.horizon_steps(0.1)  # 5 s of job time, no change yet: the 600 s prior
    assert 6000 < long_lived < 6100
    tuner.job.segment = 9  # ten contexts in the job's 5 s
    assert tuner.job.horizon_steps(0.1) < long_lived / 9


def test_a_second_job_of_a_shape_skips_what_the_first_measured_in_the_same_context():
    predictor = predictor_for(Config(16 * MIB, 64 * MIB), 0.3)  # wrong for this job: nothing wins
    first, first_sink = make(predictor)
    ScriptedJob(better(BEST, 0.0), seed=1).run(first, first_sink, 400)
    assert first.stats["trials"] == 1 and first.phase == "no headroom"
    # a second job of the same shape on the same daemon: the first one's measurement outweighs the
    # model that was wrong about it
    second_sink = MemorySink("second")
    second = JobTuner("second", SHAPE, predictor, second_sink, known=first_sink.windows)
    ScriptedJob(better(BEST, 0.0), seed=2).run(second, second_sink, 400)
    assert second.stats["trials"] == 0 and second.phase == "no headroom"
    assert "no trial is likely to win more than it costs" in second.detail, second.detail
    # nothing was tried, so nothing "beat" anything: the status says no trial was made
    assert "stays, no trial made" in second.detail and "nothing beat" not in second.detail, (
        second.detail
    )
    # in another context (a 4x slower link) the first job's windows say nothing: the search runs
    # as it would on a daemon that never saw the first job
    runs = []
    for known in (first_sink.windows, ()):
        sink = MemorySink("other")
        other = JobTuner("other", SHAPE, predictor, sink, known=known)
        ScriptedJob(better(BEST, 0.0, bandwidth=2.5e7), seed=3).run(other, sink, 400)
        assert (
            other.job.evidence.known_ratios(
                other.job.incumbent,
                [other.job.incumbent, *other.job.search.trials],
                other.job.sigma,
            )
            == {}
        )
        runs.append([(d.kind, d.config, d.reason) for d in sink.decisions])
    assert runs[0] == runs[1]
    # a job of another shape never reads them
    assert (
        JobTuner(
            "x",
            dataclasses.replace(SHAPE, world_size=4),
            predictor,
            MemorySink("x"),
            known=first_sink.windows,
        ).job.evidence.known
        == {}
    )


def test_a_job_name_run_again_keeps_its_runs_apart_and_learns_from_the_first():
    """A script run twice under one job name: the second run's tuner numbers its segments past the
    first run's (the manager passes storage.next_window_segment), so the predictor never pairs a
    window of one run with one of the other, and the first run counts as an earlier job."""
    predictor = predictor_for(BEST, 0.3)
    first, first_sink = make(predictor)
    ScriptedJob(better(BEST, 0.3), seed=1).run(first, first_sink, 400)
    segments = {w.segment for w in first_sink.windows}
    assert first.phase == "holding" and segments
    as_before = JobTuner("job", SHAPE, predictor, MemorySink("job"), known=first_sink.windows)
    assert as_before.job.evidence.known == {}  # the same segments: its own, not an earlier run's
    again_sink = MemorySink("job")
    again = JobTuner(
        "job",
        SHAPE,
        predictor,
        again_sink,
        known=first_sink.windows,
        first_segment=max(segments) + 1,
    )
    assert ("job", 0, BEST) in again.job.evidence.known_held
    ScriptedJob(better(BEST, 0.3), seed=2).run(again, again_sink, 400)
    assert again_sink.windows and {w.segment for w in again_sink.windows}.isdisjoint(segments)
    assert [d.config for d in again_sink.decisions if d.kind in ("trial", "switch")] == [BEST]
    assert (
        again.stats["trials"] == 0 and again.job.held.config == BEST
    )  # the first run's winner, at once


def test_a_second_job_tries_the_earlier_searchs_winner_first_and_stops_when_it_wins_again():
    predictor = predictor_for(BEST, 0.3)
    first, first_sink = make(predictor)
    ScriptedJob(better(BEST, 0.3), seed=1).run(first, first_sink, 400)
    assert first.phase == "holding" and first.job.held.config == BEST
    second_sink = MemorySink("second")
    second = JobTuner("second", SHAPE, predictor, second_sink, known=first_sink.windows)
    # the trial's window, then the verification's
    assert ("job", 0, BEST) in second.job.evidence.known_held
    ScriptedJob(better(BEST, 0.3), seed=2).run(second, second_sink, 400)
    # what won in this context for the first job is switched to without a trial, then verified
    assert first.stats["trials"] >= 1 and second.stats["trials"] == 0
    assert [(d.kind, d.config) for d in second_sink.decisions] == [("switch", BEST)]
    assert second_sink.decisions[0].reason.startswith(
        "warm start: 1MiB/4MiB, held by an earlier job"
    )
    # early in the baseline (min_trial_steps + 2 of its 20 steps), not after it: ~20 steps in
    params = TunerParams()
    assert second_sink.decisions[0].apply_at_step == (
        params.warmup_steps + params.min_trial_steps + 1 + params.apply_lead_steps
    )
    assert first_sink.decisions[0].apply_at_step > params.warmup_steps + params.baseline_steps
    assert second.phase == "holding" and second.job.held.config == BEST
    assert second.job.evidence.known_winners == {BEST}


def test_a_warm_start_that_does_not_win_here_counts_as_a_lost_trial_and_the_search_goes_on():
    """The first job's winner is no better for the second job (another machine's job with the same
    shape and context figures): its verification window loses, and the search continues."""
    predictor = predictor_for(BEST, 0.3)
    first, first_sink = make(predictor)
    ScriptedJob(better(BEST, 0.3), seed=1).run(first, first_sink, 400)
    second_sink = MemorySink("second")
    second = JobTuner("second", SHAPE, predictor, second_sink, known=first_sink.windows)
    ScriptedJob(better(BEST, 0.0), seed=2).run(second, second_sink, 600)
    kinds = [d.kind for d in second_sink.decisions]
    assert kinds[0] == "switch" and second_sink.decisions[0].config == BEST
    assert second.stats["trials"] >= 1 and second.job.held is not None
    assert second.job.held.config == START  # nothing beat the start here


def test_a_rescore_just_after_a_change_names_it():
    """The predictor's periodic rescore (every rescore_s while holding) can re-open the search a
    few steps after a bandwidth drop, before the drift detector's blocks confirm it: the re-tune
    names the change it was made in, as the detector would, not only the predicted gain."""
    tuner, sink = make(predictor_for(None, 0.15))  # smaller partitions predicted faster
    drop = 636  # 9 steps before the first rescore after the hold (60 s at 0.1 s a step)

    def landscape(config, step):
        if step < drop:  # the prediction is wrong here: START is the fastest
            return (0.1 if config == START else 0.12), 1e8
        octaves = math.log2((config.partition_bytes or 64 * MIB) / START.partition_bytes)
        return 0.2 * math.exp(0.15 * octaves), 4.9e7

    ScriptedJob(landscape, noise=0.02).run(tuner, sink, 760)
    first = next(d for d in sink.decisions if d.apply_at_step > drop)
    assert "(re-tuning after bandwidth drop: " in first.reason, first.reason
    assert "predicted" in first.reason.split("re-tuning after", 1)[1], first.reason  # the rescore's


def test_a_context_that_swings_and_back_during_the_trials_is_caught_by_the_winners_own_window():
    """Every configuration is equal; the context is 40% faster while the trials run and back before
    the incumbent is measured again, and no context signal shows it (a link's rate swinging while
    the bandwidth estimate is held at the compute's pace). The incumbent measured before and after
    the trials agree, so the switch goes ahead; the winner's verification window, 0.1 s against its
    trial's 0.06 s, shows the gain was the context's: the search is repeated, never held as a gain."""
    tuner, sink = make(predictor_for(BEST, 0.3))

    def landscape(config, step):
        fast = tuner.phase == "exploring" and tuner.stats["retunes"] == 0
        return (0.06 if fast else 0.1), 1e8

    job = ScriptedJob(landscape)
    job.run(tuner, sink, 400)
    kinds = [d.kind for d in sink.decisions]
    assert "switch" in kinds, [d.reason for d in sink.decisions]
    assert tuner.stats["retunes"] >= 1
    assert any(
        s.detail.startswith("re-tuning after step time rise, during the search")
        for s in sink.statuses
        if s.state == "re-tuning"
    ), [s.detail for s in sink.statuses]
    # what is held at the end was measured in the context it is held in: no 1.67x gain claimed
    assert "1.6" not in tuner.detail and "1.7" not in tuner.detail, tuner.detail
    assert tuner.phase in ("holding", "no headroom"), tuner.phase


def test_a_pulse_of_a_faster_link_under_the_first_trial_is_checked_at_once_not_switched_to():
    """Every configuration is equal; the link is faster for 40 steps from the first trial on (a
    rate swinging 4x), and the bandwidth estimate shows it 2.7x higher: less than a configuration
    alone can move it (drift.JUMP_LIMITS), so no context jump; but enough to explain the trial's
    lead (the incumbent's compute, 60 ms, is all that bounds it in that context:
    drift.fastest_in_context). The trial is checked at once: the incumbent, measured again in the
    fast phase, is as fast, and the search re-opens in the new context; no switch is made on the
    pulse (before, the baseline and the confirm both fell in the slow phase and the trial was held
    as 1.67x faster until its own verification window)."""
    tuner, sink = make(predictor_for(BEST, 0.3))

    def landscape(config, step):
        first = sink.decisions[0].apply_at_step if sink.decisions else None
        fast = first is not None and first <= step < first + 40
        return (0.06, 2.7e8) if fast else (0.1, 1e8)

    ScriptedJob(landscape).run(tuner, sink, 400)
    reasons = [d.reason for d in sink.decisions]
    assert sink.decisions[0].kind == "trial" and sink.decisions[1].kind == "check", reasons
    assert reasons[1].startswith("check: bandwidth rise during trial 1? it could explain"), reasons
    retune = next(
        i
        for i, s in enumerate(sink.statuses)
        if s.state == "re-tuning" and "during the search" in s.detail
    )
    assert "switch" not in [d.kind for d in sink.decisions[:3]], reasons
    assert not any(s.detail.startswith("switching") for s in sink.statuses[:retune]), [
        s.detail for s in sink.statuses[:retune]
    ]
    assert "1.6" not in tuner.detail and "1.7" not in tuner.detail, tuner.detail


def test_a_trial_that_beats_the_incumbent_before_and_after_a_pulse_is_credited_with_its_own_gain():
    """BEST is 10% faster than the start in any context; the link is faster for 60 steps from the
    first trial on (the step 0.1 s -> 0.06 s). The trial (54 ms) beats anything that context could
    make the start (its compute, 60 ms), so it is not checked; the confirm after it finds the start
    moved, but the trial beat it there too: the switch goes ahead, credited with the 1.11x it beat
    the start by in the trial's context, not the 1.85x against the start's baseline in the slow
    phase."""
    tuner, sink = make(predictor_for(BEST, 0.1))

    def landscape(config, step):
        first = sink.decisions[0].apply_at_step if sink.decisions else None
        fast = first is not None and first <= step < first + 60
        base, bandwidth = (0.06, 2.7e8) if fast else (0.1, 1e8)
        return (base * 0.9 if config == BEST else base), bandwidth

    ScriptedJob(landscape).run(tuner, sink, 300)
    reasons = [d.reason for d in sink.decisions]
    assert reasons[1].startswith("confirm: measuring 4MiB/16MiB again"), reasons
    switch = next(d for d in sink.decisions if d.kind == "switch")
    assert switch.config == BEST and "measured 1.11x faster than 4MiB/16MiB" in switch.reason, (
        reasons
    )
    assert not any("1.8" in r for r in reasons), reasons


def test_a_job_restarted_at_another_rank_count_tries_what_it_held_first_early_in_its_baseline():
    """The job ran at 2 ranks and held BEST; restarted at 4 ranks (another shape: its windows are
    no known ratios here), it ends its baseline early and tries BEST first, even where the model
    predicts another configuration; a trial like any, so where BEST loses at 4 ranks it is cut and
    the search goes on."""
    first, first_sink = make(predictor_for(BEST, 0.3))
    ScriptedJob(better(BEST, 0.3), seed=1).run(first, first_sink, 400)
    assert first.phase == "holding" and first.job.held.config == BEST
    at_four = dataclasses.replace(SHAPE, world_size=4)
    wrong = predictor_for(Config(16 * MIB, 64 * MIB), 0.3)
    params = TunerParams()
    early = params.warmup_steps + params.min_trial_steps + 1 + params.apply_lead_steps
    sink = MemorySink("restarted")
    restarted = JobTuner("restarted", at_four, wrong, sink, known=first_sink.windows)
    assert restarted.job.evidence.known == {}
    carried = restarted.job.evidence.carried
    assert carried is not None and (carried.config, carried.world_size) == (BEST, 2)
    ScriptedJob(better(BEST, 0.3), seed=2).run(restarted, sink, 400)
    trial = sink.decisions[0]
    assert (trial.kind, trial.config, trial.apply_at_step) == ("trial", BEST, early), trial
    assert "1MiB/4MiB, held by job at 2 ranks, predicted" in trial.reason, trial.reason
    assert restarted.phase == "holding" and restarted.job.held.config == BEST
    # without the first run the same job measures its whole baseline and follows the model
    cold_sink = MemorySink("cold")
    cold = JobTuner("cold", at_four, wrong, cold_sink)
    ScriptedJob(better(BEST, 0.3), seed=2).run(cold, cold_sink, 400)
    assert cold.job.evidence.carried is None
    assert cold_sink.decisions[0].apply_at_step > params.warmup_steps + params.baseline_steps
    assert cold_sink.decisions[0].config != BEST
    # where BEST is 30% slower at 4 ranks, its trial is cut and the search goes on from the start
    lost_sink = MemorySink("lost")
    lost = JobTuner("lost", at_four, wrong, lost_sink, known=first_sink.windows)

    def slower(config, step):
        return (0.13 if config == BEST else 0.1), 1e8

    ScriptedJob(slower, seed=3).run(lost, lost_sink, 500)
    first_trial = lost_sink.decisions[0]
    assert (first_trial.kind, first_trial.config, first_trial.state) == (
        "trial",
        BEST,
        "rolled_back",
    )
    assert lost.job.held is not None and lost.job.held.config != BEST
    # a job of a shape the daemon has measured reads that shape's evidence, not the other size's
    again_sink = MemorySink("again")
    again = JobTuner(
        "again", at_four, wrong, again_sink, known=[*first_sink.windows, *sink.windows]
    )
    assert again.job.evidence.known and again.job.evidence.carried is not None
    ScriptedJob(better(BEST, 0.3), seed=4).run(again, again_sink, 100)
    assert all("held by job at 2 ranks" not in d.reason for d in again_sink.decisions)
