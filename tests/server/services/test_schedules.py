"""The scheduler on trio's MockClock: woken at each slot (no polling) through a year of
daylight-saving changes, woken early by a put, and catching up after a stop."""

from __future__ import annotations

import calendar
from datetime import UTC, datetime
from typing import Any

import attrs
import pytest
import trio

from relay.protocol import cron
from relay.server.services import schedules
from relay.server.services.schedules import Scheduler, run_scheduler, run_schedules_once
from relay.store import commands as cmd
from relay.store.base import ScheduleSpec
from relay.store.sqlite import SqliteStore
from tests.conftest import T0
from tests.server.services.test_maintenance import FakeWriter, virtual_ms

BERLIN = "Europe/Berlin"


def ms(*args: int) -> int:
    return calendar.timegm(datetime(*args, tzinfo=UTC).timetuple()) * 1000


@attrs.frozen
class Put:
    spec: ScheduleSpec

    def apply(self, store: Any, now: int) -> Any:
        return store.schedule_put(self.spec, now)


def slots(store: SqliteStore) -> list[int]:
    rows = store._db.execute("SELECT scheduled_for FROM jobs ORDER BY id").fetchall()
    return [slot for (slot,) in rows]


@pytest.fixture
def writer() -> FakeWriter:
    return FakeWriter(SqliteStore.open(":memory:"))


async def until(ms_at: int) -> None:
    await trio.sleep((ms_at - virtual_ms()) / 1000)


async def test_a_year_of_a_berlin_schedule_wakes_at_each_slot_and_never_polls(
    writer: FakeWriter, autojump_clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No cap on a sleep: every wake-up is a slot's (or a commit's).
    monkeypatch.setattr(schedules, "MAX_SLEEP_MS", 10**12)
    scheduler = Scheduler()
    writer.listeners.append(scheduler.listener())
    await writer.execute(Put(ScheduleSpec("night", "30 2 * * *", BERLIN, "q", "1")))
    async with trio.open_nursery() as nursery:
        await nursery.start(run_scheduler, writer, scheduler, virtual_ms)
        await until(ms(2027, 1, 1))
        nursery.cancel_scope.cancel()
    expected, at = [], T0
    while (at := cron.next_slot("30 2 * * *", BERLIN, at)) < ms(2027, 1, 1):
        expected.append(at)
    assert len(expected) == 364  # 29 March has no 02:30
    assert ms(2026, 3, 29, 1, 30) not in expected and ms(2026, 10, 25, 0, 30) in expected
    assert slots(writer.store) == expected
    passes = sum(isinstance(c, cmd.RunSchedules) for c in writer.executed)
    assert passes <= len(expected) + 2  # one per slot (and the first look)
    assert scheduler.statistics().runs == {"night": 364}
    assert scheduler.statistics().last_submitted_at == {"night": expected[-1]}


async def test_a_put_wakes_the_sleeping_scheduler_for_its_first_slot(
    writer: FakeWriter, autojump_clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(schedules, "MAX_SLEEP_MS", 10**12)
    scheduler = Scheduler()
    writer.listeners.append(scheduler.listener())
    async with trio.open_nursery() as nursery:
        await nursery.start(run_scheduler, writer, scheduler, virtual_ms)
        await trio.sleep(3600)  # nothing to do: asleep (with no cap, for ever)
        await writer.execute(Put(ScheduleSpec("soon", "*/10 * * * *", "UTC", "q", "1")))
        await until(T0 + 3_600_000 + 10 * 60_000 + 1)
        nursery.cancel_scope.cancel()
    # Put at 01:00: that slot (at or after now) at once, the next ten minutes later.
    assert slots(writer.store) == [T0 + 3_600_000, T0 + 3_600_000 + 10 * 60_000]


@pytest.mark.parametrize(
    ("catch_up", "expected"),
    [
        ("latest", [ms(2026, 10, 25, 3, 30)]),
        ("none", []),
        # Every 30 min in Berlin, down from 00:45 UTC (02:45 summer time) to 04:00 UTC:
        # 02:00 winter time was 02:00 summer time's already; 03:00, 03:30, 04:00, 04:30, 05:00.
        ("all", [ms(2026, 10, 25, h, m) for h, m in ((2, 0), (2, 30), (3, 0), (3, 30))]),
    ],
)
async def test_catching_up_after_a_stop_across_the_autumn_change(
    writer: FakeWriter, autojump_clock, catch_up: str, expected: list[int]
) -> None:
    await until(ms(2026, 10, 25, 0, 45))
    await writer.execute(
        Put(ScheduleSpec("half", "*/30 * * * *", BERLIN, "q", "1", catch_up=catch_up))
    )
    await until(ms(2026, 10, 25, 4, 0) - 1)  # the server was down meanwhile
    runs, next_at, _now = await run_schedules_once(writer)
    assert [run.slot for run in runs] == expected == slots(writer.store)
    assert next_at == ms(2026, 10, 25, 4, 0)


async def test_a_schedule_held_elsewhere_is_looked_at_less_often_not_in_a_loop(
    writer: FakeWriter, autojump_clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL skips a due schedule whose row another server holds (SKIP LOCKED); one
    stopped mid-pass holds it until its session ends. Each pass then runs nothing while
    the schedule stays due: the scheduler looks again after 100 ms, doubling up to 5 s,
    instead of passes back to back."""
    await writer.execute(Put(ScheduleSpec("held", "* * * * *", "UTC", "q", "1")))
    monkeypatch.setattr(writer.store, "schedules_run_due", lambda now, limit: [])
    scheduler = Scheduler()
    async with trio.open_nursery() as nursery:
        await nursery.start(run_scheduler, writer, scheduler, virtual_ms)
        with trio.move_on_after(120):  # T0 is a slot: due, and held, for two minutes
            await writer.wait_until(
                lambda: sum(isinstance(c, cmd.RunSchedules) for c in writer.executed) > 1_000
            )
        nursery.cancel_scope.cancel()
    passes = sum(isinstance(c, cmd.RunSchedules) for c in writer.executed)
    # At 0, 0.1, 0.3, 0.7, 1.5, 3.1, 6.3 s, then every 5 s: 29 passes in two minutes.
    assert 25 <= passes <= 32, passes
