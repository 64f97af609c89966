"""The history per queue and minute as SQLite (relay/store/history.py): the flush's upsert,
the read per step, the pruning."""

from __future__ import annotations

from relay.store import history
from relay.store.sqlite.sql import SqliteBase, _execute_rows

_COLUMNS = ", ".join(history.COLUMNS)
_ADDS = ", ".join(
    f"{c} = max(history.{c}, excluded.{c})"
    if c.endswith("_max_ms")
    else f"{c} = history.{c} + excluded.{c}"
    for c in history.COLUMNS
)
_UPSERT = (
    f"INSERT INTO history (queue, minute, {_COLUMNS}) VALUES {{values}} "
    f"ON CONFLICT (queue, minute) DO UPDATE SET {_ADDS}"
)
_ROW = "(" + ", ".join(["?"] * (2 + history.N_COLUMNS)) + ")"
_READ = history.read_sql("?")
_PRUNE = (
    "DELETE FROM history WHERE rowid IN "
    "(SELECT rowid FROM history INDEXED BY history_minute WHERE minute < ? LIMIT ?)"
)


class SqliteHistory(SqliteBase):
    """History: part of ``SqliteStore``."""

    def _history_write(self, rows: list[history.HistoryRow]) -> None:
        _execute_rows(
            self._db, _UPSERT, _ROW, [(row.queue, row.minute, *row.values) for row in rows]
        )

    def history_read(
        self, queue: str | None, start: int, end: int, step: int
    ) -> list[history.HistoryPoint]:
        name = history.ALL_QUEUES if queue is None else queue
        found = self._db.execute(_READ, (start, step, name, start, end))
        return history.points(start, end, step, found.fetchall())

    def history_prune(self, now: int, limit: int) -> int:
        cursor = self._db.execute(_PRUNE, (now - history.HISTORY_KEEP_MS, limit))
        return cursor.rowcount
