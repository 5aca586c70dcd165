"""The emulated accelerator (benchmarks/testbed/emulated.py): profile sizes, gradients in backward order,
the device's accounting, emulated-mode scenarios, and real emulated ranks on the testbed."""

from __future__ import annotations

import math
import os
import shutil
import textwrap
import threading
import time

import pytest
import torch

from benchmarks import bench_emulated
from benchmarks.harness.scenario import GBIT, load_scenario
from benchmarks.testbed import wire, worker_cli
from benchmarks.testbed.emulated import (
    EmulatedModel,
    EmulatedTable,
    build_emulated,
    gradient_fill,
    scaled_elements,
)
from benchmarks.testbed.train_worker import RunConfig, _param_digest
from simulator.profiles import LayerProfile, ModelProfile, RowSparseTable, load_profile
from tests.helpers.dist import SPARSE_ROWS_EVERYWHERE
from tests.helpers.paths import ROOT

# Three layers, short waits: 5 ms of compute a step, 35 KiB of gradients in five tensors.
TINY = ModelProfile(
    "tiny",
    (
        LayerProfile("embed", 0.0005, 0.0010, (16384,)),
        LayerProfile("block", 0.0010, 0.0015, (12288, 4096)),
        LayerProfile("head", 0.0005, 0.0005, (4000, 8)),
    ),
    batch_size=4,
    source="recorded",
)


def test_layers_carry_the_profile_sizes_and_gradients_arrive_in_backward_order():
    model = EmulatedModel(TINY, byte_scale=2)
    sizes = [[p.numel() for p in layer.parameter_list()] for layer in model.layers]
    assert sizes == [[scaled_elements(b, 2) for b in layer.param_bytes] for layer in TINY.layers]
    assert sizes[2] == [500, 1]  # 4000 / 4 / 2 and the floor of one element
    order: list[str] = []
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    elapsed: list[float] = []
    before = model.device.stats()

    def one_step() -> None:  # a fresh thread: the device's launch clock starts at its first wait
        start = time.perf_counter()
        model(torch.zeros(1)).sum().backward()
        elapsed.append(time.perf_counter() - start)

    thread = threading.Thread(target=one_step)
    thread.start()
    thread.join()
    assert [n.split(".")[1] for n in order] == ["2", "2", "1", "1", "0"]
    for k, layer in enumerate(model.layers):
        for param in layer.parameter_list():
            assert torch.equal(param.grad, torch.full_like(param, gradient_fill(k, 0)))
    after = model.device.stats()
    assert after["busy_s"] - before["busy_s"] == pytest.approx(TINY.compute_s, rel=1e-9)
    assert after["waits"] - before["waits"] == 6
    assert elapsed[0] >= TINY.compute_s  # the device never shortens a wait


# TINY whose first tensor is an embedding table of 64 rows x 64 (a batch looks up a quarter of them)
TINY_TABLE = ModelProfile(
    "tiny-table",
    (
        LayerProfile("embed", 0.0005, 0.0010, (16384,), RowSparseTable(64, 0.25)),
        *TINY.layers[1:],
    ),
    batch_size=4,
    source="recorded",
)


