"""Refusals a client without a token can cause, in a flood, against ``relay-trio server``
as a subprocess: its log (JSON lines on stderr) says how many in a few lines, not a line
for each."""

from __future__ import annotations

import math
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from relay.server.http.admission import MAX_HTTP_PER_ADDRESS
from tests.server.conftest import BOUND_S
from tests.server.test_process import ServerProcess, server_process

FLOOD = 500
# Connections a flood keeps open at a time: within what one address may hold (on the
# metrics listener MAX_HTTP_PER_ADDRESS; on the WebSocket one, unauthenticated,
# default_per_address), so each attempt is refused for its Host, Origin or request.
AT_ONCE = {"origin": 8, "host": MAX_HTTP_PER_ADDRESS // 2, "handshake": 8}
SUMMARY_INTERVAL_S = 1.0  # relay.util.log: a line per kind at most this often


def address_of(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def exchange(address: tuple[str, int], request: bytes) -> bytes:
    """Send ``request`` on a new connection; everything the server answers until it closes."""
    with trio.fail_after(BOUND_S):
        stream = await trio.open_tcp_stream(*address)
        async with stream:
            await stream.send_all(request)
            data = b""
            try:
                while chunk := await stream.receive_some(65536):
                    data += chunk
            except trio.BrokenResourceError:
                pass
    return data


def origin_handshake(port: int, origin: str) -> bytes:
    return (
        f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        f"Sec-WebSocket-Version: 13\r\nOrigin: {origin}\r\n\r\n"
    ).encode()


async def flood(count: int, at_once: int, attempt: Callable[[int], Awaitable[None]]) -> float:
    """``attempt(i)`` for i below ``count``, ``at_once`` at a time; the seconds it took."""
    began = trio.current_time()
    room = trio.Semaphore(at_once)

    async def one(i: int) -> None:
        async with room:
            await attempt(i)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    return trio.current_time() - began


def lines_of(server: ServerProcess, name: str, **fields: Any) -> list[dict[str, Any]]:
    return [
        e
        for e in server.events
        if e.get("event") == name and all(e.get(k) == v for k, v in fields.items())
    ]


def failed(server: ServerProcess) -> int:
    return sum(e["failed"] for e in lines_of(server, "websocket.handshake_failed"))


async def test_a_flood_of_refusals_is_logged_in_a_few_lines_with_their_count(tmp_path):
    """500 refused WebSocket origins (each with 200 characters of the client's text), 500
    HTTP requests for another Host, 500 requests to the WebSocket port that are no
    handshake: each kind a line a second at most, whose counts add up to every refusal
    (before: a WARNING line per refused origin)."""
    async with server_process(
        tmp_path / "relay.db", "--metrics-address", "127.0.0.1:0", "--ws-address", "127.0.0.1:0"
    ) as server:
        (started,) = lines_of(server, "server.started")
        ws, metrics = address_of(started["websocket"]), address_of(started["metrics"])
        evil = "http://evil.example:7401/" + "x" * 200

        async def refused_origin(i: int) -> None:
            answer = await exchange(ws, origin_handshake(ws[1], f"{evil}{i}"))
            assert answer.startswith(b"HTTP/1.1 403 "), answer

        async def refused_host(i: int) -> None:
            request = f"GET /metrics HTTP/1.1\r\nHost: evil{i}.example\r\n\r\n".encode()
            answer = await exchange(metrics, request)
            assert answer.startswith(b"HTTP/1.1 421 "), answer

        async def not_a_handshake(i: int) -> None:
            answer = await exchange(ws, f"GET /{i} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
            assert answer.startswith(b"HTTP/1.1 400 "), answer

        took = {
            "origin": await flood(FLOOD, AT_ONCE["origin"], refused_origin),
            "host": await flood(FLOOD, AT_ONCE["host"], refused_host),
            "handshake": await flood(FLOOD, AT_ONCE["handshake"], not_a_handshake),
        }
        # A refusal past the summary's interval writes the line with the rest of the count.
        await trio.sleep(SUMMARY_INTERVAL_S + 0.1)
        await refused_origin(FLOOD)
        await refused_host(FLOOD)
        await not_a_handshake(FLOOD)
        # Its line may follow the answer (written as the handshake's reader ends).
        with trio.fail_after(BOUND_S):
            while failed(server) < FLOOD + 1:  # noqa: ASYNC110 (another process's log)
                await trio.sleep(0.05)
        server.process.send_signal(signal.SIGTERM)
        assert await server.wait(BOUND_S) == 0

    for kind, lines, count in [
        ("origin", lines_of(server, "websocket.origin_refused"), "refused"),
        ("host", lines_of(server, "http.refused", reason="host_not_loopback"), "refused"),
        ("handshake", lines_of(server, "websocket.handshake_failed"), "failed"),
    ]:
        # A line when the flood begins, one a second during it, one after it.
        assert 1 < len(lines) <= math.ceil(took[kind] / SUMMARY_INTERVAL_S) + 2, (kind, lines)
        assert sum(line[count] for line in lines) == FLOOD + 1, (kind, lines)
    for line in lines_of(server, "websocket.origin_refused"):
        assert len(line["origin"]) <= 100
