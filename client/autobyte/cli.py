"""`autobyte` command line: status, history and best of the jobs autobyted knows."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import functools
import io
import json
import statistics
import textwrap
from collections.abc import Sequence

import click

from autobyte import __version__
from autobyte.query import Client, DaemonError
from autobyte.records import DecisionRecord, JobRecord, TunerStatusRecord
from autobyte.types import (
    BYTE_UNITS_HELP,
    FSDP_FIELDS,
    MAX_CREDIT_BYTES,
    MAX_PARTITION_BYTES,
    MAX_PREFETCH,
    MAX_TAIL_BYTES,
    MIN_CREDIT_BYTES,
    MIN_PARTITION_BYTES,
    MIN_TAIL_BYTES,
    Config,
    StepMetrics,
    describe_speedup,
    format_bytes,
    parse_bytes,
    speedup,
)

# Exit codes (docs/reference.md, "Exit codes").
EXIT_ERROR = 1  # the daemon answered with an error (unknown job, wrong token, its database failed)
EXIT_USAGE = 2  # bad command line (click's usage errors)
EXIT_UNREACHABLE = 3  # no daemon answered at the address, or what answered is not autobyted
WIDTH = 80


class CommandError(click.ClickException):
    """A failure the command reports as `autobyte: MESSAGE` with its exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file=None) -> None:
        click.echo(f"autobyte: {self.format_message()}", err=True)


EXIT_CODES = {"error": EXIT_ERROR, "usage": EXIT_USAGE, "unreachable": EXIT_UNREACHABLE}


def daemon_command(fn):
    """The connection options (--daemon, --token, --tls-ca) of a command that asks autobyted: the
    command gets a `Client` in their place; a failed call is its message and exit code."""

    @functools.wraps(fn)
    def command(daemon, token, tls_ca, **kwargs):
        try:
            return fn(Client(daemon, token, tls_ca), **kwargs)
        except DaemonError as error:
            raise CommandError(str(error), EXIT_CODES[error.kind]) from None

    command = click.option(
        "--tls-ca",
        type=click.Path(exists=True, dir_okay=False),
        help="PEM CA certificate when the daemon uses TLS",
    )(command)
    command = click.option("--token", help="shared token [env AUTOBYTE_TOKEN]")(command)
    return click.option(
        "--daemon",
        help="HOST:PORT of autobyted, or several separated by commas (asked in "
        "order until one answers) [env AUTOBYTE_DAEMON; default 127.0.0.1:7077]",
    )(command)


def _when(unix_s: float) -> str:
    return (
        datetime.datetime.fromtimestamp(unix_s, datetime.UTC).strftime("%H:%M:%S")
        if unix_s
        else "-"
    )


def decision_dict(r: DecisionRecord) -> dict:
    return {
        "decision_id": r.decision_id,
        "config": r.config.to_dict(),
        "apply_at_step": r.apply_at_step,
        "reason": r.reason,
        "state": r.state,
        "created_at_s": r.created_at_s,
        "predicted_step_time_s": r.predicted_step_time_s,
        "measured_step_time_s": r.measured_step_time_s,
        "applied_at_step": r.applied_at_step,
        "source": r.source,
    }


def tuner_dict(r: TunerStatusRecord) -> dict:
    return {
        "mode": r.mode,
        "state": r.state,
        "detail": r.detail,
        "config": r.config.to_dict(),
        "baseline_step_time_s": r.baseline_step_time_s or None,
        "measured_step_time_s": r.measured_step_time_s or None,
        "predicted_step_time_s": r.predicted_step_time_s or None,
        # autobyte.types.speedup: the best candidate's predicted speed-up over the held one
        "predicted_gain": (
            speedup(r.measured_step_time_s, r.predicted_step_time_s)
            if r.measured_step_time_s and r.predicted_step_time_s
            else None
        ),
        "trials_done": r.trials_done,
        "trials_planned": r.trials_planned,
        "paused": r.paused,
    }


