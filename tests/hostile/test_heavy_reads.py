"""One connection pipelining reads of thousands of rows: another client's submit waits for
about one of them, not for all that are queued.

Found from outside (2026-12-04): a page of the job browser examines up to 10,000 jobs and
a ``workers_list`` reads up to 10,000 leases, but each weighed like one submit in the
writer's turns, so 256 of them pipelined by one connection ran in one transaction, and
every other client's request waited behind all of them: a submit took 0.8 s behind
``jobs_list`` pages and 13-22 s behind ``workers_list`` (the server then held 0.8 GB of
their rows). Now a read of that size is a connection's whole share of a batch, and the
leases held are read once for everyone who asks within a second.
"""

from __future__ import annotations

import statistics

import orjson

from tests.hostile.test_fairness import waits_of_another_client
from tests.server.conftest import start_server
from tests.worker.helpers import serving

IN_FLIGHT = 256  # the attacker's pipelined reads: max_in_flight
# The other client's submit, its median wait. Behind pages of the job browser: 2-3 ms
# here (a page in progress), 0.21-0.42 s before the fix, quiet or loaded: bound between.
# Behind workers_list: 25 ms here, 6.9 s before.
BOUND_PAGES_S = 0.1
BOUND_WORKERS_S = 0.3


def line(request: dict) -> bytes:
    return orjson.dumps(request) + b"\n"


async def test_pipelined_job_browser_pages_delay_another_client_by_about_one(tmp_path):
    async with serving(start_server, str(tmp_path / "relay.db")) as server:
        attacker = await server.connect()
        await attacker.ok("hello")
        # More (queue, state) runs than a page merges: a page of every queue reads by id,
        # and finds no pending job among the 10,000 newest (all ready): its whole bound.
        for q in range(40):
            await attacker.ok("submit", queue=f"q{q}", payload=1, delay_ms=10**9)
        for _ in range(30):
            await attacker.ok("submit_batch", jobs=[{"queue": "bulk", "payload": 1}] * 1000)
        page = await attacker.ok("jobs_list", states=["pending"], limit=1)
        assert page["jobs"] == [] and page["next_cursor"] is not None  # (the bound reached)
        request = {"op": "jobs_list", "id": 1, "states": ["pending"], "limit": 1}
        waits = await waits_of_another_client(server, attacker, [line(request)], IN_FLIGHT)
    assert statistics.median(waits) < BOUND_PAGES_S, sorted(waits)


async def test_pipelined_workers_lists_delay_another_client_by_about_one(tmp_path):
    async with serving(start_server, str(tmp_path / "relay.db")) as server:
        attacker = await server.connect()
        await attacker.ok("hello")
        for _ in range(10):  # 10,000 leases held: a read of the leases held at its bound
            await attacker.ok("submit_batch", jobs=[{"queue": "held", "payload": 1}] * 1000)
            leased = await attacker.ok(
                "lease", queues=["held"], worker_id="w", count=1000, lease_ms=3_600_000
            )
            assert len(leased["jobs"]) == 1000
        listed = await attacker.ok("workers_list")
        assert listed["workers"][0]["jobs_held"] == 10_000
        request = {"op": "workers_list", "id": 1, "limit": 1}
        waits = await waits_of_another_client(server, attacker, [line(request)], IN_FLIGHT)
    assert statistics.median(waits) < BOUND_WORKERS_S, sorted(waits)
