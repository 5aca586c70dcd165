"""The accelerator regime on this host: DDP, the scheduler and the bound on emulated-accelerator ranks.

    python -m benchmarks.bench_emulated benchmarks/scenarios/emulated-resnet50-4w.toml \
        --ranks 2,4,8 --rounds 3 --steps 10 --warmup 3 --out results/emulated-resnet50.json
    python -m benchmarks.bench_emulated SCENARIO --check-compute     # the host is not the limit
    python -m benchmarks.bench_emulated --report results/emulated-resnet50.json

The scenario (a `[testbed] mode = "emulated"` file, benchmarks/harness/scenario.py) gives the profile, its
device throughput and byte scale and the rate (its bandwidth at t=0, in the model's bytes; `--rates`
overrides it: Gbit/s, or `1x` for the rate at which a ring all-reduce of all gradients takes the
profile's compute at that rank count, `0.5x`, `2x` half and twice that). Its conditions ([straggler],
[traffic], [cpu] and a bandwidth trace that changes) are applied as the testbed's trace
(`Scenario.testbed_trace`: the conditions on rank 1), scaled with the rate, so every configuration
and both probes of the bound run under them. Under a trace that changes the rate, a row's step is
the mean of its steps (each configuration's steps span several periods of the trace), otherwise
their median. For each rank count, one testbed (a namespace per rank, benchmarks/testbed) runs
every configuration in the same processes, interleaved round by round (ABBA): the two probes of the
bound (`compute`: DDP under no_sync; `comm`: a bare all-reduce of all gradients in DDP's buckets),
DDP at its default bucket_cap_mb (25 MiB) and at a grid of them, the scheduler at its default
(4 MiB, 16 MiB) and at a small grid. Sizes are the model's bytes: on the wire (and in the worker's
labels) they are divided by the byte scale, as the tensors are. A row's step is the median over
rounds of rank 0's median step; beside it each rank's CPU busy share (process CPU time / wall time),
the backend threads' CPU per step (gloo's and torch's own, the busiest rank), the time the training
thread was runnable but waited for a CPU (worst rank), the cores the whole machine kept busy (other
users' processes too), and a flag where the CPU was the limit (a goal does not use such a row). The machine's load average is recorded before and after every block.

`--clip`: DDP's default and the scheduler's default run a second time in a loop that calls
`clip_grad_norm_` between backward and step (a read of the gradients: the scheduler waits there for
its reductions, as DDP does at the end of backward); their /DDP is against DDP + the same clip.

`--check-compute`: one rank (world size 1, no communication) runs the compute probe, whose step must
equal the profile's compute within 2% with the CPU not the limit (exit 1 otherwise), and beside it
the scheduler with nothing to reduce (what its own threads add: reported, not judged).

Only the arithmetic is emulated (benchmarks/testbed/emulated.py): every table says so and states the scale.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from autobyte.types import parse_bytes

from benchmarks.harness.scenario import GBIT, Scenario, load_scenario
from benchmarks.testbed import worker_cli
from benchmarks.testbed.host import HostWatch
from benchmarks.testbed.train_worker import RunConfig
from benchmarks.testbed.wire import (
    CLIP,
    DDP_DEFAULT_BUCKET,
    wire_label,
)

REPO = pathlib.Path(__file__).resolve().parent.parent
DDP_GRID = ("5MiB", "50MiB", "100MiB")
# ScheduledOptimizer's default: sizes derived from the job (autobyte.scheduler.start), here from
# the scaled model's bytes and the scaled links; the row says what they came to in model bytes
SCHED_DEFAULT = "sched:auto"
SCHED_GRID = ("sched:1MiB,4MiB", "sched:4MiB,16MiB", "sched:16MiB,64MiB", "sched:none,none")
# --fsdp: FSDP2 with per-block groups (benchmarks/testbed/fsdp_replica.py), as fully_shard leaves it and at
# a grid of its knobs (forward prefetch, backward prefetch, reshard|keep after forward)
FSDP_DEFAULT = "fsdp"
FSDP_GRID = (
    "fsdp:1,1,reshard",
    "fsdp:2,1,reshard",
    "fsdp:1,2,reshard",
    "fsdp:=,=,keep",
    "fsdp:1,1,keep",
    "fsdp:2,2,keep",
)
COMPUTE_TOLERANCE = 0.02  # the emulated step against the profile's compute, communication off
RUNQUEUE_LIMIT = 0.05  # the training thread waiting for a CPU this share of the step: CPU-limited
HOST_BUSY_LIMIT = 0.85  # the machine's busy cores (every process's) above this share: CPU-limited


def block_labels(
    ddp_grid: Sequence[str], sched_grid: Sequence[str], clip: bool = False
) -> list[str]:
    """The configurations of one block, in the model's bytes (DDP's default bucket spelt out);
    with `clip`, DDP's default and the scheduler's default again, each loop clipping every step."""
    ddp = [f"ddp:{DDP_DEFAULT_BUCKET}"] + [
        f"ddp:{size}" for size in ddp_grid if size != DDP_DEFAULT_BUCKET
    ]
    sched = [SCHED_DEFAULT] + [label for label in sched_grid if label != SCHED_DEFAULT]
    clipped = [f"ddp:{DDP_DEFAULT_BUCKET}{CLIP}", f"{SCHED_DEFAULT}{CLIP}"] if clip else []
    return ["compute", "comm", *ddp, *sched, *clipped]


def fsdp_labels(grid: Sequence[str]) -> list[str]:
    """An FSDP2 block: the compute probe, FSDP2's communication probe (`agrs`), FSDP2's defaults
    and the grid."""
    return ["compute", "agrs", FSDP_DEFAULT, *(g for g in grid if g != FSDP_DEFAULT)]


def balanced_rate_gbit(profile: Any, ranks: int) -> float:
    """Gbit/s (model bytes) at which a ring all-reduce of all gradients takes the profile's compute."""
    wire_factor = 2 * (ranks - 1) / ranks
    return wire_factor * profile.total_param_bytes / profile.compute_s / GBIT


