"""The clients over TLS: the async client, the blocking client and a Worker against a real
server with a certificate from a private CA (trustme, made for each test), host names
verified, refusals that say why, and reconnections that shake hands again."""

from __future__ import annotations

import functools
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from relay import ConnectionLost, JobState, LeasedJob, Worker, WrongServer, connect, open_client
from relay.client.client import parse_address, uses_tls
from relay.client.tcp import TcpTransport
from tests.tls_helpers import TlsFiles, make_tls_files
from tests.tls_helpers import tls_files as tls_files  # the fixture
from tests.worker.helpers import (
    BOUND_S,
    Proxy,
    Server,
    running,
    start_server,
    wait_for_state,
    wait_until,
)


@pytest.fixture
async def tls_server(tmp_path, tls_files: TlsFiles) -> AsyncIterator[Server]:
    async with trio.open_nursery() as nursery:
        server = await start_server(
            nursery, str(tmp_path / "relay.db"), **tls_files.server_options()
        )
        try:
            yield server
        finally:
            await server.stop()


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one blocking call in a thread, bounded."""
    with trio.fail_after(BOUND_S):
        return await trio.to_thread.run_sync(
            functools.partial(fn, *args, **kwargs), abandon_on_cancel=True
        )


def test_a_tls_address_parses_to_its_host_and_port():
    assert parse_address("tls://localhost:7400") == ("localhost", 7400)
    assert parse_address("tls://[::1]:7400") == ("::1", 7400)
    assert uses_tls("tls://localhost:7400") and not uses_tls("localhost:7400")
    assert uses_tls("localhost:7400", tls_ca="ca.pem")
    with pytest.raises(ValueError, match="tls://HOST:PORT"):
        parse_address("tls://localhost")


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["", "tls://"])
async def test_async_client_round_trip_with_a_private_ca(tls_server, tls_files, scheme):
    async with open_client(f"{scheme}{tls_server.address}", tls_ca=tls_files.ca) as client:
        submitted = await client.submit("tls", {"n": 1})
        (job,) = await client.lease(["tls"], "w1")
        assert job.job_id == submitted.job_id and job.payload == {"n": 1}
        await client.ack(job.job_id, "w1", job.token, result={"ok": True})
        view = await client.inspect(job.job_id)
    assert view.state == JobState.SUCCEEDED and view.result == {"ok": True}


async def test_host_names_are_verified(tmp_path, tls_files):
    """localhost and 127.0.0.1 are in the certificate; a server whose certificate names
    another host is refused, though the CA is trusted."""
    elsewhere = make_tls_files(tmp_path / "elsewhere", "queue.example.org")
    async with trio.open_nursery() as nursery:
        server = await start_server(
            nursery, str(tmp_path / "relay.db"), **elsewhere.server_options()
        )
        with trio.fail_after(BOUND_S), pytest.raises(ssl.SSLCertVerificationError) as caught:
            async with open_client(server.address, tls_ca=elsewhere.ca, reconnect=False):
                pass
        assert "mismatch" in caught.value.verify_message
        await server.stop()


async def test_blocking_client_round_trip_keeps_one_connection(tls_server, tls_files):
    proxy = Proxy(tls_server.handle.address)
    async with trio.open_nursery() as nursery:
        await proxy.start(nursery)
        with connect(f"tls://{proxy.address}", tls_ca=tls_files.ca, timeout=5) as queue:
            first = await call(queue.submit, "tls", {"n": 1})
            second = await call(queue.submit, "tls", {"n": 2})
            stats = await call(queue.stats)
            view = await call(queue.inspect, first.job_id)
        assert second.job_id > first.job_id
        assert stats.queues["tls"]["ready"] == 2 and view.payload == {"n": 1}
        assert proxy.accepted == 1  # between calls it saw the connection alive
        nursery.cancel_scope.cancel()


async def test_blocking_client_replaces_a_connection_the_server_closed(tmp_path, tls_files):
    async with trio.open_nursery() as nursery:
        server = await start_server(
            nursery, str(tmp_path / "relay.db"), idle_timeout_ms=200,
            **tls_files.server_options(),
        )  # fmt: skip
        async with open_client(server.address, tls_ca=tls_files.ca) as probe:

            async def alone() -> bool:  # the server has closed the blocking client's
                return (await probe.stats()).server.connections == 1

            with connect(server.address, tls_ca=tls_files.ca, timeout=5) as queue:
                await call(queue.submit, "tls", {"n": 1})
                sock = queue._sock
                await wait_until(alone, what="the idle connection closed")
                stats = await call(queue.stats)
                assert queue._sock is not sock
        assert stats.queues["tls"]["ready"] == 1
        await server.stop()


async def test_worker_runs_jobs_over_tls(tls_server, tls_files):
    done: list[Any] = []

    async def handler(job: LeasedJob) -> str:
        done.append(job.payload)
        return "done"

    async with open_client(tls_server.address, tls_ca=tls_files.ca) as client:
        submitted = await client.submit("tls", {"n": 7})
        worker = Worker(tls_server.address, queues=["tls"], handler=handler, tls_ca=tls_files.ca)
        async with running(worker):
            view = await wait_for_state(client, submitted.job_id, "succeeded")
    assert done == [{"n": 7}] and view.result == "done"


# -- refusals -------------------------------------------------------------------------------


async def test_a_client_without_the_ca_is_refused_and_others_go_on(tls_server, tls_files):
    with trio.fail_after(BOUND_S):
        # The system's trust store (a tls:// address) does not know the private CA.
        with pytest.raises(ssl.SSLCertVerificationError):
            async with open_client(f"tls://{tls_server.address}", reconnect=False):
                pass
        queue = connect(f"tls://{tls_server.address}", timeout=5)
        with queue, pytest.raises(ConnectionLost, match="certificate verify failed"):
            await call(queue.stats)
        # A plain client: the server's handshake fails on its hello, and closes.
        with pytest.raises(WrongServer):
            async with open_client(tls_server.address, reconnect=False):
                pass
        async with open_client(tls_server.address, tls_ca=tls_files.ca) as client:
            await client.ping()


async def test_a_tls_client_of_a_plain_server_fails_at_once(tmp_path, tls_files):
    """The server reads the client's TLS handshake as request lines (its extension list
    holds a newline byte: supported_groups is extension 10) and answers bad_request in
    plain text, which the client's TLS reads as no TLS at all: the client fails with the
    SSL error that says so, well before its connect timeout."""
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        for _ in range(3):
            started = trio.current_time()
            with trio.fail_after(BOUND_S), pytest.raises(ssl.SSLError, match="WRONG_VERSION"):
                async with open_client(
                    server.address, tls_ca=tls_files.ca, reconnect=False, connect_timeout=60
                ):
                    pass
            assert trio.current_time() - started < 2.0
        async with open_client(server.address) as plain:  # and the server goes on
            await plain.ping()
        await server.stop()


async def test_a_plain_client_of_a_tls_server_is_told_to_use_tls(tls_server):
    """The server closes a plain connection without a byte, at the client's hello: the
    client fails at connect, with an error that says why it may (WrongServer: trying
    again will not help)."""
    for token in (None, "t0ken"):
        with trio.fail_after(BOUND_S), pytest.raises(WrongServer, match="tls://"):
            async with open_client(tls_server.address, reconnect=False, token=token):
                pass
        blocking = connect(tls_server.address, token=token)
        with pytest.raises(WrongServer, match="tls://"):
            await call(blocking.stats)
        blocking.close()


async def test_a_connection_lost_after_replies_has_no_tls_hint(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        async with open_client(server.address, reconnect=False) as client:
            await client.ping()
            await server.kill()
            with trio.fail_after(BOUND_S), pytest.raises(ConnectionLost) as lost:
                await client.ping()
            assert "tls" not in str(lost.value)


# -- reconnection ---------------------------------------------------------------------------


async def test_a_reconnection_does_its_handshake_again(tls_server, tls_files):
    proxy = Proxy(tls_server.handle.address)
    async with trio.open_nursery() as nursery:
        await proxy.start(nursery)
        async with open_client(f"tls://{proxy.address}", tls_ca=tls_files.ca) as client:
            transport = client._transport
            assert isinstance(transport, TcpTransport)
            await client.submit("tls", {"n": 1})
            proxy.cut()

            async def reconnected() -> bool:
                return transport.connections == 2 and transport._connected.is_set()

            await wait_until(reconnected, what="the client reconnecting")
            with trio.fail_after(BOUND_S):
                stats = await client.stats()
        assert stats.queues["tls"]["ready"] == 1
        assert proxy.accepted == 2
        nursery.cancel_scope.cancel()


class BrokenTlsStream(trio.abc.Stream):
    """A connection whose writes fail, as a TLS stream's do: without telling how much of
    the data reached the server."""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        raise trio.BrokenResourceError

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.sleep_forever()
        raise AssertionError  # pragma: no cover

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_a_failed_tls_write_resends_what_is_safe_and_fails_the_rest():
    """How far a failed TLS write got is unknown: a submit in it may have been committed,
    so it raises ConnectionLost (never sent twice); an ack waits for the next connection."""
    transport = TcpTransport("127.0.0.1", 1, ssl_context=ssl.create_default_context())
    transport._stream, transport._generation = BrokenTlsStream(), 1
    transport._connected.set()
    outcomes: dict[str, Any] = {}

    async def call(op: str) -> None:
        try:
            outcomes[op] = await transport.request(op, {"queue": "q"})
        except ConnectionLost as exc:
            outcomes[op] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(transport.flush)
        nursery.start_soon(call, "submit")
        nursery.start_soon(call, "ack")
        await wait_all_tasks_blocked()
        assert isinstance(outcomes.pop("submit"), ConnectionLost)
        assert outcomes == {}  # the ack waits for a connection
        assert [(c.op, c.resent) for c in transport._outbox] == [("ack", True)]
        nursery.cancel_scope.cancel()
