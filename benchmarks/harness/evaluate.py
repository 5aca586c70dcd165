"""Evaluate policies on scenarios, side by side: simulator by default, namespace testbed with --testbed.

    python -m benchmarks.harness.evaluate benchmarks/scenarios/*.toml --policy ddp grid-best bo-once oracle \
        --out results/

Writes a table to stdout, results.csv and results.json to --out, and one PNG per scenario
(each policy's throughput as a rolling mean over time with its decisions marked, the phases of
the traces shaded, the bandwidth trace underneath). For every policy: throughput,
ratio to the per-phase oracle, ratio to the best static configuration (grid-best) and ratio to the
lower bound (perfect overlap of compute and communication). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.harness.policies import (
    AUTOBYTE_AUTO,
    AUTOBYTE_RESTART,
    AUTOBYTE_WARM,
    default_grid,
    make_policy,
    start_config,
)
from benchmarks.harness.policy import Policy, PolicyContext, RunSummary
from benchmarks.harness.scenario import GBIT, Scenario, load_scenario
from benchmarks.testbed import worker_cli
from benchmarks.testbed.host import HostWatch
from simulator.engine import RunConfig, SimulatedStep, Simulator, lower_bound_step_s

logger = logging.getLogger(__name__)

REFERENCE_POLICIES = ("oracle", "grid-best")


@dataclasses.dataclass
class PolicyRun:
    policy: str
    steps: int
    elapsed_s: float
    end_times_s: list[float]
    chose: str
    mode: str = "sim"
    # (time s, configuration label) of every change the policy made during the run
    decisions: list[tuple[float, str]] = dataclasses.field(default_factory=list)

    @property
    def throughput_steps_per_s(self) -> float:
        return self.steps / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _run_until_done(
    scenario: Scenario,
    sim: Simulator,
    policy: Policy,
    decisions: list[tuple[float, str]] | None = None,
) -> list[SimulatedStep]:
    """Run the policy until the scenario ends; its changes go to `decisions` as (time s, label)."""
    sim.reset()
    config: RunConfig = policy.initial_config()
    records: list[SimulatedStep] = []
    step_limit = scenario.duration_steps
    time_limit = scenario.duration_s
    while True:
        if step_limit is not None and len(records) >= step_limit:
            break
        if time_limit is not None and sim.now_s >= time_limit:
            break
        record = sim.step(config)
        records.append(record)
        change = policy.observe(record)
        if change is not None:
            if decisions is not None and change != config:
                decisions.append((record.end_s, _testbed_label(change)))
            config = change
    return records


def simulate_static(scenario: Scenario, sim: Simulator, config: RunConfig) -> RunSummary:
    sim.reset()
    if scenario.duration_steps is not None:
        sim.run(config, steps=scenario.duration_steps)
    else:
        while sim.now_s < scenario.duration_s:
            sim.step(config)
    return RunSummary(sim.step_index, sim.now_s)


def policy_context(scenario: Scenario, sim: Simulator, horizon_s: float) -> PolicyContext:
    return PolicyContext(
        candidates=default_grid(),
        seed=scenario.seed,
        phases=tuple(scenario.phases(horizon_s)),
        evaluate_static=lambda config: simulate_static(scenario, sim, config),
        steady_step_s=lambda config, *condition: sim.steady_step_s(config, *condition),
        profile=scenario.profile,
        workers=scenario.workers,
        backend=scenario_backend(scenario),
        link=scenario.link,
    )


def scenario_backend(scenario: Scenario) -> str:
    """The backend a rank of this scenario would report: NCCL-like link costs mean a GPU job."""
    return "nccl" if scenario.link.collective_overhead_s < 100e-6 else "gloo"


def lower_bound_run(scenario: Scenario, sim: Simulator) -> RunSummary:
    """Steps and time if every step took max(compute, communication) at the bandwidth of its start."""
    t, steps = 0.0, 0
    cache: dict[tuple[float, float], float] = {}
    while True:
        if scenario.duration_steps is not None and steps >= scenario.duration_steps:
            break
        if scenario.duration_s is not None and t >= scenario.duration_s:
            break
        key = (scenario.bandwidth.at(t), sim.compute_factor_at(t))
        step_s = cache.get(key)
        if step_s is None:
            step_s = cache[key] = sim.lower_bound_step_s(t)
        t += step_s
        steps += 1
    return RunSummary(steps, t)


def simulate_scenario(
    scenario: Scenario, policy_names: Sequence[str], keep: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Every policy on the scenario's simulator. `keep`, if given, receives per policy the policy
    object and its step records (benchmarks/harness/eval_tuner.py reads the tuner's side from them)."""
    sim = scenario.make_simulator()
    lower = lower_bound_run(scenario, sim)
    horizon = scenario.duration_s if scenario.duration_s is not None else lower.elapsed_s * 4
    context = policy_context(scenario, sim, horizon)
    runs: dict[str, PolicyRun] = {}
    for name in dict.fromkeys([*policy_names, *REFERENCE_POLICIES]):
        policy = make_policy(name)
        policy.prepare(context)
        decisions: list[tuple[float, str]] = []
        records = _run_until_done(scenario, sim, policy, decisions)
        elapsed = records[-1].end_s if records else 0.0
        runs[name] = PolicyRun(
            name,
            len(records),
            elapsed,
            [r.end_s for r in records],
            policy.describe(),
            decisions=decisions,
        )
        if keep is not None:
            keep[name] = (policy, records)
    return _summarise(scenario, policy_names, runs, lower, "sim")