def parse_rates(text: str, profile: Any, ranks: int, default_gbit: float) -> list[float]:
    """`--rates`: Gbit/s or multiples of the balanced rate (`0.5x,1x,2x`); empty: the scenario's."""
    if not text:
        return [default_gbit]
    rates = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        try:
            value = (
                float(item[:-1]) * balanced_rate_gbit(profile, ranks)
                if item.endswith("x")
                else float(item)
            )
        except ValueError:
            raise ValueError(
                f"--rates {item!r}: give Gbit/s (7.5) or a multiple of the balanced rate (1x)"
            ) from None
        if not value > 0:
            raise ValueError(f"--rates {item!r}: a rate must be > 0")
        rates.append(value)
    return rates


def scenario_at_rate(scenario: Scenario, rate_gbit: float) -> Scenario:
    """The scenario with its bandwidth trace (and straggler link) scaled so the link starts at
    `rate_gbit`; the conditions' shape (when, how much slower, how many flows) is kept."""
    link = scenario.link_bandwidth or scenario.bandwidth
    factor = rate_gbit * GBIT / link.at(0.0)
    if factor == 1.0:
        return scenario
    scaled: dict[str, Any] = {"bandwidth": scenario.bandwidth.scaled(factor)}
    if scenario.link_bandwidth is not None:
        scaled["link_bandwidth"] = scenario.link_bandwidth.scaled(factor)
    if scenario.straggler is not None:
        scaled["straggler"] = scenario.straggler.scaled(factor)
    return dataclasses.replace(scenario, **scaled)


def rate_changes(scenario: Scenario) -> bool:
    """Whether the links' rate changes during the run (the rows then report mean steps)."""
    link = scenario.link_bandwidth or scenario.bandwidth
    return not link.is_constant or (
        scenario.straggler is not None and not scenario.straggler.is_constant
    )


def _burst(scenario: Scenario, burst: int | None = None) -> int:
    """The links' tbf burst: `burst` where given (--burst), else the scenario's
    (Scenario.testbed_burst; the testbed's default for a real-mode one)."""
    from benchmarks.testbed import DEFAULT_BURST_BYTES

    if burst is None:
        burst = scenario.testbed_burst()
    return DEFAULT_BURST_BYTES if burst is None else burst


def block_trace(scenario: Scenario, until_s: float) -> Any:
    """The testbed trace of a scenario with conditions or a changing rate; None otherwise."""
    if not scenario.has_conditions and not rate_changes(scenario):
        return None
    return scenario.testbed_trace(until_s)


def describe_conditions(scenario: Scenario) -> str:
    """The conditions a block ran under, in words (the model's bytes)."""
    parts = []
    link = scenario.link_bandwidth or scenario.bandwidth
    if not link.is_constant:
        levels = sorted({value for _s, _e, value in link.phases(60.0)})
        parts.append(
            "rate changes between "
            + " and ".join(f"{v / GBIT:.3g}" for v in levels)
            + " Gbit/s (every link)"
        )
    if scenario.straggler is not None:
        parts.append(f"rank 1's link at {scenario.straggler.at(0.0) / GBIT:.3g} Gbit/s (straggler)")
    if scenario.flows is not None:
        parts.append(f"{scenario.flows.at(0.0):g} competing TCP flow(s) each way on rank 1's link")
    if scenario.cpu_share is not None:
        parts.append(f"CPU share {scenario.cpu_share.at(0.0):g} on rank 1")
    return "; ".join(parts) or "none"


