"""Embedded mode: a durable work queue inside the caller's trio program, without sockets.

    async with relay.open_local("jobs.db") as queue:
        await queue.submit("email", {"to": "ada@example.com"})
        worker = relay.Worker(queue, queues=["email"], handler=send_email)

``open_local`` runs the same core as the server (store, writer thread, dispatcher,
promoter, reaper, long-polls) and hands out a ``Client`` whose requests go straight to the
dispatcher: one request means exactly what it means over TCP, limits and errors included.

The server's core is imported when a queue is opened, not with this module: ``import relay``
stays free of the server, the stores and their drivers (a web application that only
submits over TCP pays for none of them).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import orjson
import trio

from relay.client.client import Client
from relay.protocol.errors import RelayError, ShuttingDown, reply_fields

if TYPE_CHECKING:  # annotations only: the core is imported by open_local when it runs
    from relay.server.core import Core, ServerConfig


class LocalTransport:
    """A connection to an in-process dispatcher. Each request is one frame, as over TCP."""

    def __init__(self, core: Core) -> None:
        self._core = core
        self._ids = itertools.count(1)
        self._waiting: dict[int, list[Any]] = {}
        self.in_flight = 0
        self.closed = False
        self.can_wait = True
        self.nursery = core.nursery  # the dispatcher's admin tasks (dead retry of a queue)
        self.peer = "local"
        # In-process: the program that opened the queue may do everything.
        from relay.server.requests.auth import Role

        core.dispatcher.access.set_role(self, Role.ADMIN)

    # -- the dispatcher's Connection interface ----------------------------------------------

    def begin_request(self) -> None:
        self.in_flight += 1

    # Each request here has its caller waiting for it: nothing piles up to bound.
    def reserve(self, nbytes: int) -> None:
        pass

    def release(self, nbytes: int) -> None:
        pass

    def reply_room(self) -> int:
        return sys.maxsize

    def still_wanted(self) -> bool:  # the writer thread's question (Session.still_wanted)
        return self.can_wait

    def refuse(self, data: bytes, delay: float) -> None:  # never: it is admin
        self.begin_request()
        self.reply(data)

    def revoke(self) -> None:  # never: it has no token
        pass

    def reply(self, data: bytes) -> None:
        self.in_flight -= 1
        reply = orjson.loads(data)
        slot = self._waiting.pop(reply.get("id"), None)
        if slot is None:
            return
        if slot[2] is not None:  # an orphaned lease: give its jobs back (see request)
            for job in reply.get("jobs") or []:
                self.nursery.start_soon(self._release, job, slot[2])
            return
        slot[1] = reply
        slot[0].set()

    async def _release(self, job: dict[str, Any], worker_id: str) -> None:
        with contextlib.suppress(RelayError):
            await self.request("release", {"job_id": job["job_id"], "worker_id": worker_id,
                                           "token": job["token"]})  # fmt: skip

    def deliver(self, pairs: list[tuple[Any, Any]]) -> None:
        finish = self._core.dispatcher.finish
        now = trio.current_time()
        for item, reply in pairs:
            data = finish(self, item, reply, now)
            if data is not None:
                self.reply(data)

    # -- the client's Transport interface ---------------------------------------------------

    async def request(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        if self.closed:
            raise ShuttingDown("the local queue is closed")
        request_id = next(self._ids)
        slot: list[Any] = [trio.Event(), None, None]  # done, reply, orphaned lease's worker
        self._waiting[request_id] = slot
        try:
            line = orjson.dumps({"op": op, "id": request_id, **fields})
            await self._core.writer.wait_room()
            self._core.dispatcher.dispatch(self, line, trio.current_time())
            await slot[0].wait()
        except trio.Cancelled:
            if op == "lease" and request_id in self._waiting:
                # The dispatcher may still grant it; reply() then releases the jobs.
                slot[2] = fields["worker_id"]
            else:
                self._waiting.pop(request_id, None)
            raise
        return reply_fields(slot[1])


@asynccontextmanager
async def open_local(
    db: str = ":memory:", config: ServerConfig | None = None, **options: Any
) -> AsyncIterator[Client]:
    """Run relay-trio in this process on ``db`` (a file, or ":memory:") and yield a client.

    ``options`` are ``ServerConfig`` fields (e.g. ``max_queue_depth=1000``,
    ``queue_depths={"email": 100}``). Owns the core's tasks and the writer thread: leaving
    the block lets requests in flight finish (bounded by ``shutdown_timeout_ms``), then
    stops the services and closes the database. Exceptions of the body come out as they
    are, not in an exception group.
    """
    from relay.server.core import ServerConfig, open_core

    if config is None:
        config = ServerConfig(db=db, metrics_port=None, **options)
    async with open_core(config) as core:
        transport = LocalTransport(core)
        try:
            yield Client(transport)
        finally:
            transport.closed = True
            transport.can_wait = False
            with trio.CancelScope(shield=True):
                await core.drain(config.shutdown_timeout_ms / 1000)
