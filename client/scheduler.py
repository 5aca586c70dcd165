"""The scheduler core: priority + partition + credit gradient synchronisation for torch.distributed.

`ScheduledOptimizer` replaces DistributedDataParallel's gradient sync (DESIGN §3). It wraps a model
and a per-parameter ("element-wise") `torch.optim` optimizer:

* Construction broadcasts every parameter and buffer from rank 0 (as DDP does) and checks the setup;
  unsupported setups (sparse gradients, LBFGS/SparseAdam, mixed dtypes or devices, an optimizer
  holding tensors the model does not own, DDP-wrapped models) raise `ValueError` here.
* Forward pre-hooks record the order in which parameters are first used (the first forward decides;
  rank 0's order is broadcast once so every rank shares one gradient layout). Later forward passes
  wait only for the module's *own* parameters, so layer 1 computes while the last layers' gradients
  are still on the wire (cross-iteration overlap).
* A post-accumulate-grad hook copies each gradient (divided by the world size, any strides, e.g.
  channels-last) into one flat buffer laid out in reverse forward order, plus one "used" flag element
  per parameter, and drops `param.grad`. Gradients are owned by the scheduler from then on, so
  `zero_grad()` (ours, the optimizer's or the model's) can never touch a gradient in flight.
* Partitions are zero-copy slices of that buffer: `partition_bytes` slices that fuse small tensors
  and split big ones, or one partition per parameter when `partition_bytes is None` (no partitioning,
  ByteScheduler's baseline).
* Rank 0's scheduler thread pops the highest-priority ready partition (earliest forward use; older
  steps first) while in-flight bytes < `credit_bytes` (`None` = unlimited), publishes the decision and
  issues an async all-reduce. Other ranks' scheduler threads issue exactly rank 0's sequence as their
  local gradients become ready. One thread per rank issues every collective of the data group.
* An update thread waits for a parameter's partitions, then applies that parameter's optimizer update
  with the hyper-parameters captured at the `step()` call of that step (so an LR scheduler that runs
  right after `step()` does not leak into the step still in flight). The user's optimizer object keeps
  the state, so `state_dict()` / `load_state_dict()` and LR schedulers keep working.

Collective-order guarantee (why no configuration of jitter can deadlock or mix up data)
----------------------------------------------------------------------------------------
1. Data-group collectives are issued by exactly one thread per rank (the scheduler thread); the
   layout broadcast happens once, before that thread starts, on a separate decision group.
2. Rank 0 issues its all-reduces in the order of its decision log and sends each decision batch, as
   (step, offset, length) triples, over a FIFO point-to-point channel (a TCP socket per follower,
   set up once through a dedicated gloo group; gloo isend/irecv on that group if a socket cannot be
   opened) *before* issuing them. A follower issues the triples strictly in log order, so the k-th collective
   of every rank is the same slice of the same layout: same size, same data, on every rank.
3. A follower issues a triple of step s only when every parameter overlapping the slice has produced
   its step-s gradient locally; a step-s gradient is only written after that parameter's step-(s-1)
   update (per-parameter step counters: forward pre-hooks, the gradient hook and `step()` all check
   them), so a decision for step s+1 that arrives early simply waits.
4. Every partition plan covers each element of the buffer exactly once, and a parameter is updated
   when the reduced element count of its slice (data + flag) reaches its size. Because the log
   carries the boundaries, followers never need the configuration: a `reconfigure()` only has to
   take effect on rank 0, at a step boundary (the `step()` call that ends step s fixes the plan of
   step s+1), so a change can neither drop nor duplicate a gradient. Rank 0 also publishes every
   configuration change with the step it starts at, so `last_step_metrics().config` of a step is the
   same on every rank, and `config` on other ranks follows rank 0's (it may lag rank 0 by the
   channel's latency within a step). `reconfigure()` on other ranks is validated but rank 0's word wins.

Semantics that differ from a plain optimizer, on purpose
--------------------------------------------------------
* `step()` returns before the updates land. Use `synchronize()` before reading parameters for a
  checkpoint or an evaluation outside a forward pass (forward passes wait by themselves), and use
  `ScheduledOptimizer.state_dict()` (it synchronises). `param.grad` of managed parameters is None.
* A parameter that no rank used in a step keeps its value and optimizer state (DDP with
  `find_unused_parameters=True` does the same); one used by some ranks gets the average over all.
* One backward per step: gradient accumulation over several backward passes raises.
* Global-norm gradient clipping needs every gradient: pass `clip_grad_norm=max_norm` (and
  `clip_norm_type`). The update thread then waits for all of a step's all-reduces, clips exactly like
  `torch.nn.utils.clip_grad_norm_` on the averaged gradients, and then updates. Overlap with the
  next forward is lost only for that tail; calling `clip_grad_norm_` yourself is not possible
  (gradients are in flight, `param.grad` is None).
* Buffers (e.g. BatchNorm statistics) are broadcast once at construction, not every forward
  (DDP's `broadcast_buffers=False`).
* Construction is collective over the whole default group (it creates one gloo group), so every rank
  must construct its ScheduledOptimizers in the same order; `close()` is collective too.

Untested here (CPU + gloo only): NCCL/CUDA. Nothing assumes CPU: buffers live on the parameters'
device, all-reduces are async work handles, the update thread calls `work.wait()` before using the
result, and the decision channel is always a gloo group on CPU tensors. But CUDA credit accounting
relies on the work future's callback, which NCCL may fire at enqueue time rather than completion; a
CUDA build should poll `work.is_completed()` instead. Untested: several ScheduledOptimizers at once,
process subgroups, `torch.compile`d models.
"""

from __future__ import annotations

import bisect
import collections
import copy
import datetime
import functools
import heapq
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autobyte.types import Config, StepMetrics

logger = logging.getLogger(__name__)

_UNSET: Any = object()

