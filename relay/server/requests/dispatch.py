"""From a request line to a writer item, and the accounting of every request until answered.

The dispatcher is transport-free: it talks to a ``Connection`` (a TCP session, the
embedded transport), so every transport shares one meaning of each request. ``dispatch``
is synchronous and made for the hot path: one ``orjson.loads``, plain checks of the common
shapes (``wire.fast_*``; anything else takes the general, typed path, which names what is
wrong), and one tuple into the writer; no task, Event, coroutine or object per request
(except a lease's ``PendingLease``). Replies that need no database (hello, ping, errors)
are given at once. The writer thread makes the others' reply lines after the commit
(relay/server/requests/ops.py); the connection's ``deliver`` hands each to ``finish``.

Which ops a connection may use is relay/server/requests/access.py; the handlers of the rare
requests beside the job flow (inspect, dead letters, watch) are relay/server/requests/admin.py.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import orjson
import trio

from relay.protocol import parsing, wire
from relay.protocol.errors import (
    BadRequest,
    InternalError,
    RelayError,
    ShuttingDown,
    UnknownOp,
)
from relay.server.requests import ops
from relay.server.requests.access import Access
from relay.server.requests.admin import AdminHandlers, inspect_reply_bytes, job_reply_bytes
from relay.server.requests.auth import Role, Tokens
from relay.server.requests.connection import Connection
from relay.server.requests.durations import AnsweredNow, Durations
from relay.server.requests.longpoll import LongPolls
from relay.server.requests.oldest import OldestReady
from relay.server.requests.watch import Watchers
from relay.server.requests.workers import ENTRY_BYTES, WorkerBook
from relay.store.base import REPLY_OVERHEAD_BYTES
from relay.store.items import Item
from relay.store.view import QueueView
from relay.store.writer import Writer, wall_clock_ms

log = logging.getLogger("relay.dispatch")

# The version the server reports (hello, stats, logs): the installed package's.
VERSION = importlib.metadata.version("relay-trio")

# Request duration buckets (seconds): from a pipelined submit (~0.1 ms) to a full long-poll.
DURATION_BOUNDS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
    2.5, 5, 10, 30, 60,
)  # fmt: skip


@attrs.frozen
class DispatchStatistics:
    in_flight: int
    parked_leases: int
    durations: dict[str, Any]  # op -> HistogramSnapshot


class Dispatcher(AdminHandlers):
    """Turns request lines into writer items, and answers, for every connection.

    The handlers of the rare requests beside the job flow (inspect, the dead letters,
    watch) are in relay/server/requests/admin.py (``AdminHandlers``, inherited: a part of this
    class, as the store's parts are of ``SqliteStore``).
    """

    def __init__(
        self,
        writer: Writer,
        limits: wire.Limits,
        longpolls: LongPolls,
        tokens: Tokens | None = None,
        watchers: Watchers | None = None,
        view: QueueView | None = None,
        clock: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self.writer = writer
        # The store's counts per queue as of the last commit: stats reads a page of them
        # here, in the trio thread, with no query and no turn in the writer.
        self.view = view if view is not None else QueueView()
        self.oldest = OldestReady(writer, clock)  # (stats with oldest_ready)
        self.limits = limits
        self.longpolls = longpolls
        self.watchers = watchers  # None: no watch (embedded mode)
        # How many client connections are open, for stats; the transport sets it.
        self.connections: Callable[[], int] = lambda: 0
        # This server's connections that have leased (workers_list, relay_workers), and how
        # it names itself in workers_list ("host:port" of its job listener; serve sets it).
        self.workers = WorkerBook()
        self.server_name = "local"
        self._started_ns = time.monotonic_ns()
        self._durations = Durations(DURATION_BOUNDS)
        # Requests in flight: ``in_flight``, this count (trio thread) less those the writer
        # thread answered itself (``answered_now``, relay/server/connections/direct.py).
        self._in_flight = 0
        self.answered_now = AnsweredNow(trio.lowlevel.current_clock(), DURATION_BOUNDS)
        self._idle = trio.Event()
        self.idle_wanted = 0  # wait_idle under way (read by the writer thread)
        self.leasing = True  # cleared at shutdown: leases answer no jobs at once
        # The ``reload`` op's work (relay/server/reload.py), which the server sets: it
        # returns the reply's fields. None: nothing to reload (the embedded mode).
        self.reloader: Callable[[str], Awaitable[dict[str, Any]]] | None = None
        self._job_bytes = job_reply_bytes(limits)  # (admin.py)
        self._inspect_bytes = inspect_reply_bytes(limits)
        handlers: dict[str, Callable[[Connection, Any, float, dict], None]] = {
            "hello": self._hello,
            "ping": self._ping,
            "submit": self._submit,
            "submit_batch": self._submit_batch,
            "lease": self._lease,
            "renew": self._renew,
            "ack": self._ack,
            "ack_batch": self._ack_batch,
            "fail": self._fail,
            "release": self._release,
            "inspect": self._inspect,
            "short_ids": self._short_ids,
            "stats": self._stats,
            "dead_list": self._dead_list,
            "dead_retry": self._dead_retry,
            "dead_purge": self._dead_purge,
            "cancel": self._cancel,
            "jobs_list": self._jobs_list,
            "promote": self._promote,
            "watch": self._watch,
            "unwatch": self._unwatch,
            "queue_pause": self._queue_pause,
            "queue_resume": self._queue_resume,
            "queue_list": self._queue_list,
            "queue_config": self._queue_config,
            "schedule_put": self._schedule_put,
            "schedule_delete": self._schedule_delete,
            "schedule_pause": self._schedule_pause,
            "schedule_resume": self._schedule_resume,
            "schedule_list": self._schedule_list,
            "reload": self._reload,
            "workers_list": self._workers_list,
            "history": self._history,
        }
        # Who may use which: a connection holds the table of its role (access.py).
        self.access = Access(tokens, handlers, self._answer_now, self._durations.histogram)

    # -- accounting --------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self._in_flight - self.answered_now.count

    async def wait_idle(self) -> None:
        """Return once no request is in flight on any connection."""
        self.idle_wanted += 1  # (before looking: see relay/server/connections/direct.py)
        try:
            while self.in_flight:
                if self._idle.is_set():  # (one event for every waiter, set once idle)
                    self._idle = trio.Event()
                await self._idle.wait()
        finally:
            self.idle_wanted -= 1

    def check_idle(self) -> None:
        if self.idle_wanted and not self.in_flight:
            self._idle.set()

    def statistics(self) -> DispatchStatistics:
        return DispatchStatistics(
            in_flight=self.in_flight,
            parked_leases=self.longpolls.parked,
            durations=self.answered_now.durations(self._durations.snapshots()),
        )

    def _answer_now(self, connection: Connection, op: str, started: float, data: bytes) -> None:
        """Answer a request that was not queued: counted in and out at once."""
        connection.begin_request()
        connection.reply(data)
        self._durations.histogram(op).observe(trio.current_time() - started)

    def _queue(self, connection: Connection, item: Item) -> None:
        """Hand ``item`` to the writer. A request whose reply may be large (inspect,
        dead_list, lease) has reserved that much of its connection's reply budget: given
        back when answered (``answered``) or here, if it cannot be queued."""
        try:
            self.writer.put(item)
        except ShuttingDown as exc:
            if item[0].reserves:
                _give_back(connection, item[4])
            self._answer_now(connection, item[0].name, item[3], wire.encode_error(item[2], exc))
            return
        connection.begin_request()  # (_count_in, written out: this runs per request)
        self._in_flight += 1

    def answered(self, connection: Connection, item: Item, now: float) -> None:
        """``item`` is answered (or dropped with its connection) at ``now``: count it out."""
        op = item[0]
        if op.reserves:
            _give_back(connection, item[4])
        self._count_out(1)
        self._durations.histogram(op.name).observe(now - item[3])

    def answered_lines(self, items: list[Item], now: float) -> None:
        """``items`` (none holding a reservation) are answered at ``now``: count them out,
        one histogram observation per run of items of one op that arrived together."""
        self._count_out(len(items))
        self._durations.observe_runs(items, now)

    def _count_in(self, connection: Connection) -> None:
        """A request handed on (to the writer, or to a task): in flight until answered."""
        connection.begin_request()
        self._in_flight += 1

    def _count_out(self, n: int) -> None:
        self._in_flight -= n
        self.check_idle()

    # -- requests ----------------------------------------------------------------------------

    def dispatch(self, connection: Connection, line: bytes, started: float) -> None:
        """Handle one frame that arrived at ``started`` (trio time). Never waits: the
        caller waits for room in the writer (``Writer.wait_room``) before calling."""
        request_id: Any = None
        op = "invalid"
        try:
            try:
                fields = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise BadRequest(f"not valid JSON: {exc}") from None
            if type(fields) is not dict:
                raise BadRequest("a request must be a JSON object")
            request_id = fields.get("id")
            name = fields.get("op")
            handler = connection.ops.get(name) if type(name) is str else None
            if handler is None or not (type(request_id) is int or wire.valid_id(request_id)):
                if not wire.valid_id(request_id):
                    request_id = None
                parsing.parse_request(parsing.Frame(request_id, name, fields), self.limits)
                raise UnknownOp(f"unknown op {name!r}")  # (parse_request raised first)
            op = name
            handler(connection, request_id, started, fields)
        except RelayError as exc:
            if connection.role is Role.NONE:
                # Not a hello (not even JSON, perhaps): the first request must be one.
                self.access.refuse(connection, op, started, request_id, f"not a hello: {exc.code}")
                return
            self._answer_now(connection, op, started, wire.encode_error(request_id, exc))
        except Exception:
            log.exception("request.internal_error", extra={"fields": {"op": op}})
            error = InternalError("internal error; the server logged it")
            self._answer_now(connection, op, started, wire.encode_error(request_id, error))

    def _typed(self, fields: dict[str, Any], name: str) -> Any:
        """The general path: the typed, range-checked request (relay/protocol/parsing.py)."""
        return parsing.parse_request(parsing.Frame(fields.get("id"), name, fields), self.limits)

    def _hello(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        hello = self._typed(fields, "hello")
        before = connection.role
        if not self.access.admit(connection, rid, started, hello.token):
            return
        self.workers.hello(connection, hello.client)
        if connection.role < before:
            self._lowered(connection, before)
        reply = {
            "server": "relay-trio",
            "version": VERSION,
            "protocol": wire.PROTOCOL_VERSION,
            "limits": self.limits.advertised(),
            "role": connection.role.label,
        }
        self._answer_now(connection, "hello", started, wire.encode_ok(rid, reply))

    def _lowered(self, connection: Connection, before: Role) -> None:
        """A hello lowered the connection's role from ``before``: what only the higher role
        could do ends now, before the hello's reply. Its watch ends (with an ``ended``
        event) and its parked long-polls are answered with no jobs; a lease of it still in
        the writer claims nothing (``ops._wanted``), and a whole-queue dead letter request
        under way stops before its next chunk (``_dead_queue``)."""
        if connection.role < Role.WORKER <= before:
            if self.watchers is not None and connection in self.watchers:
                self.watchers.end(connection, "role")  # type: ignore[arg-type]
            self.longpolls.drop(connection)

    def _ping(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        self._answer_now(connection, "ping", started, wire.encode_ok(rid, {}))

    def _submit(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        spec = wire.fast_submit_spec(fields, self.limits) or self._typed(fields, "submit")
        self._queue(connection, (ops.SUBMIT, connection, rid, started, spec))

    def _submit_batch(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        specs = self._typed(fields, "submit_batch")
        self._queue(connection, (ops.SUBMIT_BATCH, connection, rid, started, specs))

    def _lease(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        args = wire.fast_lease(fields, self.limits)
        if args is None:
            r = self._typed(fields, "lease")
            args = (r.queues, r.worker_id, r.count, r.lease_ms, r.wait_ms)
        queues, worker_id, count, lease_ms, wait_ms = args
        if not self.leasing:
            self._answer_now(connection, "lease", started, wire.encode_ok(rid, {"jobs": []}))
            return
        # The reply holds up to `count` payloads, within max_reply_bytes (plus the one job
        # that may cross it): reserved until answered.
        job = self.limits.max_payload_bytes + REPLY_OVERHEAD_BYTES
        reply_bytes = min(count * job, self.limits.max_reply_bytes + job)
        queues = tuple(dict.fromkeys(queues))
        lease = ops.PendingLease(
            connection=connection,
            queues=queues,
            worker_id=worker_id,
            count=count,
            lease_ms=lease_ms,
            deadline=started + wait_ms / 1000 if wait_ms else 0.0,
            max_bytes=self.limits.max_reply_bytes,
            reply_bytes=reply_bytes,
            job_bytes=job,
            reserved=reply_bytes,
            sent=started,
        )
        self.workers.leased(connection, worker_id, queues, started)
        connection.reserve(reply_bytes)
        self._queue(connection, (ops.CLAIM, connection, rid, started, lease))

    def _renew(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        r = self._typed(fields, "renew")
        args = (r.job_id, r.worker_id, r.token, r.lease_ms)
        self._queue(connection, (ops.RENEW, connection, rid, started, args))

    def _ack(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        args = wire.fast_ack(fields, self.limits)
        if args is None:
            r = self._typed(fields, "ack")
            args = (r.job_id, r.worker_id, r.token, r.result_text(self.limits))
        self._queue(connection, (ops.ACK, connection, rid, started, args))

    def _ack_batch(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        acks = self._typed(fields, "ack_batch")
        self._queue(connection, (ops.ACK_BATCH, connection, rid, started, acks))

    def _fail(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        r = self._typed(fields, "fail")
        args = (r.job_id, r.worker_id, r.token, r.error, r.retryable, r.traceback)
        self._queue(connection, (ops.FAIL, connection, rid, started, args))

    def _release(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        r = self._typed(fields, "release")
        args = (r.job_id, r.worker_id, r.token)
        self._queue(connection, (ops.RELEASE, connection, rid, started, args))

    def _stats(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        """A page of the view (relay/store/view.py), answered here; with oldest_ready, the
        ages of the page's queues that have ready jobs come from ``OldestReady``
        (relay/server/requests/oldest.py), in a task: read through the writer, at most once a
        second per queue whoever asks."""
        r = self._typed(fields, "stats")
        server = {
            "version": VERSION,
            "uptime_ms": (time.monotonic_ns() - self._started_ns) // 1_000_000,
            "connections": self.connections(),
        }
        queues, ready, next_cursor, paused = self.view.page_json(r.cursor, r.limit, r.queues)
        # Written out around the page's JSON, made as the counts were published.
        head = _STATS_HEAD % (orjson.dumps(rid), queues, orjson.dumps(server))
        tail = _STATS_TAIL % (orjson.dumps(next_cursor), len(self.view))
        if paused:  # (an extension: the page's paused queues, left out when none is)
            tail = b',"paused":' + orjson.dumps(paused) + tail
        if not r.oldest_ready or not ready:
            if r.oldest_ready:
                tail = b',"oldest_ready_ms":{}' + tail
            self._answer_now(connection, "stats", started, head + tail)
            return
        # A task in the connection's nursery, as a whole queue's dead op has (admin.py):
        # the connection keeps reading while the ages are read.
        self._count_in(connection)
        item = (ops.STATS, connection, rid, started, None)
        connection.nursery.start_soon(self._stats_oldest, connection, item, head, tail, ready)

    async def _stats_oldest(
        self, connection: Connection, item: Item, head: bytes, tail: bytes, ready: list[str]
    ) -> None:
        data = wire.encode_error(item[2], ShuttingDown("stopped before it finished"))
        try:
            ages = orjson.dumps(await self.oldest.ages(ready))
            data = head + b',"oldest_ready_ms":' + ages + tail
        except RelayError as exc:
            data = wire.encode_error(item[2], exc)
        finally:
            # Also when cancelled (the connection closed): counted as answered.
            self.answered(connection, item, trio.current_time())
            connection.reply(data)

    def _workers_list(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        """This server's connected workers (relay/server/requests/workers.py), what each
        holds read from the store: in a task, as stats with oldest_ready is."""
        r = self._typed(fields, "workers_list")
        args = ops.Reserving((r.cursor, r.limit), r.limit * ENTRY_BYTES)
        connection.reserve(args.reserved)
        self._count_in(connection)
        item = (ops.WORKERS_LIST, connection, rid, started, args)
        connection.nursery.start_soon(self._workers_page, connection, item)

    async def _workers_page(self, connection: Connection, item: Item) -> None:
        data = wire.encode_error(item[2], ShuttingDown("stopped before it finished"))
        try:
            cursor, limit = item[4].args
            fields = await self.workers.page(
                self.writer, self.oldest.clock, cursor, limit, self.server_name,
                self.longpolls.parked_count,
            )  # fmt: skip
            data = wire.encode_ok(item[2], fields)
        except RelayError as exc:
            data = wire.encode_error(item[2], exc)
        finally:
            self.answered(connection, item, trio.current_time())
            connection.reply(data)

    # -- outcomes ----------------------------------------------------------------------------

    def finish(self, connection: Connection, item: Item, reply: Any, now: float) -> bytes | None:
        """The reply line of ``item``, or None if the request is parked (long-poll).

        ``reply`` is the line the writer made, or, for a long-poll lease that found
        nothing, the empty outcome: it parks while its client may wait for it, else it is
        answered with no jobs. Runs in the trio thread inside the writer's hand-off.
        """
        if type(reply) is not bytes:
            lease = item[4]
            longpolls = self.longpolls
            may_wait = (
                self.leasing
                and connection.role >= Role.WORKER
                and connection.can_wait
                and not longpolls.closing
                and lease.deadline > now
            )
            # (One woken that found nothing parks again at its old place: it held a place.)
            if may_wait and (lease.woken or not longpolls.full):
                longpolls.park(item, connection)
                # A parked lease holds no reply: it gives back what it reserved, or a few
                # long-polls would fill the connection's byte budget and stop its reader
                # (max_in_flight still counts them). Woken, it reserves again, within the
                # room the connection has left (LongPolls.run).
                _give_back(connection, lease)
                return None
            if may_wait:  # as many are parked as the server holds: answered at once
                longpolls.turn_away()
            reply = wire.encode_ok(item[2], {"jobs": []})
        self.answered(connection, item, now)
        return reply


# A stats reply, around its page of counts (relay/store/view.py, ``page_json``) and its
# ages of the oldest ready jobs: the request id, the queues, the server's fields; then the
# next cursor and the number of queues.
_STATS_HEAD = b'{"id":%s,"ok":true,"queues":%s,"server":%s'
_STATS_TAIL = b',"next_cursor":%s,"total_queues":%d}\n'


def _give_back(connection: Connection, args: Any) -> None:
    """Release what ``args`` (a Reserving or PendingLease) holds reserved of the
    connection's reply budget (once)."""
    if args.reserved:
        connection.release(args.reserved)
        args.reserved = 0
