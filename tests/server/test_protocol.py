"""The wire contract (docs: /work/shared/protocol.md) exercised over real sockets: the
tests that take ``client`` run over TCP and over the WebSocket endpoint.

Every op, every error code a client can reach over TCP, framing, pipelining,
backpressure, and hostile clients that must not disturb well-behaved ones. Each test
asserts what the contract says, not what the implementation happens to do.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import trio

from relay.protocol import wire
from relay.protocol.model import TIMEOUT_GRACE_MS
from relay.server.requests.longpoll import PARKED_PER_CONNECTION
from relay.util.log import SUMMARY_INTERVAL_S
from tests import pg
from tests.conftest import assert_abbreviated_as_git_does, common_start
from tests.server.conftest import LineClient, RunningServer, logged, start_server, writer_barrier
from tests.worker.helpers import serving

STATES = {"pending", "ready", "leased", "retrying", "succeeded", "dead", "cancelled"}
ADVERTISED_LIMITS = {
    "max_frame_bytes",
    "max_payload_bytes",
    "max_in_flight",
    "max_connections",
    "max_lease_ms",
    "max_wait_ms",
    "max_batch",
    "max_queues_per_lease",
    "max_watchers",
    "max_watch_buffer",
}
LEASE_FIELDS = {
    "job_id",
    "queue",
    "payload",
    "priority",
    "attempt",
    "max_attempts",
    "token",
    "lease_expires_at",
}
JOB_REQUIRED = {
    "job_id",
    "queue",
    "state",
    "priority",
    "payload",
    "attempt",
    "max_attempts",
    "created_at",
    "errors",
}
JOB_OPTIONAL = {
    "ready_at",
    "run_at",
    "lease_expires_at",
    "worker_id",
    "last_error",
    "result",
    "idempotency_key",
    "finished_at",
    # (extensions: inspect's attempt history, not in dead_list's jobs)
    "attempts",
    "attempts_dropped",
}
TOKEN_RE = re.compile(r"[0-9a-fA-F]{32,}")
W = "worker-1"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@contextlib.asynccontextmanager
async def custom_server(tmp_path, **overrides: Any) -> AsyncIterator[RunningServer]:
    """A server with its own limits / timeouts, shut down at the end of the block."""
    start = functools.partial(start_server, **overrides)
    async with serving(start, str(tmp_path / "custom.db")) as running:
        yield running


@pytest.fixture(params=["sqlite", "postgres"])
async def server(request, tmp_path) -> AsyncIterator[RunningServer]:
    """The contract holds on both stores: each test using ``server`` (or ``client``) runs
    on a SQLite file and on a PostgreSQL schema of its own."""
    db = str(tmp_path / "relay.db")
    if request.param == "postgres":
        db = pg.server_url(request.getfixturevalue("pg_url"), f"contract_{secrets.token_hex(4)}")
    async with serving(start_server, db) as running:
        yield running


@pytest.fixture(params=["tcp", "websocket"])
async def client(request, server: RunningServer) -> AsyncIterator[LineClient]:
    """The contract holds over both transports: each test using ``client`` runs on each."""
    c = await server.connect_by(request.param)
    try:
        yield c
    finally:
        await c.aclose()


@contextlib.asynccontextmanager
async def connected(server: RunningServer) -> AsyncIterator[LineClient]:
    c = await server.connect()
    try:
        yield c
    finally:
        await c.aclose()


async def queue_stats(client: LineClient, queue: str) -> dict[str, int]:
    """The six state counts of ``queue`` (all zero if stats does not list it)."""
    reply = await client.ok("stats")
    return reply["queues"].get(queue, dict.fromkeys(STATES, 0))


async def submit(client: LineClient, queue: str = "q", payload: Any = None, **fields) -> str:
    reply = await client.ok("submit", queue=queue, payload=payload, **fields)
    return reply["job_id"]


async def lease_one(client: LineClient, queue: str = "q", **fields: Any) -> dict[str, Any]:
    reply = await client.ok("lease", queues=[queue], worker_id=W, **fields)
    (job,) = reply["jobs"]
    return job


async def inspect(client: LineClient, job_id: str) -> dict[str, Any]:
    return (await client.ok("inspect", job_id=job_id))["job"]


async def make_dead(client: LineClient, queue: str, n: int) -> list[str]:
    """``n`` dead jobs in ``queue`` (submitted, leased, failed not retryable), oldest first."""
    ids = [await submit(client, queue, {"i": i}, retries=0) for i in range(n)]
    leased = await client.ok("lease", queues=[queue], worker_id=W, count=n)
    assert sorted(j["job_id"] for j in leased["jobs"]) == sorted(ids)
    for job in leased["jobs"]:
        reply = await client.ok(
            "fail", job_id=job["job_id"], worker_id=W, token=job["token"], error="boom"
        )
        assert reply["state"] == "dead"
    return ids


def assert_error(reply: dict[str, Any], code: str, request_id: Any = ...) -> dict[str, Any]:
    assert reply["ok"] is False, reply
    assert set(reply) == {"id", "ok", "error"}, reply
    assert reply["error"]["code"] == code, reply
    assert isinstance(reply["error"]["message"], str) and reply["error"]["message"], reply
    if request_id is not ...:
        assert reply["id"] == request_id
    return reply["error"]


async def read_until_eof(client: LineClient) -> list[bytes]:
    """Every line until the server closes (a reset counts as closed)."""
    lines = []
    with trio.fail_after(10):
        while True:
            try:
                line = await client.read_line()
            except trio.BrokenResourceError:
                return lines
            if line is None:
                return lines
            lines.append(line)


# -- hello / ping ---------------------------------------------------------------------------


async def test_hello_reports_server_version_protocol_and_limits(server, client):
    reply = await client.ok("hello", client="test-suite")
    assert reply["server"] == "relay-trio"
    assert isinstance(reply["version"], str) and reply["version"]
    assert reply["protocol"] == 1
    assert set(reply["limits"]) >= ADVERTISED_LIMITS
    for key in ADVERTISED_LIMITS:
        assert reply["limits"][key] == getattr(server.config.limits, key)


async def test_hello_advertises_custom_limits(tmp_path):
    limits = wire.Limits(max_in_flight=7, max_connections=9, max_batch=11)
    async with custom_server(tmp_path, limits=limits) as srv, connected(srv) as c:
        advertised = (await c.ok("hello"))["limits"]
    assert advertised["max_in_flight"] == 7
    assert advertised["max_connections"] == 9
    assert advertised["max_batch"] == 11


async def test_ping_replies_with_no_fields(client):
    request_id = await client.send("ping")
    assert await client.read() == {"id": request_id, "ok": True}


# -- submit ---------------------------------------------------------------------------------


async def test_submit_ready(client):
    reply = await client.ok("submit", queue="q", payload={"a": [1, 2, 3]})
    assert set(reply) == {"id", "ok", "job_id", "state", "duplicate"}
    assert reply["job_id"].startswith("job_")
    assert reply["state"] == "ready"
    assert reply["duplicate"] is False
    job = await inspect(client, reply["job_id"])
    assert job["payload"] == {"a": [1, 2, 3]}
    assert job["priority"] == "normal"
    assert job["max_attempts"] == 4  # default retries 3


@pytest.mark.parametrize("payload", [None, 0, -1.5, "text", [1, "x", None], {"nested": {"k": []}}])
async def test_submit_any_json_payload_round_trips(client, payload):
    job_id = await submit(client, "q", payload)
    assert (await inspect(client, job_id))["payload"] == payload
    assert (await lease_one(client, "q"))["payload"] == payload


async def test_job_ids_sort_by_creation(client):
    ids = [await submit(client, "q", i) for i in range(20)]
    assert ids == sorted(ids)
    assert len(set(ids)) == 20


async def test_submit_with_delay_is_pending(client):
    reply = await client.ok("submit", queue="q", payload=1, delay_ms=60_000)
    assert reply["state"] == "pending"
    job = await inspect(client, reply["job_id"])
    assert job["state"] == "pending"
    assert job["run_at"] >= now_ms() + 50_000
    assert (await client.ok("lease", queues=["q"], worker_id=W))["jobs"] == []


async def test_submit_with_future_run_at_is_pending(client):
    run_at = now_ms() + 60_000
    reply = await client.ok("submit", queue="q", payload=1, run_at=run_at)
    assert reply["state"] == "pending"
    job = await inspect(client, reply["job_id"])
    assert job["state"] == "pending"
    assert job["run_at"] == run_at
    assert (await queue_stats(client, "q"))["pending"] == 1


async def test_submit_with_zero_delay_or_past_run_at_is_ready(client):
    assert (await client.ok("submit", queue="q", payload=1, delay_ms=0))["state"] == "ready"
    past = now_ms() - 60_000
    assert (await client.ok("submit", queue="q", payload=1, run_at=past))["state"] == "ready"


async def test_delayed_job_becomes_ready_when_due(client):
    job_id = await submit(client, "q", 1, delay_ms=100)
    job = await client.ok("lease", queues=["q"], worker_id=W, wait_ms=5_000)
    assert [j["job_id"] for j in job["jobs"]] == [job_id]


async def test_submit_with_priority_and_retries(client):
    job_id = await submit(client, "q", 1, priority="critical", retries=0)
    job = await inspect(client, job_id)
    assert job["priority"] == "critical"
    assert job["max_attempts"] == 1


async def test_idempotency_key_duplicate_returns_first_job(client):
    first = await client.ok("submit", queue="q", payload=1, idempotency_key="k-1")
    assert first["duplicate"] is False
    again = await client.ok("submit", queue="q", payload=2, idempotency_key="k-1")
    assert again["job_id"] == first["job_id"]
    assert again["duplicate"] is True
    assert again["state"] == "ready"
    assert (await queue_stats(client, "q"))["ready"] == 1
    assert (await inspect(client, first["job_id"]))["idempotency_key"] == "k-1"


async def test_idempotency_duplicate_reports_current_state(client):
    first = await client.ok("submit", queue="q", payload=1, idempotency_key="k")
    job = await lease_one(client, "q")
    await client.ok("ack", job_id=job["job_id"], worker_id=W, token=job["token"])
    again = await client.ok("submit", queue="q", payload=1, idempotency_key="k")
    assert again == {**again, "job_id": first["job_id"], "duplicate": True, "state": "succeeded"}


async def test_idempotency_key_is_per_queue(client):
    a = await client.ok("submit", queue="qa", payload=1, idempotency_key="same")
    b = await client.ok("submit", queue="qb", payload=1, idempotency_key="same")
    assert a["job_id"] != b["job_id"]
    assert b["duplicate"] is False


async def test_unique_key_answers_the_unfinished_job_then_frees_once_it_succeeds(client):
    first = await client.ok("submit", queue="q", payload=1, unique_key="report-7")
    assert first["duplicate"] is False
    again = await client.ok("submit", queue="q", payload=2, unique_key="report-7")
    assert again == {**again, "job_id": first["job_id"], "duplicate": True, "state": "ready"}
    job = await lease_one(client, "q")
    leased = await client.ok("submit", queue="q", payload=3, unique_key="report-7")
    assert (leased["job_id"], leased["state"], leased["duplicate"]) == (
        first["job_id"], "leased", True,
    )  # fmt: skip
    await client.ok("ack", job_id=job["job_id"], worker_id=W, token=job["token"])
    fresh = await client.ok("submit", queue="q", payload=4, unique_key="report-7")
    assert fresh["job_id"] != first["job_id"] and fresh["duplicate"] is False
    assert (await queue_stats(client, "q"))["ready"] == 1


async def test_unique_for_queued_frees_the_key_when_a_worker_leases_the_job(client):
    first = await client.ok("submit", queue="q", payload=1, unique_key="k", unique_for="queued")
    batch = await client.ok(
        "submit_batch",
        jobs=[{"queue": "q", "payload": 2, "unique_key": "k", "unique_for": "queued"}],
    )
    assert batch["results"][0]["job_id"] == first["job_id"]
    await lease_one(client, "q")
    second = await client.ok("submit", queue="q", payload=3, unique_key="k", unique_for="queued")
    assert second["job_id"] != first["job_id"] and second["duplicate"] is False


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"unique_for": "queued"}, "unique_for"),
        ({"unique_key": "k", "unique_for": "forever"}, "unique_for"),
        ({"unique_key": ""}, "unique_key"),
        ({"unique_key": "x" * 257}, "unique_key"),
        ({"unique_key": 7}, "unique_key"),
    ],
)
async def test_a_bad_unique_key_is_refused_and_makes_no_job(client, fields, field):
    reply = await client.request("submit", queue="q", payload=1, **fields)
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
    assert field in reply["error"]["message"]
    assert (await queue_stats(client, "q"))["ready"] == 0


async def test_a_lease_of_a_job_with_a_timeout_says_so_and_ends_by_its_deadline(client):
    job_id = await submit(client, "q", 1, timeout_ms=5_000)
    assert (await inspect(client, job_id))["timeout_ms"] == 5_000
    before = int(time.time() * 1000)
    [job] = (await client.ok("lease", queues=["q"], worker_id=W, lease_ms=600_000))["jobs"]
    after = int(time.time() * 1000)
    assert job["job_id"] == job_id and job["timeout_ms"] == 5_000
    grace = TIMEOUT_GRACE_MS
    assert before + 5_000 + grace <= job["lease_expires_at"] <= after + 5_000 + grace
    renewed = await client.ok(
        "renew", job_id=job_id, worker_id=W, token=job["token"], lease_ms=600_000
    )
    assert renewed["lease_expires_at"] == job["lease_expires_at"]
    plain = await submit(client, "p", 1)
    [other] = (await client.ok("lease", queues=["p"], worker_id=W, lease_ms=600_000))["jobs"]
    assert other["job_id"] == plain and "timeout_ms" not in other


@pytest.mark.parametrize("value", [0, -1, 7 * 24 * 3_600_000 + 1, "10", 1.5])
async def test_a_bad_timeout_is_refused(client, value):
    reply = await client.request("submit", queue="q", payload=1, timeout_ms=value)
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
    assert "timeout_ms" in reply["error"]["message"]


async def test_concurrent_duplicate_submits_create_one_job(server):
    async with connected(server) as a, connected(server) as b:
        replies: list[dict[str, Any]] = []

        async def one(c: LineClient) -> None:
            replies.append(await c.ok("submit", queue="q", payload=1, idempotency_key="race"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, a)
            nursery.start_soon(one, b)
        assert replies[0]["job_id"] == replies[1]["job_id"]
        assert sorted(r["duplicate"] for r in replies) == [False, True]
        assert (await queue_stats(a, "q"))["ready"] == 1


# -- submit_batch ---------------------------------------------------------------------------


async def test_submit_batch_results_in_order(client):
    jobs = [
        {"queue": "b", "payload": {"n": 0}},
        {"queue": "b", "payload": {"n": 1}, "delay_ms": 60_000},
        {"queue": "b", "payload": {"n": 2}, "priority": "high"},
    ]
    reply = await client.ok("submit_batch", jobs=jobs)
    assert set(reply) == {"id", "ok", "results"}
    results = reply["results"]
    assert [r["state"] for r in results] == ["ready", "pending", "ready"]
    assert all(set(r) == {"job_id", "state", "duplicate"} for r in results)
    assert all(r["job_id"].startswith("job_") and r["duplicate"] is False for r in results)
    ids = [r["job_id"] for r in results]
    assert ids == sorted(ids) and len(set(ids)) == 3
    for n, job_id in enumerate(ids):
        assert (await inspect(client, job_id))["payload"] == {"n": n}


async def test_submit_batch_with_duplicate_key(client):
    first = await client.ok("submit", queue="b", payload=1, idempotency_key="dup")
    reply = await client.ok(
        "submit_batch",
        jobs=[
            {"queue": "b", "payload": 2},
            {"queue": "b", "payload": 3, "idempotency_key": "dup"},
        ],
    )
    fresh, dup = reply["results"]
    assert fresh["duplicate"] is False
    assert dup == {"job_id": first["job_id"], "state": "ready", "duplicate": True}


@pytest.mark.parametrize(
    "bad_job",
    [
        {"queue": "b", "payload": 1, "priority": "urgent"},
        {"queue": "bad queue", "payload": 1},
        {"queue": "b"},
        {"queue": "b", "payload": 1, "retries": "3"},
        {"queue": "b", "payload": 1, "delay_ms": -1},
        "not an object",
    ],
)
async def test_submit_batch_is_all_or_nothing(client, bad_job):
    jobs = [{"queue": "b", "payload": 0}, {"queue": "b", "payload": 1}, bad_job]
    error = await client.error("submit_batch", jobs=jobs)
    assert error["code"] == "bad_request"
    assert "jobs[2]" in error["message"]
    assert await queue_stats(client, "b") == dict.fromkeys(STATES, 0)
    # Nothing was created in any queue.
    assert (await client.ok("stats"))["queues"] == {}


async def test_stats_tells_how_long_the_oldest_ready_job_has_waited_when_asked(client):
    before = time.time()
    await submit(client, "a")
    await submit(client, "a", priority="high")
    await submit(client, "later", delay_ms=60_000)
    assert "oldest_ready_ms" not in await client.ok("stats")
    reply = await client.ok("stats", oldest_ready=True)
    # Only queues with ready jobs; a wait no longer than the test has run.
    assert set(reply["oldest_ready_ms"]) == {"a"}
    assert 0 <= reply["oldest_ready_ms"]["a"] <= (time.time() - before) * 1000 + 1
    await client.ok("lease", queues=["a"], worker_id="w", count=2)
    assert (await client.ok("stats", oldest_ready=True))["oldest_ready_ms"] == {}
    error = await client.error("stats", oldest_ready="yes")
    assert error["code"] == "bad_request" and "oldest_ready" in error["message"]


async def test_submit_batch_over_max_batch(tmp_path):
    async with custom_server(tmp_path, limits=wire.Limits(max_batch=3)) as srv, connected(srv) as c:
        jobs = [{"queue": "b", "payload": i} for i in range(4)]
        error = await c.error("submit_batch", jobs=jobs)
        assert error["code"] == "bad_request" and "jobs" in error["message"]
        assert (await c.ok("stats"))["queues"] == {}
        ok = await c.ok("submit_batch", jobs=jobs[:3])
        assert len(ok["results"]) == 3


# -- lease and friends ----------------------------------------------------------------------


async def test_lease_fields(client):
    job_id = await submit(client, "lq", {"x": 1}, priority="high", retries=2)
    before = now_ms()
    reply = await client.ok("lease", queues=["lq"], worker_id=W, lease_ms=20_000)
    assert set(reply) == {"id", "ok", "jobs"}
    (job,) = reply["jobs"]
    assert set(job) == LEASE_FIELDS
    assert job["job_id"] == job_id
    assert job["queue"] == "lq"
    assert job["payload"] == {"x": 1}
    assert job["priority"] == "high"
    assert job["attempt"] == 1
    assert job["max_attempts"] == 3
    assert isinstance(job["token"], str) and TOKEN_RE.fullmatch(job["token"]), job["token"]
    assert before + 20_000 - 1000 <= job["lease_expires_at"] <= now_ms() + 20_000 + 1000
    state = await inspect(client, job_id)
    assert state["state"] == "leased"
    assert state["worker_id"] == W
    assert state["lease_expires_at"] == job["lease_expires_at"]


async def test_lease_empty_queue_returns_no_jobs(client):
    assert (await client.ok("lease", queues=["nothing"], worker_id=W))["jobs"] == []


async def test_lease_count_claims_several_fifo(client):
    ids = [await submit(client, "q", i) for i in range(3)]
    reply = await client.ok("lease", queues=["q"], worker_id=W, count=5)
    jobs = reply["jobs"]
    assert [j["job_id"] for j in jobs] == ids
    assert len({j["token"] for j in jobs}) == 3
    assert all(set(j) == LEASE_FIELDS for j in jobs)
    assert (await queue_stats(client, "q"))["leased"] == 3
    assert (await client.ok("lease", queues=["q"], worker_id=W))["jobs"] == []


async def test_lease_highest_priority_first_across_queues(client):
    low = await submit(client, "q1", 1, priority="low")
    normal = await submit(client, "q2", 2)
    critical = await submit(client, "q1", 3, priority="critical")
    high = await submit(client, "q2", 4, priority="high")
    reply = await client.ok("lease", queues=["q1", "q2"], worker_id=W, count=4)
    assert [j["job_id"] for j in reply["jobs"]] == [critical, high, normal, low]


async def test_long_poll_wakes_on_submit(server, client):
    async with connected(server) as producer:
        request_id = await client.send("lease", queues=["lp"], worker_id=W, wait_ms=10_000)
        job_id = await submit(producer, "lp", "wake")
        with trio.fail_after(5):
            reply = await client.read()
    assert reply["id"] == request_id
    assert [j["job_id"] for j in reply["jobs"]] == [job_id]


async def test_long_polls_past_the_server_s_cap_are_answered_at_once(tmp_path):
    """At most PARKED_PER_CONNECTION x max_connections long-polls park, server-wide; the
    rest find nothing and are answered ``jobs: []`` at once. The parked ones still wake."""
    limits = wire.Limits(max_connections=2)
    cap = PARKED_PER_CONNECTION * limits.max_connections
    with logged("relay.longpoll") as records:
        async with custom_server(tmp_path, limits=limits) as srv, connected(srv) as waiter:
            sent = [
                await waiter.send("lease", queues=["cap"], worker_id=W, wait_ms=30_000)
                for _ in range(cap + 8)
            ]
            with trio.fail_after(5):  # far sooner than the 30 s wait
                early = [await waiter.read() for _ in range(8)]
            assert all(reply["ok"] and reply["jobs"] == [] for reply in early)
            assert {reply["id"] for reply in early} <= set(sent)
            async with connected(srv) as producer:
                job_id = await submit(producer, "cap", "wake")
            with trio.fail_after(5):
                woken = await waiter.read()
    assert [j["job_id"] for j in woken["jobs"]] == [job_id]
    # Said once, not once per lease turned away (a flood is logged in summary).
    (full,) = [r for r in records if r.getMessage() == "longpoll.full"]
    assert full.fields == {"parked": cap, "turned_away": 1}  # type: ignore[attr-defined]


async def test_long_poll_times_out_with_no_jobs(client):
    with trio.fail_after(5):
        reply = await client.ok("lease", queues=["lp"], worker_id=W, wait_ms=150)
    assert reply["jobs"] == []


async def test_renew_extends_the_lease(client):
    job_id = await submit(client)
    job = await lease_one(client, lease_ms=5_000)
    reply = await client.ok(
        "renew", job_id=job_id, worker_id=W, token=job["token"], lease_ms=600_000
    )
    assert set(reply) == {"id", "ok", "lease_expires_at"}
    assert reply["lease_expires_at"] > job["lease_expires_at"]
    assert reply["lease_expires_at"] >= now_ms() + 590_000
    assert (await inspect(client, job_id))["lease_expires_at"] == reply["lease_expires_at"]


async def test_ack_succeeds_and_repeat_is_ok(client):
    job_id = await submit(client)
    job = await lease_one(client)
    ref = {"job_id": job_id, "worker_id": W, "token": job["token"]}
    reply = await client.ok("ack", **ref, result={"answer": 42})
    assert set(reply) == {"id", "ok", "state"} and reply["state"] == "succeeded"
    again = await client.ok("ack", **ref, result={"answer": 42})
    assert again["state"] == "succeeded"
    info = await inspect(client, job_id)
    assert info["state"] == "succeeded"
    assert info["result"] == {"answer": 42}
    assert isinstance(info["finished_at"], int)
    assert "lease_expires_at" not in info
    counts = await queue_stats(client, "q")
    assert counts["succeeded"] == 1 and counts["leased"] == 0


async def test_fail_retrying_then_dead(client):
    job_id = await submit(client, "q", 1, retries=1, backoff={"kind": "fixed", "delay_ms": 50})
    job = await lease_one(client)
    before = now_ms()
    reply = await client.ok(
        "fail", job_id=job_id, worker_id=W, token=job["token"], error="first failure"
    )
    assert set(reply) == {"id", "ok", "state", "retry_at"}
    assert reply["state"] == "retrying"
    assert before + 50 - 5 <= reply["retry_at"] <= now_ms() + 50 + 5
    info = await inspect(client, job_id)
    assert info["state"] in {"retrying", "ready"}
    assert info["last_error"] == "first failure"
    assert [(e["attempt"], e["error"]) for e in info["errors"]] == [(1, "first failure")]
    assert isinstance(info["errors"][0]["at"], int)

    # The retry becomes ready when due; the last attempt fails for good.
    second = (await client.ok("lease", queues=["q"], worker_id=W, wait_ms=5_000))["jobs"]
    assert [j["attempt"] for j in second] == [2]
    reply = await client.ok(
        "fail", job_id=job_id, worker_id=W, token=second[0]["token"], error="second failure"
    )
    assert set(reply) == {"id", "ok", "state"} and reply["state"] == "dead"
    info = await inspect(client, job_id)
    assert info["state"] == "dead"
    assert [(e["attempt"], e["error"]) for e in info["errors"]] == [
        (1, "first failure"),
        (2, "second failure"),
    ]
    assert isinstance(info["finished_at"], int)


async def test_fail_not_retryable_is_dead(client):
    job_id = await submit(client, "q", 1, retries=5)
    job = await lease_one(client)
    reply = await client.ok(
        "fail", job_id=job_id, worker_id=W, token=job["token"], error="fatal", retryable=False
    )
    assert reply["state"] == "dead"
    assert "retry_at" not in reply
    assert (await queue_stats(client, "q"))["dead"] == 1


async def test_fail_error_is_truncated_to_max_error_bytes(tmp_path):
    async with (
        custom_server(tmp_path, limits=wire.Limits(max_error_bytes=100)) as srv,
        connected(srv) as c,
    ):
        job_id = await submit(c)
        job = await lease_one(c)
        await c.ok("fail", job_id=job_id, worker_id=W, token=job["token"], error="e" * 5000)
        info = await inspect(c, job_id)
        assert 0 < len(info["last_error"].encode()) <= 100
        assert len(info["errors"][0]["error"].encode()) <= 100


TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "jobs.py", line 7, in parse_row\n'
    "    raise ValueError(row)\n"
    "ValueError: row 7"
)


async def test_fail_keeps_a_traceback_that_inspect_and_dead_list_show(client):
    job_id = await submit(client, "q", 1, retries=1, backoff={"kind": "fixed", "delay_ms": 10})
    job = await lease_one(client)
    ref = {"job_id": job_id, "worker_id": W}
    reply = await client.ok("fail", **ref, token=job["token"], error="first", traceback=TRACEBACK)
    assert reply["state"] == "retrying"
    [entry] = (await inspect(client, job_id))["errors"]
    assert entry == {"attempt": 1, "error": "first", "at": entry["at"], "traceback": TRACEBACK}

    # A fail without one (or with null) leaves it out of its entry.
    second = (await client.ok("lease", queues=["q"], worker_id=W, wait_ms=5_000))["jobs"][0]
    reply = await client.ok("fail", **ref, token=second["token"], error="second", traceback=None)
    assert reply["state"] == "dead"
    info = await inspect(client, job_id)
    assert [set(e) for e in info["errors"]] == [
        {"attempt", "error", "at", "traceback"},
        {"attempt", "error", "at"},
    ]
    assert info["errors"][0]["traceback"] == TRACEBACK
    [dead] = (await client.ok("dead_list", queue="q"))["jobs"]
    assert dead["errors"] == info["errors"]


async def test_fail_traceback_is_truncated_keeping_its_end(tmp_path):
    async with (
        custom_server(tmp_path, limits=wire.Limits(max_traceback_bytes=100)) as srv,
        connected(srv) as c,
    ):
        job_id = await submit(c)
        job = await lease_one(c)
        # The cut falls inside a 3-byte character: it is left out, not split.
        end = "\nValueError: the end"  # 20 bytes: 80 are left, 26 characters and 2 bytes
        traceback = "Traceback (most recent call last):\n" + "€" * 1000 + end
        await c.ok("fail", job_id=job_id, worker_id=W, token=job["token"], error="e",
                   traceback=traceback)  # fmt: skip
        [entry] = (await inspect(c, job_id))["errors"]
        assert entry["traceback"] == "€" * 26 + end
        assert entry["error"] == "e"


async def test_a_stale_fail_with_a_traceback_changes_nothing(client):
    job_id = await submit(client, "q", 1, retries=3, backoff={"kind": "fixed", "delay_ms": 60_000})
    job = await lease_one(client)
    ref = {"job_id": job_id, "worker_id": W}
    error = await client.error("fail", **ref, token="0" * 32, error="x", traceback=TRACEBACK)
    assert error["code"] == "stale_token"
    info = await inspect(client, job_id)
    assert info["state"] == "leased" and info["errors"] == [] and "last_error" not in info

    # Failed once; the same token again, with another traceback, is stale and keeps nothing.
    await client.ok("fail", **ref, token=job["token"], error="once", traceback="first")
    before = await inspect(client, job_id)
    error = await client.error("fail", **ref, token=job["token"], error="twice", traceback="2nd")
    assert error["code"] == "stale_token"
    assert await inspect(client, job_id) == before
    assert [e["traceback"] for e in before["errors"]] == ["first"]


async def test_release_gives_back_without_consuming_attempt(client):
    job_id = await submit(client, "q", 1)
    first = await lease_one(client)
    assert first["attempt"] == 1
    reply = await client.ok("release", job_id=job_id, worker_id=W, token=first["token"])
    assert set(reply) == {"id", "ok", "state"} and reply["state"] == "ready"
    info = await inspect(client, job_id)
    assert info["state"] == "ready" and info["attempt"] == 0
    second = await lease_one(client)
    assert second["job_id"] == job_id
    assert second["attempt"] == 1
    assert second["token"] != first["token"]
    # The released token is dead.
    error = await client.error("ack", job_id=job_id, worker_id=W, token=first["token"])
    assert error["code"] == "stale_token"


# -- inspect / stats ------------------------------------------------------------------------


async def test_inspect_fields_through_the_life_of_a_job(client):
    job_id = await submit(client, "iq", {"p": 1}, priority="low", idempotency_key="ik")
    ready = await inspect(client, job_id)
    assert set(ready) >= JOB_REQUIRED
    assert set(ready) <= JOB_REQUIRED | JOB_OPTIONAL
    assert ready["job_id"] == job_id
    assert ready["queue"] == "iq"
    assert ready["state"] == "ready"
    assert ready["priority"] == "low"
    assert ready["payload"] == {"p": 1}
    assert ready["attempt"] == 0
    assert ready["max_attempts"] == 4
    assert abs(ready["created_at"] - now_ms()) < 60_000
    assert isinstance(ready["ready_at"], int)
    assert ready["idempotency_key"] == "ik"
    assert ready["errors"] == []
    assert "lease_expires_at" not in ready and "finished_at" not in ready

    job = await lease_one(client, "iq")
    leased = await inspect(client, job_id)
    assert leased["state"] == "leased"
    assert leased["attempt"] == 1
    assert leased["worker_id"] == W
    assert leased["lease_expires_at"] == job["lease_expires_at"]

    await client.ok("fail", job_id=job_id, worker_id=W, token=job["token"], error="oops")
    failed = await inspect(client, job_id)
    assert failed["state"] == "retrying"
    assert failed["last_error"] == "oops"
    assert isinstance(failed["run_at"], int)
    assert len(failed["errors"]) == 1
    assert set(failed["errors"][0]) == {"attempt", "error", "at"}
    assert failed["errors"][0]["attempt"] == 1 and failed["errors"][0]["error"] == "oops"


async def test_inspect_with_prefix_answers_the_one_job_whose_id_begins_so(client):
    """``inspect {job_id, prefix: true}`` (an extension): an abbreviated id, as git takes
    the start of a hash. Every start of 7 to 16 digits of the only job answers it, as
    its whole id does."""
    job_id = await submit(client, "iq", {"p": 1})
    whole = await inspect(client, job_id)
    for digits in (7, 8, 11, 15, 16):
        reply = await client.ok("inspect", job_id=job_id[: 4 + digits], prefix=True)
        assert reply["job"] == whole, digits
    assert (await client.ok("inspect", job_id=job_id, prefix=False))["job"] == whole


async def test_inspect_with_prefix_of_several_jobs_is_bad_request_until_it_has_more_digits(
    client,
):
    # Two jobs made in one millisecond: their ids share all but their last digit or two.
    reply = await client.ok("submit_batch", jobs=[{"queue": "q", "payload": n} for n in (1, 2)])
    a, b = (result["job_id"] for result in reply["results"])
    common = common_start(a, b)
    assert len(common) >= len("job_") + 14
    for ambiguous in (common, a[:11]):
        error = await client.error("inspect", job_id=ambiguous, prefix=True)
        assert error["code"] == "bad_request", error
        assert error["message"].startswith("job_id: "), error
        assert "more than one job" in error["message"] and "give more" in error["message"]
    for one, payload in ((a, 1), (b, 2)):
        found = (await client.ok("inspect", job_id=one[: len(common) + 1], prefix=True))["job"]
        assert (found["job_id"], found["payload"]) == (one, payload)


@pytest.mark.parametrize(
    "prefix",
    ["job_0000000", "job_00000000000000", "job_7fffffffffffffff", "job_8000000", "job_fffffff"],
)
async def test_inspect_with_prefix_of_no_job_is_not_found(client, prefix):
    """Also where no id can begin so: a key has 63 bits, so a first digit of 8 or more."""
    await submit(client)
    error = await client.error("inspect", job_id=prefix, prefix=True)
    assert error["code"] == "not_found", error


async def test_inspect_without_prefix_takes_only_a_whole_id(client):
    job_id = await submit(client)
    for fields in ({}, {"prefix": False}):
        error = await client.error("inspect", job_id=job_id[:11], **fields)
        assert error["code"] == "not_found", error


async def test_short_ids_are_the_shortest_starts_no_other_job_has(client):
    """``short_ids {job_ids}`` (an extension): each id as git abbreviates a hash, unique
    among all the jobs (this server's database is the test's own: these are all), each
    typed back by ``inspect`` with ``prefix``. A batch's ids (one millisecond) run on in
    their last digit: each is shown whole."""
    lone = await submit(client, "sq")
    jobs = [{"queue": "sq", "payload": n} for n in range(996)]
    reply = await client.ok("submit_batch", jobs=jobs)
    batch = [result["job_id"] for result in reply["results"]]
    every = [lone, *batch]
    unknown = ["job_0000000000000001", "job_7fffffffffffffff"]  # below and above every id
    asked = [batch[-1], *every, unknown[0], unknown[1]]  # 1000: max_batch
    shown = (await client.ok("short_ids", job_ids=asked))["short_ids"]
    assert shown[-2:] == unknown and shown[0] == shown[-3]
    assert_abbreviated_as_git_does(every, asked, shown)
    assert shown[2:-2] == batch
    short_of = dict(zip(asked, shown, strict=True))
    for job_id in (lone, batch[0], batch[500], batch[-1]):
        short = short_of[job_id]
        found = (await client.ok("inspect", job_id=short, prefix=True))["job"]
        assert found["job_id"] == job_id
        if len(short) > len("job_") + 7:
            error = await client.error("inspect", job_id=short[:-1], prefix=True)
            assert error["code"] == "bad_request" and "more than one job" in error["message"]


async def test_short_ids_are_of_the_jobs_there_are_at_the_time(client):
    # The only job: 7 digits. Once a job whose id shares more is made, more.
    first = await submit(client, "sq")
    assert (await client.ok("short_ids", job_ids=[first]))["short_ids"] == [first[:11]]
    reply = await client.ok("submit_batch", jobs=[{"queue": "sq", "payload": 1}] * 2)
    a, b = (result["job_id"] for result in reply["results"])
    shown = (await client.ok("short_ids", job_ids=[first, a, b]))["short_ids"]
    assert_abbreviated_as_git_does([first, a, b], [first, a, b], shown)
    assert shown[1:] == [a[: len(common_start(a, b)) + 1], b[: len(common_start(a, b)) + 1]]


async def test_short_ids_takes_at_most_max_batch_ids(tmp_path):
    limits = wire.Limits(max_batch=3)
    async with custom_server(tmp_path, limits=limits) as srv, connected(srv) as c:
        job_id = await submit(c)
        assert (await c.ok("short_ids", job_ids=[job_id] * 3))["short_ids"] == [job_id[:11]] * 3
        error = await c.error("short_ids", job_ids=[job_id] * 4)
        assert error["code"] == "bad_request" and error["message"].startswith("job_ids: "), error
        assert "1 to 3" in error["message"]


async def test_inspect_pending_job_has_run_at(client):
    job_id = await submit(client, "q", 1, delay_ms=30_000)
    info = await inspect(client, job_id)
    assert info["state"] == "pending"
    assert set(info) >= JOB_REQUIRED | {"run_at"}


async def test_stats_shape(server, client):
    await submit(client, "s1", 1)
    await submit(client, "s1", 2, delay_ms=60_000)
    await lease_one(client, "s1")
    await submit(client, "s2", 3)
    reply = await client.ok("stats")
    # (next_cursor and total_queues: extensions, see tests/hostile/test_many_queues.py)
    assert set(reply) == {"id", "ok", "queues", "server", "next_cursor", "total_queues"}
    assert reply["next_cursor"] is None and reply["total_queues"] == len(reply["queues"])
    assert set(reply["queues"]) >= {"s1", "s2"}
    for counts in reply["queues"].values():
        assert set(counts) == STATES
    assert reply["queues"]["s1"] == {
        "pending": 1,
        "ready": 0,
        "leased": 1,
        "retrying": 0,
        "succeeded": 0,
        "dead": 0,
        "cancelled": 0,
    }
    assert reply["queues"]["s2"]["ready"] == 1
    srv = reply["server"]
    assert set(srv) >= {"version", "uptime_ms", "connections"}
    assert isinstance(srv["version"], str)
    assert isinstance(srv["uptime_ms"], int) and srv["uptime_ms"] >= 0
    assert srv["connections"] == 1
    async with connected(server) as other:
        assert (await other.ok("stats"))["server"]["connections"] == 2


# -- dead letters ---------------------------------------------------------------------------


async def test_dead_list_pages_with_cursor(client):
    ids = await make_dead(client, "dq", 5)
    await make_dead(client, "other", 1)
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        fields: dict[str, Any] = {"queue": "dq", "limit": 2}
        if cursor is not None:
            fields["cursor"] = cursor
        reply = await client.ok("dead_list", **fields)
        assert set(reply) == {"id", "ok", "jobs", "next_cursor"}
        assert len(reply["jobs"]) <= 2
        for job in reply["jobs"]:
            assert set(job) >= JOB_REQUIRED
            assert job["state"] == "dead" and job["queue"] == "dq"
            assert job["last_error"] == "boom"
            assert [e["error"] for e in job["errors"]] == ["boom"]
        seen += [j["job_id"] for j in reply["jobs"]]
        pages += 1
        cursor = reply["next_cursor"]
        if cursor is None:
            break
        assert pages < 10
    assert sorted(seen) == sorted(ids)
    assert len(seen) == len(set(seen)) == 5
    assert pages == 3
    # Without a queue: every dead job.
    everything = await client.ok("dead_list", limit=100)
    assert len(everything["jobs"]) == 6
    assert everything["next_cursor"] is None


async def dead_pages(client: LineClient, **fields: Any) -> list[list[str]]:
    """The job ids of every page of ``dead_list`` with ``fields``, following next_cursor."""
    pages: list[list[str]] = []
    cursor = None
    while len(pages) < 10:
        more = {} if cursor is None else {"cursor": cursor}
        reply = await client.ok("dead_list", **fields, **more)
        pages.append([job["job_id"] for job in reply["jobs"]])
        if (cursor := reply["next_cursor"]) is None:
            return pages
        assert cursor == pages[-1][-1]
    raise AssertionError(f"no last page: {pages}")


async def test_dead_list_newest_first_pages_to_the_oldest(client):
    ids = await make_dead(client, "dq", 5)
    await make_dead(client, "other", 1)
    assert await dead_pages(client, queue="dq", limit=2, order="newest") == [
        ids[:2:-1], ids[2:0:-1], ids[:1]
    ]  # fmt: skip
    assert await dead_pages(client, queue="dq", limit=2, order="oldest") == [
        ids[:2], ids[2:4], ids[4:]
    ]  # fmt: skip
    assert await dead_pages(client, queue="dq", limit=2) == await dead_pages(
        client, queue="dq", limit=2, order="oldest"
    )
    every = await dead_pages(client, limit=100, order="newest")
    assert len(every[0]) == 6 and every[0] == sorted(every[0], reverse=True)


async def test_dead_list_cursor_goes_on_after_its_job_when_jobs_die_between_pages(client):
    ids = await make_dead(client, "dq", 4)
    first = await client.ok("dead_list", queue="dq", limit=2, order="newest")
    cursor = first["next_cursor"]
    assert [j["job_id"] for j in first["jobs"]] == [ids[3], ids[2]] and cursor == ids[2]
    # A job dies between the pages: newer than the cursor, so not on the next page newest
    # first (it is on the first page again); oldest first, after the same cursor, it is.
    [late] = await make_dead(client, "dq", 1)
    rest = await client.ok("dead_list", queue="dq", cursor=cursor, order="newest")
    assert [j["job_id"] for j in rest["jobs"]] == [ids[1], ids[0]] and rest["next_cursor"] is None
    after = await client.ok("dead_list", queue="dq", cursor=cursor, order="oldest")
    assert [j["job_id"] for j in after["jobs"]] == [ids[3], late]
    top = await client.ok("dead_list", queue="dq", limit=1, order="newest")
    assert [j["job_id"] for j in top["jobs"]] == [late]


async def test_dead_retry_one_job(client):
    job_id, other = await make_dead(client, "dq", 2)
    reply = await client.ok("dead_retry", job_id=job_id)
    assert set(reply) == {"id", "ok", "count"} and reply["count"] == 1
    info = await inspect(client, job_id)
    assert info["state"] == "ready"
    assert (await inspect(client, other))["state"] == "dead"
    job = await lease_one(client, "dq")
    assert job["job_id"] == job_id
    assert job["attempt"] == 1  # fresh attempts
    assert job["attempt"] <= job["max_attempts"]


async def test_dead_retry_whole_queue(client):
    await make_dead(client, "dq", 3)
    await make_dead(client, "keep", 1)
    reply = await client.ok("dead_retry", queue="dq", all=True)
    assert reply["count"] == 3
    counts = await queue_stats(client, "dq")
    assert counts["dead"] == 0 and counts["ready"] == 3
    assert (await queue_stats(client, "keep"))["dead"] == 1
    assert (await client.ok("dead_retry", queue="dq", all=True))["count"] == 0


async def test_dead_purge_one_job_and_whole_queue(client):
    a, b, c = await make_dead(client, "dq", 3)
    reply = await client.ok("dead_purge", job_id=a)
    assert set(reply) == {"id", "ok", "count"} and reply["count"] == 1
    assert (await client.error("inspect", job_id=a))["code"] == "not_found"
    reply = await client.ok("dead_purge", queue="dq", all=True)
    assert reply["count"] == 2
    for job_id in (b, c):
        assert (await client.error("inspect", job_id=job_id))["code"] == "not_found"
    assert (await queue_stats(client, "dq"))["dead"] == 0
    assert (await client.ok("dead_list", queue="dq"))["jobs"] == []


# -- queue_pause / queue_resume / queue_list (extensions) -----------------------------------


async def test_a_paused_queue_takes_submits_but_leases_none_until_resumed(client):
    reply = await client.ok("queue_pause", queue="pz")
    assert set(reply) == {"id", "ok", "queue", "paused"}
    assert (reply["queue"], reply["paused"]) == ("pz", True)
    job_id = await submit(client, "pz")
    other = await submit(client, "open")
    reply = await client.ok("lease", queues=["pz", "open"], worker_id=W, count=5)
    assert [j["job_id"] for j in reply["jobs"]] == [other]
    assert (await inspect(client, job_id))["state"] == "ready"
    reply = await client.ok("queue_resume", queue="pz")
    assert (reply["queue"], reply["paused"]) == ("pz", False)
    assert (await lease_one(client, "pz"))["job_id"] == job_id


async def test_pause_and_resume_are_idempotent_and_need_no_jobs(client):
    for _ in range(2):
        assert (await client.ok("queue_pause", queue="nothing.yet"))["paused"] is True
    for _ in range(2):
        assert (await client.ok("queue_resume", queue="nothing.yet"))["paused"] is False
    error = assert_error(await client.request("queue_pause", queue="no spaces"), "bad_request")
    assert "queue" in error["message"]
    assert_error(await client.request("queue_pause"), "bad_request")


async def test_a_long_poll_parked_on_a_paused_queue_stays_parked_and_wakes_on_resume(
    server, client
):
    async with connected(server) as admin:
        await admin.ok("queue_pause", queue="pz")
        request_id = await client.send("lease", queues=["pz"], worker_id=W, wait_ms=30_000)
        await writer_barrier(client)  # (the lease has found nothing and parked)
        job_id = await submit(admin, "pz", "held")
        # The submit's commit woke the lease; its claim finds the queue paused, and it
        # parks again: no answer, for many times what a woken claim takes.
        with trio.move_on_after(0.5):
            early = await client.read()
            pytest.fail(f"a lease was answered while its queue was paused: {early!r}")
        assert (await inspect(admin, job_id))["state"] == "ready"
        await admin.ok("queue_resume", queue="pz")
        with trio.fail_after(5):
            reply = await client.read()
    assert reply["id"] == request_id
    assert [j["job_id"] for j in reply["jobs"]] == [job_id]


async def test_stats_names_the_pages_paused_queues_and_keeps_its_counts_counts(client):
    await submit(client, "a")
    await submit(client, "b")
    await client.ok("queue_pause", queue="b")
    await client.ok("queue_pause", queue="c")  # (no jobs: not on the page)
    reply = await client.ok("stats")
    assert reply["paused"] == ["b"]
    # Each queue's entry is its counts and nothing else, as clients before pauses sum it.
    assert reply["queues"]["b"] == {**dict.fromkeys(STATES, 0), "ready": 1}
    assert (await client.ok("stats", queues=["a"])).get("paused") is None
    await client.ok("queue_resume", queue="b")
    assert "paused" not in await client.ok("stats")


async def test_queue_list_pages_the_queues_with_jobs_or_settings_by_name(client):
    await make_dead(client, "d", 1)
    await submit(client, "b")
    await submit(client, "d")
    await client.ok("queue_pause", queue="a")  # no jobs
    await client.ok("queue_pause", queue="d")
    reply = await client.ok("queue_list", limit=2)
    assert set(reply) == {"id", "ok", "queues", "next_cursor"}
    assert [(q["queue"], q["paused"]) for q in reply["queues"]] == [("a", True), ("b", False)]
    assert reply["queues"][0]["counts"] == dict.fromkeys(STATES, 0)
    assert reply["queues"][1]["counts"] == {**dict.fromkeys(STATES, 0), "ready": 1}
    rest = await client.ok("queue_list", limit=2, cursor=reply["next_cursor"])
    assert [(q["queue"], q["paused"]) for q in rest["queues"]] == [("d", True)]
    assert rest["queues"][0]["counts"] == {**dict.fromkeys(STATES, 0), "ready": 1, "dead": 1}
    assert rest["next_cursor"] is None
    whole = await client.ok("queue_list")
    assert [q["queue"] for q in whole["queues"]] == ["a", "b", "d"]
    for fields, name in (({"limit": 0}, "limit"), ({"limit": 1001}, "limit"),
                         ({"cursor": "x y"}, "cursor")):  # fmt: skip
        error = assert_error(await client.request("queue_list", **fields), "bad_request")
        assert name in error["message"]


# -- queue_config (an extension) ------------------------------------------------------------

NO_SETTINGS = {
    "paused": False,
    "max_leased": None,
    "rate": None,
    "default_timeout_ms": None,
    "default_retries": None,
    "default_backoff": None,
}


async def test_queue_config_sets_clears_and_keeps_each_setting_and_queue_list_shows_them(client):
    reply = await client.ok("queue_config", queue="qc")  # nothing given: a read
    fields = {k: v for k, v in reply.items() if k not in ("id", "ok")}
    assert fields == {"queue": "qc", **NO_SETTINGS}
    reply = await client.ok(
        "queue_config", queue="qc", max_leased=3, rate={"limit": 10, "period_ms": 1000},
        default_backoff={"kind": "fixed", "delay_ms": 500}, default_retries=0,
    )  # fmt: skip
    want = {
        **NO_SETTINGS, "max_leased": 3, "rate": {"limit": 10, "period_ms": 1000},
        "default_backoff": {"kind": "fixed", "delay_ms": 500}, "default_retries": 0,
    }  # fmt: skip
    assert {k: reply[k] for k in NO_SETTINGS} == want
    # A setting not given stays; null clears one.
    reply = await client.ok("queue_config", queue="qc", max_leased=None, default_timeout_ms=60_000)
    want = {**want, "max_leased": None, "default_timeout_ms": 60_000}
    assert {k: reply[k] for k in NO_SETTINGS} == want
    [listed] = (await client.ok("queue_list"))["queues"]
    assert listed == {"queue": "qc", **want, "counts": dict.fromkeys(STATES, 0)}
    # Named queues are listed whether or not they have jobs or settings.
    named = await client.ok("queue_list", queues=["zz", "qc"])
    assert [q["queue"] for q in named["queues"]] == ["qc", "zz"]
    assert {k: named["queues"][1][k] for k in NO_SETTINGS} == NO_SETTINGS
    assert named["next_cursor"] is None
    # Every setting cleared: the queue has none, and a page no longer lists it.
    await client.ok(
        "queue_config", queue="qc", rate=None, default_backoff=None, default_retries=None,
        default_timeout_ms=None,
    )  # fmt: skip
    assert (await client.ok("queue_list"))["queues"] == []


async def test_max_leased_holds_a_queue_to_its_limit_and_a_freed_slot_wakes_a_parked_lease(
    server, client
):
    async with connected(server) as admin:
        await admin.ok("queue_config", queue="lim", max_leased=1)
        first, second = await submit(admin, "lim"), await submit(admin, "lim")
        held = await lease_one(admin, "lim")
        assert held["job_id"] == first
        assert (await admin.ok("lease", queues=["lim"], worker_id=W, count=5))["jobs"] == []
        request_id = await client.send("lease", queues=["lim"], worker_id=W, wait_ms=30_000)
        await writer_barrier(client)  # (the lease has found the queue full and parked)
        with trio.move_on_after(0.3):
            early = await client.read()
            pytest.fail(f"a lease was answered while its queue was at its limit: {early!r}")
        await admin.ok("ack", job_id=first, worker_id=W, token=held["token"])
        with trio.fail_after(5):
            reply = await client.read()
    assert reply["id"] == request_id
    assert [j["job_id"] for j in reply["jobs"]] == [second]


async def test_a_rate_limited_queue_leases_its_limit_per_window_and_wakes_at_its_end(
    server, client
):
    async with connected(server) as admin:
        await admin.ok("queue_config", queue="rl", rate={"limit": 2, "period_ms": 400})
        jobs = [await submit(admin, "rl") for _ in range(3)]
        reply = await admin.ok("lease", queues=["rl"], worker_id=W, count=5)
        assert [j["job_id"] for j in reply["jobs"]] == jobs[:2]
        opened = trio.current_time()
        reply = await client.ok("lease", queues=["rl"], worker_id=W, count=5, wait_ms=10_000)
        waited = trio.current_time() - opened
    # Parked until the window closed, then woken by the promoter's pass: not at wait_ms.
    assert [j["job_id"] for j in reply["jobs"]] == jobs[2:]
    assert 0.3 <= waited < 5, waited


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"max_leased": 0}, "max_leased"),
        ({"max_leased": "3"}, "max_leased"),
        ({"rate": {"limit": 0, "period_ms": 1000}}, "rate.limit"),
        ({"rate": {"limit": 5}}, "rate.period_ms"),
        ({"rate": {"limit": 5, "period_ms": 86_400_001}}, "rate.period_ms"),
        ({"default_timeout_ms": 0}, "default_timeout_ms"),
        ({"default_retries": -1}, "default_retries"),
        ({"default_backoff": {"kind": "linear"}}, "default_backoff.kind"),
        ({"paused": None}, "paused"),
        ({"queue": "bad queue!"}, "queue"),
    ],
)
async def test_queue_config_refuses_a_bad_setting_naming_it_and_changes_nothing(
    client, fields, name
):
    await client.ok("queue_config", queue="qc", max_leased=2)
    error = assert_error(
        await client.request("queue_config", **{"queue": "qc", **fields}), "bad_request"
    )
    assert name in error["message"]
    reply = await client.ok("queue_config", queue="qc")
    assert {k: reply[k] for k in NO_SETTINGS} == {**NO_SETTINGS, "max_leased": 2}


async def test_a_submit_gets_its_queues_default_for_each_field_it_leaves_out(client):
    defaults = {
        "default_retries": 1,
        "default_timeout_ms": 60_000,
        "default_backoff": {"kind": "fixed", "delay_ms": 500},
    }
    await client.ok("queue_config", queue="qd", **defaults)
    kept = ("max_attempts", "timeout_ms")
    # A plain submit (the fast path most take), one the full path parses, and a batch.
    plain = await submit(client, "qd", 1)
    later = await submit(client, "qd", 1, run_at=now_ms() + 600_000, idempotency_key="k")
    given = await submit(client, "qd", 1, retries=3, timeout_ms=1_000)
    reply = await client.ok(
        "submit_batch",
        jobs=[
            {"queue": "qd", "payload": 1},
            {"queue": "other", "payload": 1},
            {"queue": "qd", "payload": 1, "retries": 0},
        ],
    )
    batch = [result["job_id"] for result in reply["results"]]
    jobs = [await inspect(client, job_id) for job_id in [plain, later, given, *batch]]
    assert [tuple(job.get(k) for k in kept) for job in jobs] == [
        (2, 60_000),
        (2, 60_000),
        (4, 1_000),
        (2, 60_000),
        (4, None),
        (1, 60_000),
    ]
    # Changed later: the jobs made before keep theirs.
    await client.ok("queue_config", queue="qd", default_retries=None, default_timeout_ms=None)
    assert [(await inspect(client, plain))[k] for k in kept] == [2, 60_000]
    fresh = await inspect(client, await submit(client, "qd", 1))
    assert (fresh["max_attempts"], fresh.get("timeout_ms")) == (4, None)


async def test_a_lease_and_a_retry_follow_the_defaults_the_job_got(client):
    await client.ok(
        "queue_config", queue="qd", default_retries=2, default_timeout_ms=60_000,
        default_backoff={"kind": "fixed", "delay_ms": 500},
    )  # fmt: skip
    job_id = await submit(client, "qd", 1)
    job = await lease_one(client, "qd")
    assert (job["job_id"], job["max_attempts"], job["timeout_ms"]) == (job_id, 3, 60_000)
    before = now_ms()
    reply = await client.ok("fail", job_id=job_id, worker_id=W, token=job["token"], error="x")
    assert reply["state"] == "retrying"
    assert before + 500 - 5 <= reply["retry_at"] <= now_ms() + 500 + 5


# -- errors ---------------------------------------------------------------------------------

BAD = "bad queue!"

ILL_TYPED: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    # (op, fields, the field the message must name (any of))
    ("submit", {"payload": 1}, ("queue",)),
    ("submit", {"queue": "q"}, ("payload",)),
    ("submit", {"queue": 7, "payload": 1}, ("queue",)),
    ("submit", {"queue": "", "payload": 1}, ("queue",)),
    ("submit", {"queue": BAD, "payload": 1}, ("queue",)),
    ("submit", {"queue": "x" * 129, "payload": 1}, ("queue",)),
    ("submit", {"queue": "é", "payload": 1}, ("queue",)),
    ("submit", {"queue": "q\n", "payload": 1}, ("queue",)),
    ("submit", {"queue": "q" * 128 + "\n", "payload": 1}, ("queue",)),
    ("submit", {"queue": "q", "payload": 1, "priority": "urgent"}, ("priority",)),
    ("submit", {"queue": "q", "payload": 1, "priority": 2}, ("priority",)),
    ("submit", {"queue": "q", "payload": 1, "retries": "3"}, ("retries",)),
    ("submit", {"queue": "q", "payload": 1, "retries": -1}, ("retries",)),
    ("submit", {"queue": "q", "payload": 1, "retries": 1.5}, ("retries",)),
    ("submit", {"queue": "q", "payload": 1, "delay_ms": -1}, ("delay_ms",)),
    ("submit", {"queue": "q", "payload": 1, "delay_ms": "10"}, ("delay_ms",)),
    ("submit", {"queue": "q", "payload": 1, "delay_ms": True}, ("delay_ms",)),
    ("submit", {"queue": "q", "payload": 1, "run_at": -5}, ("run_at",)),
    ("submit", {"queue": "q", "payload": 1, "run_at": 1.5}, ("run_at",)),
    ("submit", {"queue": "q", "payload": 1, "delay_ms": 10, "run_at": 1}, ("delay_ms", "run_at")),
    ("submit", {"queue": "q", "payload": 1, "idempotency_key": 5}, ("idempotency_key",)),
    ("submit", {"queue": "q", "payload": 1, "idempotency_key": "k" * 257}, ("idempotency_key",)),
    ("submit", {"queue": "q", "payload": 1, "backoff": {"kind": "linear"}}, ("backoff",)),
    ("submit", {"queue": "q", "payload": 1, "backoff": {"kind": "fixed"}}, ("backoff",)),
    ("submit", {"queue": "q", "payload": 1, "backoff": "fast"}, ("backoff",)),
    (
        "submit",
        {"queue": "q", "payload": 1, "backoff": {"kind": "fixed", "delay_ms": -1}},
        ("backoff",),
    ),
    (
        "submit",
        {"queue": "q", "payload": 1, "backoff": {"kind": "exponential", "base_ms": 0}},
        ("backoff",),
    ),
    (
        "submit",
        {
            "queue": "q",
            "payload": 1,
            "backoff": {"kind": "exponential", "base_ms": 10, "max_ms": 5},
        },
        ("backoff",),
    ),
    ("submit_batch", {}, ("jobs",)),
    ("submit_batch", {"jobs": "x"}, ("jobs",)),
    ("submit_batch", {"jobs": []}, ("jobs",)),
    ("lease", {"worker_id": W}, ("queues",)),
    ("lease", {"queues": ["q"]}, ("worker_id",)),
    ("lease", {"queues": "q", "worker_id": W}, ("queues",)),
    ("lease", {"queues": {"q": 1}, "worker_id": W}, ("queues",)),
    ("lease", {"queues": ["q\n"], "worker_id": W}, ("queues",)),
    ("lease", {"queues": [], "worker_id": W}, ("queues",)),
    ("lease", {"queues": [BAD], "worker_id": W}, ("queues",)),
    ("lease", {"queues": ["q"], "worker_id": 1}, ("worker_id",)),
    ("lease", {"queues": ["q"], "worker_id": ""}, ("worker_id",)),
    ("lease", {"queues": ["q"], "worker_id": W, "count": True}, ("count",)),
    ("lease", {"queues": ["q"], "worker_id": W, "count": 0}, ("count",)),
    ("lease", {"queues": ["q"], "worker_id": W, "count": "2"}, ("count",)),
    ("lease", {"queues": ["q"], "worker_id": W, "count": 1001}, ("count",)),  # > max_batch
    ("lease", {"queues": ["q"], "worker_id": W, "lease_ms": 0}, ("lease_ms",)),
    ("lease", {"queues": ["q"], "worker_id": W, "lease_ms": 12 * 3_600_000 + 1}, ("lease_ms",)),
    ("lease", {"queues": ["q"], "worker_id": W, "wait_ms": -1}, ("wait_ms",)),
    ("lease", {"queues": ["q"], "worker_id": W, "wait_ms": 60_001}, ("wait_ms",)),
    ("lease", {"queues": [f"q{i}" for i in range(17)], "worker_id": W}, ("queues",)),
    ("renew", {"job_id": "job_0000000000000001", "worker_id": W}, ("token",)),
    (
        "renew",
        {"job_id": "job_0000000000000001", "worker_id": W, "token": "t", "lease_ms": -1},
        ("lease_ms",),
    ),
    (
        "renew",
        {
            "job_id": "job_0000000000000001",
            "worker_id": W,
            "token": "t",
            "lease_ms": 12 * 3_600_000 + 1,
        },
        ("lease_ms",),
    ),
    ("ack", {"worker_id": W, "token": "t"}, ("job_id",)),
    ("ack", {"job_id": "job_0000000000000001", "token": "t"}, ("worker_id",)),
    ("ack", {"job_id": "job_0000000000000001", "worker_id": W, "token": 5}, ("token",)),
    ("fail", {"job_id": "job_0000000000000001", "worker_id": W, "token": "t"}, ("error",)),
    (
        "fail",
        {"job_id": "job_0000000000000001", "worker_id": W, "token": "t", "error": 3},
        ("error",),
    ),
    (
        "fail",
        {
            "job_id": "job_0000000000000001",
            "worker_id": W,
            "token": "t",
            "error": "e",
            "retryable": "no",
        },
        ("retryable",),
    ),
    (
        "fail",
        {
            "job_id": "job_0000000000000001",
            "worker_id": W,
            "token": "t",
            "error": "e",
            "traceback": 3,
        },
        ("traceback",),
    ),
    (
        "fail",
        {
            "job_id": "job_0000000000000001",
            "worker_id": W,
            "token": "t",
            "error": "e",
            "traceback": ["Traceback (most recent call last):"],
        },
        ("traceback",),
    ),
    ("release", {"job_id": None, "worker_id": W, "token": "t"}, ("job_id",)),
    ("inspect", {}, ("job_id",)),
    ("inspect", {"job_id": 123}, ("job_id",)),
    # With prefix: "job_" and 7 to 16 lowercase hex digits, nothing else.
    ("inspect", {"job_id": "job_34472d", "prefix": True}, ("job_id",)),
    ("inspect", {"job_id": "job_" + "0" * 17, "prefix": True}, ("job_id",)),
    ("inspect", {"job_id": "job_34472D0", "prefix": True}, ("job_id",)),
    ("inspect", {"job_id": "job_34472g0", "prefix": True}, ("job_id",)),
    ("inspect", {"job_id": "34472d0a", "prefix": True}, ("job_id",)),
    ("inspect", {"job_id": "job_34472d0\n", "prefix": True}, ("job_id",)),
    ("inspect", {"job_id": "", "prefix": True}, ("job_id",)),
    ("inspect", {"job_id": "job_34472d0", "prefix": "yes"}, ("prefix",)),
    ("inspect", {"job_id": "job_34472d0", "prefix": 1}, ("prefix",)),
    # short_ids: 1 to max_batch whole ids.
    ("short_ids", {}, ("job_ids",)),
    ("short_ids", {"job_ids": []}, ("job_ids",)),
    ("short_ids", {"job_ids": ["job_0000000000000001"] * 1001}, ("job_ids",)),
    ("short_ids", {"job_ids": "job_0000000000000001"}, ("job_ids",)),
    ("short_ids", {"job_ids": ["job_0000000000000001", "job_34472d0"]}, ("job_ids[1]",)),
    ("short_ids", {"job_ids": ["job_000000000000000A"]}, ("job_ids[0]",)),
    ("short_ids", {"job_ids": ["job_8000000000000000"]}, ("job_ids[0]",)),
    ("short_ids", {"job_ids": ["job_0000000000000001\n"]}, ("job_ids[0]",)),
    ("short_ids", {"job_ids": [None]}, ("job_ids[0]",)),
    ("short_ids", {"job_ids": [1]}, ("job_ids[0]",)),
    ("dead_list", {"limit": 0}, ("limit",)),
    ("dead_list", {"limit": "10"}, ("limit",)),
    ("dead_list", {"queue": BAD}, ("queue",)),
    ("dead_list", {"queue": "q\n"}, ("queue",)),
    ("dead_list", {"order": "newer"}, ("order",)),
    ("dead_list", {"order": "NEWEST"}, ("order",)),
    ("dead_list", {"order": 1}, ("order",)),
    ("dead_list", {"order": None}, ("order",)),
    ("dead_list", {"cursor": "job_1", "order": "newest"}, ("cursor",)),
    ("dead_list", {"cursor": 5, "order": "oldest"}, ("cursor",)),
    ("dead_retry", {"queue": "q"}, ("all",)),
    ("dead_retry", {"queue": "q", "all": False}, ("all",)),
    ("dead_retry", {"queue": "q", "all": "yes"}, ("all",)),
    ("dead_retry", {}, ("job_id", "queue")),
    ("dead_purge", {"queue": "q"}, ("all",)),
    ("dead_purge", {"queue": BAD, "all": True}, ("queue",)),
    # The bulk actions' states (extension), and the job browser.
    ("dead_retry", {"queue": "q", "all": True, "states": ["succeeded"]}, ("states[0]",)),
    ("dead_retry", {"queue": "q", "all": True, "states": []}, ("states",)),
    # (by id too: the same states, checked before the job is looked up)
    ("dead_retry", {"job_id": "job_0000000000000001", "states": ["succeeded"]}, ("states[0]",)),
    ("dead_purge", {"job_id": "job_0000000000000001", "states": []}, ("states",)),
    ("dead_purge", {"queue": "q", "all": True, "states": ["ready"]}, ("states[0]",)),
    ("dead_purge", {"queue": "q", "all": True, "states": "dead"}, ("states",)),
    ("jobs_list", {"limit": 0}, ("limit",)),
    ("jobs_list", {"limit": 101}, ("limit",)),
    ("jobs_list", {"states": ["done"]}, ("states[0]",)),
    ("jobs_list", {"states": []}, ("states",)),
    ("jobs_list", {"order": "latest"}, ("order",)),
    ("jobs_list", {"cursor": "job_1"}, ("cursor",)),
    ("jobs_list", {"search": ""}, ("search",)),
    ("jobs_list", {"search": "x" * 257}, ("search",)),
    ("jobs_list", {"search": "order-"}, ("search",)),
    ("jobs_list", {"queue": BAD}, ("queue",)),
    ("promote", {}, ("job_id",)),
    ("promote", {"job_id": 5}, ("job_id",)),
    ("hello", {"client": 5}, ("client",)),
]


@pytest.mark.parametrize(
    ("op", "fields", "names"),
    ILL_TYPED,
    ids=[f"{op}-{names[0]}-{i}" for i, (op, _, names) in enumerate(ILL_TYPED)],
)
async def test_ill_typed_or_out_of_range_is_bad_request_naming_the_field(client, op, fields, names):
    request_id = await client.send(op, **fields)
    reply = await client.read()
    error = assert_error(reply, "bad_request", request_id)
    assert any(name in error["message"] for name in names), (names, error["message"])
    # Nothing was created, and the connection is still usable.
    assert (await client.ok("stats"))["queues"] == {}
    await client.ok("ping")


async def test_values_at_the_edge_of_their_range_are_accepted(server, client):
    limits = server.config.limits
    name = "A-z0.9_:" + "x" * 120
    assert len(name) == 128
    job_id = await submit(client, name, 1, idempotency_key="k" * 256, retries=0)
    job = await lease_one(client, name, lease_ms=limits.max_lease_ms)
    assert job["job_id"] == job_id
    reply = await client.ok(
        "renew", job_id=job_id, worker_id=W, token=job["token"], lease_ms=limits.max_lease_ms
    )
    assert reply["lease_expires_at"] >= job["lease_expires_at"]
    queues = [f"q{i}" for i in range(limits.max_queues_per_lease)]
    assert (await client.ok("lease", queues=queues, worker_id=W))["jobs"] == []


@pytest.mark.parametrize(
    "mangle",
    [
        lambda j: j + "\n",
        lambda j: j + " ",
        lambda j: " " + j,
        lambda j: j.upper(),
        lambda j: j[:-1],
        lambda j: j + "0",
        lambda j: j.replace("job_", "job_+"),
    ],
    ids=["trailing-newline", "trailing-space", "leading-space", "upper", "short", "long", "plus"],
)
async def test_malformed_job_ids_are_not_found(client, mangle):
    job_id = await submit(client)
    job = await lease_one(client)
    bad = mangle(job_id)
    reply = await client.request("inspect", job_id=bad)
    assert reply["ok"] is False and reply["error"]["code"] == "not_found", (bad, reply)
    reply = await client.request("ack", job_id=bad, worker_id=W, token=job["token"])
    assert reply["ok"] is False and reply["error"]["code"] == "not_found", (bad, reply)
    assert (await inspect(client, job_id))["state"] == "leased"


async def test_stats_and_hello_agree_on_version(client):
    hello = await client.ok("hello")
    stats = await client.ok("stats")
    assert stats["server"]["version"] == hello["version"]


async def test_job_ids_sort_across_restarts(tmp_path):
    ids = []
    for _ in range(3):
        async with custom_server(tmp_path) as srv, connected(srv) as c:
            ids += [await submit(c, "q", i) for i in range(5)]
    assert ids == sorted(ids)
    assert len(set(ids)) == 15


async def test_leased_jobs_are_ready_after_restart(tmp_path):
    async with custom_server(tmp_path) as srv, connected(srv) as c:
        job_id = await submit(c)
        job = await lease_one(c, lease_ms=600_000)
    async with custom_server(tmp_path) as srv, connected(srv) as c:
        assert (await inspect(c, job_id))["state"] == "ready"
        error = await c.error("ack", job_id=job_id, worker_id=W, token=job["token"])
        assert error["code"] in {"lease_expired", "stale_token"}
        again = await lease_one(c)
        assert again["job_id"] == job_id


async def test_payload_too_large(tmp_path):
    async with (
        custom_server(tmp_path, limits=wire.Limits(max_payload_bytes=1024)) as srv,
        connected(srv) as c,
    ):
        exact = "x" * 1022  # 1024 bytes encoded, with its quotes
        assert len(orjson.dumps(exact)) == 1024
        assert (await c.ok("submit", queue="q", payload=exact))["state"] == "ready"
        error = await c.error("submit", queue="q", payload="x" * 1023)
        assert error["code"] == "bad_request" and "payload" in error["message"]
        error = await c.error("submit", queue="q", payload={"big": ["y" * 600, "z" * 600]})
        assert error["code"] == "bad_request" and "payload" in error["message"]
        assert (await queue_stats(c, "q"))["ready"] == 1


async def test_frame_too_large_replies_once_then_closes(tmp_path):
    limits = wire.Limits(max_frame_bytes=1024)
    async with custom_server(tmp_path, limits=limits) as srv, connected(srv) as c:
        # A frame of exactly the limit is fine.
        line = orjson.dumps({"op": "ping", "id": 1, "pad": ""})
        line = orjson.dumps({"op": "ping", "id": 1, "pad": "p" * (1024 - len(line))})
        assert len(line) == 1024
        await c.send_raw(line + b"\n")
        assert (await c.read()) == {"id": 1, "ok": True}
        big = orjson.dumps({"op": "ping", "id": 2, "pad": "p" * 2000})
        await c.send_raw(big + b"\n")
        lines = await read_until_eof(c)
        assert len(lines) == 1, lines
        reply = orjson.loads(lines[0])
        assert reply["ok"] is False
        assert reply["error"]["code"] == "frame_too_large"
        # The server goes on serving others.
        async with connected(srv) as other:
            await other.ok("ping")


async def test_lines_before_a_frame_too_large_are_answered_before_its_error(tmp_path):
    limits = wire.Limits(max_frame_bytes=1024)
    async with custom_server(tmp_path, limits=limits) as srv, connected(srv) as c:
        await c.send_raw(
            orjson.dumps({"op": "submit", "id": "s1", "queue": "q", "payload": 1}) + b"\n"
            + orjson.dumps({"op": "lease", "id": "l1", "queues": ["none"], "worker_id": W,
                            "wait_ms": 30_000}) + b"\n"
            + orjson.dumps({"op": "submit", "id": "s2", "queue": "q", "payload": 2}) + b"\n"
            + b'{"op":"ping","pad":"' + b"p" * 2000 + b'"}\n'
        )  # fmt: skip
        replies = [orjson.loads(line) for line in await read_until_eof(c)]
        assert {r["id"] for r in replies[:3]} == {"s1", "l1", "s2"}, replies
        assert all(r["ok"] for r in replies[:3])
        (error,) = replies[3:]
        assert_error(error, "frame_too_large")
        async with connected(srv) as other:
            assert (await queue_stats(other, "q"))["ready"] == 2


async def test_frame_too_large_counts_crlf_excluded(tmp_path):
    """The limit is on the line without its newline; ``\\r\\n`` does not count against it."""
    async with (
        custom_server(tmp_path, limits=wire.Limits(max_frame_bytes=64)) as srv,
        connected(srv) as c,
    ):
        line = orjson.dumps({"op": "ping", "id": "x", "pad": ""})
        line = orjson.dumps({"op": "ping", "id": "x", "pad": "p" * (64 - len(line))})
        assert len(line) == 64
        await c.send_raw(line + b"\r\n")
        assert await c.read() == {"id": "x", "ok": True}


async def test_unknown_op(client):
    request_id = await client.send("frobnicate", queue="q")
    assert_error(await client.read(), "unknown_op", request_id)
    await client.ok("ping")


@pytest.mark.parametrize("op_value", [None, 5, ["ping"]])
async def test_missing_or_ill_typed_op_is_bad_request(client, op_value):
    frame: dict[str, Any] = {"id": 9}
    if op_value is not None:
        frame["op"] = op_value
    await client.send_raw(orjson.dumps(frame) + b"\n")
    error = assert_error(await client.read(), "bad_request", 9)
    assert "op" in error["message"]
    await client.ok("ping")


async def test_not_found(client):
    missing = "job_00000000deadbeef"
    assert (await client.error("inspect", job_id=missing))["code"] == "not_found"
    assert (await client.error("inspect", job_id="nonsense"))["code"] == "not_found"
    ref = {"worker_id": W, "token": "0" * 32}
    for job_id in ("nope", missing):
        assert (await client.error("ack", job_id=job_id, **ref))["code"] == "not_found"
        assert (await client.error("renew", job_id=job_id, **ref))["code"] == "not_found"
        assert (await client.error("release", job_id=job_id, **ref))["code"] == "not_found"
        error = await client.error("fail", job_id=job_id, error="x", **ref)
        assert error["code"] == "not_found"
        assert (await client.error("dead_retry", job_id=job_id))["code"] == "not_found"
        assert (await client.error("dead_purge", job_id=job_id))["code"] == "not_found"


async def test_stale_token_changes_nothing(client):
    job_id = await submit(client)
    job = await lease_one(client)
    wrong_token = "f" * len(job["token"])
    for op, extra in (
        ("ack", {}),
        ("renew", {}),
        ("release", {}),
        ("fail", {"error": "x"}),
    ):
        error = await client.error(op, job_id=job_id, worker_id=W, token=wrong_token, **extra)
        assert error["code"] == "stale_token", (op, error)
        error = await client.error(
            op, job_id=job_id, worker_id="someone-else", token=job["token"], **extra
        )
        assert error["code"] == "stale_token", (op, error)
    info = await inspect(client, job_id)
    assert info["state"] == "leased"
    assert info["attempt"] == 1
    assert info["lease_expires_at"] == job["lease_expires_at"]
    assert info["errors"] == []
    await client.ok("ack", job_id=job_id, worker_id=W, token=job["token"])


async def test_old_token_after_reclaim_is_stale(client):
    job_id = await submit(client)
    first = await lease_one(client)
    await client.ok("release", job_id=job_id, worker_id=W, token=first["token"])
    second = await lease_one(client)
    error = await client.error("ack", job_id=job_id, worker_id=W, token=first["token"])
    assert error["code"] == "stale_token"
    await client.ok("ack", job_id=job_id, worker_id=W, token=second["token"])


async def test_lease_expired(client):
    job_id = await submit(client, "q", 1, retries=3)
    job = await lease_one(client, lease_ms=1)
    await trio.sleep(0.05)  # real time is the behaviour under test
    ref = {"job_id": job_id, "worker_id": W, "token": job["token"]}
    for op, extra in (("ack", {}), ("renew", {}), ("fail", {"error": "x"}), ("release", {})):
        error = await client.error(op, **ref, **extra)
        assert error["code"] == "lease_expired", (op, error)
    info = await inspect(client, job_id)
    # Expired (perhaps already reaped back to ready): never succeeded, never failed by us.
    assert info["state"] in {"leased", "ready"}
    assert info["errors"] == [] or info["errors"][0]["error"] == "lease expired"
    assert not any(e["error"] == "x" for e in info["errors"])


async def test_lease_expired_after_reaper_ran(client):
    job_id = await submit(client, "q", 1, retries=3)
    job = await lease_one(client, lease_ms=1)
    # Wait until the reaper has put the job back (the contract: within about 100 ms).
    with trio.fail_after(5):
        # Polls state the server exposes only through requests.
        while (await inspect(client, job_id))["state"] != "ready":  # noqa: ASYNC110
            await trio.sleep(0.02)
    error = await client.error("ack", job_id=job_id, worker_id=W, token=job["token"])
    assert error["code"] == "lease_expired"
    again = await lease_one(client)
    assert again["job_id"] == job_id and again["attempt"] == 2


async def test_expired_last_attempt_is_dead_with_lease_expired_error(client):
    job_id = await submit(client, "q", 1, retries=0)
    job = await lease_one(client, lease_ms=1)
    with trio.fail_after(5):
        # Polls state the server exposes only through requests.
        while (info := await inspect(client, job_id))["state"] != "dead":  # noqa: ASYNC110
            await trio.sleep(0.02)
    assert info["last_error"] == "lease expired"
    error = await client.error("ack", job_id=job_id, worker_id=W, token=job["token"])
    assert error["code"] == "lease_expired"


async def test_invalid_state(client):
    job_id = await submit(client)
    assert (await client.error("dead_retry", job_id=job_id))["code"] == "invalid_state"
    assert (await client.error("dead_purge", job_id=job_id))["code"] == "invalid_state"
    job = await lease_one(client)
    ref = {"job_id": job_id, "worker_id": W, "token": job["token"]}
    assert (await client.error("dead_retry", job_id=job_id))["code"] == "invalid_state"
    assert (await client.ok("fail", **ref, error="once"))["state"] == "retrying"
    # The contract: without the current lease, fail answers stale_token.
    error = await client.error("fail", **ref, error="twice")
    assert error["code"] == "stale_token"
    info = await inspect(client, job_id)
    assert [e["error"] for e in info["errors"]] == ["once"]


async def test_lease_ops_after_the_token_failed_the_job_are_stale(client):
    job_id = await submit(client, "q", 1, retries=0)
    job = await lease_one(client)
    ref = {"job_id": job_id, "worker_id": W, "token": job["token"]}
    assert (await client.ok("fail", **ref, error="once"))["state"] == "dead"
    assert (await client.error("fail", **ref, error="twice"))["code"] == "stale_token"
    assert (await client.error("release", **ref))["code"] == "stale_token"
    assert (await client.error("renew", **ref))["code"] == "stale_token"


async def test_ack_after_fail_is_rejected(client):
    job_id = await submit(client, "q", 1, retries=0)
    job = await lease_one(client)
    ref = {"job_id": job_id, "worker_id": W, "token": job["token"]}
    await client.ok("fail", **ref, error="boom", retryable=False)
    assert (await client.error("ack", **ref))["code"] == "stale_token"
    assert (await inspect(client, job_id))["state"] == "dead"


async def test_a_flood_of_refused_connections_is_logged_in_summary(tmp_path):
    """Each one over the cap still gets its overloaded line, but the log gets one line per
    second at most, with the count, rather than one per connection."""
    limits = wire.Limits(max_connections=1)
    with logged("relay.listener") as records:
        async with custom_server(tmp_path, limits=limits) as srv, connected(srv) as held:
            await held.ok("ping")
            started = trio.current_time()
            for _ in range(30):
                extra = await srv.connect()
                try:
                    lines = await read_until_eof(extra)
                finally:
                    await extra.aclose()
                assert_error(orjson.loads(lines[0]), "overloaded")
            elapsed = trio.current_time() - started
    refused = [r for r in records if r.getMessage() == "connection.refused"]
    assert 1 <= len(refused) <= 1 + elapsed / SUMMARY_INTERVAL_S, (len(refused), elapsed)
    assert sum(r.fields["refused"] for r in refused) <= 30  # type: ignore[attr-defined]
    assert refused[0].fields["refused"] == 1  # type: ignore[attr-defined]


async def test_overloaded_over_max_connections(tmp_path):
    async with custom_server(tmp_path, limits=wire.Limits(max_connections=2)) as srv:
        c1 = await srv.connect()
        c2 = await srv.connect()
        try:
            await c1.ok("ping")
            await c2.ok("ping")
            assert (await c2.ok("stats"))["server"]["connections"] == 2
            c3 = await srv.connect()
            try:
                lines = await read_until_eof(c3)
            finally:
                await c3.aclose()
            assert len(lines) == 1, lines
            assert_error(orjson.loads(lines[0]), "overloaded")
            # The two admitted connections are unaffected.
            await c1.ok("ping")
            await c2.ok("ping")
            await c1.aclose()
            # The server notices the close asynchronously; wait (bounded) for the slot.
            with trio.fail_after(5):
                # Polls state the server exposes only through requests.
                while (await c2.ok("stats"))["server"]["connections"] != 1:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            async with connected(srv) as c4:
                await c4.ok("ping")
                assert (await c4.ok("stats"))["server"]["connections"] == 2
        finally:
            await c1.aclose()
            await c2.aclose()


# -- framing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        b"this is not json",
        b"[1, 2, 3]",
        b'"ping"',
        b"42",
        b"null",
        b"",
        b"   ",
        b'{"op": "ping"',
        b"\xff\xfe\x00garbage",
        b'{"op": "ping", "id": 1}{"op": "ping"}',
    ],
    ids=[
        "text",
        "array",
        "string",
        "number",
        "null",
        "empty",
        "blank",
        "truncated",
        "bytes",
        "two-objects",
    ],
)
async def test_not_a_json_object_is_bad_request_and_connection_stays(client, line):
    await client.send_raw(line + b"\n")
    reply = await client.read()
    assert_error(reply, "bad_request")
    assert reply["id"] is None
    request_id = await client.send("ping")
    assert await client.read() == {"id": request_id, "ok": True}


async def test_crlf_line_endings(client):
    await client.send_raw(b'{"op":"ping","id":"crlf"}\r\n')
    assert await client.read() == {"id": "crlf", "ok": True}
    await client.send_raw(b'{"op":"submit","id":2,"queue":"q","payload":[1]}\r\n')
    reply = await client.read()
    assert reply["id"] == 2 and reply["ok"] is True and reply["state"] == "ready"
    # Mixed endings in one write.
    await client.send_raw(b'{"op":"ping","id":3}\r\n{"op":"ping","id":4}\n')
    assert {(await client.read())["id"] for _ in range(2)} == {3, 4}


@pytest.mark.parametrize("request_id", ["abc", "", "ünïcode-id", 0, -7, 12345678901234, 2**53])
async def test_id_is_echoed(client, request_id):
    await client.send_raw(orjson.dumps({"op": "ping", "id": request_id}) + b"\n")
    assert await client.read() == {"id": request_id, "ok": True}
    await client.send_raw(orjson.dumps({"op": "nope", "id": request_id}) + b"\n")
    assert (await client.read())["id"] == request_id
    await client.send_raw(orjson.dumps({"op": "submit", "id": request_id}) + b"\n")
    reply = await client.read()
    assert reply["id"] == request_id and reply["error"]["code"] == "bad_request"


@pytest.mark.parametrize("bad_id", [1.5, True, [1], {"a": 1}])
async def test_ill_typed_id_is_bad_request(client, bad_id):
    await client.send_raw(orjson.dumps({"op": "ping", "id": bad_id}) + b"\n")
    reply = await client.read()
    error = assert_error(reply, "bad_request")
    assert "id" in error["message"]
    await client.ok("ping")


async def test_request_without_id_is_answered(client):
    await client.send_raw(b'{"op":"ping"}\n')
    reply = await client.read()
    assert reply["ok"] is True
    assert reply.get("id") is None


async def test_replies_match_requests_by_id(server, client):
    """Slow and fast requests interleaved: every reply carries its request's id."""
    async with connected(server) as producer:
        requests = {
            "poll": {"op": "lease", "queues": ["m"], "worker_id": W, "wait_ms": 5_000},
            "ping": {"op": "ping"},
            7: {"op": "stats"},
            "sub": {"op": "submit", "queue": "other", "payload": 1},
            8: {"op": "frobnicate"},
        }
        await client.send_raw(
            b"".join(orjson.dumps({**body, "id": rid}) + b"\n" for rid, body in requests.items())
        )
        replies: dict[Any, dict[str, Any]] = {}
        for _ in range(4):
            reply = await client.read()
            replies[reply["id"]] = reply
        assert set(replies) == {"ping", 7, "sub", 8}  # the long-poll is still parked
        job_id = await submit(producer, "m", "late")
        reply = await client.read()
        replies[reply["id"]] = reply
    assert replies["poll"]["jobs"][0]["job_id"] == job_id
    assert replies["ping"] == {"id": "ping", "ok": True}
    assert "queues" in replies[7]
    assert replies["sub"]["state"] == "ready"
    assert replies[8]["error"]["code"] == "unknown_op"


