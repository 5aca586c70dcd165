"""Row-sparse reduction of embedding gradients (`autobyte.scheduler.sparse_rows`): only the
rows some rank touched go on the wire, and the parameters stay DDP's bit for bit.

- the reduction itself against `all_reduce` of the same tensors, bit for bit, with the cases a
  value comparison misses (-0.0 rows on one rank, on every rank; a row touched by one rank only);
- which weights are eligible, and plans that keep an eligible weight one partition of its own;
- training against DDP on both hot paths under jitter and random reconfigurations: an untied
  embedding (reduced packed), the same with clipping, and a weight read densely by a functional
  output projection (falls back to the ordinary all-reduce and stays correct).
"""

from __future__ import annotations

import pytest
import torch
from autobyte.scheduler import sparse_rows
from autobyte.scheduler.layout import Layout
from torch import nn
from torch.nn import functional as F

from tests.helpers.dist import run_ranks, run_ranks_on
from tests.helpers.equiv import assert_case_equals_ddp, compare_with_ddp, ranks_on_path

ROWS, COLS = 4096, 64  # 1 MiB of float32: the smallest eligible table
D, SEQ, BATCH = COLS, 6, 4


def _bits(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).view(torch.int32).tolist()


def _reduce_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(7 + rank)
    out = {}
    for case in ("sparse", "dense", "unused"):
        # a neighbour's element (an odd offset: the zero test's wide view must cope), the weight,
        # its flag, and another neighbour's elements
        buffer = torch.zeros(1 + ROWS * COLS + 1 + 5)
        buffer[0] = 5.0
        flat = buffer[1:]
        grad = flat[: ROWS * COLS].view(ROWS, COLS)
        if case != "unused":  # "unused": no rank read the table this step (zeros, flag 0)
            touched = torch.randperm(ROWS, generator=gen)[: 100 if case == "sparse" else ROWS - 10]
            grad[touched] = torch.randn(len(touched), COLS, generator=gen)
            grad[touched[:3], :5] = -0.0  # -0.0 inside touched rows
            grad[11] = -0.0 if rank == 0 else 0.0  # a -0.0 row on one rank: DDP gives +0.0 there
            grad[12] = -0.0  # on every rank: DDP gives -0.0
            grad[13] = 0.0
            grad[13, 7] = float(rank + 1) if rank == 1 else 0.0  # touched by rank 1 only
            flat[ROWS * COLS] = 1.0  # the "used" flag
        flat[ROWS * COLS + 1 :] = 3.0  # must stay as it is
        expected = flat[: ROWS * COLS + 1].clone()
        dist.all_reduce(expected)
        entry = sparse_rows.SparseRows(1, ROWS, COLS)
        result = entry.reduce(buffer, None)
        if result is not None:
            work, unpack, nbytes = result
            work.wait()
            unpack()
        else:
            nbytes = None
            dist.all_reduce(flat[: entry.length])
        assert buffer[0].item() == 5.0
        out[case] = {
            "packed": result is not None,
            "nbytes": nbytes,
            "equal": _bits(flat[: ROWS * COLS + 1]) == _bits(expected),
            "neighbour": flat[ROWS * COLS + 1 :].tolist(),
            "row12": _bits(flat[12 * COLS : 13 * COLS]),
        }
    return out


def test_the_packed_reduction_equals_all_reduce_bit_for_bit():
    results = run_ranks(_reduce_worker, 2, timeout_s=60)
    minus_zero = torch.tensor([-0.0]).view(torch.int32).item()
    for got in results:
        sparse, dense, unused = got["sparse"], got["dense"], got["unused"]
        assert sparse["packed"] and unused["packed"], got
        assert sparse["equal"] and dense["equal"] and unused["equal"], got
        assert unused["nbytes"] == 4 + ROWS, "no row, only the flag (and the mask)"
        assert not dense["packed"], "more than half the rows touched: the whole slice is reduced"
        # 100 + 100 touched rows (at most) of 4096, plus rows 11-13: a small fraction of 1 MiB
        assert sparse["nbytes"] < 210 * COLS * 4 + ROWS + 8, sparse["nbytes"]
        assert sparse["neighbour"] == [3.0] * 5
        assert set(sparse["row12"]) == {minus_zero}, (
            "a row of -0.0 on every rank stays -0.0 (DDP's sum)"
        )


class TableModel(nn.Module):
    def __init__(self, bag: bool = False, tied_by_module: bool = False) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(ROWS, D) if bag else nn.Embedding(ROWS, D)
        self.small = nn.Embedding(10, D)
        self.head = nn.Linear(D, ROWS, bias=False)
        if tied_by_module:
            self.head.weight = self.embed.weight


def _index(params, tensor) -> int:
    return next(i for i, p in enumerate(params) if p is tensor)


def test_eligible_weights_are_large_untied_embeddings():
    model = TableModel()
    params = list(model.parameters())
    assert sparse_rows.eligible(model, params) == [_index(params, model.embed.weight)]
    bag = TableModel(bag=True)
    assert sparse_rows.eligible(bag, list(bag.parameters())) == [0]
    tied = TableModel(tied_by_module=True)
    assert sparse_rows.eligible(tied, list(tied.parameters())) == [], (
        "a tied table's gradient is dense"
    )
    narrow = nn.Embedding(1 << 20, 8)  # 32 MiB, but rows of 32 bytes: the mask would be 1/32 of it
    assert sparse_rows.eligible(narrow, list(narrow.parameters())) == []
    frozen = TableModel()
    params = [p for p in frozen.parameters() if p is not frozen.embed.weight]
    assert sparse_rows.eligible(frozen, params) == []


