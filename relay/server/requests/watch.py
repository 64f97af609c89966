"""Job events for watchers: every state change, after the commit that made it.

A connection that sends ``watch`` gets a ``Watcher``: its filters, and a bounded buffer of
event lines. The writer records events only while some connection watches
(``Writer.recording``); after each commit, ``Watchers.on_commit`` (a commit listener, in the
trio thread) offers each event to each watcher, never waiting: a watcher whose buffer is
full drops the event and counts it. The watcher's pump task (in its connection's nursery)
moves lines from the buffer into the connection's replies while the connection has taken
what it was given, so a watcher that reads slowly or not at all slows nobody, holds at
most ``max_watch_buffer`` events, and, where its stream has a gap, gets
``{"event":"lagged","dropped":N}`` before the next event after it.

The ``watch`` reply goes through the writer like a read (``ops.WATCH``), after recording
was turned on: so every commit from the one that carries the reply on is reported.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

import orjson
import trio

from relay.protocol.errors import Overloaded
from relay.store.base import Changes
from relay.store.writer import Writer

# Lines of events moved into the connection's replies at once, and the reply bytes it may
# have unsent before the pump waits for it to take them.
PUMP_LINES = 256
PUMP_UNSENT_BYTES = 256 * 1024

# (job_id, queue, state, attempt, at, from): what the store records per state change.
Event = tuple[str, str, str, int, int, str | None]


class WatchingConnection(Protocol):
    nursery: trio.Nursery

    def unsent_bytes(self) -> int: ...
    async def wait_sent(self) -> None: ...  # until some of its unsent bytes are sent
    def push(self, data: bytes) -> None: ...  # lines that answer no request


class Watcher:
    """One connection's watch: its filters, its buffer, and the gap at the buffer's end."""

    def __init__(
        self, queues: Iterable[str] | None, states: Iterable[str] | None, capacity: int
    ) -> None:
        self.queues = frozenset(queues) if queues is not None else None
        self.states = frozenset(states) if states is not None else None
        self.capacity = capacity
        # Event lines, and [n] entries: n events lost at that point of the stream.
        self.buffer: deque[bytes | list[int]] = deque()
        self.buffered = 0  # event lines in buffer (the gaps are not counted)
        self._gap: list[int] | None = None  # the gap at the buffer's end, if any
        self.waiting = trio.lowlevel.ParkingLot()  # the pump waits here for lines

    def wants(self, event: Event) -> bool:
        return (self.queues is None or event[1] in self.queues) and (
            self.states is None or event[2] in self.states
        )

    def offer(self, line: bytes) -> None:
        if self.buffered >= self.capacity:
            if self._gap is None:
                self._gap = [0]
                self.buffer.append(self._gap)
            self._gap[0] += 1
            return
        self._gap = None
        self.buffer.append(line)
        self.buffered += 1

    def take(self, most: int) -> bytes:
        """Up to ``most`` lines from the buffer's start, a gap as its ``lagged`` line."""
        lines = []
        while self.buffer and len(lines) < most:
            entry = self.buffer.popleft()
            if type(entry) is list:
                if entry is self._gap:
                    self._gap = None
                lines.append(b'{"event":"lagged","dropped":%d}\n' % entry[0])
            else:
                lines.append(entry)  # type: ignore[arg-type]
                self.buffered -= 1
        return b"".join(lines)


class Watchers:
    """Every watcher of a server; a commit listener of its writer."""

    def __init__(self, writer: Writer, max_watchers: int, capacity: int) -> None:
        self.writer = writer
        self.max_watchers = max_watchers
        self.capacity = capacity
        self._by_connection: dict[Any, tuple[Watcher, trio.CancelScope]] = {}

    def __len__(self) -> int:
        return len(self._by_connection)

    def __contains__(self, connection: object) -> bool:
        return connection in self._by_connection

    def buffered(self) -> int:
        """Events waiting in every watcher's buffer (at most watchers x capacity)."""
        return sum(entry[0].buffered for entry in self._by_connection.values())

    def watch(
        self,
        connection: WatchingConnection,
        queues: Iterable[str] | None,
        states: Iterable[str] | None,
    ) -> None:
        """Start (or, for a connection watching already, refilter) a watch. Raises
        Overloaded at ``max_watchers``."""
        entry = self._by_connection.get(connection)
        if entry is not None:  # new filters; the events waiting stay
            watcher = entry[0]
            watcher.queues = frozenset(queues) if queues is not None else None
            watcher.states = frozenset(states) if states is not None else None
            return
        if len(self._by_connection) >= self.max_watchers:
            raise Overloaded(f"too many watchers (max {self.max_watchers})")
        watcher = Watcher(queues, states, self.capacity)
        scope = trio.CancelScope()
        self._by_connection[connection] = (watcher, scope)
        self.writer.recording = True
        connection.nursery.start_soon(self._pump, connection, watcher, scope)

    def end(self, connection: WatchingConnection, reason: str) -> None:
        """End the connection's watch, if it has one, with an ``ended`` event saying why
        (the events still buffered are dropped: none is sent after it)."""
        if self.unwatch(connection):
            connection.push(b'{"event":"ended","reason":%s}\n' % orjson.dumps(reason))

    def unwatch(self, connection: WatchingConnection) -> bool:
        """End the connection's watch (also when it closes). False if it had none."""
        entry = self._by_connection.pop(connection, None)
        if entry is None:
            return False
        entry[1].cancel()
        self.writer.recording = bool(self._by_connection)
        return True

    def on_commit(self, changes: Changes) -> None:
        """Offer each event of a commit to each watcher that wants it (never waits)."""
        events = changes.events
        if not events or not self._by_connection:
            return
        watchers = [entry[0] for entry in self._by_connection.values()]
        for event in events:
            line = None
            for watcher in watchers:
                if watcher.wants(event):
                    if line is None:
                        line = _event_line(event)
                    watcher.offer(line)
        for watcher in watchers:
            if watcher.buffer:
                watcher.waiting.unpark_all()

    async def _pump(
        self, connection: WatchingConnection, watcher: Watcher, scope: trio.CancelScope
    ) -> None:
        try:
            with scope:
                while True:
                    while not watcher.buffer:
                        await watcher.waiting.park()
                    while connection.unsent_bytes() > PUMP_UNSENT_BYTES:
                        await connection.wait_sent()
                    connection.push(watcher.take(PUMP_LINES))
                    await trio.lowlevel.checkpoint()
        finally:
            # The connection went (its nursery was cancelled), or unwatch.
            if self._by_connection.get(connection, (None,))[0] is watcher:
                self.unwatch(connection)


def _event_line(event: Event) -> bytes:
    job_id, queue, state, attempt, at, src = event
    fields = {"event": "job", "job_id": job_id, "queue": queue, "state": state,
              "attempt": attempt, "at": at}  # fmt: skip
    if src is not None:  # left out for a job just made
        fields["from"] = src
    return orjson.dumps(fields, option=orjson.OPT_APPEND_NEWLINE)
