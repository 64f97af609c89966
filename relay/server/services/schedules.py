"""The scheduler: submits each schedule's due slots, woken by the next slot of any.

One pass (``run_schedules_once``) asks the writer to run the due schedules
(``Store.schedules_run_due``: each slot's job created in the transaction that moves its
schedule on), as often as some are still due, and answers the earliest next slot; the
loop (``run_scheduler``) sleeps until then, at most MAX_SLEEP_MS, and is woken earlier by
an ``Alarm`` when a commit (here or, on PostgreSQL, another server's) puts or resumes a
schedule whose next slot is sooner. No fixed polling period: an idle server with a daily
schedule wakes every MAX_SLEEP_MS to look, and once at the slot.

Every server runs it; on PostgreSQL the store makes sure one slot is submitted by one
server (relay/store/postgres/schedules.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import attrs
import trio

from relay.protocol.errors import ShuttingDown, Unavailable
from relay.server.services.maintenance import ERROR_BACKOFF_S, Alarm
from relay.store import commands as cmd
from relay.store.base import Changes, ScheduleRun
from relay.store.writer import CommitListener, Writer
from relay.util.log import event

log = logging.getLogger("relay.schedules")

# The longest the loop sleeps without looking again. The store's next slot is the truth, and
# a commit that makes an earlier one wakes the loop, so this only bounds the effect of a
# wall-clock step (slots are wall-clock times; trio sleeps on a monotonic clock): a slot
# runs at most this late after one.
MAX_SLEEP_MS = 30_000
# Due schedules one pass takes per transaction (each may create up to its catch_up_max
# jobs): one transaction stays short, and others' requests run in between.
RUN_LIMIT = 100
# Passes in one wake-up at most (each of RUN_LIMIT schedules, or about RUN_JOBS jobs:
# relay/store/schedules.py); past it, the loop looks again after BUSY_RETRY_MS.
MAX_PASSES = 1000
# A pass that ran nothing while a schedule is still due met it held by another server
# (PostgreSQL, SKIP LOCKED): usually that server's pass, done within milliseconds, but a
# server stopped mid-pass (SIGSTOP, a paused VM) holds its rows until PostgreSQL ends its
# session. The loop looks again after BUSY_RETRY_MS, doubling while nothing moves, up to
# BUSY_MAX_MS: never a run of passes that find nothing.
BUSY_RETRY_MS = 100
BUSY_MAX_MS = 5_000
# Schedules whose runs the scheduler counts for /metrics (by name): as many as may exist
# by default; beyond it, the runs are counted under "_other".
MAX_COUNTED = 1000


@attrs.frozen
class SchedulerStatistics:
    """What /metrics shows of the scheduler: slots submitted per schedule (a refused slot
    counts as a run, with ``refused``), and when each schedule last submitted a job."""

    runs: dict[str, int]
    refused: dict[str, int]
    last_submitted_at: dict[str, int]  # UTC ms of the slot, by schedule


class Scheduler:
    """The scheduler's state: its alarm, and what it counted."""

    def __init__(self) -> None:
        self.alarm = Alarm()
        self._runs: dict[str, int] = {}
        self._refused: dict[str, int] = {}
        self._last: dict[str, int] = {}

    def listener(self) -> CommitListener:
        """Wakes the loop for a commit that puts or resumes a schedule due sooner."""

        def listen(changes: Changes) -> None:
            if changes.next_schedule_at is not None:
                self.alarm.notify(changes.next_schedule_at)

        def wants(changes: Changes) -> bool:
            at = changes.next_schedule_at
            return at is not None and at < self.alarm.earliest

        return CommitListener(listen, wants)

    def count(self, runs: list[ScheduleRun]) -> None:
        for run in runs:
            name = run.name if run.name in self._runs or len(self._runs) < MAX_COUNTED else "_other"
            self._runs[name] = self._runs.get(name, 0) + 1
            if run.job_id is None:
                self._refused[name] = self._refused.get(name, 0) + 1
            elif name != "_other":
                self._last[name] = max(self._last.get(name, 0), run.slot)

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(dict(self._runs), dict(self._refused), dict(self._last))


async def run_schedules_once(
    writer: Writer, scheduler: Scheduler | None = None
) -> tuple[list[ScheduleRun], int | None, int]:
    """Submit every due slot; answer (the runs, the earliest next slot, the last pass's
    ``now``)."""
    runs: list[ScheduleRun] = []
    next_at: int | None = None
    now = 0
    for _ in range(MAX_PASSES):
        batch, next_at, now = await writer.execute(cmd.RunSchedules(RUN_LIMIT))
        runs += batch
        for run in batch:
            if run.job_id is not None:
                event(log, logging.INFO, "schedule.submitted", schedule=run.name,
                      queue=run.queue, slot=run.slot, job_id=run.job_id)  # fmt: skip
            else:
                event(log, logging.WARNING, "schedule.refused", schedule=run.name,
                      queue=run.queue, slot=run.slot, error=run.error,
                      message=f"schedule {run.name}: slot {run.slot} submitted no job: "
                      f"{run.error}")  # fmt: skip
        if scheduler is not None:
            scheduler.count(batch)
        if not batch or next_at is None or next_at > now:
            break
    return runs, next_at, now


async def run_scheduler(
    writer: Writer,
    scheduler: Scheduler,
    clock: Callable[[], int],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Submit schedules' slots as they come due. Runs until cancelled."""
    alarm = scheduler.alarm
    busy_ms = BUSY_RETRY_MS
    task_status.started()
    while True:
        try:
            # Reset first: a slot committed from here on is either seen by the pass or
            # notified to the alarm.
            alarm.earliest = math.inf
            runs, next_at, now = await run_schedules_once(writer, scheduler)
        except ShuttingDown:
            return
        except Unavailable:
            log.debug("scheduler.unavailable")
            await trio.sleep(ERROR_BACKOFF_S)
            continue
        except Exception:
            log.exception("scheduler.failed")
            await trio.sleep(ERROR_BACKOFF_S)
            continue
        target = clock() + MAX_SLEEP_MS
        if next_at is not None and next_at <= now:
            # Still due after the passes (held by another server): look again soon, later
            # each time nothing moved.
            target = min(target, clock() + busy_ms)
            busy_ms = min(2 * busy_ms, BUSY_MAX_MS) if not runs else BUSY_RETRY_MS
        else:
            busy_ms = BUSY_RETRY_MS
            if next_at is not None:
                target = min(target, next_at)
        await alarm.sleep_until(target, clock)
