"""``Pipe``: a list of statements sent to PostgreSQL in one round trip, through libpq's
pipeline mode, each statement prepared once per connection.

psycopg's own pipeline (``Connection.pipeline``) gives every statement a cursor, a queue of
pending results and a send of its own; for the writer's few statements per transaction that
cost more of the writer thread's time than the database took to run them (measured in
docs/benchmarking.md, "The writer's own share"). Here the statements' parameters are
adapted by psycopg's ``Transformer`` exactly as a cursor adapts them, and their rows loaded
by it too: the values are the same either way. What is left out is what the store never
uses: server-side cursors, COPY, several statements in one string.

Not thread-safe: the store's one thread uses it, between the connection's own statements
(the connection is out of pipeline mode before and after each round trip).
"""

from __future__ import annotations

import re
import select
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer

# At most this many statements are prepared on one connection (the store's SQL is a fixed
# set, but a statement is prepared once per set of parameter types: psycopg dumps an int as
# int2, int4 or int8 by its value). Past it, a statement is parsed and planned at each run.
MAX_PREPARED = 512

# A placeholder as psycopg writes them: %s (any format), %b (binary), %t (text), each
# optionally named, %(name)s; %% is a percent sign. Anything else after a % is refused.
_PLACEHOLDER = re.compile(rb"%(?:\(([^)]*)\))?(.?)", re.DOTALL)
_FORMATS = {b"s": PyFormat.AUTO, b"b": PyFormat.BINARY, b"t": PyFormat.TEXT}

_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK, pq.ExecStatus.EMPTY_QUERY)


class Result:
    """A statement's outcome: its rows (loaded as a cursor's default rows, tuples), the
    rows it changed or returned (``rowcount``, -1 if its command tag says none) and its
    command tag (``statusmessage``, e.g. "COMMIT")."""

    __slots__ = ("rowcount", "rows", "statusmessage")

    def __init__(self, rows: list[tuple], rowcount: int, statusmessage: str) -> None:
        self.rows = rows
        self.rowcount = rowcount
        self.statusmessage = statusmessage

    def fetchall(self) -> list[tuple]:
        return self.rows

    def fetchone(self) -> tuple | None:
        return self.rows[0] if self.rows else None

    def __iter__(self) -> Any:
        return iter(self.rows)


class _Statement:
    """A statement's SQL in PostgreSQL's form ($1, $2, ...), and how to take its
    parameters: by position, or by name (``names``), each in its psycopg format. Without
    parameters (None) the text goes as it is, as psycopg sends it then."""

    __slots__ = ("formats", "names", "query")

    def __init__(self, sql: str, plain: bool = False) -> None:
        self.names: tuple[str, ...] | None = None
        self.formats: tuple[PyFormat, ...] = ()
        self.query = text = sql.encode()
        if plain:
            return
        parts: list[bytes] = []
        names: list[str] = []
        formats: list[PyFormat] = []
        named: set[bool] = set()
        position = 0
        for match in _PLACEHOLDER.finditer(text):
            parts.append(text[position : match.start()])
            position = match.end()
            name, kind = match.groups()
            if kind == b"%" and name is None:
                parts.append(b"%")
                continue
            if kind not in _FORMATS or name == b"":
                raise psycopg.ProgrammingError(
                    f"only %s, %b, %t (or named: %(name)s) are placeholders: {sql!r}"
                )
            named.add(name is not None)
            if name is not None and name.decode() in names:  # (a name used twice: once)
                parts.append(b"$%d" % (names.index(name.decode()) + 1))
                continue
            names.append(name.decode() if name is not None else "")
            formats.append(_FORMATS[kind])
            parts.append(b"$%d" % len(formats))
        parts.append(text[position:])
        if len(named) > 1:
            raise psycopg.ProgrammingError(f"placeholders both named and not: {sql!r}")
        self.query = b"".join(parts)
        self.names = tuple(names) if named == {True} else None
        self.formats = tuple(formats)

    def values(self, params: Any) -> Sequence[Any]:
        if params is None:
            params = ()
        if self.names is not None:
            missing = [name for name in self.names if name not in params]
            if missing:
                raise psycopg.ProgrammingError(f"query parameters missing: {missing}")
            return [params[name] for name in self.names]
        if len(params) != len(self.formats):
            raise psycopg.ProgrammingError(
                f"the query has {len(self.formats)} placeholders, {len(params)} values given"
            )
        return params


