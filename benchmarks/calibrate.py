"""Calibrate the simulator against measured runs and report the error of its predicted step time.

    python -m benchmarks.calibrate MEASURED.json [--out report.json]
    python -m benchmarks.calibrate --measure-loopback measured.json   # measure, then calibrate

Measured-runs format (JSON; written by hand, by benchmarks/bench_scheduler.py, or by
--measure-loopback):

    {
      "source": "what produced these numbers",
      "link": {"latency_s": 0, "collective_overhead_s": 0.0004, "launch_s": 0.0001,
               "bandwidth_mbit": 3000},          # optional; bandwidth_mbit for unshaped runs
      "runs": [
        {"model": "mlp", "model_args": {}, "batch_size": 128,   # a benchmarks.testbed.models workload
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
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.run_inputs import bench_buckets, profile_for_run
from simulator.engine import LinkModel, Simulator, parse_config
from simulator.profiles import ModelProfile
from simulator.trace import PiecewiseConstant

MBIT = 1e6 / 8  # bytes/s in one Mbit/s
_LINK_KEYS = {
    "latency_s",
    "collective_overhead_s",
    "launch_s",
    "ddp_launch_s",
    "comm_compute_slowdown",
    "comm_cpu_s_per_byte",
}


def link_model(link_table: dict[str, Any]) -> LinkModel:
    """The simulator's link from a calibration file's "link" table (other keys ignored)."""
    return LinkModel(**{k: v for k, v in link_table.items() if k in _LINK_KEYS})


def calibrate(
    measured: dict[str, Any], base: pathlib.Path, slowdown: bool = True, link_defaults: bool = False
) -> dict[str, Any]:
    """Predict every run's step time; `slowdown=False` ignores the runs' `comm_compute` probes and
    `link_defaults=True` the file's link constants (both: the simulator as it was before them)."""
    link_table = dict(measured.get("link", {}))
    default_mbit = link_table.pop("bandwidth_mbit", None)
    if link_defaults:
        link_table = {}
    link = link_model(link_table)
    cache: dict[str, ModelProfile] = {}
    rows = []
    for run in measured["runs"]:
        profile = profile_for_run(run, base, cache)
        share = profile.optimizer_s / (profile.compute_s + profile.optimizer_s)
        if run.get("compute_time_s"):
            # compute_time_s includes the optimizer step; keep the recorded share of it.
            profile = profile.with_compute_s(float(run["compute_time_s"]) * (1 - share))
        overrides = {k: v for k, v in run.get("link", {}).items() if k in _LINK_KEYS}
        if not slowdown:
            overrides.pop("comm_cpu_s_per_byte", None)
            overrides.pop("comm_compute_slowdown", None)
        run_link = dataclasses.replace(link, **overrides) if overrides else link
        rate_mbit = run.get("rate_mbit") or default_mbit
        if not rate_mbit:
            raise ValueError(f"run {run} has no rate_mbit and the file no link.bandwidth_mbit")
        config = parse_config(run["config"])
        sim = Simulator(
            profile,
            int(run.get("workers", 2)),
            PiecewiseConstant.constant(rate_mbit * MBIT),
            run_link,
        )
        predicted = sim.steady_step_s(config, rate_mbit * MBIT, steps=8)
        actual = float(run["step_time_median_s"])
        rows.append(
            {
                "model": run.get("model", run.get("profile")),
                "config": run["config"],
                "rate": run.get("rate"),
                "rate_mbit": rate_mbit,
                "workers": run.get("workers", 2),
                "load": run.get("load"),
                "file": run.get("file"),
                "compute_slowdown": run_link.compute_slowdown(rate_mbit * MBIT),
                "measured_s": actual,
                "predicted_s": predicted,
                "error": (predicted - actual) / actual,
            }
        )
    errors = [abs(row["error"]) for row in rows]
    return {
        "source": measured.get("source", ""),
        "link": dataclasses.asdict(link),
        "options": {"slowdown": slowdown, "link_defaults": link_defaults},
        "bandwidth_mbit": default_mbit,
        "runs": rows,
        "groups": group_errors(rows),
        "median_abs_error": statistics.median(errors) if errors else None,
        "max_abs_error": max(errors) if errors else None,
    }


def group_errors(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Median and max |error| per model/rate, per configuration kind, per model."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    keys = {
        "model/rate": lambda r: f"{r['model']} {r.get('rate') or round(r['rate_mbit'])}",
        "config": lambda r: r["config"],
        "model": lambda r: str(r["model"]),
    }
    for name, key in keys.items():
        groups: dict[str, list[float]] = {}
        for row in rows:
            groups.setdefault(key(row), []).append(abs(row["error"]))
        out[name] = {
            k: {"median": statistics.median(v), "max": max(v), "n": len(v)}
            for k, v in groups.items()
        }
    return out


