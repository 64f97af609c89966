"""The database file: creation, refusals that leave the file untouched, migrations,
restart recovery and the durability of committed (and only committed) changes."""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
from pathlib import Path

import attrs
import pytest

from relay.protocol.errors import (
    DatabaseCorrupt,
    ForeignDatabase,
    JobNotFound,
    LeaseExpired,
    NotADatabase,
    SchemaTooNew,
    StoreError,
)
from relay.protocol.model import Backoff, ErrorEntry, JobState, Priority, SubmitSpec, parse_job_id
from relay.store import schema
from relay.store.base import QueueSettings, StoreConfig
from relay.store.schema import (
    APPLICATION_ID,
    MIGRATIONS,
    SCHEMA_VERSION,
    inspect_file,
    open_database,
)
from relay.store.sqlite import SqliteStore
from relay.store.sqlite import leases as sqlite_leases
from tests.conftest import T0

# PRAGMA synchronous answers a number: 0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA.
SYNCHRONOUS_NORMAL = 1
SYNCHRONOUS_FULL = 2

SIDECAR_SUFFIXES = ("-wal", "-shm", "-journal")
# The owner lock file (relay/store/owner.py): taken before the file is read, so a refused
# file has one too; it is left in place (deleting it would race) and is never the database.
LOCK = "relay.db.lock"


def pragma(conn: sqlite3.Connection, name: str) -> object:
    return conn.execute(f"PRAGMA {name}").fetchone()[0]


def sql_recount(store: SqliteStore) -> dict[str, dict[str, int]]:
    """queue_stats() computed from the table, in the same shape (zeros included)."""
    stats: dict[str, dict[str, int]] = {}
    rows = store._db.execute("SELECT queue, state, count(*) FROM jobs GROUP BY 1, 2")
    for queue, state, n in rows:
        stats.setdefault(queue, {str(s): 0 for s in JobState})[state] = n
    return stats


def all_job_ids(store: SqliteStore) -> set[int]:
    return {row[0] for row in store._db.execute("SELECT id FROM jobs")}


def spec(queue: str = "q", n: int = 0, **kwargs: object) -> SubmitSpec:
    return SubmitSpec(queue, f'{{"n": {n}}}', **kwargs)


# -- a new file ------------------------------------------------------------------------------


def test_new_file_is_wal_full_synchronous_with_foreign_keys_and_relay_ids(tmp_path: Path) -> None:
    path = str(tmp_path / "relay.db")
    conn = open_database(path)
    try:
        assert pragma(conn, "journal_mode") == "wal"
        assert pragma(conn, "synchronous") == SYNCHRONOUS_FULL
        assert pragma(conn, "foreign_keys") == 1
        assert pragma(conn, "application_id") == APPLICATION_ID
        assert pragma(conn, "user_version") == SCHEMA_VERSION
    finally:
        conn.close()
    # The ids are in the file itself, not only in this connection.
    reader = sqlite3.connect(path)
    try:
        assert pragma(reader, "application_id") == APPLICATION_ID
        assert pragma(reader, "user_version") == SCHEMA_VERSION
        assert pragma(reader, "journal_mode") == "wal"
    finally:
        reader.close()


def test_synchronous_normal_when_asked(tmp_path: Path) -> None:
    conn = open_database(str(tmp_path / "relay.db"), synchronous="normal")
    try:
        assert pragma(conn, "synchronous") == SYNCHRONOUS_NORMAL
        assert pragma(conn, "journal_mode") == "wal"
    finally:
        conn.close()


def test_store_open_passes_synchronous_through(tmp_path: Path) -> None:
    store = SqliteStore.open(str(tmp_path / "relay.db"), synchronous="normal")
    try:
        assert pragma(store._db, "synchronous") == SYNCHRONOUS_NORMAL
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["off", "extra", "FULL ", "", "wal"])
def test_unknown_synchronous_mode_is_a_value_error_and_creates_no_file(
    tmp_path: Path, mode: str
) -> None:
    path = tmp_path / "relay.db"
    with pytest.raises(ValueError, match="synchronous"):
        open_database(str(path), synchronous=mode)
    assert list(tmp_path.iterdir()) == []


def test_opening_twice_keeps_the_data_and_the_schema(tmp_path: Path) -> None:
    path = str(tmp_path / "relay.db")
    store = SqliteStore.open(path)
    [submitted] = store.jobs_submit([spec(n=1)], T0)
    store.close()

    store = SqliteStore.open(path)
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        assert pragma(store._db, "application_id") == APPLICATION_ID
        assert pragma(store._db, "journal_mode") == "wal"
        assert store.job_inspect(submitted.job_id).payload == '{"n": 1}'
        assert store.queue_stats()["q"]["ready"] == 1
    finally:
        store.close()


def test_zero_byte_file_is_initialised_as_a_new_database(tmp_path: Path) -> None:
    path = tmp_path / "relay.db"
    path.touch()
    assert inspect_file(str(path)) == 0
    store = SqliteStore.open(str(path))
    try:
        assert pragma(store._db, "application_id") == APPLICATION_ID
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        store.jobs_submit([spec()], T0)
        assert store.queue_stats() == {"q": sql_recount(store)["q"]}
    finally:
        store.close()


# -- refusals --------------------------------------------------------------------------------


@attrs.frozen
class FileSnapshot:
    data: bytes
    size: int
    mtime_ns: int
    directory: frozenset[str]


