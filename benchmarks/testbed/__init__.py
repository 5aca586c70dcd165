"""Network-namespace testbed: one namespace per rank, joined by shaped veth links, real ranks.

Where things are (the package docstring of `bed` has the topology and the usage):

    bed.py         Testbed: namespaces, shaped links, rates, CPU-share cgroups, busy loops, flows
    rates.py       '1gbit' <-> bits/s, tc sizes
    traces.py      Trace and its timed changes (rate, cpu share, busy, flows)
    runner.py      what a run collects (RunResult) and the threads that collect it
    namespaces.py  naming, listing and stale-run cleanup of namespaces (TestbedError)
    lifecycle.py   cleanup of live testbeds on exit and on SIGTERM/SIGHUP
    cli.py         python -m benchmarks.testbed [--list | --cleanup-stale]
"""

from benchmarks.testbed.bed import (
    BRIDGE_IFNAME,
    DEFAULT_BURST_BYTES,
    DEFAULT_LATENCY_MS,
    DEFAULT_MASTER_PORT,
    RANK_IFNAME,
    TRAFFIC_HOST,
    TRAFFIC_HUB_IFNAME,
    TRAFFIC_PORT,
    Testbed,
    burst_for,
)
from benchmarks.testbed.cli import main
from benchmarks.testbed.namespaces import NAME_PREFIX, TestbedError, cleanup_stale, list_namespaces
from benchmarks.testbed.rates import format_rate, parse_rate, parse_size
from benchmarks.testbed.runner import RankResult, RunResult
from benchmarks.testbed.traces import (
    FLOW_DIRECTIONS,
    BusyChange,
    Change,
    CpuShareChange,
    FlowChange,
    RateChange,
    Trace,
)

__all__ = [
    "BRIDGE_IFNAME",
    "DEFAULT_BURST_BYTES",
    "DEFAULT_LATENCY_MS",
    "DEFAULT_MASTER_PORT",
    "FLOW_DIRECTIONS",
    "NAME_PREFIX",
    "RANK_IFNAME",
    "TRAFFIC_HOST",
    "TRAFFIC_HUB_IFNAME",
    "TRAFFIC_PORT",
    "BusyChange",
    "Change",
    "CpuShareChange",
    "FlowChange",
    "RankResult",
    "RateChange",
    "RunResult",
    "Testbed",
    "TestbedError",
    "Trace",
    "burst_for",
    "cleanup_stale",
    "format_rate",
    "list_namespaces",
    "main",
    "parse_rate",
    "parse_size",
]
