"""Alembic environment: run programmatically by jetrl.store.db.upgrade (a connection is
passed in ``config.attributes``), or from the alembic CLI with ``sqlalchemy.url`` set."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from jetrl.store.schema import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode copies the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = sa.create_engine(config.get_main_option("sqlalchemy.url") or "", poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        _run(conn)
        conn.commit()


if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata, literal_binds=True
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
