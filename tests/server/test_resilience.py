"""One client's misfortune stays its own: the server keeps serving everyone else."""

from __future__ import annotations

import socket
import struct

import trio

from tests.server.conftest import BOUND_S, RunningServer


async def reset_connection(address: tuple[str, int]) -> None:
    """Connect, ask once, then close with a TCP reset (SO_LINGER 0)."""
    sock = trio.socket.socket()
    await sock.connect(address)
    await sock.send(b'{"op":"ping","id":1}\n')
    await sock.recv(100)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def test_clients_that_reset_their_connections_do_not_stop_the_server(server: RunningServer):
    with trio.fail_after(BOUND_S):
        bystander = await server.connect()
        for _ in range(5):
            await reset_connection(server.handle.address)
            assert (await bystander.request("ping"))["ok"] is True
        fresh = await server.connect()
        assert (await fresh.request("ping"))["ok"] is True
        stats = await fresh.request("stats")
    assert stats["server"]["connections"] >= 2
