"""The clients against a server with access control: open_client, the blocking client and
the Worker say hello with their token on every connection (also after a server restart),
and a token the server refuses is an Unauthorized error, never a hang. Real sockets on
127.0.0.1; every wait is bounded."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from relay import (
    JobState,
    LeasedJob,
    Unauthorized,
    Worker,
    connect,
    open_client,
    open_local,
)
from relay.server.requests.auth import Tokens, load_tokens
from tests.worker.helpers import BOUND_S, Server, running, start_server, wait_for_state

PRODUCER = "producer-token-0123456789"
WORKER = "worker-token-0123456789ab"
ADMIN = "admin-token-0123456789abcd"
WRONG = "wrong-token-0123456789abcdef"


def make_tokens(tmp_path: Path, text: str | None = None, name: str = "tokens") -> Tokens:
    path = tmp_path / name
    path.write_text(text or f"producer {PRODUCER}\nworker {WORKER}\nadmin {ADMIN}\n")
    tokens = load_tokens(str(path), None)
    assert tokens is not None
    return tokens


@pytest.fixture
def tokens(tmp_path) -> Tokens:
    return make_tokens(tmp_path)


@pytest.fixture
async def authed(tmp_path, tokens) -> AsyncIterator[Server]:
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"), tokens=tokens)
        yield server
        server.handle.shutdown()


def leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """One blocking call in a thread, bounded."""
    with trio.fail_after(BOUND_S):
        return await trio.to_thread.run_sync(
            functools.partial(fn, *args, **kwargs), abandon_on_cancel=True
        )


# -- open_client -----------------------------------------------------------------------------


async def test_open_client_with_a_token_works(authed):
    with trio.fail_after(BOUND_S):
        async with open_client(authed.address, token=PRODUCER) as client:
            submitted = await client.submit("q", {"n": 1})
            assert submitted.state == JobState.READY
            assert (await client.inspect(submitted.job_id)).payload == {"n": 1}
            assert (await client.stats()).queues["q"]["ready"] == 1
            await client.ping()


async def test_hello_on_a_tokened_connection_keeps_it(authed):
    with trio.fail_after(BOUND_S):
        async with open_client(authed.address, token=PRODUCER) as client:
            hello = await client.hello("my-app")
            assert hello.server == "relay-trio"
            await client.hello()
            await client.submit("q", 1)
            assert client._transport.connections == 1  # never dropped, never reconnected


async def test_open_client_with_a_wrong_token_raises_unauthorized_at_once(authed):
    with trio.fail_after(BOUND_S), pytest.raises(Unauthorized):
        async with open_client(authed.address, token=WRONG):
            pytest.fail("opened with a wrong token")


async def test_open_client_without_a_token_is_refused_at_its_hello(authed):
    """Every connection begins with a hello: without a token, open_client fails there, not
    at the first call."""
    with trio.fail_after(BOUND_S), pytest.raises(Unauthorized, match="must come first"):
        async with open_client(authed.address, reconnect=False):
            pass


async def test_a_worker_token_may_lease_and_a_producer_token_may_not(authed):
    with trio.fail_after(BOUND_S):
        async with open_client(authed.address, token=PRODUCER) as producer:
            await producer.submit("q", 1)
            with pytest.raises(Unauthorized):
                await producer.lease(["q"], "w")
            await producer.ping()  # still connected
        async with open_client(authed.address, token=WORKER) as worker:
            (job,) = await worker.lease(["q"], "w")
            await worker.ack(job.job_id, "w", job.token)


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_the_client_says_hello_again_after_a_server_restart(tmp_path, tokens, how):
    db = str(tmp_path / "relay.db")
    async with trio.open_nursery() as nursery:
        first = await start_server(nursery, db, tokens=tokens)
        async with open_client(first.address, token=PRODUCER) as client:
            kept = await client.submit("rs", {"kept": True})
            await (first.stop() if how == "stop" else first.kill())
            second = await start_server(nursery, db, port=first.port, tokens=tokens)
            with trio.fail_after(BOUND_S):
                again = await client.submit("rs", {"after": True})
                assert again.state == JobState.READY
                assert (await client.inspect(kept.job_id)).payload == {"kept": True}
            assert client._transport.connections == 2
        await second.stop()


async def test_a_token_refused_after_a_restart_is_unauthorized_not_a_hang(tmp_path, tokens):
    db = str(tmp_path / "relay.db")
    others = make_tokens(tmp_path, f"admin {ADMIN}\n", name="others")
    async with trio.open_nursery() as nursery:
        first = await start_server(nursery, db, tokens=tokens)
        async with open_client(first.address, token=PRODUCER) as client:
            await client.ping()
            await first.stop()
            second = await start_server(nursery, db, port=first.port, tokens=others)
            with trio.fail_after(BOUND_S), pytest.raises(Unauthorized):
                await client.submit("rs", {})
        await second.stop()


# -- the blocking client ----------------------------------------------------------------------


async def test_blocking_client_with_a_token_works(authed):
    with connect(authed.address, token=PRODUCER, timeout=5) as client:
        submitted = await call(client.submit, "q", {"n": 2})
        assert submitted.state == JobState.READY
        assert (await call(client.stats)).queues["q"]["ready"] == 1
        # A hello on the connection brings the token: the connection stays and keeps its role.
        reply = await call(client.request, "hello", client="blocking")
        assert reply["role"] == "producer"
        assert (await call(client.inspect, submitted.job_id)).payload == {"n": 2}


@pytest.mark.parametrize("token", [WRONG, None])
async def test_blocking_client_without_a_valid_token_raises_unauthorized(authed, token):
    with connect(authed.address, token=token, timeout=5) as client:
        with pytest.raises(Unauthorized):
            await call(client.stats)
        with pytest.raises(Unauthorized):
            await call(client.submit, "q", 1)
    with connect(authed.address, token=ADMIN, timeout=5) as admin:
        assert (await call(admin.stats)).queues == {}


async def test_blocking_client_says_hello_again_after_a_server_restart(tmp_path, tokens):
    db = str(tmp_path / "relay.db")
    async with trio.open_nursery() as nursery:
        first = await start_server(nursery, db, tokens=tokens)
        with connect(first.address, token=PRODUCER, timeout=5) as client:
            await call(client.submit, "rs", 1)
            await first.stop()
            second = await start_server(nursery, db, port=first.port, tokens=tokens)
            assert (await call(client.submit, "rs", 2)).state == JobState.READY
            assert (await call(client.stats)).queues["rs"]["ready"] == 2
        await second.stop()


# -- the worker -------------------------------------------------------------------------------


async def test_worker_with_a_worker_token_processes_jobs(authed):
    async def handler(job: LeasedJob) -> dict[str, Any]:
        return {"double": job.payload * 2}

    async with open_client(authed.address, token=PRODUCER) as producer:
        ids = [(await producer.submit("q", n)).job_id for n in (1, 2, 3)]
        worker = Worker(authed.address, token=WORKER, queues=["q"], handler=handler,
                        shutdown_timeout=1.0)  # fmt: skip
        async with running(worker):
            views = [await wait_for_state(producer, job_id, "succeeded") for job_id in ids]
        assert [v.result for v in views] == [{"double": 2}, {"double": 4}, {"double": 6}]
        assert worker.statistics().succeeded == 3


async def test_worker_with_a_wrong_token_fails_to_start(authed):
    async def handler(job: LeasedJob) -> None:
        pytest.fail("ran a job")

    worker = Worker(authed.address, token=WRONG, queues=["q"], handler=handler)
    with trio.fail_after(BOUND_S), pytest.raises((Unauthorized, BaseExceptionGroup)) as caught:
        await worker.run()
    assert any(isinstance(leaf, Unauthorized) for leaf in leaves(caught.value)), caught.value


async def test_worker_with_a_client_and_a_token_is_a_value_error(tmp_path):
    async with open_local(str(tmp_path / "local.db")) as client:
        with pytest.raises(ValueError, match="token"):
            Worker(client, token=WORKER, queues=["q"], handler=lambda job: None)
