"""The GPU check in one call: on a fresh GPU machine, each step under a time cap, one JSON report and a
readable table. `scripts/gpu-check.sh` runs it with the checkout on PYTHONPATH:

    python -m benchmarks.gpu_check --out DIR [--budget-s 470] [--allow-cpu] [--quick] [--only STEP,...]

Steps, in order (each a subprocess with its own cap; the whole run keeps within --budget-s):
* `environment`: Python, torch, CUDA and the device, the optional packages the steps need.
* `native`: whether the native hot path is here; where it is not, it is compiled against this torch
  (`autobyte check-build --build`, in the background while the next steps run). CUDA tensors run the
  Python path either way; the report says which was available.
* `cuda_tests`: tests/test_scheduler_cuda.py (pytest; the tests that need 2 GPUs skip on one).
* `two_ranks`: 2 ranks on the one GPU over gloo with CUDA tensors: DDP vs the scheduler, bit for bit.
* `nccl_one_rank`: one NCCL rank through the CUDA stream path vs plain training, bit for bit, and the
  host synchronisations per step of each.
* `overhead_1`, `overhead_2`: step time of a GPT-2-small-sized model and a ResNet-50, scheduler vs
  DDP, on 1 rank (NCCL) and 2 ranks (gloo on one GPU), and the host time the scheduler adds.
Without a CUDA device every GPU step is reported as skipped (exit 0), unless --allow-cpu runs them on
CPU tensors over gloo (the suite's check that the harness works). Exit 1 when a step failed or ran
out of time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent.parent
REPORT, TABLE, LOGS = "gpu-check.json", "gpu-check.txt", "gpu-check-logs.txt"
GPU_STEPS = ("cuda_tests", "two_ranks", "nccl_one_rank", "overhead_1", "overhead_2")
CAPS_S = {
    "environment": 60,
    "native": 240,
    "cuda_tests": 100,
    "two_ranks": 120,
    "nccl_one_rank": 70,
    "overhead_1": 70,
    "overhead_2": 100,
}
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


# The environment probe: every optional part guarded, so that what is missing is reported, not fatal.
_PROBE = """
import importlib.util, json, sys
out = {"python": sys.version.split()[0]}
def guarded(key, get):
    try:
        out[key] = get()
    except Exception as error:
        out[key] = f"unknown ({type(error).__name__}: {error})"
import torch
out.update(torch=torch.__version__, cuda_available=torch.cuda.is_available(), cuda=torch.version.cuda)
guarded("devices", torch.cuda.device_count)
if out["cuda_available"]:
    guarded("device_name", lambda: torch.cuda.get_device_name(0))
    guarded("nccl", lambda: str(torch.cuda.nccl.version()))
def version(name):
    if importlib.util.find_spec(name) is None:
        return None
    from importlib import metadata
    dist = {"google.protobuf": "protobuf", "grpc": "grpcio", "pytest_timeout": "pytest-timeout"}.get(name, name)
    try:
        return metadata.version(dist)
    except Exception:
        return "present"
out["packages"] = {}
for name in ("grpc", "google.protobuf", "click", "pytest", "pytest_timeout", "transformers", "lightning", "ninja"):
    guarded("_v", lambda: version(name))
    out["packages"][name] = out.pop("_v")
try:
    import autobyte, autobyte.scheduler
    out["autobyte"] = autobyte.__version__
except Exception as error:
    out["autobyte_import_error"] = f"{type(error).__name__}: {error}"
