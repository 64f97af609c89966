"""What an unauthenticated connection may make the server hold (issue: a WebSocket one held
8-17 MB, as trio-websocket counted a message's characters, not its bytes): before its
hello only a hello-sized line (wire.MAX_HELLO_BYTES) is read, on TCP and WebSocket alike,
in bytes; a longer one is frame_too_large and closes the connection (WebSocket: 1009).
Memory is measured with tracemalloc around a flood of unfinished lines and messages of
4-byte UTF-8 characters. Every wait is bounded."""

from __future__ import annotations

import contextlib
import functools
import gc
import tracemalloc
from collections.abc import AsyncIterator

import orjson
import trio
from trio_websocket import ConnectionClosed, connect_websocket
from wsproto import ConnectionType, WSConnection
from wsproto.connection import Connection
from wsproto.events import AcceptConnection, Message, Request

from relay.protocol import wire
from relay.server.connections import websocket
from relay.server.requests.auth import Role, Tokens, _digest
from tests.server.conftest import BOUND_S, RunningServer, start_server
from tests.worker.helpers import serving

TOKEN = "producer-token-for-memory-tests"
TOKENS = Tokens(((_digest(TOKEN), Role.PRODUCER),))
# One 4-byte UTF-8 character: trio-websocket counted it as one toward its message limit.
WIDE = "\U0001f600"
CONNECTIONS = 16
SENT_BYTES = 2 * 1024 * 1024  # per connection, in pieces, never a complete line
PIECE_BYTES = 64 * 1024
# What the flood may add to the server's memory at its peak, all connections together:
# each holds a hello-sized line, and while it is read or lingers a few copies of one read
# (64 KiB: the bytes read, unmasked, decoded, encoded), besides its session's own state.
# (Measured: ~3.7 MiB over WebSocket, ~2.4 MiB over TCP; before the hello-sized limit,
# ~17-18 MiB when each sent 1 MiB.)
BOUND_BYTES = CONNECTIONS * 512 * 1024


@contextlib.asynccontextmanager
async def guarded_server(tmp_path) -> AsyncIterator[RunningServer]:
    start = functools.partial(start_server, tokens=TOKENS, hello_timeout_ms=30_000)
    async with serving(start, str(tmp_path / "relay.db")) as server:
        yield server


async def open_ws(server: RunningServer):
    with trio.fail_after(BOUND_S):
        return await connect_websocket(
            server.nursery, *server.handle.ws_address, "/", use_ssl=False
        )


async def closed_with(ws) -> tuple[list[dict], int]:
    """The replies until the server closed, and its close code."""
    replies = []
    with trio.fail_after(BOUND_S):
        while True:
            try:
                replies.append(orjson.loads(await ws.get_message()))
            except ConnectionClosed as exc:
                return replies, exc.reason.code


# -- the hello-sized limit, in bytes -------------------------------------------------------


async def test_before_hello_a_websocket_message_of_wide_characters_over_4_kib_is_refused(
    tmp_path,
):
    async with guarded_server(tmp_path) as server:
        ws = await open_ws(server)
        # 1,100 characters: far below any character count, 4,400 bytes in UTF-8.
        await ws.send_message(orjson.dumps({"op": "hello", "client": WIDE * 1100}).decode())
        replies, code = await closed_with(ws)
        assert [r["error"]["code"] for r in replies] == ["frame_too_large"]
        assert "4096 bytes before a hello" in replies[0]["error"]["message"]
        assert code == websocket.TOO_BIG


async def test_before_hello_a_tcp_line_over_4_kib_is_refused(tmp_path):
    async with guarded_server(tmp_path) as server:
        client = await server.connect()
        await client.send_raw(b'{"op":"hello","client":"' + b"x" * wire.MAX_HELLO_BYTES)
        error = orjson.loads(await client.read_line())["error"]
        assert error["code"] == "frame_too_large"
        assert await client.at_eof()
        await client.aclose()


