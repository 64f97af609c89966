"""The one writer thread that owns SQLite, and the facade trio code hands work to.

Data flows one way::

    trio thread: put(item) --> SimpleQueue --> writer thread: BEGIN IMMEDIATE
                                                 the batch's items, grouped by op
                                               COMMIT; each reply made (encoded)
    sink.deliver(pairs) <-- trio thread <-- one run_sync_soon per batch

An *item* is a plain tuple ``(op, sink, tag, started, args)``: the op says how the writer
runs ``args`` on the store (``run``, or ``run_many`` for all the batch's items of that op
in one call) and how the outcome becomes a reply (``reply``, in this thread, after the
commit); ``sink.deliver`` gets ``(item, reply)`` pairs in the trio thread; ``tag`` and
``started`` are the sink's (a request id and when it arrived, say). A tuple, not an
object, because one is made per request and the two threads share one GIL: every
microsecond the trio thread spends on a request is one the writer waits for.

Group commit: the thread takes every item already queued (up to ``max_batch``), runs them
in one transaction, commits once, makes the replies, and posts them back to trio with one
``run_sync_soon``, never waiting on trio. (A batch of plain submits alone is one statement
that SQLite commits on its own, without BEGIN and COMMIT: ``Op.run_alone``.) So it starts
the next transaction as soon as it has committed one, while trio writes the replies of
the last. A success is delivered only
after its commit; if the commit fails, every item of the batch is answered with an error,
because none of it is durable.

The items of one batch were all sent before any of their replies, so they are concurrent
and any order of them is a valid one: the writer runs them grouped by op, in the order of
the ops' ``phase`` (leases first: a lease claims what was ready before its batch), and
each op's items in the order they arrived.

Typed commands (``relay.store.commands``: maintenance, admin, tests) travel the same way
through ``send`` and ``execute``, wrapped in an op that calls their ``apply``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import attrs
import trio

from relay.errors import InternalError, RelayError, ShuttingDown
from relay.histogram import Histogram, HistogramSnapshot
from relay.store.commands import Command
from relay.store.sqlite import Changes, SqliteStore

log = logging.getLogger("relay.writer")

# Items queued and not yet answered before senders wait (backpressure). Large enough to
# hold a few group commits' worth of pipelined requests from many connections.
DEFAULT_CAPACITY = 4096
# At most this many items share one transaction: bounds the latency an item can add to
# the others of its batch, and the size of one hand-off.
DEFAULT_MAX_BATCH = 512
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0

# Histogram bounds for batch sizes (items) and commit durations (seconds).
BATCH_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
COMMIT_SECONDS_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)

# (op, sink, tag, started, args): see the module docstring.
Item = tuple[Any, Any, Any, float, Any]


def wall_clock_ms() -> int:
    """Milliseconds since the Unix epoch: the server clock of the wire contract."""
    return time.time_ns() // 1_000_000


class Op(Protocol):
    """How the writer runs one kind of item. Ops are a few module constants, not made per
    request. ``run_many`` (or None) runs many items' args in one call with the store's
    all-or-nothing refusal rule: if any would be refused it raises (a ``RelayError``, or
    ValueError) having written nothing, and the writer then runs them one by one."""

    name: str
    phase: int  # the batch runs ops in this order (lower first)
    run_many: Callable[[SqliteStore, int, list[Any]], list[Any]] | None
    # For a batch of this op alone: run it as one statement that commits on its own (no
    # BEGIN, no COMMIT: two waits for the GIL fewer), or return None having written
    # nothing. May raise only before it writes.
    run_alone: Callable[[SqliteStore, int, list[Any]], list[Any] | None] | None

    def run(self, store: SqliteStore, now: int, args: Any) -> Any: ...
    def reply(self, item: Item, outcome: Any) -> Any: ...  # writer thread, after commit


class ReplySink(Protocol):
    """Where replies go. ``deliver`` runs in the trio thread, must not block, and gets the
    (item, reply) pairs of one batch for this sink, in the order they were sent."""

    def deliver(self, pairs: list[tuple[Item, Any]]) -> None: ...


class CommandOp:
    """The op of a typed command class: ``apply``, merged by ``apply_many`` if it has one;
    the reply is the outcome itself (a result, or the ``RelayError`` that refused it)."""

    name = "command"
    run_alone = None

    def __init__(self, kind: type) -> None:
        self.phase = getattr(kind, "PHASE", 1)
        self.run_many = getattr(kind, "apply_many", None)

    @staticmethod
    def run(store: SqliteStore, now: int, command: Command) -> Any:
        return command.apply(store, now)

    @staticmethod
    def reply(item: Item, outcome: Any) -> Any:
        return outcome


_COMMAND_OPS: dict[type, CommandOp] = {}


def command_op(command: Command) -> CommandOp:
    kind = type(command)
    op = _COMMAND_OPS.get(kind)
    if op is None:
        op = _COMMAND_OPS[kind] = CommandOp(kind)
    return op


@attrs.frozen
class WriterStatistics:
    queued: int  # items sent and not yet answered
    batches: int  # transactions committed
    commands: int  # items in committed transactions
    failed_commits: int  # transactions that could not commit (their items got errors)
    batch_sizes: HistogramSnapshot
    commit_seconds: HistogramSnapshot


class _Waiter:
    """A one-shot sink for ``Writer.execute``: one command, one awaiting task."""

    __slots__ = ("event", "outcome")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.outcome: Any = None

    def deliver(self, pairs: list[tuple[Item, Any]]) -> None:
        self.outcome = pairs[-1][1]
        self.event.set()


class Writer:
    """The trio side of the writer thread. Created by ``open_writer``; trio thread only."""

    def __init__(self, capacity: int) -> None:
        self.inbox: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self.capacity = capacity
        self.queued = 0  # items put and not yet answered (trio thread only)
        self.closed = False  # put refuses: stopping, stopped, or the thread is gone
        self._room = trio.lowlevel.ParkingLot()  # senders waiting for queued < capacity
        self._batch_sizes = Histogram(BATCH_SIZE_BOUNDS)
        self._commit_seconds = Histogram(COMMIT_SECONDS_BOUNDS)
        self._batches = 0
        self._commands = 0
        self._failed_commits = 0
        # Called in the trio thread after each commit's replies are delivered.
        self.commit_listeners: list[Callable[[Changes], None]] = []

    @property
    def full(self) -> bool:
        return self.queued >= self.capacity

    def put(self, item: Item) -> None:
        """Queue ``item`` now, whether or not the writer is ``full``: callers that may wait
        do so first (``wait_room``). Sync: never a checkpoint, so a burst of pipelined
        requests reaches the thread without a scheduling round trip each.

        Raises:
            ShuttingDown: the writer is stopping or stopped; nothing was queued.
        """
        if self.closed:
            raise ShuttingDown("the store is shutting down")
        self.queued += 1
        self.inbox.put(item)

    async def wait_room(self) -> None:
        """Wait until fewer than ``capacity`` items are queued (or the writer closed)."""
        while self.queued >= self.capacity and not self.closed:
            await self._room.park()

    async def send(self, command: Command, sink: ReplySink, tag: Any = None) -> None:
        """Queue a typed command, waiting for room first (backpressure); its outcome goes
        to ``sink.deliver`` as ``(item, outcome)`` with ``item[2]`` = ``tag``.

        Raises:
            ShuttingDown: the writer is stopping or stopped; the command was not queued.
        """
        await self.wait_room()
        self.put((command_op(command), sink, tag, 0.0, command))

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
            queued=self.queued,
            batches=self._batches,
            commands=self._commands,
            failed_commits=self._failed_commits,
            batch_sizes=self._batch_sizes.snapshot(),
            commit_seconds=self._commit_seconds.snapshot(),
        )

    def _answered(self, n: int, seconds: float | None) -> None:
        self.queued -= n
        if seconds is None:
            self._failed_commits += 1
        else:
            self._batches += 1
            self._commands += n
            self._batch_sizes.observe(n)
            self._commit_seconds.observe(seconds)
        if self._room and self.queued < self.capacity:
            self._room.unpark_all()

    def _close(self) -> None:
        self.closed = True
        self._room.unpark_all()


def deliver(pairs: list[tuple[Item, Any]]) -> None:
    """Hand each sink its pairs, in order; a failing sink does not stop the others."""
    by_sink: dict[int, tuple[ReplySink, list[tuple[Item, Any]]]] = {}
    for pair in pairs:
        sink = pair[0][1]
        entry = by_sink.get(id(sink))
        if entry is None:
            by_sink[id(sink)] = (sink, [pair])
        else:
            entry[1].append(pair)
    for sink, mine in by_sink.values():
        try:
            sink.deliver(mine)
        except Exception:
            log.exception("a reply sink failed; the other replies are delivered")


class _WriterThread:
    """Owns the store from start to close: ``run`` is the thread's body."""

    def __init__(
        self, store: SqliteStore, writer: Writer, clock: Callable[[], int], max_batch: int
    ) -> None:
        self.store = store
        self.writer = writer
        self.clock = clock
        self.max_batch = max_batch
        self.token = trio.lowlevel.current_trio_token()
        self.finished = trio.Event()

    # -- the trio side (called with run_sync_soon) -------------------------------------------

    def _delivered(self, pairs: list, changes: Changes | None, seconds: float | None) -> None:
        self.writer._answered(len(pairs), seconds)
        deliver(pairs)
        # Wake-ups after replies: a long-poll that a reply of this very batch parks is
        # registered by then, so a job made ready in the same batch still wakes it.
        if changes is not None:
            for listener in self.writer.commit_listeners:
                try:
                    listener(changes)
                except Exception:
                    log.exception("a commit listener failed")

    def _stopped(self, in_hand: list[Item], crashed: bool) -> None:
        writer = self.writer
        writer._close()
        # Also what was queued but never taken, if the thread died first.
        while True:
            try:
                item = writer.inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                in_hand.append(item)
        error: RelayError = InternalError("not committed: writer crashed")
        if not crashed:
            error = ShuttingDown("the store has stopped")
        writer.queued -= len(in_hand)
        deliver([(item, item[0].reply(item, error)) for item in in_hand])
        self.finished.set()

    # -- the writer thread -------------------------------------------------------------------

    def run(self) -> None:
        inbox = self.writer.inbox
        batch: list[Item] = []
        crashed = False
        more = True
        try:
            while more:
                item = inbox.get()  # blocks only when there is no work
                if item is None:
                    break
                batch = [item]
                # Everything else already waiting joins this transaction (group commit).
                while len(batch) < self.max_batch:
                    try:
                        item = inbox.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        more = False  # the stop marker: after this batch
                        break
                    batch.append(item)
                pairs, changes, seconds = self._execute(batch)
                self.token.run_sync_soon(self._delivered, pairs, changes, seconds)
                batch = []
        except trio.RunFinishedError:
            log.warning("trio stopped before the writer was closed")
        except BaseException:
            log.exception("writer thread crashed")
            crashed = True
        finally:
            try:
                # Closing with a transaction open rolls it back: nothing of `batch` is kept.
                self.store.close()
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    self.token.run_sync_soon(self._stopped, batch, crashed)

    def _execute(self, batch: list[Item]) -> tuple[list, Changes | None, float | None]:
        """Run ``batch`` in one transaction; the (item, reply) pairs, what changed, and how
        long it took (None: not committed)."""
        store = self.store
        started = time.perf_counter()
        now = self.clock()
        runs = _runs(batch)
        # (Never inside a transaction left open: its commit would be the one that counts.)
        if len(runs) == 1 and runs[0][0].run_alone is not None and not store.in_transaction:
            outcomes = self._apply_alone(batch, runs[0][0], now)
            if outcomes is not None:
                seconds = time.perf_counter() - started
                pairs = [(item, _reply(item, o)) for item, o in zip(batch, outcomes, strict=True)]
                return pairs, store.take_changes(), seconds
        try:
            store.begin()
            outcomes = self._apply_fast(batch, runs, now)
            if outcomes is None:
                # Start over, carefully: nothing of the first pass stands.
                store.rollback()
                store.begin()
                outcomes = self._apply_careful(batch, runs, now)
            changes = store.commit()
        except Exception as exc:
            log.exception("transaction of %d items failed; none is committed", len(batch))
            store.rollback()
            error = InternalError(f"not committed: {type(exc).__name__}: {exc}")
            return [(item, item[0].reply(item, error)) for item in batch], None, None
        seconds = time.perf_counter() - started
        pairs = [
            (item, _reply(item, outcome)) for item, outcome in zip(batch, outcomes, strict=True)
        ]
        return pairs, changes, seconds

    def _apply_alone(self, batch: list[Item], op: Op, now: int) -> list[Any] | None:
        """The outcomes of a batch that one statement committed on its own, or None (it
        wrote nothing: the batch takes the transaction's path, where each item gets its
        own answer). Whether it wrote is checked, not assumed: a batch that failed after
        its statement committed is never run again (its jobs would be made twice)."""
        mark = self.store.write_mark()
        try:
            return op.run_alone(self.store, now, [item[4] for item in batch])
        except Exception:
            if self.store.write_mark() != mark:
                log.exception("a batch failed after its statement committed")
                error = InternalError("committed, but no reply could be made; see the log")
                return [error] * len(batch)
            log.debug("a batch could not run alone; it runs in a transaction", exc_info=True)
            return None

    def _apply_fast(self, batch: list[Item], runs: list, now: int) -> list[Any] | None:
        """The batch's outcomes (by position), run without savepoints; None if an item
        failed in a way that may have left part of its change behind (the caller then
        starts over).

        Why: SAVEPOINT and RELEASE are statements, and each statement costs the thread a
        wait for the GIL. They are only needed when a command fails halfway, and a refusal
        never does: the store refuses before it writes (relay/store/sqlite.py). That is
        checked here, not assumed: a refusal after which the transaction has written rows
        or moved counters sends the batch to the careful path, as does any other error.
        """
        store = self.store
        outcomes: list[Any] = [None] * len(batch)
        for op, indexes in runs:
            if len(indexes) > 1:
                mark = store.write_mark()
                try:
                    merged = op.run_many(store, now, [batch[i][4] for i in indexes])
                except (RelayError, ValueError):
                    # A refusal in the run (or a job twice in one run of acks): each of
                    # its items on its own, for its own answer.
                    if store.write_mark() != mark:
                        return None
                except Exception:
                    log.warning("a merged run failed; the batch runs again", exc_info=True)
                    return None
                else:
                    for i, outcome in zip(indexes, merged, strict=True):
                        outcomes[i] = outcome
                    continue
            for i in indexes:
                mark = store.write_mark()
                try:
                    outcomes[i] = op.run(store, now, batch[i][4])
                except RelayError as exc:
                    if store.write_mark() != mark:
                        return None
                    outcomes[i] = exc
                except Exception:
                    log.warning("an item failed; the batch runs again", exc_info=True)
                    return None
        return outcomes

    def _apply_careful(self, batch: list[Item], runs: list, now: int) -> list[Any]:
        """The batch's outcomes, each item (or merged run) in its own savepoint, so that a
        failure undoes exactly that item's changes."""
        store = self.store
        outcomes: list[Any] = [None] * len(batch)
        for op, indexes in runs:
            if len(indexes) > 1:
                try:
                    with store.command():
                        merged = op.run_many(store, now, [batch[i][4] for i in indexes])
                except Exception:
                    self._check_transaction()
                else:
                    for i, outcome in zip(indexes, merged, strict=True):
                        outcomes[i] = outcome
                    continue
            for i in indexes:
                try:
                    with store.command():
                        outcomes[i] = op.run(store, now, batch[i][4])
                except RelayError as exc:
                    outcomes[i] = exc
                except Exception as exc:
                    log.exception("item %r failed", op.name)
                    outcomes[i] = InternalError(f"{type(exc).__name__}: {exc}")
                self._check_transaction()
        return outcomes

    def _check_transaction(self) -> None:
        # On some errors (SQLITE_FULL, IOERR, NOMEM) SQLite rolls back the whole
        # transaction. Running on would commit each later item on its own (autocommit)
        # while the batch is answered "not committed": stop the batch instead.
        if not self.store.in_transaction:
            raise sqlite3.OperationalError("SQLite rolled the transaction back")


