"""Calibrate the simulator against the optimum map: per condition, does it rank the grid like the
testbed, is its best configuration the testbed's, and does it predict the headroom of re-tuning?

    python -m benchmarks.calibrate --map benchmarks/calibration/optimum-map.json \\
        [--profiles benchmarks/calibration/profiles] [--out benchmarks/calibration/map.report.json]

For every block of the map (one model under one condition, every grid configuration measured on
the testbed) the simulator predicts every configuration's settled step time, in two ways:

- **probes**: from the block's own probes, measured beside the grid in the same run: compute = the
  slowest rank's `compute` probe (as a CPU share: quiet compute / this compute, so the
  communication's CPU load weighs more on a throttled rank); bandwidth = the `comm` probe's goodput;
  the cost of one collective by size = the `lat:SIZE` probes (4 KiB, 256 KiB, 2 MiB; beyond them
  the wire time at that goodput). This checks the simulator's mechanics (overlap, partitioning,
  credit, priority) given what the condition did to the link and the CPU.
- **model**: from the model's *quiet* block and the condition's description only, through the
  condition model the scenario keys use (`benchmarks/harness/scenario.py`): a CPU quota of S cores ->
  cpu share S; N busy processes beside R ranks on this 2-core machine -> share 2/(R+N) (pinned,
  one core per rank: 1/(1+N) on the busy rank's core); K
  competing flows -> the job keeps 1/(1+K) of the link and every collective pays K times the
  flow penalty by size (`flow_message_extra_s`, taken from the lat probes of the flow blocks of
  *all* models: their increase over the quiet blocks beyond the halved wire time); a straggler
  link -> the ring runs at the slower rate; N ranks -> N workers, share 2/N (oversubscribed cores).
  This checks the model of *why* each condition moves the optimum.

Constants shared by both: the scheduler's own cost per partition (`collective_overhead_s`, beyond a
bare collective: the dispatch probe's extra step time per extra partition minus a bare collective's
cost at its rate) and `launch_s` from the map's dispatch probe (or the checked-in testbed
calibration), `comm_cpu_s_per_byte` from the model's `rate=10gbit` comm probe (CPU-bound there). No
constant is fitted to the step times being predicted. Profiles (per-layer shares of compute) are
recorded here once per model and kept in --profiles, then rescaled to the probes.

Reported per block: Kendall tau-b between the measured and predicted step times of the grid (goal
>= 0.7), the regret = measured step time of the simulator's best / the measured best - 1 (goal
<= 3%), the median |error| of the step times; and per mixed trace (pairs of conditions of a model)
the headroom of the per-phase best over the best static configuration, measured (from the map)
vs predicted (goal within +-3 points).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks import optimum
from simulator.engine import LinkModel, Simulator
from simulator.profiles import ModelProfile
from simulator.trace import PiecewiseConstant

MBIT = 1e6 / 8
# Default scheduler cost per partition beyond a bare collective when the map has no dispatch probe:
# the checked-in testbed calibration (benchmarks/calibration/testbed.json: 1.35 ms extra step time
# per extra 16/64 KiB partition at 10gbit) minus a bare small collective there (~0.35 ms).
FALLBACK_OVERHEAD_S = 1.0e-3
FALLBACK_LAUNCH_S = 42e-6
HOST_CORES = 2


DENSE = (
    "+dense"  # a label suffix: embedding tables sent whole (ScheduledOptimizer sparse_rows=False)
)


@dataclasses.dataclass(frozen=True)
class BlockInputs:
    """What the simulator is told about one block."""

    profile: ModelProfile
    workers: int
    bandwidth_bytes_per_s: float
    link: LinkModel
    flows: float = 0.0
    cpu_share: float = 1.0
    notes: str = ""

    def simulator(self, row_sparse: bool = True) -> Simulator:
        return Simulator(
            self.profile,
            self.workers,
            PiecewiseConstant.constant(self.bandwidth_bytes_per_s),
            self.link,
            row_sparse=row_sparse,
        )

    def predict(self, labels: Sequence[str]) -> dict[str, float]:
        """The steady step of every label; one ending in DENSE is the configuration with embedding
        tables sent whole (benchmarks.profile_step's paired twin of the row-sparse default)."""
        from simulator.engine import parse_config

        sims = {True: self.simulator(), False: self.simulator(row_sparse=False)}
        return {
            label: sims[not label.endswith(DENSE)].steady_step_s(
                parse_config(label.removesuffix(DENSE)),
                self.bandwidth_bytes_per_s,
                1.0,
                self.flows,
                self.cpu_share,
                steps=8,
            )
            for label in labels
        }


# ---- inputs -----------------------------------------------------------------------------------


def _model_key(block: dict[str, Any]) -> str:
    return f"{block['model']}"


def profile_for_block(
    block: dict[str, Any], directory: pathlib.Path | None, cache: dict[str, ModelProfile]
) -> ModelProfile:
    """The model's per-layer profile: loaded from `directory` if recorded before, else recorded
    here (torch hooks, see record_profile) and saved there."""
    key = _model_key(block)
    if key in cache:
        return cache[key]
    path = directory / f"{key}.profile.json" if directory is not None else None
    if path is not None and path.exists():
        profile = ModelProfile.load(path)
    else:
        import torch

        from benchmarks.run_inputs import profile_for_run

        torch.set_num_threads(1)  # as the testbed's ranks train
        profile = profile_for_run(
            {
                "model": block["builder"],
                "model_args": block["model_args"],
                "batch_size": block["batch_size"],
            },
            pathlib.Path("."),
            {},
        )
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            profile.save(path)
    cache[key] = profile
    return profile


def _gradient_bytes(block: dict[str, Any], cache: dict[str, tuple[int, int]]) -> tuple[int, int]:
    key = _model_key(block)
    if key not in cache:
        from benchmarks.run_inputs import bench_buckets

        cache[key] = bench_buckets(block["builder"], block["model_args"])
    return cache[key]


def _with_compute(profile: ModelProfile, compute_with_optimizer_s: float) -> ModelProfile:
    """Rescale so that forward + backward + optimizer equals a compute probe (which includes the
    optimizer step), keeping the recorded share of the optimizer."""
    share = profile.optimizer_s / (profile.compute_s + profile.optimizer_s)
    return profile.with_compute_s(compute_with_optimizer_s * (1 - share))


def wire_factor(workers: int) -> float:
    return 2 * (workers - 1) / workers


def goodput(block: dict[str, Any], sizes: tuple[int, int], overhead_s: float = 0.0) -> float:
    """Bytes/s of the block's comm probe (bare all-reduces of all gradients, 25 MiB buckets)."""
    grad_bytes, buckets = sizes
    wire_s = block["probes"]["comm_s"] - buckets * overhead_s
    return grad_bytes * wire_factor(block["world_size"]) / wire_s


def message_table(
    block: dict[str, Any], bandwidth: float, key: str = "collective_s"
) -> tuple[tuple[float, float], ...]:
    """Per-collective cost beyond the wire time at `bandwidth`, at the probes' sizes (`key`:
    collective_s, bare; collective_busy_s, beside a compute step)."""
    factor = wire_factor(block["world_size"])
    return tuple(
        (float(size), max(0.0, cost - int(size) * factor / bandwidth))
        for size, cost in sorted(block["probes"][key].items(), key=lambda item: int(item[0]))
    )


def busy_bandwidth(block: dict[str, Any], bandwidth: float) -> float:
    """The link's goodput while the rank computes: from the slope between the two largest
    collectives beside compute (at most the bare comm probe's goodput)."""
    points = sorted(
        (int(size), cost) for size, cost in block["probes"]["collective_busy_s"].items()
    )
    (size_a, cost_a), (size_b, cost_b) = points[-2], points[-1]
    if cost_b <= cost_a:
        return bandwidth
    slope_bw = (size_b - size_a) * wire_factor(block["world_size"]) / (cost_b - cost_a)
    return min(bandwidth, slope_bw)


@dataclasses.dataclass(frozen=True)
class SharedConstants:
    overhead_s: float
    launch_s: float
    cpu_s_per_byte: dict[str, float]  # per model
    flow_message_extra_s: tuple[tuple[float, float], ...]
    sources: dict[str, str]


def shared_constants(
    blocks: Sequence[dict[str, Any]],
    dispatch: dict[str, Any] | None,
    sizes: dict[str, tuple[int, int]],
) -> SharedConstants:
    sources = {}
    overhead, launch = FALLBACK_OVERHEAD_S, FALLBACK_LAUNCH_S
    sources["overhead_s"] = "fallback: checked-in testbed calibration"
    if dispatch:
        extra = [
            row["external_us_per_extra_partition"]
            for row in dispatch["configs"].values()
            if row.get("external_us_per_extra_partition") is not None
        ]
        launches = [
            row["scheduler_us_per_partition"] + row["backend_launch_us_per_partition"]
            for row in dispatch["configs"].values()
        ]
        bare = dispatch.get("bare_collective_s")
        if extra and bare is not None:
            overhead = max(0.0, statistics.median(extra) * 1e-6 - bare)
            sources["overhead_s"] = (
                f"dispatch probe: {statistics.median(extra):.0f} us extra "
                f"step per extra partition - bare collective "
                f"{bare * 1e6:.0f} us"
            )
        if launches:
            launch = statistics.median(launches) * 1e-6
            sources["launch_s"] = "dispatch probe: scheduler + gloo launch per partition"
    cpu: dict[str, float] = {}
    for block in blocks:
        if block["condition"] == "rate=10gbit" and block["world_size"] == 2:
            grad_bytes, _buckets = sizes[_model_key(block)]
            wire_s = block["probes"]["comm_s"]
            if grad_bytes * 8 / wire_s < 0.95 * 10e9:  # CPU-bound, not held by tbf
                cpu[block["model"]] = wire_s / grad_bytes
    sources["cpu_s_per_byte"] = "per model: 1 / goodput of its rate=10gbit comm probe"
    # Flow penalty by size: lat probes of flows1=1 blocks minus their quiet blocks, beyond the wire
    # time at the job's share of the link; median over models.
    quiet = {b["model"]: b for b in blocks if b["condition"] == "quiet" and b["world_size"] == 2}
    penalties: dict[float, list[float]] = {}
    for block in blocks:
        spec = block["condition_spec"]
        if (
            block["world_size"] != 2
            or block["model"] not in quiet
            or spec.get("cpu")
            or spec.get("busy")
            or spec.get("rate")
            or spec.get("rank_rates")
        ):
            continue
        flows = [count for _, count in spec.get("flows", [])]
        if flows != [1]:
            continue
        base = quiet[block["model"]]
        bandwidth = goodput(base, sizes[_model_key(base)])
        for (size, cost_q), (_, cost_f) in zip(
            message_table(base, bandwidth), message_table(block, bandwidth / 2)
        ):
            penalties.setdefault(size, []).append(max(0.0, cost_f - cost_q))
    flow_table = tuple(
        (size, statistics.median(values)) for size, values in sorted(penalties.items())
    )
    sources["flow_message_extra_s"] = (
        "lat probes of flows1=1 blocks over their quiet blocks, "
        f"beyond the wire time at half the link ({len(quiet)} models)"
    )
    return SharedConstants(overhead, launch, cpu, flow_table, sources)


def quota(block: dict[str, Any]) -> dict[str, Any]:
    """LinkModel fields for a cgroup CPU quota in the block's condition (the testbed's period)."""
    from benchmarks.testbed.conditions import DEFAULT_PERIOD_US

    ranks = [rank for rank, _ in block["condition_spec"].get("cpu", [])]
    if not ranks:
        return {}
    throttled = block["world_size"] if None in ranks else len(set(ranks))
    return {"quota_period_s": DEFAULT_PERIOD_US * 1e-6, "quota_workers": throttled}


def _quiet_compute(quiet: dict[str, Any]) -> float:
    return min(c for c in quiet["probes"]["compute_s_per_rank"] if c)


def probe_inputs(
    block: dict[str, Any],
    quiet: dict[str, Any],
    profile: ModelProfile,
    constants: SharedConstants,
    sizes: tuple[int, int],
) -> BlockInputs:
    """Inputs from the block's probes. With collectives measured beside a compute step
    (`collective_busy_s`, from --probes-only) those set the per-collective costs and the link's
    goodput (they include whatever the condition does to communication while the CPU is busy:
    quota stalls, time-sharing, traffic); else the bare probes plus the quota stall model."""
    slowest = max(c for c in block["probes"]["compute_s_per_rank"] if c)
    base = _quiet_compute(quiet)
    share = min(1.0, base / slowest)
    bandwidth = goodput(block, sizes)
    cpb = constants.cpu_s_per_byte.get(block["model"], 0.0)
    if block["probes"].get("collective_busy_s"):
        bandwidth = busy_bandwidth(block, bandwidth)
        link = LinkModel(
            latency_s=0.0,
            collective_overhead_s=constants.overhead_s,
            launch_s=constants.launch_s,
            ddp_launch_s=20e-6,
            comm_cpu_s_per_byte=cpb,
            message_extra_s=message_table(block, bandwidth, "collective_busy_s"),
        )
        notes = f"share {share:.2f}; collectives beside compute"
    else:
        link = LinkModel(
            latency_s=0.0,
            collective_overhead_s=constants.overhead_s,
            launch_s=constants.launch_s,
            ddp_launch_s=20e-6,
            comm_cpu_s_per_byte=cpb,
            message_extra_s=message_table(block, bandwidth),
            **quota(block),
        )
        notes = f"share {share:.2f}; bare collectives"
    return BlockInputs(
        _with_compute(profile, base),
        block["world_size"],
        bandwidth,
        link,
        cpu_share=share,
        notes=notes,
    )


def condition_cpu_share(spec: dict[str, Any], ranks: int, cores: int = HOST_CORES) -> float:
    """The CPU share of the slowest rank under a condition (`Condition.as_dict()`): the lowest
    quota; busy loops (`busy=N`: N per rank, `busyK=N`: N on rank K) and ranks beyond the cores
    share the host's cores, or, pinned (one core per rank), the busy rank's own core."""
    share = 1.0
    for _, value in spec.get("cpu", []):
        share = min(share, float(value))
    busy = spec.get("busy", [])
    if spec.get("pin"):
        # ranks beyond the cores double up: N busy loops on a rank's core leave that rank
        # 1 / (ranks on the core + N) of it
        per_core = -(-ranks // cores)
        worst = max([count for _, count in busy] or [0])
        return min(share, 1.0 / (per_core + worst))
    # a namespace does not partition CPU: every runnable process shares the host's cores
    loops = sum(count * (ranks if rank is None else 1) for rank, count in busy)
    if ranks > cores or loops:
        share = min(share, cores / (ranks + loops))
    return share


def model_inputs(
    block: dict[str, Any],
    quiet: dict[str, Any],
    profile: ModelProfile,
    constants: SharedConstants,
    sizes: tuple[int, int],
) -> BlockInputs:
    """The condition model of the scenario keys, fed with the quiet block's probes only."""
    spec = block["condition_spec"]
    base_rate = float(_rate_bps(block["rate"]))
    quiet_rate = float(_rate_bps(quiet["rate"]))
    quiet_bw = goodput(quiet, sizes)
    efficiency = quiet_bw / (quiet_rate / 8)  # tbf + TCP goodput over the nominal rate
    rate = base_rate
    for _, rank_rate in spec.get("rank_rates", []):
        rate = min(rate, float(_rate_bps(rank_rate)))
    bandwidth = rate / 8 * efficiency
    cpb = constants.cpu_s_per_byte.get(block["model"], 0.0)
    if cpb:
        bandwidth = min(bandwidth, 1.0 / cpb)  # gloo over veth cannot move bytes faster
    ranks = block["world_size"]
    share = condition_cpu_share(spec, ranks)
    flows = max([count for _, count in spec.get("flows", [])] or [0])
    link = LinkModel(
        latency_s=0.0,
        collective_overhead_s=constants.overhead_s,
        launch_s=constants.launch_s,
        ddp_launch_s=20e-6,
        comm_cpu_s_per_byte=cpb,
        message_extra_s=_ring_table(quiet, quiet_bw, ranks),
        flow_message_extra_s=constants.flow_message_extra_s,
        **quota(block),
    )
    bandwidth *= link.flow_share(flows)
    return BlockInputs(
        _with_compute(profile, _quiet_compute(quiet)),
        ranks,
        bandwidth,
        link,
        flows=flows,
        cpu_share=share,
        notes=f"share {share:.2f}, flows {flows}, {bandwidth / MBIT:.0f} Mbit/s",
    )


def _ring_table(
    quiet: dict[str, Any], bandwidth: float, ranks: int
) -> tuple[tuple[float, float], ...]:
    """The quiet 2-rank per-collective cost beyond the wire time, for a ring of `ranks`: a ring
    all-reduce takes 2(N-1) steps, each paying the per-step latency once (2 for N = 2)."""
    return tuple((size, extra * (ranks - 1)) for size, extra in message_table(quiet, bandwidth))


def _rate_bps(rate: str) -> int:
    from benchmarks.testbed import parse_rate

    return parse_rate(rate)


# ---- comparison -----------------------------------------------------------------------------


def kendall_tau(measured: dict[str, float], predicted: dict[str, float]) -> float:
    from scipy.stats import kendalltau

    labels = sorted(set(measured) & set(predicted))
    value = kendalltau([measured[k] for k in labels], [predicted[k] for k in labels]).statistic
    return 0.0 if math.isnan(value) else float(value)  # nan (constant input) -> 0


def noise_ceiling(block: dict[str, Any]) -> float | None:
    """Kendall tau between the grid rankings of two disjoint halves of the block's rounds: how
    well the testbed agrees with itself (a simulator cannot be expected to agree better)."""
    rounds = min(len(v) for v in block["per_round"].values())
    if rounds < 2:
        return None
    half = rounds // 2
    first = optimum.step_times(block, range(half))
    second = optimum.step_times(block, range(half, rounds))
    return kendall_tau(first, second)


def compare(block: dict[str, Any], predicted: dict[str, float]) -> dict[str, Any]:
    measured = optimum.step_times(block)
    measured_best = optimum.best(measured)
    sim_best = optimum.best(predicted)
    errors = [abs(predicted[k] / measured[k] - 1) for k in measured]
    return {
        "model": block["model"],
        "condition": block["condition"],
        "world_size": block["world_size"],
        "tau": kendall_tau(measured, predicted),
        "tau_testbed_halves": noise_ceiling(block),
        "measured_best": measured_best,
        "sim_best": sim_best,
        "regret": measured[sim_best] / measured[measured_best] - 1.0,
        "median_abs_error": statistics.median(errors),
        "measured_s": measured,
        "predicted_s": predicted,
    }


def predicted_block(block: dict[str, Any], predicted: dict[str, float]) -> dict[str, Any]:
    """A map block with predicted step times (one 'round'), for optimum.headroom()."""
    return {
        **block,
        "rows": {k: {"median_step_s": v} for k, v in predicted.items()},
        "per_round": {k: [v] for k, v in predicted.items()},
    }


def with_probe_blocks(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The map's blocks, each with the probes of its latest --probes-only run of the same
    (model, condition) where there is one (measured apart from the grid, same condition)."""
    extra = {optimum.block_key(b): b for b in data.get("probe_blocks", [])}
    out = []
    for block in optimum.latest_blocks(data):
        probe = extra.get(optimum.block_key(block))
        if probe is not None:
            probes = dict(probe["probes"])
            probes["from"] = "probe run"
            block = {**block, "probes": probes}
        out.append(block)
    return out


def calibrate_map(
    data: dict[str, Any], profiles: pathlib.Path | None, mixed: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The report (see the module docstring); `mixed`: directly measured mixed traces
    (`bench_conditions --mixed --out`), compared with the map's and the simulator's headroom."""
    blocks = with_probe_blocks(data)
    quiet = {b["model"]: b for b in blocks if b["condition"] == "quiet" and b["world_size"] == 2}
    sizes: dict[str, tuple[int, int]] = {}
    for block in blocks:
        _gradient_bytes(block, sizes)
    constants = shared_constants(blocks, data.get("dispatch"), sizes)
    cache: dict[str, ModelProfile] = {}
    rows: dict[str, list[dict[str, Any]]] = {"probes": [], "model": []}
    predicted_blocks: dict[str, list[dict[str, Any]]] = {"probes": [], "model": []}
    for block in blocks:
        if block["model"] not in quiet:
            continue
        profile = profile_for_block(block, profiles, cache)
        labels = optimum.configs_of(block)
        for mode, make in (("probes", probe_inputs), ("model", model_inputs)):
            inputs = make(
                block, quiet[block["model"]], profile, constants, sizes[_model_key(block)]
            )
            predicted = inputs.predict(labels)
            row = compare(block, predicted)
            row["inputs"] = inputs.notes
            rows[mode].append(row)
            predicted_blocks[mode].append(predicted_block(block, predicted))
    measured_headroom = optimum.all_headrooms(blocks)
    headrooms = []
    for mode in ("probes", "model"):
        for item, predicted in zip(
            measured_headroom, optimum.all_headrooms(predicted_blocks[mode])
        ):
            headrooms.append(
                {
                    "mode": mode,
                    "model": item["model"],
                    "world_size": item["world_size"],
                    "conditions": item["conditions"],
                    "measured": item["headroom"],
                    "measured_cv": item["headroom_cv"],
                    "predicted": predicted["headroom"],
                    "measured_static": item["static"],
                    "measured_per_phase": item["per_phase"],
                    "predicted_static": predicted["static"],
                    "predicted_per_phase": predicted["per_phase"],
                }
            )
    direct = []
    for run in (mixed or {}).get("mixed", []):
        row = {
            "model": run["model"],
            "conditions": run["conditions"],
            "measured_direct": run["headroom_measured"],
            "pairs": len(run["paired_ratios"]),
            "phase_steps": run["phase_steps"],
            "commit": run.get("commit"),
            "load": run.get("load"),
            "static": run["static"],
            "per_phase": run["per_phase"],
            "command": run["command"],
        }
        for item in headrooms:
            if item["model"] == run["model"] and item["conditions"] == run["conditions"]:
                row["from_map"] = item["measured"]
                row[f"predicted_{item['mode']}"] = item["predicted"]
        direct.append(row)
    return {
        "source": [c["command"] for c in data.get("chunks", [])],
        "mixed_direct": direct,
        "constants": {
            "collective_overhead_s": constants.overhead_s,
            "launch_s": constants.launch_s,
            "comm_cpu_s_per_byte": constants.cpu_s_per_byte,
            "flow_message_extra_s": constants.flow_message_extra_s,
            "from": constants.sources,
        },
        "blocks": rows,
        "headroom": headrooms,
        "summary": summarise(rows, headrooms),
    }


def summarise(
    rows: dict[str, list[dict[str, Any]]], headrooms: list[dict[str, Any]]
) -> dict[str, Any]:
    out = {}
    for mode, items in rows.items():
        mine = [h for h in headrooms if h["mode"] == mode]
        # the blocks whose two halves of rounds rank the grid alike (tau >= 0.7): where the
        # testbed itself is consistent enough for the goal to be checkable
        steady = [r for r in items if (r["tau_testbed_halves"] or 0) >= 0.7]
        out[mode] = {
            "steady_blocks": len(steady),
            "steady_tau_ge_0.7": sum(r["tau"] >= 0.7 for r in steady),
            "steady_regret_le_3pct": sum(r["regret"] <= 0.03 for r in steady),
            "blocks": len(items),
            "tau_median": statistics.median(r["tau"] for r in items) if items else None,
            "tau_ge_0.7": sum(r["tau"] >= 0.7 for r in items),
            "regret_median": statistics.median(r["regret"] for r in items) if items else None,
            "regret_le_3pct": sum(r["regret"] <= 0.03 for r in items),
            "step_error_median": (
                statistics.median(r["median_abs_error"] for r in items) if items else None
            ),
            "headroom_within_3pts": sum(abs(h["predicted"] - h["measured"]) <= 0.03 for h in mine),
            "headrooms": len(mine),
        }
    return out


def format_map_report(report: dict[str, Any]) -> str:
    lines = []
    for mode, items in report["blocks"].items():
        lines.append(f"== simulator fed by {mode} ==")
        header = (
            f"{'model':<12} {'condition':<22} {'tau':>5} {'(tb)':>5} {'regret':>7} "
            f"{'|err|':>6}  {'testbed best':<18} {'simulator best':<18} inputs"
        )
        lines += [header, "-" * len(header)]
        for row in items:
            halves = row["tau_testbed_halves"]
            lines.append(
                f"{row['model']:<12} {row['condition']:<22} {row['tau']:5.2f} "
                f"{(f'{halves:5.2f}' if halves is not None else '    -')} "
                f"{row['regret'] * 100:6.1f}% {row['median_abs_error'] * 100:5.1f}%  "
                f"{row['measured_best'].removeprefix('sched:'):<18} "
                f"{row['sim_best'].removeprefix('sched:'):<18} {row['inputs']}"
            )
        summary = report["summary"][mode]
        lines.append(
            "(tb): tau of the testbed's two halves of rounds against each other; regret: "
            "measured step of the simulator's best / measured best - 1"
        )
        lines.append(
            f"tau >= 0.7 in {summary['tau_ge_0.7']}/{summary['blocks']} blocks "
            f"(median {summary['tau_median']:.2f}); regret <= 3% in "
            f"{summary['regret_le_3pct']}/{summary['blocks']} (median "
            f"{summary['regret_median'] * 100:.1f}%); step-time |error| median "
            f"{summary['step_error_median'] * 100:.1f}%"
        )
        lines.append(
            f"blocks whose halves agree (tb >= 0.7): tau >= 0.7 in "
            f"{summary['steady_tau_ge_0.7']}/{summary['steady_blocks']}, regret <= 3% in "
            f"{summary['steady_regret_le_3pct']}/{summary['steady_blocks']}"
        )
        lines.append("")
        header = (
            f"{'model':<12} {'mixed trace (equal steps)':<40} {'measured':>9} {'(cv)':>7} "
            f"{'predicted':>9} {'diff':>6}"
        )
        lines += [header, "-" * len(header)]
        for item in sorted(
            (h for h in report["headroom"] if h["mode"] == mode), key=lambda h: -h["measured"]
        ):
            cv = item["measured_cv"]
            lines.append(
                f"{item['model']:<12} {' | '.join(item['conditions']):<40} "
                f"{item['measured'] * 100:8.1f}% "
                f"{(f'{cv * 100:6.1f}%' if cv is not None else '      -')} "
                f"{item['predicted'] * 100:8.1f}% "
                f"{(item['predicted'] - item['measured']) * 100:+5.1f}"
            )
        lines.append(
            f"headroom within +-3 points in {summary['headroom_within_3pts']}/"
            f"{summary['headrooms']} mixed traces"
        )
        lines.append("")
    if report.get("mixed_direct"):
        lines.append(
            "mixed traces measured directly (one run, conditions switching every phase, "
            "static and per-phase cycles paired)"
        )
        header = (
            f"{'model':<12} {'mixed trace':<32} {'direct':>7} {'pairs':>5} {'map':>7} "
            f"{'sim(probes)':>11} {'sim(model)':>10}  {'load':<5} commit"
        )
        lines += [header, "-" * len(header)]
        for row in report["mixed_direct"]:

            def pct(key: str) -> str:
                value = row.get(key)  # noqa: B023 - called within this iteration
                return "-" if value is None else f"{value * 100:.1f}%"

            lines.append(
                f"{row['model']:<12} {' | '.join(row['conditions']):<32} "
                f"{pct('measured_direct'):>7} {row['pairs']:>5} {pct('from_map'):>7} "
                f"{pct('predicted_probes'):>11} {pct('predicted_model'):>10}  "
                f"{(row.get('load') or '-').split(' ')[0]:<5} {row.get('commit') or '-'}"
            )
        for mode in ("probes", "model"):
            rows = [
                r
                for r in report["mixed_direct"]
                if r.get(f"predicted_{mode}") is not None and r.get("measured_direct") is not None
            ]
            close = sum(abs(r[f"predicted_{mode}"] - r["measured_direct"]) <= 0.03 for r in rows)
            lines.append(
                f"simulator ({mode}) within +-3 points of the direct measurement in "
                f"{close}/{len(rows)}"
            )
        lines.append("")
    constants = report["constants"]
    lines.append(
        f"constants: scheduler overhead per partition {constants['collective_overhead_s'] * 1e3:.2f} ms, "
        f"launch {constants['launch_s'] * 1e6:.0f} us, CPU per byte "
        + ", ".join(f"{k} {v * 1e9:.2f} ns" for k, v in constants["comm_cpu_s_per_byte"].items())
        + "; flow penalty per collective "
        + ", ".join(
            f"{int(size) >> 10} KiB {value * 1e3:.2f} ms"
            for size, value in constants["flow_message_extra_s"]
        )
    )
    return "\n".join(lines)


# ---- scenarios for the tuner, from the map -----------------------------------------------------

PHASE_S = 30.0  # seconds per phase of a generated scenario


def _phase_values(block: dict[str, Any], base_gbit: float) -> dict[str, Any]:
    """One map condition as scenario values: bandwidth, straggler, cpu share, quota, flows."""
    spec = block["condition_spec"]
    bandwidth = _rate_bps(spec["rate"]) / 1e9 if spec.get("rate") else base_gbit
    straggler = min([_rate_bps(r) / 1e9 for _, r in spec.get("rank_rates", [])] or [bandwidth])
    shares = [float(v) for _, v in spec.get("cpu", [])]
    quota_workers = quota(block).get("quota_workers", 0)
    flows = max([count for _, count in spec.get("flows", [])] or [0])
    return {
        "bandwidth": bandwidth,
        "straggler": straggler,
        "cpu": min(shares or [1.0]),
        "quota_workers": quota_workers,
        "flows": flows,
    }


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
    return str(value)


def _step_table(values: list[float], cycles: int) -> dict[str, Any]:
    levels = [values[i % len(values)] for i in range(len(values) * cycles)]
    return {"kind": "step", "levels": levels, "at_s": [PHASE_S * i for i in range(1, len(levels))]}


def scenario_text(
    item: dict[str, Any],
    blocks: dict[tuple[str, str], dict[str, Any]],
    report: dict[str, Any],
    cycles: int = 2,
) -> tuple[str, str]:
    """(file name, TOML) of a testbed scenario alternating the conditions of a mixed trace."""
    model, conditions = item["model"], item["conditions"]
    mine = [blocks[(model, c)] for c in conditions]
    base = _rate_bps(mine[0]["rate"]) / 1e9 if not mine[0]["condition_spec"].get("rate") else 1.0
    phases = [_phase_values(b, base) for b in mine]
    constants = report["constants"]
    quiet = blocks[(model, "quiet")]
    quiet_bw = goodput(quiet, _gradient_bytes(quiet, {}))
    link: dict[str, Any] = {
        "latency_s": 0.0,
        "collective_overhead_s": constants["collective_overhead_s"],
        "launch_s": constants["launch_s"],
        "ddp_launch_s": 20e-6,
        "comm_cpu_s_per_byte": constants["comm_cpu_s_per_byte"].get(model, 0.0),
        "message_extra_s": [list(p) for p in message_table(quiet, quiet_bw)],
        "flow_message_extra_s": [list(p) for p in constants["flow_message_extra_s"]],
    }
    if any(p["quota_workers"] for p in phases):
        from benchmarks.testbed.conditions import DEFAULT_PERIOD_US

        link["quota_period_s"] = DEFAULT_PERIOD_US * 1e-6
        link["quota_workers"] = max(p["quota_workers"] for p in phases)
    static, per_phase = item["measured_static"], item["measured_per_phase"]
    grid = list(dict.fromkeys([static, *per_phase]))
    grid = [label for label in grid if label.startswith("sched:")] or ["sched:none,none"]
    spec = mine[0]
    slug = "-vs-".join(c.replace("=", "-").replace("+", "_") for c in conditions)
    name = f"testbed-{model}-2w-{slug}"
    lines = [
        "# Generated by `python -m benchmarks.calibrate --map ... --write-scenarios DIR`",
        "# from the optimum map: on the testbed the per-phase best beat the best static",
        (
            f"# configuration by {item['measured'] * 100:.1f}% (held-out rounds: "
            f"{(item['measured_cv'] or 0) * 100:.1f}%) on equal steps of "
            f"{' | '.join(conditions)}; the simulator predicts {item['predicted'] * 100:.1f}%."
        ),
        f"# Best static {static}; per phase {' / '.join(per_phase)}.",
        *[
            f"# Measured directly (one run switching conditions every {run['phase_steps']} steps, "
            f"{run['pairs']} paired cycles): {run['measured_direct'] * 100:+.1f}% "
            f"(static {run['static']}, per phase {' / '.join(run['per_phase'])})."
            for run in report.get("mixed_direct", [])
            if run["model"] == model
            and run["conditions"] == conditions
            and run["measured_direct"] is not None
        ],
        f"description = {json.dumps(f'{model} on 2 ranks, {PHASE_S:.0f} s phases alternating ' + ' | '.join(conditions) + ' (from the optimum map)')}",
        f'model = "../calibration/profiles/{model}.profile.json"',
        "workers = 2",
        f"duration_s = {PHASE_S * len(phases) * cycles:.0f}",
        "seed = 0",
        "",
    ]
    tables: dict[str, dict[str, Any]] = {
        "bandwidth": _step_table([p["bandwidth"] for p in phases], cycles)
    }
    if any(p["straggler"] < p["bandwidth"] for p in phases):
        tables["straggler"] = _step_table([p["straggler"] for p in phases], cycles)
    if any(p["cpu"] < 1.0 for p in phases):
        tables["cpu"] = _step_table([p["cpu"] for p in phases], cycles)
    if any(p["flows"] for p in phases):
        tables["traffic"] = _step_table([p["flows"] for p in phases], cycles)
    tables["link"] = link
    tables["testbed"] = {
        "model": spec["builder"],
        "model_args": spec["model_args"],
        "batch_size": spec["batch_size"],
        "max_workers": 2,
        "grid": grid,
        "bo_trial_steps": 8,
        "bo_settle_steps": 2,
        "timeout_s": 900,
    }
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return f"{name}.toml", "\n".join(lines)


def write_scenarios(
    data: dict[str, Any],
    report: dict[str, Any],
    directory: pathlib.Path,
    per_model: int = 1,
    min_headroom: float = 0.02,
) -> list[pathlib.Path]:
    """Scenarios for the mixed traces where re-tuning paid most on the testbed: per model the
    `per_model` best by held-out headroom (at least `min_headroom` both ways), busy-process
    conditions left out (a scenario's [cpu] is applied as a quota on the testbed)."""
    blocks = {(b["model"], b["condition"]): b for b in optimum.latest_blocks(data)}
    measured = [h for h in report["headroom"] if h["mode"] == "probes"]
    written = []
    for model in dict.fromkeys(h["model"] for h in measured):
        candidates = [
            h
            for h in measured
            if h["model"] == model
            and h["world_size"] == 2
            and (model, "quiet") in blocks
            and not any("busy" in c or "pin" in c for c in h["conditions"])
            and h["measured"] >= min_headroom
            and (h["measured_cv"] or 0) >= min_headroom
        ]
        for item in sorted(candidates, key=lambda h: -(h["measured_cv"] or 0))[:per_model]:
            name, text = scenario_text(item, blocks, report)
            path = directory / name
            path.write_text(text)
            written.append(path)
    return written
