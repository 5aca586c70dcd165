"""Prometheus metrics of the daemon and structured (JSON) logging for its entry point."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily

from autobyted.settings import redact


class DaemonMetrics:
    """The daemon's counters, on a registry of their own (one per daemon, so tests can run several)."""

    def __init__(self, job_states=None) -> None:
        """job_states: a callable returning {state: count}, read at every scrape."""
        self.registry = CollectorRegistry()
        if job_states is not None:
            self.registry.register(_JobsCollector(job_states))
        self.samples_ingested = Counter(
            "autobyted_samples_ingested", "Step samples stored", registry=self.registry
        )
        self.samples_rejected = Counter(
            "autobyted_samples_rejected", "Step samples rejected as invalid", registry=self.registry
        )
        self.streams = Gauge(
            "autobyted_streams_active",
            "Open telemetry and control streams",
            ["kind"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "autobyted_decisions", "Configuration decisions made", registry=self.registry
        )
        self.rpc_errors = Counter(
            "autobyted_rpc_errors",
            "RPCs answered with an error status",
            ["code"],
            registry=self.registry,
        )


class _JobsCollector:
    """autobyted_jobs{state}: counted from the database when Prometheus scrapes, so it is never stale."""

    def __init__(self, job_states) -> None:
        self._job_states = job_states

    def collect(self):
        family = GaugeMetricFamily("autobyted_jobs", "Jobs known to the daemon", labels=["state"])
        try:
            states = self._job_states()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the database is busy
            states = {}
        for state in ("running", "idle", "finished"):
            family.add_metric([state], states.get(state, 0))
        yield family


_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """A line a person reads: time, level, logger, message, then the `extra=` fields as key=value (the
    job, rank and configuration of a "rank registered" or a "decision" line)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = " ".join(
            f"{k}={v!r}" if isinstance(v, str) and (" " in v or not v) else f"{k}={v}"
            for k, v in vars(record).items()
            if k not in _STANDARD
        )
        if not fields:
            return line
        head, newline, rest = line.partition("\n")  # a traceback stays below the line
        return f"{head} {fields}{newline}{rest}"


class RedactingFormatter(logging.Formatter):
    """Wraps a formatter: every secret (token, database password) in a finished line becomes ***."""

    def __init__(self, inner: logging.Formatter, secrets: Iterable[str]) -> None:
        super().__init__()
        self._inner = inner
        self._secrets = tuple(s for s in secrets if s)

    def format(self, record: logging.LogRecord) -> str:
        return redact(self._inner.format(record), self._secrets)


def configure_logging(level: str, fmt: str, secrets: Iterable[str] = ()) -> None:
    """Only the entry point calls this; it configures the `autobyted` logger tree, nothing else."""
    handler = logging.StreamHandler()
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter()
    else:
        formatter = TextFormatter()
    handler.setFormatter(RedactingFormatter(formatter, secrets))
    root = logging.getLogger("autobyted")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
