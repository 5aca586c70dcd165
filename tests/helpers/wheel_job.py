"""A 2-rank gloo job that an installed wheel runs in a fresh virtual environment: scheduled vs DDP
on the same data, writing each rank's hot path, its reason and the largest parameter difference as
JSON (`<out>.<rank>.json`) and its log (`<out>.<rank>.log`). Written into the test's own folder and
run from there, so that nothing of the checkout is on the job's path."""

TWO_RANK_JOB = """
import json, logging, os, socket, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

def rank_main(rank, port, out):
    logging.basicConfig(level=logging.INFO, filename=f"{out}.{rank}.log")
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from autobyte import ScheduledOptimizer
    torch.manual_seed(0)
    ref, model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), \\
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.load_state_dict(ref.state_dict())
    ddp = nn.parallel.DistributedDataParallel(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(5)]
    with ScheduledOptimizer(model, opt, partition_bytes=4096, credit_bytes=8192) as sched:
        for x, y in data:
            ref_opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            ref_opt.step()
            F.mse_loss(model(x), y).backward()
            sched.step()
            sched.zero_grad()
        sched.synchronize()
        diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
        result = {"hot_path": sched.hot_path, "reason": sched.hot_path_reason, "diff": diff}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(port, sys.argv[1]), nprocs=2, start_method="spawn")
"""
