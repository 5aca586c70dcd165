"""Every rank's samples of a step merged into the one job-level sample the tuner reads.

Rank 0 alone misreads two of the three changes a job meets on a real cluster:

- a rank slowed down (a CPU quota, a busy neighbour on its host) shows on rank 0 as a longer step
  and a *lower bandwidth estimate* (rank 0's collectives wait for the slow peer, which stretches
  its communication span), while rank 0's own compute does not move: rank 0 alone reads a
  straggler as a bandwidth drop;
- a bandwidth drop shows on every rank.

So the job's sample for a step is rank 0's (step time, configuration, decision: the step
boundary is rank 0's) with the *straggler's* compute (the rank with the largest forward_s +
backward_s: the slowest rank sets the pace) and the *best* bandwidth estimate of any rank (a rank
that does not wait for a peer measures the link; a true bandwidth drop lowers every rank's
estimate, so the best one drops too; a straggler lowers only the others'). host_load is the
largest over the ranks (the busiest host is the one that slows the job). Every rank's own compute
is kept too (`JobStep.rank_compute_s`): the drift test watches each rank's compute, not only the
straggler's, because the per-step max takes the swings of whichever rank is noisiest (a CPU quota
on rank 1 barely moves it while rank 0's compute swings 75-220 ms under a neighbour's load). A job
with one rank, or a sample whose peers never arrive, passes through unchanged.

`RankMerger` buffers samples until every rank that streams (that has sent a sample) is in for a
step, or rank 0 is `max_lag_steps` or `max_lag_s` of its own wall time ahead of it, whichever comes
first: a rank whose stream is late or gone never stalls the tuner; its step is merged from the
ranks that are in. Both bounds matter: 64 steps are 2 s of 30 ms steps but 4 minutes of 4 s steps,
longer than a search (a rank whose stream stalled behind a congested link held a 4-rank job's
trial open for the rest of a 240 s run); 10 s are 330 steps of 30 ms. A rank given up on at a step
is not waited for again until it sends a sample, so a rank that is gone costs one wait, not one a
step; a rank that has already sent a later step is not waited for at an earlier one (its sample of
that step was dropped: streams arrive in step order). A job whose other ranks never stream is read
from rank 0 alone, at once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from autobyte.types import StepMetrics

MAX_LAG_STEPS = (
    64  # ~2 s of 30 ms steps; the client sends every second, so a live rank is in by then
)
MAX_LAG_S = 10.0  # ten of the client's send intervals (autobyte/transport/reporter.py: 1 s)


@dataclasses.dataclass(frozen=True)
class JobStep(StepMetrics):
    """One step of a job with several ranks streaming: rank 0's sample merged with its peers'
    (module docstring), plus each rank's own compute, forward_s + backward_s, as (rank, seconds)
    in rank order (the ranks whose sample of this step is in)."""

    rank_compute_s: tuple[tuple[int, float], ...] = ()
    # each rank's most queued link (autobyte/tcplinks.py) as (rank, link_queue_s, link_peer), the
    # ranks that measured one: where a straggler link is (autobyted/tuner/stragglers.py)
    rank_links: tuple[tuple[int, float, int], ...] = ()


def merge_ranks(
    leader: StepMetrics, peers: Sequence[StepMetrics] | Mapping[int, StepMetrics]
) -> StepMetrics:
    """The job-level sample of one step (see the module docstring); `peers` excludes rank 0: a
    mapping rank -> sample, or the samples of ranks 1, 2, ... in order."""
    by_rank = dict(peers) if isinstance(peers, Mapping) else dict(enumerate(peers, start=1))
    if not by_rank:
        return leader
    everyone = (leader, *by_rank.values())
    straggler = max(everyone, key=lambda m: m.forward_s + m.backward_s)
    ranks = {0: leader, **by_rank}
    fields = {field.name: getattr(leader, field.name) for field in dataclasses.fields(StepMetrics)}
    fields.update(
        forward_s=straggler.forward_s,
        backward_s=straggler.backward_s,
        bandwidth_bytes_per_s=max(m.bandwidth_bytes_per_s for m in everyone),
        host_load=max(m.host_load for m in everyone),
    )
    return JobStep(
        **fields,
        rank_compute_s=tuple((r, ranks[r].forward_s + ranks[r].backward_s) for r in sorted(ranks)),
        rank_links=tuple(
            (r, ranks[r].link_queue_s, ranks[r].link_peer)
            for r in sorted(ranks)
            if ranks[r].link_peer > 0
        ),
    )


class RankMerger:
    """Feed (rank, sample) in any order; `pop_ready` returns merged samples in step order."""

    def __init__(
        self, world_size: int, max_lag_steps: int = MAX_LAG_STEPS, max_lag_s: float = MAX_LAG_S
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        self.world_size, self.max_lag_steps, self.max_lag_s = world_size, max_lag_steps, max_lag_s
        self._leader: dict[int, StepMetrics] = {}
        self._peers: dict[int, dict[int, StepMetrics]] = {}
        self._newest_leader_step = -1
        self._newest_leader_wall_s = -math.inf
        # The ranks other than 0 waited for (they have sent a sample since they were last given
        # up on), each with the newest step it sent.
        self._streaming: dict[int, int] = {}

    def add(self, rank: int, sample: StepMetrics) -> None:
        if rank == 0:
            self._leader[sample.step] = sample
            self._newest_leader_step = max(self._newest_leader_step, sample.step)
            self._newest_leader_wall_s = max(self._newest_leader_wall_s, sample.wall_time_s)
        elif 0 < rank < self.world_size:
            self._streaming[rank] = max(self._streaming.get(rank, -1), sample.step)
            self._peers.setdefault(sample.step, {})[rank] = sample
            if len(self._peers) > 4 * self.max_lag_steps:  # rank 0 silent: bounded memory
                del self._peers[min(self._peers)]

    def pop_ready(self) -> list[StepMetrics]:
        out = []
        for step in sorted(self._leader):
            peers = self._peers.get(step, {})
            missing = [
                r for r, newest in self._streaming.items() if r not in peers and newest < step
            ]
            if missing:
                if (
                    step > self._newest_leader_step - self.max_lag_steps
                    and self._newest_leader_wall_s - self._leader[step].wall_time_s < self.max_lag_s
                ):
                    break  # wait for the peers of this step (and keep the order)
                for rank in missing:  # late or gone: waited for again once it sends
                    del self._streaming[rank]
            out.append(merge_ranks(self._leader.pop(step), {r: peers[r] for r in sorted(peers)}))
            self._peers.pop(step, None)
        if out:  # peers of steps rank 0 has passed (its own sample was dropped or resent) go too
            done = out[-1].step
            for step in [s for s in self._peers if s <= done]:
                del self._peers[step]
        return out

    @property
    def buffered(self) -> int:
        return len(self._leader) + sum(len(p) for p in self._peers.values())