# -- pipelining and backpressure ------------------------------------------------------------


async def pipeline_submits(client: LineClient, n: int, queue: str = "pipe") -> None:
    data = b"".join(
        orjson.dumps({"op": "submit", "id": f"r{i}", "queue": queue, "payload": {"i": i}}) + b"\n"
        for i in range(n)
    )
    await client.send_raw(data)


async def read_replies(client: LineClient, n: int) -> dict[Any, dict[str, Any]]:
    replies: dict[Any, dict[str, Any]] = {}
    for _ in range(n):
        reply = await client.read()
        assert reply["id"] not in replies, f"answered twice: {reply['id']}"
        replies[reply["id"]] = reply
    return replies


async def test_pipelining_200_submits(client):
    await pipeline_submits(client, 200)
    replies = await read_replies(client, 200)
    assert set(replies) == {f"r{i}" for i in range(200)}
    assert all(r["ok"] is True and r["state"] == "ready" for r in replies.values())
    assert len({r["job_id"] for r in replies.values()}) == 200
    # Nothing else is owed: the next request's reply is the next line.
    request_id = await client.send("ping")
    assert await client.read() == {"id": request_id, "ok": True}
    assert (await queue_stats(client, "pipe"))["ready"] == 200


async def test_backpressure_does_not_drop(tmp_path):
    async with (
        custom_server(tmp_path, limits=wire.Limits(max_in_flight=4)) as srv,
        connected(srv) as c,
    ):
        await pipeline_submits(c, 100)
        replies = await read_replies(c, 100)
        assert set(replies) == {f"r{i}" for i in range(100)}
        assert all(r["ok"] is True for r in replies.values())
        assert (await queue_stats(c, "pipe"))["ready"] == 100