def _summarise(
    scenario: Scenario,
    policy_names: Sequence[str],
    runs: dict[str, PolicyRun],
    lower: RunSummary,
    mode: str,
) -> dict[str, Any]:
    def ratio(a: float, b: float | None) -> float | None:
        return a / b if b else None

    oracle = runs.get("oracle")
    grid = runs.get("grid-best")
    oracle_tp = oracle.throughput_steps_per_s if oracle else None
    grid_tp = grid.throughput_steps_per_s if grid else None
    rows = []
    for name in policy_names:
        run = runs[name]
        tp = run.throughput_steps_per_s
        rows.append(
            {
                "scenario": scenario.name,
                "mode": mode,
                "policy": name,
                "steps": run.steps,
                "elapsed_s": run.elapsed_s,
                "throughput_steps_per_s": tp,
                "samples_per_s": tp * scenario.profile.batch_size * scenario.workers,
                "ratio_to_oracle": ratio(tp, oracle_tp),
                "ratio_to_grid_best": ratio(tp, grid_tp),
                "ratio_to_lower_bound": ratio(tp, lower.throughput_steps_per_s),
                "chose": run.chose,
            }
        )
    return {
        "scenario": scenario.name,
        "path": scenario.path,
        "mode": mode,
        "model": scenario.model,
        "workers": scenario.workers,
        "compute_s": scenario.profile.compute_s,
        "gradient_bytes": scenario.profile.total_param_bytes,
        "lower_bound_steps_per_s": lower.throughput_steps_per_s,
        "headroom_oracle_over_grid_best": ratio(oracle_tp or 0.0, grid_tp),
        "rows": rows,
        "_runs": runs,
    }


# ---- testbed ---------------------------------------------------------------------------------------


def _testbed_label(config: RunConfig) -> str:
    from simulator.engine import DDPConfig

    if isinstance(config, DDPConfig):
        return "ddp"
    from benchmarks.testbed.train_worker import RunConfig as WorkerConfig

    return WorkerConfig(
        "sched", config.partition_bytes, config.credit_bytes, config.tail_bytes
    ).label


@dataclasses.dataclass
class TestbedSeries:
    """Rank 0's steps of one testbed run: times relative to the first step's start."""

    step_times_s: list[float]
    labels: list[str]
    decisions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    applied: int = 0  # reconfigure events the worker reported
    tuner: dict[str, Any] | None = None  # the daemon's view (autobyte policy)
    host: dict[str, Any] | None = (
        None  # load and CPU steal during the run (benchmarks.testbed.host.HostWatch)
    )

    @property
    def ends_s(self) -> list[float]:
        out, total = [], 0.0
        for value in self.step_times_s:
            total += value
            out.append(total)
        return out


class _OnlineDriver:
    """Feeds rank 0's `step` events to a policy (as SimulatedSteps) and appends its decisions to the
    worker's --control file; called on the harness's reader thread, so it stays short."""

    def __init__(
        self, policy: Policy, control: pathlib.Path, scenario: Scenario, initial: RunConfig
    ) -> None:
        self.policy, self.control, self.scenario = policy, control, scenario
        self.elapsed = 0.0
        self.current = initial
        self.decisions: list[dict[str, Any]] = []
        self.applied = 0
        self.errors: list[str] = []

    def on_event(self, rank: int, event: dict[str, Any]) -> None:
        if rank != 0:
            return
        kind = event.get("event")
        if kind == "reconfigure":
            self.applied += 1
        elif kind == "reconfigure_rejected":
            self.errors.append(str(event.get("error")))
        if kind != "step":
            return
        from benchmarks.testbed.wire import model_label
        from simulator.engine import DDPConfig, parse_config

        step_s = float(event["step_time_s"])
        start = self.elapsed
        self.elapsed += step_s
        config = parse_config(model_label(event["config"], self.scenario.byte_scale))
        record = SimulatedStep(
            int(event["step"]),
            start,
            self.elapsed,
            step_s,
            0.0,
            0.0,
            0.0,
            self.scenario.bandwidth.at(start),
            self.scenario.compute.at(start),
            0,
            0,
            config,
        )
        change = self.policy.observe(record)
        if change is None or change == self.current:
            return
        if isinstance(change, DDPConfig):  # --control drives the scheduler only
            self.errors.append("policy asked for ddp: not reachable through --control")
            return
        self.current = change
        self.decisions.append(
            {"after_step": record.step, "t_s": self.elapsed, "config": _testbed_label(change)}
        )
        from benchmarks.testbed.wire import wire_bytes

        scale = self.scenario.byte_scale  # the ranks run the model's sizes divided by it
        with open(self.control, "a") as handle:
            handle.write(
                json.dumps(
                    {
                        "partition_bytes": wire_bytes(change.partition_bytes, scale),
                        "credit_bytes": wire_bytes(change.credit_bytes, scale),
                    }
                )
                + "\n"
            )