def tuner_line(t: TunerStatusRecord) -> str:
    """The lines under a job in `autobyte status`: what the tuner does, wrapped at 80 columns (never
    cut: the configuration and the figures sit at the end of the text)."""
    return "\n".join(
        textwrap.wrap(
            f"tuner: {t.detail or t.state or 'unknown'}",
            WIDTH,
            initial_indent="  ",
            subsequent_indent="    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    )


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns; callers keep widths within 80 columns."""
    widths = (
        [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
        if rows
        else [len(h) for h in headers]
    )
    lines = [
        "  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip()
        for line in [headers, *rows]
    ]
    return "\n".join(lines)


class ByteSize(click.ParamType):
    """A size as the CLI spells it (4096, 256KiB, 4MiB, 4MB, none/unlimited; autobyte.types.BYTE_UNITS),
    checked against the safe range."""

    name = "SIZE"

    def __init__(self, what: str) -> None:
        self.what = what  # "partition", "credit" or "tail"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        none_word, meaning = {
            "partition": ("none", "no partitioning"),
            "credit": ("unlimited", "unlimited credit"),
            "tail": ("none", "no tail window"),
        }[self.what]
        try:
            size = parse_bytes(str(value))
        except ValueError as error:
            self.fail(f"{error}; use {none_word} for {meaning}", param, ctx)
        if size is None:
            return None
        low, high = {
            "partition": (MIN_PARTITION_BYTES, MAX_PARTITION_BYTES),
            "credit": (MIN_CREDIT_BYTES, MAX_CREDIT_BYTES),
            "tail": (MIN_TAIL_BYTES, MAX_TAIL_BYTES),
        }[self.what]
        if not low <= size <= high:
            self.fail(
                f"{value} is outside the safe range {format_bytes(low)} to {format_bytes(high)}; "
                f"use {none_word} for {meaning}",
                param,
                ctx,
            )
        return size


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit codes: 0 done, 1 the daemon answered with an error, 2 bad command line, "
    "3 cannot reach the daemon (or what answers is not autobyted).",
)
@click.version_option(__version__, prog_name="autobyte")
def main() -> None:
    """autobyte: what the daemon sees, what was decided, and why.

    JOB, wherever a command takes one, is a job's id or any prefix that starts no other job's id."""


@main.command("check-build")
@click.option(
    "--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True
)
@click.option(
    "--build",
    "build",
    is_flag=True,
    help="Compile the native hot path now against this torch, into the torch extensions "
    "cache (waits for a compile another process started), then report.",
)
def check_build(fmt, build) -> None:
    """Say how this installation was built: the scheduler's native hot path (built? active? why
    not? prebuilt in the installation or compiled into the cache?), torch and its distributed
    backends. Needs no daemon."""
    from autobyte.native_status import build_report

    if build:
        from autobyte.native_build import build_now

        ok, message = build_now()
        click.echo(f"native build: {message}", err=True)
        if not ok:
            raise SystemExit(1)
    report = build_report()
    if fmt == "json":
        click.echo(json.dumps(report, indent=1))
        return
    yes = {True: "yes", False: "no"}
    native, torch_info = report["native"], report["torch"]
    click.echo(f"autobyte {report['autobyte']} (Python {report['python']})")
    click.echo(
        f"torch:            {torch_info['version'] if torch_info['installed'] else 'not installed'}"
    )
    click.echo(
        f"native hot path:  built {yes[native['built']]}, active {yes[native['active']]}"
        + (f" (built for torch {native['built_for_torch']})" if native["built_for_torch"] else "")
    )
    if native["reason"]:
        click.echo(textwrap.fill(f"  why not: {native['reason']}", WIDTH, subsequent_indent="    "))
    origin = report["native_build"]
    where = {
        "prebuilt": "prebuilt in this installation",
        "compiled": f"compiled on first use into {origin['cache_dir']}",
    }
    click.echo(f"  source: {where.get(origin['source'], 'not built')}")
    if origin["source"] == "not built" and origin["compile_source"]:
        click.echo(
            textwrap.fill(
                "  to fix: "
                + (
                    origin["compiler_missing"]
                    or (
                        "`autobyte check-build --build` compiles it now (about a minute); the first "
                        "ScheduledOptimizer on this host also starts it in the background"
                        + (
                            f" (an earlier compile failed: {origin['failed'][:200]})"
                            if origin["failed"]
                            else ""
                        )
                    )
                ),
                WIDTH,
                subsequent_indent="    ",
            )
        )
    if torch_info["installed"]:
        click.echo(
            "backends:         "
            + ", ".join(f"[{'X' if on else ' '}] {name}" for name, on in report["backends"].items())
        )
    click.echo(
        textwrap.fill(
            "The native path runs CPU tensors on gloo with the socket decision channel; anything else runs "
            "the Python path (the scheduler logs which one, once)."
            if native["active"]
            else "The scheduler runs its Python path (same results, more CPU per partition).",
            WIDTH,
        )
    )


@main.command()
@daemon_command
@click.option(
    "--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True
)
def status(client, fmt) -> None:
    """Jobs, state, ranks, configuration in effect, throughput, last decision.

    STATE is running (heard from within 30 s), finished (every rank said it was done) or idle."""
    response = client.status()
    if fmt == "json":
        jobs = [
            {
                "job": j.job,
                "state": j.state,
                "world_size": j.world_size,
                "engine": j.engine,
                "steps": j.steps,
                "config": j.config.to_dict(),
                "ranks": list(j.ranks),
                "backend": j.backend,
                "recent_step_time_s": j.recent_step_time_s,
                "recent_steps_per_s": steps_per_s(j),
                "dropped_samples": j.dropped_total,
                "last_decision": decision_dict(j.last_decision) if j.last_decision else None,
                "last_seen_s": j.last_seen_s,
                "tuner": tuner_dict(j.tuner),
            }
            for j in response.jobs
        ]
        click.echo(json.dumps({"jobs": jobs, "daemon_version": response.daemon_version}, indent=2))
        return
    if not response.jobs:
        click.echo("no jobs yet")
        return
    click.echo(status_table(response.jobs))


def steps_per_s(job: JobRecord) -> float:
    """The job's recent throughput, as autobyted derives it (autobyte.convert.job_status_to_proto)."""
    return 1.0 / job.recent_step_time_s if job.recent_step_time_s else 0.0


def status_table(jobs: Sequence[JobRecord]) -> str:
    """One row per job and its tuner line below, within 80 columns: an id too long for the JOB column
    stands whole on a line of its own above its row (an id is never cut: every command takes it back,
    or any unique prefix of it)."""
    # Fixed least widths keep the columns where they were from one `status` to the next (a watch
    # loop, the quick start) when a wider value (16MiB/256MiB, a 6-digit step) comes along.
    headers = [
        "JOB",
        "STATE".ljust(8),
        "RANKS",
        "STEPS".ljust(6),
        "PART/CREDIT".ljust(13),
        "STEP/S",
        "DECISION",
    ]
    rows = [
        [
            j.job,
            j.state,
            f"{len(j.ranks)}/{j.world_size}",
            str(j.steps),
            j.config.short(j.engine),
            f"{steps_per_s(j):.2f}",
            f"#{j.last_decision.decision_id} {j.last_decision.state}" if j.last_decision else "-",
        ]
        for j in jobs
    ]
    rest = sum(max(len(x) for x in col) + 2 for col in list(zip(headers, *rows))[1:])
    job_width = max(len("JOB"), min(max(len(j.job) for j in jobs), WIDTH - rest))
    own_line = [len(row[0]) > job_width for row in rows]
    # The JOB column keeps its width even where every id stands on its own line.
    lines = table(
        [headers[0].ljust(job_width), *headers[1:]],
        [["" if long else row[0], *row[1:]] for row, long in zip(rows, own_line)],
    ).split("\n")
    out = [lines[0]]
    for line, j, long in zip(lines[1:], jobs, own_line):
        if long:
            out.append(j.job)
        out.append(line)
        out.append(tuner_line(j.tuner))
    return "\n".join(out)


# A step's fields that `history --steps` lists (the step, its rank, then those StepMetrics marks
# history=True, autobyte/types.py), then its configuration.
HISTORY_STEP_FIELDS = (
    "step",
    "rank",
    *(
        f.name
        for f in dataclasses.fields(StepMetrics)
        if f.metadata.get("history") and f.name != "step"
    ),
)
HISTORY_CSV_COLUMNS = [
    "kind",
    *HISTORY_STEP_FIELDS,
    "partition_bytes",
    "credit_bytes",
    "decision_id",
    "state",
    "reason",
    "applied_at_step",
    "source",
    "predicted_step_time_s",
    "measured_step_time_s",
    "tail_bytes",
    *FSDP_FIELDS,
]


@main.command()
@click.argument("job")
@daemon_command
@click.option("--since", type=float, default=0.0, help="only records after this unix time (s)")
@click.option(
    "--steps",
    "with_steps",
    is_flag=True,
    help="also list the step records (after the decisions); --rank and --limit choose them",
)
@click.option(
    "--rank", type=click.IntRange(0), default=None, help="with --steps: only this rank's steps"
)
@click.option(
    "--limit",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="with --steps: the latest N step records",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json", "csv"]),
    default="table",
    show_default=True,
)
def history(client, job, since, with_steps, rank, limit, fmt) -> None:
    """Decisions of JOB (who, why, predicted and measured step time), then with --steps its steps.

    A decision ASKED for a step (next: as soon as possible); APPLIED is the step at which every rank
    switched (the next step boundary when the asked step had already passed)."""
    job = client.resolve(job)
    response = client.history(job, since_s=since, steps=with_steps, rank=rank, limit=limit)
    steps = [
        {**{name: getattr(s, name) for name in HISTORY_STEP_FIELDS}, "config": s.config.to_dict()}
        for s in response.steps
    ]
    decisions = [decision_dict(d) for d in response.decisions]
    if fmt == "json":
        out = {"job": job, "decisions": decisions}
        if with_steps:
            out["steps"] = steps
        click.echo(json.dumps(out, indent=2))
    elif fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, HISTORY_CSV_COLUMNS, restval="", lineterminator="\n")
        writer.writeheader()
        for d in decisions:
            # `step` is the step the decision asked for; `applied_at_step` the one it took effect at.
            writer.writerow(
                {
                    "kind": "decision",
                    "step": d["apply_at_step"],
                    "wall_time_s": d["created_at_s"],
                    **d["config"],
                    **{
                        k: "" if d[k] is None else d[k]
                        for k in (
                            "decision_id",
                            "state",
                            "reason",
                            "applied_at_step",
                            "source",
                            "predicted_step_time_s",
                            "measured_step_time_s",
                        )
                    },
                }
            )
        for s in steps:
            writer.writerow(
                {"kind": "step", **{name: s[name] for name in HISTORY_STEP_FIELDS}, **s["config"]}
            )
        click.echo(out.getvalue(), nl=False)
    else:
        steps_hint = "" if with_steps else f"; its steps: `autobyte history {job} --steps`"
        click.echo(
            textwrap.fill(
                f"{job}: {len(decisions) or 'no'} decision(s)"
                f"{', oldest first' if decisions else ''}{steps_hint}",
                WIDTH,
                break_long_words=False,
                break_on_hyphens=False,
            )
        )
        if decisions:
            click.echo(decision_table(response.decisions))
        if with_steps:
            click.echo("")
            # how a step's Config() reads: an FSDP2 job's is its script's own settings
            engine = engine_of_history(response)
            if len({m.rank for m in response.steps}) > 1:
                click.echo(folded_steps(response.steps, engine))
                return
            rows = [
                [
                    str(s["step"]),
                    str(s["rank"]),
                    _when(s["wall_time_s"]),
                    f"{s['step_time_s'] * 1e3:.1f}",
                    f"{s['exposed_comm_s'] * 1e3:.1f}",
                    m.config.short(engine),
                ]
                for s, m in zip(steps, response.steps)
            ]
            click.echo(
                table(["STEP", "RANK", "TIME", "STEP_MS", "EXPOSED_MS", "PART/CREDIT"], rows)
                if rows
                else "no steps recorded"
            )


