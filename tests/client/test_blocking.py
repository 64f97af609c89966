"""The blocking client (relay.connect) against a real server running in this process.

The client blocks, so each call runs in a worker thread (``trio.to_thread.run_sync``) while
the server keeps running in the trio loop; every call is bounded by the client's socket
timeout and by ``trio.fail_after``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import trio

from relay import (
    BadRequest,
    BlockingClient,
    ConnectionLost,
    JobNotFound,
    JobState,
    JobView,
    Overloaded,
    QueueFull,
    RelayError,
    Stats,
    SubmitResult,
    UnknownOp,
    connect,
    job_fields,
    open_client,
)
from relay.protocol.wire import Limits
from tests.worker.helpers import BOUND_S, Proxy, Server, start_server


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one blocking call in a thread, bounded."""
    with trio.fail_after(BOUND_S):
        return await trio.to_thread.run_sync(
            functools.partial(fn, *args, **kwargs), abandon_on_cancel=True
        )


@pytest.fixture
def bclient(server: Server):
    with connect(server.address, timeout=5) as c:
        yield c


async def test_connect_returns_a_blocking_client_without_connecting(server):
    client = connect(server.address)
    assert isinstance(client, BlockingClient)
    assert client.address == server.handle.address
    assert client._sock is None  # connects on its first call
    with client:
        stats = await call(client.stats)
        assert stats.server.connections == 1


async def test_stats_pages_by_queue_name(bclient):
    for queue in ("b1", "b2"):
        await call(bclient.submit, queue, {})
    first = await call(bclient.stats, limit=1)
    assert list(first.queues) == ["b1"] and first.next_cursor == "b1"
    rest = await call(bclient.stats, limit=1, cursor="b1", oldest_ready=True)
    assert list(rest.queues) == ["b2"] and rest.next_cursor is None
    assert set(rest.oldest_ready_ms or {}) == {"b2"}
    only = await call(bclient.stats, queues=["b2"])
    assert list(only.queues) == ["b2"] and only.total_queues == 2


async def test_pause_list_and_resume_a_queue(bclient):
    result = await call(bclient.submit, "bp", {})
    assert await call(bclient.queue_pause, "bp") is True
    page = await call(bclient.queue_list, limit=5)
    assert [(q.queue, q.paused, q.counts["ready"]) for q in page.queues] == [("bp", True, 1)]
    assert page.next_cursor is None
    assert (await call(bclient.stats)).queues["bp"]["ready"] == 1
    assert await call(bclient.queue_resume, "bp") is False
    assert (await call(bclient.queue_list, cursor="bp")).queues == []
    assert (await call(bclient.inspect, result.job_id)).state == JobState.READY


async def test_submit_inspect_stats(bclient):
    result = await call(bclient.submit, "email", {"to": "ada@example.com"})
    assert isinstance(result, SubmitResult)
    assert result.job_id.startswith("job_") and result.state == JobState.READY
    assert result.duplicate is False
    view = await call(bclient.inspect, result.job_id)
    assert isinstance(view, JobView)
    assert view.job_id == result.job_id and view.queue == "email"
    assert view.payload == {"to": "ada@example.com"}
    assert view.state == JobState.READY and view.attempt == 0 and view.max_attempts == 4
    stats = await call(bclient.stats)
    assert isinstance(stats, Stats)
    assert stats.queues["email"]["ready"] == 1
    assert stats.server.connections == 1


async def test_inspect_with_prefix_takes_an_abbreviated_id(bclient):
    (result,) = await call(bclient.submit_batch, [job_fields("pq", 1)])
    view = await call(bclient.inspect, result.job_id[:11], prefix=True)
    assert view.job_id == result.job_id and view.payload == 1
    with pytest.raises(JobNotFound):
        await call(bclient.inspect, result.job_id[:11])  # a whole id without prefix


