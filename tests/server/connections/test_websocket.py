"""The WebSocket endpoint: what only a WebSocket has (text and binary frames, close codes,
the opening handshake), and that it shares the TCP listener's cap, access control,
TLS and shutdown. The contract itself runs over both transports in test_protocol.py."""

from __future__ import annotations

import ssl

import orjson
import pytest
import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, connect_websocket, open_websocket

from relay.server.connections import websocket
from relay.server.requests.auth import Role, Tokens, _digest
from relay.server.serve import ServerConfig, serve
from tests.server.conftest import BOUND_S, RunningServer, start_server
from tests.server.test_protocol import custom_server
from tests.tls_helpers import tls_files as tls_files  # the fixture

ADMIN = "admin-token-for-websocket-tests"
PRODUCER = "producer-token-for-websocket-tests"
TOKENS = Tokens(((_digest(ADMIN), Role.ADMIN), (_digest(PRODUCER), Role.PRODUCER)))


async def open_ws(server: RunningServer, **options):
    host, port = server.handle.ws_address
    with trio.fail_after(BOUND_S):
        return await connect_websocket(server.nursery, host, port, "/", use_ssl=False, **options)


async def refused_with(server: RunningServer) -> int | None:
    """The HTTP status a WebSocket is refused with at its opening handshake, or None."""
    host, port = server.handle.ws_address
    try:
        with trio.fail_after(BOUND_S):
            async with open_websocket(host, port, "/", use_ssl=False):
                return None
    except ConnectionRejected as exc:
        return exc.status_code


async def until_accepted(server: RunningServer) -> None:
    """Wait (bounded) until the server takes a WebSocket again (it frees a slot when it
    has seen the previous connection close)."""
    with trio.fail_after(BOUND_S):
        while await refused_with(server) is not None:  # noqa: ASYNC110 (polling: nothing to wait on)
            await trio.sleep(0.01)


async def ask(ws, **request) -> dict:
    await ws.send_message(orjson.dumps(request).decode())
    with trio.fail_after(BOUND_S):
        return orjson.loads(await ws.get_message())


async def closed_with(ws) -> int:
    """The close code, once the server has closed (every message before it is read)."""
    with trio.fail_after(BOUND_S):
        while True:
            try:
                await ws.get_message()
            except ConnectionClosed as exc:
                return exc.reason.code


async def test_one_request_per_text_message_even_with_newlines_inside(server):
    ws = await open_ws(server)
    # A newline is JSON whitespace: the message is still one request.
    await ws.send_message('{"op":"submit",\n"id":1,\n"queue":"q","payload":{"a":\n1}}')
    with trio.fail_after(BOUND_S):
        reply = orjson.loads(await ws.get_message())
    assert reply["ok"] is True and reply["id"] == 1
    assert (await ask(ws, op="inspect", id=2, job_id=reply["job_id"]))["job"]["payload"] == {"a": 1}
    await ws.aclose()


async def test_a_binary_frame_is_bad_request_and_closes_with_1003(server):
    ws = await open_ws(server)
    assert (await ask(ws, op="ping", id=1))["ok"] is True
    await ws.send_message(b'{"op":"ping","id":2}')
    with trio.fail_after(BOUND_S):
        reply = orjson.loads(await ws.get_message())
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
    assert await closed_with(ws) == websocket.UNSUPPORTED


async def test_a_message_over_max_frame_bytes_is_frame_too_large_and_closes_with_1009(server):
    ws = await open_ws(server)
    big = '{"op":"ping","id":1,"pad":"' + "x" * server.config.limits.max_frame_bytes + '"}'
    await ws.send_message(big)
    with trio.fail_after(BOUND_S):
        reply = orjson.loads(await ws.get_message())
    assert reply["error"]["code"] == "frame_too_large"
    assert await closed_with(ws) == websocket.TOO_BIG
    ws2 = await open_ws(server)  # the server serves others on
    assert (await ask(ws2, op="ping", id=1))["ok"] is True
    await ws2.aclose()


