"""Servers on one PostgreSQL database, in this process: wake-ups across servers (LISTEN/
NOTIFY), and a lost connection (the store's, or the feed's) answered ``unavailable`` and
made again without a restart. Several server processes, killed under load, are in
test_servers_postgres.py."""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import orjson
import psycopg
import pytest
import trio

from relay.server.services import waiters as waiters_service
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


class Heard:
    """The notifications on the servers' channel, as another server's feed hears them."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute("LISTEN relay_changes")

    async def until_now(self) -> list[str]:
        """The payloads notified since the last call: a marker notified now comes after
        every notification of a commit made before (one channel's arrive in commit order)."""
        marker = f"marker-{secrets.token_hex(4)}"
        self.conn.execute("SELECT pg_notify('relay_changes', %s)", (marker,))

        def read() -> list[str]:
            heard = []
            for note in self.conn.notifies(timeout=BOUND_S):
                if note.payload == marker:
                    return heard
                heard.append(note.payload)
            raise AssertionError(f"the marker never came back; heard {heard}")

        return await trio.to_thread.run_sync(read)

    def close(self) -> None:
        self.conn.close()


def queues(text: str) -> list[str]:
    """The queues a notification names."""
    return orjson.loads(text).get("q", [])


def rows_of_waiters(url: str) -> list[str]:
    with psycopg.connect(url, autocommit=True) as admin:
        return [row[0] for row in admin.execute("SELECT queue FROM waiters ORDER BY queue")]


async def until_waiting(url: str, queue: str) -> None:
    """Until a server holds a row in ``waiters`` for ``queue``."""
    with trio.fail_after(BOUND_S):
        while queue not in rows_of_waiters(url):  # noqa: ASYNC110 (another process's view)
            await trio.sleep(0.02)


async def waiting(client: LineClient, url: str, queue: str) -> None:
    """Until the client's server holds a row for ``queue`` and is done waking the leases
    parked before it: a first lease parks on the queue until its short wait ends, the row
    written meanwhile. (So what follows is told through the row, not found by that wake.)"""
    rid = await parked_lease(client, queue, wait_ms=300)
    await until_waiting(url, queue)
    with trio.fail_after(BOUND_S):
        reply = await client.read()
    assert reply == {"id": rid, "ok": True, "jobs": []}, reply


async def test_a_commit_notifies_only_if_another_server_has_a_long_poll_on_its_queue(shared_url):
    """Jobs made ready are told to the other servers only where one of them waits: a busy
    producer's commits otherwise cost every server a notification to read and drop."""
    heard = Heard(shared_url)
    try:
        async with servers(shared_url, 2) as (a, b):
            ca, cb = await a.connect(), await b.connect()
            await ca.ok("submit", queue="nobody", payload={})
            assert not [text for text in await heard.until_now() if "nobody" in queues(text)]
            await waiting(cb, shared_url, "someone")
            rid = await parked_lease(cb, "someone")
            job = (await ca.ok("submit", queue="someone", payload={}))["job_id"]
            told = [text for text in await heard.until_now() if "someone" in queues(text)]
            assert len(told) == 1, told
            with trio.fail_after(2):
                reply = await cb.read()
            assert reply["id"] == rid and [j["job_id"] for j in reply["jobs"]] == [job], reply
            # A's own long-polls are not another server's: its commits tell nobody of them.
            await waiting(ca, shared_url, "own")
            rid = await parked_lease(ca, "own")
            job = (await ca.ok("submit", queue="own", payload={}))["job_id"]
            with trio.fail_after(2):
                reply = await ca.read()
            assert reply["id"] == rid and [j["job_id"] for j in reply["jobs"]] == [job], reply
            assert not [text for text in await heard.until_now() if "own" in queues(text)]
            await ca.aclose()
            await cb.aclose()
    finally:
        heard.close()


async def test_a_long_poll_whose_row_went_is_woken_once_its_server_writes_it_again(
    shared_url, monkeypatch
):
    """A commit made while a server's row was missing told nobody; the row written again
    (at its renewal) wakes the leases parked on its queue, which find the job."""
    monkeypatch.setattr(waiters_service, "RENEW_S", 1.0)
    heard = Heard(shared_url)
    try:
        async with servers(shared_url, 2) as (a, b):
            ca, cb = await a.connect(), await b.connect()
            await waiting(cb, shared_url, "lapsed")
            rid = await parked_lease(cb, "lapsed", wait_ms=30_000)
            with psycopg.connect(shared_url, autocommit=True) as admin:
                admin.execute("DELETE FROM waiters")
            job = (await ca.ok("submit", queue="lapsed", payload={}))["job_id"]
            told = [text for text in await heard.until_now() if "lapsed" in queues(text)]
            with trio.fail_after(BOUND_S):
                reply = await cb.read()
            assert reply["id"] == rid and [j["job_id"] for j in reply["jobs"]] == [job], reply
            assert rows_of_waiters(shared_url) == ["lapsed"]
            # (Told only if the renewal came first, on a slow machine: then the notification
            # woke it, as in the test above.)
            assert len(told) <= 1, told
            await ca.aclose()
            await cb.aclose()
    finally:
        heard.close()


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


async def test_submits_answer_the_ids_of_the_jobs_they_made_in_order_through_any_server(
    shared_url,
):
    """A submit without keys has its ids drawn by its insert, with the commit: through the
    wire, every answer names the job made of its own request, ids grow from one commit to
    the next through either server, and a watcher sees each job under its id."""
    async with servers(shared_url, 2) as (a, b):
        ca, cb, watcher = await a.connect(), await b.connect(), await a.connect()
        await watcher.ok("watch", queues=["ids"])
        sent: dict[int, list[int]] = {}  # request id -> the payloads' n
        for n in range(40):  # pipelined: many in one writer batch
            if n % 10 == 9:
                batch = [{"queue": "ids", "payload": {"n": 1000 + n * 10 + i}} for i in range(3)]
                sent[await ca.send("submit_batch", jobs=batch)] = [
                    1000 + n * 10 + i for i in range(3)
                ]
            else:
                sent[await ca.send("submit", queue="ids", payload={"n": n})] = [n]
        answers: dict[int, list[str]] = {}
        with trio.fail_after(BOUND_S):
            while len(answers) < len(sent):
                reply = await ca.read()
                assert reply["ok"], reply
                results = reply.get("results") or [reply]
                answers[reply["id"]] = [result["job_id"] for result in results]
        # (Pipelined requests are made in the writer's order, a batch's submits before
        # its submit_batches: ids grow within a request, and are each a job of its own.)
        ids = [job for rid in sorted(sent) for job in answers[rid]]
        assert all(jobs == sorted(jobs) for jobs in answers.values())
        assert len(set(ids)) == len(ids)
        for rid in sorted(sent)[::7]:
            for job, n in zip(answers[rid], sent[rid], strict=True):
                job_info = (await ca.ok("inspect", job_id=job))["job"]
                assert (job_info["queue"], job_info["payload"]) == ("ids", {"n": n})
        # One at a time through either server: each id above the one before.
        last = ids[-1]
        for i in range(10):
            job = (await (ca, cb)[i % 2].ok("submit", queue="other", payload=i))["job_id"]
            assert job > last
            last = job
        seen = []
        with trio.fail_after(BOUND_S):
            while len(seen) < len(ids):
                event = await watcher.read()
                assert event["event"] == "job" and event["state"] == "ready", event
                assert "from" not in event
                seen.append(event["job_id"])
        assert sorted(seen) == sorted(ids) and seen == sorted(seen)  # (in commit order)
        for c in (ca, cb, watcher):
            await c.aclose()
