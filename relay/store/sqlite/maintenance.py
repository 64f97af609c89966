"""The time-driven transitions, as SQLite: promote due jobs, reap expired leases, recover
leases at start, prune old jobs and keys; and the next due time and lease expiry that the
loops (relay/server/services/maintenance.py) sleep until.
"""

from __future__ import annotations

from relay.protocol.model import AttemptOutcome, format_job_id, timeout_error
from relay.store.base import (
    ATTEMPTS_KEPT,
    CANCELLED,
    DEAD,
    LEASE_EXPIRED_ERROR,
    LEASED,
    READY,
    RESTART_ERROR,
    SUCCEEDED,
    Reaped,
)
from relay.store.sqlite.sql import (
    _INSERT_ERRORS,
    _JSON_IDS,
    SqliteBase,
    _execute_rows,
    _json_ids,
    _json_rows,
    _json_select,
)

_REAP_READY = (
    "UPDATE jobs SET state = 'ready', ready_at = v.column2, last_error = v.column3, "
    "attempts_ended = attempts_ended + 1 FROM (VALUES {values}) AS v WHERE jobs.id = v.column1"
)
_REAP_DEAD = (
    "UPDATE jobs SET state = 'dead', finished_at = ?1, last_error = v.column2, "
    "attempts_ended = attempts_ended + 1 FROM (VALUES {values}) AS v WHERE jobs.id = v.column1"
)
_DUE_ROWS_SQL = _json_select(
    "id, queue, state",
    "FROM jobs WHERE state IN ('pending', 'retrying') AND run_at <= ? ORDER BY run_at LIMIT ?",
)
# The same rows with their attempts, for ``changes.events`` (only while recording).
_DUE_EVENT_ROWS_SQL = _json_select(
    "id, queue, state, attempt",
    "FROM jobs WHERE state IN ('pending', 'retrying') AND run_at <= ? ORDER BY run_at LIMIT ?",
)
_EXPIRED_ROWS_SQL = _json_select(
    "id, queue, attempt, max_attempts, lease_expires_at, deadline_at, timeout_ms, leased_at, "
    "lease_worker, attempts_ended",
    "FROM jobs WHERE state = 'leased' AND lease_expires_at <= ? ORDER BY lease_expires_at LIMIT ?",
)
_EXPIRED, _TIMED_OUT = AttemptOutcome.EXPIRED.value, AttemptOutcome.TIMED_OUT.value
_INTERRUPTED = AttemptOutcome.INTERRUPTED.value
_SUCCEEDED_BEFORE_SQL = _json_select(
    "id, queue", "FROM jobs WHERE state = 'succeeded' AND finished_at < ? LIMIT ?"
)
_CANCELLED_BEFORE_SQL = _json_select(
    "id, queue",
    "FROM jobs INDEXED BY jobs_cancelled WHERE state = 'cancelled' AND finished_at < ? LIMIT ?",
)


