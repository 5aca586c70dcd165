"""Train the tuner's prior from simulator runs and write it into the daemon package (fixed seeds).

    python -m simulator.train_prior                 # writes autobyted/tuner/prior.model
    python -m simulator.train_prior --check         # regenerates in memory, compares with the file

Training data: `CONTEXTS` random contexts, each a model, a worker count, a link bandwidth, a device
speed and a link cost model, of four kinds drawn alike (`KINDS`: CPU ranks on a gloo-like link, the
2-core testbed's calibrated gloo, GPUs on NCCL, and the emulated-accelerator testbed: a slow device
at 2-8 ranks on this host's gloo as measured at that rank count, simulator/links.py); in each, `CONFIGS_PER_CONTEXT` configurations of the tuner's own
candidate grid (always including the scheduler's default) run to a settled state in the simulator,
and a window of `WINDOW_STEPS` steps of each goes through the same adapter the `autobyte` policy
uses (simulator/adapter.py: noisy StepMetrics, what a rank reports). Pairs of windows of
one context are the training rows (autobyted/tuner/predictor.py). Beside them, the real windows of
the checked-in testbed dataset (simulator/real_windows.py; `benchmarks/record_windows.py` records
it): the CPU testbed's weighted to REAL_SHARE of the total, the emulated-accelerator ranks' to
EMULATED_SHARE. Models: the three public shapes
(VGG-16, ResNet-50, BERT-base), the testbed MLP's recorded profile, and random synthetic models
(layer counts, tensor sizes and compute drawn at random) so that the prior is not only a lookup of
four shapes. Each job's per-collective latency is what its ranks would measure on its link
(`LinkModel.tiny_collective_s`), but in UNMEASURED_SHARE of the contexts, left unknown. The checked-in scenarios are not used. `--exclude-model NAME` trains without one model
(the left-out-model error in benchmarks/bench_tuner.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import pathlib
import random
import sys
import time
from collections.abc import Sequence

import numpy as np
from autobyte.types import Config

from autobyted.tuner.features import summarize
from autobyted.tuner.predictor import Ensemble, TrainingSet, Window, train_ensemble, training_pairs
from autobyted.tuner.search import candidate_grid
from simulator.adapter import SCHEDULER_DEFAULT, MetricsAdapter, job_shape
from simulator.engine import LinkModel, Simulator
from simulator.links import gloo_n_link, lone_collective_s
from simulator.profiles import (
    LayerProfile,
    ModelProfile,
    RowSparseTable,
    bert_base,
    resnet50,
    vgg16,
)
from simulator.real_windows import DATASET_PATH, real_windows
from simulator.trace import PiecewiseConstant

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRIOR_PATH = ROOT / "autobyted" / "tuner" / "prior.model"
SEED = 0
CONTEXTS = 480
CONFIGS_PER_CONTEXT = 8
WINDOW_STEPS = 12
SETTLE_STEPS = 2
GBIT = 1e9 / 8
# Share of the training weight carried by the real (testbed) windows. The simulator covers what the
# testbed cannot make (GPUs, NCCL, 4-64 workers, models of every shape); where both have data (gloo
# on a 2-core host, the testbed's models and conditions) the real windows should correct it. They are
# few jobs (12 blocks) but many pairs in a narrow region of the features, so even a quarter of the
# weight dominates the leaves of that region. Chosen by benchmarks/predictor_error.py on left-out
# blocks (pooled median error, left-out model / left-out condition): 25% 7.9% / 10.5%, 50% 8.2% /
# 11.0%, 75% 8.7% / 11.2% (simulator only: 10.1% / 10.1%).
REAL_SHARE = 0.25
# Share of the training weight carried by the windows recorded on emulated-accelerator ranks
# (`benchmarks/record_windows.py --emulated`: 2-8 ranks, steps of 0.4-4 s, the derived start and
# the grid the tuner searches around it). Given apart from REAL_SHARE: they are fewer pairs (about
# 11 configurations a round against the CPU blocks' 29), so inside one share they would carry a
# few per cent of it, and the regime they cover (a slow device, gloo's per-collective cost at up to
# 8 ranks) is one the simulator and the CPU blocks do not measure. Chosen by
# `benchmarks/predictor_error.py --emulated` on left-out emulated blocks (docs/results.md, the
# predictor in the accelerator regime).
EMULATED_SHARE = 0.25
# Share of the simulated contexts whose jobs did not measure their per-collective latency (a
# client before registrations carried it: autobyted/tuner/features.py's latency shares missing),
# so that the prior has learnt to predict without it too rather than guess where it is missing.
UNMEASURED_SHARE = 0.25

GLOO_CPU = LinkModel(
    latency_s=0.0,
    collective_overhead_s=1.35e-3,
    launch_s=40e-6,
    ddp_launch_s=20e-6,
    comm_cpu_s_per_byte=1.1e-9,
    lone_collective_s=lone_collective_s(2),  # what its ranks measure at construction
)  # the testbed's calibrated gloo (2-core machine)
GLOO = LinkModel()  # gloo-like defaults
NCCL = LinkModel(latency_s=5e-6, collective_overhead_s=50e-6, launch_s=50e-6, ddp_launch_s=10e-6)
# The kinds of context, drawn alike: CPU ranks on a gloo-like link (2-64), the 2-core testbed's
# calibrated gloo (2 ranks), GPUs on NCCL, and the emulated-accelerator testbed (emulated_context).
KINDS = ("cpu", "cpu-gloo", "gpu", "emulated")
EMULATED_RANKS = (2, 4, 8)  # the rank counts gloo's per-collective cost was measured at
EMULATED_BYTE_SCALES = (8, 16, 32, 64, 128)  # the shipped emulated scenarios' scales


def synthetic_model(rng: random.Random, index: int, tables: random.Random) -> ModelProfile:
    """A random model: 3-80 layers, 1-3 tensors each, log-uniform sizes, compute loosely tied to size;
    one in four starts with an embedding table (2^12-2^17 rows of 64-1024 floats, a batch touching
    1-60% of its rows per worker: the scheduler reduces it row-sparse where that pays), drawn from
    `tables` so that the other contexts' draws do not depend on them."""
    layers = []
    for i in range(rng.randint(3, 80)):
        tensors = tuple(
            int(math.exp(rng.uniform(math.log(4e3), math.log(6e7)))) // 4 * 4
            for _ in range(rng.choice((1, 1, 2, 2, 3)))
        )
        forward = math.exp(rng.uniform(math.log(2e-4), math.log(3e-2)))
        layers.append(LayerProfile(f"l{i}", forward, forward * rng.uniform(1.5, 2.5), tensors))
    if tables.random() < 0.25:
        rows, dim = 1 << tables.randint(12, 17), 1 << tables.randint(6, 10)
        forward = math.exp(tables.uniform(math.log(1e-4), math.log(3e-3)))  # a lookup: cheap
        table = RowSparseTable(rows, math.exp(tables.uniform(math.log(0.01), math.log(0.6))))
        layers.insert(0, LayerProfile("embedding", forward, 2 * forward, (rows * dim * 4,), table))
    return ModelProfile(
        f"synthetic{index}",
        tuple(layers),
        32,
        optimizer_s=sum(map(sum, (l.param_bytes for l in layers))) * 3e-9,
    )


