"""The TCP transport of ``relay.Client``: one pipelined connection, re-established on loss.

Calls queue their lines in an outbox that one flusher task writes, so the calls that
tasks make in one scheduler tick go out in one write; one reader task matches replies to
calls by id and reconnects when the connection drops. Both tasks belong to ``open_client``
(relay/client/client.py), which owns this transport. With an SSL context, every connection (each
reconnection too) does its TLS handshake (relay/client/tls.py) within the connect timeout.

Every connection begins with a ``hello`` (with the token, if there is one), answered within
the connect timeout: a server that accepts but never answers, or a peer that is not a
relay-trio server (``WrongServer``), fails the connection there rather than the first call.

Here: the connection's side (connect and say hello, the reader task, what a drop does to
the calls in flight, reconnection, giving up, closing). The calls' side (``request``, the
outbox and the flusher task) is ``TcpCalls`` in relay/client/calls.py, a part that
``TcpTransport`` inherits.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import random
import socket
import ssl
import sys
from collections import deque
from contextlib import suppress
from typing import Any

import orjson
import trio

from relay.client.calls import RETRY_SAFE_OPS, TcpCalls, _Call
from relay.client.tls import TLS_HINT, _handshake
from relay.protocol.errors import (
    ConnectionLost,
    RelayError,
    Unauthorized,
    WrongServer,
    reply_error,
    reply_fields,
)
from relay.util.log import event

log = logging.getLogger("relay.client")

CONNECT_TIMEOUT_S = 5.0
RECONNECT_TIMEOUT_S = 30.0
# Reconnection backoff: doubling from the first delay up to the cap, each with jitter.
RECONNECT_FIRST_S = 0.05
RECONNECT_CAP_S = 2.0
READ_BYTES = 64 * 1024
# A hello's reply is a few hundred bytes; a peer that sends this much without a line end
# is not a relay-trio server (and is not read further).
MAX_HELLO_REPLY_BYTES = 64 * 1024
# The name a connection gives itself in its hello (``client_name``), in bytes at most.
CLIENT_NAME_BYTES = 128
# Job events a watch may have unread before the client drops (and counts) more.
MAX_EVENTS = 10_000


class TcpTransport(TcpCalls):
    """One connection at a time, re-established on loss. Owned by ``open_client``.

    A line that was not fully sent cannot have been acted on (the server acts on a line at
    its newline), so a failed send always waits for the next connection and goes again.
    A line that was sent but not answered when the connection dropped is resent only for
    ack, renew and release; any other op raises ``ConnectionLost``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        reconnect: bool = True,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        reconnect_timeout: float = RECONNECT_TIMEOUT_S,
        ssl_context: ssl.SSLContext | None = None,
        token: str | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.ssl_context = ssl_context  # None: plain TCP
        self.token = token  # sent in a hello first on every connection, and in every hello
        self.reconnect = reconnect
        self.connect_timeout = connect_timeout
        self.reconnect_timeout = reconnect_timeout
        self._ids = itertools.count(1)
        self._pending: dict[int, _Call] = {}
        self._stream: trio.abc.Stream | None = None
        self._generation = 0  # which connection _stream is
        self._unread_generation = -1  # a connection whose later lines the server ignored
        self._connected = trio.Event()  # set while _stream is usable
        self._send_lock = trio.Lock()
        # Lines to send, in order: written together by the flusher task, so the calls
        # that tasks make in one scheduler tick go out in one write.
        self._outbox: list[_Call] = []
        self._outbox_lot = trio.lowlevel.ParkingLot()
        self._closed = False
        self._failure: RelayError | None = None  # set when the transport gave up
        self._demand = trio.Event()  # a call after giving up: try to reconnect again
        # Reconnection backoff; kept across connections that die at once (a server that
        # refuses us with overloaded), reset by the first good reply.
        self._backoff = RECONNECT_FIRST_S
        self.connections = 0  # how many times a connection was established
        # Job events (lines without an id) while a watch is on: read by Client.watch. The
        # reader never waits for them: past MAX_EVENTS unread, they are dropped and counted.
        self.events: deque[dict[str, Any]] | None = None
        self.events_dropped = 0
        self.events_lot = trio.lowlevel.ParkingLot()
        self.nursery: trio.Nursery | None = None  # open_client's, for release tasks

    @property
    def _address(self) -> str:
        return f"{self.host}:{self.port}"

    def _event(self, event: dict[str, Any]) -> None:
        if self.events is None:
            return
        if len(self.events) >= MAX_EVENTS:
            self.events_dropped += 1
            return
        if self.events_dropped:
            self.events.append({"event": "lagged", "dropped": self.events_dropped})
            self.events_dropped = 0
        self.events.append(event)
        self.events_lot.unpark_all()

    def _disconnected(self) -> None:
        self.events_lot.unpark_all()  # a watch ends with the connection
        # Senders wait on the current event; replace it only once it has been set, so
        # that no sender is left waiting on an event that nobody will set.
        if self._connected.is_set():
            self._connected = trio.Event()

    async def first_connect(self) -> None:
        self._stream = await self._connect()
        self._generation = self.connections = 1
        self._connected.set()

    async def _connect(self) -> trio.abc.Stream:
        with trio.fail_after(self.connect_timeout):
            stream = await trio.open_tcp_stream(self.host, self.port)
            if self.ssl_context is not None:
                stream = await _handshake(stream, self.ssl_context, self.host)
            try:
                await _say_hello(stream, self.token, self.ssl_context is None)
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            return stream

    def _give_up(self, error: RelayError) -> None:
        self._failure = error
        self.events_lot.unpark_all()  # a watch ends with it
        for request_id, call in list(self._pending.items()):
            call.settle(error=error)
            if call.orphaned:  # nobody waits for it, and no reply will come
                del self._pending[request_id]
        self._connected.set()  # wake every sender: each sees the failure

    async def run(self) -> None:
        """Read replies; on loss, settle what cannot be resent and reconnect. Until
        cancelled (or, without ``reconnect``, until the connection is lost)."""
        while True:
            stream, generation = self._stream, self._generation
            assert stream is not None
            with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._read_replies(stream)
            if self._generation == generation:
                self._disconnected()
            await trio.aclose_forcefully(stream)
            resend = []
            unread = self._unread_generation == generation
            for request_id, call in list(self._pending.items()):
                if call.sent_on != generation or call.done.is_set():
                    continue  # not sent yet: it waits in the outbox for the next connection
                if call.orphaned:
                    del self._pending[request_id]
                elif unread and self.reconnect:
                    resend.append(call)  # the server never read it: not a repeat
                elif call.op in RETRY_SAFE_OPS and self.reconnect:
                    call.resent = True
                    resend.append(call)
                else:
                    call.settle(error=ConnectionLost(f"{call.op}: the connection dropped"))
            if not self.reconnect:
                self._give_up(ConnectionLost("the connection dropped"))
                return
            lost_at = trio.current_time()
            event(log, logging.WARNING, "client.connection_lost", address=self._address,
                  reconnecting=True, message=f"the connection to {self._address} was lost: "
                  "reconnecting")  # fmt: skip
            while True:
                try:
                    self._stream = await self._reconnect()
                    break
                except (ConnectionLost, Unauthorized) as exc:
                    # Fail what waits, then sleep until someone calls again: a worker
                    # outliving a long outage (or a token's rotation) reconnects once
                    # the server is back (or takes the token again).
                    event(log, logging.WARNING, "client.reconnect_failed",
                          address=self._address, error=str(exc),
                          message=f"could not reconnect to {self._address}: {exc}; trying "
                          "again at the next call")  # fmt: skip
                    self._give_up(exc)
                    self._demand = trio.Event()
                    await self._demand.wait()
                    self._failure = None
                    self._backoff = RECONNECT_FIRST_S
                    self._disconnected()
            self._failure = None
            self.connections += 1
            self._generation += 1
            event(log, logging.INFO, "client.reconnected", address=self._address,
                  down_ms=round((trio.current_time() - lost_at) * 1000))  # fmt: skip
            for call in resend:
                if not call.done.is_set():
                    call.sent_on = self._generation
                    # No timeout here: a send cut short would leave half a line that the
                    # next line would be glued to. A dead connection raises instead.
                    with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        async with self._send_lock:
                            await self._stream.send_all(call.line)
            self._connected.set()

    async def _reconnect(self) -> trio.abc.Stream:
        with trio.move_on_after(self.reconnect_timeout):
            while True:
                await trio.sleep(self._backoff * random.uniform(0.5, 1.0))
                self._backoff = min(self._backoff * 2, RECONNECT_CAP_S)
                try:
                    return await self._connect()
                except Unauthorized:
                    raise  # waiting will not make the token right
                except (OSError, trio.TooSlowError, trio.BrokenResourceError, RelayError):
                    pass  # not up yet, or refused for now (overloaded): try again
        raise ConnectionLost(
            f"could not reconnect to {self.host}:{self.port} within {self.reconnect_timeout} s"
        )

    async def _read_replies(self, stream: trio.abc.Stream) -> None:
        buffer = bytearray()
        while True:
            data = await stream.receive_some(READ_BYTES)
            if not data:
                return
            buffer += data
            # Split only when a line ended: a long reply arriving in many reads is then
            # gathered in linear time, not re-scanned on every read.
            if b"\n" not in data:
                continue
            *lines, rest = buffer.split(b"\n")
            buffer = bytearray(rest)
            for line in lines:
                try:
                    reply = orjson.loads(line)
                    reply.get("id")
                except (orjson.JSONDecodeError, AttributeError):
                    self._give_up(
                        WrongServer(
                            f"{self.host}:{self.port} does not answer as a relay-trio server"
                        )
                    )
                    return
                call = self._pending.get(reply.get("id"))  # type: ignore[arg-type]
                if call is not None and call.orphaned:
                    del self._pending[reply["id"]]
                    # Sent by another task: the reader must never wait on the server, or
                    # under backpressure neither side would move.
                    jobs = reply.get("jobs") or []
                    if jobs and self.nursery is not None:
                        self.nursery.start_soon(self._release, stream, call.worker_id, jobs)
                elif call is not None:
                    if reply.get("ok"):
                        self._backoff = RECONNECT_FIRST_S
                    call.settle(reply)
                elif "event" in reply:
                    self._event(reply)
                elif reply.get("id") is None and reply.get("ok") is False:
                    self._connection_error(reply)

    def _connection_error(self, reply: dict[str, Any]) -> None:
        """An error with no id (overloaded, frame_too_large): the server is closing this
        connection and acts on nothing sent after it. Send nothing more on it."""
        error = reply_error(reply)
        generation = self._generation
        self._disconnected()
        unanswered = [
            call for call in self._pending.values()
            if not call.done.is_set() and not call.orphaned
        ]  # fmt: skip
        if error.code == "overloaded":
            # Refused before anything was read: tell every waiting caller.
            for call in unanswered:
                call.settle(error=error)
            return
        # frame_too_large names no request: it is the longest line still unanswered. The
        # lines after it were never read, so they are sent again on the next connection.
        sent = [call for call in unanswered if call.sent_on == generation]
        if sent:
            max(sent, key=lambda call: len(call.line)).settle(error=error)
        self._unread_generation = generation

    async def _release(
        self, stream: trio.abc.Stream, worker_id: str | None, jobs: list[dict[str, Any]]
    ) -> None:
        """Send a release for each job; nobody waits for the replies (their ids are not
        pending, so the reader drops them). If the connection is gone, the leases expire
        instead."""
        with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._send_releases(stream, worker_id, jobs)

    async def _send_releases(
        self, stream: trio.abc.Stream, worker_id: str | None, jobs: list[dict[str, Any]]
    ) -> None:
        for job in jobs:
            fields = {
                "job_id": job.get("job_id"),
                "worker_id": worker_id,
                "token": job.get("token"),
            }
            line = orjson.dumps({"op": "release", "id": next(self._ids), **fields}) + b"\n"
            async with self._send_lock:
                await stream.send_all(line)

    async def aclose(self) -> None:
        self._closed = True
        for call in list(self._pending.values()):
            call.settle(error=ConnectionLost("the client is closed"))
        self._connected.set()
        if self._stream is not None:
            await trio.aclose_forcefully(self._stream)


