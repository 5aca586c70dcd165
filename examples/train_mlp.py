"""A data-parallel training script with autobyte: the README's pattern, nothing more.

    torchrun --nproc-per-node 2 examples/train_mlp.py                 # streams to autobyted if one runs
    AUTOBYTE_DAEMON=host:7077 AUTOBYTE_JOB=my-run torchrun --nproc-per-node 2 examples/train_mlp.py

Rank 0 prints the job's id (follow it with `autobyte history JOB`) and where it saved the model
(MLP_CHECKPOINT, default mlp.pt in the temporary directory).
"""

import os
import tempfile

import autobyte
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # or "nccl", as for DDP
torch.manual_seed(0)  # the scheduler broadcasts rank 0's parameters anyway
session = autobyte.init()  # job id from AUTOBYTE_JOB or torchrun; daemon 127.0.0.1:7077
if session is not None and dist.get_rank() == 0:
    print(
        f"autobyte job {session.job}: follow it with `autobyte history {session.job}`", flush=True
    )
model = torch.nn.Sequential(
    torch.nn.Linear(256, 1024),
    torch.nn.ReLU(),
    torch.nn.Linear(1024, 1024),
    torch.nn.ReLU(),
    torch.nn.Linear(1024, 10),
)  # the bare module: no DDP wrapper
data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own shard
with autobyte.ScheduledOptimizer(
    model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
) as opt:
    for step in range(200):
        x, y = torch.randn(64, 256, generator=data), torch.randint(0, 10, (64,), generator=data)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # returns at once: the update lands during the next forward
        opt.zero_grad()
if dist.get_rank() == 0:
    checkpoint = os.environ.get("MLP_CHECKPOINT") or os.path.join(tempfile.gettempdir(), "mlp.pt")
    torch.save(model.state_dict(), checkpoint)  # after the block every update has landed
    print(f"model saved to {checkpoint}", flush=True)
autobyte.shutdown()  # the last steps reach the daemon (bounded wait)
dist.destroy_process_group()
