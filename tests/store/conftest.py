"""The store fixtures of the conformance suite: ``store`` and ``stores`` are parametrised
over both kinds of store (tests/store/conformance.py); and of the PostgreSQL store's own
tests: ``url``, a schema of its own, and ``servers``, stores on it as servers would open."""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay.store.base import StoreConfig
from relay.store.postgres import PostgresStore
from tests.store.conformance import STORE_KINDS, Store, Stores


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def stores(request: pytest.FixtureRequest, store_kind: str, tmp_path: Path) -> Iterator[Stores]:
    """Opens empty stores of this test's kind; closes them after the test."""
    url = request.getfixturevalue("pg_url") if store_kind == "postgres" else None
    opener = Stores(store_kind, tmp_path, url)
    try:
        yield opener
    finally:
        opener.close()


@pytest.fixture
def store(stores: Stores) -> Store:
    """A fresh, empty store whose jitter comes from a seeded generator."""
    return stores.open(rng=random.Random(1234))


# How long a statement may wait for a row lock in these tests before it fails: far longer
# than any statement takes, far shorter than the transactions held open to block it.
LOCK_TIMEOUT = "500ms"


@pytest.fixture
def schema(pg_url: str) -> Iterator[str]:
    """A new, empty schema of the run's database (dropped after the test); its name."""
    name = f"t_{secrets.token_hex(4)}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def url(pg_url: str, schema: str) -> str:
    """``schema`` as a URL."""
    return make_conninfo(pg_url, options=f"-c search_path={schema}")


@pytest.fixture
def servers(url: str) -> Iterator[Callable[..., PostgresStore]]:
    """Opens stores on one database, as many servers would; closes them after the test."""
    opened: list[PostgresStore] = []

    def open_store(slot: int | None = None, config: StoreConfig | None = None) -> PostgresStore:
        store = PostgresStore.open(url, config, rng=random.Random(len(opened)), slot=slot)
        store._db.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
        opened.append(store)
        return store

    try:
        yield open_store
    finally:
        for store in opened:
            store.close()
