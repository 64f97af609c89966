"""Unauthenticated floods (issue: one host took every connection slot with idle sockets):
the pools of connections that have not said hello (relay/server/connections/prehello.py), per source
address and server-wide, and their deadline, on a real server with tokens over TCP,
WebSocket and TLS. Linux routes all of 127.0.0.0/8 to loopback, so 127.0.0.N are the
"hosts". Every wait is bounded."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator

import orjson
import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed, wrap_client_stream

from relay.protocol import wire
from relay.server.requests.auth import Role, Tokens, _digest
from tests.server.conftest import BOUND_S, LineClient, RunningServer, logged, start_server
from tests.server.test_process import server_process
from tests.tls_helpers import TlsFiles, open_tls_line_client
from tests.tls_helpers import tls_files as tls_files  # the fixture
from tests.worker.helpers import serving

TOKEN = "worker-token-for-prehello-tests"
TOKENS = Tokens(((_digest(TOKEN), Role.WORKER),))
MAX_CONNECTIONS = 32
PER_ADDRESS = 4
POOL = 8
# A legitimate client's hello is answered within this, whatever the flood (generous: the
# machine is shared; unloaded it takes a few milliseconds).
ANSWERED_S = 2.0


@contextlib.asynccontextmanager
async def flooded_server(tmp_path, **overrides) -> AsyncIterator[RunningServer]:
    options = {
        "tokens": TOKENS,
        "limits": wire.Limits(max_connections=MAX_CONNECTIONS),
        "max_prehello": POOL,
        "max_prehello_per_address": PER_ADDRESS,
        "hello_timeout_ms": 30_000,  # the idle sockets stay for the whole test
    } | overrides
    async with serving(functools.partial(start_server, **options), str(tmp_path / "r.db")) as srv:
        yield srv


async def connect_from(source: str, address: tuple[str, int]) -> trio.SocketStream:
    sock = trio.socket.socket()
    try:
        await sock.bind((source, 0))
        with trio.fail_after(BOUND_S):
            await sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def idle_sockets(source: str, address: tuple[str, int], n: int) -> list[trio.SocketStream]:
    """``n`` connections from ``source`` that send nothing, each accepted (or refused) by
    the server before the next is opened."""
    streams = []
    for _ in range(n):
        streams.append(await connect_from(source, address))
        await trio.testing.wait_all_tasks_blocked()
    return streams


async def first_line(stream: trio.SocketStream) -> bytes:
    """What the server sends before closing (b"" if it sends nothing), bounded."""
    data = b""
    with trio.fail_after(BOUND_S):
        while chunk := await stream.receive_some(4096):
            data += chunk
    return data


async def hello_from(source: str, server: RunningServer) -> float:
    """Connect from ``source`` and say hello; how long until it was answered."""
    started = trio.current_time()
    client = LineClient(await connect_from(source, server.handle.address))
    try:
        reply = await client.request("hello", token=TOKEN)
        assert reply["ok"] is True, reply
        assert (await client.ok("ping"))["ok"] is True
        return trio.current_time() - started
    finally:
        await client.aclose()


async def close_all(streams: list[trio.SocketStream]) -> None:
    for stream in streams:
        await trio.aclose_forcefully(stream)


async def test_one_address_cannot_hold_more_than_its_share_before_hello(tmp_path):
    async with flooded_server(tmp_path) as server:
        with logged("relay.listener") as records:
            flood = await idle_sockets("127.0.0.1", server.handle.address, MAX_CONNECTIONS)
            # Another host's client is answered at once; so are the held sockets' peers
            # told why the rest were refused.
            assert await hello_from("127.0.0.2", server) < ANSWERED_S
            refused = flood[PER_ADDRESS:]
            for stream in refused[:3]:
                line = orjson.loads(await first_line(stream))
                assert line["error"]["code"] == "overloaded"
                assert "from one address (max 4)" in line["error"]["message"]
        await close_all(flood)
    refusals = [r for r in records if r.getMessage() == "connection.refused"]
    assert 1 <= len(refusals) <= 2, "refusals are logged in summary"
    assert sum(r.fields["refused"] for r in refusals) <= MAX_CONNECTIONS - PER_ADDRESS
    assert refusals[0].fields["reason"] == "max_prehello_per_address"


async def test_when_the_pool_is_full_flooding_addresses_give_way_to_a_new_client(tmp_path):
    async with flooded_server(tmp_path) as server:
        address = server.handle.address
        # Authenticated before the flood: never counted against the pools.
        workers = [LineClient(await connect_from("127.0.0.9", address)) for _ in range(3)]
        for worker in workers:
            assert (await worker.request("hello", token=TOKEN))["ok"] is True
        flood = []
        for host in range(10, 10 + MAX_CONNECTIONS // PER_ADDRESS):  # 8 hosts, 4 each
            flood += await idle_sockets(f"127.0.0.{host}", address, PER_ADDRESS)
        # 32 idle sockets from 8 hosts fill max_connections without the pools; with them,
        # at most POOL stay, and each new client takes the place of a flooding one.
        for _ in range(3):
            assert await hello_from("127.0.0.2", server) < ANSWERED_S
        for worker in workers:
            assert (await worker.ok("ping"))["ok"] is True
        client = await server.connect()
        await client.ok("hello", token=TOKEN)
        stats = await client.ok("stats")
        assert stats["server"]["connections"] <= POOL + len(workers) + 1
        await client.aclose()
        await close_all(flood)
        for worker in workers:
            await worker.aclose()


async def test_the_hello_deadline_closes_idle_connections_and_frees_their_places(tmp_path):
    deadline_s = 0.3
    async with flooded_server(tmp_path, hello_timeout_ms=int(deadline_s * 1000)) as server:
        with logged("relay.listener") as records:
            started = trio.current_time()
            tcp = await idle_sockets("127.0.0.1", server.handle.address, PER_ADDRESS - 1)
            ws = await idle_sockets("127.0.0.1", server.handle.ws_address, 1)  # no handshake
            for stream in tcp + ws:
                assert await first_line(stream) == b""  # closed, without a word
            assert deadline_s <= trio.current_time() - started < deadline_s + BOUND_S / 2
            # Their places are free again: the same address is served.
            assert await hello_from("127.0.0.1", server) < ANSWERED_S
            await close_all(tcp + ws)
    timeouts = [r for r in records if r.getMessage() == "connection.hello_timeout"]
    assert 1 <= len(timeouts) <= 2, "hello timeouts are logged in summary"


async def test_a_websocket_flood_shares_the_pools_and_is_refused_with_503(tmp_path):
    async with flooded_server(tmp_path) as server:
        flood = await idle_sockets("127.0.0.1", server.handle.ws_address, 2 * PER_ADDRESS)
        response = await first_line(flood[-1])
        assert response.startswith(b"HTTP/1.1 503")
        assert b"from one address (max 4)" in response
        # A TCP connection from the same address is refused too: the pools are shared.
        (tcp,) = await idle_sockets("127.0.0.1", server.handle.address, 1)
        assert b"overloaded" in await first_line(tcp)
        # Another host's WebSocket client is served.
        stream = await connect_from("127.0.0.2", server.handle.ws_address)
        async with trio.open_nursery() as nursery:
            with trio.fail_after(ANSWERED_S):
                ws = await wrap_client_stream(nursery, stream, "127.0.0.1", "/")
                await ws.send_message(orjson.dumps({"op": "hello", "token": TOKEN}).decode())
                assert orjson.loads(await ws.get_message())["ok"] is True
            with contextlib.suppress(ConnectionClosed):
                await ws.aclose()
        await close_all([*flood, tcp])


async def test_stalled_tls_handshakes_count_before_hello_and_end_at_its_deadline(
    tmp_path, tls_files: TlsFiles
):
    deadline_s = 0.3
    async with flooded_server(
        tmp_path, hello_timeout_ms=int(deadline_s * 1000), **tls_files.server_options()
    ) as server:
        stalled = await idle_sockets("127.0.0.1", server.handle.address, 2 * PER_ADDRESS)
        # Over the per-address pool: closed at once (no line without a handshake).
        assert await first_line(stalled[-1]) == b""
        started = trio.current_time()
        # The others are closed at the deadline, mid-handshake.
        for stream in stalled[:PER_ADDRESS]:
            assert await first_line(stream) == b""
        assert trio.current_time() - started < deadline_s + BOUND_S / 2
        await trio.testing.wait_all_tasks_blocked()  # (their tasks have ended)
        client = await open_tls_line_client(server.handle.address, tls_files)
        assert (await client.request("hello", token=TOKEN))["ok"] is True
        await client.aclose()
        await close_all(stalled)


@pytest.mark.parametrize("transport", ["tcp", "websocket"])
async def test_without_tokens_connections_never_count_once_ready(tmp_path, transport):
    """Without tokens a connection has its role once its transport is ready: many open
    connections from one address are all served."""
    async with flooded_server(tmp_path, tokens=None) as server:
        clients = [await server.connect_by(transport) for _ in range(3 * PER_ADDRESS)]
        for client in clients:
            assert (await client.ok("ping"))["ok"] is True
        for client in clients:
            await client.aclose()


async def test_the_command_line_sets_the_pools_and_the_deadline(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"worker {TOKEN}\n")
    args = ["--auth-token-file", str(tokens), "--max-prehello-per-address", "1",
            "--hello-timeout-ms", "500"]  # fmt: skip
    async with server_process(tmp_path / "relay.db", *args) as server:
        assert server.address is not None
        held, refused = await idle_sockets("127.0.0.1", server.address, 2)
        line = orjson.loads(await first_line(refused))
        assert "from one address (max 1)" in line["error"]["message"]
        started = trio.current_time()
        assert await first_line(held) == b""  # closed at the hello deadline
        assert trio.current_time() - started < 0.5 + BOUND_S / 2
        await close_all([held, refused])
