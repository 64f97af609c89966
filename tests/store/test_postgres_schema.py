"""The PostgreSQL schema (relay/store/postgres/schema.py): created once, whoever starts
first; refused, untouched, where it is newer than this code or where another application's
tables have our names."""

from __future__ import annotations

import re
import threading

import psycopg
import pytest

from relay.protocol.errors import ForeignDatabase, SchemaTooNew, StoreError
from relay.protocol.model import ErrorEntry, SubmitSpec, parse_job_id
from relay.store.base import QueueSettings
from relay.store.postgres import PostgresStore
from relay.store.postgres import jobs as jobs_sql
from relay.store.postgres import leases as leases_sql
from relay.store.postgres import schema as schema_module
from relay.store.postgres.schema import SCHEMA_VERSION, migrate
from tests.conftest import T0

OURS = {
    "relay_meta", "jobs", "job_errors", "idempotency_keys", "job_counts", "queue_settings",
    "unique_keys", "schedules", "history", "waiters", "job_ids",
}  # fmt: skip


def catalog(url: str) -> list[tuple]:
    """Every relation of the schema with its file and every row of relay_meta with the
    transaction that wrote it: what a no-op open must leave exactly as it was."""
    with psycopg.connect(url, autocommit=True) as conn:
        relations = conn.execute(
            "SELECT relname, relkind, relfilenode FROM pg_class "
            "WHERE relnamespace = current_schema()::regnamespace ORDER BY relname"
        ).fetchall()
        meta: list[tuple] = []
        if any(name == "relay_meta" for name, *_ in relations):
            meta = conn.execute(
                "SELECT t::text, xmin::text FROM relay_meta AS t ORDER BY 1"
            ).fetchall()
        return [*relations, *meta]


# A plain submit as the code before schema version 8 wrote it: no queue's defaults to
# read, no timeout_ms column to write (version 5 adds it); a job's max_attempts left out
# is the protocol's.
PLAIN_SUBMIT_BEFORE_DEFAULTS = (
    "INSERT INTO jobs (id, queue, state, priority, payload, attempt, max_attempts, "
    "backoff_kind, backoff_base_ms, backoff_max_ms, backoff_jitter, created_at, ready_at) "
    "SELECT id, queue, 'ready', priority, payload, 0, coalesce(max_attempts, 4), "
    "'exponential', 1000, 300000, true, %(now)s, %(now)s "
    "FROM unnest(%(ids)s::bigint[], %(queues)s::text[], %(priorities)s::int[], "
    "%(payloads)s::text[], %(max_attempts)s::int[]) "
    "AS t(id, queue, priority, payload, max_attempts)"
)


def before_queue_settings(old_code: pytest.MonkeyPatch) -> None:
    """The store as the code before schema version 6 ran it: no queue_settings to read,
    its claims' candidates taken from every queue asked."""
    before_queue_limits(old_code)
    candidates = re.sub(
        r"FROM \(SELECT u\.queue, .*?\) AS q ",
        "FROM (SELECT queue, false AS limited FROM unnest(%s::text[]) AS u(queue)) AS q ",
        leases_sql._CANDIDATES,
    )
    assert "queue_settings" not in candidates
    old_code.setattr(leases_sql, "_CANDIDATES", candidates)


def before_schedules(old_code: pytest.MonkeyPatch) -> None:
    """The store as the code before schema version 9 ran it: a claim reads no slot (nor,
    as before version 11, writes its start)."""
    candidates = leases_sql._CANDIDATES.replace("j.scheduled_for", "NULL::bigint")
    candidates = candidates.replace("max_attempts, scheduled_for, ", "max_attempts, ")
    assert "scheduled_for" not in candidates
    old_code.setattr(leases_sql, "_CANDIDATES", candidates)
    before_attempt_history(old_code)


def before_attempt_history_claim(claim: str) -> str:
    """A claim as the code before schema version 11 made it: no start written (its
    parameter stays, set to nothing)."""
    old = claim.replace("v.expires_at, leased_at = %s, ", "v.expires_at + 0 * %s, ")
    assert old != claim
    return old


