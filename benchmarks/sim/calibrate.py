"""Calibrate the simulator against measured runs and report the error of its predicted step time.

    python -m benchmarks.sim.calibrate MEASURED.json [--out report.json]
    python -m benchmarks.sim.calibrate --measure-loopback measured.json   # measure, then calibrate

Measured-runs format (JSON; written by hand, by benchmarks/bench_scheduler.py, or by
--measure-loopback):

    {
      "source": "what produced these numbers",
      "link": {"latency_s": 0, "collective_overhead_s": 0.0004, "launch_s": 0.0001,
               "bandwidth_mbit": 3000},          # optional; bandwidth_mbit for unshaped runs
      "runs": [
        {"model": "mlp", "model_args": {}, "batch_size": 128,   # a benchmarks.models workload
         "profile": "path/to/profile.json",                  # ...or a recorded profile instead
         "workers": 2, "rate_mbit": 1000,                    # link rate (null: link.bandwidth_mbit)
         "config": "ddp" | "sched:4MiB,16MiB",
         "step_time_median_s": 0.204,                        # measured, the number predicted
         "compute_time_s": 0.073}                            # measured forward+backward+update
      ]
    }

Procedure: for each run the model's per-layer profile is recorded on this machine with torch hooks
(or loaded), rescaled so that its compute equals the measured `compute_time_s` (the simulator is
judged on communication and overlap, not on predicting this machine's FLOP rate), simulated with
the run's workers, rate and configuration until it settles, and compared with the measured median.
The link constants are not fitted to the step times being predicted: they come from the file's
"link" table (a separate all-reduce microbenchmark for --measure-loopback).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from autobyte.types import Config, parse_bytes
from benchmarks.sim.engine import DDP, LinkModel, RunConfig, Simulator
from benchmarks.sim.profiles import ModelProfile, record_profile
from benchmarks.sim.trace import Trace

MBIT = 1e6 / 8  # bytes/s in one Mbit/s
_LINK_KEYS = {"latency_s", "collective_overhead_s", "launch_s", "ddp_launch_s"}


def parse_config(label: str) -> RunConfig:
    text = label.strip().lower()
    if text == "ddp":
        return DDP
    if text.startswith("sched:"):
        partition, credit = text[len("sched:"):].split(",")
        return Config(parse_bytes(partition), parse_bytes(credit))
    raise ValueError(f"bad configuration {label!r}: use ddp or sched:P,C")


def profile_for_run(run: dict[str, Any], base: pathlib.Path,
                    cache: dict[str, ModelProfile]) -> ModelProfile:
    if "profile" in run:
        path = pathlib.Path(run["profile"])
        return ModelProfile.load(path if path.is_absolute() else base / path)
    key = json.dumps([run["model"], run.get("model_args", {}), run.get("batch_size", 0)],
                     sort_keys=True)
    if key not in cache:
        import torch

        from benchmarks.models import build
        torch.manual_seed(0)
        workload = build(run["model"], **run.get("model_args", {}))
        batch_size = int(run.get("batch_size") or workload.default_batch_size)
        batch = workload.make_batch(batch_size, torch.Generator().manual_seed(0))
        optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.01, momentum=0.9)
        cache[key] = record_profile(workload.model, lambda: batch, workload.loss_fn,
                                    name=run["model"], optimizer=optimizer, steps=5)
    return cache[key]


def calibrate(measured: dict[str, Any], base: pathlib.Path) -> dict[str, Any]:
    link_table = dict(measured.get("link", {}))
    default_mbit = link_table.pop("bandwidth_mbit", None)
    link = LinkModel(**{k: v for k, v in link_table.items() if k in _LINK_KEYS})
    cache: dict[str, ModelProfile] = {}
    rows = []
    for run in measured["runs"]:
        profile = profile_for_run(run, base, cache)
        if run.get("compute_time_s"):
            # compute_time_s includes the optimizer step; keep the recorded share of it.
            share = profile.optimizer_s / (profile.compute_s + profile.optimizer_s)
            target = float(run["compute_time_s"])
            profile = profile.with_compute_s(target * (1 - share))
        rate_mbit = run.get("rate_mbit") or default_mbit
        if not rate_mbit:
            raise ValueError(f"run {run} has no rate_mbit and the file no link.bandwidth_mbit")
        config = parse_config(run["config"])
        sim = Simulator(profile, int(run.get("workers", 2)), Trace.constant(rate_mbit * MBIT), link)
        predicted = sim.steady_step_s(config, rate_mbit * MBIT, steps=6)
        actual = float(run["step_time_median_s"])
        rows.append({"model": run.get("model", run.get("profile")), "config": run["config"],
                     "rate_mbit": rate_mbit, "workers": run.get("workers", 2),
                     "measured_s": actual, "predicted_s": predicted,
                     "error": (predicted - actual) / actual})
    errors = [abs(row["error"]) for row in rows]
    return {"source": measured.get("source", ""), "link": link.__dict__,
            "bandwidth_mbit": default_mbit, "runs": rows,
            "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None}


# ---- our own measurements: 2 gloo ranks on loopback -----------------------------------------------

def _loopback_worker(rank: int, world: int, port: int, plan: dict[str, Any], out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from benchmarks.models import build

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {"allreduce": [], "runs": []}
    # 1. all-reduce microbenchmark: time(bytes) = fixed + bytes / bandwidth (ring, N=2)
    for nbytes in plan["allreduce_bytes"]:
        tensor = torch.ones(nbytes // 4)
        for _ in range(3):
            dist.all_reduce(tensor)
        times = []
        for _ in range(plan["allreduce_reps"]):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        results["allreduce"].append({"bytes": nbytes, "median_s": statistics.median(times)})
    # 2. DDP training of MLPs: step time, and compute time under no_sync
    for model_args in plan["models"]:
        torch.manual_seed(0)
        workload = build("mlp", **model_args)
        batch = workload.make_batch(workload.default_batch_size,
                                    torch.Generator().manual_seed(rank))
        model = nn.parallel.DistributedDataParallel(workload.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        measured: dict[str, float] = {}
        for mode in ("compute", "ddp", "compute", "ddp"):
            times = []
            for step in range(plan["warmup"] + plan["steps"]):
                dist.barrier()
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                if mode == "compute":
                    with model.no_sync():
                        workload.loss_fn(model(batch[0]), batch[1]).backward()
                else:
                    workload.loss_fn(model(batch[0]), batch[1]).backward()
                optimizer.step()
                if step >= plan["warmup"]:
                    times.append(time.perf_counter() - start)
            measured.setdefault(mode, [])  # type: ignore[arg-type]
            measured[mode] += times  # type: ignore[operator]
        results["runs"].append({"model_args": model_args,
                                "batch_size": workload.default_batch_size,
                                "step_time_median_s": statistics.median(measured["ddp"]),
                                "compute_time_s": statistics.median(measured["compute"])})
    dist.destroy_process_group()
    if rank == 0:
        pathlib.Path(out_path).write_text(json.dumps(results))


def measure_loopback(out_path: pathlib.Path) -> dict[str, Any]:
    """2 gloo ranks on 127.0.0.1 (no namespaces, no shaping): all-reduce sweep + DDP MLPs."""
    import socket

    import numpy as np
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    plan = {"allreduce_bytes": [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20],
            "allreduce_reps": 15, "warmup": 3, "steps": 10,
            "models": [{"hidden": 512, "depth": 4}, {"hidden": 1024, "depth": 6},
                       {"hidden": 2048, "depth": 4}]}
    raw_path = out_path.with_suffix(".raw.json")
    mp.start_processes(_loopback_worker, args=(2, port, plan, str(raw_path)), nprocs=2,
                       start_method="spawn")
    raw = json.loads(raw_path.read_text())
    raw_path.unlink()
    sizes = np.array([item["bytes"] for item in raw["allreduce"]], dtype=float)
    times = np.array([item["median_s"] for item in raw["allreduce"]])
    # N = 2: wire bytes = bytes; time = fixed + bytes / bandwidth
    slope, fixed = np.polyfit(sizes, times, 1)
    bandwidth_mbit = 1.0 / slope / MBIT
    measured = {
        "source": "2 gloo ranks on 127.0.0.1 loopback (no shaping), this machine, "
                  f"{time.strftime('%Y-%m-%d %H:%M')}; link constants from an all-reduce sweep",
        "link": {"latency_s": 0.0, "collective_overhead_s": max(float(fixed), 0.0),
                 "ddp_launch_s": 20e-6, "bandwidth_mbit": bandwidth_mbit},
        "allreduce_sweep": raw["allreduce"],
        "runs": [{"model": "mlp", "model_args": run["model_args"], "batch_size": run["batch_size"],
                  "workers": 2, "rate_mbit": None, "config": "ddp",
                  "step_time_median_s": run["step_time_median_s"],
                  "compute_time_s": run["compute_time_s"]} for run in raw["runs"]],
    }
    out_path.write_text(json.dumps(measured, indent=1) + "\n")
    return measured


def format_report(report: dict[str, Any]) -> str:
    lines = [f"calibrated against: {report['source']}",
             f"{'model':<10} {'config':<18} {'Mbit/s':>8} {'measured':>9} {'predicted':>9} {'error':>7}"]
    for row in report["runs"]:
        lines.append(f"{str(row['model']):<10} {row['config']:<18} {row['rate_mbit']:>8.0f} "
                     f"{row['measured_s'] * 1e3:>7.1f}ms {row['predicted_s'] * 1e3:>7.1f}ms "
                     f"{row['error'] * 100:>+6.1f}%")
    lines.append(f"median |error| {report['median_abs_error'] * 100:.1f}% "
                 f"(max {report['max_abs_error'] * 100:.1f}%; goal <= 15%)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim.calibrate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("measured", help="measured-runs JSON (written first with --measure-loopback)")
    parser.add_argument("--measure-loopback", action="store_true",
                        help="measure 2 gloo ranks on loopback into MEASURED, then calibrate")
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args(argv)
    path = pathlib.Path(args.measured)
    if args.measure_loopback:
        measured = measure_loopback(path)
    else:
        measured = json.loads(path.read_text())
    report = calibrate(measured, path.parent)
    print(format_report(report))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
