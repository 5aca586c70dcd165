"""A scripted job for the tuner's tests: step times from a landscape, decisions applied as a client does.

The predictor in these tests is a real (small) xgboost ensemble trained on windows of the same kind
of job, built with autobyted.tuner's own training code: what the tuner learned from a job like this
one before. Its predictions are deliberately from a landscape the test chooses (right or wrong).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable

from autobyte.types import Config, StepMetrics

from autobyted.storage.records import Fingerprint
from autobyted.tuner.features import JobShape, summarize
from autobyted.tuner.grid import candidate_grid
from autobyted.tuner.predictor import (
    PRIOR_PARAMS,
    Predictor,
    Window,
    train_ensemble,
    training_pairs,
)

MIB = 1 << 20
START = Config(4 * MIB, 16 * MIB)
BEST = Config(1 * MIB, 4 * MIB)
SHAPE = JobShape.from_fingerprint(
    2, "gloo", Fingerprint(6_000_000, 24_000_000, 12, 8_000_000, 1_000_000, "d")
)
# landscape(config, step) -> (step time s, bandwidth estimate bytes/s[, host load])
Landscape = Callable[[Config, int], tuple[float, ...]]


def better(
    best: Config, gain: float = 0.3, base_s: float = 0.1, bandwidth: float = 1e8
) -> Landscape:
    """`best` is `gain` faster than every other configuration."""

    def landscape(config: Config, step: int) -> tuple[float, float]:
        return (base_s * (1 - gain) if config == best else base_s), bandwidth

    return landscape


def sample(
    step: int,
    config: Config,
    decision_id: int,
    step_s: float,
    bandwidth: float,
    rng: random.Random,
    noise: float = 0.01,
    host_load: float = 0.0,
    compute_s: float = 0.06,
) -> StepMetrics:
    step_s *= math.exp(rng.gauss(0, noise))
    compute = compute_s * math.exp(rng.gauss(0, noise))
    return StepMetrics(
        step=step,
        wall_time_s=1.7e9 + step * 0.1,
        step_time_s=step_s,
        forward_s=compute / 3,
        backward_s=2 * compute / 3,
        exposed_comm_s=max(0.0, step_s - compute),
        bytes_reduced=SHAPE.parameter_bytes,
        partitions=6,
        bandwidth_bytes_per_s=bandwidth * math.exp(rng.gauss(0, noise)),
        config=config,
        decision_id=decision_id,
        host_load=host_load,
    )


class ScriptedJob:
    """Runs steps under the configuration in effect, hands the tuner batches of samples, and applies
    the tuner's pending decisions at their step (or the next one), as rank 0 of a real job does."""

    def __init__(
        self,
        landscape: Landscape,
        start: Config = START,
        seed: int = 0,
        noise: float = 0.01,
        applies: bool = True,
        batch: int = 10,
        refuses: Callable[[Config], bool] = lambda config: False,
        compute_s: float = 0.06,
    ) -> None:
        """`applies` False: the job ignores every decision; `refuses(config)`: the ranks refuse
        that decision (an FSDP2 job's memory budget) and run on as they were; `compute_s`: a
        step's compute (the rest of the step is its exposed communication)."""
        self.compute_s = compute_s
        self.landscape, self.config, self.applies, self.batch = landscape, start, applies, batch
        self.refuses = refuses
        self.rng = random.Random(seed)
        self.noise = noise
        self.step = 0
        self.decision_id = 0
        self.handled = 0
        self.configs: list[Config] = []

    def run(self, tuner, sink, steps: int, host_load: float = 0.0) -> None:
        buffer = []
        for _ in range(steps):
            pending = [
                d for d in sink.decisions if d.decision_id > self.handled and d.kind != "recommend"
            ]
            if pending and self.applies and self.step >= pending[-1].apply_at_step:
                self.handled = pending[-1].decision_id
                if not self.refuses(pending[-1].config):
                    self.config, self.decision_id = pending[-1].config, pending[-1].decision_id
            step_s, bandwidth, *load = self.landscape(self.config, self.step)
            buffer.append(
                sample(
                    self.step,
                    self.config,
                    self.decision_id,
                    step_s,
                    bandwidth,
                    self.rng,
                    self.noise,
                    load[0] if load else host_load,
                    self.compute_s,
                )
            )
            self.configs.append(self.config)
            self.step += 1
            if len(buffer) >= self.batch:
                tuner.observe(buffer)
                buffer = []
        if buffer:
            tuner.observe(buffer)


def graded(gain: float, base_s: float = 0.1, bandwidth: float = 1e8) -> Landscape:
    """Every octave of partition size below START's is `gain` faster, every octave above `gain`
    slower (unpartitioned: as 64 MiB): many configurations beat START, by more the smaller."""

    def landscape(config: Config, step: int) -> tuple[float, float]:
        octaves = math.log2((config.partition_bytes or 64 * MIB) / START.partition_bytes)
        return base_s * math.exp(gain * octaves), bandwidth

    return landscape


@functools.lru_cache(maxsize=8)
def predictor_for(best: Config | None, gain: float) -> Predictor:
    """A real ensemble trained on jobs of SHAPE where `best` is `gain` faster than the rest (`best`
    None: `graded(gain)`, each octave of partition size below START's `gain` faster)."""
    rng = random.Random(1)
    windows = []
    for job in range(6):
        base = 0.05 + 0.02 * job
        landscape = better(best, gain, base) if best is not None else graded(gain, base)
        for config in candidate_grid(SHAPE, START):
            step_s, bandwidth = landscape(config, 0)
            samples = [sample(i, config, 0, step_s, bandwidth, rng) for i in range(12)]
            windows.append(
                Window(
                    f"j{job}",
                    0,
                    config,
                    summarize(samples, SHAPE),
                    sorted(s.step_time_s for s in samples)[6],
                    12,
                    0.0,
                )
            )
    data = training_pairs(windows, now_s=0.0, half_life_s=None)
    return Predictor(train_ensemble(data, params={**PRIOR_PARAMS, "max_depth": 3}, rounds=40))
