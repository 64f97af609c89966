"""Schedules on PostgreSQL: put, delete, pause and list them, and run the due ones.

Several servers share the table and every one runs the scheduler, so
``schedules_run_due`` takes the due rows ``FOR UPDATE SKIP LOCKED`` (under READ
COMMITTED, a row another server moved past ``now`` meanwhile no longer matches once
locked), and moves each one's ``next_at`` on with a compare-and-set on the value it read,
in the transaction that creates the slot's jobs: a slot is submitted by one server, once.
"""

from __future__ import annotations

from relay.protocol.errors import ScheduleNotFound
from relay.store.base import (
    SCHEDULES_PAGE,
    ScheduleInfo,
    ScheduleRun,
    ScheduleSpec,
    too_many_schedules,
)
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.sql import atomic
from relay.store.schedules import (
    COLUMNS,
    LAST_JOB,
    LAST_SLOT,
    NEXT_AT,
    RUN_JOBS,
    Passed,
    due_slots_or_none,
    first_slot,
    put_slot,
    schedule_info,
    schedule_spec,
    spec_row,
    submit_slots,
)

_ONE = f"SELECT {COLUMNS} FROM schedules WHERE name = %s"
# The advisory lock (transaction-scoped) that puts of new schedules take in turn, so that
# --max-schedules holds across servers: "RLYT" and 3 (relay/store/postgres/schema.py has 1,
# jobs.py 2).
_NEW_SCHEDULES_LOCK = 0x524C5954_00000003
_ONE_LOCKED = _ONE + " FOR UPDATE"
_PUT = (
    "INSERT INTO schedules (name, cron, timezone, queue, payload, priority, max_attempts, "
    "backoff_kind, backoff_base_ms, backoff_max_ms, backoff_jitter, timeout_ms, catch_up, "
    "catch_up_max, next_at, created_at, updated_at) VALUES "
    "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
    "ON CONFLICT (name) DO UPDATE "
    "SET cron = excluded.cron, timezone = excluded.timezone, queue = excluded.queue, "
    "payload = excluded.payload, priority = excluded.priority, "
    "max_attempts = excluded.max_attempts, backoff_kind = excluded.backoff_kind, "
    "backoff_base_ms = excluded.backoff_base_ms, backoff_max_ms = excluded.backoff_max_ms, "
    "backoff_jitter = excluded.backoff_jitter, timeout_ms = excluded.timeout_ms, "
    "catch_up = excluded.catch_up, catch_up_max = excluded.catch_up_max, "
    "next_at = excluded.next_at, updated_at = excluded.updated_at"
)
_DUE = (
    f"SELECT {COLUMNS} FROM schedules WHERE NOT paused AND next_at <= %s "
    "ORDER BY next_at, name LIMIT %s FOR UPDATE SKIP LOCKED"
)
# The compare-and-set: only from the next_at this transaction read and locked.
_ADVANCE = "UPDATE schedules SET next_at = %s WHERE name = %s AND next_at = %s AND NOT paused"
_PASSED = (
    "UPDATE schedules SET last_slot = %s, last_job_id = %s, last_job_slot = %s, "
    "last_refusal = %s WHERE name = %s"
)
_SLOT_OF_JOB = "UPDATE jobs SET scheduled_for = %s WHERE id = %s"
_PAGE = (
    f"SELECT {', '.join('s.' + c for c in COLUMNS.split(', '))}, j.state FROM schedules s "
    "LEFT JOIN jobs j ON j.id = s.last_job_id WHERE s.name > %s ORDER BY s.name LIMIT %s"
)


