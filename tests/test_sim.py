"""Simulator invariants: lower bound, monotonicity, ring cost, priority under credit, traces, BO."""

from __future__ import annotations

import dataclasses
import itertools
import math
import textwrap

import numpy as np
import pytest
from autobyte.types import Config

from benchmarks.harness.policies import (
    BayesOptOncePolicy,
    GaussianProcess,
    PolicyContext,
    default_grid,
    make_policy,
)
from simulator import (
    DDP,
    LayerProfile,
    LinkModel,
    ModelProfile,
    PiecewiseConstant,
    Simulator,
    bert_base,
    lower_bound_step_s,
    ramp_trace,
    resnet50,
    ring_allreduce_s,
    vgg16,
)
from simulator.engine import _dispatch, dependency_bound_step_s
from simulator.trace import periodic_trace, step_trace

GBIT = 1e9 / 8
MIB = 1 << 20
CONFIGS = [
    DDP,
    Config(None, None),
    Config(4 * MIB, 16 * MIB),
    Config(1 * MIB, 1 * MIB),
    Config(256 << 10, None),
]


@pytest.fixture(scope="module")
def resnet():
    return resnet50().scaled(50)


def test_builtin_profiles_match_public_parameter_counts():
    assert resnet50().total_param_bytes // 4 == 25_557_032
    assert vgg16().total_param_bytes // 4 == 138_357_544
    assert abs(bert_base().total_param_bytes // 4 - 109_482_240) < 1_000
    assert resnet50().num_tensors == 161


@pytest.mark.parametrize("workers", [2, 8, 64])
@pytest.mark.parametrize("gbit", [1, 10, 100])
def test_step_time_never_beats_lower_bound(resnet, workers, gbit):
    sim = Simulator(resnet, workers, PiecewiseConstant.constant(gbit * GBIT))
    bound = lower_bound_step_s(resnet, workers, gbit * GBIT)
    for config in CONFIGS:
        sim.reset()
        records = sim.run(config, steps=6)
        assert all(r.step_time_s >= bound * (1 - 1e-9) for r in records[1:]), config


def test_more_bandwidth_never_slower_for_ddp(resnet):
    previous = math.inf
    for gbit in (0.5, 1, 2, 5, 10, 25, 100, 1000):
        step = Simulator(resnet, 8, PiecewiseConstant.constant(gbit * GBIT)).steady_step_s(
            DDP, gbit * GBIT
        )
        assert step <= previous + 1e-12
        previous = step


def test_unlimited_bandwidth_costs_only_compute(resnet):
    link = LinkModel(latency_s=0, collective_overhead_s=0, launch_s=0, ddp_launch_s=0)
    profile = ModelProfile(resnet.name, resnet.layers, resnet.batch_size, optimizer_s=0.0)
    sim = Simulator(profile, 16, PiecewiseConstant.constant(1e30), link)
    for config in CONFIGS:
        sim.reset()
        records = sim.run(config, steps=5)
        for record in records:
            assert record.step_time_s == pytest.approx(profile.compute_s, rel=1e-9)
            assert record.blocked_s == pytest.approx(0.0, abs=1e-12)


def test_single_worker_has_no_communication(resnet):
    sim = Simulator(resnet, 1, PiecewiseConstant.constant(1 * GBIT))
    record = sim.run(Config(1 * MIB, 1 * MIB), steps=3)[-1]
    assert record.step_time_s == pytest.approx(resnet.compute_s)


@pytest.mark.parametrize("workers", [2, 3, 8, 64])
def test_ring_allreduce_formula_and_one_message_in_the_simulator(workers):
    nbytes, bandwidth, latency = 10 * MIB, 5 * GBIT, 20e-6
    expected = 2 * (workers - 1) / workers * nbytes / bandwidth + 2 * (workers - 1) * latency
    assert ring_allreduce_s(nbytes, workers, bandwidth, latency) == pytest.approx(expected)
    assert ring_allreduce_s(nbytes, 1, bandwidth, latency) == 0.0
    # A one-layer model with zero compute: the step is exactly one all-reduce.
    profile = ModelProfile("one", (LayerProfile("w", 0.0, 0.0, (nbytes,)),))
    link = LinkModel(latency_s=latency, collective_overhead_s=0, launch_s=0, ddp_launch_s=0)
    sim = Simulator(profile, workers, PiecewiseConstant.constant(bandwidth), link)
    assert sim.run(Config(None, None), steps=2)[-1].step_time_s == pytest.approx(expected)


@pytest.mark.parametrize("fixed_s", [0.001, 0.05])
def test_a_fixed_cost_that_overlaps_the_wire_holds_the_link_for_the_larger_of_the_two(fixed_s):
    """LinkModel.fixed_overlaps_wire: one collective of 10 MiB at 2 ranks (8 ms on the wire)
    takes max(fixed, wire), not their sum, on a constant link and across a rate change; the
    dependency bound (a free link) lies between the bound and any configuration's step."""
    nbytes, bandwidth = 10 * MIB, 10 * MIB / 0.008  # ring factor 1 at 2 ranks: 8 ms on the wire
    profile = ModelProfile("one", (LayerProfile("w", 0.0, 0.0, (nbytes,)),))
    link = LinkModel(latency_s=0, collective_overhead_s=fixed_s, launch_s=0, ddp_launch_s=0)
    for overlap, expected in ((False, fixed_s + 0.008), (True, max(fixed_s, 0.008))):
        model = dataclasses.replace(link, fixed_overlaps_wire=overlap)
        sim = Simulator(profile, 2, PiecewiseConstant.constant(bandwidth), model)
        assert sim.run(Config(None, None), steps=2)[-1].step_time_s == pytest.approx(expected)
        # the same across a rate change: the bytes integrate over the trace from the start
        changing = step_trace([bandwidth, bandwidth / 2], [100.0])
        sim = Simulator(profile, 2, changing, model)
        assert sim.run(Config(None, None), steps=2)[-1].step_time_s == pytest.approx(expected)
    resnet = resnet50().scaled(50)
    bound = lower_bound_step_s(resnet, 4, 5 * GBIT)
    free = dependency_bound_step_s(resnet, 4, 5 * GBIT)
    costly = Simulator(resnet, 4, PiecewiseConstant.constant(5 * GBIT), LinkModel())
    assert bound <= free <= costly.steady_step_s(Config(4 * MIB, 16 * MIB), 5 * GBIT)


def test_transfer_integrates_across_a_bandwidth_change():
    trace = step_trace([1000.0, 100.0], [1.0])
    assert trace.integrate_until(0.5, 500.0) == pytest.approx(1.0)
    assert trace.integrate_until(0.5, 600.0) == pytest.approx(2.0)
    assert trace.integrate_until(2.0, 100.0) == pytest.approx(3.0)


def test_finite_credit_sends_high_priority_first():
    # Ten 1 MiB messages, all ready at once; priority = index. The link is FIFO, so the order of
    # completion is the dispatch order.
    count = 10
    sizes = tuple([MIB] * count)
    ready = [0.0] * count
    # Ready order puts the low-priority (deep) layers first, as backward does.
    priority = tuple(range(count - 1, -1, -1))

    def completion_order(credit):
        done = _dispatch(ready, sizes, priority, credit, 1e-6, 0.0, 1.0, MIB / 1e-3, None, 0.0)
        return [priority[i] for i in np.argsort(done)]

    assert completion_order(MIB) == list(range(count))


def test_credit_lets_late_high_priority_gradients_overtake():
    # Deep layer ready first (big), shallow layer ready a bit later (small). With unlimited credit the
    # shallow layer queues behind every deep partition; with credit of one partition it overtakes.
    sizes = tuple([MIB] * 8 + [MIB])
    ready = [0.0] * 8 + [0.5e-3]
    priority = tuple([1] * 8 + [0])
    unlimited = _dispatch(ready, sizes, priority, math.inf, 1e-6, 0.0, 1.0, MIB / 1e-3, None, 0.0)
    limited = _dispatch(ready, sizes, priority, MIB, 1e-6, 0.0, 1.0, MIB / 1e-3, None, 0.0)
    assert limited[-1] < unlimited[-1]
    assert limited[-1] < 3e-3
    assert max(limited) == pytest.approx(max(unlimited), rel=0.01)  # same work in total


def test_cross_iteration_overlap_beats_ddp_when_comm_and_compute_balance():
    layers = tuple(LayerProfile(f"l{i}", 0.01, 0.02, (8 * MIB,)) for i in range(8))
    profile = ModelProfile("toy", layers)
    link = LinkModel(latency_s=0, collective_overhead_s=0, launch_s=0, ddp_launch_s=0)
    bandwidth = 2 * 64 * MIB / 0.2 / 2  # total comm ~= 0.2 s, compute 0.24 s
    sim = Simulator(profile, 2, PiecewiseConstant.constant(bandwidth), link)
    ddp = sim.steady_step_s(DDP, bandwidth)
    scheduled = sim.steady_step_s(Config(1 * MIB, 2 * MIB), bandwidth)
    bound = lower_bound_step_s(profile, 2, bandwidth)
    assert bound <= scheduled < ddp


def test_cached_and_exact_paths_agree_across_trace_changes(resnet):
    trace = step_trace([10 * GBIT, 2 * GBIT, 7 * GBIT], [3.3, 7.1])
    sim = Simulator(resnet, 8, trace)
    records = sim.run(Config(4 * MIB, 8 * MIB), until_s=12.0)
    # Steps in the low-bandwidth phase are slower, and the clock is continuous.
    low = [r.step_time_s for r in records if 4 < r.start_s < 7]
    high = [r.step_time_s for r in records if 1 < r.start_s < 3]
    assert min(low) > max(high)
    for a, b in itertools.pairwise(records):
        assert b.start_s == a.end_s


def test_trace_kinds():
    ramp = ramp_trace(10, 20, 5, 15, ramp_segments=10)
    assert ramp.at(0) == 10 and ramp.at(100) == 20
    assert 10 < ramp.at(10) < 20
    periodic = periodic_trace(10, 1, period_s=10, low_s=3, offset_s=5, until_s=30)
    assert periodic.at(6) == 1 and periodic.at(9) == 10 and periodic.at(16) == 1
    assert len(periodic.phases(30)) == 7


def test_gaussian_process_interpolates_and_is_unsure_far_away():
    x = np.array([[0.1, 0.1], [0.5, 0.5], [0.9, 0.9]])
    y = np.array([1.0, 0.2, 1.0])
    gp = GaussianProcess().fit(x, y)
    mean, std = gp.predict(np.array([[0.5, 0.5], [0.1, 0.9]]))
    assert mean[0] == pytest.approx(0.2, abs=0.1)
    assert std[1] > std[0]


def test_bo_once_runs_fifteen_trials_then_fixes_the_best(resnet):
    sim = Simulator(resnet, 8, PiecewiseConstant.constant(5 * GBIT))
    policy = BayesOptOncePolicy(trial_steps=12, settle_steps=2)
    policy.prepare(PolicyContext(candidates=default_grid(), seed=3))
    config = policy.initial_config()
    for _ in range(12 * 15 + 5):
        change = policy.observe(sim.step(config))
        config = change or config
    assert len(policy.results) == 15
    assert len({c for c, _ in policy.results}) == 15
    assert policy.final == min(policy.results, key=lambda item: item[1])[0] == config


def test_policy_names_parse():
    assert make_policy("static:4MiB,16MiB").initial_config() == Config(4 * MIB, 16 * MIB)
    assert make_policy("static:none,none").initial_config() == Config(None, None)
    assert make_policy("ddp").initial_config() == DDP
    # held like static:P,C (on the testbed a daemon observes beside it)
    assert make_policy("observe:1MiB,4MiB").initial_config() == Config(1 * MIB, 4 * MIB)
    poor = make_policy("autobyte:64KiB,64KiB")  # the tuner from a poor start
    assert (
        poor.initial_config() == Config(64 << 10, 64 << 10) and poor.name == "autobyte:64KiB,64KiB"
    )
    with pytest.raises(ValueError):
        make_policy("static:4MiB")
    with pytest.raises(ValueError, match="autobyte:4MiB,16MiB"):
        make_policy("autobyte:64KiB")
    with pytest.raises(ValueError, match="observe:4MiB,16MiB"):
        make_policy("observe:4MiB")
    with pytest.raises(ValueError):
        make_policy("nonsense")


# ---- compute slowed while communication runs (calibrated on the testbed) --------------------------


@pytest.mark.parametrize("config", CONFIGS)
def test_contended_path_equals_fast_path_without_slowdown(config):
    profile = vgg16(16)
    plain = Simulator(profile, 4, PiecewiseConstant.constant(1 * GBIT), LinkModel()).run(
        config, steps=4
    )
    # a slowdown of (almost) 1 takes the contended code path and must give the same steps
    same = Simulator(
        profile, 4, PiecewiseConstant.constant(1 * GBIT), LinkModel(comm_compute_slowdown=1 + 1e-12)
    ).run(config, steps=4)
    for a, b in zip(plain, same):
        assert b.step_time_s == pytest.approx(a.step_time_s, rel=1e-9)
        assert b.blocked_s == pytest.approx(a.blocked_s, abs=1e-9)


def test_cpu_bound_communication_serialises_with_compute():
    """With comm_cpu_s_per_byte x bandwidth >= 1 compute (almost) stops while gradients move, so a
    step costs about compute + communication; at a tenth of that load about 1/0.9 slower in the
    overlapped part; the slowdown never makes a step faster and never beats the lower bound."""
    profile = vgg16(16)
    bandwidth = 10 * GBIT
    base = LinkModel(latency_s=0, collective_overhead_s=0, launch_s=0, ddp_launch_s=0)
    comm = ring_allreduce_s(profile.total_param_bytes, 2, bandwidth, 0.0)
    config = Config(4 * MIB, None)
    free = Simulator(profile, 2, PiecewiseConstant.constant(bandwidth), base).steady_step_s(
        config, bandwidth
    )
    bound = LinkModel(**{**base.__dict__, "comm_cpu_s_per_byte": 1.0 / bandwidth})
    assert bound.compute_slowdown(bandwidth) == pytest.approx(20.0)  # capped at 95% of the CPU
    serial = Simulator(profile, 2, PiecewiseConstant.constant(bandwidth), bound).steady_step_s(
        config, bandwidth
    )
    assert free < serial <= profile.compute_s + comm + 1e-9
    assert serial > profile.compute_s + 0.9 * comm
    light = LinkModel(**{**base.__dict__, "comm_cpu_s_per_byte": 0.1 / bandwidth})
    mid = Simulator(profile, 2, PiecewiseConstant.constant(bandwidth), light).steady_step_s(
        config, bandwidth
    )
    assert free < mid < serial
    for config in CONFIGS:
        sim = Simulator(profile, 2, PiecewiseConstant.constant(bandwidth), light)
        assert (
            sim.steady_step_s(config, bandwidth) >= lower_bound_step_s(profile, 2, bandwidth) - 1e-9
        )


def test_contended_steps_follow_a_trace_change():
    profile = vgg16(16).scaled(100)
    link = LinkModel(comm_cpu_s_per_byte=1e-10)
    trace = step_trace([10 * GBIT, 1 * GBIT], [3.0])
    records = Simulator(profile, 4, trace, link).run(Config(1 * MIB, 4 * MIB), until_s=40.0)
    fast = [r.step_time_s for r in records if r.end_s < 3.0]
    slow = [r.step_time_s for r in records if r.start_s > 10.0]
    assert fast and slow and min(slow) > max(fast)


def test_from_bench_takes_link_constants_from_the_probes(tmp_path):
    """The testbed converter: rates from each block's comm probe, per-collective cost from the
    dispatch probe, CPU per byte from the CPU-bound (highest-rate) probe; step times untouched."""
    import json

    from benchmarks.calibrate import MBIT, from_bench
    from benchmarks.run_inputs import bench_buckets

    grad_bytes, buckets = bench_buckets("mlp", {})

    def block(rate, comm_s, ddp_s):
        rows = {
            "compute": {"median_step_s": 0.2},
            "comm": {"median_step_s": comm_s},
            "ddp": {"median_step_s": ddp_s, "rounds": 3},
        }
        return {
            "model": "mlp",
            "rate": rate,
            "load": "1.0 1.0 1.0",
            "batch_size": 512,
            "rows": rows,
            "raw": [],
        }

    bench = {
        "command": "x",
        "load_before": "1",
        "load_after": "1",
        "blocks": [block("10gbit", 0.03, 0.25), block("1gbit", 0.23, 0.42)],
        "dispatch": {
            "configs": {
                "a": {
                    "external_us_per_extra_partition": 1000.0,
                    "scheduler_us_per_partition": 10.0,
                    "backend_launch_us_per_partition": 30.0,
                },
                "b": {
                    "external_us_per_extra_partition": None,
                    "scheduler_us_per_partition": 10.0,
                    "backend_launch_us_per_partition": 30.0,
                },
            }
        },
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    measured = from_bench([path])
    assert measured["link"]["collective_overhead_s"] == pytest.approx(1e-3)
    assert measured["link"]["launch_s"] == pytest.approx(40e-6)
    fast, slow = measured["runs"]
    assert fast["step_time_median_s"] == 0.25 and slow["step_time_median_s"] == 0.42
    assert slow["rate_mbit"] == pytest.approx(grad_bytes / (0.23 - buckets * 1e-3) / MBIT)
    # the 10gbit probe reached far less than 10 Gbit/s: CPU-bound, its inverse goodput is the cost
    assert fast["link"]["comm_cpu_s_per_byte"] == pytest.approx(
        (0.03 - buckets * 1e-3) / grad_bytes
    )
    assert slow["link"] == fast["link"]


# ---- the scheduler's flat-buffer partitions, per-message costs, condition keys ---------


def test_partitions_are_slices_of_the_flat_buffer_as_the_scheduler_cuts_them():
    # Tensors laid out in reverse forward order (KiB): C.1 30, C.0 30, B 1000, A.1 40, A.0 400.
    k = 1 << 10
    layers = (
        LayerProfile("A", 0.001, 0.001, (400 * k, 40 * k)),
        LayerProfile("B", 0.001, 0.001, (1000 * k,)),
        LayerProfile("C", 0.001, 0.001, (30 * k, 30 * k)),
    )
    sim = Simulator(ModelProfile("toy", layers), 2, PiecewiseConstant.constant(GBIT))
    plan = sim._plan(Config(512 * k, None))
    assert plan.sizes == (512 * k, 512 * k, 476 * k)  # small tensors fused, the big one split
    assert plan.ready_layer == (1, 1, 0)  # a slice waits for the earliest layer it overlaps
    # highest offset (earliest forward use) first: a lower priority value goes first
    assert sorted(range(3), key=plan.priority.__getitem__) == [2, 1, 0]
    unpartitioned = sim._plan(Config(None, None))
    assert sorted(unpartitioned.sizes) == sorted(
        x * k for x in (30, 30, 1000, 40, 400)
    )  # one per tensor
    assert unpartitioned.ready_layer == (2, 2, 1, 0, 0)
    assert sim.messages_per_step(Config(4 * MIB, None)) == 1


def test_message_costs_interpolate_by_size_and_add_per_competing_flow():
    link = LinkModel(
        latency_s=0,
        collective_overhead_s=1e-3,
        message_extra_s=((4096, 2e-3), (1 << 20, 0.0)),
        flow_message_extra_s=((4096, 1e-3), (1 << 20, 5e-3)),
    )
    assert link.message_s(1024, 2) == pytest.approx(3e-3)  # flat below the first point
    assert link.message_s(64 << 10, 2) == pytest.approx(1e-3 + 1e-3)  # halfway in log2(bytes)
    assert link.message_s(8 << 20, 2) == pytest.approx(1e-3)  # flat beyond the last point
    assert link.message_s(64 << 10, 2, flows=2) == pytest.approx(2e-3 + 2 * 3e-3)
    assert link.flow_share(1) == pytest.approx(0.5) and link.flow_share(0) == 1.0
    with pytest.raises(ValueError):
        LinkModel(message_extra_s=((0, 1e-3),))


def test_competing_flows_and_a_cpu_quota_slow_the_simulated_job(resnet):
    link = LinkModel(comm_cpu_s_per_byte=1e-10, flow_message_extra_s=((4096, 2e-3),))
    config = Config(1 * MIB, 4 * MIB)
    sim = Simulator(resnet, 4, PiecewiseConstant.constant(5 * GBIT), link)
    quiet = sim.steady_step_s(config, 5 * GBIT)
    with_flow = sim.steady_step_s(config, 5 * GBIT * link.flow_share(1), 1.0, 1.0)
    half_core = sim.steady_step_s(config, 5 * GBIT, 1.0, 0.0, 0.5)
    assert with_flow > quiet and half_core > quiet
    assert half_core >= 2 * resnet.compute_s * 0.999  # compute alone takes twice as long
    # more messages pay the per-flow penalty more often
    small = Config(256 << 10, 1 * MIB)
    assert (
        sim.steady_step_s(small, 5 * GBIT / 2, 1.0, 1.0) - sim.steady_step_s(small, 5 * GBIT)
        > with_flow - quiet
    )


def test_scenario_condition_keys(tmp_path):
    from benchmarks.harness.scenario import load_scenario

    scenario = tmp_path / "conditions.toml"
    scenario.write_text(
        textwrap.dedent("""
        model = "resnet50"
        compute_scale = 50
        workers = 4
        duration_s = 30
        [bandwidth]
        kind = "constant"
        value = 10
        [traffic]
        kind = "step"
        levels = [0, 1, 0]
        at_s = [10, 20]
        [cpu]
        kind = "step"
        levels = [1, 0.5]
        at_s = [15]
        [straggler]
        kind = "constant"
        value = 4
        [link]
        flow_message_extra_s = [[4096, 0.002], [2097152, 0.01]]
    """)
    )
    loaded = load_scenario(scenario)
    assert loaded.has_conditions
    assert loaded.bandwidth.at(5) == pytest.approx(4 * GBIT)  # the straggler link
    assert loaded.bandwidth.at(12) == pytest.approx(2 * GBIT)  # half of it next to one flow
    assert loaded.link_bandwidth.at(12) == pytest.approx(10 * GBIT)
    phases = loaded.phases(30)
    assert [p[0] for p in phases] == [0, 10, 15, 20]
    assert phases[2][2:] == (2 * GBIT, 1.0, 1.0, 0.5)  # bandwidth, compute, flows, cpu share
    sim = loaded.make_simulator()
    records = sim.run(Config(4 * MIB, 16 * MIB), until_s=30)
    by_phase = [
        [r.step_time_s for r in records if a + 1 < r.start_s < b - 1] for a, b, *_ in phases
    ]
    assert max(by_phase[0]) < min(by_phase[1]) < min(by_phase[2])  # flow, then also half a core
    policy = make_policy("oracle")
    from benchmarks.harness.evaluate import policy_context

    policy.prepare(policy_context(loaded, sim, 30))
    assert len(policy.phase_configs) == 4
    trace = loaded.testbed_trace(30)
    kinds = [(type(c).__name__, c.at_s, c.ranks) for c in trace.changes]
    assert ("RateChange", 0.0, None) in kinds and ("RateChange", 0.0, (1,)) in kinds
    assert ("FlowChange", 10.0, (1,)) in kinds and ("CpuShareChange", 15.0, (1,)) in kinds
    # a scenario without the keys is what it was
    plain = tmp_path / "plain.toml"
    plain.write_text(
        'model = "resnet50"\nworkers = 2\nduration_s = 10\n[bandwidth]\n'
        'kind = "constant"\nvalue = 1\n'
    )
    old = load_scenario(plain)
    assert not old.has_conditions and len(old.phases(10)[0]) == 4 and old.link_bandwidth is None


def test_partitions_are_slices_of_one_buffer_like_the_real_scheduler(resnet):
    # Small tensors fuse, big ones split: ceil(total / partition) messages; no partitioning = one
    # message per tensor.
    sim = Simulator(resnet, 8, PiecewiseConstant.constant(10 * GBIT))
    total = resnet.total_param_bytes
    assert sim.messages_per_step(Config(4 * MIB, None)) == -(-total // (4 * MIB))
    assert sim.messages_per_step(Config(None, None)) == resnet.num_tensors
    profile = ModelProfile(
        "two",
        (
            LayerProfile("a", 0.001, 0.002, (3 * MIB, 1 << 10)),
            LayerProfile("b", 0.001, 0.002, (1 << 10, 3 * MIB)),
        ),
    )
    link = LinkModel(latency_s=0, collective_overhead_s=0, launch_s=0, ddp_launch_s=0)
    two = Simulator(profile, 2, PiecewiseConstant.constant(1 * GBIT), link)
    plan = two._plan(Config(4 * MIB, None))
    # buffer: b's 3 MiB + 1 KiB, then a's 1 KiB + 3 MiB; 4 MiB slices -> 2 messages, the first
    # carries b and the start of a, so it is ready only when a's backward is done
    assert plan.sizes == (4 * MIB, 2 * (3 * MIB + (1 << 10)) - 4 * MIB)
    assert plan.ready_layer == (0, 0) and plan.covers == ((0, 1), (0, 0))
    assert plan.priority == (1, 0)  # the slice nearest the input goes first
    step = two.run(Config(4 * MIB, None), steps=3)[-1]
    assert step.step_time_s >= lower_bound_step_s(profile, 2, 1 * GBIT)


def test_the_tail_window_lets_the_last_gradient_overtake_the_backlog():
    """simulator.engine models Config.tail_bytes as the scheduler runs it: while gradient bytes of
    the step are still to come (at most tail_bytes), one message at a time, so the last-ready,
    highest-priority message waits behind one transfer instead of the whole backlog."""
    import math

    from simulator.engine import _dispatch

    ready = [0.0, 0.0, 0.0, 0.001]  # three messages at once, the first layer's 1 ms later
    sizes = (10**6,) * 4  # 1 ms each at 1e9 B/s
    priority = (3, 2, 1, 0)  # the last one is needed first

    def done(tail: float) -> list[float]:
        return _dispatch(ready, sizes, priority, math.inf, 0.0, 0.0, 1.0, 1e9, None, 0.0, tail)

    plain, tailed = done(0.0), done(4e6)
    assert plain[3] == pytest.approx(0.004)  # behind all three
    assert tailed[3] == pytest.approx(0.002)  # behind one
    assert max(tailed) == pytest.approx(max(plain))  # the same bytes, the link never idles here


# ---- row-sparse embedding tables (the client's autobyte.scheduler.sparse_rows) -------------------


def test_the_row_sparse_model_uses_the_clients_thresholds_and_union():
    from autobyte.scheduler import sparse_rows

    from simulator import RowSparseTable, engine, sparse_wire

    assert engine.SPARSE_MIN_BYTES == sparse_rows.MIN_BYTES
    assert engine.SPARSE_MIN_ROW_BYTES == sparse_rows.MIN_ROW_BYTES
    tokens = RowSparseTable(8192, 0.1175)  # independent draws per worker
    assert tokens.union(1) == pytest.approx(0.1175)
    assert tokens.union(2) == pytest.approx(1 - (1 - 0.1175) ** 2)
    assert RowSparseTable(512, 0.25, overlap=1.0).union(8) == pytest.approx(0.25)  # the same rows
    half = RowSparseTable(1000, 0.2, overlap=0.5)  # 100 common rows, 100 own of the other 900
    assert half.union(2) == pytest.approx(0.1 + 0.9 * (1 - (1 - 0.1 / 0.9) ** 2))
    with pytest.raises(ValueError, match="share"):
        RowSparseTable(10, 1.5)
    row = 1024  # bytes per row
    union_rows = round(tokens.union(2) * 8192)
    assert sparse_wire(tokens, 8192 * row, 2) == union_rows * row + 8192  # the rows and the mask
    assert sparse_wire(tokens, 8192 * row, 1) is None  # nothing to reduce
    assert sparse_wire(tokens, 8192 * row, 16) is None  # the union is most of the table: whole
    assert sparse_wire(RowSparseTable(1024, 0.1), 1024 * 1023, 2) is None  # under 1 MiB
    assert sparse_wire(RowSparseTable(1 << 16, 0.1), (1 << 16) * 32, 2) is None  # 32-byte rows


def _table_model(rows=8192, dim=256, share=0.12):
    from simulator import RowSparseTable

    return ModelProfile(
        "tabled",
        (
            LayerProfile("embedding", 0.001, 0.002, (rows * dim * 4,), RowSparseTable(rows, share)),
            LayerProfile("hidden", 0.010, 0.020, (3 * MIB, 4096)),
            LayerProfile("out", 0.005, 0.010, (1 * MIB, 1024)),
        ),
    )


@pytest.mark.parametrize("partition", [64 << 10, 1 * MIB, 3 * MIB, 4 * MIB, 16 * MIB, None])
def test_a_row_sparse_table_is_a_message_of_its_own_in_every_plan(partition):
    """As the client's Layout(standalone=) cuts it: the table one message carrying its wire bytes
    (two collectives' fixed cost), every other byte in exactly one slice, slices cut from the
    table's end; row_sparse=False is the plan of the table sent whole."""
    from simulator import sparse_wire

    profile = _table_model()
    table_bytes = profile.layers[0].param_bytes[0]
    link = LinkModel(latency_s=0, collective_overhead_s=1e-3, launch_s=0, ddp_launch_s=0)
    sim = Simulator(profile, 2, PiecewiseConstant.constant(1 * GBIT), link)
    plan = sim._plan(Config(partition, 16 * MIB))
    wire = sparse_wire(profile.layers[0].table, table_bytes, 2)
    assert wire is not None and wire < table_bytes // 4
    table = [k for k, (mask, _) in enumerate(plan.sparse) if mask]
    assert len(table) == 1 and plan.sizes[table[0]] == wire
    assert plan.ready_layer[table[0]] == 0 and plan.priority[table[0]] == min(
        plan.priority
    )  # the first to go
    assert sum(plan.sizes) - wire == profile.total_param_bytes - table_bytes
    if partition is not None:
        assert all(size <= partition for k, size in enumerate(plan.sizes) if k != table[0])
    fixed = sim._fixed_per_message(Config(partition, 16 * MIB), plan, 0.0, 1.0)
    assert fixed[table[0]] > 2 * 1e-3 and all(
        f == pytest.approx(1e-3) for k, f in enumerate(fixed) if k != table[0]
    )
    whole = Simulator(profile, 2, PiecewiseConstant.constant(1 * GBIT), link, row_sparse=False)
    dense_plan = whole._plan(Config(partition, 16 * MIB))
    assert dense_plan.sparse == () and sum(dense_plan.sizes) == profile.total_param_bytes


def test_a_row_sparse_table_shortens_the_step_where_the_link_is_the_limit():
    """The table is the step's last gradient and the next forward's first parameter: at 1 Gbit/s
    sending a fifth of it shortens the step and the forward's wait; the step reports the bytes it
    put on the wire (what a rank reports as bytes_reduced)."""
    profile = _table_model()
    config = Config(1 * MIB, 2 * MIB)
    sparse = Simulator(profile, 2, PiecewiseConstant.constant(1 * GBIT)).run(config, steps=6)[-1]
    dense = Simulator(profile, 2, PiecewiseConstant.constant(1 * GBIT), row_sparse=False).run(
        config, steps=6
    )[-1]
    assert sparse.step_time_s < 0.9 * dense.step_time_s
    assert sparse.blocked_s < dense.blocked_s
    assert dense.bytes_reduced == profile.total_param_bytes
    assert sparse.bytes_reduced < profile.total_param_bytes - profile.layers[0].param_bytes[0] // 2
    ddp = Simulator(profile, 2, PiecewiseConstant.constant(1 * GBIT)).run(DDP, steps=3)[-1]
    assert ddp.bytes_reduced == profile.total_param_bytes  # DDP's buckets send the table whole


def test_bert_base_tables_are_row_sparse_and_profiles_keep_them(tmp_path):
    profile = bert_base()
    tables = {layer.name: layer.table for layer in profile.layers if layer.table is not None}
    assert set(tables) == {"embeddings.word", "embeddings.position", "embeddings.token_type"}
    assert tables["embeddings.word"].share == pytest.approx(1 - math.exp(-32 * 128 / 30522))
    assert tables["embeddings.position"].union(64) == pytest.approx(128 / 512)  # the same positions
    path = tmp_path / "bert.json"
    profile.save(path)
    assert ModelProfile.load(path) == profile


def test_the_lower_bound_counts_a_row_sparse_table_at_its_wire_bytes():
    """No schedule beats the bound: with the table row-sparse it is the smaller wire time, and the
    simulated step still respects it."""
    profile = _table_model()
    rate = 0.3 * GBIT
    sparse_bound = lower_bound_step_s(profile, 2, rate)
    dense_bound = lower_bound_step_s(profile, 2, rate, row_sparse=False)
    assert sparse_bound < dense_bound
    for config in (Config(1 * MIB, 2 * MIB), Config(None, None), Config(4 * MIB, None)):
        assert (
            Simulator(profile, 2, PiecewiseConstant.constant(rate)).steady_step_s(config, rate)
            >= sparse_bound
        )
