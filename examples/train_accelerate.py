"""An accelerate training loop on autobyte's scheduler: the only change from the stock accelerate
script is the import of `Accelerator`. A tiny GPT-2 built from its config trains on random tokens (so
nothing is downloaded), with gradient accumulation, and clips the gradients by their global norm,
logging the norm `accelerator.clip_grad_norm_` returns.

    python -m torch.distributed.run --nproc-per-node 2 examples/train_accelerate.py --steps 20
    # (needs `pip install '.[hf]' 'torch==2.13.0'` from a clone, `'autobyte[hf]'` from an index)
"""

from __future__ import annotations

import argparse

import torch
from accelerate.utils import set_seed
from autobyte.accelerate import Accelerator  # was: from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, samples: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(
            0, vocab, (samples, length), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--output-dir", default="accelerate-out")
    args = parser.parse_args()

    # cpu=True without a GPU: accelerate then runs the torchrun launch as MULTI_CPU (gloo)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accumulation, cpu=not torch.cuda.is_available()
    )
    set_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=1000, n_positions=64)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loader = torch.utils.data.DataLoader(RandomTokens(512, 64, 1000), batch_size=8, shuffle=True)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, 5, args.steps)
    model, optimizer, loader, lr_scheduler = accelerator.prepare(
        model, optimizer, loader, lr_scheduler
    )

    model.train()
    step = 0
    while step < args.steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                accelerator.print(
                    f"step {step} loss {loss.item():.4f} grad_norm {float(grad_norm):.4f}"
                )
                if step == args.steps:
                    break

    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir)
    accelerator.print(f"model saved to {args.output_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
