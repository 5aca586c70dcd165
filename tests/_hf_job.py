"""Worker for tests/test_hf.py (2 gloo ranks under torch.distributed.run): the same Trainer and
accelerate runs with DDP and with autobyte's drop-ins, tiny GPT-2 / BERT built from their configs
(nothing downloaded); writes every rank's state_dicts and logs to OUT_DIR."""

from __future__ import annotations

import json
import logging
import os
import sys

import autobyte.accelerate
import autobyte.hf
import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator as DDPAccelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    TrainingArguments,
)

OUT = sys.argv[1]
DAEMON = sys.argv[2]
RANK = int(os.environ["RANK"])


class Reconfigure(transformers.TrainerCallback):
    """What the daemon's control stream does, at a known step: a new configuration from step 2."""

    def __init__(self) -> None:
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        if (
            state.global_step == 1
            and self.trainer is not None
            and self.trainer.scheduled_optimizer is not None
        ):
            self.trainer.scheduled_optimizer.reconfigure(partition_bytes=8192, credit_bytes=None)


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=16)
    )


def bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(
        BertConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=97,
            max_position_embeddings=16,
            num_labels=3,
        )
    )


class BatchNormRegressor(torch.nn.Module):
    """A small model with BatchNorm running statistics, in Trainer's calling convention."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(6, 16),
            torch.nn.BatchNorm1d(16),
            torch.nn.ReLU(),
            torch.nn.Linear(16, 1),
        )

    def forward(self, x, labels):
        out = self.body(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def batchnorm_regressor() -> BatchNormRegressor:
    torch.manual_seed(0)
    return BatchNormRegressor()


class Features(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(n, 6, generator=g) * torch.linspace(0.5, 3.0, n).unsqueeze(1)
        self.y = torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, labels: bool = False) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 97, (n, 12), generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.labels = labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        if self.labels:
            return {"input_ids": self.ids[i], "labels": self.y[i]}
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


BATCHNORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
SKIPPED: list[int] = []  # fp16 steps whose update the GradScaler skipped, per accelerate run
NORMS: list[list] = []  # what accelerator.clip_grad_norm_ returned at each step, per accelerate run
# per accelerate run: at each step, accelerator.gather / reduce of values computed from gradients
GRAD_VALUES: list[list] = []


def reset() -> None:
    AcceleratorState._reset_state()
    GradientState._reset_state()


def state(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trainer_run(
    trainer_cls,
    make_model,
    out_dir,
    extra=None,
    resume=None,
    labels=False,
    callback=None,
    data=None,
    **overrides,
):
    reset()
    settings = {
        "output_dir": out_dir,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 4,
        "learning_rate": 1e-3,
        "warmup_steps": 1,
        "bf16": True,
        "use_cpu": True,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "save_steps": 2,
        "logging_steps": 1,
        "report_to": [],
        "seed": 0,
        "data_seed": 0,
        "dataloader_num_workers": 0,
        "run_name": "hf-test",
        "disable_tqdm": True,
        "max_grad_norm": 0.5,
    }  # below these models' gradient norms: clipping changes every step
    settings.update(overrides)
    args = TrainingArguments(**settings)
    kwargs = {} if extra is None else {"autobyte": extra}
    train, evaluation = (Tokens(48, labels), Tokens(8, labels)) if data is None else data
    trainer = trainer_cls(
        model=make_model(), args=args, train_dataset=train, eval_dataset=evaluation, **kwargs
    )
    if callback is not None:
        callback.trainer = trainer
        trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=resume)
    logs = [entry for entry in trainer.state.log_history]
    return state(trainer.model), logs


def with_fp16_scaler(accelerator):
    """fp16 autocast + GradScaler on CPU: accelerate makes fp16 on CPU plain fp32 (no autocast, no
    scaler), so both runs of the pair get them by hand, as accelerate sets them up on a GPU."""
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
    return accelerator


def accelerate_run(accelerator, resume_dir=None, save_dir=None):
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    loader = torch.utils.data.DataLoader(Tokens(32), batch_size=4, shuffle=False)
    model, optimizer, loader, lr = accelerator.prepare(model, optimizer, loader, lr)
    skipped = 0
    norms, grad_values = [], []
    for epoch in range(2):
        for i, batch in enumerate(loader):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                    norms.append(None if norm is None else float(norm))  # logged, as loops do
                    head = accelerator.unwrap_model(model).lm_head.weight.grad.float()
                    gathered = accelerator.gather(head.norm().reshape(1))  # every rank's
                    reduced = accelerator.reduce(head.sum().reshape(1), reduction="mean")
                    grad_values.append((gathered.tolist(), reduced.tolist()))
                optimizer.step()
                skipped += bool(accelerator.sync_gradients and optimizer.step_was_skipped)
                lr.step()
                optimizer.zero_grad()
        if epoch == 0:
            accelerator.save_state(save_dir)
            accelerator.wait_for_everyone()
            with torch.no_grad():  # perturb, then restore: load_state must bring everything back
                for p in model.parameters():
                    p.add_(1.0)
            accelerator.load_state(save_dir)
    SKIPPED.append(skipped)
    NORMS.append(norms)
    GRAD_VALUES.append(grad_values)
    scheduled = isinstance(accelerator, autobyte.accelerate.Accelerator) and len(
        accelerator.schedulers
    )
    if scheduled:
        accelerator.close_schedulers()  # end_training() would also end the process group
    return state(accelerator.unwrap_model(model)), scheduled


def accelerate_batchnorm(accelerator):
    """BatchNorm through accelerate: rank-local batches (and a rank-local initial running mean),
    training, an evaluation under no_grad, training again."""
    model = batchnorm_regressor()
    if RANK == 1:
        with torch.no_grad():
            model.body[1].running_mean.add_(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = Features(48)
    for step in range(6):
        if step == 3:
            model.eval()
            with torch.no_grad():
                model(data.x[:8], data.y[:8])
            model.train()
        rows = slice(8 * step + 4 * RANK, 8 * step + 4 * RANK + 4)
        accelerator.backward(model(data.x[rows] * (1 + RANK), data.y[rows])["loss"])
        optimizer.step()
        optimizer.zero_grad()
    if isinstance(accelerator, autobyte.accelerate.Accelerator):
        accelerator.close_schedulers()
    return state(accelerator.unwrap_model(model))


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("autobyte.hf").setLevel(logging.INFO)  # the configuration lines
    results: dict = {}
    dense = {"partition_bytes": 4096, "credit_bytes": 16384}
    ddp, ddp_logs = trainer_run(transformers.Trainer, gpt2, f"{OUT}/ddp")
    ours, our_logs = trainer_run(
        autobyte.hf.Trainer,
        gpt2,
        f"{OUT}/ours",
        extra={**dense, "daemon": DAEMON},
        callback=Reconfigure(),
    )
    from autobyte.transport import session

    session_closed = session._reporter is None
    results["gpt2"] = (ddp, ours)
    # resume from the step-2 checkpoint of each run
    ddp_r, _ = trainer_run(
        transformers.Trainer, gpt2, f"{OUT}/ddp", resume=f"{OUT}/ddp/checkpoint-2"
    )
    ours_r, _ = trainer_run(
        autobyte.hf.Trainer, gpt2, f"{OUT}/ours", extra=dense, resume=f"{OUT}/ours/checkpoint-2"
    )
    results["gpt2_resumed"] = (ddp_r, ours_r)
    ddp_b, _ = trainer_run(
        transformers.Trainer,
        bert,
        f"{OUT}/bddp",
        labels=True,
        bf16=False,
        gradient_accumulation_steps=1,
        max_steps=3,
        save_steps=10,
    )
    ours_b, _ = trainer_run(
        autobyte.hf.Trainer,
        bert,
        f"{OUT}/bours",
        labels=True,
        bf16=False,
        gradient_accumulation_steps=1,
        max_steps=3,
        save_steps=10,
    )
    results["bert"] = (ddp_b, ours_b)
    # BatchNorm: rank 0's statistics reach every rank before each training forward, as DDP's
    # (ddp_broadcast_buffers=None: DDP's default True); the evaluation runs on the unwrapped model
    features = {
        "labels": True,
        "bf16": False,
        "max_steps": 4,
        "save_steps": 10,
        "max_grad_norm": 0.0,
        "data": (Features(64), Features(16)),
    }
    ddp_n, ddp_n_logs = trainer_run(
        transformers.Trainer, batchnorm_regressor, f"{OUT}/nddp", **features
    )
    ours_n, ours_n_logs = trainer_run(
        autobyte.hf.Trainer, batchnorm_regressor, f"{OUT}/nours", **features
    )
    results["batchnorm"] = (ddp_n, ours_n)
    batchnorm_evals = [
        [e["eval_loss"] for e in logs if "eval_loss" in e] for logs in (ddp_n_logs, ours_n_logs)
    ]

    reset()
    a, _ = accelerate_run(
        DDPAccelerator(mixed_precision="bf16", gradient_accumulation_steps=2, cpu=True),
        save_dir=f"{OUT}/acc_ddp",
    )
    reset()
    ours_accelerator = autobyte.accelerate.Accelerator(
        mixed_precision="bf16", gradient_accumulation_steps=2, cpu=True, clip_grad_norm=0.5, **dense
    )
    b, accelerate_scheduled = accelerate_run(ours_accelerator, save_dir=f"{OUT}/acc_ours")
    results["accelerate"] = (a, b)
    reset()
    a16, _ = accelerate_run(
        with_fp16_scaler(
            DDPAccelerator(mixed_precision="fp16", gradient_accumulation_steps=2, cpu=True)
        ),
        save_dir=f"{OUT}/acc16_ddp",
    )
    skipped_ddp = SKIPPED.pop()
    reset()
    b16, fp16_scheduled = accelerate_run(
        with_fp16_scaler(
            autobyte.accelerate.Accelerator(
                mixed_precision="fp16",
                gradient_accumulation_steps=2,
                cpu=True,
                clip_grad_norm=0.5,
                **dense,
            )
        ),
        save_dir=f"{OUT}/acc16_ours",
    )
    skipped_ours = SKIPPED.pop()
    results["accelerate_fp16"] = (a16, b16)
    # the standard accelerate loop, one import changed: clip_grad_norm_ with no constructor
    # argument clips as DDP's and returns DDP's norm (bf16 with accumulation; fp16 unscales first)
    plain_norms, plain_grad_values = {}, {}
    for name, precision in (("accelerate_plain", "bf16"), ("accelerate_plain_fp16", "fp16")):
        pair = []
        for cls, extra in ((DDPAccelerator, {}), (autobyte.accelerate.Accelerator, dense)):
            reset()
            accelerator = cls(
                mixed_precision=precision, gradient_accumulation_steps=2, cpu=True, **extra
            )
            if precision == "fp16":
                with_fp16_scaler(accelerator)
            state_dict, _ = accelerate_run(accelerator, save_dir=f"{OUT}/{name}_{cls.__module__}")
            SKIPPED.pop()
            pair.append((state_dict, NORMS.pop(), GRAD_VALUES.pop()))
        results[name] = (pair[0][0], pair[1][0])
        plain_norms[name] = (pair[0][1], pair[1][1])
        plain_grad_values[name] = (pair[0][2], pair[1][2])
    no_broadcast = [DistributedDataParallelKwargs(broadcast_buffers=False)]
    reset()
    a_n = accelerate_batchnorm(DDPAccelerator(cpu=True, kwargs_handlers=no_broadcast))
    reset()
    b_n = accelerate_batchnorm(
        autobyte.accelerate.Accelerator(cpu=True, kwargs_handlers=no_broadcast, **dense)
    )
    results["accelerate_batchnorm_no_broadcast"] = (a_n, b_n)

    refusals = {}
    reset()
    try:
        autobyte.accelerate.Accelerator(
            cpu=True,
            kwargs_handlers=[
                DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
            ],
        )
        refusals["comm_hook"] = ""
    except ValueError as error:
        refusals["comm_hook"] = str(error)
    reset()
    acc = autobyte.accelerate.Accelerator(cpu=True, clip_grad_norm=0.5)
    model = gpt2()
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    try:
        acc.clip_grad_norm_(model.parameters(), 1.0)
        refusals["clip"] = ""
    except ValueError as error:
        refusals["clip"] = str(error)
    acc.close_schedulers()

    diffs = {
        name: {k: float((x[k].double() - y[k].double()).abs().max()) for k in x}
        for name, (x, y) in results.items()
    }
    keys_equal = {name: sorted(x) == sorted(y) for name, (x, y) in results.items()}
    # every rank's parameters identical: rank 0's tensors against this rank's (BatchNorm statistics
    # apart: each rank's last forward updates its own, with DDP too)
    across, across_statistics = {}, {}
    for name, (_, y) in results.items():
        worst = {False: 0.0, True: 0.0}
        for k, v in y.items():
            v0 = v.clone()
            dist.broadcast(v0, 0)
            statistic = k.endswith(BATCHNORM_STATISTICS)
            worst[statistic] = max(worst[statistic], float((v0.double() - v.double()).abs().max()))
        across[name], across_statistics[name] = worst[False], worst[True]
    with open(f"{OUT}/rank{RANK}.json", "w") as f:
        json.dump(
            {
                "diffs": diffs,
                "keys_equal": keys_equal,
                "across": across,
                "refusals": refusals,
                "fp16": {
                    "skipped_ddp": skipped_ddp,
                    "skipped_ours": skipped_ours,
                    "scheduled": fp16_scheduled,
                },
                "session_closed": session_closed,
                "batchnorm_evals": batchnorm_evals,
                "across_statistics": across_statistics,
                "accelerate_scheduled": accelerate_scheduled,
                "plain_norms": plain_norms,
                "plain_grad_values": plain_grad_values,
                "ddp_logs": ddp_logs,
                "our_logs": our_logs,
            },
            f,
            default=str,
        )


if __name__ == "__main__":
    main()
