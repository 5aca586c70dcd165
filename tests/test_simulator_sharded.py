"""FSDP2's schedule in the simulator (autobyted/tuner/shard_schedule.py) and its check against the testbed
(benchmarks/sim_vs_fsdp.py)."""

from __future__ import annotations

import json

import pytest

from autobyted.tuner.shard_schedule import ShardedModel, ShardGroup, ShardLink, simulate_step
from benchmarks import sim_vs_fsdp
from simulator.profiles import BUILTIN_PROFILES, LayerProfile, ModelProfile

MB = 1_000_000


def _model(groups: int = 2, root_bytes: int = 0) -> ShardedModel:
    """`groups` equal groups of 10 MB, 10 ms forward and 20 ms backward each."""
    return ShardedModel(
        tuple(ShardGroup(f"h.{i}", 10 * MB, 0.010, 0.020) for i in range(groups)),
        root_bytes,
        (0.0, 0.0),
        (0.0, 0.0),
    )


def test_a_profile_is_grouped_by_transformer_block_around_its_root():
    profile = BUILTIN_PROFILES["gpt2-medium"]()
    model = ShardedModel.from_profile(profile)
    assert [g.name for g in model.groups] == [f"h.{i}" for i in range(24)]
    by_name = {layer.name: layer for layer in profile.layers}
    root = ("wte", "wpe", "ln_f")
    assert model.root_bytes == sum(by_name[n].total_param_bytes for n in root)
    assert model.root_bytes + sum(g.param_bytes for g in model.groups) == profile.total_param_bytes
    assert model.compute_s == pytest.approx(profile.compute_s)
    # the LM head is charged to ln_f: the root's compute after the blocks
    assert model.root_forward_s[1] == pytest.approx(by_name["ln_f"].forward_s)
    assert model.scaled(2.0).compute_s == pytest.approx(2 * profile.compute_s)
    flat = ModelProfile("mlp", (LayerProfile("fc1", 0.01, 0.02, (4096,)),))
    with pytest.raises(ValueError, match="no transformer blocks"):
        ShardedModel.from_profile(flat)


def test_the_schedule_of_two_groups_by_hand():
    model = _model(2)
    # 2 ranks at 10 MB/s: an all-gather moves 5 MB (0.5 s), gloo's reduce-scatter twice that
    gloo = ShardLink(10 * MB, 2, rs_factor=2.0, sync_all_gathers=True)
    step = simulate_step(model, gloo)
    # forward: gather 0, compute, gather 1, compute; backward: gather 1 again (resharded), which
    # prefetches 0 (both hold the thread), compute 1, reduce-scatter 1, compute 0, reduce-scatter 0
    assert step.all_gathers == 4
    assert step.all_gather_wait_s == pytest.approx(4 * 0.5)
    assert step.reduce_scatter_wait_s == pytest.approx(2 * 1.0)
    assert step.step_s == pytest.approx(4 * 0.5 + 2 * 1.0 + 2 * 0.010 + 2 * 0.020)
    # keeping the gathered parameters: no all-gather in backward
    kept = simulate_step(model, gloo, reshard_after_forward=False)
    assert kept.all_gathers == 2
    assert kept.step_s == pytest.approx(step.step_s - 2 * 0.5)
    # per group: only group 0 kept
    one = simulate_step(model, gloo, reshard_after_forward=[False, None])
    assert one.all_gathers == 3
    with pytest.raises(ValueError, match="the model has 2"):
        simulate_step(model, gloo, reshard_after_forward=[False])


def test_prefetch_overlaps_only_where_the_all_gathers_leave_the_thread():
    model = _model(8)
    # the link about as fast as compute: a group's all-gather 10 ms beside 10 ms of forward
    rate = 10 * MB / 2 / 0.010
    sync = ShardLink(rate, 2, sync_all_gathers=True)
    asynchronous = ShardLink(rate, 2, sync_all_gathers=False)
    for link in (sync, asynchronous):
        assert simulate_step(model, link, 0, 0, False).step_s == pytest.approx(
            8 * 0.010 + 8 * 0.010 + 8 * 0.020 + 8 * 0.010  # gathers, forward, backward, RS
        )
    # held by the thread, a prefetched all-gather is waited where it is issued: nothing gained
    assert simulate_step(model, sync, 1, 0, False).step_s == pytest.approx(
        simulate_step(model, sync, 0, 0, False).step_s
    )
    # issued asynchronously it runs under the compute before it: 7 of 8 gathers hidden
    ahead = simulate_step(model, asynchronous, 1, 0, False)
    assert ahead.step_s == pytest.approx(simulate_step(model, sync, 0, 0, False).step_s - 7 * 0.010)
    assert ahead.all_gather_wait_s == pytest.approx(0.010)
    # a reduce-scatter on a stream (a GPU's) overlaps the backward: the last one ends the step
    stream = ShardLink(rate, 2, sync_reduce_scatters=False)
    overlapped = simulate_step(model, stream, 1, 1, False)
    assert overlapped.reduce_scatter_wait_s == 0.0
    assert overlapped.step_s == pytest.approx(0.010 + 8 * 0.010 + 8 * 0.020 + 0.010)


