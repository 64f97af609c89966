"""Readiness and liveness on the metrics listener: ``/healthz`` answers 200 only once the
store is open and the leases of the previous run are recovered, and 503 with the reason
while they are not (the disk refused the recovery's write) and once the shutdown began;
``/livez`` answers 200 whenever the server's loop answers, ready or not.

The store is SQLite, its lease recovery refused as a full disk refuses it until the test
sets an event (the writer thread then retries it before the next batch).
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

import trio

from relay.server import core
from relay.server.core import ServerConfig, open_core
from relay.store.sqlite import SqliteStore
from tests.server.conftest import start_server
from tests.server.test_lifecycle import http_get


class DiskFull(Exception):
    """What SQLite raises when the disk is full, as relay/store/failures.py reads it."""

    sqlite_errorcode = sqlite3.SQLITE_FULL


def held_recovery(monkeypatch, held: threading.Event) -> None:
    """Servers started from now on open a SQLite store whose lease recovery fails as on a
    full disk until ``held`` is set."""

    class HeldRecovery(SqliteStore):
        def leases_recover(self, now: int) -> Any:
            if not held.is_set():
                raise DiskFull("database or disk is full")
            return super().leases_recover(now)

    def open_store(config: ServerConfig) -> SqliteStore:
        return HeldRecovery.open(config.db, config.store_config())

    monkeypatch.setattr(core, "open_store", open_store)


async def test_healthz_is_503_until_the_leases_are_recovered_livez_200_all_along(
    tmp_path, monkeypatch
):
    held = threading.Event()
    held_recovery(monkeypatch, held)
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        address = server.handle.metrics_address
        assert address is not None
        assert await http_get(address, "/healthz") == (503, b"recovering\n")
        assert await http_get(address, "/livez") == (200, b"ok\n")
        client = await server.connect()
        error = await client.error("submit", queue="q", payload={})
        assert error["code"] == "unavailable", error  # nothing commits before the recovery
        assert await http_get(address, "/healthz") == (503, b"recovering\n")

        held.set()
        # The next batch tries the recovery first: it commits, and so does the submit.
        await client.ok("submit", queue="q", payload={})
        assert await http_get(address, "/healthz") == (200, b"ok\n")
        assert await http_get(address, "/livez") == (200, b"ok\n")
        await client.aclose()
        server.handle.shutdown()


async def test_a_store_that_recovers_at_once_is_ready_at_once(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        address = server.handle.metrics_address
        assert address is not None
        assert await http_get(address, "/healthz") == (200, b"ok\n")
        assert await http_get(address, "/livez") == (200, b"ok\n")
        server.handle.shutdown()


async def test_a_draining_server_is_no_longer_ready(tmp_path):
    config = ServerConfig(db=str(tmp_path / "relay.db"))
    async with open_core(config) as opened:
        assert opened.unready() is None
        assert await opened.drain(1.0)
        assert opened.unready() == "stopping"
