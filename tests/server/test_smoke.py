from __future__ import annotations


async def test_submit_lease_ack_round_trip(client):
    submitted = await client.ok("submit", queue="q", payload={"n": 1})
    leased = await client.ok("lease", queues=["q"], worker_id="w")
    (job,) = leased["jobs"]
    assert job["job_id"] == submitted["job_id"] and job["payload"] == {"n": 1}
    acked = await client.ok("ack", job_id=job["job_id"], worker_id="w", token=job["token"])
    assert acked["state"] == "succeeded"
