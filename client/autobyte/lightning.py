"""`AutobyteStrategy`: a PyTorch Lightning strategy whose gradient sync is autobyte's scheduler.

    import lightning as L
    from autobyte.lightning import AutobyteStrategy

    trainer = L.Trainer(strategy=AutobyteStrategy(job="my-run"),
                        accelerator="cpu", devices=2, gradient_clip_val=1.0)
    trainer.fit(module, loader)

It is Lightning's `DDPStrategy` (same launchers, process group, ranks, sampler, barrier/broadcast/
reduce) without the `DistributedDataParallel` wrapper: at `fit` the LightningModule's optimizer is
wrapped by a `ScheduledOptimizer` over the LightningModule, which reduces the gradients by priority
under a credit window and applies the updates in the background (docs/architecture.md, "The
scheduler"). The parameters are DDPStrategy's, bit for bit. How the Trainer's settings reach the scheduler:

* `gradient_clip_val` (norm) becomes `clip_grad_norm=`: the scheduler clips the *reduced* gradients,
  as DDP + `clip_grad_norm_` does, without waiting for them. Clipping by value and an overridden
  `configure_gradient_clipping` run Lightning's own clipping after `on_before_optimizer_step`, on
  the gradients DDP would hold (a read of `.grad` waits for the reduced gradients:
  `autobyte.scheduler.grad_reads`).
* hooks that read gradients (`on_before_optimizer_step`, grad-norm logging callbacks) read the
  reduced gradients, as with DDPStrategy; under "16-mixed" they are unscaled first, as the
  precision plugin does.
* precision: "bf16-mixed" / "16-mixed" autocast run as with DDP; a precision plugin's GradScaler
  ("16-mixed", on CPU pass `plugins=[MixedPrecision("16-mixed", "cpu")]`) is handed to the
  scheduler (`grad_scaler=`), which unscales, skips inf/NaN steps on every rank alike and updates the
  scale. "*-true" precisions convert the module before the scheduler sees it.
* `accumulate_grad_batches`: the micro-batches Lightning runs under `block_backward_sync()` run
  under `ScheduledOptimizer.no_sync()`, as DDP's `model.no_sync()`.
* checkpoints: the optimizer state comes from the scheduler's `state_dict()` and the model's after
  every pending update landed (both synchronise); restored through `load_state_dict()`.
* LR schedulers step the LightningModule's optimizer as usual: the scheduler captures the
  hyper-parameters at each `step()`.
* validation / test / predict: forward passes without backward simply wait for pending updates.
* buffers (BatchNorm statistics): `broadcast_buffers=True` (DDP's default) copies rank 0's buffers
  at the forwards DDP copies them at (`autobyte.scheduler.buffers`); validation steps during `fit`
  enter the LightningModule's `__call__`, as DDPStrategy enters its DDP wrapper, so they count as
  DDP's forwards do. `broadcast_buffers=False`: as DDPStrategy(broadcast_buffers=False).
* `job=` / `daemon=` / `token=` / `tune=` call `autobyte.init` at setup (and `autobyte.shutdown` at
  teardown); without them nothing is sent, unless the script called `autobyte.init()` itself.

Limits (each raises with what to do): one optimizer (manual optimization with one optimizer works).

FSDP2 (`ModelParallelStrategy`, below): Lightning's strategy of that name, whose LightningModule
calls `fully_shard` in `configure_model`, by one import; autobyte measures the sharded module and
sets FSDP2's knobs (`autobyte.fsdp`), the arithmetic stays Lightning's.

`lightning` is an optional extra (`pip install 'autobyte[lightning]'`), never a dependency of the core.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.utilities.optimizer import _optimizer_to_device
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallel
    from lightning.pytorch.trainer import call
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "autobyte.lightning needs PyTorch Lightning: pip install 'autobyte[lightning]' "
        f"(or `pip install lightning` next to the torch you use) ({error})"
    ) from error

from autobyte.scheduler import ScheduledOptimizer
from autobyte.scheduler.start import Requested
from autobyte.types import Config

logger = logging.getLogger(__name__)

__all__ = ["AutobyteStrategy", "ModelParallelStrategy"]

STRATEGY_NAME = "autobyte"


class AutobyteStrategy(DDPStrategy):
    """Data-parallel training like `DDPStrategy`, with autobyte's scheduler as the gradient sync.

    Args:
        partition_bytes: partition size (None = one partition per parameter; "auto", the default,
            = derived from the job, as `ScheduledOptimizer`'s).
        credit_bytes: in-flight window (None = unlimited; "auto" = 4 partitions).
        tail_bytes: the tail window (None = none; see `ScheduledOptimizer`).
        job, daemon, token, tune: if `job` or `daemon` is given, `autobyte.init(daemon, job, token,
            tune=tune)` runs at setup, so the job streams to autobyted and follows its
            configurations (`daemon` may also come from AUTOBYTE_DAEMON, `job` from AUTOBYTE_JOB).
        timeout_s: how long the scheduler waits for parameters or shutdown before raising.
        native: run the scheduler's C++ hot path where it can (see `ScheduledOptimizer`).
        broadcast_buffers: rank 0's buffers to every rank as DDP's `broadcast_buffers` (see
            `ScheduledOptimizer`).
        The remaining arguments are `DDPStrategy`'s (accelerator, parallel_devices,
        cluster_environment, checkpoint_io, precision_plugin, process_group_backend, timeout,
        start_method). DDP's own options (find_unused_parameters, static_graph, comm hooks, ...)
        do not apply: the scheduler handles unused parameters by itself.
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        partition_bytes: int | str | None = "auto",
        credit_bytes: int | str | None = "auto",
        *,
        job: str | None = None,
        daemon: str | None = None,
        token: str | None = None,
        tune: bool = True,
        timeout_s: float = 300.0,
        native: bool = True,
        broadcast_buffers: bool = True,
        tail_bytes: int | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        self._config = Requested(
            partition_bytes, credit_bytes, tail_bytes
        )  # ValueError naming a bad value, now
        if not (
            isinstance(timeout_s, (int, float))
            and not isinstance(timeout_s, bool)
            and 0 < timeout_s < float("inf")
        ):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        daemon_args = _daemon_args(job, daemon, token, tune)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._daemon_args = daemon_args
        self._timeout_s = float(timeout_s)
        self._native = bool(native)
        if not isinstance(broadcast_buffers, bool):
            raise ValueError(f"broadcast_buffers must be True or False, got {broadcast_buffers!r}")
        self._broadcast_buffers = broadcast_buffers
        self._scheduled: ScheduledOptimizer | None = None
        self._lightning_clips = False  # clipping by Lightning's own hook (by value, overridden)
        self._session_started = False

    # ------------------------------------------------------------------ what users read

    @property
    def scheduled_optimizer(self) -> ScheduledOptimizer | None:
        """The `ScheduledOptimizer` of the running fit (None outside `fit`)."""
        return self._scheduled

    @property
    def config(self) -> Config | Requested:
        """The scheduler configuration in effect (the requested sizes before `fit` starts)."""
        return self._scheduled.config if self._scheduled is not None else self._config

    # ------------------------------------------------------------------ setup and teardown

    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: the scheduler built in `setup` syncs the gradients."""

    def setup(self, trainer: pl.Trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        clip = _gradient_clip_norm(trainer) if fitting else None
        self._lightning_clips = fitting and clip is None and _clips(trainer)
        super().setup(trainer)  # device, precision, optimizers; DDPStrategy minus the wrapper
        if not fitting:
            return
        if len(self.optimizers) != 1:
            raise ValueError(
                f"AutobyteStrategy schedules one optimizer; configure_optimizers returned "
                f"{len(self.optimizers)}: put the parameter groups into one optimizer "
                "(per-group learning rates are kept)"
            )
        self._session_started = _start_session(self._daemon_args)
        optimizer = _unwrap(self.optimizers[0])
        scaler = getattr(self.precision_plugin, "scaler", None)
        self._scheduled = ScheduledOptimizer(
            self.lightning_module,
            optimizer,
            self._config.partition_bytes,
            self._config.credit_bytes,
            clip_grad_norm=clip,
            timeout_s=self._timeout_s,
            grad_scaler=scaler,
            native=self._native,
            tail_bytes=self._config.tail_bytes,
            broadcast_buffers=self._broadcast_buffers,
        )
        logger.info(
            "autobyte scheduler on rank %d/%d: %s%s",
            self.global_rank,
            self.world_size,
            self._config.describe(),
            "" if clip is None else f", clip_grad_norm={clip:g}",
        )

    def teardown(self) -> None:
        self._close_scheduler()
        self._session_started = _end_session(self._session_started)
        super().teardown()

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        logger.debug(
            "fit interrupted (%s): the scheduler closes at teardown", type(exception).__name__
        )

    def _close_scheduler(self) -> None:
        scheduled, self._scheduled = self._scheduled, None
        if scheduled is None:
            return
        try:
            scheduled.close()  # collective, like the rest of teardown; waits for the last updates
        except Exception:
            logger.exception("closing the autobyte scheduler failed")
            raise

    # ------------------------------------------------------------------ the training step

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's training_step, entered through its `__call__` so that the
        scheduler sees the forward pass begin (step timing, first-use order of the parameters)."""
        module = self.lightning_module
        assert module is not None
        with self.precision_plugin.train_step_context():
            if self._scheduled is None:
                return module.training_step(*args, **kwargs)
            return self._forward_redirection(module, module, "training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """As DDPStrategy's through its DDP wrapper: through the LightningModule's `__call__`, so
        the scheduler sees the forward (the buffer broadcast DDP's forward would do)."""
        module = self.lightning_module
        assert module is not None
        with self.precision_plugin.val_step_context():
            if self._scheduled is None:
                return module.validation_step(*args, **kwargs)
            return self._forward_redirection(module, module, "validation_step", *args, **kwargs)

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Run the closure (training_step, zero_grad, backward: the gradients go out as they
        appear), Lightning's `on_before_optimizer_step` hooks, then the scheduler's `step()`.
        With a GradScaler it unscales first and clipping other than by norm runs as Lightning's,
        both on the reduced gradients (reads: `autobyte.scheduler.grad_reads`)."""
        scheduled = self._scheduled
        if scheduled is None:
            raise RuntimeError(
                "AutobyteStrategy.optimizer_step outside fit: the scheduler is not set up"
            )
        if _unwrap(optimizer) is not scheduled.optimizer:
            raise ValueError(
                "AutobyteStrategy steps the optimizer returned by configure_optimizers only"
            )
        if kwargs:
            raise ValueError(
                f"optimizer.step() arguments are not supported with AutobyteStrategy: "
                f"{sorted(kwargs)}"
            )
        model = model if model is not None else self.lightning_module
        closure_result = closure()
        trainer = model.trainer
        backward_ran = closure_result is not None or not model.automatic_optimization
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled() and backward_ran:
            # as the precision plugin does before the hooks: they (and a clip) read unscaled
            # gradients, the reduced ones (autobyte.scheduler.grad_reads)
            scaler.unscale_(_unwrap(optimizer))
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        if self._lightning_clips and backward_ran:
            # clipping by value, or the module's configure_gradient_clipping: Lightning's own,
            # on the reduced gradients a read waits for (the wait DDP pays at every backward)
            self.precision_plugin._clip_gradients(
                model, optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm
            )
        # Also when training_step returned None (no backward): no rank's gradient means every
        # parameter keeps its value and optimizer state, as a torch optimizer with grad None.
        scheduled.step()
        return closure_result

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: Lightning runs the non-final micro-batches in here."""
        scheduled = self._scheduled
        if scheduled is None:
            yield None
            return
        no_sync = getattr(scheduled, "no_sync", None)
        if no_sync is None:
            raise ValueError(
                "accumulate_grad_batches > 1 needs ScheduledOptimizer.no_sync(), which this "
                "autobyte version lacks: upgrade autobyte or set accumulate_grad_batches=1"
            )
        with no_sync():
            yield None

    # ------------------------------------------------------------------ checkpoints

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        scheduled = self._scheduled
        if scheduled is not None and _unwrap(optimizer) is scheduled.optimizer:
            return scheduled.state_dict()  # waits for every pending update first
        return super().optimizer_state(optimizer)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._scheduled is not None:
            self._scheduled.synchronize()
        return super().lightning_module_state_dict()

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        scheduled = self._scheduled
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"the checkpoint holds {len(states)} optimizer states; this fit has "
                f"{len(self.optimizers)} optimizer(s)"
            )
        for optimizer, state in zip(self.optimizers, states):
            if scheduled is not None and _unwrap(optimizer) is scheduled.optimizer:
                scheduled.load_state_dict(state)
            else:
                optimizer.load_state_dict(state)
            _optimizer_to_device(_unwrap(optimizer), self.root_device)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME, cls, description="DDP's data parallelism with autobyte's scheduler"
            )


