"""`autobyted` entry point: wires storage, writer, services and server; runs until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import logging
import os
import signal
import socket
import sys
import uuid

import click
from autobyte import __version__

from autobyted.errors import AutobytedError, ConfigError, DatabaseInUse, ForeignDatabase
from autobyted.settings import (
    DEFAULT_DB,
    DEFAULT_LISTEN,
    DEFAULT_MAX_CONCURRENT_RPCS,
    Settings,
    load_settings,
    raw_secrets,
    redact,
    redact_url,
)

log = logging.getLogger("autobyted")

# Named exit codes (docs/reference.md, "Exit codes").
EXIT_OK = 0
EXIT_CONFIG = 2  # bad settings or command line (click's usage errors exit 2 as well)
EXIT_DATABASE = 3  # database refused (foreign, newer) or unusable
EXIT_BIND = 4  # cannot listen on the gRPC or Prometheus address
EXIT_DATABASE_IN_USE = 5  # another autobyted serves this SQLite database
EXIT_MISSING_EXTRA = 6  # installed without the [daemon] extra

# module -> distribution of what `autobyted start` imports beyond the base install
DAEMON_DEPENDENCIES = {
    "sqlalchemy": "sqlalchemy",
    "alembic": "alembic",
    "prometheus_client": "prometheus-client",
    "grpc_health": "grpcio-health-checking",
    "numpy": "numpy",
    "xgboost": "xgboost-cpu",
}


def missing_daemon_dependencies() -> list[str]:
    return [
        dist
        for module, dist in DAEMON_DEPENDENCIES.items()
        if importlib.util.find_spec(module) is None
    ]


class Daemon:
    """Constructed from settings; `run()` starts everything and returns after a clean shutdown."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.port: int | None = None
        self.daemon_id: str | None = None
        self.tuner = None  # the TunerManager while running (None with --tuner off)
        self.writer = None
        self.hub = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, ready=None, install_signals: bool = True) -> None:
        from autobyted.server import check_address
        from autobyted.storage.lock import DatabaseLock

        settings = self.settings
        # Everything that can fail without side effects fails first: nothing is created or
        # migrated for a daemon that cannot listen or whose database another daemon serves.
        check_address(settings.listen, "listen")
        if settings.metrics_listen:
            check_address(settings.metrics_listen, "metrics-listen")
        lock = DatabaseLock(settings.db, settings.listen)
        lock.acquire()
        try:
            await self._serve(ready, install_signals)
        finally:
            lock.release()

    async def _serve(self, ready, install_signals: bool) -> None:
        from grpc_health.v1 import health, health_pb2

        from autobyted.hub import decision_poll_loop, retention_loop
        from autobyted.ingest import IngestWriter
        from autobyted.observability import DaemonMetrics
        from autobyted.server import make_server
        from autobyted.servicer import RUNNING_WITHIN_S, make_services
        from autobyted.storage.db import make_engine, migrate
        from autobyted.storage.sql import SqlStorage

        settings = self.settings
        engine = make_engine(settings.db, settings.sqlite_synchronous)
        loop = self._loop = asyncio.get_running_loop()
        tuner = None

        def wake_tuner(jobs) -> None:  # the ingest writer and the services wake the tuner's worker
            if tuner is not None:
                tuner.notify(jobs)

        try:
            revision = migrate(engine)
            storage = SqlStorage(engine)
            metrics = DaemonMetrics(
                job_states=lambda: collections.Counter(
                    job.state for job in storage.jobs(RUNNING_WITHIN_S)
                )
            )
            writer = IngestWriter(
                storage,
                settings.writer_batch_rows,
                on_written=metrics.samples_ingested.inc,
                max_queued_rows=settings.ingest_queue_rows,
                on_jobs=wake_tuner,
            )
            services = make_services(storage, writer, settings, metrics, wake_tuner=wake_tuner)
            services.decider.loop = loop
            health_servicer = health.aio.HealthServicer()
            server, port = make_server(services, health_servicer, settings)
            # Who this daemon is to the others on the database (the holder of its leases).
            self.daemon_id = f"{socket.gethostname()}:{os.getpid()}:{port}:{uuid.uuid4().hex[:6]}"
            tuner = self.tuner = make_tuner(
                settings, storage, services.decider.decide_from_thread, self.daemon_id
            )
        except BaseException:
            engine.dispose()
            raise
        self.port = port
        self.writer = writer  # the ingest queue, for introspection (queued rows)
        self.hub = services.hub  # the open control streams, for introspection (watched jobs)
        self._stop = asyncio.Event()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop.set)
        metrics_server = None
        if settings.metrics_listen:
            from prometheus_client import start_http_server

            host, _, metrics_port = settings.metrics_listen.rpartition(":")
            metrics_server, _ = start_http_server(
                int(metrics_port), addr=host.strip("[]"), registry=metrics.registry
            )
        writer.start()
        if tuner is not None:
            tuner.start()
        await server.start()
        for service in ("", *SERVICE_NAMES):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        retention = asyncio.create_task(retention_loop(storage, settings, self.daemon_id))
        decision_poll = asyncio.create_task(
            decision_poll_loop(storage, services.hub, settings.decision_poll_s)
        )
        if settings.insecure and settings.listens_beyond_loopback:
            log.warning(
                "INSECURE: listening on %s beyond loopback without TLS (--insecure): the token "
                "and all telemetry travel in clear text",
                settings.listen,
            )
        log.info(
            "autobyted listening",
            extra={
                "listen": settings.listen,
                "port": port,
                "db": redact_url(settings.db),
                "schema_revision": revision,
                "version": __version__,
                "token": bool(settings.token),
                "tls": bool(settings.tls_cert),
                "max_concurrent_rpcs": settings.max_concurrent_rpcs,
                "sqlite_synchronous": settings.sqlite_synchronous,
                "tuner": settings.tuner,
            },
        )
        if ready is not None:
            ready(port)
        try:
            await self._stop.wait()
        finally:
            log.info("autobyted stopping: draining streams and flushing samples")
            # Health watchers (load balancers) learn first; then running RPCs get 3 s to finish.
            await health_servicer.enter_graceful_shutdown()
            retention.cancel()
            decision_poll.cancel()
            if tuner is not None:
                await asyncio.to_thread(tuner.close)
            await server.stop(grace=3.0)
            await asyncio.to_thread(writer.close)
            if metrics_server is not None:
                metrics_server.shutdown()
            engine.dispose()
            log.info("autobyted stopped")

    def stop(self) -> None:
        """Thread-safe: ask a running daemon to shut down."""
        if self._stop is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)


