"""autobyte.lightning.AutobyteStrategy in real 2-rank gloo Lightning fits: the parameters equal
DDPStrategy's bit for bit (clipping, LR scheduler, validation, bf16/fp16 AMP, checkpoint resume), a
job streams to a real daemon, and bad settings are refused with what to do."""

import os

import pytest

pytest.importorskip(
    "lightning",
    reason="the Lightning strategy is an optional extra: "
    "pip install 'autobyte[lightning]' (scripts/setup.sh installs it)",
)

from autobyte.protocol import autobyte_pb2 as pb

from tests.helpers.dist import run_ranks
from tests.helpers.rpc import Client

SAMPLES_PER_RANK = 24  # 6 steps of 4 samples per rank and epoch


def _lightning_env(rank: int, world: int) -> None:
    # torch.distributed is already initialised by run_ranks; LOCAL_RANK tells Lightning that the
    # processes exist already (it launches none) and the rest places this one.
    os.environ.update(
        LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1"
    )
    os.environ.setdefault("MASTER_PORT", "29500")  # unused: the process group exists


def _module_class():
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Net(L.LightningModule):
        """A small MLP (with BatchNorm if asked); SGD with momentum or AdamW, a per-step LR schedule,
        logged losses."""

        def __init__(self, optimizer: str = "sgd", batchnorm: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            norm = [nn.BatchNorm1d(64)] if batchnorm else []
            self.body = nn.Sequential(
                nn.Linear(16, 64), *norm, nn.ReLU(), nn.Linear(64, 32), nn.ReLU()
            )
            self.head = nn.Linear(32, 4)
            self.optimizer_name = optimizer

        def forward(self, x):
            return self.head(self.body(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log(
                "train_loss", loss, sync_dist=True
            )  # a collective of the user's on the default group
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

        def configure_optimizers(self):
            if self.optimizer_name == "adamw":
                opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)
            else:
                opt = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-4)
            schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return Net


def _loaders(with_validation: bool):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(1)
    n = 2 * SAMPLES_PER_RANK
    data = TensorDataset(
        torch.randn(n, 16, generator=generator) * 3, torch.randint(0, 4, (n,), generator=generator)
    )
    train = DataLoader(data, batch_size=4, shuffle=False)
    return (train, DataLoader(data, batch_size=8, shuffle=False)) if with_validation else (train,)


def _grad_norms():
    """A callback recording the scheduler's clipped-step norms (to show the clipping bites) and the
    gradient norm read from `.grad` in `on_before_optimizer_step` (as grad-norm loggers do)."""
    import lightning as L
    import torch

    class GradNorms(L.Callback):
        def __init__(self) -> None:
            self.norms: list[float] = []

            self.read: list[float] = []

        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            # what grad-norm logging callbacks read: every parameter's .grad, before the step
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            if grads:
                self.read.append(
                    float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
                )

        def on_train_batch_end(self, trainer, *args) -> None:
            scheduled = getattr(trainer.strategy, "scheduled_optimizer", None)
            if scheduled is not None and scheduled.last_grad_norm is not None:
                self.norms.append(scheduled.last_grad_norm)

    return GradNorms()


def _fit(
    strategy_name: str,
    *,
    max_steps: int,
    precision: str = "32-true",
    fp16_scaler: bool = False,
    clip: float | None = None,
    clip_algorithm: str | None = None,
    clipping_hook: bool = False,
    optimizer: str = "sgd",
    accumulate: int = 1,
    with_validation: bool = True,
    ckpt_dir: str | None = None,
    resume_from: str | None = None,
    strategy_kwargs: dict | None = None,
    batchnorm: bool = False,
    broadcast_buffers: bool = True,
):
    import lightning as L
    import torch
    from autobyte.lightning import AutobyteStrategy
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy

    if strategy_name == "autobyte":
        strategy = AutobyteStrategy(
            **{
                "partition_bytes": 4 << 10,
                "credit_bytes": 8 << 10,
                "broadcast_buffers": broadcast_buffers,
                **(strategy_kwargs or {}),
            }
        )
    else:
        strategy = DDPStrategy() if broadcast_buffers else DDPStrategy(broadcast_buffers=False)
    plugins = []
    if fp16_scaler:  # Lightning turns "16-mixed" on CPU into bf16 unless the plugin is given
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    norms = _grad_norms()
    callbacks = [norms]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="first", save_top_k=-1))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        max_steps=max_steps,
        precision=None if fp16_scaler else precision,
        plugins=plugins or None,
        gradient_clip_val=clip,
        gradient_clip_algorithm=clip_algorithm,
        accumulate_grad_batches=accumulate,
        val_check_interval=3 if with_validation else None,
        limit_val_batches=2,
        num_sanity_val_steps=1 if with_validation else 0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module_class = _module_class()
    if clipping_hook:

        class ClipsItself(module_class):
            def configure_gradient_clipping(
                self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
            ):
                self.clip_gradients(optimizer, 0.02, "value")
                self.clip_gradients(optimizer, 0.1, "norm")

        module_class = ClipsItself
    module = module_class(optimizer, batchnorm)
    trainer.fit(module, *_loaders(with_validation), ckpt_path=resume_from)
    # plain floats (exact for float32): tensors do not outlive a spawned rank through its queue
    # the whole state_dict: parameters and buffers (BatchNorm statistics)
    out = {
        "state": {k: v.detach().reshape(-1).tolist() for k, v in module.state_dict().items()},
        "params": [p.detach().reshape(-1).tolist() for p in module.parameters()],
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "global_step": trainer.global_step,
        "norms": norms.norms,
        "read": norms.read,
    }
    if fp16_scaler:
        out["scale"] = trainer.precision_plugin.scaler.get_scale()
    return out


