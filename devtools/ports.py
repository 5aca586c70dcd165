"""A free TCP port on the loopback interface, for a server a test or a benchmark starts.

The port is picked below the kernel's ephemeral range (net.ipv4.ip_local_port_range), where no
outgoing connection is ever given a local port: a port the kernel hands out (bind to port 0) can be
taken by another process's connection (gloo opens many) between the pick and the server's listen,
which failed a rank's rendezvous with EADDRINUSE in the exit stress runs.
"""

from __future__ import annotations

import random
import socket

_LOWEST = 10000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, outside the ephemeral range."""
    top = _ephemeral_start() - 1
    for _ in range(200):
        port = random.randint(_LOWEST, top) if top > _LOWEST else 0
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port below the ephemeral range on 127.0.0.1")