def engine_of_history(response) -> str:
    """The engine a job's History answer shows (a step's Config() reads by it: an FSDP2 job's is
    its script's own settings, not the scheduler's none/inf)."""
    return Config.engine_of(
        [*(m.config for m in response.steps), *(d.config for d in response.decisions)]
    )


def folded_steps(records: Sequence, engine: str = "scheduler") -> str:
    """One row per step of a job with several ranks: how many ranks reported it, the slowest
    rank's step time, the spread of the exposed communication, and the rank whose compute
    (forward + backward) was longest, by how much over the ranks' median: a rank whose compute
    lags makes every other rank wait in its all-reduces (their exposed time grows, its own does
    not). `--rank R` lists one rank's records."""
    by_step: dict[int, list] = {}
    for record in records:
        by_step.setdefault(record.step, []).append(record)
    rows = []
    for step in sorted(by_step):
        ranks = sorted(by_step[step], key=lambda r: r.rank)
        exposed = [r.exposed_comm_s * 1e3 for r in ranks]
        computes = [r.forward_s + r.backward_s for r in ranks]
        slowest = max(range(len(ranks)), key=lambda i: computes[i])
        median = statistics.median(computes)
        lag = (
            f"rank {ranks[slowest].rank} +{100 * (computes[slowest] / median - 1):.0f}%"
            if median > 0 and len(ranks) > 1
            else "-"
        )
        rows.append(
            [
                str(step),
                str(len(ranks)),
                _when(max(r.wall_time_s for r in ranks)),
                f"{max(r.step_time_s for r in ranks) * 1e3:.1f}",
                f"{min(exposed):.1f}-{max(exposed):.1f}",
                lag,
                ranks[0].config.short(engine),
            ]
        )
    return table(["STEP", "RANKS", "TIME", "STEP_MS", "EXPOSED_MS", "SLOWEST", "PART/CREDIT"], rows)


