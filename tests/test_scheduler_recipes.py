"""The transformer recipes people run, against DDP to the bit and across ranks: global-norm
clipping with AdamW and SGD (foreach or not), gradient accumulation with `no_sync()` (with clipping
and with AMP's GradScaler) and its misuse, raised at the backward that reveals it."""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.helpers.dist import SPARSE_ROWS_EVERYWHERE, run_ranks_on
from tests.helpers.equiv import jitter, max_state_diff

pytestmark = pytest.mark.slow

VOCAB, DIM, CONTEXT = 48, 32, 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.ln2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm blocks, an LM head tied to the
    token embedding (the habits of GPT2LMHeadModel, torch only)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(CONTEXT, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        x = self.tok(tokens) + self.pos(torch.arange(n))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def make_lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def token_batches(rank: int, count: int, batch: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + rank)
    return [torch.randint(0, VOCAB, (batch, CONTEXT + 1), generator=gen) for _ in range(count)]


def make_optimizer(kind: str, params) -> tuple:
    """AdamW with the transformer recipe's warm-up + cosine schedule, or SGD with momentum."""
    if kind == "adamw":
        opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(params, lr=0.2, momentum=0.9)
    warmup, total = 3, 20
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * s / total))
    )
    return opt, schedule


def param_digests(model: nn.Module) -> list[str]:
    """One digest per parameter tensor: equal lists mean bit-equal replicas."""
    return [
        hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest()[:16]
        for p in model.parameters()
    ]


# ---------------------------------------------------------------- 1. exact global-norm clipping


def _clip_worker(rank: int, world: int, steps: int) -> dict:
    from autobyte import ScheduledOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    results: dict = {"hot_paths": []}
    batches = token_batches(rank, steps)
    for kind in ("adamw", "sgd"):
        for foreach in (None, False):  # clip_grad_norm_'s default (foreach on CPU too) and the loop
            model = make_lm()
            ddp = DDP(model)
            opt, schedule = make_optimizer(kind, model.parameters())
            norms = []
            for tokens in batches:
                opt.zero_grad()
                lm_loss(ddp, tokens).backward()
                norms.append(
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=foreach).item()
                )
                opt.step()
                schedule.step()
            ref = model

            model = make_lm()
            opt, schedule = make_optimizer(kind, model.parameters())
            sched = ScheduledOptimizer(
                model,
                opt,
                partition_bytes=4 << 10,
                credit_bytes=8 << 10,
                clip_grad_norm=0.5,
                timeout_s=60,
            )
            jitter(model, random.Random(rank * 7 + 1))  # vary the order gradients complete in
            with sched:
                for tokens in batches:
                    lm_loss(model, tokens).backward()
                    sched.step()
                    schedule.step()
                sched.synchronize()
                last_norm = sched.last_grad_norm
            results[(kind, foreach)] = {
                "diff": max_state_diff(ref, model),
                "digests": param_digests(model),
                "clipped": sum(n > 0.5 for n in norms),
                "last_norm_equal": last_norm == norms[-1],
            }
            results["hot_paths"].append(sched.hot_path)
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_clipping_equals_ddp_to_the_bit_on_every_rank(hot_path):
    """clip_grad_norm= sums the norm in clip_grad_norm_'s order (model.parameters()), not in the
    order gradients complete: DDP's parameters to the bit, and the replicas stay equal."""
    ranks = run_ranks_on(hot_path, _clip_worker, 2, 10, timeout_s=220, env=SPARSE_ROWS_EVERYWHERE)
    for rank, got in enumerate(ranks):
        assert set(got.pop("hot_paths")) == {hot_path}
        for case, result in got.items():
            assert result["clipped"] >= 3, (case, "the test must clip for real")
            assert result["diff"] == 0.0, (rank, case, result["diff"])
            assert result["last_norm_equal"], (rank, case)
    for case in ranks[0]:
        assert ranks[0][case]["digests"] == ranks[1][case]["digests"], case


# ---------------------------------------------------------------- 2. gradient accumulation


MICRO = 4


def _accumulate(model, micro_batches, backward, no_sync) -> None:
    """The LLM recipe: all but the last micro-batch inside no_sync(), each loss divided by k."""
    for k, tokens in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        with contextlib.nullcontext() if last else no_sync():
            backward(lm_loss(model, tokens) / len(micro_batches))