async def _say_hello(stream: trio.abc.Stream, token: str | None, plain: bool = False) -> None:
    """Say hello (with ``token``, if any) on a new connection, before anything else is
    sent, and read its answer (see ``check_hello_reply``)."""
    await stream.send_all(hello_line(token))
    data = b""
    while b"\n" not in data:
        data = hello_read(data, await stream.receive_some(READ_BYTES), plain)
    check_hello_reply(data.split(b"\n", 1)[0])


# -- what both clients share: the hello that begins a connection, why a connection failed --


def hello_line(token: str | None) -> bytes:
    """The hello a connection begins with (id 0: the calls' ids start at 1), naming this
    process (``client_name``) for the server's workers list."""
    hello: dict[str, Any] = {"op": "hello", "id": 0, "client": client_name()}
    if token is not None:
        hello["token"] = token
    return orjson.dumps(hello) + b"\n"


def client_name() -> str:
    """This process as a server's ``workers_list`` shows it: its program, host and pid
    ("relay-trio on build-7, pid 4242"), at most CLIENT_NAME_BYTES (the server takes 256).
    Read at each connection: a forked worker process names its own pid."""
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    name = f"{program or 'python'} on {socket.gethostname()}, pid {os.getpid()}"
    return name.encode()[:CLIENT_NAME_BYTES].decode(errors="ignore")


