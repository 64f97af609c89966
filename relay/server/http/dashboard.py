"""The dashboard page (``GET /`` on the metrics listener): where its WebSocket is, and how
it is sent.

The page (dashboard.html, beside this module) is static: it holds no data, and gets
everything over the WebSocket endpoint after a ``hello``, with the token of whoever
opens it. So it is served to anyone, without a token, and the server only fills in two
things: the WebSocket URL to connect to, and whether a token is needed. The URL is also
the one place the page's Content-Security-Policy lets it connect to.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import html
import importlib.resources
import ipaddress
import re

import attrs

# Hosts that mean every interface: the page is then told the host the browser used.
UNSPECIFIED = frozenset({"", "0.0.0.0", "::"})
# A Host header's host (a name, an IPv4 address or a bracketed IPv6 one) and port. Anything
# else is ignored, so the header's text never reaches the page or its headers unchecked.
HOST_HEADER = re.compile(rb"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253})(:[0-9]{1,5})?")
CONTENT_TYPE = b"text/html; charset=utf-8"
# The page's own inline script and style: the only ones its policy allows (by hash).
INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.S)


@attrs.frozen
class Page:
    """The page as loaded: its text with the two markers, and its policy's hashes."""

    text: str
    script_hashes: tuple[str, ...]
    style_hashes: tuple[str, ...]


@functools.cache
def load_page() -> Page:
    """dashboard.html from the package, read once."""
    text = (
        importlib.resources.files("relay.server.http").joinpath("dashboard.html").read_text("utf-8")
    )
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for tag, body in INLINE.findall(text):
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        hashes[tag].append(f"'sha256-{digest}'")
    return Page(text, tuple(hashes["script"]), tuple(hashes["style"]))


def _url_host(host: str) -> str:
    """``host`` as it goes into a URL: an IPv6 address in brackets."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def request_host(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The host of the request's Host header (h11's lower-cased names), if well formed."""
    for name, value in headers:
        if name == b"host":
            match = HOST_HEADER.fullmatch(value.strip())
            return match.group(1).decode("ascii") if match else None
    return None


@attrs.frozen
class Dashboard:
    """What the page is told: the WebSocket endpoint (``ws_port`` None: it is off) and
    whether a token is needed."""

    metrics_host: str
    ws_host: str = "127.0.0.1"
    ws_port: int | None = None  # the port bound (not 0)
    tls: bool = False  # wss://
    tokens: bool = False

    def websocket_url(self, browser_host: str | None, local_host: str) -> str | None:
        """The URL the page connects to. ``browser_host`` is the Host header's host (what
        the browser called this server), ``local_host`` the address the request came in
        on. The WebSocket listener's own host, unless it listens on every interface or
        on the metrics listener's address: then whatever reached this listener reaches
        that one too, and the browser's name for it also matches a TLS certificate."""
        if self.ws_port is None:
            return None
        host = self.ws_host
        if host in UNSPECIFIED or host == self.metrics_host:
            host = browser_host or _url_host(local_host)
        else:
            host = _url_host(host)
        return f"{'wss' if self.tls else 'ws'}://{host}:{self.ws_port}/"

    def response(
        self, headers: list[tuple[bytes, bytes]], local_host: str
    ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """The page's body, and the headers besides its content type, for a request with
        ``headers``."""
        page = load_page()
        url = self.websocket_url(request_host(headers), local_host)
        body = page.text.replace("__RELAY_WEBSOCKET__", html.escape(url or "")).replace(
            "__RELAY_AUTH__", "token" if self.tokens else "none"
        )
        none = "'none'"
        policy = "; ".join([
            "default-src 'none'",
            f"script-src {' '.join(page.script_hashes) or none}",
            f"style-src {' '.join(page.style_hashes) or none}",
            f"connect-src {url or none}",
            "img-src 'none'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ])  # fmt: skip
        return body.encode(), [
            (b"content-security-policy", policy.encode()),
            (b"x-content-type-options", b"nosniff"),
            (b"cache-control", b"no-store"),
            (b"referrer-policy", b"no-referrer"),
        ]