async def test_backpressure_stops_reading_at_max_in_flight(tmp_path):
    """Four parked long-polls fill max_in_flight=4: a following ping is not read (so not
    answered) until one of them is answered."""
    async with (
        custom_server(tmp_path, limits=wire.Limits(max_in_flight=4)) as srv,
        connected(srv) as c,
        connected(srv) as producer,
    ):
        polls = b"".join(
            orjson.dumps(
                {
                    "op": "lease",
                    "id": f"p{i}",
                    "queues": ["bp"],
                    "worker_id": W,
                    "wait_ms": 10_000,
                }
            )
            + b"\n"
            for i in range(4)
        )
        await c.send_raw(polls + b'{"op":"ping","id":"after"}\n')
        with trio.move_on_after(0.3):
            early = await c.read_line()
            pytest.fail(f"a reply while max_in_flight requests were parked: {early!r}")
        await submit(producer, "bp", "free a slot")
        first = await c.read()
        assert first["id"] in {f"p{i}" for i in range(4)}
        assert len(first["jobs"]) == 1
        second = await c.read()
        assert second == {"id": "after", "ok": True}


# -- hostile clients ------------------------------------------------------------------------


async def well_behaved_round(c: LineClient, queue: str) -> None:
    """One full, checked job cycle on a well-behaved connection."""
    await c.ok("ping")
    job_id = await submit(c, queue, {"ok": True})
    job = await lease_one(c, queue)
    assert job["job_id"] == job_id and job["payload"] == {"ok": True}
    reply = await c.ok("ack", job_id=job_id, worker_id=W, token=job["token"])
    assert reply["state"] == "succeeded"


