"""Dead letters on PostgreSQL: retry or purge one dead job, or a queue's, a bounded piece
at a time.

One named job is locked (``FOR UPDATE``) before its state is checked, so that it is still
in that state when it is changed; a queue's dead jobs are taken with ``FOR UPDATE SKIP LOCKED``, so
that two servers emptying one queue share the work.
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.protocol.errors import InvalidState, JobNotFound
from relay.protocol.model import JobState, parse_job_id
from relay.store.base import PURGEABLE, RETRYABLE, refusal_hint
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.sql import atomic

READY, DEAD = JobState.READY, JobState.DEAD

# Fresh attempts: no old token holds anything any more. The error history is kept.
_REVIVE = (
    "SET state = 'ready', attempt = 0, ready_at = %s, run_at = NULL, finished_at = NULL, "
    "lease_token = NULL, lease_worker = NULL, lease_expires_at = NULL"
)
_REVIVE_ONE = f"UPDATE jobs {_REVIVE} WHERE id = %s"
_REVIVE_QUEUE = (
    "WITH d AS (SELECT id FROM jobs WHERE state = 'dead' AND queue = %s "
    f"ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED) UPDATE jobs {_REVIVE} "
    "FROM d WHERE jobs.id = d.id RETURNING jobs.id"
)
# Errors go with the jobs (ON DELETE CASCADE); idempotency keys stay until they expire
# (_keys_outlive).
# (The rows chosen once, in a materialized CTE: as "id IN (SELECT ... LIMIT)" the planner
# may run the limited subquery again per row of a join, and delete past the limit.)
_PURGE_QUEUE = (
    "WITH d AS MATERIALIZED (SELECT id FROM jobs WHERE state = 'dead' AND queue = %s "
    "ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED) "
    "DELETE FROM jobs USING d WHERE jobs.id = d.id RETURNING jobs.id"
)

# The same of another finished state (cancelled, succeeded: a bulk retry or purge), a scan
# of jobs_queue_state; dead ones keep the statements above, on jobs_dead_queue.
_REVIVE_STATE = _REVIVE_QUEUE.replace("state = 'dead'", "state = %s", 1)
_PURGE_STATE = _PURGE_QUEUE.replace("state = 'dead'", "state = %s", 1)


class DeadLetters(PostgresBase):
    """The dead-letter commands of ``PostgresStore``."""

    def _finished_job(
        self, job_id: str, operation: str, states: Sequence[str]
    ) -> tuple[int, str, str]:
        """(key, queue, state) of the job, locked, if it is in ``states``; else the
        refusal, raised, having written nothing."""
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._read(
                "SELECT queue, state FROM jobs WHERE id = %s FOR UPDATE", (key,)
            ).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        if row[1] not in states:
            raise InvalidState(job_id, row[1], operation, refusal_hint(operation, row[1], states))
        assert key is not None
        return key, row[0], row[1]

    @atomic
    def dead_retry(self, job_id: str, now: int, states: Sequence[str] = (DEAD,)) -> int:
        """Make one job in ``states`` (dead, cancelled) ready with fresh attempts. Its
        error history is kept."""
        key, queue, state = self._finished_job(job_id, "retry", states)
        self._write(_REVIVE_ONE, (now, key))
        self._revived([key], queue, now, state)
        return 1

    @atomic
    def dead_retry_queue(
        self, queue: str, now: int, limit: int, states: Sequence[str] = (DEAD,)
    ) -> int:
        """Make up to ``limit`` jobs of ``queue`` in ``states`` (dead, cancelled) ready;
        return how many. Call again while it returns ``limit``: each call is one bounded
        piece of work."""
        done = 0
        for state in RETRYABLE:
            if state in states and done < limit:
                if state == DEAD:
                    sql, params = _REVIVE_QUEUE, (queue, limit - done, now)
                else:
                    sql, params = _REVIVE_STATE, (state, queue, limit - done, now)
                keys = sorted(key for (key,) in self._write(sql, params))
                self._revived(keys, queue, now, state)
                done += len(keys)
        return done

    def _revived(self, keys: list[int], queue: str, now: int, state: str = DEAD) -> None:
        if not keys:
            return
        self._move(queue, state, READY, len(keys))
        self.changes.ready_queues.add(queue)
        if self.recording:  # with fresh attempts
            for key in keys:
                self._record(key, queue, state, "ready", 0, now)

    @atomic
    def dead_purge(self, job_id: str, states: Sequence[str] = (DEAD,)) -> int:
        """Delete one job in ``states`` (dead, succeeded, cancelled) and its history."""
        key, queue, state = self._finished_job(job_id, "purge", states)
        self._keys_outlive([key], state)
        self._write("DELETE FROM jobs WHERE id = %s", (key,))
        self._move(queue, state, None)
        return 1

    @atomic
    def dead_purge_queue(self, queue: str, limit: int, states: Sequence[str] = (DEAD,)) -> int:
        """Delete up to ``limit`` jobs of ``queue`` in ``states`` (dead, succeeded,
        cancelled); return how many (see retry)."""
        done = 0
        for state in PURGEABLE:
            if state in states and done < limit:
                if state == DEAD:
                    sql, params = _PURGE_QUEUE, (queue, limit - done)
                else:
                    sql, params = _PURGE_STATE, (state, queue, limit - done)
                keys = [key for (key,) in self._write(sql, params)]
                self._keys_outlive(keys, state)
                n = len(keys)
                if n:
                    self._move(queue, state, None, n)
                done += n
        return done
