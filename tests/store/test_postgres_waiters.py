"""The table ``waiters`` (relay/store/postgres/waiters.py) and what it decides: whether a
commit that only made jobs ready notifies the other servers (relay/store/postgres/notify.py).

The notification channel is the database's, not a schema's: a listener here keeps only
the notifications of the stores of its test (by their ``origin``), and knows it has heard
all a commit sent once a marker it sends itself after that commit arrives (notifications
of one channel arrive in the order of their commits).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import orjson
import psycopg
import pytest
from psycopg import sql

from relay.protocol.model import SubmitSpec
from relay.store.base import Changes
from relay.store.postgres import PostgresStore, notify
from relay.store.postgres.notify import EVERY
from relay.store.postgres.waiters import STALE_MS
from tests.conftest import T0

# (The stores of ``servers`` fail a statement that waits for a row lock: a put never waits
# for another server's rows.)
# The longest a listener waits for its own marker: it comes at once unless something is
# wrong.
HEAR_S = 10.0
UNTIL = T0 + 60_000


class Listener:
    """A connection that LISTENs on the channel of the stores' notifications."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    def heard(self, store: PostgresStore) -> list[dict]:
        """The notifications sent by ``store`` (its origin) since the last call, as their
        JSON: all that were sent before this call, since the marker sent now comes after."""
        marker = orjson.dumps({"o": f"marker-{secrets.token_hex(8)}"}).decode()
        self.conn.execute("SELECT pg_notify(%s, %s)", (notify.CHANNEL, marker))
        notes: list[dict] = []
        for note in self.conn.notifies(timeout=HEAR_S):
            if note.channel != notify.CHANNEL:
                continue
            if note.payload == marker:
                return notes
            try:
                parsed = orjson.loads(note.payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(parsed, dict) and parsed.get("o") == store.origin:
                notes.append(parsed)
        pytest.fail(f"the marker did not arrive within {HEAR_S} s")


@pytest.fixture
def listener(url: str) -> Iterator[Listener]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notify.CHANNEL)))
        yield Listener(conn)


def rows(store: PostgresStore) -> list[tuple[str, str, int]]:
    """Every row of ``waiters``, (queue, origin, until), in order."""
    return store._db.execute("SELECT queue, origin, until FROM waiters ORDER BY 1, 2").fetchall()


def submit(store: PostgresStore, queue: str = "q", now: int = T0, **kw: object) -> None:
    """One job submitted through ``store`` in a transaction of the writer's, committed
    (and notified of, if at all) before this returns."""
    store.take_changes()  # (nothing left of earlier calls outside a transaction)
    store.begin()
    store.jobs_submit([SubmitSpec(queue, '{"n": 1}', **kw)], now)  # type: ignore[arg-type]
    store.commit()


# -- waiters_put ---------------------------------------------------------------------------


def test_a_first_put_inserts_every_queue_and_returns_them_all_as_new(servers):
    a = servers()
    assert sorted(a.waiters_put(["q", "other", EVERY], [], UNTIL, T0)) == [EVERY, "other", "q"]
    assert rows(a) == [(EVERY, a.origin, UNTIL), ("other", a.origin, UNTIL), ("q", a.origin, UNTIL)]


def test_a_put_again_returns_no_queue_and_renews_their_until(servers):
    a = servers()
    a.waiters_put(["q", "other"], [], UNTIL, T0)
    assert a.waiters_put(["q", "other"], [], UNTIL + 5_000, T0 + 5_000) == []
    assert rows(a) == [("other", a.origin, UNTIL + 5_000), ("q", a.origin, UNTIL + 5_000)]
    # Only the queue that had no row is new; the one that had is renewed, the other kept.
    assert a.waiters_put(["q", "third"], [], UNTIL + 9_000, T0 + 9_000) == ["third"]
    assert rows(a) == [
        ("other", a.origin, UNTIL + 5_000),
        ("q", a.origin, UNTIL + 9_000),
        ("third", a.origin, UNTIL + 9_000),
    ]


