"""``Client.cancel`` and ``Client.cancel_queue``, async and blocking, against a real server:
typed results, and ``relay.Cancelled`` for the token of a cancelled lease."""

from __future__ import annotations

import pytest

import relay
from relay import Cancelled, InvalidState, JobState, StaleToken, connect
from tests.client.test_blocking import call
from tests.client.test_client import client, lease_one

__all__ = ["client"]  # (a fixture)


async def test_cancel_answers_the_state_the_job_was_in(client):
    running = (await client.submit("cc", 1)).job_id
    job = await lease_one(client, "cc")
    assert job.job_id == running
    waiting = (await client.submit("cc", 2)).job_id
    assert await client.cancel(waiting) == JobState.READY
    assert await client.cancel(running) == JobState.LEASED
    assert (await client.inspect(running)).state == JobState.CANCELLED
    with pytest.raises(InvalidState, match="it is cancelled"):
        await client.cancel(running)


@pytest.mark.parametrize("op", ["renew", "ack", "fail"])
async def test_the_worker_of_a_cancelled_lease_gets_relay_cancelled(client, op):
    job_id = (await client.submit("cw", 1)).job_id
    job = await lease_one(client, "cw")
    await client.cancel(job_id)
    calls = {
        "renew": lambda: client.renew(job_id, "w", job.token),
        "ack": lambda: client.ack(job_id, "w", job.token, {"done": True}),
        "fail": lambda: client.fail(job_id, "w", job.token, "boom"),
    }
    with pytest.raises(relay.Cancelled) as exc:
        await calls[op]()
    assert exc.value.code == "cancelled" and job_id in str(exc.value)
    assert not isinstance(exc.value, StaleToken)
    (outcome,) = await client.ack_batch("w", [(job_id, job.token)])
    assert isinstance(outcome, Cancelled)
    assert (await client.inspect(job_id)).state == JobState.CANCELLED


async def test_cancel_queue_cancels_the_unstarted_jobs_or_the_states_given(client):
    for i in range(3):
        await client.submit("cq", i)
    await client.submit("cq", 9, delay_ms=3_600_000)
    job = await lease_one(client, "cq")
    assert await client.cancel_queue("cq") == 3  # two ready, one pending
    assert await client.cancel_queue("cq", states=["leased"]) == 1
    assert await client.cancel_queue("cq", states=["pending", "ready", "retrying", "leased"]) == 0
    assert (await client.stats(queues=["cq"])).queues["cq"]["cancelled"] == 4
    with pytest.raises(Cancelled):
        await client.ack(job.job_id, "w", job.token)


async def test_the_blocking_client_cancels_too(server, client):
    job_id = (await client.submit("bc", 1)).job_id
    await client.submit("bc", 2)
    with connect(server.address, timeout=5) as bclient:
        assert await call(bclient.cancel, job_id) == JobState.READY
        assert await call(bclient.cancel_queue, "bc", states=["ready"]) == 1
        with pytest.raises(InvalidState):
            await call(bclient.cancel, job_id)
    assert (await client.stats(queues=["bc"])).queues["bc"]["cancelled"] == 2