class Pipe:
    """Sends statements over ``conn`` in round trips of one pipeline each (``run``), and
    counts them (``round_trips``).

    A statement's first run prepares it (a name per SQL text and parameter types), in
    the same round trip; later runs send only its parameters. If one statement fails,
    PostgreSQL skips the rest of the round trip; ``run`` raises the failure as the
    psycopg error a cursor would raise (after every result has been read: the connection
    is ready for the next statement, its transaction failed). The round trip's sync can
    fail too, after every statement ran (the commit of an implicit transaction): its
    error is raised then, and ``completed`` holds every statement's outcome.
    """

    def __init__(self, conn: psycopg.Connection) -> None:
        # psycopg prepares no statement of its own on this connection: once it has, a
        # ROLLBACK it runs makes it deallocate every prepared statement, ours too.
        conn.prepare_threshold = None
        self._conn = conn
        self._pg = conn.pgconn
        self._tx = Transformer(conn)
        # Statements by text (and whether they take values), converted once; the store's
        # texts are its code's, a few hundred at most.
        self._statements: dict[tuple[str, bool], _Statement] = {}
        self._prepared: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
        self._names = 0  # (names given so far: each name is given once)
        self._poll = select.poll()
        self._poll.register(self._pg.socket, select.POLLIN)
        self.round_trips = 0
        # The outcomes of the last run's statements that ran, up to the one that failed
        # (all of them if none did).
        self.completed: list[Result] = []

    def run(self, statements: Sequence[tuple[str, Any]]) -> list[Result]:
        """Run ``statements`` (sql, params) in order, in one round trip; their results."""
        pg = self._pg
        self.completed = []
        sent: list[bytes | None] = []  # (per result expected: the name being prepared)
        refused: Exception | None = None  # (a statement that could not be sent)
        pg.enter_pipeline_mode()
        try:
            try:
                for sql, params in statements:
                    self._send(sql, params, sent)
            except Exception as exc:
                if pg.status != pq.ConnStatus.OK:
                    raise  # (the connection is lost: nothing more can be read)
                # A value psycopg cannot adapt, say: those sent before it run, as a
                # cursor's would have, and the caller, raising, rolls back; the
                # connection is left ready either way.
                refused = exc
            pg.pipeline_sync()
            self._send_all()
            results = self._receive()
            self._settle(sent, results)
        finally:
            if pg.pipeline_status != pq.PipelineStatus.OFF and pg.status == pq.ConnStatus.OK:
                pg.exit_pipeline_mode()
        self.round_trips += 1
        return self._outcomes(sent, results, refused)

    def _send(self, sql: str, params: Any, sent: list[bytes | None]) -> None:
        pg = self._pg
        tx = self._tx
        plain = params is None
        statement = self._statements.get((sql, plain))
        if statement is None:
            statement = self._statements[sql, plain] = _Statement(sql, plain)
        values = tx.dump_sequence(statement.values(params), statement.formats)
        types = tuple(tx.types or ())
        formats = tx.formats or ()
        name = self._prepared.get((statement.query, types))
        if name is None and len(self._prepared) < MAX_PREPARED:
            self._names += 1
            name = b"relay_%d" % self._names
            pg.send_prepare(name, statement.query, param_types=types)
            # (once libpq took it; if PostgreSQL refuses it, _settle forgets it)
            self._prepared[statement.query, types] = name
            sent.append(name)
        if name is None:
            pg.send_query_params(statement.query, values, types, formats)
        else:
            pg.send_query_prepared(name, values, formats)
        sent.append(None)

    def _send_all(self) -> None:
        """Flush what libpq holds, reading results meanwhile if the socket's way out is
        full (PostgreSQL may be waiting for room to send them)."""
        pg = self._pg
        poll = self._poll
        while pg.flush():
            poll.modify(pg.socket, select.POLLIN | select.POLLOUT)
            try:
                for _, events in poll.poll():
                    if events & select.POLLIN:
                        pg.consume_input()
            finally:
                poll.modify(pg.socket, select.POLLIN)

    def _receive(self) -> list[pq.abc.PGresult]:
        """Every result up to the pipeline's sync: one per command sent (a skipped
        command's says so), and an error of the sync itself if it failed (the commit of
        an implicit transaction, e.g. a NOTIFY's over a full notification queue)."""
        pg = self._pg
        poll = self._poll
        results = []
        while True:
            while pg.is_busy():
                # (Releases the GIL while it waits. Its deadline is the connection's:
                # schema.LIVENESS has the kernel end a silent one within ~30 s, and the
                # poll then returns an error that consume_input raises.)
                poll.poll()
                pg.consume_input()
            result = pg.get_result()
            if result is None:  # (the end of one command's results)
                continue
            if result.status == pq.ExecStatus.PIPELINE_SYNC:
                return results
            results.append(result)

    def _settle(self, sent: list[bytes | None], results: list[Any]) -> None:
        """Forget the names whose preparing failed or was skipped: the next run of their
        statement prepares it again."""
        for name, result in zip(sent, results, strict=False):
            if name is not None and result.status != pq.ExecStatus.COMMAND_OK:
                for key, known in list(self._prepared.items()):
                    if known == name:
                        del self._prepared[key]

    def _outcomes(
        self, sent: list[bytes | None], results: list[Any], refused: Exception | None
    ) -> list[Result]:
        """The statements' results, or the first failure raised: a statement's, the
        sync's, or (if PostgreSQL refused nothing) the one that stopped the sending."""
        if len(results) < len(sent) or (
            len(results) > len(sent)
            and any(r.status != pq.ExecStatus.FATAL_ERROR for r in results[len(sent) :])
        ):
            raise psycopg.InternalError(f"{len(results)} results for {len(sent)} commands")
        outcomes: list[Result] = []
        failure: BaseException | None = None
        tx = self._tx
        for name, result in zip(sent, results, strict=False):
            status = result.status
            if status not in _OK:
                if failure is None and status == pq.ExecStatus.FATAL_ERROR:
                    failure = self._error(result)
                continue
            if name is not None:
                continue
            tag = (result.command_status or b"").decode()
            if status == pq.ExecStatus.TUPLES_OK:
                tx.set_pgresult(result)
                rows = tx.load_rows(0, result.ntuples, tuple)
            else:
                rows = []
            count = result.command_tuples
            outcomes.append(Result(rows, -1 if count is None else count, tag))
        self.completed = outcomes
        if failure is None and len(results) > len(sent):  # (every statement ran)
            failure = self._error(results[len(sent)])
        if failure is not None:
            if isinstance(failure, psycopg.errors.InvalidSqlStatementName):
                # Someone deallocated them (DEALLOCATE ALL): prepared again from the next
                # round trip on (this one's transaction, if any, has failed).
                self._prepared.clear()
            if refused is not None:
                raise failure from refused
            raise failure
        if refused is not None:
            raise refused
        return outcomes

    def _error(self, result: Any) -> psycopg.Error:
        return psycopg.errors.error_from_result(result, encoding=self._conn.info.encoding)
