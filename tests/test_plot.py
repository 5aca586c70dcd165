"""`autobyte plot JOB`: a PNG of a real job (a real daemon, a real 2-rank gloo run), a clean error
for an unknown job, and the extra to install when matplotlib is missing."""

import os
import struct

from tests.helpers.cli import run_cli
from tests.helpers.daemon import ThreadDaemon
from tests.helpers.dist import kill_launch
from tests.helpers.paths import ROOT
from tests.helpers.trainer import start_mlp_trainer


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; AssertionError when it is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    assert data[-12:-4] == b"\x00\x00\x00\x00IEND", "truncated PNG (no IEND chunk at its end)"
    return struct.unpack(">II", data[16:24])


def test_plot_of_a_real_job_and_of_an_unknown_one(db_url, tmp_path):
    daemon = ThreadDaemon(db_url, tuner="auto").start()
    try:
        trainer = start_mlp_trainer(daemon.address, "pictured", 250, tmp_path)
        try:
            output, _ = trainer.communicate(timeout=280)
        finally:
            kill_launch(trainer)
        assert trainer.returncode == 0, output[-3000:]
        png = tmp_path / "job.png"
        result = run_cli("plot", "pictured", "--out", str(png), "--daemon", daemon.address)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"{png}: 500 steps") and "(1200x600)" in result.stdout, (
            result.stdout
        )
        assert png_size(png) == (1200, 600)
        assert png.stat().st_size > 20_000  # lines, bands and labels, not an empty canvas

        missing = tmp_path / "nope.png"
        unknown = run_cli("plot", "nope", "--out", str(missing), "--daemon", daemon.address)
        assert unknown.returncode == 1 and unknown.stdout == ""
        assert "unknown job 'nope'" in unknown.stderr and "Traceback" not in unknown.stderr
        assert not missing.exists()

        unwritable = run_cli(
            "plot",
            "pictured",
            "--out",
            str(tmp_path / "no-such-dir" / "x.png"),
            "--daemon",
            daemon.address,
        )
        assert unwritable.returncode in (1, 2) and "Traceback" not in unwritable.stderr, (
            unwritable.stderr
        )
    finally:
        daemon.stop()


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    """matplotlib made unimportable (a package of that name that raises ImportError, first on the
    path): the command says which extra to install, before asking any daemon."""
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('matplotlib is not installed here')\n")
    path = os.pathsep.join(
        [str(shadow.parent), str(ROOT / "client"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    )
    result = run_cli(
        "plot",
        "any-job",
        "--out",
        str(tmp_path / "x.png"),
        "--daemon",
        "127.0.0.1:1",
        env={"PYTHONPATH": path},
    )
    assert result.returncode == 1, result.stderr
    assert "pip install 'autobyte[plot]'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_crowded_decisions_never_overlap_and_missing_figures_say_not_measured(tmp_path):
    """Twenty decisions in five seconds: the labels kept do not overlap (the rest are counted in the
    legend, their dashed lines stay); a decision without a measurement says so, never 'meas - ms'."""
    from autobyte.plot import DecisionMark, StepPoint, draw_job, step_times_text

    steps = [
        StepPoint(rank, i, 1.7e9 + i * 0.1, 0.1 + 0.01 * (i % 7), "64KiB/64KiB", 2e8, 0.3, i // 10)
        for i in range(300)
        for rank in (0, 1)
    ]
    decisions = [
        DecisionMark(
            d,
            1.7e9 + d * 0.25,
            "rolled_back" if d % 3 else "applied",
            f"trial {d}/20: something",
            "tuner",
            "1MiB/4MiB",
            0.09,
            None if d % 2 else 0.1,
        )
        for d in range(1, 21)
    ]
    drawn = draw_job("crowded", steps, decisions, str(tmp_path / "crowded.png"))
    assert (tmp_path / "crowded.png").stat().st_size > 0
    assert (
        drawn.labelled >= 3 and drawn.labelled + drawn.unlabelled == 20 and drawn.unlabelled > 0
    ), drawn
    assert step_times_text(decisions[0]) == "pred 90 ms, not measured"
    assert step_times_text(decisions[1]) == "pred 90 / meas 100 ms"
    assert step_times_text(decisions[0]._replace(predicted_step_time_s=None)) == "not measured"


def test_an_8_rank_job_is_folded_to_rank_0_the_lagging_rank_and_a_band(tmp_path):
    """Eight lines would hide each other: rank 0, the rank whose compute lags (named with its lag)
    and the band from the fastest to the slowest rank at each step are drawn instead."""
    from autobyte import plot

    points = [
        plot.StepPoint(
            rank,
            step,
            1000.0 + step,
            (1.2 if rank == 6 else 1.0) + 0.01 * rank,
            "1MiB/4MiB",
            1e8,
            0.1,
            0,
            0.6 if rank == 6 else 0.4,
        )
        for rank in range(8)
        for step in range(40)
    ]
    per_rank = {r: [p for p in points if p.rank == r] for r in range(8)}
    lines, (xs, low, high) = plot._fold(per_rank, 0, 5)
    assert list(lines) == [0, "rank 6: compute +50%"]
    assert len(xs) == len(low) == len(high) == 40
    assert low[0] == 1000.0 and abs(high[0] - 1260.0) < 1e-9
    out = tmp_path / "wide.png"
    plot.draw_job("wide", points, [], str(out))
    assert png_size(out) == (plot.WIDTH_PX, plot.HEIGHT_PX)


def test_a_decision_label_keeps_the_straggler_link_its_reason_names():
    """On an 8-rank job the lines are folded; the link a re-tune named stays in its label."""
    from autobyte.plot import short_reason

    named = (
        "trial 1/4: 32MiB/128MiB predicted 1.31x faster than 16MiB/64MiB (re-tuning after "
        "bandwidth drop on rank 1's link (10 ms of queueing, the other ranks' at most 1.1 ms))"
    )
    assert short_reason(named) == "trial 1/4 · rank 1's link"
    path = "re-tuning after bandwidth drop on the path between rank 2 and rank 5 (9 ms ...)"
    assert short_reason(path) == "re-tuning after bandwidth…" + " · link 2-5"
    assert short_reason("hold best: 1MiB/4MiB measured 1.20x faster") == "hold best"