# ---- our own measurements: 2 gloo ranks on loopback -----------------------------------------------


def _loopback_worker(rank: int, world: int, port: int, plan: dict[str, Any], out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from benchmarks.testbed.models import build

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
        batch = workload.make_batch(
            workload.default_batch_size, torch.Generator().manual_seed(rank)
        )
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
        results["runs"].append(
            {
                "model_args": model_args,
                "batch_size": workload.default_batch_size,
                "step_time_median_s": statistics.median(measured["ddp"]),
                "compute_time_s": statistics.median(measured["compute"]),
            }
        )
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
    plan = {
        "allreduce_bytes": [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20],
        "allreduce_reps": 15,
        "warmup": 3,
        "steps": 10,
        "models": [
            {"hidden": 512, "depth": 4},
            {"hidden": 1024, "depth": 6},
            {"hidden": 2048, "depth": 4},
        ],
    }
    raw_path = out_path.with_suffix(".raw.json")
    mp.start_processes(
        _loopback_worker, args=(2, port, plan, str(raw_path)), nprocs=2, start_method="spawn"
    )
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
        "link": {
            "latency_s": 0.0,
            "collective_overhead_s": max(float(fixed), 0.0),
            "ddp_launch_s": 20e-6,
            "bandwidth_mbit": bandwidth_mbit,
        },
        "allreduce_sweep": raw["allreduce"],
        "runs": [
            {
                "model": "mlp",
                "model_args": run["model_args"],
                "batch_size": run["batch_size"],
                "workers": 2,
                "rate_mbit": None,
                "config": "ddp",
                "step_time_median_s": run["step_time_median_s"],
                "compute_time_s": run["compute_time_s"],
            }
            for run in raw["runs"]
        ],
    }
    out_path.write_text(json.dumps(measured, indent=1) + "\n")
    return measured


