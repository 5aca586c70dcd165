"""Which of this rank's links queues: the kernel's TCP figures for the sockets that carry the job's
collectives, sampled off the training thread so a step only reads a tuple.

Why: on a ring (or any collective whose steps wait for every peer) one slow link slows every rank
alike, so every rank's step time and bandwidth estimate fall together and the daemon can say "a
bandwidth drop" but not where. The sockets can: data queued behind a slow link waits in that link's
queue, so the smoothed round-trip time of a socket that sends through it rises above the socket's
own minimum (`tcpi_rtt - tcpi_min_rtt`, the kernel's TCP_INFO), while sockets whose data crosses
only fast links keep near their minimum. A slow link on rank r's access path delays what r sends
and what its peers send to r, so the sockets of the slow pairs name r on both sides.

`LinkSampler.value` is this rank's worst socket over the last interval: (queueing delay in seconds,
the socket's local address, its peer's address), among the TCP sockets of this process that
carried at least MIN_BYTES in the interval (the collectives' sockets; the reporter's gRPC stream and
the rendezvous store carry far less). (0.0, "", "") means unknown: not Linux, no such socket yet,
or the first interval not over. Only addresses are reported (no ports): on a cluster the link is
the host's.

Cost: the sampler thread lists /proc/self/fd and asks the kernel for TCP_INFO on each socket once
per interval (a few µs a socket); the training thread never does.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import os
import socket
import struct
import threading
from typing import Any

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

MIN_BYTES = 256 << 10  # bytes a socket must have sent in an interval to count as the job's
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_INFO_LEN = 160  # through tcpi_min_rtt (offset 148), present since Linux 4.6
_RTT_AT, _BYTES_ACKED_AT, _MIN_RTT_AT = 68, 120, 148


def _plain(address: str) -> str:
    """An IPv4 address as IPv4 also where a dual-stack socket holds it IPv4-mapped (::ffff:a.b.c.d:
    a rank that listens on :: for the rendezvous store accepts its peers so)."""
    try:
        mapped = getattr(ipaddress.ip_address(address.split("%")[0]), "ipv4_mapped", None)
    except ValueError:
        return address
    return str(mapped) if mapped is not None else address


def _tcp_sockets() -> dict[tuple[str, str, int], tuple[float, float, int]]:
    """Every TCP socket of this process with its figures: (local, peer, local port) -> (smoothed
    RTT s, minimum RTT s, bytes acknowledged)."""
    out: dict[tuple[str, str, int], tuple[float, float, int]] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))
        except (OSError, ValueError):
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_LEN)
            if len(info) < _MIN_RTT_AT + 4:
                continue
            local, peer = sock.getsockname(), sock.getpeername()
            (rtt_us,) = struct.unpack_from("I", info, _RTT_AT)
            (acked,) = struct.unpack_from("Q", info, _BYTES_ACKED_AT)
            (min_rtt_us,) = struct.unpack_from("I", info, _MIN_RTT_AT)
            out[(_plain(local[0]), _plain(peer[0]), local[1])] = (
                rtt_us * 1e-6,
                min_rtt_us * 1e-6,
                acked,
            )
        except OSError:
            continue  # not connected (a listener), or gone meanwhile
        finally:
            sock.close()  # closes the duplicate only
    return out


def worst_link(
    before: dict[tuple[str, str, int], tuple[float, float, int]],
    after: dict[tuple[str, str, int], tuple[float, float, int]],
    min_bytes: int = MIN_BYTES,
) -> tuple[float, str, str]:
    """Among the sockets in both samples that sent at least `min_bytes` between them, the one whose
    smoothed RTT stands furthest above its minimum: (that queueing delay in s, local, peer)."""
    best = (0.0, "", "")
    for key, (rtt, min_rtt, acked) in after.items():
        prior = before.get(key)
        if prior is None or acked - prior[2] < min_bytes:
            continue
        delay = max(0.0, rtt - min_rtt)
        if not best[1] or delay > best[0]:
            best = (delay, key[0], key[1])
    return best


def own_address() -> str:
    """This process's address on the network its collectives use: the local address most of its
    connected TCP sockets have (gloo connects every pair of ranks when a group is made), a
    loopback one only when there is no other; "" when there are none."""
    local = collections.Counter(key[0] for key in _tcp_sockets())
    outside = [a for a, _ in local.most_common() if not ipaddress.ip_address(a).is_loopback]
    return outside[0] if outside else (local.most_common(1)[0][0] if local else "")


def _signed(value: int) -> int:
    return (value ^ (1 << 63)) - (1 << 63)


def rank_addresses(group: Any) -> dict[str, int]:
    """Each address of `group`'s ranks -> the lowest global rank with it (collective: every member
    calls it, in the same order as its other collectives on `group`; a gloo group). Ranks that
    share a host share its address: a link named by address is that host's."""
    import torch
    import torch.distributed as dist

    packed = [0, 0, 0]  # unknown: every rank must reach the all-gather whatever happens here
    try:
        mine = own_address()
        if mine:
            address = ipaddress.ip_address(mine)
            value = int(address)
            packed = [address.version, _signed(value >> 64), _signed(value & ((1 << 64) - 1))]
    except Exception:  # a figure for people; never a reason for one rank to miss the collective
        log.debug("this rank's address is unknown", exc_info=True)
    every = [torch.zeros(3, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, torch.tensor(packed, dtype=torch.int64), group=group)
    out: dict[str, int] = {}
    for rank, t in zip(dist.get_process_group_ranks(group), every):
        version, hi, lo = t.tolist()
        if version:
            value = ((hi & ((1 << 64) - 1)) << 64) | (lo & ((1 << 64) - 1))
            name = str(
                ipaddress.IPv4Address(value) if version == 4 else ipaddress.IPv6Address(value)
            )
            out.setdefault(name, rank)
            out[name] = min(out[name], rank)
    return out


class LinkSampler:
    """Samples `worst_link` every `interval_s` on a daemon thread (the module docstring)."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.value: tuple[float, str, str] = (0.0, "", "")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None or not os.path.isdir("/proc/self/fd"):
            return
        self._thread = threading.Thread(target=self._run, name="autobyte-links", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        before = _tcp_sockets()
        while not self._stop.wait(self.interval_s):
            try:
                after = _tcp_sockets()
                self.value = worst_link(before, after)
                before = after
            except Exception:
                log.debug("link sampling failed", exc_info=True)