class ModelParallelStrategy(_LightningModelParallel):
    """Lightning's `ModelParallelStrategy` (FSDP2: the LightningModule's `configure_model` calls
    `fully_shard` on its blocks and on itself), measured and tuned by autobyte: at `fit` the
    sharded module is attached (`autobyte.fsdp.attach`, with the optimizer's `step()` as the step
    boundary), so that with `job=`/`daemon=` (or a script's own `autobyte.init()`) its steps stream
    to autobyted as an FSDP2 job and the daemon's configurations (prefetch depths, resharding after
    forward) apply on every rank at the same step. The arithmetic is Lightning's: FSDP2's knobs
    change when collectives run, never what they compute.

        from autobyte.lightning import ModelParallelStrategy  # was: from lightning.pytorch.strategies

    Args: Lightning's (`data_parallel_size`, `tensor_parallel_size`, `process_group_backend`, ...),
    and `job`, `daemon`, `token`, `tune` as `AutobyteStrategy`'s; `memory_budget_bytes` as
    `autobyte.fsdp.attach`'s (a configuration predicted to gather more is never applied)."""

    def __init__(
        self,
        *args: Any,
        job: str | None = None,
        daemon: str | None = None,
        token: str | None = None,
        tune: bool = True,
        memory_budget_bytes: int | None = None,
        **kwargs: Any,
    ) -> None:
        self._daemon_args = _daemon_args(job, daemon, token, tune)
        from autobyte.fsdp import check_memory_budget

        check_memory_budget(memory_budget_bytes)
        super().__init__(*args, **kwargs)
        self._memory_budget_bytes = memory_budget_bytes
        self._sharded: Any = None
        self._session_started = False

    @property
    def sharded(self) -> Any:
        """The running fit's `autobyte.fsdp.ShardedJob` (None outside `fit`)."""
        return self._sharded

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # configure_model (fully_shard), the optimizers
        if trainer.state.fn != TrainerFn.FITTING:
            return
        import autobyte.fsdp

        self._session_started = _start_session(self._daemon_args)
        optimizer = _unwrap(self.optimizers[0]) if len(self.optimizers) == 1 else None
        self._sharded = autobyte.fsdp.attach(
            self.lightning_module, optimizer, memory_budget_bytes=self._memory_budget_bytes
        )

    def teardown(self) -> None:
        sharded, self._sharded = self._sharded, None
        if sharded is not None:
            sharded.close()
        self._session_started = _end_session(self._session_started)
        super().teardown()


