"""The files a server creates are its owner's alone, whatever the umask; the ones it is
given and finds open to others are said at start.

The ``relay-trio server`` command as a subprocess (tests/server/test_process.py).
"""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from tests.server.test_process import ServerProcess, server_process, stop_gracefully

TOKEN = "producer-token-0123456789"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@asynccontextmanager
async def started_with_umask(umask: int, db: Path, *args: str) -> AsyncIterator[ServerProcess]:
    """A server process started with ``umask`` (the child inherits it at its start)."""
    old = os.umask(umask)
    try:
        async with server_process(db, *args) as server:
            os.umask(old)
            yield server
    finally:
        os.umask(old)


async def test_a_fresh_database_its_wal_shm_and_lock_file_are_0600_under_umask_0(tmp_path):
    db = tmp_path / "relay.db"
    async with started_with_umask(0o000, db) as server:
        client = await server.connect()
        await client.ok("submit", queue="q", payload={"secret": 1})  # the WAL has it
        files = {p.name: mode(p) for p in tmp_path.iterdir()}
        await stop_gracefully(server, client)
    for name in ("relay.db", "relay.db-wal", "relay.db-shm", "relay.db.lock"):
        assert files.get(name) == 0o600, files
    assert "store.file_world_accessible" not in server.event_names()
    assert mode(db) == 0o600


async def test_an_existing_database_keeps_its_mode_and_a_world_readable_one_is_said(tmp_path):
    db = tmp_path / "relay.db"
    async with server_process(db) as server:
        await stop_gracefully(server, await server.connect())
    os.chmod(db, 0o640)  # group-readable: its owner's choice, said nothing of
    async with server_process(db) as server:
        await stop_gracefully(server, await server.connect())
    assert mode(db) == 0o640
    assert "store.file_world_accessible" not in server.event_names()
    os.chmod(db, 0o644)
    async with server_process(db) as server:
        await stop_gracefully(server, await server.connect())
    assert mode(db) == 0o644
    [warning] = [e for e in server.events if e["event"] == "store.file_world_accessible"]
    assert warning["level"] == "warning" and warning["mode"] == "0644", warning
    assert warning["message"] == (
        f"the database {db} is open to every user of this machine (mode 0644): chmod o-rwx "
        "it, and its -wal and -shm files"
    )


async def test_a_token_file_others_may_read_is_said_in_one_line_at_start(tmp_path):
    """Not for 0640 of the server's own group: root's file that the service may read and
    not change, as docs/operations.md installs it (found from outside, 2026-12-04: that
    install was warned about, chmod 600 asked for)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"producer {TOKEN}\n")
    assert tokens.stat().st_gid == os.getegid()  # (the server runs as this test's user)
    for file_mode, warned in [(0o644, True), (0o600, False), (0o620, True), (0o640, False),
                              (0o604, True)]:  # fmt: skip
        os.chmod(tokens, file_mode)
        db = tmp_path / f"relay-{file_mode:o}.db"
        async with server_process(db, "--auth-token-file", str(tokens)) as server:
            client = await server.connect()
            await client.ok("hello", token=TOKEN)
            await stop_gracefully(server, client)
        lines = [e for e in server.events if e["event"] == "auth.token_file_exposed"]
        assert len(lines) == int(warned), (file_mode, lines)
        if warned:
            assert lines[0]["level"] == "warning"
            assert lines[0]["message"] == (
                f"the token file {tokens} may be read or written by other users "
                f"(mode {file_mode:04o}): chmod 600 it, or 640 with the server's group"
            )
        names = server.event_names()
        if warned:  # said before the server serves
            assert names.index("auth.token_file_exposed") < names.index("server.started")