def test_a_free_link_leaves_the_compute_and_bad_settings_are_refused():
    model = _model(4, root_bytes=5 * MB)
    free = ShardLink(1e30, 4)
    for knobs in ((None, None, None), (3, 3, False), (0, 0, True)):
        assert simulate_step(model, free, *knobs).step_s == pytest.approx(4 * 0.030)
    with pytest.raises(ValueError, match="bytes_per_s"):
        ShardLink(0.0, 2)
    with pytest.raises(ValueError, match="workers"):
        ShardLink(1e9, 1)
    with pytest.raises(ValueError, match="prefetch"):
        simulate_step(model, free, -1, None, None)
    # a collective's fixed cost and its bytes' time: added, or the larger where they overlap
    slow = ShardLink(10 * MB, 2, fixed_s=0.2)
    assert slow.all_gather_s(10 * MB) == pytest.approx(0.7)
    overlapping = ShardLink(10 * MB, 2, fixed_s=0.2, rs_factor=2.0, fixed_overlaps_wire=True)
    assert overlapping.all_gather_s(10 * MB) == pytest.approx(0.5)
    assert overlapping.reduce_scatter_s(10 * MB) == pytest.approx(1.0)
    assert overlapping.all_gather_s(1) == pytest.approx(0.2)


def test_the_comparison_reads_bench_emulated_labels_and_the_tuners_decisions(tmp_path):
    assert sim_vs_fsdp.knobs("fsdp") == (None, None, None, True)
    assert sim_vs_fsdp.knobs("fsdp:2,1,keep") == (2, 1, False, False)
    assert sim_vs_fsdp.knobs("fsdp:=,=,reshard,sync") == (None, None, True, True)
    assert sim_vs_fsdp.tuner_knobs("prefetch 1/= keep") == (1, None, False)
    assert sim_vs_fsdp.tuner_knobs("prefetch =/2") == (None, 2, None)
    with pytest.raises(ValueError, match="FSDP2 configuration"):
        sim_vs_fsdp.tuner_knobs("none/inf")
    # a block whose steps are the simulator's own: no error, the order kept
    model = ShardedModel.from_profile(BUILTIN_PROFILES["gpt2-medium"]())
    labels = ["fsdp", "fsdp:=,=,keep", "fsdp:2,2,keep"]
    rows = [{"config": "compute", "step_s": model.compute_s}]
    block = {
        "engine": "fsdp2",
        "ranks": 2,
        "rate_gbit": 7.57,
        "wire_rate_bps": int(7.57e9 / 128),
        "burst_bytes": 64 << 10,
        "compute_s": model.compute_s,
        "rows": rows,
    }
    first = sim_vs_fsdp.compare_block(block, model, [])
    assert first["rows"] == [] and first["median_abs_error"] is None
    measured = {
        label: step["simulated_s"]
        for label, step in zip(
            labels,
            sim_vs_fsdp.compare_block(
                {**block, "rows": [{"config": label, "step_s": 1.0} for label in labels]},
                model,
                [],
            )["rows"],
        )
    }
    rows += [{"config": label, "step_s": measured[label]} for label in labels]
    result = sim_vs_fsdp.compare_block(block, model, [])
    assert [r["config"] for r in result["rows"]] == labels
    assert result["median_abs_error"] == pytest.approx(0.0, abs=1e-12)
    assert result["tau"] == pytest.approx(1.0)
    assert not result["kinder_link"]
    # the fixed cost overlapping the bytes' time: never slower than added to it
    assert all(r["overlapped_s"] <= r["simulated_s"] for r in result["rows"])
    assert result["overlapped_median_abs_error"] > 0
    # FSDP2's defaults gather twice and hold the thread: the slowest of the three
    assert measured["fsdp"] > measured["fsdp:=,=,keep"] > measured["fsdp:2,2,keep"]
    assert sim_vs_fsdp.compare_block({**block, "burst_bytes": 512 << 10}, model, [])["kinder_link"]
    # the tool: a results file without an FSDP2 block is refused by name
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps({"scenario": "x.toml", "blocks": []}))
    with pytest.raises(SystemExit, match="ddp.json"):
        sim_vs_fsdp.main([str(path)])
