"""The job listener over TLS (connections/tls.py, the listener's handshake): the context
from files, handshakes that fail or stall, the connection cap, and the session's view of
the TCP connection under TLS. Certificates come from trustme, made for each test."""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from relay.protocol import wire
from relay.server.connections.tls import TlsConfigError, server_context
from relay.server.serve import ServerConfig, serve
from tests.server.conftest import BOUND_S, RunningServer, logged, writer_barrier
from tests.server.connections.test_session import parked_leases, pipelined, reset
from tests.server.test_protocol import W, connected, custom_server, queue_stats, submit
from tests.tls_helpers import TlsFiles, make_tls_files, open_tls_line_client
from tests.tls_helpers import tls_files as tls_files  # the fixture


@contextlib.asynccontextmanager
async def tls_server(tmp_path: Path, files: TlsFiles, **overrides) -> AsyncIterator[RunningServer]:
    async with custom_server(tmp_path, **files.server_options(), **overrides) as srv:
        yield srv


def fields(records: list[logging.LogRecord], name: str) -> list[dict]:
    return [r.fields for r in records if r.getMessage() == name]  # type: ignore[attr-defined]


# -- the context from files -----------------------------------------------------------------


def test_server_context_loads_a_certificate_and_its_key(tls_files):
    context = server_context(tls_files.cert, tls_files.key)
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.verify_mode == ssl.CERT_NONE  # clients are not asked for certificates


def _encrypted(files: TlsFiles, path: Path) -> str:
    subprocess.run(
        ["openssl", "pkey", "-in", files.key, "-aes256", "-passout", "pass:secret", "-out",
         str(path)], check=True, capture_output=True,
    )  # fmt: skip
    return str(path)


@pytest.mark.parametrize(
    ("case", "what", "problem"),
    [
        ("missing certificate", "certificate", "no such file or directory"),
        ("missing key", "key", "no such file or directory"),
        ("directory as certificate", "certificate", "is a directory"),
        ("certificate not PEM", "certificate", "no PEM certificate in it"),
        ("key not PEM", "key", "no PEM private key in it"),
        ("key of another certificate", "key", "it does not match the certificate"),
        ("encrypted key", "key", "it is encrypted"),
    ],
)
def test_server_context_names_the_file_that_cannot_be_used(
    tmp_path, tls_files, case, what, problem
):
    cert, key = tls_files.cert, tls_files.key
    junk = tmp_path / "junk.pem"
    junk.write_text("not PEM at all\n")
    if case == "missing certificate":
        cert = str(tmp_path / "nope.pem")
    elif case == "missing key":
        key = str(tmp_path / "nope.pem")
    elif case == "directory as certificate":
        cert = str(tmp_path)
    elif case == "certificate not PEM":
        cert = str(junk)
    elif case == "key not PEM":
        key = str(junk)
    elif case == "key of another certificate":
        key = make_tls_files(tmp_path / "other").key
    elif case == "encrypted key":
        key = _encrypted(tls_files, tmp_path / "encrypted.pem")
    with pytest.raises(TlsConfigError) as caught:
        server_context(cert, key)
    assert caught.value.what == what
    assert caught.value.path == (cert if what == "certificate" else key)
    assert problem in caught.value.problem
    assert str(caught.value).startswith(f"cannot load TLS {what} {caught.value.path}: ")


def test_server_context_does_not_read_a_key_it_cannot_open(tmp_path, tls_files):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    os.chmod(tls_files.key, 0)
    with pytest.raises(TlsConfigError) as caught:
        server_context(tls_files.cert, tls_files.key)
    assert (caught.value.what, caught.value.problem) == ("key", "permission denied")


async def test_serve_refuses_a_bad_certificate_before_opening_the_database(tmp_path):
    db = tmp_path / "relay.db"
    config = ServerConfig(
        db=str(db), port=0, metrics_port=None, tls_cert=str(tmp_path / "nope.pem"),
        tls_key=str(tmp_path / "nope.key"),
    )  # fmt: skip
    with trio.fail_after(BOUND_S), pytest.raises(TlsConfigError) as caught:
        await serve(config)
    assert caught.value.path == str(tmp_path / "nope.pem")
    assert not db.exists()


# -- handshakes -----------------------------------------------------------------------------


async def test_requests_are_answered_over_tls(tmp_path, tls_files):
    async with tls_server(tmp_path, tls_files) as srv:
        c = await open_tls_line_client(srv.handle.address, tls_files)
        job_id = await submit(c, "tls", {"secret": True})
        reply = await c.ok("lease", queues=["tls"], worker_id=W)
        assert [job["job_id"] for job in reply["jobs"]] == [job_id]
        await c.aclose()


