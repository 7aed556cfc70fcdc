"""Shared fixtures: one real nats-server (JetStream, file storage) per test session, fresh run
ids, and database URLs (SQLite always; PostgreSQL when JETRL_TEST_POSTGRES_URL is set)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import StreamLimits
from tests.support.checkpoints import warm_tiny_moe
from tests.support.processes import mark_own_processes
from tests.support.supervised import runs_end_with_the_test

# Small reservations: many runs share the session's server.
TEST_LIMITS = StreamLimits(max_bytes=256 * 1024**2, payload_max_bytes=1024**3)
POSTGRES_ENV = "JETRL_TEST_POSTGRES_URL"
# Modules that start vLLM servers: one worker runs them in turn, so that two servers never
# compete for the core vLLM's CPU build binds its threads to (the last one).
VLLM_MODULES = ("test_vllm_engine.py", "test_run_vllm.py", "test_run_smollm2.py")


# The slowest modules' seconds on a 2-core machine with 3 workers (--durations): they are handed
# out longest first, so that none of them starts when the rest of the suite is done (in the
# order collected, tests/system/ came last and ran alone at the end for minutes).
MODULE_SECONDS = {
    "test_run_vllm.py": 210,
    "test_fuzz_consumers.py": 180,
    "test_run_smollm2.py": 155,
    "test_parallel_engine.py": 150,
    "test_multihost.py": 105,
    "test_run_parallel.py": 75,
    "test_run_hf.py": 55,
    "test_mooncake.py": 50,
    "test_recorder_faults.py": 50,
    "test_cluster_faults.py": 45,
    "test_faults.py": 45,
    "test_run_e2e.py": 40,
    "test_vllm_engine.py": 35,
}


def pytest_configure(config: pytest.Config) -> None:
    mark_own_processes()  # what a test starts is told from what another pytest process starts


def _scope(module: str) -> str:
    """The unit the scheduler below hands to a worker: a module (its path or its file name),
    or all the vLLM modules."""
    return "vllm" if module.rsplit("/", 1)[-1] in VLLM_MODULES else module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with a slow test go first, the longest first: under pytest-xdist no long module
    then starts when the rest is done. A stable sort on a key shared by a scope's items keeps
    them together."""
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    seconds: dict[str, int] = {}
    for path in {item.path for item in items}:
        scope = _scope(path.name)
        seconds[scope] = seconds.get(scope, 0) + MODULE_SECONDS.get(path.name, 0)
    items.sort(key=lambda item: (item.path not in slow_modules, -seconds[_scope(item.path.name)]))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How `make test` spreads the suite over its pytest-xdist workers (one more than the
    cores): a module runs whole on one worker (its module fixtures are made once), the vLLM
    modules on the same one, in the order of pytest_collection_modifyitems above."""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]  # no py.typed

    class ByModule(LoadScopeScheduling):  # type: ignore[misc]  # xdist's classes are untyped here
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid.split("::", 1)[0])

    config.option.loadscopereorder = False
    return ByModule(config, log)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    srv = EmbeddedServer(tmp_path_factory.mktemp("nats"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _runs_end_with_their_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with runs_end_with_the_test(monkeypatch):
        yield


@pytest.fixture(scope="session")
def warm_moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny MoE checkpoint warm-started 150 steps, shared read-only by the tests that serve it."""
    return warm_tiny_moe(tmp_path_factory.getbasetemp())


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
