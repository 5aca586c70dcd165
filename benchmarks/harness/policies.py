"""Configuration policies evaluated side by side: ddp, static:P,C, grid-best, bo-once, oracle.

Every policy implements one interface, the same one the autobyte tuner will plug into:

    policy.prepare(context)        # once; offline knowledge (only grid-best and oracle use it)
    policy.initial_config()        # the configuration of the first step
    policy.observe(record)         # after every step; returns a new configuration or None

`record` is a `simulator.SimulatedStep` (the testbed adapter produces the same record from the
harness's per-step metrics). A returned configuration takes effect at the next step, as the real
scheduler applies a reconfiguration at a step boundary. `autobyte` (benchmarks/harness/autobyte_policy.py)
runs the daemon's own tuner behind this interface, seeing only what a rank reports.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
from autobyte.types import Config, parse_bytes
from scipy.linalg import cho_factor, cho_solve
from scipy.stats import norm

from benchmarks.harness.policy import Policy, PolicyContext
from simulator.engine import DDP, RunConfig, SimulatedStep, describe_config

MIB = 1 << 20
KIB = 1 << 10

# The static search space shared by grid-best and bo-once (and the oracle).
GRID_PARTITIONS = (256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
GRID_CREDIT_MULTIPLES = (1, 2, 4, 16, None)  # credit = multiple x partition; None = unlimited
GRID_UNPARTITIONED_CREDITS = (4 * MIB, 16 * MIB, 64 * MIB, None)


def default_grid(include_ddp: bool = True) -> tuple[RunConfig, ...]:
    """The scheduler grid (29 configurations), plus DDP: not scheduling is always a candidate for
    grid-best and the oracle. bo-once searches the scheduler configurations only, as ByteScheduler."""
    grid: list[RunConfig] = [
        Config(p, None if m is None else p * m)
        for p in GRID_PARTITIONS
        for m in GRID_CREDIT_MULTIPLES
    ]
    grid += [Config(None, c) for c in GRID_UNPARTITIONED_CREDITS]
    if include_ddp:
        grid.append(DDP)
    return tuple(grid)


class StaticPolicy(Policy):
    def __init__(self, config: RunConfig, name: str | None = None) -> None:
        self.config = config
        self.name = name or ("ddp" if config == DDP else f"static:{describe_config(config)}")

    def initial_config(self) -> RunConfig:
        return self.config

    def observe(self, record: SimulatedStep) -> RunConfig | None:
        return None

    def describe(self) -> str:
        return describe_config(self.config)


class GridBestPolicy(Policy):
    """The best static configuration over the whole run, found by running every candidate."""

    name = "grid-best"

    def __init__(self) -> None:
        self.config: RunConfig | None = None
        self.scores: dict[RunConfig, float] = {}

    def prepare(self, context: PolicyContext) -> None:
        if context.evaluate_static is None:
            raise RuntimeError("grid-best needs full runs of every candidate (not available here)")
        self.scores = {
            c: context.evaluate_static(c).throughput_steps_per_s for c in context.candidates
        }
        self.config = max(self.scores, key=self.scores.__getitem__)

    def initial_config(self) -> RunConfig:
        if self.config is None:
            raise RuntimeError("grid-best used before prepare()")
        return self.config

    def observe(self, record: SimulatedStep) -> RunConfig | None:
        return None

    def describe(self) -> str:
        return describe_config(self.config) if self.config is not None else ""


class OraclePolicy(Policy):
    """The best configuration of each phase, known in advance; switches at phase boundaries."""

    name = "oracle"

    def __init__(self) -> None:
        self.phase_starts: list[float] = []
        self.phase_configs: list[RunConfig] = []

    def prepare(self, context: PolicyContext) -> None:
        if context.steady_step_s is None or not context.phases:
            raise RuntimeError("oracle needs the phases and a steady-state evaluator")
        best_by_condition: dict[tuple[float, ...], RunConfig] = {}
        for start, _end, *condition in context.phases:  # bandwidth, factor[, flows, cpu share]
            key = tuple(condition)
            if key not in best_by_condition:
                best_by_condition[key] = min(
                    context.candidates, key=lambda c: context.steady_step_s(c, *key)
                )
            self.phase_starts.append(start)
            self.phase_configs.append(best_by_condition[key])

    def _config_at(self, t_s: float) -> RunConfig:
        index = max(0, np.searchsorted(self.phase_starts, t_s, side="right") - 1)
        return self.phase_configs[index]

    def initial_config(self) -> RunConfig:
        return self._config_at(0.0)

    def observe(self, record: SimulatedStep) -> RunConfig | None:
        config = self._config_at(record.end_s)
        return config if config != record.config else None

    def describe(self) -> str:
        return f"{len(set(self.phase_configs))} configs over {len(self.phase_configs)} phases"


class GaussianProcess:
    """A small GP regressor (Matern 5/2, constant mean) with its length scale and noise picked by
    marginal likelihood over a grid; inputs are expected in [0, 1]."""

    LENGTH_SCALES = (0.1, 0.2, 0.35, 0.6, 1.0, 2.0)
    NOISES = (1e-4, 1e-2, 1e-1)

    def fit(self, x: np.ndarray, y: np.ndarray) -> GaussianProcess:
        self.x = np.asarray(x, dtype=float)
        y = np.asarray(y, dtype=float)
        self.mean, self.scale = float(y.mean()), float(y.std()) or 1.0
        self.y = (y - self.mean) / self.scale
        best = None
        for length in self.LENGTH_SCALES:
            for noise in self.NOISES:
                k = self._kernel(self.x, self.x, length) + noise * np.eye(len(self.x))
                try:
                    factor = cho_factor(k, lower=True)
                except np.linalg.LinAlgError:
                    continue
                alpha = cho_solve(factor, self.y)
                log_ml = -0.5 * self.y @ alpha - np.log(np.diag(factor[0])).sum()
                if best is None or log_ml > best[0]:
                    best = (log_ml, length, factor, alpha)
        assert best is not None
        _, self.length, self.factor, self.alpha = best
        return self

    @staticmethod
    def _kernel(a: np.ndarray, b: np.ndarray, length: float) -> np.ndarray:
        d = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)) / length
        s = math.sqrt(5) * d
        return (1 + s + s * s / 3) * np.exp(-s)

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation, in the units of the fitted y."""
        k_star = self._kernel(np.asarray(x, dtype=float), self.x, self.length)
        mean = k_star @ self.alpha
        v = cho_solve(self.factor, k_star.T)
        var = np.maximum(1.0 - (k_star * v.T).sum(1), 1e-12)
        return mean * self.scale + self.mean, np.sqrt(var) * self.scale


