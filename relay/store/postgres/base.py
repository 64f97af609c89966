"""``PostgresBase``: what the parts of ``PostgresStore`` (relay/store/postgres/store.py)
share: its connection and transactions, reads and writes, and the counts per queue and
state that it keeps in job_counts for every server. Each part (jobs.py, leases.py, ...) is a
subclass, and ``PostgresStore`` joins them.
"""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from relay.protocol.model import Rate
from relay.store import claims as claims_
from relay.store.base import ATTEMPTS_KEPT, LEASED, READY, Changes, StoreConfig
from relay.store.counts import CountsBook
from relay.store.postgres import notify
from relay.store.postgres.pipe import Pipe, Result
from relay.store.postgres.schema import open_connection
from relay.store.view import STATES, Entry, Limits

log = logging.getLogger("relay.store")

# How many rows of job_counts each (queue, state) may be spread over: a store adds its
# counts to the rows of one slot, picked at random when it opens. With a handful of
# servers, two rarely share a slot (and if they do, they take turns on its rows, in one
# order, so they never deadlock); ``queue_stats`` sums at most this many rows per count.
COUNT_SLOTS = 64

_ADD_COUNTS = (
    "INSERT INTO job_counts (slot, queue, state, n) "
    "SELECT %s, queue, state, n FROM unnest(%b::text[], %b::text[], %b::bigint[]) "
    "AS t(queue, state, n) "
    "ON CONFLICT (slot, queue, state) DO UPDATE SET n = job_counts.n + EXCLUDED.n"
)
# Of these queues' rows in every slot, the ones no other transaction holds (SKIP LOCKED:
# never a wait, so never a deadlock) that are zero, or whose (queue, state) sums to zero
# over the rows held: deleting such rows leaves every count as it was, whatever other
# servers commit meanwhile. Without it a queue moved through several slots (servers, or
# one server's restarts) would keep its rows of opposite sums once emptied, one set per
# queue name ever used.
_DROP_ZEROS = (
    "WITH held AS (SELECT slot, queue, state, n FROM job_counts WHERE queue = ANY(%s) "
    "FOR UPDATE SKIP LOCKED), "
    "zero AS (SELECT queue, state FROM held GROUP BY queue, state HAVING sum(n) = 0) "
    "DELETE FROM job_counts c USING held h "
    "WHERE c.slot = h.slot AND c.queue = h.queue AND c.state = h.state "
    "AND (h.n = 0 OR (h.queue, h.state) IN (SELECT queue, state FROM zero))"
)
# The first rows of job_counts by queue after a name: one range scan of job_counts_queue,
# which the ORDER BY and LIMIT make the plan whatever the table's statistics say (a
# DISTINCT over the range was planned as a scan of the whole table, ~110 ms at 100,000
# queues, while the table was new). The store sums the slots' rows itself.
_PAGE_COUNTS = "SELECT queue, state, n FROM job_counts WHERE queue > %s ORDER BY queue LIMIT %s"
# Rows a page reads per queue asked for: a queue has a few states with jobs, in a few slots.
# At least one queue's most rows (every state in every slot), so a page always ends after
# at least one whole queue.
_ROWS_PER_QUEUE = 4
_MIN_PAGE_ROWS = 6 * COUNT_SLOTS + 1
# Of these queues, the ones that still hold jobs.
_HOLDING = "SELECT queue FROM job_counts WHERE queue = ANY(%s) GROUP BY queue HAVING sum(n) <> 0"
# The queues with a setting a server keeps in mind, (queue, paused, limited, max_leased,
# rate_limit, rate_period_ms): those named
# after %s up to %s (None: to the end), or those in a list.
_MARKS = (
    "SELECT queue, paused, (max_leased IS NOT NULL OR rate_limit IS NOT NULL), "
    "max_leased, rate_limit, rate_period_ms FROM queue_settings WHERE "
)
_MARKED = (
    _MARKS + "(paused OR max_leased IS NOT NULL OR rate_limit IS NOT NULL) "
    "AND queue > %s AND (%s::text IS NULL OR queue <= %s)"
)
_MARKS_OF = _MARKS + "queue = ANY(%s)"


