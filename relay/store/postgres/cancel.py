"""Cancel on PostgreSQL: one job, or a bounded piece of a queue's jobs in chosen states.

The rules are SqliteStore's (relay/store/sqlite/cancel.py). One named job is locked (``FOR
UPDATE``) before its state is checked, so that a worker's ack or a claim on another server
cannot change it meanwhile; a queue's jobs are taken with ``FOR UPDATE SKIP LOCKED``, so
that two servers cancelling one queue share the work, and a job another server is leasing
or acking right now is left to the next piece.
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.protocol.model import AttemptOutcome, JobState, parse_job_id
from relay.store.base import CANCELLED, LEASED, check_cancel
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.sql import atomic

# Cancelled: finished now; the token stays only on a job that was leased.
_CANCEL = (
    "SET state = 'cancelled', finished_at = %s, lease_expires_at = NULL, "
    "lease_token = CASE WHEN jobs.state = 'leased' THEN jobs.lease_token END"
)
_CANCEL_ONE = f"UPDATE jobs {_CANCEL} WHERE id = %s"
# A queue's jobs of some states, each group a scan of the partial index that holds it
# (its predicate written out, so that a prepared statement's generic plan uses it): ready
# jobs in jobs_ready, pending and retrying ones in jobs_due_queue, leased ones in
# jobs_leased (every lease held, a number bounded by the workers' slots). The state each
# job was in comes from the locked sub-select: the update's RETURNING sees the new one.
_CANCEL_QUEUE = (
    "WITH c AS (SELECT id, state FROM jobs WHERE {where} AND queue = %s AND state = ANY(%s) "
    "ORDER BY {order} LIMIT %s FOR UPDATE SKIP LOCKED) "
    f"UPDATE jobs {_CANCEL} FROM c WHERE jobs.id = c.id RETURNING jobs.id, c.state, jobs.attempt"
)
# (where, the index's order, the states it holds): in the index's order, so that the plan
# is a scan of it that stops at the limit.
_GROUPS = (
    ("state = 'ready'", "queue, priority, ready_at, id", ("ready",)),
    ("state IN ('pending', 'retrying')", "queue, id", ("pending", "retrying")),
    ("state = 'leased'", "lease_expires_at, id", ("leased",)),
)
_CANCEL_GROUP = [
    (_CANCEL_QUEUE.format(where=where, order=order), members) for where, order, members in _GROUPS
]


class Cancel(PostgresBase):
    """Cancel one job or a queue's: part of ``PostgresStore``."""

    @atomic
    def job_cancel(self, job_id: str, now: int, leased_ok: bool = True) -> JobState:
        """Cancel one unfinished job; return the state it was in (see ``Store``)."""
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._read(
                "SELECT queue, state, attempt FROM jobs WHERE id = %s FOR UPDATE", (key,)
            ).fetchone()
        queue, state, attempt = check_cancel(job_id, row, leased_ok)
        assert key is not None
        self._write(_CANCEL_ONE, (now, key))
        self._cancelled(queue, [(key, state, attempt)], now)
        return JobState(state)

    @atomic
    def job_cancel_queue(self, queue: str, states: Sequence[str], now: int, limit: int) -> int:
        """Cancel up to ``limit`` jobs of ``queue`` in ``states``; return how many. Call
        again while it returns ``limit``: each call is one bounded piece of work."""
        rows: list[tuple] = []
        for sql, members in _CANCEL_GROUP:
            wanted = [state for state in members if state in states]
            if wanted and len(rows) < limit:
                rows += sorted(self._write(sql, (queue, wanted, limit - len(rows), now)))
        self._cancelled(queue, [tuple(row) for row in rows], now)
        return len(rows)

    def _cancelled(self, queue: str, rows: list[tuple], now: int) -> None:
        """Count and record these jobs (key, state it was in, attempt) as cancelled."""
        if not rows:
            return
        leased = [key for key, state, _attempt in rows if state == LEASED]
        if leased:  # their attempts ended (their rows keep worker and start)
            self._end_leases(leased, AttemptOutcome.CANCELLED.value, "", now)
        for _key, state, _attempt in rows:
            self._move(queue, state, CANCELLED)
        self._count(queue, "cancelled", len(rows))
        if self.recording:
            for key, state, attempt in rows:
                self._record(key, queue, state, "cancelled", attempt, now)