def make_tuner(settings: Settings, storage, decide, holder: str):
    """The tuner manager for --tuner auto|observe (None for off); started by Daemon.run."""
    if settings.tuner == "off":
        return None
    from autobyted.tuner.manager import TunerManager

    return TunerManager(
        storage,
        decide=decide,
        mode=settings.tuner,
        idle_after_s=settings.tuner_idle_s,
        retrain_interval_s=settings.tuner_retrain_s,
        holder=holder,
        lease_s=settings.tuner_lease_s,
    )


# Full names of the autobyte services, as the health service reports them.
SERVICE_NAMES = ("autobyte.v1.Telemetry", "autobyte.v1.Control", "autobyte.v1.Query")


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit codes of start: 0 stopped cleanly, 2 bad settings or command line, 3 database "
    "refused or unusable, 4 cannot listen, 5 another autobyted serves this SQLite file, "
    "6 installed without the [daemon] extra.",
)
@click.version_option(__version__, prog_name="autobyted")
def main() -> None:
    """autobyted: stores the step telemetry of training jobs, answers the `autobyte` CLI, and tunes
    each running job's scheduler configuration itself: a learned predictor (xgboost) scores candidate
    (partition, credit) configurations, the promising ones are tried on the live job, the fastest is
    held and the search re-opens when conditions change (--tuner auto; observe records
    recommendations without pushing them; off). An operator's `autobyte propose` always wins and
    pauses the tuner for that job."""


