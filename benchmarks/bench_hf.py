"""Step time under `autobyte.hf.Trainer` against the same model and settings in a plain autobyte loop
(ScheduledOptimizer + AdamW + warm-up/linear LR + clipping + bf16 autocast), 2 gloo ranks, paired
side by side in one run: does Trainer add overhead of ours? Trainer has overhead of its own (its
data loader wrapper, loss bookkeeping, callbacks), so the same pair runs with DDP too: ours is the
autobyte ratio (Trainer / loop) minus the DDP one.

Each round runs the four variants in turn (so that load on a shared machine hits both alike), each
from a fresh scheduler over the same GPT-2 built from its config (nothing downloaded): `--warmup`
unmeasured and `--steps` measured steps. A window's step time is its wall time over its steps, the
scheduler synchronized at both ends (its `step()` returns before the updates land); Trainer's window
is timed by a TrainerCallback at its step boundaries. The table shows the median over rounds and the
Trainer/loop ratio per round. Loopback by default; `--rates 1gbit` runs on the namespace testbed
(root).

    python -m benchmarks.bench_hf --rounds 5 --steps 20
    python -m benchmarks.bench_hf --rates 1gbit --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.testbed import loopback

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("loop_ddp", "trainer_ddp", "loop", "trainer")


# ---------------------------------------------------------------------- one rank


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from autobyte import ScheduledOptimizer
    from autobyte.hf import Trainer
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = args.warmup + args.steps
    config = GPT2Config(
        n_layer=args.layers,
        n_head=4,
        n_embd=args.hidden,
        vocab_size=args.vocab,
        n_positions=args.length,
    )
    samples = 2 * args.batch_size * total  # both ranks, one epoch, no sample twice

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(
                0, args.vocab, (samples, args.length), generator=torch.Generator().manual_seed(1)
            )

        def __len__(self) -> int:
            return samples

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    dataset = Tokens()

    def model() -> GPT2LMHeadModel:
        torch.manual_seed(0)
        return GPT2LMHeadModel(config)

    def run_loop(scheduled: bool) -> float:
        net = model()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.0)
        lr = transformers.get_linear_schedule_with_warmup(opt, 2, total)
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
        sched = (
            ScheduledOptimizer(net, opt, args.partition, args.credit, clip_grad_norm=1.0)
            if scheduled
            else None
        )
        wrapped = net if scheduled else torch.nn.parallel.DistributedDataParallel(net)
        try:
            start = 0.0
            for i, batch in enumerate(loader):
                if i == args.warmup:
                    if sched is not None:
                        sched.synchronize()
                    start = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = wrapped(**batch).loss
                loss.backward()
                if sched is None:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                else:
                    sched.step()
                    sched.zero_grad(set_to_none=True)
                lr.step()
            if sched is not None:
                sched.synchronize()
            return (time.perf_counter() - start) / args.steps
        finally:
            if sched is not None:
                sched.close()

    class Window(transformers.TrainerCallback):
        def __init__(self, trainer: Trainer) -> None:
            self.trainer, self.start, self.end = trainer, 0.0, 0.0

        def on_step_end(self, a, state, control, **kwargs):
            if state.global_step in (args.warmup, total):
                scheduled = getattr(self.trainer, "scheduled_optimizer", None)
                if scheduled is not None:
                    scheduled.synchronize()
                if state.global_step == args.warmup:
                    self.start = time.perf_counter()
                else:
                    self.end = time.perf_counter()

    def run_trainer(scheduled: bool) -> float:
        settings = TrainingArguments(
            output_dir=os.path.join(args.tmp, "trainer"),
            max_steps=total,
            per_device_train_batch_size=args.batch_size,
            learning_rate=1e-4,
            warmup_steps=2,
            bf16=True,
            use_cpu=True,
            save_strategy="no",
            eval_strategy="no",
            logging_steps=10**6,
            report_to=[],
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        options = (
            {"autobyte": {"partition_bytes": args.partition, "credit_bytes": args.credit}}
            if scheduled
            else {}
        )
        trainer = (Trainer if scheduled else transformers.Trainer)(
            model=model(), args=settings, train_dataset=dataset, **options
        )
        window = Window(trainer)
        trainer.add_callback(window)
        trainer.train()
        return (window.end - window.start) / args.steps

    rounds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            scheduled = not variant.endswith("_ddp")
            rounds[variant].append(
                run_loop(scheduled) if variant.startswith("loop") else run_trainer(scheduled)
            )
    if rank == 0:
        print(
            json.dumps(
                {
                    "event": "result",
                    "rounds": rounds,
                    "params": sum(p.numel() for p in model().parameters()),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


# ---------------------------------------------------------------------- the launch


def worker_argv(args: argparse.Namespace) -> list[str]:
    return loopback.worker_argv(
        "benchmarks.bench_hf",
        args,
        (
            "rounds",
            "steps",
            "warmup",
            "batch-size",
            "threads",
            "partition",
            "credit",
            "vocab",
            "hidden",
            "layers",
            "length",
            "tmp",
        ),
    )


def _env(args: argparse.Namespace) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": str(args.threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "client"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    }


def format_table(blocks: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [
        (
            "| link | params | sync | loop median step (ms) | Trainer median step (ms) | Trainer / loop "
            "(median of per-round ratios) | per-round ratios |"
        ),
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for link, result in blocks:
        for sync, suffix in (("DDP", "_ddp"), ("autobyte", "")):
            loop, trainer = result["rounds"][f"loop{suffix}"], result["rounds"][f"trainer{suffix}"]
            ratios = [t / s for t, s in zip(trainer, loop)]
            lines.append(
                f"| {link} | {result['params'] / 1e6:.1f}M | {sync} | {statistics.median(loop) * 1e3:.1f} | "
                f"{statistics.median(trainer) * 1e3:.1f} | {statistics.median(ratios):.3f} | "
                f"{', '.join(f'{r:.3f}' for r in ratios)} |"
            )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = loopback.paired_parser(__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--tmp", default="/tmp/autobyte-bench-hf")
    args = parser.parse_args(argv)
    loopback.check_at_least_one(
        parser,
        args,
        (
            "rounds",
            "steps",
            "warmup",
            "batch_size",
            "threads",
            "vocab",
            "hidden",
            "layers",
            "length",
        ),
    )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    blocks = loopback.run_blocks(args, worker_argv(args), _env(args))
    loopback.report(args, blocks, format_table(blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
