"""A server that crashed with jobs leased restarts on a full disk: the recovery of those
leases cannot commit, yet the server starts, answers pings and reads, refuses writes with
``unavailable`` (the orphaned leases included: no ack, renew or claim commits before the
recovery), and recovers the leases by itself once the disk has room again.

The ``relay-trio server`` command as a subprocess, its database on a small tmpfs
(tests/server/test_disk_full.py's fixture, which needs root) filled to the last byte.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import trio

from tests.server.conftest import BOUND_S
from tests.server.test_disk_full import small_disk
from tests.server.test_process import ServerProcess, server_process, stop_gracefully
from tests.worker.helpers import wait_until

__all__ = ["small_disk"]  # (a fixture of this module's tests)

# How long the test lets the full disk stand, to see that retries add no log lines.
FULL_FOR_S = 2.5


def fill(path: Path) -> None:
    """Write ``path`` until its file system has no byte left."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 9, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc


def count(server: ServerProcess, name: str) -> int:
    return server.event_names().count(name)


async def wait_for_event(server: ServerProcess, name: str) -> dict:
    async def logged() -> dict | None:
        return next((e for e in server.events if e["event"] == name), None)

    return await wait_until(logged, what=name)


async def test_a_crash_with_leases_then_a_full_disk_still_starts_and_recovers_later(small_disk):
    mount, _resize = small_disk
    db = mount / "relay.db"
    async with server_process(db) as first:
        client = await first.connect()
        orphan_id = (await client.ok("submit", queue="orphan", payload={"n": 1}))["job_id"]
        [held] = (await client.ok("lease", queues=["orphan"], worker_id="w", lease_ms=600_000))[
            "jobs"
        ]
        ready_id = (await client.ok("submit", queue="ready", payload={"n": 2}))["job_id"]
        first.process.kill()  # SIGKILL: the lease is left behind in the database
        assert await first.wait(BOUND_S) == -signal.SIGKILL
        await client.aclose()

    filler = mount / "filler"
    fill(filler)

    async with server_process(db) as server:
        names = server.event_names()
        assert "server.recovery_pending" in names, server.stderr.decode(errors="replace")
        assert "server.recovered_leases" not in names
        client = await server.connect()
        ack = {"job_id": orphan_id, "worker_id": "w", "token": held["token"]}

        # Reads and pings are served; the orphaned lease stands until it is recovered.
        await client.ok("ping")
        queues = (await client.ok("stats"))["queues"]
        assert (queues["orphan"]["leased"], queues["ready"]["ready"]) == (1, 1), queues
        assert (await client.ok("inspect", job_id=orphan_id))["job"]["state"] == "leased"
        # Every write is refused, the old lease's ack and renew too: nothing commits
        # before the recovery, which would otherwise take back a lease it had just renewed.
        for op, fields in [
            ("submit", {"queue": "ready", "payload": {"n": 3}}),
            ("lease", {"queues": ["ready"], "worker_id": "v"}),
            ("renew", {**ack, "lease_ms": 600_000}),
            ("ack", ack),
        ]:
            error = await client.error(op, **fields)
            assert error["code"] == "unavailable", (op, error)
            assert "disk full" in error["message"], error
        # A long-poll on the orphan's queue finds nothing ready, and waits.
        parked = await client.send("lease", queues=["orphan"], worker_id="v", wait_ms=30_000)
        await client.ok("ping")

        await trio.sleep(FULL_FOR_S)  # retried in the background, quietly
        assert count(server, "server.recovery_pending") == 1
        assert count(server, "store.unavailable") == 1
        assert (await client.ok("inspect", job_id=orphan_id))["job"]["state"] == "leased"

        os.remove(filler)  # room again: the recovery commits without any request
        recovered = await wait_for_event(server, "server.recovered_leases")
        assert recovered["count"] == 1
        # The parked long-poll is woken by the recovery and gets the orphan, its attempt
        # given back (the restart was not the job's failure).
        reply = await client.read()
        assert reply["id"] == parked and reply["ok"], reply
        [job] = reply["jobs"]
        assert (job["job_id"], job["attempt"]) == (orphan_id, 1)
        assert job["token"] != held["token"]
        # The old token is dead; the new lease and every other write work.
        error = await client.error("ack", **ack)
        assert error["code"] in ("lease_expired", "stale_token"), error
        await client.ok("ack", job_id=orphan_id, worker_id="v", token=job["token"])
        await client.ok("submit", queue="ready", payload={"n": 4})
        [again] = (await client.ok("lease", queues=["ready"], worker_id="v"))["jobs"]
        assert again["job_id"] == ready_id
        await stop_gracefully(server, client)
    assert b"Traceback" not in server.stderr, server.stderr.decode(errors="replace")


async def test_a_start_on_a_full_disk_with_nothing_leased_needs_no_write(small_disk):
    mount, _resize = small_disk
    db = mount / "relay.db"
    async with server_process(db) as first:
        client = await first.connect()
        await client.ok("submit", queue="q", payload={})
        first.process.kill()
        await first.wait(BOUND_S)
        await client.aclose()
    fill(mount / "filler")
    async with server_process(db) as server:
        assert "server.recovery_pending" not in server.event_names()
        client = await server.connect()
        assert (await client.ok("stats"))["queues"]["q"]["ready"] == 1
        await stop_gracefully(server, client)
