"""Worker for tests/test_hf_fsdp.py (2 gloo ranks under torch.distributed.run): FSDP2 through
accelerate and the Trainer, each run with accelerate's own FSDP2 path and with autobyte's drop-in
(one import changed), a tiny GPT-2 built from its config; writes every rank's results to OUT_DIR.

accelerate 1.16 turns its FSDP plugin on only on an accelerator; the reference runs here turn it
on under this CPU launch as accelerate does on one (`AcceleratorFSDP2`: the state's type and
plugin), which is what autobyte's drop-in does by itself."""

from __future__ import annotations

import json
import os
import sys

import accelerate
import autobyte.accelerate
import autobyte.fsdp
import autobyte.hf
import torch
import torch.distributed as dist
import transformers
import transformers.trainer as trainer_module
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import FSDPModule
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    TrainingArguments,
)

OUT = sys.argv[1]
DAEMON = sys.argv[2]
RANK = int(os.environ["RANK"])
# live changes, proposed by rank 0 at known steps (what the daemon's decisions do)
CHANGES = {
    1: autobyte.fsdp.ShardConfig(forward_prefetch=2, backward_prefetch=2),
    2: autobyte.fsdp.ShardConfig(reshard_after_forward=False, forward_prefetch=1),
}


class AcceleratorFSDP2(accelerate.Accelerator):
    """accelerate's own FSDP2 path, turned on under a CPU launch as accelerate does on a GPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        plugin = kwargs["fsdp_plugin"]
        self.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if self.state.mixed_precision != "no":
            plugin.set_mixed_precision(self.state.mixed_precision)
        self.state.fsdp_plugin = plugin


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2(tied: bool = False) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=3,
        n_head=2,
        n_embd=32,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=tied,
    )
    return GPT2LMHeadModel(config)


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def plugin(block: str = "GPT2Block", **settings) -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[block],
        **settings,
    )


def reset() -> None:
    AcceleratorState._reset_state()
    GradientState._reset_state()
    os.environ.pop("ACCELERATE_USE_FSDP", None)  # set by accelerate when given a plugin


def full(model: torch.nn.Module) -> dict:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def sharded(model: torch.nn.Module) -> bool:
    """The model is FSDP2's, every parameter a shard of its full tensor."""
    return isinstance(model, FSDPModule) and all(
        hasattr(p, "full_tensor") and p.to_local().numel() < p.numel()
        for p in model.parameters()
        if p.numel() >= 2 * dist.get_world_size()
    )


def accelerate_run(accelerator, make_model=gpt2) -> dict:
    """The standard accelerate loop: accumulation, clip_grad_norm_ logged, a save_state /
    load_state round trip; autobyte's FSDP2 job gets new configurations at steps 1 and 2."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Tokens(48), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    job = getattr(accelerator, "sharded_job", lambda _m: None)(model)
    configs = []
    if job is not None:
        job.add_step_callback(lambda s: configs.append(s.config.describe()))
    norms, steps = [], 0
    for epoch in range(2):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
                optimizer.step()
                optimizer.zero_grad()
                if accelerator.sync_gradients:
                    steps += 1
                    if job is not None and RANK == 0 and steps in CHANGES:
                        job.propose(CHANGES[steps])
        if epoch == 0:
            accelerator.save_state(f"{OUT}/state_{type(accelerator).__module__}")
            with torch.no_grad():  # perturb, then restore: load_state must bring it all back
                for p in model.parameters():
                    p.add_(1.0)
            accelerator.load_state(f"{OUT}/state_{type(accelerator).__module__}")
    result = {"state": full(model), "norms": norms, "sharded": sharded(model), "configs": configs}
    if job is not None:
        accelerator.close_schedulers()
    return result


class Reconfigure(transformers.TrainerCallback):
    """Rank 0 proposes the CHANGES at their steps, as the daemon's decisions arrive."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        job = self.trainer.sharded_job
        if job is not None and RANK == 0 and state.global_step in CHANGES:
            job.propose(CHANGES[state.global_step])


def trainer_run(trainer_cls, out_dir: str, autobyte_options=None) -> dict:
    reset()
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=5,
        learning_rate=1e-3,
        warmup_steps=1,
        use_cpu=True,
        save_steps=2,
        logging_steps=1,
        report_to=[],
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        run_name="hf-fsdp",
        disable_tqdm=True,
        max_grad_norm=0.5,
        fsdp="full_shard",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
    )
    kwargs = {} if autobyte_options is None else {"autobyte": autobyte_options}
    trainer = trainer_cls(model=gpt2(), args=args, train_dataset=Tokens(64), **kwargs)
    if autobyte_options is not None:
        trainer.add_callback(Reconfigure(trainer))
    trainer.train()
    return {
        "state": full(trainer.model),
        "sharded": sharded(trainer.model),
        "grad_norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
        "autobyte_logs": [
            {k: v for k, v in e.items() if k.startswith("autobyte/")}
            for e in trainer.state.log_history
            if any(k.startswith("autobyte/") for k in e)
        ],
        "checkpoints": sorted(n for n in os.listdir(out_dir) if n.startswith("checkpoint-")),
    }


