"""``watch``: job events after commit, filters, unwatch, the cap, lag, roles, clients."""

from __future__ import annotations

import orjson
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import relay
from relay.protocol import wire
from relay.server.requests.auth import Role, Tokens, _digest
from tests.server.conftest import BOUND_S, LineClient, RunningServer
from tests.server.test_lifecycle import http_get
from tests.server.test_protocol import custom_server

W = "watch-worker"


async def next_event(client: LineClient) -> dict:
    """The next line that is an event (replies in between are skipped)."""
    while True:
        line = await client.read_line()
        assert line is not None, "connection closed"
        message = orjson.loads(line)
        if "event" in message:
            return message


async def events_until(client: LineClient, n: int) -> list[dict]:
    return [await next_event(client) for _ in range(n)]


async def start_watch(server: RunningServer, transport: str = "tcp", **filters) -> LineClient:
    watcher = await server.connect_by(transport)
    reply = await watcher.request("watch", **filters)
    assert reply["ok"] is True and set(reply) == {"id", "ok"}, reply
    return watcher


@pytest.mark.parametrize("transport", ["tcp", "websocket"])
async def test_every_change_of_a_jobs_life_arrives_in_order(server, transport):
    watcher = await start_watch(server, transport)
    c = await server.connect()
    backoff = {"kind": "fixed", "delay_ms": 1}
    job_id = (await c.ok("submit", queue="life", payload=1, retries=1, backoff=backoff))["job_id"]
    (job,) = (await c.ok("lease", queues=["life"], worker_id=W))["jobs"]
    await c.ok("fail", job_id=job_id, worker_id=W, token=job["token"], error="once")
    events = await events_until(watcher, 4)  # ready, leased, retrying, ready (promoted)
    (job,) = (await c.ok("lease", queues=["life"], worker_id=W, wait_ms=5000))["jobs"]
    await c.ok("ack", job_id=job_id, worker_id=W, token=job["token"])
    events += await events_until(watcher, 2)
    assert [(e["state"], e["attempt"]) for e in events] == [
        ("ready", 0), ("leased", 1), ("retrying", 1), ("ready", 1), ("leased", 2),
        ("succeeded", 2),
    ]  # fmt: skip
    assert {e["job_id"] for e in events} == {job_id} and {e["queue"] for e in events} == {"life"}
    fields = {"event", "job_id", "queue", "state", "attempt", "at"}
    assert set(events[0]) == fields  # a job just made left no state
    assert all(e["event"] == "job" and set(e) == fields | {"from"} for e in events[1:])
    assert [e["from"] for e in events[1:]] == [e["state"] for e in events[:-1]]
    ats = [e["at"] for e in events]
    assert ats == sorted(ats)
    await watcher.aclose()
    await c.aclose()


async def test_a_job_that_dies_and_is_retried_from_the_dead(server):
    watcher = await start_watch(server)
    c = await server.connect()
    job_id = (await c.ok("submit", queue="d", payload=1, retries=0))["job_id"]
    (job,) = (await c.ok("lease", queues=["d"], worker_id=W))["jobs"]
    await c.ok("fail", job_id=job_id, worker_id=W, token=job["token"], error="no")
    await c.ok("dead_retry", job_id=job_id)
    states = [e["state"] for e in await events_until(watcher, 4)]
    assert states == ["ready", "leased", "dead", "ready"]
    await c.ok("dead_purge", queue="d", all=True)  # nothing is dead: no event either way
    await c.ok("submit", queue="d", payload=2)
    assert (await next_event(watcher))["state"] == "ready"  # the next event is the submit's


async def test_filters_by_queue_and_state_and_a_second_watch_replaces_them(server):
    watcher = await start_watch(server, queues=["a"], states=["leased"])
    c = await server.connect()
    for queue in ("a", "b"):
        await c.ok("submit", queue=queue, payload=1)
    await c.ok("lease", queues=["b"], worker_id=W)
    (job,) = (await c.ok("lease", queues=["a"], worker_id=W))["jobs"]
    event = await next_event(watcher)
    assert (event["queue"], event["state"], event["job_id"]) == ("a", "leased", job["job_id"])
    assert (await watcher.request("watch", queues=["b"]))["ok"] is True
    job_b = (await c.ok("submit", queue="b", payload=2))["job_id"]
    event = await next_event(watcher)
    assert (event["job_id"], event["state"]) == (job_b, "ready")


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"queues": []}, "queues"), ({"states": []}, "states"), ({"states": ["gone"]}, "states[0]"),
     ({"queues": ["bad queue"]}, "queues[0]"), ({"queues": "a"}, "queues"),
     ({"states": [["ready"]]}, "states[0]"), ({"queues": [7]}, "queues[0]")],
)  # fmt: skip
async def test_empty_or_invalid_filters_are_bad_request(client, fields, field):
    error = await client.error("watch", **fields)
    assert error["code"] == "bad_request" and error["message"].startswith(field)


async def test_unwatch_ends_the_events(server):
    watcher = await start_watch(server)
    c = await server.connect()
    await c.ok("submit", queue="u", payload=1)
    assert (await next_event(watcher))["state"] == "ready"
    await watcher.ok("unwatch")
    await c.ok("submit", queue="u", payload=2)
    reply = await watcher.ok("ping")  # after the submit's commit: no event came before it
    assert set(reply) == {"id", "ok"}
    await c.ok("submit", queue="u", payload=3)
    assert (await watcher.ok("stats"))["ok"] is True  # a reply, not an event


