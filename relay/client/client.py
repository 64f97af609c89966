"""The async client: typed calls over one pipelined connection, reconnecting when needed.

    async with relay.open_client("127.0.0.1:7400") as client:
        result = await client.submit("email", {"to": "ada@example.com"})

Every call sends one request and awaits its reply, matched by id; many calls may be in
flight at once on the one connection. Error replies raise the exception of their code
(``StaleToken``, ``LeaseExpired``, ``JobNotFound``, ``BadRequest``...), never an exception
group. When the connection drops, a call in flight raises ``ConnectionLost`` (it may or
may not have taken effect) — except ``ack``, ``ack_batch``, ``renew`` and ``release``,
which are safe to repeat and are sent again on the new connection. New calls wait for the
reconnection, with exponential backoff bounded by ``reconnect_timeout``.

An ``unavailable`` reply (the server could not commit: its disk is full, or failing; nothing
was kept) is retried with backoff by the calls that are safe to repeat (``ack``,
``ack_batch``, ``renew``, ``release``, and a ``submit`` or ``submit_batch`` whose jobs all
have an idempotency key), within the caller's deadline; the others raise ``Unavailable``.

Here: ``Client``'s calls and their retries, ``job_fields`` and ``open_client``, which owns
the transport's tasks. What the calls return is in relay/client/replies.py, a watch's stream of
events in relay/client/events.py, the TCP transport in relay/client/tcp.py, addresses and TLS in
relay/client/tls.py.
"""

from __future__ import annotations

import functools
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, Protocol

import trio

from relay.client.coalesce import Coalescer
from relay.client.events import EventStream
from relay.client.replies import (
    DeadPage,
    Hello,
    History,
    HistoryPoint,
    JobsPage,
    JobSummary,
    JobView,
    LeasedJob,
    QueueConfig,
    QueueInfo,
    QueuePage,
    ScheduleInfo,
    SchedulePage,
    ServerInfo,
    Stats,
    WorkerInfo,
    WorkersPage,
    config_fields,
    history_fields,
    history_reply,
    stats_reply,
    structure_reply,
    submit_result,
)
from relay.client.tcp import CONNECT_TIMEOUT_S, RECONNECT_TIMEOUT_S, TcpTransport, client_name
from relay.client.tls import TLS_SCHEME, client_context, parse_address, uses_tls
from relay.protocol.errors import (
    InternalError,
    QueueFull,
    RelayError,
    Unavailable,
    error_from_wire,
)
from relay.protocol.model import FailOutcome, JobState, SubmitResult
from relay.util.nursery import open_service_nursery

DEFAULT_ADDRESS = "127.0.0.1:7400"
# submit(wait=True) backoff while the queue is full.
QUEUE_FULL_FIRST_S = 0.05
QUEUE_FULL_CAP_S = 2.0
# Retries of ``unavailable``: a full disk is freed by an operator or a retention prune, in
# seconds or minutes, so waits grow quickly to a second, and stay there (the caller's
# deadline, if any, bounds the whole).
UNAVAILABLE_FIRST_S = 0.05
UNAVAILABLE_CAP_S = 1.0


