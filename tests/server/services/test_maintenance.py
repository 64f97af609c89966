"""Time-driven loops and the long-poll hub, on trio's MockClock with no real I/O.

A ``FakeWriter`` applies commands to an in-memory store synchronously, and the store's
clock is derived from trio's virtual clock, so the loops' sleeps jump instantly.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import trio
import trio.testing

from relay.protocol.model import JobState, SubmitSpec
from relay.server.requests import ops
from relay.server.requests.auth import Role
from relay.server.requests.longpoll import LongPolls
from relay.server.services import maintenance
from relay.server.services.maintenance import Alarm
from relay.store import commands as cmd
from relay.store.sqlite import SqliteStore
from tests.conftest import T0


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


def virtual_ms() -> int:
    return T0 + round(trio.current_time() * 1000)


class FakeWriter:
    """The writer's interface, run inline against ``store`` at virtual time."""

    def __init__(self, store: SqliteStore) -> None:
        self.store = store
        self.executed: list[Any] = []
        self.listeners: list[Any] = []
        self._executed = trio.Event()

    async def wait_until(self, predicate: Any) -> None:
        """Wait (on commands, not on time) until ``predicate()`` holds."""
        while not predicate():
            await self._executed.wait()

    async def execute(self, command: Any) -> Any:
        await trio.lowlevel.checkpoint()
        self.executed.append(command)
        result = command.apply(self.store, virtual_ms())
        changes, self.store.changes = self.store.changes, type(self.store.changes)()
        for listener in self.listeners:
            listener(changes)
        self._executed.set()
        self._executed = trio.Event()
        return result

    async def wait_room(self) -> None:
        pass

    def put(self, item: Any) -> None:
        """Run a request item at once (as its own batch) and deliver its reply."""
        op, sink, _, _, args = item
        self.executed.append(item)
        outcome = op.run(self.store, virtual_ms(), args)
        changes, self.store.changes = self.store.changes, type(self.store.changes)()
        sink.deliver([(item, op.reply(item, outcome))])
        for listener in self.listeners:
            listener(changes)


def count(writer: FakeWriter, kind: Any) -> int:
    """Commands of class ``kind``, or request items of op ``kind``, the writer ran."""
    if isinstance(kind, type):
        return sum(isinstance(c, kind) for c in writer.executed)
    return sum(type(c) is tuple and c[0] is kind for c in writer.executed)


def jobs_of(reply: Any) -> list[dict[str, Any]]:
    """The jobs of a lease's reply: a reply line, or no jobs (answered without a claim)."""
    return orjson.loads(reply)["jobs"] if isinstance(reply, bytes) else reply


async def test_alarm_sleeps_until_its_target(autojump_clock):
    alarm = Alarm()
    await alarm.sleep_until(virtual_ms() + 2_500, virtual_ms)
    assert trio.current_time() == pytest.approx(2.5)


async def test_alarm_wakes_early_for_an_earlier_deadline_only(autojump_clock):
    alarm = Alarm()
    woke_at = []

    async def sleeper():
        await alarm.sleep_until(T0 + 10_000, virtual_ms)
        woke_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sleeper)
        await trio.sleep(1)
        alarm.notify(T0 + 20_000)  # later than the target: no effect
        await trio.sleep(1)
        alarm.notify(T0 + 3_000)
    assert woke_at == [pytest.approx(3.0)]


async def test_promoter_sleeps_until_the_next_due_job_instead_of_polling(autojump_clock, store):
    writer = FakeWriter(store)
    (job,) = store.jobs_submit([SubmitSpec("q", "1", delay_ms=12_000)], virtual_ms())
    alarm = Alarm()
    async with trio.open_nursery() as nursery:
        await nursery.start(maintenance.run_promoter, writer, alarm, virtual_ms)
        await writer.wait_until(lambda: store.job_inspect(job.job_id).state == JobState.READY)
        became_ready = trio.current_time()
        nursery.cancel_scope.cancel()
    assert became_ready == pytest.approx(12.0, abs=0.02)
    # One pass at start, then one per MAX_SLEEP_MS at most: no short poll.
    assert count(writer, cmd.PromoteDue) <= 1 + 12_000 // maintenance.MAX_SLEEP_MS + 1