async def test_the_watcher_cap_is_advertised_and_enforced(tmp_path):
    limits = wire.Limits(max_watchers=1, max_watch_buffer=7)
    async with custom_server(tmp_path, limits=limits) as server:
        first = await server.connect()
        hello = await first.ok("hello")
        assert hello["limits"]["max_watchers"] == 1
        assert hello["limits"]["max_watch_buffer"] == 7
        await first.ok("watch")
        second = await server.connect()
        assert (await second.error("watch"))["code"] == "overloaded"
        await first.ok("watch", queues=["x"])  # refiltering its own watch is not a second
        await first.aclose()
        with trio.fail_after(BOUND_S):  # the slot comes back once the server sees the close
            while not (await second.request("watch"))["ok"]:  # noqa: ASYNC110
                await trio.sleep(0.01)


async def test_a_watcher_that_never_reads_is_lagged_and_bounded(tmp_path):
    capacity = 50
    limits = wire.Limits(max_watch_buffer=capacity)
    async with custom_server(tmp_path, limits=limits) as server:
        stalled = await start_watch(server)  # and then never reads, for now
        c = await server.connect()
        total = 0
        for _ in range(40):  # 4,000 events of padded jobs: far more than its socket holds
            jobs = [{"queue": "lag", "payload": "x" * 400} for _ in range(100)]
            await c.ok("submit_batch", jobs=jobs)
            total += 100
        status, body = await http_get(server.handle.metrics_address, "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        assert families["relay_watchers"].samples[0].value == 1
        assert families["relay_watch_buffered_events"].samples[0].value <= capacity
        assert (await c.ok("ping"))["ok"] is True  # the others were served all along
        # Now it reads: every event is either delivered or counted in a lagged line.
        delivered = dropped = 0
        with trio.fail_after(BOUND_S):
            while delivered + dropped < total:
                event = await next_event(stalled)
                if event["event"] == "lagged":
                    dropped += event["dropped"]
                else:
                    delivered += 1
        assert delivered + dropped == total and dropped > 0


async def test_with_tokens_watch_needs_the_worker_role(tmp_path):
    producer, worker = "producer-token-watching-1", "worker-token-watching-12"
    tokens = Tokens(((_digest(producer), Role.PRODUCER), (_digest(worker), Role.WORKER)))
    async with custom_server(tmp_path, tokens=tokens) as server:
        p = await server.connect()
        await p.ok("hello", token=producer)
        assert (await p.error("watch"))["code"] == "unauthorized"
        assert (await p.error("unwatch"))["code"] == "unauthorized"
        w = await server.connect()
        await w.ok("hello", token=worker)
        await w.ok("watch")
        await p.ok("submit", queue="t", payload=1)
        assert (await next_event(w))["state"] == "ready"


async def test_the_async_client_watches_as_an_iterator(server):
    host, port = server.handle.address
    async with relay.open_client(f"{host}:{port}") as client:
        events = client.watch(queues=["it"])
        async with events:
            job = await client.submit("it", 1)
            await client.submit("other", 1)
            (leased,) = await client.lease(["it"], W)
            await client.ack(leased.job_id, W, leased.token)
            seen = []
            with trio.fail_after(BOUND_S):
                async for event in events:
                    seen.append((event["job_id"], event["state"]))
                    if len(seen) == 3:
                        break
        assert seen == [(job.job_id, "ready"), (job.job_id, "leased"),
                        (job.job_id, "succeeded")]  # fmt: skip
        assert (await client.stats()).queues["it"]["succeeded"] == 1  # the client goes on


@pytest.mark.parametrize("transport", ["tcp", "websocket"])
async def test_shutdown_with_open_watchers_ends_within_the_grace_period(tmp_path, transport):
    from tests.server.conftest import start_server

    grace_s = 2.0
    async with trio.open_nursery() as nursery:
        server = await start_server(
            nursery, str(tmp_path / "relay.db"), shutdown_timeout_ms=int(grace_s * 1000)
        )
        watcher = await start_watch(server, transport)
        c = await server.connect()
        await c.ok("submit", queue="s", payload=1)
        assert (await next_event(watcher))["state"] == "ready"
        started = trio.current_time()
        server.handle.shutdown()
        assert await watcher.at_eof()  # the server closed it
        # Serving ends (the nursery exits) within the grace period and the closing.
    assert trio.current_time() - started < grace_s + 1.5


@pytest.mark.parametrize("reconnect", [True, False])
@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_the_async_clients_watch_ends_with_connection_lost_when_the_server_goes(
    tmp_path, reconnect, how
):
    """The watch ends with its connection: its iterator raises ConnectionLost at once,
    whether the client reconnects (the server's watch did not survive) or not. It used to
    wait forever."""
    from tests.worker.helpers import start_server

    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        async with relay.open_client(server.address, reconnect=reconnect) as client:
            events = client.watch()
            async with events:
                await client.submit("w", 1)
                with trio.fail_after(BOUND_S):
                    assert (await anext(events))["state"] == "ready"
                    await (server.stop() if how == "stop" else server.kill())
                    with pytest.raises(relay.ConnectionLost):
                        await anext(events)
