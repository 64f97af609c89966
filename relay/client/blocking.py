"""A small blocking client for producers in synchronous programs (a web app that submits).

    with relay.connect("127.0.0.1:7400") as queue:
        queue.submit("email", {"to": "ada@example.com"})

One socket, safe to share between threads. The calls that threads make while a request is
on the wire wait for it, then go out together: their lines in one write, their replies
read in one pass (``coalesce=True``: their plain submits as one ``submit_batch``, each
caller still getting its own result or error). A dropped connection raises
``ConnectionLost`` for the calls in flight (they may or may not have taken effect: use an
``idempotency_key`` to make a resubmit safe); the next call connects again. An
``unavailable`` reply (nothing was committed) is retried with backoff by a submit with an
``idempotency_key`` and a ``submit_batch`` whose jobs all have one, for up to ``timeout``
seconds, as the async client does; other calls raise ``Unavailable`` at once. TLS as for
the async client: a "tls://HOST:PORT" address, or ``tls_ca`` (a private CA's PEM file).
"""

from __future__ import annotations

import functools
import itertools
import random
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from relay.client.client import (
    DEFAULT_ADDRESS,
    UNAVAILABLE_CAP_S,
    UNAVAILABLE_FIRST_S,
    job_fields,
    schedule_fields,
)
from relay.client.replies import (
    History,
    JobsPage,
    JobView,
    QueueConfig,
    QueuePage,
    ScheduleInfo,
    SchedulePage,
    Stats,
    WorkersPage,
    config_fields,
    history_fields,
    history_reply,
    stats_reply,
    structure_reply,
    submit_result,
)
from relay.client.tcp import CONNECT_TIMEOUT_S, check_hello_reply, hello_line, hello_read
from relay.client.tls import client_context, parse_address, uses_tls
from relay.protocol.errors import ConnectionLost, RelayError, Unavailable, reply_fields
from relay.protocol.model import JobState, SubmitResult

READ_BYTES = 64 * 1024


class _Call:
    """One thread's request, answered by whichever thread takes the socket next."""

    __slots__ = ("done", "error", "fields", "op", "reply")

    def __init__(self, op: str, fields: dict[str, Any]) -> None:
        self.op, self.fields = op, fields
        self.reply: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.done = False


