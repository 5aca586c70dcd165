"""Which jobs the tuner tunes: one rule, read by the tuner and by the Status answer of a job the
tuner has not looked at yet (torch- and xgboost-free)."""

from __future__ import annotations

import time

from autobyted.storage.records import TunerStatusRecord

TUNED_ENGINES = ("scheduler", "fsdp2")


def not_tuned(tuning_disabled: bool, engine: str) -> TunerStatusRecord | None:
    """Why the tuner leaves a job alone (None: it tunes it): the job opted out, or it runs an engine
    the tuner has no search for (the scheduler's: tuner.search.JobTuner; FSDP2's:
    tuner.sharded.ShardTuner)."""
    if tuning_disabled:
        return TunerStatusRecord(
            mode="opted out",
            state="off",
            detail="off: the job opted out (autobyte.init(tune=False))",
            updated_at_s=time.time(),
        )
    if engine not in TUNED_ENGINES:
        return TunerStatusRecord(
            mode="not tuned",
            state="off",
            detail=f"off: no tuner for {engine}'s knobs (`autobyte propose` sets them)",
            updated_at_s=time.time(),
        )
    return None