def _worker_command(
    scenario: Scenario, ranks: int, wire: Sequence[str], rounds: int, steps: int, warmup: int
) -> list[str]:
    workload = scenario.testbed_workload(ranks)
    return worker_cli.command(
        *workload.worker_args(),
        optimizer="sgd",
        lr=0.001,
        configs=list(wire),
        rounds=rounds,
        abba=True,
        steps=steps,
        warmup=warmup,
    )


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(
    labels: Sequence[str],
    wire: Sequence[str],
    ranks: list[list[dict[str, Any]]],
    cores: int,
    step_stat: str = "median",
) -> list[dict[str, Any]]:
    """One row per configuration from every rank's `result` events (see the module docstring)."""
    from benchmarks.testbed.train_worker import RunConfig

    rows = []
    for label, wire_lab in zip(labels, wire):
        per_rank = [
            [r for r in results if r["config"] == _worker_label(wire_lab)] for results in ranks
        ]
        rank0 = per_rank[0]
        busy = [_median([r["cpu"]["busy_share"] for r in results]) for results in per_rank]
        backend = [
            _median([r["cpu"]["s_per_step"]["backend"] for r in results]) for results in per_rank
        ]
        runqueue = [
            _median([r["cpu"]["runqueue_s_per_step"] for r in results]) for results in per_rank
        ]
        training_runqueue = [
            _median([r["cpu"]["training_runqueue_s_per_step"] for r in results])
            for results in per_rank
        ]
        machine = _median([r["cpu"]["machine_busy_cores"] for r in rank0])
        if step_stat == "mean":
            round_steps = [statistics.fmean(r["step_times_s"]) for r in rank0 if r["step_times_s"]]
        else:
            round_steps = [r["median_step_s"] for r in rank0 if r["median_step_s"] is not None]
        step = _median(round_steps)
        exposed = _median(
            [r["exposed_comm_s"] for r in rank0 if r.get("exposed_comm_s") is not None]
        )
        device_idle = _median([r["device"]["idle_s"] for r in rank0 if "device" in r])
        # sched:auto: the sizes the scheduler derived, on the wire (the report scales them back)
        derived = (
            [rank0[0].get("partition_bytes"), rank0[0].get("credit_bytes")]
            if rank0 and RunConfig.parse(label).auto
            else None
        )
        device_busy = _median([r["device"]["busy_s"] for r in rank0 if "device" in r])
        flags = []
        if step and max(training_runqueue) > RUNQUEUE_LIMIT * step:
            flags.append("runqueue")
        if machine is not None and machine > HOST_BUSY_LIMIT * cores:
            flags.append("host-busy")
        rows.append(
            {
                "config": label,
                "wire": wire_lab,
                "derived_wire_bytes": derived,
                "step_s": step,
                "step_stat": step_stat,
                "round_steps_s": round_steps,
                "rounds": len(rank0),
                "hot_path": rank0[0].get("hot_path") if rank0 else None,
                "exposed_comm_s": exposed,
                # FSDP2 rows: the training thread's time in all-gathers / reduce-scatters a step
                **{
                    key: _median([r[key] for r in rank0 if r.get(key) is not None])
                    for key in ("all_gather_s", "reduce_scatter_s")
                },
                "device_busy_s": device_busy,
                "device_idle_s": device_idle,
                "busy_share": busy,
                "backend_cpu_s_per_step": backend,
                "runqueue_s_per_step": runqueue,
                "training_runqueue_s_per_step": training_runqueue,
                "machine_busy_cores": machine,
                "cpu_limited": flags,
            }
        )
    return rows


def _worker_label(wire_lab: str) -> str:
    from benchmarks.testbed.train_worker import RunConfig

    return RunConfig.parse(wire_lab).label