def expected_improvement(mean: np.ndarray, std: np.ndarray, best: float) -> np.ndarray:
    """EI for minimisation."""
    z = (best - mean) / std
    return (best - mean) * norm.cdf(z) + std * norm.pdf(z)


def config_features(configs: Sequence[Config]) -> np.ndarray:
    """log2 partition and log2 credit, scaled to [0, 1] (none / unlimited = the top of the range)."""
    low, high = math.log2(64 * KIB), math.log2(4 << 30)
    rows = []
    for config in configs:
        partition = config.partition_bytes or (1 << 30)
        credit = config.credit_bytes or (4 << 30)
        rows.append(
            ((math.log2(partition) - low) / (high - low), (math.log2(credit) - low) / (high - low))
        )
    return np.array(rows)


class BayesOptOncePolicy(Policy):
    """ByteScheduler-style one-shot tuning: `random_trials` random then `bo_trials` GP-EI trials,
    each `trial_steps` steps (the first `settle_steps` ignored), then the best is fixed for good."""

    name = "bo-once"

    def __init__(
        self,
        random_trials: int = 10,
        bo_trials: int = 5,
        trial_steps: int = 100,
        settle_steps: int = 10,
    ) -> None:
        self.random_trials, self.bo_trials = random_trials, bo_trials
        self.trial_steps, self.settle_steps = trial_steps, settle_steps
        self.candidates: tuple[Config, ...] = ()
        self.results: list[tuple[Config, float]] = []
        self.current: Config | None = None
        self.final: Config | None = None
        self._window: list[float] = []

    def prepare(self, context: PolicyContext) -> None:
        self.candidates = tuple(c for c in context.candidates if isinstance(c, Config))
        self.rng = random.Random(context.seed)
        order = list(self.candidates)
        self.rng.shuffle(order)
        self._random_queue = order[: self.random_trials]
        self.current = self._random_queue.pop(0)

    def initial_config(self) -> RunConfig:
        if self.current is None:
            raise RuntimeError("bo-once used before prepare()")
        return self.current

    def _next_candidate(self) -> Config | None:
        if self._random_queue:
            return self._random_queue.pop(0)
        if len(self.results) >= self.random_trials + self.bo_trials:
            return None
        tried = {c for c, _ in self.results}
        untried = [c for c in self.candidates if c not in tried]
        if not untried:
            return None
        gp = GaussianProcess().fit(
            config_features([c for c, _ in self.results]), np.array([s for _, s in self.results])
        )
        mean, std = gp.predict(config_features(untried))
        ei = expected_improvement(mean, std, min(s for _, s in self.results))
        return untried[int(np.argmax(ei))]

    def observe(self, record: SimulatedStep) -> RunConfig | None:
        if self.final is not None:
            return None
        self._window.append(record.step_time_s)
        if len(self._window) < self.trial_steps:
            return None
        assert self.current is not None
        measured = self._window[self.settle_steps :]
        self.results.append((self.current, float(np.mean(measured))))
        self._window = []
        following = self._next_candidate()
        if following is None:
            self.final = min(self.results, key=lambda item: item[1])[0]
            self.current = self.final
        else:
            self.current = following
        return self.current

    def describe(self) -> str:
        if self.final is None:
            return f"tuning ({len(self.results)} trials done)"
        return f"{describe_config(self.final)} after {len(self.results)} trials"


