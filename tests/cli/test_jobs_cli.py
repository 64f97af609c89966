"""``relay-trio jobs``: list (pages, filters, search, the table at 80 and 120 columns),
retry and purge of a queue by state (the confirmation names the count), promote, and their
errors as one line: through the command line against a real server."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest
import trio

from relay import JobState, open_client
from tests import pg
from tests.server.conftest import start_server
from tests.worker.helpers import serving

from .conftest import address_of, assert_one_line_error, cli_env, relay_trio
from .test_commands import on_a_terminal


@pytest.fixture(params=["sqlite", "postgres"])
async def either_address(request, tmp_path) -> AsyncIterator[str]:
    """A server's address, on each store in turn."""
    db = str(tmp_path / "relay.db")
    if request.param == "postgres":
        db = pg.server_url(request.getfixturevalue("pg_url"), f"cli_{secrets.token_hex(4)}")
    async with serving(start_server, db) as running:
        yield address_of(running)


async def test_retry_a_cancelled_job_and_purge_a_succeeded_one_by_id(either_address):
    address = either_address
    async with open_client(address) as client:
        cancelled = (await client.submit("one", 1)).job_id
        await client.cancel(cancelled)
        done = (await client.submit("one", 2, idempotency_key="K")).job_id
        (lease,) = await client.lease(["one"], "w1")
        await client.ack(done, "w1", lease.token)
        ready = (await client.submit("one", 3)).job_id
        # A dead job's command names the one that takes the job.
        dead = await relay_trio("dead", "retry", cancelled, address=address)
        assert_one_line_error(
            dead, "invalid_state", f"cannot retry {cancelled}: it is cancelled",
            f"relay-trio jobs retry {cancelled}",
        )  # fmt: skip
        retried = await relay_trio("jobs", "retry", cancelled, address=address)
        assert retried.code == 0 and retried.stdout == f"retried {cancelled}\n", retried
        assert (await client.inspect(cancelled)).state == JobState.READY
        refused = await relay_trio("jobs", "retry", done, address=address)
        assert_one_line_error(refused, "invalid_state", "it is succeeded", "submit it again")
        refused = await relay_trio("jobs", "purge", ready, address=address)
        assert_one_line_error(refused, "invalid_state", "it is ready", "cancel it first")
        purged = await relay_trio("jobs", "purge", done, "--json", address=address)
        assert purged.code == 0 and purged.json() == {"count": 1, "job_id": done}, purged
        # Its idempotency key outlives it: the same submit is the purged job, not a new run.
        again = await client.submit("one", 2, idempotency_key="K")
        assert (again.job_id, again.duplicate) == (done, True)
        both = await relay_trio("jobs", "purge", done, "--queue", "one", address=address)
        assert_one_line_error(both, "JOB", "not both", code=2)


async def test_promote_of_a_dead_job_names_jobs_retry(address, client):
    job = (await client.submit("pd", 1, retries=0)).job_id
    (lease,) = await client.lease(["pd"], "w1")
    await client.fail(job, "w1", lease.token, "boom", retryable=False)
    refused = await relay_trio("jobs", "promote", job, address=address)
    assert_one_line_error(
        refused, "invalid_state", f"cannot promote {job}: it is dead",
        f"relay-trio jobs retry {job} makes it ready again",
    )  # fmt: skip


async def test_jobs_list_pages_newest_first_with_the_after_hint(address, client):
    ids = [(await client.submit("jl", i)).job_id for i in range(3)]
    late = (await client.submit("jl", 9, delay_ms=3_600_000)).job_id
    first = await relay_trio("jobs", "list", "--queue", "jl", "--limit", "2", address=address)
    assert first.code == 0, first
    assert "Jobs" in first.stdout and "pending" in first.stdout
    hint = first.stdout.splitlines()[-1]
    assert hint == f"next page (older): --after {ids[2]}", first.stdout
    rest = await relay_trio("jobs", "list", "--queue", "jl", "--after", ids[2], "--json",
                            address=address)  # fmt: skip
    assert [job["job_id"] for job in rest.json()["jobs"]] == [ids[1], ids[0]]
    assert rest.json()["next_cursor"] is None
    oldest = await relay_trio("jobs", "list", "--state", "ready", "--state", "pending",
                              "--oldest", "--json", address=address)  # fmt: skip
    assert [job["job_id"] for job in oldest.json()["jobs"]] == [*ids, late]
    found = await relay_trio("jobs", "list", "--search", late, "--json", address=address)
    assert [(j["job_id"], j["state"]) for j in found.json()["jobs"]] == [(late, "pending")]
    assert "payload" not in found.json()["jobs"][0]


async def test_jobs_list_reads_at_80_and_120_columns(address, client):
    queue = "billing.invoices.monthly-reminders"
    job = (await client.submit(queue, 1, retries=0)).job_id
    (leased,) = await client.lease([queue], "worker-with-a-long-name-7")
    await client.fail(job, "worker-with-a-long-name-7", leased.token, "ValueError: " + "x" * 200,
                      retryable=False)  # fmt: skip
    for width in (80, 120):
        shown = await relay_trio("jobs", "list", "--full", env=cli_env(address, COLUMNS=str(width)))
        assert shown.code == 0, shown
        lines = shown.stdout.splitlines()
        assert all(len(line) <= width for line in lines), lines
        row = next(line for line in lines if line.startswith(job))
        assert " dead " in row and " 1/1 " in row and "ValueError" in row
        # From 110 columns, the worker (cut in the middle to 16 at most); the queue cut in
        # the middle where the room is short, its start and end kept.
        assert ("worker-w" in row and "name-7" in row) == (width >= 120), row
        assert queue[:5] in row and queue[-4:] in row, row


