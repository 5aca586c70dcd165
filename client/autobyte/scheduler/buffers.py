"""Module buffers as DDP keeps them: rank 0's copied to every rank at the start of a forward pass.

DDP (torch/nn/parallel/distributed.py, `_pre_forward` / `_sync_buffers`) with its default
`broadcast_buffers=True` broadcasts the module's buffers (BatchNorm running statistics, counters,
anything `register_buffer` made), minus the names in `module._ddp_params_and_buffers_to_ignore`,
from the group's rank 0 at the start of a forward pass, in one coalesced broadcast (buckets of 250
MiB). Which forwards: every one whose *previous* forward ran with gradients enabled and outside
`no_sync()` (and the first one) — `require_forward_param_sync`, set after each forward. So a forward
under `torch.no_grad()` still receives rank 0's buffers if training ran just before, the forwards
after it do not, and the first training forward after an evaluation does not either; train or eval
*mode* plays no part. The buffer list is collected again at each broadcast (buffers reassigned or
registered late are included), but a model without buffers when it was wrapped never broadcasts.
The broadcast keeps the buffers' autograd version counters (`_unsafe_preserve_version_counter`),
so a buffer saved for a backward still to come does not fail it. At construction DDP also broadcasts
the buffers with the parameters; `broadcast_buffers=False` leaves buffers out of both.

The scheduler does the same from its model's root forward pre-hook, on the training thread, on the
data-parallel group — where DDP issues it, so it is ordered with the user's own collectives exactly
as DDP's is — before any module of the forward reads a buffer. It overlaps the scheduler's gradient
traffic of the previous step, which runs on the scheduler's own communicator meanwhile. With
`own_communicator=False` that traffic runs on the data-parallel group itself, from a background
thread, so the buffers then get a group of their own.

A forward that does not go through DDP's wrapper (Hugging Face's Trainer evaluates the unwrapped
model) runs inside `outside_wrapper()`: it neither receives buffers nor changes which forward will.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size


def ignored_names(model: nn.Module) -> frozenset[str]:
    """The parameter and buffer names DDP leaves alone (`_ddp_params_and_buffers_to_ignore`)."""
    return frozenset(getattr(model, "_ddp_params_and_buffers_to_ignore", ()) or ())


def synced_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The buffers DDP broadcasts, in its order: `named_buffers()` minus the ignored names."""
    ignored = ignored_names(model)
    return [buffer for name, buffer in model.named_buffers() if name not in ignored]


class BufferBroadcast:
    """When and what to broadcast before a forward pass, DDP's rule (see the module doc)."""

    def __init__(self, model: nn.Module, group: Any, enabled: bool) -> None:
        self._model = model
        self._group = group
        self.enabled = enabled
        self._any = bool(synced_buffers(model))  # DDP's modules_buffers, last collected
        self._next_forward_syncs = True  # DDP's require_forward_param_sync
        self._outside = 0

    def before_forward(self) -> None:
        """Root forward pre-hook: rank 0's buffers here if this forward is one that receives them."""
        if self._outside or not (self.enabled and self._next_forward_syncs and self._any):
            return
        with torch.no_grad():
            buffers = synced_buffers(self._model)
            self._any = bool(buffers)
            if buffers:
                with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                    dist._broadcast_coalesced(self._group, buffers, BROADCAST_BUCKET_BYTES, 0)

    def after_forward(self, synchronising: bool) -> None:
        """Root forward hook: whether the next forward receives buffers (`synchronising`: the
        backward of this forward will send gradients, i.e. not inside `no_sync()`)."""
        if not self._outside:
            self._next_forward_syncs = torch.is_grad_enabled() and synchronising

    @contextlib.contextmanager
    def outside_wrapper(self) -> Iterator[None]:
        self._outside += 1
        try:
            yield
        finally:
            self._outside -= 1
