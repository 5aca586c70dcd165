"""FSDP2 through accelerate and the Hugging Face Trainer with one import changed, in one real
2-rank gloo torchrun launch (tests/_hf_fsdp_job.py, a tiny GPT-2): the parameters, the clip
norms and Trainer's `grad_norm` log equal accelerate's own FSDP2 path to the bit on every rank,
across live configuration changes, a save_state / load_state round trip and Trainer's
checkpoints, also under bf16 with tied embeddings and for Llama blocks under activation
checkpointing; both jobs stream to a real daemon as FSDP2 jobs; what autobyte cannot run is
refused with a message."""

import pytest
from autobyte.protocol import autobyte_pb2 as pb

from tests.helpers.hf import hf_launch, require_hf
from tests.helpers.rpc import Client

require_hf()


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One torchrun launch of tests/_hf_fsdp_job.py against a real daemon: (ranks, daemon jobs,
    each job's stored (rank, step) pairs)."""
    out = tmp_path_factory.mktemp("hf_fsdp")
    with hf_launch("_hf_fsdp_job.py", out, timeout_s=300) as (ranks, address, _):
        client = Client(address)
        try:
            jobs = {j.job: j for j in client.query.Status(pb.StatusRequest(), timeout=5).jobs}
            steps = {
                name: {
                    (s.rank, s.step)
                    for s in client.query.History(
                        pb.HistoryRequest(job=name, limit=1000), timeout=5
                    ).steps
                }
                for name in jobs
            }
        finally:
            client.close()
        yield ranks, jobs, steps


@pytest.mark.timeout(320)
def test_accelerate_fsdp2_loop_equals_accelerates_own_to_the_bit_across_live_changes(launch):
    ranks, _, _ = launch
    for r in ranks:
        run = r["accelerate"]
        assert run["sharded"] == [True, True]  # both really ran FSDP2 (parameters are shards)
        assert run["diff"] == 0.0 and run["across"] == 0.0
        plain, ours = run["norms"]
        assert len(ours) == 6 and ours == plain  # clip_grad_norm_'s return value, every step
        # the configurations proposed at steps 1 and 2 applied, on every rank alike
        assert run["configs"][0].startswith("forward_prefetch=as set")
        assert "forward_prefetch=2, backward_prefetch=2" in run["configs"][3]
        assert run["configs"][-1].endswith("reshard_after_forward=False")
    assert ranks[0]["accelerate"]["configs"] == ranks[1]["accelerate"]["configs"]


def test_bf16_tied_embeddings_and_checkpointed_llama_blocks_equal_accelerates_own(launch):
    ranks, _, _ = launch
    for r in ranks:
        assert set(r["variants"]) == {"bf16_tied", "llama_checkpointed"}
        for name, run in r["variants"].items():
            assert run["sharded"] == [True, True], name
            assert run["diff"] == 0.0 and run["across"] == 0.0 and run["norms_equal"], name
            assert run["changed"], name  # the live changes applied


def test_trainer_fsdp2_equals_its_own_run_and_logs_the_configurations(launch):
    ranks, _, _ = launch
    for r in ranks:
        run = r["trainer"]
        assert run["sharded"] == [True, True]
        assert run["diff"] == 0.0 and run["across"] == 0.0
        plain, ours = run["grad_norms"]
        assert len(ours) == 5 and ours == plain  # Trainer's grad_norm log entry, to the bit
        assert (
            run["checkpoints"][0]
            == run["checkpoints"][1]
            == [
                "checkpoint-2",
                "checkpoint-4",
                "checkpoint-5",
            ]
        )
    logs = ranks[0]["trainer"]["autobyte_logs"]
    assert [
        (e["autobyte/forward_prefetch"], e["autobyte/reshard_after_forward"]) for e in logs
    ] == [
        (-1, -1),  # the job as built
        (2, -1),
        (1, 0),
    ]


def test_both_stream_to_the_daemon_as_fsdp2_jobs(launch):
    _, jobs, steps = launch
    assert set(jobs) == {"acc-fsdp", "hf-fsdp"}
    for name, job in jobs.items():
        assert job.engine == "fsdp2" and sorted(job.ranks) == [0, 1], name
    assert steps["acc-fsdp"] == {(r, s) for r in (0, 1) for s in range(6)}
    assert steps["hf-fsdp"] == {(r, s) for r in (0, 1) for s in range(5)}


def test_what_autobyte_cannot_run_is_refused_with_a_message(launch):
    ranks, _, _ = launch
    refusals = ranks[0]["refusals"]
    assert "fsdp_version=1" in refusals["fsdp1"] and "fsdp_version=2" in refusals["fsdp1"]
    assert "partition_bytes=4096" in refusals["scheduler_settings"]
    assert "memory_budget_bytes=1048576" in refusals["budget_without_fsdp"]