async def test_random_bytes_do_not_disturb_others(server):
    async with connected(server) as hostile, connected(server) as good:
        noise = os.urandom(64 * 1024).replace(b"\n", b"\x00")
        for start in range(0, len(noise), 8192):
            await hostile.send_raw(noise[start : start + 8192])
            await well_behaved_round(good, "good")
        await hostile.send_raw(b"\n")
        reply = await hostile.read()
        assert_error(reply, "bad_request")
        await hostile.ok("ping")  # still open
        await well_behaved_round(good, "good")
        assert (await queue_stats(good, "good"))["succeeded"] == 9


async def test_stalled_half_line_is_closed_by_idle_timeout(tmp_path):
    async with (
        custom_server(tmp_path, idle_timeout_ms=300) as srv,
        connected(srv) as hostile,
        connected(srv) as good,
    ):
        await hostile.send_raw(b'{"op":"ping","id":1')
        started = trio.current_time()
        closed_after: list[float] = []

        async def watch_hostile() -> None:
            assert await hostile.at_eof()
            closed_after.append(trio.current_time() - started)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_hostile)
                # Keep the good client busy (and so not idle) until the stall is closed.
                rounds = 0
                while not closed_after:
                    await well_behaved_round(good, "good")
                    rounds += 1
                    await trio.sleep(0.05)
        assert rounds >= 1
        assert 0.2 <= closed_after[0] <= 3, closed_after
        await well_behaved_round(good, "good")


