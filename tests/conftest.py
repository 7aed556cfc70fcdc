"""Shared fixtures: one real nats-server (JetStream, file storage) per test session, fresh run
ids, and database URLs (SQLite always; PostgreSQL when JETRL_TEST_POSTGRES_URL is set)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import StreamLimits

# Small reservations: many runs share the session's server.
TEST_LIMITS = StreamLimits(max_bytes=256 * 1024**2, payload_max_bytes=1024**3)
POSTGRES_ENV = "JETRL_TEST_POSTGRES_URL"


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    srv = EmbeddedServer(tmp_path_factory.mktemp("nats"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def run_id() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def bus(nats_server: EmbeddedServer, run_id: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_server.url, name="test")
    await b.ensure_run(run_id, TEST_LIMITS)
    yield b
    await b.close()


def postgres_url() -> str | None:
    return os.environ.get(POSTGRES_ENV) or None


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database: a SQLite file, or a new schema-free PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    base = postgres_url()
    if not base:
        pytest.skip(
            f"PostgreSQL tests need {POSTGRES_ENV} (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test)"
        )
    import sqlalchemy as sa

    name = f"jetrl_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.make_url(base).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