class BlockingClient:
    def __init__(
        self,
        address: str | tuple[str, int] = DEFAULT_ADDRESS,
        *,
        timeout: float = 30.0,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        coalesce: bool = False,
        token: str | None = None,
        tls_ca: str | None = None,
    ) -> None:
        self.address = parse_address(address)
        self.token = token  # sent in a hello first on every connection, and in every hello
        self._ssl_context = client_context(tls_ca) if uses_tls(address, tls_ca) else None
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.coalesce = coalesce
        self._sock: socket.socket | None = None
        self._buffer = b""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # held by the thread that uses the socket
        self._waiting: list[_Call] = []  # calls not yet sent (appended under _queue_lock)
        self._queue_lock = threading.Lock()
        # The retries' clock and sleep (tests give their own).
        self._clock: Callable[[], float] = time.monotonic
        self._sleep: Callable[[float], None] = time.sleep

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._buffer = None, b""

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self.connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl_context is not None:
            try:  # the handshake, within the connect timeout
                sock = self._ssl_context.wrap_socket(sock, server_hostname=self.address[0])
            except BaseException:
                sock.close()
                raise
        try:
            self._say_hello(sock)  # within the connect timeout, too
        except BaseException:
            sock.close()
            raise
        sock.settimeout(self.timeout)
        return sock

    def _say_hello(self, sock: socket.socket) -> None:
        """Say hello (with the token, if any) before anything else, and read its answer
        (relay/client/tcp.py's ``check_hello_reply``, as the async client does)."""
        sock.sendall(hello_line(self.token))
        data = b""
        while b"\n" not in data:
            data = hello_read(data, sock.recv(READ_BYTES), plain=self._ssl_context is None)
        line, self._buffer = data.split(b"\n", 1)
        check_hello_reply(line)

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and return the reply's fields, or raise its error.

        The thread that gets the socket sends every call waiting at that moment, its own
        and those of threads that queued behind the request before, and answers them all;
        a thread whose call another one answered just returns its answer.
        """
        if op == "hello" and self.token is not None:
            fields["token"] = self.token  # a hello without it would end the authentication
        call = _Call(op, fields)
        with self._queue_lock:
            self._waiting.append(call)
        with self._lock:
            if not call.done:
                with self._queue_lock:
                    calls, self._waiting = self._waiting, []
                self._exchange(calls)
        if call.error is not None:
            raise call.error
        assert call.reply is not None
        return reply_fields(call.reply)

    def _exchange(self, calls: list[_Call]) -> None:
        """Send ``calls`` in one write and read their replies; every call gets its reply
        or an error. Holds the socket (``_lock``)."""
        if self._sock is not None and not self._alive():
            self._drop()  # the server closed it while we were idle: nothing was lost
        requests = self._requests(calls)
        try:
            if self._sock is None:
                self._sock = self._connect()
            self._sock.sendall(b"".join(line for _, line, _ in requests))
            replies = self._read_replies({request_id for request_id, _, _ in requests})
            for request_id, _, answer in requests:
                answer(replies[request_id])
        except RelayError as exc:  # refused at hello: the token, overloaded, a wrong server
            self._drop()
            for call in calls:
                if not call.done:
                    call.error, call.done = exc, True
        except OSError as exc:
            self._drop()
            for call in calls:
                if not call.done:
                    call.error, call.done = ConnectionLost(f"{call.op}: {exc}"), True

    def _requests(self, calls: list[_Call]) -> list[tuple[int, bytes, Callable]]:
        """(request id, line, what to do with its reply) per request that ``calls`` make:
        one each, or with ``coalesce`` one ``submit_batch`` for all the plain submits."""
        submits = [c for c in calls if c.op == "submit"] if self.coalesce else []
        requests = []
        if len(submits) > 1:
            requests.append(self._batch(submits))
        for call in calls:
            if len(submits) <= 1 or call.op != "submit":
                request_id = next(self._ids)
                line = orjson.dumps({"op": call.op, "id": request_id, **call.fields}) + b"\n"
                requests.append((request_id, line, functools.partial(_answer, call)))
        return requests

    def _batch(self, submits: list[_Call]) -> tuple[int, bytes, Callable]:
        request_id = next(self._ids)
        jobs = [call.fields for call in submits]
        line = orjson.dumps({"op": "submit_batch", "id": request_id, "jobs": jobs}) + b"\n"

        def answer(reply: dict[str, Any]) -> None:
            if reply.get("ok"):
                for call, result in zip(submits, reply["results"], strict=True):
                    _answer(call, {"ok": True, **result})
                return
            # Refused whole (one invalid job, a full queue): nothing was committed, so
            # each goes alone, for its own answer (pipelined, in one write).
            ids = [next(self._ids) for _ in submits]
            assert self._sock is not None
            self._sock.sendall(
                b"".join(
                    orjson.dumps({"op": "submit", "id": i, **call.fields}) + b"\n"
                    for i, call in zip(ids, submits, strict=True)
                )
            )
            replies = self._read_replies(set(ids))
            for i, call in zip(ids, submits, strict=True):
                _answer(call, replies[i])

        return request_id, line, answer

    def _alive(self) -> bool:
        """False if the server has closed the connection (a pending EOF or reset).

        Between requests nothing should be readable; if something is, peeking at it does
        not block (a socket with a timeout would wait out its timeout on an empty peek).
        """
        sock = self._sock
        assert sock is not None
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable and isinstance(sock, ssl.SSLSocket):
                return self._tls_alive(sock)
            return not readable or sock.recv(1, socket.MSG_PEEK) != b""
        except (OSError, ValueError):
            return False

    def _tls_alive(self, sock: ssl.SSLSocket) -> bool:
        """``_alive`` for TLS, which cannot peek: what is readable may be records of TLS
        alone (the session tickets a TLS 1.3 server sends after the handshake), so read
        without waiting; data, unexpected, is kept for the next reply read."""
        timeout = sock.gettimeout()
        sock.settimeout(0)
        try:
            data = sock.recv(READ_BYTES)
        except ssl.SSLWantReadError:
            return True  # only TLS records: still open
        finally:
            sock.settimeout(timeout)
        self._buffer += data
        return data != b""

    def _read_replies(self, request_ids: set[int]) -> dict[int, dict[str, Any]]:
        """The replies to ``request_ids``, which may come in any order. An error without
        an id (overloaded, frame_too_large) ends the connection's requests: it answers
        every one still unanswered."""
        assert self._sock is not None
        replies: dict[int, dict[str, Any]] = {}
        while len(replies) < len(request_ids):
            while b"\n" not in self._buffer:
                data = self._sock.recv(READ_BYTES)
                if not data:
                    raise ConnectionResetError("the server closed the connection")
                self._buffer += data
            line, _, self._buffer = self._buffer.partition(b"\n")
            reply = orjson.loads(line)
            request_id = reply.get("id")
            if request_id in request_ids:
                replies[request_id] = reply
            elif request_id is None:
                replies.update((i, reply) for i in request_ids if i not in replies)
        return replies

    def _retrying(self, op: str, **fields: Any) -> dict[str, Any]:
        """``request``, sent again while the server answers ``unavailable`` (nothing was
        committed; the caller knows a repeat is safe): after 50 ms, doubling to 1 s, with
        jitter, until a wait would end more than ``timeout`` seconds after the first try;
        then the ``Unavailable`` is raised."""
        give_up = self._clock() + self.timeout
        delay = UNAVAILABLE_FIRST_S
        while True:
            try:
                return self.request(op, **fields)
            except Unavailable:
                wait = delay * random.uniform(0.5, 1.0)
                if self._clock() + wait >= give_up:
                    raise
            self._sleep(wait)
            delay = min(delay * 2, UNAVAILABLE_CAP_S)

    def submit(self, queue: str, payload: Any, **options: Any) -> SubmitResult:
        """Create a job; ``options`` as for the async ``Client.submit``. With an
        ``idempotency_key``, ``Unavailable`` is retried (a repeat cannot make a second job)."""
        fields = job_fields(queue, payload, **options)
        send = self._retrying if fields.get("idempotency_key") is not None else self.request
        return submit_result(send("submit", **fields))

    def submit_batch(self, jobs: Sequence[dict[str, Any]]) -> list[SubmitResult]:
        """Create many jobs, all or none; ``Unavailable`` is retried if every job has an
        idempotency key."""
        keyed = all(job.get("idempotency_key") is not None for job in jobs)
        send = self._retrying if keyed else self.request
        reply = send("submit_batch", jobs=list(jobs))
        return [submit_result(r) for r in reply["results"]]

    def inspect(self, job_id: str, *, prefix: bool = False) -> JobView:
        """One job; with ``prefix``, ``job_id`` may be abbreviated (as ``Client.inspect``)."""
        fields = {"prefix": True} if prefix else {}
        return structure_reply(self.request("inspect", job_id=job_id, **fields)["job"], JobView)

    def stats(
        self,
        *,
        oldest_ready: bool = False,
        queues: Sequence[str] | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Stats:
        """As ``Client.stats``: a page of queues (``limit``, ``cursor``), or ``queues``."""
        fields: dict[str, Any] = {"oldest_ready": True} if oldest_ready else {}
        if queues is not None:
            fields["queues"] = list(queues)
        if limit is not None:
            fields["limit"] = limit
        if cursor is not None:
            fields["cursor"] = cursor
        return stats_reply(self.request("stats", **fields))

    def reload(self) -> dict[str, Any]:
        """As ``Client.reload``: the reply's fields."""
        return self.request("reload")

    def queue_pause(self, queue: str) -> bool:
        """As ``Client.queue_pause``: True (paused)."""
        return self.request("queue_pause", queue=queue)["paused"]

    def queue_resume(self, queue: str) -> bool:
        """As ``Client.queue_resume``: False (not paused)."""
        return self.request("queue_resume", queue=queue)["paused"]

    def queue_list(
        self,
        *,
        limit: int | None = None,
        cursor: str | None = None,
        queues: Sequence[str] | None = None,
    ) -> QueuePage:
        """As ``Client.queue_list``: a page of queues with their settings and counts."""
        fields: dict[str, Any] = {}
        if limit is not None:
            fields["limit"] = limit
        if cursor is not None:
            fields["cursor"] = cursor
        if queues is not None:
            fields["queues"] = list(queues)
        return structure_reply(self.request("queue_list", **fields), QueuePage)

    def queue_config(self, queue: str, **settings: Any) -> QueueConfig:
        """As ``Client.queue_config``: set (None: clear) some of a queue's settings."""
        reply = self.request("queue_config", **config_fields(queue, settings))
        return structure_reply(reply, QueueConfig)

    def schedule_put(
        self, name: str, cron: str, queue: str, payload: Any, **optional: Any
    ) -> ScheduleInfo:
        """As ``Client.schedule_put`` (the same keyword arguments)."""
        fields = schedule_fields(name, cron, queue, payload, **optional)
        return structure_reply(self.request("schedule_put", **fields)["schedule"], ScheduleInfo)

    def schedule_delete(self, name: str) -> None:
        """As ``Client.schedule_delete``."""
        self.request("schedule_delete", name=name)

    def schedule_pause(self, name: str) -> ScheduleInfo:
        """As ``Client.schedule_pause``."""
        return structure_reply(self.request("schedule_pause", name=name)["schedule"], ScheduleInfo)

    def schedule_resume(self, name: str) -> ScheduleInfo:
        """As ``Client.schedule_resume``."""
        reply = self.request("schedule_resume", name=name)
        return structure_reply(reply["schedule"], ScheduleInfo)

    def schedule_list(self, *, limit: int | None = None, cursor: str | None = None) -> SchedulePage:
        """As ``Client.schedule_list``."""
        fields: dict[str, Any] = {}
        if limit is not None:
            fields["limit"] = limit
        if cursor is not None:
            fields["cursor"] = cursor
        return structure_reply(self.request("schedule_list", **fields), SchedulePage)

    def workers_list(self, *, limit: int | None = None, cursor: str | None = None) -> WorkersPage:
        """As ``Client.workers_list``: a page of the server's connected workers."""
        fields: dict[str, Any] = {}
        if limit is not None:
            fields["limit"] = limit
        if cursor is not None:
            fields["cursor"] = cursor
        return structure_reply(self.request("workers_list", **fields), WorkersPage)

    def history(
        self,
        queue: str | None = None,
        *,
        start: int | None = None,
        end: int | None = None,
        step: int | None = None,
    ) -> History:
        """As ``Client.history``."""
        return history_reply(self.request("history", **history_fields(queue, start, end, step)))

    def cancel(self, job_id: str) -> JobState:
        """As ``Client.cancel``: the state the job was in."""
        return JobState(self.request("cancel", job_id=job_id)["was"])

    def cancel_queue(self, queue: str, *, states: Sequence[str] | None = None) -> int:
        """As ``Client.cancel_queue``: how many jobs were cancelled."""
        fields: dict[str, Any] = {"queue": queue, "all": True}
        if states is not None:
            fields["states"] = list(states)
        return self.request("cancel", **fields)["cancelled"]

    def jobs_list(
        self,
        queue: str | None = None,
        *,
        states: Sequence[str] | None = None,
        search: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        order: str | None = None,
    ) -> JobsPage:
        """As ``Client.jobs_list``: a page of jobs, newest first unless ``order="oldest"``."""
        given = {"queue": queue, "search": search, "limit": limit, "cursor": cursor}
        fields: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        if order is not None:
            fields["order"] = order
        if states is not None:
            fields["states"] = list(states)
        return structure_reply(self.request("jobs_list", **fields), JobsPage)

    def promote(self, job_id: str) -> JobState:
        """As ``Client.promote``: the state the job was in."""
        return JobState(self.request("promote", job_id=job_id)["was"])


def _answer(call: _Call, reply: dict[str, Any]) -> None:
    call.reply, call.done = reply, True


def connect(address: str | tuple[str, int] = DEFAULT_ADDRESS, **options: Any) -> BlockingClient:
    """A blocking client; it connects on its first call."""
    return BlockingClient(address, **options)