def test_a_table_is_an_embedding_whose_gradient_holds_the_rows_a_batch_looked_up(monkeypatch):
    """A profile's embedding table is an `nn.Embedding` of its rows / the byte scale, its row width
    the profile's, and each backward's gradient is non-zero in the profile's share of the rows (the
    common ones first, the rest drawn per batch): what the scheduler reduces row-sparse."""
    from autobyte.scheduler import sparse_rows

    positions = RowSparseTable(8, 0.5, overlap=1.0)  # the same 4 rows on every rank and batch
    profile = ModelProfile(
        "tables",
        (
            *TINY_TABLE.layers,
            LayerProfile("pos", 0.0005, 0.0005, (8 * 64 * 4,), positions),
        ),
        batch_size=4,
        source="recorded",
    )
    model = EmulatedModel(profile, byte_scale=2)
    tables = [layer for layer in model.layers if isinstance(layer, EmulatedTable)]
    assert [t.weight.shape for t in tables] == [(32, 64), (4, 64)]
    assert all(not isinstance(layer, EmulatedTable) for layer in model.layers[1:3])
    drawn = []
    for _ in range(3):
        model.zero_grad()
        model(torch.zeros(1)).sum().backward()
        table, pos = (t.weight.grad for t in tables)
        rows = table.ne(0).any(dim=1).nonzero().squeeze(1)
        assert len(rows) == 8 and torch.equal(table[rows], torch.full((8, 64), gradient_fill(0, 0)))
        drawn.append(rows.tolist())
        assert pos.ne(0).any(dim=1).tolist() == [True, True, False, False]
    assert len({tuple(r) for r in drawn}) == 3  # another batch, other rows
    monkeypatch.setenv(sparse_rows.MIN_BYTES_ENV, "0")
    params = list(model.parameters())
    assert [params[i] for i in sparse_rows.eligible(model, params)] == [t.weight for t in tables]


def test_the_builder_loads_the_simulators_profiles_scaled():
    workload = build_emulated("resnet50", compute_scale=50, byte_scale=16)
    profile = load_profile("resnet50").scaled(50)
    assert workload.model.profile.compute_s == pytest.approx(profile.compute_s)
    assert workload.gradient_bytes == sum(
        4 * scaled_elements(b, 16) for layer in profile.layers for b in layer.param_bytes
    )
    gpt2 = load_profile("gpt2")
    assert 124e6 < gpt2.total_param_bytes / 4 < 125e6 and gpt2.layers[0].name == "wte"
    with pytest.raises(ValueError, match="byte_scale"):
        build_emulated("resnet50", byte_scale=0.5)


@pytest.mark.parametrize("ranks, byte_scale", [(2, 16), (4, 16), (8, 32)])
def test_emulated_scenarios_select_the_mode_profile_scale_and_ranks(ranks, byte_scale):
    scenario = load_scenario(ROOT / "benchmarks" / "scenarios" / f"emulated-resnet50-{ranks}w.toml")
    workload = scenario.testbed_workload()
    assert (workload.model, workload.workers, scenario.byte_scale) == (
        "emulated",
        ranks,
        byte_scale,
    )
    assert workload.model_args["profile"] == "resnet50"
    built = build_emulated(**workload.model_args)
    assert built.model.profile.compute_s == pytest.approx(scenario.profile.compute_s)
    first = scenario.testbed_trace(10.0).changes[0]
    assert first.rate_bps == pytest.approx(scenario.bandwidth.at(0.0) * 8 / byte_scale, rel=0.01)
    assert (
        wire.wire_label("sched:4MiB,16MiB", byte_scale)
        == f"sched:{(4 << 20) // byte_scale},{(16 << 20) // byte_scale}"
    )
    assert wire.wire_label("ddp:25MiB", byte_scale) == f"ddp:{(25 << 20) // byte_scale}"
    assert wire.wire_label("py:none,64KiB", byte_scale) == "py:none,4096"  # the floor


@pytest.mark.parametrize(
    "line, message", [("byte_scale = 0.5", "byte_scale"), ('mode = "gpu"', "mode")]
)
def test_bad_emulated_settings_name_the_key(tmp_path, line, message):
    path = tmp_path / "bad.toml"
    path.write_text(
        textwrap.dedent(f"""
        model = "resnet50"
        workers = 2
        duration_steps = 10
        [bandwidth]
        kind = "constant"
        value = 5
        [testbed]
        {line}
    """)
    )
    with pytest.raises(ValueError, match=message):
        load_scenario(path)


def _tiny_scenario(tmp_path, workers: int, conditions: str = "", profile=None):
    profile = profile or TINY
    profile.save(tmp_path / f"{profile.name}.profile.json")
    path = tmp_path / "tiny.toml"
    path.write_text(
        textwrap.dedent(f"""
        model = "{profile.name}.profile.json"
        workers = {workers}
        duration_steps = 10
        [bandwidth]
        kind = "constant"
        value = 0.5
        [testbed]
        mode = "emulated"
        byte_scale = 2
    """)
        + textwrap.dedent(conditions)
    )
    return load_scenario(path)