def _ms(value: float | None) -> str:
    return f"{value * 1e3:.1f} ms" if value else "-"


def decision_table(records: Sequence[DecisionRecord]) -> str:
    """One row per decision; below it who made it, predicted and measured step time, the whole reason."""
    lines = table(
        ["DECISION", "ASKED", "APPLIED", "PART/CREDIT", "STATE"],
        [
            [
                f"#{d.decision_id}",
                str(d.apply_at_step) if d.apply_at_step else "next",
                str(d.applied_at_step) if d.applied_at_step is not None else "-",
                d.config.short(),
                d.state,
            ]
            for d in records
        ],
    ).splitlines()
    out = [lines[0]]
    for line, d in zip(lines[1:], records):
        out.append(line)
        out.append(
            f"  by {d.source}; step time predicted {_ms(d.predicted_step_time_s)}, "
            f"measured {_ms(d.measured_step_time_s)}"
        )
        if d.reason:
            out.extend(
                textwrap.wrap(
                    d.reason,
                    WIDTH,
                    initial_indent="  reason: ",
                    subsequent_indent=" " * 10,
                    break_long_words=True,
                    break_on_hyphens=False,
                )
            )
    return "\n".join(out)


@main.command()
@click.argument("job")
@daemon_command
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="PNG to write [default: JOB.png]",
)
@click.option(
    "--since", type=float, default=0.0, help="only steps and decisions after this unix time (s)"
)
@click.option(
    "--limit",
    type=click.IntRange(1, 100_000),
    default=100_000,
    show_default=True,
    help="the latest N step records (of every rank)",
)
def plot(client, job, out_path, since, limit) -> None:
    """A picture of JOB (1200x600 PNG): step time over time (rolling median per rank), the
    configuration in effect as bands, each decision with its reason and predicted vs measured
    step time, and the bandwidth estimate and host load below. Needs the `plot` extra."""
    try:
        import matplotlib  # noqa: F401  (said before asking the daemon)

        from autobyte import plot as job_plot
    except ImportError:
        raise CommandError(
            "autobyte plot needs matplotlib: pip install 'autobyte[plot]'", EXIT_ERROR
        ) from None
    job = client.resolve(job)
    response = client.history(job, since_s=since, steps=True, limit=limit)
    engine = engine_of_history(response)
    steps = [
        job_plot.StepPoint(
            s.rank,
            s.step,
            s.wall_time_s,
            s.step_time_s,
            s.config.short(engine),
            s.bandwidth_bytes_per_s,
            s.host_load,
            s.decision_id,
            s.forward_s + s.backward_s,
        )
        for s in response.steps
    ]
    decisions = [
        job_plot.DecisionMark(
            d.decision_id,
            d.created_at_s,
            d.state,
            d.reason,
            d.source,
            d.config.short(engine),
            d.predicted_step_time_s,
            d.measured_step_time_s,
        )
        for d in response.decisions
    ]
    path = out_path or f"{job}.png"
    try:
        job_plot.draw_job(job, steps, decisions, path)
    except ValueError as error:
        raise CommandError(str(error), EXIT_ERROR) from None
    except OSError as error:
        raise CommandError(f"cannot write {path}: {error.strerror or error}", EXIT_ERROR) from None
    click.echo(
        f"{path}: {len(steps)} steps, {len(decisions)} decision(s) of {job} "
        f"({job_plot.WIDTH_PX}x{job_plot.HEIGHT_PX})"
    )


