"""Admitting HTTP connections and reading their requests, for the metrics listener
(relay/server/http/metrics.py answers them: /metrics, /healthz and the dashboard page).

Anyone who can reach the port can connect, so everything a connection may hold is
bounded before a request is read (numbers in protocol.md, "Metrics"):

- Connections at once: ``MAX_HTTP_CONNECTIONS`` in all, ``MAX_HTTP_PER_ADDRESS`` from one
  address (an IPv6 one by its /64, which one host usually has whole), and the last
  ``LOCAL_RESERVE`` of them only for connections from the server's own machine: a
  liveness probe there is answered even while other addresses hold every other slot.
  One over a bound is closed at once, unanswered.
- Time: the request's head (its line and headers) must arrive within ``HEAD_TIMEOUT_S``
  of the accept, and the whole exchange be done within ``EXCHANGE_TIMEOUT_S``: a client
  that sends a byte at a time (slowloris) holds its slot for 2 s, not 10.
- Size: the head is at most ``MAX_REQUEST_BYTES``.
- Host: on a loopback bind, only a request whose ``Host`` is a loopback address or
  ``localhost`` is answered (421 otherwise). A web page whose name its owner points at
  127.0.0.1 (DNS rebinding) is then refused, where it would have read /metrics as the
  browser's own origin.

Each refusal is logged in summary (``http.refused``, a line per reason at most once a
second, with how many): they come in floods.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import trio

from relay.server.connections.listener import peer_name
from relay.server.connections.prehello import address_key
from relay.util.log import Summaries, event

log = logging.getLogger("relay.http")

# A request's head must be in within this of the accept. A scraper or a browser sends its
# head in one packet, at once; 2 s leaves room for a slow network, and bounds how long a
# client that trickles its head (slowloris) holds a connection slot.
HEAD_TIMEOUT_S = 2.0
# The whole exchange (head in, response out) must be done within this, or is dropped.
EXCHANGE_TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 16 * 1024
# HTTP connections at once. A scraper needs one or two; without a cap, a flood of clients
# that connect and stall would hold file descriptors that the job listener needs.
MAX_HTTP_CONNECTIONS = 32
# From one address (an IPv6 /64): a scraper, a probe and a browser's few connections fit.
MAX_HTTP_PER_ADDRESS = 8
# Slots of MAX_HTTP_CONNECTIONS only a connection from the server's own machine may take.
LOCAL_RESERVE = 4

# Why a connection was refused: the ``reason`` of ``http.refused``.
OVER_CAP = "max_http_connections"
OVER_ADDRESS = "max_http_per_address"
RESERVED = "reserved_for_local"
HEAD_TIMEOUT = "head_timeout"
TOO_LARGE = "request_too_large"
BAD_REQUEST = "bad_request"
HOST = "host_not_loopback"


class Admission:
    """Who may hold an HTTP connection: the bounds above, counted as connections come and
    go (``admit``, then ``release`` once for each admitted)."""

    def __init__(
        self,
        total: int = MAX_HTTP_CONNECTIONS,
        per_address: int = MAX_HTTP_PER_ADDRESS,
        reserve: int = LOCAL_RESERVE,
    ) -> None:
        self.total = total
        self.per_address = per_address
        self.reserve = reserve
        self.open = 0
        self._by_address: dict[str, int] = {}  # no key at 0: as large as ``open`` at most

    def admit(self, key: str, local: bool) -> str | None:
        """Take a slot for a connection from ``key`` (``address_key``), ``local`` if from
        this machine; None if taken, else why not."""
        if self.open >= self.total:
            return OVER_CAP
        if not local and self.total - self.open <= self.reserve:
            return RESERVED
        held = self._by_address.get(key, 0)
        if held >= self.per_address:
            return OVER_ADDRESS
        self._by_address[key] = held + 1
        self.open += 1
        return None

    def release(self, key: str) -> None:
        self.open -= 1
        if (held := self._by_address.pop(key) - 1) > 0:
            self._by_address[key] = held


def peer_of(stream: trio.SocketStream) -> tuple[str, bool] | None:
    """The peer's address, and whether it is on the server's own machine: a connection
    from the machine to itself comes from the address it reached (127.0.0.1 to 127.0.0.1,
    ::1 to ::1, 10.0.0.5 to 10.0.0.5). None if the peer is already gone."""
    try:
        peer = stream.socket.getpeername()[0]
        local = stream.socket.getsockname()[0]
    except OSError:
        return None
    return peer, peer == local


def loopback_bind(listeners: list[trio.SocketListener]) -> bool:
    """Whether every one of ``listeners`` is bound to a loopback address."""
    return all(ipaddress.ip_address(one.socket.getsockname()[0]).is_loopback for one in listeners)


# A Host header: a name or an IPv4 address, or an IPv6 one in brackets; an optional port.
_HOST = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::[0-9]*)?")


def loopback_host(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request may be answered on a loopback bind: its ``Host`` (h11's
    lower-cased names) is a loopback address or ``localhost``, with any port, or it has
    none (an HTTP/1.0 client's; a browser always sends one)."""
    hosts = [value for name, value in headers if name == b"host"]
    if not hosts:
        return True
    match = _HOST.fullmatch(hosts[0].strip().decode("latin-1").lower())
    if len(hosts) > 1 or match is None:
        return False
    host = match.group(1)
    if host in ("localhost", "localhost."):
        return True
    bracketed = host.startswith("[")
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False  # a name: whoever owns it may point it here
    if bracketed != (address.version == 6):
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


