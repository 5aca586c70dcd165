"""Alembic environment and revisions of the autobyted database (installed as autobyted.migrations)."""
