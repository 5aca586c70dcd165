"""A straggler link named: each rank's most queued socket (autobyte/tcplinks.py, read from the kernel
on real sockets here), merged per step over the ranks (autobyted/tuner/ranks.py) and named by the
rank the slow pairs share (autobyted/tuner/stragglers.py). The testbed's own run of it: tests/
test_testbed.py's straggler test."""

from __future__ import annotations

import socket
import threading

from autobyte.tcplinks import _tcp_sockets, own_address, worst_link
from autobyte.types import StepMetrics

from autobyted.tuner.ranks import merge_ranks
from autobyted.tuner.stragglers import name_link


def _ranks(step: int, queue_s: dict[int, tuple[float, int]]) -> StepMetrics:
    """One step of a job whose ranks report (queue, peer rank) each, merged as the daemon does."""
    samples = {
        rank: StepMetrics(
            step=step,
            wall_time_s=1.7e9 + step,
            step_time_s=3.5,
            link_queue_s=q,
            link_peer=peer + 1,
        )
        for rank, (q, peer) in queue_s.items()
    }
    leader = samples.pop(0)
    return merge_ranks(leader, samples)


def _ring(world: int, slow: int, queue_s: float = 0.045, idle_s: float = 3e-4):
    """A ring all-reduce's sockets (rank r sends to r + 1) with rank `slow`'s access link slow: the
    pairs whose data crosses it (slow -> slow+1, slow-1 -> slow) queue."""
    out = {}
    for rank in range(world):
        peer = (rank + 1) % world
        out[rank] = (queue_s if slow in (rank, peer) else idle_s, peer)
    return out


def test_the_rank_whose_link_both_slow_pairs_cross_is_named():
    for world, slow in ((8, 1), (4, 3), (8, 0)):
        steps = [_ranks(s, _ring(world, slow)) for s in range(5)]
        assert name_link(steps).startswith(f"rank {slow}'s link (45 ms of queueing"), (world, slow)


def test_nothing_is_named_when_every_link_queues_alike_or_no_rank_sent_figures():
    even = {r: (0.02, (r + 1) % 8) for r in range(8)}
    assert name_link([_ranks(s, even) for s in range(5)]) == ""
    quiet = {r: (3e-4 if r != 2 else 1.5e-3, (r + 1) % 8) for r in range(8)}
    assert name_link([_ranks(s, quiet) for s in range(5)]) == ""  # under MIN_QUEUE_S: not a queue
    bare = [
        merge_ranks(StepMetrics(step=s, wall_time_s=1.7e9, step_time_s=1.0), []) for s in range(5)
    ]
    assert name_link(bare) == ""


def test_one_slow_pair_names_the_path_and_two_ranks_name_nothing():
    """A single queued pair (one direction of one path) names that path. Every path between two
    ranks crosses both access links, and there is no quiet pair to compare with: nothing named."""
    one = {0: (3e-4, 1), 1: (3e-4, 2), 2: (0.03, 3), 3: (3e-4, 0)}
    assert name_link([_ranks(s, one) for s in range(5)]).startswith(
        "the path between rank 2 and rank 3 (30 ms of queueing, the other ranks' at most 0.3 ms)"
    )
    two = {0: (0.04, 1), 1: (3e-4, 0)}
    assert name_link([_ranks(s, two) for s in range(5)]) == ""


def test_half_the_pairs_slow_at_four_ranks_still_names_the_straggler():
    """At 4 ranks the straggler's two pairs are half of them (the testbed's figures: 0.2 and 2.9
    ms on the quiet pairs, 54 and 69 ms on the slow ones)."""
    four = {0: (2e-4, 3), 1: (0.054, 0), 2: (0.069, 1), 3: (2.9e-3, 2)}
    assert name_link([_ranks(s, four) for s in range(5)]) == (
        "rank 1's link (69 ms of queueing, the other ranks' at most 2.9 ms)"
    )


def test_one_slow_step_does_not_name_a_link():
    steps = [_ranks(s, _ring(8, 1, queue_s=0.045 if s == 2 else 3e-4)) for s in range(5)]
    assert name_link(steps) == ""


def test_the_kernel_figures_of_a_real_socket_that_sent_data():
    """`_tcp_sockets` finds this process's connected TCP sockets with their smoothed and minimum
    RTT and bytes acknowledged; `worst_link` counts only a socket that sent MIN_BYTES since the
    sample before, and names its local and peer addresses."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()

    def receive(want: int = 2 << 20) -> None:
        while want > 0:
            want -= len(accepted.recv(1 << 20)) or want

    received = threading.Thread(target=receive)
    received.start()
    try:
        before = _tcp_sockets()
        key = ("127.0.0.1", "127.0.0.1", client.getsockname()[1])
        assert key in before, before
        client.sendall(b"x" * (2 << 20))
        received.join(10)
        after = _tcp_sockets()
        rtt, min_rtt, acked = after[key]
        assert acked - before[key][2] >= 2 << 20 and 0 < min_rtt <= rtt < 1.0
        delay, local, peer = worst_link(before, after)
        assert (local, peer) == ("127.0.0.1", "127.0.0.1") and 0 <= delay < 1.0
        assert worst_link(after, after) == (0.0, "", "")  # nothing sent between the two samples
        assert own_address() == "127.0.0.1"  # loopback only where there is nothing else
    finally:
        for s in (client, accepted, server):
            s.close()


def test_the_label_names_a_drop_on_the_link_and_nothing_else():
    from autobyted.tuner.stragglers import where

    steps = [_ranks(s, _ring(8, 1, queue_s=0.010, idle_s=1.1e-3)) for s in range(5)]
    assert where("bandwidth", -1, steps) == (
        " on rank 1's link (10 ms of queueing, the other ranks' at most 1.1 ms)"
    )
    assert where("bandwidth", 1, steps) == "" and where("host_load", -1, steps) == ""
