"""A Hugging Face Trainer script on autobyte's scheduler: the only change from the DDP original is
the import of `Trainer` (and the optional `autobyte=` settings). A tiny GPT-2 built from its config
trains on random tokens, so nothing is downloaded.

    python -m torch.distributed.run --nproc-per-node 2 examples/train_hf_trainer.py --steps 50
    AUTOBYTE_DAEMON=127.0.0.1:7077 python -m torch.distributed.run --nproc-per-node 2 \\
        examples/train_hf_trainer.py --steps 200 --daemon     # streams to autobyted as job "gpt2-tiny"
    # (needs `pip install '.[hf]' 'torch==2.13.0'` from a clone, `'autobyte[hf]'` from an index)
"""

from __future__ import annotations

import argparse
import os

import torch
from autobyte.hf import Trainer  # was: from transformers import Trainer
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments


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
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--output-dir", default="hf-trainer-out")
    parser.add_argument(
        "--daemon", action="store_true", help="stream to AUTOBYTE_DAEMON (default 127.0.0.1:7077)"
    )
    args = parser.parse_args()
    config = GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=1000, n_positions=64)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-4,
        warmup_steps=5,
        bf16=True,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=25,
        save_steps=25,
        report_to=[],
        run_name="gpt2-tiny",
    )
    autobyte = {"partition_bytes": 1 << 20, "credit_bytes": 4 << 20}
    if args.daemon:
        autobyte["daemon"] = os.environ.get("AUTOBYTE_DAEMON", "127.0.0.1:7077")
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=training,
        train_dataset=RandomTokens(2048, 64, 1000),
        eval_dataset=RandomTokens(64, 64, 1000),
        autobyte=autobyte,
    )
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
