"""What the store conformance suite needs to run one test on either store.

The tests that take the ``store`` fixture (or ``stores``, to open more) run once per kind of
store (tests/store/conftest.py), so that the two stores cannot drift apart. Where a test
looks at rows itself, it does so through ``rows``, in SQL both dialects read. A test about
one store's own machinery (SQLite's statements, query plans, files) is marked
``sqlite_only``, with the reason beside it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from relay.store.base import StoreConfig
from relay.store.postgres import PostgresStore
from relay.store.sqlite import SqliteStore
from tests import pg

# Either store: they offer the same methods (the store Protocol, once merged).
Store = Any

STORE_KINDS = ("sqlite", "postgres")

# For a test about SQLite's own machinery: it runs on the SQLite store only.
sqlite_only = pytest.mark.parametrize("store_kind", ["sqlite"])
# For a test of several servers on one database: PostgreSQL's alone (one server owns a
# SQLite file).
postgres_only = pytest.mark.parametrize("store_kind", ["postgres"])


def rows(store: Store, sql: str, *params: object) -> list[tuple]:
    """The rows of ``sql``, written with ``?`` placeholders, on either store."""
    if isinstance(store, PostgresStore):
        sql = sql.replace("?", "%s")
    return [tuple(row) for row in store._db.execute(sql, params).fetchall()]


def scalar(store: Store, sql: str, *params: object) -> Any:
    return rows(store, sql, *params)[0][0]


def recovers_on_start(store: Store) -> bool:
    """Whether ``leases_recover`` makes every leased job ready again (SQLite: one server
    owns every lease) or leaves leases to expire (PostgreSQL: other servers hold live
    ones). SqliteStore names this in the store Protocol once the store split is merged."""
    return store.recovers_on_start


def counted_queues(store: Store) -> set[str]:
    """The queues a store keeps counts of, zeros included (what it remembers per queue)."""
    if isinstance(store, PostgresStore):
        return {queue for (queue,) in rows(store, "SELECT DISTINCT queue FROM job_counts")}
    return {queue for queue, _state in store._counts}


class Stores:
    """Opens stores of one kind for a test, each empty at first, and closes them after it.

    ``open()`` gives a new empty store; ``open(name)`` opens the store called ``name``,
    empty the first time in the test and as it was left on later opens (a restart), or
    also while another store on it is open (two servers on one database, for PostgreSQL).
    """

    def __init__(self, kind: str, tmp_path: Path, pg_url: str | None) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self.pg_url = pg_url
        self.opened: list[Store] = []
        self.named: set[str] = set()
        self.anonymous: list[tuple[str, Store]] = []

    def open(
        self,
        name: str | None = None,
        config: StoreConfig | None = None,
        *,
        rng: random.Random | None = None,
        **kwargs: Any,
    ) -> Store:
        config = config or StoreConfig()
        if self.kind == "sqlite":
            path = ":memory:" if name is None else str(self.tmp_path / f"{name}.db")
            store: Store = SqliteStore.open(path, config, rng=rng, **kwargs)
        else:
            assert self.pg_url is not None
            schema = self._free_schema() if name is None else f"named_{name}"
            url = pg_schema_url(self.pg_url, schema)
            store = PostgresStore.open(url, config, rng=rng, **kwargs)
            if name is None:
                self.anonymous.append((schema, store))
            if name is None or name not in self.named:
                pg.empty(store)
        if name is not None:
            self.named.add(name)
        self.opened.append(store)
        return store

    def _free_schema(self) -> str:
        """A schema no open store of this test uses (schemas are made once per run)."""
        busy = {schema for schema, store in self.anonymous if not store._db.closed}
        n = 0
        while f"s{n}" in busy:
            n += 1
        return f"s{n}"

    def close(self) -> None:
        for store in self.opened:
            store.close()


_SCHEMA_URLS: dict[tuple[str, str], str] = {}


def pg_schema_url(url: str, schema: str) -> str:
    """The URL of ``schema`` in the run's database (created on first use in the run)."""
    key = (url, f"relay_{schema}")
    if key not in _SCHEMA_URLS:
        _SCHEMA_URLS[key] = pg.schema_url(url, key[1])
    return _SCHEMA_URLS[key]