def snapshot(path: Path) -> FileSnapshot:
    st = path.stat()
    return FileSnapshot(
        path.read_bytes(),
        st.st_size,
        st.st_mtime_ns,
        frozenset(p.name for p in path.parent.iterdir()),
    )


def _write_text_file(path: Path) -> None:
    path.write_text("name,age\nada,36\n", encoding="utf-8")


def _write_random_bytes(path: Path) -> None:
    path.write_bytes(random.Random(7).randbytes(8192))


def _write_foreign_database(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO users (name) VALUES ('ada'), ('grace')")
    conn.commit()
    conn.close()


def _write_foreign_application_id(path: Path) -> None:
    # No tables at all: only the application id says whose file this is.
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA application_id = 0x46534C31")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("DROP TABLE t")
    conn.commit()
    conn.close()


def _write_foreign_wal_database(path: Path) -> None:
    # Another application's file that, like ours, is in WAL mode.
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA application_id = 0x46534C31")
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.commit()
    conn.close()


def _write_relay_database(path: Path, jobs: int = 3) -> None:
    store = SqliteStore.open(str(path))
    store.jobs_submit(
        [spec(f"q{i % 3}", i, priority=i % 4, idempotency_key=f"key-{i}") for i in range(jobs)],
        T0,
    )
    store.close()


def _write_newer_schema(path: Path) -> None:
    _write_relay_database(path)
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()


def _quick_check(path: Path) -> list[str]:
    """PRAGMA quick_check on ``path`` without creating -wal/-shm files (immutable)."""
    conn = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
    try:
        return [row[0] for row in conn.execute("PRAGMA quick_check")]
    except sqlite3.DatabaseError as exc:
        return [f"error: {exc}"]
    finally:
        conn.close()


def _write_corrupt_database(path: Path) -> None:
    """A real relay database with one leaf page of the jobs_ready index overwritten.

    The page is found with the dbstat virtual table, so it is a b-tree page in the middle
    of the file: never page 1 (which holds the 100-byte header and the schema), so SQLite
    still opens the file, reads the schema, application id and user version, and only
    quick_check finds the damage ("Page N: btreeInitPage() returns error code 11"). That
    makes the store answer DatabaseCorrupt, not NotADatabase ("file is not a database"),
    which is what a damaged header would give.
    """
    _write_relay_database(path, jobs=400)
    conn = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
    try:
        page_size = pragma(conn, "page_size")
        page_count = pragma(conn, "page_count")
        victims = [
            row[0]
            for row in conn.execute(
                "SELECT pageno FROM dbstat WHERE name = 'jobs_ready' AND pagetype = 'leaf' "
                "ORDER BY pageno"
            )
        ]
    finally:
        conn.close()
    assert victims, "a few hundred jobs should fill more than one index page"
    page = victims[0]
    assert 1 < page < page_count
    data = bytearray(path.read_bytes())
    start = (page - 1) * page_size
    data[start : start + page_size] = random.Random(3).randbytes(page_size)
    path.write_bytes(bytes(data))
    # The corruption must be real, or the test proves nothing.
    assert _quick_check(path) != ["ok"]


REFUSALS = [
    pytest.param(_write_text_file, NotADatabase, id="text-file"),
    pytest.param(_write_random_bytes, NotADatabase, id="random-bytes"),
    pytest.param(_write_foreign_database, ForeignDatabase, id="foreign-users-table"),
    pytest.param(_write_foreign_application_id, ForeignDatabase, id="foreign-application-id"),
    pytest.param(_write_foreign_wal_database, ForeignDatabase, id="foreign-wal-database"),
    pytest.param(_write_newer_schema, SchemaTooNew, id="schema-too-new"),
    pytest.param(_write_corrupt_database, DatabaseCorrupt, id="corrupt"),
]


@pytest.mark.parametrize(("make_file", "error"), REFUSALS)
def test_refused_file_raises_naming_the_path_and_stays_byte_for_byte_unchanged(
    tmp_path: Path, make_file, error: type[StoreError]
) -> None:
    path = tmp_path / "relay.db"
    make_file(path)
    before = snapshot(path)

    with pytest.raises(error) as excinfo:
        SqliteStore.open(str(path))

    assert type(excinfo.value) is error
    assert excinfo.value.path == str(path)
    assert str(path) in str(excinfo.value)
    after = snapshot(path)
    assert after.data == before.data
    assert after.size == before.size
    assert after.mtime_ns == before.mtime_ns


@pytest.mark.parametrize(("make_file", "error"), REFUSALS)
def test_refused_file_leaves_no_wal_or_shm_file_behind(
    tmp_path: Path, make_file, error: type[StoreError]
) -> None:
    path = tmp_path / "relay.db"
    make_file(path)
    before = snapshot(path)
    assert not any(name.endswith(SIDECAR_SUFFIXES) for name in before.directory)

    with pytest.raises(error):
        SqliteStore.open(str(path))

    assert snapshot(path).directory == before.directory | {LOCK}


@pytest.mark.parametrize(("make_file", "error"), REFUSALS)
def test_inspect_file_refuses_with_the_same_error(
    tmp_path: Path, make_file, error: type[StoreError]
) -> None:
    path = tmp_path / "relay.db"
    make_file(path)
    with pytest.raises(error):
        inspect_file(str(path))


def _write_newer_schema_left_in_the_wal_by_a_crash(path: Path) -> None:
    """A relay database whose newer user_version is committed only in its -wal file, as a
    process that died before checkpointing leaves it (the -shm is gone after a reboot)."""
    elsewhere = path.parent / "live"
    elsewhere.mkdir()
    live = elsewhere / path.name
    _write_relay_database(live)
    conn = sqlite3.connect(live, isolation_level=None)
    try:
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
        shutil.copy(live, path)
        shutil.copy(f"{live}-wal", f"{path}-wal")
    finally:
        conn.close()
    shutil.rmtree(elsewhere)


def test_refused_file_with_a_wal_left_by_a_crash_gains_no_shm_file(tmp_path: Path) -> None:
    path = tmp_path / "relay.db"
    _write_newer_schema_left_in_the_wal_by_a_crash(path)
    wal = Path(f"{path}-wal")
    assert wal.stat().st_size > 0
    before, wal_before = snapshot(path), wal.read_bytes()
    assert before.directory == {"relay.db", "relay.db-wal"}

    # The newer version is only in the WAL: refusing proves the check read it.
    with pytest.raises(SchemaTooNew):
        SqliteStore.open(str(path))

    after = snapshot(path)
    assert (after.data, after.mtime_ns) == (before.data, before.mtime_ns)
    assert wal.read_bytes() == wal_before
    assert after.directory == before.directory | {LOCK}


def test_refusal_of_a_newer_schema_names_both_versions(tmp_path: Path) -> None:
    path = tmp_path / "relay.db"
    _write_newer_schema(path)
    with pytest.raises(SchemaTooNew) as excinfo:
        SqliteStore.open(str(path))
    assert str(SCHEMA_VERSION + 1) in excinfo.value.problem


def test_sqlite_header_followed_by_garbage_is_refused_unchanged(tmp_path: Path) -> None:
    # Passes the header check, then SQLite itself says "file is not a database".
    path = tmp_path / "relay.db"
    path.write_bytes(b"SQLite format 3\x00" + random.Random(5).randbytes(4096 - 16))
    before = snapshot(path)
    with pytest.raises((NotADatabase, DatabaseCorrupt)) as excinfo:
        SqliteStore.open(str(path))
    assert str(path) in str(excinfo.value)
    after = snapshot(path)
    assert (after.data, after.mtime_ns) == (before.data, before.mtime_ns)


# -- migrations ------------------------------------------------------------------------------


def before_queue_settings(old_code: pytest.MonkeyPatch) -> None:
    """The store as the code before schema version 5 ran it: no queue_settings to read
    (nor, as before version 8, a job's slot: ``before_schedules``)."""

    def no_settings(store: SqliteStore) -> None:
        store._settings, store._settings_touched = {}, set()
        store._derive_settings()

    old_code.setattr(SqliteStore, "_load_settings", no_settings)
    before_schedules(old_code)


def before_schedules(old_code: pytest.MonkeyPatch) -> None:
    """The store as the code before schema version 8 ran it: a claim reads no slot (nor,
    as before version 10, writes its start: ``before_attempt_history``)."""
    current = sqlite_leases._claim_candidates_sql

    def candidates(queue_count: int, inline: bool) -> str:
        sql = current(queue_count, inline)
        return sql.replace(
            "timeout_ms, scheduled_for FROM", "timeout_ms, NULL AS scheduled_for FROM"
        )

    old_code.setattr(sqlite_leases, "_claim_candidates_sql", candidates)
    before_attempt_history(old_code)


def before_attempt_history(old_code: pytest.MonkeyPatch) -> None:
    """The store as the code before schema version 10 ran it: a claim writes no start."""
    claim = sqlite_leases._CLAIM_UPDATE.replace("leased_at = ?1, ", "")
    assert claim != sqlite_leases._CLAIM_UPDATE
    old_code.setattr(sqlite_leases, "_CLAIM_UPDATE", claim)


def test_there_is_a_migration_for_every_version() -> None:
    assert set(MIGRATIONS) == set(range(1, SCHEMA_VERSION + 1))
    assert all(callable(m) for m in MIGRATIONS.values())


def test_a_version_1_file_migrates_to_error_tracebacks_and_keeps_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "relay.db")
    # The file as the code of version 1 made it: its migration (never edited) and rows of
    # every kind, among them an error history (a lease that expired on its last attempt),
    # written as version 1's reaper wrote them (today's claims read later columns).
    with monkeypatch.context() as old_code:
        old_code.setattr(schema, "SCHEMA_VERSION", 1)
        before_queue_settings(old_code)
        store = SqliteStore.open(path)
        dead, ready = (r.job_id for r in store.jobs_submit([spec(max_attempts=1), spec()], T0))
        store._db.execute(
            "UPDATE jobs SET state = 'dead', attempt = 1, finished_at = ?, last_error = ?, "
            "lease_token = 't', lease_worker = 'w1', lease_expires_at = ? WHERE id = ?",
            (T0 + 1_000, "lease expired", T0 + 1_000, parse_job_id(dead)),
        )
        store._db.execute(
            "INSERT INTO job_errors (job_id, attempt, error, at) VALUES (?, 1, ?, ?)",
            (parse_job_id(dead), "lease expired", T0 + 1_000),
        )
        store.close()
    conn = sqlite3.connect(path)
    assert pragma(conn, "user_version") == 1
    columns = [row[1] for row in conn.execute("PRAGMA table_info(job_errors)")]
    assert columns == ["job_id", "attempt", "error", "at"]
    conn.close()

    store = SqliteStore.open(path)
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        info = store.job_inspect(dead)
        assert (info.state, info.last_error) == (JobState.DEAD, "lease expired")
        assert info.errors == (ErrorEntry(1, "lease expired", T0 + 1_000, None),)
        assert store.job_inspect(ready).state == JobState.READY
        assert store.queue_stats()["q"]["dead"] == 1
        # The new column takes the traceback of a failure from now on.
        [lease] = store.jobs_claim(["q"], "w1", 1, 1_000, T0 + 2_000)
        store.jobs_fail(ready, "w1", lease.token, "e", True, T0 + 2_000, "Traceback: here")
        assert [e.traceback for e in store.job_inspect(ready).errors] == ["Traceback: here"]
        # (version 6: the index that prunes cancelled jobs)
        assert store.job_cancel(ready, T0 + 3_000) == JobState.RETRYING
        indexes = {row[1] for row in store._db.execute("PRAGMA index_list(jobs)")}
        assert {"jobs_cancelled", "jobs_due_queue"} <= indexes
    finally:
        store.close()
    assert inspect_file(path) == SCHEMA_VERSION


