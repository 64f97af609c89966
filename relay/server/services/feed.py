"""Other servers' commits, as wake-ups: LISTEN on a connection and a thread of its own.

Each server using PostgreSQL runs one ``ChangeFeed`` (under the core's services nursery):
it listens on ``CHANNEL`` (psycopg blocks, so on a thread) and hands each other server's
notification (relay/store/postgres/notify.py) to trio as a ``Changes``: the same wake-ups
its own commits give the long-polls, the promoter and the reaper. Nothing polls.

When the listening connection is lost, notifications sent meanwhile are lost with it: the
feed connects again (waiting RETRY_S, doubling to RETRY_MAX_S) and, once it listens again,
wakes every parked long-poll and both time-driven loops once (``recheck``), which then
see the database as it is.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import psycopg
import trio

from relay.store.base import Changes
from relay.store.postgres.notify import CHANNEL, parse
from relay.store.postgres.schema import connection_info
from relay.util.log import event

log = logging.getLogger("relay.feed")

# How often the listening thread looks up from waiting, to see whether it must stop.
POLL_S = 0.25
# Waits between attempts to listen again after the connection was lost.
RETRY_S, RETRY_MAX_S = 0.1, 5.0


class ChangeFeed:
    """Delivers other servers' commits to ``deliver`` (a commit listener, run in trio),
    and calls ``recheck`` (in trio) whenever notifications may have been lost."""

    def __init__(
        self,
        url: str,
        origin: str,
        deliver: Callable[[Changes], None],
        recheck: Callable[[], None],
    ) -> None:
        self.url = url
        self.origin = origin
        self.deliver = deliver
        self.recheck = recheck
        self.reconnects = 0  # connections made again after one was lost

    def _connect(self) -> psycopg.Connection:
        conn = psycopg.connect(connection_info(self.url, "relay-trio listen"), autocommit=True)
        try:
            conn.execute(f"LISTEN {CHANNEL}")
        except BaseException:
            conn.close()
            raise
        return conn

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled. Started once the first LISTEN is in place."""
        conn = await trio.to_thread.run_sync(self._connect)
        stop = threading.Event()
        token = trio.lowlevel.current_trio_token()
        handed = threading.Event()  # the thread has the connection (and closes it)

        def listen() -> None:
            handed.set()
            self._listen(conn, token, stop)

        try:
            task_status.started()
            # Abandoned on cancellation: the thread sees ``stop`` within POLL_S, closes
            # its connection and ends; trio does not wait for it.
            await trio.to_thread.run_sync(listen, abandon_on_cancel=True)
        finally:
            stop.set()
            if not handed.is_set():  # cancelled before the thread began
                with contextlib.suppress(psycopg.Error):
                    conn.close()

    def _listen(self, conn: psycopg.Connection | None, token: trio.lowlevel.TrioToken,
                stop: threading.Event) -> None:  # fmt: skip
        """The thread's body: notifications to trio, and the connection kept up."""
        retry = RETRY_S
        try:
            while not stop.is_set():
                try:
                    if conn is None:
                        conn = self._connect()
                        self.reconnects += 1
                        event(log, logging.INFO, "listen.reconnected")
                        token.run_sync_soon(self.recheck)
                        retry = RETRY_S
                    for note in conn.notifies(timeout=POLL_S):
                        changes = parse(note.payload, self.origin)
                        if changes is True:
                            token.run_sync_soon(self.recheck)
                        elif changes is not None:
                            token.run_sync_soon(self.deliver, changes)
                except psycopg.Error as exc:
                    if conn is not None:
                        event(log, logging.WARNING, "listen.lost", error=str(exc).strip()[:200])
                        with contextlib.suppress(psycopg.Error):
                            conn.close()
                    conn = None
                    stop.wait(retry)
                    retry = min(retry * 2, RETRY_MAX_S)
        except trio.RunFinishedError:
            pass  # the server is gone
        finally:
            if conn is not None:
                with contextlib.suppress(psycopg.Error):
                    conn.close()