async def test_submit_options(bclient):
    delayed = await call(
        bclient.submit, "opts", [1, 2], priority="critical", delay_ms=60_000, retries=0,
        backoff={"kind": "fixed", "delay_ms": 10}, idempotency_key="k1",
    )  # fmt: skip
    assert delayed.state == JobState.PENDING
    view = await call(bclient.inspect, delayed.job_id)
    assert view.priority == "critical" and view.max_attempts == 1
    assert view.idempotency_key == "k1" and view.run_at is not None
    again = await call(bclient.submit, "opts", "other", idempotency_key="k1")
    assert again == SubmitResult(delayed.job_id, JobState.PENDING, True)


async def test_submit_batch(bclient):
    results = await call(
        bclient.submit_batch,
        [
            job_fields("b", {"n": 0}),
            job_fields("b", {"n": 1}, delay_ms=60_000),
            job_fields("c", {"n": 2}, idempotency_key="x"),
            job_fields("c", {"n": 3}, idempotency_key="x"),
        ],
    )
    assert [r.state for r in results] == [
        JobState.READY, JobState.PENDING, JobState.READY, JobState.READY,
    ]  # fmt: skip
    assert [r.duplicate for r in results] == [False, False, False, True]
    assert results[2].job_id == results[3].job_id
    assert len({r.job_id for r in results}) == 3
    stats = await call(bclient.stats)
    assert stats.queues["b"]["pending"] == 1 and stats.queues["c"]["ready"] == 1


async def test_errors_are_mapped_to_their_classes(bclient):
    with pytest.raises(BadRequest) as info:
        await call(bclient.submit, "q", {}, priority="urgent")
    assert "priority" in str(info.value)
    with pytest.raises(BadRequest, match=r"jobs\[0\]\.queue"):
        await call(bclient.submit_batch, [job_fields("bad queue", 1)])
    with pytest.raises(JobNotFound):
        await call(bclient.inspect, "job_0000000000000001")
    with pytest.raises(UnknownOp):
        await call(bclient.request, "frobnicate")
    # The connection stays usable after error replies.
    assert (await call(bclient.submit, "q", {})).state == JobState.READY
    assert bclient._sock is not None


