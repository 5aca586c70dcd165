"""What a job's search knows besides its predictor: the windows earlier jobs of its shape measured
(and which configurations their searches held), and the predictor's measured errors on this job.
Both correct the predictor's scores of the candidates (tuner.search's docstring: "what earlier jobs
of this shape measured")."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from autobyte.types import Config

from autobyted.tuner.drift import SIGNALS
from autobyted.tuner.features import Context, JobShape, summarize
from autobyted.tuner.measured import MeasuredWindow
from autobyted.tuner.predictor import Prediction, Window
from autobyted.tuner.verdict import MEDIAN_SE

ERRORS_KEPT = 24  # the predictor's most recent measured errors on a job, used to correct it
ERROR_CLIP = 0.7  # one measured error moves a prediction by at most 2x
MIN_SHIFTS = {
    signal.name: signal.min_shift for signal in SIGNALS
}  # the drift test's "same context"
KNOWN_SE_FLOOR = (
    0.02  # an earlier job's measured ratio is never taken as exact (the predictor's floor)
)


def same_context(past: Context, now: Context) -> bool:
    """Two contexts of one configuration that the drift test would not tell apart: bandwidth
    estimate, compute and host load (when both know it) within their minimum relevant shifts."""

    def log_shift(a: float, b: float) -> float:
        return abs(math.log(a / b)) if a > 0 and b > 0 else math.inf

    if log_shift(past.bandwidth_bytes_per_s, now.bandwidth_bytes_per_s) > MIN_SHIFTS["bandwidth"]:
        return False
    if log_shift(past.compute_s, now.compute_s) > MIN_SHIFTS["compute"]:
        return False
    return not (
        past.host_load > 0
        and now.host_load > 0
        and abs(past.host_load - now.host_load) > MIN_SHIFTS["host_load"]
    )


@dataclasses.dataclass(frozen=True)
class Carried:
    """What an earlier job of this model held at another world size (a restart at another rank
    count): tried first, early in the job's first baseline (tuner.phases.baseline)."""

    config: Config
    world_size: int
    job: str


def carried(
    relatives: dict[tuple[str, int], dict[Config, list[Window]]], shape: JobShape
) -> Carried | None:
    """Of the configurations earlier jobs of this model held after a search (a trial's window and
    its verification's: two windows of one configuration in one segment) at other world sizes, the
    one held last at the world size nearest this job's (in octaves); None when none was held."""
    held = [
        (abs(math.log2(windows[0].context.shape.world_size / shape.world_size)), -latest, c, w)
        for by_config in relatives.values()
        for c, windows in by_config.items()
        if len(windows) >= 2
        for w in [windows[-1]]
        for latest in [max(x.created_at_s for x in windows)]
    ]
    if not held:
        return None
    _distance, _latest, config, window = min(held, key=lambda t: t[:2])
    return Carried(config, window.context.shape.world_size, window.job)


