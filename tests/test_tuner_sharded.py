"""The FSDP2 job's tuner (autobyted.tuner.sharded) on scripted jobs: it finds the fastest of FSDP2's
knobs by measuring one knob at a time, never runs a configuration the ranks refuse (their memory
budget), holds, re-tunes when the job's step time moves, and leaves a job with no headroom alone."""

from __future__ import annotations

import pytest
from autobyte.records import MemoryLimits, ShardLayout
from autobyte.types import Config

from autobyted.tuner.memory_sink import MemorySink
from autobyted.tuner.params import TunerParams
from autobyted.tuner.shard_schedule import (
    JobSchedule,
    ShardedModel,
    ShardGroup,
    ShardLink,
    simulate_step,
)
from autobyted.tuner.sharded import SPACE, ShardTuner, neighbours
from tests.helpers.tuner import ScriptedJob

DEFAULTS = Config()  # the job as its script built it


def landscape(fast_forward=0.25, keep=0.15, base_s=0.1, keep_hurts_after=None):
    """An FSDP2 job whose all-gathers are exposed without forward prefetch (prefetching 1 or more
    groups saves `fast_forward`) and whose backward all-gathers cost `keep` (kept parameters save
    them; after step `keep_hurts_after` keeping them costs that much instead: memory pressure)."""

    def step_time(config: Config, step: int) -> tuple[float, float]:
        t = base_s
        if not config.forward_prefetch:
            t *= 1 + fast_forward
        kept = config.reshard_after_forward is False
        if kept:
            hurts = keep_hurts_after is not None and step >= keep_hurts_after
            t *= 1 + keep if hurts else 1 - keep
        return t, 1e8

    return step_time


def make(mode="auto", params=TunerParams(), memory=None, known=None):
    sink = MemorySink("fsdp-job")
    return ShardTuner("fsdp-job", sink, mode, params, memory, known), sink


def test_neighbours_move_one_knob_one_step_from_the_users_own_settings():
    assert neighbours(DEFAULTS) == [
        Config(forward_prefetch=1),
        Config(backward_prefetch=2),
        Config(reshard_after_forward=False),
    ]
    assert neighbours(
        Config(forward_prefetch=3, backward_prefetch=1, reshard_after_forward=False)
    ) == [
        Config(forward_prefetch=3, backward_prefetch=2, reshard_after_forward=False),
        Config(forward_prefetch=2, backward_prefetch=1, reshard_after_forward=False),
        Config(forward_prefetch=3, backward_prefetch=1, reshard_after_forward=True),
    ]


def test_finds_the_fastest_knobs_one_at_a_time_and_holds_them():
    tuner, sink = make()
    job = ScriptedJob(landscape(), start=DEFAULTS)
    job.run(tuner, sink, 600)
    # forward prefetch and kept parameters, each a measured win: (1 + 0.25) / (1 - 0.15) = 1.47x
    assert job.config.forward_prefetch and job.config.reshard_after_forward is False, job.config
    assert tuner.phase == "holding", tuner.detail
    assert "1.47x faster than" in tuner.detail, tuner.detail
    switches = [d for d in sink.decisions if d.kind == "switch"]
    assert switches and switches[0].config == Config(forward_prefetch=1)
    trials = [d for d in sink.decisions if d.kind == "trial"]
    assert all(d.measured_step_time_s is not None for d in trials)
    assert len(trials) <= 3 * TunerParams().max_trials
    status = tuner.status
    assert status.config == job.config and abs(status.baseline_step_time_s - 0.125) < 0.005
    assert abs(status.measured_step_time_s - 0.1 * 0.85) < 0.004


def test_a_configuration_the_ranks_refuse_never_runs_and_the_search_goes_on():
    # keeping the gathered parameters is over the job's memory budget: its ranks refuse it
    tuner, sink = make()
    job = ScriptedJob(
        landscape(), start=DEFAULTS, refuses=lambda c: c.reshard_after_forward is False
    )
    job.run(tuner, sink, 900)
    assert all(c.reshard_after_forward is not False for c in job.configs)
    assert job.config.forward_prefetch and tuner.phase == "holding", tuner.detail
    assert tuner.stats["not_applied"] >= 1
    assert all(c.reshard_after_forward is False for c in tuner.refused)
    # a refused candidate is asked for once per job, never again
    asked = [d.config for d in sink.decisions if d.kind == "trial"]
    assert len(asked) == len(set(asked))


