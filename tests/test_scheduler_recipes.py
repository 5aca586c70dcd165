"""The transformer recipes people run, against DDP to the bit and across ranks: global-norm
clipping with AdamW and SGD (foreach or not), gradient accumulation with `no_sync()` (with clipping
and with AMP's GradScaler) and its misuse, raised at the backward that reveals it."""

from __future__ import annotations

import contextlib
import functools
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
                    sched.zero_grad()
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


def _case_scaler(case: str):
    """The fp16 GradScaler of the "amp" cases (None for the others)."""
    if case == "amp":
        return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return None


def _case_autocast(case: str):
    """fp16 autocast in the "amp" cases."""
    if case == "amp":
        return torch.autocast("cpu", dtype=torch.float16)
    return contextlib.nullcontext()


def _scheduled_lm(case: str, rank: int, clip: float | None = None) -> tuple:
    """The LM, AdamW and its schedule, the case's scaler and a ScheduledOptimizer over them, with
    jitter that varies the order gradients complete in."""
    from autobyte import ScheduledOptimizer

    model = make_lm()
    opt, schedule = make_optimizer("adamw", model.parameters())
    scaler = _case_scaler(case)
    sched = ScheduledOptimizer(
        model,
        opt,
        partition_bytes=4 << 10,
        credit_bytes=8 << 10,
        clip_grad_norm=clip,
        grad_scaler=scaler,
        timeout_s=60,
    )
    jitter(model, random.Random(rank * 11 + 3))
    return model, opt, schedule, scaler, sched


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

        scaler = functools.partial(_case_scaler, case)
        autocast = functools.partial(_case_autocast, case)

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

        model, opt, schedule, sched_scaler, sched = _scheduled_lm(case, rank, clip)
        with sched:
            for micro in steps_of:

                def backward(loss):
                    (sched_scaler.scale(loss) if sched_scaler else loss).backward()  # noqa: B023 - called within this iteration

                with autocast():
                    _accumulate(model, micro, backward, sched.no_sync)
                _step(sched, schedule, sched_scaler)
                sched.zero_grad()
            sched.synchronize()
        results[case] = _outcome(ref, model, ref_scaler, sched_scaler)
        results["hot_paths"].append(sched.hot_path)

    # Misuse: a backward inside no_sync() after the step's synchronising one raises at that
    # backward, naming the parameter (DDP would leave each rank its own unsynchronised sum).
    model = make_lm()
    opt, _ = make_optimizer("sgd", model.parameters())
    with ScheduledOptimizer(model, opt, timeout_s=30) as sched:
        lm_loss(model, batches[0]).backward()
        try:
            with sched.no_sync():
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
        assert re.search(r"parameter '[\w.]+' received a gradient inside no_sync\(\)", misuse)
        assert misuse_step == "SchedulerError"
        for case, result in got.items():
            assert result["diff"] == 0.0, (rank, case, result["diff"])
            assert result["scale_equal"], (rank, case)
    for case in ranks[0]:
        assert ranks[0][case]["digests"] == ranks[1][case]["digests"], case


def _grad_norm(model: nn.Module) -> float:
    """The gradient norm a loop logs (reads every `.grad`)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _outcome(ref: nn.Module, model: nn.Module, ref_scaler, sched_scaler) -> dict:
    """How the scheduled run ended against DDP's: parameters and optimizer state, digests, scale."""
    return {
        "diff": max_state_diff(ref, model),
        "digests": param_digests(model),
        "scale_equal": (sched_scaler.get_scale() if sched_scaler else None)
        == (ref_scaler.get_scale() if ref_scaler else None),
    }


def _step(optimizer, schedule, scaler) -> None:
    """The loop's step: through the scaler where there is one, then the LR schedule."""
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    schedule.step()