def test_a_version_4_file_migrates_to_queue_settings_and_keeps_its_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "relay.db")
    with monkeypatch.context() as old_code:
        old_code.setattr(schema, "SCHEMA_VERSION", 4)
        before_queue_settings(old_code)
        store = SqliteStore.open(path)
        leased, ready = (r.job_id for r in store.jobs_submit([spec(), spec()], T0))
        [lease] = store.jobs_claim(["q"], "w1", 1, 1_000, T0)
        store.close()
    conn = sqlite3.connect(path)
    assert pragma(conn, "user_version") == 4
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_schema WHERE type='table'")}
    assert "queue_settings" not in tables
    conn.close()

    store = SqliteStore.open(path)
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        assert lease.job_id == leased
        assert store.job_inspect(leased).state == JobState.LEASED
        assert store.job_inspect(ready).state == JobState.READY
        # The new table takes a queue's pause from now on, and keeps it.
        store.queue_pause("q", True, T0 + 1)
        assert store.jobs_claim(["q"], "w1", 2, 1_000, T0 + 2) == []
        store.jobs_ack(leased, "w1", lease.token, None, T0 + 3)
        assert store.queue_stats()["q"]["succeeded"] == 1
    finally:
        store.close()
    store = SqliteStore.open(path)
    try:
        assert store.view.paused == frozenset({"q"})
    finally:
        store.close()
    assert inspect_file(path) == SCHEMA_VERSION