def _accumulation_worker(rank: int, world: int, steps: int) -> dict:
    from autobyte import ScheduledOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = token_batches(rank, steps * MICRO, batch=2)
    steps_of = [batches[s * MICRO : (s + 1) * MICRO] for s in range(steps)]
    results: dict = {"hot_paths": []}
    for case in ("plain", "clip", "amp"):
        clip = 0.5 if case == "clip" else None

        def scaler():
            if case == "amp":  # noqa: B023 - called within this iteration
                return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
            return None

        def autocast():
            if case == "amp":  # noqa: B023 - called within this iteration
                return torch.autocast("cpu", dtype=torch.float16)
            return contextlib.nullcontext()

        model = make_lm()
        ddp = DDP(model)
        opt, schedule = make_optimizer("adamw", model.parameters())
        ref_scaler = scaler()
        for micro in steps_of:
            opt.zero_grad()

            def backward(loss):
                (ref_scaler.scale(loss) if ref_scaler else loss).backward()  # noqa: B023 - called within this iteration

            with autocast():
                _accumulate(ddp, micro, backward, ddp.no_sync)
            if ref_scaler:
                ref_scaler.step(opt)
                ref_scaler.update()
            else:
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
            schedule.step()
        ref = model

        model = make_lm()
        opt, schedule = make_optimizer("adamw", model.parameters())
        sched_scaler = scaler()
        sched = ScheduledOptimizer(
            model,
            opt,
            partition_bytes=4 << 10,
            credit_bytes=8 << 10,
            clip_grad_norm=clip,
            grad_scaler=sched_scaler,
            timeout_s=60,
        )
        jitter(model, random.Random(rank * 11 + 3))
        with sched:
            for micro in steps_of:

                def backward(loss):
                    (sched_scaler.scale(loss) if sched_scaler else loss).backward()  # noqa: B023 - called within this iteration

                with autocast():
                    _accumulate(model, micro, backward, sched.no_sync)
                if sched_scaler:
                    sched_scaler.step(sched)
                    sched_scaler.update()
                else:
                    sched.step()
                schedule.step()
            sched.synchronize()
            scale = sched_scaler.get_scale() if sched_scaler else None
        results[case] = {
            "diff": max_state_diff(ref, model),
            "digests": param_digests(model),
            "scale_equal": scale == (ref_scaler.get_scale() if ref_scaler else None),
        }
        results["hot_paths"].append(sched.hot_path)

    # Misuse: a second synchronising backward raises at that backward, naming the parameter.
    model = make_lm()
    opt, _ = make_optimizer("sgd", model.parameters())
    with ScheduledOptimizer(model, opt, timeout_s=30) as sched:
        lm_loss(model, batches[0]).backward()
        try:
            lm_loss(model, batches[1]).backward()
            results["misuse"] = "not raised"
        except Exception as error:  # noqa: BLE001 - the test reports what was raised
            results["misuse"] = f"{type(error).__name__}: {error}"
        try:
            sched.step()
            results["misuse_step"] = "not raised"
        except Exception as error:  # noqa: BLE001
            results["misuse_step"] = type(error).__name__
        try:
            sched.close()
        except Exception:  # noqa: BLE001, S110 - close after a failure may report it again
            pass
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_accumulation_with_no_sync_equals_ddp_no_sync(hot_path):
    """4 micro-batches, 3 inside no_sync(): DDP + no_sync's parameters to the bit, alone, with
    clipping and with GradScaler (fp16 autocast), and equal on both ranks."""
    ranks = run_ranks_on(
        hot_path, _accumulation_worker, 2, 6, timeout_s=220, env=SPARSE_ROWS_EVERYWHERE
    )
    for rank, got in enumerate(ranks):
        assert set(got.pop("hot_paths")) == {hot_path}
        misuse, misuse_step = got.pop("misuse"), got.pop("misuse_step")
        assert misuse.startswith("SchedulerError") and "no_sync()" in misuse, misuse
        assert re.search(r"parameter '[\w.]+' received a second gradient", misuse), misuse
        assert misuse_step == "SchedulerError"
        for case, result in got.items():
            assert result["diff"] == 0.0, (rank, case, result["diff"])
            assert result["scale_equal"], (rank, case)
    for case in ranks[0]:
        assert ranks[0][case]["digests"] == ranks[1][case]["digests"], case
