"""A job's attempt history through the server: ``inspect`` gives ``attempts`` (each with
its start, end, worker, outcome, error and traceback) and ``attempts_dropped``, after a
fail, a lease expiry, an execution timeout, a release and a success; ``dead_list`` gives
no attempts (its pages stay as they were).

Real time is the behaviour under test here (leases expire, the reaper runs): the waits
poll what the server answers, each bounded.
"""

from __future__ import annotations

from typing import Any

import trio

from relay.protocol.model import TIMEOUT_GRACE_MS
from tests.server.test_protocol import TRACEBACK, inspect, now_ms, submit

W1, W2, W3, W4, W5 = (f"worker-{n}" for n in range(1, 6))


async def lease(client, worker: str, **fields: Any) -> dict[str, Any]:
    reply = await client.ok("lease", queues=["q"], worker_id=worker, wait_ms=5_000, **fields)
    (job,) = reply["jobs"]
    return job


async def until_state(client, job_id: str, state: str, bound_s: float) -> dict[str, Any]:
    with trio.fail_after(bound_s):
        # Polls state the server exposes only through requests.
        while (info := await inspect(client, job_id))["state"] != state:  # noqa: ASYNC110
            await trio.sleep(0.02)
    return info


async def test_inspect_gives_every_attempt_after_fail_expiry_timeout_release_and_ack(client):
    backoff = {"kind": "fixed", "delay_ms": 1}
    job_id = await submit(client, "q", 1, retries=9, backoff=backoff, timeout_ms=1)
    before = now_ms()

    job = await lease(client, W1)
    ref = {"job_id": job_id, "token": job["token"]}
    await client.ok("fail", **ref, worker_id=W1, error="ValueError: 7", traceback=TRACEBACK)
    # Its lease expires (1 ms, before the timeout's deadline), and the reaper takes it back.
    await lease(client, W2, lease_ms=1)
    await until_state(client, job_id, "ready", 5)
    # Its lease lasts past the attempt's deadline: it times out (1 ms + the grace).
    await lease(client, W3, lease_ms=60_000)
    await until_state(client, job_id, "ready", 5 + TIMEOUT_GRACE_MS / 1000)
    job = await lease(client, W4)
    await client.ok("release", job_id=job_id, worker_id=W4, token=job["token"])
    job = await lease(client, W5)
    running = await inspect(client, job_id)
    assert running["attempts"][-1] == {
        "attempt": 4,
        "outcome": "running",
        "started_at": running["attempts"][-1]["started_at"],
        "worker_id": W5,
    }
    await client.ok("ack", job_id=job_id, worker_id=W5, token=job["token"])
    info = await inspect(client, job_id)
    after = now_ms()

    attempts = info["attempts"]
    assert [(a["attempt"], a["outcome"], a["worker_id"]) for a in attempts] == [
        (1, "failed", W1),
        (2, "expired", W2),
        (3, "timed_out", W3),
        (4, "released", W4),
        (4, "succeeded", W5),
    ]
    assert attempts[0]["error"] == "ValueError: 7" and attempts[0]["traceback"] == TRACEBACK
    assert attempts[1]["error"] == "lease expired" and "traceback" not in attempts[1]
    assert attempts[2]["error"] == "timed out after 1 ms"
    assert "error" not in attempts[3] and "error" not in attempts[4]
    times = [t for a in attempts for t in (a["started_at"], a["ended_at"])]
    assert times == sorted(times) and before <= times[0] and times[-1] <= after
    assert attempts[4]["ended_at"] == info["finished_at"]
    # A timed-out attempt ends at its deadline at the earliest.
    assert attempts[2]["ended_at"] - attempts[2]["started_at"] >= 1 + TIMEOUT_GRACE_MS
    assert info["attempts_dropped"] == 0
    # ``errors`` stays as it was: the three erring attempts.
    assert [e["error"] for e in info["errors"]] == [
        "ValueError: 7",
        "lease expired",
        "timed out after 1 ms",
    ]


async def test_a_job_never_leased_has_no_attempts_and_dead_list_gives_none(client):
    job_id = await submit(client, "q", 1, retries=0)
    info = await inspect(client, job_id)
    assert (info["attempts"], info["attempts_dropped"]) == ([], 0)
    job = await lease(client, W1)
    await client.ok("fail", job_id=job_id, worker_id=W1, token=job["token"], error="boom")
    info = await inspect(client, job_id)
    assert [a["outcome"] for a in info["attempts"]] == ["failed"]
    [dead] = (await client.ok("dead_list", queue="q"))["jobs"]
    assert "attempts" not in dead and dead["errors"] == info["errors"]


async def test_a_job_failed_past_the_bound_keeps_the_last_32_and_says_how_many_went(client):
    job_id = await submit(client, "q", 1, retries=39, backoff={"kind": "fixed", "delay_ms": 1})
    for n in range(40):
        job = await lease(client, W1)
        error = f"failure {n}"
        await client.ok("fail", job_id=job_id, worker_id=W1, token=job["token"], error=error)
    info = await inspect(client, job_id)
    assert info["state"] == "dead"
    assert info["attempts_dropped"] == 8
    assert [a["attempt"] for a in info["attempts"]] == list(range(9, 41))
    assert [e["error"] for e in info["errors"]] == [f"failure {n}" for n in range(8, 40)]
