"""The capacity-limited accept loop for NDJSON over TCP.

Each accepted connection takes a token of a ``CapacityLimiter`` on its own behalf (the
listener acquires it, the session's task releases it), so ``max_connections`` bounds the
sessions alive at once. The contract asks that a connection over the cap be told so, so
the listener accepts it, writes one ``overloaded`` line and closes it, rather than
leaving it unaccepted in the kernel's backlog.

With TLS, the session's task does the handshake, within a deadline, after the connection
has taken its slot: so handshakes in progress count against ``max_connections``, and a
client that connects and stalls holds one slot, for the deadline, and never the accept
loop. A connection over the cap is closed without its line there, which would need a
handshake of its own (the cap exists to bound those); the client sees the connection
close during its handshake.

Until it has a role, a connection also holds a ticket of the pools of unauthenticated
connections (relay/server/connections/prehello.py): one over them is refused as one over the cap is,
or takes the place of a flooding address's oldest. Its deadline bounds the TLS handshake
too.

Out of file descriptors (EMFILE, ENFILE), ``accept`` fails until a connection closes.
``Accepting`` handles that for every listener: one summarised log line, a short back-off
(the kernel reports it without waiting for a client, so the loop would otherwise spin),
and a descriptor kept in reserve (``Spare``) to accept one waiting client and send it its
``overloaded`` line, rather than leaving it to time out in the backlog.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import ssl
from collections.abc import Awaitable, Callable

import trio

from relay.protocol import wire
from relay.protocol.errors import Overloaded
from relay.server.connections import tls
from relay.server.connections.prehello import PreHello, Ticket, source_of
from relay.util.log import Summary, event

log = logging.getLogger("relay.listener")

# A refused peer gets this long to take its one line; it is written inline by the accept
# loop, and a fresh socket's send buffer takes ~60 bytes at once, so this rarely waits.
REFUSE_TIMEOUT_S = 1.0


def peer_name(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


# After accept() fails (out of descriptors, or another error), the loop waits this long
# before it tries again.
ACCEPT_BACKOFF_S = 0.1
# accept() failing with these means no descriptor (or no memory) for the new connection.
OUT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
OUT_OF_FILES_MESSAGE = "too many connections (the server is out of file descriptors)"


def _overloaded_line(message: str) -> bytes:
    return wire.encode_error(None, Overloaded(message))


class Spare:
    """One file descriptor held in reserve, shared by the listeners of one server: freed to
    accept and refuse one client when there is none other, then taken again."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self.take()

    def take(self) -> None:
        """Hold a descriptor again, if there is one to be had (else try next time)."""
        if self._fd is None:
            with contextlib.suppress(OSError):
                self._fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def free(self) -> bool:
        """Give the descriptor back to the process; False if none was held."""
        if self._fd is None:
            return False
        os.close(self._fd)
        self._fd = None
        return True

    def close(self) -> None:
        self.free()


