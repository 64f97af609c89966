"""A raw NDJSON connection of the load generators: pre-encoded lines out, replies counted
without parsing them, so that the generator is not what is measured."""

from __future__ import annotations

import itertools
import ssl
from typing import Any

import orjson
import trio

READ_BYTES = 256 * 1024


class Conn:
    """A raw connection: pre-encoded lines out, replies counted (parsed only when asked)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.buffer = b""
        self.ids = itertools.count(1)

    @classmethod
    async def open(cls, address: tuple[str, int], context: ssl.SSLContext | None = None) -> Conn:
        """A connection; with ``context``, over TLS (the handshake done before returning)."""
        stream: trio.abc.Stream = await trio.open_tcp_stream(*address)
        if context is not None:
            stream = trio.SSLStream(stream, context, server_hostname=address[0])
            await stream.do_handshake()
        return cls(stream)

    def line(self, op: str, **fields: Any) -> bytes:
        return orjson.dumps({"op": op, "id": next(self.ids), **fields}) + b"\n"

    async def read_count(self, n: int) -> None:
        """Read ``n`` reply lines; fail on any error reply."""
        got = self.buffer.count(b"\n")
        while got < n:
            data = await self.stream.receive_some(READ_BYTES)
            if not data:
                raise RuntimeError("server closed the connection")
            self.buffer += data
            got = self.buffer.count(b"\n")
        if b'"ok":false' in self.buffer:
            raise RuntimeError(f"error reply: {self.buffer[:300]!r}")
        # Keep what follows the n-th line.
        cut = -1
        for _ in range(n):
            cut = self.buffer.index(b"\n", cut + 1)
        self.buffer = self.buffer[cut + 1 :]

    async def read_replies(self, n: int) -> list[dict[str, Any]]:
        replies = []
        while len(replies) < n:
            while b"\n" not in self.buffer:
                data = await self.stream.receive_some(READ_BYTES)
                if not data:
                    raise RuntimeError("server closed the connection")
                self.buffer += data
            *lines, self.buffer = self.buffer.split(b"\n")
            replies += [orjson.loads(line) for line in lines]
        for reply in replies:
            if not reply.get("ok"):
                raise RuntimeError(f"error reply: {reply}")
        return replies

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        await self.stream.send_all(self.line(op, **fields))
        (reply,) = await self.read_replies(1)
        return reply

    async def aclose(self) -> None:
        await self.stream.aclose()
