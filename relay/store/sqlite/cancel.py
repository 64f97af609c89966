"""Cancel, as SQLite: one job, or a bounded piece of a queue's jobs in chosen states.

A job cancelled before it started (pending, ready, retrying) loses any old lease token, so
an old token is stale as before. A leased job keeps its token and worker on the row, its
expiry cleared: ``check_lease`` then answers that token ``Cancelled`` (and any other one
``StaleToken``), and the reaper, which looks only at leased jobs, never sees it.
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.protocol.model import AttemptOutcome, JobState, format_job_id, parse_job_id
from relay.store.base import CANCELLABLE, CANCELLED, LEASED, check_cancel
from relay.store.sqlite.sql import _JSON_IDS, SqliteBase, _json_ids, _json_rows, _json_select

# Cancelled: finished now; the token stays only on a job that was leased.
_CANCEL = (
    "UPDATE jobs SET state = 'cancelled', finished_at = ?, lease_expires_at = NULL, "
    "lease_token = CASE WHEN state = 'leased' THEN lease_token END "
)
_CANCEL_ONE = _CANCEL + "WHERE id = ?"
_CANCEL_MANY = _CANCEL + f"WHERE id IN {_JSON_IDS}"

# A queue's jobs of some states, a seek on the index that holds each state: ready jobs in
# jobs_ready, pending and retrying ones in jobs_due_queue; leased ones are read from
# jobs_leased (every lease held, a number bounded by the workers' slots).
_OF_QUEUE = {
    "ready": "FROM jobs INDEXED BY jobs_ready WHERE state = 'ready' AND queue = ? "
    "ORDER BY priority, ready_at, id LIMIT ?",
    "due": (
        "FROM jobs INDEXED BY jobs_due_queue WHERE state IN ('pending', 'retrying') "
        "AND queue = ? AND state IN (SELECT value FROM json_each(?)) ORDER BY id LIMIT ?"
    ),
    "leased": "FROM jobs INDEXED BY jobs_leased WHERE state = 'leased' AND queue = ? "
    "ORDER BY lease_expires_at, id LIMIT ?",
}
_OF_QUEUE_SQL = {name: _json_select("id, state, attempt", rest) for name, rest in _OF_QUEUE.items()}


class SqliteCancel(SqliteBase):
    """Cancel one job or a queue's: part of ``SqliteStore``."""

    def job_cancel(self, job_id: str, now: int, leased_ok: bool = True) -> JobState:
        """Cancel one unfinished job; return the state it was in (see ``Store``)."""
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._db.execute(
                "SELECT queue, state, attempt FROM jobs WHERE id = ?", (key,)
            ).fetchone()
        queue, state, attempt = check_cancel(job_id, row, leased_ok)
        assert key is not None
        self._db.execute(_CANCEL_ONE, (now, key))
        self._cancelled(queue, [(key, state, attempt)], now)
        return JobState(state)

    def job_cancel_queue(self, queue: str, states: Sequence[str], now: int, limit: int) -> int:
        """Cancel up to ``limit`` jobs of ``queue`` in ``states``; return how many. Call
        again while it returns ``limit``: each call is one bounded piece of work."""
        wanted = [state for state in CANCELLABLE if state in states]
        rows: list[tuple[int, str, int]] = []
        due = [state for state in wanted if state in ("pending", "retrying")]
        if "ready" in wanted:
            rows += _json_rows(self._db, _OF_QUEUE_SQL["ready"], (queue, limit - len(rows)))
        if due and len(rows) < limit:
            params = (queue, _json_ids(due), limit - len(rows))
            rows += _json_rows(self._db, _OF_QUEUE_SQL["due"], params)
        if "leased" in wanted and len(rows) < limit:
            rows += _json_rows(self._db, _OF_QUEUE_SQL["leased"], (queue, limit - len(rows)))
        if rows:
            self._db.execute(_CANCEL_MANY, (now, _json_ids([row[0] for row in rows])))
            self._cancelled(queue, [tuple(row) for row in rows], now)
        return len(rows)

    def _cancelled(self, queue: str, rows: list[tuple[int, str, int]], now: int) -> None:
        """Count and record these jobs (key, state it was in, attempt) as cancelled."""
        leased = [key for key, state, _attempt in rows if state == LEASED]
        if leased:  # their attempts ended (their rows keep worker and start)
            self._end_leases(leased, AttemptOutcome.CANCELLED.value, "", now)
        for key, state, _attempt in rows:
            if state == LEASED:
                self._held.pop(format_job_id(key), None)
            self._move(queue, state, CANCELLED)
        self._count(queue, "cancelled", len(rows))
        if self.recording:
            for key, state, attempt in rows:
                self._record(key, queue, state, "cancelled", attempt, now)