def test_rates_are_multiples_of_the_balanced_rate_and_conditions_scale_with_them():
    from benchmarks.testbed.traces import FlowChange, RateChange

    scenarios = ROOT / "benchmarks" / "scenarios"
    straggler = load_scenario(scenarios / "emulated-resnet50-4w-straggler.toml")
    profile = straggler.profile
    balanced = bench_emulated.balanced_rate_gbit(profile, 4)
    # at the balanced rate a ring all-reduce of all gradients (1.5x them on a link) takes the compute
    assert 1.5 * profile.total_param_bytes / (balanced * GBIT) == pytest.approx(profile.compute_s)
    assert bench_emulated.parse_rates("0.5x,2x,3", profile, 4, 7.5) == pytest.approx(
        [balanced / 2, balanced * 2, 3.0]
    )
    assert bench_emulated.parse_rates("", profile, 4, 7.5) == [7.5]
    for bad in ("fast", "0x", "-1"):
        with pytest.raises(ValueError, match="--rates"):
            bench_emulated.parse_rates(bad, profile, 4, 7.5)
    # twice the scenario's rate: every link at 15 Gbit/s of model bytes, rank 1's at half of it
    trace = bench_emulated.block_trace(bench_emulated.scenario_at_rate(straggler, 15.0), 10.0)
    rates = {c.ranks: c.rate_bps for c in trace.changes if isinstance(c, RateChange)}
    assert rates == {
        None: round(15 * GBIT * 8 / 16 / 1e6) * 10**6,  # whole Mbit/s
        (1,): round(7.5 * GBIT * 8 / 16 / 1e6) * 10**6,
    }
    flows = load_scenario(scenarios / "emulated-resnet50-4w-flows.toml")
    changes = bench_emulated.block_trace(flows, 10.0).changes
    assert [(c.ranks, c.flows) for c in changes if isinstance(c, FlowChange)] == [((1,), 1)]
    assert not bench_emulated.rate_changes(flows)
    changing = load_scenario(scenarios / "emulated-resnet50-4w-rate-changes.toml")
    assert bench_emulated.rate_changes(changing)
    assert len({c.rate_bps for c in bench_emulated.block_trace(changing, 4.0).changes}) == 2
    assert (
        bench_emulated.block_trace(load_scenario(scenarios / "emulated-resnet50-4w.toml"), 10.0)
        is None
    )


def test_the_simulator_comparison_scores_a_block_against_its_own_predictions():
    """A block whose measurements are the scenario's simulator's own steps (and whose probes are its
    compute and bare all-reduce) scores no error and tau 1 both ways; a grid measured in reverse order
    scores tau -1."""
    from benchmarks import sim_vs_emulated

    scenario = load_scenario(ROOT / "benchmarks" / "scenarios" / "emulated-resnet50-2w.toml")
    labels = ["ddp:25MiB", "ddp:5MiB", "sched:4MiB,16MiB", "sched:1MiB,4MiB", "sched:none,none"]
    rate = 3.0
    block = {
        "ranks": 2,
        "rate_gbit": rate,
        "rows": [],
        "compute_s": scenario.profile.compute_s,
        "comm_s": scenario.profile.total_param_bytes / (rate * GBIT),
    }
    sim = sim_vs_emulated.block_simulator(scenario, block, "scenario")
    steps = [
        sim_vs_emulated.simulated_step_s(sim, sim_vs_emulated.simulator_config(label), False)
        for label in labels
    ]
    assert len(set(steps)) == len(steps)  # the grid's configurations differ in the simulator
    block["rows"] = [
        {"config": label, "step_s": step, "cpu_limited": []} for label, step in zip(labels, steps)
    ]
    result = sim_vs_emulated.compare_block(scenario, block)
    for variant in ("scenario", "probes"):
        assert result[variant]["median_abs_error"] == pytest.approx(0.0, abs=1e-9)
        assert result[variant]["kendall_tau"] == pytest.approx(1.0)
    # gloo's per-collective cost on this host only adds time to what the NCCL-like link predicts
    assert all(error >= 0 for error in result["gloo"]["errors"].values())
    assert result["gloo"]["errors"]["sched:1MiB,4MiB"] > 0
    for row in block["rows"]:  # a second round 10% slower: the testbed repeats its order
        row["round_steps_s"] = [row["step_s"], 1.1 * row["step_s"]]
    floor = sim_vs_emulated.compare_block(scenario, block)["noise_floor"]
    assert floor["median_abs_difference"] == pytest.approx(0.1) and floor[
        "kendall_tau"
    ] == pytest.approx(1.0)
    order = sorted(steps)
    for row in block["rows"]:  # the fastest measured slowest and so on
        row["step_s"] = order[len(order) - 1 - order.index(row["step_s"])]
    assert sim_vs_emulated.compare_block(scenario, block)["scenario"][
        "kendall_tau"
    ] == pytest.approx(-1.0)
    assert "tau" in sim_vs_emulated.format_comparison([result])
    with pytest.raises(ValueError, match="no configuration"):
        sim_vs_emulated.simulator_config("comm")