def test_each_server_has_its_own_row_for_a_queue(servers):
    a, b = servers(), servers()
    assert a.waiters_put(["q"], [], UNTIL, T0) == ["q"]
    assert b.waiters_put(["q"], [], UNTIL + 1, T0) == ["q"]  # (a's row is not b's)
    assert sorted(rows(a)) == sorted([("q", a.origin, UNTIL), ("q", b.origin, UNTIL + 1)])


def test_a_drop_removes_only_this_servers_rows_of_those_queues(servers):
    a, b = servers(), servers()
    a.waiters_put(["q", "other", "kept"], [], UNTIL, T0)
    b.waiters_put(["q", "other"], [], UNTIL, T0)
    assert a.waiters_put([], ["q", "other", "never held"], UNTIL, T0 + 1) == []
    assert sorted(rows(a)) == sorted(
        [("kept", a.origin, UNTIL), ("other", b.origin, UNTIL), ("q", b.origin, UNTIL)]
    )
    # Put and drop in one call; a queue dropped can be put again, as new.
    assert a.waiters_put(["q"], ["kept"], UNTIL, T0 + 2) == ["q"]
    assert sorted(rows(a)) == sorted(
        [("other", b.origin, UNTIL), ("q", a.origin, UNTIL), ("q", b.origin, UNTIL)]
    )


def test_a_put_removes_other_servers_rows_left_stale_and_keeps_fresher_ones(servers):
    a, b, c = servers(), servers(), servers()
    b.waiters_put(["stale", "q"], [], T0, T0 - 60_000)
    b.waiters_put(["fresh"], [], T0 + 1, T0 - 60_000)
    c.waiters_put(["q"], [], T0 + 2, T0 - 60_000)
    a.waiters_put(["mine"], [], T0, T0 - 60_000)  # (its own, as stale: never removed by it)
    # Exactly STALE_MS past its until: not yet.
    assert a.waiters_put([], [], UNTIL, T0 + STALE_MS) == []
    assert len(rows(a)) == 5
    # One ms later: b's rows whose until passed by more than STALE_MS go, whatever queue,
    # and only those; even by a put that puts and drops nothing.
    a.waiters_put([], [], UNTIL, T0 + STALE_MS + 1)
    assert sorted(rows(a)) == sorted(
        [
            ("mine", a.origin, T0),
            ("fresh", b.origin, T0 + 1),
            ("q", c.origin, T0 + 2),
        ]
    )
    # Any other server removes a's own left behind (and c's, now stale too), not its own.
    assert b.waiters_put(["q"], [], UNTIL + STALE_MS, T0 + STALE_MS + 3) == ["q"]
    assert rows(a) == [("fresh", b.origin, T0 + 1), ("q", b.origin, UNTIL + STALE_MS)]


def test_a_put_skips_a_stale_row_another_server_holds_locked_without_waiting(servers):
    a, b = servers(), servers()
    b.waiters_put(["q", "free"], [], T0, T0 - 60_000)
    b.begin()
    b.waiters_put(["q"], [], T0, T0 - 60_000)  # (b's row of q locked until b commits)
    # Waiting for b's lock would fail the put (lock_timeout): it skips that row instead.
    a.waiters_put(["mine"], [], UNTIL + STALE_MS, T0 + STALE_MS + 1)
    b.commit()
    assert sorted(rows(a)) == sorted([("mine", a.origin, UNTIL + STALE_MS), ("q", b.origin, T0)])
    a.waiters_put([], [], UNTIL + STALE_MS, T0 + STALE_MS + 1)  # (unlocked now: removed)
    assert rows(a) == [("mine", a.origin, UNTIL + STALE_MS)]


def test_a_put_that_fails_in_a_transaction_leaves_no_row(servers):
    a = servers()
    a.begin()
    assert a.waiters_put(["q"], [], UNTIL, T0) == ["q"]
    a.rollback()
    assert rows(a) == []
    assert a.waiters_put(["q"], [], UNTIL, T0) == ["q"]  # (new again)


# -- the notification of a commit that made jobs ready ---------------------------------------


def test_a_ready_job_notifies_no_one_when_no_other_server_waits(servers, listener):
    a = servers()
    submit(a)
    assert listener.heard(a) == []
    # The listener does hear a's notifications: one b waits for, just after.
    servers().waiters_put(["q"], [], UNTIL, T0)
    submit(a)
    assert [note["q"] for note in listener.heard(a)] == [["q"]]