async def test_after_hello_the_frame_limit_applies_even_in_the_same_write(tmp_path):
    """A hello and a large request sent together: the limit rises with the hello."""
    async with guarded_server(tmp_path) as server:
        client = await server.connect()
        big = {"op": "submit", "id": 2, "queue": "q", "payload": "x" * 100_000}
        await client.send_raw(
            orjson.dumps({"op": "hello", "id": 1, "token": TOKEN}) + b"\n" + orjson.dumps(big)
            + b"\n"
        )  # fmt: skip
        assert orjson.loads(await client.read_line())["ok"] is True
        assert orjson.loads(await client.read_line())["ok"] is True
        await client.aclose()
        ws = await open_ws(server)
        await ws.send_message(orjson.dumps({"op": "hello", "id": 1, "token": TOKEN}).decode())
        assert orjson.loads(await ws.get_message())["ok"] is True
        await ws.send_message(orjson.dumps(big).decode())
        assert orjson.loads(await ws.get_message())["ok"] is True
        # The frame limit counts bytes: fewer characters than it, more bytes.
        wide = WIDE * (wire.Limits().max_frame_bytes // 4 + 1)
        await ws.send_message(orjson.dumps({"op": "ping", "id": 3, "pad": wide}).decode())
        replies, code = await closed_with(ws)
        assert [r["error"]["code"] for r in replies] == ["frame_too_large"]
        assert code == websocket.TOO_BIG


# -- memory --------------------------------------------------------------------------------


def _websocket_opening() -> tuple[WSConnection, bytes]:
    ws = WSConnection(ConnectionType.CLIENT)
    return ws, ws.send(Request(host="127.0.0.1", target="/"))


async def _flood_websocket(address: tuple[str, int], pieces: list[bytes], sent: list[int]):
    """Open a WebSocket and send ``pieces`` (frames of one message that never ends)
    until the server closes the connection."""
    ws, opening = _websocket_opening()
    stream = await trio.open_tcp_stream(*address)
    try:
        await stream.send_all(opening)
        response = b""
        while b"\r\n\r\n" not in response:
            response += await stream.receive_some(4096)
        ws.receive_data(response)
        assert any(isinstance(e, AcceptConnection) for e in ws.events())
        for piece in pieces:
            await stream.send_all(piece)
            sent[0] += len(piece)
    except trio.BrokenResourceError:
        pass  # closed by the server
    finally:
        await trio.aclose_forcefully(stream)


async def _flood_tcp(address: tuple[str, int], pieces: list[bytes], sent: list[int]):
    stream = await trio.open_tcp_stream(*address)
    try:
        for piece in pieces:
            await stream.send_all(piece)
            sent[0] += len(piece)
    except trio.BrokenResourceError:
        pass
    finally:
        await trio.aclose_forcefully(stream)


def _websocket_pieces() -> list[bytes]:
    """One unfinished text message of 4-byte characters, as frames of PIECE_BYTES (masked,
    as a client's are)."""
    framing = Connection(ConnectionType.CLIENT)
    chars = WIDE * (PIECE_BYTES // 4)
    return [
        framing.send(Message(data=chars, message_finished=False))
        for _ in range(SENT_BYTES // PIECE_BYTES)
    ]


async def _peak_growth(server: RunningServer, flood, address, pieces: list[bytes]) -> int:
    """Bytes the server allocated at most, beyond what it held, while CONNECTIONS clients
    sent ``pieces`` each (the pieces are made before, so the clients allocate little)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sent = [0]
        with trio.fail_after(BOUND_S * 3):
            async with trio.open_nursery() as nursery:
                for _ in range(CONNECTIONS):
                    nursery.start_soon(flood, address, pieces, sent)
        # Until the server has closed them all, having read what they sent (the clients
        # are done sending: a server that keeps them waits out this bound).
        with trio.move_on_after(BOUND_S / 2):
            while await _connections(server) > 1:  # noqa: ASYNC110 (polling: nothing to wait on)
                await trio.sleep(0.05)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sent[0] > 0
    return peak - before


async def _connections(server: RunningServer) -> int:
    client = await server.connect()
    try:
        await client.ok("hello", token=TOKEN)
        return (await client.ok("stats"))["server"]["connections"]
    finally:
        await client.aclose()


async def test_unauthenticated_websockets_hold_no_more_than_a_hello_sized_line(tmp_path):
    pieces = _websocket_pieces()
    async with guarded_server(tmp_path) as server:
        growth = await _peak_growth(server, _flood_websocket, server.handle.ws_address, pieces)
    assert growth < BOUND_BYTES, f"{growth / 2**20:.1f} MiB for {CONNECTIONS} connections"


async def test_unauthenticated_tcp_connections_hold_no_more_than_a_hello_sized_line(tmp_path):
    piece = b'{"op":"hello","client":"' + (WIDE * (PIECE_BYTES // 4)).encode()[: PIECE_BYTES - 24]
    pieces = [piece] * (SENT_BYTES // PIECE_BYTES)
    async with guarded_server(tmp_path) as server:
        growth = await _peak_growth(server, _flood_tcp, server.handle.address, pieces)
    assert growth < BOUND_BYTES, f"{growth / 2**20:.1f} MiB for {CONNECTIONS} connections"
