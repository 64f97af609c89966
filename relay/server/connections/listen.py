"""Opening the server's listening sockets, and ``ListenError``: which one could not be
opened, where, and why.

A listener that cannot be opened stops the server before it serves. The person starting
it needs to know which of the three it was (the job listener, the metrics endpoint, the
WebSocket endpoint), the address it tried, and what to do about it; so the ``OSError`` is
translated here, once, at the socket edge, and nowhere else is an ``OSError`` taken to
mean "cannot listen".
"""

from __future__ import annotations

import errno
import os
import socket

import trio

# The listeners, as ``ListenError.listener`` names them.
JOBS = "jobs"
METRICS = "metrics"
WEBSOCKET = "WebSocket"

# Ports below this one need privileges to bind (CAP_NET_BIND_SERVICE on Linux).
FIRST_UNPRIVILEGED_PORT = 1024


class ListenError(Exception):
    """A listener could not be opened (raised by ``serve`` before it has started).

    Attributes:
        listener: ``JOBS``, ``METRICS`` or ``WEBSOCKET``.
        address: the HOST:PORT it tried, as configured.
        reason: why, and what to do, in a few words.
    """

    def __init__(self, listener: str, address: str, reason: str) -> None:
        super().__init__(f"cannot open the {listener} listener on {address}: {reason}")
        self.listener = listener
        self.address = address
        self.reason = reason


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_problem(exc: OSError, host: str, port: int) -> str:
    """Why binding ``host``:``port`` failed, and what to do, for the person starting it."""
    if isinstance(exc, socket.gaierror):
        return f"{host} is not a known host name ({exc.strerror or exc})"
    if exc.errno == errno.EADDRINUSE:
        return (
            "address already in use: another process listens there; stop it or choose another port"
        )
    if exc.errno == errno.EACCES:
        if 0 < port < FIRST_UNPRIVILEGED_PORT:
            return f"permission denied (ports below {FIRST_UNPRIVILEGED_PORT} need privileges)"
        return "permission denied"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot assign requested address ({host} is not an address of this machine)"
    if exc.errno is not None and exc.errno in errno.errorcode:
        return os.strerror(exc.errno).lower()
    return str(exc) or type(exc).__name__


async def open_listeners(listener: str, host: str, port: int) -> list[trio.SocketListener]:
    """``trio.open_tcp_listeners(port, host=host)``, its failure a ``ListenError`` naming
    ``listener``. The caller owns (and closes) the sockets returned."""
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ListenError(listener, host_port(host, port), listen_problem(exc, host, port)) from exc