def hello_read(data: bytes, more: bytes, plain: bool) -> bytes:
    """The hello's reply so far, ``data``, with the bytes just read, ``more``; or the
    error that ends it: the connection closed (before a byte, on a plain connection: what
    a server with TLS does, WrongServer), or too much without a line end (WrongServer)."""
    if not more:
        if plain and not data:
            raise WrongServer(f"the server closed the connection at hello ({TLS_HINT})")
        raise ConnectionLost("the server closed the connection during hello")
    data += more
    if b"\n" not in data and len(data) > MAX_HELLO_REPLY_BYTES:
        raise WrongServer("the server's answer to hello is no line of a relay-trio server")
    return data


def check_hello_reply(line: bytes) -> None:
    """Raise what the hello's reply says: the error of an error reply (Unauthorized for a
    token refused, Overloaded), WrongServer if it is not a relay-trio server's."""
    try:
        reply = orjson.loads(line)
        reply_fields(reply)
    except (orjson.JSONDecodeError, AttributeError):
        raise WrongServer("the server does not answer as a relay-trio server") from None
    if reply.get("server") != "relay-trio":
        raise WrongServer("the server does not answer hello as a relay-trio server")


def connect_failure(exc: BaseException) -> BaseException:
    """The error of a failed connection, out of trio's wrapper: when every address of a
    host failed, the first attempt's own error."""
    if isinstance(exc, OSError) and isinstance(exc.__cause__, BaseExceptionGroup):
        first = exc.__cause__.exceptions[0]
        if isinstance(first, OSError):
            return first
    return exc


def connect_failure_text(exc: BaseException) -> str:
    """Why a connection failed (or was lost), in a few words, as the system or OpenSSL
    says it: "Connection refused", "timed out", "TLS handshake failed: ..."."""
    exc = connect_failure(exc)
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate verification failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):  # its errno is OpenSSL's, not the system's
        return f"TLS handshake failed: {tls_reason(exc)}"
    if isinstance(exc, socket.gaierror) and exc.strerror:  # a name that does not resolve
        return exc.strerror
    if isinstance(exc, OSError) and exc.errno in errno.errorcode:
        return os.strerror(exc.errno)
    return str(exc) or type(exc).__name__


def tls_reason(exc: ssl.SSLError) -> str:
    """OpenSSL's reason, in words: "wrong version number", "certificate verify failed"."""
    return (exc.reason or str(exc)).lower().replace("_", " ")


def tls_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is TLS that no retry fixes: a certificate not trusted, or a peer
    that does not speak TLS (an EOF during the handshake may be a server restarting)."""
    return isinstance(exc, ssl.SSLError) and not isinstance(
        exc, ssl.SSLEOFError | ssl.SSLZeroReturnError | ssl.SSLSyscallError
    )
