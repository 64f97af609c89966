"""The PostgreSQL schema: connecting, checks before touching anything, creation, migrations.

``open_connection`` is the only way in. Several servers may start together on one database,
so the check and the creation or migration run in one transaction that first takes a
transaction-level advisory lock: the first server creates the schema, the others wait on
the lock and then find it in place. A database (or schema, see ``search_path``) whose
tables of our names were not made by relay-trio, or whose schema version is newer than this
code, is refused with one line naming the problem; the transaction is rolled back, so a
refusal changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from relay.protocol.errors import ForeignDatabase, SchemaTooNew, StoreError, StoreUnreachable

APPLICATION = "relay-trio"
SCHEMA_VERSION = 15

# The key of the advisory lock held while the schema is checked, created or migrated:
# "RLYT" (as in the SQLite file's application_id) and 1. Advisory locks are per database,
# so two schemas of one database migrate one after the other; that costs nothing.
MIGRATION_LOCK = 0x524C5954_00000001

# How long connecting may take where the URL does not say (connect_timeout): a server that
# cannot reach its database says so at start instead of hanging.
CONNECT_TIMEOUT_S = 10
# A connection whose peer went silent (a half-open connection: the database's machine
# lost, a network cut) is found dead within about 30 s, by TCP keepalives while idle and
# by a bound on unacknowledged sends, instead of the kernel's ~15 minutes: a writer would
# hang every request that long, and a listening connection, which never sends, forever.
LIVENESS = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,  # ms
}


def connection_info(url: str, application: str) -> str:
    """``url`` as connection parameters, with relay-trio's defaults for what it leaves
    out: its application name, the connect timeout and LIVENESS."""
    given = conninfo_to_dict(url)
    defaults = {"application_name": application, "connect_timeout": CONNECT_TIMEOUT_S, **LIVENESS}
    return make_conninfo(url, **{key: value for key, value in defaults.items() if key not in given})


# The relations relay-trio creates. Any of them present without our marker in relay_meta
# means another application's tables: refused, never altered.
META_TABLE = "relay_meta"
TABLES = (
    "jobs",
    "job_errors",
    "idempotency_keys",
    "job_counts",
    "unique_keys",
    "queue_settings",
    "schedules",
    "history",
    "waiters",
)
SEQUENCES = ("job_ids",)

_V1 = (
    "CREATE TABLE relay_meta (key text PRIMARY KEY, value text NOT NULL)",
    # Job ids come from this sequence, shared by every server on the database (an
    # in-process generator would collide across servers); see jobs.py for the layout.
    "CREATE SEQUENCE job_ids AS bigint",
    # The columns in the order of the SQLite schema, so that the rows read the same.
    """CREATE TABLE jobs (
        id bigint PRIMARY KEY,
        queue text NOT NULL,
        state text NOT NULL CHECK (state IN
            ('pending', 'ready', 'leased', 'retrying', 'succeeded', 'dead')),
        priority integer NOT NULL,
        payload text NOT NULL,
        attempt integer NOT NULL,
        max_attempts integer NOT NULL,
        backoff_kind text NOT NULL,
        backoff_base_ms bigint NOT NULL,
        backoff_max_ms bigint NOT NULL,
        backoff_jitter boolean NOT NULL,
        created_at bigint NOT NULL,
        ready_at bigint,
        run_at bigint,
        finished_at bigint,
        lease_token text,
        lease_worker text,
        lease_expires_at bigint,
        last_error text,
        result text,
        idempotency_key text
    )""",
    # A job's history and its key go with it: deleting a job (prune, purge) is one
    # statement, the cascade is PostgreSQL's. (Its idempotency key no longer since
    # version 14: it stays until it expires.)
    """CREATE TABLE job_errors (
        job_id bigint NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
        attempt integer NOT NULL,
        error text NOT NULL,
        at bigint NOT NULL,
        seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY
    )""",
    "CREATE INDEX job_errors_job ON job_errors (job_id, seq)",
    """CREATE TABLE idempotency_keys (
        queue text NOT NULL,
        key text NOT NULL,
        job_id bigint NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
        expires_at bigint NOT NULL,
        PRIMARY KEY (queue, key)
    )""",
    "CREATE INDEX idempotency_keys_job ON idempotency_keys (job_id)",
    "CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at)",
    # Jobs per (queue, state), as deltas per slot: each store adds its transactions' moves
    # to the rows of its own slot (picked at random when it opens), so servers do not queue
    # on one hot row per (queue, state). The count is the sum over slots.
    """CREATE TABLE job_counts (
        slot smallint NOT NULL,
        queue text NOT NULL,
        state text NOT NULL,
        n bigint NOT NULL,
        PRIMARY KEY (slot, queue, state)
    )""",
    # Partial indexes, as in SQLite: each holds only the rows of one state, so every
    # time-driven pass (claim, promote, reap, prune) is an index scan over that state.
    "CREATE INDEX jobs_ready ON jobs (queue, priority, ready_at, id) WHERE state = 'ready'",
    "CREATE INDEX jobs_due ON jobs (run_at, id) WHERE state IN ('pending', 'retrying')",
    "CREATE INDEX jobs_leased ON jobs (lease_expires_at, id) WHERE state = 'leased'",
    "CREATE INDEX jobs_dead ON jobs (id) WHERE state = 'dead'",
    "CREATE INDEX jobs_dead_queue ON jobs (queue, id) WHERE state = 'dead'",
    "CREATE INDEX jobs_succeeded ON jobs (finished_at) WHERE state = 'succeeded'",
)


def _create_v1(conn: psycopg.Connection) -> None:
    for statement in _V1:
        conn.execute(statement)


def _v2_error_tracebacks(conn: psycopg.Connection) -> None:
    # A failed attempt's traceback, beside its error (NULL: none was given, as for every
    # row written before). A nullable column without a default rewrites no row.
    conn.execute("ALTER TABLE job_errors ADD COLUMN traceback text")


def _v3_job_counts_by_queue(conn: psycopg.Connection) -> None:
    # The counts of a range of queues, over every slot, one range scan (the primary key
    # leads with the slot): each server reads them a page at a time to follow what the
    # others commit (PostgresStore.counts_refresh).
    conn.execute("CREATE INDEX job_counts_queue ON job_counts (queue)")


def _v4_unique_keys(conn: psycopg.Connection) -> None:
    # Unique jobs: who holds each (queue, unique key), and for how long (``unique_for``).
    # A row stays after its job leaves that scope (a submit then takes it over) and goes
    # with its job.
    conn.execute(
        """CREATE TABLE unique_keys (
            queue text NOT NULL,
            key text NOT NULL,
            job_id bigint NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
            unique_for text NOT NULL,
            PRIMARY KEY (queue, key)
        )"""
    )
    conn.execute("CREATE INDEX unique_keys_job ON unique_keys (job_id)")


def _v5_execution_timeouts(conn: psycopg.Connection) -> None:
    # As SQLite's version 4: a job's execution timeout and its attempt's deadline.
    conn.execute("ALTER TABLE jobs ADD COLUMN timeout_ms bigint, ADD COLUMN deadline_at bigint")


def _v6_queue_settings(conn: psycopg.Connection) -> None:
    # A queue's settings, one row per queue that has any (a queue may have settings before
    # it has jobs), shared by every server: a claim reads the rows of the queues it asks
    # for, by primary key, in its own statement. Only ``paused`` so far; later settings are
    # columns with defaults, and a row that holds only defaults is deleted.
    conn.execute(
        "CREATE TABLE queue_settings (queue text PRIMARY KEY, "
        "paused boolean NOT NULL DEFAULT false, updated_at bigint NOT NULL)"
    )


def _v7_cancelled(conn: psycopg.Connection) -> None:
    # The state "cancelled": the CHECK on jobs.state admits it (the constraint of v1 has
    # PostgreSQL's default name). Cancelled jobs are pruned after retention as succeeded
    # ones are (finished_at); a queue's unstarted jobs are found by queue for a whole-queue
    # cancel (ready ones are in jobs_ready).
    conn.execute("ALTER TABLE jobs DROP CONSTRAINT jobs_state_check")
    conn.execute(
        "ALTER TABLE jobs ADD CONSTRAINT jobs_state_check CHECK (state IN "
        "('pending', 'ready', 'leased', 'retrying', 'succeeded', 'dead', 'cancelled'))"
    )
    conn.execute("CREATE INDEX jobs_cancelled ON jobs (finished_at) WHERE state = 'cancelled'")
    conn.execute(
        "CREATE INDEX jobs_due_queue ON jobs (queue, id) WHERE state IN ('pending', 'retrying')"
    )


def _v8_queue_limits(conn: psycopg.Connection) -> None:
    # As SQLite's version 7: a queue's limits, its rate window, and its submit defaults.
    conn.execute(
        "ALTER TABLE queue_settings ADD COLUMN max_leased bigint, "
        "ADD COLUMN rate_limit bigint, ADD COLUMN rate_period_ms bigint, "
        "ADD COLUMN rate_window_start bigint, "
        "ADD COLUMN rate_window_count bigint NOT NULL DEFAULT 0, "
        "ADD COLUMN default_timeout_ms bigint, ADD COLUMN default_retries integer, "
        "ADD COLUMN default_backoff text"
    )


def _v9_schedules(conn: psycopg.Connection) -> None:
    # As SQLite's version 8: cron schedules, shared by every server. A server takes the
    # due ones FOR UPDATE SKIP LOCKED and moves ``next_at`` past the slots it submits in
    # the transaction that creates their jobs: no slot is submitted by two servers.
    conn.execute(
        """CREATE TABLE schedules (
            name text PRIMARY KEY,
            cron text NOT NULL,
            timezone text NOT NULL,
            queue text NOT NULL,
            payload text NOT NULL,
            priority integer NOT NULL,
            max_attempts integer NOT NULL,
            backoff_kind text NOT NULL,
            backoff_base_ms bigint NOT NULL,
            backoff_max_ms bigint NOT NULL,
            backoff_jitter boolean NOT NULL,
            timeout_ms bigint,
            catch_up text NOT NULL CHECK (catch_up IN ('latest', 'none', 'all')),
            catch_up_max integer NOT NULL,
            paused boolean NOT NULL DEFAULT false,
            next_at bigint,
            last_slot bigint,
            last_job_id bigint,
            created_at bigint NOT NULL,
            updated_at bigint NOT NULL
        )"""
    )
    conn.execute("CREATE INDEX schedules_due ON schedules (next_at) WHERE NOT paused")
    conn.execute("ALTER TABLE jobs ADD COLUMN scheduled_for bigint")


def _v10_schedule_defaults_and_refusals(conn: psycopg.Connection) -> None:
    # As SQLite's version 9: a schedule may leave its job's retries and backoff to the
    # queue's defaults (NULL), and keeps its last job's slot and its last refusal.
    for column in ("max_attempts", "backoff_kind", "backoff_base_ms", "backoff_max_ms",
                   "backoff_jitter"):  # fmt: skip
        conn.execute(f"ALTER TABLE schedules ALTER COLUMN {column} DROP NOT NULL")
    conn.execute("ALTER TABLE schedules ADD COLUMN last_job_slot bigint")
    conn.execute("ALTER TABLE schedules ADD COLUMN last_refusal text")
    conn.execute(
        "UPDATE schedules s SET last_job_slot = j.scheduled_for FROM jobs j "
        "WHERE j.id = s.last_job_id"
    )


def _v11_attempt_history(conn: psycopg.Connection) -> None:
    # As SQLite's version 10: each ended attempt's start, worker and outcome; the start of
    # the job's latest attempt; its ended attempts counted; the histories cut to the last
    # 32 rows. ADD COLUMN with a constant default rewrites no row.
    conn.execute(
        "ALTER TABLE job_errors ADD COLUMN started_at bigint, ADD COLUMN worker text, "
        "ADD COLUMN outcome text"
    )
    conn.execute(
        "ALTER TABLE jobs ADD COLUMN leased_at bigint, "
        "ADD COLUMN attempts_ended integer NOT NULL DEFAULT 0"
    )
    conn.execute(
        "UPDATE jobs SET attempts_ended = c.n FROM (SELECT job_id, count(*) AS n "
        "FROM job_errors GROUP BY job_id) AS c WHERE jobs.id = c.job_id"
    )
    conn.execute(
        "DELETE FROM job_errors WHERE seq IN (SELECT seq FROM (SELECT seq, "
        "row_number() OVER (PARTITION BY job_id ORDER BY seq DESC) AS back "
        "FROM job_errors) AS e WHERE back > 32)"
    )


def _v12_job_browser(conn: psycopg.Connection) -> None:
    # The job browser (jobs_list) and the bulk retry and purge of a queue's jobs by state,
    # as in SQLite: every job under (queue, state), by id.
    conn.execute("CREATE INDEX jobs_queue_state ON jobs (queue, state, id)")


def _v13_history(conn: psycopg.Connection) -> None:
    # As SQLite's version 12: history per queue and minute, every server adding its counts
    # to the same rows (an upsert that adds).
    conn.execute(
        """CREATE TABLE history (
            queue text NOT NULL,
            minute bigint NOT NULL,
            submitted bigint NOT NULL,
            succeeded bigint NOT NULL,
            failed bigint NOT NULL,
            dead bigint NOT NULL,
            run_count bigint NOT NULL,
            run_sum_ms bigint NOT NULL,
            run_max_ms bigint NOT NULL,
            wait_count bigint NOT NULL,
            wait_sum_ms bigint NOT NULL,
            wait_max_ms bigint NOT NULL,
            PRIMARY KEY (queue, minute)
        )"""
    )
    conn.execute("CREATE INDEX history_minute ON history (minute)")


def _v14_keys_outlive_jobs(conn: psycopg.Connection) -> None:
    # As SQLite's version 13: an idempotency key lasts its window whatever becomes of its
    # job (no cascade from jobs any more); final_state is the state its job was deleted in.
    conn.execute(
        "ALTER TABLE idempotency_keys DROP CONSTRAINT IF EXISTS idempotency_keys_job_id_fkey"
    )
    conn.execute("ALTER TABLE idempotency_keys ADD COLUMN final_state text")


def _v15_waiters(conn: psycopg.Connection) -> None:
    # The queues each server has long-polls parked on (relay/store/postgres/waiters.py).
    conn.execute(
        """CREATE TABLE waiters (
            queue text NOT NULL,
            origin text NOT NULL,
            until bigint NOT NULL,
            PRIMARY KEY (queue, origin)
        )"""
    )


# MIGRATIONS[n] turns a schema of version n - 1 into version n. Append, never edit.
MIGRATIONS: dict[int, Callable[[psycopg.Connection], None]] = {
    1: _create_v1,
    2: _v2_error_tracebacks,
    3: _v3_job_counts_by_queue,
    4: _v4_unique_keys,
    5: _v5_execution_timeouts,
    6: _v6_queue_settings,
    7: _v7_cancelled,
    8: _v8_queue_limits,
    9: _v9_schedules,
    10: _v10_schedule_defaults_and_refusals,
    11: _v11_attempt_history,
    12: _v12_job_browser,
    13: _v13_history,
    14: _v14_keys_outlive_jobs,
    15: _v15_waiters,
}


def display_url(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.Error:
        return "<unparsable database URL>"
    params.pop("password", None)
    host, port, dbname = params.get("host"), params.get("port"), params.get("dbname")
    user = params.get("user")
    where = f"{user}@" if user else ""
    where += f"{host or ''}{f':{port}' if port else ''}"
    return f"postgresql://{where}/{dbname or ''}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def open_connection(url: str) -> psycopg.Connection:
    """Connect to ``url``, create or migrate the schema, and return the connection.

    The connection is in autocommit mode: the store issues BEGIN and COMMIT itself. It may
    be handed to one other thread, which then owns it.

    Raises:
        StoreUnreachable: cannot connect (one line, no password).
        StoreError: the schema cannot be created or used.
        ForeignDatabase, SchemaTooNew: refused; nothing in the database was changed.
    """
    where = display_url(url)
    try:
        conn = psycopg.connect(connection_info(url, APPLICATION), autocommit=True)
    except psycopg.Error as exc:
        # (Whether a server answered or not: libpq gives no SQLSTATE for a failed
        # connection, so a refusal, an authentication or a database name, cannot be told
        # from a server that is down or starting but by its message's text.)
        raise StoreUnreachable(where, f"cannot connect: {_first_line(exc)}") from exc
    try:
        _check_connection(conn, where)
        migrate(conn, where)
    except BaseException:
        conn.close()
        raise
    return conn


def _check_connection(conn: psycopg.Connection, where: str) -> None:
    (encoding,) = conn.execute("SHOW server_encoding").fetchone() or ("unknown",)
    if encoding != "UTF8":
        raise StoreError(where, f"the database encoding is {encoding}, not UTF8")
    schema = conn.execute("SELECT current_schema()").fetchone()
    if schema is None or schema[0] is None:
        raise StoreError(where, "no schema to create tables in (check search_path)")


def migrate(conn: psycopg.Connection, where: str) -> int:
    """Create or migrate the schema in one transaction under the migration lock; return the
    version found before (0: none). ``conn`` must be in autocommit mode, outside a
    transaction."""
    # READ COMMITTED whatever the database's default: see the lock below.
    conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
    try:
        # Alone in its statement: the statements after it take their snapshots once the
        # lock is ours, so they see what a server that held it before us committed.
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        version = _found_version(conn, where)
        if version < SCHEMA_VERSION:
            try:
                for target in range(version + 1, SCHEMA_VERSION + 1):
                    MIGRATIONS[target](conn)
            except psycopg.Error as exc:
                raise StoreError(where, f"cannot create the schema: {_first_line(exc)}") from exc
            conn.execute(
                "INSERT INTO relay_meta (key, value) VALUES ('application', %s), "
                "('schema_version', %s) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                (APPLICATION, str(SCHEMA_VERSION)),
            )
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(psycopg.Error):
            conn.execute("ROLLBACK")
        raise
    return version


def _found_version(conn: psycopg.Connection, where: str) -> int:
    """The schema version in the current schema (0: none yet), or the refusal, raised."""
    names = [META_TABLE, *TABLES, *SEQUENCES]
    present = {
        name
        for (name,) in conn.execute(
            "SELECT relname FROM pg_class "
            "WHERE relnamespace = current_schema()::regnamespace AND relname = ANY(%s)",
            (names,),
        )
    }
    if META_TABLE not in present:
        if present:
            found = ", ".join(sorted(present))
            raise ForeignDatabase(
                where, f"holds tables relay-trio did not create ({found}); nothing was changed"
            )
        return 0
    try:
        meta = dict(conn.execute("SELECT key, value FROM relay_meta").fetchall())
    except psycopg.Error as exc:
        raise ForeignDatabase(
            where, f"holds a table {META_TABLE} of another application; nothing was changed"
        ) from exc
    if meta.get("application") != APPLICATION:
        raise ForeignDatabase(
            where, f"holds a table {META_TABLE} of another application; nothing was changed"
        )
    try:
        version = int(meta.get("schema_version", ""))
    except ValueError:
        raise ForeignDatabase(
            where, f"{META_TABLE} holds no valid schema version; nothing was changed"
        ) from None
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(
            where,
            f"schema version {version} is newer than this relay-trio ({SCHEMA_VERSION}); "
            "nothing was changed",
        )
    missing = [name for name in (*TABLES, *SEQUENCES) if name not in present]
    if version == SCHEMA_VERSION and missing:
        raise StoreError(
            where, f"schema version {version} but {', '.join(missing)} missing; nothing was changed"
        )
    return version
