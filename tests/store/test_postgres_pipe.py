"""``Pipe``, the PostgreSQL store's round trips: what it sends, what it gives back, and
that a failure leaves the connection ready for the next statement."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from relay.store.postgres.pipe import MAX_PREPARED, Pipe


@pytest.fixture
def conn(pg_url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        yield conn


def prepared(conn: psycopg.Connection) -> list[str]:
    rows = conn.execute("SELECT statement FROM pg_prepared_statements ORDER BY name")
    return [statement for (statement,) in rows]


def test_statements_go_in_one_round_trip_and_each_is_prepared_once(conn):
    pipe = Pipe(conn)
    for n in (1, 2, 3):
        results = pipe.run(
            [
                ("SELECT %s::int + %s::int", (n, 1)),
                ("SELECT x FROM unnest(%b::text[]) AS x ORDER BY x", (["b", "a", str(n)],)),
                ("SELECT %(a)s::int * %(b)s::int, %(a)s::int", {"a": n, "b": 10}),
            ]
        )
        assert [r.rows for r in results] == [[(n + 1,)], [(str(n),), ("a",), ("b",)], [(n * 10, n)]]
        assert [r.rowcount for r in results] == [1, 3, 1]
    assert pipe.round_trips == 3
    # The same text, the same types: prepared once each (a named parameter used twice is
    # one parameter of the statement).
    assert sorted(prepared(conn)) == [
        "SELECT $1::int * $2::int, $1::int",
        "SELECT $1::int + $2::int",
        "SELECT x FROM unnest($1::text[]) AS x ORDER BY x",
    ]


def test_placeholders_and_percent_signs_are_read_as_psycopg_reads_them(conn):
    pipe = Pipe(conn)
    conn.execute("CREATE TEMPORARY TABLE t (s text)")
    [insert, select, plain] = pipe.run(
        [
            ("INSERT INTO t VALUES (%s), (%s)", ("50%", "x")),
            ("SELECT s FROM t WHERE s LIKE '%%\\%%' AND %s", (True,)),
            ("SELECT '%%', '%s'", None),  # (no values: the text as it is)
        ]
    )
    assert (insert.rowcount, insert.statusmessage, insert.rows) == (2, "INSERT 0 2", [])
    assert (select.fetchall(), select.fetchone()) == ([("50%",)], ("50%",))
    assert plain.rows == [("%%", "%s")]
    for sql, params in [
        ("SELECT %x", (1,)),
        ("SELECT 1 %", (1,)),
        ("SELECT %(a)s, %s", {"a": 1}),
        ("SELECT %(a)s, %(b)s", {"a": 1}),
    ]:
        with pytest.raises(psycopg.ProgrammingError):
            pipe.run([(sql, params)])
    assert pipe.run([("SELECT %(a)s::int", {"a": 5})])[0].rows == [(5,)]


def test_a_failure_raises_the_error_a_cursor_would_and_skips_the_rest(conn):
    pipe = Pipe(conn)
    conn.execute("CREATE TEMPORARY TABLE t (n int)")
    with pytest.raises(psycopg.errors.DivisionByZero):
        pipe.run(
            [
                ("BEGIN", None),
                ("INSERT INTO t VALUES (%s)", (1,)),
                ("SELECT 1 / %s", (0,)),
                ("INSERT INTO t VALUES (%s)", (2,)),
            ]
        )
    # What ran before the failure, in order; the transaction has failed, nothing more ran.
    assert [r.statusmessage for r in pipe.completed] == ["BEGIN", "INSERT 0 1"]
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
    conn.execute("ROLLBACK")
    # The statement whose preparing was skipped is prepared when it next runs.
    [inserted] = pipe.run([("INSERT INTO t VALUES (%s)", (3,))])
    assert inserted.rowcount == 1
    assert conn.execute("SELECT n FROM t").fetchall() == [(3,)]


def test_a_value_that_cannot_be_sent_raises_and_leaves_the_connection_ready(conn):
    pipe = Pipe(conn)
    with pytest.raises(psycopg.ProgrammingError):
        pipe.run([("SELECT 1", None), ("SELECT %s", (object(),))])
    assert [r.rows for r in pipe.completed] == [[(1,)]]  # (the statement before it ran)
    with pytest.raises(psycopg.ProgrammingError):
        pipe.run([("SELECT %s, %s", (1,))])  # (a value too few)
    assert pipe.run([("SELECT %s::int", (7,))])[0].rows == [(7,)]
    assert conn.execute("SELECT 8").fetchone() == (8,)


def test_a_statement_failed_by_postgresql_is_what_raises_also_if_sending_stopped(conn):
    pipe = Pipe(conn)
    pipe.run([("BEGIN", None)])
    with pytest.raises(psycopg.errors.DivisionByZero) as raised:
        pipe.run([("SELECT 1 / %s", (0,)), ("SELECT %s", (object(),))])
    assert isinstance(raised.value.__cause__, psycopg.ProgrammingError)
    conn.execute("ROLLBACK")


def test_a_statement_libpq_refuses_to_send_is_not_thought_prepared(conn):
    pipe = Pipe(conn)
    many = 70_000  # (more parameters than the protocol carries)
    sql = "SELECT " + "+".join(["%s::int"] * many)
    for _ in range(2):
        with pytest.raises(psycopg.Error):
            pipe.run([("SELECT 1", None), (sql, [1] * many)])
        assert pipe.run([("SELECT %s::int", (2,))])[0].rows == [(2,)]
    assert len(prepared(conn)) == len(pipe._prepared) == 2


def test_an_error_of_the_sync_itself_raises_after_every_statement_ran(conn):
    """The commit of an implicit transaction happens at the sync: a deferred constraint
    (here) or a NOTIFY over a full notification queue fail there, after the statements."""
    pipe = Pipe(conn)
    conn.execute("CREATE TEMPORARY TABLE t (n int)")
    conn.execute("CREATE TEMPORARY TABLE later (n int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    with pytest.raises(psycopg.errors.UniqueViolation):
        pipe.run(
            [
                ("BEGIN", None),
                ("INSERT INTO t VALUES (%s)", (1,)),
                ("COMMIT", None),
                ("INSERT INTO later VALUES (%s), (%s)", (1, 1)),
            ]
        )
    assert [r.statusmessage for r in pipe.completed] == [
        "BEGIN",
        "INSERT 0 1",
        "COMMIT",
        "INSERT 0 2",
    ]
    assert conn.execute("SELECT count(*) FROM t").fetchone() == (1,)
    assert conn.execute("SELECT count(*) FROM later").fetchone() == (0,)
    assert pipe.run([("SELECT %s::int", (3,))])[0].rows == [(3,)]


def test_its_statements_outlive_a_rollback_and_come_back_after_a_deallocate(conn):
    pipe = Pipe(conn)
    pipe.run([("BEGIN", None), ("SELECT %s::int", (1,))])
    for _ in range(6):  # (psycopg would prepare a statement of its own by now)
        conn.execute("SELECT 1")
    conn.execute("ROLLBACK")  # (psycopg deallocates every statement after one it prepared)
    assert pipe.run([("SELECT %s::int", (2,))])[0].rows == [(2,)]
    conn.execute("DEALLOCATE ALL")
    with pytest.raises(psycopg.errors.InvalidSqlStatementName):
        pipe.run([("SELECT %s::int", (3,))])
    assert pipe.run([("SELECT %s::int", (4,))])[0].rows == [(4,)]


def test_a_round_trip_larger_than_the_sockets_buffers_is_sent_whole(conn):
    pipe = Pipe(conn)
    large = "x" * 8_000_000  # (both ways: PostgreSQL answers while it is still sent)
    results = pipe.run([("SELECT length(%s), %s", (large, large))] * 3)
    assert [(r.rows[0][0], len(r.rows[0][1])) for r in results] == [(8_000_000,) * 2] * 3


def test_past_its_bound_a_statement_runs_unprepared(conn, monkeypatch):
    monkeypatch.setattr("relay.store.postgres.pipe.MAX_PREPARED", 2)
    pipe = Pipe(conn)
    for n in range(4):
        assert pipe.run([(f"SELECT {n} + %s::int", (1,))])[0].rows == [(n + 1,)]
    assert len(prepared(conn)) == 2 < MAX_PREPARED
