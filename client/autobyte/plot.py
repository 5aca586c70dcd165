"""`autobyte plot`: one picture of a job: step time, configurations, decisions and context."""

from __future__ import annotations

import bisect
import math
import re
import statistics
from collections.abc import Sequence
from typing import NamedTuple

WIDTH_PX, HEIGHT_PX, DPI = 1200, 600, 100
PLOT_EXTRA = "plot"  # setup.cfg's extra that brings matplotlib
# The configurations' band colours (pale, so that the step-time lines stay readable on them).
BAND_COLOURS = (
    "#dbe9f6",
    "#fde2c8",
    "#d9f0d3",
    "#eadcf3",
    "#f9d6d5",
    "#f3efc9",
    "#d4f0f0",
    "#e8e8e8",
)
RANK_COLOURS = ("#1f4e9c", "#c2410c", "#15803d", "#7e22ce")
MAX_RANK_LINES = len(RANK_COLOURS)  # more ranks than this are folded (`_fold`)


class StepPoint(NamedTuple):
    """One stored step, as the picture needs it."""

    rank: int
    step: int
    wall_time_s: float
    step_time_s: float
    config: str  # the configuration it ran with, short (Config.short with the job's engine)
    bandwidth_bytes_per_s: float
    host_load: float
    decision_id: int
    compute_s: float = 0.0  # forward + backward


