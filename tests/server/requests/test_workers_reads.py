"""``WorkerBook.leases_held``: one read of the leases held at a time, of every connected
worker's, shared by the calls that began before it; never a read older than its call.
(Over the wire, with a pipelining attacker: tests/hostile/test_heavy_reads.py.)"""

from __future__ import annotations

from typing import Any

import trio

from relay.server.requests.workers import HELD_READ, JOBS_SHOWN, WorkerBook
from relay.store import commands as cmd


class HeldWriter:
    """A writer whose reads of the leases held wait until ``release`` lets one finish."""

    def __init__(self, rows: list[tuple]) -> None:
        self.rows = rows
        self.reads: list[tuple[str, ...]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.finish = trio.Semaphore(0)

    async def execute(self, command: Any) -> Any:
        assert isinstance(command, cmd.LeasesHeld) and command.limit == HELD_READ
        self.reads.append(command.worker_ids)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.finish.acquire()
        finally:
            self.in_flight -= 1
        return list(self.rows), 5_000


def book_of(*worker_ids: str) -> WorkerBook:
    book = WorkerBook()
    for n, worker_id in enumerate(worker_ids):
        book.leased(object(), worker_id, ("q",), float(n))  # type: ignore[arg-type]
    return book


async def test_calls_during_a_read_share_the_next_one_and_none_gets_an_older_read():
    rows = [(f"job_{i:016x}", "q", "a", 9_000, 1_000 + i) for i in range(3)]
    writer = HeldWriter(rows)
    book = book_of("a", "b")
    got: list[Any] = []

    async def ask(names: set[str]) -> None:
        got.append(await book.leases_held(writer, names))  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, {"a"})
        await trio.testing.wait_all_tasks_blocked()
        assert len(writer.reads) == 1  # (the first read: every connected worker's)
        assert writer.reads[0] == ("a", "b")
        for names in ({"a"}, {"b"}, {"a", "b"}, {"a"}):  # begun during the first read
            nursery.start_soon(ask, names)
        await trio.testing.wait_all_tasks_blocked()
        assert len(writer.reads) == 1  # they wait: one read at a time
        writer.finish.release()
        await trio.testing.wait_all_tasks_blocked()
        assert len(writer.reads) == 2  # one more, for all four
        writer.finish.release()
    assert writer.most_in_flight == 1
    assert len(got) == 5
    first, *later = got
    assert all(held is later[0] for held in later) and first is not later[0]
    assert later[0].seq > first.seq
    # A call after that read ended reads again (a read is never older than its call).
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, {"a"})
        await trio.testing.wait_all_tasks_blocked()
        writer.finish.release()
    assert len(writer.reads) == 3 and got[-1].seq > later[0].seq


async def test_a_read_keeps_per_worker_its_count_and_its_jobs_held_longest():
    n = JOBS_SHOWN + 5
    rows = [(f"job_{i:016x}", "q", "a", 9_000, 1_000 + i) for i in range(n)]
    rows += [("job_00000000000000ff", "q", "b", 9_000, None)]  # (started before an upgrade)
    writer = HeldWriter(rows)
    writer.finish.release()
    held = await book_of("a", "b").leases_held(writer, {"a", "b"})  # type: ignore[arg-type]
    assert held.counts == {"a": n, "b": 1}
    assert [job[0] for job in held.longest["a"]] == [f"job_{i:016x}" for i in range(JOBS_SHOWN)]
    assert held.longest_ms == {"a": 4_000}  # now 5,000 less the oldest start
    assert held.longest["b"][0][4] is None and "b" not in held.longest_ms
    assert not held.truncated
