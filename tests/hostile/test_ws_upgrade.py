"""The WebSocket endpoint's opening handshake against clients that never complete one,
on a real server: they must not keep the connection slots they took."""

from __future__ import annotations

import trio
from trio.testing import wait_all_tasks_blocked

from relay.protocol import wire
from tests.server.conftest import BOUND_S, start_server

MAX_CONNECTIONS = 4


async def test_a_bad_or_abandoned_handshake_gives_its_slot_back_at_once(tmp_path):
    """Requests that are not a handshake (answered 400) and connections closed before one
    free their connection slot as they end; before, each held it for the handshake's
    10 s, so a few of them a second kept every client out (overloaded)."""
    async with trio.open_nursery() as nursery:
        server = await start_server(
            nursery, str(tmp_path / "relay.db"), limits=wire.Limits(max_connections=MAX_CONNECTIONS)
        )
        assert server.handle.ws_address is not None
        with trio.fail_after(BOUND_S):
            for n in range(MAX_CONNECTIONS):
                stream = await trio.open_tcp_stream(*server.handle.ws_address)
                if n % 2:
                    await stream.send_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
                    answer = b""
                    while chunk := await stream.receive_some(65536):
                        answer += chunk
                    assert answer.startswith(b"HTTP/1.1 400 "), answer
                await stream.aclose()
            await wait_all_tasks_blocked()
        client = await server.connect()
        with trio.fail_after(1.0):  # another client is served at once
            assert (await client.request("ping"))["ok"] is True
        await client.aclose()
        server.handle.shutdown()
