"""A connection's watchdog: the task that closes a client that stops reading its replies,
and stops reading from one that idles.

A request costs it nothing: the watchdog compares two timestamps, the last read (which the
session's reader sets, ``last_read``) and the start of a pending send (the outbox's), and
sleeps until the earlier could expire. One per session (relay/server/connections/session.py), in the
session's nursery beside its reader and its sender.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from relay.protocol.framing import LineSplitter
from relay.server.connections.outbox import Outbox
from relay.util.log import event

log = logging.getLogger("relay.session")


class Watchdog:
    def __init__(
        self,
        idle_timeout: float,
        peer: str,
        outbox: Outbox,
        splitter: LineSplitter,
        busy: Callable[[], bool],
        stop_reading: Callable[[], None],
        broken: Callable[[BaseException], None],
    ) -> None:
        self.idle_timeout = idle_timeout
        self._peer = peer
        self._outbox = outbox
        self._splitter = splitter
        self._busy = busy  # something of the client's own is in flight or unsent, or it watches
        self._stop_reading = stop_reading
        self._broken = broken
        # Trio clock: when the client last sent bytes (set by the session's reader).
        self.last_read = trio.current_time()

    async def run(self) -> None:
        """Close a connection that has not taken any of its replies for ``idle_timeout``
        ("not reading"), and stop reading from one that idles: no bytes from the client for
        ``idle_timeout`` while nothing of its own is in flight or unsent, or with a line
        left half-sent. Waiting on its own long-poll, or watching, is not idleness. Until
        cancelled (a task of the session's nursery)."""
        idle = self.idle_timeout
        reading = True
        while True:
            now = trio.current_time()
            waiting = self._outbox.send_waiting_since
            if waiting is not None and now - waiting >= idle:
                event(log, logging.INFO, "connection.not_reading", peer=self._peer)
                self._broken(trio.TooSlowError("the client did not read its replies"))
                return
            if reading and now - self.last_read >= idle:
                if self._splitter.buffered or not self._busy():
                    event(log, logging.INFO, "connection.idle_timeout", peer=self._peer)
                    # The replies still owed are written (the session drains them, and
                    # this task still closes a client that does not take them).
                    self._stop_reading()
                    reading = False
                else:
                    self.last_read = now  # busy on its behalf: look again later
            wake = self.last_read + idle if reading else now + idle
            if waiting is not None:
                wake = min(wake, waiting + idle)
            await trio.sleep_until(wake)
