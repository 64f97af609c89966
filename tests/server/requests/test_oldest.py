"""``OldestReady`` (requests/oldest.py): the ages of the oldest ready jobs, read through
the writer at most once per interval per queue, one read at a time, shared by askers."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from relay.server.requests.oldest import CHUNK, OldestReady
from relay.store import commands as cmd


class FakeWriter:
    """Answers OldestReadyAt: every queue's oldest job became ready at 1_000 ms."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, ...]] = []
        self.at_once = 0
        self.most_at_once = 0
        self.release = trio.Event()

    async def execute(self, command: Any) -> Any:
        assert isinstance(command, cmd.OldestReadyAt)
        self.reads.append(command.queues)
        self.at_once += 1
        self.most_at_once = max(self.most_at_once, self.at_once)
        await self.release.wait()
        self.at_once -= 1
        return {queue: 1_000 for queue in command.queues if queue != "none-ready"}


async def test_askers_share_one_read_per_queue_per_interval(autojump_clock):
    writer = FakeWriter()
    oldest = OldestReady(writer, clock=lambda: 1_500, ttl_s=1.0)  # type: ignore[arg-type]
    answers: list[dict[str, int]] = []
    queues = [f"q{i}" for i in range(CHUNK + 10)] + ["none-ready"]

    async def ask() -> None:
        answers.append(await oldest.ages(queues))

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()
        writer.release.set()
    # 20 askers: each queue read once, in chunks, one chunk in the writer at a time.
    assert sorted(q for read in writer.reads for q in read) == sorted(queues)
    assert max(len(read) for read in writer.reads) <= CHUNK and writer.most_at_once == 1
    expected = {queue: 500 for queue in queues if queue != "none-ready"}
    assert answers == [expected] * 20
    reads = len(writer.reads)
    await trio.sleep(0.5)
    assert await oldest.ages(queues) == expected and len(writer.reads) == reads
    await trio.sleep(0.6)  # the interval has passed: read again
    await oldest.ages(["q1"])
    assert writer.reads[-1] == ("q1",)