def test_a_configuration_the_registration_names_over_the_budget_is_never_asked_for():
    # the job's registration named every configuration that keeps the gathered parameters as over
    # its budget: the search never decides one, costs no apply timeout, and says what it left out
    over = frozenset(
        Config(forward_prefetch=f, backward_prefetch=b, reshard_after_forward=False)
        for f in (None, 0, 1, 2, 3)
        for b in (None, 1, 2, 3)
    )
    tuner, sink = make(memory=MemoryLimits(7_500, over))
    refused = []
    job = ScriptedJob(
        landscape(), start=DEFAULTS, refuses=lambda c: c in over and not refused.append(c)
    )
    job.run(tuner, sink, 600)
    assert not refused and tuner.stats["not_applied"] == 0
    assert all(d.config not in over for d in sink.decisions)
    assert job.config.forward_prefetch and tuner.phase in ("holding", "no headroom"), tuner.detail
    trials = [d.reason for d in sink.decisions if d.kind == "trial"]
    assert any("1 neighbour over the memory budget of 7,500 bytes not tried" in r for r in trials)


BEST = Config(forward_prefetch=1, reshard_after_forward=False)


def test_what_an_earlier_job_of_the_model_held_is_measured_first_and_reached_sooner():
    def reached(known):
        tuner, sink = make(known=known)
        job = ScriptedJob(landscape(), start=DEFAULTS)
        job.run(tuner, sink, 600)
        assert job.config == BEST and tuner.phase == "holding", (job.config, tuner.detail)
        return job.configs.index(BEST), sink

    cold, _ = reached(None)
    warm, sink = reached((BEST, "earlier-run"))
    trials = [d for d in sink.decisions if d.kind == "trial"]
    assert trials[0].config == BEST, trials[0]
    assert "what job earlier-run of this model held" in trials[0].reason, trials[0].reason
    # it won by the switch margin: round 1's other trials were not run, the switch came next
    assert [d.kind for d in sink.decisions][:3] == ["trial", "return", "switch"], sink.decisions
    assert warm < cold * 0.7, (warm, cold)


def test_what_an_earlier_job_held_is_not_tried_over_this_jobs_budget_nor_kept_when_it_loses():
    over = frozenset({BEST})
    tuner, sink = make(memory=MemoryLimits(7_500, over), known=(BEST, "earlier-run"))
    job = ScriptedJob(landscape(), start=DEFAULTS)
    job.run(tuner, sink, 600)
    assert all(d.config != BEST for d in sink.decisions)
    # on a landscape where it is slower, it is one trial of round 1, and the search goes on
    tuner, sink = make(known=(Config(backward_prefetch=3), "earlier-run"))
    job = ScriptedJob(landscape(keep=0.0), start=DEFAULTS)
    job.run(tuner, sink, 600)
    trials = [d for d in sink.decisions if d.kind == "trial"]
    assert trials[0].config == Config(backward_prefetch=3) and len(trials) >= 2
    assert job.config.forward_prefetch == 1 and tuner.phase == "holding", tuner.detail


def test_no_headroom_when_no_knob_beats_the_job_as_built():
    tuner, sink = make()
    job = ScriptedJob(landscape(fast_forward=0.0, keep=0.0), start=DEFAULTS)
    job.run(tuner, sink, 300)
    assert tuner.phase == "no headroom" and job.config == DEFAULTS, tuner.detail
    assert "3 neighbour(s) of prefetch" in tuner.detail, tuner.detail
    assert not [d for d in sink.decisions if d.kind == "switch"]


def test_a_moved_step_time_re_tunes_from_the_held_configuration():
    # kept parameters win at first, then cost 15% (memory pressure from step 400 on)
    tuner, sink = make()
    job = ScriptedJob(landscape(keep_hurts_after=400), start=DEFAULTS)
    job.run(tuner, sink, 400)
    assert job.config.reshard_after_forward is False and tuner.phase == "holding"
    job.run(tuner, sink, 500)
    assert "re-tuning" in [s.state for s in sink.statuses]
    assert job.config.reshard_after_forward is True and job.config.forward_prefetch, job.config
    assert tuner.phase in ("holding", "no headroom"), tuner.detail


