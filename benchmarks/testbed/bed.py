"""Network-namespace testbed: one namespace per rank, joined by shaped veth links, real ranks.

Topology (a star, so that every rank has its own access link and N is free)::

    <prefix>-r0 [ab0 10.x.y.1] ==veth== [r0]\
    <prefix>-r1 [ab0 10.x.y.2] ==veth== [r1]-- br0  (bridge inside <prefix>-hub)
    ...                                     /

Every veth end is created directly inside a namespace this module made (``ip -n NS link add
... peer ... netns HUB``), so nothing is ever added to, or removed from, the root namespace. Each
link is shaped in both directions with ``tbf`` (the rank's egress on ``ab0`` and the hub's egress
towards the rank), so a rank's link is full duplex at the configured rate. Rates change with ``tc
qdisc change`` keeping the burst fixed: lowering tbf's burst while traffic flows froze the link for
good on this kernel, and there is no netem here.

Besides the rate, a trace (or a direct call) sets *conditions* on ranks (`benchmarks.testbed.conditions`):

- ``set_cpu_share(0.5, ranks=[1])``: a cgroup CPU quota on rank 1's process (every thread of it):
  a busy worker node, confined to that rank;
- ``set_busy(1, ranks=[1])``: busy-loop processes started inside rank 1's namespace (a namespace
  does not partition CPU: on this 2-core machine they take CPU from every rank, see docs/benchmarks.md);
- ``set_flows(2, ranks=[1], direction="both")``: competing TCP flows through rank 1's shaped link,
  to and from a traffic namespace ``<prefix>-tx`` on an unshaped port of the hub (created on first
  use), so the flows share the rank's tbf rate and queue with its all-reduces;
- ``set_rate(rate, ranks=[1])``: a straggler link.

Everything is named ``abtb-<pid>-<seq><random>-...`` so concurrent runs never collide and cleanup
only touches what this run made. Cleanup runs on ``close()``/context exit, from an ``atexit`` hook,
and on SIGTERM/SIGHUP (the handler closes all live testbeds, then chains to the previous handler
or exits); it stops condition processes, removes the cgroups, then the namespaces. A run killed
with SIGKILL leaves its namespaces and cgroups behind; ``python -m benchmarks.testbed
--cleanup-stale`` removes those whose owning pid no longer exists. Conditions a trace applies during
`run()` are undone when the run ends (rates stay, as before: they are the testbed's state).

Usage::

    with Testbed(world_size=2, rate="1gbit") as bed:
        result = bed.run(worker_cli.command(configs=["ddp", "sched:4MiB,16MiB"], steps=20),
                         trace=Trace.from_times([(0, "1gbit"), (20, "200mbit")]))
    result.ranks[0].results   # JSON objects the rank printed with {"event": "result", ...}

The worker contract: a rank prints JSON objects, one per line, on stdout.
``{"event": "train_start"}`` sets the origin of a time-based trace (before it, time counts from the
launch); ``{"event": "step", "step": n}`` from rank 0 drives a step-based trace. Everything else is
collected as is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Self

from benchmarks.testbed import conditions
from benchmarks.testbed.conditions import ConditionError, ConditionProcess, CpuCgroups, kill_group
from benchmarks.testbed.lifecycle import _SEQ, _register, _unregister
from benchmarks.testbed.namespaces import (
    NAME_PREFIX,
    TestbedError,
    _kill_namespace_pids,
    _run_cmd,
    list_namespaces,
)
from benchmarks.testbed.rates import format_rate, parse_rate, parse_size
from benchmarks.testbed.runner import RunResult, _LinkMonitor, _RankCollector, _TraceFollower
from benchmarks.testbed.traces import FLOW_DIRECTIONS, CpuShareChange, FlowChange, Trace

logger = logging.getLogger(__name__)

RANK_IFNAME = "ab0"  # the rank's interface inside its namespace (GLOO_SOCKET_IFNAME)
BRIDGE_IFNAME = "br0"
# Last octets of the two addresses beside the ranks' (.1 to .200): the traffic namespace (competing
# flows' far end) and the hub's bridge (a service such as autobyted, start_in_hub). Two, not one: a
# traffic namespace started mid-run with the hub's address took over the hub's address on the
# links it answered first, and a rank's stream to autobyted was refused until the run ended.
TRAFFIC_HOST = 254
HUB_HOST = 253
TRAFFIC_PORT = 5201
TRAFFIC_HUB_IFNAME = "traffic"  # ("tx" would read as ip's txqueuelen keyword)
# The bridge's MAC address, set once: a Linux bridge otherwise takes the lowest MAC of its ports, so
# the traffic namespace's port (added mid-run, random MAC) changed it in about one run of three,
# and a rank that had resolved the hub's address before sent to a MAC nobody held until its ARP
# entry expired (connections to the hub timed out for tens of seconds).
BRIDGE_MAC = "02:ab:00:00:00:01"  # locally administered; each bed's bridge is in its own namespace
DEFAULT_BURST_BYTES = 512 << 10  # ≥ rate/HZ up to a few gbit; kept fixed across rate changes
# The burst of an emulated run's links (`burst_for`). tbf lets `burst` bytes through at the veth's
# own speed whenever its bucket is full, and the bucket refills at the rate during every idle gap:
# a burst is bandwidth the rate does not count. DEFAULT_BURST_BYTES is 4 ms of a 1 Gbit/s link, but
# 69 ms of an emulated run's 59 Mbit/s, and a scaled collective is small (an FSDP2 block's
# all-gather on GPT-2 medium / 128 moves 197 KB a rank): measured at 2 ranks, 59 Mbit/s, the block
# all-gathers of forward took 7.5 ms with it (their wire time is 26.6 ms) and 25 ms with 64 KiB
# (docs/emulated.md, "The links' burst"). The floor: the kernel ticks at 250 Hz, and tc-tbf(8) asks
# for a burst of at least rate/HZ; below one 64 KiB GSO packet the link lost its rate (16 KiB
# moved a back-to-back all-gather + reduce-scatter probe at 0.87x of 64 KiB's speed).
KERNEL_HZ = 250  # this kernel's CONFIG_HZ
MIN_BURST_BYTES = 64 << 10


def burst_for(rate_bps: int) -> int:
    """The smallest tbf burst that keeps `rate_bps` (bits/s; a run whose rate changes: its
    highest): one kernel tick of it, at least MIN_BURST_BYTES."""
    if rate_bps <= 0:
        raise ValueError(f"rate_bps must be positive, got {rate_bps}")
    return max(MIN_BURST_BYTES, -(-int(rate_bps) // (8 * KERNEL_HZ)))


DEFAULT_LATENCY_MS = 50
DEFAULT_MASTER_PORT = 29500


@dataclasses.dataclass
class _Link:
    rank: int
    rank_ns: str
    hub_ifname: str


class Testbed:
    """N namespaces on a shaped star. The constructor starts nothing; `create()`/`with` does."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        world_size: int = 2,
        rate: str | int = "1gbit",
        *,
        burst: str | int = DEFAULT_BURST_BYTES,
        latency_ms: int = DEFAULT_LATENCY_MS,
        subnet: str = "10.217.0",
        name: str | None = None,
        pin_cpus: Sequence[int] | None = None,
    ) -> None:
        if os.geteuid() != 0:
            raise TestbedError("the testbed needs root (ip netns, tc); run as root")
        if not 1 <= world_size <= 200:
            raise ValueError(f"world_size={world_size} must be in [1, 200]")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(
                f"subnet must be the first three octets of a /24, e.g. '10.217.0', got {subnet!r}"
            )
        self.world_size = world_size
        # Rank r's processes (and the busy loops and traffic sources of its conditions) run on CPU
        # pin_cpus[r % len(pin_cpus)]: one "node" per core, so a busy loop beside rank 1 shares
        # rank 1's core only. None: not pinned (the kernel spreads everything over all cores).
        if pin_cpus is not None:
            available = os.sched_getaffinity(0)
            if not pin_cpus or any(cpu not in available for cpu in pin_cpus):
                raise ValueError(f"pin_cpus={list(pin_cpus)} must be CPUs of {sorted(available)}")
        self.pin_cpus = list(pin_cpus) if pin_cpus is not None else None
        self.burst_bytes = parse_size(burst)
        self.latency_ms = int(latency_ms)
        self.subnet = subnet
        self.name = name or f"{NAME_PREFIX}-{os.getpid()}-{next(_SEQ)}{secrets.token_hex(2)}"
        self.hub_ns = f"{self.name}-hub"
        self.links = [_Link(r, f"{self.name}-r{r}", f"r{r}") for r in range(world_size)]
        self._initial_rate_bps = parse_rate(rate)
        self.rates_bps: list[int] = [self._initial_rate_bps] * world_size
        # Conditions in force per rank (see set_cpu_share, set_busy, set_flows).
        self.cpu_shares: list[float | None] = [None] * world_size
        self.busy: list[int] = [0] * world_size
        self.flows: list[tuple[int, str]] = [(0, "both")] * world_size
        self._created: list[str] = []  # namespaces made so far, in creation order
        self._procs: list[subprocess.Popen] = []
        self._rank_pids: dict[int, int] = {}  # the running rank processes (cgroup attach)
        self._cgroups: CpuCgroups | None = None
        self._condition_procs: dict[tuple[str, int | None], list[ConditionProcess]] = {}
        self._traffic_ns: str | None = None
        self.condition_costs: list[dict[str, Any]] = []  # every stopped condition process
        self._lock = threading.RLock()
        self._closed = False

    # -- lifecycle --

    def __enter__(self) -> Self:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> Testbed:
        if self._created or self._closed:
            raise TestbedError("a Testbed is created once; make a new one")
        _register(self)
        try:
            self._make_ns(self.hub_ns)
            self._ip(self.hub_ns, "link", "add", BRIDGE_IFNAME, "type", "bridge")
            self._ip(self.hub_ns, "link", "set", BRIDGE_IFNAME, "address", BRIDGE_MAC)
            self._ip(self.hub_ns, "link", "set", BRIDGE_IFNAME, "up")
            for link in self.links:
                self._make_ns(link.rank_ns)
                self._ip(
                    link.rank_ns,
                    "link",
                    "add",
                    RANK_IFNAME,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    link.hub_ifname,
                    "netns",
                    self.hub_ns,
                )
                self._ip(
                    link.rank_ns, "addr", "add", f"{self.address(link.rank)}/24", "dev", RANK_IFNAME
                )
                self._ip(link.rank_ns, "link", "set", RANK_IFNAME, "up")
                self._ip(self.hub_ns, "link", "set", link.hub_ifname, "master", BRIDGE_IFNAME)
                self._ip(self.hub_ns, "link", "set", link.hub_ifname, "up")
                for ns, dev in ((link.rank_ns, RANK_IFNAME), (self.hub_ns, link.hub_ifname)):
                    self._tbf(ns, dev, self.rates_bps[link.rank], "replace")
        except BaseException:
            self.close()
            raise
        logger.info(
            "testbed %s: %d ranks at %s",
            self.name,
            self.world_size,
            format_rate(self._initial_rate_bps),
        )
        return self

    def close(self) -> None:
        """Kill every process this testbed started (ranks, busy loops, traffic), remove its cgroups,
        delete every namespace it made. Idempotent."""
        with self._lock:
            procs, self._procs = self._procs, []
            created, self._created = self._created, []
            condition_procs, self._condition_procs = self._condition_procs, {}
            cgroups, self._cgroups = self._cgroups, None
            self._closed = True
        for proc in procs:
            kill_group(proc)
        for group in condition_procs.values():
            for item in group:
                self.condition_costs.append(item.stop())
        if cgroups is not None:
            cgroups.close()
        # Processes that escaped their group still live inside our namespaces, which are ours.
        for ns in reversed(created):
            _kill_namespace_pids(ns)
        for ns in reversed(created):  # rank namespaces first, then the hub (deleting the peers)
            proc = _run_cmd(["ip", "netns", "del", ns], check=False)
            if proc.returncode != 0 and ns in list_namespaces():
                logger.error("could not delete namespace %s: %s", ns, proc.stderr.strip())
        _unregister(self)

    # -- addressing and shaping --

    def namespace(self, rank: int) -> str:
        return self.links[rank].rank_ns

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    @property
    def ifname(self) -> str:
        return RANK_IFNAME

    def set_rate(self, rate: str | int, ranks: Iterable[int] | None = None) -> None:
        """Change the rate of the given ranks' links (both directions) with the burst kept fixed."""
        rate_bps = parse_rate(rate)
        for rank in range(self.world_size) if ranks is None else ranks:
            link = self.links[rank]
            self._tbf(link.rank_ns, RANK_IFNAME, rate_bps, "change")
            self._tbf(self.hub_ns, link.hub_ifname, rate_bps, "change")
            self.rates_bps[rank] = rate_bps

    def link_tx_bytes(self, rank: int) -> int:
        """Bytes the rank has sent through its shaped egress so far (tc qdisc counters)."""
        return self._tbf_bytes(self.namespace(rank), RANK_IFNAME)

    def link_rx_bytes(self, rank: int) -> int:
        """Bytes sent to the rank through the hub's shaped egress towards it so far."""
        return self._tbf_bytes(self.hub_ns, self.links[rank].hub_ifname)

    @staticmethod
    def _tbf_bytes(ns: str, dev: str) -> int:
        out = _run_cmd(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev]).stdout
        for qdisc in json.loads(out or "[]"):
            if qdisc.get("kind") == "tbf":
                return int(qdisc.get("bytes", 0))
        return 0

    # -- conditions: CPU quota, busy processes, competing traffic --

    def _ranks(self, ranks: Iterable[int] | None) -> list[int]:
        chosen = list(range(self.world_size)) if ranks is None else list(ranks)
        for rank in chosen:
            if not 0 <= rank < self.world_size:
                raise ValueError(f"rank {rank} is not in [0, {self.world_size})")
        return chosen

    def _require_live(self) -> None:
        if not self._created or self._closed:
            raise TestbedError("create() the testbed before setting conditions")

    def _cpu_cgroups(self) -> CpuCgroups:
        with self._lock:
            if self._cgroups is None:
                try:
                    cgroups = CpuCgroups(self.name)
                    self._cgroups = cgroups  # before create(): close() removes a partial one
                    cgroups.create(range(self.world_size))
                except (ConditionError, OSError) as error:
                    raise TestbedError(f"cannot limit rank CPU: {error}") from None
                for rank, pid in self._rank_pids.items():
                    self._attach(rank, pid)
            return self._cgroups

    def _attach(self, rank: int, pid: int) -> None:
        assert self._cgroups is not None
        try:
            self._cgroups.attach(rank, pid)
        except OSError as error:  # the rank already exited: nothing to limit
            logger.debug("rank %d (pid %d) not attached to its cgroup: %s", rank, pid, error)

    def set_cpu_share(self, share: float | None, ranks: Iterable[int] | None = None) -> None:
        """Limit the ranks' processes (every thread) to `share` cores with a cgroup CPU quota;
        None lifts it. Applies to running ranks and to those run() starts later."""
        self._require_live()
        chosen = self._ranks(ranks)
        if share is None and self._cgroups is None:
            return
        cgroups = self._cpu_cgroups()
        for rank in chosen:
            try:
                cgroups.set_share(rank, share)
            except OSError as error:
                raise TestbedError(f"cpu quota on rank {rank}: {error}") from None
            self.cpu_shares[rank] = share

    def cpu_throttled(self, rank: int) -> dict[str, int]:
        """The rank's cgroup cpu.stat (nr_periods, nr_throttled, throttled time); {} without one."""
        return self._cgroups.throttled(rank) if self._cgroups is not None else {}

    def _stop(self, key: tuple[str, int | None]) -> list[dict[str, Any]]:
        with self._lock:
            items = self._condition_procs.pop(key, [])
        costs = [item.stop() for item in items]
        self.condition_costs += costs
        return costs

    def _start(self, key: tuple[str, int | None], item: ConditionProcess) -> None:
        with self._lock:
            if self._closed:
                item.stop()
                raise TestbedError("the testbed was closed")
            self._condition_procs.setdefault(key, []).append(item)

    def set_busy(self, processes: int, ranks: Iterable[int] | None = None) -> list[dict[str, Any]]:
        """Run `processes` busy-loop processes inside each rank's namespace (0: none). Returns the
        CPU cost of the processes it stopped."""
        self._require_live()
        if not 0 <= processes <= 64:
            raise ValueError(f"busy processes {processes} must be in [0, 64]")
        stopped: list[dict[str, Any]] = []
        for rank in self._ranks(ranks):
            stopped += self._stop(("busy", rank))
            for _ in range(processes):
                self._start(
                    ("busy", rank),
                    conditions.start_process(
                        "busy", rank, self.exec_args(rank), conditions.busy_argv()
                    ),
                )
            self.busy[rank] = processes
        return stopped

    def _ensure_traffic(self) -> str:
        """The traffic namespace (unshaped port on the hub) with a sink listening; made once."""
        with self._lock:
            if self._traffic_ns is not None:
                return self._traffic_ns
            ns = f"{self.name}-tx"
            self._make_ns(ns)
            self._ip(
                ns,
                "link",
                "add",
                RANK_IFNAME,
                "type",
                "veth",
                "peer",
                "name",
                TRAFFIC_HUB_IFNAME,
                "netns",
                self.hub_ns,
            )
            self._ip(ns, "addr", "add", f"{self.traffic_address}/24", "dev", RANK_IFNAME)
            self._ip(ns, "link", "set", RANK_IFNAME, "up")
            self._ip(self.hub_ns, "link", "set", TRAFFIC_HUB_IFNAME, "master", BRIDGE_IFNAME)
            self._ip(self.hub_ns, "link", "set", TRAFFIC_HUB_IFNAME, "up")
            self._traffic_ns = ns
        self._start(
            ("sink", None),
            conditions.start_process(
                "flow-sink",
                None,
                ["ip", "netns", "exec", ns],
                conditions.sink_argv(self.traffic_address, TRAFFIC_PORT),
                ready_line="listening",
            ),
        )
        return ns

    @property
    def traffic_address(self) -> str:
        return f"{self.subnet}.{TRAFFIC_HOST}"

    def set_flows(
        self, flows: int, ranks: Iterable[int] | None = None, direction: str = "both"
    ) -> list[dict[str, Any]]:
        """Run `flows` competing TCP flows through each rank's shaped link (0: none): "out" from
        the rank to the traffic namespace, "in" from there to the rank, "both" `flows` each way.
        Returns the CPU cost of the flow processes it stopped."""
        self._require_live()
        if not 0 <= flows <= 64:
            raise ValueError(f"flows {flows} must be in [0, 64]")
        if direction not in FLOW_DIRECTIONS:
            raise ValueError(f"flow direction {direction!r}: use one of {FLOW_DIRECTIONS}")
        stopped: list[dict[str, Any]] = []
        chosen = self._ranks(ranks)
        for rank in chosen:
            stopped += self._stop(("flow", rank))
            self.flows[rank] = (0, direction)
        if flows == 0:
            return stopped
        traffic_ns = self._ensure_traffic()
        for rank in chosen:
            detail = {"flows": flows, "direction": direction}
            if direction in ("out", "both"):
                self._start(
                    ("flow", rank),
                    conditions.start_process(
                        "flow-source",
                        rank,
                        self.exec_args(rank),
                        conditions.source_argv(self.traffic_address, TRAFFIC_PORT, flows),
                        {**detail, "towards": "traffic"},
                    ),
                )
            if direction in ("in", "both"):
                if ("sink", rank) not in self._condition_procs:
                    self._start(
                        ("sink", rank),
                        conditions.start_process(
                            "flow-sink",
                            rank,
                            self.exec_args(rank),
                            conditions.sink_argv(self.address(rank), TRAFFIC_PORT),
                            ready_line="listening",
                        ),
                    )
                self._start(
                    ("flow", rank),
                    conditions.start_process(
                        "flow-source",
                        rank,
                        ["ip", "netns", "exec", traffic_ns],
                        conditions.source_argv(self.address(rank), TRAFFIC_PORT, flows),
                        {**detail, "towards": "rank"},
                    ),
                )
            self.flows[rank] = (flows, direction)
        return stopped

    def condition_cpu_s(self) -> dict[str, float]:
        """CPU seconds used so far by condition processes, by kind (live and stopped)."""
        totals: dict[str, float] = {}
        for cost in self.condition_costs:
            totals[str(cost["kind"])] = totals.get(str(cost["kind"]), 0.0) + float(cost["cpu_s"])
        with self._lock:
            live = [item for group in self._condition_procs.values() for item in group]
        for item in live:
            totals[item.kind] = totals.get(item.kind, 0.0) + conditions.process_cpu_s(item.proc.pid)
        return totals

    def condition_pids(self) -> list[int]:
        """Pids of the live condition processes (busy loops, traffic sources and sinks)."""
        with self._lock:
            return [item.proc.pid for group in self._condition_procs.values() for item in group]

    def clear_conditions(self) -> None:
        """Lift every CPU quota, stop busy loops and competing flows (rates are left as they are)."""
        if self._cgroups is not None:
            self.set_cpu_share(None)
        self.set_busy(0)
        self.set_flows(0)

    def _snapshot_conditions(self) -> tuple:
        return list(self.cpu_shares), list(self.busy), list(self.flows)

    def _restore_conditions(self, snapshot: tuple) -> None:
        shares, busy, flows = snapshot
        for rank in range(self.world_size):
            if self.cpu_shares[rank] != shares[rank]:
                self.set_cpu_share(shares[rank], [rank])
            if self.busy[rank] != busy[rank]:
                self.set_busy(busy[rank], [rank])
            if self.flows[rank] != flows[rank]:
                self.set_flows(flows[rank][0], [rank], flows[rank][1])

    def exec_args(self, rank: int) -> list[str]:
        """Prefix that runs a command inside the rank's namespace (on its CPU when pinned)."""
        prefix = ["ip", "netns", "exec", self.namespace(rank)]
        if self.pin_cpus is not None:
            prefix += ["taskset", "-c", str(self.pin_cpus[rank % len(self.pin_cpus)])]
        return prefix

    def rank_env(self, rank: int, master_port: int = DEFAULT_MASTER_PORT) -> dict[str, str]:
        return {
            "MASTER_ADDR": self.address(0),
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "GLOO_SOCKET_IFNAME": RANK_IFNAME,
            "TP_SOCKET_IFNAME": RANK_IFNAME,
            "PYTHONUNBUFFERED": "1",
        }

    @property
    def hub_address(self) -> str:
        """The bridge's own address in the hub namespace (given on first use of `start_in_hub`)."""
        return f"{self.subnet}.{HUB_HOST}"

    def start_in_hub(
        self,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        stdout: Any = subprocess.DEVNULL,
    ) -> subprocess.Popen:
        """Start a service (e.g. autobyted) inside the hub namespace, reachable from every rank at
        `hub_address` (rank traffic to it crosses the rank's shaped link, as it would cross a real
        network). The process is killed with the testbed."""
        if not self._created or self._closed:
            raise TestbedError("create() the testbed before start_in_hub()")
        with self._lock:
            if not getattr(self, "_hub_addressed", False):
                self._ip(self.hub_ns, "addr", "add", f"{self.hub_address}/24", "dev", BRIDGE_IFNAME)
                self._hub_addressed = True
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.hub_ns, *argv],
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        with self._lock:
            self._procs.append(proc)
        return proc

    def _make_ns(self, ns: str) -> None:
        _run_cmd(["ip", "netns", "add", ns])
        with self._lock:
            self._created.append(ns)
        self._ip(ns, "link", "set", "lo", "up")

    def _ip(self, ns: str, *args: str) -> None:
        _run_cmd(["ip", "-n", ns, *args])

    def _tbf(self, ns: str, dev: str, rate_bps: int, verb: str) -> None:
        _run_cmd(
            [
                "tc",
                "-n",
                ns,
                "qdisc",
                verb,
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{rate_bps}bit",
                "burst",
                f"{self.burst_bytes}b",
                "latency",
                f"{self.latency_ms}ms",
            ]
        )

    # -- running ranks --

    def run(
        self,
        command: Callable[[int], Sequence[str]] | Sequence[str],
        *,
        env: dict[str, str] | Callable[[int], dict[str, str]] | None = None,
        trace: Trace | None = None,
        timeout_s: float = 600.0,
        master_port: int = DEFAULT_MASTER_PORT,
        fail_grace_s: float = 5.0,
        monitor_interval_s: float | None = None,
        on_event: Callable[[int, dict[str, Any]], None] | None = None,
        check: bool = True,
        cwd: str | None = None,
    ) -> RunResult:
        """Run one process per rank in its namespace, follow `trace`, and collect what they print.

        `command(rank)` (or one list for every rank) is the argv; the rank environment (MASTER_ADDR,
        MASTER_PORT, RANK, WORLD_SIZE, GLOO_SOCKET_IFNAME) is added to os.environ and `env`. When a
        rank fails, the others get `fail_grace_s` to finish, then are killed. With `check`, a failed
        or timed-out run raises TestbedError carrying each rank's stderr tail.
        """
        if not self._created or self._closed:
            raise TestbedError("create() the testbed before run()")
        trace = trace or Trace()
        if any(isinstance(c, CpuShareChange) for c in trace.changes):
            self._cpu_cgroups()  # ranks are attached at launch, before the trace needs them
        if any(isinstance(c, FlowChange) and c.flows > 0 for c in trace.changes):
            self._ensure_traffic()
        snapshot = self._snapshot_conditions()
        started = time.monotonic()
        collectors = [_RankCollector(rank, on_event) for rank in range(self.world_size)]
        follower = _TraceFollower(self, trace, started)
        for collector in collectors:
            collector.listeners.append(follower.on_event)
        procs: list[subprocess.Popen] = []
        monitor: _LinkMonitor | None = None
        try:
            for rank in range(self.world_size):
                argv = list(command(rank) if callable(command) else command)
                rank_env = dict(os.environ)
                extra = env(rank) if callable(env) else env
                rank_env.update(extra or {})
                rank_env.update(self.rank_env(rank, master_port))
                proc = subprocess.Popen(
                    self.exec_args(rank) + argv,
                    env=rank_env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    bufsize=1,
                    start_new_session=True,
                )
                with self._lock:
                    self._procs.append(proc)
                    self._rank_pids[rank] = proc.pid
                    if self._cgroups is not None:
                        self._attach(rank, proc.pid)
                procs.append(proc)
                collectors[rank].attach(proc)
            follower.start()
            if monitor_interval_s:
                monitor = _LinkMonitor(self, follower, monitor_interval_s)
                monitor.start()
            timed_out = self._wait(procs, started + timeout_s, fail_grace_s)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    kill_group(proc)
            follower.stop()
            if monitor is not None:
                monitor.stop()
            with self._lock:
                self._procs = [p for p in self._procs if p not in procs]
                self._rank_pids.clear()
            if not self._closed:  # conditions the trace applied end with the run
                try:
                    self._restore_conditions(snapshot)
                except (TestbedError, ConditionError, OSError):
                    logger.exception("could not undo the trace's conditions; closing the testbed")
                    self.close()
        samples = monitor.samples if monitor is not None else []
        for collector in collectors:
            collector.join()
        result = RunResult(
            ranks=[c.result(p.returncode) for c, p in zip(collectors, procs)],
            rate_log=follower.log,
            link_samples=samples,
            origin_wall_time=follower.origin_wall_time,
            duration_s=time.monotonic() - started,
            condition_log=follower.condition_log,
        )
        if check and (timed_out or not result.ok):
            detail = "\n".join(
                f"--- rank {r.rank} (exit {r.returncode}) stderr tail:\n{r.stderr_tail}"
                for r in result.ranks
            )
            why = f"timed out after {timeout_s:.0f}s" if timed_out else "a rank failed"
            error = TestbedError(f"testbed run {why}\n{detail}")
            error.result = result  # type: ignore[attr-defined]
            raise error
        return result

    @staticmethod
    def _wait(procs: list[subprocess.Popen], deadline: float, fail_grace_s: float) -> bool:
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return False
            now = time.monotonic()
            if now >= deadline:
                return True
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if failed_at is not None and now - failed_at > fail_grace_s:
                for proc in procs:
                    if proc.poll() is None:
                        kill_group(proc)
                return False
            time.sleep(0.05)
