"""The scheduler on models whose parameters are read outside their own module's forward: transformers
(nn.MultiheadAttention reads out_proj without calling it), tied embeddings, ViT blocks, functional
reads of a sibling's weight. Every case equals DDP bit for bit over 60 steps under jitter and random
reconfigurations on 2 gloo ranks, with every untied embedding reduced row-sparse (the encoders' tables
are sent packed; the tied decoder's is dense)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.helpers.dist import SPARSE_ROWS_EVERYWHERE, run_ranks_on
from tests.helpers.equiv import assert_case_equals_ddp, compare_with_ddp, ranks_on_path

pytestmark = pytest.mark.slow

STEPS = 60
D, HEADS, VOCAB, SEQ, BATCH = 32, 4, 512, 6, 4


class Encoder(nn.Module):
    """nn.TransformerEncoder for sequence classification (batch_first or not)."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if not self.batch_first:
            x = x.transpose(0, 1)
        x = self.encoder(x)
        return self.head(x.mean(dim=1 if self.batch_first else 0))


class TiedDecoder(nn.Module):
    """A causal decoder whose output projection is the input embedding (tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.position = nn.Parameter(torch.randn(SEQ, D) * 0.02)
        self.block = nn.TransformerEncoderLayer(
            D, HEADS, 2 * D, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        x = self.block(self.embed(tokens) + self.position, src_mask=mask, is_causal=True)
        return self.lm_head(self.norm(x))


class ViTBlock(nn.Module):
    """Patch embedding, a class token and position embedding read by the root module, a pre-norm
    block with its own attention written by hand (qkv and proj read functionally)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, D, 4, stride=4)
        self.cls = nn.Parameter(torch.zeros(1, 1, D))
        self.pos = nn.Parameter(torch.randn(1, 5, D) * 0.02)
        self.norm1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.norm2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.head = nn.Linear(D, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        b, n, _ = x.shape
        q, k, v = (
            F.linear(self.norm1(x), self.qkv.weight, self.qkv.bias)
            .view(b, n, 3, HEADS, -1)
            .unbind(2)
        )
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        x = x + F.linear(attn.transpose(1, 2).reshape(b, n, D), self.proj.weight, self.proj.bias)
        x = x + self.mlp(self.norm2(x))
        return self.head(x[:, 0])


class Siblings(nn.Module):
    """`b` never runs its own forward: its weight is read functionally by the parent."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(24, 3)  # registered first, used last
        self.a = nn.Linear(12, 24)
        self.b = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(F.linear(h, self.b.weight, self.b.bias))
        return self.c(h)


def _tokens_cls(gen):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(
        0, 3, (BATCH,), generator=gen
    )


def _tokens_lm(gen):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, torch.roll(tokens, -1, 1)


def _images(gen):
    return torch.randn(BATCH, 3, 8, 8, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen)


def _vectors(gen):
    return torch.randn(BATCH, 12, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen)


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


CASES = {
    "encoder_batch_first": (lambda: Encoder(True), _tokens_cls, F.cross_entropy),
    "encoder_seq_first": (lambda: Encoder(False), _tokens_cls, F.cross_entropy),
    "tied_decoder": (TiedDecoder, _tokens_lm, _lm_loss),
    "vit_block": (ViTBlock, _images, F.cross_entropy),
    "sibling_functional": (Siblings, _vectors, F.cross_entropy),
}


def _case_worker(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for k, name in enumerate(names):
        build, data, loss_fn = CASES[name]
        out[name] = compare_with_ddp(
            build, data, loss_fn, rank, STEPS, model_seed=11, data_seed=500, run_seed=k
        )
    return out


@pytest.fixture(scope="module", params=["native", "python"])
def model_cases(request):
    """Both hot paths (AUTOBYTE_NATIVE in the ranks' environment); each must really run."""
    return ranks_on_path(
        run_ranks_on(
            request.param, _case_worker, 2, list(CASES), timeout_s=280, env=SPARSE_ROWS_EVERYWHERE
        ),
        request.param,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_parameters_read_outside_their_module_equal_ddp(model_cases, name):
    for got in assert_case_equals_ddp(model_cases, name, STEPS):
        if name.startswith("encoder"):
            assert got["stats"]["sparse_rows_packed"] == STEPS, (
                "24 tokens per rank: sent packed every step"
            )
