"""An FSDP2 replica for the testbed's worker (benchmarks/testbed/train_worker.py): the emulated model's layers
grouped into blocks (a transformer's `h.N`), each block `fully_shard`ed and the root too, with
`autobyte.fsdp.attach` measuring it and setting FSDP2's knobs at segment boundaries.

Labels (the worker's configurations):

    fsdp             FSDP2 as `fully_shard` leaves it (implicit prefetch, resharding after forward,
                     its all-gathers holding the training thread, as gloo's do)
    fsdp:F,B,R       forward prefetch F groups, backward prefetch B, R = reshard | keep (the
                     gathered parameters kept after forward); `=` leaves a knob as FSDP2 set it;
                     all-gathers asynchronous, as `autobyte.fsdp.attach` sets them on CPU (so
                     `fsdp:=,=,=` is FSDP2's knobs with the all-gathers off the thread, as a GPU's
                     all-gather stream has them)
    fsdp:F,B,R,sync  the same knobs, the all-gathers issued as FSDP2 does (holding the thread)
    fsdp:daemon      autobyted's tuner sets the knobs (AUTOBYTE_DAEMON in the environment), from
                     where the job starts: as built, or with the worker's --fsdp-budget the
                     configuration attach derives from it
    agrs             the bound's communication probe: one all-gather and one reduce-scatter of
                     every group's parameters (FSDP2's least traffic a step: parameters kept after
                     forward), issued back to back, no compute
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autobyted.tuner.shard_schedule import block_of  # the simulator groups a profile the same way

RESHARD = {"reshard": True, "keep": False, "=": None}


def shard_config(spec: str) -> Any:
    """`F,B,R[,sync]` (the label's part after `fsdp:`) as an autobyte.fsdp.ShardConfig; ValueError
    naming it otherwise."""
    from autobyte.fsdp import ShardConfig

    parts = [p.strip() for p in spec.split(",")]
    if parts[3:] == ["sync"]:
        parts = parts[:3]
    if len(parts) != 3 or parts[2] not in RESHARD:
        raise ValueError(f"bad FSDP2 configuration {spec!r}: expected F,B,reshard|keep|=[,sync]")
    try:
        forward, backward = (None if p == "=" else int(p) for p in parts[:2])
    except ValueError:
        raise ValueError(f"bad FSDP2 configuration {spec!r}: F and B are ints or =") from None
    return ShardConfig(forward, backward, RESHARD[parts[2]])


class BlockedModel(nn.Module):
    """A model's layers (its `layers`, in forward order) with each transformer block's layers in
    one `nn.Sequential` (what FSDP2 shards as a group); the other layers stay the root's."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.device = getattr(model, "device", None)
        parts: list[nn.Module] = []
        current: str | None = None
        for layer in model.layers:
            block = block_of(getattr(layer, "profile_name", ""))
            if block is not None and block == current:
                parts[-1].append(layer)
            elif block is not None:
                parts.append(nn.Sequential(layer))
            else:
                parts.append(layer)
            current = block
        self.parts = nn.ModuleList(parts)

    @property
    def blocks(self) -> list[nn.Module]:
        return [p for p in self.parts if isinstance(p, nn.Sequential)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x


class ShardedReplica:
    """The FSDP2 replica of a worker: built on first use (collective: every rank runs the same
    segments), measured and steered by `autobyte.fsdp.attach` (under `memory_budget_bytes`, in
    the replica's own bytes, where given)."""

    def __init__(
        self, model: nn.Module, optimizer: Any, memory_budget_bytes: int | None = None
    ) -> None:
        import autobyte.fsdp as abf
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.model = BlockedModel(model)
        if not self.model.blocks:
            raise ValueError("FSDP2 rows need a model with transformer blocks (h.N layers)")
        # the groups' sizes before sharding: the probe's buffers
        self.group_elements = [
            sum(p.numel() for p in block.parameters()) for block in self.model.blocks
        ]
        root = {id(p) for b in self.model.blocks for p in b.parameters()}
        self.group_elements.append(
            sum(p.numel() for p in self.model.parameters() if id(p) not in root)
        )
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = optimizer(self.model.parameters())
        # with a budget, the job starts from the configuration derived from it (attach's
        # derived_config); a label's configuration replaces it at its segment
        self.job = abf.attach(self.model, self.optimizer, memory_budget_bytes=memory_budget_bytes)
        self.steps: list[Any] = []  # every step's autobyte.fsdp.ShardStep, as measured on this rank
        self.job.add_step_callback(self.steps.append)
        self._probe: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def use(self, spec: str) -> Any:
        """Rank 0 proposes the label's configuration (every rank applies it at one boundary a
        step or two later: the segment's warm-up); returns it. `daemon`: nothing is proposed.
        `fsdp` (spec "", FSDP2 as is) and `fsdp:F,B,R,sync` issue the all-gathers as FSDP2 does
        (on gloo they hold the training thread); every other label runs them asynchronously, as
        `attach` sets them on CPU (`ShardedJob.set_async_gathers`). Every rank calls it at the same point, between
        steps."""
        self.job.set_async_gathers(spec != "" and not spec.endswith(",sync"))
        if spec == "daemon":
            return None
        config = shard_config(spec) if spec else _defaults()
        if dist.get_rank() == 0:
            self.job.propose(config)
        return config

    def check(self, config: Any) -> None:
        """After the warm-up: the configuration is in effect on this rank."""
        if config is not None and self.job.config != config:
            raise RuntimeError(
                f"FSDP2 configuration {config.describe()} not in effect after the warm-up "
                f"(in effect: {self.job.config.describe()}): give more --warmup steps"
            )

    def step(self, inputs: Any, targets: Any, loss_fn: Any) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss_fn(self.model(inputs), targets).backward()
        self.optimizer.step()

    def probe(self) -> None:
        """One all-gather and one reduce-scatter of every group, back to back (async)."""
        world = dist.get_world_size()
        if self._probe is None:
            self._probe = []
            for elements in self.group_elements:
                shard = -(-elements // world)
                self._probe.append((torch.zeros(shard), torch.zeros(shard * world)))
        works = []
        for shard, full in self._probe:
            works.append(dist.all_gather_into_tensor(full, shard, async_op=True))
        for shard, full in self._probe:
            works.append(dist.reduce_scatter_tensor(shard, full, async_op=True))
        for work in works:
            work.wait()


def _defaults() -> Any:
    from autobyte.fsdp import ShardConfig

    return ShardConfig()
