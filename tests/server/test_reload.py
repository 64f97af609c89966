"""Reloading the token file and the TLS pair without a restart (relay/server/reload.py):
through the ``reload`` op on an in-process server with real sockets, and through SIGHUP
on a ``relay-trio server`` process. New tokens work at once, removed ones are refused at
the next hello, a connection that said hello with a removed (or re-roled) token is closed
after the grace, a file that cannot be used keeps the old tokens (one log line), and new
TLS connections get the new certificate. Every wait is bounded."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from relay.server.requests.auth import load_tokens
from tests.cli.conftest import address_of, assert_one_line_error, cli_env, relay_trio
from tests.server.conftest import BOUND_S, LineClient, RunningServer, start_server
from tests.server.requests.test_auth import assert_refused_and_closed, log_text
from tests.server.test_process import ServerProcess, server_process
from tests.tls_helpers import TlsFiles, make_tls_files, open_tls_line_client
from tests.worker.helpers import serving, wait_until

OLD = "old-admin-token-0123456789"
NEW = "new-admin-token-0123456789"
WORKER = "worker-token-0123456789ab"
GRACE_MS = 300


def write_tokens(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


@pytest.fixture
def logs(caplog, monkeypatch) -> pytest.LogCaptureFixture:
    monkeypatch.setattr(logging.getLogger("relay"), "propagate", True)
    caplog.set_level(logging.DEBUG)
    return caplog


def copy_pair(files: TlsFiles, cert: Path, key: Path) -> None:
    shutil.copyfile(files.cert, cert)
    shutil.copyfile(files.key, key)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    write_tokens(path, f"admin {OLD}\nworker {WORKER}\n")
    return path


@pytest.fixture
async def server(tmp_path: Path, token_file: Path) -> AsyncIterator[RunningServer]:
    tokens = load_tokens(str(token_file), None)

    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tokens=tokens, auth_token_file=str(token_file),
                                  token_grace_ms=GRACE_MS)  # fmt: skip

    async with serving(start, str(tmp_path / "relay.db")) as running:
        yield running


async def hello(server: RunningServer, token: str) -> LineClient:
    client = await server.connect()
    await client.ok("hello", token=token)
    return client


async def reload(server: RunningServer) -> dict:
    admin = await hello(server, NEW if server.config.auth_token_file is None else OLD)
    try:
        return await admin.ok("reload")
    finally:
        await admin.aclose()


async def closed_within(client: LineClient, seconds: float) -> bool:
    """Whether the server closes ``client`` within ``seconds`` (replies read meanwhile)."""
    with trio.move_on_after(seconds):
        while await client.read_line() is not None:
            pass
        return True
    return False


async def test_reload_op_new_token_works_removed_one_refused_and_closed_after_grace(
    server, token_file
):
    kept = await hello(server, OLD)  # said hello with the token about to be removed
    write_tokens(token_file, f"admin {NEW}\nworker {WORKER}\n")
    reply = await kept.ok("reload")
    assert reply["tokens"] == 2 and reply["closing"] == 1 and reply["errors"] == []
    assert reply["grace_ms"] == GRACE_MS and reply["tls"] is False
    # At once: the new token works, the removed one is refused at its next hello.
    fresh = await hello(server, NEW)
    await fresh.ok("stats")
    refused = await server.connect()
    await refused.send("hello", token=OLD)
    await assert_refused_and_closed(refused)
    # Within the grace the old connection goes on; after it, it is closed.
    await kept.ok("stats")
    assert await closed_within(kept, BOUND_S)
    # The connection with the new token stays.
    await fresh.ok("ping")
    await fresh.aclose()


async def test_a_new_hello_within_the_grace_keeps_the_connection(server, token_file):
    client = await hello(server, OLD)
    write_tokens(token_file, f"admin {NEW}\n")
    assert (await client.ok("reload"))["closing"] == 1
    await client.ok("hello", token=NEW)  # rotated without reconnecting
    assert not await closed_within(client, GRACE_MS / 1000 * 3)
    await client.ok("ping")
    await client.aclose()


async def test_a_token_given_another_role_closes_its_connections_after_the_grace(
    server, token_file
):
    worker = await hello(server, WORKER)
    write_tokens(token_file, f"admin {OLD}\nproducer {WORKER}\n")
    assert (await reload(server))["closing"] == 1
    assert await closed_within(worker, BOUND_S)
    again = await hello(server, WORKER)
    assert (await again.ok("hello", token=WORKER))["role"] == "producer"
    await again.aclose()


async def test_a_token_file_that_cannot_be_used_keeps_the_old_tokens(server, token_file, logs):
    client = await hello(server, WORKER)
    write_tokens(token_file, "admin short\n")  # too short: refused as at start
    reply = await reload(server)
    assert reply["closing"] == 0 and reply["tokens"] == 2
    assert len(reply["errors"]) == 1 and "tokens kept" in reply["errors"][0]
    assert "at least 16 characters" in reply["errors"][0]
    failed = [r for r in logs.records if getattr(r, "fields", {}).get("event") == "reload.failed"
              or r.getMessage() == "reload.failed"]  # fmt: skip
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING
    assert "short" not in log_text(logs)  # the token is never logged
    # The old tokens still work, and the connection stays.
    await (await hello(server, OLD)).aclose()
    assert not await closed_within(client, GRACE_MS / 1000 * 3)
    await client.ok("ping")
    # A missing file too.
    token_file.unlink()
    reply = await reload(server)
    assert "cannot read the token file" in reply["errors"][0]
    await (await hello(server, WORKER)).aclose()
    await client.aclose()


async def test_reload_is_refused_to_a_worker(server):
    client = await hello(server, WORKER)
    reply = await client.request("reload")
    assert reply["ok"] is False and reply["error"]["code"] == "unauthorized"
    await client.aclose()


def peer_certificate(client: LineClient) -> bytes:
    stream = client.stream
    assert isinstance(stream, trio.SSLStream)
    der = stream.getpeercert(binary_form=True)
    assert der is not None
    return der


async def test_reload_puts_a_new_certificate_in_force_for_new_connections(tmp_path):
    first = make_tls_files(tmp_path / "first")
    second = make_tls_files(tmp_path / "second")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    copy_pair(first, cert, key)

    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tls_cert=str(cert), tls_key=str(key))

    async with serving(start, str(tmp_path / "relay.db")) as server:
        old = await open_tls_line_client(server.handle.address, first)
        before = peer_certificate(old)
        # A pair that does not load changes nothing.
        key.write_text("not a key")
        reply = await old.ok("reload")
        assert reply["tls"] is False and "certificate kept" in reply["errors"][0]
        again = await open_tls_line_client(server.handle.address, first)
        assert peer_certificate(again) == before
        await again.aclose()
        # A good pair: new connections get it, and trust its CA; the old one goes on.
        copy_pair(second, cert, key)
        reply = await old.ok("reload")
        assert reply["tls"] is True and reply["errors"] == [] and reply["tokens"] is None
        new = await open_tls_line_client(server.handle.address, second)
        assert peer_certificate(new) != before
        await new.ok("ping")
        with pytest.raises(trio.BrokenResourceError) as refused:
            await open_tls_line_client(server.handle.address, first)  # the old CA's
        assert isinstance(refused.value.__cause__, ssl.SSLCertVerificationError)
        await old.ok("ping")
        await new.aclose()
        await old.aclose()


async def wait_for_event(server: ServerProcess, name: str) -> dict:
    async def logged() -> dict | None:
        return next((e for e in server.events if e.get("event") == name), None)

    return await wait_until(logged, what=name)


async def test_sighup_reloads_the_token_file_of_a_server_process(tmp_path, token_file):
    async with server_process(
        tmp_path / "relay.db", "--auth-token-file", str(token_file),
        "--token-grace-ms", str(GRACE_MS),
    ) as process:  # fmt: skip
        kept = await process.connect()
        await kept.ok("hello", token=OLD)
        write_tokens(token_file, f"admin {NEW}\n")
        os.kill(process.process.pid, signal.SIGHUP)
        done = await wait_for_event(process, "reload.done")
        assert done["via"] == "SIGHUP" and done["tokens"] == 1 and done["closing"] == 1
        fresh = await process.connect()
        await fresh.ok("hello", token=NEW)
        refused = await process.connect()
        await refused.send("hello", token=OLD)
        await assert_refused_and_closed(refused)
        assert await closed_within(kept, BOUND_S)
        # A bad file: one line, the old (new) tokens kept, the server goes on.
        write_tokens(token_file, "no tokens here at all\n")
        os.kill(process.process.pid, signal.SIGHUP)
        failed = await wait_for_event(process, "reload.failed")
        assert "expected 'ROLE TOKEN'" in failed["error"]
        await fresh.ok("hello", token=NEW)
        await fresh.aclose()
        process.process.send_signal(signal.SIGTERM)
        assert await process.wait(BOUND_S) == 0


async def test_relay_trio_reload_says_what_is_in_force_and_fails_in_one_line(server, token_file):
    def env(token: str) -> dict[str, str]:
        return cli_env(address_of(server), RELAY_AUTH_TOKEN=token)

    write_tokens(token_file, f"admin {OLD}\nworker {WORKER}\nproducer {NEW}\n")
    done = await relay_trio("reload", env=env(OLD))
    assert done.code == 0, done
    assert done.stdout.strip() == "reloaded: 3 tokens in force, no new certificate"
    assert_one_line_error(await relay_trio("reload", env=env(WORKER)), "unauthorized", "admin")
    write_tokens(token_file, "admin short\n")
    failed = await relay_trio("reload", "--json", env=env(OLD))
    assert failed.code == 1 and failed.json()["tokens"] == 3
    assert_one_line_error(failed, "tokens kept", "at least 16 characters")
    # Without --json: what stays in force is not called a reload (found from outside).
    kept = await relay_trio("reload", env=env(OLD))
    assert kept.code == 1 and kept.stdout.strip() == "kept: 3 tokens in force, no new certificate"
