"""Helpers for the client, blocking-client, worker and embedded-mode tests.

- ``start_server``: a real server on 127.0.0.1 (port 0, or a given port to restart on the
  same address) that a test can stop gracefully (``stop``) or kill (``kill``: cancelled,
  no grace period, every connection closed at once).
- ``Proxy``: a TCP proxy in front of a server that can cut connections, swallow the bytes
  going one way (a request or a reply "lost in flight"), and stop listening for a while.
- ``wait_until`` / ``wait_for_state``: bounded waits for observable state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import attrs
import pytest
import trio

from relay.client.client import Client, JobView
from relay.server.serve import ServerConfig, ServerHandle, serve
from relay.worker.worker import Worker


class _Running(Protocol):
    handle: ServerHandle


S = TypeVar("S", bound=_Running)  # a running server of some test suite's kind

# Every network wait is bounded: a hang fails the test, never the run.
BOUND_S = 10.0
# Polling interval of the bounded waits for observable state.
POLL_S = 0.02


# -- an in-process server ----------------------------------------------------------------------


@attrs.define
class Server:
    handle: ServerHandle
    config: ServerConfig
    scope: trio.CancelScope
    done: trio.Event

    @property
    def port(self) -> int:
        return self.handle.address[1]

    @property
    def address(self) -> str:
        host, port = self.handle.address
        return f"{host}:{port}"

    async def stop(self) -> None:
        """Graceful shutdown; returns once ``serve`` has returned."""
        self.handle.shutdown()
        with trio.fail_after(BOUND_S):
            await self.done.wait()

    async def metric(self, name: str, **labels: str) -> float:
        """The value of one sample from GET /metrics (0 if absent)."""
        assert self.handle.metrics_address is not None, "start with metrics_port=0"
        with trio.fail_after(BOUND_S):
            stream = await trio.open_tcp_stream(*self.handle.metrics_address)
            async with stream:
                await stream.send_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
                data = b""
                while chunk := await stream.receive_some(65536):
                    data += chunk
        body = data.partition(b"\r\n\r\n")[2].decode()
        selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
        prefix = f"{name}{{{selector}}} " if labels else f"{name} "
        for line in body.splitlines():
            if line.startswith(prefix):
                return float(line[len(prefix) :])
        return 0.0

    async def kill(self) -> None:
        """Cancel the server: no grace period, its connections are closed at once."""
        self.scope.cancel()
        with trio.fail_after(BOUND_S):
            await self.done.wait()


async def start_server(
    nursery: trio.Nursery, db: str, *, port: int = 0, **overrides: Any
) -> Server:
    """Start a server on 127.0.0.1:``port`` (0: any free port); ``overrides`` are
    ``ServerConfig`` fields. No metrics endpoint unless ``metrics_port`` is given."""
    overrides.setdefault("shutdown_timeout_ms", 2000)
    overrides.setdefault("metrics_port", None)
    config = ServerConfig(db=db, host="127.0.0.1", port=port, **overrides)
    scope = trio.CancelScope()
    done = trio.Event()

    async def run(task_status: trio.TaskStatus[ServerHandle]) -> None:
        try:
            with scope:
                await serve(config, task_status=task_status)
        finally:
            done.set()

    with trio.fail_after(BOUND_S):
        handle = await nursery.start(run)
    return Server(handle, config, scope, done)


@asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[Worker]:
    """Run ``worker`` for the block; stop it (gracefully) and wait for it, bounded."""
    with trio.fail_after(BOUND_S + worker.shutdown_timeout):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            try:
                yield worker
            finally:
                worker.stop()


@asynccontextmanager
async def serving(start: Callable[[trio.Nursery, str], Awaitable[S]], db: str) -> AsyncIterator[S]:
    """A server that ``start`` starts on ``db`` for the block; shut down gracefully after."""
    async with trio.open_nursery() as nursery:
        running = await start(nursery, db)
        try:
            yield running
        finally:
            running.handle.shutdown()


@pytest.fixture
async def server(tmp_path) -> AsyncIterator[Server]:
    """A server for the client, blocking-client and worker tests (tests/server and
    tests/cli share another, tests.server.conftest.line_server, for the line client)."""
    async with serving(start_server, str(tmp_path / "relay.db")) as running:
        yield running


# -- a TCP proxy that can lose things ----------------------------------------------------------


class Proxy:
    """Forwards 127.0.0.1:``port`` to ``upstream``, one upstream connection per client one.

    ``swallow_up`` / ``swallow_down``: drop client->server (requests) or server->client
    (replies) bytes instead of forwarding them; ``swallowed`` is set when that happened.
    ``cut()`` closes every connection; ``pause()`` also stops listening (connections are
    refused) until ``resume()`` listens again on the same port.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = 0
        self.swallow_up = False
        self.swallow_down = False
        self.swallowed = trio.Event()
        self.accepted = 0
        self._pairs: set[trio.CancelScope] = set()
        self._listening: trio.CancelScope | None = None
        self._not_listening = trio.Event()
        self._nursery: trio.Nursery | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        await self._listen()

    async def _listen(self) -> None:
        assert self._nursery is not None
        listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        scope = self._listening = trio.CancelScope()
        self._not_listening = trio.Event()
        await self._nursery.start(self._accept_loop, listeners, scope, self._not_listening)

    async def _accept_loop(
        self,
        listeners: list[trio.SocketListener],
        scope: trio.CancelScope,
        closed: trio.Event,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        assert self._nursery is not None
        try:
            with scope:
                task_status.started()
                while True:
                    stream = await listeners[0].accept()
                    self.accepted += 1
                    self._nursery.start_soon(self._pair, stream)
        finally:
            for listener in listeners:
                await trio.aclose_forcefully(listener)
            closed.set()

    async def _pair(self, down: trio.SocketStream) -> None:
        scope = trio.CancelScope()
        self._pairs.add(scope)
        up: trio.SocketStream | None = None
        try:
            with scope:
                up = await trio.open_tcp_stream(*self.upstream)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, down, up, True, nursery.cancel_scope)
                    nursery.start_soon(self._pump, up, down, False, nursery.cancel_scope)
        finally:
            self._pairs.discard(scope)
            await trio.aclose_forcefully(down)
            if up is not None:
                await trio.aclose_forcefully(up)

    async def _pump(
        self, src: trio.SocketStream, dst: trio.SocketStream, upward: bool, pair: trio.CancelScope
    ) -> None:
        try:
            while data := await src.receive_some(65536):
                if self.swallow_up if upward else self.swallow_down:
                    self.swallowed.set()
                    continue
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        pair.cancel()  # one side ended: close both

    def swallow(self, *, up: bool = False, down: bool = False) -> trio.Event:
        """Start swallowing; returns the event set once something was swallowed."""
        self.swallowed = trio.Event()
        self.swallow_up, self.swallow_down = up, down
        return self.swallowed

    def cut(self) -> None:
        """Stop swallowing and close every open connection."""
        self.swallow_up = self.swallow_down = False
        for scope in list(self._pairs):
            scope.cancel()

    @property
    def open_connections(self) -> int:
        return len(self._pairs)

    async def pause(self) -> None:
        """Stop listening (new connections are refused), then close every connection."""
        assert self._listening is not None
        self._listening.cancel()
        with trio.fail_after(BOUND_S):
            await self._not_listening.wait()
        self.cut()

    async def resume(self) -> None:
        await self._listen()


