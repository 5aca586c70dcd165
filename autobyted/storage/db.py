"""Engine, SQLite pragmas, the one session scope, and schema migration on start."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import pathlib
from collections.abc import Iterator

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from autobyted.errors import AlreadyExists, ForeignDatabase, StorageError
from autobyted.settings import redact, redact_url, secrets_of

log = logging.getLogger(__name__)
# Wherever the package is installed from (a wheel, an editable checkout), the import system finds it.
MIGRATIONS_DIR = pathlib.Path(importlib.import_module("autobyted.migrations").__file__).parent


def make_engine(url: str, sqlite_synchronous: str = "normal") -> Engine:
    """An engine; for SQLite the pragmas are applied on every new connection.

    sqlite_synchronous: "normal" (WAL's usual setting: a committed transaction survives a crash of
    the daemon; the last ones may be lost when the machine loses power) or "full" (they survive
    that too, at the cost of an fsync per transaction)."""
    if sqlite_synchronous not in ("normal", "full"):
        raise ValueError(f"sqlite_synchronous={sqlite_synchronous!r} must be 'normal' or 'full'")
    try:
        engine = sa.create_engine(url, future=True)
    except (SQLAlchemyError, ValueError, ImportError) as error:
        hint = ""
        if isinstance(error, ImportError) and url.startswith("postgresql"):
            hint = "; install the PostgreSQL driver: pip install 'autobyte[postgres]'"
        # Neither the URL nor SQLAlchemy's message (which may quote it) may show a password.
        raise StorageError(
            redact(
                f"cannot use database URL {redact_url(url)!r}: {error}{hint}", secrets_of(url, None)
            )
        ) from None
    if engine.dialect.name == "sqlite":
        event.listen(
            engine, "connect", functools.partial(_sqlite_pragmas, sqlite_synchronous.upper())
        )
    return engine


def _sqlite_pragmas(synchronous: str, dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA synchronous={synchronous}")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


class SessionScope:
    """`with scope() as session:` commits on success, rolls back on error, always closes, and
    turns SQLAlchemy errors into the daemon's errors."""

    def __init__(self, engine: Engine) -> None:
        self._factory = sessionmaker(engine, expire_on_commit=False)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[Session]:
        session = self._factory()
        try:
            yield session
            session.commit()
        except IntegrityError as error:
            session.rollback()
            raise AlreadyExists(f"conflicting record: {error.orig}") from None
        except DBAPIError as error:
            session.rollback()
            raise StorageError(f"database error: {error.orig}") from None
        except SQLAlchemyError as error:
            session.rollback()
            raise StorageError(f"database error: {error}") from None
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()


def _alembic_config(connection=None):
    from alembic.config import Config as AlembicConfig

    config = AlembicConfig()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config()).get_current_head()


def migrate(engine: Engine) -> str:
    """Create or upgrade the schema to head; refuse a database autobyted did not create.
    Returns the revision now in effect."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    try:
        return _migrate(engine, command, MigrationContext, ScriptDirectory)
    except SQLAlchemyError as error:
        url = engine.url.render_as_string(hide_password=True)
        raise StorageError(
            f"cannot open or migrate database {url}: {getattr(error, 'orig', None) or error}"
        ) from None


# PostgreSQL advisory lock key held while one daemon checks and migrates the schema ("autobyte").
MIGRATION_LOCK_KEY = 0x6175746F62797465


def _migrate(engine: Engine, command, MigrationContext, ScriptDirectory) -> str:
    known = {
        rev.revision for rev in ScriptDirectory.from_config(_alembic_config()).walk_revisions()
    }
    url = engine.url.render_as_string(hide_password=True)
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            # Daemons started at once on one database: one migrates, the others wait and find it done.
            connection.execute(
                sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
            )
        tables = set(sa.inspect(connection).get_table_names())
        current = MigrationContext.configure(connection).get_current_revision()
        if current is None and tables - {"alembic_version"}:
            raise ForeignDatabase(
                f"database {url} already holds tables ({', '.join(sorted(tables)[:5])}) that autobyted did "
                "not create; point --db at a new file or an autobyted database"
            )
        if current is not None and current not in known:
            raise ForeignDatabase(
                f"database {url} is at schema revision {current!r}, which this autobyted does not know "
                "(written by a newer autobyted?); upgrade autobyted or use another database"
            )
        command.upgrade(_alembic_config(connection), "head")
    revision = head_revision()
    if current != revision:
        log.info(
            "database schema migrated", extra={"from_revision": current, "to_revision": revision}
        )
    return revision


def _revision_cli() -> None:  # pragma: no cover - developer tool
    """python -m autobyted.storage.db revision "message": autogenerate a revision against the models."""
    import sys
    import tempfile

    from alembic import command

    from autobyted.storage.models import Base

    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(f"sqlite:///{tmp}/rev.db")
        with engine.begin() as connection:
            command.upgrade(_alembic_config(connection), "head")
            config = _alembic_config(connection)
            config.attributes["target_metadata"] = Base.metadata
            command.revision(config, message=sys.argv[2], autogenerate=True)


if __name__ == "__main__":  # pragma: no cover
    _revision_cli()