def test_a_ready_job_notifies_when_another_server_waits_on_its_queue(servers, listener):
    a, b = servers(), servers()
    assert b.waiters_put(["q"], [], UNTIL, T0) == ["q"]
    submit(a)
    [note] = listener.heard(a)
    assert note["o"] == a.origin and "q" in note["q"]
    heard = notify.parse(orjson.dumps(note).decode(), b.origin)
    assert isinstance(heard, Changes) and heard.ready_counts == {"q": 1}
    # Once b drops its row, a's next commit to q tells no one again.
    b.waiters_put([], ["q"], UNTIL, T0 + 1)
    submit(a, now=T0 + 1)
    assert listener.heard(a) == []


def test_a_ready_job_notifies_when_another_server_waits_on_every_queue(servers, listener):
    a, b = servers(), servers()
    b.waiters_put([EVERY], [], UNTIL, T0)
    for queue in ("q", "any", "x" * 128):
        submit(a, queue)
        assert [note["q"] for note in listener.heard(a)] == [[queue]]


def test_a_servers_own_row_does_not_make_it_notify(servers, listener):
    a = servers()
    a.waiters_put(["q", EVERY], [], UNTIL, T0)
    submit(a)
    assert listener.heard(a) == []
    servers().waiters_put(["q"], [], UNTIL, T0)  # (another's: now it does)
    submit(a)
    assert len(listener.heard(a)) == 1


def test_a_row_for_another_queue_does_not_make_a_commit_notify(servers, listener):
    a, b = servers(), servers()
    b.waiters_put(["other", "qq", "Q"], [], UNTIL, T0)
    submit(a)
    assert listener.heard(a) == []
    submit(a, "other")  # (the queue b waits on: told)
    assert [note["q"] for note in listener.heard(a)] == [["other"]]


def test_a_commit_readying_several_queues_notifies_if_one_of_them_is_waited_on(servers, listener):
    a, b = servers(), servers()
    b.waiters_put(["c"], [], UNTIL, T0)
    a.take_changes()
    a.begin()
    a.jobs_submit([SubmitSpec(queue, "{}") for queue in ("a", "b", "c", "c")], T0)
    a.commit()
    [note] = listener.heard(a)
    assert note["q"] == ["a", "b", "c"] and note["n"] == [1, 1, 2]


def test_a_delayed_job_notifies_though_no_one_waits(servers, listener):
    a = servers()
    submit(a, delay_ms=60_000)
    [note] = listener.heard(a)
    assert note["d"] == T0 + 60_000 and note["q"] == []
    # A ready job and a delayed one in one commit: told for the due time, so unconditionally.
    a.take_changes()
    a.begin()
    a.jobs_submit([SubmitSpec("q", "{}"), SubmitSpec("q", "{}", delay_ms=1_000)], T0 + 1)
    a.commit()
    [note] = listener.heard(a)
    assert note["d"] == T0 + 1_001 and note["q"] == ["q"]


def test_a_commit_readying_more_queues_than_fit_notifies_every_queue_though_no_one_waits(
    servers, listener
):
    a = servers()
    queues = [f"{i:03d}" + "x" * 125 for i in range(80)]  # (128 characters each)
    a.take_changes()
    a.begin()
    a.jobs_submit([SubmitSpec(queue, "{}") for queue in queues], T0)
    a.commit()
    [note] = listener.heard(a)
    assert note["all"] is True and note["q"] == []


def test_a_commit_with_nothing_to_tell_notifies_no_one_even_if_waited_on(servers, listener):
    a, b = servers(), servers()
    b.waiters_put(["q", EVERY], [], UNTIL, T0)
    submit(a)
    assert len(listener.heard(a)) == 1
    a.take_changes()
    a.waiters_put(["q"], [], UNTIL, T0)  # (a commit that readies nothing)
    assert listener.heard(a) == []


# -- notify.statement ----------------------------------------------------------------------


def ready(*queues: str) -> Changes:
    changes = Changes()
    for queue in queues:
        changes.made_ready(queue)
    return changes


