"""``cancel`` through the wire (docs/protocol.md, "cancel"): over TCP and WebSocket, on both
stores (the ``client`` and ``server`` fixtures of tests/server/test_protocol.py), with the
roles of a server with tokens, and what watchers and /metrics see of it."""

from __future__ import annotations

import pytest

from tests.server.conftest import RunningServer
from tests.server.requests.test_auth import ADMIN, PRODUCER, WORKER, authed, authenticate, tokens
from tests.server.requests.test_watch import next_event, start_watch
from tests.server.test_lifecycle import scrape
from tests.server.test_protocol import W, client, inspect, lease_one, queue_stats, server, submit

__all__ = ["authed", "client", "server", "tokens"]  # (fixtures)


def holder(job: dict) -> dict:
    return {"job_id": job["job_id"], "worker_id": W, "token": job["token"]}


async def test_cancel_of_a_ready_job_answers_the_state_it_was_in(client):
    job_id = await submit(client, "c", payload=1)
    reply = await client.ok("cancel", job_id=job_id)
    assert {k: reply[k] for k in ("job_id", "state", "was")} == {
        "job_id": job_id, "state": "cancelled", "was": "ready",
    }  # fmt: skip
    job = await inspect(client, job_id)
    assert job["state"] == "cancelled" and job["finished_at"] >= job["created_at"]
    assert (await queue_stats(client, "c"))["cancelled"] == 1
    assert (await client.ok("lease", queues=["c"], worker_id=W))["jobs"] == []


async def test_a_delayed_job_cancelled_is_never_promoted(client):
    job_id = await submit(client, "c", payload=1, run_at=1)  # due at once: promoted soon
    far = await submit(client, "c", payload=2, delay_ms=3_600_000)
    assert (await client.ok("cancel", job_id=far))["was"] == "pending"
    # The first job's promotion shows the promoter has passed since the cancel.
    (job,) = (await client.ok("lease", queues=["c"], worker_id=W, wait_ms=5_000))["jobs"]
    assert job["job_id"] == job_id
    assert (await inspect(client, far))["state"] == "cancelled"


async def test_a_cancelled_lease_is_refused_cancelled_and_the_job_stays_cancelled(client):
    job_id = await submit(client, "c", payload=1)
    job = await lease_one(client, "c", lease_ms=60_000)
    assert (await client.ok("cancel", job_id=job_id))["was"] == "leased"
    for op, extra in (("renew", {}), ("ack", {"result": 1}), ("fail", {"error": "x"})):
        error = await client.error(op, **holder(job), **extra)
        assert error["code"] == "cancelled" and job_id in error["message"], (op, error)
    reply = await client.ok("ack_batch", worker_id=W, acks=[{"job_id": job_id,
                                                             "token": job["token"]}])  # fmt: skip
    assert [item["error"]["code"] for item in reply["results"]] == ["cancelled"]
    stale = await client.error("ack", job_id=job_id, worker_id=W, token="0" * 32)
    assert stale["code"] == "stale_token"
    info = await inspect(client, job_id)
    assert info["state"] == "cancelled" and "result" not in info and info["errors"] == []
    counts = await queue_stats(client, "c")
    assert (counts["cancelled"], counts["leased"], counts["succeeded"]) == (1, 0, 0)


@pytest.mark.parametrize("finished", ["succeeded", "dead", "cancelled"])
async def test_cancelling_a_finished_job_is_invalid_state_naming_it(client, finished):
    job_id = await submit(client, "c", payload=1, retries=0)
    if finished == "cancelled":
        await client.ok("cancel", job_id=job_id)
    else:
        job = await lease_one(client, "c")
        if finished == "succeeded":
            await client.ok("ack", **holder(job))
        else:
            await client.ok("fail", **holder(job), error="no")
    error = await client.error("cancel", job_id=job_id)
    assert error["code"] == "invalid_state"
    assert error["message"] == f"cannot cancel {job_id}: it is {finished}"
    assert (await inspect(client, job_id))["state"] == finished


