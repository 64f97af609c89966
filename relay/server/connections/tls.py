"""TLS for the job listener: a server context from certificate and key files, and the
handshake of one accepted connection.

The context is made once, before anything listens (``server_context``), so that a missing
file, a file that is not PEM or a key that does not match its certificate stops the
server at start rather than failing every handshake. Any listener that speaks TLS (the
TCP listener; a WebSocket listener could take the same context) wraps its connections
with it. The metrics endpoint stays plain HTTP.
"""

from __future__ import annotations

import ssl

import trio

# How long a client has to complete its handshake. A connection holds a slot of
# max_connections while it handshakes, so a client that connects and sends nothing must
# not hold it for long; 10 s covers a handshake over a slow, lossy link many times over.
HANDSHAKE_TIMEOUT_MS = 10_000


class TlsConfigError(Exception):
    """The certificate or key at ``path`` cannot be used, and why (``problem``)."""

    def __init__(self, what: str, path: str, problem: str) -> None:
        super().__init__(f"cannot load TLS {what} {path}: {problem}")
        self.what, self.path, self.problem = what, path, problem


class HandshakeFailed(Exception):
    """A client's handshake failed or did not finish in time; the message says why."""


class _EncryptedKey(Exception):
    pass


def _no_password() -> str:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key's
    # password, and a server started by a service manager would wait forever.
    raise _EncryptedKey


def server_context(cert_path: str, key_path: str) -> ssl.SSLContext:
    """A server-side context with the certificate (chain) and key from two PEM files: TLS
    1.2 at least, the standard library's defaults otherwise. Raises TlsConfigError naming
    the file that cannot be used."""
    for what, path in (("certificate", cert_path), ("key", key_path)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise TlsConfigError(what, path, (exc.strerror or str(exc)).lower()) from None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_path, key_path, password=_no_password)
    except _EncryptedKey:
        raise TlsConfigError("key", key_path, "it is encrypted; give an unencrypted key") from None
    except ssl.SSLError as exc:
        # OpenSSL's message ("PEM lib") does not say which file is wrong: find out.
        if exc.reason == "KEY_VALUES_MISMATCH":
            problem = f"it does not match the certificate {cert_path}"
            raise TlsConfigError("key", key_path, problem) from None
        if not _is_certificate(cert_path):
            raise TlsConfigError("certificate", cert_path, "no PEM certificate in it") from None
        raise TlsConfigError("key", key_path, "no PEM private key in it") from None
    return context


def _is_certificate(path: str) -> bool:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError:
        return False
    return True


async def handshake(
    stream: trio.SocketStream, context: ssl.SSLContext
) -> trio.SSLStream[trio.SocketStream]:
    """The server's side of the handshake on an accepted connection; the caller bounds it
    in time. Returns the TLS stream (the caller owns it, and through it ``stream``). On
    failure closes ``stream`` and raises HandshakeFailed; when cancelled, closes it too."""
    tls = trio.SSLStream(stream, context, server_side=True)
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as exc:
        await trio.aclose_forcefully(stream)
        raise HandshakeFailed(_reason(exc.__cause__)) from None
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return tls


def _reason(exc: BaseException | None) -> str:
    if isinstance(exc, ssl.SSLEOFError | ssl.SSLSyscallError) or exc is None:
        return "the client closed the connection"
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return exc.reason.lower().replace("_", " ")  # e.g. "tlsv1 alert unknown ca"
    return str(exc) or type(exc).__name__