def test_the_simulator_at_n_ranks_takes_the_per_collective_cost_measured_at_n(tmp_path):
    """The gloo_n variant charges each collective the latency measured at the block's rank count
    (with the credit window in flight where measured); a rank count never measured is an error
    naming the command that measures it; the derived start's row is simulated at its sizes."""
    import json

    from autobyte.types import Config

    from benchmarks import sim_vs_emulated
    from simulator import links

    table = tmp_path / "collective.json"
    table.write_text(
        json.dumps(
            {
                "ranks": {
                    "2": {"1": {"latency_s": 0.004}, "4": {"latency_s": 0.002}},
                    "8": {"1": {"latency_s": 0.03}},
                }
            }
        )
    )
    assert links.collective_cost_s(2, table) == 0.002
    assert links.collective_cost_s(8, table) == 0.03
    with pytest.raises(ValueError, match="no measurement at 4 ranks.*bench_collective --ranks 4"):
        links.collective_cost_s(4, table)
    shipped = links.collective_cost_s(8)  # the checked-in calibration has 2, 4 and 8
    assert shipped > links.collective_cost_s(2) > 0
    scenario = load_scenario(ROOT / "benchmarks" / "scenarios" / "emulated-gpt2-medium-8w.toml")
    block = {"ranks": 8, "rate_gbit": 13.2, "compute_s": 1.5, "comm_s": 1.5, "rows": []}
    gloo = sim_vs_emulated.block_simulator(scenario, block, "gloo")
    per_n = sim_vs_emulated.block_simulator(scenario, block, "gloo_n")
    assert per_n.link.collective_overhead_s == shipped != gloo.link.collective_overhead_s
    row = {"config": "sched:auto", "derived_wire_bytes": [1 << 18, 1 << 20]}
    assert sim_vs_emulated.row_config(row, 128) == Config(32 << 20, 128 << 20)
    with pytest.raises(ValueError, match="derived sizes"):
        sim_vs_emulated.simulator_config("sched:auto")