def _runs(batch: list[Item]) -> list[tuple[Any, list[int]]]:
    """The batch as runs of positions: the items of an op that has ``run_many`` as one
    run, every other item alone; ops in ``phase`` order, each op's items as they came."""
    first = batch[0][0]
    if first.run_many is not None and all(item[0] is first for item in batch):
        return [(first, list(range(len(batch))))]  # the common batch: one kind of request
    by_op: dict[Any, list[int]] = {}
    for i, item in enumerate(batch):
        positions = by_op.get(item[0])
        if positions is None:
            by_op[item[0]] = [i]
        else:
            positions.append(i)
    runs: list[tuple[Any, list[int]]] = []
    for op in sorted(by_op, key=_phase):
        positions = by_op[op]
        if op.run_many is not None:
            runs.append((op, positions))
        else:
            runs += [(op, [i]) for i in positions]
    return runs


def _phase(op: Op) -> int:
    return op.phase


def _reply(item: Item, outcome: Any) -> Any:
    try:
        return item[0].reply(item, outcome)
    except Exception:
        log.exception("making the reply of %r failed", item[0].name)
        return item[0].reply(item, InternalError("internal error; the server logged it"))


@asynccontextmanager
async def open_writer(
    store: SqliteStore,
    *,
    clock: Callable[[], int] = wall_clock_ms,
    capacity: int = DEFAULT_CAPACITY,
    max_batch: int = DEFAULT_MAX_BATCH,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> AsyncIterator[Writer]:
    """Start the writer thread on ``store`` and yield its trio-side facade.

    Ownership: the thread owns ``store`` from here on and closes it (checkpoint, close)
    when it stops. Leaving the block refuses new items and queues a stop marker behind the
    ones already queued: the thread finishes them, commits, and stops; the exit waits for
    that for at most ``shutdown_timeout`` seconds, shielded from cancellation. If the disk
    is so stuck that the deadline passes, the exit logs it and returns; the daemon thread
    then ends with the process, and SQLite's journal keeps the file consistent.
    """
    writer = Writer(capacity)
    thread_side = _WriterThread(store, writer, clock, max_batch)
    thread = threading.Thread(target=thread_side.run, name="relay-writer", daemon=True)
    thread.start()
    try:
        yield writer
    finally:
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + shutdown_timeout
            if not writer.closed:
                writer._close()
                writer.inbox.put(None)
            await thread_side.finished.wait()
        if scope.cancelled_caught:
            log.error("writer thread did not stop within %.1f s", shutdown_timeout)
