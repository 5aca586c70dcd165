"""Simulated steps as a rank would report them: `MetricsAdapter` turns a simulator step into the
`autobyte.types.StepMetrics` a real rank sends, and `job_shape` gives a simulated job's registration.

What the tuner may see is fixed by construction. The adapter reads the simulated step's step,
start/end time, step time, compute time, blocked time, communication span, partition count, bytes
and configuration; it never reads the scenario's true `bandwidth_bytes_per_s` or `compute_factor`:

- bandwidth_bytes_per_s is the scheduler's own estimate, bytes / communication span (the real one
  is bytes / (last completion - first issue)), times log-normal noise (sigma 5%);
- step, forward and backward times get log-normal noise (sigma `noise`, default 3%) and, one step in
  a hundred, a 1.2-2x spike (a real rank sees GC pauses and neighbours' bursts);
- forward / backward split the step's compute time by the profile's forward share (the rank
  measures both);
- queueing delay is 0 and host load 0.0 = unknown: the simulator models neither.

The daemon's prior (simulator/train_prior.py) and the `autobyte` policy of benchmarks.harness.evaluate
both see the simulator through this adapter.
"""

from __future__ import annotations

import math
import random

from autobyte.types import Config, StepMetrics, summarize_tensor_sizes

from autobyted.storage.records import Fingerprint
from autobyted.tuner.features import JobShape
from simulator.engine import LinkModel, SimulatedStep
from simulator.profiles import ModelProfile

# The fixed start of simulated jobs and of the prior's contexts (the client derives its own start
# from the job: autobyte/scheduler/start.py)
SCHEDULER_DEFAULT = Config(4 << 20, 16 << 20)
T0 = 1.7e9  # wall clock of a simulated run's start (any plausible unix time)


def job_shape(
    profile: ModelProfile, workers: int, backend: str, link: LinkModel | None = None
) -> JobShape:
    """Registration info of a simulated job (what autobyte.transport.session.model_fingerprint
    computes), with the per-collective latency its ranks would measure on `link` (none: 0.0)."""
    sizes = summarize_tensor_sizes(
        b for layer in profile.layers for b in layer.param_bytes if b > 0
    )
    fingerprint = Fingerprint(
        parameter_count=sizes.parameter_bytes // 4, digest=profile.name, **sizes._asdict()
    )
    latency = link.tiny_collective_s(workers) if link is not None else 0.0
    return JobShape.from_fingerprint(workers, backend, fingerprint, latency)


class MetricsAdapter:
    """SimulatedStep -> StepMetrics with measurement noise (see the module docstring)."""

    def __init__(
        self,
        forward_share: float,
        seed: int = 0,
        noise: float = 0.03,
        bandwidth_noise: float = 0.05,
        spike_rate: float = 0.01,
    ) -> None:
        self.forward_share = forward_share
        self.rng = random.Random(seed)
        self.noise, self.bandwidth_noise, self.spike_rate = noise, bandwidth_noise, spike_rate

    def __call__(self, record: SimulatedStep, decision_id: int) -> StepMetrics:
        rng = self.rng
        spike = rng.uniform(1.2, 2.0) if rng.random() < self.spike_rate else 1.0
        factor = math.exp(rng.gauss(0.0, self.noise)) * spike
        compute = record.compute_s * math.exp(rng.gauss(0.0, self.noise))
        span = record.comm_span_s
        bandwidth = (
            record.bytes_reduced / span * math.exp(rng.gauss(0.0, self.bandwidth_noise))
            if span > 0
            else 0.0
        )
        config = record.config if isinstance(record.config, Config) else Config(None, None)
        return StepMetrics(
            step=record.step,
            wall_time_s=T0 + record.end_s,
            step_time_s=record.step_time_s * factor,
            forward_s=compute * self.forward_share,
            backward_s=compute * (1 - self.forward_share),
            exposed_comm_s=record.blocked_s * factor,
            queueing_delay_s=0.0,
            bytes_reduced=record.bytes_reduced,
            partitions=record.partitions,
            bandwidth_bytes_per_s=bandwidth,
            config=config,
            decision_id=decision_id,
            host_load=0.0,
        )