async def test_a_client_that_does_not_trust_the_certificate_is_refused_and_others_go_on(
    tmp_path, tls_files
):
    other_ca = make_tls_files(tmp_path / "other")
    async with tls_server(tmp_path, tls_files) as srv:
        good = await open_tls_line_client(srv.handle.address, tls_files)
        with logged("relay.listener") as records:
            with pytest.raises(trio.BrokenResourceError) as refused:
                await open_tls_line_client(srv.handle.address, other_ca)
            assert isinstance(refused.value.__cause__, ssl.SSLCertVerificationError)
            # A plain-text client: the server's handshake fails on its request line.
            async with connected(srv) as plain:
                await plain.send("ping")
                assert await plain.at_eof()
            assert (await good.ok("ping"))["ok"] is True
        failed = fields(records, "connection.tls_failed")
        assert failed and all(f["reason"] for f in failed), failed
        assert not [r for r in records if r.exc_info], "a failed handshake logged a traceback"
        await good.aclose()


async def test_a_stalled_handshake_is_closed_at_its_deadline_and_frees_its_slot(
    tmp_path, tls_files
):
    """max_connections 1: a client that connects and sends nothing holds the one slot
    (a TLS client meanwhile is closed during its handshake), for the handshake deadline
    only; then the slot is free again."""
    deadline_s = 0.5
    limits = wire.Limits(max_connections=1)
    async with tls_server(
        tmp_path, tls_files, limits=limits, tls_handshake_timeout_ms=int(deadline_s * 1000)
    ) as srv:
        with logged("relay.listener") as records:
            stalled = trio.socket.socket()
            with stalled, trio.fail_after(BOUND_S):
                await stalled.connect(srv.handle.address)
                connected_at = trio.current_time()
                await wait_all_tasks_blocked()  # accepted: it holds the slot
                with pytest.raises(trio.BrokenResourceError):  # closed during the handshake
                    await open_tls_line_client(srv.handle.address, tls_files)
                assert await stalled.recv(1) == b""  # closed by the server
                closed_after = trio.current_time() - connected_at
                await wait_all_tasks_blocked()  # its session task has ended
                c = await open_tls_line_client(srv.handle.address, tls_files)
                stats = await c.ok("stats")
                await c.aclose()
        assert deadline_s <= closed_after < deadline_s + 2, closed_after
        assert stats["server"]["connections"] == 1
        (failed,) = fields(records, "connection.tls_failed")
        assert failed["reason"] == f"no handshake within {deadline_s:g} s"
        assert fields(records, "connection.refused")  # the TLS client over the cap


async def test_handshakes_do_not_hold_up_accepting(tmp_path, tls_files):
    """Handshakes run in the sessions' tasks: a stalled one never keeps the listener from
    accepting and serving the next client."""
    async with tls_server(tmp_path, tls_files) as srv:
        stalled = [trio.socket.socket() for _ in range(3)]
        with contextlib.ExitStack() as stack:
            for sock in stalled:
                stack.enter_context(sock)
                with trio.fail_after(BOUND_S):
                    await sock.connect(srv.handle.address)
            with trio.fail_after(2):  # far below the 10 s handshake deadline
                c = await open_tls_line_client(srv.handle.address, tls_files)
                assert (await c.ok("stats"))["server"]["connections"] == 4
            await c.aclose()


# -- the session under TLS ------------------------------------------------------------------


@pytest.mark.parametrize(
    "after",
    [b"", pipelined([{"op": "ping", "id": "more"}])],
    ids=["nothing more", "a request after them"],
)
async def test_no_job_is_leased_to_a_tls_client_gone_while_its_long_polls_fill_max_in_flight(
    tmp_path, tls_files, after
):
    """The session reads the TCP state under the TLS stream: a client reset while its
    parked leases fill max_in_flight (the reader is not reading) must not take the next
    job, whether its peek sees the reset or a request stands before it."""
    limits = wire.Limits(max_in_flight=4)
    async with tls_server(tmp_path, tls_files, limits=limits) as srv:
        c = await open_tls_line_client(srv.handle.address, tls_files)
        gone = await open_tls_line_client(srv.handle.address, tls_files)
        with trio.fail_after(BOUND_S):
            await gone.send_raw(parked_leases(4))
            await wait_all_tasks_blocked()  # read and sent to the writer
            await writer_barrier(c)  # the writer answered them before this: they are parked
            if after:
                await gone.send_raw(after)
                await wait_all_tasks_blocked()
            reset(gone.stream.transport_stream.socket)  # type: ignore[attr-defined]
            await wait_all_tasks_blocked()
        await submit(c, queue="lp")
        await wait_all_tasks_blocked()  # woken: claimed again for it, or not
        await writer_barrier(c)  # (that claim, queued before this, committed)
        counts = await queue_stats(c, "lp")
        assert (counts["ready"], counts["leased"]) == (1, 0), counts
        with trio.fail_after(BOUND_S):
            assert (await c.ok("stats"))["server"]["connections"] == 1
        await c.aclose()


async def test_a_too_large_frame_over_tls_is_answered_then_closed(tmp_path, tls_files):
    """The session's linger cannot half-close a TLS stream; the error line still arrives."""
    limits = wire.Limits(max_frame_bytes=1024)
    async with tls_server(tmp_path, tls_files, limits=limits) as srv:
        c = await open_tls_line_client(srv.handle.address, tls_files)
        with trio.fail_after(BOUND_S):
            await c.send_raw(b"x" * 4096 + b"\n")
            reply = await c.read()
        assert reply["error"]["code"] == "frame_too_large"
        assert await c.at_eof()
        await c.aclose()