POLICY_NAMES = (
    "ddp",
    "static:P,C",
    "observe:P,C",
    "grid-best",
    "bo-once",
    "oracle",
    "autobyte",
    "autobyte:P,C",
    "autobyte:auto (--testbed)",
    "autobyte-warm:P,C or autobyte-warm:auto (--testbed)",
    "autobyte-restart:P,C or autobyte-restart:auto (--testbed)",
)


def start_config(spec: str, prefix: str) -> Config:
    """The P,C of "static:P,C", "observe:P,C" or "autobyte:P,C" (`prefix` the part before P)."""
    try:
        partition_text, credit_text = spec[len(prefix) :].split(",")
        return Config(parse_bytes(partition_text), parse_bytes(credit_text))
    except ValueError as exc:
        raise ValueError(f"bad policy {spec!r}: {exc} (example: {prefix}4MiB,16MiB)") from None


AUTOBYTE_AUTO = "autobyte:auto"  # the tuner from the sizes the scheduler derives (testbed only)
# The job's second run against the daemon that tuned its first (testbed only): the warm start.
AUTOBYTE_WARM = "autobyte-warm:"
# The same, its first run at another rank count ([testbed] restart_from_workers): the job
# restarted at another scale (testbed only).
AUTOBYTE_RESTART = "autobyte-restart:"


def make_policy(spec: str) -> Policy:
    """'ddp', 'static:4MiB,16MiB', 'observe:4MiB,16MiB', 'grid-best', 'bo-once', 'oracle',
    'autobyte' (from the scheduler's default), 'autobyte:64KiB,64KiB' (the tuner from that start)
    -> a fresh policy ('autobyte:auto', the tuner from the derived sizes, is evaluate --testbed's). 'observe:P,C' holds P,C like 'static:P,C'; on the testbed its ranks also
    stream to a real autobyted whose tuner runs in observe mode (everything but applying), which
    measures what the daemon's own work costs a job on the same host."""
    if spec == "ddp":
        return StaticPolicy(DDP, "ddp")
    if spec.startswith("static:"):
        return StaticPolicy(start_config(spec, "static:"), spec)
    if spec.startswith("observe:"):
        return StaticPolicy(start_config(spec, "observe:"), spec)
    if spec == "grid-best":
        return GridBestPolicy()
    if spec == "bo-once":
        return BayesOptOncePolicy()
    if spec == "oracle":
        return OraclePolicy()
    if spec.startswith((AUTOBYTE_WARM, AUTOBYTE_RESTART)):
        raise ValueError(
            f"{spec} runs on the testbed only (evaluate --testbed): the job is run twice against "
            "one real autobyted"
        )
    if spec == "autobyte" or spec.startswith("autobyte:"):
        from benchmarks.harness.autobyte_policy import (
            AutobytePolicy,  # xgboost: only when asked for
        )

        if spec == "autobyte":
            return AutobytePolicy()
        if spec == AUTOBYTE_AUTO:
            raise ValueError(
                f"{AUTOBYTE_AUTO} runs on the testbed only (evaluate --testbed): the derived start "
                "is measured on the job's own process group"
            )
        policy = AutobytePolicy(initial=start_config(spec, "autobyte:"))
        policy.name = spec
        return policy
    raise ValueError(f"unknown policy {spec!r}: use one of {', '.join(POLICY_NAMES)}")
