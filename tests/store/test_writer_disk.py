"""The writer thread when the disk refuses a write (SQLITE_FULL, SQLITE_IOERR_*): every
command of the batch that writes is answered ``unavailable``, nothing of it is kept (the
in-memory counts included), commands that write nothing still get their own answers, and
the next batch commits. One warning per episode, one info when it ends.

Errors are injected by a connection wrapper (``FailingConnection``) on a chosen statement,
or made real by SQLite's ``max_page_count`` (a database that cannot grow).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from typing import Any

import pytest
import trio

from relay.protocol.errors import InternalError, JobNotFound, Unavailable
from relay.protocol.model import JobInfo, JobState, Lease, SubmitSpec, parse_job_id
from relay.server.requests import ops
from relay.store import commands as cmd
from relay.store.base import Changes
from relay.store.failures import store_error
from relay.store.sqlite import SqliteStore
from relay.store.writer import Writer, open_writer
from tests.conftest import T0
from tests.store.test_writer import (
    BOUND_S,
    Collect,
    FakeClock,
    committed_ids,
    hold_writer,
    one_batch,
    spec,
)

FULL_MESSAGE = "not committed: disk full (SQLITE_FULL); retry later"
IOERR_MESSAGE = "not committed: I/O error (SQLITE_IOERR); retry later"


def disk_error(code: int, name: str) -> sqlite3.OperationalError:
    """An error as sqlite3 raises it, with its result code."""
    exc = sqlite3.OperationalError(name)
    exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    exc.sqlite_errorname = name  # type: ignore[attr-defined]
    return exc


class FailingConnection:
    """The store's connection, except that ``fail_next`` makes a coming statement for which
    a test holds raise an error instead of running (once): the next one, or the nth."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._armed: list[list[Any]] = []  # [when, exc, matches still to let through]
        self.failed: list[str] = []

    def fail_next(self, when: Callable[[str], bool], exc: Exception, nth: int = 1) -> None:
        self._armed.append([when, exc, nth - 1])

    def execute(self, sql: str, *args: Any) -> Any:
        for entry in self._armed:
            if entry[0](sql):
                if entry[2]:
                    entry[2] -= 1
                    continue
                self._armed.remove(entry)
                self.failed.append(sql)
                raise entry[1]
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def failing_store(path: str) -> tuple[SqliteStore, FailingConnection]:
    store = SqliteStore.open(path)
    conn = FailingConnection(store._db)
    store._db = conn  # type: ignore[assignment]
    return store, conn


@pytest.fixture
def db_path(tmp_path) -> str:
    return str(tmp_path / "relay.db")


async def leased_job(writer: Writer) -> Lease:
    """A committed job, leased by worker "w"."""
    await writer.execute(cmd.Submit((spec(),)))
    (lease,) = await writer.execute(cmd.Claim(("q",), "w", 1, 60_000))
    return lease


# -- classification --------------------------------------------------------------------------


def test_full_and_io_errors_are_store_errors_with_their_kind():
    assert store_error(disk_error(sqlite3.SQLITE_FULL, "SQLITE_FULL"))[0] == "full"
    assert store_error(disk_error(sqlite3.SQLITE_IOERR, "SQLITE_IOERR"))[0] == "ioerr"
    # Extended codes carry the primary one in their low byte.
    for code in (sqlite3.SQLITE_IOERR_WRITE, sqlite3.SQLITE_IOERR_FSYNC, 266, 4874):
        assert store_error(disk_error(code, "SQLITE_IOERR_x"))[0] == "ioerr", code


def test_other_errors_are_not_store_errors():
    assert store_error(disk_error(sqlite3.SQLITE_BUSY, "SQLITE_BUSY")) is None
    assert store_error(disk_error(sqlite3.SQLITE_CONSTRAINT_UNIQUE, "x")) is None
    assert store_error(sqlite3.OperationalError("no code")) is None
    assert store_error(ZeroDivisionError()) is None


def test_a_store_error_hidden_behind_a_later_one_is_found():
    # A savepoint's ROLLBACK TO fails once SQLite rolled the transaction back: the error
    # raised is "no such savepoint", its context the disk's.
    try:
        try:
            raise disk_error(sqlite3.SQLITE_FULL, "SQLITE_FULL")
        except sqlite3.Error:
            raise sqlite3.OperationalError("no such savepoint: command") from None
    except sqlite3.Error as exc:
        hidden = exc
    assert store_error(hidden)[0] == "full"


