"""Time-driven passes: promote due jobs, reap expired leases, prune old data, flush the
history counted in memory.

Each service is one pass (``promote_once``, ``reap_once``, ``prune_once``), which tests call
directly, and a loop that runs it. The promoter and the reaper sleep until the next due
time the store knows of, not on a fixed short poll; an ``Alarm`` wakes them early when a
commit creates an earlier deadline (a short delay, a short lease).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import trio

from relay.protocol.errors import ShuttingDown, Unavailable
from relay.protocol.model import JobState
from relay.store import commands as cmd
from relay.store.base import Changes, Reaped
from relay.store.history import FLUSH_INTERVAL_S, Histograms
from relay.store.writer import CommitListener, Writer
from relay.util.log import event

log = logging.getLogger("relay.maintenance")

# Jobs moved per transaction by one pass; a larger backlog takes several transactions,
# letting client commands in between.
PASS_LIMIT = 1000
# The longest a loop sleeps without looking again: bounds the effect of a wall-clock step
# (the store's times are wall-clock milliseconds; trio sleeps on a monotonic clock).
MAX_SLEEP_MS = 5_000
# Retention pruning is not urgent: once a minute is plenty.
PRUNE_INTERVAL_S = 60.0
# PostgreSQL: the counts that other servers commit are read into this server's view a page
# of queues at a time (PostgresStore.counts_refresh), a page every interval. A page of
# 1,000 queues is one range scan of a few thousand index entries (~5 ms); at 0.25 s it
# follows 10,000 queues within 2.5 s, and costs the writer a few percent of its time.
REFRESH_PAGE = 1000
REFRESH_INTERVAL_S = 0.25
# After an unexpected error, a loop waits this long before trying again. So it does when
# the store cannot write (``Unavailable``: disk full, I/O errors), which the writer logs
# once per episode: then the loop tries again quietly, so that due jobs are promoted and
# expired leases reaped within about this long of the disk having room again.
ERROR_BACKOFF_S = 1.0


class Alarm:
    """Wakes a sleeping loop when a deadline earlier than its target appears."""

    def __init__(self) -> None:
        self.earliest = math.inf  # earliest deadline reported since the last reset
        self._lot = trio.lowlevel.ParkingLot()

    def notify(self, at_ms: int) -> None:
        if at_ms < self.earliest:
            self.earliest = at_ms
            self._lot.unpark_all()

    async def sleep_until(self, target_ms: float, clock: Callable[[], int]) -> None:
        """Sleep until wall time ``target_ms``, or an earlier notified deadline."""
        while True:
            target_ms = min(target_ms, self.earliest)
            delay_ms = target_ms - clock()
            if delay_ms <= 0:
                return
            with trio.move_on_after(delay_ms / 1000):
                await self._lot.park()


def commit_listener(promoter: Alarm, reaper: Alarm) -> CommitListener:
    """Route each commit's new deadlines to the loop that serves them; a commit concerns
    it only with a deadline earlier than its loop's (``wants``, in the writer thread)."""

    def listen(changes: Changes) -> None:
        if changes.next_due_at is not None:
            promoter.notify(changes.next_due_at)
        if changes.next_expiry_at is not None:
            reaper.notify(changes.next_expiry_at)

    def wants(changes: Changes) -> bool:
        due, expiry = changes.next_due_at, changes.next_expiry_at
        return (due is not None and due < promoter.earliest) or (
            expiry is not None and expiry < reaper.earliest
        )

    return CommitListener(listen, wants)


async def promote_once(writer: Writer) -> int:
    """Make every due pending or retrying job ready; return how many."""
    total = 0
    while True:
        n = await writer.execute(cmd.PromoteDue(PASS_LIMIT))
        total += n
        if n < PASS_LIMIT:
            return total


async def reap_once(writer: Writer) -> list[Reaped]:
    """End every expired lease (ready again, or dead when attempts are spent)."""
    reaped: list[Reaped] = []
    while True:
        batch = await writer.execute(cmd.ReapExpired(PASS_LIMIT))
        reaped += batch
        for job in batch:
            fields = {"job_id": job.job_id, "queue": job.queue, "attempt": job.attempt,
                      "state": str(job.state), "reason": "lease expired"}  # fmt: skip
            if job.state == JobState.READY:
                event(log, logging.INFO, "lease.expired", **fields)
                continue
            # A line that names the job also where a program logs without relay's JSON.
            words = f"job {job.job_id} (queue {job.queue}, attempt {job.attempt})"
            event(log, logging.WARNING, "job.dead", **fields,
                  message=f"{words} dead: its lease expired with no attempts left")  # fmt: skip
        if len(batch) < PASS_LIMIT:
            return reaped


