"""This server's rows of ``waiters`` (WaiterRows), on trio's MockClock with fakes: a
writer that records each PutWaiters and answers from an in-memory table of rows (or with a
scripted answer or error), and long-polls that record what is woken."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from relay.protocol.errors import ShuttingDown, Unavailable
from relay.server.services import waiters
from relay.server.services.waiters import (
    ERROR_BACKOFF_S,
    LINGER_S,
    MAX_ROWS,
    REMOVE_S,
    RENEW_S,
    TTL_MS,
    WaiterRows,
)
from relay.store import commands as cmd
from relay.store.postgres.notify import EVERY


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


class FakeWriter:
    """Runs each PutWaiters against ``table`` (this server's rows) and answers the queues
    of its ``put`` that had no row. ``script`` overrides the answers in order: an exception
    is raised (the table unchanged), a tuple is answered (the table updated as usual)."""

    def __init__(self, table: set[str] | None = None) -> None:
        self.start = trio.current_time()
        self.table: set[str] = set(table or ())
        self.script: list[BaseException | tuple[str, ...]] = []
        self.commands: list[tuple[float, cmd.PutWaiters]] = []
        self.hang_on_remove = False
        self.slow_put = False  # a put is written at once, its answer comes 10 s later

    async def execute(self, command: Any) -> Any:
        await trio.lowlevel.checkpoint()  # a cancelled, unshielded caller never gets here
        assert isinstance(command, cmd.PutWaiters)
        self.commands.append((trio.current_time() - self.start, command))
        if self.hang_on_remove and command.ttl_ms == 0:
            await trio.sleep_forever()
        answer = self.script.pop(0) if self.script else None
        if isinstance(answer, BaseException):
            raise answer
        new = tuple(q for q in command.put if q not in self.table)
        self.table = (self.table - set(command.drop)) | set(command.put)
        if self.slow_put and command.put:
            await trio.sleep(10)  # (its caller may be cancelled meanwhile: it stays written)
        return new if answer is None else answer

    def at(self, t: float) -> list[cmd.PutWaiters]:
        """The commands written at ``t`` seconds (virtual) from the start."""
        return [c for when, c in self.commands if when == pytest.approx(t, abs=1e-6)]

    @property
    def times(self) -> list[float]:
        return [round(when, 6) for when, _ in self.commands]


class FakeLongPolls:
    def __init__(self) -> None:
        self.parked: set[str] = set()  # the queues parked_on answers True for
        self.woken: list[set[str]] = []
        self.woke_all = 0

    def parked_on(self, queue: str) -> bool:
        return queue in self.parked

    def queues(self) -> set[str]:
        return set(self.parked)

    def wake_queues(self, queues: set[str]) -> None:
        self.woken.append(set(queues))

    def wake_all(self) -> None:
        self.woke_all += 1


def put(put: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> cmd.PutWaiters:
    return cmd.PutWaiters(put, drop, TTL_MS)


def removal(command: cmd.PutWaiters) -> tuple[Any, ...]:
    """A command with its drop unordered: the last removal's follows the set held."""
    return command.put, frozenset(command.drop), command.ttl_ms


def make(table: set[str] | None = None) -> tuple[FakeWriter, FakeLongPolls, WaiterRows]:
    writer, longpolls = FakeWriter(table), FakeLongPolls()
    return writer, longpolls, WaiterRows(writer, longpolls)  # type: ignore[arg-type]


@asynccontextmanager
async def running(rows: WaiterRows) -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as nursery:
        await nursery.start(rows.run)
        yield nursery
        nursery.cancel_scope.cancel()


async def until(writer: FakeWriter, t: float) -> None:
    """Sleep (virtually) until ``t`` seconds from the writer's start."""
    await trio.sleep_until(writer.start + t)


async def test_a_park_on_a_new_queue_writes_its_row_and_wakes_only_the_new_queues(
    autojump_clock,
):
    # "b" already has a row of ours (say, left by this server's previous run).
    writer, longpolls, rows = make(table={"b"})
    async with running(rows):
        rows.parked(("b", "a"))
        await until(writer, 1)
        assert [c for _, c in writer.commands] == [put(("a", "b"))]
        assert writer.times == [0.0]
        # The write answered ("a",): only "a" may have missed a commit.
        assert longpolls.woken == [{"a"}]
        assert longpolls.woke_all == 0
        assert rows.held == {"a", "b"}
        assert rows.writes == 1


async def test_a_park_on_held_queues_writes_nothing_and_a_new_one_only_its_own_row(
    autojump_clock,
):
    writer, longpolls, rows = make()
    async with running(rows):
        rows.parked(("a", "b"))
        await until(writer, 1)
        rows.parked(("a",))
        rows.parked(("b", "a"))
        await until(writer, 5)
        assert [c for _, c in writer.commands] == [put(("a", "b"))]
        rows.parked(("a", "c"))
        await until(writer, 10)
        assert [c for _, c in writer.commands] == [put(("a", "b")), put(("c",))]
        assert writer.times == [0.0, 5.0]
        assert longpolls.woken == [{"a", "b"}, {"c"}]
        assert rows.held == {"a", "b", "c"}


async def test_held_rows_are_renewed_every_renew_s(autojump_clock):
    writer, longpolls, rows = make()
    longpolls.parked = {"a", "b"}  # leases stay parked on both
    async with running(rows):
        rows.parked(("a",))
        await until(writer, 5)
        rows.parked(("b",))
        await until(writer, 3 * RENEW_S + 1)
    # (The last, at 3 * RENEW_S + 1, is the removal at cancellation.)
    assert writer.times == [0.0, 5.0, RENEW_S, 2 * RENEW_S, 3 * RENEW_S, 3 * RENEW_S + 1]
    for n in (1, 2, 3):
        assert writer.at(n * RENEW_S) == [put(("a", "b"))]
    # Renewed rows are not new: nobody is woken again.
    assert longpolls.woken == [{"a"}, {"b"}]
    assert removal(writer.commands[-1][1]) == ((), {"a", "b"}, 0)


async def test_a_queue_without_parks_for_linger_s_is_dropped_unless_a_lease_is_parked_on_it(
    autojump_clock,
):
    assert 2 * RENEW_S >= LINGER_S > RENEW_S  # the timeline below
    writer, longpolls, rows = make()
    longpolls.parked = {"b"}  # a lease stays parked on "b"; none on "a" or "c"
    async with running(rows):
        rows.parked(("a", "b", "c"))
        await until(writer, 15)
        rows.parked(("c",))  # "c" parked on again within LINGER_S: kept at 2 * RENEW_S
        await until(writer, 2 * RENEW_S + 1)
        # At RENEW_S all were renewed; at 2 * RENEW_S "a" (last parked on at 0) is dropped.
        assert writer.at(RENEW_S) == [put(("a", "b", "c"))]
        assert writer.at(2 * RENEW_S) == [put(("b", "c"), drop=("a",))]
        assert rows.held == {"b", "c"}
        await until(writer, 3 * RENEW_S + 1)
        # "c" (last parked on at 15) lingered out; "b" is kept, long past LINGER_S.
        assert writer.at(3 * RENEW_S) == [put(("b",), drop=("c",))]
        assert rows.held == {"b"}
        longpolls.parked = set()  # the lease on "b" left
        await until(writer, 4 * RENEW_S + 1)
        assert writer.at(4 * RENEW_S) == [put(drop=("b",))]
        assert rows.held == set()
        assert writer.table == set()
        n = len(writer.commands)
        await until(writer, 20 * RENEW_S)
        assert len(writer.commands) == n  # nothing held: nothing to renew
    assert len(writer.commands) == n  # and nothing to remove
    assert longpolls.woken == [{"a", "b", "c"}]


async def test_past_max_rows_one_every_row_replaces_the_per_queue_rows_and_wakes_the_rest(
    autojump_clock,
):
    writer, longpolls, rows = make()
    queues = tuple(f"q{i:05}" for i in range(MAX_ROWS))
    async with running(rows):
        rows.parked(queues)
        await until(writer, 1)
        assert [c for _, c in writer.commands] == [put(queues)]
        assert longpolls.woken == [set(queues)]
        longpolls.parked = {*queues, "one-more"}
        rows.parked(("one-more",))
        await until(writer, 2)
        assert writer.at(1) == [put((EVERY,), drop=queues)]
        assert writer.table == {EVERY}
        assert rows.held == {EVERY}
        # Only the queue no row of ours covered until now: the others had theirs.
        assert longpolls.woken == [set(queues), {"one-more"}]
        rows.parked(("yet-another",))  # covered by the EVERY row
        await until(writer, 10)
        assert len(writer.commands) == 2
        await until(writer, RENEW_S + 1)
        assert writer.at(RENEW_S) == [put((EVERY,))]  # renewed, not new: nobody woken
    assert longpolls.woke_all == 0 and len(longpolls.woken) == 2
    assert writer.commands[-1][1] == cmd.PutWaiters((), (EVERY,), 0)


async def test_every_row_that_was_already_there_wakes_nobody(autojump_clock, monkeypatch):
    monkeypatch.setattr(waiters, "MAX_ROWS", 2)
    writer, longpolls, rows = make(table={EVERY})
    async with running(rows):
        rows.parked(("a", "b", "c"))
        await until(writer, 1)
    assert writer.at(0) == [put((EVERY,))]
    assert longpolls.woke_all == 0
    assert longpolls.woken == []


@pytest.mark.parametrize("error", [Unavailable("disk full"), RuntimeError("lost")])
async def test_a_failed_write_is_retried_after_the_backoff_and_its_queues_woken_after_the_next(
    autojump_clock, caplog, error
):
    writer, longpolls, rows = make()
    # The first write fails (its outcome unknown); the retry answers that nothing is new
    # (as if the failed one had committed).
    writer.script = [error, ()]
    async with running(rows):
        rows.parked(("a",))
        await until(writer, ERROR_BACKOFF_S / 2)
        assert writer.times == [0.0]
        assert longpolls.woken == [] and rows.held == set() and rows.writes == 0
        await until(writer, ERROR_BACKOFF_S + 1)
        assert writer.times == [0.0, ERROR_BACKOFF_S]
        assert [c for _, c in writer.commands] == [put(("a",)), put(("a",))]
        assert longpolls.woken == [{"a"}]
        assert rows.held == {"a"} and rows.writes == 1
        # Woken once: the next write that says nothing is new wakes nobody.
        writer.script = [()]
        rows.parked(("b",))
        await until(writer, 5)
        assert writer.at(ERROR_BACKOFF_S + 1) == [put(("b",))]
        assert longpolls.woken == [{"a"}]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == (0 if isinstance(error, Unavailable) else 1)


async def test_a_failed_renewal_is_retried_as_a_renewal(autojump_clock):
    writer, longpolls, rows = make()
    longpolls.parked = {"a"}
    async with running(rows):
        rows.parked(("a",))
        await until(writer, 1)
        writer.script = [Unavailable("disk full"), Unavailable("disk full"), ()]
        await until(writer, RENEW_S + 3 * ERROR_BACKOFF_S)
    assert writer.times[:4] == [0.0, RENEW_S, RENEW_S + ERROR_BACKOFF_S, RENEW_S + 2]
    assert [c for _, c in writer.commands[1:4]] == [put(("a",))] * 3
    # The renewal's outcome was unknown, but its row was there before it: nobody woken.
    assert longpolls.woken == [{"a"}]


async def test_shutting_down_ends_run_and_nothing_held_is_removed(autojump_clock):
    writer, longpolls, rows = make()
    writer.script = [ShuttingDown("stopping")]
    rows.parked(("a",))
    with trio.fail_after(RENEW_S):
        await rows.run()
    assert [c for _, c in writer.commands] == [put(("a",))]
    assert rows.held == set() and longpolls.woken == []


async def test_shutting_down_ends_run_after_trying_to_remove_the_held_rows(autojump_clock):
    writer, longpolls, rows = make()
    longpolls.parked = {"a"}
    # The renewal finds the writer stopping, and so does the removal (not raised).
    writer.script = [("a",), ShuttingDown("stopping"), ShuttingDown("stopping")]
    rows.parked(("a",))
    with trio.fail_after(2 * RENEW_S):
        await rows.run()
    assert [c for _, c in writer.commands] == [
        put(("a",)),
        put(("a",)),
        cmd.PutWaiters((), ("a",), 0),
    ]
    assert writer.times == [0.0, RENEW_S, RENEW_S]


async def test_cancelling_removes_the_held_rows_with_one_last_write(autojump_clock):
    writer, _, rows = make()
    async with running(rows) as nursery:
        rows.parked(("b", "a"))
        await until(writer, 1)
        assert rows.held == {"a", "b"}
        nursery.cancel_scope.cancel()
    # Sent despite the cancellation (the fake writer checkpoints first), at once.
    first, last = (c for _, c in writer.commands)
    assert first == put(("a", "b"))
    assert removal(last) == ((), {"a", "b"}, 0)
    assert writer.times == [0.0, 1.0]
    assert writer.table == set()


async def test_the_last_removal_is_given_up_after_remove_s(autojump_clock):
    writer, _, rows = make()
    writer.hang_on_remove = True
    async with running(rows) as nursery:
        rows.parked(("a",))
        await until(writer, 1)
        nursery.cancel_scope.cancel()
    assert trio.current_time() - writer.start == pytest.approx(1 + REMOVE_S, abs=1e-6)
    assert writer.commands[-1] == (pytest.approx(1.0), cmd.PutWaiters((), ("a",), 0))


async def test_cancelling_with_nothing_held_writes_nothing(autojump_clock):
    writer, longpolls, rows = make()
    async with running(rows):
        await until(writer, 3 * RENEW_S)
    assert writer.commands == []
    assert longpolls.woken == [] and longpolls.woke_all == 0


async def test_a_write_under_way_as_the_task_is_cancelled_has_its_rows_removed_after(
    autojump_clock,
):
    """A command is not withdrawn by its caller's cancellation: the rows it writes go
    with the last removal, queued after it."""
    writer, _, rows = make()
    writer.slow_put = True
    async with running(rows) as nursery:
        rows.parked(("a",))
        await until(writer, 1)
        assert writer.table == {"a"} and rows.held == set()
        nursery.cancel_scope.cancel()
    assert [c for _, c in writer.commands] == [put(("a",)), cmd.PutWaiters((), ("a",), 0)]
    assert writer.table == set()


async def test_the_rows_of_a_failed_write_are_dropped_once_their_queue_is_not_waited_on(
    autojump_clock,
):
    """A write that failed may have committed: its rows are removed as the rows held are,
    once no lease parks on their queue, though no write succeeded meanwhile."""
    writer, _, rows = make()
    failures = int(LINGER_S / ERROR_BACKOFF_S)  # (until "a" is no longer waited on)
    writer.script = [Unavailable("down")] * failures
    async with running(rows):
        rows.parked(("a",))
        await until(writer, LINGER_S + 2 * ERROR_BACKOFF_S)
    written = [c for _, c in writer.commands]
    assert written[:failures] == [put(("a",))] * failures
    assert written[failures:] == [put((), ("a",))]


async def test_a_failed_drop_is_not_taken_for_done_nor_for_undone(autojump_clock):
    """A removal whose outcome is not known: a lease that parks on its queue then asks
    for the row again, and is woken once it is written (the row may have gone)."""
    writer, longpolls, rows = make()
    async with running(rows):
        rows.parked(("a",))
        await until(writer, RENEW_S + 1)
        writer.script = [Unavailable("lost")]  # the drop at the renewal after LINGER_S
        await until(writer, 2 * RENEW_S + 0.5)
        assert writer.at(2 * RENEW_S) == [put((), ("a",))]
        assert rows.held == set()
        rows.parked(("a",))  # (during the backoff)
        await until(writer, 2 * RENEW_S + ERROR_BACKOFF_S + 0.5)
    assert writer.at(2 * RENEW_S + ERROR_BACKOFF_S) == [put(("a",))]
    assert longpolls.woken == [{"a"}, {"a"}]


async def test_below_half_max_rows_the_per_queue_rows_come_back_and_wake_nobody(
    autojump_clock, monkeypatch
):
    monkeypatch.setattr(waiters, "MAX_ROWS", 4)
    writer, longpolls, rows = make()
    async with running(rows):
        longpolls.parked = {"a", "b", "c", "d", "e"}
        rows.parked(("a", "b", "c", "d", "e"))
        await until(writer, 1)
        assert rows.held == {EVERY}
        longpolls.parked = {"a", "b", "c"}  # 3: not below half of 4, the EVERY row stays
        await until(writer, LINGER_S + RENEW_S + 1)
        assert rows.held == {EVERY}
        longpolls.parked = {"a", "b"}
        await until(writer, LINGER_S + 2 * RENEW_S + 1)
        assert rows.held == {"a", "b"}
    assert writer.at(3 * RENEW_S) == [put(("a", "b"), (EVERY,))]
    # Woken as the EVERY row was new; not as their own rows came in the transaction that
    # removed it (covered all along).
    assert longpolls.woken == [{"a", "b", "c", "d", "e"}] and longpolls.woke_all == 0