async def test_huge_frame_does_not_disturb_others(tmp_path):
    async with (
        custom_server(tmp_path, limits=wire.Limits(max_frame_bytes=4096)) as srv,
        connected(srv) as hostile,
        connected(srv) as good,
    ):
        await well_behaved_round(good, "good")

        async def flood() -> None:
            # The server stops reading and closes mid-way; the rest may not be sendable.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                for _ in range(64):
                    await hostile.send_raw(b"a" * 16384)
                    await trio.lowlevel.checkpoint()

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(flood)
                for _ in range(5):
                    await well_behaved_round(good, "good")
                lines = await read_until_eof(hostile)
        # One frame_too_large line (if the peer's reset did not eat it), then closed.
        assert len(lines) <= 1, lines
        if lines:
            assert_error(orjson.loads(lines[0]), "frame_too_large")
        await well_behaved_round(good, "good")
        assert (await queue_stats(good, "good"))["succeeded"] == 7


async def test_huge_frame_on_default_limits_gets_frame_too_large(server, client):
    """Just over the 1 MiB default: one frame_too_large line, then the connection closes."""
    async with connected(server) as good:
        line = b'{"op":"ping","pad":"' + b"p" * (1024 * 1024) + b'"}\n'
        with contextlib.suppress(trio.BrokenResourceError):
            await client.send_raw(line)
        lines = await read_until_eof(client)
        assert len(lines) == 1, lines
        assert_error(orjson.loads(lines[0]), "frame_too_large")
        await well_behaved_round(good, "good")