def _run_on_testbed(
    scenario: Scenario,
    label: str,
    trace: Any,
    policy: Policy | None = None,
    initial: RunConfig | None = None,
    daemon: str | None = None,
    daemon_dir: pathlib.Path | None = None,
    job: str | None = None,
) -> TestbedSeries:
    """One run on a fresh testbed: a fixed configuration, an online policy through --control, or
    (`daemon`: its tuner mode) the ranks streaming to a real autobyted in the hub namespace, obeying
    it ("auto") or only reporting to it ("observe": the configuration stays `label`). The daemon's
    database is kept in `daemon_dir` when given (a later run's daemon reads what this one learned),
    the job named `job` (the scenario's name by default)."""
    import tempfile

    from benchmarks import testbed as harness
    from benchmarks.testbed.wire import model_label, wire_run_label

    watch = HostWatch()
    options = scenario.testbed
    # Labels here are in the model's bytes; an emulated scenario's ranks run them divided by its
    # byte scale (as benchmarks/bench_emulated.py runs its grids), and what they report is
    # multiplied back.
    scale = scenario.byte_scale
    workload = scenario.testbed_workload()
    workers = workload.workers
    steps = int(options.get("steps", 200 if scenario.duration_s is None else 1_000_000))
    command = worker_cli.command(
        *workload.worker_args(),
        configs=[wire_run_label(label, scale)],
        steps=steps,
        warmup=0,
        rounds=1,
        steps_events=True,
        max_seconds=scenario.duration_s,
    )
    with tempfile.TemporaryDirectory(prefix="abeval-") as tmp:
        driver = None
        if policy is not None:
            control = pathlib.Path(tmp) / "control.jsonl"
            control.touch()
            command += ["--control", str(control)]
            assert initial is not None
            driver = _OnlineDriver(policy, control, scenario, initial)
        burst = scenario.testbed_burst()
        with harness.Testbed(
            world_size=workers,
            rate=trace.changes[0].rate_bps,
            burst=harness.DEFAULT_BURST_BYTES if burst is None else burst,
        ) as bed:
            hub = None
            if daemon:
                from benchmarks.harness.autobyte_policy import HubDaemon

                hub = HubDaemon(
                    bed,
                    daemon_dir or pathlib.Path(tmp),
                    job=job or scenario.name,
                    tuner=daemon,
                    byte_scale=scale,
                ).start()
            try:
                result = bed.run(
                    command,
                    trace=trace,
                    on_event=driver.on_event if driver else None,
                    timeout_s=float(options.get("timeout_s", 900)),
                    cwd=str(pathlib.Path(__file__).resolve().parents[2]),
                    env=hub.env if hub else None,
                )
            finally:
                tuned = hub.stop() if hub else None
    events = [e for e in result.ranks[0].events if e.get("event") == "step"]
    series = TestbedSeries(
        [float(e["step_time_s"]) for e in events],
        [model_label(str(e["config"]), scale) for e in events],
        host=watch.report(),
    )
    if driver is not None:
        series.decisions, series.applied = driver.decisions, driver.applied
        if driver.errors:
            logger.warning("%s: %s", label, "; ".join(driver.errors[:3]))
    if tuned is not None:
        series.decisions, series.applied = tuned["decisions"], tuned["applied"]
        series.tuner = tuned
        counts = tuned.get("samples_by_rank", {})
        for rank, count in counts.items():  # a stream that stopped: the tuner saw less than ran
            if count < 0.9 * counts.get(0, 0):
                logger.warning(
                    "%s: autobyted stored %d samples of rank %d, %d of rank 0",
                    label,
                    count,
                    rank,
                    counts[0],
                )
    return series


def _measured_steady(
    series: dict[str, TestbedSeries], phases: list[tuple[float, ...]], settle_steps: int = 2
) -> Callable[..., float]:
    """steady_step_s for the oracle on the testbed: the median measured step time of the
    configuration's fixed run during the phases with those conditions (first steps of a phase
    skipped)."""
    import statistics

    def steady(config: RunConfig, *condition: float) -> float:
        run = series.get(_testbed_label(config))
        if run is None:
            return math.inf
        times = []
        for start, end, *phase_condition in phases:
            if tuple(phase_condition) != condition:
                continue
            inside = [t for t, e in zip(run.step_times_s, run.ends_s) if start < e - t and e <= end]
            times += inside[settle_steps:]
        return statistics.median(times) if times else math.inf

    return steady


