"""The client's side of TLS, and the addresses that ask for it.

"HOST:PORT" connects in plain TCP; "tls://HOST:PORT", or any address given a private CA
(``tls_ca``), connects with TLS, the server's certificate verified for HOST with the
context of ``client_context``. Used by the async client (``open_client``, relay/client/client.py,
whose transport does the handshake on every connection, relay/client/tcp.py) and by the blocking
one (relay/client/blocking.py). The server's side of TLS is relay/server/connections/tls.py.
"""

from __future__ import annotations

import ssl

import trio

# An address that starts with this asks for TLS, verified with the system's trust store.
TLS_SCHEME = "tls://"
# What a plain client is told when the server closed without a byte, as one with TLS does.
TLS_HINT = "if the server uses TLS, connect to tls://HOST:PORT"


def parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" or "tls://HOST:PORT" (see ``uses_tls``)."""
    if isinstance(address, tuple):
        return address
    host, sep, port = address.removeprefix(TLS_SCHEME).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT or tls://HOST:PORT")
    return host.strip("[]"), int(port)


def uses_tls(address: str | tuple[str, int], tls_ca: str | None = None) -> bool:
    """Whether a client of ``address`` speaks TLS: a tls:// address, or a private CA."""
    return tls_ca is not None or (isinstance(address, str) and address.startswith(TLS_SCHEME))


async def _handshake(
    stream: trio.SocketStream, context: ssl.SSLContext, host: str
) -> trio.SSLStream[trio.SocketStream]:
    """The client's side of the TLS handshake, verifying the server's certificate for
    ``host``. Raises the ``ssl`` error (an OSError) that failed it, as a refused connection
    raises its own, or ConnectionResetError if the server closed the connection."""
    tls = trio.SSLStream(stream, context, server_hostname=host)
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as exc:
        await trio.aclose_forcefully(stream)
        cause = exc.__cause__
        # (OpenSSL reports an EOF during the handshake as either of the two.)
        closed = isinstance(cause, ssl.SSLEOFError | ssl.SSLSyscallError)
        if isinstance(cause, ssl.SSLError) and not closed:
            raise cause from None  # e.g. SSLCertVerificationError: the reason is in it
        raise ConnectionResetError(
            "the server closed the connection during the TLS handshake"
        ) from None
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return tls


def client_context(tls_ca: str | None = None) -> ssl.SSLContext:
    """The context a client verifies servers with: the system's trust store, or only the
    CA certificates in the PEM file ``tls_ca``; TLS 1.2 at least, host names checked."""
    context = ssl.create_default_context(cafile=tls_ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