class Accepting(trio.abc.Listener[trio.SocketStream]):
    """A listening socket whose ``accept`` does not fail: see the module's docstring.
    ``tell`` tells the client taken with the spare descriptor that it is refused (None: it
    is only closed)."""

    def __init__(
        self,
        listener: trio.SocketListener,
        name: str,
        spare: Spare | None,
        tell: Callable[[trio.SocketStream], Awaitable[None]] | None = None,
    ) -> None:
        self.listener = listener
        self.socket = listener.socket
        self.name = name
        self._spare = spare
        self._tell = tell
        self.failed = 0
        self._failures = Summary()  # out of descriptors, a flood fails every accept

    async def accept(self) -> trio.SocketStream:
        while True:
            try:
                stream = await self.listener.accept()
            except OSError as exc:
                self._failed(exc)
                if exc.errno in OUT_OF_FILES:
                    await self._refuse_one()
                else:
                    await trio.sleep(ACCEPT_BACKOFF_S)
                continue
            if self._spare is not None:
                self._spare.take()  # if it was lost, descriptors may be free again
            return stream

    def _failed(self, exc: OSError) -> None:
        self.failed += 1
        if n := self._failures.count(trio.current_time()):
            hint = "raise the open-files limit (ulimit -n) or lower --max-connections"
            event(log, logging.WARNING, "listener.accept_failed", listener=self.name,
                  error=os.strerror(exc.errno) if exc.errno else repr(exc), failed=n,
                  **({"hint": hint} if exc.errno in OUT_OF_FILES else {}))  # fmt: skip

    async def _refuse_one(self) -> None:
        """Out of descriptors: wait (at most the back-off) for a client to come, take it
        with the spare descriptor, refuse it, and hold the spare again."""
        with trio.move_on_after(ACCEPT_BACKOFF_S) as waited:
            await trio.lowlevel.wait_readable(self.socket)
        if waited.cancelled_caught:
            return  # nobody came: try again (descriptors may have been freed meanwhile)
        if self._spare is None or not self._spare.free():
            await trio.sleep(ACCEPT_BACKOFF_S)  # another listener's, for now
            return
        stream = None
        with trio.move_on_after(ACCEPT_BACKOFF_S), contextlib.suppress(OSError):
            stream = await self.listener.accept()  # one waits: it takes the freed one
        if stream is None:
            self._spare.take()
            await trio.sleep(ACCEPT_BACKOFF_S)
            return
        if self._tell is not None:
            await self._tell(stream)
        # Its descriptor is held again before any other task runs (another listener's
        # accept would take it).
        stream.socket.close()
        self._spare.take()
        await trio.aclose_forcefully(stream)

    async def aclose(self) -> None:
        await self.listener.aclose()


