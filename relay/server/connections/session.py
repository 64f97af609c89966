"""One client connection: bounded reads, dispatch, and replies written as they come.

A session is three tasks in its own nursery, whatever its traffic: the reader (this task)
splits frames and hands each to the dispatcher; the sender (``Outbox.run_sender``) writes
the replies that the socket could not take at once; the watchdog (relay/server/
watchdog.py) closes the connection when it idles or stops reading its replies. The
replies of one group commit go out together: written by the writer thread itself while
nothing else is queued (``deliver_now``, relay/server/connections/direct.py), else from its hand-off
through ``deliver`` (sync).

Write-through (relay/server/connections/outbox.py): a reply is written to the socket at once when
nothing is queued before it. The replies of one ``deliver`` (one commit) are written with
one call, and so are the replies given at once (ping, errors) to a slice of one read's
lines: the reader yields every ``SLICE_LINES`` lines, so one client's pipelined burst
cannot hold the others. So a request costs no task switch and no timeout scope of its own:
the watchdog checks two timestamps, the last read and the start of a pending send.

Read-through (``StreamIO.receive``): after a short read the reader waits for the socket
before it reads again, after a full one it reads at once: one read per request, no failing one.

Backpressure: at most ``max_in_flight`` requests (and MAX_OWED_BYTES of their replies) may
be unanswered or answered-but-unsent; at that point the reader stops reading, and TCP pushes
back on the client (room.py beside this module: where the reader waits, and who wakes it). So it
does while it owes any reply bytes once all sessions together owe the server's reply budget
(relay/server/connections/outbox.py, ``ReplyBudget``).
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from relay.protocol import wire
from relay.protocol.errors import FrameTooLarge
from relay.protocol.framing import LineSplitter
from relay.server.connections.direct import DirectReplies
from relay.server.connections.outbox import Outbox, ReplyBudget
from relay.server.connections.prehello import HELLO_TIMEOUT_MS, Ticket
from relay.server.connections.room import Room
from relay.server.connections.streamio import TCP_CLOSE, TCP_CLOSE_WAIT, StreamIO
from relay.server.connections.watchdog import Watchdog
from relay.server.requests.auth import Role
from relay.server.requests.dispatch import Dispatcher
from relay.store.items import Item
from relay.util.log import event

log = logging.getLogger("relay.session")

# After the client stops sending (EOF, or a fatal frame), replies still owed are written
# for at most this long beyond the longest long-poll.
DRAIN_GRACE_S = 5.0
# The reader yields to other tasks, and writes the replies it gave at once, after this
# many lines of one read: a ping costs ~10 us, so a slice stays well under a millisecond.
SLICE_LINES = 64
# The reader stops reading while the replies it owes may take this many bytes: reserved by
# large requests in flight (inspect, dead_list, lease: their most, see dispatch.py), or
# written but not yet sent. max_in_flight alone counts requests, and 256 inspects of big
# jobs would hold ~500 MiB.
MAX_OWED_BYTES = 32 * 1024 * 1024
# With tokens configured, a connection that has not said hello with a valid token within
# this of its accept is closed (the server's hello_timeout_ms, and the deadline of its
# ticket, prehello.py): an unauthenticated client holds a slot for no longer.
HELLO_TIMEOUT_S = HELLO_TIMEOUT_MS / 1000


class Session(DirectReplies):
    def __init__(
        self,
        stream: trio.abc.Stream,
        dispatcher: Dispatcher,
        *,
        idle_timeout: float,
        peer: str = "?",
        reply_budget: ReplyBudget | None = None,
        prehello: Ticket | None = None,
    ) -> None:
        self.stream = stream
        self.dispatcher = dispatcher
        self.limits = dispatcher.limits
        self.idle_timeout = idle_timeout
        self.peer = peer
        # When it was accepted and last read (trio time): workers_list shows them.
        self.opened_at = self.last_request = trio.current_time()
        dispatcher.access.set_role(self, dispatcher.access.first_role)  # self.role, self.ops
        # A failed authentication's answer and its delay: the last thing sent (refuse).
        self._refusal: tuple[bytes, float] | None = None
        # Its place among the unauthenticated connections, given back once it has a role.
        self._prehello = prehello
        # Before its hello, only a hello-sized line is read (wire.MAX_HELLO_BYTES): an
        # unauthenticated client holds no more than that.
        most = self.limits.max_frame_bytes
        self.splitter = LineSplitter(
            min(wire.MAX_HELLO_BYTES, most) if self.role is Role.NONE else most
        )
        self._max_in_flight = self.limits.max_in_flight
        self._in_flight = 0  # requests taken (see in_flight, relay/server/connections/direct.py)
        # While the client sends requests, a long-poll may wait for it. Once it has
        # stopped (EOF, shutdown), parked leases are answered at once and none is
        # claimed again: a job must not be leased to a client that has gone.
        self._can_wait = True
        self.nursery: trio.Nursery  # set by run(); the dispatcher's admin tasks live here
        self._io = StreamIO(stream)  # its bytes, its socket
        # Where the reader waits for room, and who is woken when room is made.
        self._room = Room(self, self._io, dispatcher.longpolls)
        # The replies owed (relay/server/connections/outbox.py): written through, or by its sender.
        self._outbox = Outbox(
            stream, self._io.fd, peer, self._room.made, self._broken, reply_budget
        )
        # What all the server's connections owe: once spent, this one is read only while
        # it owes nothing (``full``, ``reply_room``).
        self._budget = self._outbox.budget
        self._reserved = 0  # bytes set aside for large replies in flight (less _released_now)
        self._delivering = False  # True while deliver() collects one commit's replies
        # The reader, while it dispatches a read's lines: the replies it gives itself are
        # held until the slice ends; those of other tasks (a whole-queue dead_retry's, say)
        # are written at once, as the reader may be waiting meanwhile.
        self._holder: trio.lowlevel.Task | None = None
        self._reading = trio.CancelScope()
        self._watchdog = Watchdog(
            idle_timeout, peer, self._outbox, self.splitter, self._busy, self._reading.cancel,
            self._broken,
        )  # fmt: skip

    @property
    def closed(self) -> bool:
        """Its replies are dropped: it has failed, or is closing. (A plain attribute read,
        which the writer thread may also do, see ``still_wanted``.)"""
        return self._outbox.closed

    @property
    def can_wait(self) -> bool:
        """A long-poll may park, or be claimed again, for this client: not once it has
        stopped sending (EOF, shutdown) or gone. The reader may not have seen that yet: it
        waits for room without reading (``Room.wait``), or has not been scheduled
        since the client's FIN arrived, while another connection's commit wakes this
        client's long-poll. So the kernel's view decides too (one system call, asked only
        for a long-poll about to park or be claimed again): a FIN counts as EOF, and a
        reset closes the connection, so that no job is leased to a client that has gone."""
        if self.closed:
            return False
        if self._can_wait:
            state = self._io.tcp_state()
            if state == TCP_CLOSE:
                self._broken(ConnectionResetError("reset by the peer"))
            if state in (TCP_CLOSE, TCP_CLOSE_WAIT):
                self._can_wait = False
        return self._can_wait

    def still_wanted(self) -> bool:
        """Whether a woken long-poll's claim should still be made for this client, as
        the trio thread last saw it (``can_wait``). Asked by the writer thread just before
        the claim: plain attributes only."""
        return not self.closed and self._can_wait

    # -- called by the dispatcher and the writer's hand-off (sync, trio thread) --------------

    def begin_request(self) -> None:
        self._in_flight += 1

    def reserve(self, nbytes: int) -> None:
        self._reserved += nbytes
        self._budget.owed += nbytes

    def release(self, nbytes: int) -> None:
        self._reserved -= nbytes
        self._budget.owed -= nbytes

    def reply_room(self) -> int:
        owed = self._reserved - self._released_now + self._outbox.unsent
        if owed and self._budget.spent():
            return 0  # (the server's budget is spent: nothing more until it owes nothing)
        return MAX_OWED_BYTES - owed

    def reply(self, data: bytes) -> None:
        self._in_flight -= 1
        if self.closed:
            return
        self._outbox.add(data)
        holder = self._holder
        if not self._delivering and (holder is None or holder is not trio.lowlevel.current_task()):
            self.flush()

    def deliver(self, pairs: list[tuple[Item, Any]]) -> None:
        """The replies of one commit for this connection: written together, with one
        call."""
        dispatcher = self.dispatcher
        now = trio.current_time()
        lines: list[Item] = []  # answered with a line, holding nothing reserved
        data_of_lines: list[bytes] = []  # their replies, not yet queued
        self._delivering = True
        try:
            for item, reply in pairs:
                if type(reply) is bytes and not item[0].reserves:
                    # The common case, counted out and queued together (written out:
                    # this is reply() without its flush, per reply of every request).
                    lines.append(item)
                    data_of_lines.append(reply)
                    continue
                if data_of_lines:  # (the replies before this one go first)
                    self._outbox.add_all(data_of_lines)
                    data_of_lines = []
                data = dispatcher.finish(self, item, reply, now)
                if data is not None:
                    self.reply(data)
                else:
                    # A long-poll parked, and gave back its reservation: a reader waiting
                    # for room looks again (it may read, or watch for the client going).
                    self._room.made()
        finally:
            self._delivering = False
            if data_of_lines:
                self._outbox.add_all(data_of_lines)
            if lines:
                self._in_flight -= len(lines)
                dispatcher.answered_lines(lines, now)
        self.flush()

    # -- for a watch (relay/server/requests/watch.py): lines that answer no request ----

    def unsent_bytes(self) -> int:
        return self._outbox.unsent

    async def wait_sent(self) -> None:
        await self._room.wait_sent()

    def push(self, data: bytes) -> None:
        if not self.closed:
            self._outbox.add(data)
            self.flush()

    def refuse(self, data: bytes, delay: float) -> None:
        """Read and run nothing more; answer ``data`` after ``delay``, then close."""
        self._refusal = (data, delay)
        self._closing("unauthorized")
        self._reading.cancel()

    def revoke(self) -> None:
        """Its token was removed or given another role by a reload of the token file, and
        the grace is over (relay/server/reload.py): take no more requests, write the
        replies owed, then close (a WebSocket with the policy code)."""
        event(log, logging.INFO, "auth.revoked", peer=self.peer, role=self.role.label)
        self._closing("unauthorized")
        self._reading.cancel()

    def flush(self) -> None:
        self._outbox.flush()

    def _broken(self, exc: BaseException) -> None:
        event(log, logging.DEBUG, "connection.send_failed", peer=self.peer, error=repr(exc))
        self._outbox.close()
        self._can_wait = False
        self.nursery.cancel_scope.cancel()

    # -- tasks -------------------------------------------------------------------------------

    def stop_reading(self) -> None:
        """Take no more requests; write the replies still owed, then close (shutdown)."""
        self._closing("shutting_down")
        self._reading.cancel()

    def _closing(self, reason: str) -> None:
        """Tell a stream that can say why it closes (a WebSocket's close code) why."""
        closing = getattr(self.stream, "closing", None)
        if closing is not None:
            closing(reason)

    def owed(self) -> int:
        return self.in_flight + self._outbox.count + self._outbox.sending

    def stop_waiting(self) -> None:
        """The client has stopped sending (EOF, a reset, a fatal frame, shutdown): its
        parked long-polls are answered now, and none parks or is claimed again."""
        self._can_wait = False
        self.dispatcher.longpolls.drop(self)

    def full(self) -> bool:
        """No more requests are read for now: ``max_in_flight`` are owed, or the bytes of
        the replies owed (reserved by large requests in flight, or not yet written) reach
        MAX_OWED_BYTES, or it owes any while the server's reply budget is spent
        (outbox.py, ``ReplyBudget``). (Asked per request: written out rather than through
        owed and reply_room.)"""
        outbox = self._outbox
        owed = self._reserved - self._released_now + outbox.unsent
        budget = self._budget
        return (
            self._in_flight - self._answered_now + outbox.count + outbox.sending
            >= self._max_in_flight
            or owed >= MAX_OWED_BYTES
            or (owed > 0 and budget.owed + budget.owed_now >= budget.limit)
        )

    def _busy(self) -> bool:
        """For the watchdog: something of its own is in flight or unsent, or it watches."""
        return self.owed() != 0 or self in (self.dispatcher.watchers or ())

    async def run(self) -> None:
        """Serve the connection until the client leaves, idles out, or is cancelled.

        Owns the stream: closes it on the way out, also when cancelled.
        """
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self._outbox.run_sender)
                nursery.start_soon(self._watchdog.run)
                if self.role is Role.NONE:
                    nursery.start_soon(self._hello_deadline)
                elif self._prehello is not None:
                    self._prehello.release()  # a role from the start (no tokens)
                with self._reading:
                    await self._read_loop()
                self.stop_waiting()
                # The client sent its last request (or the server stops reading): write
                # what is owed, then close.
                with trio.move_on_after(self.limits.max_wait_ms / 1000 + DRAIN_GRACE_S):
                    await self._room.wait_answered()
                    if self._refusal is not None:
                        await self._send_refusal()
                    if self.splitter.overflow or self._refusal is not None:
                        await self._io.linger()
                nursery.cancel_scope.cancel()
        finally:
            if self._prehello is not None:
                self._prehello.release()
            self._outbox.close()
            self.stop_waiting()
            self.dispatcher.workers.forget(self)
            await self._io.close()

    async def _send_refusal(self) -> None:
        assert self._refusal is not None
        data, delay = self._refusal
        await trio.sleep(delay)
        self.begin_request()
        self.reply(data)
        await self._room.wait_answered()

    async def _hello_deadline(self) -> None:
        ticket = self._prehello
        if ticket is None:
            await trio.sleep(HELLO_TIMEOUT_S)
        else:
            await trio.sleep_until(ticket.deadline)
        if self.role is Role.NONE and self._refusal is None:
            if ticket is not None:
                ticket.timed_out(self.peer)  # logged in summary
            self._broken(trio.TooSlowError("no hello in time"))

    async def _read_loop(self) -> None:
        watchdog = self._watchdog
        while True:
            if self.full():
                await self._room.wait(line_waiting=False)
            try:
                data = await self._io.receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # reset by the peer: as good as EOF (and it reads nothing more)
            if not data:
                return
            watchdog.last_read = self.last_request = started = trio.current_time()
            if self.role is Role.NONE:
                data = await self._read_hello(data, started)
            await self._dispatch_all(self.splitter.feed(data), started)
            if self._refusal is not None:
                return
            if self.splitter.overflow:
                # Nothing after the oversized frame is read. The lines before it are
                # answered first (their commits may still be on the way; a parked
                # long-poll ends now), so that a client reading the error knows the rest.
                self.stop_waiting()
                with trio.move_on_after(DRAIN_GRACE_S):
                    await self._room.wait_answered()
                self._closing("frame_too_large")
                error = FrameTooLarge(self._too_large())
                self.begin_request()
                self.reply(wire.encode_error(None, error))
                event(log, logging.INFO, "connection.frame_too_large", peer=self.peer)
                return

    async def _read_hello(self, data: bytes, started: float) -> bytes:
        """Before a valid hello: dispatch ``data``'s lines one at a time under the
        hello-sized limit, until one gives the connection a role; then raise the limit to
        max_frame_bytes and return the rest, for the normal path (b"" once refused, or
        closing for a line over the limit)."""
        while self.role is Role.NONE:
            end = data.find(b"\n")
            if end < 0:
                return data  # no line yet: the splitter holds it, under the hello-sized limit
            await self._dispatch_all(self.splitter.feed(data[: end + 1]), started)
            data = data[end + 1 :]
            if self._refusal is not None or self.splitter.overflow:
                return b""
        if self._prehello is not None:
            self._prehello.release()
        self.splitter.max_frame_bytes = self.limits.max_frame_bytes
        return data

    def _too_large(self) -> str:
        limit = self.splitter.max_frame_bytes
        if limit < self.limits.max_frame_bytes:
            return f"frame longer than {limit} bytes before a hello (the first must be a hello)"
        return f"frame longer than {limit} bytes"

    async def _dispatch_all(self, lines: list[bytes], started: float) -> None:
        """Dispatch the complete lines of one read, which arrived at ``started``, in order.

        The replies the reader gives at once (ping, hello, errors) are held and written
        together: every ``SLICE_LINES`` lines, before waiting for room, and at the end.
        Every ``SLICE_LINES`` lines the reader also yields, so a client that pipelines
        thousands of cheap requests in one read does not keep the others waiting for all
        of them.
        """
        self._holder = trio.lowlevel.current_task()
        dispatch = self.dispatcher.dispatch
        writer = self.dispatcher.writer
        try:
            for n, line in enumerate(lines, 1):
                if self.full() or writer.full():
                    try:
                        await self._room.wait(line_waiting=True)
                        if writer.full():
                            self.flush()  # held replies count as owed: write them first
                            await writer.wait_room()
                    except trio.Cancelled:
                        # Stopped (shutdown) with these lines read: they are answered all
                        # the same, past max_in_flight or the writer's capacity by one
                        # read at most. (Not when the connection was closed for a fault:
                        # nobody would read their replies, and a lease would hold jobs
                        # for nobody.)
                        for rest in lines[n - 1 :]:
                            if self.closed or self._refusal is not None:
                                break
                            dispatch(self, rest, started)
                        raise
                dispatch(self, line, started)
                if self._refusal is not None:
                    return  # nothing after a failed authentication runs
                if n % SLICE_LINES == 0:
                    self.flush()
                    await trio.lowlevel.checkpoint()
        finally:
            self._holder = None
            self.flush()


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
