"""A training job in which one rank SIGKILLs itself in the middle of a backward pass: run by
tests/test_scheduler_rank_killed.py, as two plain processes (the survivor must raise within
seconds, naming the dead rank, and exit) or under `torch.distributed.run --max-restarts 1` (the
restarted group resumes from its last checkpoint and completes).

Rendezvous from the environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE: torchrun's or the test's).
The batch of step s on rank r depends on (r, s) only, so a resumed run sees what an uninterrupted
one sees. Writes `r{rank}.json` in --out: completion (parameter digests) or the error raised.
"""

import argparse
import hashlib
import json
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from autobyte import ScheduledOptimizer
from autobyte.scheduler import SchedulerError
from torch import nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--kill-step", type=int, default=-1)
parser.add_argument("--checkpoint-every", type=int, default=0)
parser.add_argument("--step-sleep-s", type=float, default=0.0)
args = parser.parse_args()

torch.set_num_threads(1)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
# the backend's default timeout (30 min) stays: it is not what detects a death
if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
    # torchrun's store outlives a restart, and with it gloo's keys of the dead attempt: a restarted
    # rank can read its peer's old address and fail or hang connecting (plain torch, the default
    # group included). A prefix per attempt, as torchrun users of gloo need, keeps them apart.
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"attempt{attempt}/", agent_store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
else:
    dist.init_process_group("gloo")
rank = dist.get_rank()
checkpoint = os.path.join(args.out, "checkpoint.pt")
marker = os.path.join(args.out, "killed.json")  # written once: only the first attempt dies

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
lr_schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
start = 0
if args.checkpoint_every and os.path.exists(checkpoint):
    state = torch.load(checkpoint)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    lr_schedule.load_state_dict(state["lr_schedule"])
    start = state["step"]


def die(_grad):
    with open(marker + ".tmp", "w") as out:
        json.dump({"rank": rank, "step": step, "attempt": attempt, "t": time.monotonic()}, out)
    os.replace(marker + ".tmp", marker)
    os.kill(os.getpid(), signal.SIGKILL)


report = {"rank": rank, "attempt": attempt, "resumed_from": start}
step = start
try:
    with ScheduledOptimizer(model, opt, partition_bytes=4 << 10, credit_bytes=8 << 10) as sched:
        for step in range(start, args.steps):
            gen = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
            loss = F.mse_loss(model(x), y)
            hook = None
            if rank == args.kill_rank and step == args.kill_step and not os.path.exists(marker):
                hook = model[2].weight.register_hook(die)  # mid-backward, gradients half sent
            loss.backward()
            if hook is not None:
                hook.remove()
            sched.step()
            lr_schedule.step()
            sched.zero_grad()
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                optimizer_state = sched.state_dict()  # synchronizes: every update has landed
                if rank == 0:
                    torch.save(
                        {
                            "model": model.state_dict(),
                            "optimizer": optimizer_state,
                            "lr_schedule": lr_schedule.state_dict(),
                            "step": step + 1,
                        },
                        checkpoint + ".tmp",
                    )
                    os.replace(checkpoint + ".tmp", checkpoint)
                dist.barrier()  # every rank past this checkpoint before anyone trusts it
            time.sleep(args.step_sleep_s)
    report["completed"] = True
    report["digests"] = [
        hashlib.sha256(p.detach().numpy().tobytes()).hexdigest()[:16] for p in model.parameters()
    ]
except SchedulerError as error:
    report["completed"] = False
    report["error"] = str(error)
    report["raised_t"] = time.monotonic()
report["step"] = step
report["threads_left"] = [
    t.name for t in threading.enumerate() if t.name.startswith("autobyte-") and t.is_alive()
]
with open(os.path.join(args.out, f"r{rank}.json"), "w") as out:
    json.dump(report, out)
dist.destroy_process_group()
