"""Benchmark workloads in plain torch (no downloads): MLP, VGG-style, ResNet-50, BERT-style encoders,
a GPT-style decoder.

Each builder returns a `Workload`: the model, a function that makes a synthetic batch, and the loss.
The shapes of VGG, ResNet-50 and BERT-base are their public layer shapes; `width`, `image_size`,
`layers`, `hidden` shrink them so that a step fits a 2-core machine and stays communication-bound.

    workload = build("mlp")                  # 6.8M parameters, batch 128 by default
    inputs, targets = workload.make_batch(128, torch.Generator().manual_seed(0))
    loss = workload.loss_fn(workload.model(inputs), targets)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.testbed.workload import Batch, Workload

# The workload's shape lives in its own module: the emulated builder (benchmarks/testbed/emulated.py)
# returns one too, and this module's registry builds it.
__all__ = ["BUILDERS", "Batch", "Workload", "build"]


def _classification_batch(
    shape: tuple[int, ...], classes: int
) -> Callable[[int, torch.Generator], Batch]:
    def make(batch_size: int, generator: torch.Generator) -> Batch:
        inputs = torch.randn((batch_size, *shape), generator=generator)
        return inputs, torch.randint(0, classes, (batch_size,), generator=generator)

    return make


# ---- MLP -----------------------------------------------------------------------------------------


def mlp(in_features: int = 512, hidden: int = 1024, depth: int = 6, classes: int = 10) -> Workload:
    """in -> hidden, `depth` x (hidden -> hidden), hidden -> classes. Defaults: 6.83M parameters."""
    layers: list[nn.Module] = [nn.Linear(in_features, hidden), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    layers.append(nn.Linear(hidden, classes))
    return Workload(
        "mlp",
        nn.Sequential(*layers),
        _classification_batch((in_features,), classes),
        nn.functional.cross_entropy,
        128,
    )


# ---- VGG -----------------------------------------------------------------------------------------

VGG_CONFIGS = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}


class VGG(nn.Module):
    def __init__(
        self,
        depth: int = 16,
        width: float = 1.0,
        image_size: int = 32,
        hidden: int = 4096,
        classes: int = 10,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        size = image_size
        for item in VGG_CONFIGS[depth]:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
                size //= 2
                continue
            out = max(8, int(item * width))
            layers.append(nn.Conv2d(channels, out, 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU(inplace=True))
            channels = out
        self.features = nn.Sequential(*layers)
        flat = channels * max(1, size) ** 2
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(flat, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def vgg(
    depth: int = 11, width: float = 0.5, image_size: int = 32, hidden: int = 1024, classes: int = 10
) -> Workload:
    """VGG-style convnet at small resolution. Defaults: VGG-11 at half width, 32x32, 3.6M params.

    `vgg(depth=16, width=1.0, image_size=224, hidden=4096, classes=1000)` is VGG-16's shape (138M).
    """
    model = VGG(depth, width, image_size, hidden, classes)
    return Workload(
        f"vgg{depth}",
        model,
        _classification_batch((3, image_size, image_size), classes),
        nn.functional.cross_entropy,
        32,
    )


# ---- ResNet-50 -----------------------------------------------------------------------------------


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        out = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNet(nn.Module):
    def __init__(
        self, blocks: tuple[int, ...] = (3, 4, 6, 3), width: float = 1.0, classes: int = 1000
    ) -> None:
        super().__init__()
        base = max(8, int(64 * width))
        self.stem = nn.Sequential(
            nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(base),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        in_channels = base
        for index, count in enumerate(blocks):
            channels = base * 2**index
            for block in range(count):
                stride = 2 if block == 0 and index > 0 else 1
                stages.append(Bottleneck(in_channels, channels, stride))
                in_channels = channels * Bottleneck.expansion
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def resnet50(width: float = 1.0, image_size: int = 64, classes: int = 1000) -> Workload:
    """ResNet-50's shape (25.6M parameters at width 1, 1000 classes); small images cut compute."""
    return Workload(
        "resnet50",
        ResNet((3, 4, 6, 3), width, classes),
        _classification_batch((3, image_size, image_size), classes),
        nn.functional.cross_entropy,
        16,
    )