@main.command()
@click.argument("job")
@daemon_command
@click.option(
    "--pause/--resume",
    "paused",
    required=True,
    help="pause the tuner for JOB (it keeps the configuration in effect), or hand JOB back to it",
)
def tune(client, job, paused) -> None:
    """Pause or resume the tuner for JOB (an operator's `propose` pauses it too)."""
    job = client.resolve(job)
    t = client.set_tuning(job, paused)
    if paused:
        click.echo(
            f"{job}: tuner paused; it keeps {t.config.short() if t else 'the configuration in effect'} "
            f"until `autobyte tune {job} --resume`"
        )
    else:
        # The tuner acts on a resume at its next look at the job: what it did before (the pause's
        # reason) is not news, what it will do is.
        click.echo(
            f"{job}: tuner resumed; it measures the configuration in effect, then searches from it "
            "(`autobyte status` shows its progress)"
        )


@main.command()
@click.argument("job")
@daemon_command
@click.option(
    "--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True
)
def best(client, job, fmt) -> None:
    """The best configuration measured on JOB in its latest context (conditions: run, bandwidth,
    host load), every configuration measured in that same context, the steps of each, and each
    one's speed-up: x faster than the no-scheduling baseline (or, when that did not run there, the
    configuration the context began with)."""
    job = client.resolve(job)
    r = b = client.best(job)
    if fmt == "json":
        click.echo(
            json.dumps(
                {
                    "job": b.job,
                    "found": b.found,
                    "config": b.config.to_dict() if b.found else None,
                    "median_step_time_s": b.median_step_time_s,
                    "samples": b.samples,
                    "baseline_step_time_s": b.baseline_step_time_s or None,
                    "evidence": b.evidence,
                    "context": b.context,
                    "contexts": b.contexts,
                    "reference": b.reference.to_dict() if b.found else None,
                    "reference_step_time_s": b.reference_step_time_s or None,
                    "candidates": [
                        {
                            "config": c.config.to_dict(),
                            "samples": c.samples,
                            "median_step_time_s": c.median_step_time_s,
                            "speedup": c.speedup or None,
                        }
                        for c in b.candidates
                    ],
                },
                indent=2,
            )
        )
        return
    if not r.found:
        click.echo(f"{job}: no best configuration yet ({r.evidence})")
        return
    engine = Config.engine_of([r.config, r.reference, *(c.config for c in r.candidates)])
    reference = r.reference.short(engine)
    click.echo(f"{job}: {r.config.describe(engine)}")
    click.echo(
        textwrap.fill(f"in {r.context}", WIDTH, initial_indent="  ", subsequent_indent="    ")
    )
    if r.config == r.reference:
        gain = "the context's reference"
    elif not r.reference_step_time_s:  # the context began with steps of the warm-up only
        gain = f"{reference} not measured past the warm-up in this context"
    else:
        gain = describe_speedup(speedup(r.reference_step_time_s, r.median_step_time_s), reference)
    click.echo(
        f"  median step time {r.median_step_time_s * 1e3:.1f} ms over {r.samples} steps, {gain}"
    )
    # Config(): the scheduler's no-scheduling baseline; an FSDP2 job as its script set it
    baseline = "the job as its script set it" if engine == "fsdp2" else "no-scheduling baseline"
    as_short = Config().short(engine)
    if r.baseline_step_time_s:
        click.echo(
            f"  {baseline} ({as_short}) {r.baseline_step_time_s * 1e3:.1f} ms in this context"
        )
    else:
        click.echo(f"  {baseline}: not measured in this context ({as_short})")
    click.echo(
        f"  compared in this context ({len(r.candidates)}); SPEED-UP = x faster than {reference}:"
    )
    rows = [
        [
            c.config.short(engine),
            f"{c.median_step_time_s * 1e3:.1f}",
            str(c.samples),
            f"{c.speedup:.2f}x",
        ]
        for c in r.candidates
    ]
    click.echo(
        textwrap.indent(table(["PART/CREDIT", "MEDIAN_MS", "STEPS", "SPEED-UP"], rows), "    ")
    )
    click.echo(
        textwrap.fill(
            f"evidence: {r.evidence}", WIDTH, initial_indent="  ", subsequent_indent="    "
        )
    )


