"""Profile where a scheduled step's time goes on the 2-rank testbed.

    python -m benchmarks.profile_step --model mlp --rates 1gbit,2gbit \
        --configs sched:1MiB,4MiB,sched:4MiB,16MiB --rounds 3 --steps 8 --warmup 3 \
        --out results/profile_step.json
    python -m benchmarks.profile_step --report results/profile_step.json   # the tables again

Per (model, rate), 2 ranks in the namespace testbed run, interleaved round by round in the same
processes: DDP, the two probes of the bound (`compute`: DDP under no_sync; `comm`: a bare
all-reduce of every gradient in DDP's buckets) and each scheduler configuration (native hot path).
For a scheduled step it records the training thread's marks (forward, backward, `step()`), every
wait of the forward for parameters (the instance's `wait_params`, wrapped here), the update
thread's `_apply` spans, every partition's ready / issue / done (the native engine's trace,
AUTOBYTE_TRACE_PARTITIONS=1; off by default in the library) and every thread's CPU time
(/proc/self/task/*/schedstat), and derives with `benchmarks.testbed.step_breakdown`:

- training thread: forward compute, forward wait, backward, step() call (vs the compute probe);
- link (rank 0): busy (some collective in flight), idle between transfers inside the step, the
  stall at the step boundary (last completion of step n to first issue of n+1), per-collective
  extra = (busy - comm probe) / (collectives - probe buckets);
- first partitions (those the next forward needs first): queued behind the credit, in flight,
  their completion after backward, the next forward's first wait;
- CPU per step of the training, update, dispatch and backend (gloo) threads, both ranks;
- the ranks' pace: each rank's compute (forward without waits + backward) step by step, how far
  apart the ranks are against two independent ranks of the same spreads, what waiting for the
  later one costs, and the CPU-aware bound (the compute probe + the communication's CPU).

`--worker` is the rank program (Testbed.run launches it). The machine's load average is recorded
before and after every block.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.testbed.step_breakdown import (
    StepMarks,
    Transfer,
    Wait,
    first_partitions,
    issue_skew,
    last_ready_skew,
    link_steps,
    median_of,
    merge_ranks,
    rank_pace,
    thread_times,
    time_by_kind,
    training_steps,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BATCH = {"mlp": 512, "vgg": 64, "resnet50": 16, "transformer": 16}
PROBES = ("ddp", "compute", "comm", "lat:64KiB", "lat:1MiB")  # lat: back-to-back all-reduces


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def set_thread_nice(nice: int) -> None:
    """Every thread of this process but the training (main) thread at OS priority `nice`
    (`+niceN` after a configuration: the comm threads yield the core to compute; 0 restores)."""
    main = threading.main_thread().native_id
    base = os.getpriority(os.PRIO_PROCESS, main)
    for tid_text in os.listdir("/proc/self/task"):
        tid = int(tid_text)
        if tid != main:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, min(19, base + nice))
            except (ProcessLookupError, PermissionError):
                continue


# ---------------------------------------------------------------------------- the rank program


class Profiler:
    """One rank: a DDP replica and a scheduler replica (benchmarks.testbed.train_worker.Trainer)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch.distributed as dist

        from benchmarks.testbed import train_worker

        self.dist = dist
        self.args = args
        worker_args = train_worker.parse_args(
            [
                "--model",
                args.model,
                "--batch-size",
                str(args.batch_size),
                "--optimizer",
                args.optimizer,
            ]
        )
        self.trainer = train_worker.Trainer(worker_args, need_sched=True)
        self.rank = self.trainer.rank
        self.RunConfig = train_worker.RunConfig
        self.waits: list[Wait] = []
        self.applies: list[tuple[int, float, float]] = []
        self.instrumented = False

    def _instrument(self) -> None:
        """Wrap this scheduler instance's wait and update calls with timestamps (made at its first
        step, when the update thread exists); the library itself is unchanged."""
        sched = self.trainer.sched
        updater = sched.engine.updater
        progress = updater.progress
        original_wait, original_apply = progress.wait_params, updater._apply

        def wait_params(idxs: Any, s: int) -> float:  # the forward's waits, timestamped
            blocked = original_wait(idxs, s)
            if blocked:
                t_end = time.perf_counter()
                self.waits.append(Wait(s, t_end - blocked, t_end))
            return blocked

        def apply(s: int, idxs: Any, snapshot: Any) -> None:  # the update thread's busy spans
            t0 = time.perf_counter()
            original_apply(s, idxs, snapshot)
            self.applies.append((s, t0, time.perf_counter()))

        progress.wait_params = wait_params
        updater._apply = apply
        self.instrumented = True

    def _marked_step(self, kind: str) -> StepMarks:
        trainer = self.trainer
        inputs, targets = trainer._batch()
        work = trainer.workload
        if kind in ("ddp", "compute"):
            model, opt = trainer.ddp_model, trainer.ddp_opt
            step_index = trainer.global_step
        else:
            model, opt = trainer.sched_model, trainer.sched
            step_index = opt.step_index
        t0 = time.perf_counter()
        opt.zero_grad()
        if kind == "compute":
            with model.no_sync():
                loss = work.loss_fn(model(inputs), targets)
                t1 = time.perf_counter()
                loss.backward()
        else:
            loss = work.loss_fn(model(inputs), targets)
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        opt.step()
        return StepMarks(step_index, t0, t1, t2, time.perf_counter())

    def segment(self, label: str, round_index: int) -> dict[str, Any]:
        args, trainer = self.args, self.trainer
        dense = (
            "+dense" in label
        )  # row-sparse embeddings sent whole (ScheduledOptimizer sparse_rows)
        base_label, _, nice_text = label.replace("+dense", "").partition("+nice")
        config = self.RunConfig.parse(base_label)
        nice = int(nice_text) if nice_text else 0
        set_thread_nice(nice)
        kind = config.kind
        sched = trainer.sched
        trainer._quiesce()
        sched._set_sparse_rows(not dense)
        if kind == "sched":
            sched.reconfigure(
                partition_bytes=config.partition_bytes,
                credit_bytes=config.credit_bytes,
                tail_bytes=config.tail_bytes,
            )
        for _ in range(args.warmup):
            if kind in ("comm", "lat"):
                trainer._step(config)
            else:
                self._marked_step(kind)
            trainer.global_step += 1
        sched.synchronize()
        set_thread_nice(nice)  # threads born in the warm-up (the scheduler's, at its first step)
        if kind == "sched" and not self.instrumented:
            self._instrument()
        self.dist.barrier()
        engine = sched.engine.dispatcher.engine if sched.hot_path == "native" else None
        if engine is not None:
            engine.take_trace()
        self.waits.clear()
        self.applies.clear()
        trainer.collective_spans.clear()
        times_before = thread_times()
        marks: list[StepMarks] = []
        starts = []
        for _ in range(args.steps):
            starts.append(time.perf_counter())
            if kind in ("comm", "lat"):
                trainer._step(config)
            else:
                marks.append(self._marked_step(kind))
            trainer.global_step += 1
        if kind == "sched":
            sched.synchronize()
        starts.append(time.perf_counter())
        times_after = thread_times()
        step_times = [b - a for a, b in itertools.pairwise(starts)]
        result: dict[str, Any] = {
            "event": "result",
            "rank": self.rank,
            "round": round_index,
            "config": label,
            "kind": kind,
            "step_s": statistics.median(step_times[:-1] or step_times),
            "step_times_s": step_times,
            "cpu_per_step_s": time_by_kind(times_before, times_after, args.steps),
            "runqueue_per_step_s": time_by_kind(
                times_before, times_after, args.steps, "runqueue_ns"
            ),
            "marks": marks,
        }
        if kind == "comm":
            result["buckets"] = len(trainer.comm_buffers)
        if kind == "lat":
            result["collective_s"] = statistics.median(trainer.collective_spans)
        if kind != "sched":
            return result
        result["hot_path"] = sched.hot_path
        result["waits"] = list(self.waits)
        result["applies"] = list(self.applies)
        layout = sched.engine.layout
        result["first_start"] = layout.offsets[layout.by_offset[-1]]
        if engine is not None:
            elem = layout.elem
            result["transfers"] = [
                Transfer(step, start, length, length * elem, t_ready, t_issue1, t_done)
                for step, start, length, t_ready, _t0, t_issue1, t_done in engine.take_trace()
                if t_done > 0
            ]
        return result


