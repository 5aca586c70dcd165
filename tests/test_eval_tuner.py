"""`benchmarks.harness.eval_tuner` on a scenario with condition keys (a competing flow): its phases carry
the flows and the CPU share beside the rate, and the oracle and the trials are judged under them."""

from benchmarks.harness.eval_tuner import evaluate_one
from tests.helpers.paths import ROOT


def test_a_scenario_with_a_competing_flow_is_evaluated_under_its_conditions():
    result = evaluate_one(
        str(ROOT / "benchmarks" / "scenarios" / "emulated-gpt2-medium-4w-flows.toml")
    )
    # the flow arrives and leaves: three phases, each judged against its own oracle
    assert result["changes"] >= 2 and len(result["convergence"]) == result["changes"] + 1
    assert result["steps"] > 0 and 0 < result["vs_oracle"] <= 1.0 + 1e-9
    assert result["trials_won"] + result["trials_lost"] <= result["stats"].get("trials", 0)