# -- ack_batch (an extension) ---------------------------------------------------------------


def ack_batch_codes(reply: dict[str, Any]) -> list[str]:
    """Per ack, in order: "succeeded" or its error code; checks the shape of each result."""
    assert reply["ok"] is True and set(reply) == {"id", "ok", "results"}, reply
    codes = []
    for result in reply["results"]:
        if result["ok"] is True:
            assert result == {"ok": True, "state": "succeeded"}, result
            codes.append("succeeded")
        else:
            assert result["ok"] is False and set(result) == {"ok", "error"}, result
            assert set(result["error"]) == {"code", "message"}, result
            assert isinstance(result["error"]["message"], str) and result["error"]["message"]
            codes.append(result["error"]["code"])
    return codes


def ack_of(job: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"job_id": job["job_id"], "token": job["token"], **fields}


async def test_ack_batch_answers_each_ack_in_order_and_commits_the_accepted(client):
    ids = [await submit(client, "ab", {"i": i}) for i in range(4)]
    leased = (await client.ok("lease", queues=["ab"], worker_id=W, count=3))["jobs"]
    assert [job["job_id"] for job in leased] == ids[:3]
    held, refused, acked = leased
    await client.ok("ack", **ack_of(acked), worker_id=W, result="once")
    reply = await client.ok(
        "ack_batch",
        worker_id=W,
        acks=[
            ack_of(held, result={"n": 0}),
            {"job_id": refused["job_id"], "token": "f" * len(refused["token"])},
            ack_of(acked, result="twice"),  # a repeated ack with the completing token
            {"job_id": "job_00000000deadbeef", "token": held["token"]},
            {"job_id": "nope", "token": held["token"]},
            {"job_id": ids[3], "token": held["token"]},  # ready, never leased
        ],
    )
    assert ack_batch_codes(reply) == [
        "succeeded", "stale_token", "succeeded", "not_found", "not_found", "stale_token",
    ]  # fmt: skip
    info = await inspect(client, held["job_id"])
    assert (info["state"], info["result"]) == ("succeeded", {"n": 0})
    assert isinstance(info["finished_at"], int) and "lease_expires_at" not in info
    assert (await inspect(client, acked["job_id"]))["result"] == "once"
    still = await inspect(client, refused["job_id"])
    assert (still["state"], still["attempt"]) == ("leased", 1)
    assert still["lease_expires_at"] == refused["lease_expires_at"]
    assert (await inspect(client, ids[3]))["state"] == "ready"
    counts = {**dict.fromkeys(STATES, 0), "ready": 1, "leased": 1, "succeeded": 2}
    assert await queue_stats(client, "ab") == counts
    # Another worker's batch cannot ack the refused job either; its holder's can.
    other = await client.ok("ack_batch", worker_id="someone-else", acks=[ack_of(refused)])
    assert ack_batch_codes(other) == ["stale_token"]
    mine = await client.ok("ack_batch", worker_id=W, acks=[ack_of(refused)])
    assert ack_batch_codes(mine) == ["succeeded"]
    counts = {**dict.fromkeys(STATES, 0), "ready": 1, "succeeded": 3}
    assert await queue_stats(client, "ab") == counts


