"""Daemon settings: flags > environment (AUTOBYTED_*, AUTOBYTE_TOKEN) > TOML file > defaults."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

from autobyte.channel import split_host_port as parse_host_port

from autobyted.errors import ConfigError

DEFAULT_LISTEN = "127.0.0.1:7077"
DEFAULT_DB = "sqlite:///autobyte.db"
# Each rank holds one telemetry stream, rank 0 also a control stream: 2048 covers jobs of ~2000
# ranks in total; every further RPC is refused with RESOURCE_EXHAUSTED until one ends.
DEFAULT_MAX_CONCURRENT_RPCS = 2048


@dataclasses.dataclass(frozen=True)
class Settings:
    listen: str = DEFAULT_LISTEN
    db: str = DEFAULT_DB
    token: str | None = None
    # Beyond loopback the daemon needs TLS as well as a token; `insecure` waives TLS (not the token).
    insecure: bool = False
    # Prometheus endpoint, off by default; a bare PORT binds to 127.0.0.1.
    metrics_listen: str | None = None
    log_level: str = "INFO"
    log_format: str = "json"
    tls_cert: str | None = None
    tls_key: str | None = None
    # Raw samples kept per job before older ones are downsampled (every Nth step kept).
    retention_raw_samples: int = 200_000
    downsample_every: int = 10
    # A rank not heard from for this long may be taken over by a new registration.
    rank_liveness_s: float = 30.0
    max_message_bytes: int = 4 << 20
    max_samples_per_batch: int = 10_000
    writer_batch_rows: int = 20_000
    # Samples waiting for the writer; beyond this, batches are refused with a retry hint.
    ingest_queue_rows: int = 200_000
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS
    # SQLite only: "normal" (WAL default: an acknowledged sample survives a daemon crash, the last
    # transactions may be lost on power loss) or "full" (survives power loss; slower writes).
    sqlite_synchronous: str = "normal"
    # auto: tune every job; observe: record recommendations, push nothing; off: no tuner.
    tuner: str = "auto"
    # A job without new steps for this long is left by the tuner (state "idle").
    tuner_idle_s: float = 30.0
    # The predictor is retrained at most this often, when new windows were measured.
    tuner_retrain_s: float = 60.0
    # Daemons sharing a database: a job is tuned by the one daemon that holds its lease, renewed
    # every third of this; a daemon that dies is replaced by another within it.
    tuner_lease_s: float = 15.0
    # How often a daemon looks for decisions stored by another daemon on the same database (its own
    # reach its ranks at once): the bound on how late such a decision reaches a rank.
    decision_poll_s: float = 0.5

    def __post_init__(self) -> None:
        host, _port = split_host_port(self.listen, "listen")
        if self.metrics_listen:
            metrics = str(self.metrics_listen)
            if metrics.isdigit():  # a bare port: loopback only
                object.__setattr__(self, "metrics_listen", f"127.0.0.1:{metrics}")
            split_host_port(self.metrics_listen, "metrics-listen")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(
                f"log level {self.log_level!r} is not one of DEBUG, INFO, WARNING, ERROR"
            )
        if self.log_format not in ("json", "text"):
            raise ConfigError(f"log format {self.log_format!r} must be json or text")
        if self.sqlite_synchronous not in ("normal", "full"):
            raise ConfigError(
                f"sqlite-synchronous {self.sqlite_synchronous!r} must be normal or full"
            )
        if self.db.startswith("sqlite") and (
            self.db.rstrip("/") in ("sqlite:", "sqlite:/", "sqlite://") or ":memory:" in self.db
        ):
            raise ConfigError(
                "an in-memory SQLite database is not supported (each thread would see its "
                "own empty database): use a file, e.g. sqlite:///autobyte.db"
            )
        if self.tuner not in ("auto", "observe", "off"):
            raise ConfigError(f"tuner mode {self.tuner!r} must be auto, observe or off")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        if not is_loopback(host):
            if not self.token:
                raise ConfigError(
                    f"refusing to listen on {self.listen} beyond loopback without a token: "
                    "set --token or AUTOBYTE_TOKEN"
                )
            if not self.tls_cert and not self.insecure:
                raise ConfigError(
                    f"refusing to listen on {self.listen} beyond loopback without TLS: the "
                    "token would travel in clear text; set --tls-cert and --tls-key, or "
                    "--insecure if this network is private"
                )
        for name in (
            "retention_raw_samples",
            "downsample_every",
            "max_message_bytes",
            "max_samples_per_batch",
            "writer_batch_rows",
            "ingest_queue_rows",
            "max_concurrent_rpcs",
        ):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("tuner_idle_s", "tuner_retrain_s", "tuner_lease_s", "decision_poll_s"):
            if not float(getattr(self, name)) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")

    @property
    def listens_beyond_loopback(self) -> bool:
        return not is_loopback(split_host_port(self.listen, "listen")[0])

    @property
    def secrets(self) -> tuple[str, ...]:
        """Strings that must never appear in a message or a log line."""
        return secrets_of(self.db, self.token)


def split_host_port(address: str, what: str) -> tuple[str, int]:
    """(host, port) of a listen address; port 0 is any free port. ConfigError says what is wrong."""
    try:
        return parse_host_port(address, what, lowest_port=0)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# scheme://user:password@host -> the password
_URL_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://[^:/@]*:([^@/]*)@")


def redact_url(url: str) -> str:
    """The URL with its password replaced by ***, even when SQLAlchemy could not parse it."""
    match = _URL_PASSWORD.match(url)
    if not match or not match.group(1):
        return url
    return url[: match.start(1)] + "***" + url[match.end(1) :]


def secrets_of(db: str | None, token: str | None) -> tuple[str, ...]:
    found = []
    match = _URL_PASSWORD.match(db or "")
    if match and match.group(1):
        found.append(match.group(1))
    if token:
        found.append(token)
    return tuple(found)


def redact(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


_ENV = {
    "listen": "AUTOBYTED_LISTEN",
    "db": "AUTOBYTED_DB",
    "token": "AUTOBYTE_TOKEN",
    "metrics_listen": "AUTOBYTED_METRICS_LISTEN",
    "log_level": "AUTOBYTED_LOG_LEVEL",
    "insecure": "AUTOBYTED_INSECURE",
    "max_concurrent_rpcs": "AUTOBYTED_MAX_CONCURRENT_RPCS",
    "sqlite_synchronous": "AUTOBYTED_SQLITE_SYNCHRONOUS",
    "tuner": "AUTOBYTED_TUNER",
}


def raw_secrets(
    flags: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The secrets of settings that could not be loaded (to redact the error that says why)."""
    environ = os.environ if environ is None else environ
    return secrets_of(
        flags.get("db") or environ.get(_ENV["db"]), flags.get("token") or environ.get(_ENV["token"])
    )


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"setting {name} must be true or false, got {value!r}")


