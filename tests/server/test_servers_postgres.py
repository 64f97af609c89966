"""Three real ``relay-trio server`` processes on one PostgreSQL database.

The module has a database of its own (tests/pg.py), shared by its tests; each test starts
its own three servers and uses queues no other test uses, so the counts it checks are its
own. Servers listen on 127.0.0.1 port 0 and name their address in ``server.started``.
Every wait is bounded, and every server is killed on the way out.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from relay.server.services.maintenance import REFRESH_INTERVAL_S
from tests import pg

from .conftest import BOUND_S, LineClient, writer_barrier
from .test_process import RELAY, ServerProcess

SERVERS = 3
# Long enough that no lease expires while a test means it to be held.
LONG_LEASE_MS = 30_000
# Short enough that a killed server's leases come back within a test's patience.
SHORT_LEASE_MS = 1_000


@pytest.fixture(scope="module")
def db_url() -> Iterator[str]:
    with pg.run_database() as conninfo:
        yield pg.server_url(conninfo)


@asynccontextmanager
async def servers(
    db_url: str, n: int = SERVERS, extra: tuple[str, ...] = ()
) -> AsyncIterator[list[ServerProcess]]:
    """``n`` servers on ``db_url`` (with the options ``extra``), started together; killed
    (SIGKILL) on the way out."""
    command = [
        str(RELAY), "server", "--db", db_url, "--address", "127.0.0.1:0",
        "--metrics-address", "127.0.0.1:0", "--ws-address", "off",
        "--shutdown-timeout-ms", "2000", *extra,
    ]  # fmt: skip
    started: list[ServerProcess] = []
    async with trio.open_nursery() as nursery:
        try:
            for _ in range(n):
                process = await trio.lowlevel.open_process(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
                server = ServerProcess(process)
                started.append(server)
                nursery.start_soon(server.pump)
            # Three Python processes importing at once on a small machine: allow for it.
            with trio.fail_after(3 * BOUND_S):
                for server in started:
                    await server.settled.wait()
            for server in started:
                assert server.address is not None, f"server did not start: {server.stderr!r}"
            yield started
        finally:
            for server in started:
                if server.process.returncode is None:
                    server.process.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(BOUND_S):
                for server in started:
                    await server.process.wait()


def refused(reply: dict[str, Any]) -> str:
    assert reply["ok"] is False, reply
    return reply["error"]["code"]


async def wait_for_lease(
    client: LineClient, queue: str, worker: str, within_s: float = BOUND_S, **fields: Any
) -> dict[str, Any]:
    """Lease one job from ``queue``, asking again until one comes (a lease parked on one
    server is not woken by another server's commits: this asks without waiting)."""
    with trio.fail_after(within_s):
        while True:
            reply = await client.ok("lease", queues=[queue], worker_id=worker, **fields)
            if reply["jobs"]:
                return reply["jobs"][0]
            await trio.sleep(0.05)


async def test_jobs_submitted_anywhere_are_leased_anywhere_once(db_url):
    queue, per_server, workers_per_server = "anywhere", 100, 3
    async with servers(db_url) as group:
        clients = [await s.connect() for s in group]
        a, b, c = clients

        # One job, deterministically: submitted through A, leased through B, acked through C.
        job_id = (await a.ok("submit", queue="one", payload={}))["job_id"]
        job = await wait_for_lease(b, "one", "w-b", lease_ms=LONG_LEASE_MS)
        assert job["job_id"] == job_id
        await c.ok("ack", job_id=job_id, worker_id="w-b", token=job["token"])
        assert (await a.ok("inspect", job_id=job_id))["job"]["state"] == "succeeded"

        submitted: dict[str, int] = {}  # job id -> the server it was submitted through
        for i, client in enumerate(clients):
            jobs = [{"queue": queue, "payload": {"i": n}} for n in range(per_server)]
            reply = await client.ok("submit_batch", jobs=jobs)
            submitted |= {r["job_id"]: i for r in reply["results"]}
        assert len(submitted) == SERVERS * per_server

        leases: list[tuple[str, str, int]] = []  # (job id, token, server leased through)
        in_flight: set[str] = set()
        acked: list[str] = []

        async def work(server: int, worker: str) -> None:
            client = await group[server].connect()
            while True:
                reply = await client.ok(
                    "lease", queues=[queue], worker_id=worker, count=4, lease_ms=LONG_LEASE_MS
                )
                if not reply["jobs"]:
                    return
                for job in reply["jobs"]:
                    assert job["job_id"] not in in_flight, f"{job['job_id']} leased twice"
                    in_flight.add(job["job_id"])
                    leases.append((job["job_id"], job["token"], server))
                for job in reply["jobs"]:
                    await client.ok(
                        "ack", job_id=job["job_id"], worker_id=worker, token=job["token"]
                    )
                    in_flight.discard(job["job_id"])
                    acked.append(job["job_id"])

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for server in range(SERVERS):
                    for w in range(workers_per_server):
                        nursery.start_soon(work, server, f"w{server}-{w}")

    assert sorted(acked) == sorted(submitted), "every job acked exactly once"
    assert len(leases) == len(submitted), "no job leased twice (no lease expired meanwhile)"
    assert len({token for _, token, _ in leases}) == len(leases)
    crossed = {(submitted[job], server) for job, _, server in leases}
    assert any(s != t for s, t in crossed), crossed


async def test_late_ack_through_another_server_is_refused(db_url):
    queue = "late"
    async with servers(db_url) as group:
        a, b, c = [await s.connect() for s in group]
        job_id = (await a.ok("submit", queue=queue, payload={}, retries=5))["job_id"]
        first = await wait_for_lease(b, queue, "w1", lease_ms=300)
        assert first["job_id"] == job_id

        # The lease expires and B's reaper ends it: the holder's token answers
        # lease_expired, through any server.
        with trio.fail_after(BOUND_S):
            while True:
                if (await c.ok("inspect", job_id=job_id))["job"]["state"] != "leased":
                    break
                await trio.sleep(0.05)
        late = await c.request("ack", job_id=job_id, worker_id="w1", token=first["token"])
        assert refused(late) == "lease_expired"

        # Leased again through A by another worker: the old token is now stale, and the
        # job is the new holder's to ack.
        second = await wait_for_lease(a, queue, "w2", lease_ms=LONG_LEASE_MS)
        assert second["job_id"] == job_id and second["token"] != first["token"]
        late = await c.request("ack", job_id=job_id, worker_id="w1", token=first["token"])
        assert refused(late) == "stale_token"
        await b.ok("ack", job_id=job_id, worker_id="w2", token=second["token"])
        job = (await c.ok("inspect", job_id=job_id))["job"]
        assert job["state"] == "succeeded" and job["attempt"] == 2


async def test_sigkill_of_one_server_under_load_loses_no_acknowledged_job(db_url):
    queue, held_queue, victim = "killed", "killed-held", 2
    async with servers(db_url) as group:
        submitted: set[str] = set()  # answered ok
        leased_by: dict[str, list[int]] = {}  # job id -> the servers it was leased through
        acked: set[str] = set()
        stop_producing, killed = trio.Event(), trio.Event()

        async def produce(server: int) -> None:
            client = await group[server].connect()
            n = 0
            try:
                while not stop_producing.is_set():
                    reply = await client.ok("submit", queue=queue, payload={"n": n}, retries=5)
                    submitted.add(reply["job_id"])
                    n += 1
            except (trio.BrokenResourceError, AssertionError):
                assert server == victim, f"server {server} failed, not only the killed one"

        async def work(server: int, worker: str, until: trio.Event) -> None:
            client = await group[server].connect()
            try:
                while not until.is_set():
                    # The held jobs are left to the holder until its server is killed.
                    queues = [queue, held_queue] if killed.is_set() else [queue]
                    reply = await client.ok(
                        "lease", queues=queues, worker_id=worker, count=4,
                        lease_ms=SHORT_LEASE_MS, wait_ms=200,
                    )  # fmt: skip
                    for job in reply["jobs"]:
                        leased_by.setdefault(job["job_id"], []).append(server)
                    for job in reply["jobs"]:
                        ack = await client.request(
                            "ack", job_id=job["job_id"], worker_id=worker, token=job["token"]
                        )
                        if ack["ok"]:
                            acked.add(job["job_id"])
            except (trio.BrokenResourceError, AssertionError):
                assert server == victim, f"server {server} failed, not only the killed one"

        drained = trio.Event()
        with trio.fail_after(40):
            async with trio.open_nursery() as nursery:
                for server in range(SERVERS):
                    nursery.start_soon(produce, server)
                    for w in range(2):
                        nursery.start_soon(work, server, f"w{server}-{w}", drained)
                await trio.sleep(1.0)
                # A worker on the victim that takes jobs and never acks them (from a queue
                # of their own, so that no other worker takes them first): these leases
                # die with it and must come back through the others.
                holder = await group[victim].connect()
                jobs = [{"queue": held_queue, "payload": {}, "retries": 5}] * 3
                reply = await holder.ok("submit_batch", jobs=jobs)
                submitted.update(r["job_id"] for r in reply["results"])
                lease = {"worker_id": "holder", "count": 3, "lease_ms": SHORT_LEASE_MS}
                held = (await holder.ok("lease", queues=[held_queue], **lease))["jobs"]
                group[victim].process.send_signal(signal.SIGKILL)
                killed.set()
                await trio.sleep(1.0)
                stop_producing.set()

                # Until every job is finished, as the survivors' stats say.
                a = await group[0].connect()
                while True:
                    queues = (await a.ok("stats"))["queues"]
                    states = ("pending", "ready", "leased", "retrying")
                    if not any(
                        queues.get(q, {}).get(s) for q in (queue, held_queue) for s in states
                    ):
                        break
                    await trio.sleep(0.1)
                drained.set()

            for job_id in sorted(submitted):
                job = (await a.ok("inspect", job_id=job_id))["job"]
                assert job["state"] == "succeeded", job

    assert len(held) == 3, held
    for job in held:
        servers_seen = leased_by.get(job["job_id"], [])
        assert any(s != victim for s in servers_seen), (job["job_id"], servers_seen)
    assert len(submitted) > 50, "the load was too light to mean anything"


async def test_long_poll_on_one_server_wakes_for_a_submit_on_another(db_url):
    queue = "wake"
    async with servers(db_url, 2) as group:
        a, b = [await s.connect() for s in group]
        lease_id = await b.send("lease", queues=[queue], worker_id="w", wait_ms=2_000)
        await writer_barrier(b)  # answered after the lease was parked
        await trio.sleep(0.2)
        job_id = (await a.ok("submit", queue=queue, payload={}))["job_id"]
        submitted_at = trio.current_time()
        reply = await b.read()
        waited = trio.current_time() - submitted_at
    assert reply["id"] == lease_id
    assert [j["job_id"] for j in reply["jobs"]] == [job_id]
    assert waited < 1.0, f"woken {waited:.2f} s after the submit"


async def test_stats_through_any_server_show_the_same_counts(db_url):
    queue = "counted"
    async with servers(db_url) as group:
        a, b, c = [await s.connect() for s in group]
        await a.ok("submit_batch", jobs=[{"queue": queue, "payload": {}}] * 5)
        for _ in range(2):
            await b.ok("submit", queue=queue, payload={}, delay_ms=60_000)
        leased = (
            await c.ok("lease", queues=[queue], worker_id="w", count=2, lease_ms=LONG_LEASE_MS)
        )["jobs"]
        assert len(leased) == 2
        await a.ok("ack", job_id=leased[0]["job_id"], worker_id="w", token=leased[0]["token"])

        expected = {
            "pending": 2, "ready": 3, "leased": 1, "retrying": 0, "succeeded": 1, "dead": 0,
            "cancelled": 0,
        }  # fmt: skip
        # Each server answers from its counts in memory, which follow the others' commits
        # a page of queues per REFRESH_INTERVAL_S (relay/server/services/maintenance.py).
        with trio.fail_after(5):
            while True:
                seen = [(await client.ok("stats"))["queues"].get(queue) for client in (a, b, c)]
                if all(counts == expected for counts in seen):
                    break
                await trio.sleep(REFRESH_INTERVAL_S / 5)


async def _drain(
    group: list[ServerProcess], queue: str, jobs: int, workers_per_server: int, hold_s: float
) -> list[tuple[float, float, int]]:
    """Workers on every server lease ``queue``'s jobs (two at a time, long-polling), hold
    each ``hold_s`` and ack it, until ``jobs`` are acked. Returns, per job: when its worker
    got it and when it was done with it (trio time, one clock for all), and its grant by the
    server's clock (its ``lease_expires_at`` less the lease's length)."""
    held: list[tuple[float, float, int]] = []
    done = trio.Event()

    async def work(server: ServerProcess, worker: str) -> None:
        client = await server.connect()
        while not done.is_set():
            reply = await client.ok(
                "lease", queues=[queue], worker_id=worker, count=2, wait_ms=300,
                lease_ms=LONG_LEASE_MS,
            )  # fmt: skip
            for job in reply["jobs"]:
                got = trio.current_time()
                await trio.sleep(hold_s)
                held.append((got, trio.current_time(), job["lease_expires_at"] - LONG_LEASE_MS))
                await client.ok("ack", job_id=job["job_id"], worker_id=worker, token=job["token"])
            if len(held) >= jobs:
                done.set()
        await client.aclose()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for s, server in enumerate(group):
                for w in range(workers_per_server):
                    nursery.start_soon(work, server, f"w{s}.{w}")
    assert len(held) == jobs
    return held


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (one that ends as another starts: not both)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


async def test_max_leased_is_never_exceeded_across_servers(db_url):
    queue, limit, jobs = "limited.conc", 3, 60
    async with servers(db_url) as group:
        a = await group[0].connect()
        await a.ok("queue_config", queue=queue, max_leased=limit)
        await a.ok(
            "submit_batch", jobs=[{"queue": queue, "payload": {"n": n}} for n in range(jobs)]
        )
        held = await _drain(group, queue, jobs, workers_per_server=4, hold_s=0.02)
        # Each worker's time with a job lies within the job's lease on the server (it got
        # the job after the grant and let go before its ack): those intervals overlap no
        # more than the leases did.
        assert most_at_once([(got, let_go) for got, let_go, _ in held]) == limit
        reply = await a.ok("queue_list", queues=[queue])
        assert reply["queues"][0]["counts"]["succeeded"] == jobs


async def test_a_rate_limit_holds_across_servers(db_url):
    queue, limit, period_ms, jobs = "limited.rate", 5, 500, 20
    async with servers(db_url) as group:
        a = await group[0].connect()
        await a.ok("queue_config", queue=queue, rate={"limit": limit, "period_ms": period_ms})
        await a.ok(
            "submit_batch", jobs=[{"queue": queue, "payload": {"n": n}} for n in range(jobs)]
        )
        held = await _drain(group, queue, jobs, workers_per_server=4, hold_s=0)
    grants = sorted(granted for _, _, granted in held)
    # A window holds at most `limit` leases and the next opens a period after it: any
    # 2 * limit + 1 leases in a row span three windows, so more than a period (less the
    # few ms by which servers' clocks, read as each batch starts, may disagree).
    spans = [grants[i + 2 * limit] - grants[i] for i in range(len(grants) - 2 * limit)]
    assert min(spans) >= period_ms - 50, spans
    assert grants[-1] - grants[0] >= (jobs // limit - 1) * period_ms - 50
