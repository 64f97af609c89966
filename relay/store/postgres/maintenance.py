"""The time-driven transitions on PostgreSQL: promote, reap, recover, prune, next times.

Every server runs the promoter and the reaper (relay/server/services/maintenance.py) on the same
rows. Each pass takes its rows with ``FOR UPDATE SKIP LOCKED`` and is one statement: two
servers passing at once split the due rows between them instead of waiting for each other
or doing a job's transition twice, and a row another server changed since the pass's
snapshot is checked again against the pass's conditions once locked (so a job acked
meanwhile is not reaped). No server needs to be elected for them, nor to hand over when it
dies: the remaining ones carry on at their own pace.
"""

from __future__ import annotations

from relay.protocol.model import JobState, format_job_id
from relay.store.base import ATTEMPTS_KEPT, LEASE_EXPIRED_ERROR, Reaped
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.sql import atomic

READY, SUCCEEDED, DEAD = JobState.READY, JobState.SUCCEEDED, JobState.DEAD
CANCELLED = JobState.CANCELLED

# A promoted job counts as ready from its due time, not from when the pass ran.
_PROMOTE = (
    "WITH due AS (SELECT id, state FROM jobs WHERE state IN ('pending', 'retrying') "
    "AND run_at <= %s ORDER BY run_at, id LIMIT %s FOR UPDATE SKIP LOCKED) "
    "UPDATE jobs SET state = 'ready', ready_at = jobs.run_at FROM due WHERE jobs.id = due.id "
    "RETURNING jobs.id, jobs.queue, due.state, jobs.attempt, jobs.run_at"
)
# An expired lease: ready again from its expiry if attempts are left, else dead. Either
# way "lease expired" joins the history ("timed out after N ms" for a lease that reached
# its attempt's deadline: model.timeout_error), and lease_expires_at stays, so that the
# old token keeps answering lease_expired.
_REAP = (
    "WITH expired AS (SELECT id, attempt, max_attempts, lease_expires_at, leased_at, "
    "lease_worker, deadline_at IS NOT NULL AND lease_expires_at >= deadline_at AS timed_out, "
    "CASE WHEN deadline_at IS NOT NULL AND lease_expires_at >= deadline_at "
    "THEN 'timed out after ' || timeout_ms || ' ms' ELSE %(error)s END AS error FROM jobs "
    "WHERE state = 'leased' AND lease_expires_at <= %(now)s "
    "ORDER BY lease_expires_at, id LIMIT %(limit)s FOR UPDATE SKIP LOCKED), "
    "errors AS (INSERT INTO job_errors (job_id, attempt, error, at, started_at, worker, "
    "outcome) SELECT id, attempt, error, %(now)s, leased_at, lease_worker, "
    "CASE WHEN timed_out THEN 'timed_out' ELSE 'expired' END "
    "FROM expired ORDER BY lease_expires_at, id) "
    "UPDATE jobs SET last_error = e.error, attempts_ended = jobs.attempts_ended + 1, "
    "state = CASE WHEN e.attempt < e.max_attempts THEN 'ready' ELSE 'dead' END, "
    "ready_at = CASE WHEN e.attempt < e.max_attempts THEN e.lease_expires_at "
    "ELSE jobs.ready_at END, "
    "finished_at = CASE WHEN e.attempt < e.max_attempts THEN jobs.finished_at "
    "ELSE %(now)s END "
    "FROM expired AS e WHERE jobs.id = e.id "
    "RETURNING jobs.id, jobs.queue, jobs.state, jobs.attempt, e.lease_expires_at, "
    "jobs.attempts_ended"
)
# Each the rows chosen once, in a materialized CTE: as "IN (SELECT ... LIMIT)" the
# planner may run the limited subquery again per row of a join, and delete past the limit.
_PRUNE_KEYS = (
    "WITH d AS MATERIALIZED (SELECT queue, key FROM idempotency_keys WHERE expires_at <= %s "
    "LIMIT %s FOR UPDATE SKIP LOCKED) DELETE FROM idempotency_keys AS k USING d "
    "WHERE k.queue = d.queue AND k.key = d.key"
)
# Their errors go with them (ON DELETE CASCADE), their idempotency keys stay until they
# expire (_keys_outlive). Succeeded and cancelled jobs,
# each state a scan of its own partial index (jobs_succeeded, jobs_cancelled): the state
# is written in the text, since a prepared statement's generic plan cannot match a
# parameter to an index's predicate.
_PRUNE_STATE = (
    "WITH d AS MATERIALIZED (SELECT id FROM jobs WHERE state = '{state}' "
    "AND finished_at < %s LIMIT %s FOR UPDATE SKIP LOCKED) "
    "DELETE FROM jobs USING d WHERE jobs.id = d.id RETURNING jobs.id, jobs.queue"
)
_PRUNE_JOBS = _PRUNE_STATE.format(state="succeeded")
_PRUNE_CANCELLED = _PRUNE_STATE.format(state="cancelled")
_PRUNE = {SUCCEEDED: _PRUNE_JOBS, CANCELLED: _PRUNE_CANCELLED}