def test_an_operators_decision_opens_a_search_from_it():
    tuner, sink = make()
    job = ScriptedJob(landscape(fast_forward=0.0, keep=0.0), start=DEFAULTS)
    job.run(tuner, sink, 300)
    assert tuner.phase == "no headroom"
    sink.decide(Config(forward_prefetch=3), job.step, "operator", None, "operator")
    job.run(tuner, sink, 30)
    retuned = [s.detail for s in sink.statuses if s.state == "re-tuning"]
    assert retuned and "changed to prefetch 3/= by decision #" in retuned[-1], retuned
    assert tuner.phase == "exploring" and "against prefetch 3/=" in tuner.detail, tuner.detail


def test_observe_mode_and_a_pause_issue_nothing():
    tuner, sink = make("observe")
    job = ScriptedJob(landscape(), start=DEFAULTS)
    job.run(tuner, sink, 200)
    assert tuner.phase == "observing" and not sink.decisions
    tuner, sink = make()
    tuner.pause("an operator paused it")
    job = ScriptedJob(landscape(), start=DEFAULTS)
    job.run(tuner, sink, 200)
    assert tuner.phase == "paused" and not sink.decisions
    tuner.resume()
    job.run(tuner, sink, 400)
    assert job.config.forward_prefetch, tuner.detail


class _QueuedLink:
    """The tuner as the manager feeds it a 4-rank job's merged steps (autobyted.tuner.ranks): from
    step `from_step` rank 2's link queues (its ring pairs 2 -> 1 and 3 -> 2), before it none does."""

    def __init__(self, tuner: ShardTuner, from_step: int) -> None:
        self.tuner, self.from_step = tuner, from_step

    def observe(self, samples) -> None:
        import dataclasses

        from autobyted.tuner.ranks import merge_ranks

        merged = []
        for m in samples:
            slow = m.step >= self.from_step
            peers = {
                r: dataclasses.replace(
                    m,
                    link_queue_s=0.04 if slow and r in (2, 3) else 3e-4,
                    link_peer=1 + (r - 1) % 4,
                )
                for r in (1, 2, 3)
            }
            leader = dataclasses.replace(m, link_queue_s=3e-4, link_peer=4)
            merged.append(merge_ranks(leader, peers))
        self.tuner.observe(merged)

    def __getattr__(self, name):
        return getattr(self.tuner, name)


def test_a_slower_step_with_one_link_queued_names_that_link():
    tuner, sink = make()
    job = ScriptedJob(landscape(keep_hurts_after=400), start=DEFAULTS)
    fed = _QueuedLink(tuner, from_step=400)
    job.run(fed, sink, 400)
    assert "link" not in " ".join(s.detail for s in sink.statuses)
    job.run(fed, sink, 500)
    moved = [s.detail for s in sink.statuses if "step time moved" in s.detail]
    assert moved and "rank 2's link (40 ms of queueing" in moved[0], moved


# A job whose steps come from FSDP2's schedule (autobyted/tuner/shard_schedule.py) on a model the
# daemon's model does not assume: compute not in proportion to bytes (a root of embedding bytes
# that compute little, blocks whose backward is 1.5x their forward), a per-collective cost; on
# NCCL's streams (reduce-scatters off the thread), where comm is 1.4x compute: FSDP2's defaults
# 1.32 s, forward prefetch 1 1.10 s, with the gathered parameters kept 0.92 s (two rounds of
# one-knob trials away).
TRUTH = ShardedModel(
    tuple(ShardGroup(f"h.{i}", 8_000_000, 0.02, 0.03) for i in range(12)),
    40_000_000,
    (0.001, 0.01),
    (0.001, 0.02),
)
TRUTH_LINK = ShardLink(300e6, 4, fixed_s=0.003, rs_factor=1.0, sync_reduce_scatters=False)
LAYOUT = ShardLayout(tuple(g.param_bytes for g in TRUTH.groups), TRUTH.root_bytes, True)
SCHEDULE = JobSchedule(LAYOUT, 4, "nccl", 0.003)