async def test_retry_and_purge_a_queue_by_state_confirm_with_the_count(address, client):
    for i in range(3):
        await client.submit("bq", i)
    assert await client.cancel_queue("bq") == 3
    refused = await relay_trio("jobs", "retry", "--queue", "bq", "--state", "cancelled",
                               address=address, stdin="y\n")  # fmt: skip
    assert refused.code == 2 and "--yes" in refused.stderr, refused
    confirmed = await on_a_terminal("y", "jobs", "retry", "--queue", "bq", "--state",
                                    "cancelled", address=address)  # fmt: skip
    assert "Retry 3 jobs of queue bq (cancelled) with fresh attempts?" in confirmed.stderr
    assert confirmed.stdout == "retried 3 jobs of queue bq (cancelled)\n", confirmed
    assert (await client.stats(queues=["bq"])).queues["bq"]["ready"] == 3
    declined = await on_a_terminal("n", "jobs", "purge", "--queue", "bq", "--state", "dead",
                                   address=address)  # fmt: skip
    assert declined.code == 1 and "Purge 0 jobs of queue bq (dead)" in declined.stderr
    await client.cancel_queue("bq")
    purged = await relay_trio("jobs", "purge", "--queue", "bq", "--state", "cancelled",
                              "--state", "dead", "--yes", "--json", address=address)  # fmt: skip
    assert purged.code == 0 and purged.json() == {"count": 3}, purged
    assert "bq" not in (await client.stats()).queues


async def test_promote_a_delayed_job_by_its_start(address, client):
    late = (await client.submit("pq", 1, delay_ms=3_600_000)).job_id
    done = await relay_trio("jobs", "promote", late[:-3], address=address)
    assert done.code == 0 and done.stdout == f"promoted {late}: pending -> ready\n", done
    assert (await client.inspect(late)).state == JobState.READY
    again = await relay_trio("jobs", "promote", late, address=address)
    assert_one_line_error(again, "invalid_state", f"cannot promote {late}: it is ready")


async def test_jobs_refuses_what_it_cannot_do_in_one_line(address):
    results = {}

    async def run(name: str, *args: str) -> None:
        results[name] = await relay_trio(*args, address=address)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "bad state", "jobs", "list", "--state", "done")
        nursery.start_soon(run, "bad limit", "jobs", "list", "--limit", "101")
        nursery.start_soon(run, "key without queue", "jobs", "list", "--search", "order-")
        nursery.start_soon(run, "bad cursor", "jobs", "list", "--after", "nope")
        nursery.start_soon(run, "retry ready", "jobs", "retry", "--queue", "q", "--state",
                           "ready", "--yes")  # fmt: skip
        nursery.start_soon(run, "purge without queue", "jobs", "purge", "--state", "dead")
        nursery.start_soon(run, "promote unknown", "jobs", "promote", "job_0000000000000001")
    assert_one_line_error(results["bad state"], "--state", "done", code=2)
    assert_one_line_error(results["bad limit"], "--limit", code=2)
    assert_one_line_error(results["key without queue"], "bad_request", "needs queue", code=2)
    assert_one_line_error(results["bad cursor"], "bad_request", "cursor", code=2)
    assert_one_line_error(results["retry ready"], "--state", "ready", code=2)
    assert_one_line_error(results["purge without queue"], "--queue", code=2)
    assert_one_line_error(results["promote unknown"], "not_found", "job_0000000000000001")


async def test_jobs_list_offers_the_next_page_after_a_short_or_empty_one(
    address, client, monkeypatch
):
    """A page of every queue reads a bounded stretch of jobs (10 here): one may hold none
    of the states asked and still have a cursor. The caption says so and gives --after."""
    from relay.store import rows

    monkeypatch.setattr(rows, "MERGED_RUNS_MAX", 1, raising=False)
    monkeypatch.setattr(rows, "ROWS_EXAMINED_MAX", 10, raising=False)
    late = [(await client.submit(q, 0, delay_ms=3_600_000)).job_id for q in ("a", "b")]
    for i in range(15):  # newer: the first page reads 10 of them, the next the rest
        await client.submit(f"r{i % 2}", i)
    shown = await relay_trio("jobs", "list", "--state", "pending", address=address)
    assert shown.code == 0, shown
    lines = shown.stdout.splitlines()
    assert "no jobs" in shown.stdout and all(len(line) <= 80 for line in lines), lines
    assert lines[-2] == "fewer than a page here: each page reads a stretch of jobs", lines
    after = lines[-1].removeprefix("next page (older): --after ")
    rest = await relay_trio("jobs", "list", "--state", "pending", "--after", after, "--json",
                            address=address)  # fmt: skip
    page = rest.json()
    assert [job["job_id"] for job in page["jobs"]] == late[::-1], page
    assert page["next_cursor"] is None