def test_the_simulator_past_this_host_plans_the_default_the_grid_and_ddp(capsys):
    """benchmarks.sim_at_scale: at each rank count and rate every configuration is at or above the
    bound, the bests are the minima of their grids, the default is what the scheduler derives
    from the link's costs; bad arguments exit with a message naming them."""
    from autobyte.scheduler.start import CollectiveCost, derive

    from benchmarks import sim_at_scale

    scenario = load_scenario(ROOT / "benchmarks" / "scenarios" / "emulated-gpt2-medium-8w.toml")
    ddp_grid, partitions = [5 << 20, 25 << 20], [4 << 20, 16 << 20, 64 << 20]
    result = sim_at_scale.block(scenario, 32, 1.0, ddp_grid, partitions)
    steps = [*result["ddp_s"].values(), *result["grid_s"].values(), result["default_s"]]
    assert min(steps) >= result["bound_s"] * 0.999
    # a free link takes away only the per-collective costs: the dependency bound lies between
    assert result["bound_s"] * 0.999 <= result["dependency_bound_s"] <= result["grid_best_s"]
    assert result["ddp_best_s"] == min(result["ddp_s"].values()) <= result["ddp_default_s"]
    assert result["grid_best_s"] == min(result["grid_s"].values())
    link = scenario.link
    bandwidth = result["rate_gbit"] * GBIT
    expected = derive(
        scenario.profile.total_param_bytes,
        CollectiveCost(link.fixed_s(32) + link.launch_s, 62 / 32 / bandwidth),
    )
    assert (result["default_partition"], result["default_credit"]) == (
        expected.partition_bytes,
        expected.credit_bytes,
    )
    path = str(ROOT / "benchmarks" / "scenarios" / "emulated-gpt2-medium-8w.toml")
    assert sim_at_scale.main([path, "--ranks", "16", "--rates", "1x", "--partitions", "8MiB"]) == 0
    assert "gpt2-medium" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--rates 'fast'"):
        sim_at_scale.main([path, "--rates", "fast"])
    with pytest.raises(SystemExit, match="--partitions"):
        sim_at_scale.main([path, "--partitions", "0"])


def needs_netns(test):
    """Ranks in the testbed's namespaces (the harness's code, which the markers' static reach does
    not follow): marked here; they need root and iproute2."""
    for mark in (
        pytest.mark.netns,
        pytest.mark.multiprocess,
        pytest.mark.slow,
        pytest.mark.skipif(
            os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
            reason="builds network namespaces: needs root and iproute2",
        ),
    ):
        test = mark(test)
    return test


def test_an_emulated_links_burst_is_one_kernel_tick_of_its_highest_rate():
    from benchmarks.testbed import DEFAULT_BURST_BYTES, burst_for

    # one tick (250 Hz) of the rate, never below one 64 KiB GSO packet
    assert burst_for(10**9) == 500_000
    assert burst_for(59 * 10**6) == 64 << 10
    for bad in (0, -1):
        with pytest.raises(ValueError, match="rate_bps"):
            burst_for(bad)
    scenarios = ROOT / "benchmarks" / "scenarios"
    steady = load_scenario(scenarios / "emulated-resnet50-4w.toml")  # 7.5 Gbit/s, bytes / 16
    assert steady.testbed_burst() == burst_for(int(7.5e9 / 16))
    # a rate that changes: the burst keeps its highest (tbf's burst stays fixed on the testbed)
    swing = load_scenario(scenarios / "emulated-resnet50-4w-rate-changes.toml")
    link = swing.link_bandwidth or swing.bandwidth
    assert len(set(link.values)) > 1
    assert swing.testbed_burst() == burst_for(int(max(link.values) / swing.byte_scale * 8))
    # twice the rate, twice the burst; a real-mode scenario keeps the testbed's default
    doubled = bench_emulated.scenario_at_rate(steady, 15.0)
    assert bench_emulated._burst(doubled) == burst_for(int(15e9 / 16))
    assert bench_emulated._burst(doubled, 4096) == 4096  # --burst
    real = load_scenario(scenarios / "resnet50-2w-step.toml")
    assert real.testbed_burst() is None and bench_emulated._burst(real) == DEFAULT_BURST_BYTES
    with pytest.raises(SystemExit, match="--burst"):
        bench_emulated.main([str(scenarios / "emulated-resnet50-4w.toml"), "--burst", "lots"])


