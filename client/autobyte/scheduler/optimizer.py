"""`ScheduledOptimizer`: the public API and its training-thread hooks (setup checks in `checks`).

The threads it starts live in `dispatch` (collective order) and `update` (optimizer updates); the
flat buffer in `layout`; rank 0's collective-order channel in `order_channel`; measurements in `metrics`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn

from autobyte import hooks, hostload, tcplinks
from autobyte.scheduler import (
    amp,
    checks,
    compiled,
    grad_reads,
    groups,
    health,
    process_exit,
    start,
    tracking,
)
from autobyte.scheduler import buffers as buffers_mod
from autobyte.scheduler import device as device_sync
from autobyte.scheduler import engine as engine_mod
from autobyte.scheduler import sparse_rows as sparse_rows_mod
from autobyte.scheduler.accumulation import Accumulation
from autobyte.scheduler.amp import ScalerBridge
from autobyte.scheduler.cycle import StepCycle
from autobyte.scheduler.events import StepHyperParameters, Stop
from autobyte.scheduler.metrics import StepLog
from autobyte.scheduler.progress import Progress, SchedulerError
from autobyte.scheduler.requests import ConfigRequests
from autobyte.scheduler.settings import Settings
from autobyte.types import Config, StepMetrics

logger = logging.getLogger(__name__)

_UNSET: Any = object()


def _stepped_directly(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The step pre-hook of every optimizer a ScheduledOptimizer wraps: stepping one directly
    would apply an update the scheduler does not know of and leave its own step unended (the next
    backward would read as a second one in the same step), so it is refused where it is made."""
    raise SchedulerError(
        f"{type(optimizer).__name__}.step() was called on an optimizer that a ScheduledOptimizer "
        "wraps: call the ScheduledOptimizer's step() instead (scaler.step(scheduled_optimizer) "
        "with a GradScaler); it applies this optimizer's update to each parameter as its reduced "
        "gradient arrives. After ScheduledOptimizer.close() the optimizer steps as before."
    )


