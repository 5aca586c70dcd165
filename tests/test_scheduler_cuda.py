"""The scheduler on CUDA: gloo with CUDA tensors (one GPU is enough) and NCCL (one GPU per rank),
against DDP, under jitter and random reconfigurations; nn.SyncBatchNorm beside the scheduler.

These run wherever a GPU is present and are skipped, with the reason, where none is (this project's
CI machine has none). What they guard: credit returned at completion (NCCL completes a work's future
at enqueue, so completion is polled), no work.wait() on the default stream (the update thread has a
stream of its own), gradient copies ordered before the collective (events), reads of parameters made
to wait on the update stream's events rather than on the host.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.helpers.dist import run_ranks
from tests.helpers.equiv import max_state_diff, train_ddp, train_scheduled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"),
]

needs_two = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: needs 2 CUDA GPUs"
)


class Block(nn.Module):
    def __init__(self, sync_bn: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 256)
        self.norm = nn.SyncBatchNorm(256) if sync_bn else nn.LayerNorm(256)
        self.attn = nn.MultiheadAttention(256, 4, batch_first=True)
        self.out = nn.Linear(256, 10)

    def forward(self, x):
        h = self.inp(x)
        if isinstance(self.norm, nn.SyncBatchNorm):
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        else:
            h = self.norm(h)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.out(h.mean(1))


def _cuda_worker(rank: int, world: int, sync_bn: bool) -> dict:
    device = torch.device("cuda", rank % torch.cuda.device_count())

    def make_model():
        torch.manual_seed(3)
        return Block(sync_bn).to(device)

    def make_opt(params):
        return torch.optim.AdamW(params, lr=1e-3)

    gen = torch.Generator().manual_seed(70 + rank)
    batches = [
        (
            torch.randn(8, 6, 32, generator=gen).to(device),
            torch.randint(0, 10, (8,), generator=gen).to(device),
        )
        for _ in range(60)
    ]
    ref, _ = train_ddp(make_model, make_opt, batches, F.cross_entropy)
    model, _, seen, _ = train_scheduled(make_model, make_opt, batches, F.cross_entropy, rank)
    return {"diff": max_state_diff(ref, model), "steps": len(seen)}


@pytest.mark.timeout(300)
def test_gloo_with_cuda_tensors_equals_ddp():
    for rank, got in enumerate(run_ranks(_cuda_worker, 2, False, timeout_s=280)):
        assert got == {"diff": 0.0, "steps": 60}, (rank, got)


@needs_two
@pytest.mark.timeout(300)
def test_nccl_equals_ddp():
    for rank, got in enumerate(run_ranks(_cuda_worker, 2, False, timeout_s=280, backend="nccl")):
        assert got["steps"] == 60 and got["diff"] <= 1e-6, (rank, got)


@needs_two
@pytest.mark.timeout(300)
def test_nccl_with_sync_batch_norm_equals_ddp():
    for rank, got in enumerate(run_ranks(_cuda_worker, 2, True, timeout_s=280, backend="nccl")):
        assert got["steps"] == 60 and got["diff"] <= 1e-6, (rank, got)