class Maintenance(PostgresBase):
    """The time-driven passes of ``PostgresStore``."""

    @atomic
    def jobs_promote_due(self, now: int, limit: int) -> int:
        """Make up to ``limit`` due pending and retrying jobs ready; return how many.

        A promoted job counts as ready from its due time, not from when this pass ran.
        """
        rows = self._write(_PROMOTE, (now, limit)).fetchall()
        if len(rows) > 1:  # in the order they fell due
            rows.sort(key=lambda row: (row[4], row[0]))
        for _key, queue, state, _attempt, _run_at in rows:
            self._move(queue, state, READY)
            self.changes.ready_queues.add(queue)
        if self.recording:
            for key, queue, state, attempt, _run_at in rows:
                self._record(key, queue, state, "ready", attempt, now)
        # Rate windows closed: the leases parked on their queues, on every server (by the
        # commit's notification), may take jobs again.
        for queue, jobs in self._rate_waits.due(now):
            self.changes.made_ready(queue, jobs)
        return len(rows)

    @atomic
    def leases_reap_expired(self, now: int, limit: int) -> list[Reaped]:
        """End up to ``limit`` leases that expired at or before ``now``.

        A job with attempts left becomes ready (from its expiry time); one without becomes
        dead with the error "lease expired". The old token keeps answering lease_expired.
        """
        rows = self._write(
            _REAP, {"now": now, "limit": limit, "error": LEASE_EXPIRED_ERROR}
        ).fetchall()
        if len(rows) > 1:  # in the order of their expiry
            rows.sort(key=lambda row: (row[4], row[0]))
        # (attempts_ended as updated: this attempt counted)
        self._trim_history([row[0] for row in rows if row[5] > ATTEMPTS_KEPT])
        reaped = []
        for key, queue, state, attempt, _expired_at, _ended in rows:
            self._count(queue, "expired", 1, now)
            if state == DEAD:
                self._count(queue, "dead", 1, now)
            else:
                self.changes.ready_queues.add(queue)
            self._move(queue, JobState.LEASED, state)
            reaped.append(Reaped(format_job_id(key), queue, JobState(state), attempt))
        if self.recording:  # (one change per job)
            self.changes.events += [
                (r.job_id, r.queue, r.state.value, r.attempt, now, "leased") for r in reaped
            ]
        return reaped

    def leases_recover(self, now: int) -> int:
        """At start: nothing to do here; returns 0.

        With SQLite the one server owns every lease, so at its start every leased job was
        leased through the process that is gone and is made ready at once. Here the other
        servers sharing the database hold live leases, which a starting server cannot tell
        from those its previous run held. The leases of a server that died expire instead,
        and the reapers of the remaining servers (or its own, once back) return them, with
        "lease expired": they wait at most the lease duration, and a worker still at work
        on one may yet ack it meanwhile. See ``recovers_on_start``.
        """
        return 0

    def next_due_at(self) -> int | None:
        """The earliest due time of a pending or retrying job (the start of jobs_due), or
        end of a full rate window that ready jobs wait for."""
        row = self._read(
            "SELECT min(run_at) FROM jobs WHERE state IN ('pending', 'retrying')"
        ).fetchone()
        due, window = None if row is None else row[0], self._rate_waits.next_at()
        return window if due is None or (window is not None and window < due) else due

    def next_expiry_at(self) -> int | None:
        """The earliest expiry of a held lease (the start of jobs_leased)."""
        row = self._read("SELECT min(lease_expires_at) FROM jobs WHERE state = 'leased'").fetchone()
        return None if row is None else row[0]

    @atomic
    def jobs_prune(self, now: int, limit: int) -> int:
        """Delete up to ``limit`` succeeded and cancelled jobs finished longer than the
        retention period ago, and up to ``limit`` expired idempotency keys. Returns jobs
        deleted."""
        self._write(_PRUNE_KEYS, (now, limit))
        before = now - self.config.retention_ms
        deleted = 0
        for state in (SUCCEEDED, CANCELLED):
            if deleted >= limit:
                break
            rows = self._write(_PRUNE[state], (before, limit - deleted)).fetchall()
            self._keys_outlive([key for key, _queue in rows], state)
            for _key, queue in rows:
                self._move(queue, state, None)
            deleted += len(rows)
        return deleted
