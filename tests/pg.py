"""The PostgreSQL database of a test run: made fresh for the run, dropped after it.

The server is the one this project's machines and CI run on 127.0.0.1:5432 (trust
authentication); ``RELAY_TEST_POSTGRES`` names another one, as a URL to an existing
database to connect to while creating and dropping ours. Where none answers, every
PostgreSQL test fails with one line saying so: they are never skipped.

Within the run's database each store lives in a schema of its own (``search_path``), so a
test can open two independent stores, or two stores on one schema as two servers would.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from relay.store.postgres import PostgresStore
from relay.store.postgres.schema import display_url

ADMIN_URL_VARIABLE = "RELAY_TEST_POSTGRES"
DEFAULT_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/test"
CONNECT_TIMEOUT_S = 5


def admin_url() -> str:
    return os.environ.get(ADMIN_URL_VARIABLE) or DEFAULT_ADMIN_URL


def _admin() -> psycopg.Connection:
    url = admin_url()
    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
    except psycopg.OperationalError as exc:
        problem = (str(exc).strip().splitlines() or ["no answer"])[0]
    pytest.fail(
        f"PostgreSQL is not reachable at {display_url(url)} ({problem}). The PostgreSQL "
        f"tests need it and are never skipped: start it (pg_isready -h 127.0.0.1), or "
        f"set {ADMIN_URL_VARIABLE} to the URL of a database to create test databases from.",
        pytrace=False,
    )


@contextmanager
def run_database() -> Iterator[str]:
    """A new, empty database for this run (``relay_test_<pid>_<random>``); its URL. Dropped
    afterwards, with whatever connections a failed test left open."""
    name = f"relay_test_{os.getpid()}_{secrets.token_hex(4)}"
    with _admin() as admin:
        admin.execute(
            sql.SQL("CREATE DATABASE {} ENCODING 'UTF8' TEMPLATE template0").format(
                sql.Identifier(name)
            )
        )
        # A commit need not wait for its WAL to reach the disk: a test database is not
        # meant to outlive a crash, and the tests commit thousands of times.
        admin.execute(
            sql.SQL("ALTER DATABASE {} SET synchronous_commit = off").format(sql.Identifier(name))
        )
    try:
        yield make_conninfo(admin_url(), dbname=name)
    finally:
        with _admin() as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def schema_url(url: str, schema: str) -> str:
    """``url`` with ``schema`` as its search path, created if need be."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    return make_conninfo(url, options=f"-c search_path={schema}")


def server_url(conninfo: str, schema: str | None = None) -> str:
    """``conninfo`` (as ``run_database`` gives it) as the ``postgresql://`` URL that
    ``relay-trio server --db`` takes; with ``schema`` (created if need be) as its search
    path."""
    if schema is not None:
        conninfo = schema_url(conninfo, schema)
    params = conninfo_to_dict(conninfo)
    user = quote(str(params.get("user", "")), safe="")
    host, port = params.get("host", "127.0.0.1"), params.get("port", 5432)
    password = params.get("password")
    auth = f"{user}:{quote(str(password), safe='')}@" if password else f"{user}@" if user else ""
    url = f"postgresql://{auth}{host}:{port}/{quote(str(params['dbname']), safe='')}"
    if "options" in params:
        url += "?options=" + quote(str(params["options"]), safe="")
    return url


def empty(store: PostgresStore) -> None:
    """Delete every job (their errors go with them) and idempotency key, every count, every queue's
    settings, every schedule and the history, and start the ids afresh: two stores emptied
    alike then give the same calls the same ids."""
    store._db.execute("DELETE FROM jobs")
    store._db.execute("DELETE FROM idempotency_keys")  # (they outlive their jobs)
    store._db.execute("DELETE FROM job_counts")
    store._db.execute("DELETE FROM queue_settings")
    store._db.execute("DELETE FROM schedules")
    store._db.execute("DELETE FROM history")
    store._db.execute("SELECT setval('job_ids', 1, false)")
    store.load_counts()  # (what it read as it opened, of the jobs deleted, is gone; and
    # what it knows of paused queues: none now)
