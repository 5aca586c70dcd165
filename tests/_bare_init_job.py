"""A training script that calls bare `autobyte.init()` under torchrun (no AUTOBYTE_JOB, no
--rdzv-id): run by tests/test_launch_and_warnings.py. Writes the job id each rank chose."""

import json
import sys

import autobyte
import torch
import torch.distributed as dist
from autobyte.transport import session

dist.init_process_group("gloo")
rank = dist.get_rank()
reporter = autobyte.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
with autobyte.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1)) as opt:
    for _ in range(20):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
job = session._reporter.job
flushed = reporter.flush(timeout_s=20)
autobyte.shutdown(timeout_s=10)
with open(sys.argv[1].format(rank=rank), "w") as out:
    json.dump({"job": job, "flushed": flushed}, out)
dist.destroy_process_group()
