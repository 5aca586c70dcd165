"""Facts about the benchmark host that runs and reports need: its load average, a free local port."""

from __future__ import annotations

import os

from devtools.ports import free_port  # noqa: F401  (the one copy; re-exported for the benchmarks)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as a report records them ("0.52 0.61 0.70")."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
