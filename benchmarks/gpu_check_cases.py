"""The ranks of the GPU check (benchmarks/gpu_check.py): each step's training runs, in spawned
torch.distributed processes, writing one JSON result. Run as
`python -m benchmarks.gpu_check_cases STEP --device cuda|cpu --out FILE [--quick]`.

Steps:
* `two_ranks`: 2 ranks on one device over gloo (NCCL refuses two ranks on one GPU): every case
  trains with DDP and with ScheduledOptimizer on the same setup; parameters must be equal bit for
  bit, and equal on every rank (a digest of them).
* `nccl_one_rank`: one NCCL rank through the CUDA stream path (gradient copies, the update stream,
  completion polled): ScheduledOptimizer vs plain training (`backward(); opt.step()`), bit for bit;
  the host synchronisations per step counted with `torch.cuda.set_sync_debug_mode("warn")`, with the
  source lines that caused them.
* `overhead`: step time of a GPT-2-small-sized model and a ResNet-50 under the scheduler vs DDP, 1 and
  2 ranks, plus the host time the scheduler adds per step: the training thread's CPU time (hooks,
  tracked reads), the wall time the forward pass waited for parameters (the wait-before-use), the
  other threads' CPU time (update, dispatch, completion polling), and host syncs per step.
On `--device cpu` the same code runs on gloo with CPU tensors and small models (the suite's check
that this harness works on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import hashlib
import json
import os
import random
import socket
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

SIZES = [None, 4 << 10, 64 << 10, 1 << 20]
CREDITS = [None, 4 << 10, 256 << 10, 4 << 20]


# ---- models (plain torch; no downloads) ------------------------------------------------------------


class TiedGPT(nn.Module):
    """A GPT-style decoder: token embeddings tied to the output projection (read twice per step, the
    second time by `F.linear` outside its module), `nn.MultiheadAttention` (reads `out_proj.weight`
    without calling `out_proj`), causal mask. GPT-2 small: vocab 50257, width 768, 12 layers, 12 heads."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, sequence: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(sequence, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.register_buffer(
            "causal", torch.full((sequence, sequence), float("-inf")).triu(1), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.wte(tokens) + self.wpe(torch.arange(n, device=tokens.device))
        for block in self.blocks:
            h = block(h, self.causal[:n, :n])
        return F.linear(self.norm(h), self.wte.weight)


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.ln1(h)
        h = h + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(self.ln2(h))


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 10),
    )


def _lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
    )


class Case:
    """One training setup: how to build the model, optimizer and batches, and the loop's precision."""

    def __init__(
        self,
        name: str,
        make_model: Callable[[], nn.Module],
        make_opt: Callable[[Any], Any],
        make_batch: Callable[[torch.Generator], tuple],
        loss: Callable,
        steps: int,
        amp: str | None = None,
        reconfigure: bool = False,
        jitter: bool = False,
        partition_bytes: int | None = 64 << 10,
        credit_bytes: int | None = 256 << 10,
        gpu_delays: bool = False,
    ) -> None:
        self.name, self.make_model, self.make_opt, self.make_batch = (
            name,
            make_model,
            make_opt,
            make_batch,
        )
        self.loss, self.steps, self.amp = loss, steps, amp
        self.reconfigure, self.jitter, self.gpu_delays = reconfigure, jitter, gpu_delays
        self.partition_bytes, self.credit_bytes = partition_bytes, credit_bytes


def _seeded(build: Callable[[], nn.Module], device: torch.device) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(3)
        return build().to(device)

    return make


