"""The WebSocket endpoint frame by frame (relay/server/connections/websocket.py drives wsproto): a
message split into frames is one request, pings are answered, invalid UTF-8 closes with
1007, a compression offer is declined. A raw wsproto client on a real socket; every wait
is bounded."""

from __future__ import annotations

import contextlib

import orjson
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Event,
    Message,
    Ping,
    Pong,
    Request,
    TextMessage,
)
from wsproto.extensions import PerMessageDeflate

from tests.server.conftest import BOUND_S, RunningServer


class RawClient:
    def __init__(self, stream: trio.SocketStream, ws: WSConnection) -> None:
        self.stream = stream
        self.ws = ws
        self.accepted: AcceptConnection | None = None

    @classmethod
    async def open(cls, server: RunningServer, **request) -> RawClient:
        ws = WSConnection(ConnectionType.CLIENT)
        stream = await trio.open_tcp_stream(*server.handle.ws_address)
        client = cls(stream, ws)
        await client.send(Request(host="127.0.0.1", target="/", **request))
        event = await client.next_event()
        assert isinstance(event, AcceptConnection), event
        client.accepted = event
        return client

    async def send(self, event: Event) -> None:
        await self.stream.send_all(self.ws.send(event))

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def next_event(self) -> Event | None:
        """The next event (a whole text message as one), None at EOF."""
        text = ""
        with trio.fail_after(BOUND_S):
            while True:
                for event in self.ws.events():
                    if isinstance(event, TextMessage):
                        text += event.data
                        if not event.message_finished:
                            continue
                        return TextMessage(data=text)
                    return event
                data = await self.stream.receive_some(65536)
                if not data:
                    return None
                self.ws.receive_data(data)

    async def reply(self) -> dict:
        event = await self.next_event()
        assert isinstance(event, TextMessage), event
        return orjson.loads(event.data)


async def test_a_message_in_many_frames_is_one_request(server):
    client = await RawClient.open(server)
    text = orjson.dumps({"op": "submit", "id": 1, "queue": "q", "payload": "é" * 5000}).decode()
    for start in range(0, len(text), 1000):
        last = start + 1000 >= len(text)
        await client.send(Message(data=text[start : start + 1000], message_finished=last))
    assert (await client.reply())["ok"] is True
    await client.send(Message(data='{"op":"ping","id":2}'))
    assert (await client.reply())["id"] == 2


async def test_a_ping_is_answered_with_its_payload(server):
    client = await RawClient.open(server)
    await client.send(Ping(payload=b"are you there"))
    event = await client.next_event()
    assert isinstance(event, Pong) and event.payload == b"are you there"


async def test_invalid_utf8_closes_with_1007(server):
    client = await RawClient.open(server)
    # A text frame (FIN, opcode 1), masked with zeros, holding a lone continuation byte.
    await client.send_raw(bytes([0x81, 0x80 | 1, 0, 0, 0, 0, 0x80]))
    event = await client.next_event()
    assert isinstance(event, CloseConnection) and event.code == 1007


async def test_a_compression_offer_is_declined(server):
    client = await RawClient.open(server, extensions=[PerMessageDeflate()])
    assert client.accepted is not None and client.accepted.extensions == []
    await client.send(Message(data='{"op":"ping","id":1}'))
    assert (await client.reply())["ok"] is True


async def test_a_client_close_is_answered_with_a_close(server):
    client = await RawClient.open(server)
    await client.send(CloseConnection(code=1000))
    event = await client.next_event()
    assert isinstance(event, CloseConnection) and event.code == 1000
    assert await client.next_event() is None  # then the server closes the connection


async def test_a_request_that_is_no_upgrade_or_too_long_is_answered_400(server):
    for request in (
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # no upgrade headers
        b"GET / HTTP/1.1\r\nX-Pad: " + b"x" * 70_000 + b"\r\n\r\n",  # over h11's 16 KiB
    ):
        stream = await trio.open_tcp_stream(*server.handle.ws_address)
        response = b""
        with trio.fail_after(BOUND_S):
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(request)
            with contextlib.suppress(trio.BrokenResourceError):
                while data := await stream.receive_some(4096):
                    response += data
        assert response.startswith(b"HTTP/1.1 400"), response
        await stream.aclose()
