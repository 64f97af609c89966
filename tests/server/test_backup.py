"""``relay-trio backup``: a consistent copy of a running server's SQLite database
(relay/store/backup.py), made under load; restoring it (stop, replace, start) recovers the
leases it holds; and each refusal is one line. Servers and the command run as processes
(tests/server/test_process.py); every wait is bounded."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import time
from pathlib import Path

import trio

from relay.protocol.model import parse_job_id
from tests.server.conftest import BOUND_S, LineClient
from tests.server.test_process import (
    run_command,
    server_process,
    stop_gracefully,
)

PAYLOAD = {"text": "x" * 2000}  # a few MB in the database: a backup that takes a while


def one_line(done: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == code, f"exit code {done.returncode}; stderr:\n{stderr}"
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("relay-trio: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def copy_states(path: Path) -> dict[int, str]:
    """Every job of the copy at ``path`` by integer id, once its integrity check passes."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        return dict(conn.execute("SELECT id, state FROM jobs"))
    finally:
        conn.close()


async def submit_many(client: LineClient, n: int, queue: str = "fill") -> None:
    for start in range(0, n, 500):
        jobs = [{"queue": queue, "payload": PAYLOAD} for _ in range(min(500, n - start))]
        await client.ok("submit_batch", jobs=jobs)


async def test_a_backup_under_load_holds_every_job_acknowledged_before_it_began(tmp_path):
    db, dest = tmp_path / "relay.db", tmp_path / "backups" / "copy.db"
    dest.parent.mkdir()
    async with server_process(db) as server:
        filler = await server.connect()
        await submit_many(filler, 6000)
        acked: list[str] = []  # job ids whose ack was answered ok (committed)
        rounds: list[float] = []  # how long each submit-lease-ack round took
        stop = trio.Event()

        async def load() -> None:
            client = await server.connect()
            while not stop.is_set():
                t = time.monotonic()
                jobs = [{"queue": "load", "payload": {"n": i}} for i in range(20)]
                await client.ok("submit_batch", jobs=jobs)
                leased = await client.ok("lease", queues=["load"], worker_id="w", max_jobs=20,
                                         lease_ms=60_000, wait_ms=0)  # fmt: skip
                acks = [{"job_id": j["job_id"], "token": j["token"]} for j in leased["jobs"]]
                await client.ok("ack_batch", worker_id="w", acks=acks)
                acked.extend(a["job_id"] for a in acks)
                rounds.append(time.monotonic() - t)
            await client.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(load)
            with trio.fail_after(BOUND_S):
                while len(acked) < 200:  # noqa: ASYNC110 (the load is under way)
                    await trio.sleep(0.01)
            before = list(acked)  # answered before the backup began
            started = len(rounds)
            done = await run_command("backup", str(dest), "--db", str(db), "--json")
            during = rounds[started:]
            await trio.sleep(0.1)
            stop.set()
        assert done.returncode == 0, done.stderr
        states = copy_states(dest)
        missing = [j for j in before if states.get(parse_job_id(j)) != "succeeded"]
        assert missing == [], f"{len(missing)} acknowledged jobs not in the copy"
        assert sum(1 for s in states.values() if s == "ready") >= 6000  # the filler's
        assert len(acked) > len(before), "the load went on during the backup"
        # The server went on serving: no round waited for the whole copy. (Loose: rounds
        # take ~10 ms here on a quiet machine, but seconds on a loaded one; the commits
        # made during a copy are measured in tests/store/test_backup.py.)
        assert during and max(during) < BOUND_S / 2, max(during, default=None)
        assert stat.S_IMODE(os.stat(dest).st_mode) == 0o600
        assert sorted(p.name for p in dest.parent.iterdir()) == ["copy.db"]  # nothing beside
        await stop_gracefully(server, filler)


def restore(backup: Path, db: Path) -> None:
    """The server is stopped: the copy replaces the file, and nothing stays beside it."""
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    os.replace(backup, db)


async def test_restoring_a_backup_recovers_the_leases_it_holds(tmp_path):
    db, dest = tmp_path / "relay.db", tmp_path / "copy.db"
    async with server_process(db) as server:
        client = await server.connect()
        done_id = (await client.ok("submit", queue="q", payload={"n": 1}))["job_id"]
        held_id = (await client.ok("submit", queue="q", payload={"n": 2}))["job_id"]
        [first] = (await client.ok("lease", queues=["q"], worker_id="w", lease_ms=600_000))["jobs"]
        assert first["job_id"] == done_id
        await client.ok("ack", job_id=done_id, worker_id="w", token=first["token"])
        [held] = (await client.ok("lease", queues=["q"], worker_id="w", lease_ms=600_000))["jobs"]
        assert held["job_id"] == held_id
        done = await run_command("backup", str(dest), "--db", str(db))
        assert done.returncode == 0, done.stderr
        assert b"integrity check ok" in done.stdout
        # After the backup: the held job succeeds, and another is submitted.
        await client.ok("ack", job_id=held_id, worker_id="w", token=held["token"])
        later_id = (await client.ok("submit", queue="q", payload={"n": 3}))["job_id"]
        await stop_gracefully(server, client)
    # Restore: the server is stopped; the copy replaces the file (and nothing stays beside).
    restore(dest, db)
    async with server_process(db) as server:
        client = await server.connect()
        assert (await client.ok("inspect", job_id=done_id))["job"]["state"] == "succeeded"
        # Leased when the copy was made: made ready by the recovery at start.
        restored = (await client.ok("inspect", job_id=held_id))["job"]
        assert restored["state"] == "ready", restored
        reply = await client.request("inspect", job_id=later_id)
        assert reply["ok"] is False and reply["error"]["code"] == "not_found"
        [again] = (await client.ok("lease", queues=["q"], worker_id="w2"))["jobs"]
        assert again["job_id"] == held_id
        await stop_gracefully(server, client)


async def test_backup_refusals_are_one_line(tmp_path):
    db = tmp_path / "relay.db"
    async with server_process(db) as server:
        client = await server.connect()
        await client.ok("submit", queue="q", payload=1)
        dest = tmp_path / "copy.db"
        dest.write_text("keep me")
        done = await run_command("backup", str(dest), "--db", str(db))
        one_line(done, 1, str(dest), "exists", "--force")
        assert dest.read_text() == "keep me"
        done = await run_command("backup", str(dest), "--db", str(db), "--force")
        assert done.returncode == 0, done.stderr
        assert copy_states(dest) and stat.S_IMODE(os.stat(dest).st_mode) == 0o600
        missing = tmp_path / "no-such-dir" / "copy.db"
        one_line(await run_command("backup", str(missing), "--db", str(db)), 1,
                 "does not exist", "create it")  # fmt: skip
        assert not missing.parent.exists()
        one_line(await run_command("backup", str(tmp_path / "x.db"), "--db",
                                   "postgresql://u@127.0.0.1:5432/relay"), 2,
                 "PostgreSQL", "pg_dump")  # fmt: skip
        one_line(await run_command("backup", str(tmp_path / "x.db"), "--db",
                                   str(tmp_path / "none.db")), 1, "no database at")  # fmt: skip
        other = tmp_path / "other.db"
        sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
        one_line(await run_command("backup", str(tmp_path / "x.db"), "--db", str(other)), 1,
                 "not a relay-trio database")  # fmt: skip
        assert not (tmp_path / "x.db").exists()
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
        await stop_gracefully(server, client)