class SqliteMaintenance(SqliteBase):
    """Promote, reap, recover, prune, next deadlines: part of ``SqliteStore``."""

    def jobs_promote_due(self, now: int, limit: int) -> int:
        """Make up to ``limit`` due pending and retrying jobs ready; return how many.

        A promoted job counts as ready from its due time, not from when this pass ran.
        """
        recording = self.recording
        # Recording, the rows come with their attempts: the same statement, one column more.
        sql = _DUE_EVENT_ROWS_SQL if recording else _DUE_ROWS_SQL
        rows = _json_rows(self._db, sql, (now, limit))
        if rows:
            self._db.execute(
                f"UPDATE jobs SET state = 'ready', ready_at = run_at WHERE id IN {_JSON_IDS}",
                (_json_ids([row[0] for row in rows]),),
            )
        for row in rows:
            queue = row[1]
            self._move(queue, row[2], READY)
            self.changes.ready_queues.add(queue)
        if recording:
            for key, queue, state, attempt in rows:
                self._record(key, queue, state, "ready", attempt, now)
        # Rate windows closed: the leases parked on their queues may take jobs again.
        for queue, jobs in self._rate_waits.due(now):
            self.changes.made_ready(queue, jobs)
        return len(rows)

    def leases_reap_expired(self, now: int, limit: int) -> list[Reaped]:
        """End up to ``limit`` leases that expired at or before ``now``.

        A job with attempts left becomes ready (from its expiry time); one without becomes
        dead with the error "lease expired". The old token keeps answering lease_expired.
        """
        rows = _json_rows(self._db, _EXPIRED_ROWS_SQL, (now, limit))
        reaped = []
        ready: list[tuple[int, int, str]] = []  # (id, expired at, error): ready from expiry
        dead: list[tuple[int, str]] = []
        errors: list[tuple] = []  # (id, attempt, error, now, started_at, worker, outcome)
        over: list[int] = []  # the jobs whose history passes its bound
        for row in rows:
            key, queue, attempt, max_attempts, expired_at, deadline_at, timeout_ms = row[:7]
            self._held.pop(format_job_id(key), None)
            self._count(queue, "expired", 1, now)
            error, outcome = LEASE_EXPIRED_ERROR, _EXPIRED
            if deadline_at is not None and expired_at >= deadline_at:
                error = timeout_error(timeout_ms)  # its attempt ran out of time
                outcome = _TIMED_OUT
            errors.append((key, attempt, error, now, row[7], row[8], outcome))
            if row[9] >= ATTEMPTS_KEPT:
                over.append(key)
            if attempt < max_attempts:
                ready.append((key, expired_at, error))
                state = READY
                self.changes.ready_queues.add(queue)
            else:
                dead.append((key, error))
                state = DEAD
                self._count(queue, "dead", 1, now)
            self._move(queue, LEASED, state)
            reaped.append(Reaped(format_job_id(key), queue, state, attempt))
        _execute_rows(self._db, _INSERT_ERRORS, "(?, ?, ?, ?, ?, ?, ?)", errors)
        self._trim_history(over)
        _execute_rows(self._db, _REAP_READY, "(?, ?, ?)", ready)
        _execute_rows(self._db, _REAP_DEAD, "(?, ?)", dead, (now,))
        if self.recording:  # in the order of their expiry (one change per job)
            self.changes.events += [
                (r.job_id, r.queue, r.state.value, r.attempt, now, "leased") for r in reaped
            ]
        return reaped

    def leases_recover(self, now: int) -> int:
        """At start, before serving: every leased job becomes ready again, at once.

        The lease was lost with the previous process, not through the job, so the attempt
        is given back (as with release). The old token answers lease_expired from now on.
        Returns how many jobs were recovered.
        """
        rows = self._db.execute(
            "SELECT id, queue, attempt FROM jobs WHERE state = 'leased'"
        ).fetchall()
        self._held.clear()
        if rows:
            self._end_leases([row[0] for row in rows], _INTERRUPTED, RESTART_ERROR, now)
        for _key, queue, _attempt in rows:
            self._move(queue, LEASED, READY)
            self.changes.ready_queues.add(queue)
        self._db.execute(
            "UPDATE jobs SET state = 'ready', attempt = attempt - 1, lease_expires_at = ?, "
            "last_error = ? WHERE state = 'leased'",
            (now, RESTART_ERROR),
        )
        if self.recording:  # the attempt given back, as the update does
            for key, queue, attempt in rows:
                self._record(key, queue, "leased", "ready", attempt - 1, now)
        return len(rows)

    def next_due_at(self) -> int | None:
        """The earliest due time of a pending or retrying job, or end of a full rate
        window that ready jobs wait for."""
        due = self._db.execute(
            "SELECT min(run_at) FROM jobs WHERE state IN ('pending', 'retrying')"
        ).fetchone()[0]
        window = self._rate_waits.next_at()
        return window if due is None or (window is not None and window < due) else due

    def next_expiry_at(self) -> int | None:
        """The earliest expiry of a held lease."""
        return self._db.execute(
            "SELECT min(lease_expires_at) FROM jobs WHERE state = 'leased'"
        ).fetchone()[0]

    def jobs_prune(self, now: int, limit: int) -> int:
        """Delete up to ``limit`` succeeded and cancelled jobs finished longer than the
        retention period ago, and up to ``limit`` expired idempotency keys. Returns jobs
        deleted."""
        self._db.execute(
            "DELETE FROM idempotency_keys WHERE rowid IN "
            "(SELECT rowid FROM idempotency_keys WHERE expires_at <= ? LIMIT ?)",
            (now, limit),
        )
        before = now - self.config.retention_ms
        rows = _json_rows(self._db, _SUCCEEDED_BEFORE_SQL, (before, limit))
        self._delete_jobs(rows, SUCCEEDED)
        cancelled = []
        if len(rows) < limit:
            cancelled = _json_rows(self._db, _CANCELLED_BEFORE_SQL, (before, limit - len(rows)))
            self._delete_jobs(cancelled, CANCELLED)
        return len(rows) + len(cancelled)
