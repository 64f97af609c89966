"""TLS material made at test time with trustme (never committed keys): a private CA, a
server certificate for localhost and 127.0.0.1 signed by it, and a TLS line client."""

from __future__ import annotations

import ssl
from pathlib import Path

import attrs
import pytest
import trio
import trustme

from tests.server.conftest import BOUND_S, LineClient


@attrs.frozen
class TlsFiles:
    ca: str  # the CA's certificate (PEM): what clients trust
    cert: str  # the server's certificate (PEM)
    key: str  # its private key (PEM)
    authority: trustme.CA

    def server_options(self) -> dict[str, str]:
        """The ``ServerConfig`` fields of a server using these files."""
        return {"tls_cert": self.cert, "tls_key": self.key}


def make_tls_files(directory: Path, *names: str) -> TlsFiles:
    """A new CA and a server certificate for ``names`` (default: localhost, 127.0.0.1)."""
    directory.mkdir(parents=True, exist_ok=True)
    authority = trustme.CA()
    issued = authority.issue_cert(*(names or ("localhost", "127.0.0.1")))
    ca, cert, key = (str(directory / name) for name in ("ca.pem", "cert.pem", "key.pem"))
    authority.cert_pem.write_to_path(ca)
    issued.cert_chain_pems[0].write_to_path(cert)
    issued.private_key_pem.write_to_path(key)
    return TlsFiles(ca, cert, key, authority)


@pytest.fixture
def tls_files(tmp_path: Path) -> TlsFiles:
    return make_tls_files(tmp_path / "tls")


async def open_tls_line_client(address: tuple[str, int], files: TlsFiles) -> LineClient:
    """A line client over TLS that trusts ``files``' CA; its stream is a ``trio.SSLStream``
    (the TCP socket under it: ``client.stream.transport_stream.socket``)."""
    context = ssl.create_default_context(cafile=files.ca)
    with trio.fail_after(BOUND_S):
        tcp = await trio.open_tcp_stream(*address)
        stream = trio.SSLStream(tcp, context, server_hostname=address[0])
        await stream.do_handshake()
    return LineClient(stream)