@main.command()
@click.argument("job")
@daemon_command
@click.option(
    "--partition",
    "partition",
    type=ByteSize("partition"),
    default=None,
    help=f"partition size, e.g. 4MiB, or none ({BYTE_UNITS_HELP}); a scheduler job's proposal "
    "names it and --credit",
)
@click.option(
    "--credit",
    "credit",
    type=ByteSize("credit"),
    default=None,
    help="credit window, e.g. 16MiB, or unlimited (units as for --partition)",
)
@click.option(
    "--tail",
    "tail",
    type=ByteSize("tail"),
    default=None,
    help="tail window, e.g. 8MiB: in the last that many bytes of each backward pass one collective "
    "at a time (default none)",
)
@click.option(
    "--forward-prefetch",
    type=click.IntRange(0, MAX_PREFETCH),
    default=None,
    help="an FSDP2 job (autobyte.fsdp): how many groups each group's all-gather issues ahead in "
    "forward (0: FSDP2's implicit prefetch; default: as the job set it)",
)
@click.option(
    "--backward-prefetch",
    type=click.IntRange(1, MAX_PREFETCH),
    default=None,
    help="an FSDP2 job: how many groups each prefetches in backward (1: FSDP2's default)",
)
@click.option(
    "--reshard/--keep-gathered",
    "reshard",
    default=None,
    help="an FSDP2 job: the groups below the root free their gathered parameters after forward "
    "(another all-gather in backward) or keep them (memory)",
)
@click.option(
    "--at-step",
    type=click.IntRange(0),
    default=0,
    help="step at which every rank switches (0: the next step; a step already passed: the next too)",
)
@click.option("--reason", default="operator request", show_default=True)
def propose(
    client,
    job,
    partition,
    credit,
    tail,
    forward_prefetch,
    backward_prefetch,
    reshard,
    at_step,
    reason,
) -> None:
    """Ask JOB to switch to a configuration (stored as a decision): a scheduler job's --partition
    and --credit (and --tail), or an FSDP2 job's --forward-prefetch, --backward-prefetch and
    --reshard/--keep-gathered."""
    ctx = click.get_current_context()
    given = {
        name
        for name in ("partition", "credit", "tail")
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    }
    fsdp = (forward_prefetch, backward_prefetch, reshard) != (None, None, None)
    if fsdp and given:
        raise CommandError(
            "a proposal sets one engine's knobs: --partition/--credit/--tail (a scheduler job) or "
            "--forward-prefetch/--backward-prefetch/--reshard (an FSDP2 job), not both",
            EXIT_USAGE,
        )
    if not fsdp and not {"partition", "credit"} <= given:
        raise CommandError(
            "give --partition and --credit (a scheduler job, e.g. --partition 4MiB --credit "
            "16MiB), or FSDP2's --forward-prefetch/--backward-prefetch/--reshard",
            EXIT_USAGE,
        )
    config = Config(
        partition,
        credit,
        tail,
        forward_prefetch=forward_prefetch,
        backward_prefetch=backward_prefetch,
        reshard_after_forward=reshard,
    )
    job = client.resolve(job)
    d = client.propose(job, config, at_step=at_step, reason=reason)
    click.echo(
        f"decision #{d.decision_id}: {config.describe()} for {job} ({d.state}); the tuner is paused "
        f"for {job} until `autobyte tune {job} --resume`"
    )


if __name__ == "__main__":
    main()
