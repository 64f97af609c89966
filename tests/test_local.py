"""Embedded mode (relay.open_local): the same client API and semantics without sockets.

End to end with a Worker, on ":memory:" and on a file; durability across two opens of the
same file; queue depth limits (max_queue_depth, queue_depths), submit(wait=True), batches
over the depth, duplicates on a full queue; errors; orphaned long-polls.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from relay import (
    BadRequest,
    Client,
    JobNotFound,
    JobState,
    LeasedJob,
    QueueFull,
    RelayError,
    ShuttingDown,
    StaleToken,
    SubmitResult,
    Worker,
    job_fields,
    open_local,
)
from relay.protocol.wire import Limits
from tests.worker.helpers import (
    BOUND_S,
    SpyTransport,
    queue_counts,
    running,
    wait_for_state,
    wait_until,
)


@pytest.fixture(params=["memory", "file"])
def db(request, tmp_path) -> str:
    return ":memory:" if request.param == "memory" else str(tmp_path / "local.db")


async def lease_one(client: Client, queue: str, worker: str = "w", **options: Any) -> LeasedJob:
    with trio.fail_after(BOUND_S):
        jobs = await client.lease([queue], worker, **options)
    assert len(jobs) == 1, jobs
    return jobs[0]


# -- end to end --------------------------------------------------------------------------------


async def test_submit_and_work_end_to_end(db):
    async def handler(job: LeasedJob) -> dict[str, Any]:
        return {"sum": sum(job.payload)}

    async with open_local(db) as queue:
        ids = [(await queue.submit("math", [i, i + 1])).job_id for i in range(10)]
        worker = Worker(queue, queues=["math"], handler=handler, concurrency=3, shutdown_timeout=1)
        async with running(worker):
            for i, job_id in enumerate(ids):
                view = await wait_for_state(queue, job_id, "succeeded")
                assert view.result == {"sum": 2 * i + 1}
                assert view.attempt == 1
        assert worker.statistics().succeeded == 10
        counts = await queue_counts(queue, "math")
        assert counts["succeeded"] == 10 and counts["ready"] == counts["leased"] == 0


async def test_every_call_works_locally(db):
    async with open_local(db) as queue:
        hello = await queue.hello("embedded")
        assert hello.server == "relay-trio" and hello.protocol == 1
        assert await queue.ping() is None
        results = await queue.submit_batch(
            [job_fields("q", 1), job_fields("q", 2, priority="high"), job_fields("q", 3)]
        )
        assert [r.state for r in results] == [JobState.READY] * 3
        job = await lease_one(queue, "q", lease_ms=10_000)
        assert job.payload == 2 and job.priority == "high" and job.attempt == 1
        assert await queue.renew(job.job_id, "w", job.token, lease_ms=20_000) > job.lease_expires_at
        await queue.ack(job.job_id, "w", job.token, "ok")
        job = await lease_one(queue, "q")
        outcome = await queue.fail(job.job_id, "w", job.token, "nope", retryable=False)
        assert outcome.state == JobState.DEAD and outcome.retry_at is None
        page = await queue.dead_list("q")
        assert [j.job_id for j in page.jobs] == [job.job_id] and page.next_cursor is None
        assert await queue.dead_retry(job.job_id) == 1
        job = await lease_one(queue, "q")
        await queue.release(job.job_id, "w", job.token)
        view = await queue.inspect(job.job_id)
        assert view.state == JobState.READY and view.attempt == 0
        stats = await queue.stats()
        assert stats.queues["q"]["succeeded"] == 1 and stats.queues["q"]["ready"] == 2
        assert stats.server.connections == 0  # no sockets in embedded mode


async def test_a_submit_gets_the_queues_defaults_for_what_it_leaves_out(db):
    async with open_local(db) as queue:
        await queue.queue_config("q", default_retries=0, default_timeout_ms=9_000)
        left_out = await queue.submit("q", 1)
        given = await queue.submit("q", 2, retries=2, timeout_ms=1_000)
        [batched] = await queue.submit_batch([job_fields("q", 3)])
        views = [await queue.inspect(r.job_id) for r in (left_out, given, batched)]
        assert [(v.max_attempts, v.timeout_ms) for v in views] == [
            (1, 9_000),
            (3, 1_000),
            (1, 9_000),
        ]


async def test_delayed_job_runs_when_due(db):
    ran = trio.Event()

    async def handler(job: LeasedJob) -> None:
        ran.set()

    async with open_local(db) as queue:
        submitted = await queue.submit("later", {}, delay_ms=200)
        assert submitted.state == JobState.PENDING
        started = trio.current_time()
        async with running(Worker(queue, queues=["later"], handler=handler, shutdown_timeout=1)):
            with trio.fail_after(5):
                await ran.wait()
        assert trio.current_time() - started >= 0.15
        await wait_for_state(queue, submitted.job_id, "succeeded")


async def test_data_persists_across_two_opens_of_the_same_file(tmp_path):
    path = str(tmp_path / "persist.db")
    async with open_local(path) as queue:
        kept = await queue.submit("p", {"keep": True}, idempotency_key="once")
        done = await queue.submit("p", {"done": True})
        leased = await queue.submit("p", {"leased": True})
        assert (await lease_one(queue, "p")).job_id == kept.job_id
        # Put the first back, finish the second, leave the third leased.
        first = await queue.inspect(kept.job_id)
        assert first.state == JobState.LEASED
        jobs = await queue.lease(["p"], "w", count=2)
        by_id = {j.job_id: j for j in jobs}
        await queue.ack(done.job_id, "w", by_id[done.job_id].token, {"r": 1})
    async with open_local(path) as queue:
        view = await queue.inspect(done.job_id)
        assert view.state == JobState.SUCCEEDED and view.result == {"r": 1}
        # Jobs leased when the previous process ended are ready again at once.
        for job_id in (kept.job_id, leased.job_id):
            view = await queue.inspect(job_id)
            assert view.state == JobState.READY, view
            assert view.attempt == 0
        again = await queue.submit("p", {"keep": "again"}, idempotency_key="once")
        assert again == SubmitResult(kept.job_id, JobState.READY, True)
        new = await queue.submit("p", {})
        assert new.job_id > leased.job_id  # ids keep sorting across opens


async def test_memory_databases_are_separate():
    async with open_local() as first:
        await first.submit("m", {})
    async with open_local(":memory:") as second:
        assert "m" not in (await second.stats()).queues


# -- errors ------------------------------------------------------------------------------------


async def test_errors_are_raised_as_their_classes():
    async with open_local() as queue:
        with pytest.raises(BadRequest, match="priority"):
            await queue.submit("q", {}, priority="urgent")
        with pytest.raises(JobNotFound):
            await queue.inspect("job_0000000000000001")
        await queue.submit("q", {})
        job = await lease_one(queue, "q")
        with pytest.raises(StaleToken):
            await queue.ack(job.job_id, "w", "wrong")


async def test_options_are_server_config_fields():
    async with open_local(limits=Limits(max_batch=2)) as queue:
        with pytest.raises(BadRequest, match="jobs"):
            await queue.submit_batch([job_fields("q", i) for i in range(3)])
        assert len(await queue.submit_batch([job_fields("q", i) for i in range(2)])) == 2


async def test_exception_in_the_block_comes_out_as_itself():
    with pytest.raises(StaleToken) as info:
        async with open_local() as queue:
            await queue.submit("q", {})
            job = await lease_one(queue, "q")
            await queue.ack(job.job_id, "w", "wrong")
    assert type(info.value) is StaleToken


async def test_calls_after_the_block_raise_shutting_down():
    async with open_local() as queue:
        await queue.ping()
    with pytest.raises(ShuttingDown):
        await queue.ping()


async def test_cancelled_long_poll_releases_what_it_is_granted_later():
    async with open_local() as queue:
        scope = trio.CancelScope()
        finished = trio.Event()

        async def poll() -> None:
            with scope:
                await queue.lease(["orphan"], "poller", wait_ms=5_000, lease_ms=60_000)
            finished.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await trio.testing.wait_all_tasks_blocked()  # the lease is parked
            scope.cancel()
            with trio.fail_after(BOUND_S):
                await finished.wait()
        submitted = await queue.submit("orphan", {})
        # Not kept by the abandoned long-poll for its 60 s lease: the next asker gets it,
        # as its first attempt.
        with trio.fail_after(BOUND_S):
            jobs = await queue.lease(["orphan"], "next", wait_ms=3_000)
        assert [(j.job_id, j.attempt) for j in jobs] == [(submitted.job_id, 1)]


# -- queue depth -------------------------------------------------------------------------------


async def test_fourth_submit_over_max_queue_depth_3_is_queue_full(db):
    async with open_local(db, max_queue_depth=3) as queue:
        for i in range(3):
            await queue.submit("d", i)
        with pytest.raises(QueueFull) as info:
            await queue.submit("d", 3)
        assert isinstance(info.value, RelayError) and info.value.code == "queue_full"
        # Per queue: another queue has its own three.
        for i in range(3):
            await queue.submit("e", i)
        assert (await queue_counts(queue, "d"))["ready"] == 3


async def test_depth_counts_unfinished_jobs_only():
    async with open_local(max_queue_depth=4) as queue:
        await queue.submit("u", "pending", delay_ms=600_000)
        await queue.submit("u", "retrying", backoff={"kind": "fixed", "delay_ms": 600_000})
        await queue.submit("u", "leased")
        await queue.submit("u", "ready")
        to_retry = await lease_one(queue, "u")
        outcome = await queue.fail(to_retry.job_id, "w", to_retry.token, "later")
        assert outcome.state == JobState.RETRYING
        held = await lease_one(queue, "u")
        counts = await queue_counts(queue, "u")
        assert (counts["pending"], counts["retrying"], counts["leased"], counts["ready"]) == (
            1, 1, 1, 1,
        )  # fmt: skip
        with pytest.raises(QueueFull):
            await queue.submit("u", "fifth")
        # Succeeded and dead jobs are finished: each one makes room for one more.
        await queue.ack(held.job_id, "w", held.token)
        await queue.submit("u", "fifth")
        with pytest.raises(QueueFull):
            await queue.submit("u", "sixth")
        job = await lease_one(queue, "u")
        await queue.fail(job.job_id, "w", job.token, "dead", retryable=False)
        await queue.submit("u", "sixth")
        with pytest.raises(QueueFull):
            await queue.submit("u", "seventh")


async def test_queue_depths_per_queue(db):
    async with open_local(db, max_queue_depth=2, queue_depths={"big": 4, "tiny": 1}) as queue:
        for i in range(4):
            await queue.submit("big", i)
        with pytest.raises(QueueFull):
            await queue.submit("big", 4)
        await queue.submit("tiny", 0)
        with pytest.raises(QueueFull):
            await queue.submit("tiny", 1)
        for i in range(2):
            await queue.submit("default", i)
        with pytest.raises(QueueFull):
            await queue.submit("default", 2)


async def test_queue_depths_without_a_default_leave_other_queues_unbounded():
    async with open_local(queue_depths={"tiny": 1}) as queue:
        await queue.submit("tiny", 0)
        with pytest.raises(QueueFull):
            await queue.submit("tiny", 1)
        await queue.submit_batch([job_fields("free", i) for i in range(50)])
        assert (await queue_counts(queue, "free"))["ready"] == 50


async def test_submit_batch_over_the_depth_is_rejected_whole(db):
    async with open_local(db, max_queue_depth=3) as queue:
        await queue.submit("b", 0)
        with pytest.raises(QueueFull):
            await queue.submit_batch([job_fields("b", i) for i in range(1, 4)])
        # Nothing of it was committed, also not its jobs for other queues.
        with pytest.raises(QueueFull):
            await queue.submit_batch(
                [job_fields("other", "x"), *[job_fields("b", i) for i in range(3)]]
            )
        assert (await queue_counts(queue, "b"))["ready"] == 1
        assert "other" not in (await queue.stats()).queues
        results = await queue.submit_batch([job_fields("b", 1), job_fields("b", 2)])
        assert [r.state for r in results] == [JobState.READY] * 2
        assert (await queue_counts(queue, "b"))["ready"] == 3


async def test_duplicate_idempotent_submit_on_a_full_queue_is_a_duplicate(db):
    async with open_local(db, max_queue_depth=2) as queue:
        first = await queue.submit("k", {}, idempotency_key="same")
        await queue.submit("k", {})
        dup = await queue.submit("k", {}, idempotency_key="same")
        assert dup == SubmitResult(first.job_id, JobState.READY, True)
        (batch_dup,) = await queue.submit_batch([job_fields("k", {}, idempotency_key="same")])
        assert batch_dup == SubmitResult(first.job_id, JobState.READY, True)
        with pytest.raises(QueueFull):
            await queue.submit("k", {}, idempotency_key="new")
        assert (await queue_counts(queue, "k"))["ready"] == 2


async def test_submit_wait_waits_until_a_worker_drains_a_job(db):
    async with open_local(db, max_queue_depth=3) as queue:
        for i in range(3):
            await queue.submit("full", i)
        spy = SpyTransport(queue._transport, QueueFull)
        waiting = Client(spy)
        done = trio.Event()
        result: list[SubmitResult] = []

        async def submit_waiting() -> None:
            result.append(await waiting.submit("full", "fourth", wait=True))
            done.set()

        proceed = trio.Event()
        handled: list[Any] = []

        async def handler(job: LeasedJob) -> None:
            await proceed.wait()
            handled.append(job.payload)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit_waiting)
            with trio.fail_after(BOUND_S):
                await spy.refused_event("submit").wait()  # it met a full queue
            worker = Worker(queue, queues=["full"], handler=handler, shutdown_timeout=1)
            async with running(worker):
                await wait_until(
                    lambda: _truthy(worker.statistics().running == 1), what="a job running"
                )
                assert not done.is_set()  # a leased job is still unfinished: still full
                proceed.set()  # the worker finishes one job: room for one
                with trio.fail_after(5):
                    await done.wait()
                assert handled[0] == 0
        assert result[0].state == JobState.READY
        assert (await queue.inspect(result[0].job_id)).payload == "fourth"
        assert (await queue_counts(queue, "full"))["succeeded"] >= 1


async def _truthy(value: Any) -> Any:
    return value
