"""The scheduler's own communicators: a data group (same backend as the user's data-parallel group)
and a gloo decision group, over the same ranks.

The scheduler issues its collectives from a background thread. On a communicator the user also uses
(`all_reduce(loss)` for logging, `barrier()` before a checkpoint, `all_gather` in evaluation,
SyncBatchNorm, another DDP model) the ranks would interleave them in different orders: a size
mismatch, a hang, or silently swapped data. Groups of their own make that impossible by construction.

Only the members of the data-parallel group create its groups (`use_local_synchronization`), so data-
parallel subgroups of a larger job (e.g. 4 ranks as 2 groups of 2) never call `new_group` with
different rank lists on different ranks. Every member must construct its ScheduledOptimizers in the
same order, as with any collective. The groups live as long as the process: destroying one would free
its name for the next group over the same ranks, whose rendezvous would then find the old one's
addresses in the store.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)


def member_ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def new_member_group(group: Any, backend: str | None, timeout_s: float) -> Any:
    """A new group over `group`'s ranks, created by its members only."""
    ranks = member_ranks(group)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        return dist.new_group(
            ranks, backend=backend, timeout=timeout, use_local_synchronization=True
        )
    except NotImplementedError:
        # A torch.distributed configuration that cannot create groups locally (TorchComms): every
        # rank of the world must take part, which is only possible for the whole world.
        if len(ranks) != dist.get_world_size():
            raise ValueError(
                "this torch.distributed configuration cannot create a communicator for a "
                "data-parallel subgroup from its members only; use the default group, or "
                "pass own_communicator=False (then nothing else may use process_group "
                "while training)"
            ) from None
        return dist.new_group(ranks, backend=backend, timeout=timeout)


def backend_of(group: Any) -> str | None:
    try:
        return str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - a group object the backend lookup does not know: use the default
        return None


def place_in(group: Any) -> tuple[int, int, int]:
    """(this process's rank in `group`, the group's size, the job-wide rank of the group's rank 0);
    None or the default group: the default group, led by rank 0."""
    leader = 0 if group is None or group is dist.group.WORLD else dist.get_global_rank(group, 0)
    return dist.get_rank(group), dist.get_world_size(group), leader


@dataclasses.dataclass(frozen=True)
class CommGroups:
    """This rank's place in its data-parallel group and the communicators the scheduler uses, fixed
    at construction."""

    pg: Any  # the data-parallel group the user gave (the default group for None)
    rank: int  # this process's rank in it
    world: int  # its size
    leader_global: int  # the job-wide rank of its rank 0
    data: Any  # the dispatch thread's collectives (a group of its own unless told otherwise)
    buffers: Any  # the training thread's buffer broadcasts, in program order (DDP's: pg)
    decision: Any = None  # gloo: the leader's word, the health watchdog (None on one rank)
    follower_globals: tuple[int, ...] = ()  # the job-wide ranks of every member but rank 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def placed(process_group: Any) -> CommGroups:
    """Where this process stands in `process_group` (None: the default group); no communicator of
    the scheduler's own yet (`with_communicators`)."""
    pg = process_group if process_group is not None else dist.group.WORLD
    if process_group is not None and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "this rank is not a member of process_group: construct the "
            "ScheduledOptimizer only on the ranks of its data-parallel group"
        )
    rank, world, leader = place_in(pg)
    return CommGroups(pg, rank, world, leader, data=pg, buffers=pg)


def with_communicators(
    place: CommGroups, own_communicator: bool, separate_buffers: bool, timeout_s: float
) -> CommGroups:
    """`place` with the scheduler's communicators, created in this order by every member: the data
    group (`own_communicator`), else a buffer group when `separate_buffers` (the user's group then
    carries the dispatch thread's collectives, not the training thread's), then the decision group."""
    if place.world == 1:
        return place
    data, buffers = place.pg, place.pg
    if own_communicator:
        data = new_member_group(place.pg, backend_of(place.pg), timeout_s)
    elif separate_buffers:
        buffers = new_member_group(place.pg, backend_of(place.pg), timeout_s)
    decision = new_member_group(place.pg, "gloo", timeout_s)
    followers = tuple(r for r in member_ranks(place.pg) if r != place.leader_global)
    return dataclasses.replace(
        place, data=data, buffers=buffers, decision=decision, follower_globals=followers
    )