def worker_main(args: argparse.Namespace) -> int:
    os.environ["AUTOBYTE_TRACE_PARTITIONS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        profiler = Profiler(args)
        emit(
            {
                "event": "train_start",
                "rank": profiler.rank,
                "model": args.model,
                "gradient_bytes": profiler.trainer.workload.gradient_bytes,
            }
        )
        labels = [*PROBES, *args.configs.split(";")]
        for k in range(args.rounds):
            for label in labels:
                emit(profiler.segment(label, k))
        profiler.trainer.close()
        dist.barrier()
        emit({"event": "done", "rank": profiler.rank})
    finally:
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------- the harness


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def fixed_cost(span_a: float, span_b: float, size_a: int, size_b: int) -> float:
    """The size-independent part of one collective: the intercept of the line through two
    (size, seconds per collective) points."""
    slope = (span_b - span_a) / (size_b - size_a)
    return span_a - slope * size_a


def derive(r0: dict[str, Any], r1: dict[str, Any] | None) -> dict[str, Any]:
    """One segment's breakdown from both ranks' raw records (rank 0's view, rank 1's CPU)."""
    out: dict[str, Any] = {"step_s": r0["step_s"]}
    mean_step = sum(r0["step_times_s"]) / len(r0["step_times_s"])
    # the training thread's wall time per step = on a CPU + runnable but waiting + asleep (waits)
    out["slept_training"] = (
        mean_step - r0["cpu_per_step_s"]["training"] - r0["runqueue_per_step_s"]["training"]
    )
    for prefix, rec in (("cpu_", r0), ("cpu1_", r1)):
        if rec is None:
            continue
        for k, v in rec["cpu_per_step_s"].items():
            out[prefix + k] = v
        for k, v in rec["runqueue_per_step_s"].items():
            out[prefix.replace("cpu", "runq") + k] = v
    for key in ("buckets", "collective_s"):
        if key in r0:
            out[key] = r0[key]
    marks = [StepMarks(*m) for m in r0["marks"]]
    waits = [Wait(*w) for w in r0.get("waits", [])]
    per_rank = []
    for prefix, rec in (("", r0), ("r1_", r1)):
        if rec is None or not rec["marks"]:
            continue
        rows = training_steps(
            [StepMarks(*m) for m in rec["marks"]], [Wait(*w) for w in rec.get("waits", [])]
        )
        per_rank.append(rows)
        for field in ("forward_s", "forward_wait_s", "backward_s", "step_call_s", "between_s"):
            out[prefix + field] = median_of(rows, field)
    pace = rank_pace(*per_rank) if len(per_rank) == 2 else None
    if pace is not None:
        out.update(
            {
                "pace_compute0_s": pace.compute_s[0],
                "pace_compute1_s": pace.compute_s[1],
                "pace_spread0_s": pace.spread_s[0],
                "pace_spread1_s": pace.spread_s[1],
                "pace_apart_s": pace.apart_s,
                "pace_independent_s": pace.independent_s,
                "pace_cost_s": pace.pace_cost_s,
            }
        )
    if not r0["kind"].startswith("sched"):
        return out
    busy: dict[int, float] = {}
    for s, a, b in r0["applies"]:
        busy[s] = busy.get(s, 0.0) + (b - a)
    out["update_busy_s"] = statistics.median(busy.values()) if busy else 0.0
    t0 = [Transfer(*t) for t in r0.get("transfers", [])]
    t1 = [Transfer(*t) for t in (r1 or {}).get("transfers", [])]
    if not t0:
        return out
    both = merge_ranks(t0, t1) if t1 else t0
    skew = issue_skew(t0, t1)
    out["issue_skew_s"] = statistics.median(skew) if skew else 0.0
    skew = last_ready_skew(t0, t1)
    out["last_ready_skew_s"] = statistics.median(skew) if skew else 0.0
    for name, transfers in (("link_", both), ("link0_", t0)):
        link = link_steps(transfers, marks)
        for field in (
            "collectives",
            "nbytes",
            "busy_s",
            "idle_inside_s",
            "boundary_stall_s",
            "cycle_s",
            "stall_in_forward_s",
            "stall_in_backward_s",
        ):
            out[name + field] = median_of(link, field)
    firsts = first_partitions(both, r0["first_start"], marks, waits)
    for field in (
        "ready_to_issue_s",
        "issue_to_done_s",
        "done_after_backward_s",
        "next_first_wait_s",
        "next_forward_wait_s",
    ):
        out["first_" + field] = median_of(firsts, field)
    return out


def cpu_beside_training(entry: dict[str, Any]) -> float:
    """CPU per step of a rank's threads other than the training thread (update, dispatch,
    backend), the busier rank's; on this 2-core host they run on the cores the training threads
    compute on."""
    return max(
        entry.get(f"{p}_total", 0.0) - entry.get(f"{p}_training", 0.0) for p in ("cpu", "cpu1")
    )


def summarize(rank0: list[dict[str, Any]], rank1: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration: medians over rounds of each round's breakdown; x DDP paired per round."""
    other = {(r["round"], r["config"]): r for r in rank1}
    by_config: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for r in rank0:
        by_config.setdefault(r["config"], []).append(
            (r["round"], derive(r, other.get((r["round"], r["config"]))))
        )
    ddp = {k: d["step_s"] for k, d in by_config.get("ddp", [])}
    summary: dict[str, Any] = {}
    for label, rows in by_config.items():
        keys = set.intersection(*(set(d) for _, d in rows))
        entry = {key: statistics.median(d[key] for _, d in rows) for key in sorted(keys)}
        entry["x_ddp"] = statistics.median(ddp[k] / d["step_s"] for k, d in rows if k in ddp)
        summary[label] = entry
    compute, comm = summary["compute"]["step_s"], summary["comm"]["step_s"]
    bound = max(compute, comm)
    # The CPU-aware bound, the busier rank's core: the compute probe plus the communication's CPU
    # beside the training thread; where the update runs on the update thread (the scheduler), its
    # CPU is in that, so the probe's own optimizer step comes out.
    probe = summary["compute"]
    for entry in summary.values():
        moved = probe["step_call_s"] if entry.get("cpu_update", 0.0) > 0 else 0.0
        entry["cpu_bound_s"] = (
            compute - moved + max(0.0, cpu_beside_training(entry) - cpu_beside_training(probe))
        )
    summary["bound"] = {
        "step_s": bound,
        "x_ddp": summary["ddp"]["step_s"] / bound,
        "compute_s": compute,
        "comm_s": comm,
    }
    if "lat:64KiB" in summary and "lat:1MiB" in summary:  # 16 and 4 back to back
        small, large = summary["lat:64KiB"]["collective_s"], summary["lat:1MiB"]["collective_s"]
        summary["bound"]["collective_fixed_s"] = fixed_cost(small, large, 64 << 10, 1 << 20)
    return summary


def format_block(model: str, rate: str, summary: dict[str, Any], loads: tuple[str, str]) -> str:
    """The three tables of one (model, rate) block, times in ms per step."""

    def ms(entry: dict[str, Any], key: str, width: int) -> str:
        return f"{entry.get(key, 0.0) * 1e3:{width}.1f}"

    compute, comm = summary["compute"], summary["comm"]
    rows = [(label, e) for label, e in summary.items() if label != "bound" and "lat:" not in label]
    lines = [
        (
            f"{model} @ {rate}  (load before {loads[0]}, after {loads[1]}; medians over rounds, "
            "ms per step)"
        ),
        (
            f"{'configuration':<18} {'step':>6} {'xDDP':>5} {'fwd':>6} {'fwdwait':>7} {'bwd':>6} "
            f"{'step()':>6} {'updbusy':>7} | r0 CPU: {'train':>6} {'upd':>5} {'disp':>5} "
            f"{'gloo':>5} {'total':>6} | r0 train {'runq':>5} {'slept':>5} | r1 CPU {'total':>6}"
        ),
    ]
    for label, e in rows:
        lines.append(
            f"{label:<18} {ms(e, 'step_s', 6)} {e['x_ddp']:5.2f} {ms(e, 'forward_s', 6)} "
            f"{ms(e, 'forward_wait_s', 7)} {ms(e, 'backward_s', 6)} {ms(e, 'step_call_s', 6)} "
            f"{ms(e, 'update_busy_s', 7)} |         {ms(e, 'cpu_training', 6)} {ms(e, 'cpu_update', 5)} "
            f"{ms(e, 'cpu_dispatch', 5)} {ms(e, 'cpu_backend', 5)} {ms(e, 'cpu_total', 6)} |         "
            f"   {ms(e, 'runq_training', 5)} {ms(e, 'slept_training', 5)} |        {ms(e, 'cpu1_total', 6)}"
        )
    b = summary["bound"]
    lines.append(
        f"{'bound':<18} {b['step_s'] * 1e3:6.1f} {b['x_ddp']:5.2f}  (compute "
        f"{b['compute_s'] * 1e3:.1f}, comm {b['comm_s'] * 1e3:.1f} in "
        f"{comm.get('buckets', 0):.0f} buckets)"
    )
    if "collective_fixed_s" in b:
        lat = [
            f"{label} {summary[label]['collective_s'] * 1e3:.2f}"
            for label in ("lat:64KiB", "lat:1MiB")
        ]
        lines.append(
            f"one collective alone, ms: {', '.join(lat)}; fixed (size-independent) part "
            f"{b['collective_fixed_s'] * 1e3:.2f}"
        )
    lines += [
        "",
        "link (both ranks merged: a collective moves once both issued it)",
        (
            f"{'configuration':<18} {'colls':>5} {'busy':>6} {'busy-comm':>9} {'idle in':>7} "
            f"{'stall':>6} {'in fwd':>6} {'in bwd':>6} {'cycle':>6} {'r1-r0 issue':>11} "
            f"{'busy r0 only':>12} {'r1-r0 last ready':>16}"
        ),
    ]
    for label, e in rows:
        if "link_busy_s" not in e:
            continue
        extra = {"x": e["link_busy_s"] - comm["step_s"]}
        lines.append(
            f"{label:<18} {e['link_collectives']:5.0f} {ms(e, 'link_busy_s', 6)} {ms(extra, 'x', 9)} "
            f"{ms(e, 'link_idle_inside_s', 7)} {ms(e, 'link_boundary_stall_s', 6)} "
            f"{ms(e, 'link_stall_in_forward_s', 6)} {ms(e, 'link_stall_in_backward_s', 6)} "
            f"{ms(e, 'link_cycle_s', 6)} {ms(e, 'issue_skew_s', 11)} {ms(e, 'link0_busy_s', 12)} "
            f"{ms(e, 'last_ready_skew_s', 16)}"
        )
    lines += [
        "",
        "first partitions (those the next forward needs first)",
        (
            f"{'configuration':<18} {'queued':>6} {'flight':>6} {'after bwd':>9} {'1st wait':>8} "
            f"{'fwd wait':>8}"
        ),
    ]
    for label, e in rows:
        if "first_issue_to_done_s" not in e:
            continue
        lines.append(
            f"{label:<18} {ms(e, 'first_ready_to_issue_s', 6)} {ms(e, 'first_issue_to_done_s', 6)} "
            f"{ms(e, 'first_done_after_backward_s', 9)} {ms(e, 'first_next_first_wait_s', 8)} "
            f"{ms(e, 'first_next_forward_wait_s', 8)}"
        )
    lines += [
        "",
        "rank 1's training thread",
        f"{'configuration':<18} {'fwd':>6} {'fwdwait':>7} {'bwd':>6}",
    ]
    for label, e in rows:
        if "r1_forward_s" in e:
            lines.append(
                f"{label:<18} {ms(e, 'r1_forward_s', 6)} {ms(e, 'r1_forward_wait_s', 7)} "
                f"{ms(e, 'r1_backward_s', 6)}"
            )
    lines.append(
        f"(compute probe: fwd {compute['forward_s'] * 1e3:.1f}, bwd "
        f"{compute['backward_s'] * 1e3:.1f}, opt.step {compute['step_call_s'] * 1e3:.1f})"
    )
    lines += [
        "",
        (
            "the ranks' pace (compute = forward without its waits + backward, per step; mean, "
            "spread = standard deviation; apart = mean |r1 - r0|, indep = the same for two independent "
            "ranks of those spreads; cost = apart / 2, the wait for the later rank; cpu bound = the compute "
            "probe + the busier rank's CPU beside its training thread, the update moved there)"
        ),
        (
            f"{'configuration':<18} {'r0':>6} {'r1':>6} {'spread0':>7} {'spread1':>7} {'apart':>6} "
            f"{'indep':>6} {'cost':>6} {'cpu bound':>9} {'step/cpu':>8}"
        ),
    ]
    for label, e in rows:
        if "pace_apart_s" in e:
            lines.append(
                f"{label:<18} {ms(e, 'pace_compute0_s', 6)} {ms(e, 'pace_compute1_s', 6)} "
                f"{ms(e, 'pace_spread0_s', 7)} {ms(e, 'pace_spread1_s', 7)} {ms(e, 'pace_apart_s', 6)} "
                f"{ms(e, 'pace_independent_s', 6)} {ms(e, 'pace_cost_s', 6)} {ms(e, 'cpu_bound_s', 9)} "
                f"{e['step_s'] / e['cpu_bound_s']:8.2f}"
            )
    return "\n".join(lines)


def run_block(model: str, rate: str, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.testbed import Testbed, parse_rate

    batch = args.batch_size or DEFAULT_BATCH.get(model, 0)
    command = [
        sys.executable,
        "-m",
        "benchmarks.profile_step",
        "--worker",
        "--model",
        model,
        "--batch-size",
        str(batch),
        "--optimizer",
        args.optimizer,
        "--threads",
        str(args.threads),
        "--configs",
        args.configs,
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    before = load()
    started = time.perf_counter()
    with Testbed(world_size=2, rate=parse_rate(rate), pin_cpus=[0, 1] if args.pin else None) as bed:
        result = bed.run(command, cwd=str(REPO), timeout_s=args.timeout)
    loads = (before, load())
    rank0 = [r for r in result.ranks[0].results if r.get("event") == "result"]
    rank1 = [r for r in result.ranks[1].results if r.get("event") == "result"]
    summary = summarize(rank0, rank1)
    return {
        "model": model,
        "rate": rate,
        "batch_size": batch,
        "load_before": loads[0],
        "load_after": loads[1],
        "pinned": bool(args.pin),
        "wall_s": time.perf_counter() - started,
        "summary": summary,
        "results": rank0,
        "results_rank1": rank1,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help="run as one rank (Testbed.run)")
    parser.add_argument("--model", default="mlp", help="one model (--worker) or a comma list")
    parser.add_argument("--rates", default="1gbit,2gbit,10gbit")
    parser.add_argument(
        "--configs",
        default="sched:1MiB,4MiB;sched:4MiB,16MiB",
        help="scheduler configurations separated by ';'",
    )
    parser.add_argument("--batch-size", type=int, default=0, help="0: bench_scheduler's default")
    parser.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="sgd")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--pin",
        action="store_true",
        help="rank r on CPU r (taskset, with every thread it starts): one core per rank",
    )
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--report",
        default="",
        metavar="FILE",
        help="print the tables of a saved run (--out of an earlier run) and exit",
    )
    return parser.parse_args(argv)


def write_block(block: dict[str, Any], summary: dict[str, Any]) -> None:
    sys.stdout.write(
        format_block(
            block["model"], block["rate"], summary, (block["load_before"], block["load_after"])
        )
        + "\n\n"
    )
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.report:  # the tables again from a saved run, derived by this code
        for block in json.loads(Path(args.report).read_text()):
            write_block(block, summarize(block["results"], block["results_rank1"]))
        return 0
    blocks = []
    for model in args.model.split(","):
        for rate in args.rates.split(","):
            block = run_block(model, rate, args)
            blocks.append(block)
            write_block(block, block["summary"])
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(blocks, indent=1, default=list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
