"""Which rank's link is the straggler, from each rank's most queued socket (autobyte/tcplinks.py).

A collective that waits for every peer runs at its slowest link on every rank, so a slow link
shows on every rank alike as a bandwidth drop (autobyted/tuner/ranks.py). Each rank also sends its
most queued collective socket: how far its smoothed round-trip time stood above its minimum
(`link_queue_s`), and the rank at its far end (`link_peer`, 1 + rank). Data waits in the queue of
the slow link it crosses, so the sockets whose data crosses rank r's slow access link are those r
sends on and those its peers send to r: the slow pairs share r. Here:

- per rank, the median queueing delay over the steps given, and the peer it named most often;
- the ranks sorted by that delay, the slow ones are those above the widest gap between two
  neighbours in that order, where the gap is at least SLOW_FACTOR (a delay under MIN_QUEUE_S counts
  as MIN_QUEUE_S: below it a socket's RTT is jitter, not a queue). Not a fraction of the ranks: a
  straggler slows 2 of a ring's N pairs, half of them at 4 ranks. Every link of a job that
  saturates all of them queues alike (9-20 ms each at 4 ranks on the testbed): no gap, nothing
  named;
- the rank in the most slow pairs is named when it is in more of them than any other; a single
  slow pair names the path. Two ranks name nothing: both of their pairs cross both links, and
  there is no quiet pair to compare with.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Sequence

from autobyte.types import StepMetrics

SLOW_FACTOR = 3.0
LINK_STEPS = 5  # the latest steps a link is named from where no fresher ones are given
MIN_QUEUE_S = 2e-3  # a few ms: a queue, not the jitter of an idle path's RTT (tens of µs)


def name_link(steps: Sequence[StepMetrics]) -> str:
    """ "rank 1's link (48 ms of queueing, the other ranks' at most 4.9 ms)", "the path between
    rank 2 and rank 3 (...)", or "" when no link stands out (or fewer than 3 ranks sent link
    figures)."""
    delays: dict[int, list[float]] = collections.defaultdict(list)
    peers: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for step in steps:
        for rank, queue_s, peer in getattr(step, "rank_links", ()):
            delays[rank].append(queue_s)
            peers[rank][peer - 1] += 1
    if len(delays) < 3:
        return ""
    typical = {rank: statistics.median(values) for rank, values in delays.items()}
    ordered = sorted(typical, key=typical.get)
    floor = [max(MIN_QUEUE_S, typical[rank]) for rank in ordered]
    ratio, cut = max((floor[i + 1] / floor[i], i + 1) for i in range(len(ordered) - 1))
    if ratio < SLOW_FACTOR:
        return ""
    slow = [(rank, peers[rank].most_common(1)[0][0]) for rank in ordered[cut:]]
    worst = typical[ordered[-1]]
    figures = (
        f"{worst * 1e3:.0f} ms of queueing, the other ranks' at most "
        f"{typical[ordered[cut - 1]] * 1e3:.1f} ms"
    )
    counts = collections.Counter(end for pair in slow for end in pair)
    (first, n), *others = counts.most_common()
    if n > 1 and (not others or others[0][1] < n):
        return f"rank {first}'s link ({figures})"
    if len(slow) == 1:
        a, b = sorted(counts)
        return f"the path between rank {a} and rank {b} ({figures})"
    return ""


def where(signal: str, direction: int, steps: Sequence[StepMetrics]) -> str:
    """The words a bandwidth drop's label gains where `steps` name its link, " on rank 1's link
    (10 ms of queueing, the other ranks' at most 1.1 ms)"; else ""."""
    if signal != "bandwidth" or direction >= 0:
        return ""
    named = name_link(steps)
    return f" on {named}" if named else ""
