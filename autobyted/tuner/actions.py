"""What a phase of the search asks for (`Phase.on_sample` returns one); tuner.transitions acts on
it: it is the one place that issues decisions (and pauses the job when one is refused), names the
status, writes what the job and its search remember, and builds the next phase. A phase only
measures and judges.

    Stay                      the phase goes on
    Open                      a search: baseline, or re-tuning after drift / a rescore / a resume
    BaselineMeasured          the baseline's window is in: plan the search from it (ended early:
                              what this model held at another rank count is the first trial)
    WarmStart                 early in the baseline, an earlier job's winner wins here: switch to it
    Accept                    a trial's window counts: learn from it, then the next trial or the end
    Check                     a trial's context jumped: measure the incumbent again first
    Finish                    the search's end: pick the winner, confirm, switch, verify
    Verified                  the winner's verification window kept it: hold it
    WarmStartLost             a warm start's switch did not win: a lost trial, the search goes on
    RollBack                  the winner measured slower than the incumbent: back, verify again
    Abort                     the context moved under the search: search again, or hold
"""

from __future__ import annotations

import dataclasses

from autobyte.types import Config, StepMetrics

from autobyted.tuner.drift import Alarm
from autobyted.tuner.evidence import Carried
from autobyted.tuner.job import Search
from autobyted.tuner.measured import MeasuredWindow
from autobyted.tuner.predictor import Prediction


class Action:
    """Base of what `Phase.on_sample` returns."""


@dataclasses.dataclass(frozen=True)
class Stay(Action):
    pass


STAY = Stay()


@dataclasses.dataclass(frozen=True)
class Open(Action):
    reason: str  # why ("" for the job's first search)
    new_segment: bool
    steps: int  # the baseline's nominal window
    sample: StepMetrics | None = None  # a sample the new baseline starts with (after warm-up)
    retune: bool = False  # counted as a re-tune (drift, a rescore)
    # steps already measured in the new context (a drift alarm's fresh steps): the baseline's first
    seed: tuple[StepMetrics, ...] = ()


@dataclasses.dataclass(frozen=True)
class BaselineMeasured(Action):
    search: Search
    incumbent: MeasuredWindow
    carried: Carried | None = None  # ended early to try what this model held at another size


@dataclasses.dataclass(frozen=True)
class WarmStart(Action):
    search: Search
    incumbent: MeasuredWindow
    candidates: tuple[Config, ...]
    prediction: Prediction
    config: Config
    predicted_s: float


@dataclasses.dataclass(frozen=True)
class Accept(Action):
    search: Search
    trial: MeasuredWindow
    checked: tuple[MeasuredWindow, ...] = ()  # trials a check of the incumbent followed (A-B-A)
    cleared: tuple[str, int] | None = None  # a context jump the check showed to be the trials'


@dataclasses.dataclass(frozen=True)
class Check(Action):
    search: Search
    trial: MeasuredWindow
    jump: Alarm
    fastest_s: float  # the incumbent at best in the trial's context


@dataclasses.dataclass(frozen=True)
class Finish(Action):
    search: Search
    why: str = ""
    confirmed: bool = False  # the incumbent was just measured again (confirming)


@dataclasses.dataclass(frozen=True)
class Verified(Action):
    search: Search
    winner: MeasuredWindow
    measured: MeasuredWindow


@dataclasses.dataclass(frozen=True)
class WarmStartLost(Action):
    search: Search
    measured: MeasuredWindow


@dataclasses.dataclass(frozen=True)
class RollBack(Action):
    search: Search
    winner: MeasuredWindow
    measured: MeasuredWindow


@dataclasses.dataclass(frozen=True)
class Abort(Action):
    search: Search
    moved: Alarm
    in_effect: MeasuredWindow
