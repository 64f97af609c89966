"""One client connection: bounded reads, dispatch, and replies written in batches.

A session is two tasks in its own nursery, whatever its traffic: the reader (this task)
splits frames and hands each to the dispatcher; the sender writes every reply that has
accumulated in one ``send_all``. Replies arrive from the writer's hand-off through
``deliver`` (sync), so the replies of one group commit go out together.

Backpressure: at most ``max_in_flight`` requests may be unanswered or answered-but-unsent;
at that point the reader stops reading, and TCP pushes back on the client.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from relay import wire
from relay.errors import FrameTooLarge
from relay.log import event
from relay.server.dispatch import Dispatcher

log = logging.getLogger("relay.session")

# Bytes per receive: large enough for a pipelined burst of small requests in one call.
RECEIVE_BYTES = 64 * 1024
# After the client stops sending (EOF, or a fatal frame), replies still owed are written
# for at most this long beyond the longest long-poll.
DRAIN_GRACE_S = 5.0
# Before closing a connection over a too-large frame: how long, and how many bytes, to
# read and discard so that the error line is not lost to a TCP reset (see _linger).
LINGER_S = 1.0
LINGER_BYTES = 4 * 1024 * 1024


class Session:
    def __init__(
        self,
        stream: trio.abc.Stream,
        dispatcher: Dispatcher,
        *,
        idle_timeout: float,
        peer: str = "?",
    ) -> None:
        self.stream = stream
        self.dispatcher = dispatcher
        self.limits = dispatcher.limits
        self.idle_timeout = idle_timeout
        self.peer = peer
        self.splitter = wire.LineSplitter(self.limits.max_frame_bytes)
        self.in_flight = 0  # requests taken, not yet answered
        self.closed = False
        # While the client sends requests, a long-poll may wait for it. Once it has
        # stopped (EOF, shutdown), parked leases are answered at once and none is
        # claimed again: a job must not be leased to a client that has gone.
        self.can_wait = True
        self.nursery: trio.Nursery  # set by run(); the dispatcher's admin tasks live here
        self._out: list[bytes] = []
        self._sending = 0  # replies taken by the sender, not yet written
        self._out_lot = trio.lowlevel.ParkingLot()  # the sender waits here for replies
        self._room_lot = trio.lowlevel.ParkingLot()  # the reader waits here for room
        self._reading = trio.CancelScope()

    # -- called by the dispatcher and the writer's hand-off (sync, trio thread) --------------

    def begin_request(self) -> None:
        self.in_flight += 1

    def reply(self, data: bytes) -> None:
        self.in_flight -= 1
        if self.closed:
            return
        self._out.append(data)
        self._out_lot.unpark_all()

    def deliver(self, replies: list[tuple[Any, Any]]) -> None:
        finish = self.dispatcher.finish
        for tag, outcome in replies:
            data = finish(self, tag, outcome)
            if data is not None:
                self.reply(data)

    # -- tasks -------------------------------------------------------------------------------

    def stop_reading(self) -> None:
        """Take no more requests; write the replies still owed, then close (shutdown)."""
        self._reading.cancel()

    def _owed(self) -> int:
        return self.in_flight + len(self._out) + self._sending

    async def run(self) -> None:
        """Serve the connection until the client leaves, idles out, or is cancelled.

        Owns the stream: closes it on the way out, also when cancelled.
        """
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self._send_loop)
                with self._reading:
                    await self._read_loop()
                self.can_wait = False
                self.dispatcher.longpolls.drop(self)
                # The client sent its last request (or the server stops reading): write
                # what is owed, then close.
                with trio.move_on_after(self.limits.max_wait_ms / 1000 + DRAIN_GRACE_S):
                    while self._owed():
                        await self._room_lot.park()
                    if self.splitter.overflow:
                        await self._linger()
                nursery.cancel_scope.cancel()
        finally:
            self.closed = True
            self.can_wait = False
            self.dispatcher.longpolls.drop(self)
            await trio.aclose_forcefully(self.stream)

    async def _linger(self) -> None:
        # Closing a socket with unread input makes the kernel reset the connection, which
        # can destroy the frame_too_large line still on its way. So: half-close, then read
        # and discard what the client is still sending, bounded in time and bytes.
        with trio.move_on_after(LINGER_S):
            try:
                await self.stream.send_eof()  # type: ignore[attr-defined]
                discarded = 0
                while discarded < LINGER_BYTES:
                    data = await self.stream.receive_some(RECEIVE_BYTES)
                    if not data:
                        return
                    discarded += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    async def _read_loop(self) -> None:
        max_in_flight = self.limits.max_in_flight
        while True:
            while self._owed() >= max_in_flight:
                await self._room_lot.park()
            with trio.move_on_after(self.idle_timeout) as idle:
                try:
                    data = await self.stream.receive_some(RECEIVE_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # reset by the peer: as good as EOF (and it reads nothing more)
            if idle.cancelled_caught:
                # Waiting on our own long-poll is not idleness; a half-sent line is.
                if self.in_flight == 0 or self.splitter.buffered:
                    event(log, logging.INFO, "connection.idle_timeout", peer=self.peer)
                    return
                continue
            if not data:
                return
            for line in self.splitter.feed(data):
                while self._owed() >= max_in_flight:
                    await self._room_lot.park()
                await self.dispatcher.dispatch(self, line)
            if self.splitter.overflow:
                error = FrameTooLarge(f"frame longer than {self.limits.max_frame_bytes} bytes")
                self.begin_request()
                self.reply(wire.encode_error(None, error))
                event(log, logging.INFO, "connection.frame_too_large", peer=self.peer)
                return

    async def _send_loop(self) -> None:
        try:
            while True:
                while not self._out:
                    await self._out_lot.park()
                data = b"".join(self._out)
                self._sending = len(self._out)
                self._out.clear()
                # A client that does not read its replies is closed, not waited for.
                with trio.fail_after(self.idle_timeout):
                    await self.stream.send_all(data)
                self._sending = 0
                self._room_lot.unpark_all()
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError) as exc:
            event(log, logging.DEBUG, "connection.send_failed", peer=self.peer, error=repr(exc))
            self.closed = True
            self.nursery.cancel_scope.cancel()


class Sessions:
    """The open sessions of a server, so that shutdown can stop them together."""

    def __init__(self) -> None:
        self._open: set[Session] = set()
        self._none_open = trio.Event()
        self._none_open.set()

    def __len__(self) -> int:
        return len(self._open)

    async def run(self, session: Session) -> None:
        if not self._open:
            self._none_open = trio.Event()
        self._open.add(session)
        try:
            await session.run()
        finally:
            self._open.discard(session)
            if not self._open:
                self._none_open.set()

    def stop_reading(self) -> None:
        for session in self._open:
            session.stop_reading()

    async def wait_closed(self) -> None:
        await self._none_open.wait()
