"""Schedules as SQLite: put, delete, pause and list them, and run the due ones.

``schedules_run_due`` creates a due slot's job (with ``jobs_submit``, as a client's submit
would, so depth limits, counts and events hold) and moves the schedule's ``next_at`` past
it in the writer's one transaction: the slot is submitted with the commit, or not at all.
One server owns the file, so nothing else can run the same slot meanwhile.
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
from relay.store.sqlite.sql import SqliteBase

_ONE = f"SELECT {COLUMNS} FROM schedules WHERE name = ?"
_PUT = (
    "INSERT INTO schedules (name, cron, timezone, queue, payload, priority, max_attempts, "
    "backoff_kind, backoff_base_ms, backoff_max_ms, backoff_jitter, timeout_ms, catch_up, "
    "catch_up_max, next_at, created_at, updated_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE "
    "SET cron = excluded.cron, timezone = excluded.timezone, queue = excluded.queue, "
    "payload = excluded.payload, priority = excluded.priority, "
    "max_attempts = excluded.max_attempts, backoff_kind = excluded.backoff_kind, "
    "backoff_base_ms = excluded.backoff_base_ms, backoff_max_ms = excluded.backoff_max_ms, "
    "backoff_jitter = excluded.backoff_jitter, timeout_ms = excluded.timeout_ms, "
    "catch_up = excluded.catch_up, catch_up_max = excluded.catch_up_max, "
    "next_at = excluded.next_at, updated_at = excluded.updated_at"
)
_DUE = (
    f"SELECT {COLUMNS} FROM schedules INDEXED BY schedules_due "
    "WHERE NOT paused AND next_at <= ? ORDER BY next_at, name LIMIT ?"
)
_ADVANCE = (
    "UPDATE schedules SET next_at = ?, last_slot = ?, last_job_id = ?, last_job_slot = ?, "
    "last_refusal = ? WHERE name = ?"
)
_SLOT_OF_JOB = "UPDATE jobs SET scheduled_for = ? WHERE id = ?"
_PAGE = (
    f"SELECT {', '.join('s.' + c for c in COLUMNS.split(', '))}, j.state FROM schedules s "
    "LEFT JOIN jobs j ON j.id = s.last_job_id WHERE s.name > ? ORDER BY s.name LIMIT ?"
)


class SqliteSchedules(SqliteBase):
    """Schedules: part of ``SqliteStore``."""

    def _schedule(self, name: str) -> ScheduleInfo:
        row = self._db.execute(_ONE, (name,)).fetchone()
        if row is None:
            raise ScheduleNotFound(name)
        state = None
        if row[LAST_JOB] is not None:
            found = self._db.execute(
                "SELECT state FROM jobs WHERE id = ?", (row[LAST_JOB],)
            ).fetchone()
            state = found[0] if found else None
        return schedule_info(row, state)

    def schedule_put(self, spec: ScheduleSpec, now: int) -> ScheduleInfo:
        """Create or replace a schedule (see ``Store.schedule_put``)."""
        row = self._db.execute(_ONE, (spec.name,)).fetchone()
        if row is None:
            (held,) = self._db.execute("SELECT count(*) FROM schedules").fetchone()
            if held >= self.config.max_schedules:
                raise too_many_schedules(held, self.config.max_schedules)
        next_at = put_slot(spec, now, row)
        self._db.execute(_PUT, (*spec_row(spec), next_at, now, now))
        if row is None or not row[14]:  # (not paused)
            self.changes.schedule(next_at)
        return self._schedule(spec.name)

    def schedule_delete(self, name: str) -> None:
        """Delete a schedule (see ``Store.schedule_delete``)."""
        if self._db.execute("DELETE FROM schedules WHERE name = ?", (name,)).rowcount == 0:
            raise ScheduleNotFound(name)

    def schedule_pause(self, name: str, paused: bool, now: int) -> ScheduleInfo:
        """Pause or resume a schedule (see ``Store.schedule_pause``)."""
        row = self._db.execute(_ONE, (name,)).fetchone()
        if row is None:
            raise ScheduleNotFound(name)
        if bool(row[14]) != paused:
            next_at = row[NEXT_AT]
            if not paused:  # from the first slot after now: no catch-up of a pause
                next_at = first_slot(schedule_spec(row), now, row[LAST_SLOT])
                self.changes.schedule(next_at)
            self._db.execute(
                "UPDATE schedules SET paused = ?, next_at = ?, updated_at = ? WHERE name = ?",
                (int(paused), next_at, now, name),
            )
        return self._schedule(name)

    def schedule_list(self, after: str | None, limit: int) -> list[ScheduleInfo]:
        """A page of schedules by name (see ``Store.schedule_list``)."""
        limit = max(0, min(limit, SCHEDULES_PAGE + 1))
        rows = self._db.execute(_PAGE, (after or "", limit)).fetchall()
        return [schedule_info(row[:-1], row[-1]) for row in rows]

    def schedules_run_due(self, now: int, limit: int) -> list[ScheduleRun]:
        """Submit the due slots of up to ``limit`` schedules (see ``Store``)."""
        runs: list[ScheduleRun] = []
        for row in self._db.execute(_DUE, (now, limit)).fetchall():
            if len(runs) >= RUN_JOBS:  # the rest wait for the next pass (still due)
                break
            spec = schedule_spec(row)
            slots, next_at, broken = due_slots_or_none(spec, row[NEXT_AT], now)
            passed = Passed.of(row)
            if broken is not None:
                runs.append(ScheduleRun(spec.name, spec.queue, row[NEXT_AT], None, broken))
                passed.refusal = broken
            runs += submit_slots(self, spec, slots, now, passed, self._mark_slot)
            self._db.execute(_ADVANCE, (next_at, *passed.columns(), spec.name))
            self.changes.schedule(next_at)
        return runs

    def _mark_slot(self, slot: int, job_id: int) -> None:
        self._db.execute(_SLOT_OF_JOB, (slot, job_id))

    def schedule_last_slots(self, limit: int) -> list[tuple[str, int | None]]:
        """(name, last slot that made a job) of the first ``limit`` schedules (see
        ``Store``)."""
        rows = self._db.execute(
            "SELECT name, last_job_slot FROM schedules ORDER BY name LIMIT ?", (max(0, limit),)
        )
        return [(name, slot) for name, slot in rows]

    def next_schedule_at(self) -> int | None:
        """The earliest next slot of a schedule not paused (one seek of schedules_due)."""
        row = self._db.execute(
            "SELECT min(next_at) FROM schedules INDEXED BY schedules_due WHERE NOT paused"
        ).fetchone()
        return row[0]
