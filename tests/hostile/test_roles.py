"""A hello that lowers a connection's role (issue 25, item 11) ends what the higher role
started: its watch ends with an ``ended`` event, its parked long-polls are answered with
no jobs, and a whole-queue dead letter request stops. Through the wire, with tokens."""

from __future__ import annotations

from typing import Any

import orjson
import trio

from tests.server.conftest import BOUND_S, LineClient, RunningServer
from tests.server.requests.test_auth import ADMIN, PRODUCER, WORKER, authed, authenticate, tokens

__all__ = ["authed", "tokens"]  # (fixtures, from tests/server/requests/test_auth.py)


async def lines_until_reply(client: LineClient, *request_ids: int) -> list[dict[str, Any]]:
    """Every line the client gets up to and with the replies to ``request_ids``."""
    lines: list[dict[str, Any]] = []
    waiting = set(request_ids)
    while waiting:
        line = orjson.loads(await client.read_line() or b"null")
        assert line is not None, "connection closed"
        lines.append(line)
        if "ok" in line:
            waiting.discard(line.get("id"))
    return lines


async def test_a_worker_that_says_hello_as_producer_loses_its_watch_and_long_polls(authed):
    client = await authenticate(authed, WORKER)
    other = await authenticate(authed, ADMIN)
    await client.ok("watch", queues=["q"])
    parked = await client.send("lease", queues=["q"], worker_id="w", wait_ms=30_000)
    await client.ok("ping")  # (the lease is in; it finds nothing and parks)
    hello = await client.send("hello", token=PRODUCER)
    lines = await lines_until_reply(client, hello, parked)
    assert any(line.get("id") == hello and line["role"] == "producer" for line in lines)
    # The watch's end comes before the hello's reply, and no event after it.
    ended = lines.index({"event": "ended", "reason": "role"})
    assert ended < next(i for i, line in enumerate(lines) if line.get("id") == hello)
    assert not any("event" in line for line in lines[ended + 1 :])
    assert {"id": parked, "ok": True, "jobs": []} in lines
    # From then on: no event, no lease, and no job taken for it.
    job_id = (await other.ok("submit", queue="q", payload=2))["job_id"]
    ping = await client.send("ping")
    with trio.fail_after(BOUND_S):
        after = await lines_until_reply(client, ping)
    assert after == [{"id": ping, "ok": True}]
    assert (await other.ok("inspect", job_id=job_id))["job"]["state"] == "ready"
    assert (await client.error("watch"))["code"] == "unauthorized"
    await client.aclose()
    await other.aclose()


async def test_a_hello_as_worker_again_keeps_the_watch(authed):
    client = await authenticate(authed, ADMIN)
    await client.ok("watch", queues=["q"])
    assert (await client.ok("hello", token=WORKER))["role"] == "worker"
    await client.send("submit", queue="q", payload=1)
    lines = [await client.read(), await client.read()]
    assert any(line.get("event") == "job" for line in lines), lines
    await client.aclose()


async def test_an_admin_lowered_to_producer_stops_a_whole_queue_dead_retry(
    authed: RunningServer,
):
    admin = await authenticate(authed, ADMIN)
    job_id = (await admin.ok("submit", queue="dq", payload=1, retries=0))["job_id"]
    job = (await admin.ok("lease", queues=["dq"], worker_id="w"))["jobs"][0]
    await admin.ok("fail", job_id=job_id, worker_id="w", token=job["token"], error="x")
    # In one write: the queue's retry starts, and the role is lowered before it runs.
    retry, hello = 101, 102
    await admin.send_raw(
        orjson.dumps({"op": "dead_retry", "id": retry, "queue": "dq", "all": True})
        + b"\n"
        + orjson.dumps({"op": "hello", "id": hello, "token": PRODUCER})
        + b"\n"
    )
    lines = await lines_until_reply(admin, hello, retry)
    (reply,) = [line for line in lines if line.get("id") == retry]
    assert reply["ok"] is False and reply["error"]["code"] == "unauthorized", reply
    assert "stopped after 0 jobs" in reply["error"]["message"]
    assert (await admin.ok("inspect", job_id=job_id))["job"]["state"] == "dead"
    await admin.aclose()