class JobEvidence:
    """Earlier jobs' windows of this job's shape, and the predictor's measured errors on this job."""

    def __init__(
        self, job: str, shape: JobShape, known: Sequence[Window], first_segment: int
    ) -> None:
        self.shape = shape
        # Earlier jobs' windows of this shape, by (job, segment). The segments of this run are
        # numbered from `first_segment` on (the manager passes one past the job's stored ones): a
        # job name used again (a script run twice) keeps its runs apart, in the predictor's pairs
        # and here, where its earlier runs count as earlier jobs.
        self.known: dict[tuple[str, int], dict[Config, Window]] = {}
        self.known_held: set[tuple[str, int, Config]] = set()  # an earlier search's verified winner
        self.known_winners: set[Config] = set()  # those of segments in this context (known_ratios)
        # Earlier jobs of this model at other world sizes: (job, segment) -> config -> windows.
        relatives: dict[tuple[str, int], dict[Config, list[Window]]] = {}
        for window in known:
            earlier = window.job != job or window.segment < first_segment
            if not earlier or window.step_time_s <= 0:
                continue
            key = (window.job, window.segment)
            if window.context.shape == shape:
                if window.config in self.known.get(key, {}):
                    # A second window of a configuration in one segment is the verification of a
                    # search's winner (a trial's window, then the switch's; baselines open segments).
                    self.known_held.add((*key, window.config))
                self.known.setdefault(key, {})[window.config] = window
            elif window.context.shape.same_model(shape):
                relatives.setdefault(key, {}).setdefault(window.config, []).append(window)
        self.carried = carried(relatives, shape)
        # The predictor's measured errors on this job: (config, measured - predicted log ratio).
        self.errors: list[tuple[Config, float]] = []
        self.search_errors: list[tuple[Config, float]] = []  # this search's, until it ends cleanly

    # ------------------------------------------------------------------ the predictor's errors
    def open_search(self, reference: Config) -> None:
        self.search_errors = [(reference, 0.0)]  # the reference of this search's errors

    def add_search_error(self, config: Config, error: float) -> None:
        self.search_errors.append((config, max(-ERROR_CLIP, min(ERROR_CLIP, error))))

    def keep_search_errors(self) -> None:
        self.errors = (self.errors + self.search_errors)[-ERRORS_KEPT:]
        self.search_errors = []

    def drop_search_errors(self) -> None:
        self.search_errors = []

    def corrected(self, prediction: Prediction, reference: Config) -> Prediction:
        """The predictor's means corrected by its measured errors on this job: a kernel-weighted
        mean of the errors of configurations near each candidate (distance in octaves of
        partition and credit size, a Gaussian kernel one octave wide; each search's incumbent is a
        point of error 0, the reference its errors were measured against), shrunk towards 0 when the evidence is thin
        (prior weight 0.25): a few measured trials teach the search, before any retraining, that
        e.g. large partitions are slower here than the predictor thinks."""
        errors = self.errors + self.search_errors
        if len(errors) <= 1:
            return prediction
        gradient = float(self.shape.parameter_bytes or 1)
        mean_tensor = gradient / max(1, self.shape.tensor_count)

        def position(config: Config) -> tuple[float, float]:
            return (
                math.log2(config.partition_bytes or mean_tensor),
                math.log2(min(config.credit_bytes or gradient, gradient) or 1.0),
            )

        points = [(position(c), e) for c, e in errors]

        def correction(config: Config) -> float:
            partition_octave, credit_octave = position(config)
            weights = [
                math.exp(-((partition_octave - a) ** 2 + (credit_octave - b) ** 2) / 2)
                for (a, b), _ in points
            ]
            return sum(w * e for w, (_, e) in zip(weights, points)) / (sum(weights) + 0.25)

        base = correction(
            reference
        )  # predictions are relative to the reference: so are corrections
        mean = prediction.mean.copy()
        for i, candidate in enumerate(prediction.candidates):
            if candidate != reference:
                mean[i] += correction(candidate) - base
        return Prediction(prediction.candidates, mean, prediction.std)

    # ------------------------------------------------------------------ earlier jobs
    def with_known(
        self,
        prediction: Prediction,
        reference: MeasuredWindow,
        measured: Sequence[MeasuredWindow | None],
        sigma: float,
        first: int | None = None,
    ) -> Prediction:
        """The predictions of the first `first` candidates (all by default) combined with what
        earlier jobs of this shape measured in the same context (tuner.search's docstring);
        `measured`: this search's incumbent and trials (anchors of the ratios)."""
        ratios = self.known_ratios(reference, measured, sigma)
        if not ratios:
            return prediction
        mean, std = prediction.mean.copy(), prediction.std.copy()
        # The model's error on this shape, where the earlier jobs measured what it predicts: its
        # bias (the mean residual, shrunk by one pseudo-observation of 0) moves the candidates
        # nobody measured, and what is left of the residuals widens its spread (alone, the spread
        # would let a model that is wrong here outweigh a measurement).
        residuals = [
            ratios[c][0] - float(mu)
            for c, mu in zip(prediction.candidates, prediction.mean)
            if c in ratios and c != reference.config
        ]
        bias = sum(residuals) / (len(residuals) + 1)
        error2 = statistics.mean((r - bias) ** 2 for r in residuals) if residuals else 0.0
        for i, candidate in enumerate(prediction.candidates[:first]):
            if candidate == reference.config:
                continue
            std[i] = math.sqrt(float(std[i]) ** 2 + error2)
            if candidate not in ratios:
                mean[i] += bias
                continue
            ratio, se = ratios[candidate]
            w_model, w_known = 1 / float(std[i]) ** 2, 1 / se**2
            mean[i] = (w_model * float(mean[i]) + w_known * ratio) / (w_model + w_known)
            std[i] = math.sqrt(1 / (w_model + w_known))
        return Prediction(prediction.candidates, mean, std)

    def held_before(self, reference: MeasuredWindow) -> bool:
        """An earlier job of this shape held `reference`'s configuration after a search in the same
        context (tuner.search's docstring)."""
        if not self.known_held:
            return False
        now = summarize(reference.samples, self.shape)
        return any(
            (job, segment, reference.config) in self.known_held
            and same_context(windows[reference.config].context, now)
            for (job, segment), windows in self.known.items()
        )

    def known_ratios(
        self, reference: MeasuredWindow, measured: Sequence[MeasuredWindow | None], sigma: float
    ) -> dict[Config, tuple[float, float]]:
        """Candidate -> (mean measured log ratio to the reference configuration, its standard error)
        over the earlier jobs' context segments that measured, in this context, the reference or
        another configuration this search measured (an anchor: the ratio is chained through it,
        past candidate/anchor + this job's anchor/reference). Sets `known_winners`."""
        if not self.known:
            return {}
        anchors = [reference] + [
            m for m in measured if m is not None and not m.cut and m.config != reference.config
        ]
        contexts = {id(m): summarize(m.samples, self.shape) for m in anchors}
        ratios: dict[Config, list[tuple[float, float]]] = {}
        self.known_winners = set()
        for (job, segment), windows in self.known.items():
            anchor = next(
                (
                    m
                    for m in anchors
                    if m.config in windows
                    and same_context(windows[m.config].context, contexts[id(m)])
                ),
                None,
            )
            if anchor is None:
                continue
            self.known_winners |= {c for c in windows if (job, segment, c) in self.known_held}
            past = windows[anchor.config]
            # this job's anchor against its reference (0 when the anchor is the reference)
            offset = anchor.log_median - reference.log_median
            offset_se2 = (
                0.0
                if anchor is reference
                else (MEDIAN_SE * sigma) ** 2
                * (1 / len(anchor.samples) + 1 / len(reference.samples))
            )
            for config, window in windows.items():
                if config in (anchor.config, reference.config):
                    continue
                se2 = (MEDIAN_SE * sigma) ** 2 * (
                    1 / max(1, window.samples) + 1 / max(1, past.samples)
                )
                ratios.setdefault(config, []).append(
                    (math.log(window.step_time_s / past.step_time_s) + offset, se2 + offset_se2)
                )
        out = {}
        for config, values in ratios.items():
            logs = [v for v, _ in values]
            spread = statistics.pstdev(logs) if len(logs) > 1 else 0.0
            se = math.sqrt(statistics.mean(e2 for _, e2 in values) / len(values) + spread**2)
            out[config] = (statistics.mean(logs), max(KNOWN_SE_FLOOR, se))
        return out