class Listener:
    """Accepts connections until ``stop_accepting``; owns every session task it starts.

    ``handle(stream, peer, ticket)`` serves one connection; ``ticket`` is its place among
    the unauthenticated (relay/server/connections/prehello.py), which it gives back once it has a
    role."""

    def __init__(
        self,
        listeners: list[trio.SocketListener],
        handle: Callable[[trio.abc.Stream, str, Ticket], Awaitable[None]],
        max_connections: int,
        prehello: PreHello,
        *,
        name: str = "jobs",
        limiter: trio.CapacityLimiter | None = None,
        refusal: Callable[[str], bytes] | None = None,
        tls_context: ssl.SSLContext | None = None,
        handshake_timeout: float = tls.HANDSHAKE_TIMEOUT_MS / 1000,
        spare: Spare | None = None,
    ) -> None:
        self._listeners = [
            Accepting(each, name, spare, self._tell_out_of_files) for each in listeners
        ]
        self._handle = handle
        # Shared by the listeners of one server (TCP, WebSocket): one cap for all, and one
        # pool of unauthenticated connections.
        self.limiter = limiter or trio.CapacityLimiter(max_connections)
        self.prehello = prehello
        self._refusal = refusal or _overloaded_line  # what a refused connection gets
        self._accepting = trio.CancelScope()
        self.refused = 0
        self._refusals: dict[str, Summary] = {}  # by reason; logged in summary: floods
        self._tls_context = tls_context  # None: plain TCP
        self._handshake_timeout = handshake_timeout
        self.handshakes_failed = 0
        self._handshake_failures = Summary()  # a scanner or a misconfigured pool floods too

    @property
    def connections(self) -> int:
        return self.limiter.borrowed_tokens

    def stop_accepting(self) -> None:
        """Close the listening sockets; sessions already open go on."""
        self._accepting.cancel()

    def use_tls(self, context: ssl.SSLContext) -> None:
        """Connections accepted from now on shake hands with ``context`` (a reloaded
        certificate and key: relay/server/reload.py); those open keep theirs. Only a
        listener that has TLS may change its context."""
        assert self._tls_context is not None, "TLS is configured at start"
        self._tls_context = context

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        """Run until cancelled. Cancellation ends every session (the nursery owns them)."""
        async with trio.open_nursery() as sessions:
            try:
                with self._accepting:
                    async with trio.open_nursery() as accepting:
                        for listener in self._listeners:
                            accepting.start_soon(self._accept_loop, listener, sessions)
                        task_status.started()
            finally:
                # Also when the whole server is cancelled at once: Cancelled then goes
                # past the accepting scope, and only a finally still runs here.
                for listener in self._listeners:
                    await trio.aclose_forcefully(listener)

    async def _accept_loop(self, listener: Accepting, sessions: trio.Nursery) -> None:
        while True:
            stream = await listener.accept()
            owner = object()
            try:
                self.limiter.acquire_on_behalf_of_nowait(owner)
            except trio.WouldBlock:
                limit = int(self.limiter.total_tokens)
                await self._refuse(stream, "max_connections", f"too many connections (max {limit})")
                continue
            ticket = self.prehello.admit(source_of(_peer_address(stream)))
            if not isinstance(ticket, Ticket):
                self.limiter.release_on_behalf_of(owner)
                await self._refuse(stream, *ticket)
                continue
            sessions.start_soon(self._run_session, stream, owner, ticket)

    async def _tell_out_of_files(self, stream: trio.SocketStream) -> None:
        await self._tell(stream, "open_files", OUT_OF_FILES_MESSAGE)

    async def _refuse(self, stream: trio.SocketStream, reason: str, message: str) -> None:
        await self._tell(stream, reason, message)
        await trio.aclose_forcefully(stream)

    async def _tell(self, stream: trio.SocketStream, reason: str, message: str) -> None:
        """Tell a connection it is refused (``message``, the overloaded line's; under TLS
        nothing) before it is closed; logged in summary, per ``reason`` (the limit it is
        over)."""
        self.refused += 1
        refusals = self._refusals.setdefault(reason, Summary())
        if n := refusals.count(trio.current_time()):
            event(log, logging.WARNING, "connection.refused", peer=peer_name(stream),
                  reason=reason, refused=n)  # fmt: skip
        if self._tls_context is not None:
            return  # no line without a handshake: see above
        with trio.move_on_after(REFUSE_TIMEOUT_S), contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(self._refusal(message))

    async def _run_session(self, stream: trio.SocketStream, owner: object, ticket: Ticket) -> None:
        peer = peer_name(stream)
        event(log, logging.DEBUG, "connection.open", peer=peer)
        try:
            with ticket.scope:  # cancelled if another connection takes its place
                if self._tls_context is None:
                    await self._handle(stream, peer, ticket)
                elif (secured := await self._handshake(stream, peer, ticket)) is not None:
                    await self._handle(secured, peer, ticket)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            event(log, logging.DEBUG, "connection.broken", peer=peer, error=repr(exc))
        except Exception:
            # One connection must never take the server down, whatever went wrong in it
            # (an ExceptionGroup from its nursery included). Cancellation still passes.
            log.exception("connection.crashed", extra={"fields": {"peer": peer}})
        finally:
            ticket.release()
            self.limiter.release_on_behalf_of(owner)
            event(log, logging.DEBUG, "connection.close", peer=peer)

    async def _handshake(
        self, stream: trio.SocketStream, peer: str, ticket: Ticket
    ) -> trio.abc.Stream | None:
        """The TLS stream over ``stream``, or None if the handshake failed or stalled (the
        connection is then closed, and logged in summary). It must end by the handshake
        deadline and by the ticket's (a TLS handshake is part of the time to a hello)."""
        assert self._tls_context is not None
        deadline = min(trio.current_time() + self._handshake_timeout, ticket.deadline)
        reason = f"no handshake within {self._handshake_timeout:g} s"
        if deadline == ticket.deadline:
            reason = "no handshake and hello within the hello timeout"
        with trio.move_on_at(deadline):
            try:
                return await tls.handshake(stream, self._tls_context)
            except tls.HandshakeFailed as exc:
                reason = str(exc)
        self.handshakes_failed += 1
        if n := self._handshake_failures.count(trio.current_time()):
            event(log, logging.INFO, "connection.tls_failed", peer=peer, reason=reason,
                  failed=n)  # fmt: skip
        return None


def _peer_address(stream: trio.SocketStream) -> object:
    try:
        return stream.socket.getpeername()
    except OSError:
        return None
