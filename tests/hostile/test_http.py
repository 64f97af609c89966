"""The metrics listener (/healthz, /metrics, the dashboard page) under slow and misdirected
HTTP clients: every case on a real server, over real sockets on loopback.

Linux routes all of 127.0.0.0/8 to the loopback interface, so a client bound to
127.0.0.2, 127.0.0.3, ... stands for another machine: the server tells a connection from
its own machine by its source address being the one it reached (127.0.0.1 to 127.0.0.1).
"""

from __future__ import annotations

import contextlib

import trio

from relay.server.http.admission import (
    HEAD_TIMEOUT_S,
    LOCAL_RESERVE,
    MAX_HTTP_CONNECTIONS,
    MAX_HTTP_PER_ADDRESS,
    MAX_REQUEST_BYTES,
)
from tests.server.conftest import BOUND_S, RunningServer, start_server

# Another client's probe is answered within this, whatever the attackers hold.
ANSWERED_WITHIN_S = 1.0
HALF_SENT = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n"  # the blank line never comes


async def open_from(source: str, address: tuple[str, int]) -> trio.SocketStream:
    with trio.fail_after(BOUND_S):
        return await trio.open_tcp_stream(*address, local_address=source)


async def half_sent(source: str, address: tuple[str, int], count: int) -> list[trio.SocketStream]:
    """``count`` connections from ``source``, each with a request head that never ends."""
    streams = []
    for _ in range(count):
        stream = await open_from(source, address)
        with contextlib.suppress(trio.BrokenResourceError):  # refused and closed already
            await stream.send_all(HALF_SENT)
        streams.append(stream)
    return streams


async def read_all(stream: trio.abc.Stream) -> bytes:
    """Everything until the server closes (a reset counts as a close), bounded."""
    data = b""
    with trio.fail_after(BOUND_S):
        try:
            while chunk := await stream.receive_some(65536):
                data += chunk
        except trio.BrokenResourceError:
            pass
    return data


async def get(
    address: tuple[str, int],
    path: str = "/healthz",
    *,
    source: str = "127.0.0.1",
    host: str = "localhost",
    within: float = BOUND_S,
) -> tuple[int | None, bytes]:
    """One GET: (status, body); status None if the connection was closed unanswered."""
    with trio.fail_after(within):
        stream = await open_from(source, address)
        request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        try:
            await stream.send_all(request.encode())
        except trio.BrokenResourceError:
            return None, b""
        data = await read_all(stream)
        await stream.aclose()
    if not data:
        return None, b""
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def close_all(streams: list[trio.SocketStream]) -> None:
    for stream in streams:
        await trio.aclose_forcefully(stream)


async def test_one_address_cannot_take_every_http_slot(tmp_path):
    """Twice the cap of half-sent requests from one address: another address's /healthz
    is still answered at once (before the per-address limit, 0 of them were)."""
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        address = server.handle.metrics_address
        assert address is not None
        stalled = await half_sent("127.0.0.2", address, 2 * MAX_HTTP_CONNECTIONS)
        try:
            status, body = await get(address, source="127.0.0.3", within=ANSWERED_WITHIN_S)
            assert (status, body) == (200, b"ok\n")
        finally:
            await close_all(stalled)
        server.handle.shutdown()


async def test_a_local_probe_is_answered_while_other_addresses_hold_every_slot(tmp_path):
    """Half-sent requests from 8 other addresses, twice the cap in all: the addresses that
    are not the server's own take every slot they may, and /healthz from the server's own
    machine is still answered at once; at the head deadline the stalled ones are closed
    and the slots free again."""
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        address = server.handle.metrics_address
        assert address is not None
        sources = [f"127.0.0.{n}" for n in range(2, 10)]
        per_source = 2 * MAX_HTTP_CONNECTIONS // len(sources)
        assert per_source >= MAX_HTTP_PER_ADDRESS  # each source fills its own share
        stalled: list[trio.SocketStream] = []
        try:
            began = trio.current_time()
            for source in sources:
                stalled += await half_sent(source, address, per_source)
            # Every slot open to other addresses is taken: one more of them is refused.
            assert (await get(address, source="127.0.0.20"))[0] is None
            status, body = await get(address, within=ANSWERED_WITHIN_S)
            assert (status, body) == (200, b"ok\n")
            # The stalled requests end at their deadline, answered 408.
            with trio.fail_after(HEAD_TIMEOUT_S + BOUND_S):
                answers = [await read_all(stream) for stream in stalled]
            ended = trio.current_time() - began
            # Those admitted (every slot but the reserve) were answered 408, the others
            # closed unanswered at once.
            timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408 ")]
            assert len(timed_out) == MAX_HTTP_CONNECTIONS - LOCAL_RESERVE
            assert sorted(set(answers) - set(timed_out)) == [b""]
            assert ended < HEAD_TIMEOUT_S + 3.0, f"stalled requests held {ended:.1f} s"
            status, _ = await get(address, source="127.0.0.20", within=ANSWERED_WITHIN_S)
            assert status == 200
        finally:
            await close_all(stalled)
        server.handle.shutdown()


