"""The databases a storage test runs on: a SQLite file, or a fresh database on PostgreSQL.

A fixture parametrized with `params=DATABASES` gets its URL from `database_url(request, tmp_path)`;
the PostgreSQL case carries the `postgres` marker (tests/conftest.py adds `slow` to it).
"""

from __future__ import annotations

import pytest

DATABASES = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


def database_url(request, tmp_path) -> str:
    """For a fixture parametrized over DATABASES: a SQLite file or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'autobyte.db'}"
    return request.getfixturevalue("pg_url")
