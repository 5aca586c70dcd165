"""`autobyte best` compares only configurations measured in the same context, says
which context and how many steps each, and gives one speed-up figure (x faster than a reference)."""

import json

import pytest
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.types import describe_speedup, speedup

from tests.helpers.cli import run_cli
from tests.helpers.rpc import Client, sample

SMALL = pb.Config(partition_bytes=64 << 10, credit_bytes=64 << 10)
MEDIUM = pb.Config(partition_bytes=4 << 20, credit_bytes=16 << 20)
LARGE = pb.Config(partition_bytes=16 << 20, credit_bytes=64 << 20)
BASELINE = pb.Config()


def stream(address: str, job: str, phases, first_seq: int = 1, instance: str = "i-0") -> int:
    """phases: (steps, config, step_time_s, bandwidth_bytes_per_s, host_load) in order."""
    client = Client(address)
    session = client.register(job=job, instance=instance).session_id
    samples, seq, wall = [], first_seq, 1_764_500_000.0 + first_seq
    for steps, config, step_time_s, bandwidth, load in phases:
        for _ in range(steps):
            wall += step_time_s
            samples.append(
                sample(
                    seq,
                    step=seq - first_seq,
                    wall_time_s=wall,
                    step_time_s=step_time_s,
                    bandwidth_bytes_per_s=bandwidth,
                    host_load=load,
                    config=config,
                )
            )
            seq += 1
    # final: this process is done (a later run's process may take rank 0 over at once)
    client.stream(
        [pb.MetricsBatch(job=job, rank=0, session_id=session, samples=samples, final=True)]
    )
    client.close()
    return seq


def best_json(address: str, job: str) -> dict:
    result = run_cli("best", job, "--format", "json", "--daemon", address)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_best_compares_only_within_the_latest_context(thread_daemon):
    """SMALL ran only before a bandwidth drop (fast link: 200 ms); MEDIUM before and after; LARGE only
    after, as fast as MEDIUM there. Across contexts LARGE would look 1.33x slower than MEDIUM's
    early steps and SMALL would be compared with configurations it never ran beside."""
    stream(
        thread_daemon.address,
        "drop",
        [
            (40, SMALL, 0.200, 2.5e8, 0.05),
            (40, MEDIUM, 0.050, 2.5e8, 0.05),
            (40, MEDIUM, 0.150, 3.5e7, 0.05),  # the link drops 7x: MEDIUM measured again
            (40, LARGE, 0.150, 3.6e7, 0.05),
        ],
    )
    best = best_json(thread_daemon.address, "drop")
    assert best["contexts"] == 2
    assert (
        best["context"].startswith("context 2 of 2: run 1, steps ")
        and "a bandwidth drop at step 8" in best["context"]
    ), best["context"]
    compared = {
        (c["config"]["partition_bytes"], c["config"]["credit_bytes"]): c for c in best["candidates"]
    }
    assert set(compared) == {(4 << 20, 16 << 20), (16 << 20, 64 << 20)}  # SMALL is not compared
    assert all(c["median_step_time_s"] == pytest.approx(0.150) for c in compared.values())
    # The context began with MEDIUM (the baseline never ran in it): the speed-ups are over MEDIUM.
    assert best["reference"] == {"partition_bytes": 4 << 20, "credit_bytes": 16 << 20}
    assert best["baseline_step_time_s"] is None
    assert [c["speedup"] for c in best["candidates"]] == pytest.approx([1.0, 1.0])
    assert (
        compared[(4 << 20, 16 << 20)]["samples"] == 40
        and compared[(16 << 20, 64 << 20)]["samples"] == 40
    )

    table = run_cli("best", "drop", "--daemon", thread_daemon.address)
    assert table.returncode == 0, table.stderr
    assert all(len(line) <= 80 for line in table.stdout.splitlines()), table.stdout
    text = " ".join(table.stdout.split())
    assert "in context 2 of 2" in text and "since a bandwidth drop at step" in text
    assert "SPEED-UP = x faster than 4MiB/16MiB" in text and "64KiB/64KiB" not in text, table.stdout
    assert "not measured in this context" in text