# -- bounded waits -----------------------------------------------------------------------------


async def wait_until(
    probe: Callable[[], Awaitable[Any]], within: float = BOUND_S, what: str = "condition"
) -> Any:
    """Call ``probe`` until it returns something truthy; fail after ``within`` seconds."""
    try:
        with trio.fail_after(within):
            while True:
                value = await probe()
                if value:
                    return value
                await trio.sleep(POLL_S)
    except trio.TooSlowError:
        raise AssertionError(f"{what} not reached within {within} s") from None


async def wait_for_state(
    client: Client, job_id: str, *states: str, within: float = BOUND_S
) -> JobView:
    """Inspect ``job_id`` until its state is one of ``states``; return that view."""
    last: list[JobView] = []

    async def probe() -> JobView | None:
        job = await client.inspect(job_id)
        last[:] = [job]
        return job if str(job.state) in states else None

    try:
        return await wait_until(probe, within, f"{job_id} in {states}")
    except AssertionError:
        raise AssertionError(f"{job_id} not in {states} within {within} s: {last}") from None


async def queue_counts(client: Client, queue: str) -> dict[str, int]:
    """The queue's per-state counts (all zeros if the queue has no jobs)."""
    stats = await client.stats()
    zeros = dict.fromkeys(("pending", "ready", "leased", "retrying", "succeeded", "dead"), 0)
    return {**zeros, **stats.queues.get(queue, {})}


class SpyTransport:
    """Wraps a client's transport: records each op's errors, and sets ``refused[op]``
    when one of its requests raised ``error_type`` (e.g. QueueFull). Use as
    ``Client(SpyTransport(client._transport, QueueFull))``."""

    def __init__(self, inner: Any, error_type: type[BaseException]) -> None:
        self.inner = inner
        self.error_type = error_type
        self.refused: dict[str, trio.Event] = {}
        self.errors: list[tuple[str, BaseException]] = []

    def refused_event(self, op: str) -> trio.Event:
        return self.refused.setdefault(op, trio.Event())

    async def request(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self.inner.request(op, fields)
        except self.error_type as exc:
            self.errors.append((op, exc))
            self.refused_event(op).set()
            raise
