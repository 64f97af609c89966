"""The replies one connection owes its client: written through at once, the rest as the
socket drains.

Write-through: replies are written with a non-blocking ``write`` from the trio thread when
nothing is queued before them, so a request costs no task switch of its own; only what the
kernel does not take goes to the sender task (``run_sender``, one per connection), which
waits for the socket to drain. While the sender writes, later replies queue behind it, so
bytes never interleave. The owner (``relay.server.connections.session.Session``) decides when to
flush (it holds the replies of a slice of one read, and of one delivery, to write them
together) and is told when room is made or the connection breaks.

The writer thread may write a commit's replies itself (``write_now``), but only while the
outbox is idle: nothing queued, nothing being sent. ``lock`` makes that check and the
write one step against the trio thread's own queueing and writing, so that bytes never
interleave; every other method runs in the trio thread.

Every outbox of a server counts its unsent bytes in the server's ``ReplyBudget`` too (and
its session, the bytes it reserves): what all connections owe together, which stops the
reading of those that owe any once it is spent.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable

import trio

from relay.util.log import event

log = logging.getLogger("relay.session")

# The sender writes a backlog in pieces of this size; each one written counts as progress.
SEND_PIECE_BYTES = 64 * 1024
# A connection whose unwritten replies exceed this is closed: its client pipelines large
# replies faster than it reads them, beyond what the reservations foresaw (as Redis's client
# output buffer limit). A reader drains a burst at the speed of the network long before.
MAX_UNSENT_BYTES = 64 * 1024 * 1024

# The reply bytes all the connections of a server may owe at once (reserved for large
# replies in flight, or not yet taken by their sockets) before those that owe any are no
# longer read: ``--max-reply-buffer-bytes``. Each connection also has its own limits
# (relay/server/connections/session.py, MAX_OWED_BYTES, and MAX_UNSENT_BYTES here).
DEFAULT_REPLY_BUFFER_BYTES = 256 * 1024 * 1024

# What ``write_now`` did: nothing (the trio thread queues the replies as usual), all of
# them, or part (the rest is queued, and the trio thread must flush it).
NOT_WRITTEN, WRITTEN, PART_WRITTEN = 0, 1, 2


class ReplyBudget:
    """The reply bytes that all the connections of a server owe together, against
    ``limit``: reserved for large replies in flight (a session's ``reserve``) or written
    and not yet taken by a socket (each outbox's ``unsent``). Once they reach ``limit``
    (``spent``), a connection that owes any is not read (``Session.full``), and its woken
    long-polls wait for room, until it owes none: the connections that hold the memory
    wait for their clients to read, and a client that reads its replies goes on. So what
    they owe together stays under ``limit`` plus, per connection, one reply (a request
    read while it owed nothing) and the small replies of the requests it had read before
    (docs/protocol.md, "Values and limits").

    Each counter is written by one thread only, and the two are read together (under the
    GIL, a sum that may lag one change): ``owed`` by the trio thread, ``owed_now`` by the
    writer thread (replies it wrote only in part, reservations it gave back).
    """

    __slots__ = ("limit", "owed", "owed_now")

    def __init__(self, limit: float = math.inf) -> None:
        self.limit = limit
        self.owed = 0
        self.owed_now = 0

    @property
    def total(self) -> int:
        return self.owed + self.owed_now

    def spent(self) -> bool:
        return self.owed + self.owed_now >= self.limit


class Outbox:
    def __init__(
        self,
        stream: trio.abc.Stream,
        fd: int | None,
        peer: str,
        on_room: Callable[[], None],
        on_broken: Callable[[BaseException], None],
        budget: ReplyBudget | None = None,
    ) -> None:
        self._stream = stream
        self._fd = fd  # None: every reply goes through the sender task
        self._peer = peer
        self._on_room = on_room  # everything queued is written: the owner's room grew
        self._on_broken = on_broken  # a write failed, or too much is left unread
        self.parts: list[bytes] = []  # reply bytes not yet written, in order
        self.count = 0  # replies (whole or partly) in parts
        self.unsent = 0  # bytes of replies not yet written (in parts or being sent)
        # The server's, where unsent bytes are counted too (None: a budget of its own).
        self.budget = budget if budget is not None else ReplyBudget()
        self.sending = 0  # replies taken by the sender, not yet written
        self.closed = False  # replies are dropped
        # For the owner's watchdog (trio clock): since when a write has been waiting for
        # the client to read (None: not waiting).
        self.send_waiting_since: float | None = None
        self._lot = trio.lowlevel.ParkingLot()  # the sender waits here for replies
        # Held while the queue is changed or written, by either thread (see write_now);
        # reentrant, as a failed write closes the outbox from inside a flush.
        self.lock = threading.RLock()

    def write_now(self, data: bytes) -> int:
        """Writer thread: write ``data`` (replies) if nothing is queued or being sent, and
        queue what the socket does not take; NOT_WRITTEN, WRITTEN or PART_WRITTEN. A
        failed write writes nothing: the trio thread's own write then meets the error."""
        with self.lock:
            if self.parts or self.sending or self.closed or self._fd is None:
                return NOT_WRITTEN
            try:
                written = os.write(self._fd, data)
            except OSError:  # BlockingIOError too: the socket takes nothing now
                return NOT_WRITTEN
            if written == len(data):
                return WRITTEN
            self.parts.append(data[written:])
            self.count += 1
            self.unsent += len(data) - written
            self.budget.owed_now += len(data) - written
            return PART_WRITTEN

    def add(self, data: bytes) -> None:
        """Queue one reply (written at the next ``flush``)."""
        if not self.closed:
            with self.lock:
                self.parts.append(data)
                self.count += 1
                self.unsent += len(data)
                self.budget.owed += len(data)

    def add_all(self, data: list[bytes]) -> None:
        """Queue these replies, in order (``add`` for each)."""
        if not self.closed:
            with self.lock:
                n = sum(map(len, data))
                self.parts += data
                self.count += len(data)
                self.unsent += n
                self.budget.owed += n

    def close(self) -> None:
        """Drop what is queued and every later reply."""
        with self.lock:
            self.closed = True
            self.parts.clear()
            self.count = 0
            self.budget.owed -= self.unsent  # (what is being sent too: never counted out)
            self.unsent = 0

    def flush(self) -> None:
        """Write what is queued, without waiting; what the socket does not take now is
        left to the sender task. Only while the sender is not itself writing: two writers
        would interleave bytes."""
        if not self.parts or self.closed:
            return
        with self.lock:
            self._flush()

    def _flush(self) -> None:
        if not self.parts or self.closed:
            return
        if not self.sending:
            if self._fd is not None:
                data = b"".join(self.parts) if len(self.parts) > 1 else self.parts[0]
                try:
                    written = os.write(self._fd, data)
                except BlockingIOError:
                    written = 0
                except OSError as exc:  # reset or closed by the peer
                    self._on_broken(exc)
                    return
                self.unsent -= written
                self.budget.owed -= written
                if written == len(data):
                    self.parts.clear()
                    self.count = 0
                    self._on_room()
                    return
                # The rest waits for the socket to drain: counted as one reply or more.
                self.parts[:] = [data[written:]]
            self._lot.unpark_all()
        if self.unsent > MAX_UNSENT_BYTES:
            # What the socket did not take passes the cap: the client pipelines large
            # replies faster than it reads them, beyond what the reservations foresaw.
            event(log, logging.WARNING, "connection.backlog_too_large", peer=self._peer,
                  unsent_bytes=self.unsent)  # fmt: skip
            self._on_broken(trio.TooSlowError("the client left too many reply bytes unread"))

    async def run_sender(self) -> None:
        """Write what the socket did not take at once, waiting for it to drain. Until
        cancelled (a task of the owner's nursery)."""
        try:
            while True:
                while not self.parts:
                    await self._lot.park()
                with self.lock:
                    data = memoryview(b"".join(self.parts))
                    self.sending = self.count
                    self.parts.clear()
                    self.count = 0
                # In pieces, so that the watchdog sees progress: a client that reads a
                # large backlog steadily is slow, not stalled.
                for start in range(0, len(data), SEND_PIECE_BYTES):
                    self.send_waiting_since = trio.current_time()
                    piece = data[start : start + SEND_PIECE_BYTES]
                    await self._stream.send_all(piece)
                    if not self.closed:  # (closing counted everything out)
                        self.unsent -= len(piece)
                        self.budget.owed -= len(piece)
                self.send_waiting_since = None
                with self.lock:
                    self.sending = 0
                self._on_room()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._on_broken(exc)