def test_a_version_6_file_migrates_to_queue_limits_and_keeps_its_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "relay.db")
    with monkeypatch.context() as old_code:
        old_code.setattr(schema, "SCHEMA_VERSION", 6)
        before_queue_settings(old_code)
        store = SqliteStore.open(path)
        job = store.jobs_submit([spec()], T0)[0].job_id
        store._db.execute("INSERT INTO queue_settings VALUES ('paused.q', 1, ?)", (T0,))
        store.close()
    conn = sqlite3.connect(path)
    assert pragma(conn, "user_version") == 6
    columns = [row[1] for row in conn.execute("PRAGMA table_info(queue_settings)")]
    assert columns == ["queue", "paused", "updated_at"]
    conn.close()

    store = SqliteStore.open(path)
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        assert store.queue_settings(None, 10) == [QueueSettings("paused.q", paused=True)]
        assert store.view.paused == frozenset({"paused.q"})
        # The new columns take a queue's limits and defaults from now on.
        limited = store.queue_config("q", {"max_leased": 1, "default_retries": 2}, T0 + 1)
        assert limited == QueueSettings("q", max_leased=1, default_retries=2)
        assert store.job_inspect(job).state == JobState.READY
    finally:
        store.close()
    assert inspect_file(path) == SCHEMA_VERSION


def test_empty_sqlite_file_at_version_zero_is_initialised(tmp_path: Path) -> None:
    path = tmp_path / "relay.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.execute("DROP TABLE t")
    conn.commit()
    assert pragma(conn, "user_version") == 0
    assert pragma(conn, "application_id") == 0
    assert conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()[0] == 0
    conn.close()
    assert path.read_bytes().startswith(b"SQLite format 3\x00")
    assert inspect_file(str(path)) == 0

    store = SqliteStore.open(str(path))
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        assert pragma(store._db, "application_id") == APPLICATION_ID
        tables = {
            row[0] for row in store._db.execute("SELECT name FROM sqlite_schema WHERE type='table'")
        }
        assert {"jobs", "job_errors", "idempotency_keys", "meta"} <= tables
        [result] = store.jobs_submit([spec()], T0)
        assert store.job_inspect(result.job_id).state is JobState.READY
    finally:
        store.close()
    assert inspect_file(str(path)) == SCHEMA_VERSION


# -- restart recovery ------------------------------------------------------------------------

QUEUES = ("emails", "reports", "thumbnails")


