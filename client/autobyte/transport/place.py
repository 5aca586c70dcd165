"""Where a rank sits in its job: the identity it registers with and its data-parallel group."""

from __future__ import annotations

from typing import NamedTuple


class RankPlace(NamedTuple):
    """Where a process sits: its job-wide rank (identity) and its place in its data-parallel group."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    dp_leader: int
