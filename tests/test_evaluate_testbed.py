"""The runner's testbed half: an online policy (bo-once) trains real ranks under a rate trace, and
a fixed configuration is reported to a real daemon that only observes (observe:P,C)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.slow]

if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
    pytest.skip(
        "the testbed tests need root and iproute2 (ip, tc); they run as root in CI",
        allow_module_level=True,
    )

from benchmarks.harness.evaluate import main
from benchmarks.testbed import NAME_PREFIX, list_namespaces

REPO = Path(__file__).resolve().parents[1]

# A tiny MLP (0.4M parameters), 4 s per run, 1gbit -> 200mbit at 2 s; grid-best and the oracle
# (always run as references) have one grid configuration, so the whole evaluation is 3 testbed runs
# (grid, observe, oracle), ~25 s.
SCENARIO = textwrap.dedent("""
    model = "{profile}"
    workers = 2
    duration_s = 4
    [bandwidth]
    kind = "step"
    levels = [1, 0.2]
    at_s = [2]
    [testbed]
    model = "mlp"
    model_args = {{in_features = 256, hidden = 256, depth = 4}}
    batch_size = 32
    grid = ["sched:1MiB,4MiB"]
    bo_trial_steps = 3
    bo_settle_steps = 1
    timeout_s = 60
""")


def test_online_policy_runs_on_testbed(tmp_path: Path) -> None:
    profile = REPO / "benchmarks" / "scenarios" / "testbed-mlp.profile.json"
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO.format(profile=profile))
    out = tmp_path / "out"
    assert (
        main([str(scenario), "--policy", "observe:1MiB,4MiB", "--testbed", "--out", str(out)]) == 0
    )
    with open(out / "results.csv", newline="") as table_file:
        rows = list(csv.DictReader(table_file))
    assert [row["policy"] for row in rows] == ["observe:1MiB,4MiB"]
    # the run stopped at the scenario's duration (--max-seconds), not after a fixed step count
    # (a step here takes milliseconds: the bound leaves room for another test's load beside it)
    assert 3.0 < float(rows[0]["elapsed_s"]) < 8.0
    result = json.loads((out / "results.json").read_text())["scenarios"][0]
    # observe: the configuration held, every step reported to a real autobyted whose tuner looked
    # at the job (a status record exists) and whose recommendations were never applied (a policy
    # that applies its decisions while the ranks train: bo-once in the scaled scenario's test below)
    assert rows[0]["mode"] == "testbed" and int(rows[0]["steps"]) > 10
    observed = result["online"]["observe:1MiB,4MiB"]
    assert observed["applied"] == 0 and observed["tuner"].get("mode") == "observe", observed[
        "tuner"
    ]
    assert "sched:1MiB,4MiB held" in rows[0]["chose"]
    # the host during every run (load, the CPU the hypervisor stole: a share of all CPU time)
    for policy in ("observe:1MiB,4MiB", "oracle", "grid-best"):
        host = result["hosts"][policy]
        assert 0.0 <= host["steal_share"] < 1.0 and len(host["load_start"].split()) == 3, (
            policy,
            host,
        )
    assert (out / "tiny.png").exists()
    assert not [ns for ns in list_namespaces() if ns.startswith(f"{NAME_PREFIX}-{os.getpid()}-")]


# GPT-2 small's tensors and rates / 64 on 2 emulated ranks, ~90 ms of compute a step
SCALED = textwrap.dedent("""
    model = "gpt2"
    compute_scale = 2000
    workers = 2
    duration_s = 8
    [bandwidth]
    kind = "step"
    levels = [17, 4]
    at_s = [3]
    [testbed]
    mode = "emulated"
    byte_scale = 64
    grid = ["sched:16MiB,64MiB", "sched:64MiB,256MiB"]
    bo_trial_steps = 2
    bo_settle_steps = 1
    timeout_s = 90
""")


def test_a_scaled_emulated_scenario_runs_its_policies_in_the_models_bytes(tmp_path: Path) -> None:
    """`evaluate --testbed` on a scenario whose byte scale is not 1: every size a policy names is
    the model's; the ranks run it divided by the scale, and what they report reads back in the
    model's bytes (a size run unscaled would read back 64 times too large)."""
    scenario = tmp_path / "scaled.toml"
    scenario.write_text(SCALED)
    cache = tmp_path / "cache"
    argv = [str(scenario), "--testbed", "--skip-references", "--testbed-cache", str(cache)]
    # DDP's label across the scale: test_emulated.py, test_sizes_cross_the_byte_scale_both_ways
    policies = ["--policy", "static:16MiB,64MiB", "--policy", "bo-once"]
    assert main([*argv, *policies, "--out", str(tmp_path / "out")]) == 0
    runs = {path.name: json.loads(path.read_text()) for path in cache.glob("*.json")}
    static = next(run for name, run in runs.items() if "16MiB_64MiB" in name)
    assert set(static["labels"]) == {"sched:16MiB,64MiB"} and len(static["labels"]) > 3
    result = json.loads((tmp_path / "out" / "results.json").read_text())["scenarios"][0]
    online = result["online"]["bo-once"]
    assert online["applied"] >= 1
    tried = {d["config"] for d in online["decisions"]}
    bo_run = next(run for name, run in runs.items() if "bo-once" in name)
    # what rank 0 ran after bo-once's first decision are its decisions, read back in model bytes
    # (one made after the last step never ran)
    ran = set(bo_run["labels"])
    assert ran <= tried | {bo_run["labels"][0]} and len(ran) >= 2, (bo_run["labels"], tried)