# -- the transaction path -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "kind", "message"),
    [
        (sqlite3.SQLITE_FULL, "full", FULL_MESSAGE),
        (sqlite3.SQLITE_IOERR_WRITE, "ioerr", IOERR_MESSAGE),
    ],
)
async def test_a_commit_the_disk_refuses_answers_every_write_unavailable(
    db_path, code, kind, message
):
    store, conn = failing_store(db_path)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            lease = await leased_job(writer)
            before = await writer.execute(cmd.Stats())
            # (The first COMMIT is the batch that holds the writer for one_batch.)
            conn.fail_next(lambda sql: sql == "COMMIT", disk_error(code, "x"), nth=2)
            sink = await one_batch(writer, [
                ("submit", cmd.Submit((spec(), spec(queue="r")))),
                ("submit2", cmd.Submit((spec(),))),
                ("ack", cmd.Ack(lease.job_id, "w", lease.token)),
                ("stale", cmd.Ack("job_0000000000000001", "w", "t")),
                ("inspect", cmd.Inspect(lease.job_id)),
                ("stats", cmd.Stats()),
            ])  # fmt: skip
            after = await writer.execute(cmd.Stats())
            statistics = writer.statistics()
            # Space again: the same ack commits.
            await writer.execute(cmd.Ack(lease.job_id, "w", lease.token))
            recovered = await writer.execute(cmd.Stats())
    assert conn.failed == ["COMMIT"]
    out = sink.outcomes
    for tag in ("submit", "submit2", "ack"):
        assert isinstance(out[tag], Unavailable), out[tag]
        assert out[tag].code == "unavailable" and out[tag].message == message
    # What writes nothing is answered as it would have been: from what is committed.
    assert isinstance(out["stale"], JobNotFound)
    assert isinstance(out["inspect"], JobInfo) and out["inspect"].state == JobState.LEASED
    assert out["stats"] == before == after == {"q": {**zeros(), "leased": 1}}
    assert committed_ids(db_path) == {parse_job_id(lease.job_id)}
    assert statistics.failed_commits == 1
    assert statistics.store_errors == {
        "full": 0,
        "ioerr": 0,
        "connection": 0,
        "conflict": 0,
        kind: 1,
    }
    assert recovered == {"q": {**zeros(), "succeeded": 1}}


async def test_a_batch_the_disk_refuses_delivers_no_events(db_path):
    store, conn = failing_store(db_path)
    heard: list[Changes] = []
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            writer.commit_listeners.append(heard.append)
            writer.recording = True
            lease = await leased_job(writer)
            heard.clear()
            conn.fail_next(lambda sql: sql == "COMMIT", disk_error(sqlite3.SQLITE_FULL, "x"), nth=2)
            sink = await one_batch(writer, [
                ("submit", cmd.Submit((spec("lost"),))),
                ("ack", cmd.Ack(lease.job_id, "w", lease.token)),
                ("stale", cmd.Ack("job_0000000000000001", "w", "t")),
                ("inspect", cmd.Inspect(lease.job_id)),
            ])  # fmt: skip
            # (Its reads and refusals were run again, on what is committed.)
            assert isinstance(sink.outcomes["inspect"], JobInfo)
            await writer.execute(cmd.Ack(lease.job_id, "w", lease.token))
    assert conn.failed == ["COMMIT"]
    assert isinstance(sink.outcomes["ack"], Unavailable)
    # The gate's batch (no event), then the ack that committed: nothing of the lost batch.
    assert [c.events for c in heard] == [[], [(lease.job_id, "q", "succeeded", 1, T0, "leased")]]


async def test_a_plain_submit_batch_the_disk_refuses_delivers_no_events(db_path):
    store, conn = failing_store(db_path)
    heard: list[Changes] = []
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            writer.commit_listeners.append(heard.append)
            writer.recording = True
            conn.fail_next(
                lambda sql: sql.startswith("INSERT INTO jobs"),
                disk_error(sqlite3.SQLITE_FULL, "SQLITE_FULL"),
            )
            failed = await put_batch(writer, [(ops.SUBMIT, spec("lost")) for _ in range(3)])
            again = await put_batch(writer, [(ops.SUBMIT, spec("kept"))])
    assert len(conn.failed) == 1
    assert all(b"unavailable" in failed.outcomes[i] for i in range(3))
    kept = orjson_loads(again.outcomes[0])["job_id"]
    assert [event for c in heard for event in c.events] == [(kept, "kept", "ready", 0, T0, None)]


def zeros() -> dict[str, int]:
    return {str(state): 0 for state in JobState}