def _decision_time_s(decision: dict[str, Any], ends_s: Sequence[float]) -> float:
    """When a testbed decision took effect: the driver's own time, or (a daemon's decision, read from
    its database) the end of the step before the one it applied at."""
    if "t_s" in decision:
        return float(decision["t_s"])
    step = decision.get("applied_at_step") or decision.get("apply_at_step") or 0
    return ends_s[min(step, len(ends_s)) - 1] if ends_s and step > 0 else 0.0


def _run_name(scenario: Scenario, key: str) -> str:
    """A run's name in file names: the scenario's and the policy's, no '/', ':' or ','."""
    return f"{scenario.name}--{key.replace('/', '_').replace(':', '_').replace(',', '_')}"


def _cache_path(cache: pathlib.Path, scenario: Scenario, key: str) -> pathlib.Path:
    return cache / f"{_run_name(scenario, key)}.json"


def _cached_run(
    cache: pathlib.Path | None, scenario: Scenario, key: str, run: Callable[[], TestbedSeries]
) -> TestbedSeries:
    """A testbed run, or its result from an earlier command (`--testbed-cache DIR`), so that long
    traces can be measured one policy per command and combined afterwards."""
    if cache is None:
        return run()
    path = _cache_path(cache, scenario, key)
    if path.exists():
        logger.info("%s: %s from %s", scenario.name, key, path)
        return TestbedSeries(**json.loads(path.read_text()))
    series = run()
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(series)) + "\n")
    return series


def _autobyte_label(name: str) -> str:
    """The testbed label an autobyte policy starts from: 'autobyte' the scheduler's default,
    'autobyte:auto' the sizes each rank derives (start.py), 'autobyte:P,C' / 'autobyte-warm:P,C'
    P,C."""
    from simulator.adapter import SCHEDULER_DEFAULT

    prefix = next((p for p in SECOND_RUNS if name.startswith(p)), "autobyte:")
    if name == "autobyte":
        return _testbed_label(SCHEDULER_DEFAULT)
    if name[len(prefix) :] == "auto":
        return "sched:auto"  # each rank derives its sizes from the job (start.py)
    return _testbed_label(start_config(name, prefix))


# The policies that measure a job's second run against the daemon that tuned its first.
SECOND_RUNS = (AUTOBYTE_WARM, AUTOBYTE_RESTART)


def restart_workers(scenario: Scenario) -> int:
    """The rank count of an 'autobyte-restart:' policy's first run ([testbed] restart_from_workers);
    ValueError naming the scenario when it is missing or the scenario's own count."""
    value = scenario.testbed.get("restart_from_workers")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"{scenario.name}: {AUTOBYTE_RESTART}P,C needs [testbed] restart_from_workers, the rank "
            f"count of the job's first run (an int >= 1), got {value!r}"
        )
    if value == scenario.workers:
        raise ValueError(
            f"{scenario.name}: restart_from_workers = {value} is the scenario's own rank count "
            f"(that is {AUTOBYTE_WARM}P,C)"
        )
    return value


def _warm_pair(
    cache: pathlib.Path | None,
    scenario: Scenario,
    trace: Any,
    label: str,
    cold_key: str,
    first_workers: int | None = None,
) -> TestbedSeries:
    """'autobyte-warm:P,C': the job run twice against one daemon (one database), the second run
    under another job name (a second job of the same model and rank count), both from `label`;
    returns the second. The first is stored under its cold twin's key (it is that policy's run),
    and both runs happen again unless the second is cached (the daemon's database is not).
    'autobyte-restart:P,C' (`first_workers`): the first run at that rank count, the second at the
    scenario's (the job restarted at another scale); the first is stored under the second's key
    and "-first"."""
    import tempfile

    restart = first_workers is not None
    kind = "policy-autobyte-restart" if restart else "policy-autobyte-warm"
    warm_key = cold_key.replace("policy-autobyte", kind, 1)
    pair: list[TestbedSeries] = []
    first = dataclasses.replace(scenario, workers=first_workers) if restart else scenario

    def both() -> TestbedSeries:
        with tempfile.TemporaryDirectory(prefix="abwarm-") as daemon_dir:
            for run_scenario, job in ((first, scenario.name), (scenario, f"{scenario.name}-again")):
                pair.append(
                    _run_on_testbed(
                        run_scenario,
                        label,
                        trace,
                        daemon="auto",
                        daemon_dir=pathlib.Path(daemon_dir),
                        job=job,
                    )
                )
        return pair[1]

    second = _cached_run(cache, scenario, warm_key, both)
    if pair and cache is not None:  # the first run of this pair replaces an older cold run
        first_path = _cache_path(cache, scenario, f"{warm_key}-first" if restart else cold_key)
        first_path.write_text(json.dumps(dataclasses.asdict(pair[0])) + "\n")
    return second


def _kept(root: pathlib.Path | None, scenario: Scenario, key: str) -> pathlib.Path | None:
    """Where an autobyte run's daemon keeps its database and log (`--keep-daemon`), created."""
    if root is None:
        return None
    path = root / _run_name(scenario, key)
    path.mkdir(parents=True, exist_ok=True)
    return path


