"""The MLP job the tests and benchmarks run under torchrun: sizes, configuration and step count from
the command line, and what the client's transport did (flushed, acknowledged, dropped) written as
JSON for the caller to check. A user's script looks like examples/train_mlp.py instead.

    torchrun --nproc-per-node 2 devtools/mlp_job.py --steps 200 --out /tmp/job-{rank}.json
    # AUTOBYTE_DAEMON / AUTOBYTE_JOB select the daemon and the job id; --offline disables streaming.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import autobyte
import torch
import torch.distributed as dist
from autobyte.types import parse_bytes


def build_model(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(256, width), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--partition", default="4MiB")
    parser.add_argument("--credit", default="16MiB")
    parser.add_argument(
        "--step-sleep-s", type=float, default=0.0, help="extra work per step (simulated compute)"
    )
    parser.add_argument("--offline", action="store_true", help="do not stream to autobyted")
    parser.add_argument(
        "--out", help="write per-step timings of this rank as JSON here (a {rank} is filled in)"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    reporter = None if args.offline else autobyte.init()
    model = build_model(args.width, args.depth)
    optimizer = autobyte.ScheduledOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        partition_bytes=parse_bytes(args.partition),
        credit_bytes=parse_bytes(args.credit),
    )
    generator = torch.Generator().manual_seed(rank)
    step_ends = []
    for _ in range(args.steps):
        x = torch.randn(args.batch, 256, generator=generator)
        y = torch.randint(0, 10, (args.batch,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if args.step_sleep_s:
            time.sleep(args.step_sleep_s)
        optimizer.step()
        optimizer.zero_grad()
        step_ends.append(time.monotonic())
    optimizer.synchronize()
    reporter_state = {}
    if reporter is not None:
        flushed = reporter.flush(float(os.environ.get("AUTOBYTE_FLUSH_TIMEOUT_S", "10")))
        reporter_state = {
            "flushed": flushed,
            "acked_seq": reporter.acked_seq,
            "dropped": reporter.dropped_total,
            "buffered": reporter.buffered,
            "telemetry_cpu_s": reporter.background_cpu_s,
            "daemon": reporter.address,
            "failovers": reporter.failovers,
        }
        autobyte.shutdown()
    if args.out:
        with open(args.out.format(rank=rank), "w") as handle:
            json.dump(
                {
                    "rank": rank,
                    "step_ends": step_ends,
                    "config": optimizer.config.to_dict(),
                    **reporter_state,
                },
                handle,
            )
    optimizer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