def test_restart_recovers_every_leased_job_of_a_thousand_and_loses_nothing(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "relay.db")
    store = SqliteStore.open(path, rng=random.Random(0))
    specs = [
        spec(
            QUEUES[i % len(QUEUES)],
            i,
            priority=(i // 3) % len(Priority),
            max_attempts=3,
            backoff=Backoff.fixed(60_000),
        )
        for i in range(1_000)
    ]
    submitted = store.jobs_submit(specs, T0)
    assert len({r.job_id for r in submitted}) == 1_000

    leases = []
    worker = {}  # job id -> the worker that holds its lease
    for round_ in range(4):
        claimed = store.jobs_claim(QUEUES, f"worker-{round_}", 100, 30_000, T0 + 1_000)
        worker.update((lease.job_id, f"worker-{round_}") for lease in claimed)
        leases += claimed
    assert len(leases) == 400
    assert len({lease.job_id for lease in leases}) == 400

    acked, failed, dead, held = leases[:100], leases[100:180], leases[180:200], leases[200:]
    for lease in acked:
        store.jobs_ack(lease.job_id, worker[lease.job_id], lease.token, '"done"', T0 + 2_000)
    for lease in failed:
        outcome = store.jobs_fail(
            lease.job_id, worker[lease.job_id], lease.token, "boom", True, T0 + 2_000
        )
        assert outcome.state is JobState.RETRYING
    for lease in dead:
        outcome = store.jobs_fail(
            lease.job_id, worker[lease.job_id], lease.token, "fatal", False, T0 + 2_000
        )
        assert outcome.state is JobState.DEAD

    ids_before = all_job_ids(store)
    infos_before = {r.job_id: store.job_inspect(r.job_id) for r in submitted}
    store.close()

    store = SqliteStore.open(path, rng=random.Random(0))
    try:
        assert store.queue_stats() == sql_recount(store)
        recover_at = T0 + 5_000
        assert store.leases_recover(recover_at) == len(held)

        assert all_job_ids(store) == ids_before
        for lease in held:
            info = store.job_inspect(lease.job_id)
            assert info.state is JobState.READY
            # The attempt lost with the process is given back.
            assert info.attempt == lease.attempt - 1 == 0
            assert info.lease_expires_at is None
            with pytest.raises(LeaseExpired):
                store.jobs_ack(lease.job_id, worker[lease.job_id], lease.token, None, T0)
        for lease in acked:
            info = store.job_inspect(lease.job_id)
            assert info.state is JobState.SUCCEEDED
            assert info.result == '"done"'
            assert info.finished_at == T0 + 2_000
        for lease in failed:
            info = store.job_inspect(lease.job_id)
            assert info.state is JobState.RETRYING
            assert info.run_at == T0 + 2_000 + 60_000
            assert info.attempt == 1
            assert info.last_error == "boom"
        for lease in dead:
            assert store.job_inspect(lease.job_id).state is JobState.DEAD
        leased_ids = {lease.job_id for lease in leases}
        for job_id, info in infos_before.items():
            if job_id not in leased_ids:
                assert store.job_inspect(job_id) == info

        stats = store.queue_stats()
        assert stats == sql_recount(store)
        totals = {state: sum(q[state] for q in stats.values()) for state in map(str, JobState)}
        assert totals == {
            "pending": 0,
            "ready": 600 + len(held),
            "leased": 0,
            "retrying": len(failed),
            "succeeded": len(acked),
            "dead": len(dead),
            "cancelled": 0,
        }

        # The wall clock stepped back an hour: new ids still sort after every old one.
        [late] = store.jobs_submit([spec("emails", 1_001)], T0 - 3_600_000)
        assert late.job_id > max(r.job_id for r in submitted)
        assert int(late.job_id[4:], 16) > max(ids_before)
        [later] = store.jobs_submit([spec("emails", 1_002)], T0 - 3_600_000)
        assert later.job_id > late.job_id
    finally:
        store.close()


# -- durability of committed data ------------------------------------------------------------


def test_committed_commands_survive_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "relay.db")
    store = SqliteStore.open(path)
    store.begin()
    with store.command():
        [a] = store.jobs_submit([spec("q", 1)], T0)
    with store.command():
        [b] = store.jobs_submit([spec("q", 2, delay_ms=10_000)], T0)
    store.commit()
    store.close()

    store = SqliteStore.open(path)
    try:
        assert store.job_inspect(a.job_id).state is JobState.READY
        assert store.job_inspect(b.job_id).state is JobState.PENDING
        assert store.queue_stats()["q"]["ready"] == 1
        assert store.queue_stats()["q"]["pending"] == 1
    finally:
        store.close()


def test_rolled_back_transaction_is_not_durable_and_stats_revert(tmp_path: Path) -> None:
    path = str(tmp_path / "relay.db")
    store = SqliteStore.open(path)
    [kept] = store.jobs_submit([spec("q", 1)], T0)
    stats_before = store.queue_stats()

    store.begin()
    with store.command():
        dropped, _other = store.jobs_submit([spec("q", 2), spec("other", 3)], T0 + 1)
    with store.command():
        [lease] = store.jobs_claim(["q"], "w", 1, 30_000, T0 + 2)
    assert store.queue_stats() != stats_before
    store.rollback()

    assert store.queue_stats() == stats_before == sql_recount(store)
    with pytest.raises(JobNotFound):
        store.job_inspect(dropped.job_id)
    assert store.job_inspect(lease.job_id).state is JobState.READY
    assert store.job_inspect(lease.job_id).attempt == 0
    store.close()

    store = SqliteStore.open(path)
    try:
        assert all_job_ids(store) == {int(kept.job_id[4:], 16)}
        with pytest.raises(JobNotFound):
            store.job_inspect(dropped.job_id)
        assert store.queue_stats() == stats_before
    finally:
        store.close()