def _true_step(config: Config) -> float:
    return simulate_step(
        TRUTH,
        TRUTH_LINK,
        config.forward_prefetch,
        config.backward_prefetch,
        config.reshard_after_forward,
    ).step_s


def scheduled(config: Config, step: int) -> tuple[float, float]:
    return _true_step(config), 1e8


def test_the_job_schedule_recovers_a_rate_and_predicts_the_steps_it_was_fitted_on():
    """Calibrated on one measured configuration of a job that is its own model, the schedule
    finds the rate and predicts every other configuration exactly; with the collectives hidden it
    predicts no gain anywhere; without compute or with one rank it declines."""
    model = SCHEDULE.model(0.4)
    link = SCHEDULE.link(250e6)
    start = Config(forward_prefetch=1)
    truth = simulate_step(model, link, 1, None, None)
    exposed = truth.step_s - model.compute_s  # the step's time outside compute
    fitted = SCHEDULE.calibrate(start, truth.step_s, exposed)
    assert fitted is not None and fitted.bytes_per_s == pytest.approx(250e6, rel=1e-6)
    for config in SPACE:
        expected = simulate_step(
            model,
            link,
            config.forward_prefetch,
            config.backward_prefetch,
            config.reshard_after_forward,
        ).step_s
        assert fitted.predict(config) == pytest.approx(expected, rel=1e-6), config
    # nothing exposed (and no per-collective cost): the link is not the limit anywhere
    hidden = JobSchedule(LAYOUT, 4, "gloo").calibrate(start, 0.4, 0.0)
    assert hidden is not None
    assert max(hidden.predict(c) for c in SPACE) < 0.4 * 1.01
    assert SCHEDULE.calibrate(start, 0.4, 0.4) is None  # no compute: not a step of this model
    one = JobSchedule(LAYOUT, 1, "gloo")
    assert one.calibrate(start, 1.0, 0.5) is None


def _run_scheduled(schedule, steps=400, start=DEFAULTS, memory=None):
    sink = MemorySink("fsdp-job")
    tuner = ShardTuner("fsdp-job", sink, "auto", TunerParams(), memory, None, schedule)
    job = ScriptedJob(scheduled, start=start, compute_s=TRUTH.compute_s)
    job.run(tuner, sink, steps)
    return tuner, sink, job


def test_the_schedule_model_jumps_to_the_predicted_fastest_and_reaches_it_sooner():
    """From FSDP2's defaults, the model (fitted on the defaults' window, wrong about where the
    compute is) names the fastest setting first: the first trial, measured, wins, and the job holds
    a setting within 2% of the true best in fewer steps and trials than the neighbours' walk."""
    best = min(_true_step(c) for c in SPACE)
    modelled, sink, job = _run_scheduled(SCHEDULE)
    walked, walked_sink, walked_job = _run_scheduled(None)
    first = next(d for d in sink.decisions if d.kind == "trial")
    assert "the fastest of 24 settings as the job's schedule model predicts" in first.reason
    assert first.predicted_step_time_s is not None, first
    assert _true_step(first.config) <= best * 1.02, (first.config, best)
    for tuner, run in ((modelled, job), (walked, walked_job)):
        assert tuner.phase in ("holding", "no headroom"), tuner.detail
        assert _true_step(run.config) <= best * 1.02, (run.config, _true_step(run.config), best)
    reached = job.configs.index(job.config)
    assert reached < walked_job.configs.index(walked_job.config), (job.configs, walked_job.configs)
    trials = [d for d in sink.decisions if d.kind == "trial"]
    assert len(trials) < len([d for d in walked_sink.decisions if d.kind == "trial"])


def test_neighbours_predicted_clearly_slower_are_not_tried_and_the_search_says_so():
    """From the true best, every neighbour that frees the gathered parameters again is predicted
    far slower: none of them is measured, and the tuner says how many it left out."""
    best = min(SPACE, key=_true_step)
    tuner, sink, job = _run_scheduled(SCHEDULE, steps=250, start=best)
    asked = [d.config for d in sink.decisions if d.kind == "trial"]
    assert all(c.reshard_after_forward is False for c in asked), asked
    assert job.config == best and tuner.phase == "no headroom", tuner.detail
    assert "predicted over 10% slower not tried" in tuner.detail, tuner.detail
