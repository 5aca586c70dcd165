"""The flat gradient buffer's layout and the partition plans cut from it.

Every managed parameter owns a slice of one flat buffer: its gradient (divided by the world size)
followed by one "used" flag element. Slices are laid out in *reverse* first-use order: the parameter
used last in the forward pass (whose gradient comes first in backward) sits at offset 0, so a higher
offset means a higher priority. A plan cuts the buffer into partitions: `partition_bytes` slices that
fuse small tensors and split big ones, or one partition per parameter (`partition_bytes is None`).
A *standalone* parameter (`autobyte.scheduler.sparse_rows`: an embedding reduced row-sparse) is one
partition of its own in every plan; the slices between standalone parameters are cut from the end
of the previous one. Every plan covers each element exactly once.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch


class Plan:
    """The partitions of one step (rank 0) and how many parameters each still waits for."""

    __slots__ = ("drain", "left", "param_parts", "parts", "remaining", "tail", "unready")

    def __init__(
        self,
        parts: list[tuple[int, int]],
        param_parts: list[tuple[int, ...]],
        counts: list[int],
        total: int,
    ) -> None:
        self.parts = parts  # (start, length) in elements
        self.param_parts = param_parts  # per parameter: the partitions its slice overlaps
        self.remaining = list(counts)  # per partition: parameters not yet ready
        self.left = len(parts)  # partitions not yet issued
        self.unready = total  # elements of the buffer whose gradient of this step is not yet ready
        self.tail = 0  # the tail window in elements (0: none); see Config.tail_bytes
        self.drain = False  # a read waits for the whole step (Dispatcher.drain)


class Layout:
    """Offsets and views of the flat buffer for a fixed parameter order."""

    def __init__(
        self,
        order: Sequence[int],
        shapes: Sequence[torch.Size],
        dtype: torch.dtype,
        device: torch.device,
        standalone: Sequence[int] = (),
    ) -> None:
        n = len(shapes)
        if sorted(order) != list(range(n)):
            raise ValueError("the parameter order is not a permutation of the parameters")
        self.n = n
        self.numel = [int(torch.Size(s).numel()) for s in shapes]
        self.ext_len = [m + 1 for m in self.numel]  # gradient + "used" flag
        self.by_offset = list(order)[::-1]  # parameter at each layout position, lowest offset first
        self.offsets = [0] * n
        offset = 0
        for i in self.by_offset:
            self.offsets[i] = offset
            offset += self.ext_len[i]
        self.total = offset
        self.sorted_offsets = [self.offsets[i] for i in self.by_offset]
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.flat = torch.zeros(offset, dtype=dtype, device=device)
        flat, offs, ext = self.flat, self.offsets, self.ext_len
        self.ext_views = [flat[offs[i] : offs[i] + ext[i]] for i in range(n)]
        self.grad_views = [
            flat[offs[i] : offs[i] + self.numel[i]].view(shapes[i]) for i in range(n)
        ]
        self.flag_views = [flat[offs[i] + self.numel[i] : offs[i] + ext[i]] for i in range(n)]
        self.standalone = frozenset(standalone)
        self._templates: dict[int | None, tuple] = {}

    def flag_index(self, i: int) -> int:
        """Index of parameter i's "used" flag in the flat buffer."""
        return self.offsets[i] + self.numel[i]

    def params_in(self, start: int, length: int) -> tuple[int, int]:
        """Layout positions of the first and last parameter overlapping flat[start:start+length]."""
        offs = self.sorted_offsets
        return bisect.bisect_right(offs, start) - 1, bisect.bisect_right(
            offs, start + length - 1
        ) - 1

    def plan(self, partition_bytes: int | None, tail_bytes: int | None = None) -> Plan:
        """A fresh plan (its counters are per step) for a partition size and a tail window."""
        template = self._templates.get(partition_bytes)
        if template is None:
            template = self._templates[partition_bytes] = self._template(partition_bytes)
        plan = Plan(*template, self.total)
        if tail_bytes is not None:
            plan.tail = max(1, tail_bytes // self.elem)
        return plan

    def _template(self, partition_bytes: int | None) -> tuple:
        offsets, ext = self.offsets, self.ext_len
        if partition_bytes is None:
            parts = [(offsets[i], ext[i]) for i in self.by_offset]
            part_of = {i: k for k, i in enumerate(self.by_offset)}
            return parts, [(part_of[i],) for i in range(self.n)], [1] * len(parts)
        size = max(1, partition_bytes // self.elem)
        parts: list[tuple[int, int]] = []
        a = 0
        for i in self.by_offset:
            if i in self.standalone:
                parts += [(b, min(size, offsets[i] - b)) for b in range(a, offsets[i], size)]
                parts.append((offsets[i], ext[i]))
                a = offsets[i] + ext[i]
        parts += [(b, min(size, self.total - b)) for b in range(a, self.total, size)]
        starts = [start for start, _ in parts]
        counts = [0] * len(parts)
        param_parts = []
        for i in range(self.n):
            ks = tuple(
                range(
                    bisect.bisect_right(starts, offsets[i]) - 1,
                    bisect.bisect_right(starts, offsets[i] + ext[i] - 1),
                )
            )
            for k in ks:
                counts[k] += 1
            param_parts.append(ks)
        return parts, param_parts, counts