def _daemon_args(
    job: str | None, daemon: str | None, token: str | None, tune: bool
) -> tuple[str | None, str | None, str | None, bool] | None:
    """What `autobyte.init` gets at setup (None: the strategy starts no session); ValueError for a
    bad value, before any process starts."""
    for name, value in (("job", job), ("daemon", daemon), ("token", token)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if daemon is not None:
        from autobyte.channel import daemon_addresses

        daemon_addresses(daemon)  # ValueError for a malformed address
    return (daemon, job, token, bool(tune)) if job is not None or daemon is not None else None


def _start_session(args: tuple[str | None, str | None, str | None, bool] | None) -> bool:
    if args is None:
        return False
    import autobyte

    daemon, job, token, tune = args
    autobyte.init(daemon, job, token, tune=tune)
    return True


def _end_session(started: bool) -> bool:
    if started:
        import autobyte

        autobyte.shutdown()
    return False


def _unwrap(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _clips(trainer: pl.Trainer) -> bool:
    """Whether the Trainer's configuration clips gradients at all."""
    module = trainer.lightning_module
    overridden = module is not None and is_overridden("configure_gradient_clipping", module)
    return overridden or bool(trainer.gradient_clip_val)


def _gradient_clip_norm(trainer: pl.Trainer) -> float | None:
    """The Trainer's gradient clipping as the scheduler's `clip_grad_norm=`, which clips once the
    gradients are reduced without a wait (None: no clipping, or clipping Lightning's own way: by
    value, or by an overridden `configure_gradient_clipping`)."""
    value = trainer.gradient_clip_val
    module = trainer.lightning_module
    if module is not None and is_overridden("configure_gradient_clipping", module):
        return None
    if value is None or value == 0:
        return None
    algorithm = trainer.gradient_clip_algorithm
    if algorithm is not None and GradClipAlgorithmType(algorithm) != GradClipAlgorithmType.NORM:
        return None
    return float(value)


AutobyteStrategy.register_strategies(StrategyRegistry)
