"""The async client (relay.open_client) against a real server over TCP on 127.0.0.1.

Every call returns its typed result with the right values; each error code raises its own
exception class (never an exception group); many calls pipeline over one connection; the
client reconnects after a server restart, resends ack/renew/release that were in flight,
raises ConnectionLost for other calls in flight, and releases the jobs of a lease whose
caller gave up (an orphaned long-poll).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

import relay
from relay import (
    BadRequest,
    Client,
    ConnectionLost,
    DeadPage,
    InvalidState,
    JobNotFound,
    JobState,
    JobView,
    LeasedJob,
    LeaseExpired,
    NotFound,
    Overloaded,
    QueueFull,
    QueueInfo,
    QueuePage,
    RelayError,
    StaleToken,
    Stats,
    SubmitResult,
    UnknownOp,
    job_fields,
    open_client,
)
from relay.client.client import Hello, ServerInfo
from relay.protocol.errors import (
    ERRORS_BY_CODE,
    FrameTooLarge,
    InternalError,
    ShuttingDown,
    Unauthorized,
    error_from_wire,
)
from relay.protocol.model import ErrorEntry, FailOutcome
from relay.protocol.wire import Limits
from tests.conftest import answer_hello, common_start
from tests.worker.helpers import (
    BOUND_S,
    Proxy,
    Server,
    SpyTransport,
    queue_counts,
    start_server,
    wait_for_state,
    wait_until,
)


def now_ms() -> int:
    return int(time.time() * 1000)


@pytest.fixture
async def client(server: Server) -> AsyncIterator[Client]:
    with trio.fail_after(BOUND_S):
        async with open_client(server.address) as c:
            yield c


async def lease_one(client: Client, queue: str, worker: str = "w", **options: Any) -> LeasedJob:
    with trio.fail_after(BOUND_S):
        jobs = await client.lease([queue], worker, **options)
    assert len(jobs) == 1, jobs
    return jobs[0]


async def make_dead(client: Client, queue: str, n: int) -> list[str]:
    ids = [(await client.submit(queue, {"i": i}, retries=0)).job_id for i in range(n)]
    for _ in ids:
        job = await lease_one(client, queue)
        outcome = await client.fail(job.job_id, "w", job.token, "boom")
        assert outcome.state == JobState.DEAD
    return ids


# -- every call, typed results -----------------------------------------------------------------


async def test_hello_returns_typed_server_info(client):
    hello = await client.hello("tests")
    assert isinstance(hello, Hello)
    assert hello.server == "relay-trio"
    assert hello.protocol == 1
    assert isinstance(hello.version, str) and hello.version
    assert hello.limits["max_connections"] == Limits().max_connections
    assert hello.limits["max_batch"] == Limits().max_batch
    assert set(hello.limits) >= {
        "max_frame_bytes", "max_payload_bytes", "max_in_flight", "max_connections",
        "max_lease_ms", "max_wait_ms", "max_batch", "max_queues_per_lease",
    }  # fmt: skip


async def test_ping_returns_none(client):
    assert await client.ping() is None


async def test_submit_defaults(client):
    result = await client.submit("email", {"to": "ada@example.com"})
    assert isinstance(result, SubmitResult)
    assert result.job_id.startswith("job_")
    assert result.state == JobState.READY
    assert result.duplicate is False
    job = await client.inspect(result.job_id)
    assert job.payload == {"to": "ada@example.com"}
    assert job.priority == "normal"
    assert job.max_attempts == 4  # retries default 3
    assert job.attempt == 0
    assert job.idempotency_key is None


async def test_submit_with_every_option(client):
    before = now_ms()
    delayed = await client.submit(
        "opts", [1, "two", None], priority="high", delay_ms=60_000, retries=5,
        backoff={"kind": "fixed", "delay_ms": 250}, idempotency_key="key-1",
    )  # fmt: skip
    assert delayed.state == JobState.PENDING and delayed.duplicate is False
    job = await client.inspect(delayed.job_id)
    assert job.state == JobState.PENDING
    assert job.payload == [1, "two", None]
    assert job.priority == "high"
    assert job.max_attempts == 6
    assert job.idempotency_key == "key-1"
    assert job.run_at is not None and before + 60_000 <= job.run_at <= now_ms() + 60_000

    run_at = now_ms() + 120_000
    scheduled = await client.submit("opts", {}, run_at=run_at, priority="critical")
    assert scheduled.state == JobState.PENDING
    job = await client.inspect(scheduled.job_id)
    assert job.run_at == run_at and job.priority == "critical"

    past = await client.submit("opts", {}, run_at=1, priority="low", retries=0)
    assert past.state == JobState.READY
    job = await client.inspect(past.job_id)
    assert job.priority == "low" and job.max_attempts == 1

    exponential = await client.submit(
        "opts", {}, backoff={"kind": "exponential", "base_ms": 10, "max_ms": 20, "jitter": False}
    )
    assert exponential.state == JobState.READY

    again = await client.submit("opts", {"other": True}, idempotency_key="key-1")
    assert again == SubmitResult(delayed.job_id, JobState.PENDING, True)


async def test_submit_backoff_is_used_by_fail(client):
    await client.submit("bo", {}, backoff={"kind": "fixed", "delay_ms": 5_000})
    job = await lease_one(client, "bo")
    before = now_ms()
    outcome = await client.fail(job.job_id, "w", job.token, "try later")
    assert outcome.state == JobState.RETRYING
    assert outcome.retry_at is not None
    assert before + 5_000 <= outcome.retry_at <= now_ms() + 5_000


async def test_submit_batch_with_job_fields(client):
    jobs = [
        job_fields("batch", {"n": 0}),
        job_fields("batch", {"n": 1}, priority="high", delay_ms=60_000),
        job_fields("other", {"n": 2}, idempotency_key="k", retries=0),
        job_fields("other", {"n": 3}, idempotency_key="k"),
    ]
    results = await client.submit_batch(jobs)
    assert [type(r) for r in results] == [SubmitResult] * 4
    assert [r.state for r in results] == [
        JobState.READY, JobState.PENDING, JobState.READY, JobState.READY,
    ]  # fmt: skip
    assert [r.duplicate for r in results] == [False, False, False, True]
    assert results[3].job_id == results[2].job_id
    assert results[0].job_id < results[1].job_id < results[2].job_id
    second = await client.inspect(results[1].job_id)
    assert second.queue == "batch" and second.payload == {"n": 1} and second.priority == "high"
    third = await client.inspect(results[2].job_id)
    assert third.queue == "other" and third.max_attempts == 1 and third.payload == {"n": 2}


def test_job_fields_leaves_out_unset_options():
    assert job_fields("q", None) == {"queue": "q", "payload": None}
    assert job_fields("q", 1, priority="low", delay_ms=0, retries=0) == {
        "queue": "q", "payload": 1, "priority": "low", "delay_ms": 0, "retries": 0,
    }  # fmt: skip


async def test_lease_returns_leased_jobs(client):
    submitted = await client.submit("lq", {"x": 1}, priority="high", retries=2)
    before = now_ms()
    (job,) = await client.lease(["lq"], "worker-1", lease_ms=10_000)
    assert isinstance(job, LeasedJob)
    assert job.job_id == submitted.job_id
    assert job.queue == "lq"
    assert job.payload == {"x": 1}
    assert job.priority == "high"
    assert job.attempt == 1
    assert job.max_attempts == 3
    assert isinstance(job.token, str) and len(job.token) >= 16
    assert before + 10_000 <= job.lease_expires_at <= now_ms() + 10_000
    view = await client.inspect(job.job_id)
    assert view.state == JobState.LEASED and view.worker_id == "worker-1"
    assert view.lease_expires_at == job.lease_expires_at


async def test_lease_count_and_empty(client):
    assert await client.lease(["empty"], "w") == []
    ids = [(await client.submit("many", i)).job_id for i in range(3)]
    jobs = await client.lease(["many"], "w", count=2)
    assert [j.job_id for j in jobs] == ids[:2]
    assert len({j.token for j in jobs}) == 2


async def test_lease_long_poll_wakes_on_submit(client, server):
    async with open_client(server.address) as producer, trio.open_nursery() as nursery:
        got: list[LeasedJob] = []

        async def poll() -> None:
            got.extend(await client.lease(["lp"], "w", wait_ms=5_000))

        nursery.start_soon(poll)
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(2):
            submitted = await producer.submit("lp", "hi")
    assert [j.job_id for j in got] == [submitted.job_id]


async def test_renew_returns_the_new_expiry(client):
    await client.submit("rq", {})
    job = await lease_one(client, "rq", lease_ms=1_000)
    before = now_ms()
    expires = await client.renew(job.job_id, "w", job.token, lease_ms=60_000)
    assert isinstance(expires, int)
    assert before + 60_000 <= expires <= now_ms() + 60_000
    assert (await client.inspect(job.job_id)).lease_expires_at == expires


async def test_ack_with_result_and_repeat(client):
    await client.submit("aq", {})
    job = await lease_one(client, "aq")
    assert await client.ack(job.job_id, "w", job.token, {"sent": True, "n": [1, 2]}) is None
    view = await client.inspect(job.job_id)
    assert view.state == JobState.SUCCEEDED
    assert view.result == {"sent": True, "n": [1, 2]}
    assert view.finished_at is not None
    assert view.lease_expires_at is None
    # A repeated ack with the completing token answers ok (a lost reply is safe to retry).
    await client.ack(job.job_id, "w", job.token, {"sent": True, "n": [1, 2]})


async def test_ack_without_result(client):
    await client.submit("aq", {})
    job = await lease_one(client, "aq")
    await client.ack(job.job_id, "w", job.token)
    view = await client.inspect(job.job_id)
    assert view.state == JobState.SUCCEEDED and view.result is None


async def test_fail_retrying_then_dead(client):
    submitted = await client.submit("fq", {}, retries=1, backoff={"kind": "fixed", "delay_ms": 50})
    job = await lease_one(client, "fq")
    before = now_ms()
    outcome = await client.fail(job.job_id, "w", job.token, "first")
    assert isinstance(outcome, FailOutcome)
    assert outcome.state == JobState.RETRYING
    assert outcome.retry_at is not None and before + 50 <= outcome.retry_at <= now_ms() + 50
    await wait_for_state(client, submitted.job_id, "ready")
    job = await lease_one(client, "fq")
    assert job.attempt == 2
    outcome = await client.fail(job.job_id, "w", job.token, "second")
    assert outcome == FailOutcome(JobState.DEAD, None)
    view = await client.inspect(submitted.job_id)
    assert view.state == JobState.DEAD
    assert view.last_error == "second"
    assert [(e.attempt, e.error) for e in view.errors] == [(1, "first"), (2, "second")]


async def test_fail_not_retryable_is_dead(client):
    await client.submit("fq", {}, retries=5)
    job = await lease_one(client, "fq")
    outcome = await client.fail(job.job_id, "w", job.token, "permanent", retryable=False)
    assert outcome == FailOutcome(JobState.DEAD, None)
    assert (await client.inspect(job.job_id)).state == JobState.DEAD


async def test_release_gives_the_job_back(client):
    submitted = await client.submit("rel", {})
    job = await lease_one(client, "rel")
    assert await client.release(job.job_id, "w", job.token) is None
    view = await client.inspect(submitted.job_id)
    assert view.state == JobState.READY
    assert view.attempt == 0
    again = await lease_one(client, "rel", worker="w2")
    assert again.job_id == job.job_id and again.attempt == 1 and again.token != job.token


async def test_inspect_with_prefix_takes_an_abbreviated_id(client):
    """``inspect(..., prefix=True)``: the one job whose id begins so; several are
    ``BadRequest`` (give more digits), none ``JobNotFound``; without it, a whole id."""
    a, b = await client.submit_batch([job_fields("pq", n) for n in range(2)])
    common = common_start(a.job_id, b.job_id)
    view = await client.inspect(a.job_id[: len(common) + 1], prefix=True)
    assert view == await client.inspect(a.job_id) and view.job_id == a.job_id
    with pytest.raises(BadRequest, match=r"job_id: .* more than one job"):
        await client.inspect(common, prefix=True)
    with pytest.raises(JobNotFound):
        await client.inspect("job_0000000", prefix=True)
    with pytest.raises(BadRequest, match="job_id"):
        await client.inspect("job_12", prefix=True)
    with pytest.raises(JobNotFound):
        await client.inspect(a.job_id[:11])


async def test_short_ids_are_what_inspect_with_prefix_takes_back(client):
    """``short_ids`` (an extension): each id, in order, as its shortest start that no other
    job's id has; an id of no job whole; none asked, none answered (without a request:
    the server takes 1 to max_batch)."""
    a, b = await client.submit_batch([job_fields("sq", n) for n in range(2)])
    unknown = "job_0000000000000001"
    shown = await client.short_ids([b.job_id, unknown, a.job_id])
    assert shown == [b.job_id[: len(common_start(a.job_id, b.job_id)) + 1], unknown,
                     a.job_id[: len(common_start(a.job_id, b.job_id)) + 1]]  # fmt: skip
    assert (await client.inspect(shown[0], prefix=True)).job_id == b.job_id
    assert await client.short_ids([]) == []
    with pytest.raises(BadRequest, match=r"job_ids\[0\]"):
        await client.short_ids(["job_34472d0"])


async def test_inspect_job_view_fields(client):
    submitted = await client.submit(
        "iq", {"a": 1}, priority="low", retries=2, idempotency_key="ik",
        backoff={"kind": "fixed", "delay_ms": 0},
    )  # fmt: skip
    view = await client.inspect(submitted.job_id)
    assert isinstance(view, JobView)
    assert view.job_id == submitted.job_id
    assert view.queue == "iq"
    assert view.state == JobState.READY and isinstance(view.state, JobState)
    assert view.priority == "low"
    assert view.payload == {"a": 1}
    assert view.attempt == 0 and view.max_attempts == 3
    assert abs(view.created_at - now_ms()) < 60_000
    assert view.ready_at is not None and view.ready_at >= view.created_at
    assert view.errors == [] and view.last_error is None
    assert view.worker_id is None and view.lease_expires_at is None
    assert view.result is None and view.finished_at is None
    assert view.idempotency_key == "ik"

    job = await lease_one(client, "iq", worker="wk")
    await client.fail(job.job_id, "wk", job.token, "oops")
    view = await wait_for_state(client, job.job_id, "ready")
    assert view.attempt == 1
    assert view.last_error == "oops"
    assert len(view.errors) == 1
    (entry,) = view.errors
    assert isinstance(entry, ErrorEntry)
    assert entry.attempt == 1 and entry.error == "oops" and abs(entry.at - now_ms()) < 60_000


async def test_stats_counts_and_server_info(client):
    await client.submit("s1", {})
    await client.submit("s1", {}, delay_ms=60_000)
    await client.submit("s2", {})
    job = await lease_one(client, "s2")
    await client.ack(job.job_id, "w", job.token)
    stats = await client.stats()
    assert isinstance(stats, Stats) and isinstance(stats.server, ServerInfo)
    assert stats.queues["s1"] == {
        "pending": 1, "ready": 1, "leased": 0, "retrying": 0, "succeeded": 0, "dead": 0,
        "cancelled": 0,
    }  # fmt: skip
    assert stats.queues["s2"]["succeeded"] == 1 and stats.queues["s2"]["ready"] == 0
    assert stats.server.connections == 1
    assert stats.server.uptime_ms >= 0
    assert stats.server.version == (await client.hello()).version


async def test_stats_pages_by_queue_name_and_answers_the_queues_asked_for(client):
    await client.submit_batch([job_fields(q, {}) for q in ("p1", "p2", "p3")])
    first = await client.stats(limit=2)
    assert list(first.queues) == ["p1", "p2"]
    assert first.next_cursor == "p2" and first.total_queues == 3
    rest = await client.stats(limit=2, cursor=first.next_cursor)
    assert list(rest.queues) == ["p3"] and rest.next_cursor is None
    only = await client.stats(queues=["p3", "none"], oldest_ready=True)
    assert only.queues["none"]["ready"] == 0 and set(only.oldest_ready_ms or {}) == {"p3"}


async def test_a_paused_queue_is_listed_and_leases_nothing_until_resumed(client):
    job_id = (await client.submit("pq", {})).job_id
    assert await client.queue_pause("pq") is True
    assert await client.queue_pause("later") is True  # (no jobs yet)
    assert await client.lease(["pq"], "w") == []
    page = await client.queue_list(limit=1)
    assert isinstance(page, QueuePage) and page.next_cursor == "later"
    assert page.queues == [QueueInfo("later", True, counts=dict.fromkeys(map(str, JobState), 0))]
    rest = await client.queue_list(cursor=page.next_cursor)
    assert [(q.queue, q.paused, q.counts["ready"]) for q in rest.queues] == [("pq", True, 1)]
    assert rest.next_cursor is None
    assert await client.queue_resume("pq") is False
    assert [job.job_id for job in await client.lease(["pq"], "w")] == [job_id]


async def test_dead_list_pages(client):
    ids = await make_dead(client, "dl", 5)
    other = await make_dead(client, "dl-other", 1)
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        page = await client.dead_list("dl", limit=2, cursor=cursor)
        assert isinstance(page, DeadPage)
        assert all(isinstance(j, JobView) for j in page.jobs)
        assert all(j.state == JobState.DEAD and j.queue == "dl" for j in page.jobs)
        seen.extend(j.job_id for j in page.jobs)
        pages += 1
        if page.next_cursor is None:
            break
        assert len(page.jobs) == 2
        cursor = page.next_cursor
        assert pages < 10
    assert seen == ids
    assert pages == 3
    everything = await client.dead_list()
    assert [j.job_id for j in everything.jobs] == ids + other
    assert everything.next_cursor is None
    first = everything.jobs[0]
    assert first.last_error == "boom" and first.errors[0].error == "boom"
    assert first.payload == {"i": 0} and first.finished_at is not None


async def test_dead_list_newest_first_pages_with_the_same_order(client):
    ids = await make_dead(client, "dn", 3)
    page = await client.dead_list("dn", limit=2, order="newest")
    assert [j.job_id for j in page.jobs] == [ids[2], ids[1]]
    rest = await client.dead_list("dn", limit=2, cursor=page.next_cursor, order="newest")
    assert [j.job_id for j in rest.jobs] == [ids[0]] and rest.next_cursor is None
    oldest = await client.dead_list("dn", order="oldest")
    assert [j.job_id for j in oldest.jobs] == ids
    with pytest.raises(BadRequest, match="order"):
        await client.dead_list("dn", order="latest")  # type: ignore[arg-type]


async def test_dead_retry_and_purge_by_id(client):
    retry_id, purge_id = await make_dead(client, "dr", 2)
    assert await client.dead_retry(retry_id) == 1
    view = await client.inspect(retry_id)
    assert view.state == JobState.READY and view.attempt == 0
    assert await client.dead_purge(purge_id) == 1
    with pytest.raises(JobNotFound):
        await client.inspect(purge_id)
    assert [j.job_id for j in (await client.dead_list("dr")).jobs] == []


async def test_dead_retry_and_purge_by_queue(client):
    retried = await make_dead(client, "dq", 3)
    purged = await make_dead(client, "dp", 2)
    kept = await make_dead(client, "dk", 1)
    assert await client.dead_retry(queue="dq", all=True) == 3
    for job_id in retried:
        assert (await client.inspect(job_id)).state == JobState.READY
    assert await client.dead_purge(queue="dp", all=True) == 2
    for job_id in purged:
        with pytest.raises(JobNotFound):
            await client.inspect(job_id)
    assert await client.dead_retry(queue="dq", all=True) == 0
    assert [j.job_id for j in (await client.dead_list()).jobs] == kept


# -- errors: one exception class per code ------------------------------------------------------


async def test_bad_request_names_the_field(client):
    with pytest.raises(BadRequest) as info:
        await client.submit("q", {}, priority="urgent")
    assert type(info.value) is BadRequest
    assert "priority" in str(info.value) and info.value.code == "bad_request"
    with pytest.raises(BadRequest, match="lease_ms"):
        await client.lease(["q"], "w", lease_ms=Limits().max_lease_ms + 1)
    with pytest.raises(BadRequest, match="queue"):
        await client.submit("no spaces allowed", {})
    with pytest.raises(BadRequest, match=r"jobs\[1\]\.retries"):
        await client.submit_batch([job_fields("q", 1), job_fields("q", 2, retries=-1)])
    with pytest.raises(BadRequest, match="delay_ms"):
        await client.submit("q", {}, delay_ms=-1)
    # Nothing of the rejected batch was committed; the connection is still usable.
    assert "q" not in (await client.stats()).queues


async def test_not_found(client):
    missing = "job_0000000000000001"
    for call in (
        lambda: client.inspect(missing),
        lambda: client.renew(missing, "w", "t"),
        lambda: client.ack(missing, "w", "t"),
        lambda: client.fail(missing, "w", "t", "e"),
        lambda: client.release(missing, "w", "t"),
        lambda: client.dead_retry(missing),
        lambda: client.dead_purge(missing),
    ):
        with pytest.raises(JobNotFound) as info:
            await call()
        assert type(info.value) is JobNotFound and info.value.code == "not_found"
    assert NotFound is JobNotFound
    with pytest.raises(NotFound):
        await client.inspect("not-a-job-id")


async def test_stale_token(client):
    await client.submit("st", {})
    job = await lease_one(client, "st")
    with pytest.raises(StaleToken):
        await client.ack(job.job_id, "w", "not-the-token")
    with pytest.raises(StaleToken):
        await client.renew(job.job_id, "someone-else", job.token)
    with pytest.raises(StaleToken):
        await client.fail(job.job_id, "w", job.token + "x", "e")
    with pytest.raises(StaleToken):
        await client.release(job.job_id, "w2", job.token)
    # Nothing changed: the real holder can still ack.
    assert (await client.inspect(job.job_id)).state == JobState.LEASED
    await client.ack(job.job_id, "w", job.token)


async def test_lease_expired(client):
    await client.submit("le", {})
    job = await lease_one(client, "le", lease_ms=100)
    # The reaper ends the lease (observable: the job is ready again).
    await wait_for_state(client, job.job_id, "ready", within=5)
    for call in (
        lambda: client.ack(job.job_id, "w", job.token),
        lambda: client.renew(job.job_id, "w", job.token),
        lambda: client.fail(job.job_id, "w", job.token, "late"),
        lambda: client.release(job.job_id, "w", job.token),
    ):
        with pytest.raises(LeaseExpired) as info:
            await call()
        assert info.value.code == "lease_expired"
    view = await client.inspect(job.job_id)
    assert view.state == JobState.READY and view.last_error == "lease expired"


async def test_invalid_state(client):
    submitted = await client.submit("is", {})
    with pytest.raises(InvalidState):
        await client.dead_retry(submitted.job_id)
    with pytest.raises(InvalidState):
        await client.dead_purge(submitted.job_id)
    job = await lease_one(client, "is")
    await client.fail(job.job_id, "w", job.token, "e", retryable=False)
    with pytest.raises(StaleToken):  # the token no longer holds a lease
        await client.fail(job.job_id, "w", job.token, "again")


async def test_unknown_op(client):
    with pytest.raises(UnknownOp):
        await client._transport.request("frobnicate", {})
    await client.ping()


async def test_frame_too_large_raises_frame_too_large(client):
    big = "x" * (Limits().max_frame_bytes + 10)
    with trio.fail_after(BOUND_S), pytest.raises(FrameTooLarge):
        await client.submit("big", big)


async def test_call_after_frame_too_large_waits_for_the_new_connection(client):
    big = "x" * (Limits().max_frame_bytes + 10)
    with trio.fail_after(BOUND_S), pytest.raises(FrameTooLarge):
        await client.submit("big", big)
    # The server closed that connection. A call made now was not in flight when it
    # dropped: it waits for the new connection and succeeds.
    with trio.fail_after(BOUND_S):
        await client.ping()
    assert "big" not in (await client.stats()).queues
    assert client._transport.connections == 2


@pytest.mark.parametrize("cls", sorted(ERRORS_BY_CODE.values(), key=lambda c: c.code))
def test_error_from_wire_gives_one_class_per_code(cls):
    error = error_from_wire(cls.code, "the server's words")
    assert type(error) is cls
    assert isinstance(error, RelayError)
    assert error.code == cls.code and error.message == "the server's words"
    assert str(error) == "the server's words"


def test_error_from_wire_unknown_code_is_internal():
    error = error_from_wire("brand_new_code", "from a newer server")
    assert type(error) is InternalError
    assert "brand_new_code" in error.message and "from a newer server" in error.message


def test_every_wire_code_has_a_class():
    codes = {
        "bad_request", "frame_too_large", "unknown_op", "not_found", "stale_token",
        "lease_expired", "invalid_state", "overloaded", "shutting_down", "unauthorized",
        "internal", "queue_full", "unavailable", "too_many_queues", "cancelled",
        "too_many_schedules",
    }  # fmt: skip
    assert set(ERRORS_BY_CODE) == codes
    assert ERRORS_BY_CODE["shutting_down"] is ShuttingDown
    assert ERRORS_BY_CODE["unauthorized"] is Unauthorized
    assert issubclass(ConnectionLost, RelayError) and ConnectionLost.code not in codes


async def test_queue_full_from_a_server_with_max_queue_depth(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(
            nursery, str(tmp_path / "relay.db"), max_queue_depth=2, queue_depths={"big": 3}
        )
        async with open_client(server.address) as client:
            first = await client.submit("q", {}, idempotency_key="a")
            await client.submit("q", {})
            with pytest.raises(QueueFull) as info:
                await client.submit("q", {})
            assert type(info.value) is QueueFull and info.value.code == "queue_full"
            # A duplicate of a job already in the full queue is not refused.
            dup = await client.submit("q", {}, idempotency_key="a")
            assert dup == SubmitResult(first.job_id, JobState.READY, True)
            # Per-queue depths override the default.
            for _ in range(3):
                await client.submit("big", {})
            with pytest.raises(QueueFull):
                await client.submit_batch([job_fields("big", 1)])
            # A finished job makes room.
            job = await lease_one(client, "q")
            with pytest.raises(QueueFull):  # leased is still unfinished
                await client.submit("q", {})
            await client.ack(job.job_id, "w", job.token)
            assert (await client.submit("q", {})).state == JobState.READY
            assert (await queue_counts(client, "q"))["ready"] == 2
        server.handle.shutdown()


async def test_submit_wait_retries_until_the_queue_has_room(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"), max_queue_depth=1)
        async with open_client(server.address) as client:
            await client.submit("w", {"n": 1})
            spy = SpyTransport(client._transport, QueueFull)
            waiting = Client(spy)
            submitted = trio.Event()
            result: list[SubmitResult] = []

            async def submit_waiting() -> None:
                result.append(await waiting.submit("w", {"n": 2}, wait=True))
                submitted.set()

            async with trio.open_nursery() as inner:
                inner.start_soon(submit_waiting)
                with trio.fail_after(BOUND_S):
                    await spy.refused_event("submit").wait()  # refused at least once
                job = await lease_one(client, "w")
                assert job.payload == {"n": 1}
                assert not submitted.is_set()  # leased is unfinished: still full
                await client.ack(job.job_id, "w", job.token)
                with trio.fail_after(5):
                    await submitted.wait()
            assert result[0].state == JobState.READY
            assert (await client.inspect(result[0].job_id)).payload == {"n": 2}
        server.handle.shutdown()


async def test_overloaded_when_over_max_connections(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(
            nursery, str(tmp_path / "relay.db"), limits=Limits(max_connections=1)
        )
        async with open_client(server.address) as first:
            await first.ping()
            # The second connection is accepted, told `overloaded` and closed: the call
            # made on it raises Overloaded (a RelayError), not a group nor a hang.
            with trio.fail_after(BOUND_S), pytest.raises(Overloaded) as info:
                async with open_client(server.address, reconnect_timeout=2) as second:
                    await second.ping()
            assert isinstance(info.value, RelayError)
            assert info.value.code == "overloaded"
            await first.ping()
        server.handle.shutdown()


# -- no exception group escapes open_client ----------------------------------------------------


async def test_error_raised_in_the_block_comes_out_as_itself(server):
    await_ok = False
    with pytest.raises(StaleToken) as info:
        async with open_client(server.address) as client:
            await client.submit("eg", {})
            job = await lease_one(client, "eg")
            await_ok = True
            await client.ack(job.job_id, "w", "wrong")
    assert await_ok
    assert type(info.value) is StaleToken


async def test_plain_exception_in_the_block_comes_out_as_itself(server):
    class Boom(Exception):
        pass

    with pytest.raises(Boom) as info:
        async with open_client(server.address) as client:
            await client.ping()
            raise Boom("body")
    assert type(info.value) is Boom and str(info.value) == "body"


async def test_exception_in_the_block_with_a_call_in_flight(server):
    errors: list[BaseException] = []
    done = trio.Event()

    async def poll(client: Client) -> None:
        try:
            await client.lease(["parked"], "w", wait_ms=5_000)
        except RelayError as exc:
            errors.append(exc)
        done.set()

    async with trio.open_nursery() as nursery:
        with pytest.raises(KeyError) as info:
            async with open_client(server.address) as client:
                nursery.start_soon(poll, client)
                await trio.testing.wait_all_tasks_blocked()
                raise KeyError("x")
        assert type(info.value) is KeyError
        # The call in flight ends with ConnectionLost when the client closes.
        with trio.fail_after(BOUND_S):
            await done.wait()
    assert [type(e) for e in errors] == [ConnectionLost]


async def test_connect_refused_raises_oserror(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        address = server.address
        await server.stop()
    with trio.fail_after(BOUND_S), pytest.raises(OSError):
        async with open_client(address):
            pass


# -- pipelining --------------------------------------------------------------------------------


async def test_200_concurrent_submits_share_one_connection(client):
    ids: list[str] = []

    async def one(i: int) -> None:
        ids.append((await client.submit("pipe", {"i": i})).job_id)

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(one, i)
    assert len(ids) == 200 and len(set(ids)) == 200
    stats = await client.stats()
    assert stats.queues["pipe"]["ready"] == 200
    assert stats.server.connections == 1
    assert client._transport.connections == 1


async def test_calls_made_in_one_tick_go_out_in_one_write(client, monkeypatch):
    import relay.client.calls as calls_module

    writes: list[int] = []  # lines per write
    real_write = calls_module._write

    async def counting(stream, data):
        writes.append(data.count(b"\n"))
        return await real_write(stream, data)

    monkeypatch.setattr(calls_module, "_write", counting)
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(client.submit, "tick", {"i": i})
    assert writes == [50]
    assert (await client.stats()).queues["tick"]["ready"] == 50


async def test_a_write_cut_short_sends_its_unwritten_lines_on_the_next_connection(
    client, monkeypatch
):
    """The first line of a write reached the server and the rest did not: the first may
    have been acted on (a submit raises ConnectionLost, as any call in flight would); the
    others never were, so they go on the next connection, once."""
    import relay.client.calls as calls_module

    real_write = calls_module._write
    cuts = [True]

    async def cut_after_the_first_line(stream, data):
        if cuts and data.count(b"\n") > 1:
            cuts.clear()
            first = data[: data.index(b"\n") + 1]
            await real_write(stream, first)
            raise calls_module._CutShort(len(first))
        return await real_write(stream, data)

    monkeypatch.setattr(calls_module, "_write", cut_after_the_first_line)
    outcomes: dict[int, Any] = {}

    async def one(i: int) -> None:
        try:
            outcomes[i] = await client.submit("cut", {"i": i})
        except ConnectionLost as exc:
            outcomes[i] = exc

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
        stats = await client.stats()
    lost = [i for i, o in outcomes.items() if isinstance(o, ConnectionLost)]
    assert len(lost) == 1
    assert all(isinstance(o, SubmitResult) for i, o in outcomes.items() if i not in lost)
    assert client._transport.connections == 2
    # The first line was read by the server: its job exists, and nothing was sent twice.
    assert stats.queues["cut"]["ready"] == 3


async def test_a_call_given_up_while_its_write_was_cut_short_is_not_sent_again():
    """The caller of a large submit gives up while its line is being written to a server
    that does not read; the connection is then reset. The line was not acted on, and
    nobody waits for it: it must not be sent on a later connection (nor be kept)."""
    import socket
    import struct

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    accepted: list[trio.SocketStream] = []
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:

            async def accept_one() -> None:
                stream = await listeners[0].accept()
                await answer_hello(stream)
                accepted.append(stream)

            nursery.start_soon(accept_one)
            async with open_client(("127.0.0.1", port), reconnect_timeout=0.5) as client:
                transport = client._transport
                with trio.move_on_after(0.3):  # the server reads nothing: the write blocks
                    await client.submit("big", "x" * (8 << 20))
                (server_end,) = accepted
                # Reset the connection, and listen no more: the client cannot reconnect.
                server_end.socket.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                await server_end.aclose()
                await listeners[0].aclose()
                with pytest.raises(ConnectionLost):
                    await client.ping()  # waits for the reconnection, which gives up
                await trio.testing.wait_all_tasks_blocked()
                assert transport._outbox == []  # the given-up submit is not kept
                assert not transport._pending


# -- reconnection ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_next_call_succeeds_after_a_server_restart_on_the_same_port(tmp_path, how):
    db = str(tmp_path / "relay.db")
    async with trio.open_nursery() as nursery:
        first = await start_server(nursery, db)
        async with open_client(first.address) as client:
            submitted = await client.submit("rs", {"kept": True})
            await (first.stop() if how == "stop" else first.kill())
            second = await start_server(nursery, db, port=first.port)
            with trio.fail_after(BOUND_S):
                view = await client.inspect(submitted.job_id)
            assert view.payload == {"kept": True} and view.state == JobState.READY
            assert client._transport.connections == 2
            assert (await client.submit("rs", {})).state == JobState.READY
        await second.stop()


async def test_call_waiting_for_reconnection_succeeds_once_the_server_is_back(tmp_path):
    db = str(tmp_path / "relay.db")
    async with trio.open_nursery() as nursery:
        first = await start_server(nursery, db)
        async with open_client(first.address) as client:
            await client.ping()
            await first.stop()
            done = trio.Event()
            got: list[Stats] = []

            async def stats_call() -> None:
                got.append(await client.stats())
                done.set()

            nursery.start_soon(stats_call)
            await trio.testing.wait_all_tasks_blocked()
            assert not done.is_set()  # no server: the call waits for the reconnection
            second = await start_server(nursery, db, port=first.port)
            with trio.fail_after(BOUND_S):
                await done.wait()
            assert got[0].server.connections == 1
        await second.stop()


async def test_lease_in_flight_when_the_server_dies_raises_connection_lost(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        async with open_client(server.address, reconnect_timeout=2) as client:
            errors: list[BaseException] = []
            done = trio.Event()

            async def poll() -> None:
                try:
                    await client.lease(["nothing"], "w", wait_ms=30_000)
                except RelayError as exc:
                    errors.append(exc)
                done.set()

            async with trio.open_nursery() as inner:
                inner.start_soon(poll)
                await trio.testing.wait_all_tasks_blocked()
                # Sent after the lease, answered by the writer: the lease is parked now.
                await client.short_ids(["job_0000000000000000"])
                await server.kill()  # no grace: the connection is closed, no reply
                with trio.fail_after(BOUND_S):
                    await done.wait()
            assert [type(e) for e in errors] == [ConnectionLost]


async def test_reconnect_timeout_exceeded_raises_connection_lost(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        async with open_client(server.address, reconnect_timeout=0.5) as client:
            await client.ping()
            await server.stop()
            started = trio.current_time()
            # A call made while reconnecting must end with ConnectionLost once the
            # reconnect timeout has passed, not wait forever.
            with trio.fail_after(5), pytest.raises(ConnectionLost):
                await client.ping()
            assert trio.current_time() - started < 4
            # Later calls fail at once.
            with trio.fail_after(1), pytest.raises(ConnectionLost):
                await client.ping()


async def test_reconnect_timeout_exceeded_later_calls_raise_connection_lost(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        async with open_client(server.address, reconnect_timeout=0.3) as client:
            await client.ping()
            await server.stop()
            # Wait (bounded) until the client has given up reconnecting, then call.
            await wait_until(
                lambda: _given_up(client), within=5, what="the client giving up reconnecting"
            )
            with trio.fail_after(1), pytest.raises(ConnectionLost):
                await client.submit("q", {})


async def _given_up(client: Client) -> bool:
    return client._transport._failure is not None


async def test_without_reconnect_a_dropped_connection_raises_connection_lost(tmp_path):
    db = str(tmp_path / "relay.db")
    async with trio.open_nursery() as nursery:
        first = await start_server(nursery, db)
        async with open_client(first.address, reconnect=False) as client:
            await client.ping()
            await first.stop()
            second = await start_server(nursery, db, port=first.port)
            with trio.fail_after(BOUND_S), pytest.raises(ConnectionLost):
                await client.ping()
        await second.stop()


# Through a proxy: a request (or its reply) is lost in flight, then the connection drops.


@pytest.fixture
async def proxied(server: Server) -> AsyncIterator[tuple[Proxy, Client, Client]]:
    """(proxy, client through the proxy, direct client)."""
    async with trio.open_nursery() as nursery:
        proxy = Proxy(server.handle.address)
        await proxy.start(nursery)
        async with open_client(proxy.address) as through, open_client(server.address) as direct:
            yield proxy, through, direct
        nursery.cancel_scope.cancel()


async def _in_flight_then_cut(proxy: Proxy, call, *, lose: str) -> list[Any]:
    """Run ``call`` with its request (lose="request") or its reply (lose="reply")
    swallowed by the proxy, then cut the connection; return [result] or [exception]."""
    outcome: list[Any] = []
    swallowed = proxy.swallow(up=lose == "request", down=lose == "reply")

    async def run() -> None:
        try:
            outcome.append(await call())
        except RelayError as exc:
            outcome.append(exc)

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await swallowed.wait()
            assert outcome == []
            proxy.cut()
    return outcome


@pytest.mark.parametrize("lose", ["request", "reply"])
async def test_ack_in_flight_is_resent_and_succeeds(proxied, lose):
    proxy, client, direct = proxied
    await client.submit("rsnd", {})
    job = await lease_one(client, "rsnd", lease_ms=60_000)
    outcome = await _in_flight_then_cut(
        proxy, lambda: client.ack(job.job_id, "w", job.token, {"r": 1}), lose=lose
    )
    assert outcome == [None], outcome
    view = await direct.inspect(job.job_id)
    assert view.state == JobState.SUCCEEDED and view.result == {"r": 1}
    assert client._transport.connections == 2


@pytest.mark.parametrize("lose", ["request", "reply"])
async def test_renew_in_flight_is_resent_and_succeeds(proxied, lose):
    proxy, client, direct = proxied
    await client.submit("rsnd", {})
    job = await lease_one(client, "rsnd", lease_ms=10_000)
    outcome = await _in_flight_then_cut(
        proxy, lambda: client.renew(job.job_id, "w", job.token, lease_ms=600_000), lose=lose
    )
    assert len(outcome) == 1 and isinstance(outcome[0], int), outcome
    view = await direct.inspect(job.job_id)
    assert view.state == JobState.LEASED and view.lease_expires_at == outcome[0]
    assert view.lease_expires_at > now_ms() + 300_000


@pytest.mark.parametrize("lose", ["request", "reply"])
async def test_release_in_flight_is_resent_and_succeeds(proxied, lose):
    proxy, client, direct = proxied
    await client.submit("rsnd", {})
    job = await lease_one(client, "rsnd", lease_ms=60_000)
    outcome = await _in_flight_then_cut(
        proxy, lambda: client.release(job.job_id, "w", job.token), lose=lose
    )
    assert outcome == [None], outcome
    view = await direct.inspect(job.job_id)
    assert view.state == JobState.READY and view.attempt == 0


@pytest.mark.parametrize("op", ["submit", "lease", "inspect", "fail"])
async def test_other_calls_in_flight_raise_connection_lost(proxied, op):
    proxy, client, direct = proxied
    await client.submit("cl", {})
    job = await lease_one(client, "cl", lease_ms=60_000)
    await direct.submit("cl-wait", {})
    calls = {
        "submit": lambda: client.submit("cl-new", {}),
        "lease": lambda: client.lease(["cl-wait"], "w"),
        "inspect": lambda: client.inspect(job.job_id),
        "fail": lambda: client.fail(job.job_id, "w", job.token, "e"),
    }
    outcome = await _in_flight_then_cut(proxy, calls[op], lose="request")
    assert len(outcome) == 1 and type(outcome[0]) is ConnectionLost, outcome
    # The request never reached the server: nothing happened.
    assert "cl-new" not in (await direct.stats()).queues
    assert (await queue_counts(direct, "cl-wait"))["ready"] == 1
    assert (await direct.inspect(job.job_id)).state == JobState.LEASED
    # The client reconnected: the next call works.
    with trio.fail_after(BOUND_S):
        await client.ping()


async def test_ack_issued_while_disconnected_waits_and_succeeds(proxied):
    proxy, client, direct = proxied
    await client.submit("dis", {})
    job = await lease_one(client, "dis", lease_ms=60_000)
    await proxy.pause()  # new connections refused, the open one closed
    # Bounded wait until the client has noticed the drop (it is reconnecting).
    await wait_until(lambda: _disconnected(client), within=5, what="the client noticing the drop")
    done = trio.Event()

    async def ack() -> None:
        await client.ack(job.job_id, "w", job.token, "late but fine")
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ack)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()
        assert (await direct.inspect(job.job_id)).state == JobState.LEASED
        await proxy.resume()
        with trio.fail_after(BOUND_S):
            await done.wait()
    view = await direct.inspect(job.job_id)
    assert view.state == JobState.SUCCEEDED and view.result == "late but fine"


async def _disconnected(client: Client) -> bool:
    return not client._transport._connected.is_set()


# -- orphaned leases ---------------------------------------------------------------------------


async def test_cancelled_long_poll_releases_what_it_is_granted_later(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"), metrics_port=0)
        async with open_client(server.address) as client:
            scope = trio.CancelScope()
            finished = trio.Event()

            async def poll() -> None:
                with scope:
                    await client.lease(["orphan"], "poller", wait_ms=5_000, lease_ms=60_000)
                finished.set()

            async with trio.open_nursery() as inner:
                inner.start_soon(poll)
                await trio.testing.wait_all_tasks_blocked()
                # Sent after the lease on this connection, answered by the writer: it is parked.
                await client.short_ids(["job_0000000000000000"])
                scope.cancel()
                with trio.fail_after(BOUND_S):
                    await finished.wait()
            assert scope.cancelled_caught

            async with open_client(server.address) as producer:
                submitted = await producer.submit("orphan", {"x": 1})

                # The parked lease is granted the job after all (observable in the metrics)...
                async def granted() -> bool:
                    return await server.metric("relay_jobs_leased_total", queue="orphan") >= 1

                await wait_until(granted, within=5, what="the parked lease being granted")
                # ...and the client releases it at once: it is ready again well before the
                # 60 s lease would have expired, its attempt given back.
                view = await wait_for_state(producer, submitted.job_id, "ready", within=3)
                assert view.attempt == 0
                job = await lease_one(producer, "orphan", worker="next")
                assert job.job_id == submitted.job_id and job.attempt == 1
        server.handle.shutdown()


# -- ack_batch (an extension op) ---------------------------------------------------------------


async def test_ack_batch_returns_none_or_the_error_per_ack_in_order(client):
    for i in range(4):
        await client.submit("abq", {"i": i})
    with trio.fail_after(BOUND_S):
        first, second, done, ready = await client.lease(["abq"], "w", count=4)
    await client.release(ready.job_id, "w", ready.token)
    await client.ack(done.job_id, "w", done.token, "once")
    outcomes = await client.ack_batch(
        "w",
        [
            (first.job_id, first.token, {"r": [1, 2]}),
            (second.job_id, "not-the-token"),
            (done.job_id, done.token, "twice"),  # repeated with the completing token
            ("job_0000000000000001", first.token),
            (ready.job_id, ready.token),  # released: the token no longer holds a lease
            (second.job_id, second.token, None),  # a job named twice: refused, not run
        ],
    )
    assert isinstance(outcomes, list) and len(outcomes) == 6
    assert [outcomes[i] for i in (0, 2)] == [None, None]
    assert [type(outcomes[i]) for i in (1, 3, 4, 5)] == [
        StaleToken, JobNotFound, StaleToken, BadRequest,
    ]  # fmt: skip
    codes = ["stale_token", "not_found", "stale_token", "bad_request"]
    assert [outcomes[i].code for i in (1, 3, 4, 5)] == codes
    assert all(isinstance(outcomes[i].message, str) and outcomes[i].message for i in (1, 3, 4))
    assert (await client.inspect(first.job_id)).result == {"r": [1, 2]}
    assert (await client.inspect(done.job_id)).result == "once"
    assert (await client.inspect(second.job_id)).state == JobState.LEASED
    assert await client.ack_batch("w", [(second.job_id, second.token, None)]) == [None]
    view = await client.inspect(second.job_id)
    assert view.state == JobState.SUCCEEDED and view.result is None
    assert (await client.inspect(ready.job_id)).state == JobState.READY
    counts = await queue_counts(client, "abq")
    assert (counts["succeeded"], counts["leased"], counts["ready"]) == (3, 0, 1)


async def test_ack_batch_refusals_of_another_worker_or_an_expired_lease(client):
    await client.submit("abe", {})
    await client.submit("abk", {})
    expired = await lease_one(client, "abe", lease_ms=100)
    kept = await lease_one(client, "abk", lease_ms=60_000)
    # The reaper ends the short lease (observable: the job is ready again).
    await wait_for_state(client, expired.job_id, "ready", within=5)
    outcomes = await client.ack_batch("someone-else", [(kept.job_id, kept.token)])
    assert [type(o) for o in outcomes] == [StaleToken]
    outcomes = await client.ack_batch(
        "w", [(expired.job_id, expired.token), (kept.job_id, kept.token, 7)]
    )
    assert type(outcomes[0]) is LeaseExpired and outcomes[0].code == "lease_expired"
    assert outcomes[1] is None
    assert (await client.inspect(kept.job_id)).result == 7
    assert (await client.inspect(expired.job_id)).state == JobState.READY


async def test_malformed_ack_batch_raises_bad_request_and_changes_nothing(client):
    await client.submit("abm", {})
    job = await lease_one(client, "abm")
    with pytest.raises(BadRequest, match=r"^acks: "):
        await client.ack_batch("w", [])
    with pytest.raises(BadRequest, match=r"^acks\[1\]\.token: "):
        await client.ack_batch("w", [(job.job_id, job.token), (job.job_id, "")])
    with pytest.raises(BadRequest, match=r"^acks\[0\]\.result: "):
        await client.ack_batch("w", [(job.job_id, job.token, "x" * Limits().max_result_bytes)])
    with pytest.raises(BadRequest, match=r"^worker_id: "):
        await client.ack_batch("", [(job.job_id, job.token)])
    view = await client.inspect(job.job_id)
    assert view.state == JobState.LEASED and view.result is None
    assert await client.ack_batch("w", [(job.job_id, job.token)]) == [None]


@pytest.mark.parametrize("lose", ["request", "reply"])
async def test_ack_batch_in_flight_is_resent_and_answers_as_before(proxied, lose):
    proxy, client, direct = proxied
    await client.submit("rsnd", {})
    await client.submit("rsnd", {})
    with trio.fail_after(BOUND_S):
        good, other = await client.lease(["rsnd"], "w", count=2, lease_ms=60_000)
    acks = [(good.job_id, good.token, {"r": 1}), (other.job_id, "not-the-token")]
    outcome = await _in_flight_then_cut(proxy, lambda: client.ack_batch("w", acks), lose=lose)
    assert len(outcome) == 1 and isinstance(outcome[0], list), outcome
    (results,) = outcome
    assert results[0] is None and type(results[1]) is StaleToken, results
    view = await direct.inspect(good.job_id)
    assert view.state == JobState.SUCCEEDED and view.result == {"r": 1}
    assert (await direct.inspect(other.job_id)).state == JobState.LEASED
    assert client._transport.connections == 2


async def test_schedules_put_list_pause_resume_delete_and_their_jobs_slot(tmp_path):
    from relay import NotFound, ScheduleInfo, SchedulePage
    from relay.protocol.wire import Limits

    async with trio.open_nursery() as nursery:
        server = await start_server(
            nursery, str(tmp_path / "relay.db"), limits=Limits(allow_second_schedules=True)
        )
        async with open_client(server.address) as client:
            info = await client.schedule_put(
                "nightly", "@daily", "reports", {"r": 1}, timezone="Europe/Berlin",
                retries=1, catch_up="all", catch_up_max=5,
            )  # fmt: skip
            assert isinstance(info, ScheduleInfo)
            assert (info.cron, info.timezone, info.retries, info.catch_up) == (
                "0 0 * * *", "Europe/Berlin", 1, "all",
            )  # fmt: skip
            assert (await client.schedule_pause("nightly")).paused is True
            assert (await client.schedule_resume("nightly")).paused is False
            await client.schedule_put("tick", "* * * * * *", "ticks", 7)
            page = await client.schedule_list(limit=1)
            assert isinstance(page, SchedulePage) and page.next_cursor == "nightly"
            assert [s.name for s in page.schedules] == ["nightly"]
            [job] = await client.lease(["ticks"], "w", wait_ms=5_000)
            assert job.payload == 7 and job.scheduled_for is not None
            assert (await client.inspect(job.job_id)).scheduled_for == job.scheduled_for
            await client.schedule_delete("tick")
            with pytest.raises(NotFound):
                await client.schedule_delete("tick")
        nursery.cancel_scope.cancel()


async def test_jobs_list_promote_and_bulk_actions_by_state(client):
    late = (await client.submit("jb", {"n": 0}, delay_ms=3_600_000)).job_id
    ids = [(await client.submit("jb", {"n": i})).job_id for i in range(1, 4)]
    page = await client.jobs_list("jb", limit=2)
    assert isinstance(page, relay.JobsPage)
    assert [j.job_id for j in page.jobs] == [ids[2], ids[1]]
    assert all(isinstance(j, relay.JobSummary) for j in page.jobs)
    rest = await client.jobs_list("jb", cursor=page.next_cursor)
    assert [j.job_id for j in rest.jobs] == [ids[0], late] and rest.next_cursor is None
    pending = await client.jobs_list(states=["pending"], order="oldest")
    assert [(j.job_id, j.state) for j in pending.jobs] == [(late, JobState.PENDING)]
    assert [j.job_id for j in (await client.jobs_list(search=late)).jobs] == [late]
    assert await client.promote(late) == JobState.PENDING
    with pytest.raises(InvalidState, match="cannot promote"):
        await client.promote(late)
    assert await client.cancel_queue("jb") == 4
    assert await client.dead_retry(queue="jb", all=True, states=["cancelled"]) == 4
    assert await client.cancel_queue("jb") == 4
    assert await client.dead_purge(queue="jb", all=True, states=["cancelled"]) == 4
    assert (await client.jobs_list("jb")).jobs == []


async def test_the_blocking_client_lists_and_promotes(server):
    def use() -> None:
        with relay.connect(server.address, timeout=5) as queue:
            late = queue.submit("bj", {}, delay_ms=3_600_000).job_id
            page = queue.jobs_list("bj", states=["pending"])
            assert [j.job_id for j in page.jobs] == [late] and page.next_cursor is None
            assert queue.promote(late) == JobState.PENDING
            assert queue.jobs_list(search=late, order="oldest").jobs[0].state == JobState.READY

    await trio.to_thread.run_sync(use)