def run_block(
    scenario: Scenario,
    ranks: int,
    rate_gbit: float,
    labels: Sequence[str],
    rounds: int,
    steps: int,
    warmup: int,
    timeout_s: float = 900.0,
    burst: int | None = None,
) -> dict[str, Any]:
    """Every configuration at `ranks` emulated ranks on one testbed, interleaved round by round;
    `burst`: the links' tbf burst in bytes (None: the scenario's, `_burst`)."""
    from benchmarks.testbed import Testbed

    wire = [wire_label(label, scenario.byte_scale) for label in labels]
    wire_rate_bps = int(rate_gbit * GBIT * 8 / scenario.byte_scale)
    at_rate = scenario_at_rate(scenario, rate_gbit)
    trace = block_trace(at_rate, timeout_s) if ranks > 1 else None
    step_stat = "mean" if rate_changes(at_rate) else "median"
    watch = HostWatch()
    with Testbed(world_size=ranks, rate=wire_rate_bps, burst=_burst(at_rate, burst)) as bed:
        result = bed.run(
            _worker_command(scenario, ranks, wire, rounds, steps, warmup),
            trace=trace,
            timeout_s=timeout_s,
            cwd=str(REPO),
        )
    host = watch.report()
    rows = summarise(
        labels, wire, [rank.results for rank in result.ranks], os.cpu_count() or 1, step_stat
    )
    by_config = {row["config"]: row for row in rows}
    compute, comm = (
        by_config.get("compute", {}).get("step_s"),
        by_config.get("comm", by_config.get("agrs", {})).get("step_s"),
    )
    fsdp = FSDP_DEFAULT in by_config
    bound = max(compute, comm) if compute and comm else None
    unclipped = [row for row in rows if not row["config"].endswith(CLIP)]
    # an FSDP2 block's reference is FSDP2's defaults and its grid, where DDP's are in the columns
    ddp_rows = [
        row
        for row in unclipped
        if row["config"].startswith("fsdp" if fsdp else "ddp") and row["step_s"]
    ]
    ddp_default = by_config.get(FSDP_DEFAULT if fsdp else f"ddp:{DDP_DEFAULT_BUCKET}", {}).get(
        "step_s"
    )
    ddp_clip = by_config.get(f"ddp:{DDP_DEFAULT_BUCKET}{CLIP}", {}).get("step_s")
    ddp_best = min((row["step_s"] for row in ddp_rows), default=None)
    sched_grid = [
        row
        for row in unclipped
        if row["config"].startswith("sched:") and row["config"] != SCHED_DEFAULT
    ]
    sched_best = min((row["step_s"] for row in sched_grid if row["step_s"]), default=None)
    for row in rows:
        if row.get("derived_wire_bytes"):  # in the model's bytes, as the grid's labels
            from autobyte.types import format_bytes

            row["derived"] = "/".join(
                format_bytes(None if b is None else round(b * scenario.byte_scale), "none")
                for b in row["derived_wire_bytes"]
            )
        step = row["step_s"]
        clipped = row["config"].endswith(CLIP)
        row["vs_sched_grid_best"] = (
            sched_best / step if step and sched_best and not clipped else None
        )
        row["x_bound"] = step / bound if step and bound else None
        # a clipping loop against DDP's default bucket with the same clip
        ddp_same_loop = ddp_clip if clipped else ddp_default
        row["speedup_vs_ddp_default"] = ddp_same_loop / step if step and ddp_same_loop else None
        row["speedup_vs_ddp_best"] = ddp_best / step if step and ddp_best and not clipped else None
        if clipped:  # per round, paired: the rounds ran interleaved in the same processes
            ddp_rounds = by_config.get(f"ddp:{DDP_DEFAULT_BUCKET}{CLIP}", {}).get("round_steps_s")
            row["vs_ddp_clip_per_round"] = [
                d / t for d, t in zip(ddp_rounds or [], row["round_steps_s"]) if t
            ]
    return {
        "ranks": ranks,
        "rate_gbit": rate_gbit,
        "wire_rate_bps": wire_rate_bps,
        "burst_bytes": _burst(at_rate, burst),
        "balanced_rate_gbit": balanced_rate_gbit(scenario.profile, ranks) if ranks > 1 else None,
        "conditions": describe_conditions(at_rate) if trace is not None else "none",
        "step_stat": step_stat,
        # what the testbed applied: the first few changes of each kind and how many in all
        "rate_changes": {
            "count": len(result.rate_log),
            "first": [
                {"t_s": e.get("t_s"), "rate_bps": e.get("rate_bps"), "ranks": e.get("ranks")}
                for e in result.rate_log[:4]
            ],
        },
        "condition_changes": [
            {k: v for k, v in e.items() if k not in ("wall_time", "stopped")}
            for e in result.condition_log
        ],
        "ddp_default_s": ddp_default,
        "ddp_clip_s": ddp_clip,
        "ddp_best_s": ddp_best,
        "ddp_best_config": min(ddp_rows, key=lambda row: row["step_s"])["config"]
        if ddp_rows
        else None,
        "engine": "fsdp2" if fsdp else "ddp",
        "profile_compute_s": scenario.profile.compute_s,
        "bound_s": bound,
        "compute_s": compute,
        "comm_s": comm,
        "host": host,
        "rows": rows,
    }


