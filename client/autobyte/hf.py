"""`Trainer`: a `transformers.Trainer` whose data-parallel gradient sync is autobyte's scheduler.

    from autobyte.hf import Trainer                     # was: from transformers import Trainer

    trainer = Trainer(model=model, args=TrainingArguments(..., run_name="gpt2-ft"),
                      train_dataset=train, eval_dataset=val,
                      autobyte={"daemon": "localhost:7077"})   # optional: the scheduler's settings
    trainer.train()

The Trainer builds its accelerator as `autobyte.accelerate.Accelerator` (see there for how
accelerate's calls map to the scheduler's), so everything Trainer does with accelerate keeps its
meaning: AdamW with its LR schedule, clipping (on by default), `gradient_accumulation_steps`,
bf16 / fp16, evaluation during training, `save_steps` checkpoints (the model and optimizer state after every pending update landed)
and `resume_from_checkpoint`. The parameters are Trainer's own DDP run's, bit for bit, and so are
the buffers (BatchNorm statistics): `TrainingArguments.ddp_broadcast_buffers` (default: DDP's True)
is the scheduler's `broadcast_buffers`, and the evaluation's forwards, which Trainer runs on the
unwrapped model, receive no broadcast there either (`ScheduledOptimizer.unwrapped()`).

Trainer's `max_grad_norm` clipping and its `grad_norm` log entry are its own: its
`accelerator.clip_grad_norm_` reads the reduced gradients (a read of `.grad` waits for the step's
reductions, `autobyte.scheduler.grad_reads`), so it clips and logs DDP's norm, to the bit.

FSDP2 (`TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2, ...})`): the model is
sharded as Trainer and accelerate shard it, and autobyte attaches to it (`autobyte.fsdp`: its
prefetch depths and resharding measured and tuned, the arithmetic FSDP2's; see
`autobyte.accelerate`, also for CPU launches); `grad_norm`, clipping and checkpoints are Trainer's.

What it adds to the Trainer's logs:
* one log entry per configuration the scheduler applies (`autobyte/partition_bytes`,
  `autobyte/credit_bytes`, `autobyte/tail_bytes`, `autobyte/decision`; an FSDP2 job's
  `autobyte/forward_prefetch`, `autobyte/backward_prefetch`, `autobyte/reshard_after_forward`,
  -1 where the job keeps what the user set), so the tuner's decisions appear in the console and
  in every logging integration Trainer reports to;
* the job streams to autobyted under `TrainingArguments.run_name` when a daemon is given.

`autobyte=` (a dict) takes `partition_bytes`, `credit_bytes`, `tail_bytes`, `daemon`, `job`,
`token`, `tune`, `timeout_s`, `native`, `memory_budget_bytes` (`autobyte.accelerate.Accelerator`'s
arguments).
Refused with a ValueError: a DDP setting whose numbers the scheduler cannot reproduce (see
`autobyte.accelerate`), an unknown `autobyte=` key.

`transformers` and `accelerate` are an optional extra (`pip install 'autobyte[hf]'`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

try:
    import transformers
    import transformers.trainer as trainer_module
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"autobyte.hf needs transformers and accelerate: pip install 'autobyte[hf]' ({error})"
    ) from error

from autobyte.accelerate import Accelerator
from autobyte.types import NO_LIMIT_BYTES, Config

logger = logging.getLogger(__name__)

__all__ = ["Trainer"]

OPTIONS = frozenset(
    {
        "partition_bytes",
        "credit_bytes",
        "tail_bytes",
        "daemon",
        "job",
        "token",
        "tune",
        "timeout_s",
        "native",
        "memory_budget_bytes",
    }
)


class Trainer(transformers.Trainer):
    """`transformers.Trainer` with autobyte's scheduler as the gradient sync (see the module doc).

    Args:
        autobyte: the scheduler's settings and the daemon to stream to (keys: see `OPTIONS`);
            `job` defaults to `TrainingArguments.run_name`.
        Everything else is `transformers.Trainer`'s.
    """

    def __init__(
        self, *args: Any, autobyte: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        options = dict(autobyte or {})
        unknown = sorted(set(options) - OPTIONS)
        if unknown:
            raise ValueError(f"autobyte= does not take {unknown}: its keys are {sorted(OPTIONS)}")
        self._autobyte_options = options
        super().__init__(*args, **kwargs)
        self._configurations = _ConfigurationLog(self)
        self.add_callback(self._configurations)

    # ------------------------------------------------------------------ the accelerator

    def create_accelerator_and_postprocess(self) -> None:
        options = dict(self._autobyte_options)
        if self.args.run_name and (options.get("daemon") or options.get("job")):
            options.setdefault("job", self.args.run_name)
        with _trainer_accelerator(functools.partial(Accelerator, **options)):
            super().create_accelerator_and_postprocess()

    @property
    def scheduled_optimizer(self) -> Any:
        """The model's `ScheduledOptimizer` while training (None outside `train`, or single-process)."""
        return self.accelerator.scheduled_optimizer(self.model)

    @property
    def sharded_job(self) -> Any:
        """An FSDP2 model's `autobyte.fsdp.ShardedJob` while training (None otherwise)."""
        return self.accelerator.sharded_job(self.model)

    # ------------------------------------------------------------------ training and checkpoints

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            # the last updates landed and the threads stop: self.model holds the final parameters
            self.accelerator.close_schedulers()
            self._configurations.scheduled = None

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        # Trainer evaluates the unwrapped model, not DDP's wrapper: no buffer broadcast there
        scheduled = self.scheduled_optimizer
        with scheduled.unwrapped() if scheduled is not None else contextlib.nullcontext():
            return super().evaluation_loop(*args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self.accelerator.synchronize()
        super()._save_checkpoint(model, trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        self.accelerator.synchronize()
        super().save_model(output_dir, _internal_call)


class _ConfigurationLog(TrainerCallback):
    """One Trainer log entry (and one `autobyte.hf` log line) per configuration the scheduler or
    the FSDP2 job applied, read from their step measurements on the training thread."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.scheduled: Any = None  # the ScheduledOptimizer or ShardedJob it listens to
        self._logged: tuple[Any, int] | None = None
        self._applied: list[Any] = []  # StepMetrics or ShardStep: config, decision_id, step

    def _on_step(self, metrics: Any) -> None:
        if (metrics.config, metrics.decision_id) != self._logged:
            self._logged = (metrics.config, metrics.decision_id)
            self._applied.append(metrics)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        scheduled = self._trainer.scheduled_optimizer or self._trainer.sharded_job
        if scheduled is not None and scheduled is not self.scheduled:
            self.scheduled = scheduled
            scheduled.add_step_callback(self._on_step)
        applied, self._applied = self._applied, []
        should_log = control.should_log  # Trainer.log clears it: the step's own log must still run
        for metrics in applied:
            config = metrics.config
            logger.info(
                "autobyte configuration from step %d: %s (decision %d)",
                metrics.step,
                config.describe(),
                metrics.decision_id,
            )
            self._trainer.log(
                {
                    **_entries(config),
                    "autobyte/decision": metrics.decision_id,
                    "autobyte/from_step": metrics.step,
                }
            )
        control.should_log = should_log


def _entries(config: Any) -> dict[str, int]:
    """A configuration as Trainer log entries: the scheduler's sizes, or an FSDP2 job's knobs
    (-1: as the user set it; resharding 1 / 0 for every group)."""
    if isinstance(config, Config):
        return {
            "autobyte/partition_bytes": _bytes(config.partition_bytes),
            "autobyte/credit_bytes": _bytes(config.credit_bytes),
            "autobyte/tail_bytes": _bytes(config.tail_bytes),
        }
    held = config.to_config()
    return {
        f"autobyte/{name}": -1 if value is None else int(value)
        for name, value in (
            ("forward_prefetch", held.forward_prefetch),
            ("backward_prefetch", held.backward_prefetch),
            ("reshard_after_forward", held.reshard_after_forward),
        )
    }


def _bytes(value: int | None) -> int:
    """A size for a log entry: NO_LIMIT_BYTES stands for None (no partitioning / unlimited / no tail)."""
    return NO_LIMIT_BYTES if value is None else int(value)


@contextlib.contextmanager
def _trainer_accelerator(factory: Any) -> Iterator[None]:
    """Trainer builds its accelerator from transformers.trainer's `Accelerator` name: ours, meanwhile."""
    original = trainer_module.Accelerator
    trainer_module.Accelerator = factory
    try:
        yield
    finally:
        trainer_module.Accelerator = original
