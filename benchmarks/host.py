"""Facts about the benchmark host that runs and reports need: its load average, a free local port."""

from __future__ import annotations

import os
import socket


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as a report records them ("0.52 0.61 0.70")."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