class ScheduledOptimizer:
    """Gradient sync + optimizer step with priority, partitioning and a credit window.

    Args:
        model: the module to train (not wrapped in DDP).
        optimizer: a `torch.optim` optimizer over (some of) the model's parameters, with a
            per-parameter update rule (SGD, Adam, AdamW, RMSprop, ...), or a list of them (e.g. one
            for the body and one for the head). Trainable parameters that no optimizer given here
            holds get their averaged gradient in `.grad` when `backward()` returns, as with DDP.
        partition_bytes: partition size; None = one partition per parameter (no partitioning);
            "auto" (default) = derived from the gradients' bytes and the all-reduce cost measured
            on the process group at construction (`autobyte.scheduler.start`; `start_config`).
        credit_bytes: in-flight window; None = unlimited; "auto" (default) = 4 partitions.
        tail_bytes: the tail window (`autobyte.types.Config.tail_bytes`): in the last tail_bytes of
            each backward pass, one collective at a time, so the gradients the next forward needs
            first do not queue behind a full credit window; None (default) = no tail window.
        process_group: the data-parallel group (default: the default group).
        clip_grad_norm: if set, clip the averaged gradients to this global norm before updating.
        clip_norm_type: the norm for `clip_grad_norm`.
        timeout_s: how long the training thread waits for parameters or shutdown before raising.
        own_communicator: run the scheduler's collectives on a group of its own (default), so that
            nothing the user does on any group can interleave with them. False: on
            `process_group` itself — only safe if nothing else uses that group while training.
        grad_scaler: a `torch.amp.GradScaler` for fp16 mixed precision: the scheduler unscales the
            reduced gradients, skips a step with inf/NaN on every rank alike and updates the scale
            (see `autobyte.scheduler.amp`); the usual `scaler.scale(loss).backward();
            scaler.step(opt); scaler.update()` loop works unchanged.
        native: run the per-partition hot path in C++ (`autobyte.scheduler.native`) where it can
            run; False: always the Python path. Both give bit-identical parameters; `hot_path`
            says which one runs (`AUTOBYTE_NATIVE=0` also forces the Python path).
        sparse_rows: reduce the gradients of large `nn.Embedding` / `nn.EmbeddingBag` weights
            row-sparse: only the rows some rank touched go on the wire, with DDP's numbers to the
            bit (`autobyte.scheduler.sparse_rows`; CPU/gloo). False: every gradient dense.
        broadcast_buffers: as DDP's: rank 0's buffers (BatchNorm running statistics, ...) are
            copied to every rank at construction and at the start of each forward pass that DDP
            would copy them at (`autobyte.scheduler.buffers`). False: buffers stay each rank's own,
            at construction too.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        partition_bytes: int | str | None = start.AUTO,
        credit_bytes: int | str | None = start.AUTO,
        process_group: Any = None,
        *,
        clip_grad_norm: float | None = None,
        clip_norm_type: float = 2.0,
        timeout_s: float = 300.0,
        own_communicator: bool = True,
        grad_scaler: Any = None,
        native: bool = True,
        tail_bytes: int | None = None,
        sparse_rows: bool = True,
        broadcast_buffers: bool = True,
    ) -> None:
        start.Requested(partition_bytes, credit_bytes, tail_bytes)  # checked before anything runs
        setup = checks.check_setup(model, optimizer, clip_grad_norm, timeout_s, grad_scaler)
        optimizers, params, index_of = setup.optimizers, setup.params, setup.index_of

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group() before ScheduledOptimizer"
            )

        self._model = model
        self._optimizers = optimizers
        self._optimizer = (
            optimizer
            if len(optimizers) == 1 and not isinstance(optimizer, (list, tuple))
            else optimizers
        )
        self._groups = groups.placed(process_group)
        self._settings = Settings(
            None if clip_grad_norm is None else float(clip_grad_norm),
            float(clip_norm_type),
            float(timeout_s),
            bool(native),
            grad_scaler,
        )
        if not isinstance(sparse_rows, bool):
            raise ValueError(f"sparse_rows must be True or False, got {sparse_rows!r}")
        if not isinstance(broadcast_buffers, bool):
            raise ValueError(f"broadcast_buffers must be True or False, got {broadcast_buffers!r}")

        # weights reduced row-sparse (decided from the model alone: the same on every rank)
        self._managed = checks.managed(
            setup,
            sparse_rows_mod.eligible(model, params)
            if sparse_rows and self._groups.world > 1
            else (),
        )

        self._broadcast_initial_state(broadcast_buffers)
        self._groups = groups.with_communicators(
            self._groups,
            own_communicator,
            bool(broadcast_buffers and buffers_mod.synced_buffers(model)),
            self._settings.timeout_s,
        )

        # the pids of the group's other ranks on this host: their CPU is this job's, not others'
        # load (autobyte.hostload; the transport's sampler excludes them)
        self.local_job_pids = (
            hostload.local_peer_pids(self._groups.decision) if self._groups.world > 1 else ()
        )
        # each rank's address (autobyte.tcplinks: the peer of a queued link, named by its rank)
        self.rank_addresses = (
            tcplinks.rank_addresses(self._groups.decision) if self._groups.world > 1 else {}
        )

        # "auto": derived from the gradients' bytes and the group's measured all-reduce cost
        # (autobyte.scheduler.start); the same on every rank
        config, self._start_cost = start.resolve(
            partition_bytes,
            credit_bytes,
            world=self._groups.world,
            group=self._groups.data,
            device=self._managed.device,
            dtype=self._managed.dtype,
            grad_bytes=sum(p.numel() * p.element_size() for p in params),
        )
        config = dataclasses.replace(config, tail_bytes=tail_bytes)
        # the per-collective cost the daemon's predictor reads (autobyte.records.Registration;
        # a few small all-reduces, ms)
        self._collective_latency_s = (
            start.measure_latency(self._groups.data, self._managed.device, self._managed.dtype)
            if self._groups.world > 1
            else 0.0
        )

        # Training-thread state.
        self._cycle = StepCycle(self._managed.n)
        self._progress = Progress(self._managed.n, self._groups.rank, self._settings.timeout_s)
        # ranks that disagree on the step count, or die, raise within seconds (`health`)
        self._health = (
            None
            if self._groups.world == 1
            else health.watchdog_for(
                self._groups.decision,
                self._groups.leader_global,
                self._groups.is_leader,
                self._groups.rank,
                self._groups.world,
                self._progress,
                lambda: self._cycle.index,
                self._settings.timeout_s,
            )
        )
        self._closed = False
        self._accumulation = Accumulation(self._managed.n)
        self._buffers = buffers_mod.BufferBroadcast(
            model, self._groups.buffers, broadcast_buffers and self._groups.world > 1
        )
        self._device_sync: device_sync.DeviceSync = device_sync.DeviceSync()
        self._engine: engine_mod.Engine | None = None  # built at the first step (engine.py)
        self._steps = StepLog(config)
        self._requests = ConfigRequests()
        if self._groups.is_leader:
            self._steps.log_config(0, config, 0)
        self._threads: list[threading.Thread] = []
        self._bridge = (
            ScalerBridge(
                grad_scaler,
                amp.Owner(
                    self,
                    self._optimizers,
                    lambda: self._cycle.index,
                    self.step,
                    self.synchronize,
                    self._synchronize_if_open,
                    self._wait_all_updated,
                    self._unscale_for_loop,
                ),
            )
            if grad_scaler is not None and grad_scaler.is_enabled()
            else None
        )

        # eager even inside a torch.compile'd forward (a graph break there: `compiled`)
        self._handles = [
            model.register_forward_pre_hook(
                tracking.CopySafeHook(compiled.run_eagerly(self._root_pre_hook)), prepend=True
            ),
            model.register_forward_hook(
                tracking.CopySafeHook(compiled.run_eagerly(self._root_hook))
            ),
        ]
        for i, p in enumerate(params):
            self._handles.append(
                p.register_post_accumulate_grad_hook(functools.partial(self._grad_hook, i))
            )
        for module in model.modules():
            own = tuple(
                dict.fromkeys(
                    index_of[p] for p in module.parameters(recurse=False) if p in index_of
                )
            )
            if own:
                self._handles.append(
                    module.register_forward_pre_hook(
                        tracking.CopySafeHook(functools.partial(self._forward_pre_hook, own))
                    )
                )
        # The wrapped optimizers are never stepped by the scheduler (its update thread steps
        # copies of them, without their hooks: update.py), so a step of one is the loop's own.
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(_stepped_directly))
        self._tracked = tracking.install(
            model, index_of, self._on_read
        )  # last: no read of ours after it
        grad_reads.manage(params, self._grad_read, self._grad_write)
        # The transport (autobyte.transport.session) attaches itself: streams to autobyted if
        # autobyte.init() was called (now or later); a no-op otherwise.
        hooks.scheduler_created(self)

    # ------------------------------------------------------------------ public API

    @property
    def model(self) -> nn.Module:
        """The wrapped model."""
        return self._model

    @property
    def process_group(self) -> Any:
        """The data-parallel process group."""
        return self._groups.pg

    @property
    def config(self) -> Config:
        """The configuration in effect for the step in progress (rank 0's, on every rank)."""
        return self._steps.current()[0]

    @property
    def start_cost(self) -> start.CollectiveCost | None:
        """The all-reduce cost measured at construction for an "auto" partition size (None when
        the sizes were given, or on one rank)."""
        return self._start_cost

    @property
    def collective_latency_s(self) -> float:
        """One small all-reduce on the data-parallel group (start.measure_latency), measured at
        construction: the slowest rank's seconds, the same on every rank; 0.0 on one rank."""
        return self._collective_latency_s

    @property
    def step_index(self) -> int:
        """Number of steps so far (their updates may still be landing): `step()` calls, and each
        second synchronising backward in a step (accumulation without `no_sync()`) counts one."""
        return self._cycle.index

    @property
    def optimizer(self) -> Any:
        """The wrapped optimizer (attach LR schedulers to it), or the list of them if a list was given."""
        return self._optimizer

    @property
    def param_groups(self) -> list[dict]:
        """The param groups of the wrapped optimizer(s), in order."""
        return [g for opt in self._optimizers for g in opt.param_groups]

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last clipped step (with `clip_grad_norm`)."""
        norm = self._engine.updater.last_grad_norm if self._engine is not None else None
        return None if norm is None else float(norm)

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped because of inf/NaN gradients (with `grad_scaler`)."""
        return self._engine.updater.skipped_steps if self._engine is not None else 0

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # torch.amp.GradScaler.step() asks this before treating us as an optimizer of its own.
        raise SchedulerError(
            "pass the GradScaler to ScheduledOptimizer(..., grad_scaler=scaler): the "
            "scheduler unscales the gradients itself once they are reduced"
        )

    def reconfigure(
        self,
        partition_bytes: int | None = _UNSET,
        credit_bytes: int | None = _UNSET,
        *,
        tail_bytes: int | None = _UNSET,
        decision_id: int | None = None,
        at_step: int | None = None,
    ) -> Config:
        """Request a configuration from the next step boundary on (or from step `at_step`, if that
        is later). Omitted values stay as they are.

        Bad values raise ValueError and change nothing. Rank 0's request is the one that takes
        effect (on every rank, at the same step); thread-safe. A newer request replaces a pending one.
        """
        for name, value in (("decision_id", decision_id), ("at_step", at_step)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        return self._requests.request(
            lambda base: Config(
                base.partition_bytes if partition_bytes is _UNSET else partition_bytes,
                base.credit_bytes if credit_bytes is _UNSET else credit_bytes,
                base.tail_bytes if tail_bytes is _UNSET else tail_bytes,
            ),
            self.config,
            0 if decision_id is None else decision_id,
            at_step or 0,
        )

    engine_name = "scheduler"  # autobyte.types.ENGINES: the Config fields its configurations set

    def apply_decision(self, config: Config, decision_id: int, at_step: int) -> Config:
        """A daemon's decision (autobyte/transport/control.py) as `reconfigure` takes it; a
        configuration of another engine's knobs is a ValueError and changes nothing."""
        config.for_engine(self.engine_name)
        return self.reconfigure(
            config.partition_bytes,
            config.credit_bytes,
            tail_bytes=config.tail_bytes,
            decision_id=decision_id,
            at_step=at_step,
        )

    def add_step_callback(self, fn: Callable[[StepMetrics], Any]) -> None:
        """Call fn(StepMetrics) on the training thread for each completed step (keep it cheap).

        Exceptions raised by fn are logged and swallowed.
        """
        if not callable(fn):
            raise ValueError("the step callback must be callable")
        self._steps.callbacks.append(fn)

    def last_step_metrics(self) -> StepMetrics | None:
        """Measurements of the most recent step whose updates have all landed."""
        self._steps.drain()
        return self._steps.last_metrics

    def step(self, closure: Any = None) -> None:
        """End the step: flush unused parameters, capture hyper-parameters, return at once."""
        if closure is not None:
            raise ValueError("step(closure) is not supported: the update runs per parameter, later")
        self._check_usable()
        self._check_frozen()
        if self._engine is None:
            self._finalize_layout()
        s = self._cycle.index
        if (
            self._bridge is not None
            and self._bridge.scaled_step != s
            and self._progress.produced_count
        ):
            raise SchedulerError(
                "grad_scaler is set but this step's loss was not scaled: call "
                "scaler.scale(loss).backward()"
            )
        snapshot = [
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            for opt in self._optimizers
        ]
        self._end_step(s, snapshot)
        for opt in self._optimizers:
            opt._opt_called = True  # what the LR scheduler's step tracker would set
        self._steps.drain()

    def _end_step(self, s: int, snapshot: list | None) -> None:
        """Close step s: flush unused parameters, hand the updater the step's hyper-parameters
        (None: a step whose reduced gradients carry into the next, `_carry_over`), fix the next
        step's configuration on rank 0."""
        progress = self._progress
        if progress.produced_count != self._managed.n:
            self._flush_unused(s)
        self._steps.record(s).t_step = time.perf_counter()
        self._engine.updater.post(StepHyperParameters(s, snapshot))
        if self._groups.is_leader:
            config, decision_id = self._steps.current()
            due = self._requests.due(s + 1)
            if due is not None:
                config, decision_id = due
                if due != self._steps.current():
                    self._steps.log_config(s + 1, config, decision_id)
            self._engine.dispatcher.step_boundary(s + 1, config, decision_id)
            if self._cycle.read_synced == s:  # a loop that reads its gradients reads them again
                self._engine.dispatcher.drain(s + 1)
        progress.produced_count = 0
        self._cycle.index = s + 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation, as DDP's `model.no_sync()`: backward passes inside keep their
        gradients in `param.grad` (summed over micro-batches); the next backward outside it sends
        the sum, partitioned and by priority as it appears, then `step()`:

            for k, micro in enumerate(micro_batches):
                with opt.no_sync() if k < len(micro_batches) - 1 else contextlib.nullcontext():
                    (loss_fn(model(micro)) / len(micro_batches)).backward()
            opt.step()

        The loss scaling stays the user's (the scheduler never rescales). If every backward of a
        step ran inside it, `step()` sends the accumulated gradients."""
        with self._accumulation.no_sync():
            yield

    @contextlib.contextmanager
    def unwrapped(self) -> Iterator[None]:
        """Forward passes inside run as DDP's unwrapped `ddp_model.module(...)` would: no buffer
        broadcast, and which later forward receives rank 0's buffers stays as it was (Hugging Face's
        Trainer evaluates the unwrapped model; see `autobyte.scheduler.buffers`)."""
        with self._buffers.outside_wrapper():
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: those of managed parameters read as None from now until the next
        backward (a gradient in flight is never touched); the others as `Optimizer.zero_grad`.
        Between `backward()` and `step()` it clears what DDP's clears there: the step then updates
        nothing, and micro-batch sums held under `no_sync()` are dropped."""
        s = self._cycle.index
        progress = self._progress
        n = self._managed.n
        if self._engine is not None and (progress.produced_count or self._cycle.backward_done == s):
            dropped = self._engine.updater.dropped
            for i in range(n):
                dropped[i] = s
        produced = progress.produced
        for i in range(n):
            self._cycle.cleared[i] = produced[i]
            param = self._managed.params[i]
            local = grad_reads.raw_grad(param)
            if local is not None and self._managed.owner[i] is not None:
                if set_to_none:
                    grad_reads.set_raw_grad(param, None)
                else:
                    local.detach_().zero_()
        managed = set(self._managed.params)
        for group in self.param_groups:
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
            timeout_s = self._settings.timeout_s
        elif not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self._progress.wait_updated_through(self._cycle.index, timeout_s)
        self._progress.raise_if_failed()
        self._steps.drain()

    def state_dict(self) -> Any:
        """The optimizer's state_dict (a list of them for a list of optimizers), after `synchronize()`."""
        self.synchronize()
        if isinstance(self._optimizer, list):
            return [opt.state_dict() for opt in self._optimizers]
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        """Load the optimizer's state (a list for a list of optimizers), after `synchronize()`."""
        self.synchronize()
        if isinstance(self._optimizer, list):
            if not isinstance(state_dict, (list, tuple)) or len(state_dict) != len(
                self._optimizers
            ):
                raise ValueError(
                    f"expected a list of {len(self._optimizers)} optimizer state dicts"
                )
            for opt, sd in zip(self._optimizers, state_dict):
                opt.load_state_dict(sd)
        else:
            self._optimizer.load_state_dict(state_dict)

    def _wait_all_updated(self) -> None:
        """Every update of every step so far has landed (used before loss scaling)."""
        if not self._closed:
            self._progress.wait_updated_through(self._cycle.index, self._settings.timeout_s)
            self._progress.raise_if_failed()

    def _synchronize_if_open(self) -> None:
        if not self._closed and self._progress.error is None:
            self.synchronize()

    def dispatch_stats(self) -> dict[str, float]:
        """Scheduler costs: own overhead vs backend launch per partition, decision channel."""
        engine = self._engine
        dispatcher, channel = (engine.dispatcher, engine.channel) if engine else (None, None)
        stats = dispatcher.stats if dispatcher is not None else None
        parts = (stats.parts if stats is not None else 0) or 1
        messages, send_ns, latency_ns, latency_n = (
            dispatcher.channel_stats() if dispatcher is not None else (0, 0, 0, 0)
        )
        return {
            "partitions": float(stats.parts if stats is not None else 0),
            # CPU time of the scheduler thread, without the backend's launch calls
            "scheduler_us_per_partition": (stats.sched_ns if stats else 0) / 1e3 / parts,
            # the all-reduce launch call (+ channel posts on rank 0): CPU time, and wall time
            "backend_launch_us_per_partition": (stats.backend_ns if stats else 0) / 1e3 / parts,
            "backend_launch_wall_us_per_partition": (stats.backend_wall_ns if stats else 0)
            / 1e3
            / parts,
            "channel_socket": float(channel is not None and channel.kind == "socket"),
            "channel_messages": float(messages),
            # rank 0: cost of posting one decision message (all followers) on the scheduler thread
            "channel_send_us_per_message": send_ns / 1e3 / messages if messages else 0.0,
            # followers: send-to-receive latency (wall clocks; meaningful on one host or with NTP)
            "channel_latency_us": latency_ns / 1e3 / latency_n if latency_n else 0.0,
            "native": float(self.hot_path == "native"),
            # row-sparse weights (sparse_rows): how many, and the reductions sent packed so far
            "sparse_rows_weights": float(len(self._managed.sparse_idx)),
            "sparse_rows_packed": float(stats.sparse_packed if stats is not None else 0),
        }

    def _set_sparse_rows(self, active: bool) -> None:
        """Row-sparse reduction on or off for every row-sparse weight (benchmarks pair the two in one
        run). Collective: every rank calls it after `synchronize()`, at the same step boundary."""
        for entry in self._engine.sparse if self._engine is not None else ():
            entry.active, entry.dense_streak = bool(active), 0
        if self.hot_path == "native":
            self._engine.dispatcher.engine.set_sparse_active(bool(active))

    @property
    def engine(self) -> engine_mod.Engine | None:
        """What the first step built (scheduler/engine.py: layout, channel, dispatcher, updater):
        for benchmarks and diagnostics (the native path's trace, the flat buffer); None before."""
        return self._engine

    @property
    def hot_path(self) -> str | None:
        """ "native" or "python": which per-partition hot path runs (decided collectively at the
        first backward pass; None before it). `hot_path_reason` says why not the native one."""
        return self._engine.hot_path if self._engine is not None else None

    @property
    def hot_path_reason(self) -> str:
        """Why the Python path runs ("" on the native path or before the first backward)."""
        return self._engine.hot_path_reason if self._engine is not None else ""

    def close(self) -> None:
        """Stop the scheduler threads (collective: every rank calls it) and remove the hooks."""
        if self._closed:
            return
        bound_s = min(self._settings.timeout_s, 60.0)
        failed = self._progress.error is not None
        stop_error: BaseException | None = None
        watchdog = self._health if self._threads else None
        if watchdog is not None:
            watchdog.closing(self._cycle.index)
        if self._threads and not failed:
            try:
                self.synchronize()
                if watchdog is not None:  # every rank closes at our step count, or all raise
                    watchdog.agree_on_close(bound_s)
            except BaseException as error:  # noqa: BLE001 - still stop the threads below
                stop_error = error
                self._progress.fail(error)
        stuck = self._stop(closed=stop_error is None and not failed, bound_s=bound_s)
        if stop_error is not None:
            raise stop_error
        if stuck and not failed:
            # the receiving thread of a follower waits on rank 0; it is a daemon thread
            real = [name for name in stuck if not name.endswith("receiver")]
            if real:
                raise SchedulerError(f"scheduler threads did not stop in time: {', '.join(real)}")
            logger.warning("decision receiver still waiting for rank 0's stop message: %s", stuck)

    def _end_at_exit(self, budget_s: float) -> None:
        """The process ends with this scheduler open (`autobyte.scheduler.process_exit`): the
        updates of every `step()` land, as DDP's have when `step()` returns, then the threads stop;
        within `budget_s`, never waiting for the other ranks to end too.

        Not collective: once every update has landed, every peer has issued this rank's
        collectives, so it is marked closed at its step count and a peer that steps on raises
        (the watchdog's mismatch). Updates that cannot land within the budget (a peer dead or
        stopped mid-step) mark this rank failed, which its peers raise on at once."""
        if self._closed:
            return
        deadline = time.monotonic() + budget_s
        landed = not self._threads
        if self._threads and self._progress.error is None:
            try:
                self._progress.wait_updated_through(self._cycle.index, budget_s)
                self._progress.raise_if_failed()
                self._steps.drain()
                landed = True
            except BaseException as error:  # noqa: BLE001 - the process ends anyway: say why
                logger.warning(
                    "rank %d ends at step %d with updates that did not land: %s",
                    self._groups.rank,
                    self._cycle.index,
                    error,
                )
                self._progress.fail(error)
        if landed and self._health is not None and self._threads:
            self._health.closing(self._cycle.index)
        self._stop(closed=landed, bound_s=max(0.5, deadline - time.monotonic()))

    def _stop(self, closed: bool, bound_s: float) -> list[str]:
        """Stop the threads (each bounded by `bound_s` in all), remove the hooks; the names of the
        threads still running."""
        process_exit.untrack(self)
        watchdog = self._health if self._threads else None
        self._closed = True
        if watchdog is not None:
            watchdog.stop(closed=closed)
        deadline = time.monotonic() + bound_s
        if self._engine is not None:
            self._engine.dispatcher.stop(bound_s)
            self._engine.updater.post(Stop())
        stuck = []
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                stuck.append(thread.name)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        tracking.uninstall(self._tracked)
        self._tracked = []
        grad_reads.release(self._managed.params)
        if self._bridge is not None:
            self._bridge.restore()
        if not stuck:
            self._device_sync.close()
        return stuck

    def __enter__(self) -> Self:
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

    def _broadcast_initial_state(self, with_buffers: bool) -> None:
        buffers = buffers_mod.synced_buffers(self._model) if with_buffers else []
        tensors = list(dict.fromkeys([*self._model.parameters(), *buffers]))
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.device, t.dtype), []).append(t)
        with torch.no_grad():
            for group in by_kind.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                dist.broadcast(flat, src=self._groups.leader_global, group=self._groups.pg)
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _finalize_layout(self) -> None:
        """Fix the flat layout (rank 0's first-use order), build the engine, start its threads."""
        order = list(self._cycle.order or [])
        order += [i for i in range(self._managed.n) if not self._cycle.seen[i]]
        self._cycle.order = None
        self._cycle.recording = False
        engine = engine_mod.build(
            engine_mod.agreed_order(order, self._groups, self._managed),
            self._groups,
            self._managed,
            engine_mod.UpdateSettings(
                self._optimizers,
                self._settings.clip,
                self._settings.clip_norm_type,
                self._settings.scaler if self._bridge is not None else None,
                self._cycle.local_used,
            ),
            self._progress,
            self._steps,
            self._settings.timeout_s,
            self._settings.native,
        )
        self._device_sync = engine.device_sync
        self._engine = engine
        self._start_threads(self._cycle.index)

    def _start_threads(self, start_step: int) -> None:
        def spawn(name: str, target: Callable, args: tuple) -> None:
            thread = threading.Thread(
                target=target, args=args, daemon=True, name=f"autobyte-r{self._groups.rank}-{name}"
            )
            self._threads.append(thread)
            thread.start()

        process_exit.track(self, self._end_at_exit)
        self._engine.dispatcher.start(start_step, spawn)
        spawn("update", self._engine.updater.main, ())
        if self._health is not None:
            self._health.start(spawn)

    # ------------------------------------------------------------------ hooks (training thread)

    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        s = self._cycle.index
        if self._cycle.forward_seen != s:
            self._cycle.forward_seen = s
            self._check_frozen()
        if compiled.called_from_compiled_code():
            # the compiled graph reads parameters without our hooks: every update first
            everything = tuple(range(self._managed.n))
            for i in everything:
                self._cycle.read_step[i] = s
            self._wait_params(everything, s)
            if self._device_sync.cuda:
                self._device_sync.before_read(everything, s)
        rec = self._steps.records.get(s)
        if rec is None or rec.t_forward is None:
            self._steps.record(s).t_forward = time.perf_counter()
        if self._cycle.order is not None:
            self._cycle.recording = True
        self._buffers.before_forward()

    def _root_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self._accumulation.after_forward(torch.is_grad_enabled())
        self._buffers.after_forward(synchronising=not self._accumulation.active)

    def _check_frozen(self) -> None:
        """A parameter frozen at construction and unfrozen since would train unsynchronised."""
        for name, p in self._managed.frozen:
            if p.requires_grad:
                raise SchedulerError(
                    f"parameter {name!r} was frozen (requires_grad=False) when this ScheduledOptimizer "
                    f"was built and requires a gradient now (step {self._cycle.index}): its gradient would "
                    "never be synchronised. After changing requires_grad, build a new one, as a DDP "
                    "model must be re-wrapped: opt.close(); opt = ScheduledOptimizer(model, optimizer, "
                    "...) (the optimizer keeps its state)"
                )

    def _forward_pre_hook(self, own: tuple[int, ...], module: nn.Module, args: Any) -> None:
        self._on_read(own, False)

    def _on_read(self, idxs: tuple[int, ...], iterating: bool) -> None:
        """A read of managed parameters (tracking, module pre-hooks): record the first-use order,
        mark them read in this step, and wait for their pending updates."""
        if torch.compiler.is_compiling():
            return  # traced by torch.compile: the root pre-hook waited, eagerly (`compiled`)
        s = self._cycle.index
        if self._cycle.recording:
            seen = self._cycle.seen
            for i in idxs:
                if not seen[i]:
                    seen[i] = True
                    self._cycle.order.append(i)
        read_step = self._cycle.read_step
        for i in idxs:
            read_step[i] = s
        progress = self._progress
        if progress.updated_through >= s or progress.ready(idxs, s):
            if self._device_sync.cuda:
                self._device_sync.before_read(idxs, s)
            return
        if iterating and tracking.called_from_zero_grad():
            return  # Module.zero_grad() only touches .grad, which the scheduler owns
        self._wait_params(idxs, s)
        if self._device_sync.cuda:
            self._device_sync.before_read(idxs, s)

    def _wait_params(self, idxs: tuple[int, ...], s: int) -> None:
        blocked = self._progress.wait_params(idxs, s)
        if blocked:
            rec = self._steps.record(s)
            rec.blocked_s += blocked
            if rec.t_backward is None:  # still in the forward pass (no gradient yet)
                rec.blocked_forward_s += blocked

    def _grad_hook(self, i: int, param: torch.Tensor) -> None:
        progress = self._progress
        if (
            not self._closed
            and progress.produced[i] >= self._cycle.index
            and self._accumulation.local()
        ):
            # a misuse: raised at the backward that reveals it (and kept for step()); this
            # parameter's gradient of the step is already sent, so the collectives are unaffected
            error = self._accumulation.second_gradient(self._managed.names[i], self._cycle.index)
            progress.fail(error)
            raise error
        try:
            if self._closed:
                return
            if progress.produced[i] >= self._cycle.index:
                self._carry_over()
            s = self._cycle.index
            if self._cycle.read_step[i] != s:
                raise SchedulerError(
                    f"parameter {self._managed.names[i]!r} received a gradient in step {s} but was never read "
                    "through its module in that step (a tensor reference kept elsewhere?), so the "
                    "scheduler cannot make that read wait for its update; read it as an attribute of "
                    "its module (e.g. self.layer.weight) inside the forward pass"
                )
            if progress.param_step[i] < s:
                self._wait_params((i,), s)
            if self._accumulation.keep_local(i, s):
                return  # inside no_sync(): autograd sums the micro-batches in param.grad
            if self._engine is None:
                self._finalize_layout()
            if self._cycle.backward_end_queued != s:
                self._cycle.backward_end_queued = s
                torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            grad = grad_reads.raw_grad(param)
            if grad is None:
                raise SchedulerError("the gradient vanished before the scheduler's hook ran")
            self._hand_off(i, grad, s)
        except BaseException as error:  # an Exception is surfaced at the next step()/synchronize()
            self._keep_sequence(i, error)
            if not isinstance(error, Exception):
                # Ctrl-C (KeyboardInterrupt) or a signal handler's sys.exit() that landed inside
                # this hook: it goes on out of backward(), as it would with DDP, so the script
                # ends with the interrupt's exit status, not as a scheduler failure
                raise

    def _carry_over(self) -> None:
        """A second synchronising backward in step s (a gradient of a parameter whose step-s
        gradient is already sent, outside no_sync()): DDP all-reduces again what `.grad` holds then,
        the reduced gradient plus this backward's, and the optimizer steps on the sum. So step s
        ends here without an update (the updater marks each parameter done as its slice lands) and
        step s+1 starts, whose gradients add to step s's reduced ones as they are handed off
        (`_carried`): DDP's sums to the bit, one more synchronisation, as DDP pays. Reads of this backward's forward were of step s; they count for s+1 (no update
        between)."""
        s = self._cycle.index
        self._end_step(s, None)
        read_step = self._cycle.read_step
        for i in range(self._managed.n):
            if read_step[i] == s:
                read_step[i] = s + 1
        if self._bridge is not None and self._bridge.scaled_step == s:
            self._bridge.scaled_step = s + 1

    def _carried(self, i: int, s: int) -> torch.Tensor | None:
        """What DDP's `.grad` of parameter i still holds from step s-1 when step s's gradient is
        added to it: its reduced gradient, unless a `zero_grad()` or an assignment cleared it (every
        usual loop does, and then this is None at no cost) — in a carry step (`_carry_over`), or
        in a loop that never clears its gradients. None also where the tensor autograd left in the
        field already includes it (parameters outside the wrapped optimizers,
        `_on_backward_end`)."""
        if s == 0 or self._cycle.cleared[i] >= s - 1 or self._managed.owner[i] is None:
            return None
        if self._progress.param_step[i] < s:
            self._wait_params((i,), s)
        if self._device_sync.cuda:
            self._device_sync.before_read((i,), s)
        return self._reduced_grad(i, s - 1)

    def _hand_off(self, i: int, grad: torch.Tensor | None, s: int) -> None:
        """Copy parameter i's gradient of step s into the flat buffer and hand it to dispatch; in a
        carry step, added to the previous step's reduced gradient first (`_carry_over`); None: no
        gradient of this rank, only a carried one."""
        if grad is not None and grad.layout != torch.strided:
            raise SchedulerError("sparse gradients are not supported")
        layout = self._engine.layout
        carried = self._carried(i, s)
        if grad is None:
            grad = carried
        elif carried is not None:
            grad = grad + carried  # autograd's accumulation into DDP's `.grad`
        with torch.no_grad():
            if self._groups.world == 1:
                layout.grad_views[i].copy_(grad)
            else:
                torch.mul(grad, 1.0 / self._groups.world, out=layout.grad_views[i])
            layout.flag_views[i].fill_(1.0)
        if self._device_sync.cuda:
            self._device_sync.after_grad_copy(i)
        self._cycle.local_used[i] = s
        grad_reads.set_raw_grad(self._managed.params[i], None)
        self._post_grad(i, s)

    def _keep_sequence(self, i: int, error: BaseException) -> None:
        """A failed gradient hook: keep the error for step() and the collectives going."""
        progress = self._progress
        progress.fail(error)
        if self._engine is not None and progress.produced[i] < self._cycle.index:
            # keep the collective sequence going for the other ranks: a zero contribution
            self._engine.layout.ext_views[i].zero_()
            grad_reads.set_raw_grad(self._managed.params[i], None)
            self._post_grad(i, self._cycle.index)

    def _post_grad(self, i: int, s: int) -> None:
        progress = self._progress
        now = time.perf_counter()
        if progress.produced_count == 0:
            rec = self._steps.record(s)
            if rec.t_backward is None:
                rec.t_backward = now
        progress.produced_t[i] = now
        progress.produced[i] = s
        progress.produced_count += 1
        self._engine.dispatcher.grad_ready(i, s)

    def _flush_unused(self, s: int) -> None:
        """Parameters without a gradient this step contribute zeros (flag 0); those holding
        no_sync() micro-batch gradients that no later backward reached send them."""
        progress = self._progress
        accumulation = self._accumulation
        for i in range(self._managed.n):
            if progress.produced[i] < s:
                if progress.param_step[i] < s:
                    self._wait_params((i,), s)
                grad = grad_reads.raw_grad(self._managed.params[i])
                if accumulation.holds(i, s) and grad is not None:
                    self._hand_off(i, grad, s)
                    continue
                # DDP sends what `.grad` holds: the field's tensor, else a carried gradient
                if grad is not None or self._carried(i, s) is not None:
                    self._hand_off(i, grad, s)
                    continue
                self._engine.layout.ext_views[i].zero_()
                if self._device_sync.cuda:
                    self._device_sync.after_grad_copy(i)
                self._post_grad(i, s)

    def _on_backward_end(self) -> None:
        """End of the backward pass (autograd engine callback, only with parameters outside the
        wrapped optimizers): flush unused parameters, then hand those parameters their averaged
        gradient in `.grad`, as DDP does by the time backward() returns."""
        s = self._cycle.index
        try:
            if self._closed:
                return
            self._cycle.backward_done = s
            if not self._managed.uncovered_idx:
                return
            if self._progress.produced_count != self._managed.n:
                self._flush_unused(s)
            idxs = self._managed.uncovered_idx
            self._progress.wait_reduced(idxs, s)
            layout = self._engine.layout
            maybe = [i for i in idxs if self._cycle.local_used[i] != s]
            flags = layout.flat[[layout.flag_index(i) for i in maybe]].tolist() if maybe else []
            unused = {i for i, flag in zip(maybe, flags) if flag <= 0}
            with torch.no_grad():
                for i in idxs:
                    if i not in unused:
                        grad_reads.set_raw_grad(
                            self._managed.params[i], layout.grad_views[i].clone()
                        )
        except BaseException as error:
            self._progress.fail(error)
            raise

    # ------------------------------------------------------------------ reads of .grad

    def _grad_read(self, i: int) -> torch.Tensor | None:
        """`params[i].grad` while its field holds None: the gradient DDP would hold (`grad_reads`)."""
        if self._closed or self._engine is None:
            return None
        s = self._cycle.index
        produced = self._progress.produced[i]
        if produced >= s or self._cycle.backward_done == s:  # between backward() and step()
            self._check_usable()
            if self._cycle.backward_done != s:
                raise SchedulerError(
                    f"the gradient of {self._managed.names[i]!r} was read inside backward() after the "
                    "scheduler took it: the reduced value is not known before backward() returns "
                    "(DDP's is not either); read gradients after backward()"
                )
            self._sync_for_read(s)
            return self._reduced_grad(i, s)
        last = s - 1
        if produced < last or self._cycle.cleared[i] >= produced:
            return None
        if tracking.called_from_zero_grad():
            self._cycle.cleared[i] = produced  # zero_grad() reads it only to clear it
            return None
        self._check_usable()
        self._wait_params((i,), s)  # its update has landed: the buffer's view is stable now
        return self._reduced_grad(i, last)

    def _sync_for_read(self, s: int) -> None:
        """The first read of step s's gradients: send those not produced, wait for every slice."""
        if self._cycle.read_synced == s:
            return
        if self._groups.is_leader:
            self._engine.dispatcher.drain(s)  # the rest of the step as few collectives as can be
        if self._progress.produced_count != self._managed.n:
            self._flush_unused(s)
        self._progress.wait_step_reduced(s)
        if self._device_sync.cuda:
            torch.cuda.synchronize(
                self._managed.device
            )  # the reduction's stream, before the user's
        self._cycle.read_synced = s

    def _reduced_grad(self, i: int, s: int) -> torch.Tensor | None:
        """Step s's averaged gradient of parameter i; None where no rank used it, or dropped."""
        layout = self._engine.layout
        if self._engine.updater.dropped[i] == s or self._cycle.cleared[i] >= s:
            return None
        if self._managed.owner[i] is None:
            return None  # handed back in `.grad` at the end of backward; not there: unused
        if self._cycle.local_used[i] != s and float(layout.flat[layout.flag_index(i)]) <= 0:
            return None
        return layout.grad_views[i]

    def _unscale_for_loop(self, scaler: Any, optimizer: Any) -> None:
        """`scaler.unscale_(optimizer)` before step() (amp.py): unscale this step's reduced
        gradients, every wrapped optimizer's at the first call (one found_inf for the step)."""
        from autobyte.scheduler.update import unscale

        s = self._cycle.index
        if self._cycle.unscaled_by[0] != s:
            self._cycle.unscaled_by = (s, [])
        if any(optimizer is o for o in self._cycle.unscaled_by[1]):
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        self._cycle.unscaled_by[1].append(optimizer)
        if s in self._engine.updater.unscaled:
            return
        if scaler._scale is None:
            raise SchedulerError("scaler.unscale_() before scaler.scale(loss)")
        grads = [  # reads of the optimizers' gradients: reduced (grad_reads)
            g
            for i, p in enumerate(self._managed.params)
            if self._managed.owner[i] is not None and (g := p.grad) is not None
        ]
        self._engine.updater.unscaled[s] = unscale(scaler._scale, grads)

    def _grad_write(self, i: int, value: torch.Tensor | None) -> None:
        """`params[i].grad = value` while its field holds None (`grad_reads`)."""
        if self._closed or self._engine is None:
            grad_reads.set_raw_grad(self._managed.params[i], value)
            return
        s = self._cycle.index
        produced = self._progress.produced[i]
        if produced >= s or self._cycle.backward_done == s:  # between backward() and step()
            self._check_usable()
            self._sync_for_read(s)
            if value is None:
                self._engine.updater.dropped[i] = s
                return
            if self._reduced_grad(i, s) is None:
                raise SchedulerError(
                    f"a gradient was assigned to {self._managed.names[i]!r}, which no rank used in this "
                    "step: its update cannot be added after backward(); assign it before "
                    "backward() or to a parameter that has a gradient"
                )
            with torch.no_grad():
                self._engine.layout.grad_views[i].copy_(value)
            return
        # the reduced gradient `.grad` held is gone (`_carried`); a tensor takes its place, and
        # autograd accumulates into it, as into DDP's
        self._cycle.cleared[i] = max(self._cycle.cleared[i], produced)
        if value is not None:
            grad_reads.set_raw_grad(self._managed.params[i], value)

    # ------------------------------------------------------------------ errors

    def _check_usable(self) -> None:
        if self._closed:
            raise SchedulerError("this ScheduledOptimizer is closed")
        self._progress.raise_if_failed()
