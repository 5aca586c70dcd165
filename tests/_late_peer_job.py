"""A rank interrupted with collectives in flight whose peer dies while the interpreter finalizes:
run by tests/test_process_exit.py.

    python tests/_late_peer_job.py RANK PORT DIR

After one whole step, rank 0 hands the next step's gradients to the scheduler, whose all-reduces then wait on rank 1 (which
never joins them), and raises KeyboardInterrupt (Ctrl-C). While its interpreter finalizes (a module
global's `__del__` holds it there for a while), rank 1 dies: the connections close, and the
backend fails the collectives still in flight on its own threads. DDP's process exits -2 there.
Rank 1 waits for rank 0's `atexit` marker (the last thing before finalization), then dies with
`os._exit`.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

FINALIZE_HOLD_S = 2.0


class _HoldsFinalization:
    def __del__(self) -> None:  # runs as the interpreter clears this module, finalizing
        time.sleep(FINALIZE_HOLD_S)


def main(rank: int, port: int, marker: str) -> None:
    import autobyte
    from autobyte.scheduler import process_exit

    process_exit.EXIT_BUDGET_S = 1.0  # the updates cannot land: rank 1 never joins
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    opt = autobyte.ScheduledOptimizer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), partition_bytes=4 << 10
    )
    model(torch.randn(16, 64)).sum().backward()  # one whole step on both ranks: the layout is fixed
    opt.step()
    opt.zero_grad()
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(FINALIZE_HOLD_S / 4)  # rank 0 is inside its finalization now
        os._exit(0)
    atexit.register(lambda: open(marker, "w").close())
    model(torch.randn(16, 64)).sum().backward()  # every all-reduce now waits on rank 1
    time.sleep(0.2)
    raise KeyboardInterrupt


_hold = _HoldsFinalization()

if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), os.path.join(sys.argv[3], "finalizing"))