def _hf_gpt2(device: torch.device) -> Callable[[], nn.Module] | None:
    """transformers' GPT2LMHeadModel from a config (random weights, no download), if installed."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except Exception:  # noqa: BLE001 - not installed or broken: the case is skipped with the reason
        return None

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = GPT2Config(
                vocab_size=512,
                n_positions=64,
                n_embd=128,
                n_layer=2,
                n_head=4,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                tie_word_embeddings=True,
                use_cache=False,
            )
            self.gpt2 = GPT2LMHeadModel(config)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.gpt2(input_ids=tokens).logits

    return _seeded(Logits, device)


def _tokens(vocab: int, batch: int, sequence: int, device: torch.device) -> Callable:
    def make(gen: torch.Generator) -> tuple:
        tokens = torch.randint(0, vocab, (batch, sequence), generator=gen).to(device)
        return tokens, tokens

    return make


def _features(batch: int, device: torch.device) -> Callable:
    def make(gen: torch.Generator) -> tuple:
        return (
            torch.randn(batch, 64, generator=gen).to(device),
            torch.randint(0, 10, (batch,), generator=gen).to(device),
        )

    return make


def equivalence_cases(device: torch.device, quick: bool) -> tuple[list[Case], dict[str, str]]:
    """(cases, {case: why skipped})."""
    steps = 6 if quick else 30
    width = 64 if quick else 512
    gpt = (
        _seeded(lambda: TiedGPT(256, 64, 2, 4, 32), device)
        if quick
        else _seeded(lambda: TiedGPT(2048, 256, 4, 8, 64), device)
    )
    vocab, sequence = (256, 32) if quick else (2048, 64)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)
    sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
    mlp = _seeded(lambda: _mlp(width), device)
    cases = [
        Case("mlp_sgd_momentum", mlp, sgd, _features(32, device), F.cross_entropy, steps),
        Case(
            "mlp_unpartitioned_unlimited",
            mlp,
            sgd,
            _features(32, device),
            F.cross_entropy,
            steps,
            partition_bytes=None,
            credit_bytes=None,
        ),
        Case(
            "transformer_tied_adamw",
            gpt,
            adamw,
            _tokens(vocab, 4, sequence, device),
            _lm_loss,
            steps,
        ),
        Case(
            "amp_fp16_gradscaler",
            gpt,
            adamw,
            _tokens(vocab, 4, sequence, device),
            _lm_loss,
            steps,
            amp="fp16",
        ),
        Case(
            "amp_bf16", gpt, adamw, _tokens(vocab, 4, sequence, device), _lm_loss, steps, amp="bf16"
        ),
        Case(
            "reconfigure_under_jitter",
            gpt,
            adamw,
            _tokens(vocab, 4, sequence, device),
            _lm_loss,
            steps,
            reconfigure=True,
            jitter=True,
        ),
    ]
    skipped: dict[str, str] = {}
    if device.type == "cuda":
        cases.append(
            Case(
                "stream_ordering_gpu_delays",
                gpt,
                adamw,
                _tokens(vocab, 4, sequence, device),
                _lm_loss,
                steps,
                gpu_delays=True,
            )
        )
    else:
        skipped["stream_ordering_gpu_delays"] = "needs CUDA (delays injected on the GPU's streams)"
    if device.type == "cuda":
        # SyncBatchNorm's collectives run inside the forward, on the default group, beside the
        # scheduler's own communicator; its running statistics are compared too (`_diff`)
        syncbn = _seeded(
            lambda: nn.Sequential(
                nn.Linear(64, width), nn.SyncBatchNorm(width), nn.ReLU(), nn.Linear(width, 10)
            ),
            device,
        )
        cases.append(
            Case("sync_batchnorm", syncbn, sgd, _features(32, device), F.cross_entropy, steps)
        )
    else:
        skipped["sync_batchnorm"] = "needs CUDA (torch's SyncBatchNorm runs on GPUs only)"
    hf = _hf_gpt2(device) if not quick else None
    if hf is not None:
        cases.append(Case("hf_gpt2_tied", hf, adamw, _tokens(512, 4, 64, device), _lm_loss, steps))
    else:
        skipped["hf_gpt2_tied"] = "quick mode" if quick else "transformers is not importable"
    return cases, skipped


# ---- training loops -------------------------------------------------------------------------------


def _autocast(case: Case, device: torch.device) -> Any:
    if case.amp is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(
        device.type, dtype=torch.float16 if case.amp == "fp16" else torch.bfloat16
    )


def _batches(case: Case, rank: int) -> list:
    gen = torch.Generator().manual_seed(100 + rank)
    return [case.make_batch(gen) for _ in range(case.steps)]


def train_reference(case: Case, device: torch.device, batches: list, ddp: bool) -> nn.Module:
    """DDP (ddp=True) or plain training on one rank."""
    model = case.make_model()
    wrapped = nn.parallel.DistributedDataParallel(model) if ddp else model
    opt = case.make_opt(model.parameters())
    scaler = torch.amp.GradScaler(device.type) if case.amp == "fp16" else None
    for x, y in batches:
        opt.zero_grad()
        with _autocast(case, device):
            loss = case.loss(wrapped(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    return model


def _jitter(model: nn.Module, rng: random.Random) -> None:
    def nap(*_: Any) -> None:
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.002)

    for module in model.modules():
        module.register_forward_pre_hook(nap)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(nap)


class _GpuDelays:
    """Random GPU-side delays where a missing stream ordering would show as wrong parameters: before
    each gradient's copy into the flat buffer (a sleep kernel queued by a gradient hook that runs
    before the scheduler's), and before each collective on the scheduler's issue stream (after its
    event waits), so the update and the next forward's reads run while the collective is still
    late. Fault injection around the real code, restored on exit; the math is unchanged."""

    def __init__(self, model: nn.Module, rng: random.Random) -> None:
        self.rng = rng
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(
                lambda _p: torch.cuda._sleep(self.rng.randint(0, 400_000))
            )

    def __enter__(self) -> None:
        from autobyte.scheduler import device as device_sync

        self.cls = device_sync.CudaSync
        self.original = original = self.cls.before_issue
        rng = self.rng

        def delayed(sync: Any, params: Any) -> None:
            original(sync, params)
            torch.cuda._sleep(rng.randint(50_000, 600_000))

        self.cls.before_issue = delayed

    def __exit__(self, *exc: object) -> None:
        self.cls.before_issue = self.original


def train_scheduled(
    case: Case, device: torch.device, batches: list, rank: int
) -> tuple[nn.Module, dict]:
    import contextlib

    from autobyte import ScheduledOptimizer

    rng = random.Random(7 + rank)
    model = case.make_model()
    opt = case.make_opt(model.parameters())
    scaler = torch.amp.GradScaler(device.type) if case.amp == "fp16" else None
    # registered before the scheduler's hooks, so that they run first
    delays = (
        _GpuDelays(model, rng)
        if case.gpu_delays and device.type == "cuda"
        else contextlib.nullcontext()
    )
    sched = ScheduledOptimizer(
        model,
        opt,
        partition_bytes=case.partition_bytes,
        credit_bytes=case.credit_bytes,
        grad_scaler=scaler,
        timeout_s=120,
    )
    if case.jitter:
        _jitter(model, rng)
    configs = set()
    sched.add_step_callback(
        lambda m: configs.add((m.config.partition_bytes, m.config.credit_bytes))
    )
    with sched, delays:
        for x, y in batches:
            if case.reconfigure and rng.random() < 0.5:
                sched.reconfigure(rng.choice(SIZES), rng.choice(CREDITS))
            sched.zero_grad()  # as the reference's loop clears them
            with _autocast(case, device):
                loss = case.loss(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(sched)
                scaler.update()
            else:
                loss.backward()
                sched.step()
        sched.synchronize()
        info = {
            "hot_path": sched.hot_path,
            "hot_path_reason": sched.hot_path_reason,
            "configs_seen": len(configs),
            "skipped_steps": sched.skipped_steps,
        }
    return model, info


def _diff(a: nn.Module, b: nn.Module) -> float:
    """The largest difference of the whole state_dicts: parameters and buffers (BatchNorm statistics)."""
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        return float("inf")
    return max(
        (0.0 if torch.equal(sa[k], sb[k]) else (sa[k].double() - sb[k].double()).abs().max().item())
        for k in sa
    )


def _digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _run_cases(rank: int, device: torch.device, cases: list[Case], ddp: bool) -> dict:
    results = {}
    for case in cases:
        started = time.monotonic()
        try:
            batches = _batches(case, rank)
            reference = train_reference(case, device, batches, ddp)
            scheduled, info = train_scheduled(case, device, batches, rank)
            results[case.name] = {
                "max_abs_diff": _diff(reference, scheduled),
                "digest": _digest(scheduled),
                "seconds": round(time.monotonic() - started, 2),
                **info,
            }
        except Exception:  # noqa: BLE001 - one case's failure is reported
            results[case.name] = {"error": traceback.format_exc()[-3000:]}
            if ddp:
                break  # the other rank may be stuck in a collective of this case: no further case
    return results


# ---- host synchronisations ----------------------------------------------------------------------


class SyncCounter:
    """Counts CUDA host synchronisations (torch.cuda.set_sync_debug_mode("warn")) on every thread,
    with the source line of each (the warning's location)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.count = 0
        self.where: collections.Counter = collections.Counter()

    def __enter__(self) -> Self:
        self._catch = warnings.catch_warnings(record=True)
        self._records = self._catch.__enter__()
        warnings.simplefilter("always")
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()  # (itself a synchronisation: after the count)
        self._catch.__exit__(*exc)
        for record in self._records:
            if "synchroniz" in str(record.message).lower():
                self.count += 1
                self.where[f"{os.path.relpath(record.filename)}:{record.lineno}"] += 1


def _sync_probe(case: Case, device: torch.device, batches: list, scheduled: bool) -> dict:
    """Host syncs per step after warm-up, of plain training or of the scheduler, on one rank."""
    from autobyte import ScheduledOptimizer

    model = case.make_model()
    opt = case.make_opt(model.parameters())
    scaler = torch.amp.GradScaler(device.type) if case.amp == "fp16" else None
    sched = (
        ScheduledOptimizer(
            model,
            opt,
            partition_bytes=case.partition_bytes,
            credit_bytes=case.credit_bytes,
            grad_scaler=scaler,
            timeout_s=120,
        )
        if scheduled
        else None
    )
    stepper = sched if sched is not None else opt
    warm = 3

    def one(x: Any, y: Any) -> None:
        stepper.zero_grad()
        with _autocast(case, device):
            loss = case.loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(stepper)
            scaler.update()
        else:
            loss.backward()
            stepper.step()

    try:
        for x, y in batches[:warm]:
            one(x, y)
        if sched is not None:
            sched.synchronize()
        if device.type == "cuda":
            torch.cuda.synchronize()
        measured = batches[warm:]
        with SyncCounter(device) as counter:
            for x, y in measured:
                one(x, y)
            if sched is not None:
                sched.synchronize()
    finally:
        if sched is not None:
            sched.close()
    return {
        "syncs_per_step": counter.count / max(1, len(measured)),
        "where": dict(counter.where.most_common(8)),
        "counted": counter.cuda,
    }


def nccl_one_rank(rank: int, device: torch.device, quick: bool) -> dict:
    cases, _ = equivalence_cases(device, quick)
    keep = {
        "mlp_sgd_momentum",
        "transformer_tied_adamw",
        "amp_fp16_gradscaler",
        "amp_bf16",
        "stream_ordering_gpu_delays",
    }
    cases = [c for c in cases if c.name in keep]
    results = _run_cases(rank, device, cases, ddp=False)
    for case in cases:
        if "error" in results[case.name]:
            continue
        batches = _batches(case, rank)
        try:
            results[case.name]["syncs_plain"] = _sync_probe(case, device, batches, scheduled=False)
            results[case.name]["syncs_scheduled"] = _sync_probe(
                case, device, batches, scheduled=True
            )
        except Exception:  # noqa: BLE001
            results[case.name]["sync_probe_error"] = traceback.format_exc()[-2000:]
    return {"cases": results, "skipped": {}}


def two_ranks(rank: int, device: torch.device, quick: bool) -> dict:
    cases, skipped = equivalence_cases(device, quick)
    return {"cases": _run_cases(rank, device, cases, ddp=True), "skipped": skipped}


# ---- overhead at device speed ----------------------------------------------------------------------


def _overhead_models(
    device: torch.device, quick: bool
) -> list[tuple[str, Callable, Callable, Callable]]:
    """(name, make_model, make_batch, loss) of the GPT-2-small-sized model and a ResNet-50."""
    from benchmarks.testbed.models import ResNet

    if quick:
        gpt = (
            _seeded(lambda: TiedGPT(512, 64, 2, 4, 32), device),
            _tokens(512, 2, 32, device),
            _lm_loss,
        )
        resnet = (
            _seeded(lambda: ResNet((1, 1, 1, 1), 0.125, 10), device),
            _images(4, 32, 10, device),
            F.cross_entropy,
        )
    else:
        gpt = (
            _seeded(lambda: TiedGPT(50257, 768, 12, 12, 512), device),
            _tokens(50257, 8, 512, device),
            _lm_loss,
        )
        resnet = (
            _seeded(lambda: ResNet((3, 4, 6, 3), 1.0, 1000), device),
            _images(32, 224, 1000, device),
            F.cross_entropy,
        )
    return [("gpt2_small", *gpt), ("resnet50", *resnet)]


def _images(batch: int, size: int, classes: int, device: torch.device) -> Callable:
    def make(gen: torch.Generator) -> tuple:
        return (
            torch.randn(batch, 3, size, size, generator=gen).to(device),
            torch.randint(0, classes, (batch,), generator=gen).to(device),
        )

    return make


def _timed(
    device: torch.device,
    run_step: Callable[[Any, Any], None],
    finish: Callable[[], None],
    batches: list,
    warm: int,
) -> dict:
    for x, y in batches[:warm]:
        run_step(x, y)
    finish()
    measured = batches[warm:]
    loop_s = []
    cpu0, thread0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
    for x, y in measured:
        started = time.perf_counter()
        run_step(x, y)
        loop_s.append(time.perf_counter() - started)
    finish()
    wall, cpu, thread = (
        time.perf_counter() - t0,
        time.process_time() - cpu0,
        time.thread_time() - thread0,
    )
    n = len(measured)
    return {
        "step_ms": 1e3 * wall / n,
        "host_loop_ms_median": 1e3 * statistics.median(loop_s),
        "training_thread_cpu_ms": 1e3 * thread / n,
        "other_threads_cpu_ms": 1e3 * (cpu - thread) / n,
        "steps": n,
    }


def _finish(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _overhead_ddp(
    device: torch.device, make_model: Callable, loss_fn: Callable, batches: list, warm: int
) -> dict:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def ddp_step(x: Any, y: Any) -> None:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()

    return _timed(device, ddp_step, lambda: _finish(device), batches, warm)


def _overhead_scheduled(
    device: torch.device, make_model: Callable, loss_fn: Callable, batches: list, warm: int
) -> dict:
    from autobyte import ScheduledOptimizer

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = ScheduledOptimizer(model, opt, timeout_s=120)  # the default configuration
    blocked: list[float] = []
    sched.add_step_callback(lambda m: blocked.append(m.exposed_comm_s))

    def sched_step(x: Any, y: Any) -> None:
        sched.zero_grad()
        loss_fn(model(x), y).backward()
        sched.step()

    def finish() -> None:
        sched.synchronize()
        _finish(device)

    with sched:
        row = _timed(device, sched_step, finish, batches, warm)
        # the wall time the forward pass waited for parameters (the wait-before-use), median step
        row["wait_before_use_ms"] = 1e3 * statistics.median(blocked[warm:] or [0.0])
        row["hot_path"] = sched.hot_path
        row["dispatch"] = sched.dispatch_stats()
        with SyncCounter(device) as counter:
            for x, y in batches[:3]:
                sched_step(x, y)
            sched.synchronize()
        row["syncs_per_step"] = counter.count / 3
        row["sync_where"] = dict(counter.where.most_common(6))
    row["parameters"] = sum(p.numel() for p in model.parameters())
    return row


def overhead(rank: int, device: torch.device, quick: bool) -> dict:
    steps, warm = (6, 2) if quick else (14, 4)
    if device.type == "cuda":  # the speed a GPU user trains at
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out: dict[str, Any] = {}
    for name, make_model, make_batch, loss_fn in _overhead_models(device, quick):
        gen = torch.Generator().manual_seed(rank)
        batches = [make_batch(gen) for _ in range(steps)]
        row: dict[str, Any] = {}
        try:
            row["ddp"] = _overhead_ddp(device, make_model, loss_fn, batches, warm)
            row["scheduled"] = _overhead_scheduled(device, make_model, loss_fn, batches, warm)
            row["speed_vs_ddp"] = row["ddp"]["step_ms"] / row["scheduled"]["step_ms"]
        except Exception:  # noqa: BLE001 - e.g. out of memory: the other model still runs
            row["error"] = traceback.format_exc()[-2000:]
        del batches
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out[name] = row
    return {"world": dist.get_world_size(), "models": out}


STEPS: dict[str, Callable[[int, torch.device, bool], dict]] = {
    "two_ranks": two_ranks,
    "nccl_one_rank": nccl_one_rank,
    "overhead_1": overhead,
    "overhead_2": overhead,
}
WORLD = {"two_ranks": 2, "nccl_one_rank": 1, "overhead_1": 1, "overhead_2": 2}


def backend_for(step: str, device: torch.device) -> str:
    """gloo for 2 ranks on one device (NCCL refuses it), NCCL for one rank on a GPU."""
    return "nccl" if device.type == "cuda" and WORLD[step] == 1 else "gloo"


def _rank_entry(rank: int, step: str, device_kind: str, quick: bool, port: int, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device_kind == "cpu":
        torch.set_num_threads(1)
    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = WORLD[step]
    result: dict[str, Any]
    try:
        if device.type == "cuda" and step != "overhead_1" and step != "overhead_2":
            # the math attention kernels: deterministic, so DDP and the scheduler see the same gradients
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
        dist.init_process_group(
            backend_for(step, device),
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            result = {"ok": True, **STEPS[step](rank, device, quick)}
        finally:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported in the step's JSON
        result = {"ok": False, "error": traceback.format_exc()[-3000:]}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="small models and few steps")
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = WORLD[args.step]
    mp.start_processes(
        _rank_entry,
        args=(args.step, args.device, args.quick, port, args.out),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    ranks = []
    for rank in range(world):
        with open(f"{args.out}.rank{rank}") as f:
            ranks.append(json.load(f))
        os.unlink(f"{args.out}.rank{rank}")
    with open(args.out, "w") as f:
        json.dump(
            {
                "step": args.step,
                "device": args.device,
                "backend": backend_for(args.step, torch.device(args.device)),
                "world": world,
                "ranks": ranks,
            },
            f,
            indent=1,
        )
    return 0 if all(r["ok"] for r in ranks) else 1


if __name__ == "__main__":
    sys.exit(main())
