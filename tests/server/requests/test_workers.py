"""``workers_list`` over the wire, with real workers connected (raw connections and a
``relay.Worker``), on both stores: each connection that has leased, with its client name,
address, queues, the jobs it holds now (read from the store: an ack through another
connection, or an expiry, ends a hold), its parked long-polls; bounded and paged; a
closed connection is no longer listed; and ``relay_workers`` /
``relay_queue_oldest_ready_seconds`` on /metrics."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import relay
from relay.protocol.requests import WORKERS_PAGE
from tests import pg
from tests.server.conftest import BOUND_S, LineClient, RunningServer, start_server
from tests.server.test_lifecycle import scrape
from tests.worker.helpers import serving, wait_until

LEASE_MS = 30_000


@pytest.fixture(params=["sqlite", "postgres"])
async def any_server(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[RunningServer]:
    if request.param == "sqlite":
        db = str(tmp_path / "relay.db")
        async with serving(start_server, db) as running:
            yield running
        return
    with pg.run_database() as conninfo:
        async with serving(start_server, pg.server_url(conninfo)) as running:
            yield running


async def workers(client: LineClient, **fields) -> dict:
    return await client.ok("workers_list", **fields)


async def submit(client: LineClient, queue: str, n: int) -> list[str]:
    return [(await client.ok("submit", queue=queue, payload={"n": i}))["job_id"] for i in range(n)]


async def test_a_leasing_connection_is_listed_with_what_it_holds(any_server) -> None:
    server = any_server
    admin = await server.connect()
    jobs = await submit(admin, "a", 3)
    assert (await workers(admin))["workers"] == []  # submitting is not working
    pump = await server.connect()
    await pump.ok("hello", client="pump/1.0")
    leased = await pump.ok("lease", queues=["a", "b"], worker_id="w1", count=2, lease_ms=LEASE_MS)
    assert [job["job_id"] for job in leased["jobs"]] == jobs[:2]
    page = await workers(admin)
    host, port = pump.stream.socket.getsockname()[:2]
    assert page["server"] == f"{socket.gethostname()}:{server.handle.address[1]}"
    assert page["total"] == 1 and page["next_cursor"] is None
    [entry] = page["workers"]
    assert entry["worker_id"] == "w1" and entry["worker_ids"] == ["w1"]
    assert entry["client"] == "pump/1.0"
    assert entry["peer"] == f"{host}:{port}"
    assert entry["queues"] == ["a", "b"] and entry["queues_total"] == 2
    assert entry["jobs_held"] == 2 and entry["parked"] == 0
    held = {job["job_id"]: job for job in entry["jobs"]}
    assert set(held) == set(jobs[:2])
    assert all(job["queue"] == "a" and job["worker_id"] == "w1" for job in held.values())
    assert all(0 <= job["held_ms"] < BOUND_S * 1000 for job in held.values())
    assert entry["longest_held_ms"] == max(job["held_ms"] for job in held.values())
    assert entry["connected_at"] <= entry["first_lease_at"] <= entry["last_request_at"]
    assert entry["last_request_at"] <= page["at"]

    # Acked through another connection (a worker that reconnected), a job is no longer
    # held; a long-poll of the first connection is counted as parked.
    other = await server.connect()
    await other.ok(
        "ack", job_id=jobs[0], worker_id="w1", token=leased["jobs"][0]["token"], result=None
    )
    await pump.send("lease", queues=["c"], worker_id="w2", wait_ms=10_000)

    async def parked() -> dict | None:
        entries = {e["worker_id"]: e for e in (await workers(admin))["workers"]}
        return entries.get("w2") if entries.get("w2", {}).get("parked") == 1 else None

    entry = await wait_until(parked, what="the long-poll parked")
    assert entry["worker_ids"] == ["w2", "w1"]
    assert entry["queues"] == ["a", "b", "c"]
    assert [job["job_id"] for job in entry["jobs"]] == [jobs[1]]

    # Gone, it is listed no more (its lease is the store's until it expires).
    await pump.aclose()

    async def gone() -> bool:
        return (await workers(admin))["workers"] == []

    await wait_until(gone, what="the closed connection forgotten")
    for each in (admin, other):
        await each.aclose()


async def test_a_job_leased_before_a_reconnect_is_held_with_its_start(server) -> None:
    admin = await server.connect()
    [job] = await submit(admin, "q", 1)
    first = await server.connect()
    await first.ok("lease", queues=["q"], worker_id="w1", lease_ms=LEASE_MS)
    await first.aclose()
    again = await server.connect()
    await again.ok("lease", queues=["q"], worker_id="w1", lease_ms=LEASE_MS)

    async def one() -> dict | None:
        page = await workers(admin)
        return page if len(page["workers"]) == 1 else None

    [entry] = (await wait_until(one, what="the first connection forgotten"))["workers"]
    [held] = entry["jobs"]
    assert (held["job_id"], held["worker_id"], entry["jobs_held"]) == (job, "w1", 1)
    assert 0 <= held["held_ms"] < BOUND_S * 1000
    assert entry["longest_held_ms"] == held["held_ms"]
    for each in (admin, again):
        await each.aclose()


async def test_the_oldest_job_of_a_busy_worker_keeps_its_time(server) -> None:
    """A worker stuck on one job while it runs hundreds of others: the stuck job is the
    longest held, with its time (it was the one forgotten when each connection kept only
    its last hand-outs)."""
    admin = await server.connect()
    [stuck] = await submit(admin, "slow", 1)
    worker = await server.connect()
    await worker.ok("lease", queues=["slow"], worker_id="w1", lease_ms=LEASE_MS)
    await submit(admin, "q", 600)
    for _ in range(6):
        reply = await worker.ok("lease", queues=["q"], worker_id="w1", count=100, lease_ms=LEASE_MS)
        for job in reply["jobs"]:
            await worker.ok("ack", job_id=job["job_id"], worker_id="w1", token=job["token"])
    [entry] = (await workers(admin))["workers"]
    assert [job["job_id"] for job in entry["jobs"]] == [stuck]
    assert entry["jobs"][0]["held_ms"] is not None
    assert entry["longest_held_ms"] == entry["jobs"][0]["held_ms"]
    for each in (admin, worker):
        await each.aclose()


async def test_pages_in_the_order_connections_first_leased(server) -> None:
    admin = await server.connect()
    conns = [await server.connect() for _ in range(3)]
    for i, conn in enumerate(conns):
        await conn.ok("lease", queues=["q"], worker_id=f"w{i}")
    first = await workers(admin, limit=2)
    assert [e["worker_id"] for e in first["workers"]] == ["w0", "w1"]
    assert first["total"] == 3 and first["next_cursor"] is not None
    rest = await workers(admin, limit=2, cursor=first["next_cursor"])
    assert [e["worker_id"] for e in rest["workers"]] == ["w2"] and rest["next_cursor"] is None
    for bad in ({"limit": 0}, {"limit": WORKERS_PAGE + 1}, {"cursor": "x"}):
        assert (await admin.error("workers_list", **bad))["code"] == "bad_request"
    for each in (admin, *conns):
        await each.aclose()


async def test_a_connection_leasing_many_queues_and_worker_ids_is_bounded(server) -> None:
    admin = await server.connect()
    conn = await server.connect()
    for i in range(10):
        queues = [f"q{i}-{k}" for k in range(10)]
        await conn.ok("lease", queues=queues, worker_id=f"w{i}")
    [entry] = (await workers(admin))["workers"]
    assert entry["worker_ids"] == ["w9", "w8", "w7", "w6"]  # the last 4
    assert entry["queues_total"] == 40 and len(entry["queues"]) == 32
    for each in (admin, conn):
        await each.aclose()


async def test_a_relay_worker_is_listed_with_the_job_it_runs(server) -> None:
    admin = await server.connect()
    started, done = trio.Event(), trio.Event()

    async def handler(job):
        started.set()
        await done.wait()

    host, port = server.handle.address
    worker = relay.Worker(
        f"{host}:{port}", queues=["mail"], handler=handler, worker_id="mailer-1",
        shutdown_timeout=1,
    )  # fmt: skip
    [job] = await submit(admin, "mail", 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        with trio.fail_after(BOUND_S):
            await started.wait()
        [entry] = (await workers(admin))["workers"]
        assert entry["worker_id"] == "mailer-1" and entry["queues"] == ["mail"]
        assert [j["job_id"] for j in entry["jobs"]] == [job]
        assert entry["jobs"][0]["held_ms"] is not None
        done.set()

        async def finished() -> bool:
            return (await admin.ok("inspect", job_id=job))["job"]["state"] == "succeeded"

        await wait_until(finished, what="the job acked")
        [entry] = (await workers(admin))["workers"]
        assert entry["jobs"] == [] and entry["jobs_held"] == 0
        nursery.cancel_scope.cancel()
    await admin.aclose()


async def families(server: RunningServer) -> dict[str, dict[tuple, float]]:
    text, _ = await scrape(server)
    done = await trio.run_process(
        ["promtool", "check", "metrics"], stdin=text.encode(), capture_stdout=True,
        capture_stderr=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    found: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


async def test_metrics_count_workers_per_queue_and_the_oldest_ready_age(server) -> None:
    admin = await server.connect()
    await submit(admin, "idle", 2)  # ready jobs, no worker
    conns = [await server.connect() for _ in range(2)]
    await conns[0].ok("lease", queues=["busy", "other"], worker_id="a")
    await conns[1].ok("lease", queues=["busy"], worker_id="b")
    found = await families(server)
    assert found["relay_workers"] == {
        (("queue", "busy"),): 2, (("queue", "other"),): 1, (("queue", "idle"),): 0,
    }  # fmt: skip
    ages = found["relay_queue_oldest_ready_seconds"]
    assert set(ages) == {(("queue", "idle"),)} and 0 <= ages[(("queue", "idle"),)] < BOUND_S
    for each in (admin, *conns):
        await each.aclose()


async def test_the_clients_read_a_page_of_workers(server) -> None:
    host, port = server.handle.address
    conn = await server.connect()
    await conn.ok("hello", client="batcher")
    await conn.ok("lease", queues=["q"], worker_id="w1")
    async with relay.open_client(f"{host}:{port}") as client:
        page = await client.workers_list(limit=5)
    assert isinstance(page, relay.WorkersPage) and page.total == 1
    [worker] = page.workers
    assert isinstance(worker, relay.WorkerInfo)
    assert (worker.worker_id, worker.client, worker.queues, worker.jobs) == (
        "w1", "batcher", ["q"], [],
    )  # fmt: skip

    def blocking() -> relay.WorkersPage:
        queue = relay.connect(f"{host}:{port}")
        try:
            return queue.workers_list(limit=1)
        finally:
            queue.close()

    same = await trio.to_thread.run_sync(blocking)
    assert [w.worker_id for w in same.workers] == ["w1"] and same.server == page.server
    await conn.aclose()


async def test_a_worker_id_with_a_nul_is_listed_with_its_job(any_server) -> None:
    """A worker id may be any text: one with a NUL (which PostgreSQL's text cannot hold,
    so it is stored escaped) neither breaks ``workers_list`` nor hides its jobs."""
    server = any_server
    admin = await server.connect()
    [job] = await submit(admin, "q", 1)
    worker = await server.connect()
    await worker.ok("lease", queues=["q"], worker_id="w\x00x", lease_ms=LEASE_MS)
    [entry] = (await workers(admin))["workers"]
    assert entry["worker_id"] == "w\x00x" and entry["jobs_held"] == 1
    assert [(j["job_id"], j["worker_id"]) for j in entry["jobs"]] == [(job, "w\x00x")]
    for each in (admin, worker):
        await each.aclose()
