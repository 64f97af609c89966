"""The one writer thread that owns SQLite, and the async facade trio code awaits.

Data flows one way::

    trio task --Envelope--> memory channel --> writer thread: BEGIN IMMEDIATE
                                                 command.apply (each; runs merged)
                                               COMMIT
    trio task <--deliver(replies)-- trio thread <-- one hand-off per batch

Group commit: the thread takes every envelope already queued (up to ``max_batch``) and runs
them in one transaction, commits once, then hands all the outcomes back to trio in one
call. One command's error does not undo the others: a refusal writes nothing, and after
any other failure the batch runs again with a savepoint per command (``_execute``). A
success is delivered only after its commit; if the commit fails, every command of the
batch is answered with an error, because none of it is durable.

The thread is a plain daemon thread owned by ``open_writer``. A feeder task moves commands
from the memory channel into a ``queue.SimpleQueue`` as they arrive; the thread takes
everything waiting there as its next batch, and posts each batch's outcomes back with the
run's ``run_sync_soon``, never waiting on trio. So the thread starts the next transaction as
soon as it has committed one, while trio delivers the replies of the last: the fsync of
one batch overlaps the delivery of the one before and the arrival of the one after.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import attrs
import trio

from relay.errors import InternalError, RelayError, ShuttingDown
from relay.histogram import Histogram, HistogramSnapshot
from relay.nursery import open_service_nursery
from relay.store.commands import Command
from relay.store.sqlite import Changes, SqliteStore

log = logging.getLogger("relay.writer")

# Commands queued before senders wait (backpressure). Large enough to hold a few group
# commits' worth of pipelined requests from many connections.
DEFAULT_CAPACITY = 4096
# At most this many commands share one transaction: bounds the latency a command can add
# to the others of its batch, and the size of one hand-off.
DEFAULT_MAX_BATCH = 512
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0

# Histogram bounds for batch sizes (commands) and commit durations (seconds).
BATCH_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
COMMIT_SECONDS_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)


def wall_clock_ms() -> int:
    """Milliseconds since the Unix epoch: the server clock of the wire contract."""
    return time.time_ns() // 1_000_000


class ReplySink(Protocol):
    """Where outcomes go. ``deliver`` runs in the trio thread, must not block, and gets the
    (tag, outcome) pairs of one batch; an outcome is a result or a ``RelayError``."""

    def deliver(self, replies: list[tuple[Any, Any]]) -> None: ...


@attrs.define(slots=True)
class Envelope:
    command: Command
    sink: ReplySink
    tag: Any = None


@attrs.frozen
class WriterStatistics:
    queued: int  # commands sent and not yet answered (in the channel or the thread's hands)
    batches: int  # transactions committed
    commands: int  # commands in committed transactions
    failed_commits: int  # transactions that could not commit (their commands got errors)
    batch_sizes: HistogramSnapshot
    commit_seconds: HistogramSnapshot


class _Waiter:
    """A one-shot sink for ``Writer.execute``: one request, one awaiting task."""

    __slots__ = ("event", "outcome")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.outcome: Any = None

    def deliver(self, replies: list[tuple[Any, Any]]) -> None:
        self.outcome = replies[-1][1]
        self.event.set()


class Writer:
    """The async side of the writer thread. Created by ``open_writer``."""

    def __init__(self, send: trio.MemorySendChannel[Envelope]) -> None:
        self._send = send
        self._batch_sizes = Histogram(BATCH_SIZE_BOUNDS)
        self._commit_seconds = Histogram(COMMIT_SECONDS_BOUNDS)
        self._batches = 0
        self._commands = 0
        self._failed_commits = 0
        # Commands handed to the thread and not yet answered (the feeder counts them).
        self.handed = 0
        # Called in the trio thread after each commit's replies are delivered.
        self.commit_listeners: list[Callable[[Changes], None]] = []

    async def send(self, command: Command, sink: ReplySink, tag: Any = None) -> None:
        """Queue ``command``; its outcome goes to ``sink.deliver`` after the commit.

        Waits while the channel is full (backpressure). Cancelling this call before it
        returns means the command was not queued. While the channel has room it returns
        without yielding to the scheduler (it is not a checkpoint then), so a burst of
        pipelined requests reaches the writer without a scheduling round trip each.

        Raises:
            ShuttingDown: the writer is stopping or stopped; the command was not queued.
        """
        envelope = Envelope(command, sink, tag)
        try:
            try:
                self._send.send_nowait(envelope)
            except trio.WouldBlock:
                await self._send.send(envelope)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ShuttingDown("the store is shutting down") from None

    async def execute(self, command: Command) -> Any:
        """Run one command and return its result once committed, or raise its error.

        Cancellation: cancelling the wait does not withdraw a command already queued; it
        still runs and commits, its outcome is dropped. Use it for work whose loss of a
        reply is safe (everything here is safe to observe later with ``Inspect``).
        """
        waiter = _Waiter()
        await self.send(command, waiter)
        await waiter.event.wait()
        if isinstance(waiter.outcome, BaseException):
            raise waiter.outcome
        return waiter.outcome

    def statistics(self) -> WriterStatistics:
        return WriterStatistics(
            queued=self._send.statistics().current_buffer_used + self.handed,
            batches=self._batches,
            commands=self._commands,
            failed_commits=self._failed_commits,
            batch_sizes=self._batch_sizes.snapshot(),
            commit_seconds=self._commit_seconds.snapshot(),
        )

    def _record(self, size: int, seconds: float | None) -> None:
        if seconds is None:
            self._failed_commits += 1
            return
        self._batches += 1
        self._commands += size
        self._batch_sizes.observe(size)
        self._commit_seconds.observe(seconds)


class _WriterThread:
    """Owns the store from start to close. Two halves: ``feed`` (a trio task) moves commands
    from the channel to the thread's inbox; ``run`` (the thread) executes all that waits
    there as one batch and hands the outcomes back with ``run_sync_soon``.

    Why a feeder task rather than the thread pulling with ``trio.from_thread.run``: each
    blocking round trip between the threads costs ~100 µs on a small VM. Here the thread
    never waits on trio: it blocks on a ``queue.SimpleQueue`` only when there is no work.
    The feeder keeps at most ``2 * max_batch`` commands handed over and not yet answered;
    beyond that, commands wait in the bounded channel, whose senders then wait in turn.
    """

    def __init__(
        self,
        store: SqliteStore,
        writer: Writer,
        receive: trio.MemoryReceiveChannel[Envelope],
        clock: Callable[[], int],
        max_batch: int,
    ) -> None:
        self.store = store
        self.writer = writer
        self.receive = receive
        self.clock = clock
        self.max_batch = max_batch
        self.token = trio.lowlevel.current_trio_token()
        self.inbox: queue.SimpleQueue[list[Envelope] | None] = queue.SimpleQueue()
        self.max_handed = 2 * max_batch
        self.room = trio.Event()  # set when answers free room below max_handed
        self.crashed = False
        self.finished = trio.Event()
        # Shielded: the feeder stops at the end of the channel, not when cancelled; only
        # open_writer's shutdown deadline cancels it (a thread stuck on a dead disk).
        self.feed_scope = trio.CancelScope(shield=True)

    # -- the trio side -----------------------------------------------------------------------

    def _take_nowait(self, limit: int) -> list[Envelope]:
        batch: list[Envelope] = []
        while len(batch) < limit:
            try:
                batch.append(self.receive.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        return batch

    async def feed(self) -> None:
        """Hand the thread the commands queued in the channel until it is closed and
        drained. Runs shielded: it stops only at the end of the channel or when the thread
        is gone, never with commands left behind."""
        with self.feed_scope:
            while not self.crashed:
                try:
                    first = await self.receive.receive()
                except trio.EndOfChannel:
                    break
                while self.writer.handed >= self.max_handed and not self.crashed:
                    self.room = trio.Event()
                    await self.room.wait()
                taken = [first, *self._take_nowait(self.max_handed - self.writer.handed - 1)]
                if self.crashed:
                    _refuse(taken)
                    break
                self.writer.handed += len(taken)
                self.inbox.put(taken)
            if self.crashed:
                # Answer what is still queued and refuse new commands, so that no sender
                # waits forever for a thread that is gone.
                while leftover := self._take_nowait(self.max_batch):
                    _refuse(leftover)
                self.receive.close()
            else:
                self.inbox.put(None)  # the thread finishes, closes the store, and stops

    def _delivered(
        self,
        batch: list[Envelope],
        outcomes: list[Any],
        changes: Changes | None,
        seconds: float | None,
    ) -> None:
        self.writer._record(len(batch), seconds)
        self.writer.handed -= len(batch)
        self.room.set()
        by_sink: dict[int, tuple[ReplySink, list[tuple[Any, Any]]]] = {}
        for envelope, outcome in zip(batch, outcomes, strict=True):
            entry = by_sink.get(id(envelope.sink))
            if entry is None:
                entry = by_sink[id(envelope.sink)] = (envelope.sink, [])
            entry[1].append((envelope.tag, outcome))
        for sink, replies in by_sink.values():
            try:
                sink.deliver(replies)
            except Exception:
                log.exception("a reply sink failed; the other replies are delivered")
        # Wake-ups after replies: a long-poll that a reply of this very batch parks is
        # registered by then, so a job made ready in the same batch still wakes it.
        if changes is not None:
            for listener in self.writer.commit_listeners:
                try:
                    listener(changes)
                except Exception:
                    log.exception("a commit listener failed")

    def _stopped(self, in_hand: list[Envelope], crashed: bool) -> None:
        # Also what was handed over but never taken, if the thread died first.
        while True:
            try:
                waiting = self.inbox.get_nowait()
            except queue.Empty:
                break
            if waiting is not None:
                in_hand += waiting
        for envelope in in_hand:
            envelope.sink.deliver([(envelope.tag, InternalError("not committed: writer crashed"))])
        if in_hand or crashed:
            self.crashed = True
            self.room.set()
        self.finished.set()

    # -- the writer thread -------------------------------------------------------------------

    def run(self) -> None:
        batch: list[Envelope] = []  # being executed
        pending: list[Envelope] = []  # taken from the inbox, waiting for a transaction
        more = True  # the feeder may still hand over commands
        crashed = False
        try:
            while True:
                if not pending:
                    # Blocks only when there is no work.
                    taken = self.inbox.get() if more else None
                    if taken is None:
                        break
                    pending = taken
                # Everything else already waiting joins this transaction (group commit).
                while more and len(pending) < self.max_batch:
                    try:
                        taken = self.inbox.get_nowait()
                    except queue.Empty:
                        break
                    if taken is None:
                        more = False
                    else:
                        pending += taken
                batch, pending = pending[: self.max_batch], pending[self.max_batch :]
                outcomes, changes, seconds = self._execute(batch)
                self.token.run_sync_soon(self._delivered, batch, outcomes, changes, seconds)
                batch = []
        except trio.RunFinishedError:
            log.warning("trio stopped before the writer channel was closed")
        except BaseException:
            log.exception("writer thread crashed")
            crashed = True
        finally:
            try:
                # Closing with a transaction open rolls it back: nothing of `batch` is kept.
                self.store.close()
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    self.token.run_sync_soon(self._stopped, batch + pending, crashed)

    def _check_transaction(self) -> None:
        # On some errors (SQLITE_FULL, IOERR, NOMEM) SQLite rolls back the whole
        # transaction. Running on would commit each later command on its own (autocommit)
        # while the batch is answered "not committed": stop the batch instead.
        if not self.store.in_transaction:
            raise sqlite3.OperationalError("SQLite rolled the transaction back")

    def _apply_one(self, command: Command, now: int) -> Any:
        """The command's result, or the error it ends with (its changes then undone by
        its savepoint)."""
        try:
            with self.store.command():
                return command.apply(self.store, now)
        except RelayError as exc:
            return exc
        except Exception as exc:
            log.exception("command %r failed", type(command).__name__)
            return InternalError(f"{type(exc).__name__}: {exc}")

    def _apply_merged(
        self, merge: Callable, run: list[Envelope], now: int, outcomes: list[Any]
    ) -> bool:
        """Run consecutive commands of one class in one call and one savepoint. False
        (and nothing changed) if any of them failed: the caller runs them one by one."""
        try:
            with self.store.command():
                merged = merge(self.store, now, [envelope.command for envelope in run])
        except Exception:
            self._check_transaction()
            return False
        outcomes.extend(merged)
        return True

    def _apply_fast(self, batch: list[Envelope], now: int) -> list[Any] | None:
        """The batch's outcomes, run without savepoints; None if a command failed in a way
        that may have left part of its change behind (the caller then starts over).

        Why: SAVEPOINT and RELEASE are statements, and each statement costs the thread a
        wait for the GIL. They are only needed when a command fails halfway, and a refusal
        never does: the store refuses before it writes (relay/store/sqlite.py). That is
        checked here, not assumed: a refusal after which the transaction has written rows
        or moved counters sends the batch to the careful path, as does any other error.
        """
        store = self.store
        outcomes: list[Any] = []
        for merge, run in _runs(batch):
            if merge is not None:
                mark = store.write_mark()
                try:
                    outcomes += merge(store, now, [envelope.command for envelope in run])
                    continue
                except (RelayError, ValueError):
                    # A refusal in the run (or a job twice in one run of acks): each of
                    # its commands on its own, for its own answer.
                    if store.write_mark() != mark:
                        return None
                except Exception:
                    log.warning("a merged run failed; the batch runs again", exc_info=True)
                    return None
            for envelope in run:
                mark = store.write_mark()
                try:
                    outcomes.append(envelope.command.apply(store, now))
                except RelayError as exc:
                    if store.write_mark() != mark:
                        return None
                    outcomes.append(exc)
                except Exception:
                    log.warning("a command failed; the batch runs again", exc_info=True)
                    return None
        return outcomes

    def _apply_careful(self, batch: list[Envelope], now: int) -> list[Any]:
        """The batch's outcomes, each command (or merged run) in its own savepoint, so that
        a failure undoes exactly that command's changes."""
        outcomes: list[Any] = []
        for merge, run in _runs(batch):
            if merge is not None and self._apply_merged(merge, run, now, outcomes):
                continue
            for envelope in run:
                outcomes.append(self._apply_one(envelope.command, now))
                self._check_transaction()
        return outcomes

    def _execute(self, batch: list[Envelope]) -> tuple[list[Any], Changes | None, float | None]:
        store = self.store
        started = time.perf_counter()
        now = self.clock()
        try:
            store.begin()
            outcomes = self._apply_fast(batch, now)
            if outcomes is None:
                # Start over, carefully: nothing of the first pass stands.
                store.rollback()
                store.begin()
                outcomes = self._apply_careful(batch, now)
            changes = store.commit()
        except Exception as exc:
            log.exception("transaction of %d commands failed; none is committed", len(batch))
            store.rollback()
            error = InternalError(f"not committed: {type(exc).__name__}: {exc}")
            return [error] * len(batch), None, None
        return outcomes, changes, time.perf_counter() - started


