"""One training rank for the testbed: runs a plan of (configuration, steps) segments, prints JSON.

Launched once per namespace by `benchmarks.testbed.Testbed.run` (it reads MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE and GLOO_SOCKET_IFNAME from the environment). A configuration is one of

    ddp              DistributedDataParallel with default buckets (25 MiB)
    ddp:CAP          DistributedDataParallel with bucket_cap_mb = CAP (a size: 4MiB, 262144), a
                     replica of its own per bucket size
    sched:P,C        autobyte.ScheduledOptimizer with partition_bytes=P, credit_bytes=C (sizes
                     such as 4MiB, 256KiB; 'none' = no partitioning / unlimited credit)
    sched:P,C,T      the same with tail_bytes=T (the tail window)
    sched:auto       the scheduler with the configuration it derives at construction ("auto" sizes)
    ...+clip         a ddp or sched configuration whose loop calls `clip_grad_norm_(
                     model.parameters(), CLIP_MAX_NORM)` between backward and step, as transformer
                     loops do (the same replica as the label without it)
    fsdp[:F,B,R]     the model under FSDP2 (per-block groups) with its knobs set so
    fsdp:daemon      (benchmarks/testbed/fsdp_replica.py); `agrs`: FSDP2's communication probe
    compute          forward + backward + update, no gradient sync (DDP under no_sync)
    comm             all-reduce of all gradients in DDP-sized buckets, no compute
    lat[:SIZE]       all-reduces of SIZE (default 4 KiB) issued back to back, as the scheduler
                     issues partitions, no compute: `lat_collectives(SIZE)` of them (16 up to
                     256 KiB, then 4 MiB worth); step time / count = the cost of one collective
    latc[:SIZE]      the same all-reduces issued from a second thread while the main thread runs a
                     compute step (as in training, where the CPU is busy with forward/backward):
                     the result's `collective_s` is their span / count

The plan comes from either

    --configs ddp "sched:none,none" "sched:4MiB,8MiB" --rounds 3 --steps 20 --warmup 5
        interleaved: every round runs every configuration (warm-up steps, then measured steps), so
        that drift on a noisy machine hits all configurations alike; or
    --schedule FILE --steps N [--max-seconds S]
        one run of N steps whose configuration changes at given steps (JSON list of
        {"at_step": n, "config": "sched:4MiB,8MiB"}), for trace-driven evaluations.

With AUTOBYTE_DAEMON (and AUTOBYTE_JOB, AUTOBYTE_TOKEN) in the environment, every rank streams its
scheduler's metrics to that autobyted and rank 0 applies the daemon's decisions (the real client,
`autobyte.init()`): the `autobyte` policy of `benchmarks.harness.evaluate --testbed`.

With `--control FILE` (scheduler configurations only) rank 0 reads new lines of FILE before every
step: each a JSON object {"partition_bytes": int|null, "credit_bytes": int|null} (an omitted key
keeps its value) passed to `reconfigure()`; a rejected one is reported as a
`reconfigure_rejected` event and training goes on. Rank 0's word is the scheduler's word, so the change lands on every rank at the
same step. A policy in the harness process reads the `step` events (Testbed.run's on_event) and
appends decisions: online tuning on the testbed.

All configurations share one process: one model replica under DDP (and one per other DDP bucket
size) and one under the scheduler, switched at segment boundaries after `synchronize()` and a
barrier, and reconfigured in place.

Every result carries the rank's CPU over its measured steps (`cpu`: the process's CPU time / wall
time as `busy_share`, and CPU seconds per step of its training, update, dispatch and backend threads
-- backend: the threads Python did not make, gloo's among them -- with the time they were runnable
but waiting for a CPU, `runqueue_s_per_step`, the training thread's apart, and the cores the whole
machine kept busy, every process's, `machine_busy_cores`), so that a run where the host's CPU was
the limit can be told apart. With `--model emulated` (benchmarks/testbed/emulated.py) it also carries the emulated
device's accounting (`device`).

Output (stdout, one JSON object per line; rank 0 also prints `step` events for step-based traces):
    {"event": "train_start", ...}
    {"event": "step", "step": global_step, "config": label, "step_time_s": ...}      (rank 0)
    {"event": "reconfigure", "step": global_step, "partition_bytes": .., "credit_bytes": ..}
    {"event": "result", "rank": r, "segment": i, "round": k, "config": label, "step_times_s": [...],
     "median_step_s": ..., "exposed_comm_s": ..., "metrics": [...]}
    {"event": "done", "rank": r, "wall_s": ...}
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.testbed import worker_cli
from benchmarks.testbed.models import build

DDP_BUCKET_BYTES = 25 << 20
LAT_PROBE_BYTES = 4 << 10
# sched: the scheduler on a communicator of its own (the default; its native hot path where built);
# shared: the same scheduler with own_communicator=False, its collectives on the default group (for
# the cost of the dedicated one); py: the same as sched on the Python hot path (native=False), for
# native-vs-Python pairs in one run.
SCHED_KINDS = ("sched", "shared", "py")
CLIP_MAX_NORM = 1e-3  # +clip: far below the models' gradient norms: every step is really clipped


def lat_collectives(size_bytes: int) -> int:
    """How many all-reduces one `lat:SIZE` probe step issues."""
    return 16 if size_bytes <= 256 << 10 else max(1, (4 << 20) // size_bytes)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A parsed configuration label."""

    kind: str  # ddp | sched | shared | compute | comm | lat | latc (partition: the probe's size;
    # ddp: the bucket cap, None = DDP's default)
    partition_bytes: int | None = None
    credit_bytes: int | None = None
    tail_bytes: int | None = None  # sched:P,C,T: the tail window; absent = none
    auto: bool = False  # sched:auto: the configuration the scheduler derives at construction
    clip: bool = False  # +clip: clip_grad_norm_ between backward and step
    shard: str = ""  # fsdp:F,B,R: the FSDP2 knobs ("daemon": autobyted's; "": FSDP2's own)

    @classmethod
    def parse(cls, label: str) -> RunConfig:
        text, plus, modifier = label.strip().lower().partition("+")
        config = cls._parse(text, label)
        if not plus:
            return config
        if modifier != "clip" or config.kind not in ("ddp", *SCHED_KINDS):
            raise ValueError(
                f"bad configuration {label!r}: the only modifier is +clip, on ddp or sched labels"
            )
        return dataclasses.replace(config, clip=True)

    @classmethod
    def _parse(cls, text: str, label: str) -> RunConfig:
        if text in ("ddp", "compute", "comm", "fsdp", "agrs"):
            return cls(text)
        if text.startswith("fsdp:"):
            spec = text.partition(":")[2]
            if spec != "daemon":
                from benchmarks.testbed.fsdp_replica import shard_config

                shard_config(spec)  # ValueError naming a bad one
            return cls("fsdp", shard=spec)
        kind, _, rest = text.partition(":")
        if kind == "ddp":
            from autobyte.types import parse_bytes

            return cls("ddp", parse_bytes(rest))
        if kind in ("lat", "latc"):
            from autobyte.types import parse_bytes

            size = parse_bytes(rest) if rest else LAT_PROBE_BYTES
            if not size or size % 4:
                raise ValueError(f"bad probe {label!r}: {kind}:SIZE needs a size in whole floats")
            return cls(kind, size)
        if kind in SCHED_KINDS:
            from autobyte.types import parse_bytes

            if rest == "auto":
                return cls(kind, auto=True)
            parts = rest.split(",")
            if len(parts) not in (2, 3):
                raise ValueError(
                    f"bad configuration {label!r}: expected {kind}:PARTITION,CREDIT[,TAIL]"
                )
            return cls(kind, *(parse_bytes(part) for part in parts))
        raise ValueError(
            f"bad configuration {label!r}: expected ddp, compute, comm, lat or sched:P,C "
            "(or shared:P,C / py:P,C)"
        )

    @property
    def label(self) -> str:
        return self._base_label + ("+clip" if self.clip else "")

    @property
    def _base_label(self) -> str:
        if self.kind == "ddp" and self.partition_bytes is not None:
            from autobyte.types import format_bytes

            return f"ddp:{format_bytes(self.partition_bytes)}"
        if self.kind in ("lat", "latc"):
            from autobyte.types import format_bytes

            return (
                self.kind
                if self.partition_bytes == LAT_PROBE_BYTES
                else f"{self.kind}:{format_bytes(self.partition_bytes, 'none')}"
            )
        if self.kind == "fsdp" and self.shard:
            return f"fsdp:{self.shard}"
        if self.kind not in SCHED_KINDS:
            return self.kind
        if self.auto:
            return f"{self.kind}:auto"
        from autobyte.types import format_bytes

        partition = format_bytes(self.partition_bytes, "none")
        tail = "" if self.tail_bytes is None else f",{format_bytes(self.tail_bytes)}"
        return f"{self.kind}:{partition},{format_bytes(self.credit_bytes, 'none')}{tail}"