async def test_queue_full(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"), max_queue_depth=2)
        with connect(server.address, timeout=5) as client:
            first = await call(client.submit, "q", 1, idempotency_key="a")
            await call(client.submit, "q", 2)
            with pytest.raises(QueueFull):
                await call(client.submit, "q", 3)
            with pytest.raises(QueueFull):
                await call(client.submit_batch, [job_fields("q", 4)])
            dup = await call(client.submit, "q", 1, idempotency_key="a")
            assert dup == SubmitResult(first.job_id, JobState.READY, True)
            assert (await call(client.stats)).queues["q"]["ready"] == 2
        server.handle.shutdown()


async def test_overloaded(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(
            nursery, str(tmp_path / "relay.db"), limits=Limits(max_connections=1)
        )
        async with open_client(server.address) as holder:
            await holder.ping()
            with connect(server.address, timeout=5) as client:
                with pytest.raises(Overloaded) as info:
                    await call(client.stats)
                assert isinstance(info.value, RelayError)
        server.handle.shutdown()


async def test_shared_between_threads(bclient):
    ids: list[str] = []
    lock = threading.Lock()

    def submit_many(start: int) -> None:
        for i in range(start, start + 25):
            job_id = bclient.submit("threads", {"i": i}).job_id
            with lock:
                ids.append(job_id)

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            for t in range(4):
                nursery.start_soon(call, submit_many, t * 25)
    assert len(ids) == 100 and len(set(ids)) == 100
    stats = await call(bclient.stats)
    assert stats.queues["threads"]["ready"] == 100
    assert stats.server.connections == 1


class _CountingList(list):
    """The client's list of waiting calls: sets ``full`` once it holds ``n``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.full = threading.Event()

    def append(self, item: Any) -> None:
        super().append(item)
        if len(self) >= self.n:
            self.full.set()


async def _queued_behind_a_busy_socket(client: BlockingClient, calls: list[Callable[[], Any]]):
    """Run ``calls`` in threads while the test holds the client's socket, so that they all
    queue; then let them go. Their outcomes (result or exception), and the requests the
    client made of them."""
    waiting = client._waiting = _CountingList(len(calls))
    exchanges: list[list[tuple[int, bytes, Any]]] = []
    real_requests = client._requests

    def recording(batch):
        requests = real_requests(batch)
        exchanges.append(requests)
        return requests

    client._requests = recording  # type: ignore[method-assign]
    outcomes: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            outcomes[i] = calls[i]()
        except RelayError as exc:
            outcomes[i] = exc

    client._lock.acquire()
    try:
        async with trio.open_nursery() as nursery:
            for i in range(len(calls)):
                nursery.start_soon(call, run, i)
            await call(waiting.full.wait, BOUND_S)
            client._lock.release()
    finally:
        if client._lock.locked() and not waiting.full.is_set():
            client._lock.release()
    return outcomes, [[line for _, line, _ in requests] for requests in exchanges]


async def test_calls_of_threads_queued_behind_one_go_out_together(bclient):
    calls = [functools.partial(bclient.submit, "together", {"i": i}) for i in range(10)]
    with trio.fail_after(BOUND_S):
        outcomes, exchanges = await _queued_behind_a_busy_socket(bclient, calls)
    assert all(isinstance(o, SubmitResult) for o in outcomes)
    assert len({o.job_id for o in outcomes}) == 10
    # One write of ten pipelined submits.
    assert len(exchanges) == 1 and len(exchanges[0]) == 10
    assert all(b'"op":"submit"' in line for line in exchanges[0])


async def test_coalesced_submits_of_threads_go_as_one_submit_batch(server):
    with connect(server.address, timeout=5, coalesce=True) as client:
        calls = [functools.partial(client.submit, "batch", {"i": i}) for i in range(10)]
        calls.append(functools.partial(client.submit, "not a queue!", {}))
        calls.append(client.stats)
        with trio.fail_after(BOUND_S):
            outcomes, exchanges = await _queued_behind_a_busy_socket(client, calls)
            stats = await call(client.stats)
    assert isinstance(outcomes[10], BadRequest)  # its own error; the others stand
    assert all(isinstance(o, SubmitResult) for o in outcomes[:10])
    assert isinstance(outcomes[11], Stats)
    assert stats.queues["batch"]["ready"] == 10
    # One submit_batch (refused whole for the bad job, then each submit alone) and stats.
    assert len(exchanges) == 1 and len(exchanges[0]) == 2
    assert b'"op":"submit_batch"' in exchanges[0][0] and b'"op":"stats"' in exchanges[0][1]


# -- dropped connections -----------------------------------------------------------------------


async def test_next_call_after_a_server_restart_succeeds(tmp_path):
    db = str(tmp_path / "relay.db")
    async with trio.open_nursery() as nursery:
        first = await start_server(nursery, db)
        with connect(first.address, timeout=5) as client:
            submitted = await call(client.submit, "rs", {"kept": 1})
            await first.stop()
            second = await start_server(nursery, db, port=first.port)
            # The connection dropped while idle (no call in flight): the next call
            # connects again and succeeds.
            view = await call(client.inspect, submitted.job_id)
            assert view.payload == {"kept": 1}
            assert (await call(client.stats)).server.connections == 1
        await second.stop()


async def test_call_after_connection_lost_connects_again(tmp_path):
    db = str(tmp_path / "relay.db")
    async with trio.open_nursery() as nursery:
        first = await start_server(nursery, db)
        with connect(first.address, timeout=5) as client:
            submitted = await call(client.submit, "rs", {"kept": 1})
            await first.stop()
            second = await start_server(nursery, db, port=first.port)
            try:
                view = await call(client.inspect, submitted.job_id)
            except ConnectionLost:
                view = await call(client.inspect, submitted.job_id)
            assert view.payload == {"kept": 1}
            assert (await call(client.submit, "rs", {})).state == JobState.READY
        await second.stop()


async def test_call_in_flight_when_the_connection_drops_raises_connection_lost(server):
    async with trio.open_nursery() as nursery:
        proxy = Proxy(server.handle.address)
        await proxy.start(nursery)
        with connect(proxy.address, timeout=5) as client:
            await call(client.stats)
            swallowed = proxy.swallow(up=True)
            outcome: list[Any] = []

            async def submit() -> None:
                try:
                    outcome.append(await call(client.submit, "lost", {}))
                except RelayError as exc:
                    outcome.append(exc)

            async with trio.open_nursery() as inner:
                inner.start_soon(submit)
                with trio.fail_after(BOUND_S):
                    await swallowed.wait()
                proxy.cut()
            assert len(outcome) == 1 and type(outcome[0]) is ConnectionLost, outcome
            # The request never reached the server; the next call connects again.
            stats = await call(client.stats)
            assert "lost" not in stats.queues
            assert proxy.accepted == 2
        nursery.cancel_scope.cancel()


async def test_server_that_does_not_answer_raises_connection_lost_after_the_timeout(server):
    async with trio.open_nursery() as nursery:
        proxy = Proxy(server.handle.address)
        await proxy.start(nursery)
        with connect(proxy.address, timeout=0.3) as client:
            await call(client.stats)
            proxy.swallow(down=True)  # replies never arrive
            started = trio.current_time()
            with pytest.raises(ConnectionLost):
                await call(client.submit, "slow", {})
            assert trio.current_time() - started < 3
            proxy.swallow()  # replies flow again; the next call uses a new connection
            stats = await call(client.stats)
            assert stats.queues["slow"]["ready"] == 1  # it did take effect
        nursery.cancel_scope.cancel()


async def test_first_call_to_a_closed_port_fails_without_hanging(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        address = server.address
        await server.stop()
    client = connect(address, timeout=1, connect_timeout=1)
    with pytest.raises((OSError, ConnectionLost)):
        await call(client.stats)
    client.close()


async def test_put_list_pause_and_delete_a_schedule(bclient):
    info = await call(bclient.schedule_put, "bs", "*/5 * * * *", "q", {"n": 1}, priority="high")
    assert (info.name, info.priority, info.paused) == ("bs", "high", False)
    assert (await call(bclient.schedule_pause, "bs")).paused is True
    assert (await call(bclient.schedule_resume, "bs")).paused is False
    page = await call(bclient.schedule_list, limit=5)
    assert [s.name for s in page.schedules] == ["bs"] and page.next_cursor is None
    await call(bclient.schedule_delete, "bs")
    assert (await call(bclient.schedule_list)).schedules == []


async def test_history_of_a_queue_and_of_every_queue(tmp_path):
    from tests.worker.helpers import serving

    start = functools.partial(start_server, history_flush_ms=20)
    async with serving(start, str(tmp_path / "h.db")) as server:
        with connect(server.address, timeout=5) as c:
            await call(c.submit, "q", {"n": 1})
            # (a producer's client: the worker's ops as plain requests)
            [job] = (await call(c.request, "lease", queues=["q"], worker_id="w"))["jobs"]
            await call(c.request, "fail", job_id=job["job_id"], worker_id="w",
                       token=job["token"], error="boom", retryable=False)  # fmt: skip
            with trio.fail_after(BOUND_S):  # (flushed every 20 ms)
                while not (h := await call(c.history, "q")).points[-1].dead:  # noqa: ASYNC110
                    await trio.sleep(0.02)
            assert (h.queue, h.step, h.end - h.start) == ("q", 60_000, 60 * 60_000)
            point = h.points[-1]
            assert (point.submitted, point.failed, point.run_count) == (1, 1, 1)
            assert point.run_mean_ms == point.run_sum_ms and point.wait_mean_ms is not None
            every = await call(c.history, start=h.start, end=h.end, step=3_600_000)
            assert every.queue is None and len(every.points) == 1  # the hour, one step
            assert sum(p.submitted for p in every.points) == 1
            with pytest.raises(BadRequest, match="step"):
                await call(c.history, step=90_000)
