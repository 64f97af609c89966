"""The history op over real sockets, on both stores: the counts of jobs that moved, per
minute, once the server flushed them; the range and step checks; and a graceful shutdown
that flushes what was counted (nothing is left to the next interval)."""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import AsyncIterator

import pytest
import trio

from relay.store.history import COLUMNS
from tests import pg
from tests.server.conftest import BOUND_S, LineClient, start_server
from tests.server.test_protocol import assert_error
from tests.worker.helpers import serving

MINUTE = 60_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def database(request, tmp_path) -> str:
    if request.param == "postgres":
        return pg.server_url(request.getfixturevalue("pg_url"), f"hist_{secrets.token_hex(4)}")
    return str(tmp_path / "relay.db")


@pytest.fixture(params=["sqlite", "postgres"])
def db(request, tmp_path) -> str:
    return database(request, tmp_path)


@pytest.fixture
async def client(db) -> AsyncIterator[LineClient]:
    start = functools.partial(start_server, history_flush_ms=20)
    async with serving(start, db) as running:
        c = await running.connect_by("tcp")
        try:
            yield c
        finally:
            await c.aclose()


async def totals(client: LineClient, **fields) -> dict[str, int]:
    """The sums over the points of a history reply (maxima as maxima)."""
    reply = await client.ok("history", **fields)
    sums = dict.fromkeys(COLUMNS, 0)
    for point in reply["points"]:
        for name in COLUMNS:
            value = point[name]
            sums[name] = max(sums[name], value) if name.endswith("_max_ms") else sums[name] + value
    return sums


async def wait_for(client: LineClient, want: dict[str, int], **fields) -> dict[str, int]:
    """The history's totals once they show ``want`` (the server flushes every 20 ms)."""
    with trio.fail_after(BOUND_S):
        while True:
            got = await totals(client, **fields)
            if all(got[name] == n for name, n in want.items()):
                return got
            await trio.sleep(0.02)


async def test_history_counts_what_jobs_did_per_queue(client):
    await client.ok("submit_batch", jobs=[{"queue": "a", "payload": {}}] * 3)
    await client.ok("submit", queue="b", payload={}, retries=0)
    reply = await client.ok("lease", queues=["a", "b"], worker_id="w", count=4, lease_ms=60_000)
    by_queue = {job["queue"]: job for job in reply["jobs"]}
    one = by_queue["a"]
    await client.ok("ack", job_id=one["job_id"], worker_id="w", token=one["token"])
    b = by_queue["b"]
    await client.ok("fail", job_id=b["job_id"], worker_id="w", token=b["token"], error="x")
    got = await wait_for(
        client, {"submitted": 4, "succeeded": 1, "failed": 1, "dead": 1, "wait_count": 4}
    )
    assert got["run_count"] == 2 and got["run_max_ms"] >= 0
    only_a = await totals(client, queue="a")
    assert (only_a["submitted"], only_a["succeeded"], only_a["failed"]) == (3, 1, 0)


async def test_history_answers_every_step_of_its_range(client):
    end = now_ms()
    reply = await client.ok("history", queue="q", step=5 * MINUTE)
    # 60 steps before the end of the minute under way, from a minute's start.
    assert reply["to"] % MINUTE == 0 and end <= reply["to"] < end + MINUTE
    assert reply["to"] - reply["from"] == 60 * 5 * MINUTE and len(reply["points"]) == 60
    assert [p["at"] for p in reply["points"][:2]] == [reply["from"], reply["from"] + 5 * MINUTE]
    assert set(reply["points"][0]) == {"at", *COLUMNS}
    # A range from the minute of "from" to the end of the minute of "to".
    reply = await client.ok("history", **{"from": 90_000, "to": 90_000 + 1_439 * MINUTE})
    assert (reply["from"], reply["to"], len(reply["points"])) == (60_000, 1_441 * MINUTE, 1_440)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"step": 90_000}, "step"),
        ({"step": 0}, "step"),
        ({"from": 10 * MINUTE, "to": MINUTE}, "from"),
        ({"from": 0, "to": 1_441 * MINUTE}, "step"),
        ({"from": 90_000, "to": 90_000 + 1_440 * MINUTE}, "step"),  # 1,441 minutes
        ({"from": 0}, "step"),  # to now: decades of minutes
        ({"queue": "no such queue!"}, "queue"),
        ({"from": "yesterday"}, "from"),
    ],
)
async def test_history_refuses_a_bad_range_naming_the_field(client, fields, field):
    error = assert_error(await client.request("history", **fields), "bad_request")
    assert error["message"].startswith(f"{field}: "), error


async def test_a_graceful_shutdown_flushes_what_was_counted(db):
    # A flush interval far longer than the test: only the shutdown's flush can write.
    start = functools.partial(start_server, history_flush_ms=3_600_000)
    async with serving(start, db) as running:
        c = await running.connect_by("tcp")
        await c.ok("submit_batch", jobs=[{"queue": "q", "payload": {}}] * 2)
        assert (await totals(c))["submitted"] == 0
        await c.aclose()
    async with serving(start, db) as running:
        c = await running.connect_by("tcp")
        assert (await totals(c))["submitted"] == 2
        await c.aclose()


async def test_metrics_show_the_run_and_wait_histograms_of_flushed_jobs(db):
    from prometheus_client.parser import text_string_to_metric_families

    from tests.server.test_lifecycle import http_get

    start = functools.partial(start_server, history_flush_ms=20)
    async with serving(start, db) as running:
        client = await running.connect_by("tcp")
        await client.ok("submit", queue="mail", payload={})
        reply = await client.ok("lease", queues=["mail"], worker_id="w", lease_ms=60_000)
        [job] = reply["jobs"]
        await client.ok("ack", job_id=job["job_id"], worker_id="w", token=job["token"])
        await wait_for(client, {"run_count": 1})
        with trio.fail_after(BOUND_S):
            while True:  # (the histograms follow the flush's commit)
                status, body = await http_get(running.handle.metrics_address, "/metrics")
                assert status == 200
                families = {f.name: f for f in text_string_to_metric_families(body.decode())}
                counts = {
                    (f.name, s.labels["queue"]): s.value
                    for f in families.values()
                    for s in f.samples
                    if s.name.endswith("_seconds_count") and f.name.startswith("relay_job_")
                }
                if counts.get(("relay_job_run_seconds", "mail")) == 1:
                    break
                await trio.sleep(0.02)
        assert counts[("relay_job_wait_seconds", "mail")] == 1
        await client.aclose()
