"""The quick start's story on the testbed, checked: after the links drop the tuner names the
bandwidth as the cause, `autobyte best` names the configuration the tuner holds (or, when the run
ends during the re-tune, as the README's does, one the re-tune measured after the drop), and no
decision of the finished job is left pending. A shorter run than the README's (QUICKSTART_SECONDS=60: the drop
at 36 s, more than twice as long as the first search takes to settle: it held at 16 s in CI at
50b8c3d)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

TRAIN_S = 60  # the drop at 36 s (scripts/quickstart.py's DROP_AT_S)
REACT_S = 2.0
CAUSE = re.compile(r"(?:re-tuning after|check:) ([a-z0-9 -]+?)(?:,| during|:|\?|\))")
ENDS_SEARCH = ("return to ", "hold best: ", "switching to ")


def causes_named_after(decisions, since_s: float) -> list[str]:
    """The causes the tuner names (a re-tune's, a trial's check's) in the decisions made from
    `since_s` on, in order. A search under way before `since_s` goes on carrying the cause it opened
    with in its reasons until it ends: those decisions name nothing new (a re-tune after a compute
    slowdown seen just before the drop, its second trial decided just after it)."""
    causes: list[str] = []
    ongoing = None  # the cause of the re-tune under way at since_s
    for d in sorted(decisions, key=lambda d: d.created_at_s):
        check = d.reason.startswith("check:")
        found = CAUSE.search(d.reason) if check or "re-tuning after" in d.reason else None
        cause = found.group(1) if found else None
        if d.created_at_s < since_s:
            if not check:
                ongoing = cause
        elif cause and (check or cause != ongoing):
            causes.append(cause)
        if d.reason.startswith(ENDS_SEARCH):
            ongoing = None
    return causes


@pytest.mark.alone  # asserts on a measurement another test's load would distort
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the quick start's testbed builds network namespaces: needs root and iproute2",
)
def test_the_quickstart_tells_one_true_story():
    from autobyted.best import best as best_of
    from autobyted.storage.db import make_engine
    from autobyted.storage.sql import SqlStorage

    env = {**os.environ, "QUICKSTART_SECONDS": str(TRAIN_S), "QUICKSTART_KEEP": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=ROOT,
        check=False,
    )
    out = result.stdout + result.stderr
    work = re.search(r"its log and database are in (\S+)", out)
    try:
        assert result.returncode == 0 and work, out[-4000:]
        assert "run again with QUICKSTART_KEEP=1" not in out  # it was set
        db_url = re.search(r"with (sqlite:///\S+)", out).group(1)
        storage = SqlStorage(make_engine(db_url))
        decisions = storage.decisions("quickstart")
        drop_wall_s = float(
            re.search(
                r"the links dropped at \d+ s, rank 0's step \d+ \(unix time ([\d.]+)\)", out
            ).group(1)
        )
        held = storage.tuner_status("quickstart")
        # The first cause the tuner names after the drop (a re-tune or a check of a trial), among the
        # decisions made from steps after it: no test can see a change sooner than REACT_S (the drift
        # test needs four blocks of about half a second, a trial's check five steps of the new pace).
        causes = causes_named_after(decisions, drop_wall_s + REACT_S)
        if not causes:
            # A re-tune that found nothing worth a trial makes no decision: its cause is in the
            # tuner's status ("no headroom after bandwidth drop: ... stays").
            found = re.search(r"after ([a-z0-9 -]+?)(?:,|:|\)|$)", held.detail)
            causes = [found.group(1)] if found else []
        timeline = [
            f"{d.created_at_s - drop_wall_s:+.1f} s {d.state}: {d.reason}" for d in decisions
        ]
        if not (causes and causes[0] == "bandwidth drop"):
            # in full on the failure's captured stdout (pytest -q cuts a long assertion message)
            print("timeline:", *timeline, f"status: {held.state}: {held.detail}", sep="\n")
        assert causes and causes[0] == "bandwidth drop", (timeline, held.detail, out[-3000:])
        assert [d for d in decisions if d.state == "pending"] == [], [
            (d.decision_id, d.state) for d in decisions
        ]
        best = best_of(storage, "quickstart")
        assert held.state == "finished" and best.found, (held, best, out[-3000:])
        drop_step = int(re.search(r"the links dropped at \d+ s, rank 0's step (\d+)", out).group(1))
        if "re-tuning" in held.detail:
            # The run ended during the re-tune (a trial or a check in flight: the README's run ends
            # so too). The status says that search was on, and `autobyte best` compares only what
            # was measured after the drop, among what the tuner held or tried there.
            # The re-tune in flight is the drop's, or a later one whose cause the tuner names: on
            # this 2-core host a rank's compute speeds up once the link carries less (gloo's
            # threads take less of the CPU), and the drift detection may see that after the drop's
            # re-tune. The first cause after the drop is the drop's (above); `best`'s contexts
            # split on the link and the host load only, so its context is still the drop's.
            assert re.search(r"re-tuning after [a-z0-9 -]+", held.detail), held
            first = int(re.search(r"steps (\d+)\.\.", best.context).group(1))
            # drop_step is the step rank 0 was in when the links dropped (the worker reports a step
            # as it ends). The reductions of the step before run on into that step's forward (the
            # scheduler's overlap), so the drop can first show in that step's measurement.
            assert first >= drop_step - 1, (best.context, drop_step)
            # one change, one cause: best's context names it as the tuner's status does
            assert "since a bandwidth drop at step" in best.context, (best.context, held.detail)
            before = [
                d.config for d in decisions if d.state == "applied" and d.apply_at_step < first
            ]
            held_or_tried = {d.config for d in decisions if d.apply_at_step >= first} | set(
                before[-1:]
            )
            assert best.config in held_or_tried, (best, [d.reason for d in decisions])
        else:  # the tuner settled: best names the configuration it holds
            assert best.config == held.config, (held, best, out[-3000:])
        assert f"quickstart: {best.config.describe()}" in out  # what `autobyte best` printed
    finally:
        if work:
            shutil.rmtree(work.group(1), ignore_errors=True)
