"""The ``relay-trio server`` command as a real subprocess: signals, crash safety, refusals.

The server listens on 127.0.0.1 port 0; its ``server.started`` log event (JSON lines on
stderr) names the address it got, so there is no free-port race. Every wait is bounded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio

from relay.store.sqlite import SqliteStore

from .conftest import BOUND_S, LineClient

RELAY = Path(sys.executable).parent / "relay-trio"
SHUTDOWN_TIMEOUT_MS = 2000


class ServerProcess:
    """A running ``relay-trio server``; its stderr is read (and kept) by ``pump``."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.stderr = b""
        self.events: list[dict[str, Any]] = []
        self.address: tuple[str, int] | None = None
        self.settled = trio.Event()  # started, or its stderr closed (it exited)
        self.stderr_closed = trio.Event()

    async def pump(self) -> None:
        assert self.process.stderr is not None
        buffer = b""
        try:
            while data := await self.process.stderr.receive_some(65536):
                self.stderr += data
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self._line(line)
        finally:
            self.settled.set()
            self.stderr_closed.set()

    def _line(self, line: bytes) -> None:
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            return
        if not isinstance(entry, dict):
            return
        self.events.append(entry)
        if entry.get("event") == "server.started":
            host, _, port = entry["address"].rpartition(":")
            self.address = (host, int(port))
            self.settled.set()

    def event_names(self) -> list[str]:
        return [e.get("event") for e in self.events]

    async def connect(self) -> LineClient:
        assert self.address is not None
        with trio.fail_after(BOUND_S):
            return LineClient(await trio.open_tcp_stream(*self.address))

    async def wait(self, within: float) -> int:
        """The exit code, waiting at most ``within`` seconds (and for stderr to close)."""
        with trio.fail_after(within):
            code = await self.process.wait()
        with trio.fail_after(BOUND_S):
            await self.stderr_closed.wait()
        return code


