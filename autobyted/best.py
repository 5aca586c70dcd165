"""`autobyte best`: the fastest configuration of a job's latest context, by the tuner's rule.

What storage returns (rank 0's steps, `BaseStorage.rank0_points`) is split into contexts
(autobyted.contexts) and compared with the tuner's switching test (autobyted.tuner.verdict), past
the tuner's warm-up: storage itself knows nothing of the tuner.
"""

from __future__ import annotations

import math
import statistics

from autobyte.types import Config, describe_speedup, speedup

from autobyted.contexts import StepPoint, split_contexts
from autobyted.signals import robust_sigma
from autobyted.storage.base import BaseStorage
from autobyted.storage.records import BestRecord, CandidateRecord
from autobyted.tuner.params import TunerParams
from autobyted.tuner.verdict import beats

PARAMS = TunerParams()
MIN_SAMPLES = 5  # measured steps a configuration needs past the warm-up to be compared


def best(storage: BaseStorage, job: str, min_samples: int = MIN_SAMPLES) -> BestRecord:
    """The job's best configuration (NotFound for an unknown job, as storage raises it)."""
    return best_in_latest_context(job, storage.rank0_points(job), min_samples)


def best_in_latest_context(
    job: str, points: list[StepPoint], min_samples: int, params: TunerParams = PARAMS
) -> BestRecord:
    """The fastest configuration among those measured (min_samples steps past a run's warm-up) in
    the job's latest context that has one (autobyted.contexts), with the speed-up of each over the
    context's reference: the no-scheduling baseline when it ran there, else the configuration the
    context began with."""
    contexts = split_contexts(points)
    for context in reversed(contexts):
        by_config: dict[Config, list[StepPoint]] = {}
        for point in context.steps:
            if point.step >= params.warmup_steps:
                by_config.setdefault(point.config, []).append(point)
        medians = {
            config: statistics.median(p.step_time_s for p in measured)
            for config, measured in by_config.items()
            if len(measured) >= min_samples
        }
        if medians:
            break
    else:
        return BestRecord(
            job=job,
            found=False,
            contexts=len(contexts),
            evidence=f"no configuration has {min_samples} measured steps past warm-up yet",
        )
    # The tuner's rule (tuner.verdict): the configuration the context began with (the incumbent
    # the tuner measured first there) stays the best unless another beats it beyond the noise.
    logs = {
        config: [math.log(p.step_time_s) for p in by_config[config] if p.step_time_s > 0]
        for config in medians
    }
    sigma = max(params.sigma_floor, statistics.median(robust_sigma(v) for v in logs.values()))
    fastest = best = min(medians, key=medians.get)
    incumbent = context.steps[0].config
    if (
        incumbent in medians
        and best != incumbent
        and not beats(
            math.log(medians[best]),
            len(logs[best]),
            math.log(medians[incumbent]),
            len(logs[incumbent]),
            sigma,
            params,
        )
    ):
        best = incumbent
    baseline = medians.get(Config(), 0.0)
    reference = Config() if baseline else context.steps[0].config
    reference_s = medians.get(reference, 0.0)
    steps = sorted(p.step for p in by_config[best])
    evidence = (
        f"median of {len(steps)} rank-0 steps in {steps[0]}..{steps[-1]}; {len(medians)} configuration(s) "
        f"compared in context {context.index} of {len(contexts)}"
    )
    if reference_s and best != reference:
        name = reference.short() + (
            " (the no-scheduling baseline)" if baseline else " (the context's first configuration)"
        )
        evidence += f"; {describe_speedup(speedup(reference_s, medians[best]), name)}"
    if fastest != best:
        evidence += (
            f"; {fastest.short()} measured {describe_speedup(speedup(medians[best], medians[fastest]), best.short())}"
            f", within the noise (the tuner's rule, tuner.verdict: at least {params.min_gain:.0%} "
            f"and {params.z_switch} standard errors)"
        )
    if len(contexts) > 1:
        evidence += "; configurations measured only in other contexts are not compared"
    compared = tuple(
        CandidateRecord(
            config,
            medians[config],
            len(by_config[config]),
            speedup(reference_s, medians[config]) if reference_s else 0.0,
        )
        for config in sorted(medians, key=medians.get)
    )
    return BestRecord(
        job=job,
        found=True,
        config=best,
        median_step_time_s=medians[best],
        samples=len(steps),
        baseline_step_time_s=baseline,
        evidence=evidence,
        candidates=compared,
        context=context.describe(len(contexts)),
        reference=reference,
        reference_step_time_s=reference_s,
        contexts=len(contexts),
    )