def _runs(batch: list[Envelope]) -> Iterator[tuple[Callable | None, list[Envelope]]]:
    """The batch in runs: consecutive commands of one class that has ``apply_many`` come
    as one run with that method; every other command comes alone, with None."""
    i = 0
    while i < len(batch):
        kind = type(batch[i].command)
        merge = getattr(kind, "apply_many", None)
        j = i + 1
        if merge is not None:
            while j < len(batch) and type(batch[j].command) is kind:
                j += 1
        yield (merge if j - i > 1 else None), batch[i:j]
        i = j


def _refuse(envelopes: list[Envelope]) -> None:
    for envelope in envelopes:
        envelope.sink.deliver([(envelope.tag, ShuttingDown("the store has stopped"))])


@asynccontextmanager
async def open_writer(
    store: SqliteStore,
    *,
    clock: Callable[[], int] = wall_clock_ms,
    capacity: int = DEFAULT_CAPACITY,
    max_batch: int = DEFAULT_MAX_BATCH,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> AsyncIterator[Writer]:
    """Start the writer thread on ``store`` and yield its async facade.

    Ownership: the thread owns ``store`` from here on and closes it (checkpoint, close)
    when it stops; the feeder task lives in a nursery of this block. Leaving the block
    closes the command channel: the thread finishes what is queued, commits, and stops;
    the exit waits for that for at most ``shutdown_timeout`` seconds, shielded from
    cancellation. If the disk is so stuck that the deadline passes, the exit logs it and
    returns; the daemon thread then ends with the process, and SQLite's journal keeps the
    file consistent.
    """
    send, receive = trio.open_memory_channel[Envelope](capacity)
    writer = Writer(send)
    thread_side = _WriterThread(store, writer, receive, clock, max_batch)
    thread = threading.Thread(target=thread_side.run, name="relay-writer", daemon=True)
    thread.start()
    async with open_service_nursery() as nursery:
        nursery.start_soon(thread_side.feed)
        try:
            yield writer
        finally:
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + shutdown_timeout
                await send.aclose()
                await thread_side.finished.wait()
            if scope.cancelled_caught:
                log.error("writer thread did not stop within %.1f s", shutdown_timeout)
                thread_side.feed_scope.cancel()  # leave the thread behind (daemon)