def test_a_command_that_raises_is_undone_while_the_others_commit(tmp_path: Path) -> None:
    path = str(tmp_path / "relay.db")
    store = SqliteStore.open(path)
    store.begin()
    with store.command():
        [first] = store.jobs_submit([spec("q", 1)], T0)
    with pytest.raises(RuntimeError, match="mid-command"), store.command():
        undone, _side = store.jobs_submit([spec("q", 2), spec("side", 3)], T0)
        store.jobs_claim(["q"], "w", 2, 30_000, T0)
        raise RuntimeError("mid-command")
    with store.command():
        [last] = store.jobs_submit([spec("q", 4)], T0)
    assert store.queue_stats() == {"q": {**dict.fromkeys(map(str, JobState), 0), "ready": 2}}
    store.commit()
    assert store.queue_stats() == sql_recount(store)
    store.close()

    store = SqliteStore.open(path)
    try:
        assert store.job_inspect(first.job_id).state is JobState.READY
        assert store.job_inspect(first.job_id).attempt == 0
        assert store.job_inspect(last.job_id).state is JobState.READY
        with pytest.raises(JobNotFound):
            store.job_inspect(undone.job_id)
        assert store.queue_stats() == sql_recount(store)
        assert set(store.queue_stats()) == {"q"}
    finally:
        store.close()


def test_uncommitted_transaction_is_lost_when_the_process_dies(tmp_path: Path) -> None:
    # A copy of the files taken while a transaction is open is what a crash leaves behind.
    path = tmp_path / "relay.db"
    store = SqliteStore.open(str(path), StoreConfig())
    [committed] = store.jobs_submit([spec("q", 1)], T0)
    store.begin()
    with store.command():
        [uncommitted] = store.jobs_submit([spec("q", 2)], T0)
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    for name in os.listdir(tmp_path):
        if name.startswith("relay.db"):
            shutil.copy(tmp_path / name, crashed / name)
    store.rollback()
    store.close()

    survivor = SqliteStore.open(str(crashed / "relay.db"))
    try:
        assert survivor.job_inspect(committed.job_id).state is JobState.READY
        with pytest.raises(JobNotFound):
            survivor.job_inspect(uncommitted.job_id)
    finally:
        survivor.close()


def test_a_version_2_file_migrates_to_unique_keys_and_keeps_its_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "relay.db")
    with monkeypatch.context() as old_code:
        old_code.setattr(schema, "SCHEMA_VERSION", 2)
        before_queue_settings(old_code)
        store = SqliteStore.open(path)
        [old] = store.jobs_submit([spec()], T0)
        store.close()
    conn = sqlite3.connect(path)
    assert pragma(conn, "user_version") == 2
    assert (
        conn.execute("SELECT name FROM sqlite_master WHERE name = 'unique_keys'").fetchall() == []
    )
    conn.close()

    store = SqliteStore.open(path)
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        assert store.job_inspect(old.job_id).state == JobState.READY
        [first] = store.jobs_submit([spec(unique_key="u")], T0)
        [again] = store.jobs_submit([spec(unique_key="u")], T0)
        assert (again.job_id, again.duplicate) == (first.job_id, True)
    finally:
        store.close()


def test_a_version_3_file_migrates_to_execution_timeouts_and_keeps_its_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "relay.db")
    with monkeypatch.context() as old_code:
        old_code.setattr(schema, "SCHEMA_VERSION", 3)
        before_queue_settings(old_code)
        store = SqliteStore.open(path)
        [old] = store.jobs_submit([spec()], T0)
        store.close()
    conn = sqlite3.connect(path)
    assert pragma(conn, "user_version") == 3
    assert "timeout_ms" not in [row[1] for row in conn.execute("PRAGMA table_info(jobs)")]
    conn.close()

    store = SqliteStore.open(path)
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        assert store.job_inspect(old.job_id).timeout_ms is None
        [timed] = store.jobs_submit([spec(timeout_ms=1_000)], T0)
        leases = store.jobs_claim(["q"], "w1", 2, 60_000, T0)
        assert {lease.job_id: lease.timeout_ms for lease in leases} == {
            old.job_id: None,
            timed.job_id: 1_000,
        }
    finally:
        store.close()


def test_a_version_7_file_migrates_to_schedules_and_keeps_its_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.store.base import ScheduleSpec

    path = str(tmp_path / "relay.db")
    with monkeypatch.context() as old_code:
        old_code.setattr(schema, "SCHEMA_VERSION", 7)
        before_schedules(old_code)
        store = SqliteStore.open(path)
        [old] = store.jobs_submit([spec()], T0)
        store.close()
    conn = sqlite3.connect(path)
    assert pragma(conn, "user_version") == 7
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_schema WHERE type='table'")}
    assert "schedules" not in tables
    conn.close()

    store = SqliteStore.open(path)
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        assert store.job_inspect(old.job_id).scheduled_for is None
        store.schedule_put(ScheduleSpec("s", "* * * * *", "UTC", "q", "1"), T0)
        [run] = store.schedules_run_due(T0, 10)
        leases = store.jobs_claim(["q"], "w1", 2, 60_000, T0)
        assert {lease.job_id: lease.scheduled_for for lease in leases} == {
            old.job_id: None,
            run.job_id: T0,
        }
    finally:
        store.close()
    assert inspect_file(path) == SCHEMA_VERSION