def testbed_mlp() -> ModelProfile:
    return ModelProfile.load(ROOT / "benchmarks" / "scenarios" / "testbed-mlp.profile.json")


NAMED_MODELS = {
    "vgg16": vgg16,
    "resnet50": resnet50,
    "bert-base": bert_base,
    "testbed-mlp": testbed_mlp,
}


def draw_context(
    rng: random.Random, index: int, exclude: Sequence[str], seed: int = SEED
) -> tuple[ModelProfile, int, float, LinkModel]:
    """(profile scaled to its device, workers, bandwidth bytes/s, link model) of one random context."""
    names = [n for n in NAMED_MODELS if n not in exclude]
    pick = rng.random()
    if pick < 0.4 or not names:
        base = synthetic_model(rng, index, random.Random(f"tables-{seed}-{index}"))
    else:
        base = NAMED_MODELS[rng.choice(names)]()
    kind = rng.choice(KINDS)
    if kind == "emulated":
        return emulated_context(rng, base)
    if kind == "gpu":
        profile = base.scaled(rng.choice((20.0, 50.0, 100.0)))
        link, workers = NCCL, rng.choice((2, 4, 8, 16, 32, 64))
        bandwidth = math.exp(rng.uniform(math.log(1.0), math.log(100.0))) * GBIT
    elif kind == "cpu-gloo":
        profile = base.scaled(rng.uniform(0.5, 20.0))
        link, workers = GLOO_CPU, 2
        bandwidth = math.exp(rng.uniform(math.log(0.2), math.log(10.0))) * GBIT
    else:
        profile = base.scaled(rng.uniform(0.5, 20.0))
        link, workers = GLOO, rng.choice((2, 4, 8, 16, 32, 64))
        bandwidth = math.exp(rng.uniform(math.log(0.3), math.log(25.0))) * GBIT
    return profile, workers, bandwidth, link


