"""Coalesced submits and acks (open_client(batch_window_ms=...)) against a real server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from relay import BadRequest, Client, ConnectionLost, StaleToken, SubmitResult, open_client
from relay.client.coalesce import Coalescer
from tests.conftest import answer_hello
from tests.worker.helpers import BOUND_S, Server


class CountingTransport:
    """Records the op of every request that reaches the wire."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ops: list[str] = []

    async def request(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        self.ops.append(op)
        return await self.inner.request(op, fields)


@pytest.fixture
async def batching(server: Server) -> AsyncIterator[tuple[Client, CountingTransport]]:
    """A client whose submits and acks coalesce (a long window: the tests that need it
    to end never wait for it), and the requests it sent."""
    with trio.fail_after(BOUND_S):
        async with open_client(server.address) as plain, trio.open_nursery() as nursery:
            counting = CountingTransport(plain._transport)
            yield Client(counting, Coalescer(counting.request, 30.0, nursery)), counting
            nursery.cancel_scope.cancel()


async def test_submits_made_at_once_go_as_one_batch_and_each_gets_its_own_result(batching):
    client, sent = batching
    results: dict[int, SubmitResult] = {}

    async def one(i: int) -> None:
        results[i] = await client.submit("co", {"i": i})

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(one, i)
    assert sent.ops == ["submit_batch"]
    assert len({r.job_id for r in results.values()}) == 100
    for i, result in results.items():
        assert (await client.inspect(result.job_id)).payload == {"i": i}


async def test_a_lone_submit_waits_for_no_window(batching):
    client, sent = batching
    with trio.fail_after(1):  # the window is 30 s
        result = await client.submit("co", {})
    assert result.job_id.startswith("job_") and sent.ops == ["submit"]


async def test_calls_made_while_a_batch_is_in_flight_do_not_wait_for_the_window(batching):
    client, sent = batching
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(client.submit, "co", {"i": i})
            await trio.testing.wait_all_tasks_blocked()
            # The first ten are in flight: these wait for their answer, not the window.
            for i in range(10, 30):
                nursery.start_soon(client.submit, "co", {"i": i})
    assert sent.ops == ["submit_batch", "submit_batch"]
    assert (await client.stats()).queues["co"]["ready"] == 30


async def test_a_bad_job_fails_alone_and_the_others_are_submitted(batching):
    client, sent = batching
    outcomes: dict[int, Any] = {}

    async def one(i: int) -> None:
        try:
            outcomes[i] = await client.submit("co" if i != 3 else "bad queue!", {"i": i})
        except BadRequest as exc:
            outcomes[i] = exc

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
    assert isinstance(outcomes.pop(3), BadRequest)
    assert all(isinstance(o, SubmitResult) for o in outcomes.values())
    # The refused batch committed nothing; each call then went alone.
    assert sent.ops == ["submit_batch"] + ["submit"] * 6
    assert (await client.stats()).queues["co"]["ready"] == 5


async def test_acks_made_at_once_go_as_one_ack_batch_and_a_stale_one_fails_alone(batching):
    client, sent = batching
    for i in range(5):
        await client.submit("ack", {"i": i})
    jobs = await client.lease(["ack"], "w", count=5)
    sent.ops.clear()
    outcomes: dict[str, Any] = {}

    async def one(job_id: str, token: str) -> None:
        try:
            outcomes[job_id] = await client.ack(job_id, "w", token)
        except StaleToken as exc:
            outcomes[job_id] = exc

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            for n, job in enumerate(jobs):
                nursery.start_soon(one, job.job_id, job.token if n else "0" * 32)
    assert sent.ops == ["ack_batch"]
    assert isinstance(outcomes[jobs[0].job_id], StaleToken)
    assert [outcomes[job.job_id] for job in jobs[1:]] == [None] * 4
    counts = (await client.stats()).queues["ack"]
    assert (counts["succeeded"], counts["leased"]) == (4, 1)


async def test_open_client_with_a_batch_window_coalesces(server):
    with trio.fail_after(BOUND_S):
        async with open_client(server.address, batch_window_ms=5) as client:
            async with trio.open_nursery() as nursery:
                for i in range(50):
                    nursery.start_soon(client.submit, "win", {"i": i})
            assert (await client.stats()).queues["win"]["ready"] == 50


async def test_calls_waiting_or_in_flight_when_the_client_closes_raise_connection_lost():
    """A server that reads and never answers: one submit is in flight, another waits for
    it. Leaving the client's block ends both, and a call made after raises too."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    outcomes: dict[int, Any] = {}

    async def one(client: Client, i: int) -> None:
        try:
            outcomes[i] = await client.submit("co", {"i": i})
        except ConnectionLost as exc:
            outcomes[i] = exc

    async def read_forever() -> None:
        stream = await listeners[0].accept()
        await answer_hello(stream)
        while await stream.receive_some(65536):
            pass

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as server:
            server.start_soon(read_forever)
            async with trio.open_nursery() as callers:
                async with open_client(("127.0.0.1", port), batch_window_ms=30_000) as client:
                    callers.start_soon(one, client, 0)
                    await trio.testing.wait_all_tasks_blocked()
                    callers.start_soon(one, client, 1)  # waits for the first's answer
                    await trio.testing.wait_all_tasks_blocked()
                await one(client, 2)
            server.cancel_scope.cancel()
    assert all(isinstance(outcomes[i], ConnectionLost) for i in range(3)), outcomes