# ---- the testbed: convert benchmarks/bench_scheduler.py results --------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def from_bench(paths: Sequence[str | pathlib.Path]) -> dict[str, Any]:
    """Measured runs from `bench_scheduler.py --dispatch --out FILE` results (one or more files).

    Nothing here is fitted to the step times that calibrate() predicts; every constant comes from a
    probe the benchmark ran beside the measured configurations:
    - `collective_overhead_s` (per all-reduce, occupies the link): the median of the dispatch
      probe's `extra step us/part` (extra step time per extra partition of a 0.3M-parameter MLP at
      10gbit: what one more gloo collective costs end to end);
    - `launch_s` (scheduler thread per partition): the dispatch probe's scheduler + gloo launch time;
    - `rate_mbit` per run: the goodput of the block's own `comm` probe (bare all-reduces of all
      gradients in 25 MiB buckets, no compute): bytes / (probe time - buckets x overhead), so tbf's
      real rate and gloo's ring efficiency are measured, not assumed from the nominal rate;
    - `compute_time_s` per run: the block's `compute` probe (forward + backward + update, no sync);
    - `link.comm_cpu_s_per_byte` per (file, model): CPU seconds a rank spends per all-reduced
      byte, = 1 / the goodput of the comm probe in the block with the highest rate, where the
      probe is CPU-bound (gloo over veth below tbf's rate: ~8 of 10 Gbit/s; checked, and left out
      when the probe reached the nominal rate). It slows compute while the link is busy by
      1 / (1 - comm_cpu_s_per_byte x bandwidth) (LinkModel.compute_slowdown).
    - `comm_compute` per run (not used for the prediction; a check of the slowdown model): the
      scheduler's own per-step metrics in the block's lowest-rate block ... median over
      configurations of forward_s + backward_s - exposed_comm_s (compute while all-reduces run)
      next to the compute probe.
    """
    runs: list[dict[str, Any]] = []
    dispatch_us: list[float] = []
    launch_us: list[float] = []
    sources = []
    slowdown_blocks: dict[tuple[int, str], dict[str, Any]] = {}
    fastest_blocks: dict[tuple[int, str], dict[str, Any]] = {}
    bench_sizes: dict[str, tuple[int, int]] = {}
    for file_index, path in enumerate(paths):
        data = json.loads(pathlib.Path(path).read_text())
        sources.append(
            f"{path}: {data.get('command', '')} (load {data.get('load_before')} -> "
            f"{data.get('load_after')})"
        )
        for row in (data.get("dispatch") or {}).get("configs", {}).values():
            if row.get("external_us_per_extra_partition") is not None:
                dispatch_us.append(row["external_us_per_extra_partition"])
            launch_us.append(
                row["scheduler_us_per_partition"] + row["backend_launch_us_per_partition"]
            )
        for block in data["blocks"]:
            rows, model = block["rows"], block["model"]
            if "compute" not in rows or "comm" not in rows:
                continue
            key = (file_index, model)
            nominal = parse_bytes_per_s(block["rate"])
            best = slowdown_blocks.get(key)
            if best is None or nominal < best["nominal"]:
                slowdown_blocks[key] = {"nominal": nominal, "block": block}
            fastest = fastest_blocks.get(key)
            if fastest is None or nominal > fastest["nominal"]:
                fastest_blocks[key] = {"nominal": nominal, "block": block}
            if model not in bench_sizes:
                bench_sizes[model] = bench_buckets(model, {})
            for label, row in rows.items():
                if label in ("compute", "comm"):
                    continue
                runs.append(
                    {
                        "model": model,
                        "model_args": {},
                        "batch_size": block["batch_size"],
                        "workers": 2,
                        "rate": block["rate"],
                        "config": label,
                        "step_time_median_s": row["median_step_s"],
                        "compute_time_s": rows["compute"]["median_step_s"],
                        "comm_probe_s": rows["comm"]["median_step_s"],
                        "rounds": row.get("rounds"),
                        "load": block.get("load"),
                        "file": str(path),
                        "_key": key,
                    }
                )
    overhead_s = (_median(dispatch_us) or 0.0) * 1e-6
    launch_s = (_median(launch_us) or 100.0) * 1e-6
    slowdowns: dict[tuple[int, str], float] = {}
    for key, item in slowdown_blocks.items():
        block = item["block"]
        under_comm = []
        for result in block["raw"]:
            metrics = result.get("metrics_median")
            if result.get("kind") != "sched" or not metrics:
                continue
            under_comm.append(
                metrics["forward_s"] + metrics["backward_s"] - (result.get("exposed_comm_s") or 0.0)
            )
        if under_comm:
            slowdowns[key] = {
                "under_comm_s": statistics.median(under_comm),
                "compute_s": block["rows"]["compute"]["median_step_s"],
                "rate": block["rate"],
            }
    cpu_per_byte: dict[tuple[int, str], dict[str, Any]] = {}
    for key, item in fastest_blocks.items():
        grad_bytes, buckets = bench_sizes[key[1]]
        wire_s = item["block"]["rows"]["comm"]["median_step_s"] - buckets * overhead_s
        goodput_bits = grad_bytes * 8 / wire_s
        if goodput_bits < 0.95 * item["nominal"]:  # CPU-bound, not held by tbf
            cpu_per_byte[key] = {
                "s_per_byte": wire_s / grad_bytes,
                "rate": item["block"]["rate"],
                "goodput_mbit": goodput_bits / 1e6,
            }
    for run in runs:
        grad_bytes, buckets = bench_sizes[run["model"]]
        wire_s = run["comm_probe_s"] - buckets * overhead_s
        run["rate_mbit"] = grad_bytes / wire_s / MBIT  # N = 2: wire bytes = gradient bytes
        key = run.pop("_key")
        if key in cpu_per_byte:
            run["link"] = {"comm_cpu_s_per_byte": cpu_per_byte[key]["s_per_byte"]}
            run["comm_cpu_from"] = (
                f"comm probe at {cpu_per_byte[key]['rate']}: "
                f"{cpu_per_byte[key]['goodput_mbit']:.0f} Mbit/s goodput"
            )
        info = slowdowns.get(key)
        if info is not None:
            run["comm_compute"] = {
                "under_comm_s": info["under_comm_s"],
                "alone_s": info["compute_s"],
                "measured_at": info["rate"],
            }
    return {
        "source": "; ".join(sources),
        "link": {
            "latency_s": 0.0,
            "collective_overhead_s": overhead_s,
            "launch_s": launch_s,
            "ddp_launch_s": 20e-6,
        },
        "link_from": {
            "collective_overhead_s": "median dispatch-probe extra step time per extra partition",
            "samples_us": dispatch_us,
            "launch_s": "median dispatch-probe scheduler + gloo launch per partition",
            "rate_mbit": "per run, from the block's comm probe",
        },
        "runs": runs,
    }


def parse_bytes_per_s(rate: str) -> float:
    from benchmarks.testbed import parse_rate

    return float(parse_rate(rate))


