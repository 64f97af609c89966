"""The WebSocket transport: the same sessions as TCP, one request and one reply per frame.

A WebSocket connection is served by the same ``Session`` as a TCP one (relay/server/
session.py): ``MessageStream`` shows the connection to it as the byte stream of NDJSON
lines it reads and writes. Each text message read becomes one line (a newline inside it,
JSON whitespace, is sent on as a carriage return, also whitespace, so a message stays one
request), and each reply line written goes out as one text message. Everything else, the
limits, backpressure, access control, long-polls and shutdown, is the session's.

The protocol is wsproto's, driven here, with no task of its own: a message's text is
handed to the session as it arrives, frame piece by frame piece, in UTF-8 bytes, and the
session's line splitter bounds it as it bounds a TCP line (``max_frame_bytes``, and the
hello-sized limit before a hello): so a connection holds no more of a message than a TCP
connection holds of a line, whatever its characters, and nothing is read while the
session does not read (TCP pushes back on the client). Pings are answered as they are
read; the opening handshake's request is bounded by h11 (16 KiB); no extension (such as
compression) is accepted.

What only a WebSocket has: a binary message is answered ``bad_request`` and the
connection closed with 1003 (unsupported data); a message over the frame limit is
answered ``frame_too_large`` and closed with 1009 (message too big); a refused hello
closes with 1008 (policy violation), shutdown with 1001 (going away), a connection
refused as ``overloaded`` gets an HTTP 503 instead of the handshake.

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
from typing import NamedTuple

import attrs
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Message,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from relay.protocol import wire
from relay.protocol.errors import BadRequest
from relay.util.log import Summaries, event

log = logging.getLogger("relay.websocket")

# The opening handshake (HTTP upgrade) must be done within this, or the connection closes
# (and by the connection's hello deadline, which is usually sooner).
HANDSHAKE_TIMEOUT_S = 10.0
# Characters of a refused Origin that its log line shows (the rest is the client's text).
ORIGIN_LOGGED = 100
# Bytes per read from the connection: a session's read gets at most about this much text.
RECEIVE_BYTES = 64 * 1024
# Closing, the client's closing frame is awaited for at most this many bytes (and within
# the session's close grace, relay/server/connections/streamio.py).
CLOSE_DRAIN_BYTES = 4 * 1024 * 1024

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


class _Closed(Exception):
    """The connection ended (EOF, a reset, or it is closed)."""


class MessageStream(trio.abc.HalfCloseableStream):
    """A WebSocket connection, after its opening handshake, as a stream of NDJSON lines,
    for one ``Session``. ``transport`` is the TCP (or TLS) stream below it; its owner
    closes it (``run_websocket`` in relay/server/serve.py)."""

    def __init__(self, transport: trio.abc.Stream, ws: WSConnection) -> None:
        self._transport = transport
        self._ws = ws
        self._sending = trio.StrictFIFOLock()  # the session's replies, and pongs
        self._eof = False  # the client closed, or sent what ends the connection
        self._outgoing = b""  # the start of a reply line not yet complete
        self._close_code = NORMAL
        self._last_words: bytes | None = None  # a reply to send just before closing

    def closing(self, reason: str) -> None:
        """The session says why it will close (the code the peer gets)."""
        self._close_code = CLOSE_CODES.get(reason, self._close_code)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """The text that has arrived, as UTF-8 lines (b"": the client is done). ``max_bytes``
        is not heeded: a call returns what one read of the connection carried."""
        while not self._eof:
            text = await self._take_events()
            if text:
                return text
            if self._eof:
                break
            try:
                data = await self._transport.receive_some(RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self._eof = True
                break
            self._ws.receive_data(data)
        return b""

    async def _take_events(self) -> bytes:
        """Handle the events of what has been read; the text of its messages, as lines."""
        pieces: list[bytes] = []
        for ws_event in self._ws.events():
            if isinstance(ws_event, TextMessage):
                pieces.append(ws_event.data.encode().replace(b"\n", b"\r"))
                if ws_event.message_finished:
                    pieces.append(b"\n")
            elif isinstance(ws_event, BytesMessage):
                # The session sees EOF: it answers what it owes, then closes (aclose).
                error = BadRequest("binary frames are not accepted; send each request as text")
                self._last_words = wire.encode_error(None, error)
                self._close_code = UNSUPPORTED
                self._eof = True
                break
            elif isinstance(ws_event, Ping):
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._send(ws_event.response())
            elif isinstance(ws_event, CloseConnection):
                # The client's closing frame, or one wsproto made of a protocol error
                # (invalid UTF-8, say): answered with the same code, then EOF.
                self._eof = True
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._send(ws_event.response())
                break
        return b"".join(pieces)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send each complete line of what has been written as one text message."""
        data = self._outgoing + bytes(data)
        if b"\n" not in data:
            self._outgoing = data
            return
        *lines, self._outgoing = data.split(b"\n")
        for line in lines:
            await self._send(Message(data=line.decode()))

    async def _send(self, ws_event: Event) -> None:
        async with self._sending:
            try:
                data = self._ws.send(ws_event)
            except LocalProtocolError:  # closed (or closing): nothing more may be sent
                if isinstance(ws_event, CloseConnection):
                    return
                raise trio.BrokenResourceError("the WebSocket is closed") from None
            await self._transport.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        """Close with the code the session gave (the peer may still send its close)."""
        await self.aclose()

    async def aclose(self) -> None:
        """The last words, if any, then the closing handshake: the closing frame, and the
        client's, read for at most CLOSE_DRAIN_BYTES. Its caller bounds it in time (the
        session's close, CLOSE_GRACE_S)."""
        if self._last_words is not None:
            line, self._last_words = self._last_words, None
            with contextlib.suppress(trio.BrokenResourceError):
                await self._send(Message(data=line.rstrip(b"\n").decode()))
        if self._ws.state is ConnectionState.OPEN:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._send(CloseConnection(code=self._close_code))
        drained = 0
        while self._ws.state is ConnectionState.LOCAL_CLOSING and drained < CLOSE_DRAIN_BYTES:
            try:
                data = await self._transport.receive_some(RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            drained += len(data)
            self._ws.receive_data(data)
            for _ in self._ws.events():  # what is still read is not taken
                pass


class _Endpoint(NamedTuple):
    address: str
    port: int


class _Upgrade:
    """A client's opening handshake, read: its ``headers``, the ``local`` address it
    arrived on; ``accept`` or ``reject`` it."""

    def __init__(self, stream: trio.abc.Stream, ws: WSConnection, request: Request) -> None:
        self._stream = stream
        self._ws = ws
        self.headers = list(request.extra_headers)
        sock = getattr(getattr(stream, "transport_stream", stream), "socket", None)
        address = sock.getsockname() if sock is not None else ("", 0)
        self.local = _Endpoint(address[0], address[1])

    async def accept(self) -> MessageStream:
        await self._stream.send_all(self._ws.send(AcceptConnection()))
        return MessageStream(self._stream, self._ws)

    async def reject(self, status: int, *, body: bytes) -> None:
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
        data = self._ws.send(RejectConnection(status_code=status, headers=headers, has_body=True))
        data += self._ws.send(RejectData(data=body))
        await self._stream.send_all(data)


async def _read_upgrade(stream: trio.abc.Stream) -> _Upgrade:
    """Read the opening handshake's request. Raises _Closed if the connection ends first,
    or RemoteProtocolError if it is not one (having answered it, 400 or so)."""
    ws = WSConnection(ConnectionType.SERVER)
    try:
        while True:
            for ws_event in ws.events():
                if isinstance(ws_event, Request):
                    return _Upgrade(stream, ws, ws_event)
            data = await stream.receive_some(RECEIVE_BYTES)
            if not data:
                raise _Closed
            ws.receive_data(data)
    except RemoteProtocolError as exc:
        if exc.event_hint is not None:
            with contextlib.suppress(LocalProtocolError):
                await stream.send_all(ws.send(exc.event_hint))
        raise


async def accept_websocket(
    stream: trio.abc.Stream, origins: Origins, deadline: float = float("inf")
) -> MessageStream | None:
    """The opening handshake on an accepted connection, within HANDSHAKE_TIMEOUT_S and by
    ``deadline`` (the connection's hello deadline); None if it failed or ``origins``
    refused it (the caller closes the stream)."""
    with trio.move_on_at(min(trio.current_time() + HANDSHAKE_TIMEOUT_S, deadline)):
        try:
            request = await _read_upgrade(stream)
            origin = _header(request.headers, b"origin")
            if not origins.permit(origin, str(request.local.address)):
                if n := origins.refusals.count("origin", trio.current_time()):
                    event(log, logging.WARNING, "websocket.origin_refused",
                          origin=origin[:ORIGIN_LOGGED], refused=n)  # fmt: skip
                await request.reject(403, body=b"this page's origin may not connect\n")
                return None
            return await request.accept()
        except (
            _Closed, RemoteProtocolError, trio.BrokenResourceError, trio.ClosedResourceError
        ) as exc:  # fmt: skip
            _handshake_failed(origins, "closed or not a WebSocket handshake", repr(exc)[:200])
            return None
    _handshake_failed(origins, "not done in time", None)
    return None


def _handshake_failed(origins: Origins, reason: str, error: str | None) -> None:
    if n := origins.refusals.count(reason, trio.current_time()):
        event(log, logging.INFO, "websocket.handshake_failed", reason=reason, error=error,
              failed=n)  # fmt: skip


def overloaded_response(message: str) -> bytes:
    """What a refused connection gets instead of the opening handshake (``message`` says
    which limit): an HTTP 503 written at once, without reading its request (the listener
    writes it inline)."""
    body = f"{message}\n".encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
        b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
