"""A session's stream below its lines: how its bytes are read, how it lingers and closes,
and what its TCP socket says (its state, a peek at the client's next bytes).

A plain TCP stream is read with ``os.read`` on its file descriptor (and its replies are
written the same way, relay/server/connections/outbox.py); a TLS stream, or the WebSocket adapter
(relay/server/connections/websocket.py), through the stream itself. The TCP socket is still found
under TLS, for its state and the peek; never for its bytes.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

import trio

# Bytes per receive: large enough for a pipelined burst of small requests in one call.
RECEIVE_BYTES = 64 * 1024
# Before closing a connection with unread input (after a too-large frame, a refused hello):
# how long, and how many bytes, to read and discard so that the last reply is not lost to
# a TCP reset (see linger).
LINGER_S = 1.0
LINGER_BYTES = 4 * 1024 * 1024
# TCP states (linux/tcp_states.h, the first byte of TCP_INFO) in which the peer has closed
# or reset its side.
TCP_CLOSE, TCP_CLOSE_WAIT = 7, 8
# Closing a connection gracefully (a TLS close_notify, a WebSocket's close frame) may take
# this long; then it is closed forcefully.
CLOSE_GRACE_S = 1.0


def _tcp_socket(stream: trio.abc.Stream) -> trio.socket.SocketType | None:
    """The TCP socket under ``stream``: its own (``trio.SocketStream``) or its transport's
    (``trio.SSLStream`` over one); None if there is none."""
    sock = getattr(getattr(stream, "transport_stream", stream), "socket", None)
    if sock is None or sock.type != socket.SOCK_STREAM:
        return None
    return sock


class StreamIO:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        # The TCP socket, also under TLS: for its state and a peek for EOF.
        self.socket = _tcp_socket(stream)
        # Its file descriptor, to read requests and write replies through, where the
        # stream is the socket's own (not TLS); else None: bytes go through the stream.
        self.fd = (
            self.socket.fileno()
            if self.socket is not None and getattr(stream, "socket", None) is self.socket
            else None
        )
        # The socket where its TCP state can be read (TCP on Linux: TCP_INFO; other systems
        # number their states differently), else None.
        self._tcp = (
            self.socket
            if self.socket is not None
            and self.socket.family in (socket.AF_INET, socket.AF_INET6)
            and sys.platform.startswith("linux")
            else None
        )
        self._full_read = False  # the last read filled its buffer: more is likely waiting

    async def receive(self) -> bytes:
        """The client's next bytes (b"" at EOF).

        After a short read (a client that waits for its replies) wait for the socket
        first, then read once; after a full read (a pipelining client) read at once. A
        stream's ``receive_some`` tries the read first every time, and for a one-at-a-time
        client that first try is a failing system call per request: one more release and
        retake of the GIL while the writer thread wants it."""
        fd = self.fd
        if fd is None:
            return await self.stream.receive_some(RECEIVE_BYTES)
        if self._full_read:
            await trio.lowlevel.checkpoint()
        else:
            await trio.lowlevel.wait_readable(fd)
        while True:
            try:
                data = os.read(fd, RECEIVE_BYTES)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(fd)
                continue
            except OSError as exc:
                raise trio.BrokenResourceError from exc
            self._full_read = len(data) == RECEIVE_BYTES
            return data

    def tcp_state(self) -> int | None:
        """The connection's TCP state, where the socket tells it, else None."""
        if self._tcp is None:
            return None
        try:
            return self._tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        except OSError:
            return None  # cannot tell: the reader finds out when it reads

    async def peek(self) -> bytes:
        """Wait until the client sends something, or leaves (b"": EOF or a reset), without
        taking it. (Under TLS the peek sees records, not requests.)"""
        assert self.socket is not None
        try:
            return await self.socket.recv(1, socket.MSG_PEEK)
        except OSError:  # reset by the peer
            return b""

    async def linger(self) -> None:
        """Half-close, then read and discard what the client is still sending, bounded in
        time and bytes: closing a socket with unread input makes the kernel reset the
        connection, which can destroy the last reply still on its way."""
        with trio.move_on_after(LINGER_S):
            try:
                # A TLS stream cannot half-close: it only reads and discards.
                if (send_eof := getattr(self.stream, "send_eof", None)) is not None:
                    await send_eof()
                discarded = 0
                while discarded < LINGER_BYTES:
                    data = await self.stream.receive_some(RECEIVE_BYTES)
                    if not data:
                        return
                    discarded += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    async def close(self) -> None:
        """Close, also when cancelled: gracefully within CLOSE_GRACE_S (a TLS
        close_notify, a WebSocket's close frame), else forcefully."""
        deadline = trio.current_time() + CLOSE_GRACE_S
        closed = contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError)
        with trio.CancelScope(shield=True, deadline=deadline) as scope, closed:
            await self.stream.aclose()
        if scope.cancelled_caught:
            await trio.aclose_forcefully(self.stream)