@needs_netns
def test_emulated_ranks_run_ddp_the_scheduler_and_the_bound_on_the_testbed(tmp_path):
    scenario = _tiny_scenario(
        tmp_path,
        4,
        """
        [straggler]  # the testbed's trace puts it on rank 1
        kind = "constant"
        value = 0.25
    """,
    )
    # the scheduler on both hot paths (py: the Python one)
    labels = ["compute", "comm", "ddp:25MiB", "ddp:64KiB", "sched:4MiB,16MiB", "py:64KiB,256KiB"]
    block = bench_emulated.run_block(
        scenario, 4, 0.5, labels, rounds=1, steps=3, warmup=1, timeout_s=240
    )
    assert block["wire_rate_bps"] == int(0.5 * GBIT * 8 / 2)
    assert block["burst_bytes"] == scenario.testbed_burst()
    rows = {row["config"]: row for row in block["rows"]}
    assert list(rows) == labels
    for row in rows.values():
        assert row["rounds"] == 1 and row["step_s"] > 0
        assert len(row["busy_share"]) == 4 and all(0 < b < 4 for b in row["busy_share"])
        assert all(b >= 0 for b in row["backend_cpu_s_per_step"])
        # The device gave exactly the profile's compute per step, whatever else ran (none to the
        # bare all-reduce).
        expected = 0.0 if row["config"] == "comm" else TINY.compute_s
        assert row["device_busy_s"] == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert rows["ddp:64KiB"]["wire"] == "ddp:32768"
    assert rows["py:64KiB,256KiB"]["wire"] == "py:32768,131072"
    assert rows["py:64KiB,256KiB"]["hot_path"] == "python"
    assert rows["sched:4MiB,16MiB"]["hot_path"] == "native"  # the worktree's built _native
    assert block["bound_s"] == max(rows["compute"]["step_s"], rows["comm"]["step_s"])
    assert rows["sched:4MiB,16MiB"]["exposed_comm_s"] is not None
    applied = {tuple(c["ranks"] or ()): c["rate_bps"] for c in block["rate_changes"]["first"]}
    assert applied == {(): int(0.5 * GBIT * 8 / 2), (1,): int(0.25 * GBIT * 8 / 2)}
    assert "straggler" in block["conditions"]
    text = bench_emulated.format_block(block, "EMULATED arithmetic: tiny")
    assert "EMULATED" in text and "x bound" in text and "straggler" in text
    assert f"tbf burst {block['burst_bytes'] / 1024:.0f} KiB" in text


@needs_netns
def test_the_compute_check_runs_one_rank_without_communication(tmp_path):
    scenario = _tiny_scenario(tmp_path, 2)
    block = bench_emulated.check_compute(scenario, rounds=1, steps=3, warmup=1, timeout_s=180)
    assert block["ranks"] == 1 and block["comm_s"] is None
    compute = next(row for row in block["rows"] if row["config"] == "compute")
    assert compute["device_busy_s"] == pytest.approx(TINY.compute_s, rel=1e-6)
    assert math.isfinite(compute["x_profile"]) and isinstance(compute["within_tolerance"], bool)


def test_sizes_cross_the_byte_scale_both_ways():
    """What evaluate --testbed and bench_emulated hand the ranks (the model's sizes / the scale)
    and read back from them (x the scale); DDP's default bucket is the model's 25 MiB, scaled."""
    from benchmarks.testbed.wire import model_label, wire_run_label

    assert wire_run_label("sched:16MiB,64MiB", 128) == "sched:131072,524288"
    assert model_label("sched:131072,524288", 128) == "sched:16MiB,64MiB"
    assert wire_run_label("ddp", 128) == "ddp:204800" and model_label("ddp:204800", 128) == "ddp"
    assert model_label(wire_run_label("sched:none,none", 64), 64) == "sched:none,none"
    assert model_label(wire_run_label("sched:1MiB,4MiB,8MiB", 16), 16) == "sched:1MiB,4MiB,8MiB"
    # byte scale 1: labels as they are
    assert wire_run_label("ddp", 1.0) == "ddp" == model_label("ddp", 1.0)
    # a loop that clips keeps its modifier both ways
    assert wire_run_label("ddp+clip", 128) == "ddp:204800+clip"
    assert model_label("sched:131072,524288+clip", 128) == "sched:16MiB,64MiB+clip"
    assert wire_run_label("sched:auto+clip", 128) == "sched:auto+clip"


