"""Backpressure on a connection's reader: where it waits while the connection is full, and
who is woken when room is made.

A session stops reading while it owes ``max_in_flight`` replies, or MAX_OWED_BYTES of them
(relay/server/connections/session.py, ``Session.full``); TCP then pushes back on the client. Its own
parked long-polls may be what fills it, for up to ``max_wait_ms``, so meanwhile the reader
still watches for the client to stop sending (EOF) or to go (a reset), which it could not
see otherwise: the parked leases are then answered at once, and no job is leased to a
client that has gone. Room is made when the outbox has written everything queued
(``made``, its ``on_room``), or a long-poll parks and gives back its reservation. Trio
thread only.
"""

from __future__ import annotations

from typing import Protocol

import trio

from relay.server.connections.streamio import StreamIO
from relay.server.requests.longpoll import LongPolls, LongPollSink


class Full(LongPollSink, Protocol):
    """What the room reads of its session (relay/server/connections/session.py)."""

    def flush(self) -> None: ...  # write the replies held back
    def full(self) -> bool: ...  # whether the reader must wait
    def owed(self) -> int: ...  # requests not yet answered and written
    def stop_waiting(self) -> None: ...  # the client has gone: answer its parked leases


class Room:
    def __init__(self, session: Full, io: StreamIO, longpolls: LongPolls) -> None:
        self._session = session
        self._io = io
        self._longpolls = longpolls
        self._lot = trio.lowlevel.ParkingLot()  # the reader waits here for room
        self._sent_lot = trio.lowlevel.ParkingLot()  # a watch's pump waits here
        # The reader's watch for the client's next bytes while it waits for room: cancelled
        # when room is made (see wait).
        self._watch: trio.CancelScope | None = None
        # Waits under way (the reader's, a drain's, a watch pump's), counted before they
        # look: the writer thread, answering requests itself, then knows to wake them
        # (relay/server/connections/direct.py).
        self.waiting = 0

    async def wait(self, line_waiting: bool) -> None:
        """Wait until the connection is no longer full (``Session.full``), watching for
        the client to go while its own parked long-polls fill it. Requests sent meanwhile
        stay unread until there is room (backpressure), so the watch ends at the client's
        first byte, as it does when a line is waiting (``line_waiting``)."""
        session = self._session
        watch = not line_waiting and self._io.socket is not None
        session.flush()  # held replies count as owed: write them first
        self.waiting += 1
        try:
            while session.full():
                if watch and self._longpolls.parked_for(session):
                    watch = await self._watch_for_goodbye()
                else:
                    await self._lot.park()
        finally:
            self.waiting -= 1

    async def wait_answered(self) -> None:
        """Wait until nothing is owed: every request answered, and its reply written."""
        self.waiting += 1
        try:
            while self._session.owed():
                await self._lot.park()
        finally:
            self.waiting -= 1

    async def wait_sent(self) -> None:
        """Wait until the outbox next writes everything queued (a watch's pump)."""
        self.waiting += 1
        try:
            await self._sent_lot.park()
        finally:
            self.waiting -= 1

    async def _watch_for_goodbye(self) -> bool:
        """Wait for room or for the client's next bytes. On EOF or a reset, answer the
        parked long-polls. Returns whether to go on watching. (Under TLS the peek sees
        records, not requests: any, a close_notify too, ends the watch as a request would,
        and the TCP state in ``Session.can_wait`` still sees the FIN that follows.)"""
        with trio.CancelScope() as self._watch:
            try:
                more = await self._io.peek()
            finally:
                self._watch = None
            if not more:  # EOF or a reset; requests would wait for room, unread
                self._session.stop_waiting()
            return False
        return True  # room was made

    def made(self) -> None:
        """Room was made: the reader, if it waits for room, looks again, and so do the
        long-polls woken while there was none (LongPolls.run)."""
        if self._lot:
            self._lot.unpark_all()
        if self._sent_lot:
            self._sent_lot.unpark_all()
        if self._watch is not None:
            self._watch.cancel()
        longpolls = self._longpolls
        if longpolls.short_of_room(self._session):
            longpolls.room_made(self._session)
