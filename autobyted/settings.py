"""Daemon settings: flags > environment (AUTOBYTED_*, AUTOBYTE_TOKEN) > TOML file > defaults."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import tomllib
from typing import Any, Mapping

from autobyted.errors import ConfigError

DEFAULT_LISTEN = "127.0.0.1:7077"


@dataclasses.dataclass(frozen=True)
class Settings:
    listen: str = DEFAULT_LISTEN
    db: str = "sqlite:///autobyte.db"
    token: str | None = None
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
    # auto: tune every job; observe: record recommendations, push nothing; off: no tuner.
    tuner: str = "auto"
    # A job without new steps for this long is left by the tuner (state "idle").
    tuner_idle_s: float = 30.0
    # The predictor is retrained at most this often, when new windows were measured.
    tuner_retrain_s: float = 60.0

    def __post_init__(self) -> None:
        host, port = split_host_port(self.listen, "listen")
        if self.metrics_listen:
            split_host_port(self.metrics_listen, "metrics-listen")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(f"log level {self.log_level!r} is not one of DEBUG, INFO, WARNING, ERROR")
        if self.log_format not in ("json", "text"):
            raise ConfigError(f"log format {self.log_format!r} must be json or text")
        if self.db.startswith("sqlite") and (self.db.rstrip("/") in ("sqlite:", "sqlite:/", "sqlite://")
                                             or ":memory:" in self.db):
            raise ConfigError("an in-memory SQLite database is not supported (each thread would see its "
                              "own empty database): use a file, e.g. sqlite:///autobyte.db")
        if self.tuner not in ("auto", "observe", "off"):
            raise ConfigError(f"tuner mode {self.tuner!r} must be auto, observe or off")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        if not is_loopback(host) and not self.token:
            raise ConfigError(f"refusing to listen on {self.listen} beyond loopback without a token: "
                              "set --token or AUTOBYTE_TOKEN")
        for name in ("retention_raw_samples", "downsample_every", "max_message_bytes",
                     "max_samples_per_batch", "writer_batch_rows", "tuner_idle_s", "tuner_retrain_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")


def split_host_port(address: str, what: str) -> tuple[str, int]:
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ConfigError(f"{what} address {address!r} must look like HOST:PORT, e.g. 127.0.0.1:7077")
    return host.strip("[]"), int(port_text)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_ENV = {"listen": "AUTOBYTED_LISTEN", "db": "AUTOBYTED_DB", "token": "AUTOBYTE_TOKEN",
        "metrics_listen": "AUTOBYTED_METRICS_LISTEN", "log_level": "AUTOBYTED_LOG_LEVEL",
        "tuner": "AUTOBYTED_TUNER"}


def load_settings(flags: Mapping[str, Any], config_file: str | None = None,
                  environ: Mapping[str, str] | None = None) -> Settings:
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
                raise ConfigError(f"unknown setting {key!r} in {config_file}; known: "
                                  + ", ".join(sorted(fields)))
            merged[name] = value
    for name, variable in _ENV.items():
        if environ.get(variable):
            merged[name] = environ[variable]
    merged.update({name: value for name, value in flags.items() if value is not None})
    for name, value in merged.items():
        expected = fields[name].type
        if "int" in str(expected) and not isinstance(value, int):
            try:
                merged[name] = int(value)
            except (TypeError, ValueError):
                raise ConfigError(f"setting {name} must be an integer, got {value!r}") from None
        elif "float" in str(expected) and not isinstance(value, float):
            try:
                merged[name] = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"setting {name} must be a number, got {value!r}") from None
    return Settings(**merged)