# ---- BERT-style encoder --------------------------------------------------------------------------


class BertEncoder(nn.Module):
    def __init__(
        self,
        vocab: int = 30522,
        hidden: int = 768,
        layers: int = 12,
        heads: int = 12,
        intermediate: int = 3072,
        max_positions: int = 512,
        classes: int = 2,
    ) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.token_type = nn.Embedding(2, hidden)
        self.norm = nn.LayerNorm(hidden)
        layer = nn.TransformerEncoderLayer(
            hidden, heads, intermediate, dropout=0.0, activation="gelu", batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooler = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word(tokens) + self.position(positions) + self.token_type(torch.zeros_like(tokens))
        x = self.encoder(self.norm(x))
        return self.head(torch.tanh(self.pooler(x[:, 0])))


def bert(
    hidden: int = 768,
    layers: int = 12,
    heads: int = 12,
    intermediate: int | None = None,
    vocab: int = 30522,
    sequence: int = 64,
    classes: int = 2,
) -> Workload:
    """A BERT-base-style encoder (≈110M parameters at the defaults) for sequence classification."""
    model = BertEncoder(
        vocab, hidden, layers, heads, intermediate or 4 * hidden, max(512, sequence), classes
    )

    def make(batch_size: int, generator: torch.Generator) -> Batch:
        tokens = torch.randint(0, vocab, (batch_size, sequence), generator=generator)
        return tokens, torch.randint(0, classes, (batch_size,), generator=generator)

    return Workload("bert", model, make, nn.functional.cross_entropy, 8)


def transformer(
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    vocab: int = 8192,
    sequence: int = 64,
    classes: int = 2,
) -> Workload:
    """A small BERT-style encoder (≈5.5M parameters, 57 tensors) sized for this 2-core testbed:
    `nn.TransformerEncoder` layers, so `nn.MultiheadAttention` reads `out_proj` without calling it."""
    workload = bert(hidden, layers, heads, None, vocab, sequence, classes)
    return Workload("transformer", workload.model, workload.make_batch, workload.loss_fn, 16)


class GptBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class TinyGpt(nn.Module):
    """A GPT-2-style decoder: token + position embeddings, pre-norm blocks, an LM head tied to the
    token embedding (the habits of GPT2LMHeadModel, torch only)."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(context, hidden)
        self.blocks = nn.ModuleList([GptBlock(hidden, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=tokens.device), diagonal=1)
        x = self.tok(tokens) + self.pos(torch.arange(n, device=tokens.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def tiny_gpt(
    vocab: int = 512, hidden: int = 64, layers: int = 2, heads: int = 4, context: int = 32
) -> Workload:
    """A tiny GPT-2-style LM (≈0.13M parameters at the defaults, 28 tensors): next-token loss."""
    model = TinyGpt(vocab, hidden, layers, heads, context)

    def make(batch_size: int, generator: torch.Generator) -> Batch:
        tokens = torch.randint(0, vocab, (batch_size, context + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )

    return Workload("tiny_gpt", model, make, loss, 8)


def emulated(**overrides: Any) -> Workload:
    """A profile's layers on an emulated accelerator (benchmarks/testbed/emulated.py): timed waits, real
    gradients of the profile's sizes."""
    from benchmarks.testbed.emulated import build_emulated

    return build_emulated(**overrides)


BUILDERS: dict[str, Callable[..., Workload]] = {
    "mlp": mlp,
    "vgg": vgg,
    "resnet50": resnet50,
    "bert": bert,
    "transformer": transformer,
    "tiny_gpt": tiny_gpt,
    "emulated": emulated,
}


def build(name: str, **overrides: Any) -> Workload:
    """Build a workload by name ('mlp', 'vgg', 'resnet50', 'bert', 'transformer', 'tiny_gpt',
    'emulated') with keyword overrides."""
    try:
        builder = BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(BUILDERS)}") from None
    return builder(**overrides)