def _fit_both(rank, world, settings):
    import torch

    _lightning_env(rank, world)
    torch.set_num_threads(1)
    return {"ddp": _fit("ddp", **settings), "autobyte": _fit("autobyte", **settings)}


def _max_diff(a, b) -> float:
    """The largest difference of two parameter lists, or of two state_dicts (name -> values)."""
    import torch

    assert len(a) == len(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        a, b = [a[k] for k in a], [b[k] for k in a]
    return max(
        (torch.tensor(x, dtype=torch.float64) - torch.tensor(y, dtype=torch.float64))
        .abs()
        .max()
        .item()
        for x, y in zip(a, b)
    )


def _assert_equal_to_ddp(results) -> None:
    for rank, result in enumerate(results):
        ddp, ours = result["ddp"], result["autobyte"]
        assert ddp["global_step"] == ours["global_step"] > 0
        assert _max_diff(ddp["state"], ours["state"]) == 0.0, (
            f"rank {rank} differs from DDPStrategy"
        )
        assert ddp["lr"] == ours["lr"]
        assert ddp["read"] == ours["read"] and len(ddp["read"]) > 0, (ddp["read"], ours["read"])
        assert ddp.get("scale") == ours.get("scale")
    assert _max_diff(results[0]["autobyte"]["params"], results[1]["autobyte"]["params"]) == 0.0


def test_fit_equals_ddp_strategy_with_clipping_lr_schedule_and_validation():
    results = run_ranks(_fit_both, 2, {"max_steps": 7, "clip": 0.5}, timeout_s=240)
    _assert_equal_to_ddp(results)
    ours = results[0]["autobyte"]
    assert ours["lr"] == pytest.approx(0.2 * 0.5**3), "the per-step LR schedule must have stepped"
    assert max(ours["norms"]) > 0.5, "the test must clip for real"


def test_bf16_mixed_precision_equals_ddp_strategy():
    results = run_ranks(
        _fit_both,
        2,
        {
            "max_steps": 5,
            "precision": "bf16-mixed",
            "clip": 1.0,
            "optimizer": "adamw",
            "with_validation": False,
        },
        timeout_s=240,
    )
    _assert_equal_to_ddp(results)


def test_fp16_mixed_precision_with_grad_scaler_equals_ddp_strategy():
    results = run_ranks(
        _fit_both,
        2,
        {"max_steps": 6, "fp16_scaler": True, "clip": 1.0, "with_validation": False},
        timeout_s=240,
    )
    _assert_equal_to_ddp(results)
    assert results[0]["autobyte"]["scale"] != 2.0**10, "the loss scale must follow GradScaler's"


def test_gradient_accumulation_equals_ddp_strategy():
    # Lightning runs the non-final micro-batches under block_backward_sync(): ScheduledOptimizer.no_sync()
    results = run_ranks(_fit_both, 2, {"max_steps": 4, "accumulate": 3, "clip": 0.5}, timeout_s=240)
    _assert_equal_to_ddp(results)
    assert max(results[0]["autobyte"]["norms"]) > 0.5


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_batchnorm_statistics_equal_ddp_strategys(broadcast_buffers):
    """BatchNorm's running statistics, with validation during fit (a sanity check first, as
    DDPStrategy runs through its DDP wrapper) and accumulation: every rank's whole state_dict is
    DDPStrategy's, broadcast_buffers=True (the default) and False."""
    results = run_ranks(
        _fit_both,
        2,
        {
            "max_steps": 7,
            "accumulate": 2,
            "batchnorm": True,
            "broadcast_buffers": broadcast_buffers,
        },
        timeout_s=240,
    )
    _assert_equal_to_ddp(results)
    first, second = (result["autobyte"]["state"]["body.1.running_mean"] for result in results)
    assert first != second  # each rank's last training forward updates its own statistics


def _resume(rank, world, ckpt_dir):
    import torch

    _lightning_env(rank, world)
    torch.set_num_threads(1)
    out = {}
    for name in (
        "ddp",
        "autobyte",
    ):  # each: 6 steps saving a checkpoint in the fit, then resume to 12
        folder = os.path.join(ckpt_dir, name)
        first = _fit(name, max_steps=6, clip=0.5, with_validation=False, ckpt_dir=folder)
        resumed = _fit(
            name,
            max_steps=12,
            clip=0.5,
            with_validation=False,
            resume_from=os.path.join(folder, "first.ckpt"),
        )
        out[name] = {"first": first, "resumed": resumed}
    return out


def test_checkpoint_saved_during_fit_resumes_as_ddp_strategys(tmp_path):
    results = run_ranks(_resume, 2, str(tmp_path), timeout_s=240)
    for result in results:
        ddp, ours = result["ddp"], result["autobyte"]
        assert ours["first"]["global_step"] == 6 and ours["resumed"]["global_step"] == 12
        # the checkpoint holds every update of the first fit (and the momentum buffers: the resumed
        # fit would drift from DDPStrategy's otherwise)
        assert _max_diff(ddp["first"]["state"], ours["first"]["state"]) == 0.0
        assert _max_diff(ddp["resumed"]["state"], ours["resumed"]["state"]) == 0.0
        assert ddp["resumed"]["lr"] == ours["resumed"]["lr"]
    assert (
        _max_diff(
            results[0]["autobyte"]["resumed"]["params"], results[1]["autobyte"]["resumed"]["params"]
        )
        == 0.0
    )


def _fit_with_daemon(rank, world, address, job):
    import torch

    _lightning_env(rank, world)
    torch.set_num_threads(1)
    out = _fit(
        "autobyte",
        max_steps=8,
        with_validation=False,
        strategy_kwargs={"daemon": address, "job": job},
    )
    from autobyte.transport import session

    return {"global_step": out["global_step"], "session_closed": session._reporter is None}


def test_strategy_job_streams_to_the_daemon(thread_daemon):
    results = run_ranks(_fit_with_daemon, 2, thread_daemon.address, "lit-job", timeout_s=240)
    assert [r["global_step"] for r in results] == [8, 8]
    assert all(r["session_closed"] for r in results), "teardown must end the session it started"
    client = Client(thread_daemon.address)
    try:
        (job,) = client.query.Status(pb.StatusRequest(), timeout=5).jobs
        assert job.job == "lit-job" and sorted(job.ranks) == [0, 1]
        history = client.query.History(pb.HistoryRequest(job="lit-job", limit=1000), timeout=5)
        assert sorted({(s.rank, s.step) for s in history.steps}) == [
            (r, s) for r in (0, 1) for s in range(8)
        ]
    finally:
        client.close()


@pytest.mark.parametrize(
    "settings",
    [
        {"clip": 0.01, "clip_algorithm": "value"},
        {"clipping_hook": True},
        {"clip": 0.01, "clip_algorithm": "value", "fp16_scaler": True, "with_validation": False},
    ],
    ids=["value", "hook", "value-fp16"],
)
def test_lightnings_own_clipping_by_value_and_by_its_hook_equals_ddp_strategy(settings):
    """Clipping by value and an overridden configure_gradient_clipping run Lightning's own clip on
    the reduced gradients (reads of .grad wait for them): DDPStrategy's parameters, to the bit."""
    results = run_ranks(_fit_both, 2, {"max_steps": 5, **settings}, timeout_s=240)
    _assert_equal_to_ddp(results)


def test_bad_settings_are_refused_with_what_to_do():
    from autobyte.lightning import AutobyteStrategy

    with pytest.raises(ValueError, match="partition_bytes"):
        AutobyteStrategy(partition_bytes=0)
    with pytest.raises(ValueError, match="timeout_s"):
        AutobyteStrategy(timeout_s=-1)
    with pytest.raises(ValueError, match="job"):
        AutobyteStrategy(job="")
    with pytest.raises(ValueError):
        AutobyteStrategy(daemon="not an address")


def test_the_strategy_is_registered_by_name():
    from autobyte.lightning import AutobyteStrategy
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["autobyte"]["strategy"] is AutobyteStrategy


def _fit_sharded(rank, world, address):
    """Lightning's ModelParallelStrategy (FSDP2 in configure_model) and autobyte's drop-in of the
    same name streaming to a real autobyted: the parameters after the same steps."""
    import lightning as L
    import torch
    from autobyte.lightning import ModelParallelStrategy
    from lightning.pytorch.strategies import ModelParallelStrategy as Plain
    from torch import nn

    _lightning_env(rank, world)
    torch.set_num_threads(1)

    class Sharded(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList([nn.Linear(24, 24) for _ in range(3)])
            self.head = nn.Linear(24, 3)

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

        def forward(self, x):
            for block in self.blocks:
                x = torch.relu(block(x))
            return self.head(x)

        def training_step(self, batch, _index):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 24, generator=g), torch.randint(0, 3, (64,), generator=g)
    )
    out = {}
    for name, strategy in (
        ("plain", Plain(data_parallel_size=world, tensor_parallel_size=1)),
        (
            "autobyte",
            ModelParallelStrategy(
                data_parallel_size=world, tensor_parallel_size=1, daemon=address, job="lit-fsdp"
            ),
        ),
    ):
        module = Sharded()
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=world,
            max_steps=6,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
        out[name] = [p.full_tensor().flatten().tolist() for p in module.parameters()]
    out["sharded_after_fit"] = strategy.sharded
    return out


def test_the_fsdp2_drop_in_streams_an_fsdp2_job_with_lightnings_bits(thread_daemon):
    results = run_ranks(_fit_sharded, 2, thread_daemon.address, timeout_s=240)
    for r in results:
        assert r["autobyte"] == r["plain"] == results[0]["plain"]  # to the bit, every rank
        assert r["sharded_after_fit"] is None  # teardown detached it
    client = Client(thread_daemon.address)
    try:
        (job,) = client.query.Status(pb.StatusRequest(), timeout=5).jobs
        assert job.job == "lit-fsdp" and job.engine == "fsdp2" and sorted(job.ranks) == [0, 1]
        history = client.query.History(pb.HistoryRequest(job="lit-fsdp", limit=1000), timeout=5)
        assert {(s.rank, s.step) for s in history.steps} == {
            (r, s) for r in (0, 1) for s in range(6)
        }
    finally:
        client.close()
