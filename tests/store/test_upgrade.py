"""Upgrades: a database written by the last release (relay-trio 0.1.0, SQLite schema 1:
tests/fixtures/relay-0.1.0.db, made by tests/fixtures/make_release_0_1_0_db.py with that
release's code) opens with this code and keeps every job as it was; the migration from it
runs in one transaction (a step that fails leaves the file at its old version, nothing of
the earlier steps kept); and a database from a newer release is refused by
``relay-trio server`` with one line, on SQLite as on PostgreSQL, changing nothing."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from relay.protocol.errors import StoreError
from relay.protocol.model import JobState, SubmitSpec, format_job_id
from relay.store import schema
from relay.store.postgres import PostgresStore
from relay.store.sqlite import SqliteStore
from tests import pg

FIXTURE = Path(__file__).parent.parent / "fixtures" / "relay-0.1.0.db"
RELAY = Path(sys.executable).parent / "relay-trio"
T0 = 1_767_225_600_000  # the fixture's time: 2026-01-01T00:00:00Z

# The fixture's jobs, by payload: (queue, state, attempt, errors).
RELEASED_JOBS = {
    '"ready"': ("work", JobState.READY, 0, []),
    '"pending"': ("work", JobState.PENDING, 0, []),
    '"leased"': ("leased", JobState.LEASED, 1, []),
    '"retrying"': ("retrying", JobState.RETRYING, 1, ["boom"]),
    '"succeeded"': ("succeeded", JobState.SUCCEEDED, 1, []),
    '"dead"': ("dead", JobState.DEAD, 1, ["fatal"]),
    '"released"': ("released", JobState.READY, 0, []),
}


@pytest.fixture
def released(tmp_path: Path) -> Path:
    """A copy of the release's database (opening migrates it in place)."""
    path = tmp_path / "relay.db"
    shutil.copyfile(FIXTURE, path)
    path.chmod(0o600)
    return path


def ids_by_payload(path: Path) -> dict[str, str]:
    conn = sqlite3.connect(path)
    try:
        return {p: format_job_id(i) for i, p in conn.execute("SELECT id, payload FROM jobs")}
    finally:
        conn.close()


def catalog(path: Path) -> tuple[int, list[tuple]]:
    conn = sqlite3.connect(path)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        return version, conn.execute(
            "SELECT type, name, sql FROM sqlite_schema ORDER BY 2"
        ).fetchall()
    finally:
        conn.close()


def test_the_fixture_is_the_release_schema() -> None:
    version, _ = catalog(FIXTURE)
    assert version == 1 < schema.SCHEMA_VERSION


def test_a_database_of_the_last_release_opens_and_keeps_every_job(released: Path) -> None:
    ids = ids_by_payload(released)
    assert set(ids) == set(RELEASED_JOBS)
    store = SqliteStore.open(str(released))
    try:
        for payload, (queue, state, attempt, errors) in RELEASED_JOBS.items():
            info = store.job_inspect(ids[payload])
            assert (info.queue, info.state, info.attempt) == (queue, state, attempt), payload
            assert [e.error for e in info.errors] == errors, payload
        assert store.job_inspect(ids['"succeeded"']).result == '{"ok": true}'
        # What a server does at start: the release's lease is taken back.
        store.begin()
        with store.command():
            assert store.leases_recover(T0 + 10) == 1
        # The release's idempotency key still answers its job.
        with store.command():
            [again] = store.jobs_submit(
                [SubmitSpec("work", '"again"', idempotency_key="k-ready")], T0 + 10
            )
        store.commit()
        assert again.job_id == ids['"ready"'] and again.duplicate
        assert store.job_inspect(ids['"leased"']).state is JobState.READY
        assert store.queue_stats()["work"]["ready"] == 1
        # And a feature added since works on it: a queue's settings.
        store.begin()
        with store.command():
            store.queue_pause("work", True, T0 + 11)
        store.commit()
    finally:
        store.close()
    assert catalog(released)[0] == schema.SCHEMA_VERSION


def test_a_migration_step_that_fails_leaves_the_release_database_as_it_was(
    released: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = catalog(released)
    last = schema.SCHEMA_VERSION

    def broken(db: object) -> None:
        raise sqlite3.OperationalError("disk I/O error (a test's)")

    monkeypatch.setitem(schema.MIGRATIONS, last, broken)
    with pytest.raises((StoreError, sqlite3.Error)):
        SqliteStore.open(str(released))
    # Every earlier step ran in the same transaction, and is undone with it.
    assert catalog(released) == before
    monkeypatch.undo()
    SqliteStore.open(str(released)).close()  # the real migration then succeeds
    assert catalog(released)[0] == last


def one_line_refusal(db: str, *fragments: str) -> None:
    done = subprocess.run(
        [str(RELAY), "server", "--db", db, "--address", "127.0.0.1:0", "--metrics-address",
         "off", "--ws-address", "off"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("relay-trio: refusing to open"), done.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_a_sqlite_database_of_a_newer_release_is_refused_in_one_line(released: Path) -> None:
    SqliteStore.open(str(released)).close()
    conn = sqlite3.connect(released)
    conn.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
    conn.close()
    before = released.read_bytes()
    one_line_refusal(
        str(released),
        str(released),
        f"schema version {schema.SCHEMA_VERSION + 1} is newer than this relay-trio",
    )
    assert released.read_bytes() == before


def test_a_postgres_database_of_a_newer_release_is_refused_in_one_line() -> None:
    with pg.run_database() as conninfo:
        PostgresStore.open(conninfo).close()
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("UPDATE relay_meta SET value = '999' WHERE key = 'schema_version'")
        one_line_refusal(
            pg.server_url(conninfo), "schema version 999 is newer", "nothing was changed"
        )
