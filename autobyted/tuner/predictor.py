"""The predictor: a bootstrap ensemble of xgboost regressors of log(candidate / reference step time),
its training data (pairs of measured windows), online retraining on top of the shipped prior, and
its file format (the same bytes go into the database and into autobyted/tuner/prior.model).

Why an ensemble and not a quantile objective: the tuner needs to know where the model has *not seen*
data (a new model shape, an unexplored configuration) to explore there; that is epistemic
uncertainty, which a quantile loss does not measure (it gives the noise of the data it saw). The
members are trained on Bayesian-bootstrap reweightings *of jobs* (all windows of a job share one
random weight), so their disagreement grows where few jobs carry the evidence — a job unlike the
ones seen, the case a cross-job warm start is about.
Five members: the spread of five is a usable (if rough) estimate, at five times one model's cost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from importlib import resources

import numpy as np
from autobyte.types import Config

from autobyted.tuner.features import FEATURE_NAMES, Context, feature_matrix

MAGIC = b"AUTOBYTE-PREDICTOR\n"
FORMAT_VERSION = 1
MEMBERS = 5
# An ensemble's spread is never taken as zero: measurement noise alone is a few percent.
SIGMA_FLOOR = 0.02
PRIOR_PARAMS = {
    "objective": "reg:squarederror",
    "max_depth": 5,
    "eta": 0.1,
    "subsample": 0.8,
    "colsample_bytree": 0.8,
    "min_child_weight": 2.0,
    "lambda": 1.0,
    "tree_method": "hist",
    "nthread": 1,
}
PRIOR_ROUNDS = 100
# Online corrections: few shallow trees on top of the prior, so one retraining stays cheap
# (bounded rows x rounds x members) and a handful of real windows cannot erase the prior.
ONLINE_PARAMS = {**PRIOR_PARAMS, "max_depth": 4, "eta": 0.15}
ONLINE_ROUNDS = 30
MAX_ONLINE_PAIRS = 20_000
RECENCY_HALF_LIFE_S = 7 * 86_400.0
WINDOWS_PER_CONFIG = 3  # per (job, segment, configuration): the latest few


@dataclasses.dataclass(frozen=True)
class Window:
    """A measured window: one configuration in one context segment of one job."""

    job: str
    segment: int
    config: Config
    context: Context
    step_time_s: float
    samples: int
    created_at_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class TrainingSet:
    x: np.ndarray
    y: np.ndarray
    groups: np.ndarray  # the job of each row: the bootstrap unit
    weights: np.ndarray

    def digest(self) -> str:
        h = hashlib.sha256()
        for array in (self.x, self.y, self.weights):
            h.update(np.ascontiguousarray(array, dtype=np.float64).tobytes())
        h.update("\n".join(map(str, self.groups)).encode())
        return h.hexdigest()[:16]


def training_pairs(
    windows: Sequence[Window],
    now_s: float | None = None,
    half_life_s: float | None = RECENCY_HALF_LIFE_S,
) -> TrainingSet:
    """Every ordered pair (A, B) of windows of different configurations in the same job and context
    segment gives one row: features(context of A, config A, config B) -> log(t_B / t_A).

    Weights: old windows fade (half-life `half_life_s`; Pollux's model never forgot) and a short
    window (a trial cut early) counts less than a full one."""
    groups: dict[tuple[str, int], dict[Config, list[Window]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for window in windows:
        if window.step_time_s > 0 and window.samples > 0:
            groups[(window.job, window.segment)][window.config].append(window)
    rows, targets, jobs, weights = [], [], [], []
    now_s = time.time() if now_s is None else now_s
    for (job, _segment), by_config in groups.items():
        kept = [w for ws in by_config.values() for w in ws[-WINDOWS_PER_CONFIG:]]
        for a in kept:
            others = [b for b in kept if b.config != a.config]
            if not others:
                continue
            features = feature_matrix(a.context, a.config, [b.config for b in others])
            for row, b in zip(features, others):
                rows.append(row)
                targets.append(math.log(b.step_time_s / a.step_time_s))
                jobs.append(job)
                age = max(0.0, now_s - max(a.created_at_s, b.created_at_s))
                recency = 0.5 ** (age / half_life_s) if half_life_s else 1.0
                weights.append(max(0.05, recency) * min(1.0, min(a.samples, b.samples) / 15.0))
    x = np.asarray(rows, dtype=np.float64).reshape(len(rows), len(FEATURE_NAMES))
    return TrainingSet(x, np.asarray(targets), np.asarray(jobs, dtype=object), np.asarray(weights))


class Ensemble:
    """K xgboost boosters; `predict` gives the mean and spread of log step-time ratios."""

    def __init__(self, members: list, meta: dict) -> None:
        self.members = members
        self.meta = meta

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(x) == 0:
            return np.zeros(0), np.zeros(0)
        predictions = np.stack(
            [member.inplace_predict(x, missing=np.nan) for member in self.members]
        )
        mean = predictions.mean(axis=0)
        spread = predictions.std(axis=0)
        return mean, np.sqrt(spread * spread + SIGMA_FLOOR * SIGMA_FLOOR)

    def to_bytes(self) -> bytes:
        blobs = [bytes(member.save_raw("ubj")) for member in self.members]
        header = json.dumps(
            {**self.meta, "format": FORMAT_VERSION, "sizes": [len(b) for b in blobs]},
            sort_keys=True,
        ).encode()
        return MAGIC + struct.pack("<I", len(header)) + header + b"".join(blobs)

    @classmethod
    def from_bytes(cls, data: bytes) -> Ensemble:
        import xgboost as xgb

        if not data.startswith(MAGIC):
            raise ValueError("not an autobyte predictor file")
        offset = len(MAGIC)
        (length,) = struct.unpack_from("<I", data, offset)
        offset += 4
        meta = json.loads(data[offset : offset + length])
        offset += length
        if meta.get("format") != FORMAT_VERSION or tuple(meta.get("features", ())) != FEATURE_NAMES:
            raise ValueError("predictor file of another format or feature set; regenerate it")
        members = []
        for size in meta.pop("sizes"):
            booster = xgb.Booster()
            booster.load_model(bytearray(data[offset : offset + size]))
            booster.set_param({"nthread": 1})
            members.append(booster)
            offset += size
        meta.pop("format", None)
        return cls(members, meta)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()[:16]


def _bootstrap(groups: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Row weights of a Bayesian bootstrap over groups (jobs): every job gets an Exp(1) weight (mean
    1), shared by all its rows. Unlike drawing jobs with replacement, no member ignores a job
    entirely (a third of them would, and mispredict that very job), yet members still disagree
    where few jobs carry the evidence."""
    names = sorted(set(groups.tolist()))
    index = {name: i for i, name in enumerate(names)}
    weights = rng.exponential(1.0, len(names))
    return np.array([weights[index[g]] for g in groups], dtype=np.float64)


def train_ensemble(
    data: TrainingSet,
    *,
    seed: int = 0,
    base: Ensemble | None = None,
    params: dict | None = None,
    rounds: int | None = None,
    kind: str = "prior",
    note: str = "",
) -> Ensemble:
    """Train MEMBERS boosters on bootstrap resamples of jobs; with `base`, each member continues
    the corresponding base member (new trees fit what the base gets wrong)."""
    import xgboost as xgb

    if len(data.y) == 0:
        raise ValueError("no training pairs")
    params = dict(params or (ONLINE_PARAMS if base is not None else PRIOR_PARAMS))
    rounds = rounds or (ONLINE_ROUNDS if base is not None else PRIOR_ROUNDS)
    members = []
    for member in range(MEMBERS):
        rng = np.random.default_rng(seed * 1000 + member)
        weight = data.weights * _bootstrap(data.groups, rng)
        keep = weight > 0
        matrix = xgb.DMatrix(
            data.x[keep],
            label=data.y[keep],
            weight=weight[keep],
            missing=np.nan,
            feature_names=list(FEATURE_NAMES),
            nthread=1,
        )
        start = base.members[member].copy() if base is not None else None
        members.append(
            xgb.train(
                {**params, "seed": seed * 1000 + member},
                matrix,
                num_boost_round=rounds,
                xgb_model=start,
            )
        )
    meta = {
        "features": list(FEATURE_NAMES),
        "kind": kind,
        "examples": len(data.y),
        "jobs": len(set(data.groups.tolist())),
        "data_digest": data.digest(),
        "note": note,
        "base": base.meta.get("base") or base.digest if base is not None else "",
    }
    return Ensemble(members, meta)


def train_online(
    prior: Ensemble, windows: Sequence[Window], *, seed: int = 0, now_s: float | None = None
) -> Ensemble | None:
    """The daemon's retraining: corrections on top of the prior from real windows of every job
    (the most recent MAX_ONLINE_PAIRS pairs). None when the windows make no pair yet."""
    data = training_pairs(windows, now_s)
    if len(data.y) == 0:
        return None
    if len(data.y) > MAX_ONLINE_PAIRS:
        data = TrainingSet(
            data.x[-MAX_ONLINE_PAIRS:],
            data.y[-MAX_ONLINE_PAIRS:],
            data.groups[-MAX_ONLINE_PAIRS:],
            data.weights[-MAX_ONLINE_PAIRS:],
        )
    return train_ensemble(
        data,
        seed=seed,
        base=prior,
        kind="online",
        note=f"{len(data.y)} pairs from {len(set(data.groups.tolist()))} jobs",
    )


PRIOR_RESOURCE = "prior.model"


def load_prior() -> Ensemble:
    """The simulator-trained prior shipped in this package (simulator/train_prior.py makes it)."""
    data = resources.files("autobyted.tuner").joinpath(PRIOR_RESOURCE).read_bytes()
    return Ensemble.from_bytes(data)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted log ratio (candidate / reference step time) per candidate, and its spread."""

    candidates: tuple[Config, ...]
    mean: np.ndarray
    std: np.ndarray

    def step_time_s(self, reference_step_s: float, index: int) -> float:
        return reference_step_s * math.exp(float(self.mean[index]))


class Predictor:
    """The ensemble in use (thread-safe swap: the trainer thread replaces it, tuners read it)."""

    def __init__(self, ensemble: Ensemble) -> None:
        self._ensemble = ensemble
        self._lock = threading.Lock()

    @property
    def ensemble(self) -> Ensemble:
        return self._ensemble

    def swap(self, ensemble: Ensemble) -> None:
        with self._lock:
            self._ensemble = ensemble

    def predict(
        self, context: Context, reference: Config, candidates: Sequence[Config]
    ) -> Prediction:
        x = feature_matrix(context, reference, candidates)
        mean, std = self._ensemble.predict(x)
        # The reference itself needs no model: it was just measured.
        for i, candidate in enumerate(candidates):
            if candidate == reference:
                mean[i], std[i] = 0.0, SIGMA_FLOOR
        bad = ~np.isfinite(mean) | ~np.isfinite(std)
        mean[bad], std[bad] = 0.0, 1.0  # a broken feature never looks like a gain
        return Prediction(tuple(candidates), mean, std)