class DecisionMark(NamedTuple):
    decision_id: int
    created_at_s: float
    state: str
    reason: str
    source: str
    config: str  # the configuration decided, short
    predicted_step_time_s: float | None
    measured_step_time_s: float | None


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed: the message says which extra brings it."""


_LINK = re.compile(r"rank (\d+)'s link|the path between rank (\d+) and rank (\d+)")


def short_reason(reason: str, limit: int = 28) -> str:
    """The head of a decision's reason ('trial 2/4', 'hold best', 'rollback', 'operator request'),
    cut at a word: the whole text is in `autobyte history`. A straggler's link the reason names
    (autobyted/tuner/stragglers.py) is kept after it ('trial 1/4 · rank 1's link'): on a job of
    many ranks it is what the picture could not show otherwise."""
    head = reason.split(":", 1)[0].strip() or "decision"
    if len(head) > limit:
        head = head[:limit].rsplit(" ", 1)[0] + "…"
    link = _LINK.search(reason)
    if link is None:
        return head
    one, a, b = link.groups()
    return f"{head} · " + (f"rank {one}'s link" if one else f"link {a}-{b}")


LABEL_ROWS = 4  # heights a decision's label may take before it is left out (its line stays)


def label_rank(decision: DecisionMark) -> int:
    """Which labels are placed first where they crowd: what the job ended up doing (hold, return,
    switch, re-tune, an operator's) before trials, before checks and confirms."""
    head = decision.reason.split(":", 1)[0]
    if head.startswith(("check", "confirm")):
        return 2
    if head.startswith("trial"):
        return 1
    return 0


def step_times_text(decision: DecisionMark) -> str:
    """'pred 282 / meas 300 ms'; a figure that is missing says so."""
    predicted, measured = decision.predicted_step_time_s, decision.measured_step_time_s
    if predicted and measured:
        return f"pred {_ms(predicted)} / meas {_ms(measured)} ms"
    if predicted:
        return f"pred {_ms(predicted)} ms, not measured"
    if measured:
        return f"meas {_ms(measured)} ms, no prediction"
    return "not measured"


def rolling_median(values: Sequence[float], window: int) -> list[float]:
    """Median of the last `window` values at each point (fewer at the start)."""
    out, recent = [], []
    for value in values:
        recent.append(value)
        if len(recent) > window:
            recent.pop(0)
        out.append(statistics.median(recent))
    return out


def _stints(points: Sequence[StepPoint]) -> list[tuple[float, float, str]]:
    """(start, end, configuration) of each run of consecutive steps under one configuration."""
    stints: list[list] = []
    for point in points:
        label = point.config
        if stints and stints[-1][2] == label:
            stints[-1][1] = point.wall_time_s
        else:
            start = stints[-1][1] if stints else point.wall_time_s - point.step_time_s
            stints.append([start, point.wall_time_s, label])
    return [(a, b, c) for a, b, c in stints]


def _fold(
    per_rank: dict[int, list[StepPoint]], leader_rank: int, window: int
) -> tuple[dict, tuple[list[float], list[float], list[float]]]:
    """The lines a many-rank job keeps (rank 0; the rank whose median compute is longest, named
    with its lag over the ranks' median) and the band of the ranks' step times at each of rank
    0's steps (rolling medians of the fastest and the slowest rank's step time)."""
    computes = {
        rank: statistics.median(p.compute_s for p in points)
        for rank, points in per_rank.items()
        if points
    }
    lines: dict = {leader_rank: per_rank[leader_rank]}
    typical = statistics.median(computes.values()) if computes else 0.0
    lagging = max(computes, key=lambda r: computes[r]) if computes else leader_rank
    if typical > 0 and lagging != leader_rank:
        lag = 100 * (computes[lagging] / typical - 1)
        lines[f"rank {lagging}: compute +{lag:.0f}%"] = per_rank[lagging]
    by_step: dict[int, list[float]] = {}
    for points in per_rank.values():
        for p in points:
            by_step.setdefault(p.step, []).append(p.step_time_s)
    leader = [p for p in per_rank[leader_rank] if p.step in by_step]
    low = rolling_median([min(by_step[p.step]) * 1e3 for p in leader], window)
    high = rolling_median([max(by_step[p.step]) * 1e3 for p in leader], window)
    return lines, ([p.wall_time_s for p in leader], low, high)


def _mark_time(decision: DecisionMark, leader: Sequence[StepPoint]) -> float:
    """When a decision took effect: the first leader step under it; else when it was made."""
    for point in leader:
        if point.decision_id == decision.decision_id:
            return point.wall_time_s - point.step_time_s
    return decision.created_at_s


def _ms(value: float | None) -> str:
    return f"{value * 1e3:.0f}" if value else "-"


class Drawn(NamedTuple):
    """What a picture shows of its decisions: labels kept (no two overlap) and left out."""

    labelled: int
    unlabelled: int


def draw_job(
    job: str, steps: Sequence[StepPoint], decisions: Sequence[DecisionMark], path: str
) -> Drawn:
    """Write the picture of a job as a PNG of WIDTH_PX x HEIGHT_PX. ValueError when there are no
    steps; PlotUnavailable without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            "autobyte plot needs matplotlib: pip install 'autobyte[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not steps:
        raise ValueError(f"job {job!r} has no steps to plot yet")
    ordered = sorted(steps, key=lambda p: (p.wall_time_s, p.rank))
    origin = min(p.wall_time_s - p.step_time_s for p in ordered)
    ranks = sorted({p.rank for p in ordered})
    leader_rank = ranks[0]
    leader = [p for p in ordered if p.rank == leader_rank]
    per_rank = {rank: [p for p in ordered if p.rank == rank] for rank in ranks}
    window = max(5, min(51, len(leader) // 60))

    fig, (top, bottom) = plt.subplots(
        2,
        1,
        sharex=True,
        figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI),
        dpi=DPI,
        gridspec_kw={"height_ratios": [3, 1.25]},
    )
    # A fixed layout (the legends sit in the right margin), set before the labels are measured.
    fig.subplots_adjust(left=0.075, right=0.79, top=0.94, bottom=0.085, hspace=0.08)
    # The configuration in effect (the leader's: every rank switches at the same step) as bands;
    # every configuration is keyed in the legend, the wide bands are also named in place.
    from matplotlib.patches import Patch

    colours: dict[str, str] = {}
    band_names = []  # (name in place, the band's end): kept where the band holds it (below)
    stints = _stints(leader)
    span = max(1e-9, leader[-1].wall_time_s - origin)
    for start, end, label in stints:
        colour = colours.setdefault(label, BAND_COLOURS[len(colours) % len(BAND_COLOURS)])
        for axis in (top, bottom):
            axis.axvspan(start - origin, end - origin, color=colour, zorder=0, linewidth=0)
        band_names.append(
            (
                top.annotate(
                    label,
                    (start - origin, 0.0),
                    xycoords=("data", "axes fraction"),
                    xytext=(3, 4),
                    textcoords="offset points",
                    fontsize=8,
                    color="0.3",
                ),
                end - origin,
            )
        )
    # Step time: a rolling median per rank, rank by rank; more ranks than there are colours are
    # folded: rank 0, the band between the ranks' fastest and slowest, the rank whose compute lags.
    all_medians = []
    if len(per_rank) > MAX_RANK_LINES:
        per_rank, band = _fold(per_rank, leader_rank, window)
        xs_band, low, high_band = band
        top.fill_between(
            [x - origin for x in xs_band],
            low,
            high_band,
            color="0.55",
            alpha=0.3,
            linewidth=0,
            label=f"{len(ranks)} ranks: fastest to slowest",
            zorder=2,
        )
        all_medians.extend(high_band)
    for index, (rank, points) in enumerate(per_rank.items()):
        medians = [m * 1e3 for m in rolling_median([p.step_time_s for p in points], window)]
        all_medians.extend(medians)
        top.plot(
            [p.wall_time_s - origin for p in points],
            medians,
            color=RANK_COLOURS[index % len(RANK_COLOURS)],
            linewidth=1.4,
            label=rank if isinstance(rank, str) else f"rank {rank}",
            zorder=3,
        )
    high = sorted(all_medians)[int(0.99 * (len(all_medians) - 1))] if all_medians else 1.0
    top.set_ylim(0, high * 1.45)  # headroom above the lines for the decision labels
    top.set_ylabel(f"step time (ms)\nrolling median of {window}")
    # Each decision: a dashed line where it took effect; a label (its reason, short, predicted vs
    # measured step time) where one fits without covering another: the more important first.
    times = [p.wall_time_s for p in leader]
    shown = []
    for decision in decisions:
        at = _mark_time(decision, leader)
        if (
            origin - 1 <= at <= leader[-1].wall_time_s + 1
        ):  # else outside the steps shown (--since, --limit)
            shown.append((at - origin, decision))
            top.axvline(
                at - origin,
                color="#7f1d1d" if decision.state == "rolled_back" else "0.25",
                linestyle="--",
                linewidth=0.8,
                zorder=2,
            )
    fig.canvas.draw()  # the renderer measures each label before it is kept
    renderer = fig.canvas.get_renderer()
    for name, end in band_names:  # a band too narrow for its name is named by the legend only
        if name.get_window_extent(renderer).x1 > top.transData.transform((end, 0))[0] - 2:
            name.remove()
    placed = []  # display boxes of the labels kept
    hidden = 0
    for x, decision in sorted(shown, key=lambda item: (label_rank(item[1]), item[0])):
        i = min(len(leader) - 1, bisect.bisect_left(times, x + origin))
        measured_here = leader[i].step_time_s * 1e3
        label = (
            f"#{decision.decision_id} {short_reason(decision.reason)}\n{step_times_text(decision)}"
        )
        for row in range(LABEL_ROWS):
            note = top.annotate(
                label,
                (x, min(measured_here, high * 1.4)),
                xytext=(x, high * 1.45 * (0.97 - 0.11 * row)),
                textcoords="data",
                fontsize=7,
                ha="left",
                va="top",
                zorder=4,
                color="#7f1d1d" if decision.state == "rolled_back" else "black",
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "0.6", "alpha": 0.9},
                arrowprops={"arrowstyle": "-", "color": "0.5", "linewidth": 0.6},
            )
            note.draw(renderer)
            box = note.get_bbox_patch().get_window_extent(renderer)
            inside = top.get_window_extent(renderer)
            if box.x1 <= inside.x1 and not any(box.overlaps(other) for other in placed):
                placed.append(box)
                break
            note.remove()
        else:
            hidden += 1
    handles, _labels = top.get_legend_handles_labels()
    handles += [Patch(color=colour, label=f"in effect: {name}") for name, colour in colours.items()]
    if any(d.state == "rolled_back" for _, d in shown):
        handles.append(Patch(facecolor="white", edgecolor="#7f1d1d", label="red: rolled back"))
    if hidden:
        handles.append(
            Patch(
                facecolor="white",
                edgecolor="0.6",
                label=f"{hidden} decision(s) unlabelled: autobyte history",
            )
        )
    # Outside the axes, on the right: it covers no band label, decision or line.
    top.legend(
        handles=handles,
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        framealpha=0.9,
        borderaxespad=0.0,
    )
    top.set_title(
        f"{job}: step time, configuration in effect (bands) and decisions "
        f"({len(leader)} steps of rank {leader_rank}, {len(ranks)} rank(s))",
        fontsize=10,
    )
    # Context on a second axis: the scheduler's bandwidth estimate and the host's load.
    xs = [p.wall_time_s - origin for p in leader]
    bandwidth = [p.bandwidth_bytes_per_s * 8 / 1e6 for p in leader]
    if any(b > 0 for b in bandwidth):
        bottom.plot(
            xs,
            rolling_median(bandwidth, window),
            color="#0f766e",
            linewidth=1.3,
            label="bandwidth estimate (Mbit/s)",
        )
    bottom.set_ylabel("bandwidth\n(Mbit/s)", color="#0f766e")
    bottom.set_ylim(bottom=0)
    load_axis = bottom.twinx()
    loads = [p.host_load for p in leader]
    if any(value > 0 for value in loads):
        load_axis.plot(
            xs,
            rolling_median(loads, window),
            color="#b45309",
            linewidth=1.1,
            linestyle="-",
            label="host load (others' CPU share)",
        )
    load_axis.set_ylim(0, max(1.0, max(loads, default=0.0) * 1.1))
    load_axis.set_ylabel("host load", color="#b45309")
    lines = bottom.get_legend_handles_labels()[0] + load_axis.get_legend_handles_labels()[0]
    if lines:
        bottom.legend(
            lines,
            [line.get_label() for line in lines],
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.06, 1.0),
            framealpha=0.9,
            borderaxespad=0.0,
        )
    bottom.set_xlabel("time since the first step (s)")
    bottom.set_xlim(0, math.ceil(span))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return Drawn(len(placed), hidden)
