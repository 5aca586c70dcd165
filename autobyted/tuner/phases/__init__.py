"""The phases of one job's search. Each measures and judges; `Phase.on_sample` returns what it asks
for (tuner.actions), and tuner.transitions acts on it (decisions, status, the next phase):

    warm-up -> baseline -> exploring k/N -> (checking) -> (confirming) -> verifying -> holding
    (baseline.py)          (exploring.py)   (checking.py)                  (verifying.py) (watching.py)
                  ^                                                                       |
                  +--------------------- re-tuning (baseline.py) <-- drift, rescore ------+

- baseline.py: warm-up and baseline / re-tuning: a window of the configuration in effect gives the
  context, the noise level and the incumbent's step time (the search is planned from it in
  tuner.transitions); early in it, the warm start when an earlier job's winner wins here, or
  the first trial of what this model held at another rank count.
- exploring.py: a trial's window with its sequential cut, and the context check a suspicious trial
  gets.
- checking.py: the incumbent measured again, after a suspicious trial (checking) or before switching
  to the search's winner (confirming): a sequential test with two looks.
- verifying.py: the winner's window after the switch: kept, rolled back, or the search re-opened.
- watching.py: holding / no headroom / observing: the drift detector and the periodic rescore watch
  the held configuration.
- paused.py: an operator decided or paused it; only a resume ends it.

Each phase object owns only its own working state (its window, its trial, its decision); what a
search measured is its `tuner.job.Search`, what the job measured is its `tuner.job.TunerJob`, both
written by tuner.transitions. The arithmetic of the judgements is tuner.verdict (no state). Phase
modules import none of one another: the graph is tuner.transitions.
"""

from __future__ import annotations

from autobyte.types import StepMetrics

from autobyted.tuner.actions import Action
from autobyted.tuner.job import TunerJob


class Phase:
    """A phase of one job's search: it owns its working state, and `on_sample` returns what it
    asks for (`actions.STAY` to go on)."""

    name = ""  # the status a phase shows is set by tuner.transitions

    def __init__(self, job: TunerJob) -> None:
        self.job = job

    def on_sample(self, m: StepMetrics) -> Action:
        raise NotImplementedError
