"""The dead letters (and other finished jobs), as SQLite: retry (ready again with fresh
attempts) and purge (delete), one job or a bounded piece of a queue at a time. Listing
them is a read (reads.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.protocol.errors import InvalidState, JobNotFound
from relay.protocol.model import parse_job_id
from relay.store.base import DEAD, PURGEABLE, READY, RETRYABLE, refusal_hint
from relay.store.sqlite.sql import _JSON_IDS, SqliteBase, _json_ids, _json_rows, _json_select

_DEAD_OF_QUEUE_SQL = _json_select(
    "id, queue",
    "FROM jobs INDEXED BY jobs_dead_queue WHERE state = 'dead' AND queue = ? ORDER BY id LIMIT ?",
)

# A queue's jobs of another finished state (cancelled, succeeded), for a bulk retry or
# purge: a seek of jobs_queue_state.
_OF_QUEUE_STATE_SQL = _json_select(
    "id, queue",
    "FROM jobs INDEXED BY jobs_queue_state WHERE queue = ? AND state = ? ORDER BY id LIMIT ?",
)


class SqliteDead(SqliteBase):
    """Dead-letter retry and purge: part of ``SqliteStore``."""

    def _finished_job(
        self, job_id: str, operation: str, states: Sequence[str]
    ) -> tuple[int, str, str]:
        """(key, queue, state) of the job if it is in ``states``; else the refusal."""
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._db.execute("SELECT queue, state FROM jobs WHERE id = ?", (key,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        if row[1] not in states:
            raise InvalidState(job_id, row[1], operation, refusal_hint(operation, row[1], states))
        assert key is not None
        return key, row[0], row[1]

    def dead_retry(self, job_id: str, now: int, states: Sequence[str] = (DEAD,)) -> int:
        """Make one job in ``states`` (dead, cancelled) ready with fresh attempts. Its
        error history is kept."""
        key, queue, state = self._finished_job(job_id, "retry", states)
        self._revive([(key, queue)], now, state)
        return 1

    def dead_retry_queue(
        self, queue: str, now: int, limit: int, states: Sequence[str] = (DEAD,)
    ) -> int:
        """Make up to ``limit`` jobs of ``queue`` in ``states`` (dead, cancelled) ready;
        return how many. Call again while it returns ``limit``: each call is one bounded
        piece of work."""
        done = 0
        for state in RETRYABLE:
            if state in states and done < limit:
                rows = self._of_queue(queue, state, limit - done)
                self._revive(rows, now, state)
                done += len(rows)
        return done

    def _of_queue(self, queue: str, state: str, limit: int) -> list:
        if state == DEAD:
            return _json_rows(self._db, _DEAD_OF_QUEUE_SQL, (queue, limit))
        return _json_rows(self._db, _OF_QUEUE_STATE_SQL, (queue, state, limit))

    def _revive(self, rows: list[tuple[int, str]], now: int, state: str = DEAD) -> None:
        self._db.execute(
            "UPDATE jobs SET state = 'ready', attempt = 0, ready_at = ?, run_at = NULL, "
            "finished_at = NULL, lease_token = NULL, lease_worker = NULL, "
            f"lease_expires_at = NULL WHERE id IN {_JSON_IDS}",
            (now, _json_ids([key for key, _queue in rows])),
        )
        for _key, queue in rows:
            self._move(queue, state, READY)
            self.changes.ready_queues.add(queue)
        if self.recording:  # with fresh attempts
            for key, queue in rows:
                self._record(key, queue, state, "ready", 0, now)

    def dead_purge(self, job_id: str, states: Sequence[str] = (DEAD,)) -> int:
        """Delete one job in ``states`` (dead, succeeded, cancelled) and its history."""
        key, queue, state = self._finished_job(job_id, "purge", states)
        self._delete_jobs([(key, queue)], state)
        return 1

    def dead_purge_queue(self, queue: str, limit: int, states: Sequence[str] = (DEAD,)) -> int:
        """Delete up to ``limit`` jobs of ``queue`` in ``states`` (dead, succeeded,
        cancelled); return how many (see retry)."""
        done = 0
        for state in PURGEABLE:
            if state in states and done < limit:
                rows = self._of_queue(queue, state, limit - done)
                self._delete_jobs(rows, state)
                done += len(rows)
        return done