def testbed_scenario(
    scenario: Scenario,
    policy_names: Sequence[str],
    cache: pathlib.Path | None = None,
    references: bool = True,
    keep_daemon: pathlib.Path | None = None,
) -> dict[str, Any]:
    """Run every policy on the namespace testbed under the scenario's bandwidth trace.

    The scenario's [testbed] table says which harness model to train (model, model_args,
    batch_size), for how long (the scenario's duration_s: every run stops at the same time, via the
    worker's --max-seconds; or `steps`), the fixed configurations grid-best tries (grid, "sched:P,C"
    labels) and bo-once's trial length (bo_trial_steps, bo_settle_steps; 100/10 in the simulator
    are too long for a testbed run). Fixed policies run their configuration for the whole run.
    bo-once and oracle are the simulator's policy classes, driven online: the harness turns rank 0's
    `step` events into SimulatedSteps for policy.observe() and appends each decision to the worker's
    --control file, which rank 0 applies with reconfigure() before its next step. The oracle's
    per-phase choice comes from the grid runs measured just before (median step time of every grid
    configuration in every phase), over the grid's scheduler configurations only (--control cannot
    switch to DDP).

    `cache`: results of earlier commands are reused and new ones stored (one policy per command
    for long traces); `references=False` runs only the named policies (no oracle / grid-best).
    """
    from benchmarks.harness.policies import BayesOptOncePolicy
    from simulator.engine import parse_config

    options = scenario.testbed
    horizon = scenario.duration_s if scenario.duration_s is not None else math.inf
    phases = scenario.phases(horizon)
    trace = scenario.testbed_trace(horizon)
    grid_labels = list(
        options.get(
            "grid",
            [
                "sched:none,none",
                "sched:1MiB,4MiB",
                "sched:4MiB,8MiB",
                "sched:4MiB,16MiB",
                "sched:16MiB,32MiB",
                "sched:16MiB,none",
            ],
        )
    )
    wanted = list(dict.fromkeys([*policy_names, *(REFERENCE_POLICIES if references else ())]))
    if any(name.startswith(AUTOBYTE_RESTART) for name in wanted):
        restart_workers(scenario)  # a scenario without the first run's rank count: before any run
    fixed: dict[str, list[str]] = {}
    for name in wanted:
        if name == "ddp":
            fixed[name] = ["ddp"]
        elif name.startswith(("static:", "observe:")):
            fixed[name] = [_testbed_label(make_policy(name).initial_config())]
        elif name == "grid-best":
            fixed[name] = grid_labels
    measured: dict[str, TestbedSeries] = {}
    for label in dict.fromkeys(
        label for name, group in fixed.items() if not name.startswith("observe:") for label in group
    ):
        logger.info("%s: fixed %s", scenario.name, label)
        measured[label] = _cached_run(
            cache, scenario, label, lambda label=label: _run_on_testbed(scenario, label, trace)
        )
    observed: dict[str, TestbedSeries] = {}  # observe:P,C -- P,C held, a daemon observing beside it
    for name in (name for name in fixed if name.startswith("observe:")):
        label = fixed[name][0]
        logger.info("%s: fixed %s, reported to autobyted --tuner observe", scenario.name, label)
        observed[name] = _cached_run(
            cache,
            scenario,
            f"observe-{label}",
            lambda label=label: _run_on_testbed(scenario, label, trace, daemon="observe"),
        )

    def as_run(name: str, series: TestbedSeries, chose: str) -> PolicyRun:
        ends = series.ends_s
        return PolicyRun(
            name,
            len(ends),
            ends[-1] if ends else 0.0,
            ends,
            chose,
            "testbed",
            [(_decision_time_s(d, ends), d["config"]) for d in series.decisions],
        )

    def throughput(series: TestbedSeries) -> float:
        ends = series.ends_s
        return len(ends) / ends[-1] if ends and ends[-1] > 0 else 0.0

    runs: dict[str, PolicyRun] = {}
    extra: dict[str, Any] = {}
    hosts: dict[str, Any] = {}  # the host during each policy's run (older cached runs: none)
    tuned: dict[str, TestbedSeries] = {}  # the autobyte policies' runs
    for name, group in fixed.items():
        if name in observed:
            series = observed[name]
            hosts[name] = series.host
            detail = (series.tuner or {}).get("detail", "?")
            # Its decisions are recommendations, never applied: the run switched nothing.
            runs[name] = as_run(
                name,
                dataclasses.replace(series, decisions=[]),
                f"{group[0]} held; the observing tuner: {detail}; "
                f"{len(series.decisions)} recommendations",
            )
            extra[name] = {
                "decisions": series.decisions,
                "applied": series.applied,
                "tuner": series.tuner or {},
            }
            continue
        best = max(group, key=lambda lab: throughput(measured[lab]))
        runs[name] = as_run(name, measured[best], best)
        hosts[name] = measured[best].host
    # A warm policy's first run is its cold twin's (autobyte:P,C): run first, so that a cold twin
    # asked for in the same command reads it from the cache instead of running again.
    for name in sorted(
        (n for n in wanted if n not in fixed), key=lambda n: not n.startswith(SECOND_RUNS)
    ):
        policy: Policy
        if name == "autobyte" or name.startswith(("autobyte:", *SECOND_RUNS)):
            label = _autobyte_label(name)
            logger.info(
                "%s: %s (a real autobyted in the hub namespace) from %s",
                scenario.name,
                "autobyte, the job's second run" if name.startswith(SECOND_RUNS) else "autobyte",
                label,
            )
            key = "policy-autobyte" if name == "autobyte" else f"policy-autobyte-{label}"
            if name.startswith(AUTOBYTE_RESTART):
                series = _warm_pair(cache, scenario, trace, label, key, restart_workers(scenario))
            elif name.startswith(AUTOBYTE_WARM):
                series = _warm_pair(cache, scenario, trace, label, key)
            else:
                series = _cached_run(
                    cache,
                    scenario,
                    key,
                    lambda label=label, key=key: _run_on_testbed(
                        scenario,
                        label,
                        trace,
                        daemon="auto",
                        daemon_dir=_kept(keep_daemon, scenario, key),
                    ),
                )
            tuner = series.tuner or {}
            tuned[name] = series
            hosts[name] = series.host
            runs[name] = as_run(
                name, series, f"{tuner.get('detail', '?')}; {len(series.decisions)} decisions"
            )
            extra[name] = {"decisions": series.decisions, "applied": series.applied, "tuner": tuner}
            continue
        if name == "bo-once":
            policy = BayesOptOncePolicy(
                trial_steps=int(options.get("bo_trial_steps", 10)),
                settle_steps=int(options.get("bo_settle_steps", 2)),
            )
            context = PolicyContext(candidates=default_grid(include_ddp=False), seed=scenario.seed)
        elif name == "oracle":
            policy = make_policy(name)
            # The oracle switches configurations live, which DDP cannot be (its buckets are built
            # once): DDP's bucket sizes in a grid are grid-best's candidates, not the oracle's.
            candidates = tuple(
                parse_config(lab) for lab in grid_labels if lab.split(":")[0] != "ddp"
            )
            context = PolicyContext(
                candidates=candidates,
                seed=scenario.seed,
                phases=tuple(phases),
                steady_step_s=_measured_steady(measured, phases),
            )
        else:
            raise ValueError(f"policy {name!r} has no testbed driver")
        policy.prepare(context)
        initial = policy.initial_config()
        label = _testbed_label(initial)
        logger.info("%s: online %s from %s", scenario.name, name, label)
        ran: list[bool] = []

        def run_online() -> TestbedSeries:  # called (or not) by _cached_run within this iteration
            ran.append(True)  # noqa: B023
            return _run_on_testbed(scenario, label, trace, policy=policy, initial=initial)  # noqa: B023

        series = _cached_run(cache, scenario, f"policy-{name}", run_online)
        # A run read from the cache has no policy object that saw it: say what it decided instead.
        described = policy.describe() if ran or cache is None else "(cached run)"
        hosts[name] = series.host
        runs[name] = as_run(
            name,
            series,
            f"{described}; {len(series.decisions)} decisions, {series.applied} applied",
        )
        extra[name] = {"decisions": series.decisions, "applied": series.applied}
    # The lower bound uses the scenario's (simulator) profile of the trained model.
    sim = scenario.make_simulator()
    bounded = (
        scenario
        if scenario.duration_s is not None
        else dataclasses.replace(scenario, duration_steps=max(run.steps for run in runs.values()))
    )
    lower = lower_bound_run(bounded, sim)
    summary = _summarise(scenario, list(policy_names), runs, lower, "testbed")
    summary["online"] = extra
    summary["hosts"] = hosts
    summary["fixed_runs"] = {
        label: {
            "steps": len(s.step_times_s),
            "elapsed_s": sum(s.step_times_s),
            "steps_per_s": throughput(s),
        }
        for label, s in measured.items()
    }
    if len(phases) == 1 and grid_labels and all(lab in measured for lab in grid_labels):
        # One context for the whole run: how soon each tuner ran within 3% of the grid's best.
        best = max(grid_labels, key=lambda lab: throughput(measured[lab]))
        target_s = statistics.median(measured[best].step_times_s[REACH_SETTLE_STEPS:])
        summary["reach"] = {
            name: {"target_s": target_s, "grid_best": best, **steps_to_reach(series, target_s)}
            for name, series in tuned.items()
        }
    return summary


