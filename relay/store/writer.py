"""The one writer thread that owns SQLite, and the facade trio code hands work to.

Data flows one way::

    trio thread: put(item) --> SimpleQueue --> writer thread: BEGIN IMMEDIATE
                                                 the batch's items, grouped by op
                                               COMMIT; each reply made (encoded)
                                               replies written to idle connections
    sink.deliver(pairs) <-- trio thread <-- one run_sync_soon per batch, when needed

What an item is: relay/store/items.py. What the thread does with a batch (group commit,
the passes, a batch of plain submits as one statement, the replies it writes itself):
relay/store/thread.py. Here: the ``Writer`` that trio code puts items into and waits on,
and ``open_writer``, which owns the thread.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from relay.protocol.errors import InternalError, ShuttingDown
from relay.store.base import Changes, Store
from relay.store.commands import Command
from relay.store.failures import STORE_ERROR_KINDS
from relay.store.items import Item, ReplySink, command_op
from relay.store.thread import WriterThread
from relay.util.histogram import Histogram, HistogramSnapshot

log = logging.getLogger("relay.writer")

# Items queued and not yet answered before senders wait (backpressure). Large enough to
# hold a few group commits' worth of pipelined requests from many connections.
DEFAULT_CAPACITY = 4096
# At most this many items share one transaction: bounds the latency an item can add to
# the others of its batch, and the size of one hand-off.
DEFAULT_MAX_BATCH = 512
# At most this much of one batch is one connection's, in jobs its requests touch (a
# submit, an ack: 1; a submit_batch, an ack_batch: its items; a lease: its count), and at
# least one request: another connection waits for at most one heavy request of it.
DEFAULT_MAX_SHARE = 1000
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0

# Histogram bounds for batch sizes (items) and commit durations (seconds).
BATCH_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
COMMIT_SECONDS_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)


def wall_clock_ms() -> int:
    """Milliseconds since the Unix epoch: the server clock of the wire contract."""
    return time.time_ns() // 1_000_000


@attrs.frozen
class WriterStatistics:
    queued: int  # items sent and not yet answered
    batches: int  # transactions committed
    commands: int  # items in committed transactions
    failed_commits: int  # transactions that could not commit (their items got errors)
    store_errors: dict[str, int]  # of those, the disk's: "full", "ioerr" -> transactions
    batch_sizes: HistogramSnapshot
    commit_seconds: HistogramSnapshot


@attrs.frozen
class CommitListener:
    """A commit listener (``on_commit``, trio thread) that can say in the writer thread
    whether a commit concerns it (``wants``: plain reads of what the trio thread keeps,
    never a call into trio). A batch whose replies the thread wrote itself is handed to
    the trio thread only if some listener wants its changes (``Writer._wants_trio``)."""

    on_commit: Callable[[Changes], None]
    wants: Callable[[Changes], bool]

    def __call__(self, changes: Changes) -> None:
        self.on_commit(changes)


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
        # Items put (trio thread), less those answered through the trio thread; those the
        # writer thread answered itself are ``_done_now`` (writer thread): ``queued``.
        self._put = 0
        self._done_now = 0
        self.closed = False  # put refuses: stopping, stopped, or the thread is gone
        self._room = trio.lowlevel.ParkingLot()  # senders waiting for queued < capacity
        self._room_wanted = 0  # senders about to wait, or waiting (read by the thread)
        # Per batch, kept by the writer thread (read by statistics()).
        self._batch_sizes = Histogram(BATCH_SIZE_BOUNDS)
        self._commit_seconds = Histogram(COMMIT_SECONDS_BOUNDS)
        self._batches = 0
        self._commands = 0
        self._failed_commits = 0
        self._store_errors = dict.fromkeys(STORE_ERROR_KINDS, 0)
        # Called in the trio thread after each commit's replies are delivered. A listener
        # with a ``wants(changes)`` method (a ``CommitListener``) is asked first, in the
        # writer thread, whether this commit concerns it; one without always is.
        self.commit_listeners: list[Callable[[Changes], None]] = []
        # Hand-offs posted by the thread / run by the trio thread: while they differ, what
        # the trio side knows lags the commits, and every batch is handed over.
        self._handed = 0
        self._handed_done = 0
        # Whether the store records each job state change in the Changes given to the
        # listeners (``Changes.events``): set while someone watches. The thread reads it
        # at the start of each batch.
        self.recording = False
        # The lease recovery at start has yet to commit (the disk refused it so far): no
        # write commits until it has (relay/store/thread.py). Set by the thread; the
        # server is not ready meanwhile (its /healthz).
        self.recovering = False

    @property
    def queued(self) -> int:
        """Items put and not yet answered."""
        return self._put - self._done_now

    def full(self) -> bool:
        """``capacity`` items are queued: a sender waits (``wait_room``). (A method, not a
        property: the reader asks it per request, and a property's call costs more.)"""
        return self._put - self._done_now >= self.capacity

    def put(self, item: Item) -> None:
        """Queue ``item`` now, whether or not the writer is ``full``: callers that may wait
        do so first (``wait_room``). Sync: never a checkpoint, so a burst of pipelined
        requests reaches the thread without a scheduling round trip each.

        Raises:
            ShuttingDown: the writer is stopping or stopped; nothing was queued.
        """
        if self.closed:
            raise ShuttingDown("the store is shutting down")
        self._put += 1
        self.inbox.put(item)

    async def wait_room(self) -> None:
        """Wait until fewer than ``capacity`` items are queued (or the writer closed)."""
        # Said before looking, so that the writer thread, answering items itself, sees
        # that someone may wait (relay/store/thread.py) whenever this sees no room.
        self._room_wanted += 1
        try:
            while self._put - self._done_now >= self.capacity and not self.closed:
                await self._room.park()
        finally:
            self._room_wanted -= 1

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
        """The writer thread keeps these per batch, and they are read here field by field:
        a snapshot taken as a batch is recorded may count it in some fields and not yet in
        others (each field only grows; the next snapshot has it in all)."""
        return WriterStatistics(
            queued=self.queued,
            batches=self._batches,
            commands=self._commands,
            failed_commits=self._failed_commits,
            store_errors=dict(self._store_errors),
            batch_sizes=self._batch_sizes.snapshot(),
            commit_seconds=self._commit_seconds.snapshot(),
        )

    def _answered(self, n: int) -> None:
        """Trio thread: ``n`` items were answered through it; there may be room now (for
        those the thread answered itself too)."""
        self._put -= n
        if self._room and self._put - self._done_now < self.capacity:
            self._room.unpark_all()

    def _record(self, n: int, seconds: float | None, store_error: str | None) -> None:
        """Writer thread: a batch of ``n`` items committed in ``seconds``, or not (None),
        stopped by a store error of this kind (or another failure: None)."""
        if seconds is None:
            self._failed_commits += 1
            if store_error is not None:
                self._store_errors[store_error] += 1
        else:
            self._batches += 1
            self._commands += n
            self._batch_sizes.observe(n)
            self._commit_seconds.observe(seconds)

    def _wants_trio(self, changes: Changes | None) -> bool:
        """Writer thread: whether a batch whose replies all went out from the thread must
        still be handed to the trio thread: a sender waits for room, an earlier hand-off
        has not run yet, or a commit listener wants its changes. Plain reads only."""
        if self._room_wanted or self._handed != self._handed_done:
            return True
        if changes is None:
            return False
        for listener in self.commit_listeners:
            wants = getattr(listener, "wants", None)
            try:
                if wants is None or wants(changes):
                    return True
            except Exception:
                log.exception("a commit listener's wants() failed; it is told")
                return True
        return False

    def _close(self) -> None:
        self.closed = True
        self._room.unpark_all()


@asynccontextmanager
async def open_writer(
    store: Store,
    *,
    clock: Callable[[], int] = wall_clock_ms,
    capacity: int = DEFAULT_CAPACITY,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_share: int = DEFAULT_MAX_SHARE,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    recover: bool = False,
) -> AsyncIterator[Writer]:
    """Start the writer thread on ``store`` and yield its trio-side facade.

    ``recover``: the thread first gives back the leases of the store's previous process
    (``Store.leases_recover``, where ``recovers_on_start``), and nothing else commits
    before that has (relay/store/thread.py); yields once it has been tried, committed or
    refused by the disk (then it is tried again until it commits).

    Ownership: the thread owns ``store`` from here on and closes it (checkpoint, close)
    when it stops. Leaving the block refuses new items and queues a stop marker behind the
    ones already queued: the thread finishes them, commits, and stops; the exit waits for
    that for at most ``shutdown_timeout`` seconds, shielded from cancellation. If the disk
    is so stuck that the deadline passes, the exit logs it and returns; the daemon thread
    then ends with the process, and SQLite's journal keeps the file consistent.
    """
    # The writer thread and the trio thread share counters that each writes alone, and
    # each says what it does before it looks at what the other did: under the GIL those
    # steps happen one at a time, in an order both threads see (relay/server/connections/direct.py).
    # A free-threaded interpreter gives no such order.
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        raise RuntimeError("relay-trio needs the GIL: run it with PYTHON_GIL=1")
    writer = Writer(capacity)
    thread_side = WriterThread(store, writer, clock, max_batch, max_share, recover)
    thread = threading.Thread(target=thread_side.run, name="relay-writer", daemon=True)
    thread.start()
    try:
        await thread_side.first_recovery.wait()
        if thread_side.finished.is_set():
            raise InternalError("the writer thread stopped as it started; see the log")
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
