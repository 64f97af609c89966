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
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable

import trio

from relay import wire
from relay.errors import Overloaded
from relay.log import Summary, event
from relay.server import tls

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


def _overloaded_line(limit: int) -> bytes:
    return wire.encode_error(None, Overloaded(f"too many connections (max {limit})"))


class Listener:
    """Accepts connections until ``stop_accepting``; owns every session task it starts."""

    def __init__(
        self,
        listeners: list[trio.SocketListener],
        handle: Callable[[trio.abc.Stream, str], Awaitable[None]],
        max_connections: int,
        *,
        limiter: trio.CapacityLimiter | None = None,
        refusal: Callable[[int], bytes] | None = None,
        tls_context: ssl.SSLContext | None = None,
        handshake_timeout: float = tls.HANDSHAKE_TIMEOUT_MS / 1000,
    ) -> None:
        self._listeners = listeners
        self._handle = handle
        # Shared by the listeners of one server (TCP, WebSocket): one cap for all.
        self.limiter = limiter or trio.CapacityLimiter(max_connections)
        self._refusal = refusal or _overloaded_line  # what a connection over the cap gets
        self._accepting = trio.CancelScope()
        self.refused = 0
        self._refusals = Summary()  # logged in summary: they come in floods
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

    async def _accept_loop(self, listener: trio.SocketListener, sessions: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE and friends: back off instead of spinning
                event(log, logging.WARNING, "listener.accept_failed", error=str(exc))
                await trio.sleep(0.1)
                continue
            owner = object()
            try:
                self.limiter.acquire_on_behalf_of_nowait(owner)
            except trio.WouldBlock:
                await self._refuse(stream)
                continue
            sessions.start_soon(self._run_session, stream, owner)

    async def _refuse(self, stream: trio.SocketStream) -> None:
        self.refused += 1
        if n := self._refusals.count(trio.current_time()):
            event(log, logging.WARNING, "connection.refused", peer=peer_name(stream),
                  reason="max_connections", refused=n)  # fmt: skip
        if self._tls_context is not None:
            await trio.aclose_forcefully(stream)  # no line without a handshake: see above
            return
        with trio.move_on_after(REFUSE_TIMEOUT_S), contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(self._refusal(int(self.limiter.total_tokens)))
        await trio.aclose_forcefully(stream)

    async def _run_session(self, stream: trio.SocketStream, owner: object) -> None:
        peer = peer_name(stream)
        event(log, logging.DEBUG, "connection.open", peer=peer)
        try:
            if self._tls_context is None:
                await self._handle(stream, peer)
            elif (secured := await self._handshake(stream, peer)) is not None:
                await self._handle(secured, peer)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            event(log, logging.DEBUG, "connection.broken", peer=peer, error=repr(exc))
        except Exception:
            # One connection must never take the server down, whatever went wrong in it
            # (an ExceptionGroup from its nursery included). Cancellation still passes.
            log.exception("connection.crashed", extra={"fields": {"peer": peer}})
        finally:
            self.limiter.release_on_behalf_of(owner)
            event(log, logging.DEBUG, "connection.close", peer=peer)

    async def _handshake(self, stream: trio.SocketStream, peer: str) -> trio.abc.Stream | None:
        """The TLS stream over ``stream``, or None if the handshake failed or stalled (the
        connection is then closed, and logged in summary)."""
        assert self._tls_context is not None
        reason = f"no handshake within {self._handshake_timeout:g} s"
        with trio.move_on_after(self._handshake_timeout):
            try:
                return await tls.handshake(stream, self._tls_context)
            except tls.HandshakeFailed as exc:
                reason = str(exc)
        self.handshakes_failed += 1
        if n := self._handshake_failures.count(trio.current_time()):
            event(log, logging.INFO, "connection.tls_failed", peer=peer, reason=reason,
                  failed=n)  # fmt: skip
        return None