def test_a_statement_for_ready_jobs_only_is_conditional_on_a_waiter():
    changes = ready("b", "a", "b")
    sent, params = notify.statement("me", changes)  # type: ignore[misc]
    assert sent == notify.NOTIFY_IF_WAITED
    assert params == (notify.payload("me", changes), [EVERY, "a", "b"], "me")
    assert orjson.loads(params[0]) == {"o": "me", "q": ["a", "b"], "n": [1, 2]}
    assert sent.startswith(notify.NOTIFY) and sent.count("%s") == 3


def test_a_statement_for_ready_jobs_and_an_expiry_not_told_is_conditional():
    changes = ready("q")
    changes.expiry(T0)
    sent, params = notify.statement("me", changes, expiry=False)  # type: ignore[misc]
    assert sent == notify.NOTIFY_IF_WAITED
    assert params == (notify.payload("me", changes, False), [EVERY, "q"], "me")
    assert "e" not in orjson.loads(params[0])


@pytest.mark.parametrize("deadline", ["due", "expiry", "schedule"])
@pytest.mark.parametrize("queues", [(), ("q",)])
def test_a_statement_that_tells_a_deadline_notifies_unconditionally(deadline, queues):
    changes = ready(*queues)
    getattr(changes, deadline)(T0)
    assert notify.statement("me", changes) == (notify.NOTIFY, (notify.payload("me", changes),))
    note = orjson.loads(notify.payload("me", changes) or "")
    assert note[{"due": "d", "expiry": "e", "schedule": "s"}[deadline]] == T0
    assert note["q"] == list(queues)


def test_no_statement_for_a_commit_with_nothing_to_tell():
    assert notify.statement("me", Changes()) is None
    expiry_only = Changes()
    expiry_only.expiry(T0)
    assert notify.statement("me", expiry_only, expiry=False) is None


def test_a_statement_for_more_queues_than_fit_is_unconditional_and_says_every_queue():
    changes = ready(*(f"{i:04d}" + "x" * 124 for i in range(100)))
    sent, params = notify.statement("me", changes)  # type: ignore[misc]
    assert sent == notify.NOTIFY and len(params) == 1
    assert orjson.loads(params[0]) == {"o": "me", "q": [], "all": True}
    assert len(params[0].encode()) < notify.MAX_PAYLOAD


def test_a_statement_for_queues_that_just_fit_stays_conditional():
    """The largest set of queues whose payload fits: named, and conditional."""
    queues: list[str] = []
    for i in range(1_000):  # (the payload says "every queue" once they do not fit)
        more = [*queues, f"{i:04d}" + "x" * 124]
        text = notify.payload("me", ready(*more))
        assert text is not None
        if orjson.loads(text).get("all"):
            break
        queues = more
    assert queues and len(notify.payload("me", ready(*queues)).encode()) < notify.MAX_PAYLOAD
    sent, params = notify.statement("me", ready(*queues))  # type: ignore[misc]
    assert sent == notify.NOTIFY_IF_WAITED
    assert orjson.loads(params[0])["q"] == sorted(queues)
    assert params[1] == [EVERY, *sorted(queues)]
    sent, _ = notify.statement("me", ready(*queues, "zzzz" + "x" * 124))  # type: ignore[misc]
    assert sent == notify.NOTIFY


def test_a_commit_that_tells_of_ready_jobs_only_leaves_the_expiry_told_as_it_was(servers, listener):
    """A lease expiry is told once while it is ahead; a notification of ready jobs in
    between (which carries none) does not make the next claim tell its expiry again."""
    a, b = servers(), servers()
    b.waiters_put(["r"], [], UNTIL, T0)
    for _ in range(2):
        submit(a)  # (nobody waits on q: not told)
    a.take_changes()
    lease_ms = 30_000
    a.jobs_claim(["q"], "w", 1, lease_ms, T0 + 1)
    submit(a, queue="r", now=T0 + 2)
    a.take_changes()
    a.jobs_claim(["q"], "w", 1, lease_ms, T0 + 3)  # (its expiry is after the one told)
    heard = listener.heard(a)
    assert [(note.get("e"), note["q"]) for note in heard] == [
        (T0 + 1 + lease_ms, []),
        (None, ["r"]),
    ], heard
