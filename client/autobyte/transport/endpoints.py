"""The daemons a rank may stream to (any of several sharing one database), the one in use, and a
channel to each, opened once: fail-over moves to the next address of the list."""

from __future__ import annotations

import logging
import threading

import grpc

from autobyte.channel import daemon_addresses, open_channel

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())


class DaemonEndpoints:
    """addresses[current] is the daemon in use; only the send loop moves it (never the training thread)."""

    def __init__(self, address: str, tls_ca: str | None) -> None:
        self.addresses = daemon_addresses(address)
        self._current = 0
        self._tls_ca = tls_ca
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self.failovers = 0  # moves to another address after a failure

    def start_at(self, rank: int) -> None:
        """Ranks spread over the daemons: rank r starts at address r modulo their number."""
        self._current = rank % len(self.addresses)

    @property
    def address(self) -> str:
        """The daemon in use now."""
        return self.addresses[self._current]

    def channel(self) -> grpc.Channel:
        """The channel to the daemon in use (opened once per address, closed by close())."""
        address = self.address
        with self._lock:
            if address not in self._channels:
                self._channels[address] = open_channel(address, self._tls_ca)
            return self._channels[address]

    def fail_over(self, why: str) -> bool:
        """Move to the next daemon of the list; False when there is only one."""
        if len(self.addresses) == 1:
            return False
        previous = self.address
        self._current = (self._current + 1) % len(self.addresses)
        self.failovers += 1
        log.debug("autobyted at %s failed (%s); moving to %s", previous, why, self.address)
        return True

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()


def release_call(error: grpc.RpcError) -> None:
    """Drop the traceback of a streaming call's error. gRPC raises the call object itself, and its
    traceback holds gRPC's frame whose `self` is that call: a cycle only the cyclic collector
    frees, possibly during interpreter shutdown, where the call's `__del__` waits forever on a lock
    that a daemon thread stopped by the shutdown may hold (a rank that never exits). Without the
    traceback the call is freed on the thread that handled it, while every thread still runs."""
    error.__traceback__ = None
