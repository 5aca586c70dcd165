"""Measurements of the tuner that are not the evaluation table (that is benchmarks/harness/eval_tuner.py):

    python -m benchmarks.bench_tuner predictor            # step-time error: held-out configs, left-out models
    python -m benchmarks.bench_tuner predictor --testbed  # ... and on real testbed measurements (root)
    python -m benchmarks.bench_tuner warmstart            # cold vs warm start (simulator)
    python -m benchmarks.bench_tuner warmstart --testbed  # a second real job after a first (root)
    python -m benchmarks.bench_tuner cpu                  # tuner CPU per decision (p50/p99)
    python -m benchmarks.bench_tuner daemon --jobs 100    # a real autobyted with 100 concurrent jobs
    python -m benchmarks.bench_tuner drift --loopback     # false alarms on a real stationary job, true ones injected
    python -m benchmarks.bench_tuner hostload             # the host-load sampler's per-step cost

Every mode prints a table and the load average before and after. Numbers for reports are measured
under the exclusive lock (flock -x /work/cpu.lock ...), see /work/COORDINATION.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.testbed import worker_cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The testbed MLP the tuner's testbed studies train (the quick start's model).
TESTBED_MLP = {
    "model": "mlp",
    "model_args": {"in_features": 512, "hidden": 1024, "depth": 3},
    "batch_size": 128,
}


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else math.nan


# ---------------------------------------------------------------------------------- predictor


def _errors(ensemble, windows, reference_config, held_out) -> list[float]:
    """|predicted / measured - 1| of every held-out configuration, predicted from the reference's
    window of the same context."""
    from autobyted.tuner.features import feature_matrix

    by_job: dict[str, list] = {}
    for w in windows:
        by_job.setdefault(w.job, []).append(w)
    errors = []
    for ws in by_job.values():
        refs = [w for w in ws if w.config == reference_config]
        targets = [w for w in ws if w.config in held_out and w.config != reference_config]
        if not refs or not targets:
            continue
        ref = refs[0]
        mean, _ = ensemble.predict(
            feature_matrix(ref.context, ref.config, [t.config for t in targets])
        )
        errors += [
            abs(ref.step_time_s * math.exp(float(m)) / t.step_time_s - 1)
            for m, t in zip(mean, targets)
        ]
    return errors


def predictor_sim(args) -> None:
    from autobyted.tuner.predictor import load_prior, train_online
    from simulator import train_prior
    from simulator.adapter import SCHEDULER_DEFAULT

    prior = load_prior()
    rows = []
    # Held-out configurations of known jobs: fresh contexts (another seed than the prior's); the
    # online model sees 4 configurations of each job, the error is on the other 4.
    windows = train_prior.generate_windows(seed=args.seed, contexts=args.contexts)
    rng = random.Random(args.seed)
    known, held = [], []
    by_job: dict[str, list] = {}
    for w in windows:
        by_job.setdefault(w.job, []).append(w)
    held_configs: dict[str, set] = {}
    for job, ws in by_job.items():
        others = [w for w in ws if w.config != SCHEDULER_DEFAULT]
        rng.shuffle(others)
        seen = {SCHEDULER_DEFAULT} | {w.config for w in others[:3]}
        held_configs[job] = {w.config for w in others[3:]}
        known += [w for w in ws if w.config in seen]
        held += [w for w in ws if w.config not in seen or w.config == SCHEDULER_DEFAULT]
    online = train_online(prior, known, now_s=0.0)

    def held_errors(ensemble):
        out = []
        for job, configs in held_configs.items():
            out += _errors(ensemble, [w for w in held if w.job == job], SCHEDULER_DEFAULT, configs)
        return out

    for name, ensemble in (
        ("prior only", prior),
        ("prior + online (4 configs of each job)", online),
    ):
        errors = held_errors(ensemble)
        rows.append(
            (
                "held-out configs of known jobs",
                name,
                len(errors),
                np.median(errors),
                pct(errors, 90),
            )
        )
    # A model left out of the prior's training entirely.
    for model in args.left_out:
        started = time.perf_counter()
        without = train_prior.train(exclude=[model])
        test = train_prior.generate_windows(
            seed=args.seed + 1, contexts=args.contexts * 3, only=[model]
        )
        configs = {w.config for w in test}
        errors = _errors(without, test, SCHEDULER_DEFAULT, configs)
        rows.append(
            (
                f"left-out model {model}",
                f"prior without it ({time.perf_counter() - started:.0f} s)",
                len(errors),
                np.median(errors),
                pct(errors, 90),
            )
        )
        errors = _errors(prior, test, SCHEDULER_DEFAULT, configs)
        rows.append(
            (
                f"  same contexts, {model}",
                "shipped prior (saw the model)",
                len(errors),
                np.median(errors),
                pct(errors, 90),
            )
        )
    print(f"{'what':<36} {'predictor':<40} {'n':>5} {'median':>7} {'p90':>7}")
    for what, name, n, median, p90 in rows:
        print(f"{what:<36} {name:<40} {n:5d} {100 * median:6.1f}% {100 * p90:6.1f}%")


def predictor_testbed(args) -> None:
    """Real measurements: the testbed MLP, 2 ranks, every configuration of a small grid interleaved
    at two rates, each a window of the scheduler's own StepMetrics; the prior's error (and a model
    trained online on the other rate's windows) predicting each configuration from the default."""
    from autobyte.types import Config, StepMetrics, parse_bytes

    from autobyted.storage.records import Fingerprint
    from autobyted.tuner.features import JobShape, summarize
    from autobyted.tuner.predictor import Window, load_prior, train_online
    from benchmarks.testbed import Testbed
    from simulator.adapter import SCHEDULER_DEFAULT

    grid = [
        "sched:4MiB,16MiB",
        "sched:none,none",
        "sched:256KiB,1MiB",
        "sched:1MiB,2MiB",
        "sched:1MiB,4MiB",
        "sched:4MiB,4MiB",
        "sched:16MiB,none",
        "sched:none,4MiB",
    ]
    windows = []
    for rate in args.rates:
        command = worker_cli.command(
            **TESTBED_MLP,
            configs=list(grid),
            rounds=args.rounds,
            steps=12,
            warmup=3,
            full_metrics=True,
        )
        with Testbed(world_size=2, rate=rate) as bed:
            result = bed.run(command, timeout_s=900, cwd=str(ROOT))
        started = next(e for e in result.ranks[0].events if e.get("event") == "train_start")
        gradient = int(started["gradient_bytes"])
        shape = JobShape.from_fingerprint(
            2, "gloo", Fingerprint(gradient // 4, gradient, 8, gradient // 2, gradient // 16, "mlp")
        )
        for item in result.ranks[0].results:
            label = item["config"]
            partition, credit = (parse_bytes(x) for x in label[len("sched:") :].split(","))
            samples = []
            for m in item.get("metrics", []):
                m = dict(m)
                m["config"] = (
                    Config(**m["config"])
                    if isinstance(m.get("config"), dict)
                    else Config(partition, credit)
                )
                samples.append(
                    StepMetrics(
                        **{k: v for k, v in m.items() if k in StepMetrics.__dataclass_fields__}
                    )
                )
            if samples:
                windows.append(
                    Window(
                        f"{rate}-round{item['round']}",
                        0,
                        Config(partition, credit),
                        summarize(samples, shape),
                        item["median_step_s"],
                        len(samples),
                        time.time(),
                    )
                )
    prior = load_prior()
    configs = {w.config for w in windows}
    print(f"load {load()}; {len(windows)} windows")
    print(f"{'test rate':<10} {'predictor':<44} {'n':>4} {'median':>7} {'p90':>7}")
    for rate in args.rates:
        test = [w for w in windows if w.job.startswith(rate)]
        train = [w for w in windows if not w.job.startswith(rate)]
        for name, ensemble in (
            ("prior only", prior),
            ("prior + online on the other rate's windows", train_online(prior, train, now_s=0.0)),
        ):
            if ensemble is None:
                continue
            errors = _errors(ensemble, test, SCHEDULER_DEFAULT, configs)
            print(
                f"{rate:<10} {name:<44} {len(errors):4d} {100 * np.median(errors):6.1f}% {100 * pct(errors, 90):6.1f}%"
            )


# ---------------------------------------------------------------------------------- warm start


def _first_search(policy, records) -> tuple[int, int]:
    """(trials, steps) until the tuner first settled (holding / no headroom)."""
    log = policy.config_log
    statuses = policy.sink.statuses
    trials = 0
    for status in statuses:
        if status.state in ("holding", "no headroom"):
            break
        trials = max(trials, status.trials_done)
    settled_step = next(
        (
            d.applied_at_step
            for d in policy.sink.decisions
            if d.kind in ("switch", "return") and d.applied_at_step is not None
        ),
        None,
    )
    if settled_step is None:  # the last trial won and was held where it was
        trial_steps = [step for step, _config, kind in log if kind == "trial"]
        settled_step = (trial_steps[0] + policy.params.trial_steps + 20) if trial_steps else 0
    return trials or sum(1 for _s, _c, k in log if k == "trial"), settled_step


def warmstart_sim(args) -> None:
    from benchmarks.harness.autobyte_policy import AutobytePolicy
    from benchmarks.harness.evaluate import _run_until_done, lower_bound_run, policy_context
    from benchmarks.harness.gen_scenarios import scenario_text
    from benchmarks.harness.scenario import load_scenario
    from simulator import train_prior

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="warmstart-"))
    rng = random.Random(args.seed)
    paths = []
    for index in range(args.scenarios):
        name, text = scenario_text(rng, index, stationary=True)
        (tmp / f"{name}.toml").write_text(text.replace("duration_s = 3600", "duration_s = 600"))
        paths.append(tmp / f"{name}.toml")
    from autobyte.types import Config, parse_bytes

    from simulator.adapter import SCHEDULER_DEFAULT

    initial = SCHEDULER_DEFAULT
    if args.sim_start:
        partition, credit = args.sim_start.split(",")
        initial = Config(parse_bytes(partition), parse_bytes(credit))
    priors = {"shipped prior": None}
    if args.left_out:
        priors[f"prior without {args.left_out}"] = train_prior.train(exclude=[args.left_out])

    def run(path, prior, history, job):
        scenario = load_scenario(path)
        sim = scenario.make_simulator()
        lower = lower_bound_run(scenario, sim)
        context = policy_context(scenario, sim, scenario.duration_s or lower.elapsed_s * 4)
        policy = AutobytePolicy(prior=prior, history=history, seed=0, job=job, initial=initial)
        policy.prepare(context)
        records = _run_until_done(scenario, sim, policy)
        oracle = min(
            sim.steady_step_s(c, scenario.bandwidth.at(0), 1.0) for c in context.candidates
        )
        end = records[-1].step_time_s
        return policy, records, end / oracle

    print(
        f"load {load()}; {len(paths)} stationary scenarios (600 s), start {initial}, "
        f"models {sorted({load_scenario(p).model for p in paths})}"
    )
    print(
        f"{'prior':<28} {'start':<6} {'trials median':>13} {'mean':>6} {'steps to settle median':>23} "
        f"{'final/oracle median':>20}"
    )
    for label, prior in priors.items():
        cold = [run(p, prior, (), f"{p.stem}-cold") for p in paths]
        # warm: the history of every *other* scenario's job (the windows its run measured);
        # second: the same, plus the first (cold) job of this very scenario: a second job of a
        # model and conditions the daemon has seen
        warm, second = [], []
        for index, path in enumerate(paths):
            history = [
                w
                for j, (policy, _r, _x) in enumerate(cold)
                if j != index
                for w in policy.sink.windows
            ]
            warm.append(run(path, prior, history, f"{path.stem}-warm"))
            second.append(
                run(path, prior, history + list(cold[index][0].sink.windows), f"{path.stem}-second")
            )
        for start, results in (("cold", cold), ("warm", warm), ("second", second)):
            searches = [_first_search(policy, records) for policy, records, _x in results]
            trials = [t for t, _s in searches]
            steps = [s for _t, s in searches]
            print(
                f"{label:<28} {start:<6} {statistics.median(trials):13.1f} {statistics.mean(trials):6.2f} "
                f"{statistics.median(steps):23.0f} {statistics.median(x for _p, _r, x in results):20.3f}"
            )
    print(f"load {load()}")