@asynccontextmanager
async def server_process(db: Path, *args: str) -> AsyncIterator[ServerProcess]:
    """Start a server on ``db`` and wait until it serves; kill it on the way out if needed."""
    command = [
        str(RELAY), "server", "--db", str(db), "--address", "127.0.0.1:0",
        "--metrics-address", "off", "--ws-address", "off",
        "--shutdown-timeout-ms", str(SHUTDOWN_TIMEOUT_MS), *args,
    ]  # fmt: skip
    async with trio.open_nursery() as nursery:
        # Its log is read as JSON lines (what a pipe gets, unless the environment says).
        env = {**os.environ, "RELAY_LOG_FORMAT": "json"}
        process = await trio.lowlevel.open_process(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        server = ServerProcess(process)
        nursery.start_soon(server.pump)
        try:
            with trio.fail_after(BOUND_S):
                await server.settled.wait()
            assert server.address is not None, f"server did not start: {server.stderr!r}"
            yield server
        finally:
            if process.returncode is None:
                process.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(BOUND_S):
                await process.wait()


async def pipeline(
    client: LineClient,
    requests: list[dict[str, Any]],
    on_reply: Callable[[int, dict[str, Any]], Awaitable[None] | None],
    window: int = 200,
) -> None:
    """Send ``requests`` (request i gets id i) with at most ``window`` unanswered, calling
    ``on_reply(i, reply)`` for each reply, until all are answered or the connection ends."""
    room = trio.Semaphore(window)
    answered = 0

    async def send_all() -> None:
        try:
            for i, request in enumerate(requests):
                await room.acquire()
                await client.send_raw(orjson.dumps({**request, "id": i}) + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_all)
        while answered < len(requests):
            try:
                line = await client.read_line()
            except trio.BrokenResourceError:
                line = None
            if line is None:
                break
            reply = orjson.loads(line)
            answered += 1
            room.release()
            result = on_reply(reply["id"], reply)
            if result is not None:
                await result
        nursery.cancel_scope.cancel()


# -- signals ------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_signal_shuts_down_gracefully_with_exit_code_0(tmp_path, signum):
    db = tmp_path / "relay.db"
    async with server_process(db) as server:
        client = await server.connect()
        submitted = await client.ok("submit", queue="sig", payload={"kept": True})
        # A parked long-poll, far from its deadline.
        lease_id = await client.send("lease", queues=["idle"], worker_id="w", wait_ms=30_000)
        stats_id = await client.send("stats")
        assert (await client.read())["id"] == stats_id  # the lease is parked now

        server.process.send_signal(signum)
        signalled = trio.current_time()
        try:
            line = await client.read_line()
        except trio.BrokenResourceError:
            line = None
        answered_after = trio.current_time() - signalled
        code = await server.wait(SHUTDOWN_TIMEOUT_MS / 1000 + 3)
        assert code == 0, server.stderr.decode(errors="replace")
        await client.aclose()

    names = server.event_names()
    for name in ("shutdown.signal", "shutdown.stopped_accepting", "server.stopped"):
        assert name in names, (name, names)
    assert "shutdown.requests_drained" in names or "shutdown.grace_expired" in names, names
    (sig,) = [e for e in server.events if e["event"] == "shutdown.signal"]
    assert sig["signal"] == signum.name
    assert names.index("shutdown.signal") < names.index("server.stopped")

    store = SqliteStore.open(str(db))
    try:
        assert store.job_inspect(submitted["job_id"]).payload == '{"kept":true}'
    finally:
        store.close()
    # Parked long-polls answer `jobs: []` (not a silently closed connection).
    assert line is not None, "the parked long-poll got no reply: the connection was closed"
    assert orjson.loads(line) == {"id": lease_id, "ok": True, "jobs": []}
    assert answered_after < 1.0, f"parked long-poll answered after {answered_after:.2f}s"


async def test_second_signal_exits_at_once_with_130(tmp_path):
    async with server_process(tmp_path / "relay.db") as server:
        # Two different signals (one signal repeated may be coalesced), back to back: the
        # second arrives while the first's graceful shutdown is still running.
        server.process.send_signal(signal.SIGINT)
        server.process.send_signal(signal.SIGTERM)
        code = await server.wait(SHUTDOWN_TIMEOUT_MS / 1000 + 3)
    assert code == 130, server.stderr.decode(errors="replace")
    assert "shutdown.forced" in server.event_names()


# -- crash safety -------------------------------------------------------------------------


async def stop_gracefully(server: ServerProcess, client: LineClient) -> None:
    """Close ``client``, then SIGTERM: the server exits 0 within its shutdown timeout."""
    await client.aclose()
    server.process.send_signal(signal.SIGTERM)
    assert await server.wait(SHUTDOWN_TIMEOUT_MS / 1000 + 3) == 0


def intact_crash_jobs(db: Path) -> int:
    """The jobs of queue ``crash`` in ``db``, once ``PRAGMA integrity_check`` passes."""
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        return conn.execute("SELECT count(*) FROM jobs WHERE queue = 'crash'").fetchone()[0]
    finally:
        conn.close()


async def test_sigkill_while_submitting_loses_no_acknowledged_job(tmp_path):
    db = tmp_path / "relay.db"
    total, kill_after = 2000, 1000
    acknowledged: dict[int, str] = {}  # request index -> job id, for every ok reply

    async with server_process(db) as server:
        client = await server.connect()
        requests = [{"op": "submit", "queue": "crash", "payload": {"n": i}} for i in range(total)]

        def on_reply(i: int, reply: dict[str, Any]) -> None:
            assert reply["ok"] is True, reply
            acknowledged[i] = reply["job_id"]
            if len(acknowledged) == kill_after:
                server.process.kill()  # SIGKILL, with submits still in the pipeline

        with trio.fail_after(BOUND_S * 2):
            await pipeline(client, requests, on_reply)
        code = await server.wait(BOUND_S)
        assert code == -signal.SIGKILL
        await client.aclose()
    # Replies already in our socket buffer when the server died also count (they are
    # acknowledgements), so there may be a few more than kill_after; not all of them.
    assert kill_after <= len(acknowledged) < total

    async with server_process(db) as server:
        client = await server.connect()
        stats = (await client.ok("stats"))["queues"]["crash"]
        assert stats["ready"] >= len(acknowledged), stats
        found: dict[int, dict[str, Any]] = {}
        order = sorted(acknowledged)

        def on_inspect(k: int, reply: dict[str, Any]) -> None:
            assert reply["ok"] is True, (acknowledged[order[k]], reply)
            found[order[k]] = reply["job"]

        inspects = [{"op": "inspect", "job_id": acknowledged[i]} for i in order]
        with trio.fail_after(BOUND_S * 2):
            await pipeline(client, inspects, on_inspect)
        assert len(found) == len(acknowledged)
        for i, job in found.items():
            assert job["payload"] == {"n": i} and job["state"] == "ready", job
        await stop_gracefully(server, client)

    assert len(acknowledged) <= intact_crash_jobs(db) <= total


async def test_sigkill_while_leasing_and_acking_loses_no_acknowledged_ack(tmp_path):
    """Killed with acks in the pipeline: after a restart every job whose ack was answered
    ok has succeeded, every other job is ready again (its lease given back), the tokens
    issued before the crash change nothing, and all the jobs can still be finished."""
    db = tmp_path / "relay.db"
    total, kill_after = 800, 300
    leased: dict[str, str] = {}  # job id -> token, for every job leased before the kill
    acked: set[str] = set()  # jobs whose ack was answered ok

    async with server_process(db) as server:
        client = await server.connect()
        jobs = [{"queue": "crash", "payload": {"n": i}} for i in range(total)]
        for start in range(0, total, 100):
            await client.ok("submit_batch", jobs=jobs[start : start + 100])
        # Leased and never acked: these are sure to hold live leases at the crash.
        held = (await client.ok("lease", queues=["crash"], worker_id="w", count=16))["jobs"]
        leased.update({job["job_id"]: job["token"] for job in held})
        with trio.fail_after(BOUND_S * 2):
            while len(acked) < kill_after:
                reply = await client.ok(
                    "lease", queues=["crash"], worker_id="w", count=32, lease_ms=60_000
                )
                batch = reply["jobs"]
                assert batch, "the queue ran dry before the kill"
                leased.update({job["job_id"]: job["token"] for job in batch})
                acks = [
                    {"op": "ack", "job_id": job["job_id"], "worker_id": "w", "token": job["token"]}
                    for job in batch
                ]

                def on_reply(i: int, reply: dict[str, Any], batch=batch) -> None:
                    assert reply["ok"] is True, reply
                    acked.add(batch[i]["job_id"])
                    if len(acked) == kill_after:
                        server.process.kill()  # SIGKILL, with acks still in the pipeline

                await pipeline(client, acks, on_reply)
        assert await server.wait(BOUND_S) == -signal.SIGKILL
        await client.aclose()
    assert kill_after <= len(acked) <= len(leased) - len(held)
    assert len(leased) < total

    async with server_process(db) as server:
        client = await server.connect()
        stats = (await client.ok("stats"))["queues"]["crash"]
        assert stats["succeeded"] >= len(acked), stats
        assert stats["succeeded"] + stats["ready"] == total, stats
        for job_id in acked:
            job = (await client.ok("inspect", job_id=job_id))["job"]
            assert job["state"] == "succeeded", job
        # A job leased but not acked before the crash: its old token changes nothing.
        for job_id in [job["job_id"] for job in held]:
            error = await client.error("ack", job_id=job_id, worker_id="w", token=leased[job_id])
            assert error["code"] in ("stale_token", "lease_expired"), error
            job = (await client.ok("inspect", job_id=job_id))["job"]
            assert job["state"] == "ready", job
        # Nothing was lost: every remaining job can be leased and finished.
        with trio.fail_after(BOUND_S * 2):
            while True:
                reply = await client.ok("lease", queues=["crash"], worker_id="v", count=100)
                if not reply["jobs"]:
                    break
                acks = [{"job_id": job["job_id"], "token": job["token"]} for job in reply["jobs"]]
                reply = await client.ok("ack_batch", worker_id="v", acks=acks)
                assert all(r["ok"] for r in reply["results"]), reply
        stats = (await client.ok("stats"))["queues"]["crash"]
        assert stats["succeeded"] == total, stats
        await stop_gracefully(server, client)

    assert intact_crash_jobs(db) == total


# -- refused databases --------------------------------------------------------------------


def _text_file(path: Path) -> None:
    path.write_text("these are my notes, not a database\n" * 20)


def _foreign_sqlite(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO users (name) VALUES ('ada'), ('grace')")
    conn.commit()
    conn.close()


@pytest.mark.parametrize("make", [_text_file, _foreign_sqlite], ids=["text", "foreign_sqlite"])
async def test_refused_database_exits_2_and_leaves_the_file_unchanged(tmp_path, make):
    db = tmp_path / "precious.db"
    make(db)
    before = db.read_bytes()
    siblings = sorted(p.name for p in tmp_path.iterdir())
    command = [
        str(RELAY), "server", "--db", str(db), "--address", "127.0.0.1:0",
        "--metrics-address", "off", "--ws-address", "off",
    ]  # fmt: skip
    with trio.fail_after(BOUND_S):
        done = await trio.run_process(
            command, stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True,
            check=False,
        )  # fmt: skip
    stderr = done.stderr.decode(errors="replace")
    assert str(db) in stderr, stderr
    assert db.read_bytes() == before
    # No -wal, -shm or journal; the owner lock file, taken first, is left in place.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*siblings, "precious.db.lock"])
    assert done.returncode == 2, f"exit code {done.returncode}; stderr:\n{stderr}"
    assert "Traceback" not in stderr, stderr


# -- one server per database file ----------------------------------------------------------


async def run_command(*args: str, as_user: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``relay-trio *args`` to completion (bounded), its output captured."""
    with trio.fail_after(BOUND_S * 2):
        return await trio.run_process(
            [*as_user, str(RELAY), *args], stdin=subprocess.DEVNULL, capture_stdout=True,
            capture_stderr=True, check=False,
        )  # fmt: skip


def one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2 and exactly one "relay-trio: ..." line on stderr naming each fragment."""
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == 2, f"exit code {done.returncode}; stderr:\n{stderr}"
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("relay-trio: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def server_args(db: Path | str) -> tuple[str, ...]:
    """A second server's command line: every listener of its own (port 0)."""
    return (
        "server", "--db", str(db), "--address", "127.0.0.1:0",
        "--metrics-address", "127.0.0.1:0", "--ws-address", "127.0.0.1:0",
    )  # fmt: skip


def digest(*paths: Path) -> list[str | None]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None for p in paths]


async def test_a_second_server_on_the_same_file_is_refused_and_the_first_undisturbed(tmp_path):
    db = tmp_path / "relay.db"
    wal = tmp_path / "relay.db-wal"
    async with server_process(db) as first:
        client = await first.connect()
        job_id = (await client.ok("submit", queue="q", payload={"n": 1}))["job_id"]
        [job] = (await client.ok("lease", queues=["q"], worker_id="w", lease_ms=600_000))["jobs"]
        before = digest(db, wal)  # the first server is idle now

        second = await run_command(*server_args(db))
        line = one_line_error(second, str(db), f"pid {first.process.pid}", "in use")
        assert line == (
            f"relay-trio: refusing to open {db}: in use by another relay-trio process "
            f"(pid {first.process.pid}); stop it, or give this one another --db"
        )
        assert second.stdout == b""
        assert digest(db, wal) == before  # it neither recovered nor wrote anything

        # The first server's lease stands: the job was not handed back, and its ack works.
        assert (await client.ok("inspect", job_id=job_id))["job"]["state"] == "leased"
        stats = (await client.ok("stats"))["queues"]["q"]
        assert (stats["leased"], stats["ready"]) == (1, 0), stats
        await client.ok("ack", job_id=job_id, worker_id="w", token=job["token"])
        # A lease held when the first server dies, for the restart to recover.
        second_job = (await client.ok("submit", queue="q", payload={"n": 2}))["job_id"]
        await client.ok("lease", queues=["q"], worker_id="w", lease_ms=600_000)

        first.process.kill()  # SIGKILL: the kernel drops its lock
        assert await first.wait(BOUND_S) == -signal.SIGKILL
        await client.aclose()

    async with server_process(db) as restarted:
        [recovered] = [e for e in restarted.events if e["event"] == "server.recovered_leases"]
        assert recovered["count"] == 1
        client = await restarted.connect()
        assert (await client.ok("inspect", job_id=job_id))["job"]["state"] == "succeeded"
        assert (await client.ok("inspect", job_id=second_job))["job"]["state"] == "ready"
        await stop_gracefully(restarted, client)


async def test_demo_on_a_file_a_server_holds_is_refused_in_one_line(tmp_path):
    db = tmp_path / "relay.db"
    async with server_process(db) as server:
        before = digest(db, tmp_path / "relay.db-wal")
        done = await run_command("demo", "--db", str(db), "--jobs", "1")
        one_line_error(done, f"refusing to open {db}", f"pid {server.process.pid}")
        assert digest(db, tmp_path / "relay.db-wal") == before


# -- --db paths that cannot hold a database ------------------------------------------------


async def test_a_directory_as_db_is_refused_in_one_line(tmp_path):
    done = await run_command(*server_args(tmp_path))
    one_line_error(done, f"refusing to open {tmp_path}: is a directory: give a file path")
    assert not await trio.Path(f"{tmp_path}.lock").exists()


async def test_a_db_in_a_missing_directory_is_refused_in_one_line(tmp_path):
    missing = tmp_path / "no" / "such"
    done = await run_command(*server_args(missing / "relay.db"))
    one_line_error(done, str(missing / "relay.db"), f"directory {missing} does not exist")
    assert list(tmp_path.iterdir()) == []


NOBODY = 65534  # the unprivileged user of most Linux systems


@pytest.fixture
def unprivileged() -> Iterator[tuple[Path, tuple[str, ...]]]:
    """A directory others may enter, and a command prefix under which permission bits
    apply: none for a normal user; as root (whom they do not stop: CI), nobody's rights
    through setpriv(1), if that can run relay-trio here."""
    as_user: tuple[str, ...] = ()
    if os.geteuid() == 0:
        as_user = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
        if shutil.which("setpriv") is None:
            pytest.skip("root writes anything, and setpriv(1) is missing to run as nobody")
        probe = subprocess.run([*as_user, str(RELAY), "--version"], capture_output=True,
                               timeout=BOUND_S * 2, check=False)  # fmt: skip
        if probe.returncode != 0:
            pytest.skip(f"root writes anything, and nobody cannot run relay-trio: {probe}")
    base = Path(tempfile.mkdtemp(prefix="relay-trio-perm-"))  # (tmp_path's parent is 0700)
    base.chmod(0o755)
    try:
        yield base, as_user
    finally:
        for path in (base, *base.rglob("*")):
            path.chmod(0o700 if path.is_dir() else 0o600)
        shutil.rmtree(base)


async def test_a_db_in_a_directory_without_write_permission_is_refused(unprivileged):
    base, as_user = unprivileged
    locked = base / "locked"
    locked.mkdir()
    locked.chmod(0o555)  # others (and the owner) may enter but not create
    done = await run_command(*server_args(locked / "relay.db"), as_user=as_user)
    line = one_line_error(done, str(locked / "relay.db"), "permission denied", str(locked))
    assert "-wal" in line and ".lock" in line  # why the directory must be writable
    assert list(locked.iterdir()) == []


async def test_a_db_file_without_read_write_permission_is_refused(unprivileged):
    base, as_user = unprivileged
    base.chmod(0o777)  # the directory is not the problem here
    db = base / "relay.db"
    db.write_bytes(b"")
    db.chmod(0)
    done = await run_command(*server_args(db), as_user=as_user)
    one_line_error(done, f"refusing to open {db}: permission denied")
    assert sorted(p.name for p in base.iterdir()) == ["relay.db"]
