"""The interface every configuration policy implements (see benchmarks.harness.policies for the contract),
and what a policy may know before a run: the policies and the `autobyte` policy both build on it.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable

from simulator.engine import LinkModel, RunConfig, SimulatedStep
from simulator.profiles import ModelProfile


@dataclasses.dataclass(frozen=True)
class RunSummary:
    steps: int
    elapsed_s: float

    @property
    def throughput_steps_per_s(self) -> float:
        return self.steps / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class PolicyContext:
    """What a policy may know before the run. Offline hooks are None where they cannot exist."""

    candidates: tuple[RunConfig, ...]
    seed: int = 0
    # (start_s, end_s, bandwidth bytes/s, compute factor[, competing flows, cpu share]) of every
    # phase of the run's traces (the last two only for scenarios with condition keys)
    phases: tuple[tuple[float, ...], ...] = ()
    # full run of one static configuration (grid-best); None when too expensive (testbed)
    evaluate_static: Callable[[RunConfig], RunSummary] | None = None
    # settled step time of a configuration in a phase's conditions (oracle): (config, bandwidth,
    # compute factor[, flows, cpu share]) -> seconds
    steady_step_s: Callable[..., float] | None = None
    # registration info of the job (the autobyte policy's JobShape): what a rank would report
    profile: ModelProfile | None = None
    workers: int = 1
    backend: str = "gloo"
    link: LinkModel | None = None  # the per-collective latency a rank would measure on it


class Policy(abc.ABC):
    """Chooses the configuration of every step (see the module docstring for the contract)."""

    name: str = ""

    def prepare(self, context: PolicyContext) -> None:
        """Receive what is known before the run; online policies ignore it."""

    @abc.abstractmethod
    def initial_config(self) -> RunConfig: ...

    @abc.abstractmethod
    def observe(self, record: SimulatedStep) -> RunConfig | None: ...

    def describe(self) -> str:
        """What the policy chose, for reports."""
        return ""
