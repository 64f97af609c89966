"""What both stores do with schedules, written once: the columns of a schedule's row and
the values they make, and which slots a due schedule runs (its catch-up policy).

The slots themselves (a cron expression in a time zone) are relay/protocol/cron.py's.
Each dialect reads and writes the rows its own way (sqlite/schedules.py,
postgres/schedules.py) and creates a slot's job with its own ``jobs_submit``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from relay.protocol import cron
from relay.protocol.errors import RelayError
from relay.protocol.model import Backoff, format_job_id, parse_job_id
from relay.store.base import ScheduleInfo, ScheduleRun, ScheduleSpec

# A slot at most this late is not missed: a server that wakes for it a little late (a
# busy writer, a restart within the minute) runs it whatever the catch-up policy.
LATE_GRACE_MS = 60_000

# Jobs one call of ``schedules_run_due`` creates at most, give or take one schedule's
# catch-up (CATCH_UP_MAX): it takes no further schedule once it has made this many, so one
# transaction stays a few milliseconds however many schedules catch up at once; the
# schedules left are still due, and the scheduler's next pass takes them.
RUN_JOBS = 1000

# The columns of a schedule's row, in the order ``schedule_info`` reads them.
COLUMNS = (
    "name, cron, timezone, queue, payload, priority, max_attempts, backoff_kind, "
    "backoff_base_ms, backoff_max_ms, backoff_jitter, timeout_ms, catch_up, catch_up_max, "
    "paused, next_at, last_slot, last_job_id, created_at, updated_at, last_job_slot, "
    "last_refusal"
)
NEXT_AT, LAST_SLOT, LAST_JOB, LAST_JOB_SLOT, LAST_REFUSAL = 15, 16, 17, 20, 21


def spec_row(spec: ScheduleSpec) -> tuple:
    """The definition's columns, ``name`` to ``catch_up_max``, in COLUMNS' order."""
    b = spec.backoff
    backoff = (None,) * 4 if b is None else (b.kind, b.base_ms, b.max_ms, bool(b.jitter))
    return (
        spec.name, spec.cron, spec.timezone, spec.queue, spec.payload, spec.priority,
        spec.max_attempts, *backoff, spec.timeout_ms, spec.catch_up, spec.catch_up_max,
    )  # fmt: skip


def schedule_spec(row: Sequence) -> ScheduleSpec:
    return ScheduleSpec(
        name=row[0], cron=row[1], timezone=row[2], queue=row[3], payload=row[4],
        priority=row[5], max_attempts=row[6],
        backoff=None if row[7] is None else Backoff(row[7], row[8], row[9], bool(row[10])),
        timeout_ms=row[11],
        catch_up=row[12], catch_up_max=row[13],
    )  # fmt: skip


def schedule_info(row: Sequence, job_state: str | None) -> ScheduleInfo:
    """The schedule of ``row`` (COLUMNS), its last job being in ``job_state`` now."""
    return ScheduleInfo(
        spec=schedule_spec(row),
        paused=bool(row[14]),
        next_at=row[NEXT_AT],
        last_slot=row[LAST_SLOT],
        last_job_id=None if row[LAST_JOB] is None else format_job_id(row[LAST_JOB]),
        last_job_state=job_state,
        created_at=row[18],
        updated_at=row[19],
        last_job_slot=row[LAST_JOB_SLOT],
        last_refusal=row[LAST_REFUSAL],
    )


@attrs.define
class Passed:
    """Where a schedule stands after the slots it passed: the last slot, its last job and
    that job's slot, and why the last slot made no job (None: it made one)."""

    slot: int | None
    job: int | None
    job_slot: int | None
    refusal: str | None

    @classmethod
    def of(cls, row: Sequence) -> Passed:
        return cls(row[LAST_SLOT], row[LAST_JOB], row[LAST_JOB_SLOT], row[LAST_REFUSAL])

    def columns(self) -> tuple:
        """last_slot, last_job_id, last_job_slot, last_refusal."""
        return (self.slot, self.job, self.job_slot, self.refusal)


def submit_slots(
    store: Any,
    spec: ScheduleSpec,
    slots: Sequence[int],
    now: int,
    passed: Passed,
    mark: Callable[[int, int], None],
) -> list[ScheduleRun]:
    """Submit one job per slot with the store's own ``jobs_submit`` (so depth limits, queue
    defaults, counts and events hold), ``mark(slot, job id)`` each job with its slot, and
    move ``passed`` along. A slot its queue refuses (a full queue: refused before it
    wrote) is passed all the same, with the refusal kept."""
    runs: list[ScheduleRun] = []
    for slot in slots:
        try:
            [result] = store.jobs_submit([spec.job()], now)
        except RelayError as exc:
            runs.append(ScheduleRun(spec.name, spec.queue, slot, None, exc.message))
            passed.refusal = exc.message
        else:
            job = parse_job_id(result.job_id)
            mark(slot, job)
            runs.append(ScheduleRun(spec.name, spec.queue, slot, result.job_id))
            passed.job, passed.job_slot, passed.refusal = job, slot, None
        passed.slot = slot
    return runs


def first_slot(spec: ScheduleSpec, now: int, last_slot: int | None) -> int | None:
    """A schedule's next slot when it is put or resumed at ``now``: its first slot at or
    after ``now``, and after the last slot it ran (a slot is never run twice)."""
    after = now - 1 if last_slot is None else max(now - 1, last_slot)
    return cron.next_slot(spec.cron, spec.timezone, after)


def put_slot(spec: ScheduleSpec, now: int, row: Sequence | None) -> int | None:
    """The next slot of a schedule put at ``now`` over ``row`` (None: a new one). Put
    again with the same expression and zone (a deployment that puts every schedule at
    start), it keeps its next slot, even one already due: that slot and any missed with
    it run by its catch-up policy, as if no put had come. A new or changed expression
    starts from its first slot from now."""
    if row is not None and row[NEXT_AT] is not None and (row[1], row[2]) == (
        spec.cron, spec.timezone,
    ):  # fmt: skip
        return row[NEXT_AT]
    return first_slot(spec, now, None if row is None else row[LAST_SLOT])


def due_slots_or_none(
    spec: ScheduleSpec, next_at: int, now: int
) -> tuple[list[int], int | None, str | None]:
    """``due_slots``, and None; or, for a schedule whose slots cannot be computed any more
    (its zone gone from the system's time zone data, a row edited by hand): no slot, no
    next slot (it stops, and ``schedule_list`` shows it so) and the reason. One broken
    schedule must not keep the others from running."""
    try:
        slots, following = due_slots(spec, next_at, now)
    except (RelayError, ValueError) as exc:
        reason = exc.message if isinstance(exc, RelayError) else str(exc)
        return [], None, f"its slots cannot be computed ({reason}); put it again"
    return slots, following, None


def due_slots(spec: ScheduleSpec, next_at: int, now: int) -> tuple[list[int], int | None]:
    """The slots a schedule due at ``now`` (its next slot ``next_at`` <= now) runs, oldest
    first, and its next slot after ``now``.

    ``latest``: the latest slot due, once (on time, that is ``next_at`` itself); ``none``:
    that one only if it is at most LATE_GRACE_MS late, else nothing until the next;
    ``all``: every slot due, the latest ``catch_up_max`` of them at most.
    """
    limit = spec.catch_up_max if spec.catch_up == "all" else 1
    slots = cron.latest_slots(spec.cron, spec.timezone, next_at, now, limit)
    if spec.catch_up == "none":
        slots = [slot for slot in slots if now - slot <= LATE_GRACE_MS]
    return slots, cron.next_slot(spec.cron, spec.timezone, now)
