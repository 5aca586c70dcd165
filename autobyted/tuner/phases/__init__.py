"""The phases of one job's search (tuner.search.JobTuner dispatches every sample to the phase in
effect; `Phase.on_sample` returns the phase the next sample goes to):

    warm-up -> baseline -> exploring k/N -> (checking) -> (confirming) -> verifying -> holding
    (baseline.py)          (exploring.py)   (checking.py)                  (verifying.py) (watching.py)
                  ^                                                                       |
                  +--------------------- re-tuning (baseline.py) <-- drift, rescore ------+

- baseline.py: warm-up and baseline / re-tuning: a window of the configuration in effect gives the
  context, the noise level and the incumbent's step time; planning the search from it; `abort`
  when the context moved under a search.
- exploring.py: which candidate's trial pays (`paying`), the next trial, a trial's window with its
  sequential cut, the context check a suspicious trial gets, and the warm start.
- checking.py: the incumbent measured again, after a suspicious trial (checking) or before switching
  to the search's winner (confirming): a sequential test with two looks.
- verifying.py: the search's end (`finish`: the winner with hysteresis; confirm, switch, verify,
  roll back) and `settle` (what the status says the search found).
- watching.py: holding / no headroom / observing: the drift detector and the periodic rescore watch
  the held configuration; a decision the job never applied.
- paused.py: an operator decided or paused it; only a resume ends it.

Each phase object owns only its own working state (its window, its trial, its decision); what a
search measured is its `tuner.job.Search`, what the job measured is its `tuner.job.TunerJob`. The
arithmetic of the decisions is tuner.verdict (no state), the evidence of earlier jobs and this job's
predictor errors tuner.evidence. The phase modules refer to one another (a state machine's graph is
a cycle): each imports its successors as modules and reaches them at call time.
"""

from __future__ import annotations

from autobyte.types import StepMetrics

from autobyted.tuner.job import TunerJob


class Phase:
    """A phase of one job's search: it owns its working state, and `on_sample` returns the phase
    the next sample goes to (itself to stay)."""

    def __init__(self, job: TunerJob) -> None:
        self.job = job

    def on_sample(self, m: StepMetrics) -> Phase:
        raise NotImplementedError
