"""Alembic revisions produce exactly the models' schema, on SQLite and on PostgreSQL; every revision
upgrades and downgrades on both; foreign and newer databases are refused."""

import sqlite3

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from autobyted.errors import ForeignDatabase
from autobyted.storage.db import head_revision, make_engine, migrate
from autobyted.storage.models import Base
from tests.helpers.databases import DATABASES, database_url


@pytest.fixture(params=DATABASES)
def db_url(request, tmp_path) -> str:
    return database_url(request, tmp_path)


def test_empty_database_migrates_to_exactly_the_models(db_url):
    engine = make_engine(db_url)
    assert migrate(engine) == head_revision()
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert diff == []


def test_every_revision_downgrades_and_upgrades_again(db_url):
    from alembic import command
    from alembic.script import ScriptDirectory

    from autobyted.storage.db import _alembic_config

    engine = make_engine(db_url)
    revisions = [
        r.revision for r in ScriptDirectory.from_config(_alembic_config()).walk_revisions()
    ][::-1]
    with engine.begin() as connection:
        for revision in revisions:  # one at a time, as an older database would be brought along
            command.upgrade(_alembic_config(connection), revision)
        command.downgrade(_alembic_config(connection), "base")
        assert set(sa.inspect(connection).get_table_names()) <= {"alembic_version"}
    assert migrate(engine) == revisions[-1] == head_revision()
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    engine.dispose()


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


def test_upgrade_from_0001_keeps_rows_and_fills_new_columns(db_url):
    """A database written by the first release upgrades in place: old samples get host_load 0
    (unknown), old decisions are the operator's, old jobs are tuned."""
    from alembic import command

    from autobyted.storage.db import _alembic_config
    from autobyted.storage.sql import SqlStorage

    engine = make_engine(db_url)
    with engine.begin() as connection:
        command.upgrade(_alembic_config(connection), "0001")
        connection.execute(
            sa.text(
                "insert into jobs (id, name, world_size, backend, model_digest, parameter_count, parameter_bytes, "
                "tensor_count, largest_tensor_bytes, median_tensor_bytes, created_at, last_seen_at, max_step, "
                "dropped_total) values (1, 'old', 2, 'gloo', '', 1, 4, 1, 4, 4, 0, 0, 0, 0)"
            )
        )
        connection.execute(
            sa.text(
                "insert into step_metrics (job_id, rank, step, wall_time_s, step_time_s, forward_s, backward_s, "
                "exposed_comm_s, queueing_delay_s, bytes_reduced, partitions, bandwidth_bytes_per_s, decision_id) "
                "values (1, 0, 0, 1.0, 0.1, 0, 0, 0, 0, 4, 1, 0, 0)"
            )
        )
        connection.execute(
            sa.text(
                "insert into decisions (job_id, apply_at_step, reason, created_at, state) values (1, 5, 'x', 0, 'pending')"
            )
        )
    assert migrate(engine) == head_revision()
    store = SqlStorage(engine)
    (row,) = store.samples_after("old", 0)
    assert row.metrics.host_load == 0.0
    assert [d.source for d in store.decisions("old")] == ["operator"]
    assert store.job_info("old").tuning_disabled is False
