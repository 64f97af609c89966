"""The time-driven services while the store cannot write (``Unavailable``: disk full, I/O
errors): they keep running, try again quietly, and do their work once the disk has room."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
import trio.testing

from relay.protocol.errors import Unavailable
from relay.protocol.model import JobState, SubmitSpec
from relay.server.services import maintenance
from relay.server.services.maintenance import Alarm
from relay.store import commands as cmd
from tests.server.services.test_maintenance import FakeWriter, virtual_ms

WRITES = (cmd.PromoteDue, cmd.ReapExpired, cmd.Prune)


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


class FullDiskWriter(FakeWriter):
    """A FakeWriter whose writes are answered ``unavailable`` while ``full``."""

    full = True
    refused = 0

    async def execute(self, command: Any) -> Any:
        if self.full and isinstance(command, WRITES):
            await trio.lowlevel.checkpoint()
            self.refused += 1
            raise Unavailable("not committed: disk full (SQLITE_FULL); retry later")
        return await super().execute(command)


async def room_at(writer: FullDiskWriter, seconds: float) -> None:
    await trio.sleep(seconds)
    writer.full = False


@pytest.mark.parametrize("loop", ["promoter", "reaper"])
async def test_a_timed_loop_retries_while_the_disk_is_full(autojump_clock, store, caplog, loop):
    writer = FullDiskWriter(store)
    alarm = Alarm()
    if loop == "promoter":
        (job,) = store.jobs_submit([SubmitSpec("q", "1", delay_ms=1_000)], virtual_ms())
        job_id, run = job.job_id, maintenance.run_promoter
    else:
        store.jobs_submit([SubmitSpec("q", "1")], virtual_ms())
        (lease,) = store.jobs_claim(("q",), "w", 1, 1_000, virtual_ms())
        job_id, run = lease.job_id, maintenance.run_reaper
    async with trio.open_nursery() as nursery:
        await nursery.start(run, writer, alarm, virtual_ms)
        nursery.start_soon(room_at, writer, 4.0)
        await writer.wait_until(lambda: store.job_inspect(job_id).state == JobState.READY)
        done_at = trio.current_time()
        nursery.cancel_scope.cancel()
    # Due (or expired) at 1 s, refused until 4 s, done within a back-off of the room.
    assert 4.0 <= done_at <= 4.0 + maintenance.ERROR_BACKOFF_S + 0.01
    assert writer.refused >= 3
    # Quiet: the writer logs the episode; the loop logs no error per try.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_the_pruner_tries_again_the_next_minute(autojump_clock, store):
    writer = FullDiskWriter(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(maintenance.run_pruner, writer)
        nursery.start_soon(room_at, writer, 1.0)
        await writer.wait_until(lambda: any(isinstance(c, cmd.Prune) for c in writer.executed))
        pruned_at = trio.current_time()
        nursery.cancel_scope.cancel()
    assert writer.refused == 1
    assert pruned_at == pytest.approx(maintenance.PRUNE_INTERVAL_S)
