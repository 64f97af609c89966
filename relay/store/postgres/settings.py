"""Queue settings on PostgreSQL: pause and resume a queue, and read the settings a page at
a time.

Several servers share the table, so a claim reads it itself, in its own statement (the
candidates' query of leases.py leaves out the queues paused as committed when it starts):
a pause committed by any server stops every server's claims from then on. What this
server knows of the paused queues (``_paused_known``) is for display only (``stats``,
/metrics): its own commits, and the pages ``counts_refresh`` reads.
"""

from __future__ import annotations

from relay.store.base import (
    MAX_QUEUE_SETTINGS,
    READY,
    SETTINGS_PAGE,
    QueueSettings,
    too_many_settings,
)
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.sql import atomic

_PAUSE = (
    "INSERT INTO queue_settings (queue, paused, updated_at) VALUES (%(queue)s, true, %(now)s) "
    "ON CONFLICT (queue) DO UPDATE SET paused = true, updated_at = %(now)s"
)
# Locks the row: two servers resuming at once, one of them wakes the parked leases.
_RESUME = (
    "UPDATE queue_settings SET paused = false, updated_at = %(now)s "
    "WHERE queue = %(queue)s AND paused RETURNING queue"
)
# A row left with only defaults says nothing: deleted (later settings add theirs here).
_DROP_DEFAULTS = "DELETE FROM queue_settings WHERE queue = %s AND NOT paused"
_PAGE = "SELECT queue, paused FROM queue_settings WHERE queue > %s ORDER BY queue LIMIT %s"


class Settings(PostgresBase):
    """Pause, resume, and the settings' pages: part of ``PostgresStore``."""

    @atomic
    def queue_pause(self, queue: str, paused: bool, now: int) -> bool:
        """Pause or resume ``queue`` (see ``Store.queue_pause``)."""
        args = {"queue": queue, "now": now}
        if paused:
            row = self._read("SELECT 1 FROM queue_settings WHERE queue = %s", (queue,)).fetchone()
            if row is None:
                (held,) = self._read("SELECT count(*) FROM queue_settings").fetchone() or (0,)
                if held >= MAX_QUEUE_SETTINGS:
                    raise too_many_settings(held)
            self._write(_PAUSE, args)
        elif self._write(_RESUME, args).fetchone() is not None:
            self._write(_DROP_DEFAULTS, (queue,))
            # Its ready jobs are claimable again: as if made ready now, so that leases
            # parked on it wake, here and, by the commit's notification, on every server.
            ready = self._counts([queue]).get((queue, READY), 0)
            if ready > 0:
                self.changes.made_ready(queue, ready)
        self._paused_touched.add(queue)
        return paused

    def queue_settings(self, after: str | None, limit: int) -> list[QueueSettings]:
        """The settings of up to ``limit`` queues after ``after`` (see ``Store``)."""
        limit = max(0, min(limit, SETTINGS_PAGE + 1))  # (a page, and whether more follow)
        rows = self._read(_PAGE, (after or "", limit)).fetchall()
        return [QueueSettings(queue, bool(paused)) for queue, paused in rows]