def test_a_version_8_file_migrates_to_schedule_defaults_and_keeps_its_schedules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.protocol.model import Backoff
    from relay.store.base import ScheduleSpec

    path = str(tmp_path / "relay.db")
    with monkeypatch.context() as old_code:
        old_code.setattr(schema, "SCHEMA_VERSION", 8)
        before_attempt_history(old_code)
        store = SqliteStore.open(path)
        [job] = store.jobs_submit([spec()], T0)
        store.close()
    # A schedule as version 8 wrote it (every column of its job's template given), whose
    # last job made its 03:00 slot.
    conn = sqlite3.connect(path)
    assert pragma(conn, "user_version") == 8
    slot = T0 - 3_600_000
    conn.execute("UPDATE jobs SET scheduled_for = ? WHERE id = ?", (slot, parse_job_id(job.job_id)))
    conn.execute(
        "INSERT INTO schedules VALUES ('kept', '0 3 * * *', 'Europe/Berlin', 'q', '1', 1, 2, "
        "'fixed', 10, 10, 0, NULL, 'latest', 100, 0, ?, ?, ?, ?, ?)",
        (T0 + 86_400_000, slot, parse_job_id(job.job_id), T0, T0),
    )
    conn.commit()
    with pytest.raises(sqlite3.IntegrityError):  # the columns that version 9 opens to NULL
        conn.execute("UPDATE schedules SET max_attempts = NULL")
    conn.close()

    store = SqliteStore.open(path)
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        [kept] = store.schedule_list(None, 10)
        assert (kept.spec.max_attempts, kept.spec.backoff) == (2, Backoff.fixed(10))
        assert (kept.next_at, kept.last_slot, kept.last_job_id) == (
            T0 + 86_400_000, slot, job.job_id,
        )  # fmt: skip
        assert (kept.last_job_slot, kept.last_refusal) == (slot, None)  # read from its job
        store.schedule_put(ScheduleSpec("left", "* * * * *", "UTC", "q", "1"), T0)
        [left] = [s for s in store.schedule_list(None, 10) if s.spec.name == "left"]
        assert (left.spec.max_attempts, left.spec.backoff) == (None, None)
        assert store.schedules_run_due(T0, 10)[0].name == "left"
    finally:
        store.close()
    assert inspect_file(path) == SCHEMA_VERSION


def test_a_version_9_file_migrates_to_attempt_history_and_bounds_its_histories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.protocol.model import AttemptEntry, AttemptOutcome
    from relay.store.base import ATTEMPTS_KEPT, RESTART_ERROR

    path = str(tmp_path / "relay.db")
    # Rows as the code of version 9 wrote them: an unbounded error history (40 entries,
    # of every kind that code wrote), a job leased and one succeeded, without a start.
    errors = ["boom", "lease expired", "timed out after 5 ms", RESTART_ERROR] * 10
    with monkeypatch.context() as old_code:
        old_code.setattr(schema, "SCHEMA_VERSION", 9)
        before_attempt_history(old_code)
        store = SqliteStore.open(path)
        dead, leased, done = (r.job_id for r in store.jobs_submit([spec()] * 3, T0))
        key = parse_job_id(dead)
        store._db.execute(
            "UPDATE jobs SET state = 'dead', attempt = 40, finished_at = ?, last_error = ? "
            "WHERE id = ?",
            (T0 + 40, errors[-1], key),
        )
        for n, error in enumerate(errors, 1):
            store._db.execute(
                "INSERT INTO job_errors (job_id, attempt, error, at) VALUES (?, ?, ?, ?)",
                (key, n, error, T0 + n),
            )
        store._db.execute(
            "UPDATE jobs SET state = 'leased', attempt = 1, lease_token = 't', "
            "lease_worker = 'w1', lease_expires_at = ? WHERE id = ?",
            (T0 + 60_000, parse_job_id(leased)),
        )
        store._db.execute(
            "UPDATE jobs SET state = 'succeeded', attempt = 1, lease_worker = 'w2', "
            "finished_at = ? WHERE id = ?",
            (T0 + 50, parse_job_id(done)),
        )
        store.close()
    conn = sqlite3.connect(path)
    assert pragma(conn, "user_version") == 9
    assert conn.execute("SELECT count(*) FROM job_errors").fetchone() == (40,)
    conn.close()

    store = SqliteStore.open(path)
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        # Cut to the last ATTEMPTS_KEPT rows, the ones dropped counted; each old row's
        # outcome read from its error.
        assert store._db.execute("SELECT count(*) FROM job_errors").fetchone() == (32,)
        info = store.job_inspect(dead)
        assert (len(info.attempts), info.attempts_dropped) == (ATTEMPTS_KEPT, 8)
        outcomes = [a.outcome for a in info.attempts[:4]]
        assert outcomes == [
            AttemptOutcome.FAILED,
            AttemptOutcome.EXPIRED,
            AttemptOutcome.TIMED_OUT,
            AttemptOutcome.INTERRUPTED,
        ]
        first = AttemptEntry(9, AttemptOutcome.FAILED, None, T0 + 9, None, "boom")
        assert info.attempts[0] == first
        assert [e.error for e in info.errors] == errors[8:]
        assert store.job_inspect(done).attempts == (
            AttemptEntry(1, AttemptOutcome.SUCCEEDED, None, T0 + 50, "w2"),
        )
        assert store.job_inspect(leased).attempts == (
            AttemptEntry(1, AttemptOutcome.RUNNING, None, None, "w1"),
        )
        # The lease held across the migration ends with its history written as today's.
        store.jobs_fail(leased, "w1", "t", "late", True, T0 + 100)
        assert store.job_inspect(leased).attempts == (
            AttemptEntry(1, AttemptOutcome.FAILED, None, T0 + 100, "w1", "late"),
        )
    finally:
        store.close()
    assert inspect_file(path) == SCHEMA_VERSION


