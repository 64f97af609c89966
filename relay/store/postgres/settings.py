"""Queue settings on PostgreSQL: pause and resume a queue, its limits and submit defaults
(``queue_config``), and the settings read a page at a time.

Several servers share the table, so a claim reads it itself, in its own statements (the
candidates' query of leases.py leaves out the queues paused as committed when it starts,
and locks the rows of the limited ones it meets): a change committed by any server holds
for every server's claims from then on. What this server knows of the paused and limited
queues (``_paused_known``, ``_limited_known``) is for display (``stats``, /metrics) and for
whom a lease's end wakes: its own commits, and the pages ``counts_refresh`` reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from relay.store.base import (
    MAX_QUEUE_SETTINGS,
    READY,
    SETTINGS_COLUMNS,
    SETTINGS_PAGE,
    QueueSettings,
    too_many_settings,
)
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.sql import atomic

# (The rate window's columns keep their values: a window open stays open.)
_UPSERT = (
    f"INSERT INTO queue_settings ({SETTINGS_COLUMNS}, updated_at) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (queue) DO UPDATE SET "
    "paused = excluded.paused, max_leased = excluded.max_leased, "
    "rate_limit = excluded.rate_limit, rate_period_ms = excluded.rate_period_ms, "
    "default_timeout_ms = excluded.default_timeout_ms, "
    "default_retries = excluded.default_retries, "
    "default_backoff = excluded.default_backoff, updated_at = excluded.updated_at"
)
# Locks the row: two servers changing one queue's settings at once take turns, and each
# changes what the other left.
_ROW = f"SELECT {SETTINGS_COLUMNS} FROM queue_settings WHERE queue = %s FOR UPDATE"
_OF = f"SELECT {SETTINGS_COLUMNS} FROM queue_settings WHERE queue = ANY(%s)"
_PAGE = f"SELECT {SETTINGS_COLUMNS} FROM queue_settings WHERE queue > %s ORDER BY queue LIMIT %s"


class Settings(PostgresBase):
    """Pause, resume, limits, defaults, and the settings' pages: part of ``PostgresStore``."""

    def queue_pause(self, queue: str, paused: bool, now: int) -> bool:
        """Pause or resume ``queue`` (see ``Store.queue_pause``)."""
        return self.queue_config(queue, {"paused": paused}, now).paused

    @atomic
    def queue_config(self, queue: str, changes: Mapping[str, Any], now: int) -> QueueSettings:
        """Change ``queue``'s settings, return them all (see ``Store.queue_config``)."""
        row = self._read(_ROW, (queue,)).fetchone()
        old = QueueSettings(queue) if row is None else QueueSettings.from_row(row)
        new = old.changed(changes)
        if new == old:
            return old
        if new.is_default:
            self._write("DELETE FROM queue_settings WHERE queue = %s", (queue,))
        else:
            if row is None:
                (held,) = self._read("SELECT count(*) FROM queue_settings").fetchone() or (0,)
                if held >= MAX_QUEUE_SETTINGS:
                    raise too_many_settings(held)
            self._write(_UPSERT, (*new.to_row(), now))
        if new.loosens(old):
            # Its ready jobs may be claimable again: as if made ready now, so that leases
            # parked on it wake, here and, by the commit's notification, on every server.
            ready = self._counts([queue]).get((queue, READY), 0)
            if ready > 0:
                self.changes.made_ready(queue, ready)
        self._settings_touched.add(queue)
        return new

    def queue_settings_of(self, queues: Sequence[str]) -> list[QueueSettings]:
        """The settings of those of ``queues`` that have any (see ``Store``)."""
        rows = self._read(_OF, (list(queues),)).fetchall()
        return [QueueSettings.from_row(row) for row in rows]

    def queue_settings(self, after: str | None, limit: int) -> list[QueueSettings]:
        """The settings of up to ``limit`` queues after ``after`` (see ``Store``)."""
        limit = max(0, min(limit, SETTINGS_PAGE + 1))  # (a page, and whether more follow)
        rows = self._read(_PAGE, (after or "", limit)).fetchall()
        return [QueueSettings.from_row(row) for row in rows]