async def test_with_tokens_a_websocket_says_hello_first_and_keeps_to_its_role(tmp_path):
    async with custom_server(tmp_path, tokens=TOKENS) as server:
        ws = await open_ws(server)
        reply = await ask(ws, op="ping", id=1)
        assert reply["error"]["code"] == "unauthorized"
        assert await closed_with(ws) == websocket.POLICY

        ws = await open_ws(server)
        assert (await ask(ws, op="hello", id=1, token=PRODUCER))["role"] == "producer"
        assert (await ask(ws, op="submit", id=2, queue="q", payload=1))["ok"] is True
        refused = await ask(ws, op="lease", id=3, queues=["q"], worker_id="w")
        assert refused["error"]["code"] == "unauthorized"
        assert (await ask(ws, op="ping", id=4))["ok"] is True  # still open
        await ws.aclose()


async def test_the_websocket_listener_shares_the_connection_cap(tmp_path):
    async with custom_server(tmp_path, limits=_limits(max_connections=1)) as server:
        tcp = await server.connect()
        assert (await tcp.ok("ping"))["ok"] is True  # holds the one slot
        assert await refused_with(server) == 503
        await tcp.aclose()
        await until_accepted(server)
        ws = await open_ws(server)
        assert (await ask(ws, op="ping", id=1))["ok"] is True
        await ws.aclose()


async def test_a_stalled_opening_handshake_is_closed_and_frees_its_slot(tmp_path, monkeypatch):
    monkeypatch.setattr(websocket, "HANDSHAKE_TIMEOUT_S", 0.2)
    async with custom_server(tmp_path, limits=_limits(max_connections=1)) as server:
        stalled = await trio.open_tcp_stream(*server.handle.ws_address)  # sends nothing
        with trio.fail_after(BOUND_S):
            assert await stalled.receive_some(1024) == b""  # closed by the server
        await stalled.aclose()
        await until_accepted(server)
        ws = await open_ws(server)
        assert (await ask(ws, op="ping", id=1))["ok"] is True
        await ws.aclose()


async def test_shutdown_closes_websockets_with_1001_within_the_grace_period(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"), shutdown_timeout_ms=2000)
        ws = await open_ws(server)
        await ws.send_message(
            orjson.dumps(
                {"op": "lease", "id": 1, "queues": ["none"], "worker_id": "w", "wait_ms": 30_000}
            ).decode()
        )
        # Answered after the lease's empty claim was delivered: the lease is parked by then.
        assert (await ask(ws, op="stats", id=2))["ok"] is True
        started = trio.current_time()
        server.handle.shutdown()
        with trio.fail_after(BOUND_S):
            reply = orjson.loads(await ws.get_message())
        assert reply["jobs"] == []  # a parked long-poll is answered at shutdown
        assert await closed_with(ws) == websocket.GOING_AWAY
        assert trio.current_time() - started < 2 + 1  # the grace period, and the close


def test_a_websocket_listener_beyond_loopback_without_tokens_is_refused(tmp_path):
    from relay.server.requests.auth import ExposureError

    config = ServerConfig(
        db=str(tmp_path / "relay.db"), port=0, metrics_port=None, ws_host="0.0.0.0", ws_port=0
    )

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, config)

    with pytest.raises(BaseExceptionGroup) as caught:
        trio.run(main)
    assert caught.group_contains(ExposureError, match="websocket")
    assert not (tmp_path / "relay.db").exists()


