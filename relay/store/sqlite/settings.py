"""Queue settings as SQLite: pause and resume a queue, its limits and submit defaults
(``queue_config``), and the settings read a page at a time.

One server owns the file, so the settings are kept in memory (``_settings``, and what a
claim needs of them: ``_paused``, ``_limited``; what a submit needs: ``_defaults``):
loaded when the store opens, changed only once the transaction that changed the table has
committed (``_settle_settings``), so they never hold what was rolled back. A claim filters
its queues against them, and pays one truth test each when no queue is paused or limited
(leases.py); a submit pays one when no queue has defaults (jobs.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from relay.store import claims as claims_
from relay.store.base import (
    LEASED,
    MAX_QUEUE_SETTINGS,
    READY,
    SETTINGS_COLUMNS,
    SETTINGS_PAGE,
    ClaimArgs,
    QueueSettings,
    SubmitDefaults,
    too_many_settings,
)
from relay.store.sqlite.sql import SqliteBase

# (The rate window's columns keep their values: a window open stays open.)
_UPSERT = (
    f"INSERT INTO queue_settings ({SETTINGS_COLUMNS}, updated_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?9) ON CONFLICT (queue) DO UPDATE SET "
    "paused = excluded.paused, max_leased = excluded.max_leased, "
    "rate_limit = excluded.rate_limit, rate_period_ms = excluded.rate_period_ms, "
    "default_timeout_ms = excluded.default_timeout_ms, "
    "default_retries = excluded.default_retries, "
    "default_backoff = excluded.default_backoff, updated_at = ?9"
)
_ROW = f"SELECT {SETTINGS_COLUMNS} FROM queue_settings WHERE queue = ?"
_WINDOW = "SELECT rate_window_start, rate_window_count FROM queue_settings WHERE queue = ?"
_SET_WINDOW = (
    "UPDATE queue_settings SET rate_window_start = ?, rate_window_count = ? WHERE queue = ?"
)
_OF = (
    f"SELECT {SETTINGS_COLUMNS} FROM queue_settings WHERE queue IN (SELECT value FROM json_each(?))"
)
_PAGE = f"SELECT {SETTINGS_COLUMNS} FROM queue_settings WHERE queue > ? ORDER BY queue LIMIT ?"


class SqliteSettings(SqliteBase):
    """Pause, resume, limits, defaults, and the settings' pages: part of ``SqliteStore``."""

    # Every queue's settings, as committed (the queues without a row have none); the
    # queues paused, those with a limit, and those with submit defaults among them (each
    # with what a spec takes of them: base.SubmitDefaults); and the queues the open
    # transaction changed, read again by its commit, forgotten by its rollback.
    _settings: dict[str, QueueSettings]
    _paused: frozenset[str]
    _limited: frozenset[str]
    _defaults: dict[str, SubmitDefaults]
    _settings_touched: set[str]
    # The rate-limited queues a claim left with ready jobs and a full window; the rate
    # windows the claim being made read (queue -> (opened at, leases in it)).
    _rate_waits: claims_.RateWaits
    _windows: dict[str, tuple[int | None, int]]

    def _load_settings(self) -> None:
        rows = self._db.execute(f"SELECT {SETTINGS_COLUMNS} FROM queue_settings").fetchall()
        self._settings = {row[0]: QueueSettings.from_row(row) for row in rows}
        self._settings_touched = set()
        self._rate_waits = claims_.RateWaits()
        self._derive_settings()

    def _derive_settings(self) -> None:
        values = self._settings.values()
        self._paused = frozenset(s.queue for s in values if s.paused)
        self._limited = frozenset(s.queue for s in values if s.limited)
        self._defaults = {
            s.queue: defaults for s in values if (defaults := s.submit_defaults) is not None
        }
        limits = {s.queue: (s.max_leased, s.rate) for s in values if s.limited}
        self.view.publish_paused(self._paused, limits)

    def _settle_settings(self, committed: bool) -> None:
        """After a commit (``committed``) or a rollback: the transaction's setting changes
        take effect, or are forgotten. What took effect is read back from the table, for
        the queues the transaction touched: a command undone by its savepoint (a batch the
        disk refused, run again item by item: relay/store/passes.py) left its change here
        but not there."""
        touched, self._settings_touched = list(self._settings_touched), set()
        if not committed or not touched:
            return
        for queue in touched:
            row = self._db.execute(_ROW, (queue,)).fetchone()
            if row is None:
                self._settings.pop(queue, None)
            else:
                self._settings[queue] = QueueSettings.from_row(row)
        self._derive_settings()

    def _claim_room(self, claims: Sequence[ClaimArgs], now: int) -> dict[str, int] | None:
        """How many jobs each limited queue the claims ask for may lease (None: none is
        limited): its limit less its jobs leased now (the counts in memory, this
        transaction's claims included), and its rate window's room (read from its row,
        kept in ``_windows`` for ``_claimed_limited``)."""
        limited = {q for claim in claims for q in claim[0] if q in self._limited}
        if not limited:
            return None
        room, self._windows = {}, {}
        for queue in limited:
            settings = self._settings[queue]
            window: tuple[int | None, int] = (None, 0)
            if settings.rate is not None:
                window = self._db.execute(_WINDOW, (queue,)).fetchone() or window
                self._windows[queue] = window
            leased = self._counts.get((queue, LEASED), 0)
            room[queue] = claims_.room_for(settings, leased, window, now)
        return room

    def _claimed_limited(self, leased: dict[str, int], now: int) -> None:
        """After a claim that had room in limited queues and leased ``leased`` jobs per
        queue: each rate window counts its leases; one left full (and open) with ready jobs
        waits for its end."""
        for queue, window in self._windows.items():
            rate = self._settings[queue].rate
            assert rate is not None
            ready = self._counts.get((queue, READY), 0)
            n = leased.get(queue, 0)
            after = self._rate_waits.after_claim(queue, rate, window, now, n, ready, self.changes)
            if after is not None:
                self._db.execute(_SET_WINDOW, (*after, queue))

    def queue_pause(self, queue: str, paused: bool, now: int) -> bool:
        """Pause or resume ``queue`` (see ``Store.queue_pause``)."""
        return self.queue_config(queue, {"paused": paused}, now).paused

    def queue_config(self, queue: str, changes: Mapping[str, Any], now: int) -> QueueSettings:
        """Change ``queue``'s settings, return them all (see ``Store.queue_config``)."""
        row = self._db.execute(_ROW, (queue,)).fetchone()
        old = QueueSettings(queue) if row is None else QueueSettings.from_row(row)
        new = old.changed(changes)
        if new == old:
            return old
        if new.is_default:
            self._db.execute("DELETE FROM queue_settings WHERE queue = ?", (queue,))
        else:
            if row is None:
                (held,) = self._db.execute("SELECT count(*) FROM queue_settings").fetchone()
                if held >= MAX_QUEUE_SETTINGS:
                    raise too_many_settings(held)
            self._db.execute(_UPSERT, (*new.to_row(), now))
        if new.loosens(old):
            # Its ready jobs may be claimable again: as if made ready now, so that leases
            # parked on it wake (relay/server/requests/longpoll.py).
            ready = self._counts.get((queue, READY), 0)
            if ready:
                self.changes.made_ready(queue, ready)
        self._settings_touched.add(queue)
        if self._journal is None:  # outside a transaction: the statement has committed
            self._settle_settings(True)
        return new

    def queue_settings_of(self, queues: Sequence[str]) -> list[QueueSettings]:
        """The settings of those of ``queues`` that have any (see ``Store``)."""
        rows = self._db.execute(_OF, (json.dumps(list(queues)),))
        return [QueueSettings.from_row(row) for row in rows]

    def queue_settings(self, after: str | None, limit: int) -> list[QueueSettings]:
        """The settings of up to ``limit`` queues after ``after`` (see ``Store``)."""
        limit = max(0, min(limit, SETTINGS_PAGE + 1))  # (a page, and whether more follow)
        rows = self._db.execute(_PAGE, (after or "", limit))
        return [QueueSettings.from_row(row) for row in rows]
