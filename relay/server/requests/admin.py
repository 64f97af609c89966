"""The handlers of the requests beside the job flow: inspect, short ids, the dead letters
(list, retry, purge: of one job, or of a whole queue in chunks), cancel (of one job, or of
a whole queue in chunks), the queues (pause, resume, list), watch and unwatch.

Rare requests, never on the hot path; ``AdminHandlers`` is a part of the ``Dispatcher``
(relay/server/requests/dispatch.py), which inherits it as ``SqliteStore`` inherits the store's
parts, so that these answer and are accounted exactly as every other request is. ("Admin"
names the module, not the role: inspect needs only a producer, watch a worker; see
relay/server/requests/auth.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from relay.protocol import requests, wire
from relay.protocol.errors import RelayError, ShuttingDown, Unauthorized, UnknownOp
from relay.protocol.model import QUEUE_NAME_MAX
from relay.server.requests import ops
from relay.server.requests.auth import Role
from relay.store import commands as cmd
from relay.store.base import (
    ATTEMPTS_KEPT,
    ERRORS_SHOWN,
    REPLY_OVERHEAD_BYTES,
    SUMMARY_ERROR_CHARS,
    ScheduleSpec,
)
from relay.store.items import Item

if TYPE_CHECKING:
    from relay.server.requests.connection import Connection

# Dead letters of a whole queue are retried or purged (or a queue's jobs cancelled) this
# many per transaction, so one admin request never holds the writer for long.
DEAD_CHUNK = 1000


def job_reply_bytes(limits: wire.Limits) -> int:
    """The most one job can take in an inspect or dead_list reply: payload, result, and
    its last error and error history with their tracebacks (each byte of these texts at
    most 6 once escaped as JSON)."""
    errors = (ERRORS_SHOWN + 1) * 6 * limits.max_error_bytes
    errors += ERRORS_SHOWN * 6 * limits.max_traceback_bytes
    return limits.max_payload_bytes + limits.max_result_bytes + errors + REPLY_OVERHEAD_BYTES


def summary_reply_bytes(limits: wire.Limits) -> int:
    """The most one item of a jobs_list reply can take: its texts, each byte at most 6
    once escaped as JSON (the worker id and idempotency key, max_id_bytes each; the last
    error, cut to SUMMARY_ERROR_CHARS characters; the queue name), and its other fields
    (ids, states and up to nine numbers)."""
    texts = 6 * (2 * limits.max_id_bytes + SUMMARY_ERROR_CHARS) + QUEUE_NAME_MAX
    return texts + 2 * REPLY_OVERHEAD_BYTES


def inspect_reply_bytes(limits: wire.Limits) -> int:
    """The most an inspect reply can take: its job (``job_reply_bytes``) and the job's
    attempts, the ATTEMPTS_KEPT ended ones with their errors and tracebacks and the one
    running or succeeded, each with its worker id and fields."""
    texts = ATTEMPTS_KEPT * 6 * (limits.max_error_bytes + limits.max_traceback_bytes)
    entries = (ATTEMPTS_KEPT + 1) * (6 * limits.max_id_bytes + REPLY_OVERHEAD_BYTES)
    return job_reply_bytes(limits) + texts + entries


class AdminHandlers:
    """Handlers of ``Dispatcher``. They use the dispatcher's ``writer``, ``limits``,
    ``watchers``, ``_job_bytes`` (``job_reply_bytes``), ``_inspect_bytes``
    (``inspect_reply_bytes``) and its accounting: ``_typed``,
    ``_queue``, ``_answer_now``, ``_count_in``, ``answered``."""

    def _inspect(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        r = self._typed(fields, "inspect")
        args = ops.Reserving((r.job_id, r.prefix), self._inspect_bytes)
        connection.reserve(args.reserved)
        self._queue(connection, (ops.INSPECT, connection, rid, started, args))

    def _short_ids(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        # No reservation: the reply is shorter than the request (each id answered by at
        # most itself), as a stats reply is small.
        job_ids = tuple(self._typed(fields, "short_ids").job_ids)
        self._queue(connection, (ops.SHORT_IDS, connection, rid, started, job_ids))

    def _dead_list(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        r = self._typed(fields, "dead_list")
        page = (r.queue, r.limit, r.cursor, self.limits.max_reply_bytes, r.order == "newest")
        args = ops.Reserving(page, self.limits.max_reply_bytes + self._job_bytes)
        connection.reserve(args.reserved)
        self._queue(connection, (ops.DEAD_LIST, connection, rid, started, args))

    def _jobs_list(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        # A page of at most `limit` summaries (no payload, result or history; keys,
        # worker id and a cut last error), each at most summary_reply_bytes: reserved
        # until answered, as a dead_list page is.
        r = self._typed(fields, "jobs_list")
        page = (r.queue, r.chosen_states, r.search, r.cursor, r.limit, r.order == "newest")
        reply_bytes = r.limit * summary_reply_bytes(self.limits) + REPLY_OVERHEAD_BYTES
        args = ops.Reserving(page, reply_bytes)
        connection.reserve(args.reserved)
        self._queue(connection, (ops.JOBS_LIST, connection, rid, started, args))

    def _promote(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        job_id = self._typed(fields, "promote").job_id
        self._queue(connection, (ops.PROMOTE, connection, rid, started, job_id))

    def _dead_retry(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        request = self._typed(fields, "dead_retry")
        states = tuple(request.states or ("dead",))
        chunk = lambda queue, limit: cmd.DeadRetryQueue(queue, limit, states)  # noqa: E731
        self._dead(connection, rid, started, request, ops.DEAD_RETRY, chunk)

    def _dead_purge(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        request = self._typed(fields, "dead_purge")
        states = tuple(request.states or ("dead",))
        chunk = lambda queue, limit: cmd.DeadPurgeQueue(queue, limit, states)  # noqa: E731
        self._dead(connection, rid, started, request, ops.DEAD_PURGE, chunk)

    def _dead(
        self,
        connection: Connection,
        rid: Any,
        started: float,
        request: requests.DeadRetry | requests.DeadPurge,
        one: ops.RequestOp,
        chunk: Callable[[str, int], Any],
    ) -> None:
        if request.job_id is not None:
            states = tuple(request.states or ("dead",))
            self._queue(connection, (one, connection, rid, started, (request.job_id, states)))
            return
        # A whole queue: a rare admin request that may take many transactions. It gets a
        # task in the connection's nursery (the one exception to "no task per request"),
        # so the connection keeps reading and the writer serves others between chunks.
        assert request.queue is not None
        self._count_in(connection)
        item = (one, connection, rid, started, None)
        connection.nursery.start_soon(self._dead_queue, connection, item, request.queue, chunk)

    def _cancel(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        request = self._typed(fields, "cancel")
        if request.job_id is not None:
            # A producer may cancel a job that has not started; a leased one needs admin
            # (the store refuses it, unauthorized, having changed nothing).
            args = (request.job_id, connection.role >= Role.ADMIN)
            self._queue(connection, (ops.CANCEL, connection, rid, started, args))
            return
        if connection.role < Role.ADMIN:
            raise Unauthorized(
                f"cancel of a whole queue needs the admin role; this token is "
                f"{connection.role.label} (cancel one job by its job_id)"
            )
        assert request.queue is not None
        states = request.chosen_states
        self._count_in(connection)
        item = (ops.CANCEL, connection, rid, started, None)
        connection.nursery.start_soon(
            self._dead_queue,
            connection,
            item,
            request.queue,
            lambda queue, limit: cmd.JobCancelQueue(queue, states, limit),
            "cancelled",
        )

    async def _dead_queue(
        self, connection: Connection, item: Item, queue: str, chunk: Callable, field: str = "count"
    ) -> None:
        total = 0
        data = wire.encode_error(item[2], ShuttingDown("stopped before it finished"))
        try:
            while True:
                if connection.role < Role.ADMIN:  # a hello lowered it meanwhile
                    raise Unauthorized(
                        f"stopped after {total} jobs: this connection's role is now "
                        f"{connection.role.label}; {item[0].name} needs admin"
                    )
                n = await self.writer.execute(chunk(queue, DEAD_CHUNK))
                total += n
                if n < DEAD_CHUNK:
                    break
            data = wire.encode_ok(item[2], {field: total})
        except RelayError as exc:
            data = wire.encode_error(item[2], exc)
        finally:
            # Also when cancelled (the connection closed): the request must be accounted
            # as answered, or shutdown would wait for it until its deadline.
            self.answered(connection, item, trio.current_time())
            connection.reply(data)

    def _reload(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        self._typed(fields, "reload")
        reloader = self.reloader
        if reloader is None:  # the embedded mode: no token file, no certificate
            nothing = {"tokens": None, "tls": False, "closing": 0, "grace_ms": 0, "errors": []}
            self._answer_now(connection, "reload", started, wire.encode_ok(rid, nothing))
            return
        # Files are read in a thread: a task in the connection's nursery, as a whole
        # queue's dead letters are, accounted until answered.
        self._count_in(connection)
        item = (ops.RELOAD, connection, rid, started, None)
        connection.nursery.start_soon(self._reload_task, connection, item, reloader)

    async def _reload_task(self, connection: Connection, item: Item, reloader: Callable) -> None:
        data = wire.encode_error(item[2], ShuttingDown("stopped before it finished"))
        try:
            data = wire.encode_ok(item[2], await reloader("op"))
        finally:
            self.answered(connection, item, trio.current_time())
            connection.reply(data)

    def _queue_pause(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        queue = self._typed(fields, "queue_pause").queue
        self._queue(connection, (ops.QUEUE_PAUSE, connection, rid, started, (queue, True)))

    def _queue_resume(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        queue = self._typed(fields, "queue_resume").queue
        self._queue(connection, (ops.QUEUE_RESUME, connection, rid, started, (queue, False)))

    def _queue_list(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        # No reservation: a page of at most QUEUE_LIST_PAGE queues, each a few hundred
        # bytes, as a stats page is.
        r = self._typed(fields, "queue_list")
        args = (r.cursor, r.limit, r.queues)
        self._queue(connection, (ops.QUEUE_LIST, connection, rid, started, args))

    def _queue_config(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        r = self._typed(fields, "queue_config")
        args = (r.queue, r.changes(self.limits))
        self._queue(connection, (ops.QUEUE_CONFIG, connection, rid, started, args))

    def _schedule_put(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        # No reservation: the reply is the request's own size or so (its payload, bounded
        # by max_payload_bytes as a submit's), as a submit's is smaller than its request.
        spec = ScheduleSpec(**self._typed(fields, "schedule_put").to_fields(self.limits))
        self._queue(connection, (ops.SCHEDULE_PUT, connection, rid, started, spec))

    def _schedule_delete(
        self, connection: Connection, rid: Any, started: float, fields: dict
    ) -> None:
        name = self._typed(fields, "schedule_delete").name
        self._queue(connection, (ops.SCHEDULE_DELETE, connection, rid, started, name))

    def _schedule_pause(
        self, connection: Connection, rid: Any, started: float, fields: dict
    ) -> None:
        name = self._typed(fields, "schedule_pause").name
        self._queue(connection, (ops.SCHEDULE_PAUSE, connection, rid, started, (name, True)))

    def _schedule_resume(
        self, connection: Connection, rid: Any, started: float, fields: dict
    ) -> None:
        name = self._typed(fields, "schedule_resume").name
        self._queue(connection, (ops.SCHEDULE_RESUME, connection, rid, started, (name, False)))

    def _schedule_list(
        self, connection: Connection, rid: Any, started: float, fields: dict
    ) -> None:
        # A page stops adding schedules once their payloads reach max_reply_bytes (at
        # least one is given), and reserves that much and one payload, as dead_list does.
        r = self._typed(fields, "schedule_list")
        page = (r.cursor, r.limit, self.limits.max_reply_bytes)
        args = ops.Reserving(page, self.limits.max_reply_bytes + self.limits.max_payload_bytes)
        connection.reserve(args.reserved)
        self._queue(connection, (ops.SCHEDULE_LIST, connection, rid, started, args))

    def _history(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        # A reply of at most HISTORY_POINTS points, each about 250 bytes: reserved.
        request = self._typed(fields, "history")
        args = ops.Reserving(request, ops.HISTORY_REPLY_BYTES)
        connection.reserve(args.reserved)
        self._queue(connection, (ops.HISTORY, connection, rid, started, args))

    def _watch(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        request = self._typed(fields, "watch")
        if self.watchers is None or not hasattr(connection, "push"):
            raise UnknownOp("watch needs a network connection (TCP or WebSocket)")
        self.watchers.watch(connection, request.queues, request.states)  # type: ignore[arg-type]
        # Answered after the next commit, which records events already (see watch.py).
        self._queue(connection, (ops.WATCH, connection, rid, started, None))

    def _unwatch(self, connection: Connection, rid: Any, started: float, fields: dict) -> None:
        self._typed(fields, "unwatch")
        if self.watchers is not None:
            self.watchers.unwatch(connection)
        self._answer_now(connection, "unwatch", started, wire.encode_ok(rid, {}))
