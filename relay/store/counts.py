"""What every store counts in memory beside its database (``CountsBook``): the event
totals, the events recorded, and the journal that undoes a transaction's counter changes.
Nothing here touches a database.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from relay.protocol.errors import TooManyQueues
from relay.store import history
from relay.store.base import Changes
from relay.store.view import EVENTS, Entry, QueueView

# (counter, key, n): one counter change, undone on rollback by subtracting n; or (None,
# counter, 0): a flush took the history's counter, given back on rollback.
JournalEntry = tuple[Counter | None, Any, int]


class CountsBook:
    """What every store counts in memory beside its database: events per (queue, event)
    since it opened, the events it records, and the journal that undoes its counters.

    A store inherits it, and adds its own count of jobs per (queue, state), which is where
    the two differ: ``SqliteStore`` keeps every count in memory (``_counts``, loaded when
    it opens), ``PostgresStore`` only the open transaction's moves (``_moves``, added to
    job_counts by its commit). Each moves its counts with ``_move``, through ``_bump``.

    Inside a transaction (``_journal`` not None: the store sets it at ``begin``) every
    counter change is journaled, so that a rolled-back savepoint (``_undo(mark)``) or
    transaction (``_undo_transaction``) takes back its own changes, and the counters
    always equal what is committed.

    After each commit (or rollback) the store publishes the queues whose counters moved
    to its ``view`` (``_publish``, relay/store/view.py), which other threads read; and
    before a submit creates a queue it checks the bound on queues (``_check_queues``)
    against that view, in memory.
    """

    changes: Changes  # the store's: ``_record`` appends to its events
    config: Any  # the store's StoreConfig (max_queues)

    def __init__(self) -> None:
        self._totals: Counter[tuple[str, str]] = Counter()  # (queue, event) -> since start
        # While a transaction runs: every counter change, to undo them on rollback.
        self._journal: list[JournalEntry] | None = None
        # What commits have made of the counts, for other threads to read.
        self.view = QueueView()
        # Queues whose counters moved since they were last published.
        self._touched: set[str] = set()
        # Queues that submits since the last publish may create (``_check_queues``).
        self._new_queues: set[str] = set()
        # (queue, minute, field) -> what was counted and not yet flushed (history.py).
        self._history: Counter[history.HistoryKey] = Counter()
        # The queues whose history has rows of its own (``history.take_rows``): the first
        # seen since the store opened, at most ``config.history_max_queues``.
        self._history_queues: set[str] = set()

    def _undo(self, mark: int) -> None:
        assert self._journal is not None
        for counter, key, n in reversed(self._journal[mark:]):
            if counter is None:  # a flush took the history counted before it (``key``)
                key.update(self._history)  # (what came after it is undone by now)
                self._history = key
                continue
            counter[key] -= n
        del self._journal[mark:]

    def _undo_transaction(self) -> None:
        """Take back every counter change of the transaction, if one is open, and end it."""
        if self._journal is not None:
            self._undo(0)
        self._journal = None

    def _statement(self, sql: str) -> None:
        """Run one statement of the store's own (a savepoint's) in the open transaction."""
        raise NotImplementedError

    @contextlib.contextmanager
    def command(self) -> Iterator[None]:
        """One command inside the transaction: on any exception its changes are undone,
        in the database (a savepoint), in the counters and in the recorded events."""
        assert self._journal is not None, "command() outside begin()"
        mark = len(self._journal)
        events = self.changes.events
        events_mark = len(events)
        self._statement("SAVEPOINT command")
        try:
            yield
        except BaseException:
            self._statement("ROLLBACK TO command")
            self._statement("RELEASE command")
            self._undo(mark)
            del events[events_mark:]  # no event of what did not happen
            raise
        self._statement("RELEASE command")

    def _bump(self, counter: Counter[tuple[str, str]], key: tuple[str, str], n: int) -> None:
        counter[key] += n
        self._touched.add(key[0])
        if self._journal is not None:
            self._journal.append((counter, key, n))

    def _count(self, queue: str, event: str, n: int = 1, now: int | None = None) -> None:
        """Count ``n`` events of ``queue``; with ``now``, in its minute's history too."""
        self._bump(self._totals, (queue, event), n)
        if now is not None:
            field = history.EVENT_FIELDS.get(event)
            if field is not None:
                self._bump(self._history, (queue, now - now % history.MINUTE_MS, field), n)

    def _observe(self, queue: str, kind: int, values: list[int], now: int) -> None:
        """Add ``values`` (ms) of ``kind`` (history.FIELD_RUN or FIELD_WAIT) to the queue's
        minute: sum, buckets, and the max (raised by a journaled change, so a rollback
        lowers it again). ``_bump``'s work, written out: this runs per claim and per ack."""
        minute = now - now % history.MINUTE_MS
        counter, journal = self._history, self._journal
        for field, n in history.observe_fields(kind, values):
            key = (queue, minute, field)
            counter[key] += n
            if journal is not None:
                journal.append((counter, key, n))
        key = (queue, minute, kind + 2)
        rise = max(values) - counter.get(key, 0)
        if rise > 0:
            counter[key] += rise
            if journal is not None:
                journal.append((counter, key, rise))
        self._touched.add(queue)

    def _observe_each(
        self, kind: int, queues: list[str], values: list[int | None], now: int
    ) -> None:
        """``_observe`` of ``values`` (None: not known, left out), each of the queue at its
        place in ``queues``: grouped by queue (nearly always one, taken at once)."""
        if len(set(queues)) == 1:
            known = [value for value in values if value is not None]
            if known:
                self._observe(queues[0], kind, known, now)
            return
        by_queue: dict[str, list[int]] = {}
        for queue, value in zip(queues, values, strict=True):
            if value is not None:
                by_queue.setdefault(queue, []).append(value)
        for queue, known in by_queue.items():
            self._observe(queue, kind, known, now)

    def _observe_claimed(self, rows: list, queue_at: int, ready_at: int, now: int) -> None:
        """The waits of the jobs of a claim (its candidate ``rows``: each one's queue and
        ``ready_at`` at those places)."""
        self._observe_each(
            history.FIELD_WAIT, [row[queue_at] for row in rows],
            [now - row[ready_at] for row in rows], now,
        )  # fmt: skip

    def _observe_ended(self, queues: list[str], started: list[int | None], now: int) -> None:
        """The run times of attempts (of ``queues``) that ended at ``now``, from their
        starts (the jobs' ``leased_at``; None: not known, as for a lease granted before
        the column was)."""
        runs = [None if at is None else now - at for at in started]
        self._observe_each(history.FIELD_RUN, queues, runs, now)

    def history_flush(self, now: int) -> history.HistoryFlushed:
        """Write what was counted since the last flush to the table ``history`` (one
        upsert: adds to the rows there), and return the histograms' deltas. In the open
        transaction: if it rolls back, what it took is counted again (journaled)."""
        counter = self._history
        if not counter:
            return history.HistoryFlushed(0, {})
        rows, observed = history.take_rows(
            counter, self.config.history_max_queues, self._history_queues
        )
        if rows:
            self._history_write(rows)
        # Taken whole: one journal entry, which a rollback turns back (``_undo``), however
        # many queues (not a change per counter, nor the queues published again).
        self._history = Counter()
        if self._journal is not None:
            self._journal.append((None, counter, 0))
        return history.HistoryFlushed(len(rows), observed)

    def _history_write(self, rows: list[history.HistoryRow]) -> None:
        """Add ``rows`` to the table (the store's dialect)."""
        raise NotImplementedError

    def _record(self, key: int, queue: str, src: str, state: str, attempt: int, now: int) -> None:
        """One job's change from state ``src``, for ``changes.events`` (call only while
        recording)."""
        self.changes.events.append((f"job_{key:016x}", queue, state, attempt, now, src))

    def _forget_totals(self, queues: Iterable[str]) -> None:
        """Drop the event totals of these queues, left with no jobs at all by a commit:
        what is kept in memory then grows with the queues that have jobs, not with every
        queue name ever used."""
        for queue in queues:
            for event in EVENTS:
                self._totals.pop((queue, event), None)

    def _check_queues(self, queues: Iterable[str]) -> None:
        """Refuse (``TooManyQueues``) a submit to queues that hold no jobs yet if they would
        take the number of queues that hold jobs past ``config.max_queues``. In memory:
        one lookup per queue named. Queues that earlier submits of the open transaction
        may create count too (until it is published, also if a savepoint undid them)."""
        limit = self.config.max_queues
        if limit is None:
            return
        view, pending = self.view, self._new_queues
        new = [queue for queue in queues if queue not in view and queue not in pending]
        if not new:
            return
        held = len(view) + len(pending)
        if held + len(new) > limit:
            raise TooManyQueues(
                f"{held} queues hold jobs (max {limit}); submit to an existing queue, or "
                "let queues drain (succeeded jobs are pruned after retention, dead ones "
                "purged) or raise the server's --max-queues"
            )
        pending.update(new)

    def _entry(self, queue: str) -> Entry | None:
        """The queue's counts as committed, then its event totals (None: it holds no
        jobs). The store's: where it keeps its committed counts differs."""
        raise NotImplementedError

    def _publish(self) -> None:
        """After a commit or a rollback: the touched queues' committed counts to ``view``."""
        self._new_queues.clear()
        if not self._touched:
            return
        touched, self._touched = self._touched, set()
        self.view.publish([(queue, self._entry(queue)) for queue in touched])

    def _totals_of(self, queue: str) -> tuple[int, ...]:
        totals = self._totals
        return tuple([totals.get((queue, event), 0) for event in EVENTS])

    def _publish_all(self, queues: Iterable[str]) -> None:
        """Publish these queues and every queue the view holds (after a recount)."""
        self._touched.update(queues)
        self._touched.update(self.view.names_between(None, None))
        self._publish()

    def event_totals(self) -> dict[tuple[str, str], int]:
        """(queue, event) -> how many times it happened since this store was opened (in
        this process: servers sharing a database each count their own)."""
        return {key: n for key, n in self._totals.items() if n}