def before_attempt_history(old_code: pytest.MonkeyPatch) -> None:
    """The store as the code before schema version 11 ran it: a claim writes no start."""
    old_code.setattr(leases_sql, "_CLAIM", before_attempt_history_claim(leases_sql._CLAIM))
    read = before_attempt_history_claim(leases_sql._CLAIM_READ)
    old_code.setattr(leases_sql, "_CLAIM_READ", read)


def before_queue_limits(old_code: pytest.MonkeyPatch) -> None:
    """The store as the code before schema version 8 ran it: queue_settings has no limits'
    or defaults' columns to read (nor, as before version 9, a job's slot)."""
    old_code.setattr(PostgresStore, "_load_paused", lambda store: None)
    before_schedules(old_code)
    old_code.setitem(jobs_sql._INSERTS, (False, True), PLAIN_SUBMIT_BEFORE_DEFAULTS)


def execute(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def test_a_fresh_database_gets_every_table_and_the_schema_version(url):
    store = PostgresStore.open(url)
    try:
        names = {row[0] for row in catalog(url)}
        assert names >= OURS
        meta = dict(store._db.execute("SELECT key, value FROM relay_meta").fetchall())
        assert meta == {"application": "relay-trio", "schema_version": str(SCHEMA_VERSION)}
        [result] = store.jobs_submit([SubmitSpec("q", '{"n": 1}')], T0)
        assert store.job_inspect(result.job_id).state == "ready"
    finally:
        store.close()


def test_opening_again_changes_nothing(url):
    PostgresStore.open(url).close()
    before = catalog(url)
    store = PostgresStore.open(url)
    try:
        assert catalog(url) == before
        assert migrate(store._db, "here") == SCHEMA_VERSION  # found in place: nothing to do
        assert catalog(url) == before
    finally:
        store.close()


def test_three_servers_starting_together_create_the_schema_once(url):
    """Each migrates on its own connection at the same moment: one finds nothing and
    creates the schema, the others wait on the advisory lock and find it made."""
    connections = [psycopg.connect(url, autocommit=True) for _ in range(3)]
    start = threading.Barrier(3)
    found: list[int] = []
    errors: list[BaseException] = []

    def starting(conn: psycopg.Connection) -> None:
        try:
            start.wait()
            found.append(migrate(conn, "here"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=starting, args=(conn,)) for conn in connections]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert errors == []
        assert sorted(found) == [0, SCHEMA_VERSION, SCHEMA_VERSION]
    finally:
        for conn in connections:
            conn.close()
    # One transaction wrote the marker; stores open on it as on any other.
    assert len({xmin for *_, xmin in catalog(url)[-2:]}) == 1
    opened = [PostgresStore.open(url) for _ in range(3)]
    for store in opened:
        store.close()


def test_three_stores_opening_together_all_open(url):
    start = threading.Barrier(3)
    opened: list[PostgresStore] = []
    errors: list[BaseException] = []

    def opening() -> None:
        try:
            start.wait()
            opened.append(PostgresStore.open(url))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=opening) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    try:
        assert errors == []
        assert len(opened) == 3
    finally:
        for store in opened:
            store.close()


