"""The dead letters, as SQLite: retry (ready again with fresh attempts) and purge (delete),
one job or a bounded piece of a queue at a time. Listing them is a read (reads.py).
"""

from __future__ import annotations

from relay.protocol.errors import InvalidState, JobNotFound
from relay.protocol.model import parse_job_id
from relay.store.base import DEAD, READY
from relay.store.sqlite.sql import _JSON_IDS, SqliteBase, _json_ids, _json_rows, _json_select

_DEAD_OF_QUEUE_SQL = _json_select(
    "id, queue",
    "FROM jobs INDEXED BY jobs_dead_queue WHERE state = 'dead' AND queue = ? ORDER BY id LIMIT ?",
)


class SqliteDead(SqliteBase):
    """Dead-letter retry and purge: part of ``SqliteStore``."""

    def _dead_job(self, job_id: str, operation: str) -> tuple[int, str]:
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._db.execute("SELECT queue, state FROM jobs WHERE id = ?", (key,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        if row[1] != DEAD:
            raise InvalidState(job_id, row[1], operation)
        assert key is not None
        return key, row[0]

    def dead_retry(self, job_id: str, now: int) -> int:
        """Make one dead job ready with fresh attempts. Its error history is kept."""
        key, queue = self._dead_job(job_id, "retry")
        self._revive([(key, queue)], now)
        return 1

    def dead_retry_queue(self, queue: str, now: int, limit: int) -> int:
        """Make up to ``limit`` dead jobs of ``queue`` ready; return how many. Call again
        while it returns ``limit``: each call is one bounded piece of work."""
        rows = _json_rows(self._db, _DEAD_OF_QUEUE_SQL, (queue, limit))
        self._revive(rows, now)
        return len(rows)

    def _revive(self, rows: list[tuple[int, str]], now: int) -> None:
        self._db.execute(
            "UPDATE jobs SET state = 'ready', attempt = 0, ready_at = ?, run_at = NULL, "
            "finished_at = NULL, lease_token = NULL, lease_worker = NULL, "
            f"lease_expires_at = NULL WHERE id IN {_JSON_IDS}",
            (now, _json_ids([key for key, _queue in rows])),
        )
        for _key, queue in rows:
            self._move(queue, DEAD, READY)
            self.changes.ready_queues.add(queue)
        if self.recording:  # with fresh attempts
            for key, queue in rows:
                self._record(key, queue, "dead", "ready", 0, now)

    def dead_purge(self, job_id: str) -> int:
        """Delete one dead job and its history."""
        key, queue = self._dead_job(job_id, "purge")
        self._delete_jobs([(key, queue)], DEAD)
        return 1

    def dead_purge_queue(self, queue: str, limit: int) -> int:
        """Delete up to ``limit`` dead jobs of ``queue``; return how many (see retry)."""
        rows = _json_rows(self._db, _DEAD_OF_QUEUE_SQL, (queue, limit))
        self._delete_jobs(rows, DEAD)
        return len(rows)