def emulated_context(
    rng: random.Random, base: ModelProfile
) -> tuple[ModelProfile, int, float, LinkModel]:
    """A context of the emulated-accelerator testbed (docs/emulated.md): a slow device (a step's
    compute 0.3-4 s), 2, 4 or 8 ranks, a rate of 0.35-3x the balanced one (where a ring all-reduce
    of every gradient takes the compute) and this host's gloo at that rank count, with the bytes
    divided by one of the testbed's byte scales (simulator/links.py `gloo_n_link`: what
    benchmarks/sim_vs_emulated.py checks the simulator with against the testbed)."""
    workers = rng.choice(EMULATED_RANKS)
    profile = dataclasses.replace(
        base.with_compute_s(math.exp(rng.uniform(math.log(0.3), math.log(4.0)))), optimizer_s=0.0
    )
    ring = 2 * (workers - 1) / workers
    balanced = ring * profile.total_param_bytes / profile.compute_s
    bandwidth = balanced * math.exp(rng.uniform(math.log(0.35), math.log(3.0)))
    return profile, workers, bandwidth, gloo_n_link(NCCL, rng.choice(EMULATED_BYTE_SCALES), workers)


def context_windows(
    profile: ModelProfile,
    workers: int,
    bandwidth: float,
    link: LinkModel,
    configs: Sequence[Config],
    job: str,
    seed: int,
    compute_factor: float = 1.0,
    measured_latency: bool = True,
) -> list[Window]:
    """A settled window of every configuration, measured through the policy's adapter; the job's
    per-collective latency in its shape where `measured_latency`."""
    backend = "nccl" if link.collective_overhead_s < 100e-6 else "gloo"
    shape = job_shape(profile, workers, backend, link if measured_latency else None)
    sim = Simulator(
        profile,
        workers,
        PiecewiseConstant.constant(bandwidth),
        link,
        PiecewiseConstant.constant(compute_factor),
    )
    forward_share = profile.forward_s / profile.compute_s if profile.compute_s > 0 else 0.5
    adapter = MetricsAdapter(forward_share, seed=seed)
    windows = []
    for config in configs:
        sim.reset()
        records = sim.run(config, steps=SETTLE_STEPS + WINDOW_STEPS)[SETTLE_STEPS:]
        samples = [adapter(record, 0) for record in records]
        step = float(np.median([s.step_time_s for s in samples]))
        windows.append(Window(job, 0, config, summarize(samples, shape), step, len(samples), 0.0))
    return windows


def generate_windows(
    seed: int = SEED,
    contexts: int = CONTEXTS,
    exclude: Sequence[str] = (),
    only: Sequence[str] = (),
) -> list[Window]:
    rng = random.Random(seed)
    windows: list[Window] = []
    for index in range(contexts):
        profile, workers, bandwidth, link = draw_context(rng, index, exclude, seed)
        if only and profile.name not in only:
            continue
        shape = job_shape(profile, workers, "gloo")
        # with the tail window: the tuner does not search it, but a job may start with one
        grid = [c for c in candidate_grid(shape, tail_window=True) if c != SCHEDULER_DEFAULT]
        configs = [SCHEDULER_DEFAULT] + rng.sample(grid, min(len(grid), CONFIGS_PER_CONTEXT - 1))
        compute_factor = rng.choice((1.0, 1.0, 1.0, 1.3, 2.0))
        windows += context_windows(
            profile,
            workers,
            bandwidth,
            link,
            configs,
            f"ctx{index}-{profile.name}",
            seed * 100_000 + index,
            compute_factor,
            # its own draw: the contexts stay those of the seed
            random.Random(f"latency-{seed}-{index}").random() >= UNMEASURED_SHARE,
        )
    return windows


def is_emulated(window: Window) -> bool:
    """A window of an emulated-accelerator block (simulator/real_windows.py block_job)."""
    return window.job.startswith("real:emulated:")


def with_real(
    simulated: TrainingSet,
    real: Sequence[Window],
    real_share: float = REAL_SHARE,
    emulated_share: float = EMULATED_SHARE,
) -> TrainingSet:
    """The simulator's pairs plus the real windows' pairs: the CPU testbed's weighted to carry
    `real_share` of the total weight, the emulated ranks' `emulated_share` (see REAL_SHARE and
    EMULATED_SHARE); the simulator's keep the rest."""
    parts = []
    for windows, share in (
        ([w for w in real if not is_emulated(w)], real_share),
        ([w for w in real if is_emulated(w)], emulated_share),
    ):
        if windows and share > 0:
            measured = training_pairs(windows, now_s=0.0, half_life_s=None)
            if len(measured.y):
                parts.append((measured, share))
    if not parts:
        return simulated
    simulated_share = 1.0 - sum(share for _, share in parts)
    if not simulated_share > 0:
        raise ValueError(
            f"real_share + emulated_share = {1.0 - simulated_share:g}: must leave the simulator "
            "a share (< 1)"
        )
    total = float(simulated.weights.sum()) / simulated_share
    sets = [simulated] + [
        TrainingSet(m.x, m.y, m.groups, m.weights * (share * total / float(m.weights.sum())))
        for m, share in parts
    ]
    return TrainingSet(
        np.concatenate([t.x for t in sets]),
        np.concatenate([t.y for t in sets]),
        np.concatenate([t.groups for t in sets]),
        np.concatenate([t.weights for t in sets]),
    )


