"""The GPU check's CPU side (scripts/gpu-check.sh, benchmarks/gpu_check.py), so that it cannot rot
between the sessions that are lent a GPU: on a machine without one it reports every GPU step as
skipped because there is no CUDA device (exit 0); with --allow-cpu its steps run for real on CPU
tensors over gloo (the same harness the GPU run uses), with DDP's parameters bit for bit."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def _gpu_check(out, *args, timeout=280):
    # CUDA_VISIBLE_DEVICES="": the same answer on a machine that has a GPU
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    env.update(PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        ["bash", str(SCRIPT), str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=out.parent,
        timeout=timeout,
        check=False,
    )


def test_without_a_gpu_every_gpu_step_is_skipped_cleanly(tmp_path):
    out = tmp_path / "report"
    result = _gpu_check(out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    report = json.loads((out / "gpu-check.json").read_text())
    assert (
        report["device"] == "cpu" and report["verdict"] == "passed" and report["failed_steps"] == []
    )
    steps = report["steps"]
    for name in ("cuda_tests", "two_ranks", "nccl_one_rank", "overhead_1", "overhead_2"):
        assert steps[name] == {
            "status": "skipped",
            "reason": "no CUDA device (torch.cuda.is_available() is False)",
        }, name
    assert steps["environment"]["status"] == "passed"
    info = steps["environment"]["info"]
    assert info["cuda_available"] is False and info["torch"] and "autobyte" in info
    assert info["packages"]["google.protobuf"] and info["packages"]["grpc"]
    # this checkout is set up with the native path prebuilt (scripts/setup.sh): nothing to compile
    assert steps["native"]["status"] == "passed" and steps["native"]["source"] == "prebuilt"
    table = (out / "gpu-check.txt").read_text()
    assert table.startswith("autobyte GPU check: PASSED") and table.count("no CUDA device") == 5
    assert result.stdout == table
    assert {p.name for p in out.iterdir()} == {
        "gpu-check.json",
        "gpu-check.txt",
        "gpu-check-logs.txt",
    }


def test_bad_arguments_are_refused_with_the_bad_value(tmp_path):
    result = _gpu_check(tmp_path / "report", "--only", "two_ranks,warp_drive")
    assert (
        result.returncode == 2
        and "warp_drive" in result.stderr
        and "Traceback" not in result.stderr
    )
    result = _gpu_check(tmp_path / "report", "--budget-s", "5")
    assert result.returncode == 2 and "--budget-s" in result.stderr and "5" in result.stderr
    missing = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "OUT"},
        check=False,
    )
    assert missing.returncode == 2 and "usage" in missing.stderr


@pytest.mark.timeout(600)
def test_cpu_self_test_runs_the_steps_bit_for_bit(tmp_path):
    out = tmp_path / "report"
    result = _gpu_check(
        out, "--allow-cpu", "--quick", "--only", "two_ranks,nccl_one_rank,overhead_2", timeout=560
    )
    report = json.loads((out / "gpu-check.json").read_text())
    assert result.returncode == 0, (report, (out / "gpu-check-logs.txt").read_text()[-4000:])
    steps = report["steps"]
    assert set(steps) == {"environment", "two_ranks", "nccl_one_rank", "overhead_2"}
    two = steps["two_ranks"]
    assert two["status"] == "passed" and len(two["ranks"]) == 2
    cases = two["ranks"][0]["cases"]
    assert {
        "mlp_sgd_momentum",
        "transformer_tied_adamw",
        "amp_fp16_gradscaler",
        "amp_bf16",
        "reconfigure_under_jitter",
    } <= set(cases)
    for name in cases:
        rows = [rank["cases"][name] for rank in two["ranks"]]
        assert [row["max_abs_diff"] for row in rows] == [0.0, 0.0], name
        assert rows[0]["digest"] == rows[1]["digest"], name
    assert cases["reconfigure_under_jitter"]["configs_seen"] > 1
    one = steps["nccl_one_rank"]
    assert one["status"] == "passed" and len(one["ranks"]) == 1
    for name, row in one["ranks"][0]["cases"].items():
        assert row["max_abs_diff"] == 0.0, name
        assert row["syncs_scheduled"]["counted"] is False  # host syncs are counted on CUDA only
    overhead = steps["overhead_2"]
    assert overhead["status"] == "measured"
    for rank in overhead["ranks"]:
        assert set(rank["models"]) == {"gpt2_small", "resnet50"}
        for row in rank["models"].values():
            assert row["ddp"]["step_ms"] > 0 and row["scheduled"]["step_ms"] > 0
            assert row["scheduled"]["training_thread_cpu_ms"] > 0 and row["scheduled"][
                "hot_path"
            ] in ("native", "python")
    table = (out / "gpu-check.txt").read_text()
    assert "two_ranks: case" in table and "overhead_2 (rank 0" in table