REACH_WITHIN = 0.03  # "within 3% of the grid-best" (the tuner-at-scale goal)
REACH_SETTLE_STEPS = 2  # a configuration's first steps (a run's, a switch's) are not its own


def steps_to_reach(series: TestbedSeries, target_s: float) -> dict[str, Any]:
    """{"step": the first step at which the run started or switched to a configuration whose
    steps in this run (each stretch's first REACH_SETTLE_STEPS left out) have a median within
    REACH_WITHIN of `target_s`, "config": that configuration} ({"step": None} if it never did).
    Measured on the run's own steps, so a configuration outside the grid counts too."""
    stretches: list[tuple[int, str]] = []
    own: dict[str, list[float]] = {}
    for i, (step_s, label) in enumerate(zip(series.step_times_s, series.labels)):
        if not stretches or stretches[-1][1] != label:
            stretches.append((i, label))
        if i - stretches[-1][0] >= REACH_SETTLE_STEPS:
            own.setdefault(label, []).append(step_s)
    for start, label in stretches:
        times = own.get(label)
        if times and statistics.median(times) <= target_s * (1 + REACH_WITHIN):
            return {"step": start, "config": label}
    return {"step": None, "config": None}


# ---- reports ---------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(results: Sequence[dict[str, Any]]) -> str:
    header = (
        f"{'scenario':<28} {'policy':<20} {'steps/s':>9} {'vs oracle':>9} {'vs grid':>8} "
        f"{'vs bound':>8}  chose"
    )
    lines = [header, "-" * len(header)]
    for result in results:
        for row in result["rows"]:
            lines.append(
                f"{row['scenario']:<28} {row['policy']:<20} "
                f"{_fmt(row['throughput_steps_per_s'], 3):>9} "
                f"{_fmt(row['ratio_to_oracle']):>9} {_fmt(row['ratio_to_grid_best']):>8} "
                f"{_fmt(row['ratio_to_lower_bound']):>8}  {row['chose']}"
            )
        lines.append(
            f"{'':<28} {'(headroom oracle/grid-best)':<29}"
            f"{_fmt(result['headroom_oracle_over_grid_best']):>9}    "
            f"lower bound {_fmt(result['lower_bound_steps_per_s'])} steps/s"
        )
        for policy, reach in result.get("reach", {}).items():
            lines.append(
                f"{'':<28} {policy}: within {REACH_WITHIN:.0%} of the grid-best "
                f"({reach['grid_best']}, {reach['target_s']:.3f} s/step) "
                + (
                    f"from step {reach['step']} ({reach['config']})"
                    if reach["step"] is not None
                    else "never"
                )
            )
        for policy, host in result.get("hosts", {}).items():  # testbed runs: the host during each
            lines.append(f"{'':<28} host during {policy}: {HostWatch.describe(host)}")
    return "\n".join(lines)


