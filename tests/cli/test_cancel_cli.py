"""``relay-trio cancel``: one job (whole or abbreviated id), a whole queue, and its errors:
each one line, through the command line against a real server."""

from __future__ import annotations

import trio

from relay import JobState

from .conftest import assert_one_line_error, relay_trio

WORKER = "test-worker"


async def test_cancel_one_job_by_its_id_or_its_start(address, client):
    first = (await client.submit("c", 1)).job_id
    done = await relay_trio("cancel", first, address=address)
    assert done.code == 0 and done.stdout == f"cancelled {first} (it was ready)\n", done
    assert (await client.inspect(first)).state == JobState.CANCELLED
    second = (await client.submit("c", 2, delay_ms=3_600_000)).job_id
    as_json = await relay_trio("cancel", second[:-3], "--json", address=address)  # its start
    assert as_json.code == 0, as_json
    assert as_json.json() == {"job_id": second, "state": "cancelled", "was": "pending"}
    again = await relay_trio("cancel", first, address=address)
    assert_one_line_error(again, "invalid_state", f"cannot cancel {first}: it is cancelled")


async def test_cancel_a_whole_queue_in_the_states_given(address, client):
    for i in range(3):
        await client.submit("cq", i)
    (job,) = await client.lease(["cq"], WORKER)
    done = await relay_trio("cancel", "--queue", "cq", "--all", address=address)
    assert done.code == 0, done
    assert done.stdout == "cancelled 2 jobs of queue cq (pending, ready, retrying)\n"
    assert (await client.inspect(job.job_id)).state == JobState.LEASED
    leased = await relay_trio(
        "cancel", "--queue", "cq", "--all", "--state", "leased", "--json", address=address
    )
    assert leased.code == 0 and leased.json() == {"cancelled": 1}, leased
    assert (await client.stats(queues=["cq"])).queues["cq"]["cancelled"] == 3


async def test_cancel_refuses_what_it_cannot_do_in_one_line(address):
    results = {}

    async def run(name: str, *args: str) -> None:
        results[name] = await relay_trio(*args, address=address)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "nothing", "cancel")
        nursery.start_soon(run, "queue without all", "cancel", "--queue", "q")
        nursery.start_soon(run, "all without queue", "cancel", "--all")
        nursery.start_soon(run, "both", "cancel", "job_0000000000000001", "--queue", "q", "--all")
        nursery.start_soon(run, "bad state", "cancel", "--queue", "q", "--all", "--state", "dead")
        nursery.start_soon(run, "not an id", "cancel", "34472d0")
        nursery.start_soon(run, "unknown", "cancel", "job_0000000000000001")
    assert_one_line_error(results["nothing"], "give a JOB id", code=2)
    assert_one_line_error(results["queue without all"], "--all", code=2)
    assert_one_line_error(results["all without queue"], "--queue", code=2)
    assert_one_line_error(results["both"], "not both", code=2)
    assert_one_line_error(results["bad state"], "--state", "dead", code=2)
    assert_one_line_error(results["not an id"], "not a job id", code=2)
    assert_one_line_error(results["unknown"], "not_found", "job_0000000000000001")