def _sync_accumulation_worker(rank: int, world: int, steps: int) -> dict:
    """Accumulation as many plain loops write it for DDP: every micro-batch's backward outside
    no_sync(), so each all-reduces what `.grad` holds (the reduced sum so far + its own)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = token_batches(rank, steps * MICRO, batch=2)
    steps_of = [batches[s * MICRO : (s + 1) * MICRO] for s in range(steps)]
    results: dict = {"hot_paths": []}
    # plain: AdamW + schedule; clip: clip_grad_norm_ in the loop, its norms logged; amp: fp16
    # GradScaler; read: the gradient norm logged after every micro-batch; mixed: the first
    # micro-batch inside no_sync(), a zero_grad() after step() and the model's or the optimizer's
    # between two micro-batches (of a no_sync() sum, of reduced gradients);
    # never: gradients never cleared, so each step's add to the last step's (as DDP's do), and
    # assigned once after step()
    for case in ("plain", "clip", "amp", "read", "mixed", "never"):
        logged: dict[str, list[float]] = {"ddp": [], "sched": []}

        scaler = functools.partial(_case_scaler, case)
        autocast = functools.partial(_case_autocast, case)

        def train(model, stepper, zero, no_sync, scale, log):
            for s, micro in enumerate(steps_of):
                for k, tokens in enumerate(micro):
                    skip = case == "mixed" and k == 0  # noqa: B023
                    with no_sync() if skip else contextlib.nullcontext(), autocast():  # noqa: B023
                        loss = lm_loss(model, tokens) / len(micro)
                    (scale.scale(loss) if scale else loss).backward()
                    if case == "read":  # noqa: B023
                        log.append(_grad_norm(model))
                    if case == "mixed" and (s, k) == (1, 1):  # noqa: B023
                        model.zero_grad()  # drops what the first two micro-batches summed
                    if case == "mixed" and (s, k) in ((2, 0), (3, 2)):  # noqa: B023
                        zero()  # the optimizer's: a no_sync() sum, then a reduced one
                if case == "clip":  # noqa: B023
                    log.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
                stepper(scale)
                if case != "never":  # noqa: B023
                    model.zero_grad()
                elif s == 1:  # a gradient assigned after step() replaces the held one
                    for p in model.parameters():
                        p.grad = torch.full_like(p, 1e-3)

        model = make_lm()
        ddp = DDP(model)
        opt, schedule = make_optimizer("adamw", model.parameters())

        ref_scaler = scaler()
        stepper = functools.partial(_step, opt, schedule)
        train(ddp, stepper, opt.zero_grad, ddp.no_sync, ref_scaler, logged["ddp"])
        ref = model

        model, opt, schedule, sched_scaler, sched = _scheduled_lm(case, rank)

        with sched:
            stepper = functools.partial(_step, sched, schedule)
            train(model, stepper, sched.zero_grad, sched.no_sync, sched_scaler, logged["sched"])
            sched.synchronize()
        results[case] = _outcome(ref, model, ref_scaler, sched_scaler)
        results[case]["logged_equal"] = logged["ddp"] == logged["sched"]
        results[case]["logged"] = len(logged["ddp"])
        results["hot_paths"].append(sched.hot_path)
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_accumulation_without_no_sync_equals_ddp(hot_path):
    """4 micro-batches a step, each backward synchronising (no no_sync()): DDP's parameters to the
    bit, with AdamW and its schedule, a loop's clip_grad_norm_, GradScaler, gradient norms read
    after every micro-batch, no_sync() for the first only and a zero_grad() between micro-batches;
    every logged norm equal to DDP's, and every rank the same; and a loop that never clears its
    gradients, whose steps add to the last step's reduced gradients as DDP's do."""
    ranks = run_ranks_on(hot_path, _sync_accumulation_worker, 2, 4, timeout_s=220)
    for rank, got in enumerate(ranks):
        assert set(got.pop("hot_paths")) == {hot_path}
        for case, result in got.items():
            assert result["diff"] == 0.0, (rank, case, result["diff"])
            assert result["scale_equal"], (rank, case)
            assert result["logged_equal"], (rank, case)
        assert got["clip"]["logged"] == 4 and got["read"]["logged"] == 4 * MICRO
    for case in ranks[0]:
        assert ranks[0][case]["digests"] == ranks[1][case]["digests"], case