def default_real_windows() -> list[Window]:
    """The checked-in testbed dataset's windows (none where the dataset is absent)."""
    return real_windows() if DATASET_PATH.exists() else []


def train(
    seed: int = SEED,
    exclude: Sequence[str] = (),
    real: Sequence[Window] | None = None,
    real_share: float = REAL_SHARE,
    simulated: Sequence[Window] | None = None,
    emulated_share: float = EMULATED_SHARE,
) -> Ensemble:
    """The prior: `simulated` (default: generate_windows(seed, exclude)) and `real` windows (default:
    the checked-in testbed dataset; pass [] for a simulator-only prior)."""
    windows = generate_windows(seed, exclude=exclude) if simulated is None else simulated
    real = default_real_windows() if real is None else list(real)
    data = with_real(
        training_pairs(windows, now_s=0.0, half_life_s=None), real, real_share, emulated_share
    )
    cpu_jobs = len({w.job for w in real if not is_emulated(w)})
    emulated_jobs = len({w.job for w in real if is_emulated(w)})
    note = (
        f"simulator/train_prior.py seed {seed}: {CONTEXTS} contexts x {CONFIGS_PER_CONTEXT} configurations"
        + (f", without {','.join(exclude)}" if exclude else "")
        + (
            f"; {sum(not is_emulated(w) for w in real)} real windows of {cpu_jobs} testbed blocks "
            f"at {real_share:.0%} of the weight"
            if cpu_jobs and real_share > 0
            else ""
        )
        + (
            f"; {sum(map(is_emulated, real))} windows of {emulated_jobs} emulated-accelerator "
            f"blocks at {emulated_share:.0%}"
            if emulated_jobs and emulated_share > 0
            else ""
        )
    )
    return train_ensemble(data, seed=seed, kind="prior", note=note)


def probe_rows(seed: int = 12345) -> np.ndarray:
    """Feature rows of a few fresh contexts, to compare two priors' predictions."""
    from autobyted.tuner.features import feature_matrix

    windows = generate_windows(seed, contexts=12)
    rows = [
        feature_matrix(w.context, w.config, [c.config for c in windows if c.job == w.job])
        for w in windows
    ]
    return np.concatenate(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(PRIOR_PATH))
    parser.add_argument("--check", action="store_true", help="regenerate and compare with --out")
    parser.add_argument("--exclude-model", action="append", default=[])
    parser.add_argument(
        "--exclude-emulated",
        action="append",
        default=[],
        metavar="MODEL",
        help="train without the dataset's emulated-accelerator blocks of MODEL (a prior that "
        "never saw it in that regime, for a left-out run of the tuner)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    real = None
    if args.exclude_emulated:
        real = real_windows(
            exclude=lambda b: bool(b.get("emulated")) and b["model"] in args.exclude_emulated
        )
    ensemble = train(exclude=args.exclude_model, real=real)
    data = ensemble.to_bytes()
    took = time.perf_counter() - started
    if args.check:
        shipped = Ensemble.from_bytes(pathlib.Path(args.out).read_bytes())
        rows = probe_rows()
        diff = float(np.max(np.abs(shipped.predict(rows)[0] - ensemble.predict(rows)[0])))
        same = shipped.meta["data_digest"] == ensemble.meta["data_digest"]
        print(
            f"regenerated in {took:.1f} s: training data {'identical' if same else 'DIFFERENT'} "
            f"({ensemble.meta['data_digest']}), max prediction difference {diff:.2e}"
        )
        return 0 if same and diff < 1e-6 else 1
    pathlib.Path(args.out).write_bytes(data)
    print(
        f"wrote {args.out}: {len(data)} bytes, {ensemble.meta['examples']} pairs from {ensemble.meta['jobs']} "
        f"contexts, data {ensemble.meta['data_digest']}, sha256 {hashlib.sha256(data).hexdigest()[:16]}, "
        f"{took:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
