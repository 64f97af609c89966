"""A real server on 127.0.0.1 port 0 for each test, and a tiny NDJSON client to talk to it."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import attrs
import orjson
import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, connect_websocket

from relay.protocol import wire
from relay.server.serve import ServerConfig, ServerHandle, serve
from tests.worker.helpers import serving

# Every network wait in these tests is bounded; a hang fails the test, never the run.
BOUND_S = 10


class LineClient:
    """One connection. ``request`` sends one op and returns its reply (matched by id)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buffer = b""
        self._ids = itertools.count(1)

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send(self, op: str, **fields: Any) -> int:
        request_id = next(self._ids)
        await self.send_raw(orjson.dumps({"op": op, "id": request_id, **fields}) + b"\n")
        return request_id

    async def read_line(self) -> bytes | None:
        """The next line, or None at EOF."""
        with trio.fail_after(BOUND_S):
            while b"\n" not in self._buffer:
                data = await self.stream.receive_some(65536)
                if not data:
                    return None
                self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    async def read(self) -> dict[str, Any]:
        line = await self.read_line()
        assert line is not None, "connection closed"
        return orjson.loads(line)

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        request_id = await self.send(op, **fields)
        reply = await self.read()
        assert reply["id"] == request_id
        return reply

    async def ok(self, op: str, **fields: Any) -> dict[str, Any]:
        reply = await self.request(op, **fields)
        assert reply["ok"] is True, reply
        return reply

    async def error(self, op: str, **fields: Any) -> dict[str, Any]:
        reply = await self.request(op, **fields)
        assert reply["ok"] is False, reply
        return reply["error"]

    async def at_eof(self) -> bool:
        """True if the server closed the connection (reads until EOF, bounded)."""
        with trio.fail_after(BOUND_S):
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return True
                if not data:
                    return True

    async def aclose(self) -> None:
        await self.stream.aclose()


class WebSocketLineClient(LineClient):
    """The same client over the WebSocket endpoint: each line it sends is one text
    message, each message it gets one line."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self._buffer = b""
        self._unsent = b""
        self._ids = itertools.count(1)

    async def send_raw(self, data: bytes) -> None:
        *lines, self._unsent = (self._unsent + data).split(b"\n")
        for line in lines:
            # A text message cannot hold invalid UTF-8: such bytes go as U+FFFD.
            await self.ws.send_message(line.decode(errors="replace"))

    async def read_line(self) -> bytes | None:
        with trio.fail_after(BOUND_S):
            try:
                message = await self.ws.get_message()
            except ConnectionClosed:
                return None
        assert isinstance(message, str), "replies are text messages"
        return message.encode()

    async def at_eof(self) -> bool:
        while await self.read_line() is not None:
            pass
        return True

    async def aclose(self) -> None:
        await self.ws.aclose()


@attrs.define
class RunningServer:
    handle: ServerHandle
    config: ServerConfig
    nursery: trio.Nursery

    async def connect(self) -> LineClient:
        host, port = self.handle.address
        return LineClient(await trio.open_tcp_stream(host, port))

    async def connect_websocket(self) -> WebSocketLineClient:
        assert self.handle.ws_address is not None, "started without ws_port"
        host, port = self.handle.ws_address
        with trio.fail_after(BOUND_S):
            ws = await connect_websocket(self.nursery, host, port, "/", use_ssl=False)
        return WebSocketLineClient(ws)

    async def connect_by(self, transport: str) -> LineClient:
        """A client over ``transport``: "tcp" or "websocket"."""
        if transport == "websocket":
            return await self.connect_websocket()
        return await self.connect()


async def writer_barrier(client: LineClient) -> None:
    """One request that the writer answers (an inspect of no job): once its reply is read,
    the writer has answered every request the connection sent before it (stats no longer
    serves: it is answered at once, from memory)."""
    reply = await client.request("inspect", job_id="job_0000000000000000")
    assert reply["error"]["code"] == "not_found", reply


async def start_server(nursery: trio.Nursery, db: str, **overrides: Any) -> RunningServer:
    limits = overrides.pop("limits", wire.Limits())
    defaults = {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "ws_port": 0}
    # Scrapes see every change at once (tests scrape, act, and scrape again); the cache's
    # own tests set it.
    defaults["metrics_cache_ms"] = 1
    config = ServerConfig(db=db, limits=limits, **(defaults | overrides))
    handle = await nursery.start(serve, config)
    return RunningServer(handle, config, nursery)


@pytest.fixture(name="server")
async def line_server(tmp_path) -> AsyncIterator[RunningServer]:
    """A server for the tests of tests/server and tests/cli (which imports this)."""
    async with serving(start_server, str(tmp_path / "relay.db")) as running:
        yield running


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[LineClient]:
    c = await server.connect()
    try:
        yield c
    finally:
        await c.aclose()


@contextlib.contextmanager
def logged(name: str) -> Iterator[list[logging.LogRecord]]:
    """The records logger ``name`` emits meanwhile (DEBUG and up), whatever the logging
    config."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