def run_tuned_block(
    scenario: Scenario,
    ranks: int,
    rate_gbit: float,
    steps: int,
    label: str = "fsdp:daemon",
    warmup: int = 0,
    timeout_s: float = 1800.0,
    budget_bytes: int | None = None,
    jobs: int = 1,
    burst: int | None = None,
) -> dict[str, Any]:
    """FSDP2 tuned live: one run of `steps` steps whose knobs a real autobyted's tuner sets (its
    own process in the testbed's hub namespace, `--tuner auto`), on a testbed like the static
    block's, under the scenario's trace from its start; the steps, what the tuner decided and where
    it ended. With another `label` (fsdp, fsdp:F,B,R), that configuration held for the same steps
    under the same trace, no daemon: the static setting the tuned run is compared with, step for
    step of the trace. `warmup` steps run before the measured ones (a held setting takes effect
    at the second boundary; the tuned run gets as many, so both measure the same span of the
    trace). `budget_bytes` (the model's bytes): the job's memory budget for gathered parameters,
    from which the tuned run starts (`autobyte.fsdp.ShardedJob.derived_config`); None: FSDP2's
    defaults. `jobs` > 1 (tuned only): as many jobs of the model one after the other against the
    same daemon, each its own job name, the first's figures at the top and the later ones' in
    `later_jobs` (each learns from those before it: tuner.sharded's `known`)."""
    import tempfile

    from benchmarks.harness.autobyte_policy import HubDaemon
    from benchmarks.testbed import Testbed

    wire_rate_bps = int(rate_gbit * GBIT * 8 / scenario.byte_scale)
    at_rate = scenario_at_rate(scenario, rate_gbit)
    trace = block_trace(at_rate, timeout_s)
    workload = scenario.testbed_workload(ranks)
    command = worker_cli.command(
        *workload.worker_args(),
        optimizer="sgd",
        lr=0.001,
        configs=[label],
        rounds=1,
        steps=steps,
        warmup=warmup,
        fsdp_budget=int(budget_bytes / scenario.byte_scale) if budget_bytes else None,
    )
    runs = []
    with (
        tempfile.TemporaryDirectory(prefix="abfsdp-") as tmp,
        Testbed(world_size=ranks, rate=wire_rate_bps, burst=_burst(at_rate, burst)) as bed,
    ):
        hub = None
        if label == "fsdp:daemon":
            hub = HubDaemon(bed, pathlib.Path(tmp), job=f"fsdp-{ranks}w", tuner="auto").start()
        try:
            for k in range(jobs if hub is not None else 1):
                watch = HostWatch()
                job = f"fsdp-{ranks}w" + (f"-{k + 1}" if k else "")
                env = {**hub.env, "AUTOBYTE_JOB": job} if hub is not None else None
                result = bed.run(command, trace=trace, timeout_s=timeout_s, cwd=str(REPO), env=env)
                runs.append([result, watch.report(), job])
        finally:
            cpu_s = hub.stop().get("daemon_cpu_s") if hub is not None else None
        for run in runs:  # the database outlives the daemon until the folder goes
            run[2] = {**hub.records(run[2], cpu_s), "job": run[2]} if hub is not None else None

    def one(result: Any, host: dict, tuned: dict | None) -> dict[str, Any]:
        (row,) = summarise([label], [label], [r.results for r in result.ranks], os.cpu_count() or 1)
        (only,) = result.ranks[0].results  # one segment
        times = only["step_times_s"]
        tail = times[-max(1, len(times) // 4) :]
        return {
            "label": label,
            "ranks": ranks,
            "rate_gbit": rate_gbit,
            "burst_bytes": _burst(at_rate, burst),
            "budget_bytes": budget_bytes,
            "conditions": describe_conditions(at_rate) if trace is not None else "none",
            "steps": len(times),
            "step_times_s": times,
            "mean_s": statistics.fmean(times),
            "last_quarter_median_s": statistics.median(tail),
            "by_rate": mean_by_rate(times, at_rate) if rate_changes(at_rate) else {},
            "row": row,
            "tuner": tuned,
            "host": host,
        }

    first, *later = [one(*run) for run in runs]
    return {**first, "later_jobs": later} if later else first


def mean_by_rate(step_times_s: Sequence[float], scenario: Scenario) -> dict[str, float]:
    """The mean step per link rate (Gbit/s in the model's bytes, as text) of a run that starts at
    the trace's start: each step counted at the rate when it began."""
    link = scenario.link_bandwidth or scenario.bandwidth
    groups: dict[str, list[float]] = {}
    start = 0.0
    for step_s in step_times_s:
        groups.setdefault(f"{link.at(start) / GBIT:g}", []).append(step_s)
        start += step_s
    return {rate: statistics.fmean(times) for rate, times in sorted(groups.items())}


def format_tuned(
    tuned: dict[str, Any], static: dict[str, Any] | None, beside: Sequence[dict[str, Any]] = ()
) -> str:
    """The live-tuned run beside its static block's FSDP2 defaults and best static setting, and
    beside the static settings held for the same steps under the same trace (`beside`)."""
    flags = ",".join(tuned["row"]["cpu_limited"]) or "-"
    by_rate = "".join(
        f"; at {rate} Gbit/s {_ms(mean)} ms" for rate, mean in tuned.get("by_rate", {}).items()
    )
    if tuned.get("label", "fsdp:daemon") != "fsdp:daemon":
        return (
            f"{tuned['label']} held ({tuned['ranks']} ranks, {tuned['steps']} steps, conditions "
            f"{tuned.get('conditions', 'none')}): mean {_ms(tuned['mean_s'])} ms{by_rate}; flag "
            f"{flags}; host {HostWatch.describe(tuned['host'])}"
        )
    t = tuned["tuner"]
    kinds: dict[str, int] = {}
    for d in t["decisions"]:
        kind = d["reason"].split(":")[0].split(" ")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    ref = ""
    if static and static.get("ddp_default_s") and static.get("ddp_best_s"):
        held, mean = tuned["last_quarter_median_s"], tuned["mean_s"]
        ref = (
            f"; held x FSDP2 defaults {static['ddp_default_s'] / held:.2f}, x best static "
            f"({static['ddp_best_config']}) {static['ddp_best_s'] / held:.2f}; whole run (its "
            f"trials included) x defaults {static['ddp_default_s'] / mean:.2f}, x best static "
            f"{static['ddp_best_s'] / mean:.2f} (sequential runs on the same testbed, not paired)"
        )
    budget = (
        f"memory budget {tuned['budget_bytes']:,} model bytes (started from the derived "
        "configuration), "
        if tuned.get("budget_bytes")
        else ""
    )
    held_runs = "".join(
        f"; whole run x {b['label']} held under the same trace {b['mean_s'] / tuned['mean_s']:.3f}"
        for b in beside
    )
    return (
        f"autobyte (live, {tuned['ranks']} ranks, {tuned['steps']} steps, {budget}conditions "
        f"{tuned.get('conditions', 'none')}): last quarter median "
        f"{_ms(tuned['last_quarter_median_s'])} ms, mean {_ms(tuned['mean_s'])} ms{by_rate}{ref}"
        f"{held_runs}; decisions {dict(sorted(kinds.items()))}; tuner: {t.get('detail', '')}; "
        f"flag {flags}; host {HostWatch.describe(tuned['host'])}"
    )


def check_compute(
    scenario: Scenario, rounds: int = 3, steps: int = 10, warmup: int = 3, timeout_s: float = 600.0
) -> dict[str, Any]:
    """World size 1 (no communication): the compute probe and the scheduler's step against the
    profile's compute."""
    labels = ["compute", SCHED_DEFAULT]
    block = run_block(scenario, 1, 1.0, labels, rounds, steps, warmup, timeout_s)
    profile_s = scenario.profile.compute_s
    for row in block["rows"]:
        row["x_profile"] = row["step_s"] / profile_s if row["step_s"] else None
        row["within_tolerance"] = (
            row["x_profile"] is not None and abs(row["x_profile"] - 1.0) <= COMPUTE_TOLERANCE
        )
    return block


def _ddps(block: dict[str, Any]) -> str:
    if not block.get("ddp_best_config"):
        return ""
    if block.get("engine") == "fsdp2":
        return (
            f"; FSDP2 defaults {_ms(block['ddp_default_s'])} ms, best static "
            f"({block['ddp_best_config']}) {_ms(block['ddp_best_s'])} ms"
        )
    return (
        f"; DDP default (25MiB) {_ms(block['ddp_default_s'])} ms, DDP best "
        f"({block['ddp_best_config']}) {_ms(block['ddp_best_s'])} ms"
    )


def _balanced(block: dict[str, Any]) -> str:
    balanced = block.get("balanced_rate_gbit")
    return f", {block['rate_gbit'] / balanced:.2g}x the balanced rate" if balanced else ""


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _auto_vs_grid(block: dict[str, Any]) -> str:
    auto = next((row for row in block["rows"] if row["config"] == SCHED_DEFAULT), None)
    if auto is None or auto.get("vs_sched_grid_best") is None:
        return ""
    return f"auto at {auto['vs_sched_grid_best']:.3f}x the scheduler grid's best; "


def _burst_words(block: dict[str, Any]) -> str:
    burst = block.get("burst_bytes")  # absent in results recorded before it was set per run
    return "" if burst is None else f", tbf burst {burst / 1024:.0f} KiB"


def format_block(block: dict[str, Any], scale: str) -> str:
    ref = "/FSDP" if block.get("engine") == "fsdp2" else "/DDP"
    lines = [
        scale,
        (
            f"{block['ranks']} ranks, {block['rate_gbit']:.3g} Gbit/s in model bytes "
            f"({block['wire_rate_bps'] / 1e6:.0f} Mbit/s on the wire{_balanced(block)}"
            f"{_burst_words(block)}); conditions: "
            f"{block.get('conditions', 'none')}; step: {block.get('step_stat', 'median')} of a "
            f"configuration's steps; profile compute "
            f"{_ms(block['profile_compute_s'])} ms, compute probe {_ms(block['compute_s'])} ms, bare "
            f"{'all-gather + reduce-scatter' if block.get('engine') == 'fsdp2' else 'all-reduce'} "
            f"{_ms(block['comm_s'])} ms, bound {_ms(block['bound_s'])} ms; host "
            f"{HostWatch.describe(block['host'])} (load {block['host'].get('load_start')} -> "
            f"{block['host'].get('load_end')})" + _ddps(block)
        ),
        (
            f"{'config (model bytes)':22} {'wire':22} {'step ms':>8} {'x bound':>7} {'/DDP':>5} "
            f"{'/DDPbest':>8} {'exposed':>7} {'CPU busy per rank':>22} {'gloo ms':>7} {'runq ms':>7} "
            f"{'host':>4} flag"
        ),
    ]
    for row in block["rows"]:
        busy = "/".join(f"{b:.2f}" for b in row["busy_share"] if b is not None)
        backend = max((b for b in row["backend_cpu_s_per_step"] if b is not None), default=None)
        runqueue = max(
            (b for b in row["training_runqueue_s_per_step"] if b is not None), default=None
        )
        machine = row["machine_busy_cores"]
        extra = ""
        if "x_profile" in row:
            extra = (
                f"  x profile {_x(row['x_profile'])} "
                f"({'within' if row['within_tolerance'] else 'OUTSIDE'} {COMPUTE_TOLERANCE:.0%})"
            )
        config = row["config"]
        if row.get("derived"):
            config = f"auto={row['derived']}" + (CLIP if config.endswith(CLIP) else "")
        lines.append(
            f"{config:22} {row['wire']:22} {_ms(row['step_s']):>8} {_x(row['x_bound']):>7} "
            f"{_x(row['speedup_vs_ddp_default']):>5} {_x(row['speedup_vs_ddp_best']):>8} "
            f"{_ms(row['exposed_comm_s']):>7} {busy:>22} {_ms(backend):>7} {_ms(runqueue):>7} "
            f"{'-' if machine is None else f'{machine:.1f}':>4} "
            f"{','.join(row['cpu_limited']) or '-'}{extra}"
        )
    lines.append(
        "auto=P/C: the scheduler's default, the sizes it derived (model bytes); "
        f"{_auto_vs_grid(block)}"
        + (
            "/FSDP, /FSDPbest: FSDP2's step (as fully_shard leaves it, best of the grid) / this "
            "step; fsdp:F,B,R: forward prefetch F groups, backward B, reshard|keep after forward, "
            "all-gathers asynchronous (autobyte.fsdp's on CPU; ,sync: holding the thread, as "
            "FSDP2's own on gloo); exposed: the training thread's time in collectives; "
            if ref == "/FSDP"
            else "/DDP, /DDPbest: DDP's step (default bucket, best of the grid) / this step; "
            "exposed: the scheduler's median forward wait; "
        )
        + "gloo ms: CPU per step of the threads Python did not "
        "make (gloo's), busiest rank; runq: the training thread runnable but without a CPU, per "
        f"step, worst rank; host: cores the machine kept busy (every process's, of {os.cpu_count()}); "
        "flag: the CPU was the limit (runq > 5% of the step, host > 85%): not for goals"
        + (
            "; +clip: the loop calls clip_grad_norm_ between backward and step, /DDP against DDP's "
            "default bucket + the same clip"
            if block.get("ddp_clip_s")
            else ""
        )
    )
    for row in block["rows"]:
        if row.get("vs_ddp_clip_per_round"):
            lines.append(
                f"{row['config']} x DDP + clip per round: "
                + ", ".join(f"{r:.3f}" for r in row["vs_ddp_clip_per_round"])
            )
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    tables = [format_block(block, report["scale"]) for block in report["blocks"]]
    runs = report.get("tuned", [])
    for tuned in runs:
        same = [
            r for r in runs if (r["ranks"], r["rate_gbit"]) == (tuned["ranks"], tuned["rate_gbit"])
        ]
        static = next(
            (
                b
                for b in report["blocks"]
                if b["ranks"] == tuned["ranks"] and b["rate_gbit"] == tuned["rate_gbit"]
            ),
            None,
        )
        beside = [r for r in same if r.get("label", "fsdp:daemon") != "fsdp:daemon"]
        tables.append(format_tuned(tuned, static, beside))
        tables += [format_later_job(later, tuned) for later in tuned.get("later_jobs", ())]
    return "\n\n".join(tables)


def settled_at(tuned: dict[str, Any]) -> int | None:
    """The step at which the job's last switch took effect (None: it never switched)."""
    steps = [
        d["applied_at_step"]
        for d in tuned["tuner"]["decisions"]
        if d["reason"].startswith("switch to") and d.get("applied_at_step") is not None
    ]
    return max(steps) if steps else None


def format_later_job(later: dict[str, Any], first: dict[str, Any]) -> str:
    """A later job of the model against the same daemon (`run_tuned_block`'s `jobs`), beside the
    first: whole-run mean, the step its search switched last, where it ended."""
    t = later["tuner"]
    first_trial = next((d for d in t["decisions"] if d["reason"].startswith("trial")), None)
    return (
        f"later job {t.get('job', '?')} of the model, same daemon ({later['ranks']} ranks, "
        f"{later['steps']} steps): mean {_ms(later['mean_s'])} ms (x the first job "
        f"{first['mean_s'] / later['mean_s']:.3f}), last quarter median "
        f"{_ms(later['last_quarter_median_s'])} ms; last switch at step {settled_at(later)} "
        f"(the first job: {settled_at(first)}); first trial: "
        f"{first_trial['reason'] if first_trial else 'none'}; tuner: {t.get('detail', '')}; "
        f"flag {','.join(later['row']['cpu_limited']) or '-'}; host "
        f"{HostWatch.describe(later['host'])}"
    )


def _save(report: dict[str, Any], out: str) -> None:
    """The results so far as JSON at `out` (nothing without one)."""
    if out:
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenario", nargs="?", help="an emulated-mode scenario file")
    parser.add_argument(
        "--ranks", default="", help="rank counts, e.g. 2,4,8 (default: the scenario's)"
    )
    parser.add_argument(
        "--rates",
        default="",
        help="Gbit/s in the model's bytes, or multiples of the rate where a ring all-reduce "
        "takes the compute at each rank count (0.5x,1x,2x); default: the scenario's",
    )
    parser.add_argument(
        "--ddp-grid",
        default=",".join(DDP_GRID),
        help="bucket_cap sizes beside the default 25MiB (model bytes)",
    )
    parser.add_argument(
        "--sched-grid",
        default=";".join(SCHED_GRID),
        help="scheduler configurations beside the default, ';'-separated",
    )
    parser.add_argument(
        "--clip",
        action="store_true",
        help="also run DDP's default and the scheduler's default with clip_grad_norm_ "
        "between backward and step (the loop of most transformer scripts)",
    )
    parser.add_argument(
        "--fsdp",
        nargs="?",
        const=";".join(FSDP_GRID),
        default=None,
        help="FSDP2 instead of DDP and the scheduler: its defaults and this ';'-separated grid "
        f"of fsdp:F,B,R labels (default {';'.join(FSDP_GRID)})",
    )
    parser.add_argument(
        "--fsdp-tuned",
        type=int,
        default=0,
        metavar="STEPS",
        help="with --fsdp: also one run of STEPS steps tuned live by a real autobyted at each "
        "rank count and rate (under the scenario's trace from its start)",
    )
    parser.add_argument(
        "--fsdp-jobs",
        type=int,
        default=1,
        metavar="N",
        help="with --fsdp-tuned: N jobs of the model one after the other against the same daemon "
        "(each learns from those before it)",
    )
    parser.add_argument(
        "--fsdp-held",
        default="",
        metavar="LABELS",
        help="with --fsdp-tuned: also these ';'-separated FSDP2 labels (fsdp, fsdp:F,B,R), each "
        "held for the same STEPS under the same trace: the tuned run's whole-run reference",
    )
    parser.add_argument(
        "--fsdp-budget",
        default="",
        metavar="SIZE",
        help="with --fsdp-tuned: the jobs' memory budget for gathered parameters (the model's "
        "bytes, e.g. 2GiB); the tuned run starts from the configuration derived from it "
        "(default: no budget, FSDP2's defaults)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per block")
    parser.add_argument(
        "--check-compute",
        action="store_true",
        help="world size 1: the step against the profile's compute (exit 1 beyond 2%%)",
    )
    parser.add_argument(
        "--burst",
        default="auto",
        help="the links' tbf burst on the wire: auto (one kernel tick of the highest rate, at "
        "least 64 KiB: benchmarks/testbed/bed.py burst_for) or a size such as 512KiB",
    )
    parser.add_argument("--out", default="", help="write the results as JSON here")
    parser.add_argument("--report", default="", help="print the tables of a results JSON and exit")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(format_report(json.loads(pathlib.Path(args.report).read_text())))
        return 0
    if not args.scenario:
        raise SystemExit(
            "give an emulated-mode scenario file (benchmarks/scenarios/emulated-*.toml)"
        )
    try:
        scenario = load_scenario(args.scenario)
    except (OSError, ValueError) as error:
        raise SystemExit(f"bench_emulated: {error}") from None
    if not scenario.emulated:
        raise SystemExit(f'bench_emulated: {args.scenario} has no [testbed] mode = "emulated"')
    from benchmarks.testbed.emulated import describe_scale

    scale = describe_scale(
        scenario.profile, scenario.byte_scale, scenario.device_flops_per_s, scenario.compute_scale
    )
    blocks: list[dict[str, Any]] = []
    tuned: list[dict[str, Any]] = []
    report = {
        "scenario": scenario.path,
        "scale": scale,
        "byte_scale": scenario.byte_scale,
        "emulated": True,
        "blocks": blocks,
        "tuned": tuned,
    }
    if args.check_compute:
        block = check_compute(scenario, args.rounds, args.steps, args.warmup, args.timeout_s)
        blocks.append(block)
        # The verdict is the compute probe's (communication off); the scheduler's row beside it
        # shows what its own threads add with nothing to reduce.
        ok = all(
            row["within_tolerance"] and not row["cpu_limited"]
            for row in block["rows"]
            if row["config"] == "compute"
        )
    else:
        try:
            ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else [scenario.workers]
        except ValueError:
            raise SystemExit(
                f"bench_emulated: --ranks {args.ranks!r}: give counts such as 2,4,8"
            ) from None
        if any(r < 2 for r in ranks):
            raise SystemExit(
                "bench_emulated: every --ranks count must be >= 2 (--check-compute runs 1)"
            )
        default_rate = (scenario.link_bandwidth or scenario.bandwidth).at(0.0) / GBIT
        try:
            rates = {n: parse_rates(args.rates, scenario.profile, n, default_rate) for n in ranks}
        except ValueError as error:
            raise SystemExit(f"bench_emulated: {error}") from None
        labels = (
            fsdp_labels([s for s in args.fsdp.split(";") if s])
            if args.fsdp is not None
            else block_labels(
                [s for s in args.ddp_grid.split(",") if s],
                [s for s in args.sched_grid.split(";") if s],
                clip=args.clip,
            )
        )
        held = [s for s in args.fsdp_held.split(";") if s]
        try:
            burst = None if args.burst == "auto" else parse_bytes(args.burst)
        except ValueError as error:
            raise SystemExit(f"bench_emulated: --burst: {error}") from None
        if burst is not None and burst <= 0:
            raise SystemExit(f"bench_emulated: --burst {args.burst!r} must be positive")
        try:
            budget = parse_bytes(args.fsdp_budget) if args.fsdp_budget else None
        except ValueError as error:
            raise SystemExit(f"bench_emulated: --fsdp-budget: {error}") from None
        for label in held:
            try:
                ok_label = RunConfig.parse(label).kind == "fsdp" and label != "fsdp:daemon"
            except ValueError:
                ok_label = False
            if not ok_label:
                raise SystemExit(f"bench_emulated: --fsdp-held {label!r} is not fsdp or fsdp:F,B,R")
        for n in ranks:
            for rate in rates[n]:
                blocks.append(
                    run_block(
                        scenario,
                        n,
                        rate,
                        labels,
                        args.rounds,
                        args.steps,
                        args.warmup,
                        args.timeout_s,
                        burst,
                    )
                )
                _save(report, args.out)  # each block as it ends: a later failure loses nothing
        ok = True
        for b in list(blocks) if args.fsdp is not None and args.fsdp_tuned else []:
            for label in ("fsdp:daemon", *held):
                tuned.append(
                    run_tuned_block(
                        scenario,
                        b["ranks"],
                        b["rate_gbit"],
                        args.fsdp_tuned,
                        label,
                        args.warmup,
                        budget_bytes=budget,
                        jobs=args.fsdp_jobs if label == "fsdp:daemon" else 1,
                        burst=burst,
                    )
                )
                _save(report, args.out)
    _save(report, args.out)  # before the tables: they outlive a mistake in printing them
    print(format_report(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