def rolling_throughput(
    end_times_s: Sequence[float], window_steps: int
) -> tuple[list[float], list[float]]:
    """(t, steps/s) at every step end from the window_steps-th on: window_steps divided by the time
    those steps took. Unlike counting whole steps in fixed time bins (which jumps between 2, 4, 6 …
    steps/s when a step takes ~0.3 s), evenly spaced steps give a flat line."""
    if window_steps < 1:
        raise ValueError(f"window_steps={window_steps} must be at least 1")
    ends = [0.0, *end_times_s]
    times, rates = [], []
    for index in range(window_steps, len(ends)):
        span = ends[index] - ends[index - window_steps]
        if span > 0:
            times.append(ends[index])
            rates.append(window_steps / span)
    return times, rates


def draw_scenario(result: dict[str, Any], scenario: Scenario):
    """The figure of one scenario: each policy's throughput (rolling mean over 1/40 of its steps,
    3 to 25), the lower bound, the phases of the traces shaded on both panels, each policy's
    decisions marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs: dict[str, PolicyRun] = result["_runs"]
    end = max((run.elapsed_s for run in runs.values()), default=1.0) or 1.0
    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(9, 6), gridspec_kw={"height_ratios": [3, 1]}
    )
    for index, (start, stop, bandwidth, factor, *_conditions) in enumerate(scenario.phases(end)):
        for axis in (top, bottom):
            if index % 2:
                axis.axvspan(start, stop, color="0.92", zorder=0, label="_phase")
        if stop - start >= end / 8:  # name the wide phases; the bottom panel shows every one
            top.annotate(
                f"{bandwidth / GBIT:.3g} Gbit/s"
                + (f", compute x{factor:.3g}" if factor != 1 else ""),
                (start, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -10),
                textcoords="offset points",
                fontsize=7,
                color="0.35",
            )
    for name in [row["policy"] for row in result["rows"]]:
        run = runs[name]
        window = max(3, min(25, len(run.end_times_s) // 40))
        times, rates = rolling_throughput(run.end_times_s, window)
        (line,) = top.plot(times, rates, label=f"{name} (mean of {window} steps)", linewidth=1.2)
        if run.decisions and times:
            at = [t for t, _ in run.decisions]
            top.plot(
                at,
                np.interp(at, times, rates),
                linestyle="none",
                marker="v",
                markersize=6,
                color=line.get_color(),
                label=f"{name}: {len(at)} decision(s)",
            )
    grid = np.linspace(0.0, end, 600)
    bound = [
        1.0
        / lower_bound_step_s(
            scenario.profile, scenario.workers, scenario.bandwidth.at(t), scenario.compute.at(t)
        )
        for t in grid
    ]
    top.plot(grid, bound, color="grey", linestyle=":", drawstyle="steps-post", label="lower bound")
    top.set_ylabel("throughput (steps/s, rolling mean)")
    top.set_title(
        f"{scenario.name}: {scenario.model}, {scenario.workers} workers ({result['mode']})"
    )
    top.legend(fontsize=7, loc="best")
    bottom.plot(
        grid, [scenario.bandwidth.at(t) / GBIT for t in grid], color="black", drawstyle="steps-post"
    )
    bottom.set_ylabel("bandwidth (Gbit/s)")
    bottom.set_xlabel("time (s)")
    if not scenario.compute.is_constant:
        twin = bottom.twinx()
        twin.plot(
            grid, [scenario.compute.at(t) for t in grid], color="tab:red", drawstyle="steps-post"
        )
        twin.set_ylabel("compute slowdown", color="tab:red")
    fig.tight_layout()
    return fig


def plot_scenario(result: dict[str, Any], scenario: Scenario, path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig = draw_scenario(result, scenario)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_outputs(
    results: Sequence[dict[str, Any]], scenarios: Sequence[Scenario], out: pathlib.Path
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [row for result in results for row in result["rows"]]
    with open(out / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    public = [{k: v for k, v in result.items() if not k.startswith("_")} for result in results]
    (out / "results.json").write_text(json.dumps({"scenarios": public}, indent=1) + "\n")
    for result, scenario in zip(results, scenarios):
        plot_scenario(result, scenario, out / f"{scenario.name}.png")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.harness.evaluate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("scenarios", nargs="+", help="scenario TOML files")
    parser.add_argument(
        "--policy",
        nargs="+",
        action="extend",
        default=None,
        help="ddp, static:P,C (e.g. static:4MiB,16MiB), observe:P,C (static, reported to a "
        "daemon in observe mode), grid-best, bo-once, oracle, autobyte (the daemon's "
        "tuner), autobyte:P,C (from P,C), autobyte:auto (from the derived sizes; --testbed "
        "only), autobyte-warm:P,C or autobyte-warm:auto (the job's second run against the "
        "daemon that tuned its first: the warm start; --testbed only; its first run is "
        "autobyte:P,C's), autobyte-restart:P,C or autobyte-restart:auto (the same, its first run "
        "at [testbed] restart_from_workers ranks: the job restarted at another scale); "
        "--policy a b and --policy a --policy b both work "
        "[default: ddp grid-best bo-once oracle]",
    )
    parser.add_argument(
        "--testbed",
        action="store_true",
        help="run on the namespace testbed (root) instead of the simulator",
    )
    parser.add_argument("--out", default="results", help="directory for csv, json and png")
    parser.add_argument(
        "--testbed-cache",
        default=None,
        metavar="DIR",
        help="with --testbed: reuse the runs stored in DIR by earlier commands, store new ones",
    )
    parser.add_argument(
        "--keep-daemon",
        default=None,
        metavar="DIR",
        help="with --testbed: keep each autobyte run's daemon database and log in "
        "DIR/SCENARIO--POLICY (for `autobyted start --db sqlite:///...` and `autobyte status`, "
        "`history`, `plot` afterwards)",
    )
    parser.add_argument(
        "--skip-references",
        action="store_true",
        help="with --testbed: run only the named policies (no oracle / grid-best)",
    )
    args = parser.parse_args(argv)
    args.policy = list(dict.fromkeys(args.policy or ["ddp", "grid-best", "bo-once", "oracle"]))
    if args.keep_daemon and not args.testbed:
        parser.error("--keep-daemon keeps the testbed's daemons: it needs --testbed")
    try:
        for name in args.policy:
            if args.testbed and name.startswith(SECOND_RUNS):
                _autobyte_label(name)  # a bad P,C is named here, before any run
            elif not (args.testbed and name == AUTOBYTE_AUTO):
                make_policy(name)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        scenarios = [load_scenario(path) for path in args.scenarios]
    except ValueError as exc:
        print(f"python -m benchmarks.harness.evaluate: error: {exc}", file=sys.stderr)
        return 2
    results = []
    for scenario in scenarios:
        started = time.perf_counter()
        if args.testbed:
            result = testbed_scenario(
                scenario,
                args.policy,
                pathlib.Path(args.testbed_cache) if args.testbed_cache else None,
                references=not args.skip_references,
                keep_daemon=pathlib.Path(args.keep_daemon) if args.keep_daemon else None,
            )
        else:
            result = simulate_scenario(scenario, args.policy)
        logger.info("%s done in %.1f s", scenario.name, time.perf_counter() - started)
        results.append(result)
    print(format_table(results))
    write_outputs(results, scenarios, pathlib.Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