@pytest.mark.parametrize("label", ["comm+clip", "sched:auto+clip2", "lat+clip"])
def test_a_modifier_other_than_clip_on_a_training_loop_is_refused(label):
    from benchmarks.testbed.train_worker import RunConfig

    with pytest.raises(ValueError, match="the only modifier is \\+clip"):
        RunConfig.parse(label)


@needs_netns
def test_the_scheduler_trains_an_emulated_model_to_ddps_bits_at_two_ranks(tmp_path):
    """Both hot paths and DDP from the same start with the emulated gradients (a different fill
    on each rank): after the same steps every replica on every rank holds the same parameters;
    then three more steps each in a loop that clips (`+clip`: clip_grad_norm_ between backward and
    step, on the scheduler a read of the reduced gradients), again the same everywhere. Two fresh
    DDP replicas, one clipping, show that the clip changed the parameters."""
    from benchmarks.testbed import Testbed

    scenario = _tiny_scenario(tmp_path, 2, profile=TINY_TABLE)
    plain = ["ddp", "sched:4096,16384", "py:4096,16384"]
    clipped = ["ddp+clip", "sched:4096,16384+clip", "py:4096,16384+clip"]
    labels = [*plain, *clipped, "ddp:64KiB", "ddp:32KiB+clip"]
    command = worker_cli.command(
        *scenario.testbed_workload().worker_args(),
        configs=labels,
        steps=3,
        warmup=0,
        param_digest=True,
    )
    with Testbed(world_size=2, rate="200mbit") as bed:  # the table reduced row-sparse, too
        result = bed.run(command, cwd=str(ROOT), timeout_s=180, env=SPARSE_ROWS_EVERYWHERE)
    digests = {
        (rank.rank, r["config"]): r["param_digest"] for rank in result.ranks for r in rank.results
    }
    assert len(digests) == 2 * len(labels), digests
    digests = {(rank, RunConfig.parse(label).label): d for (rank, label), d in digests.items()}
    for group in (plain, clipped):
        keys = [(rank, RunConfig.parse(label).label) for rank in (0, 1) for label in group]
        assert len({digests[key] for key in keys}) == 1, digests
    assert digests[0, "ddp:64KiB"] == digests[0, "ddp"]  # a fresh replica, three plain steps
    assert digests[0, "ddp:32KiB+clip"] != digests[0, "ddp"]  # the clip changed them
    start = EmulatedModel(TINY_TABLE, byte_scale=2)  # every parameter zero: training did move them
    assert _param_digest(start) not in digests.values()
    # and the scheduler sent the table's rows packed: fewer bytes than every gradient dense
    dense = sum(p.numel() * p.element_size() for p in start.parameters())
    for rank in result.ranks:
        for row in rank.results:
            if row["kind"] in ("sched", "py"):
                assert row["metrics_median"]["bytes_reduced"] < dense - 2048, row


# Two transformer blocks (h.0, h.1) between an embedding and a final norm: FSDP2 rows group them
TINY_GPT = ModelProfile(
    "tiny-gpt",
    (
        LayerProfile("wte", 0.0005, 0.0010, (16384,)),
        LayerProfile("h.0.attn", 0.0010, 0.0015, (12288, 4096)),
        LayerProfile("h.0.mlp", 0.0010, 0.0015, (16384, 4096)),
        LayerProfile("h.1.attn", 0.0010, 0.0015, (12288, 4096)),
        LayerProfile("h.1.mlp", 0.0010, 0.0015, (16384, 4096)),
        LayerProfile("ln_f", 0.0005, 0.0005, (4096, 4096)),
    ),
    batch_size=4,
    source="recorded",
)