def test_one_speedup_figure_over_the_baseline_in_its_context(thread_daemon):
    """With the no-scheduling baseline measured in the context, every speed-up is over it, and the
    table, the JSON and the headline give the same figure (baseline median / candidate median)."""
    stream(
        thread_daemon.address,
        "steady",
        [
            (30, BASELINE, 0.100, 1e8, 0.1),
            (30, MEDIUM, 0.080, 1e8, 0.1),
            (30, SMALL, 0.125, 1e8, 0.1),
        ],
    )
    best = best_json(thread_daemon.address, "steady")
    assert best["contexts"] == 1 and best["reference"] == {
        "partition_bytes": None,
        "credit_bytes": None,
    }
    speedups = {c["config"]["partition_bytes"]: c["speedup"] for c in best["candidates"]}
    assert speedups == pytest.approx({4 << 20: 1.25, None: 1.0, 64 << 10: 0.8})
    assert speedup(0.100, 0.080) == pytest.approx(1.25)
    table = run_cli("best", "steady", "--daemon", thread_daemon.address).stdout
    assert describe_speedup(1.25, "none/inf") in table  # the headline: "1.25x faster than none/inf"
    assert "0.80x" in table and "1.25x" in table
    assert describe_speedup(0.8, "none/inf") == "0.80x as fast as none/inf"
    with pytest.raises(ValueError, match="two positive step times"):
        speedup(0.0, 0.1)


def test_a_new_run_and_a_host_load_rise_are_new_contexts(thread_daemon):
    seq = stream(
        thread_daemon.address, "runs", [(30, SMALL, 0.1, 1e8, 0.05), (30, MEDIUM, 0.05, 1e8, 0.05)]
    )
    after_restart = best_json(thread_daemon.address, "runs")
    assert after_restart["contexts"] == 1 and len(after_restart["candidates"]) == 2
    # A new process on rank 0 starts a new run (steps from 0), then a neighbour takes half the host.
    stream(
        thread_daemon.address,
        "runs",
        [(30, LARGE, 0.07, 1e8, 0.05), (30, LARGE, 0.12, 1e8, 0.6), (30, SMALL, 0.2, 1e8, 0.6)],
        first_seq=seq,
        instance="i-1",
    )
    best = best_json(thread_daemon.address, "runs")
    assert best["contexts"] == 3, best
    assert "run 2" in best["context"] and "a host load rise at step 30" in best["context"], best[
        "context"
    ]
    assert {c["config"]["partition_bytes"] for c in best["candidates"]} == {16 << 20, 64 << 10}


def test_the_holding_line_and_its_switch_decision_show_the_same_figure():
    """The tuner's status and the decision that switched give one speed-up, worded one way."""
    import re

    from autobyted.tuner.search import JobTuner
    from benchmarks.harness.autobyte_policy import MemorySink
    from tests.helpers.tuner import BEST, SHAPE, ScriptedJob, better, predictor_for

    sink = MemorySink("job")
    tuner = JobTuner("job", SHAPE, predictor_for(BEST, 0.3), sink)
    ScriptedJob(better(BEST, 0.3)).run(tuner, sink, 400)
    (switch,) = [d for d in sink.decisions if d.kind == "switch"]
    figure = re.compile(r"measured (\d+\.\d\dx faster than 4MiB/16MiB)")
    assert tuner.phase == "holding" and figure.search(tuner.detail), tuner.detail
    assert figure.search(switch.reason).group(1) == figure.search(tuner.detail).group(1)
    trial = next(d for d in sink.decisions if d.kind == "trial")
    assert re.search(r"predicted \d+\.\d\dx faster than 4MiB/16MiB", trial.reason), trial.reason


def test_best_names_the_tuners_winner_not_a_faster_median_within_the_noise():
    """The quick start's ending: the context began with 16MiB/64MiB (~480 ms), none/inf measured 466 ms
    over a few noisy steps: the tuner's rule (tuner.verdict.beats: 2% and 2.5 standard errors) keeps
    16MiB/64MiB, and so does `best`; a configuration clearly faster is named."""
    import math
    import random

    from autobyte.types import Config

    from autobyted.best import best_in_latest_context
    from autobyted.contexts import StepPoint

    rng = random.Random(4)
    held, baseline, clear = Config(16 << 20, 64 << 20), Config(), Config(4 << 20, 8 << 20)

    def points(phases):
        out, wall = [], 1.7e9
        for steps, config, step_s in phases:
            for _ in range(steps):
                time_s = step_s * math.exp(rng.gauss(0, 0.08))
                wall += time_s
                out.append(StepPoint(len(out), wall, time_s, config, 3e7, 0.2))
        return out

    noisy = best_in_latest_context(
        "j", points([(40, held, 0.48), (12, baseline, 0.466), (20, held, 0.48)]), 5
    )
    assert (
        noisy.config == held
        and "none/inf measured" in noisy.evidence
        and "within the noise" in noisy.evidence
    )
    clearly = best_in_latest_context(
        "j", points([(40, held, 0.48), (20, clear, 0.40), (20, held, 0.48)]), 5
    )
    assert clearly.config == clear and "within the noise" not in clearly.evidence


