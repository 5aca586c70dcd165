"""`Accelerator`: an `accelerate.Accelerator` whose gradient sync is autobyte's scheduler instead of DDP.

    from autobyte.accelerate import Accelerator          # was: from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2,
                              clip_grad_norm=1.0)          # the scheduler's settings are optional
    model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()

Under a multi-process launch (`torchrun`, `accelerate launch`) `prepare` leaves the model
unwrapped (mixed precision, device placement and `torch.compile` as accelerate does them, no
`DistributedDataParallel`) and builds a `ScheduledOptimizer` over the model and its prepared
optimizer; the prepared optimizer's `step()` is the scheduler's. Single-process runs are plain
accelerate. The parameters are DDP's to the bit. How accelerate's calls map to the scheduler's:

* `backward`: accelerate's own (loss / accumulation steps, GradScaler); the gradients go out as
  autograd produces them.
* `accumulate` / `no_sync`: the scheduler's `no_sync()`, as DDP's `model.no_sync()`.
* `clip_grad_norm_(params, max_norm)`, `clip_grad_value_`, `unscale_gradients`, any read of
  `.grad` after `backward`: accelerate's own, on the gradients DDP would hold (a read waits for the
  reduced gradients, the wait DDP pays at every backward: `autobyte.scheduler.grad_reads`), so the
  norm returned and the parameters are DDP's. `Accelerator(clip_grad_norm=max_norm)` is an
  optimisation: the scheduler clips once reduced, without that wait; `clip_grad_norm_` with the same
  value then returns None (`last_grad_norm()` has the norm after the step).
* fp16 (`GradScaler`): handed to the scheduler, which unscales, skips inf/NaN steps on every rank
  alike and updates the scale; `optimizer.step_was_skipped` (which the LR scheduler reads) waits for
  the step's updates, so an fp16 step does not overlap the next forward pass.
* `save_state` / `load_state` / `get_state_dict`: after every pending update landed.
* `end_training()`: closes the schedulers (collective) and the autobyted session it opened.

FSDP2 (`fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)`, or `accelerate launch` with
an FSDP2 config): `prepare` shards the model as accelerate does (`fully_shard` per its wrap policy,
the optimizer switched to the sharded parameters), then attaches autobyte to it
(`autobyte.fsdp.attach(model, optimizer, memory_budget_bytes=...)`): every step measured and, with
a daemon, streamed as an FSDP2 job whose prefetch depths and resharding autobyted tunes. The
arithmetic stays accelerate's FSDP2 (the knobs move when collectives run, never what they
compute); `clip_grad_norm_`, `accumulate` (FSDP2's `set_requires_gradient_sync`), mixed precision
and checkpoints are accelerate's own. accelerate 1.16 turns the plugin on only on an accelerator
(on CPU it runs the job as plain data parallelism, the plugin ignored); this Accelerator turns it
on under a multi-process CPU launch too (gloo runs FSDP2's collectives), so a script behaves the
same on both.

Refused with a ValueError (never silently different): distributed types other than DDP's and
FSDP2 (FSDP1, DeepSpeed, XLA, tensor, context or replicated-shard parallelism), DDP
communication hooks (they change the numbers), a clipping norm other than the one given to the
constructor, the scheduler's settings on an FSDP2 job or a memory budget on a DDP-style one.

Buffers (BatchNorm statistics): `DistributedDataParallelKwargs(broadcast_buffers=...)` (default True)
becomes the scheduler's `broadcast_buffers`, which copies rank 0's buffers as DDP does.

`accelerate` is an optional extra (`pip install 'autobyte[hf]'`), never a dependency of the core.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

try:
    import accelerate
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import PartialState
    from accelerate.utils import (
        DDPCommunicationHookType,
        DistributedType,
        FullyShardedDataParallelPlugin,
    )
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "autobyte.accelerate needs accelerate: pip install 'autobyte[hf]' "
        f"(or `pip install accelerate` next to the torch you use) ({error})"
    ) from error

from autobyte.scheduler import ScheduledOptimizer
from autobyte.scheduler.start import Requested

logger = logging.getLogger(__name__)

__all__ = ["Accelerator"]

# the distributed types whose data parallelism is DDP's, which the scheduler replaces
_DDP_TYPES = frozenset({DistributedType.MULTI_CPU, DistributedType.MULTI_GPU})


class Accelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` with autobyte's scheduler as the gradient sync (see the module doc).

    Args:
        partition_bytes, credit_bytes, tail_bytes: the scheduler's starting configuration
            (`autobyte.types.Config`; "auto", the default, as `ScheduledOptimizer`'s; the tuner
            may change it when a daemon is connected).
        clip_grad_norm: clip the reduced gradients to this global norm (None: no clipping);
            `clip_grad_norm_` calls must pass the same value. clip_norm_type: its norm.
        job, daemon, token, tune: if `job` or `daemon` is given, `autobyte.init(daemon, job, token,
            tune=tune)` runs when the first scheduler is built, and `end_training()` shuts it down.
        timeout_s, native: as `ScheduledOptimizer`'s.
        memory_budget_bytes: an FSDP2 job's budget of gathered parameters
            (`autobyte.fsdp.attach`'s: a configuration predicted to exceed it is never applied).
        The remaining arguments are accelerate's `Accelerator`'s.
    """

    def __init__(
        self,
        *args: Any,
        partition_bytes: int | str | None = "auto",
        credit_bytes: int | str | None = "auto",
        tail_bytes: int | None = None,
        clip_grad_norm: float | None = None,
        clip_norm_type: float = 2.0,
        job: str | None = None,
        daemon: str | None = None,
        token: str | None = None,
        tune: bool = True,
        timeout_s: float = 300.0,
        native: bool = True,
        memory_budget_bytes: int | None = None,
        **kwargs: Any,
    ) -> None:
        from autobyte.fsdp import check_memory_budget

        check_memory_budget(memory_budget_bytes)
        self._memory_budget = memory_budget_bytes
        self._requested = (partition_bytes, credit_bytes, tail_bytes)
        self._config = Requested(
            partition_bytes, credit_bytes, tail_bytes
        )  # ValueError naming a bad value
        if clip_grad_norm is not None and not (
            isinstance(clip_grad_norm, (int, float))
            and not isinstance(clip_grad_norm, bool)
            and 0 < clip_grad_norm < math.inf
        ):
            raise ValueError(
                f"clip_grad_norm must be a positive finite norm or None, got {clip_grad_norm!r}"
            )
        if not (
            isinstance(timeout_s, (int, float))
            and not isinstance(timeout_s, bool)
            and 0 < timeout_s < math.inf
        ):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        for name, value in (("job", job), ("daemon", daemon), ("token", token)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if daemon is not None:
            from autobyte.channel import daemon_addresses

            daemon_addresses(daemon)  # ValueError for a malformed address, before anything starts
        self._clip = None if clip_grad_norm is None else float(clip_grad_norm)
        self._clip_norm_type = float(clip_norm_type)
        self._timeout_s = float(timeout_s)
        self._native = bool(native)
        self._daemon_args = (
            (daemon, job, token, bool(tune)) if job is not None or daemon is not None else None
        )
        self._session_started = False
        self._scheduled: dict[int, ScheduledOptimizer] = {}  # id(model) -> its scheduler
        self._sharded: dict[int, Any] = {}  # id(model) -> its autobyte.fsdp.ShardedJob
        plugin = kwargs.get("fsdp_plugin")
        if plugin is None and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            plugin = kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin()  # as accelerate's
        super().__init__(*args, **kwargs)
        self._scheduling = self.use_distributed and self.num_processes > 1
        if self._scheduling and plugin is not None and plugin.fsdp_version != 2:
            raise ValueError(
                f"fsdp_plugin with fsdp_version={plugin.fsdp_version}: autobyte tunes FSDP2; "
                "pass FullyShardedDataParallelPlugin(fsdp_version=2) (the same arithmetic), or "
                "use accelerate's own Accelerator for FSDP1"
            )
        if (
            plugin is not None
            and self.device.type == "cpu"
            and self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.FSDP)
            and getattr(self.state, "fsdp_plugin", None) is None
        ):
            self._shard_on_cpu(plugin)
        self._sharding = self._scheduling and getattr(self.state, "fsdp_plugin", None) is not None
        if self._scheduling:
            self._check_supported()

    # ------------------------------------------------------------------ what users read

    @property
    def schedulers(self) -> list[ScheduledOptimizer]:
        """The `ScheduledOptimizer`s built by `prepare` (one per prepared model with an optimizer)."""
        return list(self._scheduled.values())

    @property
    def clip_grad_norm(self) -> float | None:
        """The global norm the schedulers clip the reduced gradients to (None: no clipping)."""
        return self._clip

    def scheduled_optimizer(self, model: nn.Module) -> ScheduledOptimizer | None:
        """The scheduler of a prepared model (None: not scheduled)."""
        return self._scheduled.get(id(self.unwrap_model(model)))

    @property
    def sharded_jobs(self) -> list[Any]:
        """The `autobyte.fsdp.ShardedJob`s `prepare` attached (one per FSDP2 model with an optimizer)."""
        return list(self._sharded.values())

    def sharded_job(self, model: nn.Module) -> Any:
        """The `autobyte.fsdp.ShardedJob` of a prepared FSDP2 model (None: not attached)."""
        return self._sharded.get(id(_uncompiled(model)))

    def last_grad_norm(self, model: nn.Module | None = None) -> float | None:
        """The global gradient norm before clipping of the last step, after it landed (with
        `clip_grad_norm`); `model` may be omitted when one model is scheduled."""
        scheduled = self._only_scheduler() if model is None else self.scheduled_optimizer(model)
        if scheduled is None:
            return None
        scheduled.synchronize()
        return scheduled.last_grad_norm

    def synchronize(self) -> None:
        """Wait until every pending update of every scheduler landed (checkpoints, timings)."""
        for scheduled in self._scheduled.values():
            scheduled.synchronize()

    # ------------------------------------------------------------------ prepare

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        result = super().prepare(*args, device_placement=device_placement)
        if self._sharding:
            self._attach_prepared()
        elif self._scheduling:
            self._schedule_prepared()
        return result

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        # evaluation_mode: accelerate's preparation minus the DistributedDataParallel wrapper
        return super().prepare_model(
            model,
            device_placement=device_placement,
            evaluation_mode=evaluation_mode or (self._scheduling and not self._sharding),
        )

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> Any:
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self._scheduling and not self._sharding and type(prepared) is AcceleratedOptimizer:
            prepared.__class__ = _ScheduledStepOptimizer  # no state of its own beyond `scheduled`
            prepared.scheduled = None
        return prepared

    def _schedule_prepared(self) -> None:
        """A scheduler for every prepared optimizer whose model is prepared too."""
        for prepared in self._optimizers:
            if not isinstance(prepared, _ScheduledStepOptimizer) or prepared.scheduled is not None:
                continue
            held = {id(p) for group in prepared.param_groups for p in group["params"]}
            model = next((m for m in self._models if held <= {id(p) for p in m.parameters()}), None)
            if model is None:
                continue  # its model is prepared later
            if id(model) in self._scheduled:
                raise ValueError(
                    f"{type(model).__name__} already has a prepared optimizer: with "
                    "autobyte.accelerate.Accelerator a model trains with one optimizer; "
                    "put the parameter groups into one optimizer"
                )
            prepared.scheduled = self._build_scheduler(model, prepared)
            self._scheduled[id(model)] = prepared.scheduled

    def _attach_prepared(self) -> None:
        """autobyte on every prepared FSDP2 model whose optimizer is prepared too."""
        import autobyte.fsdp

        for prepared in self._optimizers:
            held = {id(p) for group in prepared.param_groups for p in group["params"]}
            model = next(
                (
                    m
                    for m in map(_uncompiled, self._models)
                    if held <= {id(p) for p in m.parameters()}
                ),
                None,
            )
            if model is None or id(model) in self._sharded:
                continue  # its model is prepared later, or attached already
            self._start_session()
            self._sharded[id(model)] = autobyte.fsdp.attach(
                model, prepared.optimizer, memory_budget_bytes=self._memory_budget
            )
            logger.info(
                "autobyte on FSDP2, rank %d/%d: %s",
                self.process_index,
                self.num_processes,
                self._sharded[id(model)].config.describe(),
            )

    def _start_session(self) -> None:
        if self._daemon_args is not None and not self._session_started:
            import autobyte

            daemon, job, token, tune = self._daemon_args
            autobyte.init(daemon, job, token, tune=tune)
            self._session_started = True

    def _shard_on_cpu(self, plugin: FullyShardedDataParallelPlugin) -> None:
        """accelerate's FSDP2 path under a CPU launch, where accelerate ignores the plugin (also
        where an earlier FSDP2 Accelerator of this process left PartialState's type at FSDP)."""
        state = self.state
        state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)
        state.fsdp_plugin = plugin

    def _build_scheduler(
        self, model: nn.Module, prepared: AcceleratedOptimizer
    ) -> ScheduledOptimizer:
        self._start_session()
        scaler = self.scaler if self.scaler is not None and self.scaler.is_enabled() else None
        scheduled = ScheduledOptimizer(
            model,
            prepared.optimizer,
            self._config.partition_bytes,
            self._config.credit_bytes,
            clip_grad_norm=self._clip,
            clip_norm_type=self._clip_norm_type,
            timeout_s=self._timeout_s,
            grad_scaler=scaler,
            native=self._native,
            tail_bytes=self._config.tail_bytes,
            broadcast_buffers=self._broadcast_buffers(),
        )
        logger.info(
            "autobyte scheduler on rank %d/%d: %s%s",
            self.process_index,
            self.num_processes,
            scheduled.config.describe(),
            "" if self._clip is None else f", clip_grad_norm={self._clip:g}",
        )
        return scheduled

    def _check_supported(self) -> None:
        if self._sharding:
            self._check_sharded()
            return
        if self._memory_budget is not None:
            raise ValueError(
                f"memory_budget_bytes={self._memory_budget!r} bounds an FSDP2 job's gathered "
                "parameters; this job is not sharded (no fsdp_plugin): remove it"
            )
        if self.distributed_type not in _DDP_TYPES or (
            getattr(self, "parallelism_config", None) is not None
            and self.parallelism_config.total_size > 1
        ):
            raise ValueError(
                f"autobyte.accelerate.Accelerator replaces DDP's gradient sync; "
                f"distributed_type={self.distributed_type.value} (or a parallelism_config) "
                "is not DDP: use accelerate's own Accelerator for it"
            )
        handler = self.ddp_handler
        if handler is not None and (
            handler.comm_hook != DDPCommunicationHookType.NO
            or handler.comm_wrapper != DDPCommunicationHookType.NO
        ):
            raise ValueError(
                f"DistributedDataParallelKwargs(comm_hook={handler.comm_hook.value!r}, "
                f"comm_wrapper={handler.comm_wrapper.value!r}) changes the reduced "
                "gradients, which the scheduler does not reproduce: remove the comm hook"
            )

    def _check_sharded(self) -> None:
        given = [
            f"{name}={value!r}"
            for name, value, default in zip(
                ("partition_bytes", "credit_bytes", "tail_bytes"),
                self._requested,
                ("auto", "auto", None),
                strict=True,
            )
            if value != default
        ]
        if self._clip is not None:
            given.append(f"clip_grad_norm={self._clip!r}")
        if given:
            raise ValueError(
                f"{', '.join(given)}: the DDP-style scheduler's settings, and this job is "
                "FSDP2 (its knobs are prefetch and resharding, set by autobyte.fsdp): remove "
                "them (clip with accelerator.clip_grad_norm_ in the loop)"
            )
        config = self.parallelism_config
        if config is not None and (
            config.tp_enabled or config.cp_enabled or config.dp_replicate_enabled
        ):
            raise ValueError(
                f"parallelism_config {config!r}: autobyte tunes FSDP2 sharded over every "
                "rank (dp_shard only); tensor, context and replicated-shard parallelism are "
                "not supported: use accelerate's own Accelerator for them"
            )

    def _broadcast_buffers(self) -> bool:
        return True if self.ddp_handler is None else bool(self.ddp_handler.broadcast_buffers)

    def _only_scheduler(self) -> ScheduledOptimizer | None:
        if len(self._scheduled) > 1:
            raise ValueError("several models are scheduled: pass the model")
        return next(iter(self._scheduled.values()), None)

    # ------------------------------------------------------------------ the training step

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        scheduled = self.scheduled_optimizer(model) if self._scheduling else None
        if scheduled is None:
            with super().no_sync(model):
                yield
            return
        with scheduled.no_sync():
            yield

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        if not self._scheduled or self._clip is None:
            # accelerate's own: unscale, then torch's clip on the gradients DDP would hold (a read
            # of `.grad` waits for the reduced gradients: autobyte.scheduler.grad_reads)
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        if max_norm == math.inf:
            return None  # a norm without clipping (Trainer's max_grad_norm=0): known only after the step
        if (
            self._clip is None
            or float(max_norm) != self._clip
            or float(norm_type) != self._clip_norm_type
        ):
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}): this Accelerator "
                f"was built with clip_grad_norm={self._clip}, clip_norm_type="
                f"{self._clip_norm_type}, which the scheduler applies after the reduction; "
                "call clip_grad_norm_ with those values, or build it without clip_grad_norm= "
                "(then clip_grad_norm_ clips as accelerate's does)"
            )
        return None  # clipped by the scheduler once reduced: last_grad_norm() after the step

    # ------------------------------------------------------------------ checkpoints and the end

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        self.synchronize()
        return super().get_state_dict(model, unwrap=unwrap)

    def save_state(
        self,
        output_dir: str | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> Any:
        self.synchronize()
        return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)

    def load_state(
        self,
        input_dir: str | None = None,
        load_kwargs: dict | None = None,
        **load_model_func_kwargs: Any,
    ) -> Any:
        self.synchronize()
        return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)

    def close_schedulers(self) -> None:
        """Wait for the last updates and stop every scheduler, detach every FSDP2 job (collective:
        every rank calls it); a later `prepare` builds new ones. Also shuts down the autobyted session opened here."""
        schedulers, self._scheduled = list(self._scheduled.values()), {}
        sharded, self._sharded = list(self._sharded.values()), {}
        for prepared in self._optimizers:
            if isinstance(prepared, _ScheduledStepOptimizer):
                prepared.scheduled = None
        try:
            for scheduled in schedulers:
                scheduled.close()
            for job in sharded:
                job.close()
        finally:
            if self._session_started:
                import autobyte

                autobyte.shutdown()
                self._session_started = False

    def end_training(self) -> None:
        self.close_schedulers()
        super().end_training()


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module `torch.compile` wraps (FSDP2's root), else the module itself."""
    return getattr(model, "_orig_mod", model)


class _ScheduledStepOptimizer(AcceleratedOptimizer):
    """A prepared optimizer whose step is its `ScheduledOptimizer`'s (set once its model is prepared)."""

    scheduled: ScheduledOptimizer | None

    def step(self, closure: Any = None) -> None:
        scheduled = self.scheduled
        if scheduled is None:
            raise RuntimeError(
                "optimizer.step() before its model was prepared: pass the model to "
                "accelerator.prepare() too (the scheduler needs both)"
            )
        if not self.gradient_state.sync_gradients:
            return  # an accumulation micro-batch: the gradients stay local, as accelerate's step
        if self.scaler is not None and self.scaler.is_enabled():
            self._skipped_before = scheduled.skipped_steps
            if closure is not None:
                scheduled.step(closure)  # raises: the update runs per parameter, later
            self.scaler.step(scheduled)
            self.scaler.update()
            self._overflow_known = False
        else:
            scheduled.step(closure)

    @property
    def step_was_skipped(self) -> bool:
        scheduled = self.scheduled
        if scheduled is None or self.scaler is None or getattr(self, "_overflow_known", True):
            return self._is_overflow
        scheduled.synchronize()  # the step skipped or not once its updates landed, on every rank alike
        self._is_overflow = scheduled.skipped_steps > self._skipped_before
        self._overflow_known = True
        return self._is_overflow

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.scheduled is None:
            super().zero_grad(set_to_none)
        elif self.gradient_state.sync_gradients:
            self.scheduled.zero_grad(True if set_to_none is None else set_to_none)

    def state_dict(self) -> Any:
        return self.scheduled.state_dict() if self.scheduled is not None else super().state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        if self.scheduled is None:
            super().load_state_dict(state_dict)
        else:
            self.scheduled.load_state_dict(state_dict)