def refusal(make) -> str:
    reset()
    try:
        make()
    except ValueError as error:
        return str(error)
    return ""


def main() -> None:
    torch.set_num_threads(1)
    reset()
    plain = accelerate_run(
        AcceleratorFSDP2(cpu=True, fsdp_plugin=plugin(), gradient_accumulation_steps=2)
    )
    reset()
    ours = accelerate_run(
        autobyte.accelerate.Accelerator(
            cpu=True,
            fsdp_plugin=plugin(),
            gradient_accumulation_steps=2,
            daemon=DAEMON,
            job="acc-fsdp",
        )
    )
    # more of what users shard: bf16 (accelerate's MixedPrecisionPolicy) with tied embeddings,
    # Llama blocks under activation checkpointing
    variants = {}
    for name, make_model, block, settings, precision in (
        ("bf16_tied", lambda: gpt2(tied=True), "GPT2Block", {}, "bf16"),
        (
            "llama_checkpointed",
            llama,
            "LlamaDecoderLayer",
            {"activation_checkpointing": True},
            "no",
        ),
    ):
        pair = []
        for cls in (AcceleratorFSDP2, autobyte.accelerate.Accelerator):
            reset()
            accelerator = cls(
                cpu=True,
                fsdp_plugin=plugin(block, **settings),
                gradient_accumulation_steps=2,
                mixed_precision=precision,
            )
            pair.append(accelerate_run(accelerator, make_model))
        variants[name] = pair
    original = trainer_module.Accelerator
    trainer_module.Accelerator = AcceleratorFSDP2
    try:
        plain_trainer = trainer_run(transformers.Trainer, f"{OUT}/plain")
    finally:
        trainer_module.Accelerator = original
    ours_trainer = trainer_run(autobyte.hf.Trainer, f"{OUT}/ours", {"daemon": DAEMON})
    refusals = {
        "fsdp1": refusal(
            lambda: autobyte.accelerate.Accelerator(
                cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1)
            )
        ),
        "scheduler_settings": refusal(
            lambda: autobyte.accelerate.Accelerator(
                cpu=True, fsdp_plugin=plugin(), partition_bytes=4096
            )
        ),
        "budget_without_fsdp": refusal(
            lambda: autobyte.accelerate.Accelerator(cpu=True, memory_budget_bytes=1 << 20)
        ),
    }
    reset()

    def diff(a: dict, b: dict) -> float:
        return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)

    def across(state: dict) -> float:
        worst = 0.0
        for v in state.values():
            v0 = v.clone()
            dist.broadcast(v0, 0)
            worst = max(worst, float((v0.double() - v.double()).abs().max()))
        return worst

    out = {
        "accelerate": {
            "diff": diff(plain["state"], ours["state"]),
            "across": across(ours["state"]),
            "norms": (plain["norms"], ours["norms"]),
            "sharded": (plain["sharded"], ours["sharded"]),
            "configs": ours["configs"],
        },
        "trainer": {
            "diff": diff(plain_trainer["state"], ours_trainer["state"]),
            "across": across(ours_trainer["state"]),
            "grad_norms": (plain_trainer["grad_norms"], ours_trainer["grad_norms"]),
            "sharded": (plain_trainer["sharded"], ours_trainer["sharded"]),
            "autobyte_logs": ours_trainer["autobyte_logs"],
            "checkpoints": (plain_trainer["checkpoints"], ours_trainer["checkpoints"]),
        },
        "refusals": refusals,
        "variants": {
            name: {
                "diff": diff(a["state"], b["state"]),
                "across": across(b["state"]),
                "norms_equal": a["norms"] == b["norms"],
                "sharded": (a["sharded"], b["sharded"]),
                "changed": b["configs"][-1] != b["configs"][0],
            }
            for name, (a, b) in variants.items()
        },
    }
    with open(f"{OUT}/rank{RANK}.json", "w") as f:
        json.dump(out, f)
    # every result is written: end without the interpreter's finalization, during which a gloo
    # worker thread freeing the last tensor of a collective above (a checkpoint's broadcast, not
    # autobyte's: client/autobyte/fsdp.py ShardedJob._retire keeps its own) cannot take the GIL
    # and aborts the process (torch 2.13, gloo; about 1 launch in 20 under load)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
