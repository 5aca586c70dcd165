"""Row-sparse reduction of embedding gradients: only the rows some rank touched go on the wire.

An embedding's gradient has a non-zero row only for the tokens a batch looked up (a batch of 16 x 64
tokens touches at most 1,024 of the benchmark transformer's 8,192 rows; a 32,000-token vocabulary
far fewer). Sent dense, the whole table crosses the link every step, and it is the *last* gradient
of the backward pass and the *first* parameter the next forward reads: on the testbed its 8 MiB are
67 ms of the transformer's 85-110 ms first wait at 1 Gbit/s (`benchmarks.profile_step`).

How (both hot paths, every rank the same collectives in the same order): such a weight is one
partition of its own in every plan (`Layout(standalone=)`), and its collective becomes

1. a mask all-reduce (MAX, one byte per row): which rows any rank holds non-zero;
2. if at most half the rows are in the union: an all-reduce of the union's rows, packed, with the
   weight's "used" flag, unpacked into the flat buffer when it completes; else the ordinary
   all-reduce of the whole slice.

DDP's numbers to the bit: every element ends as the same sum DDP's all-reduce computes.
- A row that some rank holds with a non-zero bit pattern is in the union; every rank sends its values
  of that row (its zeros included), and the packed all-reduce sums exactly those values.
- A row that every rank holds with all bits zero (+0.0 everywhere; a -0.0 counts as non-zero) is
  not sent: DDP's sum of +0.0s is +0.0, which is what every rank's buffer already holds there.
The same argument holds for any partition of the rows, so the row split changes no element's
summation more than partitioning does.

Which weights: those of `nn.Embedding` / `nn.EmbeddingBag` modules (held by no other module: a
weight tied to an output layer has a dense gradient), of at least MIN_BYTES, with rows of at least
MIN_ROW_BYTES (the mask costs one byte per row), on CPU tensors (gloo). A weight whose union
exceeded half its rows in DENSE_STEPS_OFF consecutive steps (a model that reads the table densely,
e.g. tied by a functional call) is reduced as an ordinary partition from then on: every rank sees the
same reduced masks in the same collective order, so every rank switches at the same collective.
`ScheduledOptimizer(sparse_rows=False)` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MIN_BYTES = 1 << 20  # below this, a mask round trip (~1 ms on gloo) buys little
MIN_BYTES_ENV = "AUTOBYTE_SPARSE_ROWS_MIN_BYTES"
MIN_ROW_BYTES = 64  # the mask is at most 1/64 of the table
DENSE_STEPS_OFF = 4  # consecutive dense unions before a weight is reduced as an ordinary partition
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a dtype's bit pattern


def _bits_dtype(row_bytes: int, offset_bytes: int) -> torch.dtype:
    """The widest integer type a row's bytes and the table's offset divide into (the zero test then
    reads the fewest elements; a view as a wider type must start on its alignment)."""
    return next(
        _BITS[size] for size in (8, 4, 2, 1) if row_bytes % size == 0 and offset_bytes % size == 0
    )


def min_bytes() -> int:
    """The smallest table reduced row-sparse: MIN_BYTES, or AUTOBYTE_SPARSE_ROWS_MIN_BYTES (bytes,
    e.g. 0 to include every embedding: the equivalence tests run small models through this path)."""
    text = os.environ.get(MIN_BYTES_ENV, "").strip()
    if not text:
        return MIN_BYTES
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{MIN_BYTES_ENV} must be a number of bytes >= 0, got {text!r}")
    return value


def embedding_tables(model: nn.Module) -> list[tuple[nn.Module, torch.Tensor]]:
    """(module, weight) of every `nn.Embedding` / `nn.EmbeddingBag` whose 2-D weight no other module
    holds (a weight tied to an output layer has a dense gradient): the tables whose gradient is
    row-sparse, whatever their size or device (simulator.profiles.record_profile records them)."""
    holders: dict[torch.Tensor, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[p] = holders.get(p, 0) + 1
    return [
        (module, module.weight)
        for module in model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
        and holders.get(module.weight, 0) == 1
        and module.weight.dim() == 2
    ]


def eligible(model: nn.Module, params: Sequence[torch.Tensor]) -> list[int]:
    """Indices into `params` of the embedding weights reduced row-sparse (module docstring)."""
    smallest = min_bytes()
    index_of = {p: i for i, p in enumerate(params)}
    out = []
    for _, p in embedding_tables(model):
        if p not in index_of or p.device.type != "cpu":
            continue
        elem = p.element_size()
        if elem not in _BITS or p.numel() * elem < smallest or p.shape[1] * elem < MIN_ROW_BYTES:
            continue
        out.append(index_of[p])
    return sorted(set(out))


class SparseRows:
    """One weight's row-sparse reduction state (identical on every rank: it changes only with the
    reduced masks)."""

    __slots__ = ("active", "cols", "dense_streak", "length", "rows", "start")

    def __init__(self, start: int, rows: int, cols: int) -> None:
        self.start = start  # the weight's offset in the flat buffer
        self.rows = rows
        self.cols = cols
        self.length = rows * cols + 1  # its slice: the gradient and the "used" flag
        self.active = True
        self.dense_streak = 0

    def reduce(self, flat: torch.Tensor, group: Any) -> tuple[Any, Callable[[], None], int] | None:
        """Steps 1-2 of the module docstring, issued from the dispatch thread. Returns (work,
        what to run on its completion, bytes sent with the mask), or None
        when the slice is to be reduced whole (the caller issues the ordinary all-reduce; the mask's
        bytes are then `self.rows`)."""
        rows, cols, start = self.rows, self.cols, self.start
        view = flat[start : start + rows * cols].view(rows, cols)
        lo, hi = torch.aminmax(
            view.view(_bits_dtype(cols * flat.element_size(), start * flat.element_size())), dim=1
        )
        mask = ((lo != 0) | (hi != 0)).to(torch.uint8)  # a row of all-zero bits: min = max = 0
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)  # waits: the next step needs it
        idx = mask.nonzero().squeeze(1)
        k = int(idx.numel())
        if 2 * k > rows:
            self.dense_streak += 1
            if self.dense_streak >= DENSE_STEPS_OFF:
                self.active = False
            return None
        self.dense_streak = 0
        packed = torch.empty(k * cols + 1, dtype=flat.dtype, device=flat.device)
        torch.index_select(view, 0, idx, out=packed[: k * cols].view(k, cols))
        flag = flat[start + rows * cols : start + self.length]
        packed[k * cols :].copy_(flag)
        work = dist.all_reduce(packed, group=group, async_op=True)

        def unpack() -> None:
            view.index_copy_(0, idx, packed[: k * cols].view(k, cols))
            flag.copy_(packed[k * cols :])

        return work, unpack, (k * cols + 1) * flat.element_size() + rows
