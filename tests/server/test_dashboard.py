"""The dashboard page (GET / on the metrics listener, relay/server/dashboard.py and
dashboard.html): served to anyone with its headers and WebSocket URL."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import AsyncIterator

import pytest
import trio

from relay.server.auth import Role, Tokens, _digest
from relay.server.dashboard import Dashboard
from tests.server.conftest import BOUND_S, RunningServer, start_server
from tests.tls_helpers import tls_files as tls_files  # the fixture
from tests.worker_helpers import serving
from tests.worker_helpers import start_server as start_stoppable

ADMIN = "admin-token-for-dashboard-tests"
WORKER = "worker-token-for-dashboard-tests"
WRONG = "wrong-token-for-dashboard-tests"
TOKENS = Tokens(((_digest(ADMIN), Role.ADMIN), (_digest(WORKER), Role.WORKER)))


# -- over HTTP, without a browser -------------------------------------------------------------


async def http(
    address: tuple[str, int], method: str = "GET", path: str = "/", host: str | None = "relay"
) -> tuple[int, dict[str, str], bytes]:
    """One request: (status, headers by lower-cased name, body)."""
    lines = [f"{method} {path} HTTP/1.1", "Connection: close"]
    if host is not None:
        lines.append(f"Host: {host}")
    with trio.fail_after(BOUND_S):
        stream = await trio.open_tcp_stream("127.0.0.1", address[1])
        async with stream:
            await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *fields = head.decode("latin-1").split("\r\n")
    headers = dict((k.lower(), v.strip()) for k, _, v in (f.partition(":") for f in fields))
    return int(status.split()[1]), headers, body


def websocket_of(body: bytes) -> str:
    match = re.search(rb'data-websocket="([^"]*)"', body)
    assert match is not None, body[:500]
    return match.group(1).decode()


@pytest.fixture
async def exposed(tmp_path) -> AsyncIterator[RunningServer]:
    """Tokens, and the metrics listener on every interface: /metrics needs a token."""

    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tokens=TOKENS, metrics_host="0.0.0.0")

    async with serving(start, str(tmp_path / "relay.db")) as server:
        yield server


async def test_page_needs_no_token_where_metrics_do(exposed):
    address = exposed.handle.metrics_address
    assert address is not None and exposed.handle.ws_address is not None
    status, headers, body = await http(address)
    assert status == 200
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["cache-control"] == "no-store"
    # The WebSocket listens on 127.0.0.1, not where the metrics do: that is its URL.
    url = f"ws://127.0.0.1:{exposed.handle.ws_address[1]}/"
    assert websocket_of(body) == url
    assert b'data-auth="token"' in body
    assert await http(address, "HEAD") == (200, headers, b"")
    # Everything else is as before: a token first.
    for method, path in (("GET", "/metrics"), ("GET", "/healthz"), ("POST", "/")):
        assert (await http(address, method, path))[0] == 401, (method, path)


async def test_page_policy_allows_its_own_script_and_style_and_its_websocket_only(server):
    address = server.handle.metrics_address
    _, headers, body = await http(address, host="127.0.0.1:7401")
    policy = dict(
        (d.split()[0], d.split()[1:]) for d in headers["content-security-policy"].split("; ")
    )
    text = body.decode()
    for tag in ("script", "style"):
        inline = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.S)
        assert len(inline) == 1
        digest = base64.b64encode(hashlib.sha256(inline[0].encode()).digest()).decode()
        assert policy[f"{tag}-src"] == [f"'sha256-{digest}'"], tag
    assert (
        policy["connect-src"]
        == [websocket_of(body)]
        == [f"ws://127.0.0.1:{server.handle.ws_address[1]}/"]
    )
    assert policy["default-src"] == ["'none'"] and policy["frame-ancestors"] == ["'none'"]
    # Self-contained: nothing to load from anywhere, and a size one can read.
    assert not re.search(rb"\b(src|href)=", body) and b"@import" not in body
    assert body.count(b"\n") < 400 and b'data-auth="none"' in body


async def test_page_says_wss_when_the_server_has_tls(tmp_path, tls_files):
    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tls_cert=tls_files.cert, tls_key=tls_files.key)

    async with serving(start, str(tmp_path / "relay.db")) as server:
        # Both listeners on 127.0.0.1: the name the browser used, which the certificate has.
        _, headers, body = await http(server.handle.metrics_address, host="localhost:7401")
    assert websocket_of(body) == f"wss://localhost:{server.handle.ws_address[1]}/"
    assert f"connect-src {websocket_of(body)};" in headers["content-security-policy"]


async def test_page_without_a_websocket_endpoint_connects_nowhere(tmp_path):
    async with serving(
        lambda nursery, db: start_stoppable(nursery, db, metrics_port=0), str(tmp_path / "r.db")
    ) as server:
        assert server.handle.ws_address is None
        _, headers, body = await http(server.handle.metrics_address)
    assert websocket_of(body) == ""
    assert "connect-src 'none'" in headers["content-security-policy"]


@pytest.mark.parametrize(
    ("dashboard", "host_header", "local", "url"),
    [
        # Bound to one address that is not the metrics listener's: that address.
        (Dashboard("0.0.0.0", "127.0.0.1", 7402), b"queue.example:7401", "10.0.0.5",
         "ws://127.0.0.1:7402/"),
        (Dashboard("127.0.0.1", "::1", 7402), b"relay", "127.0.0.1", "ws://[::1]:7402/"),
        # On every interface, or beside the metrics listener: the host the browser used.
        (Dashboard("0.0.0.0", "0.0.0.0", 7402), b"queue.example:7401", "10.0.0.5",
         "ws://queue.example:7402/"),
        (Dashboard("::", "::", 9, tls=True), b"[fd00::5]:7401", "fd00::5", "wss://[fd00::5]:9/"),
        (Dashboard("10.0.0.5", "10.0.0.5", 7402, tls=True), b"queue.example", "10.0.0.5",
         "wss://queue.example:7402/"),
        # No Host header, or one that is not a host: where the request came in.
        (Dashboard("0.0.0.0", "0.0.0.0", 7402), None, "10.0.0.5", "ws://10.0.0.5:7402/"),
        (Dashboard("::", "::", 7402), b'x"><script>', "::1", "ws://[::1]:7402/"),
        (Dashboard("0.0.0.0", "0.0.0.0", 7402), b"a b", "10.0.0.5", "ws://10.0.0.5:7402/"),
        (Dashboard("127.0.0.1"), b"relay", "127.0.0.1", None),
    ],
)  # fmt: skip
def test_websocket_url_names_a_host_the_browser_reaches(dashboard, host_header, local, url):
    headers = [] if host_header is None else [(b"host", host_header)]
    body, _ = dashboard.response(headers, local)
    assert websocket_of(body) == (url or "")
