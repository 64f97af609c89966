"""The WebSocket transport: the same sessions as TCP, one request and one reply per frame.

A WebSocket connection is served by the same ``Session`` as a TCP one (relay/server/
session.py): ``MessageStream`` shows the connection to it as the byte stream of NDJSON
lines it reads and writes. Each text message read becomes one line (a newline inside it,
JSON whitespace, is sent on as a carriage return, also whitespace, so a message stays one
request), and each reply line written goes out as one text message. Everything else, the
limits, backpressure, access control, long-polls and shutdown, is the session's.

What only a WebSocket has: a binary message is answered ``bad_request`` and the
connection closed with 1003 (unsupported data); a message over ``max_frame_bytes`` is
answered ``frame_too_large`` and closed with 1009 (message too big; one over twice that
many characters is closed with 1009 by trio-websocket as it arrives, unanswered, so that
memory stays bounded); a refused hello closes with 1008 (policy violation), shutdown with
1001 (going away), a connection over ``max_connections`` gets an HTTP 503 instead of the handshake.
"""

from __future__ import annotations

import contextlib
import logging

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, wrap_server_stream

from relay import wire
from relay.errors import BadRequest
from relay.log import event

log = logging.getLogger("relay.websocket")

# The opening handshake (HTTP upgrade) must be done within this, or the connection closes.
HANDSHAKE_TIMEOUT_S = 10.0

# Close codes (RFC 6455, section 7.4.1), by the reason the session gives (``closing``).
NORMAL, GOING_AWAY, POLICY, UNSUPPORTED, TOO_BIG = 1000, 1001, 1008, 1003, 1009
CLOSE_CODES = {
    "unauthorized": POLICY,
    "frame_too_large": TOO_BIG,
    "shutting_down": GOING_AWAY,
}


class MessageStream(trio.abc.HalfCloseableStream):
    """A WebSocket connection as a stream of NDJSON lines, for one ``Session``."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self._incoming = b""  # the rest of the current message's line
        self._outgoing = b""  # the start of a reply line not yet complete
        self._close_code = NORMAL
        self._last_words: bytes | None = None  # a reply to send just before closing

    def closing(self, reason: str) -> None:
        """The session says why it will close (the code the peer gets)."""
        self._close_code = CLOSE_CODES.get(reason, self._close_code)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._incoming:
            try:
                message = await self.ws.get_message()
            except ConnectionClosed:
                return b""
            if not isinstance(message, str):
                # The session sees EOF: it answers what it owes, then closes (aclose).
                error = BadRequest("binary frames are not accepted; send each request as text")
                self._last_words = wire.encode_error(None, error)
                self._close_code = UNSUPPORTED
                return b""
            self._incoming = message.encode().replace(b"\n", b"\r") + b"\n"
        if max_bytes is None or max_bytes >= len(self._incoming):
            data, self._incoming = self._incoming, b""
        else:
            data, self._incoming = self._incoming[:max_bytes], self._incoming[max_bytes:]
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send each complete line of what has been written as one text message."""
        data = self._outgoing + bytes(data)
        if b"\n" not in data:
            self._outgoing = data
            return
        *lines, self._outgoing = data.split(b"\n")
        for line in lines:
            await self._send(line)

    async def _send(self, line: bytes) -> None:
        try:
            await self.ws.send_message(line.decode())
        except ConnectionClosed as exc:
            raise trio.BrokenResourceError("the WebSocket is closed") from exc

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        """Close with the code the session gave (the peer may still send its close)."""
        await self.aclose()

    async def aclose(self) -> None:
        """The last words, if any, then the closing handshake. Its caller bounds it in
        time (the session's close, CLOSE_GRACE_S); the TCP stream under it is closed by
        its owner (``run_websocket`` in relay/server/serve.py) whatever happens here."""
        if self._last_words is not None:
            line, self._last_words = self._last_words, None
            with contextlib.suppress(trio.BrokenResourceError):
                await self._send(line.rstrip(b"\n"))
        await self.ws.aclose(self._close_code)


async def accept_websocket(
    stream: trio.abc.Stream,
    nursery: trio.Nursery,
    max_frame_bytes: int,
) -> MessageStream | None:
    """The opening handshake on an accepted connection, within HANDSHAKE_TIMEOUT_S; None
    if it failed (the caller closes the stream). The connection's reader task goes into
    ``nursery``, which must outlive the session."""
    with trio.move_on_after(HANDSHAKE_TIMEOUT_S):
        try:
            # Twice the frame limit in characters: a message up to that gets its
            # frame_too_large reply (relay counts bytes, trio-websocket characters).
            request = await wrap_server_stream(
                nursery, stream, message_queue_size=1, max_message_size=2 * max_frame_bytes
            )
            return MessageStream(await request.accept())
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            event(log, logging.DEBUG, "websocket.handshake_failed", error=repr(exc))
            return None
    event(log, logging.DEBUG, "websocket.handshake_timeout")
    return None


def overloaded_response(limit: int) -> bytes:
    """What a connection over ``limit`` gets instead of the opening handshake: an HTTP 503
    written at once, without reading its request (the listener writes it inline)."""
    body = f"too many connections (max {limit})\n".encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
        b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