@main.command()
@click.option(
    "--listen",
    help=f"HOST:PORT for gRPC [env AUTOBYTED_LISTEN; default {DEFAULT_LISTEN}]; "
    "beyond loopback it needs --token and TLS (or --insecure)",
)
@click.option(
    "--db",
    help=f"SQLAlchemy URL [env AUTOBYTED_DB; default {DEFAULT_DB}]; a SQLite file "
    "serves one daemon at a time",
)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML settings file")
@click.option(
    "--token",
    help="shared token every RPC must carry (the health service excepted) [env AUTOBYTE_TOKEN]",
)
@click.option(
    "--tls-cert", type=click.Path(exists=True, dir_okay=False), help="PEM certificate for TLS"
)
@click.option(
    "--tls-key", type=click.Path(exists=True, dir_okay=False), help="PEM private key for TLS"
)
@click.option(
    "--insecure",
    is_flag=True,
    default=None,
    help="allow listening beyond loopback without TLS (the token still required) "
    "[env AUTOBYTED_INSECURE]",
)
@click.option(
    "--metrics-listen",
    help="PORT (on 127.0.0.1) or HOST:PORT for the Prometheus endpoint "
    "[env AUTOBYTED_METRICS_LISTEN; off by default]",
)
@click.option(
    "--max-concurrent-rpcs",
    type=click.IntRange(1),
    help="RPCs served at once, streams "
    "included; more are refused with RESOURCE_EXHAUSTED [env AUTOBYTED_MAX_CONCURRENT_RPCS; "
    f"default {DEFAULT_MAX_CONCURRENT_RPCS}]",
)
@click.option(
    "--sqlite-synchronous",
    type=click.Choice(["normal", "full"]),
    help="normal: acknowledged samples survive a daemon crash, the latest may be lost on "
    "power loss; full: they survive power loss too, writes are slower "
    "[env AUTOBYTED_SQLITE_SYNCHRONOUS; default normal]",
)
@click.option("--log-level", help="DEBUG, INFO, WARNING or ERROR [default INFO]")
@click.option(
    "--log-format", type=click.Choice(["json", "text"]), help="log line format [default json]"
)
@click.option(
    "--tuner",
    type=click.Choice(["auto", "observe", "off"]),
    help="auto: tune jobs; observe: record recommendations only; off [env AUTOBYTED_TUNER; default auto]",
)
def start(config_file, **flags) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT."""
    missing = missing_daemon_dependencies()
    if missing:
        click.echo(
            f"autobyted: this installation lacks the daemon's dependencies ({', '.join(missing)}): "
            "install them with  pip install 'autobyte[daemon]'",
            err=True,
        )
        sys.exit(EXIT_MISSING_EXTRA)
    try:
        settings = load_settings(flags, config_file)
    except ConfigError as error:
        click.echo(f"autobyted: {redact(str(error), raw_secrets(flags))}", err=True)
        sys.exit(EXIT_CONFIG)
    from autobyted.observability import configure_logging

    configure_logging(settings.log_level, settings.log_format, settings.secrets)
    code = EXIT_OK
    try:
        asyncio.run(Daemon(settings).run())
    except ForeignDatabase as error:
        message, code = str(error), EXIT_DATABASE
    except DatabaseInUse as error:
        message, code = str(error), EXIT_DATABASE_IN_USE
    except AutobytedError as error:
        message, code = str(error), EXIT_DATABASE
    except OSError as error:
        message, code = str(error), EXIT_BIND
    if code != EXIT_OK:
        click.echo(f"autobyted: {redact(message, settings.secrets)}", err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
