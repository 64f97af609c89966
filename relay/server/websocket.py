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

A browser's handshake carries the ``Origin`` of the page that opens it, and any page may
try, so a handshake from another site's page is refused with HTTP 403 (``Origins``):
without tokens, a page from anywhere would otherwise act as admin through the browser of
someone on the server's machine.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import urllib.parse
from collections.abc import Awaitable, Callable

import attrs
import trio
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    wrap_server_stream,
)

from relay import wire
from relay.errors import BadRequest
from relay.log import Summaries, event

log = logging.getLogger("relay.websocket")

# The opening handshake (HTTP upgrade) must be done within this, or the connection closes.
HANDSHAKE_TIMEOUT_S = 10.0
# Characters of a refused Origin that its log line shows (the rest is the client's text).
ORIGIN_LOGGED = 100

# Close codes (RFC 6455, section 7.4.1), by the reason the session gives (``closing``).
NORMAL, GOING_AWAY, POLICY, UNSUPPORTED, TOO_BIG = 1000, 1001, 1008, 1003, 1009
CLOSE_CODES = {
    "unauthorized": POLICY,
    "frame_too_large": TOO_BIG,
    "shutting_down": GOING_AWAY,
}


@attrs.define
class Origins:
    """Which pages may open a WebSocket: ``allowed`` (exact origins, ``--ws-origin``), and
    the dashboard's own page (the metrics listener's ``page_port``) reached by the address
    the WebSocket connection arrived on (or by ``localhost``, on loopback). A handshake
    without an Origin (not from a browser: a script, a worker) is not a page's and is let
    through."""

    allowed: frozenset[str] = frozenset()
    page_port: int | None = None  # set once the metrics listener is bound
    # Refused and failed handshakes of the listener, logged in summary: they come in floods
    # (a line per kind at most once a second, with how many).
    refusals: Summaries = attrs.field(factory=Summaries, eq=False)

    def permit(self, origin: str | None, local: str) -> bool:
        """Whether a handshake from ``origin`` that arrived on address ``local`` may go on."""
        if origin is None or origin in self.allowed:
            return True
        try:
            page = urllib.parse.urlsplit(origin)
            port = page.port or {"http": 80, "https": 443}.get(page.scheme)
            here = _address(local)
        except ValueError:
            return False
        if page.scheme not in ("http", "https") or page.hostname is None:
            return False
        if port != self.page_port or here is None:
            return False
        # Only an address (or localhost) is trusted: a name could be made to point here by
        # whoever owns it (DNS rebinding), and its page would then pass for the dashboard.
        if page.hostname == "localhost":
            return here.is_loopback
        return _address(page.hostname) == here


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An IP address (an IPv4-mapped IPv6 one as IPv4), or None for a name."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


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
    origins: Origins,
) -> MessageStream | None:
    """The opening handshake on an accepted connection, within HANDSHAKE_TIMEOUT_S; None
    if it failed or ``origins`` refused it (the caller closes the stream). The
    connection's reader task goes into ``nursery``, which must outlive the session."""
    reader = _Reader(nursery)
    with trio.move_on_after(HANDSHAKE_TIMEOUT_S):
        try:
            # Twice the frame limit in characters: a message up to that gets its
            # frame_too_large reply (relay counts bytes, trio-websocket characters).
            request = await _request(reader, stream, max_message_size=2 * max_frame_bytes)
            if request is None:
                _handshake_failed(origins, "closed or not a WebSocket handshake", None)
                return None
            origin = _header(request.headers, b"origin")
            if not origins.permit(origin, str(request.local.address)):
                if n := origins.refusals.count("origin", trio.current_time()):
                    event(log, logging.WARNING, "websocket.origin_refused",
                          origin=origin[:ORIGIN_LOGGED], refused=n)  # fmt: skip
                await request.reject(403, body=b"this page's origin may not connect\n")
                return None
            return MessageStream(await request.accept())
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            _handshake_failed(origins, "closed or not a WebSocket handshake", repr(exc)[:200])
            return None
    _handshake_failed(origins, f"not done within {HANDSHAKE_TIMEOUT_S:g} s", None)
    return None


class _Reader:
    """What trio-websocket starts a connection's reader task in (it only calls
    ``start_soon``): the task goes into ``nursery``, and ``ended`` is set when it returns.
    A request that is not a handshake (answered 400), or a close before one, ends the
    reader without waking the wait for the handshake (trio-websocket 0.12), which would
    otherwise hold the connection's slot until HANDSHAKE_TIMEOUT_S."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.ended = trio.Event()

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        async def watched() -> None:
            try:
                await fn(*args)
            finally:
                self.ended.set()

        self._nursery.start_soon(watched)


async def _request(
    reader: _Reader, stream: trio.abc.Stream, max_message_size: int
) -> WebSocketRequest | None:
    """The opening handshake's request, or None if the reader ended without one."""
    request = None
    async with trio.open_nursery() as racing:

        async def give_up() -> None:
            await reader.ended.wait()
            racing.cancel_scope.cancel()

        racing.start_soon(give_up)
        request = await wrap_server_stream(
            reader,  # type: ignore[arg-type]
            stream,
            message_queue_size=1,
            max_message_size=max_message_size,
        )
        racing.cancel_scope.cancel()
    return request


def _handshake_failed(origins: Origins, reason: str, error: str | None) -> None:
    if n := origins.refusals.count(reason, trio.current_time()):
        event(log, logging.INFO, "websocket.handshake_failed", reason=reason, error=error,
              failed=n)  # fmt: skip


def overloaded_response(limit: int) -> bytes:
    """What a connection over ``limit`` gets instead of the opening handshake: an HTTP 503
    written at once, without reading its request (the listener writes it inline)."""
    body = f"too many connections (max {limit})\n".encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
        b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
