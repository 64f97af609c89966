"""The client's side of ``watch``: the job events of one watch, as an async iterator.

``Client.watch`` (relay/client/client.py) returns an ``EventStream``. It starts the watch with
its first ``__anext__`` (or ``async with``), then reads the events that the transport's
reader task collects without waiting for anyone (``TcpTransport.events``, relay/client/tcp.py),
and ends with the connection it began on.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from relay.protocol.errors import ConnectionLost, RelayError, UnknownOp

# How the stream sends ``watch`` and ``unwatch``: the client's call, given by ``Client.watch``.
Call = Callable[..., Awaitable[dict[str, Any]]]


class EventStream:
    """The events of one watch (``Client.watch``): the first ``__anext__`` starts it."""

    def __init__(self, call: Call, transport: Any, fields: dict[str, Any]) -> None:
        self._call = call
        self._transport = transport
        self._fields = fields
        self._connection: int | None = None  # which connection the watch is on

    def __aiter__(self) -> EventStream:
        return self

    async def __aenter__(self) -> EventStream:
        await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _start(self) -> None:
        if self._connection is not None:
            return
        transport = self._transport
        if not hasattr(transport, "events_lot"):
            raise UnknownOp("watch needs a network connection (TCP or WebSocket)")
        transport.events, transport.events_dropped = deque(), 0  # before the ok: none lost
        await self._call("watch", **self._fields)
        self._connection = transport.connections

    async def __anext__(self) -> dict[str, Any]:
        await self._start()
        transport = self._transport
        while not transport.events:
            if transport.events is None or self._gone():
                raise ConnectionLost("the connection dropped: the watch ended")
            await transport.events_lot.park()
        return transport.events.popleft()

    def _gone(self) -> bool:
        """Whether the connection the watch is on has gone (another one since, or none
        now: a reconnection under way, or given up): the server's watch went with it."""
        transport = self._transport
        return (
            transport.connections != self._connection
            or not transport._connected.is_set()
            or transport._failure is not None
        )

    async def aclose(self) -> None:
        """End the watch (on the server too, if the connection still stands)."""
        self._transport.events = None
        if self._connection is not None and not self._gone():
            with contextlib.suppress(RelayError):
                await self._call("unwatch")
