"""Servers on one PostgreSQL database, in this process: wake-ups across servers (LISTEN/
NOTIFY), and a lost connection (the store's, or the feed's) answered ``unavailable`` and
made again without a restart. Several server processes, killed under load, are in
test_servers_postgres.py."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import psycopg
import pytest
import trio

from tests import pg
from tests.server.conftest import BOUND_S, LineClient, RunningServer, start_server


@pytest.fixture
def shared_url() -> Iterator[str]:
    """A ``postgresql://`` URL (what ``--db`` takes) to a database of this test's own, so
    that its sessions (pg_stat_activity) are its servers' only."""
    with pg.run_database() as conninfo:
        yield pg.server_url(conninfo)


@asynccontextmanager
async def servers(url: str, n: int) -> AsyncIterator[list[RunningServer]]:
    async with trio.open_nursery() as nursery:
        running = [await start_server(nursery, url, shutdown_timeout_ms=2000) for _ in range(n)]
        try:
            yield running
        finally:
            for server in running:
                server.handle.shutdown()


def terminate(url: str, application: str) -> int:
    """End the database sessions of ``application`` on this database; how many."""
    with psycopg.connect(url, autocommit=True) as admin:
        return admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            (application,),
        ).fetchone()[0]


def sessions(url: str, application: str) -> int:
    with psycopg.connect(url, autocommit=True) as admin:
        return admin.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            (application,),
        ).fetchone()[0]


async def parked_lease(client: LineClient, queue: str, wait_ms: int = 10_000) -> int:
    """Send a long-poll lease and return its request id once it is parked: an ``inspect``
    sent after it on the same connection is answered only after the lease found nothing
    (the writer answers a connection's requests in order, and parks a lease as it
    delivers; ``stats`` would not do: it is answered at once, from memory)."""
    rid = await client.send("lease", queues=[queue], worker_id="w-b", wait_ms=wait_ms)
    marker = await client.send("inspect", job_id="job_0000000000000000")
    with trio.fail_after(BOUND_S):
        reply = await client.read()
    assert reply["id"] == marker, f"the lease was answered before it parked: {reply}"
    return rid


async def test_a_submit_through_one_server_wakes_a_long_poll_parked_on_another(shared_url):
    async with servers(shared_url, 2) as (a, b):
        ca, cb = await a.connect(), await b.connect()
        rid = await parked_lease(cb, "wake")
        started = trio.current_time()
        job = (await ca.ok("submit", queue="wake", payload={"n": 1}))["job_id"]
        with trio.fail_after(2):  # the lease waits 10 s unless something wakes it
            reply = await cb.read()
        waited = trio.current_time() - started
        assert reply["id"] == rid and [j["job_id"] for j in reply["jobs"]] == [job], reply
        assert waited < 1.0, f"woken after {waited:.3f} s"
        await ca.aclose()
        await cb.aclose()


async def test_the_feed_listens_again_after_its_connection_is_lost(shared_url):
    async with servers(shared_url, 2) as (a, b):
        ca, cb = await a.connect(), await b.connect()
        assert terminate(shared_url, "relay-trio listen") == 2
        with trio.fail_after(BOUND_S):
            while sessions(shared_url, "relay-trio listen") < 2:  # noqa: ASYNC110 (the feeds' threads)
                await trio.sleep(0.05)
        rid = await parked_lease(cb, "again")
        job = (await ca.ok("submit", queue="again", payload={}))["job_id"]
        with trio.fail_after(2):
            reply = await cb.read()
        assert reply["id"] == rid and [j["job_id"] for j in reply["jobs"]] == [job], reply
        await ca.aclose()
        await cb.aclose()


async def test_a_lost_store_connection_is_unavailable_then_made_again(shared_url, caplog):
    caplog.set_level(logging.INFO, logger="relay.writer")
    async with servers(shared_url, 1) as (a,):
        c = await a.connect()
        kept = (await c.ok("submit", queue="lost", payload={"n": 0}))["job_id"]
        assert terminate(shared_url, "relay-trio") == 1
        # The first batch to find the connection gone (this request's, or one of the
        # server's own passes) is answered unavailable: not committed, retry later. Then
        # the writer connects again and serves, without a restart.
        answers = []
        with trio.fail_after(BOUND_S):
            while True:
                reply = await c.request("submit", queue="lost", payload={"n": len(answers) + 1})
                answers.append(reply)
                if reply["ok"]:
                    break
                assert reply["error"]["code"] == "unavailable", reply
                await trio.sleep(0.05)
        logged = [r.getMessage() for r in caplog.records if r.name == "relay.writer"]
        assert "store.unavailable" in logged and "store.reconnected" in logged, logged
        assert logged.index("store.unavailable") < logged.index("store.reconnected")
        # Every job answered ok is there, and only those.
        stats = (await c.ok("stats"))["queues"]["lost"]
        assert stats["ready"] == 1 + sum(reply["ok"] for reply in answers), stats
        assert (await c.ok("inspect", job_id=kept))["job"]["state"] == "ready"
        await c.aclose()