def test_fsdp2_labels_name_its_knobs_and_a_bad_one_is_refused():
    from benchmarks.testbed.fsdp_replica import block_of, shard_config

    assert RunConfig.parse("fsdp").label == "fsdp"
    assert RunConfig.parse("FSDP:1,2,keep").label == "fsdp:1,2,keep"
    assert RunConfig.parse("fsdp:daemon").shard == "daemon"
    config = shard_config("2,=,keep")
    assert (config.forward_prefetch, config.backward_prefetch) == (2, None)
    assert config.reshard_after_forward is False
    # `,sync`: the same knobs, FSDP2's own all-gathers (the replica's switch, not the config's)
    assert shard_config("2,=,keep,sync") == config
    assert RunConfig.parse("fsdp:2,=,keep,sync").label == "fsdp:2,=,keep,sync"
    for bad in ("fsdp:1,2", "fsdp:1,2,maybe", "fsdp:x,1,keep", "fsdp:1,1,keep,async"):
        with pytest.raises(ValueError, match="bad FSDP2 configuration"):
            RunConfig.parse(bad)
    assert block_of("h.3.attn.c_attn") == "h.3" and block_of("wte") is None
    assert wire.wire_run_label("fsdp:1,1,keep", 128) == "fsdp:1,1,keep"


@needs_netns
def test_a_long_run_under_a_changing_rate_reports_its_mean_step_per_rate():
    """bench_emulated --fsdp-tuned/--fsdp-held under the swing trace: each step counted at the rate
    when it began (the run starts at the trace's start)."""
    swing = load_scenario(ROOT / "benchmarks" / "scenarios" / "emulated-gpt2-medium-4w-swing.toml")
    assert bench_emulated.rate_changes(swing)
    # 26.4 Gbit/s for the first 60 s (30 steps of 2 s), then 6.6 (5 of 4 s, 2 of 1 s), then 26.4
    times = [2.0] * 30 + [4.0] * 5 + [1.0] * 2 + [40.0] + [3.0]  # the 40 s step ends at 122 s
    assert bench_emulated.mean_by_rate(times, swing) == pytest.approx(
        {"26.4": (2.0 * 30 + 3.0) / 31, "6.6": (4.0 * 5 + 1.0 * 2 + 40.0) / 8}
    )


def test_fsdp2_rows_run_its_defaults_a_grid_and_the_bound_on_the_testbed(tmp_path):
    """Per-block FSDP2 groups on emulated ranks: each configuration is in effect on every rank
    after its warm-up (the worker checks, else the run fails), the bound's communication is the
    all-gather + reduce-scatter probe, and the columns are against FSDP2's defaults."""
    scenario = _tiny_scenario(tmp_path, 2, profile=TINY_GPT)
    labels = bench_emulated.fsdp_labels(["fsdp:1,1,keep", "fsdp:2,2,reshard,sync"])
    block = bench_emulated.run_block(
        scenario, 2, 0.5, labels, rounds=1, steps=2, warmup=3, timeout_s=240
    )
    rows = {row["config"]: row for row in block["rows"]}
    assert list(rows) == ["compute", "agrs", "fsdp", "fsdp:1,1,keep", "fsdp:2,2,reshard,sync"]
    assert all(row["step_s"] > 0 for row in rows.values())
    # each FSDP2 row: the training thread's time in its all-gathers and reduce-scatters, measured
    for label in ("fsdp", "fsdp:1,1,keep", "fsdp:2,2,reshard,sync"):
        row = rows[label]
        assert row["all_gather_s"] > 0 and row["reduce_scatter_s"] > 0, row
        assert 0 < row["exposed_comm_s"] < row["step_s"], row
    assert block["engine"] == "fsdp2" and block["comm_s"] == rows["agrs"]["step_s"]
    assert block["ddp_default_s"] == rows["fsdp"]["step_s"]  # the /FSDP column's reference
    assert rows["fsdp"]["speedup_vs_ddp_default"] == pytest.approx(1.0)
    text = bench_emulated.format_block(block, "EMULATED arithmetic: tiny-gpt")
    assert "/FSDP" in text and "all-gather + reduce-scatter" in text