def test_a_version_10_file_migrates_to_the_job_browsers_index_and_lists_its_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "relay.db")
    with monkeypatch.context() as old_code:
        old_code.setattr(schema, "SCHEMA_VERSION", 10)
        store = SqliteStore.open(path)
        first, second = (r.job_id for r in store.jobs_submit([spec(), spec()], T0))
        [lease] = store.jobs_claim(["q"], "w1", 1, 60_000, T0)
        store.jobs_ack(lease.job_id, "w1", lease.token, None, T0 + 1)
        store.close()
    conn = sqlite3.connect(path)
    assert pragma(conn, "user_version") == 10
    assert (
        conn.execute("SELECT name FROM sqlite_master WHERE name = 'jobs_queue_state'").fetchall()
        == []
    )
    conn.close()

    store = SqliteStore.open(path)
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        everyone = ("pending", "ready", "leased", "retrying", "succeeded", "dead", "cancelled")
        jobs, cursor = store.jobs_list("q", everyone, None, None, 10)
        assert [(job.job_id, job.state) for job in jobs] == [
            (second, "ready"),
            (first, "succeeded"),
        ]
        assert cursor is None
        assert store.dead_purge_queue("q", 10, ("succeeded",)) == 1
    finally:
        store.close()
    assert inspect_file(path) == SCHEMA_VERSION


def test_a_version_11_file_migrates_to_history_and_keeps_its_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "relay.db")
    with monkeypatch.context() as old_code:
        old_code.setattr(schema, "SCHEMA_VERSION", 11)
        store = SqliteStore.open(path)
        [old] = store.jobs_submit([spec()], T0)
        store.close()
    conn = sqlite3.connect(path)
    assert pragma(conn, "user_version") == 11
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_schema WHERE type='table'")}
    assert "history" not in tables
    conn.close()

    store = SqliteStore.open(path)
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        [lease] = store.jobs_claim(["q"], "w1", 1, 60_000, T0 + 250)
        assert lease.job_id == old.job_id
        store.jobs_submit([spec()], T0 + 300)
        store.history_flush(T0 + 400)
        minute = T0 - T0 % 60_000
        [point] = store.history_read("q", minute, minute + 60_000, 60_000)
        # The job submitted before the migration was not counted; its wait since is.
        fields = point.as_fields()
        assert (fields["submitted"], fields["wait_count"], fields["wait_max_ms"]) == (1, 1, 250)
    finally:
        store.close()
    assert inspect_file(path) == SCHEMA_VERSION


def test_a_version_12_file_migrates_to_keys_that_outlive_their_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "relay.db")
    with monkeypatch.context() as old_code:
        old_code.setattr(schema, "SCHEMA_VERSION", 12)
        store = SqliteStore.open(path)
        [old] = store.jobs_submit([spec()], T0)
        # The key as version 12 wrote it (its columns, its foreign key to jobs).
        store._db.execute(
            "INSERT INTO idempotency_keys (queue, key, job_id, expires_at) VALUES (?, ?, ?, ?)",
            ("q", "K", parse_job_id(old.job_id), T0 + 86_400_000),
        )
        store.close()
    conn = sqlite3.connect(path)
    assert pragma(conn, "user_version") == 12
    assert (
        "REFERENCES"
        in conn.execute("SELECT sql FROM sqlite_schema WHERE name = 'idempotency_keys'").fetchone()[
            0
        ]
    )
    conn.close()

    store = SqliteStore.open(path)
    try:
        assert pragma(store._db, "user_version") == SCHEMA_VERSION
        [again] = store.jobs_submit([spec(idempotency_key="K")], T0 + 1)
        assert (again.job_id, again.duplicate) == (old.job_id, True)
        [lease] = store.jobs_claim(["q"], "w1", 1, 60_000, T0 + 2)
        store.jobs_ack(lease.job_id, "w1", lease.token, None, T0 + 3)
        assert store.dead_purge(old.job_id, ("succeeded",)) == 1
        # The job is gone, its key is not: the same submit is still the purged job.
        [again] = store.jobs_submit([spec(idempotency_key="K")], T0 + 4)
        assert (again.job_id, again.state, again.duplicate) == (
            old.job_id,
            JobState.SUCCEEDED,
            True,
        )
        # Until the key expires: then a submit with it makes a job.
        assert store.jobs_prune(T0 + 86_400_000, 100) == 0
        [new] = store.jobs_submit([spec(idempotency_key="K")], T0 + 86_400_001)
        assert new.duplicate is False and new.job_id != old.job_id
        [again] = store.jobs_submit([spec(idempotency_key="K")], T0 + 86_400_002)
        assert (again.job_id, again.state, again.duplicate) == (new.job_id, JobState.READY, True)
        assert sql_recount(store)["q"]["ready"] == 1
    finally:
        store.close()
    assert inspect_file(path) == SCHEMA_VERSION
