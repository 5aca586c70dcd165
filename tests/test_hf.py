"""autobyte.hf.Trainer and autobyte.accelerate.Accelerator in one real 2-rank gloo torchrun launch
(tests/_hf_job.py, tiny GPT-2 and BERT built from their configs): the parameters and buffers equal
Trainer's / Accelerator's own DDP runs bit for bit on every rank (clipping, accumulation, bf16, fp16 with a
GradScaler, evaluation, a checkpoint resume, save_state/load_state, a configuration change mid-run), the
configurations applied show up in Trainer's logs, the job streams to a real daemon under the
Trainer's run name, and settings the scheduler cannot reproduce are refused."""

import pytest
from autobyte.protocol import autobyte_pb2 as pb

from tests.helpers.dist import run_launch, torchrun_argv
from tests.helpers.hf import hf_env, hf_launch, require_hf
from tests.helpers.paths import ROOT
from tests.helpers.rpc import Client

require_hf()


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One torchrun launch of tests/_hf_job.py against a real daemon: (rank results, daemon jobs)."""
    out = tmp_path_factory.mktemp("hf")
    with hf_launch("_hf_job.py", out, timeout_s=400) as (ranks, address, output):
        client = Client(address)
        try:
            jobs = {
                j.job: sorted(j.ranks)
                for j in client.query.Status(pb.StatusRequest(), timeout=5).jobs
            }
        finally:
            client.close()
        yield ranks, jobs, output


CASES = [
    "gpt2",
    "gpt2_resumed",
    "bert",
    "batchnorm",
    "accelerate",
    "accelerate_fp16",
    "accelerate_batchnorm_no_broadcast",
    "accelerate_plain",
    "accelerate_plain_fp16",
]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", CASES)
def test_parameters_and_buffers_equal_ddp_on_every_rank(launch, case):
    ranks, _, _ = launch
    for result in ranks:
        assert result["keys_equal"][case], "the state_dicts hold different entries"
        worst = max(result["diffs"][case].values())
        assert worst == 0.0, f"{case}: max |autobyte - DDP| = {worst}"
        assert result["across"][case] == 0.0, f"{case}: the ranks' parameters differ"


def test_the_scheduler_ran_and_its_configurations_are_in_the_trainer_log(launch):
    ranks, _, output = launch
    for result in ranks:
        fp16 = result["fp16"]
        assert fp16["scheduled"] == 1 and fp16["skipped_ours"] == fp16["skipped_ddp"] >= 1, fp16
        assert result["accelerate_scheduled"] == 1
        applied = [e for e in result["our_logs"] if "autobyte/partition_bytes" in e]
        assert [(e["autobyte/partition_bytes"], e["autobyte/credit_bytes"]) for e in applied] == [
            (4096, 16384),
            (8192, -1),
        ], applied
        assert applied[1]["autobyte/from_step"] == 2
        # the training log entries are Trainer's (one per logging step), with the same losses
        ddp = [(e["step"], e["loss"]) for e in result["ddp_logs"] if "loss" in e]
        ours = [(e["step"], e["loss"]) for e in result["our_logs"] if "loss" in e]
        assert ours == ddp
        norms = [
            (e.get("grad_norm"), d.get("grad_norm"))
            for e, d in zip(
                [e for e in result["our_logs"] if "loss" in e],
                [d for d in result["ddp_logs"] if "loss" in d],
            )
        ]
        # Trainer's own clip_grad_norm_ read the reduced gradients: DDP's norm, to the bit
        assert norms and all(a is not None and a == b for a, b in norms), norms
        evals = [e["eval_loss"] for e in result["our_logs"] if "eval_loss" in e]
        assert (
            evals == [e["eval_loss"] for e in result["ddp_logs"] if "eval_loss" in e]
            and len(evals) == 2
        )
    assert "autobyte configuration from step 2: partition=8KiB credit=unlimited" in output


def test_batchnorm_statistics_and_evaluation_equal_ddp(launch):
    """BatchNorm's buffers are in the compared state_dicts (so the cases above cover them); the
    evaluation losses, gathered over both ranks' statistics, are DDP's; without the broadcast
    the ranks keep statistics of their own, as with DDP(broadcast_buffers=False)."""
    ranks, _, _ = launch
    for result in ranks:
        assert "body.1.running_mean" in result["diffs"]["batchnorm"]
        ddp, ours = result["batchnorm_evals"]
        assert ours == ddp and len(ddp) == 2, (ddp, ours)
    # rank 1 against rank 0 (rank 0's own entry compares rank 0 with itself)
    assert ranks[1]["across_statistics"]["accelerate_batchnorm_no_broadcast"] > 0.5, ranks[1][
        "across_statistics"
    ]


def test_the_job_streams_under_the_trainer_run_name(launch):
    ranks, jobs, _ = launch
    assert jobs.get("hf-test") == [0, 1], jobs
    assert all(r["session_closed"] for r in ranks), "train() must end the session it started"


def test_settings_the_scheduler_cannot_reproduce_are_refused(launch):
    ranks, _, _ = launch
    for result in ranks:
        refusals = result["refusals"]
        assert (
            "comm_hook='fp16'" in refusals["comm_hook"]
            and "remove the comm hook" in refusals["comm_hook"]
        )
        assert "built with clip_grad_norm=0.5" in refusals["clip"], refusals["clip"]


def test_the_standard_accelerate_loop_logs_ddps_clip_norm_with_no_constructor_argument(launch):
    """`accelerator.clip_grad_norm_(...)` with one import changed: the norm it returns (and logs) is
    DDP's, to the bit, at every synchronising step, bf16 and fp16 (unscaled first) alike."""
    ranks, _, _ = launch
    for result in ranks:
        for name, (ddp, ours) in result["plain_norms"].items():
            # fp16 at this scale overflows (inf/NaN norms, skipped steps: the same ones)
            assert len(ddp) >= 4 and None not in ours, (name, ddp, ours)
            assert [repr(n) for n in ours] == [repr(n) for n in ddp], (name, ours, ddp)
        assert result["plain_norms"]["accelerate_plain"][0][0] > 0.5  # the clip bites
        # accelerator.gather / reduce of values computed from the gradients after the clip
        for name, (ddp, ours) in result["plain_grad_values"].items():
            assert len(ddp) >= 4 and repr(ours) == repr(ddp), (name, ours, ddp)


def test_unknown_trainer_option_is_refused():
    from autobyte.hf import Trainer

    with pytest.raises(ValueError, match="does not take \\['partition'\\]"):
        Trainer(model=None, autobyte={"partition": 1})


@pytest.mark.timeout(240)
def test_trainer_example_trains_and_saves(tmp_path):
    env = hf_env(tmp_path)
    job = run_launch(
        torchrun_argv(
            str(ROOT / "examples" / "train_hf_trainer.py"),
            "--steps",
            "4",
            "--output-dir",
            str(tmp_path / "out"),
        ),
        env=env,
        cwd=tmp_path,
        timeout_s=200,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert "'autobyte/partition_bytes': 1048576" in job.stdout + job.stderr
