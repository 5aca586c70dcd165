"""What a benchmark workload is (benchmarks/testbed/models.py builds them by name): the model, a
function that makes a synthetic batch, the loss and its default batch size."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Batch = tuple[Any, torch.Tensor]


@dataclasses.dataclass
class Workload:
    name: str
    model: nn.Module
    make_batch: Callable[[int, torch.Generator], Batch]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    default_batch_size: int

    @property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def gradient_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