def test_a_version_1_schema_migrates_to_error_tracebacks_and_keeps_its_rows(url, monkeypatch):
    # The schema as the code of version 1 made it (its migration is never edited), with
    # rows of every kind, among them an error history (a lease expired on its last attempt).
    # (Written as version 1's reaper wrote them: today's claims read later columns.)
    with monkeypatch.context() as old_code:
        old_code.setattr(schema_module, "SCHEMA_VERSION", 1)
        before_queue_settings(old_code)
        store = PostgresStore.open(url)
        specs = [SubmitSpec("q", '{"n": 1}', max_attempts=1), SubmitSpec("q", '{"n": 2}')]
        dead, ready = (r.job_id for r in store.jobs_submit(specs, T0))
        key = parse_job_id(dead)
        with store._db.transaction():
            store._db.execute(
                "UPDATE jobs SET state = 'dead', attempt = 1, finished_at = %s, "
                "last_error = 'lease expired', lease_token = 't', lease_worker = 'w1', "
                "lease_expires_at = %s WHERE id = %s",
                (T0 + 1_000, T0 + 1_000, key),
            )
            store._db.execute(
                "INSERT INTO job_errors (job_id, attempt, error, at) "
                "VALUES (%s, 1, 'lease expired', %s)",
                (key, T0 + 1_000),
            )
            store._db.execute(
                "INSERT INTO job_counts (slot, queue, state, n) VALUES (0, 'q', 'ready', -1), "
                "(0, 'q', 'dead', 1) ON CONFLICT (slot, queue, state) "
                "DO UPDATE SET n = job_counts.n + EXCLUDED.n"
            )
        store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute(
            "SELECT value FROM relay_meta WHERE key = 'schema_version'"
        ).fetchone() == ("1",)
        columns = conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'job_errors' "
            "AND table_schema = current_schema() ORDER BY ordinal_position"
        ).fetchall()
        assert [name for (name,) in columns] == ["job_id", "attempt", "error", "at", "seq"]

    store = PostgresStore.open(url)
    try:
        meta = dict(store._db.execute("SELECT key, value FROM relay_meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION)
        # (version 3: the counts by queue, which each server reads a page at a time)
        indexes = store._db.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'job_counts' "
            "AND schemaname = current_schema()"
        ).fetchall()
        assert ("job_counts_queue",) in indexes
        assert store.view.get("q") is not None  # (its counts, read as it opened)
        info = store.job_inspect(dead)
        assert (info.state, info.last_error) == ("dead", "lease expired")
        assert info.errors == (ErrorEntry(1, "lease expired", T0 + 1_000, None),)
        assert store.job_inspect(ready).state == "ready"
        assert store.queue_stats()["q"]["dead"] == 1
        [lease] = store.jobs_claim(["q"], "w1", 1, 1_000, T0 + 2_000)
        store.jobs_fail(ready, "w1", lease.token, "e", True, T0 + 2_000, "Traceback: here")
        assert [e.traceback for e in store.job_inspect(ready).errors] == ["Traceback: here"]
        # (version 7: the CHECK on the state admits "cancelled")
        assert store.job_cancel(ready, T0 + 3_000) == "retrying"
        assert store.job_inspect(ready).state == "cancelled"
    finally:
        store.close()


def test_a_version_3_schema_migrates_to_unique_keys_and_keeps_its_jobs(url, monkeypatch):
    with monkeypatch.context() as old_code:
        old_code.setattr(schema_module, "SCHEMA_VERSION", 3)
        before_queue_settings(old_code)
        store = PostgresStore.open(url)
        [old] = store.jobs_submit([SubmitSpec("q", '{"n": 1}')], T0)
        store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('unique_keys')").fetchone() == (None,)

    store = PostgresStore.open(url)
    try:
        meta = dict(store._db.execute("SELECT key, value FROM relay_meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION)
        assert store.job_inspect(old.job_id).state == "ready"
        [first] = store.jobs_submit([SubmitSpec("q", "1", unique_key="u")], T0)
        [again] = store.jobs_submit([SubmitSpec("q", "2", unique_key="u")], T0)
        assert (again.job_id, again.duplicate) == (first.job_id, True)
    finally:
        store.close()


def test_a_version_4_schema_migrates_to_execution_timeouts_and_keeps_its_jobs(url, monkeypatch):
    with monkeypatch.context() as old_code:
        old_code.setattr(schema_module, "SCHEMA_VERSION", 4)
        before_queue_settings(old_code)
        store = PostgresStore.open(url)
        [old] = store.jobs_submit([SubmitSpec("q", '{"n": 1}')], T0)
        store.close()

    store = PostgresStore.open(url)
    try:
        meta = dict(store._db.execute("SELECT key, value FROM relay_meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION)
        assert store.job_inspect(old.job_id).timeout_ms is None
        [timed] = store.jobs_submit([SubmitSpec("q", "2", timeout_ms=1_000)], T0)
        leases = store.jobs_claim(["q"], "w1", 2, 60_000, T0)
        assert {lease.job_id: lease.timeout_ms for lease in leases} == {
            old.job_id: None,
            timed.job_id: 1_000,
        }
    finally:
        store.close()


def test_a_version_5_schema_migrates_to_queue_settings_and_keeps_its_jobs(url, monkeypatch):
    with monkeypatch.context() as old_code:
        old_code.setattr(schema_module, "SCHEMA_VERSION", 5)
        before_queue_settings(old_code)
        store = PostgresStore.open(url)
        specs = [SubmitSpec("q", '{"n": 1}'), SubmitSpec("q", '{"n": 2}')]
        first, second = (r.job_id for r in store.jobs_submit(specs, T0))
        [lease] = store.jobs_claim(["q"], "w1", 1, 60_000, T0)
        store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute(
            "SELECT value FROM relay_meta WHERE key = 'schema_version'"
        ).fetchone() == ("5",)
        assert conn.execute("SELECT to_regclass('queue_settings')").fetchone() == (None,)

    store = PostgresStore.open(url)
    try:
        meta = dict(store._db.execute("SELECT key, value FROM relay_meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION)
        assert store.job_inspect(first).state == "leased"
        assert store.job_inspect(second).state == "ready"
        # The lease taken before the migration is still held, and the queue now pauses.
        store.queue_pause("q", True, T0 + 1)
        assert store.jobs_claim(["q"], "w1", 2, 60_000, T0 + 2) == []
        store.jobs_ack(first, "w1", lease.token, None, T0 + 3)
        assert store.queue_stats()["q"] == {**store.queue_stats()["q"], "succeeded": 1, "ready": 1}
    finally:
        store.close()


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message
    return message


def test_a_newer_schema_version_is_refused_and_nothing_changes(url):
    PostgresStore.open(url).close()
    execute(url, "UPDATE relay_meta SET value = '999' WHERE key = 'schema_version'")
    before = catalog(url)
    with pytest.raises(SchemaTooNew) as refused:
        PostgresStore.open(url)
    message = _one_line(refused.value)
    assert "schema version 999 is newer than this relay-trio" in message
    assert "nothing was changed" in message
    assert catalog(url) == before


@pytest.mark.parametrize(
    "foreign",
    [
        ["CREATE TABLE jobs (id serial PRIMARY KEY, title text)"],
        ["CREATE SEQUENCE job_ids"],
        ["CREATE TABLE relay_meta (name text, size int)"],
        [
            "CREATE TABLE relay_meta (key text PRIMARY KEY, value text NOT NULL)",
            "INSERT INTO relay_meta VALUES ('application', 'someone-else')",
        ],
    ],
    ids=["jobs", "sequence", "meta-columns", "meta-application"],
)
def test_tables_of_another_application_with_our_names_are_refused_and_left_alone(url, foreign):
    execute(url, *foreign)
    before = catalog(url)
    with pytest.raises(ForeignDatabase) as refused:
        PostgresStore.open(url)
    message = _one_line(refused.value)
    assert "another application" in message or "did not create" in message
    assert "nothing was changed" in message
    assert catalog(url) == before


@pytest.mark.parametrize("table", ["history", "waiters"])
def test_a_schema_of_this_version_missing_one_of_its_tables_is_refused(url, table):
    PostgresStore.open(url).close()
    execute(url, f"DROP TABLE {table}")
    before = catalog(url)
    with pytest.raises(StoreError) as refused:
        PostgresStore.open(url)
    message = _one_line(refused.value)
    assert f"but {table} missing" in message and "nothing was changed" in message
    assert catalog(url) == before


def test_an_unreachable_server_is_one_line_without_the_password():
    with pytest.raises(StoreError) as refused:
        PostgresStore.open("postgresql://relay:s3cret@127.0.0.1:1/nowhere?connect_timeout=2")
    message = _one_line(refused.value)
    assert message.startswith("postgresql://relay@127.0.0.1:1/nowhere: cannot connect")
    assert "s3cret" not in message


def test_connections_find_a_silent_peer_dead_unless_the_url_says_otherwise():
    """Keepalives and a bound on unacknowledged sends: a half-open connection is found
    dead in about 30 s, not the kernel's 15 minutes. What the URL sets wins."""
    from psycopg.conninfo import conninfo_to_dict

    from relay.store.postgres.schema import LIVENESS, connection_info

    params = conninfo_to_dict(connection_info("postgresql://u@h:5432/d", "relay-trio"))
    assert {k: int(params[k]) for k in LIVENESS} == LIVENESS
    assert params["application_name"] == "relay-trio" and int(params["connect_timeout"]) > 0
    given = "postgresql://u@h/d?keepalives_idle=60&application_name=mine&connect_timeout=3"
    params = conninfo_to_dict(connection_info(given, "relay-trio"))
    assert (params["keepalives_idle"], params["application_name"]) == ("60", "mine")
    assert params["connect_timeout"] == "3" and params["tcp_user_timeout"] == "30000"


def test_a_version_7_schema_migrates_to_queue_limits_and_keeps_its_settings(url, monkeypatch):
    with monkeypatch.context() as old_code:
        old_code.setattr(schema_module, "SCHEMA_VERSION", 7)
        before_queue_limits(old_code)
        store = PostgresStore.open(url)
        [job] = store.jobs_submit([SubmitSpec("q", '{"n": 1}')], T0)
        store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO queue_settings VALUES ('paused.q', true, %s)", (T0,))
        assert conn.execute(
            "SELECT value FROM relay_meta WHERE key = 'schema_version'"
        ).fetchone() == ("7",)

    store = PostgresStore.open(url)
    try:
        meta = dict(store._db.execute("SELECT key, value FROM relay_meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION)
        assert store.queue_settings(None, 10) == [QueueSettings("paused.q", paused=True)]
        assert store.view.paused == frozenset({"paused.q"})
        limited = store.queue_config("q", {"max_leased": 1, "default_retries": 2}, T0 + 1)
        assert limited == QueueSettings("q", max_leased=1, default_retries=2)
        assert store.job_inspect(job.job_id).state == "ready"
    finally:
        store.close()


def test_a_version_8_schema_migrates_to_schedules_and_keeps_its_jobs(url, monkeypatch):
    from relay.store.base import ScheduleSpec

    with monkeypatch.context() as old_code:
        old_code.setattr(schema_module, "SCHEMA_VERSION", 8)
        before_schedules(old_code)
        store = PostgresStore.open(url)
        [old] = store.jobs_submit([SubmitSpec("q", '{"n": 1}')], T0)
        store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('schedules')").fetchone() == (None,)

    store = PostgresStore.open(url)
    try:
        meta = dict(store._db.execute("SELECT key, value FROM relay_meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION)
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


def test_a_version_9_schema_migrates_to_schedule_defaults_and_keeps_its_schedules(url, monkeypatch):
    from relay.protocol.model import Backoff, parse_job_id
    from relay.store.base import ScheduleSpec

    with monkeypatch.context() as old_code:
        old_code.setattr(schema_module, "SCHEMA_VERSION", 9)
        before_attempt_history(old_code)
        store = PostgresStore.open(url)
        [job] = store.jobs_submit([SubmitSpec("q", '{"n": 1}')], T0)
        store.close()
    slot = T0 - 3_600_000
    with psycopg.connect(url, autocommit=True) as conn:
        # A schedule as version 9 wrote it, whose last job made its 03:00 slot.
        conn.execute(
            "UPDATE jobs SET scheduled_for = %s WHERE id = %s", (slot, parse_job_id(job.job_id))
        )
        conn.execute(
            "INSERT INTO schedules VALUES ('kept', '0 3 * * *', 'Europe/Berlin', 'q', '1', 1, "
            "2, 'fixed', 10, 10, false, NULL, 'latest', 100, false, %s, %s, %s, %s, %s)",
            (T0 + 86_400_000, slot, parse_job_id(job.job_id), T0, T0),
        )
        with pytest.raises(psycopg.errors.NotNullViolation):
            conn.execute("UPDATE schedules SET max_attempts = NULL")

    store = PostgresStore.open(url)
    try:
        [kept] = store.schedule_list(None, 10)
        assert (kept.spec.max_attempts, kept.spec.backoff) == (2, Backoff.fixed(10))
        assert (kept.last_slot, kept.last_job_id) == (slot, job.job_id)
        assert (kept.last_job_slot, kept.last_refusal) == (slot, None)  # read from its job
        store.schedule_put(ScheduleSpec("left", "* * * * *", "UTC", "q", "1"), T0)
        left = next(s for s in store.schedule_list(None, 10) if s.spec.name == "left")
        assert (left.spec.max_attempts, left.spec.backoff) == (None, None)
        assert [run.name for run in store.schedules_run_due(T0, 10)] == ["left"]
    finally:
        store.close()


def test_a_version_10_schema_migrates_to_attempt_history_and_bounds_its_histories(url, monkeypatch):
    from relay.protocol.model import AttemptEntry, AttemptOutcome
    from relay.store.base import ATTEMPTS_KEPT

    # Rows as the code of version 10 wrote them: an unbounded error history of 40 entries
    # (fail and the reaper's), and a job leased by that code's claim, without a start.
    errors = ["boom", "lease expired", "timed out after 5 ms", "boom"] * 10
    with monkeypatch.context() as old_code:
        old_code.setattr(schema_module, "SCHEMA_VERSION", 10)
        before_attempt_history(old_code)
        store = PostgresStore.open(url)
        dead, leased = (r.job_id for r in store.jobs_submit([SubmitSpec("q", "1")] * 2, T0))
        [lease] = store.jobs_claim(["q"], "w1", 1, 60_000, T0)
        assert lease.job_id == dead
        store._db.execute(
            "UPDATE jobs SET state = 'dead', attempt = 40, finished_at = %s WHERE id = %s",
            (T0 + 40, parse_job_id(dead)),
        )
        for n, error in enumerate(errors, 1):
            store._db.execute(
                "INSERT INTO job_errors (job_id, attempt, error, at) VALUES (%s, %s, %s, %s)",
                (parse_job_id(dead), n, error, T0 + n),
            )
        [lease] = store.jobs_claim(["q"], "w2", 1, 60_000, T0 + 50)
        assert lease.job_id == leased
        store._db.commit()
        store.close()

    store = PostgresStore.open(url)
    try:
        meta = dict(store._db.execute("SELECT key, value FROM relay_meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION)
        assert store._db.execute("SELECT count(*) FROM job_errors").fetchone() == (32,)
        info = store.job_inspect(dead)
        assert (len(info.attempts), info.attempts_dropped) == (ATTEMPTS_KEPT, 8)
        assert info.attempts[:3] == (
            AttemptEntry(9, AttemptOutcome.FAILED, None, T0 + 9, None, "boom"),
            AttemptEntry(10, AttemptOutcome.EXPIRED, None, T0 + 10, None, "lease expired"),
            AttemptEntry(11, AttemptOutcome.TIMED_OUT, None, T0 + 11, None, errors[2]),
        )
        assert [e.error for e in info.errors] == errors[8:]
        assert store.job_inspect(leased).attempts == (
            AttemptEntry(1, AttemptOutcome.RUNNING, None, None, "w2"),
        )
        store.jobs_fail(leased, "w2", lease.token, "late", True, T0 + 100)
        assert store.job_inspect(leased).attempts == (
            AttemptEntry(1, AttemptOutcome.FAILED, None, T0 + 100, "w2", "late"),
        )
    finally:
        store.close()


def test_a_version_11_schema_migrates_to_the_job_browsers_index_and_lists_its_jobs(
    url, monkeypatch
):
    with monkeypatch.context() as old_code:
        old_code.setattr(schema_module, "SCHEMA_VERSION", 11)
        store = PostgresStore.open(url)
        specs = [SubmitSpec("q", '{"n": 1}'), SubmitSpec("q", '{"n": 2}')]
        first, second = (r.job_id for r in store.jobs_submit(specs, T0))
        [lease] = store.jobs_claim(["q"], "w1", 1, 60_000, T0)
        store.jobs_ack(lease.job_id, "w1", lease.token, None, T0 + 1)
        store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('jobs_queue_state')").fetchone() == (None,)

    store = PostgresStore.open(url)
    try:
        meta = dict(store._db.execute("SELECT key, value FROM relay_meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION)
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


def test_a_version_12_schema_migrates_to_history_and_keeps_its_jobs(url, monkeypatch):
    with monkeypatch.context() as old_code:
        old_code.setattr(schema_module, "SCHEMA_VERSION", 12)
        store = PostgresStore.open(url)
        [old] = store.jobs_submit([SubmitSpec("q", '{"n": 1}')], T0)
        store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('history')").fetchone() == (None,)

    store = PostgresStore.open(url)
    try:
        meta = dict(store._db.execute("SELECT key, value FROM relay_meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION)
        [lease] = store.jobs_claim(["q"], "w1", 1, 60_000, T0 + 250)
        assert lease.job_id == old.job_id
        store.jobs_submit([SubmitSpec("q", "{}")], T0 + 300)
        store.history_flush(T0 + 400)
        minute = T0 - T0 % 60_000
        [point] = store.history_read("q", minute, minute + 60_000, 60_000)
        # The job submitted before the migration was not counted; its wait since is.
        assert point.as_fields()["submitted"] == 1
        assert (point.as_fields()["wait_count"], point.as_fields()["wait_max_ms"]) == (1, 250)
    finally:
        store.close()


def test_a_version_13_schema_migrates_to_keys_that_outlive_their_jobs(url, monkeypatch):
    with monkeypatch.context() as old_code:
        old_code.setattr(schema_module, "SCHEMA_VERSION", 13)
        store = PostgresStore.open(url)
        [old] = store.jobs_submit([SubmitSpec("q", '{"n": 1}')], T0)
        store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        # The key as version 13 wrote it (its columns, its cascade from jobs).
        conn.execute(
            "INSERT INTO idempotency_keys (queue, key, job_id, expires_at) VALUES (%s, %s, %s, %s)",
            ("q", "K", parse_job_id(old.job_id), T0 + 86_400_000),
        )

    store = PostgresStore.open(url)
    try:
        meta = dict(store._db.execute("SELECT key, value FROM relay_meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION)
        [again] = store.jobs_submit([SubmitSpec("q", "{}", idempotency_key="K")], T0 + 1)
        assert (again.job_id, again.duplicate) == (old.job_id, True)
        [lease] = store.jobs_claim(["q"], "w1", 1, 60_000, T0 + 2)
        store.jobs_ack(lease.job_id, "w1", lease.token, None, T0 + 3)
        assert store.dead_purge(old.job_id, ("succeeded",)) == 1
        # The job is gone, its key is not: the same submit is still the purged job.
        [again] = store.jobs_submit([SubmitSpec("q", "{}", idempotency_key="K")], T0 + 4)
        assert (again.job_id, again.state, again.duplicate) == (old.job_id, "succeeded", True)
        # Until the key expires: then a submit with it makes a job.
        assert store.jobs_prune(T0 + 86_400_000, 100) == 0
        [new] = store.jobs_submit([SubmitSpec("q", "{}", idempotency_key="K")], T0 + 86_400_001)
        assert new.duplicate is False and new.job_id != old.job_id
        [again] = store.jobs_submit([SubmitSpec("q", "{}", idempotency_key="K")], T0 + 86_400_002)
        assert (again.job_id, again.state, again.duplicate) == (new.job_id, "ready", True)
    finally:
        store.close()


def test_a_version_14_schema_migrates_to_waiters_and_keeps_its_jobs(url, monkeypatch):
    with monkeypatch.context() as old_code:
        old_code.setattr(schema_module, "SCHEMA_VERSION", 14)
        store = PostgresStore.open(url)
        [old] = store.jobs_submit([SubmitSpec("q", '{"n": 1}')], T0)
        store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('waiters')").fetchone() == (None,)

    store = PostgresStore.open(url)
    try:
        meta = dict(store._db.execute("SELECT key, value FROM relay_meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION)
        assert store.waiters_put(["q"], [], T0 + 60_000, T0) == ["q"]
        assert store.waiters_put(["q"], [], T0 + 70_000, T0 + 10_000) == []
        [lease] = store.jobs_claim(["q"], "w1", 1, 60_000, T0 + 250)
        assert lease.job_id == old.job_id
    finally:
        store.close()
