"""The history per queue and minute as PostgreSQL (relay/store/history.py): the flush's one
upsert, which adds to what other servers flushed; the read per step; the pruning."""

from __future__ import annotations

from relay.store import history
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.sql import atomic

_COLUMNS = ", ".join(history.COLUMNS)
_ADDS = ", ".join(
    f"{c} = greatest(history.{c}, excluded.{c})"
    if c.endswith("_max_ms")
    else f"{c} = history.{c} + excluded.{c}"
    for c in history.COLUMNS
)
# One statement for every row of a flush, its rows in (queue, minute) order: two servers
# flushing at once lock the rows they share in the same order, so they never deadlock.
_UPSERT = (
    f"INSERT INTO history (queue, minute, {_COLUMNS}) "
    "SELECT * FROM unnest(%s::text[], %s::bigint[], "
    + ", ".join(["%s::bigint[]"] * history.N_COLUMNS)
    + f") ON CONFLICT (queue, minute) DO UPDATE SET {_ADDS}"
)
_READ = history.read_sql("%s")
_PRUNE = (
    "DELETE FROM history WHERE ctid = ANY(ARRAY("
    "SELECT ctid FROM history WHERE minute < %s LIMIT %s))"
)


class History(PostgresBase):
    """History: part of ``PostgresStore``."""

    @atomic
    def history_flush(self, now: int) -> history.HistoryFlushed:
        return super().history_flush(now)

    def _history_write(self, rows: list[history.HistoryRow]) -> None:
        columns = [[row.queue for row in rows], [row.minute for row in rows]]
        columns += [[row.values[i] for row in rows] for i in range(history.N_COLUMNS)]
        self._write(_UPSERT, columns)

    def history_read(
        self, queue: str | None, start: int, end: int, step: int
    ) -> list[history.HistoryPoint]:
        name = history.ALL_QUEUES if queue is None else queue
        found = self._read(_READ, (start, step, name, start, end))
        return history.points(start, end, step, found.fetchall())

    @atomic
    def history_prune(self, now: int, limit: int) -> int:
        return self._write(_PRUNE, (now - history.HISTORY_KEEP_MS, limit)).rowcount