async def test_ack_batch_answers_lease_expired_for_that_ack_only(client):
    expired_id = await submit(client, "abx", 1, retries=3)
    kept_id = await submit(client, "aby", 2)
    expired = await lease_one(client, "abx", lease_ms=1)
    kept = await lease_one(client, "aby")
    # Wait until the reaper has put the job back (the contract: within about 100 ms).
    with trio.fail_after(5):
        # Polls state the server exposes only through requests.
        while (await inspect(client, expired_id))["state"] != "ready":  # noqa: ASYNC110
            await trio.sleep(0.02)
    reply = await client.ok("ack_batch", worker_id=W, acks=[ack_of(expired), ack_of(kept)])
    assert ack_batch_codes(reply) == ["lease_expired", "succeeded"]
    assert (await inspect(client, kept_id))["state"] == "succeeded"
    info = await inspect(client, expired_id)
    assert (info["state"], info["last_error"]) == ("ready", "lease expired")
    assert (await queue_stats(client, "abx"))["succeeded"] == 0


async def test_ack_batch_with_a_job_twice_runs_its_first_ack_and_refuses_the_repeats(client):
    await submit(client, "ab2", 1)
    await submit(client, "ab2", 2)
    await submit(client, "ab2", 3)
    first = await lease_one(client, "ab2")
    second = await lease_one(client, "ab2")
    third = await lease_one(client, "ab2")
    wrong = {"job_id": second["job_id"], "token": "f" * len(second["token"])}
    acks = [
        ack_of(first, result=1), ack_of(first, result=2), wrong, ack_of(second, result=3),
        ack_of(third, result=4),
    ]  # fmt: skip
    reply = await client.ok("ack_batch", worker_id=W, acks=acks)
    assert ack_batch_codes(reply) == [
        "succeeded", "bad_request", "stale_token", "bad_request", "succeeded",
    ]  # fmt: skip
    assert reply["results"][1]["error"]["message"].startswith("acks[1].job_id: acked by acks[0]")
    assert (await inspect(client, first["job_id"]))["result"] == 1
    assert (await inspect(client, second["job_id"]))["state"] == "leased"
    assert (await inspect(client, third["job_id"]))["result"] == 4
    counts = await queue_stats(client, "ab2")
    assert (counts["succeeded"], counts["leased"]) == (2, 1)
    # Sent again alone, the refused repeat is an ack as any other.
    again = await client.ok("ack_batch", worker_id=W, acks=[ack_of(second, result=3)])
    assert ack_batch_codes(again) == ["succeeded"]