print("GPU-CHECK-ENV " + json.dumps(out))
"""


def _run(
    args: list[str], cap_s: float, log: list[str], name: str, env: dict[str, str]
) -> tuple[int | None, str]:
    """(exit code or None on timeout, output), the whole process group killed at the cap."""
    proc = subprocess.Popen(
        args,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=cap_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
    log.append(f"===== {name} (exit {code}) =====\n{output[-20000:]}\n")
    return code, output


class Check:
    def __init__(
        self, out: Path, budget_s: float, allow_cpu: bool, quick: bool, only: set[str] | None
    ) -> None:
        self.out, self.allow_cpu, self.quick, self.only = out, allow_cpu, quick, only
        self.deadline = time.monotonic() + budget_s
        self.work = Path(tempfile.mkdtemp(prefix="autobyte-gpu-check-"))
        self.log: list[str] = []
        self.steps: dict[str, dict[str, Any]] = {}
        self.env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            AUTOBYTE_NATIVE_BUILD="0",
            TORCH_EXTENSIONS_DIR=os.environ.get(
                "TORCH_EXTENSIONS_DIR", str(self.work / "torch_extensions")
            ),
        )
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "client"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        self.device = "cpu"
        self._native_build: subprocess.Popen | None = None

    def cap(self, name: str) -> float:
        return max(0.0, min(CAPS_S[name], self.deadline - time.monotonic()))

    def wanted(self, name: str) -> bool:
        return self.only is None or name in self.only

    # ---------------------------------------------------------------------------------- steps

    def environment(self) -> None:
        started = time.monotonic()
        code, output = _run(
            [sys.executable, "-c", _PROBE],
            self.cap("environment"),
            self.log,
            "environment",
            self.env,
        )
        line = next((ln for ln in output.splitlines() if ln.startswith("GPU-CHECK-ENV ")), None)
        if code != 0 or line is None:
            self.steps["environment"] = {
                "status": "failed",
                "seconds": _since(started),
                "reason": f"the probe failed (exit {code}): {output[-1500:]}",
            }
            return
        info = json.loads(line.split(" ", 1)[1])
        self.device = "cuda" if info["cuda_available"] else "cpu"
        failed = "autobyte_import_error" in info
        reason = ""
        if failed:
            reason = "the checkout's autobyte does not import: " + info["autobyte_import_error"]
            if "protobuf" in reason.lower() or "grpc" in reason.lower():
                reason += (
                    "; run bash scripts/gpu-check-wheels.sh where pip reaches the index, and carry "
                    ".whl to this machine"
                )
        self.steps["environment"] = {
            "status": "failed" if failed else "passed",
            "seconds": _since(started),
            "info": info,
            **({"reason": reason} if failed else {}),
        }

    def start_native(self) -> None:
        started = time.monotonic()
        code, output = _run(
            [sys.executable, "-m", "autobyte.cli", "check-build", "--format", "json"],
            self.cap("environment"),
            self.log,
            "native: check-build",
            self.env,
        )
        try:
            report = json.loads(output[output.index("{") :])
        except ValueError:
            self.steps["native"] = {
                "status": "failed",
                "seconds": _since(started),
                "reason": f"autobyte check-build failed (exit {code})",
            }
            return
        native = report["native"]
        self.steps["native"] = {
            "status": "passed",
            "seconds": _since(started),
            "before": native,
            "source": report["native_build"]["source"],
        }
        if native["built"] or not report["torch"]["installed"]:
            self.steps["native"]["result"] = (
                "prebuilt in the checkout" if native["built"] else "no torch"
            )
            return
        self._native_started = time.monotonic()
        self._native_build = subprocess.Popen(
            [sys.executable, "-m", "autobyte.cli", "check-build", "--build", "--format", "json"],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def finish_native(self) -> None:
        proc = self._native_build
        if proc is None:
            return
        remaining = max(
            1.0,
            min(
                CAPS_S["native"] - (time.monotonic() - self._native_started),
                self.deadline - time.monotonic(),
            ),
        )
        step = self.steps["native"]
        try:
            output, _ = proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            step.update(
                status="timed out",
                result="the compile did not finish in time: the Python path "
                "ran (CUDA tensors run it anyway)",
            )
        else:
            if proc.returncode == 0:
                after = json.loads(output[output.index("{") :])
                step["after"] = after["native"]
                step["result"] = (
                    f"compiled against torch {after['native']['built_for_torch']} here "
                    f"({after['native_build']['cache_dir']}); CUDA tensors run the Python path"
                )
            else:
                step.update(status="failed", result="the compile failed: the Python path ran")
        step["seconds"] = round(step["seconds"] + time.monotonic() - self._native_started, 1)
        self.log.append(
            f"===== native: check-build --build (exit {proc.returncode}) =====\n{output[-20000:]}\n"
        )

    def cuda_tests(self) -> None:
        started = time.monotonic()
        junit = self.work / "cuda-tests.xml"
        code, output = _run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-rs",
                f"--junitxml={junit}",
                "tests/test_scheduler_cuda.py",
            ],
            self.cap("cuda_tests"),
            self.log,
            "cuda_tests",
            self.env,
        )
        result: dict[str, Any] = {"seconds": _since(started), "exit": code}
        if code is None:
            result.update(status="timed out", reason=f"over its {CAPS_S['cuda_tests']} s cap")
        if junit.exists():
            tests = []
            for case in ElementTree.parse(junit).getroot().iter("testcase"):
                outcome, detail = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    found = case.find(tag)
                    if found is not None:
                        outcome = "failed" if tag != "skipped" else "skipped"
                        detail = (found.get("message") or "")[:500]
                tests.append(
                    {
                        "name": case.get("name"),
                        "outcome": outcome,
                        "detail": detail,
                        "seconds": float(case.get("time") or 0.0),
                    }
                )
            result["tests"] = tests
            if code is not None:
                ran = [t for t in tests if t["outcome"] != "skipped"]
                bad = [t for t in tests if t["outcome"] == "failed"]
                result["status"] = (
                    "failed" if bad or code not in (0, 5) else ("passed" if ran else "skipped")
                )
                if not ran and not bad:
                    result["reason"] = (
                        "; ".join(sorted({t["detail"] for t in tests})) or "no test ran"
                    )
        elif code is not None:
            result.update(
                status="failed", reason=f"pytest exited {code} without a report: {output[-800:]}"
            )
        self.steps["cuda_tests"] = result

    def cases(self, name: str) -> None:
        started = time.monotonic()
        target = self.work / f"{name}.json"
        args = [
            sys.executable,
            "-m",
            "benchmarks.gpu_check_cases",
            name,
            "--device",
            self.device,
            "--out",
            str(target),
        ] + (["--quick"] if self.quick else [])
        code, output = _run(args, self.cap(name), self.log, name, self.env)
        ranks = _read_ranks(target)
        result: dict[str, Any] = {"seconds": _since(started), "exit": code, "ranks": ranks}
        if code is None:
            result.update(
                status="timed out", reason=f"over its {CAPS_S[name]} s cap (or the budget)"
            )
        elif not ranks or any(not r.get("ok") for r in ranks):
            errors = [r.get("error", "no result") for r in ranks] or [output[-1500:]]
            result.update(status="failed", reason=errors[0][-1500:])
        else:
            result.update(_judge(name, ranks))
        self.steps[name] = result

    # ---------------------------------------------------------------------------------- the run

    def run(self) -> int:
        self.environment()
        env_ok = self.steps["environment"]["status"] == "passed"
        if env_ok and self.wanted("native"):
            self.start_native()
        on_gpu = self.device == "cuda" or self.allow_cpu
        for name in GPU_STEPS:
            if not self.wanted(name):
                continue
            if not env_ok:
                self.steps[name] = {"status": "skipped", "reason": "the environment step failed"}
            elif not on_gpu:
                self.steps[name] = {"status": "skipped", "reason": NO_CUDA}
            elif self.cap(name) < 5:
                self.steps[name] = {"status": "skipped", "reason": "no time left in the budget"}
            elif name == "cuda_tests":
                self.cuda_tests()
            else:
                if name.startswith("overhead"):
                    self.finish_native()  # no compile running beside the timed steps
                self.cases(name)
        self.finish_native()
        return self.write()

    def write(self) -> int:
        failed = [n for n, s in self.steps.items() if s.get("status") in ("failed", "timed out")]
        report = {
            "device": self.device,
            "allow_cpu": self.allow_cpu,
            "quick": self.quick,
            "verdict": "failed" if failed else "passed",
            "failed_steps": failed,
            "steps": self.steps,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / REPORT).write_text(json.dumps(report, indent=1))
        (self.out / TABLE).write_text(table(report))
        (self.out / LOGS).write_text("".join(self.log)[-4_000_000:])
        shutil.rmtree(
            self.work, ignore_errors=True
        )  # step results (now in the report), the compile
        return 1 if failed else 0


def _since(started: float) -> float:
    return round(time.monotonic() - started, 1)


def _read_ranks(target: Path) -> list[dict]:
    """The merged result, or what the ranks left (a step killed at its cap merges nothing)."""
    if target.exists():
        return json.loads(target.read_text())["ranks"]
    ranks = []
    for part in sorted(target.parent.glob(target.name + ".rank*")):
        ranks.append(json.loads(part.read_text()))
    return ranks


def _judge(name: str, ranks: list[dict]) -> dict[str, Any]:
    """passed/failed of a cases step: bit for bit (max |Δstate_dict| == 0.0) and equal on every rank."""
    if name.startswith("overhead"):
        errors = {
            m: row["error"] for r in ranks for m, row in r["models"].items() if "error" in row
        }
        return (
            {
                "status": "failed",
                "reason": f"{sorted(errors)}: {next(iter(errors.values()))[-800:]}",
            }
            if errors
            else {"status": "measured"}
        )
    bad = []
    for case in ranks[0]["cases"]:
        rows = [r["cases"].get(case, {"error": "missing on this rank"}) for r in ranks]
        if any("error" in row for row in rows):
            bad.append(f"{case}: {next(row['error'] for row in rows if 'error' in row)[-600:]}")
        elif any(row["max_abs_diff"] != 0.0 for row in rows):
            bad.append(
                f"{case}: max |Δstate_dict| {max(row['max_abs_diff'] for row in rows)} (must be 0.0)"
            )
        elif len({row["digest"] for row in rows}) != 1:
            bad.append(f"{case}: parameters differ between ranks")
    return {"status": "failed", "reason": "; ".join(bad)} if bad else {"status": "passed"}


def table(report: dict) -> str:
    """The readable summary: one line per step, then the cases and the overhead rows."""
    lines = [
        (
            f"autobyte GPU check: {report['verdict'].upper()} (device {report['device']}"
            f"{', CPU self-test' if report['allow_cpu'] and report['device'] == 'cpu' else ''})"
        ),
        "",
    ]
    lines.append(f"{'STEP':<15}{'STATUS':<11}{'SECONDS':>8}  NOTE")
    for name, step in report["steps"].items():
        note = step.get("reason") or step.get("result") or ""
        if name == "environment" and "info" in step:
            info = step["info"]
            note = (
                f"python {info['python']}, torch {info['torch']}, cuda {info.get('cuda')}, "
                f"{info.get('device_name', 'no GPU')}; missing: "
                + (", ".join(k for k, v in info["packages"].items() if not v) or "none")
                + (f"; {step['reason']}" if step.get("reason") else "")
            )
        lines.append(
            f"{name:<15}{step.get('status', '?'):<11}{step.get('seconds', 0):>8}  {note[:200]}"
        )
    for name in ("two_ranks", "nccl_one_rank"):
        ranks = report["steps"].get(name, {}).get("ranks") or []
        if not ranks or "cases" not in ranks[0]:
            continue
        lines += [
            "",
            f"{name}: case, max |Δstate_dict| per rank, equal on every rank, syncs/step plain -> scheduled",
        ]
        for case in ranks[0]["cases"]:
            rows = [r.get("cases", {}).get(case, {}) for r in ranks]
            if any("error" in row or not row for row in rows):
                lines.append(f"  {case:<30} ERROR")
                continue
            diffs = " ".join(f"{row['max_abs_diff']:g}" for row in rows)
            same = "yes" if len({row["digest"] for row in rows}) == 1 else "NO"
            syncs = ""
            if "syncs_scheduled" in rows[0]:
                syncs = (
                    f"  {rows[0]['syncs_plain']['syncs_per_step']:.1f} -> "
                    f"{rows[0]['syncs_scheduled']['syncs_per_step']:.1f}"
                )
            lines.append(f"  {case:<30} {diffs:<12} {same:<4}{syncs}")
        for case, why in ranks[0].get("skipped", {}).items():
            lines.append(f"  {case:<30} skipped: {why}")
    for name in ("overhead_1", "overhead_2"):
        ranks = report["steps"].get(name, {}).get("ranks") or []
        if not ranks or "models" not in ranks[0]:
            continue
        lines += [
            "",
            (
                f"{name} (rank 0; ms per step): model, DDP, scheduled, speed vs DDP, host loop (no "
                "sync) DDP/sched, training-thread CPU DDP/sched, other threads CPU DDP/sched, "
                "wait-before-use, syncs/step"
            ),
        ]
        for model, row in ranks[0]["models"].items():
            if "error" in row:
                lines.append(f"  {model:<12} ERROR")
                continue
            d, s = row["ddp"], row["scheduled"]
            lines.append(
                f"  {model:<12} {d['step_ms']:8.2f} {s['step_ms']:8.2f} {row['speed_vs_ddp']:6.3f}x "
                f"{d['host_loop_ms_median']:7.2f}/{s['host_loop_ms_median']:<7.2f} "
                f"{d['training_thread_cpu_ms']:7.2f}/{s['training_thread_cpu_ms']:<7.2f} "
                f"{d['other_threads_cpu_ms']:7.2f}/{s['other_threads_cpu_ms']:<7.2f} "
                f"{s['wait_before_use_ms']:7.2f} {s['syncs_per_step']:5.1f}"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=os.environ.get("OUT"), help="report folder (default: $OUT)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=470.0, help="the whole run's time, seconds"
    )
    parser.add_argument(
        "--allow-cpu", action="store_true", help="without a GPU, run the steps on CPU tensors"
    )
    parser.add_argument("--quick", action="store_true", help="small models and few steps")
    parser.add_argument("--only", default="", help="comma-separated steps (default: all)")
    args = parser.parse_args(argv)
    if not args.out:
        parser.error("--out DIR is required when $OUT is not set")
    if not 30 <= args.budget_s <= 3600:
        parser.error(f"--budget-s must be between 30 and 3600 seconds, got {args.budget_s:g}")
    only = {s.strip() for s in args.only.split(",") if s.strip()} or None
    unknown = (only or set()) - {"native", *GPU_STEPS}
    if unknown:
        parser.error(f"unknown step(s) {sorted(unknown)}; choose from {['native', *GPU_STEPS]}")
    check = Check(Path(args.out), args.budget_s, args.allow_cpu, args.quick, only)
    code = check.run()
    sys.stdout.write((Path(args.out) / TABLE).read_text())
    return code


if __name__ == "__main__":
    sys.exit(main())
