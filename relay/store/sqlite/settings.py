"""Queue settings as SQLite: pause and resume a queue, and read the settings a page at a
time.

One server owns the file, so the set of paused queues is kept in memory (``_paused``):
loaded when the store opens, changed only once the transaction that changed the table
has committed (``_settle_paused``), so it never holds what was rolled back. A claim then
filters its queues against it, and pays one truth test when no queue is paused
(leases.py).
"""

from __future__ import annotations

from relay.store.base import (
    MAX_QUEUE_SETTINGS,
    READY,
    SETTINGS_PAGE,
    QueueSettings,
    too_many_settings,
)
from relay.store.sqlite.sql import SqliteBase

_PAUSE = (
    "INSERT INTO queue_settings (queue, paused, updated_at) VALUES (?1, 1, ?2) "
    "ON CONFLICT (queue) DO UPDATE SET paused = 1, updated_at = ?2"
)
_RESUME = "UPDATE queue_settings SET paused = 0, updated_at = ?2 WHERE queue = ?1 AND paused"
# A row left with only defaults says nothing: deleted, so the rows stay the queues set
# otherwise (later settings add their defaults to this condition).
_DROP_DEFAULTS = "DELETE FROM queue_settings WHERE queue = ? AND NOT paused"
_PAGE = "SELECT queue, paused FROM queue_settings WHERE queue > ? ORDER BY queue LIMIT ?"


class SqliteSettings(SqliteBase):
    """Pause, resume, and the settings' pages: part of ``SqliteStore``."""

    # The queues paused, as committed; and the queues the open transaction paused or
    # resumed, read again by its commit (``_settle_paused``), forgotten by its rollback.
    _paused: frozenset[str]
    _paused_touched: set[str]

    def _load_paused(self) -> None:
        rows = self._db.execute("SELECT queue FROM queue_settings WHERE paused")
        self._paused = frozenset(queue for (queue,) in rows)
        self._paused_touched = set()
        self.view.publish_paused(self._paused)

    def _settle_paused(self, committed: bool) -> None:
        """After a commit (``committed``) or a rollback: the transaction's pauses and
        resumes take effect, or are forgotten. What took effect is read back from the
        table, for the queues the transaction touched: a command undone by its savepoint
        (a batch the disk refused, run again item by item: relay/store/passes.py) left
        its change here but not there."""
        touched, self._paused_touched = list(self._paused_touched), set()
        if not committed or not touched:
            return
        rows = self._db.execute(
            "SELECT queue FROM queue_settings WHERE paused AND queue IN "
            f"({', '.join('?' * len(touched))})",
            touched,
        )
        paused = self._paused.difference(touched) | {queue for (queue,) in rows}
        self._paused = frozenset(paused)
        self.view.publish_paused(self._paused)

    def queue_pause(self, queue: str, paused: bool, now: int) -> bool:
        """Pause or resume ``queue`` (see ``Store.queue_pause``)."""
        row = self._db.execute(
            "SELECT paused FROM queue_settings WHERE queue = ?", (queue,)
        ).fetchone()
        if paused:
            if row is None:
                (held,) = self._db.execute("SELECT count(*) FROM queue_settings").fetchone()
                if held >= MAX_QUEUE_SETTINGS:
                    raise too_many_settings(held)
            self._db.execute(_PAUSE, (queue, now))
        elif row is not None and row[0]:
            self._db.execute(_RESUME, (queue, now))
            self._db.execute(_DROP_DEFAULTS, (queue,))
            # Its ready jobs are claimable again: as if made ready now, so that leases
            # parked on it wake (relay/server/requests/longpoll.py).
            ready = self._counts.get((queue, READY), 0)
            if ready:
                self.changes.made_ready(queue, ready)
        self._paused_touched.add(queue)
        if self._journal is None:  # outside a transaction: the statement has committed
            self._settle_paused(True)
        return paused

    def queue_settings(self, after: str | None, limit: int) -> list[QueueSettings]:
        """The settings of up to ``limit`` queues after ``after`` (see ``Store``)."""
        limit = max(0, min(limit, SETTINGS_PAGE + 1))  # (a page, and whether more follow)
        rows = self._db.execute(_PAGE, (after or "", limit))
        return [QueueSettings(queue, bool(paused)) for queue, paused in rows]