class Refused(Exception):
    """A request refused: why (``reason``), and the status and one line the client gets."""

    def __init__(self, reason: str, status: int, text: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.text = text


class Refusals:
    """Logs the refusals of one listener in summary, a line per reason at most once a
    second (``http.refused``, with ``refused``: how many since the last line)."""

    def __init__(self) -> None:
        self._summaries = Summaries()

    def refused(self, reason: str, peer: str) -> None:
        if n := self._summaries.count(reason, trio.current_time()):
            level = logging.INFO if reason in (BAD_REQUEST, HEAD_TIMEOUT) else logging.WARNING
            event(log, level, "http.refused", reason=reason, peer=peer, refused=n)


async def read_request(
    stream: trio.abc.Stream, conn: h11.Connection, deadline: float, loopback_only: bool
) -> h11.Request | None:
    """The request's head, read by ``conn`` by ``deadline`` (trio's clock); None if the
    client closed first. Raises Refused if it is late, malformed or too large, or (when
    ``loopback_only``) for a Host that is not loopback's."""
    with trio.move_on_at(deadline):
        while True:
            try:
                incoming: Any = conn.next_event()
            except h11.RemoteProtocolError as exc:
                if exc.error_status_hint == 431:
                    text = f"request head over {MAX_REQUEST_BYTES} bytes"
                    raise Refused(TOO_LARGE, 431, text) from None
                raise Refused(BAD_REQUEST, 400, "not an HTTP/1.x request") from None
            if incoming is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(MAX_REQUEST_BYTES))
                continue
            if not isinstance(incoming, h11.Request):
                return None  # closed before a request
            if loopback_only and not loopback_host(incoming.headers):
                raise Refused(
                    HOST, 421, "on loopback, this server answers only to Host: localhost or a "
                    "loopback address",
                )  # fmt: skip
            return incoming
    raise Refused(HEAD_TIMEOUT, 408, "request head not received in time")


_PHRASES = {
    400: b"Bad Request",
    408: b"Request Timeout",
    421: b"Misdirected Request",
    431: b"Request Header Fields Too Large",
}


def refusal_response(refused: Refused) -> bytes:
    """What a refused request is sent: its status and one line of text (then the close)."""
    body = f"{refused.text}\n".encode()
    return b"HTTP/1.1 %d %s\r\ncontent-type: text/plain\r\nconnection: close\r\n" \
        b"content-length: %d\r\n\r\n%s" % (refused.status, _PHRASES[refused.status],
                                           len(body), body)  # fmt: skip


# Answers one request, read by the connection given (h11's), on the stream given.
Respond = Callable[[trio.SocketStream, h11.Connection, h11.Request], Awaitable[None]]


async def serve_http(
    listeners: list[trio.SocketListener],
    respond: Respond,
    *,
    head_timeout: float = HEAD_TIMEOUT_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept on ``listeners`` until cancelled; for each connection admitted, read its
    request's head and let ``respond`` answer it, then close the connection. Each
    connection is a task of trio's ``serve_listeners``, cancelled with it."""
    admission = Admission()
    refusals = Refusals()
    loopback_only = loopback_bind(listeners)

    async def handle(stream: trio.SocketStream) -> None:
        peer = peer_of(stream)
        if peer is None:  # gone already
            await trio.aclose_forcefully(stream)
            return
        key = address_key(peer[0])
        if reason := admission.admit(key, local=peer[1]):
            refusals.refused(reason, peer_name(stream))
            await trio.aclose_forcefully(stream)
            return
        try:
            with trio.move_on_after(EXCHANGE_TIMEOUT_S):
                await _serve_one(stream, respond, head_timeout, loopback_only, refusals)
            await trio.aclose_forcefully(stream)
        finally:
            admission.release(key)

    await trio.serve_listeners(handle, listeners, task_status=task_status)


async def _serve_one(
    stream: trio.SocketStream,
    respond: Respond,
    head_timeout: float,
    loopback_only: bool,
    refusals: Refusals,
) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
    try:
        deadline = trio.current_time() + head_timeout
        request = await read_request(stream, conn, deadline, loopback_only)
    except Refused as refused:
        refusals.refused(refused.reason, peer_name(stream))
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(refusal_response(refused))
        return
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        event(log, logging.DEBUG, "http.broken", error=repr(exc))
        return
    if request is not None:
        await respond(stream, conn, request)
