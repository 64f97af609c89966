"""A call on the TCP transport, from its request line to its reply: the outbox and its flusher.

A caller's ``request`` queues its line, as a ``_Call``, in the outbox and waits until the
call is settled. The flusher task (``TcpCalls.flush``, a task of ``open_client``,
relay/client/client.py) writes what is queued, the lines of one scheduler tick in one write, and
records how far each write got. The reader task (``TcpTransport.run``, relay/client/tcp.py)
settles a call with its reply; when the connection drops, it sends the call again if that
is safe (``RETRY_SAFE_OPS``), or settles it with ``ConnectionLost``.
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson
import trio

from relay.protocol.errors import ConnectionLost, reply_fields

# Ops that are safe to send again after a reconnection: repeating them changes nothing
# that the first one did not (a repeated ack with the completing token answers ok).
RETRY_SAFE_OPS = frozenset({"ack", "ack_batch", "renew", "release"})


@attrs.define(eq=False)
class _Call:
    op: str
    line: bytes
    request_id: int
    worker_id: str | None = None
    sent_on: int | None = None  # the connection it was last sent on, once fully sent
    queued: bool = False  # waiting in the outbox: not written yet
    abandoned: bool = False  # its caller gave up while it was being written: not resent
    resent: bool = False
    orphaned: bool = False  # a lease whose caller gave up: release what it brings
    done: trio.Event = attrs.Factory(trio.Event)
    reply: Any = None
    error: BaseException | None = None

    def settle(self, reply: Any = None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.reply, self.error = reply, error
            self.done.set()


class TcpCalls:
    """The calls' side of ``TcpTransport`` (relay/client/tcp.py), a part it inherits: ``request``,
    the outbox and the flusher task. It uses the transport's ``token``, ``reconnect``,
    ``_ids``, ``_pending``, ``_outbox``, ``_outbox_lot``, ``_closed``, ``_failure``,
    ``_demand``, ``_connected``, ``_stream``, ``_generation``, ``_send_lock`` and
    ``_disconnected``."""

    async def request(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        if op == "hello" and self.token is not None:
            # A hello without the token would end the connection's authentication.
            fields = {**fields, "token": self.token}
        request_id = next(self._ids)
        line = orjson.dumps({"op": op, "id": request_id, **fields}) + b"\n"
        call = _Call(op, line, request_id, fields.get("worker_id"))
        self._pending[request_id] = call
        try:
            self._queue(call)
            await call.done.wait()
        except trio.Cancelled:
            if call.queued:  # never written: nothing to answer
                self._outbox.remove(call)
                call.queued = False
            else:
                # Taken by the flusher: if its write is cut short, it is not sent again.
                call.abandoned = True
                # A cancelled lease (a long-poll given up) may still be granted by the
                # server; the reader then releases those jobs instead of leaving them
                # leased until their leases expire.
                call.orphaned = op == "lease"
            raise
        finally:
            if not call.orphaned:
                self._pending.pop(request_id, None)
        if call.error is not None:
            raise call.error
        reply = call.reply
        if call.resent and op == "release" and not reply.get("ok"):
            # The first release may have taken effect before the connection dropped: the
            # token then no longer holds the job, which is what a release is for.
            code = (reply.get("error") or {}).get("code")
            if code in ("stale_token", "lease_expired"):
                return {"state": "ready"}
        return reply_fields(reply)

    def _queue(self, call: _Call) -> None:
        if self._failure is not None:
            self._demand.set()  # the next call waits for a new reconnection
            raise self._failure
        if self._closed:
            raise ConnectionLost("the client is closed")
        call.queued = True
        self._outbox.append(call)
        if len(self._outbox) == 1:
            self._outbox_lot.unpark_all()

    async def flush(self) -> None:
        """Write the queued lines, until cancelled (a task of ``open_client``).

        Woken by the first line queued, it runs after the tasks that ran with that one,
        so the lines of one scheduler tick go out in one write. It knows how far each
        write got: a line fully written counts as sent on that connection (and, once the
        connection drops unanswered, is sent again only if its op is safe to repeat); a
        line cut short was not acted on (the server acts on a line at its newline) and
        goes first on the next connection. A TLS write that failed cannot tell how far it
        got: its calls are settled at once (``_lost_in_write``)."""
        while True:
            while not self._outbox:
                await self._outbox_lot.park()
            await self._connected.wait()
            stream, generation = self._stream, self._generation
            if stream is None or self._failure is not None:
                # Given up: every call was settled with the failure; drop their lines.
                self._outbox = [call for call in self._outbox if _wanted(call)]
                continue
            # A call answered meanwhile (an overloaded refusal settles what waits) or
            # given up is not written.
            calls, self._outbox = [call for call in self._outbox if _wanted(call)], []
            for call in calls:
                call.queued = False
            data = b"".join([call.line for call in calls])
            written = 0
            try:
                async with self._send_lock:
                    written = await _write(stream, data)
            except _CutShort as exc:
                if generation == self._generation:
                    self._disconnected()
                    await trio.aclose_forcefully(stream)  # the reader notices, reconnects
                if exc.written is None:
                    self._lost_in_write(calls)
                    continue
                written = exc.written
            end = 0
            for i, call in enumerate(calls):
                end += len(call.line)
                if end > written:
                    for c in calls[i:]:
                        if c.orphaned:  # given up and never sent: no reply will come
                            self._pending.pop(c.request_id, None)
                    unsent = [c for c in calls[i:] if _wanted(c)]
                    for c in unsent:
                        c.queued = True
                    self._outbox[:0] = unsent
                    break
                call.sent_on = generation

    def _lost_in_write(self, calls: list[_Call]) -> None:
        """Settle the calls of a write that failed after an unknown part of it was sent
        (TLS): each may or may not have taken effect, as when a connection drops before
        the reply. The ops safe to repeat go first on the next connection; the others
        raise ``ConnectionLost``. Done here, not by the reader, which may already have
        settled that connection's calls."""
        again = []
        for call in calls:
            if call.orphaned:  # given up: no reply will be waited for
                self._pending.pop(call.request_id, None)
            elif call.op in RETRY_SAFE_OPS and self.reconnect and _wanted(call):
                call.resent = call.queued = True
                again.append(call)
            else:
                call.settle(error=ConnectionLost(f"{call.op}: the connection dropped"))
        self._outbox[:0] = again


def _wanted(call: _Call) -> bool:
    """Whether a call's line is still to be written: not answered, not given up."""
    return not call.done.is_set() and not call.abandoned


class _CutShort(Exception):
    """A write that the connection cut short after ``written`` bytes (None: unknown)."""

    def __init__(self, written: int | None) -> None:
        super().__init__(f"the connection dropped after {written} bytes")
        self.written = written


async def _write(stream: trio.abc.Stream, data: bytes) -> int:
    """Write all of ``data``, or raise ``_CutShort`` with how much the kernel took."""
    if not isinstance(stream, trio.SocketStream):
        try:  # TLS: a failed write cannot tell how much of it the kernel took
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _CutShort(None) from exc
        return len(data)
    sock = stream.socket
    view = memoryview(data)
    written = 0
    while written < len(data):
        try:
            written += await sock.send(view[written:])
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _CutShort(written) from exc
    return written
