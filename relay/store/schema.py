"""The database file: checks before touching it, the schema, migrations, and connection setup.

``open_database`` is the only way in. It takes the file's owner lock first (one open store
per file: relay/store/owner.py), then refuses, without writing a byte, a file that is not
SQLite, a SQLite file of another application, a schema newer than this code, and a file
that fails ``PRAGMA quick_check``. Only then does it open the write connection, switch
to WAL and create or migrate the schema in one transaction.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import quote

from relay.protocol.errors import (
    DatabaseCorrupt,
    ForeignDatabase,
    NotADatabase,
    SchemaTooNew,
    StoreError,
)
from relay.store.owner import OwnedConnection, OwnerLock, create_private
from relay.util.log import event

if TYPE_CHECKING:  # imported by _migrate, when a schema is created or migrated: a server
    # opening a database already at this version does without it (its imports: ~4 MB)
    import sqlite_utils

log = logging.getLogger("relay.store")

# "RLYT" as a big-endian 32-bit integer: marks the file as relay-trio's in its header, so
# `file(1)` and our own check can tell it from any other SQLite database.
APPLICATION_ID = 0x524C5954
SCHEMA_VERSION = 13

SQLITE_HEADER = b"SQLite format 3\x00"
SYNCHRONOUS_MODES = ("full", "normal")

# How long a statement waits for a lock held by another connection (a backup tool, the
# sqlite3 shell) before failing. Our own writer never contends with itself.
BUSY_TIMEOUT_MS = 5_000
# Prepared statements the write connection keeps: a multi-row statement has one text per
# row count up to relay.store.sqlite.sql.ONE_STATEMENT_ROWS, for a few kinds of statement.
CACHED_STATEMENTS = 512


def _create_v1(db: sqlite_utils.Database) -> None:
    db["jobs"].create(
        {
            # The integer form of the job id: milliseconds << 21 | sequence (relay.protocol.model).
            # Using it as the rowid keeps one b-tree for the table and its key.
            "id": int,
            "queue": str,
            "state": str,
            "priority": int,
            "payload": str,
            "attempt": int,
            "max_attempts": int,
            "backoff_kind": str,
            "backoff_base_ms": int,
            "backoff_max_ms": int,
            "backoff_jitter": int,
            "created_at": int,
            "ready_at": int,
            "run_at": int,
            "finished_at": int,
            "lease_token": str,
            "lease_worker": str,
            "lease_expires_at": int,
            "last_error": str,
            "result": str,
            "idempotency_key": str,
        },
        pk="id",
        not_null=[
            "queue",
            "state",
            "priority",
            "payload",
            "attempt",
            "max_attempts",
            "backoff_kind",
            "backoff_base_ms",
            "backoff_max_ms",
            "backoff_jitter",
            "created_at",
        ],
        strict=True,
    )
    db["job_errors"].create(
        {"job_id": int, "attempt": int, "error": str, "at": int},
        foreign_keys=[("job_id", "jobs", "id")],
        not_null=["job_id", "attempt", "error", "at"],
        strict=True,
    )
    db["job_errors"].create_index(["job_id"], index_name="job_errors_job")
    db["idempotency_keys"].create(
        {"queue": str, "key": str, "job_id": int, "expires_at": int},
        pk=("queue", "key"),
        foreign_keys=[("job_id", "jobs", "id")],
        not_null=["job_id", "expires_at"],
        strict=True,
    )
    db["idempotency_keys"].create_index(["job_id"], index_name="idempotency_keys_job")
    db["idempotency_keys"].create_index(["expires_at"], index_name="idempotency_keys_expiry")
    db["meta"].create({"key": str, "value": str}, pk="key", strict=True)
    # Partial indexes hold only the rows of one state, so each stays as small as that state
    # and every time-driven pass (claim, promote, reap, prune) is a seek, not a scan.
    # sqlite-utils cannot express a WHERE on an index, hence plain SQL.
    for statement in (
        # Claim: the oldest ready job of each (queue, priority class) is the only candidate.
        "CREATE INDEX jobs_ready ON jobs (queue, priority, ready_at, id) WHERE state = 'ready'",
        "CREATE INDEX jobs_due ON jobs (run_at) WHERE state IN ('pending', 'retrying')",
        "CREATE INDEX jobs_leased ON jobs (lease_expires_at) WHERE state = 'leased'",
        "CREATE INDEX jobs_dead ON jobs (id) WHERE state = 'dead'",
        "CREATE INDEX jobs_dead_queue ON jobs (queue, id) WHERE state = 'dead'",
        "CREATE INDEX jobs_succeeded ON jobs (finished_at) WHERE state = 'succeeded'",
    ):
        db.execute(statement)


def _v2_error_tracebacks(db: sqlite_utils.Database) -> None:
    # A failed attempt's traceback, beside its error (NULL: none was given, as for every
    # row written before). Adding a nullable column rewrites no row.
    db.execute("ALTER TABLE job_errors ADD COLUMN traceback TEXT")


def _v3_unique_keys(db: sqlite_utils.Database) -> None:
    # Unique jobs: who holds each (queue, unique key), and for how long (``unique_for``).
    # A row stays after its job leaves that scope (a submit then takes it over) and goes
    # with its job (``_delete_jobs``).
    db["unique_keys"].create(
        {"queue": str, "key": str, "job_id": int, "unique_for": str},
        pk=("queue", "key"),
        foreign_keys=[("job_id", "jobs", "id")],
        not_null=["job_id", "unique_for"],
        strict=True,
    )
    db["unique_keys"].create_index(["job_id"], index_name="unique_keys_job")


def _v4_execution_timeouts(db: sqlite_utils.Database) -> None:
    # A job's execution timeout (NULL: none), and the deadline of its current attempt
    # (its lease's start + timeout + grace; NULL without a timeout), which no lease or
    # renewal passes. Nullable columns: rewrites no row.
    db.execute("ALTER TABLE jobs ADD COLUMN timeout_ms INTEGER")
    db.execute("ALTER TABLE jobs ADD COLUMN deadline_at INTEGER")


def _v5_queue_settings(db: sqlite_utils.Database) -> None:
    # A queue's settings, one row per queue that has any (a queue may have settings before
    # it has jobs). Only ``paused`` so far; later settings are columns with defaults, and a
    # row that holds only defaults is deleted (so the rows are the queues set otherwise).
    db.execute(
        "CREATE TABLE queue_settings (queue TEXT PRIMARY KEY, "
        "paused INTEGER NOT NULL DEFAULT 0, updated_at INTEGER NOT NULL) STRICT"
    )


def _v6_cancelled(db: sqlite_utils.Database) -> None:
    # The state "cancelled" (the column has no CHECK): its jobs are pruned after retention
    # as succeeded ones are (finished_at), and a queue's unstarted jobs are found by queue
    # for a whole-queue cancel (ready ones are in jobs_ready).
    db.execute("CREATE INDEX jobs_cancelled ON jobs (finished_at) WHERE state = 'cancelled'")
    db.execute(
        "CREATE INDEX jobs_due_queue ON jobs (queue, id) WHERE state IN ('pending', 'retrying')"
    )


def _v7_queue_limits(db: sqlite_utils.Database) -> None:
    # A queue's limits (leased at once; leases per window, with the window's state: when
    # it opened and how many it gave) and the defaults a submit to it gets. NULL: not set.
    for column in (
        "max_leased INTEGER",
        "rate_limit INTEGER",
        "rate_period_ms INTEGER",
        "rate_window_start INTEGER",
        "rate_window_count INTEGER NOT NULL DEFAULT 0",
        "default_timeout_ms INTEGER",
        "default_retries INTEGER",
        "default_backoff TEXT",
    ):
        db.execute(f"ALTER TABLE queue_settings ADD COLUMN {column}")


def _v8_schedules(db: sqlite_utils.Database) -> None:
    # Cron schedules (relay/protocol/cron.py): each with its job's template, its catch-up
    # policy, and where it stands: ``next_at``, its next slot (NULL: none ever again),
    # and the last slot it submitted with that job. A slot's job is created in the same
    # transaction that moves ``next_at`` past it, so a slot is never submitted twice.
    # A job a schedule created carries its slot (``jobs.scheduled_for``; NULL for any
    # other job): a nullable column, which rewrites no row.
    db.execute(
        "CREATE TABLE schedules (name TEXT PRIMARY KEY, cron TEXT NOT NULL, "
        "timezone TEXT NOT NULL, queue TEXT NOT NULL, payload TEXT NOT NULL, "
        "priority INTEGER NOT NULL, max_attempts INTEGER NOT NULL, "
        "backoff_kind TEXT NOT NULL, backoff_base_ms INTEGER NOT NULL, "
        "backoff_max_ms INTEGER NOT NULL, backoff_jitter INTEGER NOT NULL, "
        "timeout_ms INTEGER, catch_up TEXT NOT NULL, catch_up_max INTEGER NOT NULL, "
        "paused INTEGER NOT NULL DEFAULT 0, next_at INTEGER, last_slot INTEGER, "
        "last_job_id INTEGER, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL) STRICT"
    )
    db.execute("CREATE INDEX schedules_due ON schedules (next_at) WHERE NOT paused")
    db.execute("ALTER TABLE jobs ADD COLUMN scheduled_for INTEGER")


def _v9_schedule_defaults_and_refusals(db: sqlite_utils.Database) -> None:
    # A schedule may leave its job's retries and backoff to the queue's defaults (NULL), as
    # a submit may; and it keeps the slot of its last job (``last_job_slot``: what the
    # "schedule stopped" gauge measures from) apart from the last slot it passed, with
    # why that one made no job (``last_refusal``: a full queue). SQLite cannot drop NOT
    # NULL in place: the table (a row per schedule) is made again with its rows, each
    # last job's slot read from the job (NULL if it is gone), and its index.
    db.execute(
        "CREATE TABLE schedules_v9 (name TEXT PRIMARY KEY, cron TEXT NOT NULL, "
        "timezone TEXT NOT NULL, queue TEXT NOT NULL, payload TEXT NOT NULL, "
        "priority INTEGER NOT NULL, max_attempts INTEGER, backoff_kind TEXT, "
        "backoff_base_ms INTEGER, backoff_max_ms INTEGER, backoff_jitter INTEGER, "
        "timeout_ms INTEGER, catch_up TEXT NOT NULL, catch_up_max INTEGER NOT NULL, "
        "paused INTEGER NOT NULL DEFAULT 0, next_at INTEGER, last_slot INTEGER, "
        "last_job_id INTEGER, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL, "
        "last_job_slot INTEGER, last_refusal TEXT) STRICT"
    )
    db.execute(
        "INSERT INTO schedules_v9 SELECT s.*, "
        "(SELECT j.scheduled_for FROM jobs j WHERE j.id = s.last_job_id), NULL "
        "FROM schedules s"
    )
    db.execute("DROP TABLE schedules")
    db.execute("ALTER TABLE schedules_v9 RENAME TO schedules")
    db.execute("CREATE INDEX schedules_due ON schedules (next_at) WHERE NOT paused")


def _v10_attempt_history(db: sqlite_utils.Database) -> None:
    # Attempt history: each ended attempt's row in job_errors (fail, lease expiry, timeout,
    # release, cancel while leased, recovery at start) gains its start, its worker and its
    # outcome (NULL for the rows before: rows.py reads theirs from their error). The
    # attempt running or succeeded is the job row's: its start (``leased_at``, set by the
    # claim), worker and end. ``attempts_ended`` counts a job's ended attempts, so that a
    # write deletes the oldest rows only when more than base.ATTEMPTS_KEPT are there.
    # Nullable columns, or NOT NULL with a default: no row is rewritten.
    db.execute("ALTER TABLE job_errors ADD COLUMN started_at INTEGER")
    db.execute("ALTER TABLE job_errors ADD COLUMN worker TEXT")
    db.execute("ALTER TABLE job_errors ADD COLUMN outcome TEXT")
    db.execute("ALTER TABLE jobs ADD COLUMN leased_at INTEGER")
    db.execute("ALTER TABLE jobs ADD COLUMN attempts_ended INTEGER NOT NULL DEFAULT 0")
    # The histories kept so far had no bound: counted, then cut to the last 32 rows
    # (base.ATTEMPTS_KEPT at this version), in one pass over job_errors.
    db.execute(
        "UPDATE jobs SET attempts_ended = c.n FROM (SELECT job_id, count(*) AS n "
        "FROM job_errors GROUP BY job_id) AS c WHERE jobs.id = c.job_id"
    )
    db.execute(
        "DELETE FROM job_errors WHERE rowid IN (SELECT rowid FROM (SELECT rowid, "
        "row_number() OVER (PARTITION BY job_id ORDER BY rowid DESC) AS back "
        "FROM job_errors) WHERE back > 32)"
    )


def _v11_job_browser(db: sqlite_utils.Database) -> None:
    # The job browser (jobs_list) and the bulk retry and purge of a queue's jobs by state:
    # every job under (queue, state), by id, so that a page of one queue's jobs in one
    # state is a seek whatever the state (succeeded and cancelled jobs had no index by
    # queue, ready ones only in claim order). Building it reads the table once.
    db.execute("CREATE INDEX jobs_queue_state ON jobs (queue, state, id)")


def _v12_history(db: sqlite_utils.Database) -> None:
    # History per queue and minute (relay/store/history.py): counts added by each flush,
    # kept HISTORY_KEEP_MS. Read by queue and time (the key), or over every queue by
    # time, and pruned by time (history_minute).
    db.execute(
        "CREATE TABLE history (queue TEXT NOT NULL, minute INTEGER NOT NULL, "
        "submitted INTEGER NOT NULL, succeeded INTEGER NOT NULL, failed INTEGER NOT NULL, "
        "dead INTEGER NOT NULL, run_count INTEGER NOT NULL, run_sum_ms INTEGER NOT NULL, "
        "run_max_ms INTEGER NOT NULL, wait_count INTEGER NOT NULL, "
        "wait_sum_ms INTEGER NOT NULL, wait_max_ms INTEGER NOT NULL, "
        "PRIMARY KEY (queue, minute)) STRICT"
    )
    db.execute("CREATE INDEX history_minute ON history (minute)")


def _v13_keys_outlive_jobs(db: sqlite_utils.Database) -> None:
    # An idempotency key lasts its window whatever becomes of its job: a purge or a prune
    # deletes the job and leaves the key, which then answers a submit with the deleted job's
    # id and final_state (the state it was deleted in; NULL while the job exists). SQLite
    # cannot drop a foreign key, so the table is made again without it, and copied.
    db.execute(
        "CREATE TABLE idempotency_keys_new (queue TEXT NOT NULL, key TEXT NOT NULL, "
        "job_id INTEGER NOT NULL, expires_at INTEGER NOT NULL, final_state TEXT, "
        "PRIMARY KEY (queue, key)) STRICT"
    )
    db.execute(
        "INSERT INTO idempotency_keys_new (queue, key, job_id, expires_at) "
        "SELECT queue, key, job_id, expires_at FROM idempotency_keys"
    )
    db.execute("DROP TABLE idempotency_keys")
    db.execute("ALTER TABLE idempotency_keys_new RENAME TO idempotency_keys")
    db.execute("CREATE INDEX idempotency_keys_job ON idempotency_keys (job_id)")
    db.execute("CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at)")


# MIGRATIONS[n] turns a schema of version n - 1 into version n. Append, never edit.
MIGRATIONS: dict[int, Callable[[sqlite_utils.Database], None]] = {
    1: _create_v1,
    2: _v2_error_tracebacks,
    3: _v3_unique_keys,
    4: _v4_execution_timeouts,
    5: _v5_queue_settings,
    6: _v6_cancelled,
    7: _v7_queue_limits,
    8: _v8_schedules,
    9: _v9_schedule_defaults_and_refusals,
    10: _v10_attempt_history,
    11: _v11_job_browser,
    12: _v12_history,
    13: _v13_keys_outlive_jobs,
}


def inspect_file(path: str) -> int:
    """Check an existing file read-only; return its schema version (0 for an empty file).

    Raises:
        NotADatabase, ForeignDatabase, SchemaTooNew, DatabaseCorrupt: naming the file.
    """
    with open(path, "rb") as f:
        header = f.read(len(SQLITE_HEADER))
    wal, shm = path + "-wal", path + "-shm"
    has_wal = os.path.exists(wal) and os.path.getsize(wal) > 0
    if not header and not has_wal:
        return 0
    if header and header != SQLITE_HEADER:
        raise NotADatabase(path, "not a SQLite database (wrong file header)")
    # Without a -wal file the main file is the whole database: read it as immutable, which
    # takes no locks and creates nothing beside it. With one (a crash left committed
    # transactions there; the main file may even be empty), SQLite must read the WAL too,
    # which needs a -shm index: if we create one, we remove it again below.
    shm_existed = os.path.exists(shm)
    immutable = "" if has_wal else "&immutable=1"
    try:
        conn = sqlite3.connect(f"file:{quote(path)}?mode=ro{immutable}", uri=True)
    except sqlite3.Error as exc:
        raise NotADatabase(path, f"cannot be opened read-only: {exc}") from exc
    try:
        return _check_contents(path, conn)
    except sqlite3.DatabaseError as exc:
        raise DatabaseCorrupt(path, f"unreadable: {exc}") from exc
    finally:
        conn.close()
        # Only a -shm we created, and no other connection can be using it: any other
        # process with the database open would have created it before us.
        if not shm_existed and os.path.exists(shm):
            with contextlib.suppress(OSError):
                os.remove(shm)


def _check_contents(path: str, conn: sqlite3.Connection) -> int:
    application_id = conn.execute("PRAGMA application_id").fetchone()[0]
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    has_tables = conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()[0] > 0
    if application_id != APPLICATION_ID and (application_id != 0 or has_tables):
        raise ForeignDatabase(
            path, f"a SQLite database of another application (application_id {application_id:#x})"
        )
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(
            path, f"schema version {version} is newer than this relay-trio ({SCHEMA_VERSION})"
        )
    problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
    if problems != ["ok"]:
        raise DatabaseCorrupt(path, "integrity check failed: " + "; ".join(problems[:5]))
    return version


def open_database(path: str, *, synchronous: str = "full") -> sqlite3.Connection:
    """Open (creating or migrating) a relay-trio database and return the write connection.

    The connection is in autocommit mode (``isolation_level=None``): the writer issues
    ``BEGIN IMMEDIATE`` / ``COMMIT`` itself. It may be handed to one other thread, which
    then owns it; nothing else may use it.

    A file is owned by the connection returned, which holds its lock (relay/store/owner.py)
    until it is closed.

    Raises:
        BadDatabasePath: the path is a directory, its directory is missing, no permission.
        DatabaseInUse: another open store owns the file.
        NotADatabase, ForeignDatabase, SchemaTooNew, DatabaseCorrupt: the file is refused
            and left byte-for-byte unchanged.
    """
    if synchronous not in SYNCHRONOUS_MODES:
        raise ValueError(f"synchronous must be one of {SYNCHRONOUS_MODES}, not {synchronous!r}")
    in_memory = path == ":memory:"
    version = 0
    # Before a byte of the file is read: one owner per file (relay/store/owner.py).
    owner = None if in_memory else OwnerLock.acquire(path)
    conn = None
    try:
        if not in_memory and os.path.exists(path):
            version = inspect_file(path)
            _warn_if_world_accessible(path)
        elif not in_memory:
            # Created here, so with mode 0600 whatever the umask; SQLite gives the -wal and
            # -shm files the database's mode. (No SQLite lock of ours is on it yet, which
            # closing a descriptor of it would drop: relay/store/owner.py.) Where a symbolic
            # link points, as SQLite would have created it.
            os.close(create_private(os.path.realpath(path)))
        conn = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False,
            cached_statements=CACHED_STATEMENTS, factory=OwnedConnection,
        )  # fmt: skip
        conn.owner = owner  # released when the connection is closed
    except sqlite3.Error as exc:  # e.g. the directory went away since the check
        raise StoreError(path, f"cannot be opened: {exc}") from exc
    except OSError as exc:  # inspect_file's read of the header, or the file's creation
        raise StoreError(path, f"cannot be read or created: {exc.strerror or exc}") from exc
    finally:
        if conn is None and owner is not None:
            owner.release()
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if not in_memory:
            conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        conn.execute("PRAGMA foreign_keys = ON")
        # The write connection sees the WAL as well: its version is the one to migrate from.
        version = max(version, conn.execute("PRAGMA user_version").fetchone()[0])
        _migrate(conn, version)
    except sqlite3.Error as exc:
        conn.close()
        raise StoreError(path, f"cannot be initialised: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _warn_if_world_accessible(path: str) -> None:
    """A database file that exists keeps its mode (its owner chose it, or an older
    relay-trio did), but one that any user of the machine may read or write is said, once,
    at open: its jobs' payloads and results are in it."""
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o006:
        event(
            log, logging.WARNING, "store.file_world_accessible", path=path, mode=f"{mode:04o}",
            message=f"the database {path} is open to every user of this machine (mode "
            f"{mode:04o}): chmod o-rwx it, and its -wal and -shm files",
        )  # fmt: skip


def _migrate(conn: sqlite3.Connection, version: int) -> None:
    if version == SCHEMA_VERSION:
        return
    import sqlite_utils

    db = sqlite_utils.Database(conn)
    conn.execute("BEGIN IMMEDIATE")
    try:
        for target in range(version + 1, SCHEMA_VERSION + 1):
            MIGRATIONS[target](db)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
