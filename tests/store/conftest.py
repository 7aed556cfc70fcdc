"""Fixtures of the store tests: a migrated store on each backend (tests/conftest.py's
``db_url``: SQLite always, PostgreSQL with JETRL_TEST_POSTGRES_URL)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from jetrl.store.db import Store, open_store


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = open_store(db_url)
    yield s
    s.close()
