"""Alembic environment: runs revisions on the connection autobyted hands over (or on the ini URL)."""

from alembic import context
from sqlalchemy import engine_from_config, pool

config = context.config
# Only autogenerate needs the models; revisions themselves never import them.
target_metadata = config.attributes.get("target_metadata")


def run_migrations(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run_migrations(connection)
else:
    engine = engine_from_config(
        config.get_section(config.config_ini_section, {}),
        prefix="sqlalchemy.",
        poolclass=pool.NullPool,
    )
    with engine.connect() as conn:
        run_migrations(conn)