def _points(phases):
    """StepPoints of rank 0: phases of (steps, config, step_time_s, bandwidth, host_load)."""
    from autobyte.types import Config

    from autobyted.contexts import StepPoint

    points, wall = [], 1_764_500_000.0
    for steps, config, step_time_s, bandwidth, load in phases:
        for _ in range(steps):
            wall += step_time_s
            points.append(
                StepPoint(len(points), wall, step_time_s, Config(*config), bandwidth, load)
            )
    return points


@pytest.mark.parametrize("straddler_bandwidth", [2.4e8, 1.4e8, 4e7])
def test_a_link_drop_is_one_context_from_the_step_it_happened_in_named_as_the_tuner_names_it(
    straddler_bandwidth,
):
    """The quick start's drop: the link falls 7x inside step 47 (in the middle of a block), and the
    host load falls with it (less traffic takes less of the host's CPU). The new context is labelled
    a bandwidth drop, as the tuner labels it, never a host load drop; it begins at step 47 or 48,
    and step 47, whatever share of it ran on the slow link, is in no context before it."""
    from autobyted.contexts import split_contexts

    medium = (4 << 20, 16 << 20)
    contexts = split_contexts(
        _points(
            [
                (47, medium, 0.05, 2.5e8, 0.42),
                (1, medium, 0.10, straddler_bandwidth, 0.30),  # step 47: the change inside it
                (60, medium, 0.15, 3.5e7, 0.15),
            ]
        )
    )
    assert len(contexts) == 2, [c.describe(len(contexts)) for c in contexts]
    old, new = contexts
    assert new.started_by in ("a bandwidth drop at step 47", "a bandwidth drop at step 48"), (
        new.started_by
    )
    assert new.first_step >= 47 and old.last_step < 47, (old.describe(2), new.describe(2))
    assert f"step {new.first_step}" in new.started_by


def test_a_host_load_change_alone_is_named_host_load():
    from autobyted.contexts import split_contexts

    medium = (4 << 20, 16 << 20)
    contexts = split_contexts(
        _points([(43, medium, 0.05, 2.5e8, 0.05), (60, medium, 0.06, 2.4e8, 0.65)])
    )
    assert [c.started_by for c in contexts] == ["the job's start", "a host load rise at step 43"]
    assert contexts[0].last_step == 41  # step 42, just before the change point: in neither


def test_a_rate_swinging_every_minute_under_slow_steps_is_a_context_a_phase():
    """The 8-rank swing trace's shape (benchmarks/scenarios/emulated-gpt2-medium-8w-swing.toml):
    60 s phases of 1.7 s steps (35 steps) and 3.5 s steps (17 steps), the bandwidth estimate 10
    and 3.5 MB/s. Ten-step blocks needed 30 steps to confirm a move, longer than a slow phase: the
    whole job was one context and `best` compared configurations measured at both rates. Now each
    phase is a context of its own, named by what changed."""
    from autobyted.contexts import split_contexts

    held = (256 << 10, 1 << 20)
    fast, slow = (35, held, 1.72, 1.0e7, 0.0), (17, held, 3.47, 3.5e6, 0.0)
    contexts = split_contexts(_points([fast, slow, fast, slow]))
    assert [c.started_by.split(" at ")[0] for c in contexts] == [
        "the job's start",
        "a bandwidth drop",
        "a bandwidth rise",
        "a bandwidth drop",
    ], [c.describe(len(contexts)) for c in contexts]
    for context, begins in zip(contexts[1:], (35, 52, 87)):
        assert abs(context.first_step - begins) <= 1, context.describe(len(contexts))


def test_a_brief_wander_of_the_estimate_is_no_new_context_at_any_step_time():
    """A 2x dip of the bandwidth estimate for 15 steps of 0.1 s (the wander measured on 2-rank gloo
    jobs on a shared host), or for two of 3.5 s: neither lasts the three blocks a move needs."""
    from autobyted.contexts import split_contexts

    held = (4 << 20, 16 << 20)
    for step_s, dip in ((0.1, 15), (3.5, 2)):
        steady, wander = (40, held, step_s, 1.0e7, 0.0), (dip, held, step_s, 4.0e6, 0.0)
        contexts = split_contexts(_points([steady, wander, steady]))
        assert len(contexts) == 1, (step_s, [c.describe(len(contexts)) for c in contexts])