# The attempts of leased jobs ended otherwise (release, cancel), from their rows as they
# are, with their count of ended attempts, for ``_trim_history``.
_END_LEASES = (
    "WITH e AS (INSERT INTO job_errors (job_id, attempt, error, at, started_at, worker, "
    "outcome) SELECT id, attempt, %(error)s, %(now)s, leased_at, lease_worker, %(outcome)s "
    "FROM jobs WHERE id = ANY(%(ids)s) RETURNING job_id) "
    "UPDATE jobs SET attempts_ended = attempts_ended + 1 FROM e WHERE jobs.id = e.job_id "
    "RETURNING jobs.id, jobs.attempts_ended"
)
# A job's rows past the ATTEMPTS_KEPT most recent: a scan of job_errors_job (job_id, seq)
# that reads at most ATTEMPTS_KEPT + 1 entries.
_TRIM_HISTORY = (
    "DELETE FROM job_errors WHERE job_id = %(id)s AND seq <= (SELECT seq FROM job_errors "
    f"WHERE job_id = %(id)s ORDER BY seq DESC OFFSET {ATTEMPTS_KEPT} LIMIT 1)"
)


class PostgresBase(CountsBook):
    """The connection, transactions and counts of ``PostgresStore``.

    Not thread-safe: exactly one thread (the writer) may call it.
    """

    def __init__(
        self,
        conn: psycopg.Connection,
        config: StoreConfig | None = None,
        *,
        rng: random.Random | None = None,
        slot: int | None = None,
    ) -> None:
        self._db = conn
        self._pipe = Pipe(conn)  # (the round trips of the writer's statements)
        self.url: str | None = None  # where to reconnect to (``open``)
        # Tells the other servers' change feeds (relay/server/services/feed.py) which
        # commits are this store's own.
        self.origin = secrets.token_hex(8)
        self.config = config or StoreConfig()
        # Jitter needs no cryptographic strength; tokens do, and use `secrets`.
        self._rng = rng or random.Random()
        self.slot = secrets.randbelow(COUNT_SLOTS) if slot is None else slot
        super().__init__()  # the counts book (relay/store/base.py): empty, no transaction
        # The moves of the open transaction, (queue, state) -> jobs: added to the
        # slot's rows of job_counts by its commit.
        self._moves: Counter[tuple[str, str]] = Counter()
        # Queues some of whose jobs the open transaction deleted: their event totals are
        # forgotten if they are left without jobs (as SqliteStore does).
        self._deleted_from: set[str] = set()
        # (queue, state) -> jobs, over every server, as this store knows it: read when it
        # opens and a page at a time since (``counts_refresh``), its own commits added as
        # they commit. What ``view`` publishes; what the bound on queues is checked on.
        self._known: Counter[tuple[str, str]] = Counter()
        # Rows written by every statement so far (for ``write_mark``).
        self._rows = 0
        # BEGIN not sent yet: it goes with the transaction's first statement (``_read``).
        self._begin_pending = False
        # Writes whose results no one reads (``_write_later``), not sent yet: they go out
        # with the transaction's next read, or with its commit, in one round trip.
        self._queued: list[tuple[str, Any]] = []
        # Of those, the ones whose rows someone reads once sent: (position in _queued,
        # what takes the result); and, once taken for a round trip, (position in it, ...).
        self._then: list[tuple[int, Callable[[Result], None]]] = []
        self._sending: list[tuple[int, Callable[[Result], None]]] = []
        # Until when (``now``) the ids the sequence gives are known to be fresh enough to
        # be drawn by an insert unchecked (jobs.py, ``_fresh_until``); nothing at first.
        self._ids_fresh_until = 0
        # The lease expiry the other servers were last told of (notify.py).
        self._expiry_told = notify.ExpiryTold()
        self.changes = Changes()
        # Whether transitions append to ``changes.events``; the writer sets it per batch.
        self.recording = False
        # The queues paused, and those with a limit, as this server knows them (for stats
        # and /metrics, and whom a lease's end wakes: a claim reads the table itself), and
        # the queues whose settings the open transaction changed, read by its commit
        # (settings.py).
        self._paused_known: set[str] = set()
        self._limited_known: set[str] = set()
        self._limits_known: dict[str, Limits] = {}  # (for /metrics: view.limits)
        self._settings_touched: set[str] = set()
        # The rate-limited queues a claim left with a full window and ready jobs.
        self._rate_waits = claims_.RateWaits()
        self.load_counts()

    def load_counts(self) -> None:
        """Read every server's counts into ``_known``, and publish them (at open: one
        read of job_counts, whatever its size; afterwards ``counts_refresh`` reads it a
        page at a time)."""
        rows = self._db.execute(
            "SELECT queue, state, sum(n)::bigint FROM job_counts GROUP BY queue, state"
        ).fetchall()
        self._known = Counter({(queue, state): n for queue, state, n in rows if n})
        self._publish_all({queue for queue, _ in self._known})
        self._load_paused()

    def _load_paused(self) -> None:
        """Read which queues are paused or limited (every server's word); publish the
        paused to ``view``."""
        self._paused_known, self._limited_known, self._limits_known = set(), set(), {}
        self._know_settings(self._db.execute(_MARKED, ("", None, None)).fetchall())
        self._publish_settings()

    def _publish_settings(self) -> None:
        self.view.publish_paused(frozenset(self._paused_known), dict(self._limits_known))

    def _know_settings(self, rows: list[tuple]) -> None:
        """Take (queue, paused, limited[, max_leased, rate_limit, rate_period_ms]) rows
        as what is known of their queues."""
        for queue, paused, limited, *limits in rows:
            (self._paused_known.add if paused else self._paused_known.discard)(queue)
            (self._limited_known.add if limited else self._limited_known.discard)(queue)
            if limited:
                max_leased, rate_limit, period_ms = limits
                rate = None if rate_limit is None else Rate(rate_limit, period_ms)
                self._limits_known[queue] = (max_leased, rate)
            else:
                self._limits_known.pop(queue, None)

    @property
    def broken(self) -> bool:
        """The connection is lost (the server went, the network failed): ``reconnect``."""
        return self._db.closed or self._db.broken

    def reconnect(self) -> None:
        """A new connection in place of a lost one; raises ``StoreError`` if it cannot be
        made yet. Whatever the lost connection's transaction held was rolled back by the
        database (or committed, if its COMMIT arrived: see docs/failure-model.md)."""
        if self.url is None:
            raise psycopg.OperationalError("the store was given a connection, not a URL")
        conn = open_connection(self.url)
        with contextlib.suppress(psycopg.Error):
            self._db.close()
        self._db = conn
        self._pipe = Pipe(conn)
        self._undo_transaction()
        self._begin_pending = False
        self._queued.clear()
        self._then.clear()
        self._sending.clear()
        self._ids_fresh_until = 0  # (the database may have been restored meanwhile)
        self._expiry_told.forget()
        self._moves.clear()
        self._deleted_from.clear()
        self._settings_touched.clear()
        self._publish()
        self.changes = Changes()

    def close(self) -> None:
        """Close the connection; a transaction still open is rolled back with it."""
        self._db.close()

    # -- statements --------------------------------------------------------------------------

    def _read(self, sql: str, params: Any = None) -> Result:
        """Run a statement, in the open transaction if there is one. What waits to be
        sent goes with it, in one round trip (a pipeline: the results come back once all
        have run, in order): BEGIN, if this is the transaction's first statement, and the
        writes queued since the last round trip (``_write_later``)."""
        statements = self._waiting()
        statements.append((sql, params))
        *sent, result = self._pipe.run(statements)
        self._count_rows(sent)
        return result

    def _waiting(self) -> list[tuple[str, Any]]:
        """What goes first in the next round trip, taken: BEGIN if it waits, then the
        queued writes, in order. READ COMMITTED whatever the database's default: every
        rule here re-reads a row once it is locked."""
        statements = self._queued
        self._queued = []
        first = 0
        if self._begin_pending:
            self._begin_pending = False
            statements.insert(0, ("BEGIN ISOLATION LEVEL READ COMMITTED", None))
            first = 1
        self._sending = [(first + i, then) for i, then in self._then]
        self._then = []
        return statements

    def _count_rows(self, results: list[Result], committed: bool = False) -> None:
        """The rows of the queued writes (and BEGIN's none) just sent, for ``write_mark``;
        the results that are read (``_write_later``'s ``then``) handed over. Once
        ``committed``, a ``then`` that raises (a bug) is logged, not raised: the commit
        stands, and the answers it was to fill are left unknown (their replies say so)."""
        self._rows += sum(max(result.rowcount, 0) for result in results)
        sending, self._sending = self._sending, []
        for i, then in sending:
            if not committed:
                then(results[i])
                continue
            try:
                then(results[i])
            except Exception:
                log.exception("taking the result of a committed write failed")

    def _write(self, sql: str, params: Any = None) -> Result:
        """Run a statement that writes; its rows count in ``write_mark``."""
        result = self._read(sql, params)
        if result.rowcount > 0:
            self._rows += result.rowcount
        return result

    def _write_later(
        self, sql: str, params: Any = None, then: Callable[[Result], None] | None = None
    ) -> None:
        """A write sent with the transaction's next round trip (a read's, or the
        commit's), not in one of its own; ``then``, if given, is called with its result
        as that round trip ends. In the open transaction (``begin``) only. An error of it
        is raised by that round trip; the transaction has failed then, as if the write had
        raised here (the careful pass sends every command's writes before its savepoint
        ends: ``command``), and ``then`` is never called. It counts in ``write_mark`` as
        written at once (one row; its own rows once sent)."""
        assert self._journal is not None, "a write sent later needs a transaction"
        if then is not None:
            self._then.append((len(self._queued), then))
        self._queued.append((sql, params))
        self._rows += 1

    def _flush(self) -> None:
        """Send the queued writes now (one round trip), if there are any."""
        if self._queued:
            self._count_rows(self._pipe.run(self._waiting()))

    @contextlib.contextmanager
    def command(self) -> Iterator[None]:
        """``CountsBook.command``, whose writes are all sent before its savepoint ends:
        one that fails so is undone by its own savepoint, never by the next command's. A
        command that raises drops its writes not sent yet (every write queued since its
        SAVEPOINT is its own), so that they do not run before its ROLLBACK TO."""
        with super().command():
            try:
                yield
                self._flush()
            except BaseException:
                self._queued.clear()
                self._then.clear()
                raise

    def _end_leases(self, keys: list[int], outcome: str, error: str, now: int) -> None:
        """Record the attempts of these leased jobs as ended now with ``outcome`` (before
        their rows change), and keep each job's history to its bound."""
        params = {"ids": keys, "error": error, "now": now, "outcome": outcome}
        ended = self._write(_END_LEASES, params).fetchall()
        self._trim_history([key for key, n in ended if n > ATTEMPTS_KEPT])

    def _trim_history(self, keys: list[int]) -> None:
        """Delete these jobs' ended attempts past the ATTEMPTS_KEPT most recent: called
        only for jobs whose ``attempts_ended`` passed it, so most writes never run it."""
        for key in keys:
            self._write(_TRIM_HISTORY, {"id": key})

    # -- transactions (used by the writer) -------------------------------------------------

    def begin(self) -> None:
        """Start a transaction. Nothing is sent yet: BEGIN goes with its first statement,
        and a transaction that runs none costs no round trip at all."""
        self._begin_pending = True
        self._journal = []

    @property
    def in_transaction(self) -> bool:
        """False once PostgreSQL has failed the transaction (a statement raised outside a
        savepoint, or the connection broke): nothing of it can commit then."""
        if self._begin_pending:
            return True
        return self._db.info.transaction_status == TransactionStatus.INTRANS

    def write_mark(self) -> tuple[int, int]:
        """Where the transaction's writes stand (rows written, counter moves): equal marks
        before and after a call mean that it wrote nothing."""
        return self._rows, len(self._journal or ())

    def _statement(self, sql: str) -> None:
        self._read(sql)  # (with the deferred BEGIN, if it is the transaction's first)

    def take_changes(self) -> Changes:
        """What changed since the last call (or commit), after calls made outside a
        transaction of the writer's."""
        changes, self.changes = self.changes, Changes()
        return changes

    def commit(self) -> Changes:
        """Commit; return what changed and start collecting afresh."""
        self._commit()
        changes, self.changes = self.changes, Changes()
        return changes

    def _commit(self) -> None:
        if self._begin_pending and not self._queued:  # no statement: nothing to send
            assert not any(self._moves.values()), "counts moved without a statement"
            self._begin_pending = False
            empty: list[str] = []
        else:
            if (
                not self._begin_pending
                and self._db.info.transaction_status != TransactionStatus.INTRANS
            ):
                # COMMIT would answer ROLLBACK without an error: say so instead.
                raise psycopg.errors.InFailedSqlTransaction(
                    "the transaction failed before its commit; nothing of it was kept"
                )
            empty = self._flush_counts_and_commit()
        self._journal = None
        known = self._known
        for key, n in self._moves.items():
            if n:
                known[key] += n
                if not known[key]:
                    del known[key]
        self._moves.clear()
        self._deleted_from.clear()
        self._forget_totals(empty)
        for queue in empty:  # (the database's word: none of its rows count a job)
            self._touched.add(queue)
            for state in STATES:
                known.pop((queue, state), None)
        if self._settings_touched:
            # What this transaction leaves, read back: a command undone by its savepoint
            # (a batch refused, run again item by item) left its change in the set only.
            touched = list(self._settings_touched)
            rows = self._db.execute(_MARKS_OF, (touched,)).fetchall()
            marked = {row[0] for row in rows}
            self._know_settings(rows + [(q, False, False) for q in touched if q not in marked])
            self._settings_touched.clear()
            self._publish_settings()
        self._publish()

    def rollback(self) -> None:
        self._roll_back()
        self.changes = Changes()

    def _roll_back(self) -> None:
        self._queued.clear()  # (never sent)
        self._then.clear()
        self._sending.clear()
        if self._begin_pending:  # nothing was sent
            self._begin_pending = False
        else:
            with contextlib.suppress(psycopg.Error):
                self._db.execute("ROLLBACK")
        self._undo_transaction()
        self._moves.clear()
        self._deleted_from.clear()
        self._settings_touched.clear()
        self._publish()

    def _on_its_own(
        self, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``method`` in a transaction of its own (``sql.atomic``); what it changed stays in
        ``changes`` until ``take_changes``, as a call outside a transaction does in SQLite."""
        events_mark = len(self.changes.events)
        self.begin()
        try:
            result = method(self, *args, **kwargs)
            self._commit()
        except BaseException:
            self._roll_back()
            del self.changes.events[events_mark:]
            raise
        return result

    def _keys_outlive(self, keys: list[int], state: str) -> None:
        """Before these jobs (all in ``state``) are deleted: their idempotency keys stay,
        until they expire, naming the job and the state it was deleted in."""
        if keys:
            self._write(
                "UPDATE idempotency_keys SET final_state = %s WHERE job_id = ANY(%s)",
                (state, keys),
            )

    # -- counts ------------------------------------------------------------------------------

    def _move(self, queue: str, src: str | None, dst: str | None, n: int = 1) -> None:
        if src is not None:
            self._bump(self._moves, (queue, src), -n)
            if src == LEASED and dst != READY and queue in self._limited_known:
                # A limited queue's lease ended: a lease parked on it, on any server (by
                # the commit's notification), may take its place.
                self.changes.made_ready(queue, n)
        if dst == READY:
            self.changes.made_ready(queue, n)
        if dst is not None:
            self._bump(self._moves, (queue, dst), n)
        elif src is not None:
            self._deleted_from.add(queue)

    def _flush_counts_and_commit(self) -> list[str]:
        """Send the writes still queued, add the transaction's moves to this store's slot
        of job_counts and commit, in one round trip (a pipeline), the commit's
        notification after it (notify.NOTIFY); return the queues the transaction left
        without jobs (whose event totals are then forgotten).

        One statement for all the moves, its rows in (queue, state) order: two stores that
        share a slot lock its rows in the same order, so they never deadlock. A transaction
        that deleted jobs also drops those queues' rows, of any slot, that add up to zero
        (``_DROP_ZEROS``)."""
        moves = sorted((key, n) for key, n in self._moves.items() if n)
        queues = sorted(self._deleted_from)
        statements = self._waiting()  # (BEGIN, if nothing was sent yet, the queued writes)
        if moves:
            params = (
                self.slot,
                [queue for (queue, _), _ in moves],
                [state for (_, state), _ in moves],
                [n for _, n in moves],
            )
            statements.append((_ADD_COUNTS, params))
        if queues:
            statements.append((_DROP_ZEROS, (queues,)))
        written = len(statements)  # (the statements whose rows count in write_mark)
        if queues:
            statements.append((_HOLDING, (queues,)))
        commit = len(statements)
        statements.append(("COMMIT", None))
        expiry = self.changes.next_expiry_at
        tell = self._expiry_told.needed(expiry)
        notification = notify.statement(self.origin, self.changes, tell)
        if notification is not None:  # (not run if anything before it failed)
            if tell:  # (it tells the expiry: until it is known to have gone)
                self._expiry_told.forget()
            statements.append(notification)
        try:
            results = self._pipe.run(statements)
        except psycopg.Error:
            results = self._pipe.completed  # (those that ran)
            if len(results) <= commit or results[commit].statusmessage != "COMMIT":
                raise
            # Only the notification failed (the notification queue full, say): the
            # commit stands; the other servers learn of it as they look again.
            log.warning("a commit's notification could not be sent", exc_info=True)
        else:
            if tell and notification is not None and expiry is not None:
                self._expiry_told.told(expiry)
        self._count_rows(results[:written], committed=True)
        if not queues:
            return []
        holding = {queue for (queue,) in results[written]}
        return [queue for queue in queues if queue not in holding]

    def _entry(self, queue: str) -> Entry | None:
        known = self._known
        states = [known.get((queue, state), 0) for state in STATES]
        if not any(states):
            return None
        return (*states, *self._totals_of(queue))

    def counts_refresh(self, after: str | None, limit: int) -> str | None:
        """Read the counts of about ``limit`` queues named after ``after`` (None: from the
        first) from job_counts, over every server, into ``_known``: what other servers
        committed reaches this store's view so, a page per call. Return the name to pass
        next, or None once the last page is read. One range scan of ``job_counts_queue``
        of ``limit * _ROWS_PER_QUEUE`` rows, whatever the number of queues; the queues it
        reads whole (all but the last, if more follow).

        In the writer's transaction: this transaction's moves are not in job_counts yet
        (its commit adds them), so replacing what was known by what is read loses none.
        """
        # ("" sorts before every queue name: they are 1 to 128 characters.)
        wanted = max(limit * _ROWS_PER_QUEUE, _MIN_PAGE_ROWS)
        rows = self._read(_PAGE_COUNTS, (after or "", wanted)).fetchall()
        last = None
        if len(rows) == wanted:  # more follow: the last queue read may be partial
            last = rows[-1][0]
            rows = [row for row in rows if row[0] != last]
            last = rows[-1][0]
        sums: Counter[tuple[str, str]] = Counter()
        for queue, state, n in rows:
            sums[(queue, state)] += n
        page = {queue for queue, _ in sums}
        known = self._known
        gone = self.view.names_between(after, last)  # (every queue known in the range)
        for queue in gone:
            for state in STATES:
                known.pop((queue, state), None)
        for key, n in sums.items():
            if n:
                known[key] = n
        self._touched.update(gone)
        self._touched.update(page)
        self._refresh_paused(after, last)
        return last

    def _refresh_paused(self, after: str | None, last: str | None) -> None:
        """What is known of the paused queues named after ``after`` up to ``last`` (None:
        to the end), read again: other servers' pauses and resumes reach stats so."""
        rows = self._read(_MARKED, (after or "", last, last)).fetchall()
        low = after or ""
        before = frozenset(self._paused_known), dict(self._limits_known)
        for known in (self._paused_known, self._limited_known):
            known.difference_update([q for q in known if q > low and (last is None or q <= last)])
        for queue in [q for q in self._limits_known if q > low and (last is None or q <= last)]:
            del self._limits_known[queue]
        self._know_settings(rows)
        if before != (self._paused_known, self._limits_known):
            self._publish_settings()

    def recount(self) -> None:
        """Nothing to do: the counts are rows, written in the same transactions as the jobs
        (``SqliteStore.recount`` repairs counts kept in memory)."""
        self._moves.clear()

    def _counts(self, queues: list[str] | None = None) -> Counter[tuple[str, str]]:
        """(queue, state) -> jobs, over every server's slot, with this transaction's moves."""
        if queues is None:
            rows = self._read(
                "SELECT queue, state, sum(n)::bigint FROM job_counts GROUP BY queue, state"
            )
        else:
            rows = self._read(
                "SELECT queue, state, sum(n)::bigint FROM job_counts WHERE queue = ANY(%s) "
                "GROUP BY queue, state",
                (queues,),
            )
        counts: Counter[tuple[str, str]] = Counter({(q, s): n for q, s, n in rows})
        for key, n in self._moves.items():
            if queues is None or key[0] in queues:
                counts[key] += n
        return counts
