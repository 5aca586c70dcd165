"""True labels on the testbed: inject a change into a real 2-rank gloo run, count correct labels.

Each injection is one run of `benchmarks.testbed.train_worker` (the real scheduler, 2 ranks in network
namespaces, one configuration held, as the tuner holds it) with one change at a step:

    bandwidth   the links' rate 2 Gbit/s -> 300 Mbit/s (tc)            expected "bandwidth drop"
    cpu_quota   rank 1 limited to half a core (cgroup CPU quota)        expected "compute slowdown on rank 1"
    flows       2 competing TCP flows each way through every link       expected "bandwidth drop"

Every rank's StepMetrics (what the client streams to the daemon, with its host load) is replayed
through what the daemon runs while it holds a configuration: tuner.ranks.RankMerger (the job's
sample: the straggler's compute, the best bandwidth estimate) into drift.DriftDetector with the
held window as its head start. The first alarm after the change is the injection's label; an
alarm before it (another user's load on a shared machine) is reported and the detector restarts
from the next window, as the tuner's does. For comparison, the same samples as the daemon read them before
(rank 0 alone, the waits for parameters counted in its compute) give the "before" column.

    python -m benchmarks.bench_labels --injections 10        # the issue's goal: >= 9/10 each
    python -m benchmarks.bench_labels --injections 3 --kinds bandwidth cpu_quota
    python -m benchmarks.bench_labels --injections 3 --rejudge DIR   # samples kept by --samples-dir
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from autobyte.types import Config, StepMetrics

from autobyted.tuner.drift import DriftDetector
from autobyted.tuner.ranks import RankMerger
from benchmarks.testbed import CpuShareChange, FlowChange, RateChange, Testbed, Trace, worker_cli

REPO = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 10  # the tuner's warm-up (TunerParams.warmup_steps)
HEAD_START_STEPS = 20  # the held configuration's measured window (TunerParams.baseline_steps)
KINDS = {
    "bandwidth": "bandwidth drop",
    "cpu_quota": "compute slowdown on rank 1",
    "flows": "bandwidth drop",
}


def injection_trace(kind: str, at_step: int) -> Trace:
    if kind == "bandwidth":
        return Trace([RateChange(at_step=at_step, rate_bps=300_000_000)])
    if kind == "cpu_quota":
        return Trace([CpuShareChange(at_step=at_step, cpu_share=0.5, ranks=(1,))])
    if kind == "flows":
        return Trace([FlowChange(at_step=at_step, flows=2, direction="both")])
    raise ValueError(f"injection kind {kind!r}: use one of {sorted(KINDS)}")


def metrics_from_dict(raw: dict[str, Any]) -> StepMetrics:
    config = raw.get("config") or {}
    fields = {f.name for f in dataclasses.fields(StepMetrics)} - {"config"}
    return StepMetrics(
        **{k: v for k, v in raw.items() if k in fields},
        config=Config(config.get("partition_bytes"), config.get("credit_bytes")),
    )


def first_label(samples: list[StepMetrics], change_step: int) -> dict[str, Any]:
    """The held configuration's drift detector over a job's samples: its first alarm after the
    change. An alarm before it (a change nobody injected: on a shared machine, another user's
    load) is counted and the detector restarts from the next window, as the tuner's does after a
    re-tune that keeps the configuration; if no clean window fits before the change, the
    injection is not judged (label "unjudged")."""
    samples = [s for s in samples if s.step >= WARMUP_STEPS]
    early: list[tuple[int, str]] = []
    start = 0
    while True:
        head = samples[start : start + HEAD_START_STEPS]
        if not head or head[-1].step >= change_step:
            return {"label": "unjudged", "step": None, "early": early, "delay_steps": None}
        detector = DriftDetector(head)
        for index in range(start + HEAD_START_STEPS, len(samples)):
            sample = samples[index]
            alarm = detector.update(sample)
            if alarm is None:
                continue
            if sample.step < change_step:
                early.append((sample.step, alarm.reason))
                start = index + 1
                break
            return {
                "label": alarm.reason,
                "step": sample.step,
                "early": early,
                "delay_steps": sample.step - change_step,
            }
        else:
            return {"label": None, "step": None, "early": early, "delay_steps": None}


def old_signals(sample: StepMetrics) -> StepMetrics:
    """A sample as the client measured it before: the waits for parameters inside the compute
    (exposed_comm_s holds all of them; most are in the forward pass)."""
    return dataclasses.replace(sample, forward_s=sample.forward_s + sample.exposed_comm_s)


def judge(per_rank: dict[int, list[StepMetrics]], change_step: int) -> dict[str, Any]:
    merger = RankMerger(world_size=len(per_rank))
    for rank, samples in per_rank.items():
        for sample in samples:
            merger.add(rank, sample)
    job = merger.pop_ready()
    return {
        "now": first_label(job, change_step),
        "before": first_label([old_signals(s) for s in per_rank[0]], change_step),
    }


def run_injection(kind: str, index: int, args: argparse.Namespace) -> dict[str, Any]:
    change_step = args.steps_before + 3 * index  # not always at the same point of a block
    steps = change_step + args.steps_after
    command = worker_cli.command(
        model=args.model,
        threads=1,
        configs=[f"sched:{args.config}"],
        rounds=1,
        steps=steps,
        warmup=0,
        full_metrics=True,
        steps_events=True,
        seed=index,
    )
    started = time.time()
    with Testbed(world_size=2, rate=args.rate) as bed:
        result = bed.run(
            command, trace=injection_trace(kind, change_step), cwd=str(REPO), timeout_s=args.timeout
        )
    per_rank = {}
    for rank in result.ranks:
        segments = [r for r in rank.results if r.get("event") == "result"]
        per_rank[rank.rank] = [
            metrics_from_dict(m) for seg in segments for m in seg.get("metrics", [])
        ]
    if args.samples_dir:
        Path(args.samples_dir).mkdir(parents=True, exist_ok=True)
        Path(args.samples_dir, f"{kind}-{index}.json").write_text(
            json.dumps(
                {
                    "change_step": change_step,
                    "ranks": {
                        rank: [dataclasses.asdict(s) for s in samples]
                        for rank, samples in per_rank.items()
                    },
                }
            )
        )
    return verdict_row(kind, index, change_step, time.time() - started, per_rank)


def verdict_row(
    kind: str, index: int, change_step: int, wall_s: float, per_rank: dict[int, list[StepMetrics]]
) -> dict[str, Any]:
    verdict = judge(per_rank, change_step)
    expected = KINDS[kind]
    out = {
        "kind": kind,
        "index": index,
        "expected": expected,
        "change_step": change_step,
        "wall_s": round(wall_s, 1),
        **verdict,
    }
    for column in ("now", "before"):
        v = verdict[column]
        # rank 0 alone ("before") cannot name a rank: its compute label counts without one
        accepted = (expected, expected.split(" on rank ")[0]) if column == "before" else (expected,)
        out[f"{column}_correct"] = v["label"] in accepted
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--injections", type=int, default=10, help="injections of each kind")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--config", default="4MiB,16MiB", help="the held configuration P,C")
    parser.add_argument("--rate", default="2gbit")
    parser.add_argument("--steps-before", type=int, default=100)
    parser.add_argument("--steps-after", type=int, default=60)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default="", help="write every injection's verdict as JSON")
    parser.add_argument("--samples-dir", default="", help="keep every injection's samples there")
    parser.add_argument(
        "--rejudge",
        default="",
        help="judge the samples kept in this --samples-dir again (no testbed run)",
    )
    args = parser.parse_args(argv)
    if args.injections < 1:
        parser.error(f"--injections={args.injections} must be at least 1")
    load = os.getloadavg()[0]
    rows = []
    for kind in args.kinds:
        for index in range(args.injections):
            if args.rejudge:  # the samples of an earlier run, judged by the code as it is now
                saved = Path(args.rejudge, f"{kind}-{index}.json")
                if not saved.exists():
                    continue
                raw = json.loads(saved.read_text())
                if "ranks" not in raw:  # kept by an older version: the ranks only
                    raw = {"change_step": args.steps_before + 3 * index, "ranks": raw}
                row = verdict_row(
                    kind,
                    index,
                    raw["change_step"],
                    0.0,
                    {
                        int(rank): [metrics_from_dict(m) for m in samples]
                        for rank, samples in raw["ranks"].items()
                    },
                )
            else:
                row = run_injection(kind, index, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(
        f"\nload average at start {load:.1f}; held sched:{args.config}, model {args.model}, "
        f"rate {args.rate}"
    )
    print(
        f"{'change':<11} {'expected':<17} {'correct now':>11} {'before':>7}  labels now "
        "(+k: k alarms before the change, uninjected)"
    )
    for kind in args.kinds:
        mine = [r for r in rows if r["kind"] == kind]
        now = sum(r["now_correct"] for r in mine)
        before = sum(r["before_correct"] for r in mine)
        labels = ", ".join(
            str(r["now"]["label"]) + (f" (+{len(r['now']['early'])})" if r["now"]["early"] else "")
            for r in mine
        )
        print(
            f"{kind:<11} {KINDS[kind]:<17} {now:>7}/{len(mine):<3} {before:>3}/{len(mine):<3}  {labels}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