async def prune_once(writer: Writer) -> int:
    """Delete succeeded jobs past retention and expired idempotency keys, and history
    rows past the period kept (HISTORY_KEEP_MS); return the jobs deleted."""
    total = 0
    while True:
        n = await writer.execute(cmd.Prune(PASS_LIMIT))
        total += n
        if n < PASS_LIMIT:
            if total:
                event(log, logging.INFO, "jobs.pruned", count=total)
            break
    while await writer.execute(cmd.HistoryPrune(PASS_LIMIT)) == PASS_LIMIT:
        pass
    return total


async def flush_history_once(writer: Writer, histograms: Histograms) -> int:
    """Add what the store counted since the last flush to the history table, and its
    run and wait times to ``histograms`` (once committed); return the rows written."""
    flushed = await writer.execute(cmd.HistoryFlush())
    histograms.add(flushed.observed)
    return flushed.rows


async def run_history_flusher(
    writer: Writer,
    histograms: Histograms,
    *,
    interval_s: float = FLUSH_INTERVAL_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Flush the history every ``interval_s``. Runs until cancelled: what was counted
    after the last flush is lost with the process (a crash, or a shutdown, whose last
    flush the cancellation may cut short), at most ``interval_s`` of history."""
    task_status.started()
    while True:
        await trio.sleep(interval_s)
        try:
            await flush_history_once(writer, histograms)
        except ShuttingDown:
            return
        except Unavailable:
            log.debug("history_flusher.unavailable")  # kept in memory: the next flush
        except Exception:
            log.exception("history_flusher.failed")


async def _run_timed(
    name: str,
    writer: Writer,
    pass_once: Callable[[Writer], Awaitable[object]],
    pick: Callable[[tuple[int | None, int | None]], int | None],
    alarm: Alarm,
    clock: Callable[[], int],
    task_status: trio.TaskStatus[None],
) -> None:
    task_status.started()
    while True:
        try:
            # Reset first: a deadline committed from here on is either seen by the
            # NextDeadlines below or notified to the alarm.
            alarm.earliest = math.inf
            await pass_once(writer)
            next_at = pick(await writer.execute(cmd.NextDeadlines()))
        except ShuttingDown:
            return
        except Unavailable:
            log.debug(f"{name}.unavailable")
            await trio.sleep(ERROR_BACKOFF_S)
            continue
        except Exception:
            log.exception(f"{name}.failed")
            await trio.sleep(ERROR_BACKOFF_S)
            continue
        target = clock() + MAX_SLEEP_MS
        if next_at is not None:
            target = min(target, next_at)
        await alarm.sleep_until(target, clock)


async def run_promoter(
    writer: Writer,
    alarm: Alarm,
    clock: Callable[[], int],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Promote due jobs whenever the earliest due time arrives. Runs until cancelled."""
    await _run_timed("promoter", writer, promote_once, lambda d: d[0], alarm, clock, task_status)


async def run_reaper(
    writer: Writer,
    alarm: Alarm,
    clock: Callable[[], int],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Reap leases whenever the earliest expiry arrives. Runs until cancelled."""
    await _run_timed("reaper", writer, reap_once, lambda d: d[1], alarm, clock, task_status)


async def run_pruner(
    writer: Writer, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Prune once a minute. Runs until cancelled."""
    task_status.started()
    while True:
        try:
            await prune_once(writer)
        except ShuttingDown:
            return
        except Unavailable:
            log.debug("pruner.unavailable")  # (the writer logs the episode) next minute
        except Exception:
            log.exception("pruner.failed")
        await trio.sleep(PRUNE_INTERVAL_S)


async def refresh_counts_once(writer: Writer, after: str | None) -> str | None:
    """Read one page of every server's counts into the store's view; the cursor next."""
    return await writer.execute(cmd.RefreshCounts(after, REFRESH_PAGE))


async def run_counts_refresher(
    writer: Writer, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """PostgreSQL: follow the counts of the other servers sharing the database, a page per
    REFRESH_INTERVAL_S, round and round. Runs until cancelled."""
    task_status.started()
    after: str | None = None
    while True:
        await trio.sleep(REFRESH_INTERVAL_S)
        try:
            after = await refresh_counts_once(writer, after)
        except ShuttingDown:
            return
        except Unavailable:
            log.debug("counts_refresher.unavailable")
            await trio.sleep(ERROR_BACKOFF_S)
        except Exception:
            log.exception("counts_refresher.failed")
            await trio.sleep(ERROR_BACKOFF_S)