async def test_an_io_error_on_a_statement_answers_the_batch_unavailable(db_path):
    store, conn = failing_store(db_path)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            conn.fail_next(
                lambda sql: sql.startswith("INSERT INTO jobs"),
                disk_error(sqlite3.SQLITE_IOERR_WRITE, "SQLITE_IOERR_WRITE"),
            )
            sink = await one_batch(writer, [
                ("keyed", cmd.Submit((spec(idempotency_key="k"),))),
                ("plain", cmd.Submit((spec(),))),
            ])  # fmt: skip
            after = await writer.execute(cmd.Stats())
            again = await writer.execute(cmd.Submit((spec(idempotency_key="k"),)))
            stats = await writer.execute(cmd.Stats())
    assert len(conn.failed) == 1
    assert all(isinstance(o, Unavailable) for o in sink.outcomes.values()), sink.outcomes
    assert {o.message for o in sink.outcomes.values()} == {IOERR_MESSAGE}
    assert after == {}
    # The key was not kept either: the retry makes the job.
    assert again[0].duplicate is False
    assert stats == {"q": {**zeros(), "ready": 1}}
    assert committed_ids(db_path) == {parse_job_id(again[0].job_id)}


async def test_a_store_error_in_the_careful_pass_answers_the_batch_unavailable(db_path):
    # A refusal that wrote first sends the batch to the careful pass; the disk then fails
    # there, on a savepoint's statement.
    from tests.store.test_writer import WriteThenRefuse

    store, conn = failing_store(db_path)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            gate = await hold_writer(writer)
            sink = Collect(2)
            await writer.send(WriteThenRefuse(), sink, tag="refuse")
            await writer.send(cmd.Submit((spec(),)), sink, tag="submit")
            # The first pass runs no savepoint: this fails the second pass's first one.
            conn.fail_next(
                lambda sql: sql.startswith("SAVEPOINT"),
                disk_error(sqlite3.SQLITE_FULL, "SQLITE_FULL"),
            )
            gate.release.set()
            await sink.done.wait()
            stats = await writer.execute(cmd.Stats())
    assert conn.failed and conn.failed[0].startswith("SAVEPOINT")
    assert all(isinstance(o, Unavailable) for o in sink.outcomes.values()), sink.outcomes
    assert stats == {} and committed_ids(db_path) == set()


async def test_a_full_database_keeps_nothing_and_commits_again_once_it_has_room(db_path):
    # A real SQLITE_FULL: the database may not grow past a few pages more, so SQLite
    # itself fails the statement and rolls the transaction back.
    store = SqliteStore.open(db_path)
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    big = SubmitSpec("q", '"' + "x" * 400_000 + '"')
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            kept = await writer.execute(cmd.Submit((spec(),)))
            store._db.execute(f"PRAGMA max_page_count = {pages + 40}")
            sink = await one_batch(
                writer, [("big", cmd.Submit((big,))), ("small", cmd.Submit((spec(),)))]
            )
            full = await writer.execute(cmd.Stats())
            store._db.execute("PRAGMA max_page_count = 1073741823")  # room again
            retried = await writer.execute(cmd.Submit((big,)))
            stats = await writer.execute(cmd.Stats())
            statistics = writer.statistics()
    assert all(o.message == FULL_MESSAGE for o in sink.outcomes.values()), sink.outcomes
    assert full == {"q": {**zeros(), "ready": 1}}
    assert stats == {"q": {**zeros(), "ready": 2}}
    assert committed_ids(db_path) == {parse_job_id(r.job_id) for r in (*kept, *retried)}
    assert statistics.store_errors["full"] == 1


# -- the batch of plain submits alone (one statement, no transaction) ---------------------------


async def put_batch(writer: Writer, items: list[tuple[Any, Any]]) -> Collect:
    """Request ops ((op, args) pairs) as one batch of the writer thread."""
    gate = await hold_writer(writer)
    sink = Collect(len(items))
    for i, (op, args) in enumerate(items):
        writer.put((op, sink, i, trio.current_time(), args))
    gate.release.set()
    await sink.done.wait()
    return sink


async def test_a_full_disk_in_the_one_statement_path_answers_unavailable_at_once(db_path):
    store, conn = failing_store(db_path)
    statements: list[str] = []
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            conn.fail_next(
                lambda sql: sql.startswith("INSERT INTO jobs"),
                disk_error(sqlite3.SQLITE_FULL, "SQLITE_FULL"),
            )
            gate = await hold_writer(writer)
            sink = Collect(3)
            for i in range(3):
                writer.put((ops.SUBMIT, sink, i, trio.current_time(), spec()))
            store._db.set_trace_callback(statements.append)
            gate.release.set()
            await sink.done.wait()
            store._db.set_trace_callback(None)
            failed = await writer.execute(cmd.Stats())
            again = await put_batch(writer, [(ops.SUBMIT, spec()) for _ in range(3)])
            stats = await writer.execute(cmd.Stats())
            statistics = writer.statistics()
    replies = [orjson_loads(sink.outcomes[i]) for i in range(3)]
    assert [r["error"] for r in replies] == [{"code": "unavailable", "message": FULL_MESSAGE}] * 3
    # Answered from the one statement: the batch was not run again in a transaction.
    assert len(conn.failed) == 1
    assert statements == ["COMMIT"]  # the gate's batch, open meanwhile
    assert failed == {}
    ids = [orjson_loads(again.outcomes[i])["job_id"] for i in range(3)]
    assert stats == {"q": {**zeros(), "ready": 3}}
    assert committed_ids(db_path) == {parse_job_id(job_id) for job_id in ids}
    assert statistics.store_errors["full"] == 1


