"""The history flusher and the pruning of history rows, on trio's MockClock (the
``FakeWriter`` of test_maintenance.py runs commands inline at virtual time)."""

from __future__ import annotations

import trio

from relay.protocol.model import SubmitSpec
from relay.server.services import maintenance
from relay.store import commands as cmd
from relay.store.history import FLUSH_INTERVAL_S, HISTORY_KEEP_MS, MINUTE_MS, Histograms
from tests.server.services.test_maintenance import FakeWriter, count, virtual_ms


def submitted(store, start: int, end: int) -> list[int]:
    return [p.values[0] for p in store.history_read("q", start, end, MINUTE_MS)]


async def test_the_flusher_writes_every_interval_and_feeds_the_histograms(autojump_clock, store):
    writer = FakeWriter(store)
    histograms = Histograms(10)
    start = virtual_ms() - virtual_ms() % MINUTE_MS
    store.jobs_submit([SubmitSpec("q", "1")] * 2, virtual_ms())
    async with trio.open_nursery() as nursery:
        await nursery.start(maintenance.run_history_flusher, writer, histograms)
        await trio.sleep(FLUSH_INTERVAL_S - 0.1)
        assert count(writer, cmd.HistoryFlush) == 0  # not flushed yet: only counted
        assert sum(submitted(store, start, start + MINUTE_MS)) == 0
        await trio.sleep(0.2)
        assert count(writer, cmd.HistoryFlush) == 1
        assert sum(submitted(store, start, start + MINUTE_MS)) == 2
        await trio.sleep(1)  # a job waits a second, runs two
        [lease] = store.jobs_claim(["q"], "w", 1, 60_000, virtual_ms())
        await trio.sleep(2)
        store.jobs_ack(lease.job_id, "w", lease.token, None, virtual_ms())
        await trio.sleep(FLUSH_INTERVAL_S)
        assert count(writer, cmd.HistoryFlush) == 2
        nursery.cancel_scope.cancel()
    (run, run_sum, wait, wait_sum) = histograms.snapshot()["q"]
    assert (sum(run), run_sum, sum(wait)) == (1, 2_000, 1)
    assert 6_000 <= wait_sum <= 6_100  # submitted at 0, leased after 5.1 + 1 s


async def test_prune_once_deletes_history_past_the_kept_period_in_passes(
    autojump_clock, store, monkeypatch
):
    monkeypatch.setattr(maintenance, "PASS_LIMIT", 2)
    writer = FakeWriter(store)
    old = virtual_ms() - HISTORY_KEEP_MS - 10 * MINUTE_MS
    for minute in range(3):  # three old minutes (six rows: each queue's and every queue's)
        store.jobs_submit([SubmitSpec("q", "1")], old + minute * MINUTE_MS)
    store.jobs_submit([SubmitSpec("q", "1")], virtual_ms())
    await maintenance.flush_history_once(writer, Histograms(10))
    await maintenance.prune_once(writer)
    assert count(writer, cmd.HistoryPrune) == 4  # 2 + 2 + 2 + 0
    now = virtual_ms()
    assert sum(submitted(store, old, old + 3 * MINUTE_MS)) == 0
    assert sum(submitted(store, now - now % MINUTE_MS, now + MINUTE_MS)) == 1
