"""Alembic revisions produce exactly the models' schema; foreign and newer databases are refused."""

import sqlite3

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from autobyted.errors import ForeignDatabase
from autobyted.storage.db import head_revision, make_engine, migrate
from autobyted.storage.models import Base


def test_empty_database_migrates_to_exactly_the_models(db_url):
    engine = make_engine(db_url)
    assert migrate(engine) == head_revision()
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert diff == []


def test_migrate_is_idempotent(db_url):
    engine = make_engine(db_url)
    migrate(engine)
    assert migrate(engine) == head_revision()


def test_unknown_revision_is_refused(db_url, tmp_path):
    engine = make_engine(db_url)
    migrate(engine)
    with engine.begin() as connection:
        connection.execute(sa.text("update alembic_version set version_num = 'fromthefuture'"))
    with pytest.raises(ForeignDatabase, match="fromthefuture"):
        migrate(engine)


def test_foreign_tables_are_refused(tmp_path):
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("create table users (id integer)")
    with pytest.raises(ForeignDatabase, match="did not create"):
        migrate(make_engine(f"sqlite:///{path}"))