async def test_a_request_head_not_done_by_the_deadline_is_answered_408_and_closed(tmp_path):
    """Half a head, or a head trickled a byte at a time (slowloris): closed at the head
    deadline with one line, not held for the whole exchange's 10 s."""
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        address = server.handle.metrics_address
        assert address is not None
        stalled = (await half_sent("127.0.0.2", address, 1))[0]
        trickling = await open_from("127.0.0.3", address)
        began = trio.current_time()

        async def trickle() -> None:
            try:
                for byte in HALF_SENT:
                    await trickling.send_all(bytes([byte]))
                    await trio.sleep(HEAD_TIMEOUT_S / 10)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async with trio.open_nursery() as clients:
            clients.start_soon(trickle)
            for stream in (stalled, trickling):
                answer = await read_all(stream)
                ended = trio.current_time() - began
                assert answer.startswith(b"HTTP/1.1 408 "), answer
                assert answer.endswith(b"\r\n\r\nrequest head not received in time\n")
                assert HEAD_TIMEOUT_S - 0.2 < ended < HEAD_TIMEOUT_S + 1.0, ended
        await close_all([stalled, trickling])
        server.handle.shutdown()


async def test_a_malformed_or_oversized_request_head_gets_one_line(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        address = server.handle.metrics_address
        assert address is not None
        for request, expected in [
            (b"\x16\x03\x01 not http\r\n\r\n", b"HTTP/1.1 400 Bad Request\r\n"),
            (b"GET /healthz HTTP/1.1\r\nX: " + b"a" * MAX_REQUEST_BYTES,
             b"HTTP/1.1 431 Request Header Fields Too Large\r\n"),
        ]:  # fmt: skip
            stream = await open_from("127.0.0.1", address)
            await stream.send_all(request)
            answer = await read_all(stream)
            await stream.aclose()
            assert answer.startswith(expected), answer
            body = answer.partition(b"\r\n\r\n")[2]
            assert body.count(b"\n") == 1 and body.endswith(b"\n"), answer  # one line
        server.handle.shutdown()


# -- DNS rebinding ---------------------------------------------------------------------------


async def test_on_loopback_a_request_for_another_host_is_refused(tmp_path):
    """A page of evil.example, its name pointed at 127.0.0.1, makes the browser send
    ``Host: evil.example``: it gets 421 and no count or queue name; loopback names pass."""
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        client = await server.connect()
        await client.ok("submit", queue="secret-queue-name", payload={})
        address = server.handle.metrics_address
        assert address is not None
        for path in ("/metrics", "/healthz", "/"):
            for host in ("evil.example", "evil.example:7401", "127.0.0.1.evil.example",
                         "localhost.evil.example", "[::1].example", "2130706433"):  # fmt: skip
                status, body = await get(address, path, host=host)
                assert status == 421, (path, host, status)
                assert body.count(b"\n") == 1 and b"queue" not in body, body
        for host in ("localhost", f"localhost:{address[1]}", "LOCALHOST", "127.0.0.1",
                     f"127.0.0.1:{address[1]}", "127.1.2.3", "[::1]", "[::1]:7401"):  # fmt: skip
            status, body = await get(address, "/metrics", host=host)
            assert status == 200, (host, status)
            assert b'queue="secret-queue-name"' in body
        await client.aclose()
        server.handle.shutdown()


async def test_off_loopback_any_host_is_answered(tmp_path):
    """Beyond loopback the Host is not checked: tokens guard /metrics there (and without
    them, --insecure said anyone may read it)."""
    async with trio.open_nursery() as nursery:
        server = await start_server(
            nursery, str(tmp_path / "relay.db"), metrics_host="0.0.0.0", insecure=True
        )
        address = server.handle.metrics_address
        assert address is not None
        status, _ = await get(("127.0.0.1", address[1]), host="evil.example")
        assert status == 200
        server.handle.shutdown()


async def test_a_rebound_page_cannot_open_the_websocket(tmp_path):
    """The WebSocket endpoint needs no Host check of its own: a browser's handshake always
    carries the page's Origin, and a page reached by a name (evil.example, pointed at
    127.0.0.1) is refused by it with 403."""
    async with trio.open_nursery() as nursery:
        server: RunningServer = await start_server(nursery, str(tmp_path / "relay.db"))
        assert server.handle.ws_address is not None and server.handle.metrics_address
        host, port = server.handle.ws_address
        page = f"http://evil.example:{server.handle.metrics_address[1]}"
        with trio.fail_after(BOUND_S):
            stream = await trio.open_tcp_stream(host, port)
            request = (
                f"GET / HTTP/1.1\r\nHost: evil.example:{port}\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                f"Sec-WebSocket-Version: 13\r\nOrigin: {page}\r\n\r\n"
            )
            await stream.send_all(request.encode())
            answer = await read_all(stream)
        assert answer.startswith(b"HTTP/1.1 403 "), answer
        server.handle.shutdown()