async def test_promoter_is_woken_by_a_commit_with_an_earlier_due_time(autojump_clock, store):
    writer = FakeWriter(store)
    promoter, reaper = Alarm(), Alarm()
    writer.listeners.append(maintenance.commit_listener(promoter, reaper))
    async with trio.open_nursery() as nursery:
        await nursery.start(maintenance.run_promoter, writer, promoter, virtual_ms)
        await trio.sleep(1)  # the promoter is asleep for MAX_SLEEP_MS: nothing is due
        (job,) = await writer.execute(cmd.Submit((SubmitSpec("q", "1", delay_ms=500),)))
        await writer.wait_until(lambda: store.job_inspect(job.job_id).state == JobState.READY)
        became_ready = trio.current_time()
        nursery.cancel_scope.cancel()
    assert became_ready == pytest.approx(1.5, abs=0.02)


async def test_reaper_ends_a_lease_at_its_expiry(autojump_clock, store):
    writer = FakeWriter(store)
    promoter, reaper = Alarm(), Alarm()
    writer.listeners.append(maintenance.commit_listener(promoter, reaper))
    store.jobs_submit([SubmitSpec("q", "1")], virtual_ms())
    async with trio.open_nursery() as nursery:
        await nursery.start(maintenance.run_reaper, writer, reaper, virtual_ms)
        (lease,) = await writer.execute(cmd.Claim(("q",), "w", 1, 2_000))
        await writer.wait_until(lambda: store.job_inspect(lease.job_id).state != JobState.LEASED)
        reaped_at = trio.current_time()
        nursery.cancel_scope.cancel()
    assert reaped_at == pytest.approx(2.0, abs=0.02)
    info = store.job_inspect(lease.job_id)
    assert info.state == JobState.READY
    assert info.last_error == "lease expired"


async def test_promote_once_drains_a_backlog_larger_than_one_pass(autojump_clock, store):
    writer = FakeWriter(store)
    n = maintenance.PASS_LIMIT * 2 + 5
    store.jobs_submit([SubmitSpec("q", "1", delay_ms=10)] * n, virtual_ms())
    await trio.sleep(0.01)
    assert await maintenance.promote_once(writer) == n
    assert count(writer, cmd.PromoteDue) == 3
    assert store.queue_stats()["q"]["ready"] == n


class Sink:
    def __init__(self) -> None:
        self.replies: list[tuple[Any, Any]] = []
        self.closed = False
        self.role = Role.WORKER
        self.can_wait = True
        self._delivered = trio.Event()

    def deliver(self, replies):
        self.replies += replies
        self._delivered.set()
        self._delivered = trio.Event()

    def reply_room(self) -> int:
        return 1 << 40

    def still_wanted(self) -> bool:
        return self.can_wait

    def reserve(self, nbytes: int) -> None:
        pass

    async def wait_for(self, n: int) -> None:
        while len(self.replies) < n:
            await self._delivered.wait()


def lease_item(sink: Any, queues=("q",), wait_s=5.0, count=1) -> Any:
    """A lease request's writer item, as the dispatcher makes it."""
    lease = ops.PendingLease(
        connection=sink, queues=queues, worker_id="w", count=count, lease_ms=30_000,
        deadline=trio.current_time() + wait_s, max_bytes=1 << 20, reply_bytes=1 << 20,
        job_bytes=1 << 10,
    )  # fmt: skip
    return (ops.CLAIM, sink, 1, trio.current_time(), lease)


async def test_parked_lease_is_claimed_again_when_its_queue_gets_a_job(autojump_clock, store):
    writer = FakeWriter(store)
    hub = LongPolls(writer)  # type: ignore[arg-type]
    writer.listeners.append(hub.on_commit)
    sink = Sink()
    async with trio.open_nursery() as nursery:
        await nursery.start(hub.run)
        hub.park(lease_item(sink, queues=("a", "q")), sink)
        assert hub.parked == 1
        await trio.sleep(1)
        await writer.execute(cmd.Submit((SubmitSpec("other", "1"),)))
        await trio.lowlevel.checkpoint()
        assert count(writer, ops.CLAIM) == 0  # another queue wakes nobody
        await writer.execute(cmd.Submit((SubmitSpec("q", "1"),)))
        with trio.fail_after(1):
            await sink.wait_for(1)
        nursery.cancel_scope.cancel()
    ((_item, reply),) = sink.replies
    assert [job["queue"] for job in jobs_of(reply)] == ["q"]
    assert hub.parked == 0