def format_report(report: dict[str, Any], runs: bool = True) -> str:
    lines = [f"calibrated against: {report['source']}"]
    if runs:
        lines.append(
            f"{'model':<10} {'config':<18} {'Mbit/s':>8} {'measured':>9} {'predicted':>9} "
            f"{'error':>7}"
        )
        for row in report["runs"]:
            lines.append(
                f"{row['model']!s:<10} {row['config']:<18} {row['rate_mbit']:>8.0f} "
                f"{row['measured_s'] * 1e3:>7.1f}ms {row['predicted_s'] * 1e3:>7.1f}ms "
                f"{row['error'] * 100:>+6.1f}%"
            )
    for name, groups in report.get("groups", {}).items():
        if len(groups) < 2:
            continue
        lines.append(f"|error| by {name}:")
        for key, g in groups.items():
            lines.append(
                f"  {key:<22} median {g['median'] * 100:5.1f}%  max {g['max'] * 100:5.1f}%"
                f"  (n={g['n']})"
            )
    lines.append(
        f"median |error| {report['median_abs_error'] * 100:.1f}% "
        f"(max {report['max_abs_error'] * 100:.1f}%; goal <= 15%)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.calibrate", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "measured",
        nargs="?",
        help="measured-runs JSON (with --measure-loopback: written first; with "
        "--from-bench: written from the benchmark results)",
    )
    parser.add_argument(
        "--measure-loopback",
        action="store_true",
        help="measure 2 gloo ranks on loopback into MEASURED, then calibrate",
    )
    parser.add_argument(
        "--from-bench",
        nargs="+",
        metavar="BENCH_JSON",
        help="convert bench_scheduler.py --out results into MEASURED, then calibrate",
    )
    parser.add_argument(
        "--no-slowdown",
        action="store_true",
        help="ignore the measured compute slowdown under communication",
    )
    parser.add_argument(
        "--link-defaults",
        action="store_true",
        help="ignore the file's link constants (LinkModel defaults)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also report the simulator without slowdown and probe constants",
    )
    parser.add_argument("--quiet", action="store_true", help="groups only, not every run")
    parser.add_argument(
        "--map",
        metavar="MAP_JSON",
        help="calibrate against an optimum map (benchmarks.bench_conditions): per "
        "condition Kendall tau of the grid, regret of the simulator's best, "
        "headroom predicted vs measured",
    )
    parser.add_argument(
        "--mixed-results",
        metavar="MIXED_JSON",
        help="--map: mixed traces measured directly (bench_conditions --mixed)",
    )
    parser.add_argument(
        "--write-scenarios",
        metavar="DIR",
        help="--map: also write testbed scenarios of the mixed traces where "
        "re-tuning paid most into DIR",
    )
    parser.add_argument(
        "--profiles",
        default="benchmarks/calibration/profiles",
        help="--map: recorded model profiles are read from / written to here",
    )
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args(argv)
    if args.map:
        from benchmarks.calibrate_map import calibrate_map, format_map_report

        mixed = (
            json.loads(pathlib.Path(args.mixed_results).read_text()) if args.mixed_results else None
        )
        report = calibrate_map(
            json.loads(pathlib.Path(args.map).read_text()),
            pathlib.Path(args.profiles) if args.profiles else None,
            mixed,
        )
        print(format_map_report(report))
        if args.write_scenarios:
            from benchmarks.calibrate_map import write_scenarios

            for path in write_scenarios(
                json.loads(pathlib.Path(args.map).read_text()),
                report,
                pathlib.Path(args.write_scenarios),
            ):
                print(f"wrote {path}")
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps(_rounded(report), indent=1) + "\n")
        return 0
    if not args.measured:
        parser.error("give MEASURED (or --map)")
    path = pathlib.Path(args.measured)
    if args.measure_loopback:
        measured = measure_loopback(path)
    elif args.from_bench:
        measured = from_bench(args.from_bench)
        path.write_text(json.dumps(_rounded(measured), indent=1) + "\n")
    else:
        measured = json.loads(path.read_text())
    report = calibrate(
        measured, path.parent, slowdown=not args.no_slowdown, link_defaults=args.link_defaults
    )
    if args.compare:
        before = calibrate(measured, path.parent, slowdown=False, link_defaults=True)
        print("== before (LinkModel defaults, no compute slowdown) ==")
        print(format_report(before, runs=not args.quiet))
        print("== after ==")
        report["before"] = {
            k: before[k] for k in ("link", "options", "groups", "median_abs_error", "max_abs_error")
        }
        for row, old in zip(report["runs"], before["runs"]):
            row["predicted_before_s"] = old["predicted_s"]
    print(format_report(report, runs=not args.quiet))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(_rounded(report), indent=1) + "\n")
    return 0


def _rounded(obj: Any) -> Any:
    """Floats to 4 significant digits (a small report); numpy scalars become Python numbers."""
    if hasattr(obj, "dtype") and hasattr(obj, "item"):
        obj = obj.item()
    if isinstance(obj, float):
        return float(f"{obj:.4g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