class Schedules(PostgresBase):
    """Schedules: part of ``PostgresStore``."""

    def _schedule(self, name: str) -> ScheduleInfo:
        row = self._read(_ONE, (name,)).fetchone()
        if row is None:
            raise ScheduleNotFound(name)
        state = None
        if row[LAST_JOB] is not None:
            found = self._read("SELECT state FROM jobs WHERE id = %s", (row[LAST_JOB],))
            state = (found.fetchone() or (None,))[0]
        return schedule_info(row, state)

    @atomic
    def schedule_put(self, spec: ScheduleSpec, now: int) -> ScheduleInfo:
        """Create or replace a schedule (see ``Store.schedule_put``)."""
        row = self._read(_ONE_LOCKED, (spec.name,)).fetchone()
        if row is None:
            # New schedules are counted one at a time across servers: two puts of new
            # names on two servers would each count the other's as not yet there.
            self._read("SELECT pg_advisory_xact_lock(%s)", (_NEW_SCHEDULES_LOCK,))
            (held,) = self._read("SELECT count(*) FROM schedules").fetchone() or (0,)
            if held >= self.config.max_schedules:
                raise too_many_schedules(held, self.config.max_schedules)
        next_at = put_slot(spec, now, row)
        self._write(_PUT, (*spec_row(spec), next_at, now, now))
        if row is None or not row[14]:
            self.changes.schedule(next_at)
        return self._schedule(spec.name)

    @atomic
    def schedule_delete(self, name: str) -> None:
        """Delete a schedule (see ``Store.schedule_delete``)."""
        if self._write("DELETE FROM schedules WHERE name = %s", (name,)).rowcount == 0:
            raise ScheduleNotFound(name)

    @atomic
    def schedule_pause(self, name: str, paused: bool, now: int) -> ScheduleInfo:
        """Pause or resume a schedule (see ``Store.schedule_pause``)."""
        row = self._read(_ONE_LOCKED, (name,)).fetchone()
        if row is None:
            raise ScheduleNotFound(name)
        if bool(row[14]) != paused:
            next_at = row[NEXT_AT]
            if not paused:
                next_at = first_slot(schedule_spec(row), now, row[LAST_SLOT])
                self.changes.schedule(next_at)
            self._write(
                "UPDATE schedules SET paused = %s, next_at = %s, updated_at = %s WHERE name = %s",
                (paused, next_at, now, name),
            )
        return self._schedule(name)

    def schedule_list(self, after: str | None, limit: int) -> list[ScheduleInfo]:
        """A page of schedules by name (see ``Store.schedule_list``)."""
        limit = max(0, min(limit, SCHEDULES_PAGE + 1))
        rows = self._read(_PAGE, (after or "", limit)).fetchall()
        return [schedule_info(row[:-1], row[-1]) for row in rows]

    @atomic
    def schedules_run_due(self, now: int, limit: int) -> list[ScheduleRun]:
        """Submit the due slots of up to ``limit`` schedules no other server is running
        (see ``Store``)."""
        runs: list[ScheduleRun] = []
        for row in self._read(_DUE, (now, limit)).fetchall():
            if len(runs) >= RUN_JOBS:  # the rest wait for the next pass (still due)
                break
            spec = schedule_spec(row)
            slots, next_at, broken = due_slots_or_none(spec, row[NEXT_AT], now)
            # The compare-and-set first: if it moved nothing, another server ran these
            # slots (the lock makes that impossible; this makes it impossible to miss).
            claimed = self._write(_ADVANCE, (next_at, spec.name, row[NEXT_AT]))
            if claimed.rowcount != 1:
                continue
            passed = Passed.of(row)
            if broken is not None:
                runs.append(ScheduleRun(spec.name, spec.queue, row[NEXT_AT], None, broken))
                passed.refusal = broken
            runs += submit_slots(self, spec, slots, now, passed, self._mark_slot)
            self._write(_PASSED, (*passed.columns(), spec.name))
            self.changes.schedule(next_at)
        return runs

    def _mark_slot(self, slot: int, job_id: int) -> None:
        self._write(_SLOT_OF_JOB, (slot, job_id))

    def schedule_last_slots(self, limit: int) -> list[tuple[str, int | None]]:
        """(name, last slot that made a job) of the first ``limit`` schedules (see
        ``Store``)."""
        rows = self._read(
            "SELECT name, last_job_slot FROM schedules ORDER BY name LIMIT %s", (max(0, limit),)
        ).fetchall()
        return [(name, slot) for name, slot in rows]

    def next_schedule_at(self) -> int | None:
        """The earliest next slot of a schedule not paused (one index scan)."""
        row = self._read("SELECT min(next_at) FROM schedules WHERE NOT paused").fetchone()
        return row[0] if row else None