async def test_parked_lease_gets_no_jobs_at_its_deadline(autojump_clock, store):
    hub = LongPolls(FakeWriter(store))  # type: ignore[arg-type]
    sink = Sink()
    async with trio.open_nursery() as nursery:
        await nursery.start(hub.run)
        hub.park(lease_item(sink, wait_s=2.0), sink)
        hub.park(lease_item(sink, wait_s=0.5), sink)
        with trio.fail_after(5):
            await sink.wait_for(2)
        answered_at = trio.current_time()
        nursery.cancel_scope.cancel()
    assert answered_at == pytest.approx(2.0, abs=0.01)
    assert [result for _, result in sink.replies] == [[], []]


async def test_closing_the_hub_answers_every_parked_lease_at_once(autojump_clock, store):
    hub = LongPolls(FakeWriter(store))  # type: ignore[arg-type]
    sinks = [Sink() for _ in range(3)]
    for sink in sinks:
        hub.park(lease_item(sink, wait_s=30), sink)
    hub.close()
    assert [s.replies[0][1] for s in sinks] == [[], [], []]
    assert hub.parked == 0


async def test_a_dropped_connection_leaves_nothing_parked(autojump_clock, store):
    hub = LongPolls(FakeWriter(store))  # type: ignore[arg-type]
    gone, staying = Sink(), Sink()
    hub.park(lease_item(gone), gone)
    hub.park(lease_item(staying), staying)
    gone.closed, gone.can_wait = True, False
    hub.drop(gone)
    assert hub.parked == 1
    assert len(gone.replies) == 1 and staying.replies == []


class ShortSink(Sink):
    """A connection with no room left for replies: each reply written makes some, and
    wakes the leases waiting for it, as a session's write does."""

    def __init__(self, hub: LongPolls) -> None:
        super().__init__()
        self.hub = hub

    def reply_room(self) -> int:
        return 0

    def deliver(self, replies):
        super().deliver(replies)
        if self.hub.short_of_room(self):
            self.hub.room_made(self)


@contextlib.asynccontextmanager
async def hub_short_of_room(
    store: SqliteStore,
) -> AsyncIterator[tuple[FakeWriter, LongPolls, ShortSink]]:
    """A running hub whose one connection has no room for replies."""
    writer = FakeWriter(store)
    hub = LongPolls(writer)  # type: ignore[arg-type]
    writer.listeners.append(hub.on_commit)
    async with trio.open_nursery() as nursery:
        await nursery.start(hub.run)
        yield writer, hub, ShortSink(hub)
        nursery.cancel_scope.cancel()


async def test_leases_woken_without_room_park_again_and_are_answered_once(autojump_clock, store):
    async with hub_short_of_room(store) as (writer, hub, sink):
        for _ in range(3):
            hub.park(lease_item(sink, wait_s=30), sink)
        await writer.execute(cmd.Submit((SubmitSpec("q", "1"),)))
        await trio.testing.wait_all_tasks_blocked()
        # Woken, but no room for a reply: parked again, nothing claimed.
        assert hub.parked == 3 and hub.short_of_room(sink)
        assert count(writer, ops.CLAIM) == 0 and sink.replies == []
        # The client goes: each is answered once, though each reply makes room.
        hub.drop(sink)
        await trio.testing.wait_all_tasks_blocked()
    assert len(sink.replies) == 3 and len({id(tag) for tag, _ in sink.replies}) == 3
    assert [jobs for _, jobs in sink.replies] == [[], [], []]
    assert hub.parked == 0 and not hub.short_of_room(sink)
    assert count(writer, ops.CLAIM) == 0


async def test_a_lease_woken_as_its_client_leaves_is_answered_at_once(autojump_clock, store):
    """Woken, then its client stops sending before the run task claims it: it must be
    answered with no jobs now, not parked again (for lack of room) until its deadline."""
    async with hub_short_of_room(store) as (writer, hub, sink):
        hub.park(lease_item(sink, wait_s=30), sink)
        await writer.execute(cmd.Submit((SubmitSpec("q", "1"),)))  # woken, not yet run
        sink.can_wait = False  # the client's EOF, in the same tick (Session.run)
        hub.drop(sink)
        await trio.testing.wait_all_tasks_blocked()
        answered_at = trio.current_time()
    assert [jobs for _, jobs in sink.replies] == [[]]
    assert answered_at < 1 and hub.parked == 0 and not hub.short_of_room(sink)