@dataclasses.dataclass
class Segment:
    config: RunConfig
    steps: int
    warmup: int
    round: int = 0


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


class Trainer:
    """Holds the replicas (DDP and scheduler) and runs segments."""

    def __init__(
        self,
        args: argparse.Namespace,
        need_sched: bool,
        need_shared: bool = False,
        need_py: bool = False,
    ) -> None:
        self.args = args
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        model_args = json.loads(args.model_args) if args.model_args else {}
        torch.manual_seed(args.seed)
        self.workload = build(args.model, **model_args)
        self.batch_size = args.batch_size or self.workload.default_batch_size
        generator = torch.Generator().manual_seed(args.seed * 1000 + self.rank)
        self.batches = [self.workload.make_batch(self.batch_size, generator) for _ in range(4)]
        self.global_step = 0
        self.control = None
        if args.control and dist.get_rank() == 0:
            self.control = open(args.control, "a+")  # noqa: SIM115 - read at every step, closed by close(); a+ creates it if the harness has not yet
            self.control.seek(0)
        self._control_partial = ""
        # --max-seconds: rank 0's clock decides, a flag on a group of its own tells every rank at the
        # same step (a separate group: never interleaved with DDP's or the scheduler's all-reduces).
        self.stop_group = dist.new_group(backend="gloo") if args.max_seconds else None
        self.deadline: float | None = None
        self.stopped = False
        # DDP replica (also used for compute-only steps under no_sync).
        self.ddp_model = nn.parallel.DistributedDataParallel(self.workload.model)
        self.ddp_opt = self._optimizer(self.ddp_model.parameters())
        self.ddp_replicas: dict[int, tuple[Any, Any]] = {}  # bucket cap (bytes) -> (DDP, optimizer)
        self.comm_buffers = self._comm_buffers()
        self.lat_buffers: dict[int, list[torch.Tensor]] = {}
        self.collective_spans: list[float] = []  # lat/latc probes: seconds per collective
        self.sched = None
        if need_sched and os.environ.get("AUTOBYTE_DAEMON"):
            # Stream to autobyted and obey its decisions (evaluate --testbed --policy autobyte):
            # the real client, registering the scheduler created below.
            import autobyte

            autobyte.init()
        self.host_load: Any = None  # autobyte.hostload.HostLoadSampler under --full-metrics
        self.replicas: dict[str, tuple[Any, Any, list]] = {}  # kind -> (model, optimizer, metrics)
        # sched:auto: built with "auto" sizes, the configuration each replica derived (measured
        # once, at construction, as a user's job does)
        auto = any(RunConfig.parse(label).auto for label in args.configs or [])
        self.derived: dict[str, Any] = {}
        self.start_costs: dict[str, Any] = {}  # the all-reduce cost each derivation measured
        for kind, wanted in (("sched", need_sched), ("shared", need_shared), ("py", need_py)):
            if not wanted:
                continue
            from autobyte.scheduler import ScheduledOptimizer

            torch.manual_seed(args.seed)
            sched_model = build(args.model, **model_args).model
            group = dist.new_group(backend="gloo") if args.sched_group else None
            sched = ScheduledOptimizer(
                sched_model,
                self._optimizer(sched_model.parameters()),
                partition_bytes="auto" if auto else None,
                credit_bytes="auto" if auto else None,
                process_group=group,
                own_communicator=kind != "shared",
                native=kind != "py",
            )
            self.derived[kind] = sched.config
            self.start_costs[kind] = sched.start_cost
            # Every completed step's metrics (last_step_metrics() lags and may skip steps), with
            # the host load the real client's reporter would add (--full-metrics).
            metrics: list[Any] = []
            sched.add_step_callback(
                self._with_host_load(metrics) if args.full_metrics else metrics.append
            )
            self.replicas[kind] = (sched_model, sched, metrics)
        if "sched" in self.replicas:
            self.sched_model, self.sched, self.sched_metrics = self.replicas["sched"]
        self.fsdp: Any = None  # benchmarks.testbed.fsdp_replica.ShardedReplica, built at first use
        self._fsdp_config: Any = None
        if any(RunConfig.parse(label).shard == "daemon" for label in args.configs or []):
            import autobyte

            autobyte.init()  # before attach: the FSDP2 job streams to autobyted
        # An emulated model's device (benchmarks/testbed/emulated.py: one per process, every replica's).
        self.device = getattr(self.workload.model, "device", None)

    def _with_host_load(self, metrics: list[Any]) -> Any:
        from autobyte.hostload import HostLoadSampler

        if self.host_load is None:
            self.host_load = HostLoadSampler()
            self.host_load.start()
        sampler = self.host_load
        return lambda m: metrics.append(dataclasses.replace(m, host_load=sampler.value))

    def _use(self, kind: str) -> None:
        """Make the replica of a scheduler kind the current one."""
        self.sched_model, self.sched, self.sched_metrics = self.replicas[kind]

    def _ddp(self, bucket_bytes: int | None) -> tuple[Any, Any]:
        """The DDP replica (and its optimizer) of a bucket cap: the default one for None, else one
        built on first use from the same seed (bucket_cap_mb = bucket_bytes / 2**20)."""
        if bucket_bytes is None:
            return self.ddp_model, self.ddp_opt
        if bucket_bytes not in self.ddp_replicas:
            model_args = json.loads(self.args.model_args) if self.args.model_args else {}
            torch.manual_seed(self.args.seed)
            model = nn.parallel.DistributedDataParallel(
                build(self.args.model, **model_args).model, bucket_cap_mb=bucket_bytes / 2**20
            )
            self.ddp_replicas[bucket_bytes] = (model, self._optimizer(model.parameters()))
        return self.ddp_replicas[bucket_bytes]

    def _optimizer(self, params: Any) -> torch.optim.Optimizer:
        if self.args.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.args.lr, momentum=0.9)
        if self.args.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.args.lr)
        return torch.optim.AdamW(params, lr=self.args.lr)

    def _comm_buffers(self) -> list[torch.Tensor]:
        sizes, current = [], 0
        for p in reversed(list(self.workload.model.parameters())):
            nbytes = p.numel() * p.element_size()
            if current and current + nbytes > DDP_BUCKET_BYTES:
                sizes.append(current)
                current = 0
            current += nbytes
        sizes.append(current)
        return [torch.zeros(n // 4) for n in sizes]

    def _batch(self) -> Any:
        return self.batches[self.global_step % len(self.batches)]

    def _step(self, config: RunConfig) -> None:
        """One training step (or one probe) under `config`."""
        inputs, targets = self._batch()
        if config.kind in ("lat", "latc"):
            size = int(config.partition_bytes or LAT_PROBE_BYTES)
            buffers = self.lat_buffers.setdefault(
                size, [torch.zeros(size // 4) for _ in range(lat_collectives(size))]
            )
            if config.kind == "latc":  # beside a compute step, from another thread
                thread = threading.Thread(target=self._collectives, args=(buffers,))
                thread.start()
                self._step(RunConfig("compute"))
                thread.join()
            else:
                self._collectives(buffers)
            return
        if config.kind == "comm":
            self._collectives(self.comm_buffers)
            return
        if config.kind in ("fsdp", "agrs"):
            if config.kind == "agrs":
                self._sharded().probe()
            else:
                self._sharded().step(inputs, targets, self.workload.loss_fn)
            return
        if config.kind in ("ddp", "compute"):
            model, opt = self._ddp(config.partition_bytes if config.kind == "ddp" else None)
            opt.zero_grad(set_to_none=True)
            if config.kind == "compute":
                with model.no_sync():
                    self.workload.loss_fn(model(inputs), targets).backward()
            else:
                self.workload.loss_fn(model(inputs), targets).backward()
            if config.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_MAX_NORM)
            opt.step()
            return
        assert self.sched is not None and config.kind in SCHED_KINDS
        self.sched.zero_grad()
        self.workload.loss_fn(self.sched_model(inputs), targets).backward()
        if config.clip:  # a read of .grad: waits for this step's reductions (DDP's wait)
            torch.nn.utils.clip_grad_norm_(self.sched_model.parameters(), CLIP_MAX_NORM)
        self.sched.step()

    def _sharded(self) -> Any:
        if self.fsdp is None:
            from benchmarks.testbed.fsdp_replica import ShardedReplica

            model_args = json.loads(self.args.model_args) if self.args.model_args else {}
            torch.manual_seed(self.args.seed)
            self.fsdp = ShardedReplica(
                build(self.args.model, **model_args).model,
                self._optimizer,
                self.args.fsdp_budget or None,
            )
        return self.fsdp

    def _collectives(self, buffers: list[torch.Tensor]) -> None:
        """All-reduce every buffer, issued back to back; records the span per collective."""
        start = time.perf_counter()
        works = [dist.all_reduce(b, async_op=True) for b in buffers]
        for work in works:
            work.wait()
        self.collective_spans.append((time.perf_counter() - start) / len(buffers))

    def _poll_control(self) -> None:
        """Rank 0: apply the configurations appended to the control file since the last step."""
        if self.control is None or self.sched is None:
            return
        self._control_partial += self.control.read()
        *lines, self._control_partial = self._control_partial.split("\n")
        for line in filter(None, (line.strip() for line in lines)):
            try:
                request = json.loads(line)
                # An omitted key keeps its value; null means none / unlimited.
                config = self.sched.reconfigure(
                    **{
                        k: request[k]
                        for k in ("partition_bytes", "credit_bytes", "tail_bytes")
                        if k in request
                    }
                )
            except (ValueError, TypeError, AttributeError) as error:  # training goes on
                emit(
                    {
                        "event": "reconfigure_rejected",
                        "step": self.global_step,
                        "request": line,
                        "error": str(error),
                    }
                )
                continue
            emit(
                {
                    "event": "reconfigure",
                    "step": self.global_step,
                    "partition_bytes": config.partition_bytes,
                    "credit_bytes": config.credit_bytes,
                    "tail_bytes": config.tail_bytes,
                }
            )

    def _should_stop(self) -> bool:
        """Collective: whether rank 0's --max-seconds deadline has passed (False without one)."""
        if self.stop_group is None:
            return False
        flag = torch.zeros(1)
        if self.rank == 0 and self.deadline is not None and time.perf_counter() >= self.deadline:
            flag[0] = 1
        dist.broadcast(flag, src=0, group=self.stop_group)
        self.stopped = bool(flag[0])
        return self.stopped

    def _quiesce(self) -> None:
        for _, sched, _ in self.replicas.values():
            sched.synchronize()
        dist.barrier()

    def run_segment(self, index: int, segment: Segment, emit_steps: bool) -> dict[str, Any]:
        config = segment.config
        self._quiesce()
        scheduled = config.kind in SCHED_KINDS
        if scheduled:
            if config.kind not in self.replicas:
                raise RuntimeError(f"a {config.kind}: configuration needs autobyte.scheduler")
            self._use(config.kind)
            sizes = self.derived[config.kind] if config.auto else config
            self.sched.reconfigure(
                partition_bytes=sizes.partition_bytes,
                credit_bytes=sizes.credit_bytes,
                tail_bytes=sizes.tail_bytes,
            )
        if config.kind == "fsdp":
            self._fsdp_config = self._sharded().use(config.shard)
        for _ in range(segment.warmup):
            self._step(config)
            self.global_step += 1
        if scheduled:
            self.sched.synchronize()
        if config.kind == "fsdp":
            self.fsdp.check(self._fsdp_config)
        dist.barrier()
        sched_first = self.sched.step_index if scheduled else 0
        shard_first = len(self.fsdp.steps) if config.kind == "fsdp" else 0
        dispatch_before = self.sched.dispatch_stats() if scheduled else None
        self.collective_spans.clear()
        if config.kind == "ddp":
            self._ddp(config.partition_bytes)  # a new replica is built before the clock starts
        cpu_before = _CpuSnapshot.take(self.device)
        marks = [time.perf_counter()]
        for _ in range(segment.steps):
            if self._should_stop():
                break
            if scheduled:
                self._poll_control()
            self._step(config)
            if scheduled and len(marks) == segment.steps:
                self.sched.synchronize()  # the last step's updates land inside its own time
            marks.append(time.perf_counter())
            self.global_step += 1
            if emit_steps and self.rank == 0:
                label = config.label
                if scheduled:  # the configuration in effect, under --control too
                    label = RunConfig(
                        config.kind,
                        self.sched.config.partition_bytes,
                        self.sched.config.credit_bytes,
                        self.sched.config.tail_bytes,
                    ).label
                emit(
                    {
                        "event": "step",
                        "step": self.global_step,
                        "config": label,
                        "step_time_s": marks[-1] - marks[-2],
                        "t": time.time(),
                    }
                )
        if self.stopped and scheduled:
            self.sched.synchronize()
        step_times = [b - a for a, b in itertools.pairwise(marks)]
        cpu = _CpuSnapshot.take(self.device).since(cpu_before, len(step_times))
        metrics: list[dict[str, Any]] = []
        dispatch = None
        if scheduled:
            self.sched.last_step_metrics()  # drains completed steps into the callback
            last = self.sched.step_index
            metrics = [_as_dict(m) for m in self.sched_metrics if sched_first <= m.step < last]
            self.sched_metrics.clear()
            dispatch = _dispatch_delta(dispatch_before, self.sched.dispatch_stats())
        exposed = [m.get("exposed_comm_s", 0.0) for m in metrics]
        sharded = self.fsdp.steps[shard_first:] if config.kind == "fsdp" else []
        if sharded:  # FSDP2: the training thread's time in the step's collectives
            exposed = [s.comm_s for s in sharded]
        result = {
            "event": "result",
            "rank": self.rank,
            "segment": index,
            "round": segment.round,
            "config": config.label,
            "kind": config.kind,
            # sched:auto: the sizes the scheduler derived (real bytes, as every size here)
            **{
                key: getattr(self.derived[config.kind] if config.auto else config, key)
                for key in ("partition_bytes", "credit_bytes", "tail_bytes")
            },
            "start_cost": dataclasses.asdict(self.start_costs[config.kind])
            if config.auto and self.start_costs.get(config.kind) is not None
            else None,
            "steps": segment.steps,
            "step_times_s": step_times,
            "median_step_s": statistics.median(step_times) if step_times else None,
            "exposed_comm_s": statistics.median(exposed) if exposed else None,
            "first_step": self.global_step - len(step_times),
            "cpu": cpu["cpu"],
        }
        if sharded:  # FSDP2: the step's all-gathers and reduce-scatters apart (medians of sums)
            result["all_gather_s"] = statistics.median(
                sum(s.all_gather_s.values()) for s in sharded
            )
            result["reduce_scatter_s"] = statistics.median(
                sum(s.reduce_scatter_s.values()) for s in sharded
            )
        if "device" in cpu:
            result["device"] = cpu["device"]
        if self.args.param_digest and config.kind in ("ddp", *SCHED_KINDS):
            model = self.sched_model if scheduled else self._ddp(config.partition_bytes)[0].module
            result["param_digest"] = _param_digest(model)
        if dispatch is not None:
            result["dispatch"] = dispatch
            result["hot_path"] = self.sched.hot_path
        if config.kind in ("lat", "latc") and self.collective_spans:
            result["collective_s"] = statistics.median(self.collective_spans)
        if metrics and self.args.full_metrics:
            result["metrics"] = metrics
        elif metrics:
            keys = (
                "forward_s",
                "backward_s",
                "queueing_delay_s",
                "partitions",
                "bytes_reduced",
                "bandwidth_bytes_per_s",
            )
            result["metrics_median"] = {
                k: statistics.median(m.get(k, 0) or 0 for m in metrics) for k in keys
            }
        return result

    def close(self) -> None:
        if os.environ.get("AUTOBYTE_DAEMON"):
            import autobyte

            autobyte.shutdown(timeout_s=5.0)
        if self.control is not None:
            self.control.close()
        for _, sched, _ in self.replicas.values():
            sched.synchronize()
            sched.close()
        if self.fsdp is not None:
            self.fsdp.job.close()


@dataclasses.dataclass(frozen=True)
class _CpuSnapshot:
    """The rank's CPU and, with an emulated model, its device's accounting at one moment."""

    wall_s: float
    process_cpu_s: float
    machine_busy_s: float  # every process's (other ranks', other users'): /proc/stat
    threads: dict[int, Any]  # benchmarks.testbed.step_breakdown.thread_times()
    device: dict[str, float] | None

    @classmethod
    def take(cls, device: Any) -> _CpuSnapshot:
        from benchmarks.testbed.host import machine_busy_s
        from benchmarks.testbed.step_breakdown import thread_times

        return cls(
            time.perf_counter(),
            time.process_time(),
            machine_busy_s(),
            thread_times(),
            device.stats() if device is not None else None,
        )

    def since(self, before: _CpuSnapshot, steps: int) -> dict[str, Any]:
        from benchmarks.testbed.step_breakdown import time_by_kind

        wall = self.wall_s - before.wall_s
        runqueue = time_by_kind(before.threads, self.threads, steps, "runqueue_ns")
        out: dict[str, Any] = {
            "cpu": {
                "busy_share": (self.process_cpu_s - before.process_cpu_s) / wall
                if wall > 0
                else None,
                "machine_busy_cores": (self.machine_busy_s - before.machine_busy_s) / wall
                if wall > 0
                else None,
                "s_per_step": time_by_kind(before.threads, self.threads, steps),
                "runqueue_s_per_step": runqueue["total"],
                "training_runqueue_s_per_step": runqueue["training"],
            }
        }
        if self.device is not None and before.device is not None:
            out["device"] = {
                key: (self.device[key] - before.device[key]) / max(1, steps) for key in self.device
            }
        return out


def _param_digest(model: nn.Module) -> str:
    """sha256 of every parameter's bytes, in parameters() order: replicas that trained the same
    steps agree to the bit exactly when their digests do."""
    import hashlib

    digest = hashlib.sha256()
    with torch.no_grad():
        for param in model.parameters():
            digest.update(param.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _as_dict(metrics: Any) -> dict[str, Any]:
    return dataclasses.asdict(metrics) if dataclasses.is_dataclass(metrics) else dict(metrics)


def _dispatch_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-partition scheduler and backend-launch cost over one segment, from cumulative means."""
    parts = after["partitions"] - before["partitions"]
    out = {"partitions": parts}
    for key in ("scheduler_us_per_partition", "backend_launch_us_per_partition"):
        total = after[key] * after["partitions"] - before[key] * before["partitions"]
        out[key] = total / parts if parts else 0.0
    out["channel_messages"] = after["channel_messages"] - before["channel_messages"]
    out["channel_send_us_per_message"] = after["channel_send_us_per_message"]
    out["channel_latency_us"] = after["channel_latency_us"]
    return out


def make_plan(args: argparse.Namespace) -> list[Segment]:
    if args.schedule:
        with open(args.schedule) as f:
            changes = sorted(json.load(f), key=lambda c: c["at_step"])
        if not changes or changes[0]["at_step"] != 0:
            changes.insert(0, {"at_step": 0, "config": args.configs[0] if args.configs else "ddp"})
        plan = []
        for change, following in zip(changes, changes[1:] + [{"at_step": args.steps}]):
            steps = min(following["at_step"], args.steps) - change["at_step"]
            if steps > 0:
                plan.append(Segment(RunConfig.parse(change["config"]), steps, 0))
        return plan
    configs = [RunConfig.parse(c) for c in args.configs]
    plan = []
    for r in range(args.rounds):
        # --abba: odd rounds run the configurations in reverse order, so a load that rises or falls
        # steadily over the run hits every configuration alike on average
        order = configs[::-1] if args.abba and r % 2 else configs
        plan += [Segment(c, args.steps, args.warmup, r) for c in order]
    return plan


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return worker_cli.parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    try:
        plan = make_plan(args)
        if args.control and any(s.config.kind != "sched" for s in plan):
            raise SystemExit("--control needs scheduler configurations only (sched:P,C)")
        trainer = Trainer(
            args,
            need_sched=any(s.config.kind == "sched" for s in plan),
            need_shared=any(s.config.kind == "shared" for s in plan),
            need_py=any(s.config.kind == "py" for s in plan),
        )
        emit(
            {
                "event": "train_start",
                "rank": trainer.rank,
                "model": args.model,
                "parameters": trainer.workload.parameter_count,
                "gradient_bytes": trainer.workload.gradient_bytes,
                "batch_size": trainer.batch_size,
                "threads": args.threads,
                "segments": len(plan),
                "pid": os.getpid(),
            }
        )
        if args.max_seconds:
            trainer.deadline = time.perf_counter() + args.max_seconds
        emit_steps = args.steps_events or bool(args.schedule)
        for index, segment in enumerate(plan):
            emit(trainer.run_segment(index, segment, emit_steps))
            if trainer.stopped:
                break
        trainer.close()
        dist.barrier()
        emit({"event": "done", "rank": trainer.rank, "wall_s": time.perf_counter() - started})
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