def warmstart_testbed(args) -> None:
    """Two jobs of the same model, one after the other, on one real autobyted (fresh database): the
    second starts with a predictor retrained on the first one's windows."""
    from autobyted.storage.db import make_engine
    from autobyted.storage.sql import SqlStorage
    from benchmarks.harness.autobyte_policy import HubDaemon
    from benchmarks.testbed import Testbed

    work = pathlib.Path(tempfile.mkdtemp(prefix="warmstart-tb-"))
    command = worker_cli.command(
        **TESTBED_MLP,
        configs=[args.start],
        steps=1_000_000,
        warmup=0,
        rounds=1,
        steps_events=True,
        max_seconds=args.seconds,
    )
    rows = []
    print(f"load {load()}")
    with Testbed(world_size=2, rate=args.rate) as bed:
        hub = HubDaemon(bed, work, job="first", extra_args=["--config", str(work / "daemon.toml")])
        (work / "daemon.toml").write_text("tuner_retrain_s = 5\n")
        hub.start()
        for job in ("first", "second"):
            env = dict(hub.env, AUTOBYTE_JOB=job)
            result = bed.run(command, env=env, timeout_s=args.seconds + 120, cwd=str(ROOT))
            steps = [e for e in result.ranks[0].events if e.get("event") == "step"]
            rows.append((job, steps))
            time.sleep(12)  # the trainer thread retrains from the first job's windows
        hub.stop()
    storage = SqlStorage(make_engine(hub.db_url))
    print(
        f"{'job':<8} {'trials':>6} {'decisions':>9} {'step of last decision':>22} {'median step ms (last third)':>28}"
        f"  held"
    )
    for job, steps in rows:
        decisions = storage.decisions(job)
        trials = [d for d in decisions if d.reason.startswith("trial")]
        last = decisions[-1].applied_at_step if decisions else 0
        times = [e["step_time_s"] for e in steps[len(steps) * 2 // 3 :]]
        status = storage.tuner_status(job)
        print(
            f"{job:<8} {len(trials):6d} {len(decisions):9d} {last or 0:22d} {1e3 * statistics.median(times):28.1f}"
            f"  {status.detail if status else '-'}"
        )
    model = storage.latest_model()
    print(
        f"predictor in the database: {model.kind if model else None} ({model.note if model else ''}); load {load()}"
    )


# ---------------------------------------------------------------------------------- CPU


def cpu_sim(args) -> None:
    """CPU of the tuner's own work (JobTuner.observe, incl. scoring with the predictor) per call that
    issued a decision and per sample, over simulated runs of checked-in scenarios."""
    from benchmarks.harness.autobyte_policy import AutobytePolicy
    from benchmarks.harness.evaluate import _run_until_done, lower_bound_run, policy_context
    from benchmarks.harness.scenario import load_scenario

    per_decision, per_sample = [], []
    for path in args.scenarios:
        scenario = load_scenario(path)
        sim = scenario.make_simulator()
        lower = lower_bound_run(scenario, sim)
        context = policy_context(scenario, sim, scenario.duration_s or lower.elapsed_s * 4)
        policy = AutobytePolicy(retrain_interval_s=1e9)
        policy.prepare(context)
        tuner = policy.tuner
        original = tuner.observe

        def timed(samples, original=original, tuner=tuner):
            before = len(policy.sink.decisions)  # noqa: B023 - called only within this iteration's _run_until_done
            cpu0 = time.thread_time()
            original(samples)
            spent = time.thread_time() - cpu0
            if len(policy.sink.decisions) > before:  # noqa: B023 - called only within this iteration's _run_until_done
                per_decision.append(spent)
            elif samples:
                per_sample.append(spent / len(samples))

        tuner.observe = timed
        _run_until_done(scenario, sim, policy)
    print(
        f"load {load()}; {len(per_decision)} calls that decided, {len(per_sample)} batches without a decision"
    )
    print(
        f"CPU per decision (the call that issued it): p50 {1e3 * pct(per_decision, 50):.2f} ms, "
        f"p99 {1e3 * pct(per_decision, 99):.2f} ms, max {1e3 * max(per_decision):.2f} ms"
    )
    print(
        f"CPU per sample otherwise: p50 {1e6 * pct(per_sample, 50):.1f} us, p99 {1e6 * pct(per_sample, 99):.1f} us"
    )


def _proc_cpu_s(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _jobs_load(
    address: str, jobs: int, seconds: float, steps_per_s: float, result: dict
) -> None:
    """`jobs` synthetic jobs (rank 0 only) streaming 1 s batches and applying the daemon's decisions:
    a 30%-faster configuration exists, and the link slows down half way."""
    import asyncio

    import grpc
    from autobyte.convert import config_from_proto, config_to_proto
    from autobyte.protocol import autobyte_pb2 as pb
    from autobyte.protocol import autobyte_pb2_grpc as pb_grpc
    from autobyte.types import Config

    best = Config(1 << 20, 4 << 20)
    channel = grpc.aio.insecure_channel(address)
    telemetry, control = pb_grpc.TelemetryStub(channel), pb_grpc.ControlStub(channel)
    deadline = time.monotonic() + seconds

    async def one(index: int) -> None:
        job = f"load-{index:03d}"
        rng = random.Random(index)
        response = await telemetry.Register(
            pb.RegisterRequest(
                job=job,
                rank=0,
                world_size=8,
                backend="gloo",
                instance_id=job,
                model=pb.ModelFingerprint(
                    parameter_count=6_000_000,
                    parameter_bytes=24_000_000,
                    tensor_count=12,
                    largest_tensor_bytes=8_000_000,
                    median_tensor_bytes=1_000_000,
                    digest="x",
                ),
                config=config_to_proto(Config(4 << 20, 16 << 20)),
            )
        )
        state = {"config": Config(4 << 20, 16 << 20), "decision": 0, "pending": None}

        async def watch() -> None:
            async for update in control.WatchConfig(pb.WatchConfigRequest(job=job, rank=0)):
                state["pending"] = (
                    update.decision_id,
                    config_from_proto(update.config),
                    update.apply_at_step,
                )

        watcher = asyncio.create_task(watch())
        queue: asyncio.Queue = asyncio.Queue()

        async def batches():
            while True:
                item = await queue.get()
                if item is None:
                    return
                yield item

        stream = telemetry.StreamMetrics(batches())
        acks = asyncio.create_task(_drain(stream))
        seq, step, start = 0, 0, time.monotonic()
        try:
            while time.monotonic() < deadline:
                samples = []
                for _ in range(int(steps_per_s)):
                    pending = state["pending"]
                    if pending and step >= pending[2]:
                        state["decision"], state["config"], state["pending"] = (
                            pending[0],
                            pending[1],
                            None,
                        )
                    slow = 2.0 if time.monotonic() - start > seconds / 2 else 1.0
                    step_s = (
                        0.1
                        * slow
                        * (0.7 if state["config"] == best else 1.0)
                        * math.exp(rng.gauss(0, 0.03))
                    )
                    seq += 1
                    samples.append(
                        pb.StepMetrics(
                            seq=seq,
                            step=step,
                            wall_time_s=time.time(),
                            step_time_s=step_s,
                            forward_s=0.02,
                            backward_s=0.04,
                            exposed_comm_s=step_s - 0.06,
                            bytes_reduced=24_000_000,
                            partitions=6,
                            bandwidth_bytes_per_s=2e8 / slow,
                            config=config_to_proto(state["config"]),
                            decision_id=state["decision"],
                        )
                    )
                    step += 1
                await queue.put(
                    pb.MetricsBatch(
                        job=job, rank=0, session_id=response.session_id, samples=samples
                    )
                )
                await asyncio.sleep(1.0)
        finally:
            await queue.put(None)
            await acks
            watcher.cancel()
        result[job] = step

    await asyncio.gather(*(one(i) for i in range(jobs)))
    await channel.close()


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def daemon_cpu(args) -> None:
    """A real autobyted process under `jobs` concurrent synthetic jobs (10 steps/s each, 1 s
    batches), with --tuner off and --tuner auto, side by side: the daemon's CPU and what it decided."""
    import asyncio

    from autobyted.storage.db import make_engine
    from autobyted.storage.sql import SqlStorage
    from benchmarks.testbed.host import free_port

    print(
        f"load {load()}; {args.jobs} jobs x {args.steps_per_s} steps/s for {args.seconds:.0f} s per mode"
    )
    print(
        f"{'tuner':<6} {'daemon CPU s':>12} {'cores':>6} {'samples':>8} {'decisions':>9} {'jobs tuned':>10}"
    )
    for mode in args.modes:
        work = pathlib.Path(tempfile.mkdtemp(prefix="bench-tuner-"))
        port = free_port()
        db = f"sqlite:///{work}/autobyted.db"
        log = open(work / "log", "w")  # noqa: SIM115 - the daemon's output, open while it runs
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "autobyted.app",
                "start",
                "--listen",
                f"127.0.0.1:{port}",
                "--db",
                db,
                "--tuner",
                mode,
                "--log-level",
                "WARNING",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            time.sleep(3.0)
            cpu0, wall0 = _proc_cpu_s(proc.pid), time.monotonic()
            result: dict = {}
            asyncio.run(
                _jobs_load(f"127.0.0.1:{port}", args.jobs, args.seconds, args.steps_per_s, result)
            )
            cpu, wall = _proc_cpu_s(proc.pid) - cpu0, time.monotonic() - wall0
        finally:
            proc.terminate()
            proc.wait(30)
        storage = SqlStorage(make_engine(db))
        decisions = sum(len(storage.decisions(job)) for job in result)
        tuned = sum(1 for job in result if storage.decisions(job))
        print(
            f"{mode:<6} {cpu:12.1f} {cpu / wall:6.2f} {storage.sample_count():8d} {decisions:9d} {tuned:10d}"
        )
    print(f"load {load()}")


# ---------------------------------------------------------------------------------- drift, host load


def drift_loopback(args) -> None:
    """False alarms on real stationary runs: a 2-rank gloo job on loopback at one configuration, its
    rank-0 samples (from a real autobyted, --tuner off) replayed through the tuner's DriftDetector;
    then true alarms: the same series with a change injected at several points."""
    from autobyted.storage.db import make_engine
    from autobyted.storage.sql import SqlStorage
    from autobyted.tuner.drift import DriftDetector
    from benchmarks.testbed.host import free_port

    print(f"load {load()}")
    print(
        f"{'configuration':<14} {'steps':>7} {'minutes':>8} {'block steps':>11} {'alarms':>6} {'alarms/hour':>11}"
    )
    series = {}
    for config in args.configs:
        partition, credit = config.split(",")
        work = pathlib.Path(tempfile.mkdtemp(prefix="drift-"))
        port = free_port()
        db = f"sqlite:///{work}/a.db"
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "autobyted.app",
                "start",
                "--listen",
                f"127.0.0.1:{port}",
                "--db",
                db,
                "--tuner",
                "off",
                "--log-level",
                "WARNING",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            time.sleep(2.0)
            env = {**os.environ, "AUTOBYTE_DAEMON": f"127.0.0.1:{port}", "AUTOBYTE_JOB": "drift"}
            steps = int(args.minutes * 60 / args.step_estimate_s)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    "2",
                    "--master-port",
                    str(free_port()),
                    str(ROOT / "devtools" / "mlp_job.py"),
                    "--steps",
                    str(steps),
                    "--partition",
                    partition,
                    "--credit",
                    credit,
                ],
                env=env,
                check=True,
                capture_output=True,
            )
        finally:
            daemon.terminate()
            daemon.wait(30)
        storage = SqlStorage(make_engine(db))
        samples = [
            row.metrics for row in storage.samples_after("drift", 0, rank=0, limit=10_000_000)
        ]
        samples = samples[20:]
        detector = DriftDetector()
        alarms = 0
        for sample in samples:
            if detector.update(sample):
                alarms += 1
                detector = DriftDetector()  # the tuner re-tunes and watches afresh after an alarm
        minutes = (samples[-1].wall_time_s - samples[0].wall_time_s) / 60
        print(
            f"{config:<14} {len(samples):7d} {minutes:8.1f} {detector._block_steps:11d} {alarms:6d} "
            f"{alarms / (minutes / 60):11.2f}"
        )
        series[config] = samples
    print(f"load {load()}")
    print(
        "true alarms: the same real series with a change injected (from the step where it starts, a new"
    )
    print(
        "detector watching from 30 s before it, as the tuner would hold; restarted after a false alarm"
    )
    print("there): detected within 2000 steps / injections, delay from the change to the alarm")
    print(
        f"{'configuration':<14} {'change':<28} {'detected':>9} {'delay steps med':>15} {'delay s med':>11}"
    )
    for config, samples in series.items():
        for name, change in INJECTED_CHANGES.items():
            found, starts, delays_steps, delays_s = true_alarms(samples, change)
            print(
                f"{config:<14} {name:<28} {found:>4d}/{starts:<4d} "
                f"{pct(delays_steps, 50):15.0f} {pct(delays_s, 50):11.2f}"
            )


def true_alarms(samples, change, count: int = 10, horizon_steps: int = 2000):
    """`change` injected at `count` points of a stationary series: (detected, injections, delays in
    steps, delays in seconds)."""
    from autobyted.tuner.drift import DriftDetector

    found, delays_steps, delays_s = 0, [], []
    starts = _injection_points(samples, count)
    for start in starts:
        detector = DriftDetector()
        for sample in samples[:start]:
            if sample.wall_time_s < samples[start].wall_time_s - 30:
                continue
            if detector.update(sample):
                detector = DriftDetector()  # a false alarm before the change: watch afresh
        for i, sample in enumerate(samples[start : start + horizon_steps]):
            if detector.update(change(sample)):
                found += 1
                delays_steps.append(i + 1)
                delays_s.append(sample.wall_time_s - samples[start].wall_time_s)
                break
    return found, len(starts), delays_steps, delays_s


def _scaled(**factors):
    import dataclasses

    def change(m):
        return dataclasses.replace(m, **{k: getattr(m, k) * f for k, f in factors.items()})

    return change


# Changes the tuner must notice, injected into a real stationary series (each at the drift test's
# minimum relevant shift or a little above it, see autobyted/tuner/drift.py).
INJECTED_CHANGES = {
    "bandwidth estimate x0.5": _scaled(bandwidth_bytes_per_s=0.5),
    "compute x1.3 (step x1.3)": _scaled(forward_s=1.3, backward_s=1.3, step_time_s=1.3),
    "step time x1.15 alone": _scaled(step_time_s=1.15),
}


def _injection_points(samples, count: int = 10) -> list[int]:
    """Up to `count` starts, evenly spread, each with 30 s of samples before it."""
    t0 = samples[0].wall_time_s + 30
    first = next((i for i, s in enumerate(samples) if s.wall_time_s >= t0), len(samples))
    usable = len(samples) - first - 200
    if usable <= 0:
        return []
    return [first + usable * k // count for k in range(count)]


def hostload(args) -> None:
    from autobyte.hostload import HostLoadSampler, job_processes

    sampler = HostLoadSampler(interval_s=0.5)
    sampler.start()
    time.sleep(1.2)
    reads = []
    for _ in range(args.calls // 1000):
        t0 = time.perf_counter_ns()
        for _ in range(1000):
            sampler.value  # noqa: B018 - the property read is what is timed
        reads.append((time.perf_counter_ns() - t0) / 1000)
    samples = []
    for _ in range(200):
        t0 = time.thread_time_ns()
        sampler.sample()
        samples.append(time.thread_time_ns() - t0)
    # as on an 8-rank host: 7 co-located ranks, each with 2 children (data-loader workers)
    peers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                (
                    "import subprocess, sys, time; "
                    "[subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']) "
                    "for _ in range(2)]; time.sleep(60)"
                ),
            ]
        )
        for _ in range(7)
    ]
    try:
        time.sleep(1.0)
        sampler.exclude(p.pid for p in peers)
        with_peers = []
        for _ in range(200):
            t0 = time.thread_time_ns()
            sampler.sample()
            with_peers.append(time.thread_time_ns() - t0)
    finally:
        for peer in peers:
            for pid in reversed(job_processes([peer.pid])):  # its children first, then itself
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            peer.wait()
    sampler.stop()
    print(f"load {load()}")
    print(
        f"training thread, a read of HostLoadSampler.value: {np.median(reads) / 1000:.3f} us per call "
        f"(median over means of 1000 calls; p99 {pct(reads, 99) / 1000:.3f} us)"
    )
    print(
        f"sampler thread, one /proc/stat sample: median {np.median(samples) / 1000:.1f} us CPU, "
        f"p99 {pct(samples, 99) / 1000:.1f} us, once per interval (1 s by default)"
    )
    print(
        "sampler thread, with 7 co-located ranks of 2 children each excluded (24 processes "
        f"read): median {np.median(with_peers) / 1000:.1f} us CPU, p99 {pct(with_peers, 99) / 1000:.1f} us"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("predictor")
    p.add_argument("--testbed", action="store_true")
    p.add_argument("--contexts", type=int, default=60)
    p.add_argument("--seed", type=int, default=21)
    p.add_argument(
        "--left-out", nargs="*", default=["bert-base", "resnet50", "vgg16", "testbed-mlp"]
    )
    p.add_argument("--rates", nargs="+", default=["2gbit", "400mbit"])
    p.add_argument("--rounds", type=int, default=2)
    w = sub.add_parser("warmstart")
    w.add_argument("--testbed", action="store_true")
    w.add_argument("--scenarios", type=int, default=12)
    w.add_argument("--seed", type=int, default=5)
    w.add_argument("--left-out", default="bert-base")
    w.add_argument("--rate", default="1gbit")
    w.add_argument("--seconds", type=float, default=60.0)
    w.add_argument("--start", default="sched:64KiB,64KiB")
    w.add_argument(
        "--sim-start",
        default="",
        help="the simulated jobs' starting configuration P,C (default: the scheduler's default)",
    )
    c = sub.add_parser("cpu")
    c.add_argument(
        "scenarios",
        nargs="*",
        default=sorted(
            str(p)
            for p in (ROOT / "benchmarks" / "scenarios").glob("*.toml")
            if "testbed" not in p.name
        ),
    )
    d = sub.add_parser("daemon")
    d.add_argument("--jobs", type=int, default=100)
    d.add_argument("--seconds", type=float, default=120.0)
    d.add_argument("--steps-per-s", type=float, default=10.0)
    d.add_argument("--modes", nargs="+", default=["off", "auto"])
    r = sub.add_parser("drift")
    r.add_argument("--loopback", action="store_true", required=True)
    r.add_argument("--minutes", type=float, default=5.0)
    r.add_argument("--configs", nargs="+", default=["1MiB,4MiB", "none,none"])
    r.add_argument("--step-estimate-s", type=float, default=0.01)
    h = sub.add_parser("hostload")
    h.add_argument("--calls", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    if args.mode == "predictor":
        (predictor_testbed if args.testbed else predictor_sim)(args)
    elif args.mode == "warmstart":
        (warmstart_testbed if args.testbed else warmstart_sim)(args)
    elif args.mode == "cpu":
        cpu_sim(args)
    elif args.mode == "daemon":
        daemon_cpu(args)
    elif args.mode == "drift":
        drift_loopback(args)
    else:
        hostload(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
