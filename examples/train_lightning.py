"""A LightningModule trained data-parallel on 2 CPU processes with autobyte's scheduler as the gradient sync.

python examples/train_lightning.py --steps 200              # Lightning starts both processes
python examples/train_lightning.py --steps 200 --job demo   # and streams to autobyted
# (AUTOBYTE_DAEMON selects the daemon, default 127.0.0.1:7077; needs `pip install '.[lightning]' 'torch==2.13.0'` from a clone)
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from autobyte.lightning import AutobyteStrategy
from torch.utils.data import DataLoader, TensorDataset


class MLP(L.LightningModule):
    def __init__(self, width: int = 1024, depth: int = 4) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = [torch.nn.Linear(256, width), torch.nn.ReLU()]
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=self.trainer.max_steps
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--job", help="stream to autobyted under this job id (default: nothing is sent)"
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    data = TensorDataset(
        torch.randn(64 * 2 * args.steps, 256), torch.randint(0, 10, (64 * 2 * args.steps,))
    )
    trainer = L.Trainer(
        strategy=AutobyteStrategy(partition_bytes=4 << 20, credit_bytes=16 << 20, job=args.job),
        accelerator="cpu",
        devices=2,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(MLP(), DataLoader(data, batch_size=64))


if __name__ == "__main__":
    main()
