"""Model profiles for the simulator: per-layer forward/backward compute time and gradient sizes.

A profile lists the layers (modules that own parameters) in the order the forward pass first uses
them; that order is the scheduler's priority. Each layer carries the byte sizes of its parameter
tensors, because the scheduler partitions every tensor separately and DDP buckets tensors.

Four profiles are built from public layer shapes (VGG-16, ResNet-50 at 224x224, a BERT-base
encoder at sequence length 128, the GPT-2 small decoder at context 1024) with compute derived from FLOPs at a configurable device
throughput; `record_profile` measures one from a real torch model on this machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

BYTES_PER_PARAM = 4  # fp32 gradients

# Base device throughput for FLOP-derived profiles: roughly what a 2-core CPU sustains on
# convolutions and matrix products. `compute_scale` (e.g. 50 for a GPU) divides every time.
DEFAULT_DEVICE_FLOPS_PER_S = 1e11
# Element-wise layers (batch norm + ReLU, layer norm, embeddings) are memory-bound: charge this many
# FLOPs per element so that their share of a step is realistic (~10-20% for ResNet-50).
ELEMENTWISE_FLOPS_PER_ELEMENT = 10.0
BACKWARD_TO_FORWARD = 2.0  # gradient w.r.t. inputs and w.r.t. weights


@dataclasses.dataclass(frozen=True)
class RowSparseTable:
    """An embedding table whose gradient has a non-zero row only for the rows a batch looked up (the
    layer's first tensor). The scheduler reduces such a table row-sparse (client/autobyte/scheduler/
    sparse_rows.py; the simulator's model of it: simulator/engine.py, `sparse_wire`).

    `share`: the rows one worker's batch touches, as a share of `rows`; `overlap`: the share of
    those rows that every worker touches (a position table read at the same positions by every
    batch: 1; tokens drawn independently per worker: 0)."""

    rows: int
    share: float
    overlap: float = 0.0

    def __post_init__(self) -> None:
        if self.rows < 1 or not 0.0 <= self.share <= 1.0 or not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"a table needs rows >= 1 and share, overlap in [0, 1], got {self}")

    def union(self, workers: int) -> float:
        """The share of rows some worker touches: the common rows, plus the rest drawn independently
        by each worker (1 - (1 - p)^N for independent draws of share p)."""
        common = self.share * self.overlap
        if common >= 1.0:
            return 1.0
        own = (self.share - common) / (1.0 - common)  # of the rows outside the common ones
        return common + (1.0 - common) * (1.0 - (1.0 - own) ** max(1, workers))


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One module that owns parameters, in forward order."""

    name: str
    forward_s: float
    backward_s: float
    param_bytes: tuple[int, ...]  # one entry per parameter tensor
    table: RowSparseTable | None = (
        None  # param_bytes[0] is an embedding table (row-sparse gradient)
    )

    @property
    def total_param_bytes(self) -> int:
        return sum(self.param_bytes)


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """A model as the simulator sees it. `optimizer_s` is the optimizer step for all parameters."""

    name: str
    layers: tuple[LayerProfile, ...]
    batch_size: int = 1
    optimizer_s: float = 0.0
    source: str = "flops"  # "flops" (from shapes) or "recorded" (measured with torch hooks)

    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        return sum(layer.backward_s for layer in self.layers)

    @property
    def compute_s(self) -> float:
        """Forward + backward of one step, no communication."""
        return self.forward_s + self.backward_s

    @property
    def total_param_bytes(self) -> int:
        return sum(layer.total_param_bytes for layer in self.layers)

    @property
    def num_tensors(self) -> int:
        return sum(len(layer.param_bytes) for layer in self.layers)

    def scaled(self, compute_scale: float) -> ModelProfile:
        """The same model on a device `compute_scale` times faster (50 ~ a GPU against this CPU)."""
        if compute_scale <= 0:
            raise ValueError(f"compute_scale must be > 0, got {compute_scale}")
        layers = tuple(
            dataclasses.replace(
                layer,
                forward_s=layer.forward_s / compute_scale,
                backward_s=layer.backward_s / compute_scale,
            )
            for layer in self.layers
        )
        return dataclasses.replace(
            self, layers=layers, optimizer_s=self.optimizer_s / compute_scale
        )

    def with_compute_s(self, compute_s: float) -> ModelProfile:
        """Rescale so that forward + backward takes `compute_s` (keeps the per-layer shares)."""
        return self.scaled(self.compute_s / compute_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "batch_size": self.batch_size,
            "optimizer_s": self.optimizer_s,
            "source": self.source,
            "layers": [
                {
                    "name": layer.name,
                    "forward_s": layer.forward_s,
                    "backward_s": layer.backward_s,
                    "param_bytes": list(layer.param_bytes),
                    **({"table": dataclasses.asdict(layer.table)} if layer.table else {}),
                }
                for layer in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        layers = tuple(
            LayerProfile(
                name=item["name"],
                forward_s=float(item["forward_s"]),
                backward_s=float(item["backward_s"]),
                param_bytes=tuple(int(b) for b in item["param_bytes"]),
                table=RowSparseTable(
                    int(item["table"]["rows"]),
                    float(item["table"]["share"]),
                    float(item["table"].get("overlap", 0.0)),
                )
                if item.get("table")
                else None,
            )
            for item in data["layers"]
        )
        return cls(
            name=data["name"],
            layers=layers,
            batch_size=int(data.get("batch_size", 1)),
            optimizer_s=float(data.get("optimizer_s", 0.0)),
            source=str(data.get("source", "recorded")),
        )

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | pathlib.Path) -> ModelProfile:
        return cls.from_dict(json.loads(pathlib.Path(path).read_text()))


class _ShapeBuilder:
    """Accumulates layers with FLOP counts, then turns FLOPs into seconds."""

    def __init__(self, batch_size: int, device_flops_per_s: float) -> None:
        self.batch_size = batch_size
        self.device_flops_per_s = device_flops_per_s
        self.layers: list[LayerProfile] = []

    def add(
        self,
        name: str,
        forward_flops_per_sample: float,
        params: Sequence[int],
        table: RowSparseTable | None = None,
    ) -> None:
        forward_s = forward_flops_per_sample * self.batch_size / self.device_flops_per_s
        self.layers.append(
            LayerProfile(
                name,
                forward_s,
                forward_s * BACKWARD_TO_FORWARD,
                tuple(int(p) * BYTES_PER_PARAM for p in params),
                table,
            )
        )

    def embedding(
        self, name: str, rows: int, dim: int, lookups: int, *, shared: bool = False
    ) -> None:
        """A table of `rows` x `dim` read at `lookups` rows per sample: uniformly drawn tokens (the
        distinct rows of batch x lookups draws), or `shared`: the same rows for every sample and
        worker (positions)."""
        draws = lookups * (1 if shared else self.batch_size)
        share = min(1.0, draws / rows) if shared else 1.0 - math.exp(-draws / rows)
        self.add(
            name,
            ELEMENTWISE_FLOPS_PER_ELEMENT * lookups * dim,
            [rows * dim],
            RowSparseTable(rows, share, 1.0 if shared else 0.0),
        )

    def conv(
        self,
        name: str,
        c_in: int,
        c_out: int,
        kernel: int,
        h_out: int,
        w_out: int,
        bias: bool = False,
    ) -> None:
        flops = 2.0 * kernel * kernel * c_in * c_out * h_out * w_out
        params = [kernel * kernel * c_in * c_out] + ([c_out] if bias else [])
        self.add(name, flops, params)

    def norm(self, name: str, channels: int, elements: int) -> None:
        self.add(name, ELEMENTWISE_FLOPS_PER_ELEMENT * elements, [channels, channels])

    def linear(
        self, name: str, d_in: int, d_out: int, tokens: int = 1, extra_flops: float = 0.0
    ) -> None:
        self.add(name, 2.0 * d_in * d_out * tokens + extra_flops, [d_in * d_out, d_out])

    def build(self, name: str, optimizer_s_per_byte: float = 0.0) -> ModelProfile:
        layers = tuple(self.layers)
        total = sum(layer.total_param_bytes for layer in layers)
        return ModelProfile(name, layers, self.batch_size, optimizer_s=total * optimizer_s_per_byte)


# Optimizer (SGD with momentum) cost per gradient byte at the base device throughput: a few
# memory passes over parameters, gradients and momentum (~1 GB/s effective on a small CPU).
_OPTIMIZER_S_PER_BYTE = 1e-9 * 3


def vgg16(
    batch_size: int = 32, device_flops_per_s: float = DEFAULT_DEVICE_FLOPS_PER_S
) -> ModelProfile:
    """VGG-16 (configuration D) at 224x224: 13 conv + 3 fully connected layers, 138.4M params."""
    b = _ShapeBuilder(batch_size, device_flops_per_s)
    plan = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    size, c_in, index = 224, 3, 0
    for item in plan:
        if item == "M":
            size //= 2
            continue
        b.conv(f"features.{index}", c_in, int(item), 3, size, size, bias=True)
        c_in, index = int(item), index + 1
    b.linear("classifier.0", 512 * 7 * 7, 4096)
    b.linear("classifier.3", 4096, 4096)
    b.linear("classifier.6", 4096, 1000)
    return b.build("vgg16", _OPTIMIZER_S_PER_BYTE)


def resnet50(
    batch_size: int = 32, device_flops_per_s: float = DEFAULT_DEVICE_FLOPS_PER_S
) -> ModelProfile:
    """ResNet-50 v1.5 (torchvision layout) at 224x224: 53 conv, 53 batch norms, fc; 25.6M params."""
    b = _ShapeBuilder(batch_size, device_flops_per_s)
    b.conv("conv1", 3, 64, 7, 112, 112)
    b.norm("bn1", 64, 64 * 112 * 112)
    c_in, size = 64, 56
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        c_out = width * 4
        for block in range(blocks):
            stride = 2 if (block == 0 and stage > 1) else 1
            out_size = size // stride
            prefix = f"layer{stage}.{block}"
            b.conv(f"{prefix}.conv1", c_in, width, 1, size, size)
            b.norm(f"{prefix}.bn1", width, width * size * size)
            b.conv(f"{prefix}.conv2", width, width, 3, out_size, out_size)
            b.norm(f"{prefix}.bn2", width, width * out_size * out_size)
            b.conv(f"{prefix}.conv3", width, c_out, 1, out_size, out_size)
            b.norm(f"{prefix}.bn3", c_out, c_out * out_size * out_size)
            if block == 0:
                b.conv(f"{prefix}.downsample.0", c_in, c_out, 1, out_size, out_size)
                b.norm(f"{prefix}.downsample.1", c_out, c_out * out_size * out_size)
            c_in, size = c_out, out_size
    b.linear("fc", 2048, 1000)
    return b.build("resnet50", _OPTIMIZER_S_PER_BYTE)


def bert_base(
    batch_size: int = 32, seq_len: int = 128, device_flops_per_s: float = DEFAULT_DEVICE_FLOPS_PER_S
) -> ModelProfile:
    """A BERT-base encoder: 30522-token vocabulary, 12 layers, hidden 768, 12 heads, FFN 3072."""
    hidden, ffn, layers, vocab, positions = 768, 3072, 12, 30522, 512
    b = _ShapeBuilder(batch_size, device_flops_per_s)
    elements = seq_len * hidden
    # Embedding lookups are cheap; their gradients are row-sparse (uniform tokens: an upper bound on
    # the rows real text touches), the positions the same seq_len rows on every worker.
    b.embedding("embeddings.word", vocab, hidden, seq_len)
    b.embedding("embeddings.position", positions, hidden, seq_len, shared=True)
    b.embedding("embeddings.token_type", 2, hidden, seq_len, shared=True)
    b.norm("embeddings.norm", hidden, elements)
    # Scores (QK^T) and context (AV): 2 * 2 * seq^2 * hidden, plus softmax over heads x seq^2.
    attention_flops = (
        4.0 * seq_len * seq_len * hidden + ELEMENTWISE_FLOPS_PER_ELEMENT * 12 * seq_len**2
    )
    for index in range(layers):
        prefix = f"encoder.{index}"
        b.linear(f"{prefix}.attention.query", hidden, hidden, seq_len)
        b.linear(f"{prefix}.attention.key", hidden, hidden, seq_len)
        b.linear(f"{prefix}.attention.value", hidden, hidden, seq_len)
        b.linear(f"{prefix}.attention.output", hidden, hidden, seq_len, extra_flops=attention_flops)
        b.norm(f"{prefix}.attention.norm", hidden, elements)
        b.linear(
            f"{prefix}.ffn.intermediate",
            hidden,
            ffn,
            seq_len,
            extra_flops=ELEMENTWISE_FLOPS_PER_ELEMENT * seq_len * ffn,
        )
        b.linear(f"{prefix}.ffn.output", ffn, hidden, seq_len)
        b.norm(f"{prefix}.ffn.norm", hidden, elements)
    b.linear("pooler", hidden, hidden)
    return b.build("bert-base", _OPTIMIZER_S_PER_BYTE)


def gpt2(
    batch_size: int = 8,
    seq_len: int = 1024,
    device_flops_per_s: float = DEFAULT_DEVICE_FLOPS_PER_S,
    hidden: int = 768,
    layers: int = 12,
    name: str = "gpt2",
) -> ModelProfile:
    """The GPT-2 small decoder (124.4M parameters): 50257-token vocabulary, 12 pre-norm blocks of
    hidden 768 (12 heads, FFN 3072), a final layer norm and an LM head tied to the token embedding;
    `hidden` and `layers` give the larger GPT-2s (FFN 4 x hidden; `gpt2_medium`).

    The tied table is first used by the input lookup, so it is the first layer, and its gradient is
    dense (the LM head writes every row) and complete only at the end of the backward pass; the LM
    head's product is charged to `ln_f`, the last layer of the forward pass (its backward runs first,
    before `ln_f`'s gradient is ready)."""
    ffn, vocab = 4 * hidden, 50257
    b = _ShapeBuilder(batch_size, device_flops_per_s)
    elements = seq_len * hidden
    b.add("wte", ELEMENTWISE_FLOPS_PER_ELEMENT * elements, [vocab * hidden])
    b.embedding("wpe", 1024, hidden, seq_len, shared=True)
    attention_flops = (
        4.0 * seq_len * seq_len * hidden + ELEMENTWISE_FLOPS_PER_ELEMENT * 12 * seq_len**2
    )
    for index in range(layers):
        prefix = f"h.{index}"
        b.norm(f"{prefix}.ln_1", hidden, elements)
        b.linear(f"{prefix}.attn.c_attn", hidden, 3 * hidden, seq_len, extra_flops=attention_flops)
        b.linear(f"{prefix}.attn.c_proj", hidden, hidden, seq_len)
        b.norm(f"{prefix}.ln_2", hidden, elements)
        b.linear(
            f"{prefix}.mlp.c_fc",
            hidden,
            ffn,
            seq_len,
            extra_flops=ELEMENTWISE_FLOPS_PER_ELEMENT * seq_len * ffn,
        )
        b.linear(f"{prefix}.mlp.c_proj", ffn, hidden, seq_len)
    b.add(
        "ln_f",
        ELEMENTWISE_FLOPS_PER_ELEMENT * elements + 2.0 * hidden * vocab * seq_len,
        [hidden, hidden],
    )
    return b.build(name, _OPTIMIZER_S_PER_BYTE)


def gpt2_medium(
    batch_size: int = 8, seq_len: int = 1024, device_flops_per_s: float = DEFAULT_DEVICE_FLOPS_PER_S
) -> ModelProfile:
    """GPT-2 medium (354.8M parameters, 1.42 GB of fp32 gradients in 292 tensors): 24 blocks of
    hidden 1024 (FFN 4096), otherwise as `gpt2`."""
    return gpt2(batch_size, seq_len, device_flops_per_s, 1024, 24, "gpt2-medium")


BUILTIN_PROFILES: dict[str, Callable[..., ModelProfile]] = {
    "vgg16": vgg16,
    "resnet50": resnet50,
    "bert-base": bert_base,
    "gpt2": gpt2,
    "gpt2-medium": gpt2_medium,
}


def load_profile(
    name_or_path: str,
    batch_size: int | None = None,
    device_flops_per_s: float = DEFAULT_DEVICE_FLOPS_PER_S,
) -> ModelProfile:
    """A built-in profile by name, or a recorded profile from a JSON file."""
    if name_or_path in BUILTIN_PROFILES:
        kwargs: dict[str, Any] = {"device_flops_per_s": device_flops_per_s}
        if batch_size is not None:
            kwargs["batch_size"] = batch_size
        return BUILTIN_PROFILES[name_or_path](**kwargs)
    path = pathlib.Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        return ModelProfile.load(path)
    raise ValueError(
        f"unknown model {name_or_path!r}: use one of {sorted(BUILTIN_PROFILES)} "
        "or a profile JSON written by record_profile"
    )


def record_profile(
    model: Any,
    make_batch: Callable[[], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], Any],
    *,
    name: str = "recorded",
    optimizer: Any = None,
    warmup_steps: int = 2,
    steps: int = 5,
) -> ModelProfile:
    """Measure a profile from a real torch model on this machine.

    Forward time of a layer is the time from its forward pre-hook to the next layer's (parameter-free
    modules in between are charged to the layer before them), so layers are in first-use order.
    Backward time of a layer is the gap between its gradients becoming ready and the previous ready
    gradient (post-accumulate-grad hooks), which is exactly what the scheduler sees. Medians over
    `steps` after `warmup_steps`. An `nn.Embedding` / `nn.EmbeddingBag` weight held by no other
    module is a `RowSparseTable`: the share of its gradient's rows with a non-zero element (this
    process's batches; `overlap` 0: one process cannot see which rows other workers share).
    """
    import torch
    from autobyte.scheduler.sparse_rows import embedding_tables

    modules = [
        (mod_name, module)
        for mod_name, module in model.named_modules()
        if any(True for _ in module.parameters(recurse=False))
    ]
    forward_marks: list[tuple[int, float]] = []
    grad_marks: dict[int, float] = {}
    param_owner: dict[int, int] = {}
    handles = []
    for index, (_, module) in enumerate(modules):
        handles.append(
            module.register_forward_pre_hook(
                lambda _m, _i, index=index: forward_marks.append((index, time.perf_counter()))
            )
        )
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                param_owner[id(param)] = index
                handles.append(
                    param.register_post_accumulate_grad_hook(
                        lambda p, index=index: grad_marks.__setitem__(index, time.perf_counter())
                    )
                )

    untied = {id(module) for module, _ in embedding_tables(model)}
    tables = {
        index: module.weight
        for index, (_, module) in enumerate(modules)
        if id(module) in untied and module.weight.requires_grad
    }
    touched: dict[int, list[float]] = {index: [] for index in tables}
    samples: list[tuple[list[float], list[float], float, list[int]]] = []
    try:
        for step in range(warmup_steps + steps):
            inputs, target = make_batch()
            forward_marks.clear()
            grad_marks.clear()
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss = loss_fn(model(inputs), target)
            forward_end = time.perf_counter()
            loss.backward()
            backward_end = time.perf_counter()
            if step >= warmup_steps:
                for index, weight in tables.items():
                    grad = weight.grad
                    rows = 0.0 if grad is None else float((grad != 0).any(dim=1).float().mean())
                    touched[index].append(rows)
            optimizer_s = 0.0
            if optimizer is not None:
                opt_start = time.perf_counter()
                optimizer.step()
                optimizer_s = time.perf_counter() - opt_start
            if step < warmup_steps:
                continue
            first_use: list[int] = []
            seen: set[int] = set()
            marks: list[tuple[int, float]] = []
            for index, mark in forward_marks:
                if index not in seen:
                    seen.add(index)
                    first_use.append(index)
                    marks.append((index, mark))
            forward = [0.0] * len(modules)
            bounds = [mark for _, mark in marks] + [forward_end]
            for position, (index, mark) in enumerate(marks):
                forward[index] = bounds[position + 1] - mark
            if marks:  # work before the first parameterised module belongs to the first layer
                forward[marks[0][0]] += marks[0][1] - start
            backward = [0.0] * len(modules)
            previous = forward_end
            for index, mark in sorted(grad_marks.items(), key=lambda item: item[1]):
                backward[index] = mark - previous
                previous = mark
            if grad_marks:
                tail = backward_end - previous
                backward[min(grad_marks, key=grad_marks.get)] += tail
            samples.append((forward, backward, optimizer_s, first_use))
    finally:
        for handle in handles:
            handle.remove()

    order = samples[-1][3] + [i for i in range(len(modules)) if i not in samples[-1][3]]

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2]

    layers = []
    for index in order:
        mod_name, module = modules[index]
        sizes = tuple(
            p.numel() * p.element_size()
            for p in module.parameters(recurse=False)
            if p.requires_grad
        )
        table = None
        if index in tables and touched[index] and sizes:
            table = RowSparseTable(int(tables[index].shape[0]), median(touched[index]))
        layers.append(
            LayerProfile(
                mod_name or "model",
                median([s[0][index] for s in samples]),
                median([s[1][index] for s in samples]),
                sizes,
                table,
            )
        )
    batch_size = 1
    inputs, _ = make_batch()
    if isinstance(inputs, torch.Tensor) and inputs.dim() > 0:
        batch_size = int(inputs.shape[0])
    optimizer_s = median([s[2] for s in samples]) if samples else 0.0
    if math.isnan(optimizer_s):
        optimizer_s = 0.0
    return ModelProfile(name, tuple(layers), batch_size, optimizer_s, source="recorded")
