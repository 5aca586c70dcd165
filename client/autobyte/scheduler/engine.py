"""What the first backward pass builds, as one record (DDP builds its Reducer's buckets from the
first iteration's order; FSDP2 its FSDPParamGroup at lazy init): the flat layout in rank 0's
first-use order, the order channel, the hot path (native or Python) with its dispatcher and
updater, the device synchronisation, the row-sparse weights' state.

`build` is collective: every rank of the job calls it at its first step, with the order recorded
on that rank (rank 0's is the one every rank uses)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autobyte.scheduler import device as device_sync
from autobyte.scheduler import groups, native
from autobyte.scheduler import sparse_rows as sparse_rows_mod
from autobyte.scheduler.checks import Managed
from autobyte.scheduler.dispatch import Dispatcher
from autobyte.scheduler.groups import CommGroups
from autobyte.scheduler.layout import Layout
from autobyte.scheduler.metrics import StepLog
from autobyte.scheduler.order_channel import OrderChannel
from autobyte.scheduler.progress import Progress, SchedulerError
from autobyte.scheduler.update import Updater


@dataclasses.dataclass(frozen=True)
class Engine:
    layout: Layout
    channel: OrderChannel | None  # None at one rank: nobody to tell the order
    dispatcher: Dispatcher | native.NativeDispatcher
    updater: Updater | native.NativeUpdater
    device_sync: device_sync.DeviceSync
    sparse: tuple[sparse_rows_mod.SparseRows, ...]
    hot_path: str  # "native" or "python"
    hot_path_reason: str  # why not the native one ("" on it)

    @property
    def grad_ready(self) -> Callable[[int, int], None]:
        return self.dispatcher.grad_ready


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """What the updater applies besides the optimizers' own step: the constructor's clip and the
    AMP scaler bridged to it."""

    optimizers: Sequence[torch.optim.Optimizer]
    clip: float | None
    clip_norm_type: float
    scaler: Any  # the GradScaler when bridged, else None
    local_used: list[int]  # last step in which this rank produced each gradient


def agreed_order(recorded: Sequence[int], comm: CommGroups, managed: Managed) -> list[int]:
    """Rank 0's first-use order (the parameters it never saw appended), on every rank; the
    parameters handed back in `.grad` at the end of backward first (highest priority)."""
    order = list(recorded)
    if comm.world > 1:
        tensor = torch.tensor(order, dtype=torch.int64)
        dist.broadcast(tensor, src=comm.leader_global, group=comm.decision)
        order = tensor.tolist()
    if sorted(order) != list(range(managed.n)):
        raise SchedulerError("rank 0 published an inconsistent parameter order")
    return [i for i in order if managed.uncovered[i]] + [
        i for i in order if not managed.uncovered[i]
    ]


def build(
    order: Sequence[int],
    comm: CommGroups,
    managed: Managed,
    update: UpdateSettings,
    progress: Progress,
    steps: StepLog,
    timeout_s: float,
    native_wanted: bool,
) -> Engine:
    """The engine for `order` (agreed_order's): collective (the channel opens, the hot path is
    chosen on every rank together)."""
    channel = None
    if comm.world > 1:
        channel = OrderChannel(
            comm.is_leader,
            comm.rank,
            comm.leader_global,
            comm.follower_globals,
            comm.decision,
            timeout_s,
        )
        channel.open()
    layout = Layout(
        list(order),
        [p.shape for p in managed.params],
        managed.dtype,
        managed.device,
        standalone=managed.sparse_idx,
    )
    sparse = tuple(
        sparse_rows_mod.SparseRows(layout.offsets[i], *managed.params[i].shape)
        for i in managed.sparse_idx
    )
    sync = device_sync.make(managed.device, managed.n)
    module, reason = native.choose_hot_path(
        native_wanted,
        managed.device,
        groups.backend_of(comm.data),
        channel,
        comm.decision,
        comm.world,
    )
    native.log_choice(module is not None, reason)
    updater_args = (
        layout,
        managed.params,
        update.optimizers,
        managed.owner,
        progress,
        steps,
        update.clip,
        update.clip_norm_type,
        update.scaler,
        update.local_used,
        sync,
    )
    dispatcher: Dispatcher | native.NativeDispatcher
    updater: Updater | native.NativeUpdater
    if module is not None:
        dispatcher = native.NativeDispatcher(
            module,
            layout,
            comm.data,
            comm.is_leader,
            comm.rank,
            steps,
            channel,
            timeout_s,
            trace=native.trace_requested(),
            sparse=list(sparse),
        )
        updater = native.NativeUpdater(*updater_args, engine=dispatcher.engine, module=module)
    else:
        updater = Updater(*updater_args)
        dispatcher = Dispatcher(
            layout,
            comm.data,
            comm.is_leader,
            comm.world > 1,
            progress,
            steps,
            channel,
            updater.queue,
            sync,
            sparse=list(sparse),
        )
    return Engine(
        layout,
        channel,
        dispatcher,
        updater,
        sync,
        sparse,
        "native" if module is not None else "python",
        reason,
    )
