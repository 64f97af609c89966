"""The registry of parked long-polls (relay/server/requests/longpoll.py), without a server: the
deadlines, and whom a commit wakes (as many as the jobs it made ready, in turn across
connections, no wake-up lost), on trio's MockClock against an in-memory store."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import attrs
import orjson
import pytest
import trio

from relay.protocol.model import SubmitSpec
from relay.server.requests import ops
from relay.server.requests.longpoll import COMPACT_SLACK, LongPolls
from relay.store import commands as cmd
from relay.store.base import REPLY_OVERHEAD_BYTES, Changes
from relay.store.sqlite import SqliteStore
from tests.server.services.test_maintenance import FakeWriter, lease_item
from tests.server.services.test_maintenance import Sink as Connection


@attrs.define
class Lease:
    queues: tuple[str, ...]
    deadline: float
    count: int = 1
    woken: bool = False
    place: int = -1
    sent: float = 0.0


def item(lease: Lease, sink: Any) -> tuple:
    return (None, sink, None, 0.0, lease)


class Sink:
    def __init__(self) -> None:
        self.answered: list[tuple[Any, Any]] = []

    def deliver(self, replies: list[tuple[Any, Any]]) -> None:
        self.answered += replies


async def test_leases_answered_before_their_deadline_do_not_pile_up():
    """A long-poll answered early leaves its deadline behind; parking again and again
    (a busy consumer, or clients that come and go) must not grow the registry for the
    whole of max_wait_ms."""
    longpolls = LongPolls(writer=None)  # type: ignore[arg-type]
    sink = Sink()
    far = trio.current_time() + 60
    for _ in range(10):
        for i in range(COMPACT_SLACK):
            longpolls.park(item(Lease(("q",), far + i), sink), sink)
        longpolls.drop(sink)
    assert len(sink.answered) == 10 * COMPACT_SLACK
    assert longpolls.parked == 0
    longpolls.park(item(Lease(("q",), far), sink), sink)
    assert longpolls.parked == 1
    assert len(longpolls._deadlines) <= 2 + COMPACT_SLACK


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


class Worker(Connection):
    """A connection as the dispatcher treats it: a woken lease that found nothing parks
    again (``Dispatcher.finish``); anything else is its answer."""

    def __init__(self, hub: LongPolls, name: str) -> None:
        super().__init__()
        self.hub = hub
        self.name = name

    def deliver(self, replies):
        for item, reply in replies:
            lease = item[4]
            if reply == [] and lease.woken and self.can_wait and not self.hub.closing:
                self.hub.park(item, self)
            else:
                super().deliver([(item, reply)])

    def jobs(self) -> list[str]:
        return [
            job["job_id"]
            for _, reply in self.replies
            if isinstance(reply, bytes)
            for job in orjson.loads(reply)["jobs"]
        ]


@contextlib.asynccontextmanager
async def running_hub(store: SqliteStore) -> AsyncIterator[tuple[FakeWriter, LongPolls]]:
    writer = FakeWriter(store)
    hub = LongPolls(writer)  # type: ignore[arg-type]
    writer.listeners.append(hub.on_commit)
    async with trio.open_nursery() as nursery:
        await nursery.start(hub.run)
        yield writer, hub
        nursery.cancel_scope.cancel()


def claims(writer: FakeWriter) -> list[Any]:
    """The sinks of the leases the writer claimed for, in order."""
    return [c[1] for c in writer.executed if type(c) is tuple and c[0] is ops.CLAIM]


async def submit(writer: FakeWriter, queue: str, n: int) -> None:
    await writer.execute(cmd.Submit(tuple(SubmitSpec(queue, "1") for _ in range(n))))
    await trio.testing.wait_all_tasks_blocked()


async def test_a_commit_wakes_as_many_parked_leases_as_jobs_it_made_ready(autojump_clock, store):
    async with running_hub(store) as (writer, hub):
        workers = [Worker(hub, f"w{i}") for i in range(4)]
        for _ in range(25):
            for worker in workers:
                hub.park(lease_item(worker, wait_s=30), worker)
        await submit(writer, "q", 3)
        assert len(claims(writer)) == 3
        assert sum(len(w.jobs()) for w in workers) == 3
        assert hub.parked == 97
        await submit(writer, "q", 1)
        assert len(claims(writer)) == 4
        assert hub.parked == 96


async def test_leases_taking_several_jobs_are_woken_until_their_counts_cover_the_jobs(
    autojump_clock, store
):
    async with running_hub(store) as (writer, hub):
        worker = Worker(hub, "w")
        for _ in range(10):
            hub.park(lease_item(worker, wait_s=30, count=5), worker)
        await submit(writer, "q", 12)
        assert len(claims(writer)) == 3  # 5 + 5 + 2
        assert len(set(worker.jobs())) == 12
        assert hub.parked == 7


async def test_connections_take_turns_and_each_connection_its_oldest_first(autojump_clock, store):
    async with running_hub(store) as (writer, hub):
        early, late = Worker(hub, "early"), Worker(hub, "late")
        early_items = [lease_item(early, wait_s=30) for _ in range(10)]
        for each in early_items:
            hub.park(each, early)
        hub.park(lease_item(late, wait_s=30), late)
        await submit(writer, "q", 2)
        # Not the early connection's two oldest: one each, the early one's oldest.
        assert claims(writer) == [early, late]
        assert early.replies[0][0] is early_items[0]
        await submit(writer, "q", 1)
        assert early.replies[1][0] is early_items[1]


async def test_a_woken_lease_that_finds_nothing_parks_again_at_its_old_place(autojump_clock, store):
    async with running_hub(store) as (writer, hub):
        worker = Worker(hub, "w")
        first = lease_item(worker, wait_s=30)
        hub.park(first, worker)
        for _ in range(3):
            hub.park(lease_item(worker, wait_s=30), worker)
        # A commit that made a job ready, taken by another lease before the woken claims:
        # it finds nothing, and is the first woken again.
        hub.on_commit(Changes(ready_queues={"q"}, ready_counts={"q": 1}))
        await trio.testing.wait_all_tasks_blocked()
        assert claims(writer) == [worker] and hub.parked == 4 and worker.replies == []
        await submit(writer, "q", 1)
        assert [item for item, _ in worker.replies] == [first]
        assert hub.parked == 3


async def test_a_lease_parked_on_several_queues_is_woken_once(autojump_clock, store):
    async with running_hub(store) as (writer, hub):
        both, only_b = Worker(hub, "both"), Worker(hub, "b")
        hub.park(lease_item(both, queues=("a", "b"), wait_s=30), both)
        hub.park(lease_item(only_b, queues=("b",), wait_s=30), only_b)
        await submit(writer, "a", 1)
        assert claims(writer) == [both] and len(both.jobs()) == 1
        await submit(writer, "b", 1)
        # The lease on both queues is answered: the job of b goes to the other.
        assert claims(writer) == [both, only_b] and len(only_b.jobs()) == 1
        assert hub.parked == 0


async def test_a_lease_on_several_queues_parks_again_after_finding_nothing(autojump_clock, store):
    """Woken through one queue, it is still in the other queue's heap when it parks again
    at its old place: it is there twice, and woken once."""
    async with running_hub(store) as (writer, hub):
        both = Worker(hub, "both")
        hub.park(lease_item(both, queues=("a", "b"), wait_s=30), both)
        hub.park(lease_item(both, queues=("b", "a"), wait_s=30), both)
        for _ in range(3):  # made ready, and taken by another lease first
            hub.on_commit(Changes(ready_queues={"a"}, ready_counts={"a": 1}))
            await trio.testing.wait_all_tasks_blocked()
        assert hub.parked == 2 and both.replies == []
        await submit(writer, "b", 2)
        assert len(set(both.jobs())) == 2 and hub.parked == 0


async def test_a_woken_lease_whose_client_went_passes_its_job_on(autojump_clock, store):
    async with running_hub(store) as (writer, hub):
        gone, staying = Worker(hub, "gone"), Worker(hub, "staying")
        hub.park(lease_item(gone, wait_s=30), gone)
        hub.park(lease_item(staying, wait_s=30), staying)
        await writer.execute(cmd.Submit((SubmitSpec("q", "1"),)))  # wakes `gone`, first
        gone.can_wait = False  # before the run task sends its claim
        await trio.testing.wait_all_tasks_blocked()
        assert gone.replies == [(gone.replies[0][0], [])]
        assert len(staying.jobs()) == 1 and hub.parked == 0


async def test_a_woken_claim_not_run_passes_its_jobs_on(autojump_clock, store):
    """The client goes after the claim is queued: the writer thread does not claim for it
    (``_wanted``), and the jobs it was woken for wake others at that commit."""
    async with running_hub(store) as (writer, hub):
        gone, staying = Worker(hub, "gone"), Worker(hub, "staying")
        hub.park(lease_item(gone, wait_s=30, count=2), gone)
        hub.park(lease_item(staying, wait_s=30, count=2), staying)
        gone.still_wanted = lambda: False  # type: ignore[method-assign]
        await submit(writer, "q", 2)
        assert gone.jobs() == []
        assert len(staying.jobs()) == 2


async def test_a_woken_claim_stopped_by_its_byte_budget_passes_the_rest_on(autojump_clock, store):
    async with running_hub(store) as (writer, hub):
        small, other = Worker(hub, "small"), Worker(hub, "other")
        budget = lease_item(small, wait_s=30, count=3)
        payload = '"' + "x" * 1000 + '"'
        hub.park(budget, small)
        hub.park(lease_item(other, wait_s=30, count=3), other)
        budget[4].max_bytes = len(payload) + REPLY_OVERHEAD_BYTES  # one job's worth
        budget[4].reply_bytes = budget[4].job_bytes = 1 << 20
        await writer.execute(cmd.Submit(tuple(SubmitSpec("q", payload) for _ in range(3))))
        await trio.testing.wait_all_tasks_blocked()
        # (The run task sets its budget from its room: one job's room is what it gets.)
        assert len(small.jobs()) >= 1
        assert len(small.jobs()) + len(other.jobs()) == 3


async def test_no_job_made_ready_while_leases_are_parked_stays_unleased(autojump_clock, store):
    """Many commits, parked leases of several counts and queues: every job is leased
    once, and none is left ready while a lease that could take it is parked."""
    async with running_hub(store) as (writer, hub):
        workers = [Worker(hub, f"w{i}") for i in range(5)]
        shapes = [(("a",), 1), (("b",), 2), (("a", "b"), 3), (("b", "a"), 1), (("a",), 4)]
        for (queues, n), worker in zip(shapes, workers, strict=True):
            for _ in range(6):
                hub.park(lease_item(worker, queues=queues, wait_s=60, count=n), worker)
        made = 0
        for round_ in range(12):
            for queue in ("a", "b"):
                await submit(writer, queue, round_ % 4 + 1)
                made += round_ % 4 + 1
            stats = store.queue_stats()
            waited_on = {q for es in hub._by_sink.values() for e in es for q in e.item[4].queues}
            for queue in ("a", "b"):
                assert stats[queue]["ready"] == 0 or queue not in waited_on
        leased = [job for w in workers for job in w.jobs()]
        assert len(leased) == len(set(leased))
        stats = store.queue_stats()
        assert len(leased) == made - stats["a"]["ready"] - stats["b"]["ready"]


async def test_a_lease_whose_claim_was_on_its_way_as_another_servers_commit_came_claims_again(
    autojump_clock, store
):
    """Another server's commit heard while a claim was with the writer: the claim may have
    looked before it, and the wake-up came before the lease parked. It claims again at
    once; one sent after the commit was heard parks."""
    async with running_hub(store) as (writer, hub):
        early, late = Worker(hub, "early"), Worker(hub, "late")
        sent_early = lease_item(early, wait_s=30)
        sent_early[4].sent = trio.current_time()
        autojump_clock.jump(1)
        changes = Changes()
        changes.made_ready("q")
        hub.on_remote_commit(changes)  # (nobody parked on q yet: it wakes no one)
        autojump_clock.jump(1)
        sent_late = lease_item(late, wait_s=30)
        sent_late[4].sent = trio.current_time()
        hub.park(sent_early, early)
        hub.park(sent_late, late)
        await trio.testing.wait_all_tasks_blocked()
        assert claims(writer) == [early]
        assert hub.parked == 2  # (the early one found nothing again, and parked)