async def test_wss_with_the_servers_certificate(tmp_path, tls_files):
    async with custom_server(tmp_path, **tls_files.server_options()) as server:
        context = ssl.create_default_context(cafile=tls_files.ca)
        port = server.handle.ws_address[1]
        with trio.fail_after(BOUND_S):
            ws = await connect_websocket(server.nursery, "localhost", port, "/", use_ssl=context)
        assert (await ask(ws, op="ping", id=1))["ok"] is True
        await ws.aclose()
        untrusting = ssl.create_default_context()  # the system's store: no such CA
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        secured = trio.SSLStream(raw, untrusting, server_hostname="localhost")
        with trio.fail_after(BOUND_S), pytest.raises(trio.BrokenResourceError) as caught:
            await secured.do_handshake()
        assert isinstance(caught.value.__cause__, ssl.SSLCertVerificationError)
        await trio.aclose_forcefully(secured)
        ws = await connect_websocket(server.nursery, "localhost", port, "/", use_ssl=context)
        assert (await ask(ws, op="ping", id=2))["ok"] is True  # others are served on
        await ws.aclose()


def _limits(**fields):
    from relay.protocol import wire

    return wire.Limits(**fields)


# -- which pages may open a WebSocket ------------------------------------------------------


async def status_with_origin(server: RunningServer, origin: str) -> int | None:
    """The HTTP status a handshake from a page of ``origin`` is refused with, or None."""
    host, port = server.handle.ws_address
    try:
        with trio.fail_after(BOUND_S):
            async with open_websocket(
                host, port, "/", use_ssl=False, extra_headers=[(b"origin", origin.encode())]
            ) as ws:
                assert (await ask(ws, op="ping", id=1))["ok"] is True
                return None
    except ConnectionRejected as exc:
        return exc.status_code


async def test_only_the_dashboards_page_and_allowed_origins_may_open_a_websocket(tmp_path):
    async with custom_server(tmp_path, ws_origins=("https://ops.example.com",)) as server:
        page_port = server.handle.metrics_address[1]
        # The dashboard's own page, as the browser reached it (the handshake's Host).
        assert await status_with_origin(server, f"http://127.0.0.1:{page_port}") is None
        assert await status_with_origin(server, f"http://localhost:{page_port}") is None
        assert await status_with_origin(server, "https://ops.example.com") is None
        for foreign in (
            "https://evil.example",  # another site's page
            f"http://127.0.0.1:{page_port + 1}",  # another port on this host: not the page
            "https://ops.example.com:8443",  # not the allowed origin exactly
            "null",  # a sandboxed frame, a file
        ):
            assert await status_with_origin(server, foreign) == 403, foreign
        # Refused at the handshake: no session was opened, everyone else is served.
        c = await server.connect()
        assert (await c.ok("ping"))["ok"] is True
        await c.aclose()


@pytest.mark.parametrize(
    ("origin", "local", "permitted"),
    [
        (None, "127.0.0.1", True),  # not a browser
        ("http://127.0.0.1:7401", "127.0.0.1", True),
        ("http://127.0.0.1:7401", "::ffff:127.0.0.1", True),  # a dual-stack socket
        ("http://[::1]:7401", "::1", True),
        ("http://localhost:7401", "127.0.0.1", True),
        ("http://localhost:7401", "10.0.0.5", False),  # localhost is not this address
        ("http://10.0.0.5:7401", "10.0.0.5", True),  # the page reached by its address
        ("http://10.0.0.6:7401", "10.0.0.5", False),  # another machine's page
        # DNS rebinding: a name its owner points at this server.
        ("http://rebind.example:7401", "10.0.0.5", False),
        ("http://127.0.0.1:80", "127.0.0.1", False),
        ("http://127.0.0.1", "127.0.0.1", False),  # port 80 by default
        ("ftp://127.0.0.1:7401", "127.0.0.1", False),
        ("http://127.0.0.1:99999", "127.0.0.1", False),  # not a port
        ("null", "127.0.0.1", False),
        ("https://ops.example.com", "10.0.0.5", True),  # allowed by name
    ],
)
def test_origins_permit_the_page_by_address_and_named_origins_only(origin, local, permitted):
    origins = websocket.Origins(frozenset({"https://ops.example.com"}), page_port=7401)
    assert origins.permit(origin, local) is permitted