@pytest.mark.parametrize("partition_bytes", [None, 1, 4 << 10, 100 << 10, 1 << 20, 64 << 20])
def test_plans_keep_a_standalone_weight_one_partition_and_cover_every_element_once(partition_bytes):
    shapes = [torch.Size([300]), torch.Size([ROWS, COLS]), torch.Size([7, 9]), torch.Size([5000])]
    layout = Layout([2, 1, 0, 3], shapes, torch.float32, torch.device("cpu"), standalone=[1])
    plan = layout.plan(partition_bytes)
    covered = torch.zeros(layout.total, dtype=torch.int64)
    for start, length in plan.parts:
        covered[start : start + length] += 1
    assert covered.eq(1).all()
    assert (layout.offsets[1], layout.ext_len[1]) in plan.parts
    for i in range(layout.n):  # every parameter's partitions are the ones its slice overlaps
        a, b = layout.offsets[i], layout.offsets[i] + layout.ext_len[i]
        assert list(plan.param_parts[i]) == [
            k for k, (s, n) in enumerate(plan.parts) if s < b and s + n > a
        ]
    assert sum(plan.remaining) == sum(len(ks) for ks in plan.param_parts)
    if partition_bytes is not None:
        size = max(1, partition_bytes // 4)
        assert all(n <= size for (s, n) in plan.parts if s != layout.offsets[1])


class Classifier(nn.Module):
    """A token classifier with a 1 MiB untied embedding (row-sparse gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(ROWS, D)
        self.body = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.LayerNorm(D))
        self.head = nn.Linear(D, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)).mean(dim=1))


class FunctionalTie(nn.Module):
    """A language model whose output projection reads the embedding functionally: every row of the
    embedding gets a gradient (dense), which only the masks reveal."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(ROWS, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(self.embed(tokens)), self.embed.weight)


class TwoTables(nn.Module):
    """Each batch reads one of two tables (its first token's parity): in a step one table may be read
    by one rank only, or by none (its packed reduction then carries only the "used" flag)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Embedding(ROWS, D)
        self.b = nn.Embedding(ROWS, D)
        self.head = nn.Linear(D, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.a if int(tokens[0, 0]) % 2 == 0 else self.b
        return self.head(table(tokens).mean(dim=1))


def _classify(gen):
    return torch.randint(0, ROWS, (BATCH, SEQ), generator=gen), torch.randint(
        0, 3, (BATCH,), generator=gen
    )


def _lm(gen):
    tokens = torch.randint(0, ROWS, (BATCH, SEQ), generator=gen)
    return tokens, torch.roll(tokens, -1, 1)


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, ROWS), targets.reshape(-1))


CASES = {
    "classifier": (Classifier, _classify, F.cross_entropy, {}),
    "classifier_clipped": (Classifier, _classify, F.cross_entropy, {"clip_grad_norm": 0.05}),
    "functional_tie": (FunctionalTie, _lm, _lm_loss, {}),
    "two_tables": (TwoTables, _classify, F.cross_entropy, {}),
}
STEPS = 40


def _train_worker(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for k, name in enumerate(names):
        build, data, loss_fn, kwargs = CASES[name]
        ddp_kwargs = {
            "clip_grad_norm": kwargs.get("clip_grad_norm"),
            "find_unused": name == "two_tables",
        }
        got = compare_with_ddp(
            build,
            data,
            loss_fn,
            rank,
            STEPS,
            model_seed=5,
            data_seed=900,
            run_seed=k,
            ddp_kwargs=ddp_kwargs,
            **kwargs,
        )
        got["weights"], got["packed"] = (
            got["stats"]["sparse_rows_weights"],
            got["stats"]["sparse_rows_packed"],
        )
        out[name] = got
    return out


@pytest.fixture(scope="module", params=["native", "python"])
def trained(request):
    return ranks_on_path(
        run_ranks_on(request.param, _train_worker, 2, list(CASES), timeout_s=280), request.param
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_training_with_a_row_sparse_embedding_equals_ddp(trained, name):
    for got in assert_case_equals_ddp(trained, name, STEPS):
        if name == "two_tables":  # both tables every step, read or not
            assert got["weights"] == 2.0 and got["packed"] == 2 * STEPS, got
            continue
        assert got["weights"] == 1.0, got
        if name == "functional_tie":
            assert got["packed"] == 0.0, "a dense table is never sent packed"
        else:  # every step packed: 24 tokens per rank touch at most 48 of 4096 rows
            assert got["packed"] == STEPS, got


def test_the_smallest_table_can_be_set_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv(sparse_rows.MIN_BYTES_ENV, "0")
    small = TableModel()
    params = list(small.parameters())
    assert sparse_rows.eligible(small, params) == sorted(
        [_index(params, small.embed.weight), _index(params, small.small.weight)]
    )
    monkeypatch.setenv(sparse_rows.MIN_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match="AUTOBYTE_SPARSE_ROWS_MIN_BYTES.*'lots'"):
        sparse_rows.eligible(small, params)
    monkeypatch.setenv(sparse_rows.MIN_BYTES_ENV, "")
    assert sparse_rows.min_bytes() == sparse_rows.MIN_BYTES