def orjson_loads(line: bytes) -> dict[str, Any]:
    import orjson

    return orjson.loads(line)


async def test_an_error_that_is_not_the_disk_s_is_still_internal(db_path):
    store, conn = failing_store(db_path)
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            conn.fail_next(lambda sql: sql == "COMMIT", sqlite3.OperationalError("odd"), nth=2)
            sink = await one_batch(writer, [(0, cmd.Submit((spec(),)))])
            statistics = writer.statistics()
    assert isinstance(sink.outcomes[0], InternalError)
    assert statistics.failed_commits == 1
    assert statistics.store_errors == {"full": 0, "ioerr": 0, "connection": 0, "conflict": 0}


# -- logs ---------------------------------------------------------------------------------------


async def test_an_episode_logs_one_warning_and_one_info_when_commits_succeed_again(db_path, caplog):
    caplog.set_level(logging.DEBUG, logger="relay.writer")
    store, conn = failing_store(db_path)
    full = disk_error(sqlite3.SQLITE_FULL, "SQLITE_FULL")
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock()) as writer:
            for _ in range(3):
                conn.fail_next(lambda sql: sql == "COMMIT", full)
                with pytest.raises(Unavailable):
                    await writer.execute(cmd.Submit((spec(),)))
            # A batch that writes nothing commits, but says nothing of the disk.
            await writer.execute(cmd.Stats())
            events_during = [r.getMessage() for r in store_events(caplog)]
            await writer.execute(cmd.Submit((spec(),)))
            await writer.execute(cmd.Submit((spec(),)))
    events = [(r.levelno, r.getMessage()) for r in store_events(caplog)]
    assert events_during == ["store.unavailable"]
    assert events == [(logging.WARNING, "store.unavailable"), (logging.INFO, "store.available")]
    available = store_events(caplog)[1].fields  # type: ignore[attr-defined]
    assert available["kind"] == "full" and available["failed_batches"] == 3


def store_events(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("store.")]


# -- the lease recovery at start ---------------------------------------------------------------


async def test_a_lease_recovery_the_disk_refuses_comes_before_every_other_write(db_path):
    """A previous process left a job leased; the recovery of it cannot commit at first.
    Until it has, every write is answered unavailable (the old lease's ack too), reads are
    answered; the first batch that finds room commits the recovery before its own items."""
    with trio.fail_after(BOUND_S):
        async with open_writer(SqliteStore.open(db_path), clock=FakeClock()) as writer:
            orphan = await leased_job(writer)
            await writer.execute(cmd.Submit((spec(),)))  # a ready one
    store, conn = failing_store(db_path)
    recovery = "UPDATE jobs SET state = 'ready', attempt = attempt - 1"
    for _ in range(3):  # at start, and before each of one_batch's two batches
        conn.fail_next(lambda sql: sql.startswith(recovery), disk_error(sqlite3.SQLITE_FULL, "x"))
    with trio.fail_after(BOUND_S):
        async with open_writer(store, clock=FakeClock(), recover=True) as writer:
            assert len(conn.failed) == 1  # tried before the writer is handed out
            sink = await one_batch(writer, [
                ("claim", cmd.Claim(("q",), "v", 10, 60_000)),
                ("renew", cmd.Renew(orphan.job_id, "w", orphan.token, 60_000)),
                ("ack", cmd.Ack(orphan.job_id, "w", orphan.token)),
                ("inspect", cmd.Inspect(orphan.job_id)),
            ])  # fmt: skip
            assert len(conn.failed) == 3
            # Room again: the recovery commits first, then the claim takes both jobs.
            claimed = await writer.execute(cmd.Claim(("q",), "v", 10, 60_000))
            stale = await one_batch(writer, [("ack", cmd.Ack(orphan.job_id, "w", orphan.token))])
    out = sink.outcomes
    for tag in ("claim", "renew", "ack"):
        assert isinstance(out[tag], Unavailable) and out[tag].message == FULL_MESSAGE, out[tag]
    assert out["inspect"].state == JobState.LEASED
    assert sorted(lease.job_id for lease in claimed)[0] == orphan.job_id
    assert len(claimed) == 2
    assert [lease.attempt for lease in claimed if lease.job_id == orphan.job_id] == [1]
    assert stale.outcomes["ack"].code in ("lease_expired", "stale_token")