async def test_cancelling_an_unknown_job_is_not_found(client):
    error = await client.error("cancel", job_id="job_0000000000000001")
    assert error["code"] == "not_found"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({}, "job_id"),
        ({"queue": "q"}, "all"),
        ({"queue": "q", "all": False}, "all"),
        ({"job_id": "job_0000000000000001", "queue": "q", "all": True}, "job_id"),
        ({"queue": "q", "all": True, "states": []}, "states"),
        ({"queue": "q", "all": True, "states": ["dead"]}, "states[0]"),
        ({"queue": "q", "all": True, "states": ["ready", "cancelled"]}, "states[1]"),
        ({"queue": "no spaces", "all": True}, "queue"),
    ],
)
async def test_a_malformed_cancel_is_a_bad_request_naming_its_field(client, fields, field):
    error = await client.error("cancel", **fields)
    assert error["code"] == "bad_request" and field in error["message"], error


async def test_cancel_of_a_whole_queue_takes_the_unstarted_jobs_unless_told(client):
    leased_id = await submit(client, "cq", payload=0)
    leased = await lease_one(client, "cq", lease_ms=60_000)
    unstarted = [await submit(client, "cq", payload=i) for i in range(3)]
    unstarted.append(await submit(client, "cq", payload=9, delay_ms=3_600_000))
    other = await submit(client, "other", payload=1)
    assert (await client.ok("cancel", queue="cq", all=True))["cancelled"] == 4
    assert [(await inspect(client, j))["state"] for j in unstarted] == ["cancelled"] * 4
    assert (await inspect(client, leased_id))["state"] == "leased"
    assert (await inspect(client, other))["state"] == "ready"
    reply = await client.ok("cancel", queue="cq", all=True, states=["leased"])
    assert reply["cancelled"] == 1
    assert (await client.error("ack", **holder(leased)))["code"] == "cancelled"
    assert (await client.ok("cancel", queue="cq", all=True))["cancelled"] == 0
    assert (await queue_stats(client, "cq"))["cancelled"] == 5


async def test_a_watcher_sees_a_cancel_with_the_state_it_left(server: RunningServer):
    watcher = await start_watch(server, states=["cancelled"])
    c = await server.connect()
    job_id = await submit(c, "w", payload=1)
    await c.ok("cancel", job_id=job_id)
    event = await next_event(watcher)
    assert (event["job_id"], event["state"], event["from"]) == (job_id, "cancelled", "ready")
    await watcher.aclose()
    await c.aclose()


async def test_metrics_count_cancelled_jobs_and_cancels(server: RunningServer, client):
    for _ in range(2):
        await client.ok("cancel", job_id=await submit(client, "mc", payload=1))
    _text, samples = await scrape(server)
    assert samples['relay_queue_jobs{queue="mc",state="cancelled"}'] == 2
    assert samples['relay_jobs_cancelled_total{queue="mc"}'] == 2


# -- roles ---------------------------------------------------------------------------------


async def test_a_producer_cancels_a_job_that_has_not_started_only(authed: RunningServer):
    producer = await authenticate(authed, PRODUCER)
    worker = await authenticate(authed, WORKER)
    admin = await authenticate(authed, ADMIN)
    waiting = await submit(producer, "r", payload=1)
    running = await submit(producer, "r", payload=2)
    await producer.ok("cancel", job_id=waiting)
    (job,) = (await worker.ok("lease", queues=["r"], worker_id=W, lease_ms=60_000))["jobs"]
    assert job["job_id"] == running
    error = await producer.error("cancel", job_id=running)
    assert error["code"] == "unauthorized" and "admin" in error["message"], error
    error = await producer.error("cancel", queue="r", all=True)
    assert error["code"] == "unauthorized" and "admin" in error["message"], error
    assert (await inspect(admin, running))["state"] == "leased"  # the refusals changed nothing
    await worker.ok("renew", **holder(job))
    assert (await admin.ok("cancel", job_id=running))["was"] == "leased"
    assert (await worker.error("ack", **holder(job)))["code"] == "cancelled"
    for c in (producer, worker, admin):
        await c.aclose()