class Transport(Protocol):
    async def request(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        """Send one request; return the reply's fields, or raise its error."""
        ...


class Client:
    """Typed calls on a transport (TCP, or in-process for ``open_local``). With a
    ``coalescer`` (``open_client(batch_window_ms=...)``), submits and acks that tasks make
    at once go out as one request each (relay/client/coalesce.py)."""

    def __init__(self, transport: Transport, coalescer: Coalescer | None = None) -> None:
        self._transport = transport
        self._coalescer = coalescer

    async def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        return await self._transport.request(op, {k: v for k, v in fields.items() if v is not None})

    async def _retrying(self, send: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any:
        """``await send(*args, **kw)``, sent again while the server answers ``unavailable``
        (nothing was committed; the caller knows a repeat is safe): after 50 ms, doubling
        to 1 s, with jitter. A wait that would reach the caller's deadline
        (``trio.current_effective_deadline()``) is not begun: the ``Unavailable`` is raised.
        """
        delay = UNAVAILABLE_FIRST_S
        while True:
            try:
                return await send(*args, **kw)
            except Unavailable:
                wait = delay * random.uniform(0.5, 1.0)
                if trio.current_time() + wait >= trio.current_effective_deadline():
                    raise
            await trio.sleep(wait)
            delay = min(delay * 2, UNAVAILABLE_CAP_S)

    def watch(
        self, queues: Sequence[str] | None = None, states: Sequence[str] | None = None
    ) -> EventStream:
        """Job events, as an async iterator of dicts: ``{"event": "job", "job_id",
        "queue", "state", "attempt", "at", "from"?}`` for each state change of a job of ``queues``
        in ``states`` (None: all), after its commit; ``{"event": "lagged", "dropped": N}``
        where N were lost because this client read too slowly. It ends with
        ``ConnectionLost`` if the connection drops (watch again to go on). Use it as
        ``async with client.watch(...) as events:`` to end the watch on the server as the
        block ends; one watch per client at a time."""
        fields = {"queues": list(queues) if queues is not None else None,
                  "states": list(states) if states is not None else None}  # fmt: skip
        return EventStream(self._call, self._transport, fields)

    async def hello(self, client: str | None = None) -> Hello:
        """Say hello again (the server's limits, this connection's role); ``client`` names
        this process in the server's workers list (default: as each connection's first
        hello does, ``tcp.client_name``)."""
        reply = await self._call("hello", client=client if client is not None else client_name())
        return structure_reply(reply, Hello)

    async def ping(self) -> None:
        await self._call("ping")

    async def submit(
        self,
        queue: str,
        payload: Any,
        *,
        priority: str | None = None,
        delay_ms: int | None = None,
        run_at: int | None = None,
        retries: int | None = None,
        backoff: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        unique_key: str | None = None,
        unique_for: str | None = None,
        timeout_ms: int | None = None,
        wait: bool = False,
    ) -> SubmitResult:
        """Create a job. With ``wait``, a full queue (``QueueFull``) is retried with backoff
        until it has room; without, ``QueueFull`` is raised. With an ``idempotency_key``,
        ``Unavailable`` is retried too (a repeat cannot make a second job). With a
        ``unique_key``, the queue's job holding that key (while unfinished, or with
        ``unique_for="queued"`` while not yet leased) is answered as a duplicate. With
        ``timeout_ms``, an attempt may run that long: ``relay.Worker`` cancels the handler
        then, and the server ends the lease soon after."""
        job = job_fields(
            queue, payload, priority=priority, delay_ms=delay_ms, run_at=run_at,
            retries=retries, backoff=backoff, idempotency_key=idempotency_key,
            unique_key=unique_key, unique_for=unique_for, timeout_ms=timeout_ms,
        )  # fmt: skip
        send = None if self._coalescer is None else self._coalescer.submit
        reply = await self._while_full(wait, "submit", job, send, idempotency_key is not None)
        return submit_result(reply)

    async def submit_batch(
        self, jobs: Sequence[dict[str, Any]], *, wait: bool = False
    ) -> list[SubmitResult]:
        """Create many jobs, all or none. Build each with ``job_fields``. ``Unavailable``
        is retried if every job has an idempotency key."""
        keyed = all(job.get("idempotency_key") is not None for job in jobs)
        reply = await self._while_full(wait, "submit_batch", {"jobs": list(jobs)}, None, keyed)
        return [submit_result(r) for r in reply["results"]]

    async def _while_full(
        self, wait: bool, op: str, fields: dict[str, Any], send: Any, retry: bool
    ) -> dict[str, Any]:
        delay = QUEUE_FULL_FIRST_S
        if send is None:
            send = functools.partial(self._transport.request, op)
        if retry:
            send = functools.partial(self._retrying, send)
        while True:
            try:
                return await send(fields)
            except QueueFull:
                if not wait:
                    raise
            await trio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, QUEUE_FULL_CAP_S)

    async def lease(
        self,
        queues: Sequence[str],
        worker_id: str,
        *,
        count: int = 1,
        lease_ms: int | None = None,
        wait_ms: int | None = None,
    ) -> list[LeasedJob]:
        reply = await self._call(
            "lease", queues=list(queues), worker_id=worker_id, count=count,
            lease_ms=lease_ms, wait_ms=wait_ms,
        )  # fmt: skip
        return [structure_reply(job, LeasedJob) for job in reply["jobs"]]

    async def renew(
        self, job_id: str, worker_id: str, token: str, *, lease_ms: int | None = None
    ) -> int:
        reply = await self._retrying(
            self._call, "renew", job_id=job_id, worker_id=worker_id, token=token,
            lease_ms=lease_ms,
        )  # fmt: skip
        return reply["lease_expires_at"]

    async def ack(self, job_id: str, worker_id: str, token: str, result: Any = None) -> None:
        if self._coalescer is None:
            await self._retrying(
                self._call, "ack", job_id=job_id, worker_id=worker_id, token=token, result=result
            )
            return
        item = {"job_id": job_id, "token": token}
        if result is not None:
            item["result"] = result
        await self._retrying(self._coalescer.ack, worker_id, item)

    async def ack_batch(
        self, worker_id: str, acks: Sequence[tuple[str, str] | tuple[str, str, Any]]
    ) -> list[RelayError | None]:
        """Ack many jobs of ``worker_id`` in one request (``ack_batch``, an extension):
        ``acks`` holds (job_id, token) or (job_id, token, result). Each ack has its own
        outcome, in order: None when it succeeded, else the error that refused it (as
        ``ack`` would have raised it). A malformed request raises."""
        items = []
        for job_id, token, *rest in acks:
            item = {"job_id": job_id, "token": token}
            if rest and rest[0] is not None:
                item["result"] = rest[0]
            items.append(item)
        reply = await self._retrying(self._call, "ack_batch", worker_id=worker_id, acks=items)
        if len(reply["results"]) != len(items):
            raise InternalError(f"ack_batch: {len(items)} acks, {len(reply['results'])} results")
        return [
            None if r["ok"] else error_from_wire(r["error"]["code"], r["error"]["message"])
            for r in reply["results"]
        ]

    async def fail(
        self,
        job_id: str,
        worker_id: str,
        token: str,
        error: str,
        *,
        retryable: bool = True,
        traceback: str | None = None,
    ) -> FailOutcome:
        """Record a failed attempt; ``traceback`` (an extension) is kept beside the error,
        its end if it is long (the server's ``max_traceback_bytes``, 8 KiB by default)."""
        reply = await self._call(
            "fail", job_id=job_id, worker_id=worker_id, token=token, error=error,
            retryable=retryable, traceback=traceback,
        )  # fmt: skip
        return FailOutcome(JobState(reply["state"]), reply.get("retry_at"))

    async def release(self, job_id: str, worker_id: str, token: str) -> None:
        await self._retrying(self._call, "release", job_id=job_id, worker_id=worker_id, token=token)

    async def inspect(self, job_id: str, *, prefix: bool = False) -> JobView:
        """One job. With ``prefix`` (an extension), ``job_id`` may be abbreviated, "job_"
        and 7 to 16 of its hex digits, as ``relay-trio dead list`` shows it: the one job
        whose id begins so (``JobView.job_id`` is the whole id). No such job raises
        ``JobNotFound``; several, or a malformed abbreviation, ``BadRequest``."""
        reply = await self._call("inspect", job_id=job_id, prefix=prefix or None)
        return structure_reply(reply["job"], JobView)

    async def short_ids(self, job_ids: Sequence[str]) -> list[str]:
        """Each of ``job_ids`` (whole ids, at most the server's ``max_batch``), in order, as
        its shortest start, "job_" and 7 hex digits at least, that no other job's id
        begins with now, as git abbreviates a hash: what ``inspect(..., prefix=True)``
        takes back while no job that shares it is made. An id of no job comes back whole.
        An extension (``short_ids``): an older server raises ``UnknownOp``."""
        if not job_ids:
            return []
        reply = await self._call("short_ids", job_ids=list(job_ids))
        return reply["short_ids"]

    async def stats(
        self,
        *,
        oldest_ready: bool = False,
        queues: Sequence[str] | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Stats:
        """Jobs per queue and state: a page of at most ``limit`` queues by name (the
        server's default and most: 1,000) after ``cursor`` (the ``next_cursor`` of the page
        before), or only ``queues``; with ``oldest_ready``, how long each one's oldest ready
        job has waited."""
        reply = await self._call(
            "stats",
            oldest_ready=oldest_ready or None,
            queues=None if queues is None else list(queues),
            limit=limit,
            cursor=cursor,
        )
        return stats_reply(reply)

    async def dead_list(
        self,
        queue: str | None = None,
        *,
        limit: int | None = None,
        cursor: str | None = None,
        order: Literal["oldest", "newest"] | None = None,
    ) -> DeadPage:
        """A page of dead jobs by job id: oldest first (the default) or ``order="newest"``;
        pass its ``next_cursor`` as ``cursor`` (with the same order) for the next page."""
        reply = await self._call("dead_list", queue=queue, limit=limit, cursor=cursor, order=order)
        return structure_reply(reply, DeadPage)

    async def dead_retry(
        self,
        job_id: str | None = None,
        *,
        queue: str | None = None,
        all: bool = False,
        states: Sequence[str] | None = None,
    ) -> int:
        """Make one job, or every job of ``queue`` (with ``all=True``), in ``states`` (of
        dead, cancelled; None: dead) ready again with fresh attempts; return how many.
        ``states`` is an extension (with ``job_id`` too)."""
        reply = await self._call(
            "dead_retry",
            job_id=job_id,
            queue=queue,
            all=all or None,
            states=None if states is None else list(states),
        )
        return reply["count"]

    async def dead_purge(
        self,
        job_id: str | None = None,
        *,
        queue: str | None = None,
        all: bool = False,
        states: Sequence[str] | None = None,
    ) -> int:
        """Delete one job, or every job of ``queue`` (with ``all=True``), in ``states`` (of
        dead, succeeded, cancelled; None: dead); return how many. Idempotency keys stay
        until they expire. ``states`` is an extension (with ``job_id`` too)."""
        reply = await self._call(
            "dead_purge",
            job_id=job_id,
            queue=queue,
            all=all or None,
            states=None if states is None else list(states),
        )
        return reply["count"]

    async def reload(self) -> dict[str, Any]:
        """Have the server read its token file and TLS certificate and key again (role
        admin). Returns the reply's fields: ``tokens``, ``tls``, ``closing``, ``grace_ms``
        and ``errors`` (one line per file that could not be used, which changed nothing).
        An extension: an older server raises ``UnknownOp``."""
        return await self._call("reload")

    async def jobs_list(
        self,
        queue: str | None = None,
        *,
        states: Sequence[str] | None = None,
        search: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        order: Literal["oldest", "newest"] | None = None,
    ) -> JobsPage:
        """A page of jobs in ``states`` (None: every state), of ``queue`` or of all, by
        job id: newest first (the default) or ``order="oldest"``; pass its
        ``next_cursor`` as ``cursor`` (with the same order) for the next page, until it is
        None: a page may hold fewer than ``limit`` jobs, even none, while more follow (a
        page reads a bounded number of jobs). ``search``:
        the start of a job id, or with ``queue`` of an idempotency or unique key. Items
        carry no payload (``inspect`` has it). An extension: an older server raises
        ``UnknownOp``."""
        reply = await self._call(
            "jobs_list",
            queue=queue,
            states=None if states is None else list(states),
            search=search,
            limit=limit,
            cursor=cursor,
            order=order,
        )
        return structure_reply(reply, JobsPage)

    async def promote(self, job_id: str) -> JobState:
        """Make a pending (delayed) or retrying job ready now (role admin); return the
        state it was in. Any other state raises ``InvalidState``. An extension."""
        return JobState((await self._call("promote", job_id=job_id))["was"])

    async def queue_pause(self, queue: str) -> bool:
        """Pause ``queue``: it takes submits, but no lease takes its jobs until it is
        resumed (role admin). Returns True (paused). An extension: an older server raises
        ``UnknownOp``."""
        return (await self._call("queue_pause", queue=queue))["paused"]

    async def queue_resume(self, queue: str) -> bool:
        """Resume ``queue``: its ready jobs are leased again (role admin). Returns False
        (not paused)."""
        return (await self._call("queue_resume", queue=queue))["paused"]

    async def queue_list(
        self,
        *,
        limit: int | None = None,
        cursor: str | None = None,
        queues: Sequence[str] | None = None,
    ) -> QueuePage:
        """A page of at most ``limit`` queues by name (the server's default and most:
        1,000), those with jobs or settings, after ``cursor`` (the ``next_cursor`` of the
        page before); or the ``queues`` named, with or without jobs: each with its
        settings and its jobs per state."""
        named = None if queues is None else list(queues)
        reply = await self._call("queue_list", limit=limit, cursor=cursor, queues=named)
        return structure_reply(reply, QueuePage)

    async def queue_config(self, queue: str, **settings: Any) -> QueueConfig:
        """Set some of ``queue``'s settings (role admin), each a keyword of
        ``QUEUE_SETTINGS``: ``max_leased=5``, ``rate={"limit": 100, "period_ms": 1000}``,
        ``default_timeout_ms``, ``default_retries``, ``default_backoff`` (as ``submit``'s),
        ``paused``; None clears one, one not given stays. Returns them all; with none
        given, reads them. An extension: an older server raises ``UnknownOp``."""
        reply = await self._transport.request("queue_config", config_fields(queue, settings))
        return structure_reply(reply, QueueConfig)

    async def cancel(self, job_id: str) -> JobState:
        """Cancel one job that has not finished (an extension op); return the state it was
        in. A leased job needs an admin token: its worker's next renew, ack or fail is
        refused with ``Cancelled``. A finished job raises ``InvalidState``."""
        reply = await self._call("cancel", job_id=job_id)
        return JobState(reply["was"])

    async def cancel_queue(self, queue: str, *, states: Sequence[str] | None = None) -> int:
        """Cancel every job of ``queue`` in ``states`` (of pending, ready, retrying, leased;
        None: the first three, the jobs that have not started); return how many. Needs an
        admin token; the server works in bounded transactions."""
        reply = await self._call(
            "cancel", queue=queue, all=True, states=None if states is None else list(states)
        )
        return reply["cancelled"]

    async def schedule_put(
        self,
        name: str,
        cron: str,
        queue: str,
        payload: Any,
        *,
        timezone: str | None = None,
        priority: str | None = None,
        retries: int | None = None,
        backoff: dict[str, Any] | None = None,
        timeout_ms: int | None = None,
        catch_up: str | None = None,
        catch_up_max: int | None = None,
    ) -> ScheduleInfo:
        """Create or replace the schedule ``name`` (role admin): a job on ``queue`` with
        ``payload`` at each slot of ``cron`` in ``timezone`` (default UTC). ``catch_up``:
        "latest" (default), "none" or "all" (at most ``catch_up_max``) of the slots missed
        while no server ran. An extension: an older server raises ``UnknownOp``."""
        fields = schedule_fields(
            name, cron, queue, payload, timezone=timezone, priority=priority,
            retries=retries, backoff=backoff, timeout_ms=timeout_ms, catch_up=catch_up,
            catch_up_max=catch_up_max,
        )  # fmt: skip
        reply = await self._call("schedule_put", **fields)
        return structure_reply(reply["schedule"], ScheduleInfo)

    async def schedule_delete(self, name: str) -> None:
        """Delete the schedule ``name`` (role admin); its jobs stay. ``NotFound`` if none."""
        await self._call("schedule_delete", name=name)

    async def schedule_pause(self, name: str) -> ScheduleInfo:
        """Pause the schedule ``name``: no slot runs until it is resumed (role admin)."""
        return structure_reply((await self._call("schedule_pause", name=name))["schedule"],
                               ScheduleInfo)  # fmt: skip

    async def schedule_resume(self, name: str) -> ScheduleInfo:
        """Resume the schedule ``name`` from its first slot after now (role admin)."""
        return structure_reply((await self._call("schedule_resume", name=name))["schedule"],
                               ScheduleInfo)  # fmt: skip

    async def schedule_list(
        self, *, limit: int | None = None, cursor: str | None = None
    ) -> SchedulePage:
        """A page of schedules by name after ``cursor`` (the ``next_cursor`` of the page
        before), at most ``limit`` (the server's default and most: 1,000)."""
        reply = await self._call("schedule_list", limit=limit, cursor=cursor)
        return structure_reply(reply, SchedulePage)

    async def workers_list(
        self, *, limit: int | None = None, cursor: str | None = None
    ) -> WorkersPage:
        """A page of the connected workers of the server this client talks to (role
        worker), at most ``limit`` (the server's default and most: 100) after ``cursor``
        (the ``next_cursor`` of the page before); ``server`` names that server. An
        extension: an older server raises ``UnknownOp``."""
        reply = await self._call("workers_list", limit=limit, cursor=cursor)
        return structure_reply(reply, WorkersPage)

    async def history(
        self,
        queue: str | None = None,
        *,
        start: int | None = None,
        end: int | None = None,
        step: int | None = None,
    ) -> History:
        """What the jobs of ``queue`` (None: every queue) did per ``step`` ms (a multiple of
        60,000; default a minute) from ``start`` to ``end`` (ms since the epoch; default: the
        60 steps to now): at most 1,440 points (role producer)."""
        reply = await self._call("history", **history_fields(queue, start, end, step))
        return history_reply(reply)


def schedule_fields(name: str, cron: str, queue: str, payload: Any, **optional: Any) -> dict:
    """A schedule_put's fields as the wire wants them (the ones given)."""
    fields: dict[str, Any] = {"name": name, "cron": cron, "queue": queue, "payload": payload}
    fields.update((k, v) for k, v in optional.items() if v is not None)
    return fields


def job_fields(
    queue: str,
    payload: Any,
    *,
    priority: str | None = None,
    delay_ms: int | None = None,
    run_at: int | None = None,
    retries: int | None = None,
    backoff: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    unique_key: str | None = None,
    unique_for: str | None = None,
    timeout_ms: int | None = None,
) -> dict[str, Any]:
    """One job of a submit or submit_batch, as the wire wants it."""
    job: dict[str, Any] = {"queue": queue, "payload": payload}
    optional = {
        "priority": priority,
        "delay_ms": delay_ms,
        "run_at": run_at,
        "retries": retries,
        "backoff": backoff,
        "idempotency_key": idempotency_key,
        "unique_key": unique_key,
        "unique_for": unique_for,
        "timeout_ms": timeout_ms,
    }
    job.update((k, v) for k, v in optional.items() if v is not None)
    return job


@asynccontextmanager
async def open_client(
    address: str | tuple[str, int] = DEFAULT_ADDRESS,
    *,
    reconnect: bool = True,
    connect_timeout: float = CONNECT_TIMEOUT_S,
    reconnect_timeout: float = RECONNECT_TIMEOUT_S,
    batch_window_ms: float | None = None,
    token: str | None = None,
    tls_ca: str | None = None,
) -> AsyncIterator[Client]:
    """Connect to a relay-trio server and yield a ``Client``.

    Calls that tasks make in one scheduler tick always go out in one write. With
    ``batch_window_ms``, a submit (or an ack) also waits up to that long for others: those
    made meanwhile go as one ``submit_batch`` (``ack_batch`` per worker), each caller still
    getting its own result or error (relay/client/coalesce.py). It trades that much latency for
    far fewer requests when many tasks submit at once.

    ``token``: for a server with access control, sent in a ``hello`` first on every
    connection (and reconnection); a token the server refuses raises ``Unauthorized``.

    TLS: a "tls://HOST:PORT" address verifies the server's certificate for HOST with the
    system's trust store; ``tls_ca`` (a PEM file) trusts that CA instead, and implies TLS.
    Every reconnection does its handshake again.

    Owns two background tasks (the reply reader, which also reconnects, and the writer of
    queued lines) in a nursery of its own; leaving the block closes the connection and
    cancels them. Raises OSError (or ``trio.TooSlowError``) if the first connection
    cannot be made: ``ssl.SSLCertVerificationError`` if the server's certificate is not
    trusted.
    """
    host, port = parse_address(address)
    context = client_context(tls_ca) if uses_tls(address, tls_ca) else None
    transport = TcpTransport(
        host, port, reconnect=reconnect, connect_timeout=connect_timeout,
        reconnect_timeout=reconnect_timeout, ssl_context=context, token=token,
    )  # fmt: skip
    await transport.first_connect()
    async with open_service_nursery() as nursery:
        transport.nursery = nursery
        nursery.start_soon(transport.run)
        nursery.start_soon(transport.flush)
        coalescer = None
        if batch_window_ms is not None:
            coalescer = Coalescer(transport.request, batch_window_ms / 1000, nursery)
        try:
            yield Client(transport, coalescer)
        finally:
            if coalescer is not None:
                coalescer.close()
            await transport.aclose()


__all__ = [
    "TLS_SCHEME",
    "Client",
    "DeadPage",
    "History",
    "HistoryPoint",
    "JobSummary",
    "JobView",
    "JobsPage",
    "LeasedJob",
    "QueueConfig",
    "QueueInfo",
    "QueuePage",
    "ScheduleInfo",
    "SchedulePage",
    "ServerInfo",
    "Stats",
    "WorkerInfo",
    "WorkersPage",
    "job_fields",
    "open_client",
    "parse_address",
]