# Events on a scheduler thread's queue (tuples, first element the kind).
_EV_GRAD = 0  # (kind, param_index, step): a parameter's step gradient is in the flat buffer
_EV_DONE = 1  # (kind, nbytes): an all-reduce finished, its credit comes back (rank 0)
_EV_STEP = 2  # (kind, next_step, config, decision_id): step boundary seen by rank 0
_EV_DECISIONS = 3  # (kind, entries): rank 0's decisions, received by a follower
_EV_STOP = 4  # (kind,): sentinel
# Events on the update thread's queue.
_UP_REDUCED = 0  # (kind, step, start, length, work, t_done)
_UP_STEP = 1  # (kind, step, hyper-parameter snapshot)
_UP_STOP = 2

# Decision-channel messages: int64 tensors of fixed length.
_MSG_DECISIONS = 1  # [kind, n, send_time_ns, 0, (step, start, length) * n]
_MSG_CONFIG = 2  # [kind, step, send_time_ns, decision_id, partition_bytes|-1, credit_bytes|-1]
_MSG_STOP = 3
_MSG_HEADER = 4
_MSG_MAX_ENTRIES = 64
_MSG_LEN = _MSG_HEADER + 3 * _MSG_MAX_ENTRIES
_FRAME = struct.Struct(f"<{_MSG_LEN}q")
_MAX_ADDRESSES = 8

# Optimizers that cannot be updated one parameter at a time (closure-based or sparse-only).
_UNSUPPORTED_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in ("LBFGS", "SparseAdam")
                                if hasattr(torch.optim, name))


_cpu_ns = time.thread_time_ns  # the scheduler's own cost is CPU time, not time lost to preemption


def _interface_ipv4(name: str) -> str | None:
    try:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            packed = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        return None


def _candidate_addresses() -> list[str]:
    """Rank 0's IPv4 addresses, most likely reachable first: gloo's interface, MASTER_ADDR, host."""
    found: list[str] = []
    for name in filter(None, os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")):
        found.append(_interface_ipv4(name.strip()) or "")
    for host in (os.environ.get("MASTER_ADDR"), socket.gethostname()):
        if host:
            try:
                found += socket.gethostbyname_ex(host)[2]
            except OSError:
                pass
    found.append("127.0.0.1")
    return [a for a in dict.fromkeys(found) if a]


def _accept_followers(listener: socket.socket, token: int, count: int, accepted: list,
                      timeout_s: float) -> None:
    listener.settimeout(timeout_s)
    hello = struct.Struct("<qq")
    try:
        while len(accepted) < count:
            conn, _ = listener.accept()
            conn.settimeout(5.0)
            try:
                data = b""
                while len(data) < hello.size:
                    chunk = conn.recv(hello.size - len(data))
                    if not chunk:
                        break
                    data += chunk
                if len(data) == hello.size and hello.unpack(data)[0] == token:
                    conn.sendall(data)
                    conn.settimeout(None)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    accepted.append(conn)
                    continue
            except OSError:
                pass
            conn.close()
    except OSError:
        pass


def _connect_leader(addresses: list[str], port: int, token: int) -> socket.socket | None:
    hello = struct.pack("<qq", token, os.getpid())
    for address in addresses:
        try:
            sock = socket.create_connection((address, port), timeout=2.0)
        except OSError:
            continue
        try:
            sock.sendall(hello)
            data = b""
            while len(data) < len(hello):
                chunk = sock.recv(len(hello) - len(data))
                if not chunk:
                    break
                data += chunk
            if data == hello:
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
        except OSError:
            pass
        sock.close()
    return None


class SchedulerError(RuntimeError):
    """A failure in the scheduler's hooks or threads, raised in the training thread."""


class _AliasState:
    """The optimizer's `state`, seen through detached aliases of the parameters.

    The update thread steps aliases (same storage, their own `.grad`), so a user's `zero_grad()` can
    never reach the gradient handed to the optimizer; the state stays keyed by the real parameters.
    """

    __slots__ = ("_optimizer", "_param_of")

    def __init__(self, optimizer: torch.optim.Optimizer, param_of: dict[torch.Tensor, torch.Tensor]):
        self._optimizer = optimizer
        self._param_of = param_of

    def __getitem__(self, alias: torch.Tensor) -> dict:
        return self._optimizer.state[self._param_of[alias]]

    def __setitem__(self, alias: torch.Tensor, value: dict) -> None:
        self._optimizer.state[self._param_of[alias]] = value

    def __contains__(self, alias: torch.Tensor) -> bool:
        return self._param_of[alias] in self._optimizer.state

    def get(self, alias: torch.Tensor, default: Any = None) -> Any:
        return self._optimizer.state.get(self._param_of[alias], default)


class _Plan:
    """The partitions of one step on rank 0 and which parameters each waits for."""

    __slots__ = ("parts", "param_parts", "remaining", "left")

    def __init__(self, parts: list[tuple[int, int]], param_parts: list[tuple[int, ...]],
                 counts: list[int]):
        self.parts = parts
        self.param_parts = param_parts
        self.remaining = list(counts)
        self.left = len(parts)


class _StepRecord:
    """Raw measurements of one step, written by the thread that sees each event."""

    __slots__ = ("t_forward", "t_backward", "t_step", "blocked_s", "bytes", "parts", "queue_s",
                 "t_first_issue", "t_last_done")

    def __init__(self) -> None:
        self.t_forward = self.t_backward = self.t_step = None
        self.blocked_s = 0.0
        self.bytes = 0
        self.parts = 0
        self.queue_s = 0.0
        self.t_first_issue = None
        self.t_last_done = 0.0


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _UNSUPPORTED_OPTIMIZERS):
        raise ValueError(f"{type(optimizer).__name__} cannot be applied one parameter at a time "
                         "(closure-based or sparse-only); use an element-wise optimizer such as "
                         "SGD, Adam or AdamW")


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("pass the bare module, not a DistributedDataParallel wrapper: "
                         "ScheduledOptimizer replaces DDP's gradient sync")
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise ValueError(f"module {name or type(module).__name__!r} produces sparse gradients "
                             "(sparse=True), which the scheduler cannot partition; use sparse=False")