def load_settings(
    flags: Mapping[str, Any],
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Merge the four sources; flags whose value is None were not given."""
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    merged: dict[str, Any] = {}
    if config_file:
        try:
            with open(config_file, "rb") as handle:
                data = tomllib.load(handle)
        except OSError as error:
            raise ConfigError(f"cannot read config file {config_file}: {error.strerror}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {config_file} is not valid TOML: {error}") from None
        data = data.get("autobyted", data)
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ConfigError(
                    f"unknown setting {key!r} in {config_file}; known: " + ", ".join(sorted(fields))
                )
            merged[name] = value
    for name, variable in _ENV.items():
        if environ.get(variable):
            merged[name] = environ[variable]
    merged.update({name: value for name, value in flags.items() if value is not None})
    for name, value in merged.items():
        expected = str(fields[name].type)
        if expected == "bool":
            merged[name] = _parse_bool(name, value)
        elif "int" in expected and not isinstance(value, int):
            try:
                merged[name] = int(value)
            except (TypeError, ValueError):
                raise ConfigError(f"setting {name} must be an integer, got {value!r}") from None
        elif "float" in expected and not isinstance(value, float):
            try:
                merged[name] = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"setting {name} must be a number, got {value!r}") from None
    if "metrics_listen" in merged and merged["metrics_listen"] is not None:
        merged["metrics_listen"] = str(merged["metrics_listen"])
    return Settings(**merged)
