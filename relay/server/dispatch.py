"""From a parsed frame to a store command, and from a committed outcome to reply bytes.

The dispatcher is transport-free: it talks to a ``Connection`` (anything with ``deliver``,
``reply``, ``begin_request`` and a nursery for rare admin work), so TCP sessions and the
WebSocket endpoint share it. The hot path spawns no task and allocates no Event: a request
becomes an envelope for the writer, tagged with a small ``Pending``; the writer's hand-off
calls ``Connection.deliver``, which calls ``finish`` to encode each reply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio

from relay import wire
from relay.errors import InternalError, RelayError, ShuttingDown
from relay.histogram import Histogram
from relay.log import event
from relay.model import FailOutcome, JobInfo, JobState, Lease, SubmitResult
from relay.server.longpoll import LongPolls
from relay.store import commands as cmd
from relay.store.sqlite import ERRORS_SHOWN, REPLY_OVERHEAD_BYTES
from relay.store.writer import Writer

log = logging.getLogger("relay.dispatch")

VERSION = "0.1.0"

# Request duration buckets (seconds): from a pipelined submit (~0.1 ms) to a full long-poll.
DURATION_BOUNDS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
    2.5, 5, 10, 30, 60,
)  # fmt: skip

# Dead letters of a whole queue are retried or purged this many per transaction, so one
# admin request never holds the writer for long.
DEAD_CHUNK = 1000


class Connection(Protocol):
    nursery: trio.Nursery
    closed: bool  # replies are dropped
    can_wait: bool  # a long-poll may park for this connection

    def begin_request(self) -> None: ...
    def reserve(self, nbytes: int) -> None: ...  # a large reply is coming (Dispatcher._send)
    def release(self, nbytes: int) -> None: ...
    def reply_room(self) -> int: ...  # reply bytes it may still be owed (see LongPolls.run)
    def reply(self, data: bytes) -> None: ...
    def deliver(self, replies: list[tuple[Any, Any]]) -> None: ...


def _job_reply_bytes(limits: wire.Limits) -> int:
    """The most one job can take in an inspect or dead_list reply: payload, result, and
    its last error and error history (each error byte at most 6 once escaped as JSON)."""
    errors = (ERRORS_SHOWN + 1) * 6 * limits.max_error_bytes
    return limits.max_payload_bytes + limits.max_result_bytes + errors + REPLY_OVERHEAD_BYTES


@attrs.define(slots=True, eq=False)
class Pending:
    """The tag of a request in flight: enough to encode its reply and to time it."""

    request_id: Any
    op: str
    started: float
    encode: Callable[[Any], dict[str, Any]]
    queued: bool = False  # handed to the writer (or to an admin task): answered later
    reserved: int = 0  # reply bytes the connection set aside for it (see Connection.reserve)


@attrs.define(slots=True, eq=False)
class PendingLease(Pending):
    queues: tuple[str, ...] = ()
    worker_id: str = ""
    count: int = 1
    lease_ms: int = 0
    deadline: float = 0.0

    max_bytes: int | None = None
    reply_bytes: int = 0  # the most its reply may take: what it reserves while claimed
    job_bytes: int = 0  # the most one job takes in its reply

    def claim(self, max_bytes: int | None = None) -> cmd.Claim:
        """Its claim, within ``max_bytes`` of job texts if given (never past its own)."""
        budget = self.max_bytes
        if max_bytes is not None:
            budget = max_bytes if budget is None else min(budget, max_bytes)
        return cmd.Claim(self.queues, self.worker_id, self.count, self.lease_ms, budget)


def _submit_result(result: SubmitResult) -> dict[str, Any]:
    return {"job_id": result.job_id, "state": str(result.state), "duplicate": result.duplicate}


def _encode_submit(results: list[SubmitResult]) -> dict[str, Any]:
    return _submit_result(results[0])


def _encode_batch(results: list[SubmitResult]) -> dict[str, Any]:
    return {"results": [_submit_result(r) for r in results]}


def _encode_lease(leases: list[Lease]) -> dict[str, Any]:
    return {"jobs": [wire.lease_fields(lease) for lease in leases]}


def _encode_ack_batch(outcomes: list[RelayError | None]) -> dict[str, Any]:
    return {
        "results": [
            {"ok": True, "state": "succeeded"}
            if outcome is None
            else {"ok": False, "error": {"code": outcome.code, "message": outcome.message}}
            for outcome in outcomes
        ]
    }


def _encode_fail(outcome: FailOutcome) -> dict[str, Any]:
    fields: dict[str, Any] = {"state": str(outcome.state)}
    if outcome.retry_at is not None:
        fields["retry_at"] = outcome.retry_at
    return fields


def _encode_inspect(job: JobInfo) -> dict[str, Any]:
    return {"job": wire.job_fields(job)}


def _encode_dead_list(page: tuple[list[JobInfo], str | None]) -> dict[str, Any]:
    jobs, next_cursor = page
    return {"jobs": [wire.job_fields(job) for job in jobs], "next_cursor": next_cursor}


@attrs.frozen
class DispatchStatistics:
    in_flight: int
    parked_leases: int
    durations: dict[str, Any]  # op -> HistogramSnapshot


class Dispatcher:
    """Turns requests into store commands and outcomes into replies, for every connection."""

    def __init__(
        self,
        writer: Writer,
        limits: wire.Limits,
        longpolls: LongPolls,
    ) -> None:
        self.writer = writer
        self.limits = limits
        self.longpolls = longpolls
        # How many client connections are open, for stats; the transport sets it.
        self.connections: Callable[[], int] = lambda: 0
        self._started_ns = time.monotonic_ns()
        self._durations: dict[str, Histogram] = {}
        self.in_flight = 0
        self._idle = trio.Event()
        self._idle.set()
        self.leasing = True  # cleared at shutdown: leases answer no jobs at once
        self._job_bytes = _job_reply_bytes(limits)

    # -- accounting --------------------------------------------------------------------------

    def _begin(self, connection: Connection) -> None:
        connection.begin_request()
        self.in_flight += 1
        if self._idle.is_set():
            self._idle = trio.Event()

    def _end(self, op: str, started: float) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()
        histogram = self._durations.get(op)
        if histogram is None:
            histogram = self._durations[op] = Histogram(DURATION_BOUNDS)
        histogram.observe(trio.current_time() - started)

    async def wait_idle(self) -> None:
        """Return once no request is in flight on any connection."""
        while self.in_flight:
            await self._idle.wait()

    def statistics(self) -> DispatchStatistics:
        return DispatchStatistics(
            in_flight=self.in_flight,
            parked_leases=self.longpolls.parked,
            durations={op: h.snapshot() for op, h in self._durations.items()},
        )

    def _reply_now(self, connection: Connection, op: str, started: float, data: bytes) -> None:
        connection.reply(data)
        self._end(op, started)

    # -- requests ----------------------------------------------------------------------------

    async def dispatch(self, connection: Connection, line: bytes) -> None:
        """Handle one frame. Waits only for room in the writer's channel (backpressure)."""
        started = trio.current_time()
        self._begin(connection)
        request_id: Any = None
        op = "invalid"
        try:
            frame = wire.decode_frame(line)
            request_id = frame.id
            op = frame.op if isinstance(frame.op, str) and frame.op in wire.REQUEST_TYPES else op
            request = wire.parse_request(frame, self.limits)
            handler = getattr(self, f"_op_{frame.op}")
            tag = Pending(request_id, op, started, _no_fields)
            try:
                await handler(connection, tag, request)
            except Exception:
                raise  # answered just below
            except BaseException:
                if not tag.queued:
                    # Cancelled while waiting for room in the writer (the connection is
                    # closing): answered here, or it would stay in flight for ever.
                    error = ShuttingDown("not queued: the connection is closing")
                    self._reply_now(connection, op, started, wire.encode_error(request_id, error))
                raise
        except RelayError as exc:
            self._reply_now(connection, op, started, wire.encode_error(request_id, exc))
        except Exception:
            log.exception("request.internal_error", extra={"fields": {"op": op}})
            error = InternalError("internal error; the server logged it")
            self._reply_now(connection, op, started, wire.encode_error(request_id, error))

    async def _send(
        self,
        connection: Connection,
        tag: Pending,
        command: Any,
        encode: Callable,
        reply_bytes: int = 0,
    ) -> None:
        """Hand ``command`` to the writer. A request whose reply may be large (up to
        ``reply_bytes``: inspect, dead_list, lease) reserves that much of the connection's
        reply budget until it is answered (``finish``), so that a client cannot have
        hundreds of MiB of replies in flight: max_in_flight counts requests, not bytes.
        Reserved before it is queued, since once queued it may be answered before this
        task runs again."""
        tag.encode = encode
        if reply_bytes:
            tag.reserved = reply_bytes
            connection.reserve(reply_bytes)
        try:
            await self.writer.send(command, connection, tag)
        except BaseException:  # not queued (shutting down, or cancelled): nothing to answer
            _give_back(connection, tag)
            raise
        tag.queued = True

    async def _op_hello(self, connection: Connection, tag: Pending, request: wire.Hello) -> None:
        fields = {
            "server": "relay-trio",
            "version": VERSION,
            "protocol": wire.PROTOCOL_VERSION,
            "limits": self.limits.advertised(),
        }
        self._reply_now(connection, tag.op, tag.started, wire.encode_ok(tag.request_id, fields))

    async def _op_ping(self, connection: Connection, tag: Pending, request: wire.Ping) -> None:
        self._reply_now(connection, tag.op, tag.started, wire.encode_ok(tag.request_id, {}))

    async def _op_submit(self, connection: Connection, tag: Pending, spec: Any) -> None:
        await self._send(connection, tag, cmd.Submit((spec,)), _encode_submit)

    async def _op_submit_batch(self, connection: Connection, tag: Pending, specs: Any) -> None:
        await self._send(connection, tag, cmd.Submit(specs), _encode_batch)

    async def _op_lease(
        self, connection: Connection, tag: Pending, request: wire.LeaseRequest
    ) -> None:
        if not self.leasing:
            data = wire.encode_ok(tag.request_id, {"jobs": []})
            self._reply_now(connection, tag.op, tag.started, data)
            return
        lease = PendingLease(
            tag.request_id,
            tag.op,
            tag.started,
            _encode_lease,
            queues=tuple(dict.fromkeys(request.queues)),
            worker_id=request.worker_id,
            count=request.count,
            lease_ms=request.lease_ms,
            deadline=tag.started + request.wait_ms / 1000,
            max_bytes=self.limits.max_reply_bytes,
        )
        # The reply holds up to `count` payloads, within max_reply_bytes (plus the one job
        # that may cross it): reserved as in _send.
        lease.job_bytes = job = self.limits.max_payload_bytes + REPLY_OVERHEAD_BYTES
        lease.reply_bytes = min(request.count * job, self.limits.max_reply_bytes + job)
        await self._send(connection, lease, lease.claim(), _encode_lease, lease.reply_bytes)
        tag.queued = True

    async def _op_renew(self, connection: Connection, tag: Pending, request: wire.Renew) -> None:
        command = cmd.Renew(request.job_id, request.worker_id, request.token, request.lease_ms)
        await self._send(connection, tag, command, lambda at: {"lease_expires_at": at})

    async def _op_ack(self, connection: Connection, tag: Pending, request: wire.Ack) -> None:
        result = request.result_text(self.limits)
        command = cmd.Ack(request.job_id, request.worker_id, request.token, result)
        await self._send(connection, tag, command, lambda _: {"state": "succeeded"})

    async def _op_ack_batch(
        self, connection: Connection, tag: Pending, acks: wire.AckTuples
    ) -> None:
        await self._send(connection, tag, cmd.AckBatch(acks), _encode_ack_batch)

    async def _op_fail(self, connection: Connection, tag: Pending, request: wire.Fail) -> None:
        command = cmd.Fail(
            request.job_id, request.worker_id, request.token, request.error, request.retryable
        )

        def encode(outcome: FailOutcome) -> dict[str, Any]:
            if outcome.state == JobState.DEAD:
                event(
                    log, logging.WARNING, "job.dead", job_id=request.job_id,
                    reason="failed" if request.retryable else "failed, not retryable",
                    error=request.error[:200],
                )  # fmt: skip
            return _encode_fail(outcome)

        await self._send(connection, tag, command, encode)

    async def _op_release(
        self, connection: Connection, tag: Pending, request: wire.Release
    ) -> None:
        command = cmd.Release(request.job_id, request.worker_id, request.token)
        await self._send(connection, tag, command, lambda _: {"state": "ready"})

    async def _op_inspect(
        self, connection: Connection, tag: Pending, request: wire.Inspect
    ) -> None:
        command = cmd.Inspect(request.job_id)
        await self._send(connection, tag, command, _encode_inspect, self._job_bytes)

    async def _op_stats(self, connection: Connection, tag: Pending, request: wire.Stats) -> None:
        def encode(queues: dict[str, dict[str, int]]) -> dict[str, Any]:
            server = {
                "version": VERSION,
                "uptime_ms": (time.monotonic_ns() - self._started_ns) // 1_000_000,
                "connections": self.connections(),
            }
            return {"queues": queues, "server": server}

        await self._send(connection, tag, cmd.Stats(), encode)

    async def _op_dead_list(
        self, connection: Connection, tag: Pending, request: wire.DeadList
    ) -> None:
        command = cmd.DeadList(
            request.queue, request.limit, request.cursor, self.limits.max_reply_bytes
        )
        reply_bytes = self.limits.max_reply_bytes + self._job_bytes
        await self._send(connection, tag, command, _encode_dead_list, reply_bytes)

    async def _op_dead_retry(
        self, connection: Connection, tag: Pending, request: wire.DeadRetry
    ) -> None:
        await self._dead(connection, tag, request, cmd.DeadRetry, cmd.DeadRetryQueue)

    async def _op_dead_purge(
        self, connection: Connection, tag: Pending, request: wire.DeadPurge
    ) -> None:
        await self._dead(connection, tag, request, cmd.DeadPurge, cmd.DeadPurgeQueue)

    async def _dead(
        self,
        connection: Connection,
        tag: Pending,
        request: wire.DeadSelect,
        one: Callable[[str], Any],
        chunk: Callable[[str, int], Any],
    ) -> None:
        if request.job_id is not None:
            await self._send(connection, tag, one(request.job_id), lambda n: {"count": n})
            return
        # A whole queue: a rare admin request that may take many transactions. It gets a
        # task in the connection's nursery (the one exception to "no task per request"),
        # so the connection keeps reading and the writer serves others between chunks.
        assert request.queue is not None
        connection.nursery.start_soon(self._dead_queue, connection, tag, request.queue, chunk)
        tag.queued = True

    async def _dead_queue(
        self, connection: Connection, tag: Pending, queue: str, chunk: Callable
    ) -> None:
        total = 0
        data = wire.encode_error(tag.request_id, ShuttingDown("stopped before it finished"))
        try:
            while True:
                n = await self.writer.execute(chunk(queue, DEAD_CHUNK))
                total += n
                if n < DEAD_CHUNK:
                    break
            data = wire.encode_ok(tag.request_id, {"count": total})
        except RelayError as exc:
            data = wire.encode_error(tag.request_id, exc)
        finally:
            # Also when cancelled (the connection closed): the request must be accounted
            # as answered, or shutdown would wait for it until its deadline.
            self._reply_now(connection, tag.op, tag.started, data)

    # -- outcomes ----------------------------------------------------------------------------

    def finish(self, connection: Connection, tag: Pending, outcome: Any) -> bytes | None:
        """The reply bytes for ``outcome``, or None if the request is parked (long-poll).

        Runs in the trio thread inside the writer's hand-off; must not block.
        """
        if isinstance(outcome, RelayError):
            data = wire.encode_error(tag.request_id, outcome)
        else:
            if (
                not outcome
                and isinstance(tag, PendingLease)
                and self.leasing
                and connection.can_wait
                and not self.longpolls.closing
                and tag.deadline > trio.current_time()
            ):
                self.longpolls.park(tag, connection)
                # A parked lease holds no reply: it gives back what it reserved, or a few
                # long-polls would fill the connection's byte budget and stop its reader
                # (max_in_flight still counts them). Woken, it reserves again, within the
                # room the connection has left (LongPolls.run).
                _give_back(connection, tag)
                return None
            try:
                data = wire.encode_ok(tag.request_id, tag.encode(outcome))
            except Exception:
                log.exception("encoding the reply of %s failed", tag.op)
                error = InternalError("internal error; the server logged it")
                data = wire.encode_error(tag.request_id, error)
        _give_back(connection, tag)
        self._end(tag.op, tag.started)
        return data


def _give_back(connection: Connection, tag: Pending) -> None:
    """Release what ``tag`` holds reserved of the connection's reply budget (once)."""
    if tag.reserved:
        connection.release(tag.reserved)
        tag.reserved = 0


def _no_fields(_: Any) -> dict[str, Any]:
    return {}