class ScheduledOptimizer:
    """Gradient sync + optimizer step with priority, partitioning and a credit window.

    Args:
        model: the module to train (not wrapped in DDP).
        optimizer: a `torch.optim` optimizer over (some of) the model's parameters, with a
            per-parameter update rule (SGD, Adam, AdamW, RMSprop, ...).
        partition_bytes: partition size; None = one partition per parameter (no partitioning).
        credit_bytes: in-flight window; None = unlimited.
        process_group: the data-parallel group (default: the default group).
        clip_grad_norm: if set, clip the averaged gradients to this global norm before updating.
        clip_norm_type: the norm for `clip_grad_norm`.
        timeout_s: how long the training thread waits for parameters or shutdown before raising.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 partition_bytes: int | None = 4 << 20, credit_bytes: int | None = 16 << 20,
                 process_group: Any = None, *, clip_grad_norm: float | None = None,
                 clip_norm_type: float = 2.0, timeout_s: float = 300.0) -> None:
        config = Config(partition_bytes, credit_bytes)
        _check_model(model)
        _check_optimizer(optimizer)
        if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float))
                                               and not isinstance(clip_grad_norm, bool)
                                               and 0 < clip_grad_norm < float("inf")):
            raise ValueError(f"clip_grad_norm must be a positive finite number or None, "
                             f"got {clip_grad_norm!r}")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        if not params:
            raise ValueError("the model has no parameter that requires a gradient")
        first = params[0]
        for p in params:
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError("all trainable parameters must share one dtype and device, found "
                                 f"{first.dtype}/{first.device} and {p.dtype}/{p.device}")
            if not p.dtype.is_floating_point:
                raise ValueError(f"trainable parameters must be floating point, found {p.dtype}")
            if p.layout != torch.strided:
                raise ValueError(f"only dense (strided) parameters are supported, found {p.layout}")
        index_of = {p: i for i, p in enumerate(params)}
        all_model_params = set(model.parameters())
        group_of = [-1] * len(params)
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p not in all_model_params:
                    raise ValueError("the optimizer holds a tensor that is not a parameter of the model")
                if p in index_of:
                    group_of[index_of[p]] = g

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group() before ScheduledOptimizer")

        self._model = model
        self._optimizer = optimizer
        self._pg = process_group if process_group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self._pg)
        self._world = dist.get_world_size(self._pg)
        self._leader_global = dist.get_global_rank(self._pg, 0) if process_group is not None else 0
        self._is_leader = self._rank == 0
        self._clip = None if clip_grad_norm is None else float(clip_grad_norm)
        self._clip_norm_type = float(clip_norm_type)
        self._timeout_s = float(timeout_s)

        self._params = params
        self._group_of = group_of
        self._n = len(params)
        self._numel = [p.numel() for p in params]
        self._dtype = first.dtype
        self._device = first.device
        self._elem = first.element_size()

        self._broadcast_initial_state()
        self._decision_group = None
        if self._world > 1:
            ranks = dist.get_process_group_ranks(self._pg)
            self._decision_group = dist.new_group(
                ranks, backend="gloo", timeout=datetime.timedelta(seconds=self._timeout_s))
            self._follower_globals = [r for r in ranks if r != self._leader_global]

        # Training-thread state.
        self._step_index = 0
        self._produced = [-1] * self._n  # last step whose gradient is in the buffer
        self._produced_t = [0.0] * self._n
        self._produced_count = 0
        self._param_step = [0] * self._n  # number of updates applied
        self._updated_through = 0  # every parameter has its updates of steps < this
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._order: list[int] | None = []  # first-use order while recording
        self._seen = [False] * self._n
        self._layout_ready = False
        self._records: dict[int, _StepRecord] = {}
        self._completed: collections.deque[int] = collections.deque()
        self._last_metrics: StepMetrics | None = None
        self._last_step_t = time.perf_counter()
        self._callbacks: list[Callable[[StepMetrics], Any]] = []
        self._cfg_lock = threading.Lock()
        self._pending: tuple[Config, int, int] | None = None  # (config, decision, first step)
        self._config_log: list[tuple[int, Config, int]] = []  # (first step, config, decision id)
        self._config_steps: list[int] = []
        self._initial = (config, 0)
        if self._is_leader:
            self._log_config(0, config, 0)
        self._last_grad_norm: float | None = None

        # Statistics of the scheduler itself.
        self._stat_parts = 0
        self._stat_sched_ns = 0
        self._stat_backend_ns = 0
        self._stat_backend_wall_ns = 0
        self._stat_msgs = 0
        self._stat_msg_send_ns = 0
        self._stat_channel_ns = 0
        self._stat_channel_n = 0

        self._comm_q: queue.SimpleQueue = queue.SimpleQueue()
        self._update_q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

        # Update-thread optimizer: the same class and state, stepping detached aliases.
        self._aliases = [p.detach() for p in params]
        worker = copy.copy(optimizer)
        worker.__dict__.pop("step", None)  # an LR scheduler's instance-level wrapper
        worker._optimizer_step_pre_hooks = collections.OrderedDict()
        worker._optimizer_step_post_hooks = collections.OrderedDict()
        worker.state = _AliasState(optimizer, dict(zip(self._aliases, params)))
        self._worker = worker
        self._worker_step = type(optimizer).step

        self._handles = []
        for i, p in enumerate(params):
            self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._grad_hook, i)))
        for module in model.modules():
            own = tuple(dict.fromkeys(index_of[p] for p in module.parameters(recurse=False)
                                      if p in index_of))
            if own:
                self._handles.append(module.register_forward_pre_hook(
                    functools.partial(self._forward_pre_hook, own)))
        # Streams to autobyted if autobyte.init() was called (now or later); a no-op otherwise.
        from autobyte import telemetry

        telemetry.on_optimizer_created(self)

    # ------------------------------------------------------------------ public API

    @property
    def model(self) -> nn.Module:
        """The wrapped model."""
        return self._model

    @property
    def process_group(self) -> Any:
        """The data-parallel process group."""
        return self._pg

    @property
    def config(self) -> Config:
        """The configuration in effect for the step in progress (rank 0's, on every rank)."""
        if self._config_log:
            return self._config_log[-1][1]
        return self._initial[0]

    @property
    def step_index(self) -> int:
        """Number of `step()` calls so far (their updates may still be landing)."""
        return self._step_index

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer (attach LR schedulers to it)."""
        return self._optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self._optimizer.param_groups

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last clipped step (with `clip_grad_norm`)."""
        return self._last_grad_norm

    def reconfigure(self, partition_bytes: int | None = _UNSET, credit_bytes: int | None = _UNSET,
                    *, decision_id: int | None = None, at_step: int | None = None) -> Config:
        """Request a configuration from the next step boundary on (or from step `at_step`, if that
        is later). Omitted values stay as they are.

        Bad values raise ValueError and change nothing. Rank 0's request is the one that takes
        effect (on every rank, at the same step); thread-safe. A newer request replaces a pending one.
        """
        for name, value in (("decision_id", decision_id), ("at_step", at_step)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        with self._cfg_lock:
            base = self._pending[0] if self._pending is not None else self.config
            new = Config(base.partition_bytes if partition_bytes is _UNSET else partition_bytes,
                         base.credit_bytes if credit_bytes is _UNSET else credit_bytes)
            self._pending = (new, 0 if decision_id is None else decision_id, at_step or 0)
        return new

    def add_step_callback(self, fn: Callable[[StepMetrics], Any]) -> None:
        """Call fn(StepMetrics) on the training thread for each completed step (keep it cheap).

        Exceptions raised by fn are logged and swallowed.
        """
        if not callable(fn):
            raise ValueError("the step callback must be callable")
        self._callbacks.append(fn)

    def last_step_metrics(self) -> StepMetrics | None:
        """Measurements of the most recent step whose updates have all landed."""
        self._drain_metrics()
        return self._last_metrics

    def step(self, closure: Any = None) -> None:
        """End the step: flush unused parameters, capture hyper-parameters, return at once."""
        if closure is not None:
            raise ValueError("step(closure) is not supported: the update runs per parameter, later")
        self._check_usable()
        if not self._layout_ready:
            self._finalize_layout()
        s = self._step_index
        if self._produced_count != self._n:
            self._flush_unused(s)
        groups = self._optimizer.param_groups
        snapshot = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        now = time.perf_counter()
        rec = self._record(s)
        rec.t_step = now
        self._update_q.put((_UP_STEP, s, snapshot))
        if self._is_leader:
            config, decision_id = self._config_log[-1][1], self._config_log[-1][2]
            with self._cfg_lock:
                if self._pending is not None and s + 1 >= self._pending[2]:
                    config, decision_id, _ = self._pending
                    self._pending = None
                    if (config, decision_id) != self._config_log[-1][1:]:
                        self._log_config(s + 1, config, decision_id)
            self._comm_q.put((_EV_STEP, s + 1, config, decision_id))
        self._produced_count = 0
        self._step_index = s + 1
        self._optimizer._opt_called = True  # what the LR scheduler's step tracker would set
        self._drain_metrics()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients of parameters the scheduler does not manage; managed ones are never touched."""
        managed = set(self._params)
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                if p not in managed and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Wait until every update of every `step()` so far has landed; raise any scheduler error.

        `timeout_s` (default: the constructor's `timeout_s`) bounds the wait; SchedulerError on expiry.
        """
        self._check_usable()
        if timeout_s is None:
            timeout_s = self._timeout_s
        elif not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        target = self._step_index
        if self._updated_through < target:
            deadline = time.monotonic() + timeout_s
            with self._cond:
                while self._updated_through < target:
                    self._raise_if_failed()
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise SchedulerError(f"synchronize() timed out after {timeout_s}s waiting "
                                             f"for step {target - 1}'s updates")
                    self._cond.wait(min(remaining, 1.0))
        self._raise_if_failed()
        self._drain_metrics()

    def state_dict(self) -> dict:
        """The optimizer's state_dict, after `synchronize()`."""
        self.synchronize()
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the optimizer's state, after `synchronize()`."""
        self.synchronize()
        self._optimizer.load_state_dict(state_dict)

    def dispatch_overhead_us(self) -> float:
        """The scheduler's own cost per partition in µs: CPU time of its thread (decisions, queues,
        bookkeeping, decision messages), excluding the backend's all-reduce launch calls."""
        return self._stat_sched_ns / 1e3 / self._stat_parts if self._stat_parts else 0.0

    def dispatch_stats(self) -> dict[str, float]:
        """Scheduler costs: own overhead vs backend launch per partition, decision channel."""
        parts = self._stat_parts or 1
        return {
            "partitions": float(self._stat_parts),
            # CPU time of the scheduler thread, without the backend's launch calls
            "scheduler_us_per_partition": self._stat_sched_ns / 1e3 / parts,
            # the all-reduce launch call (+ channel posts on rank 0): CPU time, and wall time
            "backend_launch_us_per_partition": self._stat_backend_ns / 1e3 / parts,
            "backend_launch_wall_us_per_partition": self._stat_backend_wall_ns / 1e3 / parts,
            "channel_socket": float(getattr(self, "_channel", "") == "socket"),
            "channel_messages": float(self._stat_msgs),
            # rank 0: cost of posting one decision message (all followers) on the scheduler thread
            "channel_send_us_per_message": (self._stat_msg_send_ns / 1e3 / self._stat_msgs
                                            if self._stat_msgs else 0.0),
            # followers: send-to-receive latency (wall clocks; meaningful on one host or with NTP)
            "channel_latency_us": (self._stat_channel_ns / 1e3 / self._stat_channel_n
                                   if self._stat_channel_n else 0.0),
        }

    def close(self) -> None:
        """Stop the scheduler threads (collective: every rank calls it) and remove the hooks."""
        if self._closed:
            return
        failed = self._error is not None
        stop_error: BaseException | None = None
        if self._threads and not failed:
            try:
                self.synchronize()
            except BaseException as error:  # still stop the threads below
                stop_error = error
        self._closed = True
        self._comm_q.put((_EV_STOP,))
        self._update_q.put((_UP_STOP,))
        deadline = time.monotonic() + min(self._timeout_s, 60.0)
        stuck = []
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                stuck.append(thread.name)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if stop_error is not None:
            raise stop_error
        if stuck and not failed:
            # the receiving thread of a follower waits on rank 0; it is a daemon thread
            real = [name for name in stuck if not name.endswith("receiver")]
            if real:
                raise SchedulerError(f"scheduler threads did not stop in time: {', '.join(real)}")
            logger.warning("decision receiver still waiting for rank 0's stop message: %s", stuck)

    def __enter__(self) -> "ScheduledOptimizer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except BaseException:
                logger.exception("while closing the scheduler after an error")

    # ------------------------------------------------------------------ setup

    def _broadcast_initial_state(self) -> None:
        tensors = list(dict.fromkeys([*self._model.parameters(), *self._model.buffers()]))
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.device, t.dtype), []).append(t)
        with torch.no_grad():
            for group in by_kind.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                dist.broadcast(flat, src=self._leader_global, group=self._pg)
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _finalize_layout(self) -> None:
        """Fix the flat layout (rank 0's first-use order), allocate the buffer, start threads."""
        order = list(self._order or [])
        order += [i for i in range(self._n) if not self._seen[i]]
        self._order = None
        if self._world > 1:
            tensor = torch.tensor(order, dtype=torch.int64)
            dist.broadcast(tensor, src=self._leader_global, group=self._decision_group)
            order = tensor.tolist()
        if sorted(order) != list(range(self._n)):
            raise SchedulerError("rank 0 published an inconsistent parameter order")
        if self._world > 1:
            self._setup_channel()
        # Reverse first-use order: the last-used parameter (first gradient in backward) at offset 0,
        # so a higher offset means a higher priority.
        layout = order[::-1]
        offsets = [0] * self._n
        offset = 0
        for i in layout:
            offsets[i] = offset
            offset += self._numel[i] + 1
        self._total = offset
        self._flat = torch.zeros(offset, dtype=self._dtype, device=self._device)
        self._ext_len = [m + 1 for m in self._numel]
        self._ext_views = [self._flat[offsets[i]:offsets[i] + self._ext_len[i]] for i in range(self._n)]
        self._grad_views = [self._flat[offsets[i]:offsets[i] + self._numel[i]].view(self._params[i].shape)
                            for i in range(self._n)]
        self._flag_views = [self._flat[offsets[i] + self._numel[i]:offsets[i] + self._ext_len[i]]
                            for i in range(self._n)]
        # sorted by offset, for slice -> parameters lookups
        self._by_offset = layout
        self._sorted_offsets = [offsets[i] for i in layout]
        self._offsets = offsets
        self._plans: dict[int | None, tuple] = {}
        self._layout_ready = True
        start_step = self._step_index
        self._start_threads(start_step)

    def _setup_channel(self) -> None:
        """Open the decision channel: TCP sockets from rank 0 to each follower, else gloo p2p.

        A plain socket costs ~10 µs to post and ~15 µs to deliver a decision on loopback, against
        ~120 µs and ~65 µs for a gloo isend/irecv (and far more under load). Rank 0 listens and
        publishes its candidate addresses once over the decision group; every follower connects and
        proves it reached the right process with a random token. If any follower cannot connect,
        every rank falls back to gloo point-to-point (the decision is taken collectively).
        AUTOBYTE_DECISION_CHANNEL=gloo on rank 0 forces the gloo channel.
        """
        self._socks: list[socket.socket] = []
        self._rsock: socket.socket | None = None
        group, leader = self._decision_group, self._leader_global
        header = torch.zeros(3 + _MAX_ADDRESSES, dtype=torch.int64)
        listener = None
        accepted: list[socket.socket] = []
        acceptor = None
        if self._is_leader and os.environ.get("AUTOBYTE_DECISION_CHANNEL", "socket") != "gloo":
            token = secrets.randbits(62)
            try:
                listener = socket.create_server(("0.0.0.0", 0), backlog=len(self._follower_globals) + 4)
                addresses = _candidate_addresses()[:_MAX_ADDRESSES]
                header[0], header[1], header[2] = listener.getsockname()[1], token, len(addresses)
                for k, address in enumerate(addresses):
                    header[3 + k] = struct.unpack("!I", socket.inet_aton(address))[0]
                acceptor = threading.Thread(target=_accept_followers, daemon=True,
                                            args=(listener, token, len(self._follower_globals), accepted,
                                                  self._timeout_s), name=f"autobyte-r{self._rank}-accept")
                acceptor.start()
            except OSError:
                logger.warning("cannot listen for the decision channel; using gloo", exc_info=True)
                header.zero_()
        dist.broadcast(header, src=leader, group=group)
        port, token, count = header[:3].tolist()
        ok = torch.ones(1, dtype=torch.int64)
        if not self._is_leader:
            addresses = [socket.inet_ntoa(struct.pack("!I", a)) for a in header[3:3 + count].tolist()]
            self._rsock = _connect_leader(addresses, port, token) if port else None
            ok[0] = int(self._rsock is not None)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if self._is_leader and acceptor is not None:
            acceptor.join(self._timeout_s if ok.item() else 0.0)
            self._socks = list(accepted) if ok.item() and len(accepted) == len(self._follower_globals) else []
            listener.close()
        if not ok.item() or (self._is_leader and not self._socks):
            for sock in [*self._socks, *accepted, *([self._rsock] if self._rsock else [])]:
                sock.close()
            self._socks, self._rsock = [], None
            logger.info("decision channel: gloo point-to-point")
        self._channel = "socket" if ok.item() else "gloo"

    def _start_threads(self, start_step: int) -> None:
        if self._is_leader:
            targets = [("leader", self._leader_main, (start_step,))]
        else:
            targets = [("follower", self._follower_main, ()), ("receiver", self._receiver_main, ())]
        targets.append(("update", self._update_main, ()))
        for name, target, args in targets:
            thread = threading.Thread(target=target, args=args, daemon=True,
                                      name=f"autobyte-r{self._rank}-{name}")
            self._threads.append(thread)
            thread.start()

    def _plan_template(self, partition_bytes: int | None) -> tuple:
        cached = self._plans.get(partition_bytes)
        if cached is not None:
            return cached
        layout, offsets, ext = self._by_offset, self._offsets, self._ext_len
        if partition_bytes is None:
            parts = [(offsets[i], ext[i]) for i in layout]
            part_of = {i: k for k, i in enumerate(layout)}
            param_parts = [(part_of[i],) for i in range(self._n)]
            counts = [1] * len(parts)
        else:
            size = max(1, partition_bytes // self._elem)
            parts = [(a, min(size, self._total - a)) for a in range(0, self._total, size)]
            counts = [0] * len(parts)
            param_parts = []
            for i in range(self._n):
                ks = tuple(range(offsets[i] // size, (offsets[i] + ext[i] - 1) // size + 1))
                for k in ks:
                    counts[k] += 1
                param_parts.append(ks)
        cached = (parts, param_parts, counts)
        self._plans[partition_bytes] = cached
        return cached

    def _new_plan(self, config: Config) -> _Plan:
        return _Plan(*self._plan_template(config.partition_bytes))

    def _params_in(self, start: int, length: int) -> tuple[int, int]:
        """Positions (in layout order) of the first and last parameter overlapping a slice."""
        offs = self._sorted_offsets
        return bisect.bisect_right(offs, start) - 1, bisect.bisect_right(offs, start + length - 1) - 1

    def _log_config(self, step: int, config: Config, decision_id: int) -> None:
        self._config_log.append((step, config, decision_id))
        self._config_steps.append(step)

    def _config_at(self, step: int) -> tuple[Config, int]:
        k = bisect.bisect_right(self._config_steps, step) - 1
        if k < 0:
            return self._initial
        _, config, decision_id = self._config_log[k]
        return config, decision_id

    def _record(self, step: int) -> _StepRecord:
        rec = self._records.get(step)
        if rec is None:
            rec = self._records.setdefault(step, _StepRecord())
        return rec

    # ------------------------------------------------------------------ hooks (training thread)

    def _forward_pre_hook(self, own: tuple[int, ...], module: nn.Module, args: Any) -> None:
        s = self._step_index
        rec = self._records.get(s)
        if rec is None or rec.t_forward is None:
            self._record(s).t_forward = time.perf_counter()
        if self._order is not None:
            seen = self._seen
            for i in own:
                if not seen[i]:
                    seen[i] = True
                    self._order.append(i)
        if self._updated_through >= s:
            return
        self._wait_params(own, s)

    def _wait_params(self, idxs: tuple[int, ...], s: int) -> None:
        ps = self._param_step
        for i in idxs:
            if ps[i] < s:
                break
        else:
            return
        t0 = time.perf_counter()
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            while any(ps[i] < s for i in idxs):
                self._raise_if_failed()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SchedulerError(f"timed out after {self._timeout_s}s waiting for the updates "
                                         f"of step {s - 1}")
                self._cond.wait(min(remaining, 1.0))
        self._record(s).blocked_s += time.perf_counter() - t0

    def _grad_hook(self, i: int, param: torch.Tensor) -> None:
        try:
            if self._closed:
                return
            if not self._layout_ready:
                self._finalize_layout()
            s = self._step_index
            if self._produced[i] >= s:
                raise SchedulerError("a parameter received a second gradient in one step: gradient "
                                     "accumulation over several backward() calls is not supported")
            if self._param_step[i] < s:
                self._wait_params((i,), s)
            grad = param.grad
            if grad is None:
                raise SchedulerError("the gradient vanished before the scheduler's hook ran")
            if grad.layout != torch.strided:
                raise SchedulerError("sparse gradients are not supported")
            with torch.no_grad():
                if self._world == 1:
                    self._grad_views[i].copy_(grad)
                else:
                    torch.mul(grad, 1.0 / self._world, out=self._grad_views[i])
                self._flag_views[i].fill_(1.0)
            param.grad = None
            self._post_grad(i, s)
        except BaseException as error:  # surfaced at the next step()/synchronize()
            self._fail(error)
            if self._layout_ready and self._produced[i] < self._step_index:
                # keep the collective sequence going for the other ranks: a zero contribution
                self._ext_views[i].zero_()
                param.grad = None
                self._post_grad(i, self._step_index)

    def _post_grad(self, i: int, s: int) -> None:
        now = time.perf_counter()
        if self._produced_count == 0:
            rec = self._record(s)
            if rec.t_backward is None:
                rec.t_backward = now
        self._produced_t[i] = now
        self._produced[i] = s
        self._produced_count += 1
        self._comm_q.put((_EV_GRAD, i, s))

    def _flush_unused(self, s: int) -> None:
        """Parameters without a gradient this step contribute zeros (flag 0)."""
        for i in range(self._n):
            if self._produced[i] < s:
                if self._param_step[i] < s:
                    self._wait_params((i,), s)
                self._ext_views[i].zero_()
                self._post_grad(i, s)

    # ------------------------------------------------------------------ errors, metrics

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
                logger.error("autobyte scheduler failed on rank %d: %r", self._rank, error)
            self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise SchedulerError(f"the gradient scheduler failed: {self._error!r}") from self._error

    def _check_usable(self) -> None:
        if self._closed:
            raise SchedulerError("this ScheduledOptimizer is closed")
        self._raise_if_failed()

    def _drain_metrics(self) -> None:
        completed = self._completed
        while completed:
            s = completed.popleft()
            rec = self._records.pop(s, None)
            if rec is None:
                continue
            config, decision_id = self._config_at(s)
            t_step = rec.t_step or time.perf_counter()
            span = rec.t_last_done - rec.t_first_issue if rec.t_first_issue is not None else 0.0
            metrics = StepMetrics(
                step=s, wall_time_s=time.time(), step_time_s=t_step - self._last_step_t,
                forward_s=(rec.t_backward - rec.t_forward
                           if rec.t_forward is not None and rec.t_backward is not None else 0.0),
                backward_s=t_step - rec.t_backward if rec.t_backward is not None else 0.0,
                exposed_comm_s=rec.blocked_s,
                queueing_delay_s=rec.queue_s / rec.parts if rec.parts else 0.0,
                bytes_reduced=rec.bytes, partitions=rec.parts,
                bandwidth_bytes_per_s=rec.bytes / span if span > 0 else 0.0,
                config=config, decision_id=decision_id)
            self._last_step_t = t_step
            self._last_metrics = metrics
            k = bisect.bisect_right(self._config_steps, s) - 1
            if k > 0:  # entries before the one in effect at a finished step are history
                del self._config_log[:k]
                del self._config_steps[:k]
            for fn in self._callbacks:
                try:
                    fn(metrics)
                except Exception:
                    logger.warning("a step callback raised; ignored", exc_info=True)

    # ------------------------------------------------------------------ scheduler threads

    def _issue(self, s: int, start: int, length: int, t_ready: float) -> int:
        """Launch one all-reduce; returns the backend launch time in ns."""
        c0, t0 = _cpu_ns(), time.perf_counter_ns()
        work = dist.all_reduce(self._flat[start:start + length], group=self._pg, async_op=True)
        t1, c1 = time.perf_counter_ns(), _cpu_ns()
        self._stat_backend_wall_ns += t1 - t0
        work.get_future().add_done_callback(functools.partial(self._on_reduced, s, start, length, work))
        rec = self._record(s)
        now = time.perf_counter()
        if rec.t_first_issue is None:
            rec.t_first_issue = now
        rec.bytes += length * self._elem
        rec.parts += 1
        rec.queue_s += max(0.0, now - t_ready)
        self._stat_parts += 1
        return c1 - c0

    def _on_reduced(self, s: int, start: int, length: int, work: Any, future: Any) -> None:
        # Runs on the backend's thread: keep it tiny.
        try:
            future.value()
        except BaseException as error:
            self._fail(error)
            return
        t_done = time.perf_counter()
        if self._is_leader:
            self._comm_q.put((_EV_DONE, length * self._elem))
        self._update_q.put((_UP_REDUCED, s, start, length, work, t_done))

    def _send(self, message: list[int]) -> int:
        """Post one decision message to every follower (rank 0); returns ns spent."""
        c0, t0 = _cpu_ns(), time.perf_counter_ns()
        message[2] = time.time_ns()
        if self._socks:
            frame = _FRAME.pack(*message, *([0] * (_MSG_LEN - len(message))))
            for sock in self._socks:
                sock.sendall(frame)
            self._stat_msgs += 1
            self._stat_msg_send_ns += time.perf_counter_ns() - t0
            return _cpu_ns() - c0
        tensor = torch.tensor(message + [0] * (_MSG_LEN - len(message)), dtype=torch.int64)
        for dst in self._follower_globals:
            work = dist.isend(tensor, dst=dst, group=self._decision_group)
            self._sends.append((work, tensor))
        sends = self._sends
        while sends and sends[0][0].is_completed():
            sends.popleft()
        self._stat_msgs += 1
        self._stat_msg_send_ns += time.perf_counter_ns() - t0
        return _cpu_ns() - c0

    def _leader_main(self, start_step: int) -> None:
        try:
            with torch.no_grad():
                self._leader_loop(start_step)
        except BaseException as error:
            self._fail(error)

    def _leader_loop(self, start_step: int) -> None:
        self._sends: collections.deque = collections.deque()
        followers = self._world > 1
        config, decision_id = self._config_at(start_step)
        plans = {start_step: self._new_plan(config)}
        credit = config.credit_bytes
        if followers:
            self._send(self._config_message(start_step, config, decision_id))
        heap: list = []
        push, pop = heapq.heappush, heapq.heappop
        inflight = 0
        elem = self._elem
        get, get_nowait = self._comm_q.get, self._comm_q.get_nowait
        perf = time.perf_counter
        empty = queue.Empty
        while True:
            event = get()
            t0 = _cpu_ns()
            backend_ns = 0
            while True:
                kind = event[0]
                if kind == _EV_GRAD:
                    plan = plans[event[2]]
                    remaining = plan.remaining
                    for k in plan.param_parts[event[1]]:
                        remaining[k] -= 1
                        if remaining[k] == 0:
                            start, length = plan.parts[k]
                            push(heap, (event[2], -start, length, perf()))
                elif kind == _EV_DONE:
                    inflight -= event[1]
                elif kind == _EV_STEP:
                    _, step, new_config, new_id = event
                    plans[step] = self._new_plan(new_config)
                    if (new_config, new_id) != (config, decision_id) and followers:
                        backend_ns += self._send(self._config_message(step, new_config, new_id))
                    config, decision_id, credit = new_config, new_id, new_config.credit_bytes
                elif kind == _EV_STOP:
                    if followers:
                        self._send([_MSG_STOP, 0, 0, 0])
                        for work, _ in self._sends:
                            work.wait()
                        for sock in self._socks:
                            sock.close()
                    return
                try:
                    event = get_nowait()
                except empty:
                    break
            if heap and (credit is None or inflight < credit):
                batch = []
                while heap and (credit is None or inflight < credit):
                    step, neg_start, length, t_ready = pop(heap)
                    batch.append((step, -neg_start, length, t_ready))
                    inflight += length * elem
                if followers:
                    for b in range(0, len(batch), _MSG_MAX_ENTRIES):
                        chunk = batch[b:b + _MSG_MAX_ENTRIES]
                        message = [_MSG_DECISIONS, len(chunk), 0, 0]
                        for step, start, length, _ in chunk:
                            message += (step, start, length)
                        backend_ns += self._send(message)
                for step, start, length, t_ready in batch:
                    backend_ns += self._issue(step, start, length, t_ready)
                    plan = plans[step]
                    plan.left -= 1
                    if plan.left == 0:
                        del plans[step]
            self._stat_sched_ns += _cpu_ns() - t0 - backend_ns
            self._stat_backend_ns += backend_ns

    @staticmethod
    def _config_message(step: int, config: Config, decision_id: int) -> list[int]:
        return [_MSG_CONFIG, step, 0, decision_id,
                -1 if config.partition_bytes is None else config.partition_bytes,
                -1 if config.credit_bytes is None else config.credit_bytes]

    def _receiver_main(self) -> None:
        """Follower: receive rank 0's decision stream (the only user of the decision group here)."""
        try:
            buf = torch.zeros(_MSG_LEN, dtype=torch.int64)
            sock = self._rsock
            frame = bytearray(_FRAME.size)
            view = memoryview(frame)
            while True:
                if sock is not None:
                    got = 0
                    while got < len(frame):
                        n = sock.recv_into(view[got:])
                        if n == 0:
                            raise SchedulerError("rank 0 closed the decision channel without a stop "
                                                 "message (did it fail?)")
                        got += n
                    message = _FRAME.unpack(frame)
                else:
                    dist.irecv(buf, src=self._leader_global, group=self._decision_group).wait()
                    message = buf.tolist()
                now = time.time_ns()
                kind = message[0]
                self._stat_channel_ns += max(0, now - message[2])
                self._stat_channel_n += 1
                if kind == _MSG_DECISIONS:
                    entries = []
                    for k in range(message[1]):
                        step, start, length = message[_MSG_HEADER + 3 * k:_MSG_HEADER + 3 * k + 3]
                        first, last = self._params_in(start, length)
                        entries.append((step, start, length, first, last))
                    self._comm_q.put((_EV_DECISIONS, entries))
                elif kind == _MSG_CONFIG:
                    config = Config(None if message[4] < 0 else message[4],
                                    None if message[5] < 0 else message[5])
                    self._log_config(message[1], config, message[3])
                elif kind == _MSG_STOP:
                    self._comm_q.put((_EV_STOP,))
                    if sock is not None:
                        sock.close()
                    return
                else:
                    raise SchedulerError(f"unknown decision message kind {kind}")
        except BaseException as error:
            if not self._closed:
                self._fail(error)

    def _follower_main(self) -> None:
        try:
            with torch.no_grad():
                self._follower_loop()
        except BaseException as error:
            self._fail(error)

    def _follower_loop(self) -> None:
        pending: collections.deque = collections.deque()
        produced, produced_t, by_offset = self._produced, self._produced_t, self._by_offset
        get, get_nowait = self._comm_q.get, self._comm_q.get_nowait
        empty = queue.Empty
        cursor = -1  # first position of the head entry not yet known to be ready
        stopping = False
        while True:
            event = get()
            t0 = _cpu_ns()
            while True:
                kind = event[0]
                if kind == _EV_DECISIONS:
                    pending.extend(event[1])
                elif kind == _EV_STOP:
                    stopping = True
                try:
                    event = get_nowait()
                except empty:
                    break
            backend_ns = 0
            while pending:
                step, start, length, first, last = pending[0]
                pos = max(first, cursor)
                while pos <= last and produced[by_offset[pos]] >= step:
                    pos += 1
                if pos <= last:
                    cursor = pos
                    break
                cursor = -1
                pending.popleft()
                t_ready = max(produced_t[by_offset[q]] for q in range(first, last + 1))
                backend_ns += self._issue(step, start, length, t_ready)
            self._stat_sched_ns += _cpu_ns() - t0 - backend_ns
            self._stat_backend_ns += backend_ns
            if stopping:
                return

    def _update_main(self) -> None:
        try:
            with torch.no_grad():
                self._update_loop()
        except BaseException as error:
            self._fail(error)

    def _update_loop(self) -> None:
        n = self._n
        offs, by_offset, ext = self._sorted_offsets, self._by_offset, self._ext_len
        reduced = [0] * n
        ready: dict[int, list[int]] = {}
        snapshots: dict[int, list[dict]] = {}
        updated: dict[int, int] = {}
        clipping = self._clip is not None
        get, get_nowait = self._update_q.get, self._update_q.get_nowait
        empty = queue.Empty
        bisect_right = bisect.bisect_right
        while True:
            event = get()
            while True:
                kind = event[0]
                if kind == _UP_REDUCED:
                    _, s, start, length, work, t_done = event
                    work.wait()  # no-op for gloo; orders the device stream for NCCL
                    end = start + length
                    pos = bisect_right(offs, start) - 1
                    while pos < n and offs[pos] < end:
                        i = by_offset[pos]
                        overlap = min(end, offs[pos] + ext[i]) - max(start, offs[pos])
                        reduced[i] += overlap
                        if reduced[i] == ext[i]:
                            reduced[i] = 0
                            ready.setdefault(s, []).append(i)
                        pos += 1
                    rec = self._record(s)
                    if t_done > rec.t_last_done:
                        rec.t_last_done = t_done
                elif kind == _UP_STEP:
                    snapshots[event[1]] = event[2]
                elif kind == _UP_STOP:
                    return
                try:
                    event = get_nowait()
                except empty:
                    break
            for s in sorted(ready):
                if s not in snapshots:
                    continue
                if clipping and len(ready[s]) < n:
                    continue
                idxs = ready.pop(s)
                self._apply(s, idxs, snapshots[s])
                done = updated.get(s, 0) + len(idxs)
                with self._cond:
                    step_number = s + 1
                    for i in idxs:
                        self._param_step[i] = step_number
                    if done == n:
                        del snapshots[s]
                        updated.pop(s, None)
                        self._updated_through = step_number
                        self._completed.append(s)
                    else:
                        updated[s] = done
                    self._cond.notify_all()

    def _apply(self, s: int, idxs: list[int], snapshot: list[dict]) -> None:
        """Apply step s's optimizer update to parameters whose gradients are reduced."""
        flags = self._flat[[self._offsets[i] + self._numel[i] for i in idxs]].tolist()
        used = [i for i, flag in zip(idxs, flags) if flag > 0]
        if self._clip is not None:
            views = [self._grad_views[i] for i in used]
            if views:
                norms = torch._foreach_norm(views, self._clip_norm_type)
                total = torch.linalg.vector_norm(torch.stack(norms), self._clip_norm_type)
                coef = torch.clamp(self._clip / (total + 1e-6), max=1.0)
                torch._foreach_mul_(views, coef)
                self._last_grad_norm = float(total)
        by_group: dict[int, list[torch.Tensor]] = {}
        for i in used:
            g = self._group_of[i]
            if g < 0:
                continue
            alias = self._aliases[i]
            alias.grad = self._grad_views[i]
            by_group.setdefault(g, []).append(alias)
        if not by_group:
            return
        if len(snapshot) != len(self._optimizer.param_groups):
            raise SchedulerError("the optimizer's param_groups changed after construction")
        worker = self._worker
        worker.param_groups = [dict(snapshot[g], params=aliases) for g, aliases in sorted(by_group.items())]
        try:
            self._worker_step(worker)
        finally:
            for aliases in by_group.values():
                for alias in aliases:
                    alias.grad = None
