"""``SqliteStore``: the store on one SQLite connection, assembled from its parts.

Here: opening and closing, the transactions the writer runs (``begin``, ``command``,
``commit``, ``rollback``, ``write_mark``) and loading the counts. The transitions live by
concern: jobs.py (submit), leases.py (claim, renew, ack, fail, release), maintenance.py
(promote, reap, recover, prune, next deadlines), dead.py (dead-letter retry and purge),
cancel.py (cancel a job or a queue's), reads.py (inspect, dead list), settings.py (pause,
resume, the queues' settings), schedules.py (cron schedules and their due slots). Never
imports trio; never reads the clock.
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
from collections import Counter

from relay.protocol.model import JobIdGenerator, JobState
from relay.store.base import Changes, StoreConfig
from relay.store.counts import JournalEntry
from relay.store.schema import open_database
from relay.store.sqlite.browse import SqliteBrowse
from relay.store.sqlite.cancel import SqliteCancel
from relay.store.sqlite.dead import SqliteDead
from relay.store.sqlite.history import SqliteHistory
from relay.store.sqlite.jobs import SqliteJobs
from relay.store.sqlite.leases import SqliteLeases
from relay.store.sqlite.maintenance import SqliteMaintenance
from relay.store.sqlite.reads import SqliteReads
from relay.store.sqlite.schedules import SqliteSchedules
from relay.store.sqlite.settings import SqliteSettings
from relay.store.view import EVENTS, STATES, Entry


class SqliteStore(
    SqliteJobs,
    SqliteLeases,
    SqliteMaintenance,
    SqliteDead,
    SqliteCancel,
    SqliteReads,
    SqliteSettings,
    SqliteSchedules,
    SqliteBrowse,
    SqliteHistory,
):
    """The job store on one SQLite connection, which it owns (the ``Store`` interface of
    relay/store/base.py).

    Not thread-safe: exactly one thread (the writer) may call it.
    """

    recovers_on_start = True  # one server owns the file: its leased jobs are orphans
    broken = False  # a file has no connection to lose

    def reconnect(self) -> None:
        """Nothing to do (see ``Store.reconnect``)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        config: StoreConfig | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._db = conn
        self.config = config or StoreConfig()
        # Jitter needs no cryptographic strength; tokens do, and use `secrets`.
        self._rng = rng or random.Random()
        last = conn.execute("SELECT value FROM meta WHERE key = 'last_job_id'").fetchone()
        top = conn.execute("SELECT max(id) FROM jobs").fetchone()[0]
        self._ids = JobIdGenerator(max(int(last[0]) if last else 0, top or 0))
        super().__init__()  # the counts book (relay/store/base.py): empty, no transaction
        self._counts = Counter()
        self._load_counts()
        self._publish_all(())
        self._load_settings()
        self._held = {}  # the leases granted (SqliteBase, sql.py)
        self.changes = Changes()
        # Whether transitions append to ``changes.events``. Off, they cost one check of
        # this flag per call and no statement more; the writer sets it per batch.
        self.recording = False

    @classmethod
    def open(
        cls,
        path: str,
        config: StoreConfig | None = None,
        *,
        synchronous: str = "full",
        rng: random.Random | None = None,
    ) -> SqliteStore:
        """Open or create the database at ``path`` (see ``schema.open_database``)."""
        return cls(open_database(path, synchronous=synchronous), config, rng=rng)

    def close(self) -> None:
        """Checkpoint the WAL into the main file and close the connection."""
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()

    # -- transactions (used by the writer) -------------------------------------------------

    def begin(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        self._journal = []

    @property
    def in_transaction(self) -> bool:
        """False if SQLite itself rolled the transaction back (disk full, I/O error):
        then nothing of it stands, and nothing more may run as if it did."""
        return self._db.in_transaction

    def write_mark(self) -> tuple[int, int]:
        """Where the transaction's writes stand (rows changed, counter moves): equal marks
        before and after a call mean that it wrote nothing."""
        # (total_changes counts a statement once it has finished; the store leaves no
        # statement unfinished, e.g. no RETURNING cursor, when a method returns or raises.)
        return self._db.total_changes, len(self._journal or ())

    def _statement(self, sql: str) -> None:
        self._db.execute(sql)

    def take_changes(self) -> Changes:
        """What changed since the last call (or commit), after a statement that committed
        on its own (``jobs_submit(alone=True)``)."""
        self._publish()
        changes, self.changes = self.changes, Changes()
        return changes

    def commit(self) -> Changes:
        """Commit; return what changed and start collecting afresh."""
        self._db.execute("COMMIT")
        self._settle_settings(True)
        journal, self._journal = self._journal, None
        if journal:
            self._forget_empty(journal)
        self._publish()
        changes, self.changes = self.changes, Changes()
        return changes

    def rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("ROLLBACK")
        # Ids issued in the rolled-back transaction stay used in this process (the
        # generator never goes back); none was committed or answered, so none needs
        # remembering across a restart.
        self._undo_transaction()
        self._settle_settings(False)
        self._publish()
        self.changes = Changes()

    def recount(self) -> None:
        """Count the jobs per queue and state again from the table (after a failure that
        may have left the counts short of what was committed outside a transaction)."""
        self._load_counts()
        self._publish_all({queue for queue, _ in self._counts})

    def _entry(self, queue: str) -> Entry | None:
        get = self._counts.get
        states = [get((queue, state), 0) for state in STATES]
        if not any(states):
            return None
        totals = self._totals.get
        return (*states, *[totals((queue, event), 0) for event in EVENTS])

    def _forget_empty(self, journal: list[JournalEntry]) -> None:
        """Drop the counts that this transaction brought to zero, and the event totals of
        a queue left with no jobs at all: what is kept in memory then grows with the queues
        that have jobs, not with every queue name ever used."""
        emptied = set()
        for counter, key, _ in journal:
            if counter is self._counts and key in self._counts and not self._counts[key]:
                del self._counts[key]
                emptied.add(key[0])
        for queue in emptied:
            if not any(self._counts.get((queue, state)) for state in JobState):
                for state in JobState:
                    self._counts.pop((queue, state), None)
                self._forget_totals([queue])

    def _load_counts(self) -> None:
        self._counts.clear()
        rows = self._db.execute("SELECT queue, state, count(*) FROM jobs GROUP BY queue, state")
        for queue, state, n in rows:
            self._counts[(queue, state)] = n
        self._touched.update(queue for queue, _ in self._counts)
