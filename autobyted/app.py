"""`autobyted` entry point: wires storage, writer, services and server; runs until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import sys

import click

from autobyte import __version__
from autobyted.errors import AutobytedError, ConfigError, ForeignDatabase
from autobyted.settings import DEFAULT_LISTEN, Settings, load_settings

log = logging.getLogger("autobyted")

# Named exit codes.
EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_DATABASE = 3
EXIT_BIND = 4


class Daemon:
    """Constructed from settings; `run()` starts everything and returns after a clean shutdown."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.port: int | None = None
        self.tuner = None  # the TunerManager while running (None with --tuner off)
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, ready=None, install_signals: bool = True) -> None:
        from autobyted.ingest import IngestWriter
        from autobyted.observability import DaemonMetrics
        from autobyted.server import make_server
        from autobyted.servicer import RUNNING_WITHIN_S, Services, retention_loop
        from autobyted.storage.db import make_engine, migrate
        from autobyted.storage.sql import SqlStorage

        settings = self.settings
        engine = make_engine(settings.db)
        revision = migrate(engine)
        storage = SqlStorage(engine)
        metrics = DaemonMetrics(job_states=lambda: collections.Counter(
            job.state for job in storage.jobs(RUNNING_WITHIN_S)))
        loop = self._loop = asyncio.get_running_loop()
        tuner = None

        def wake_tuner(jobs) -> None:  # the ingest writer and the services wake the tuner's worker
            if tuner is not None:
                tuner.notify(jobs)

        writer = IngestWriter(storage, settings.writer_batch_rows, on_written=metrics.samples_ingested.inc,
                              on_jobs=wake_tuner)
        services = Services(storage, writer, settings, metrics, wake_tuner=wake_tuner)
        services.loop = loop
        tuner = self.tuner = make_tuner(settings, storage, services.decide_from_thread)
        server, port = make_server(services, settings)
        self.port = port
        self._stop = asyncio.Event()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop.set)
        metrics_server = None
        if settings.metrics_listen:
            from prometheus_client import start_http_server

            host, _, metrics_port = settings.metrics_listen.rpartition(":")
            metrics_server, _ = start_http_server(int(metrics_port), addr=host.strip("[]"),
                                                  registry=metrics.registry)
        writer.start()
        if tuner is not None:
            tuner.start()
        await server.start()
        retention = asyncio.create_task(retention_loop(storage, settings))
        log.info("autobyted listening", extra={"listen": settings.listen, "port": port, "db": _safe_url(settings.db),
                                               "schema_revision": revision, "version": __version__,
                                               "token": bool(settings.token), "tls": bool(settings.tls_cert),
                                               "tuner": settings.tuner})
        if ready is not None:
            ready(port)
        try:
            await self._stop.wait()
        finally:
            log.info("autobyted stopping: draining streams and flushing samples")
            retention.cancel()
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


def make_tuner(settings: Settings, storage, decide):
    """The tuner manager for --tuner auto|observe (None for off); started by Daemon.run."""
    if settings.tuner == "off":
        return None
    from autobyted.tuner.manager import TunerManager

    return TunerManager(storage, decide=decide, mode=settings.tuner, idle_after_s=settings.tuner_idle_s,
                        retrain_interval_s=settings.tuner_retrain_s)


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparsable url>"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autobyted")
def main() -> None:
    """autobyted: stores training telemetry, predicts good scheduler configurations, pushes them."""


@main.command()
@click.option("--listen", help=f"HOST:PORT for gRPC [env AUTOBYTED_LISTEN; default {DEFAULT_LISTEN}]")
@click.option("--db", help="SQLAlchemy URL [env AUTOBYTED_DB; default sqlite:///autobyte.db]")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML settings file")
@click.option("--token", help="shared token every RPC must carry [env AUTOBYTE_TOKEN]")
@click.option("--metrics-listen", help="HOST:PORT for the Prometheus endpoint (off by default)")
@click.option("--log-level", help="DEBUG, INFO, WARNING or ERROR [default INFO]")
@click.option("--log-format", type=click.Choice(["json", "text"]), help="log line format [default json]")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), help="PEM certificate for TLS")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="PEM private key for TLS")
@click.option("--tuner", type=click.Choice(["auto", "observe", "off"]),
              help="auto: tune jobs; observe: record recommendations only; off [env AUTOBYTED_TUNER; default auto]")
def start(config_file, **flags) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT."""
    try:
        settings = load_settings(flags, config_file)
    except ConfigError as error:
        click.echo(f"autobyted: {error}", err=True)
        sys.exit(EXIT_CONFIG)
    from autobyted.observability import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    try:
        asyncio.run(Daemon(settings).run())
    except ForeignDatabase as error:
        click.echo(f"autobyted: {error}", err=True)
        sys.exit(EXIT_DATABASE)
    except AutobytedError as error:
        click.echo(f"autobyted: {error}", err=True)
        sys.exit(EXIT_DATABASE)
    except OSError as error:
        click.echo(f"autobyted: {error}", err=True)
        sys.exit(EXIT_BIND)
    sys.exit(EXIT_OK)


if __name__ == "__main__":
    main()