BAD_ACK_BATCHES: list[tuple[Any, str]] = [
    # (the request's fields, given one good ack; the field the error must name)
    (lambda good: {"worker_id": W, "acks": []}, "acks"),
    (lambda good: {"worker_id": W}, "acks"),
    (lambda good: {"worker_id": W, "acks": good}, "acks"),
    (lambda good: {"acks": [good]}, "worker_id"),
    (lambda good: {"worker_id": "", "acks": [good]}, "worker_id"),
    (lambda good: {"worker_id": W, "acks": [good, "ack"]}, "acks[1]"),
    (lambda good: {"worker_id": W, "acks": [good, {"job_id": good["job_id"]}]}, "acks[1].token"),
    (lambda good: {"worker_id": W, "acks": [good, {"token": good["token"]}]}, "acks[1].job_id"),
    (lambda good: {"worker_id": W, "acks": [good, {**good, "token": 5}]}, "acks[1].token"),
    (lambda good: {"worker_id": W, "acks": [good, {**good, "job_id": ""}]}, "acks[1].job_id"),
    (
        lambda good: {
            "worker_id": W,
            "acks": [good, {**good, "result": "x" * wire.Limits().max_result_bytes}],
        },
        "acks[1].result",
    ),
]


@pytest.mark.parametrize(
    ("fields", "field"),
    BAD_ACK_BATCHES,
    ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_ACK_BATCHES)],
)
async def test_malformed_ack_batch_is_bad_request_naming_the_field_and_changes_nothing(
    client, fields, field
):
    job_id = await submit(client, "abb")
    job = await lease_one(client, "abb")
    request_id = await client.send("ack_batch", **fields(ack_of(job)))
    error = assert_error(await client.read(), "bad_request", request_id)
    assert error["message"].startswith(field + ": "), error
    info = await inspect(client, job_id)
    assert (info["state"], info["lease_expires_at"]) == ("leased", job["lease_expires_at"])
    assert "result" not in info
    # The connection is still usable, and the good ack alone goes through.
    reply = await client.ok("ack_batch", worker_id=W, acks=[ack_of(job)])
    assert ack_batch_codes(reply) == ["succeeded"]


async def test_ack_batch_holds_at_most_max_batch_acks(tmp_path):
    async with custom_server(tmp_path, limits=wire.Limits(max_batch=3)) as srv, connected(srv) as c:
        for i in range(3):
            await submit(c, "abm", i)
        jobs = (await c.ok("lease", queues=["abm"], worker_id=W, count=3))["jobs"]
        acks = [ack_of(job) for job in jobs]
        error = await c.error("ack_batch", worker_id=W, acks=[*acks, acks[0]])
        assert error["code"] == "bad_request" and error["message"].startswith("acks: ")
        assert (await queue_stats(c, "abm"))["leased"] == 3
        reply = await c.ok("ack_batch", worker_id=W, acks=acks)
        assert ack_batch_codes(reply) == ["succeeded"] * 3
        counts = await queue_stats(c, "abm")
        assert (counts["succeeded"], counts["leased"]) == (3, 0)


# -- the job browser and its actions (extensions) ---------------------------------------------


async def test_jobs_list_pages_summaries_newest_first_through_the_wire(client):
    ids = [(await client.ok("submit", queue="jl", payload={"n": i}))["job_id"] for i in range(5)]
    first = await client.ok("jobs_list", queue="jl", limit=2)
    assert [j["job_id"] for j in first["jobs"]] == [ids[4], ids[3]]
    assert first["next_cursor"] == ids[3]
    item = first["jobs"][0]
    assert "payload" not in item and "errors" not in item and "result" not in item
    assert (item["state"], item["priority"], item["attempt"]) == ("ready", "normal", 0)
    rest = await client.ok("jobs_list", queue="jl", cursor=first["next_cursor"], limit=10)
    assert [j["job_id"] for j in rest["jobs"]] == [ids[2], ids[1], ids[0]]
    assert rest["next_cursor"] is None
    oldest = await client.ok("jobs_list", queue="jl", order="oldest", states=["ready"])
    assert [j["job_id"] for j in oldest["jobs"]] == ids
    assert (await client.ok("jobs_list", states=["dead"]))["jobs"] == []
    found = await client.ok("jobs_list", search=ids[2])
    assert [j["job_id"] for j in found["jobs"]] == [ids[2]]


async def test_retry_and_purge_of_one_job_take_the_states_the_bulk_forms_take(client):
    cancelled = await submit(client, "one", {"n": 1})
    assert (await client.ok("cancel", job_id=cancelled))["state"] == "cancelled"
    done = await submit(client, "one", {"n": 2})
    job = await lease_one(client, "one")
    await client.ok("ack", worker_id=W, job_id=job["job_id"], token=job["token"], result=1)
    # By default, as before: a dead job only, and the refusal says what to do.
    error = await client.error("dead_retry", job_id=cancelled)
    assert error["code"] == "invalid_state", error
    assert error["message"] == (
        f'cannot retry {cancelled}: it is cancelled (name "cancelled" in states to retry it)'
    )
    error = await client.error("dead_retry", job_id=done, states=["dead", "cancelled"])
    assert error["code"] == "invalid_state", error
    assert "submit it again" in error["message"], error
    error = await client.error("dead_purge", job_id=done)
    assert error["code"] == "invalid_state" and '"succeeded" in states' in error["message"]
    # With states: a cancelled job retried, a succeeded one purged, by id.
    reply = await client.ok("dead_retry", job_id=cancelled, states=["dead", "cancelled"])
    assert reply["count"] == 1
    assert (await inspect(client, cancelled))["state"] == "ready"
    error = await client.error("dead_purge", job_id=cancelled, states=PURGE_STATES)
    assert error["code"] == "invalid_state", error
    assert "cancel it first" in error["message"], error
    reply = await client.ok("dead_purge", job_id=done, states=["succeeded"])
    assert reply["count"] == 1
    assert (await client.error("inspect", job_id=done))["code"] == "not_found"
    counts = await queue_stats(client, "one")
    assert (counts["succeeded"], counts["ready"], counts["cancelled"]) == (0, 1, 0)
    # A state outside the allowed set is the request's fault, as in the bulk form.
    error = await client.error("dead_retry", job_id=cancelled, states=["succeeded"])
    assert error["code"] == "bad_request" and error["message"].startswith("states[0]: ")


PURGE_STATES = ["dead", "succeeded", "cancelled"]


@pytest.mark.parametrize("by_id", [True, False], ids=["by-id", "bulk"])
async def test_a_purged_job_keeps_its_idempotency_key_until_the_key_expires(client, by_id):
    first = await submit(client, "ik", {"n": 1}, idempotency_key="K")
    job = await lease_one(client, "ik")
    await client.ok("ack", worker_id=W, job_id=first, token=job["token"])
    if by_id:
        purged = await client.ok("dead_purge", job_id=first, states=["succeeded"])
    else:
        purged = await client.ok("dead_purge", queue="ik", all=True, states=["succeeded"])
    assert purged["count"] == 1
    assert (await client.error("inspect", job_id=first))["code"] == "not_found"
    # The same key within its window: the purged job, not a second run of it.
    again = await client.ok("submit", queue="ik", payload={"n": 1}, idempotency_key="K")
    assert (again["job_id"], again["state"], again["duplicate"]) == (first, "succeeded", True)
    assert (await queue_stats(client, "ik"))["ready"] == 0
    assert (await client.ok("lease", queues=["ik"], worker_id=W))["jobs"] == []


async def test_promote_and_bulk_retry_and_purge_through_the_wire(client):
    late = (await client.ok("submit", queue="pq", payload={}, delay_ms=3_600_000))["job_id"]
    promoted = await client.ok("promote", job_id=late)
    assert (promoted["job_id"], promoted["state"], promoted["was"]) == (late, "ready", "pending")
    assert (await client.ok("inspect", job_id=late))["job"]["state"] == "ready"
    reply = await client.error("promote", job_id=late)
    assert (
        reply["code"] == "invalid_state"
        and f"cannot promote {late}: it is ready" in reply["message"]
    )
    assert (await client.error("promote", job_id="job_0000000000000001"))["code"] == "not_found"
    others = [(await client.ok("submit", queue="pq", payload={}))["job_id"] for _ in range(3)]
    assert (await client.ok("cancel", queue="pq", all=True))["cancelled"] == 4
    retried = await client.ok("dead_retry", queue="pq", all=True, states=["cancelled"])
    assert retried["count"] == 4
    assert (await client.ok("cancel", queue="pq", all=True))["cancelled"] == 4
    purged = await client.ok("dead_purge", queue="pq", all=True, states=["dead", "cancelled"])
    assert purged["count"] == 4
    for job in [late, *others]:
        assert (await client.error("inspect", job_id=job))["code"] == "not_found"
