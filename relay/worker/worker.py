"""The pull worker: lease jobs into N slots, run handlers, renew, ack or fail.

    worker = relay.Worker("127.0.0.1:7400", queues=["email"], concurrency=16,
                          handler=send_email)
    await worker.run()          # until worker.stop(), or SIGINT/SIGTERM via run_worker()

A ``trio.CapacityLimiter`` of ``concurrency`` slots bounds the jobs held: the worker asks
the server for at most as many jobs as it has free slots (``lease count`` = free slots,
with a long-poll ``wait_ms``), and each job holds its slot from lease to ack. So a worker
of concurrency N never holds more than N jobs.

A job has a task of its own while its handler runs. A handler that returns hands its ack to
the worker's ack task, and the job's task ends there; the ack task frees the slot once the
ack is answered (a job costs no wake-up after its ack). Until then the job still holds its
slot and its lease is still renewed.

While a handler runs, its lease is renewed about every third of the lease, by one renewal
task for the whole worker (it wakes at the earliest renewal due, at most four times per
renewal interval, and renews every job due then, concurrently). If a renewal is refused
(the lease expired, or another worker holds the job now), the handler is cancelled and
nothing is acked: the job belongs to someone else. If it is refused because the job was
cancelled (``cancel``), the handler is cancelled too, and the job is settled without a
fail (``job.cancelled`` in the log); so is a job whose ack or fail is refused so. A
handler that returns is acked with its return value as the result (when it is
JSON-serialisable; the acks of jobs that finish while an ack request is in flight go
together in one ``ack_batch``); one that raises is failed with the exception's text
(``PermanentError``: not retryable). Synchronous handlers run in a worker thread, under
the same slots.

Graceful stop: stop leasing, let running jobs finish within ``shutdown_timeout``, then
cancel them and ``release`` their leases so others can take them at once. A second stop
(second signal) cancels at once.

The server going away is one rule, at start as later: it is retried, with backoff, and
logged. A worker given an address tries until the server answers (50 ms doubling to 5 s,
with jitter), logging each attempt; after the first connection, its client reconnects
(50 ms doubling to 2 s, for up to its reconnect timeout, relay/client/tcp.py), and a lease that
fails meanwhile is logged and asked again, so that the worker goes on trying as long as
it runs. At start, what no retry can fix ends ``run`` with its error: a token refused or
of the producer role, a certificate not trusted or TLS on one side only, a peer that is
not a relay-trio server, a lease length or a number of queues over the server's limits.
Later (a token revoked, a server restarted with smaller limits) the lease requests are
refused, logged and asked again: a running worker is not stopped by its server.

Here: the configuration, ``run`` (which owns every task: one per running job, the renewal
task and the ack task), ``stop``, the lease loop and the renewal task. ``Worker`` inherits
the rest, as ``SqliteStore`` inherits the store's parts: relay/worker/jobs.py, one job's
task (its handler, then its ack handed over or its outcome reported); relay/worker/acks.py,
the ack task.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import random
import secrets
import signal
import socket
from collections.abc import Mapping, Sequence

import attrs
import trio

from relay.client.client import Client, open_client
from relay.client.replies import Hello
from relay.client.tcp import CONNECT_TIMEOUT_S, connect_failure_text, tls_refused
from relay.protocol.errors import (
    BadRequest,
    Cancelled,
    ConnectionLost,
    Overloaded,
    RelayError,
    ShuttingDown,
    Unauthorized,
)
from relay.util.histogram import Histogram
from relay.util.log import event
from relay.util.nursery import open_service_nursery
from relay.worker.acks import WorkerAcks
from relay.worker.jobs import (
    _LEASE_GONE,
    SETTLE_TIMEOUT_S,
    Handler,
    PermanentError,
    WorkerJobs,
    _PendingAck,
    _Running,
)

log = logging.getLogger("relay.worker")

DEFAULT_LEASE_MS = 30_000
# How long one lease request may wait on the server for work (a long-poll).
LEASE_WAIT_MS = 5_000
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# After a failed lease request (server restarting...), wait this long before the next,
# doubling while they keep failing (a token revoked: a line every 10 s, not a flood).
LEASE_ERROR_BACKOFF_S = 0.5
LEASE_ERROR_BACKOFF_CAP_S = 10.0
# A worker that starts before its server (or while it restarts) tries again after 50 ms,
# doubling to 5 s: quick to catch a server that is starting, and a line in the log every
# few seconds, not a flood, while one is down.
CONNECT_RETRY_FIRST_S = 0.05
CONNECT_RETRY_CAP_S = 5.0
# Most acks, and most bytes of results, sent in one ack_batch: well inside the server's
# default max_batch (1000) and max_frame_bytes (1 MiB), and lowered to a quarter of the
# frame and to max_batch if the server advertises less. A batch the server refuses anyway
# is acked one by one.
MAX_ACK_BATCH = 100
MAX_ACK_BATCH_BYTES = 256 * 1024


def default_worker_id() -> str:
    """Unique per process: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def _is_coroutine_handler(handler: Handler) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004
    )


@attrs.frozen
class WorkerStatistics:
    running: int
    concurrency: int
    succeeded: int
    failed: int
    lost: int  # renewal refused: cancelled, not acked
    released: int
    cancelled: int = 0  # the job was cancelled (the server said so): stopped, not failed


class Worker(WorkerJobs, WorkerAcks):
    def __init__(
        self,
        server: str | tuple[str, int] | Client,
        *,
        queues: Sequence[str] | None = None,
        handler: Handler | None = None,
        handlers: Mapping[str, Handler] | None = None,
        concurrency: int = 1,
        lease_ms: int = DEFAULT_LEASE_MS,
        wait_ms: int = LEASE_WAIT_MS,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        worker_id: str | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        """Args:
        server: an address "HOST:PORT" (or "tls://HOST:PORT"), or a ``Client`` (e.g. from
            ``open_local``).
        token: with an address, the access token (role ``worker`` or ``admin``) that its
            connection says hello with; a given ``Client`` brings its own.
        queues: the queues to lease from; with ``handlers``, defaults to its keys.
        handler: one handler for every queue; or ``handlers``, one per queue.
        concurrency: slots, the most jobs held at once.
        tls_ca: with an address, a private CA's PEM file to verify the server with (implies
            TLS; see ``open_client``).
        connect_timeout: with an address, how long one attempt to connect and say hello
            may take (then it is tried again, see the module docstring).
        """
        if (handler is None) == (handlers is None):
            raise ValueError("give handler or handlers (one per queue), not both or neither")
        self._handlers: Mapping[str, Handler] = dict(handlers or {})
        self._default = handler
        self.queues = list(queues if queues is not None else self._handlers)
        if not self.queues:
            raise ValueError("no queues to lease from")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if token is not None and isinstance(server, Client):
            raise ValueError("a Client brings its own token: give the token to open_client")
        self._server = server
        self._token = token
        self._tls_ca = tls_ca
        self._connect_timeout = connect_timeout
        self.concurrency = concurrency
        self.lease_ms = lease_ms
        self.wait_ms = wait_ms
        self.shutdown_timeout = shutdown_timeout
        self.worker_id = worker_id or default_worker_id()
        # Each slot holds a job, and, for a sync handler, its thread (a limiter of its own
        # per job, relay/worker/jobs.py: trio's default thread limit of 40 never stands
        # between a slot and its job, and a thread left running keeps its slot).
        self._slots = trio.CapacityLimiter(concurrency)
        self._leasing = trio.CancelScope()
        self._jobs_scope = trio.CancelScope()
        # Around the attempts to reach the server and the waits between them: stop() ends
        # them wherever they are (a connection, its hello, a wait).
        self._connecting = trio.CancelScope()
        self._connected = False  # the server answered: stop() is graceful from then on
        self._stopping = False
        # Keyed by entry, not job id: a job whose lease expired under a slow run may be
        # leased to this worker again while that run is still finishing.
        self._running: set[_Running] = set()
        self._slot_freed = trio.lowlevel.ParkingLot()  # the lease loop waits here
        self._job_started = trio.lowlevel.ParkingLot()  # an idle renewal task waits here
        # Seconds between renewals of one lease, and the least time between two passes
        # of the renewal task (so a stream of short jobs does not wake it per job).
        self._renew_interval = max(lease_ms / 3000, 0.01)
        self._renew_granularity = self._renew_interval / 4
        self._acks: list[_PendingAck] = []  # finished jobs' acks, not yet sent
        self._acks_sending: list[_PendingAck] = []  # the ack request in flight
        self._acks_queued = trio.lowlevel.ParkingLot()  # the ack task waits here
        self._acks_answered = trio.lowlevel.ParkingLot()  # a stopping worker waits here
        self._ack_batches = True  # cleared if the server does not know ack_batch
        # Acks and result bytes per ack_batch: the defaults, lowered to what the server
        # advertises when the worker starts.
        self._ack_batch_max = MAX_ACK_BATCH
        self._ack_batch_bytes = MAX_ACK_BATCH_BYTES
        self._lease_max = concurrency  # jobs per lease request: the server's max_batch too
        self._acking = True  # cleared when the ack task ends: jobs then ack on their own
        # Set when a graceful stop begins: the latest moment for the last acks, the bound
        # a job had before (its handler's shutdown timeout, then its settle timeout).
        self._settle_by: float | None = None
        # Which handlers are coroutine functions, decided once rather than per job.
        self._is_async = {
            id(h): _is_coroutine_handler(h)
            for h in (handler, *self._handlers.values())
            if h is not None
        }
        self._counts = dict.fromkeys(("succeeded", "failed", "lost", "released", "cancelled"), 0)
        self.durations = Histogram((0.001, 0.01, 0.1, 1, 10, 60, 600))

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(
            running=len(self._running), concurrency=self.concurrency, **self._counts
        )

    def stop(self) -> None:
        """First call: graceful (stop leasing, finish or release within the timeout).
        Second call: cancel running jobs at once (their leases are still released)."""
        if self._stopping:
            self._jobs_scope.cancel()
            return
        self._stopping = True
        self._leasing.cancel()
        if not self._connected:  # still trying to reach its server: it stops trying
            self._connecting.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        """Work until ``stop()``. Owns its connection (unless given a client), one task per
        running job, the renewal task and the ack task; all end before this returns.

        Raises what no retry can fix (see the module docstring): ``Unauthorized``,
        ``BadRequest`` (a setting over the server's limits, with ``field`` naming it),
        ``WrongServer``, an ``ssl.SSLError``."""
        # A stop() that comes before the server answers cancels this scope; one after it
        # stops the worker gracefully (see stop).
        with self._connecting:
            async with contextlib.AsyncExitStack() as stack:
                client, hello = await self._connect(stack)
                self._connected = True
                helpers = await stack.enter_async_context(trio.open_nursery())
                event(
                    log, logging.INFO, "worker.started", worker_id=self.worker_id,
                    queues=self.queues, concurrency=self.concurrency,
                )  # fmt: skip
                self._fit(hello.limits)
                helpers.start_soon(self._renew_loop, client)
                helpers.start_soon(self._ack_loop, client)
                with self._jobs_scope:
                    async with trio.open_nursery() as jobs:
                        task_status.started()
                        with self._leasing:
                            await self._lease_loop(client, jobs)
                        # Leasing stopped: running jobs get the shutdown timeout, then are
                        # cancelled (and release their leases).
                        self._jobs_scope.deadline = trio.current_time() + self.shutdown_timeout
                        self._settle_by = self._jobs_scope.deadline + SETTLE_TIMEOUT_S
                # No job runs any more; the acks of the last ones may still be on their way.
                if self._settle_by is not None:
                    with trio.move_on_at(self._settle_by):
                        while self._acking and (self._acks or self._acks_sending):
                            await self._acks_answered.park()
                helpers.cancel_scope.cancel()
        if not self._connected:  # stopped before the server answered
            task_status.started()
        event(log, logging.INFO, "worker.stopped", worker_id=self.worker_id, **self._counts)

    async def _connect(self, stack: contextlib.AsyncExitStack) -> tuple[Client, Hello]:
        """The client to work with and its server's hello: the client given, or a
        connection to the address, tried until the server answers (or until cancelled:
        ``stop()``). The hello is checked: a producer's token, or settings over the
        server's limits, raise."""
        if isinstance(self._server, Client):
            client = self._server
            with trio.fail_after(SETTLE_TIMEOUT_S):
                hello = await client.hello()
        else:
            client, hello = await self._reach_server(stack)
        self._check_hello(hello)
        return client, hello

    async def _reach_server(self, stack: contextlib.AsyncExitStack) -> tuple[Client, Hello]:
        """Try to connect and say hello until the server answers; the connection is left
        on ``stack``. Until cancelled (``stop()``), or what no retry fixes raises."""
        delay = CONNECT_RETRY_FIRST_S
        while True:
            try:
                async with contextlib.AsyncExitStack() as attempt:
                    connection = open_client(
                        self._server, token=self._token, tls_ca=self._tls_ca,
                        connect_timeout=self._connect_timeout,
                    )  # fmt: skip
                    client = await attempt.enter_async_context(connection)
                    with trio.fail_after(SETTLE_TIMEOUT_S):
                        hello = await client.hello()
                    stack.push_async_exit(attempt.pop_all())
                    return client, hello
            except (OSError, trio.TooSlowError, ConnectionLost, Overloaded, ShuttingDown) as exc:
                if tls_refused(exc):
                    raise
                wait = delay * random.uniform(0.5, 1.0)
                why = connect_failure_text(exc)
                event(
                    log, logging.WARNING, "worker.connect_failed", address=str(self._server),
                    error=why, retry_in_s=round(wait, 2),
                    message=f"worker {self.worker_id}: cannot reach {self._server} ({why}); "
                    f"trying again in {wait:.2g} s",
                )  # fmt: skip
                await trio.sleep(wait)
                delay = min(delay * 2, CONNECT_RETRY_CAP_S)

    def _check_hello(self, hello: Hello) -> None:
        """Refuse at start what the server would refuse on every lease: a token of the
        producer role; a lease or a list of queues over its limits. (A concurrency over
        its max_batch is not: leases then ask for max_batch jobs at most.)"""
        if hello.role == "producer":
            raise Unauthorized(
                "the token's role is producer: a worker needs the worker or admin role"
            )
        checks = (
            ("lease_ms", self.lease_ms, "max_lease_ms"),
            ("queues", len(self.queues), "max_queues_per_lease"),
        )
        for field, value, limit in checks:
            top = hello.limits.get(limit)
            if top is not None and value > top:
                raise BadRequest(
                    f"{field} {value} is more than the server allows ({limit} = {top})",
                    field=field,
                )

    async def _lease_loop(self, client: Client, jobs: trio.Nursery) -> None:
        backoff = LEASE_ERROR_BACKOFF_S
        while True:
            while self._slots.available_tokens == 0:
                await self._slot_freed.park()
            free = min(int(self._slots.available_tokens), self._lease_max)
            try:
                # If this wait is cancelled (stop), the client releases whatever the
                # server leases to it after all.
                leased = await client.lease(
                    self.queues, self.worker_id, count=free, lease_ms=self.lease_ms,
                    wait_ms=self.wait_ms,
                )  # fmt: skip
            except RelayError as exc:
                event(
                    log, logging.WARNING, "worker.lease_failed", error=repr(exc),
                    retry_in_s=backoff,
                    message=f"worker {self.worker_id}: a lease failed ({exc.code}: "
                    f"{exc.message}); asking again in {backoff:g} s",
                )  # fmt: skip
                if isinstance(exc, BadRequest):
                    # A lease this worker made within the limits it read is refused: the
                    # server may have restarted with smaller ones. Read them again.
                    await self._fit_to_server(client)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, LEASE_ERROR_BACKOFF_CAP_S)
                continue
            backoff = LEASE_ERROR_BACKOFF_S
            renew_at = trio.current_time() + self._renew_interval
            for job in leased:
                owner = object()
                self._slots.acquire_on_behalf_of_nowait(owner)
                running = _Running(job, trio.CancelScope(), renew_at)
                self._running.add(running)
                jobs.start_soon(self._run_job, client, running, owner, name=job.job_id)
            if leased:
                self._job_started.unpark_all()

    async def _renew_loop(self, client: Client) -> None:
        """Renew every running job's lease about every third of the lease."""
        while True:
            if not self._running:
                await self._job_started.park()
                continue
            now = trio.current_time()
            # Renew what falls due before the next pass, so no lease waits two passes.
            horizon = now + self._renew_granularity
            due = [r for r in self._running if r.renew_at <= horizon]
            if due:
                for running in due:
                    running.renew_at = now + self._renew_interval
                # A pass waits at most one interval: a renewal still unanswered then is
                # given up, and sent again when it falls due next.
                with trio.move_on_after(self._renew_interval) as slow:
                    async with trio.open_nursery() as nursery:
                        for running in due:
                            nursery.start_soon(self._renew, client, running)
                if slow.cancelled_caught:
                    event(log, logging.WARNING, "worker.renewals_unanswered", jobs=len(due))
            # Jobs started later are due later: the earliest of those running now is next.
            wake = min((r.renew_at for r in self._running), default=now)
            await trio.sleep_until(max(wake, now + self._renew_granularity))

    async def _renew(self, client: Client, running: _Running) -> None:
        job = running.job
        try:
            await client.renew(job.job_id, self.worker_id, job.token, lease_ms=self.lease_ms)
        except Cancelled:
            if running.done:  # its ack or fail is refused too, and says so (jobs.py)
                return
            # The job was cancelled: stop its handler; it is settled without a fail.
            running.cancelled = True
            self._log_cancelled(job, "its renewal", "its handler is stopped, no fail is sent")
            running.scope.cancel()
        except (*_LEASE_GONE, ConnectionLost) as exc:
            if running.done:
                # Settled meanwhile (the token is spent), or its ack is on its way (and
                # will be refused, and counted then): there is no handler left to stop.
                return
            # The job is someone else's now (or may be): stop working on it.
            running.lost = True
            event(log, logging.WARNING, "job.lease_lost", job_id=job.job_id, error=repr(exc))
            running.scope.cancel()
        except RelayError as exc:
            # Overloaded, shutting down, internal: the lease may still hold; try again
            # next pass (an expired one is refused then).
            event(log, logging.WARNING, "job.renew_failed", job_id=job.job_id, error=repr(exc))

    async def _fit_to_server(self, client: Client) -> None:
        """Read the server's limits again (``hello``) and keep within them (``_fit``).
        Without an answer, the limits read before hold."""
        try:
            with trio.move_on_after(SETTLE_TIMEOUT_S):
                self._fit((await client.hello()).limits)
        except RelayError as exc:
            event(log, logging.INFO, "worker.hello_failed", error=repr(exc))

    def _fit(self, limits: Mapping[str, int]) -> None:
        """Keep leases and ack batches within the limits the server advertises: a lease of
        more than its max_batch would be refused. A limit it does not advertise leaves the
        default, and a batch the server refuses anyway is acked one by one."""
        most = max(1, limits.get("max_batch", MAX_ACK_BATCH))
        self._lease_max = min(self.concurrency, most)
        self._ack_batch_max = min(MAX_ACK_BATCH, most)
        frame = limits.get("max_frame_bytes", 4 * MAX_ACK_BATCH_BYTES)
        self._ack_batch_bytes = max(1, min(MAX_ACK_BATCH_BYTES, frame // 4))


async def run_worker(worker: Worker) -> list[signal.Signals]:
    """Run ``worker`` until SIGINT/SIGTERM: the first stops it gracefully (it logs
    ``worker.draining`` with how long running jobs may still take), the second at once.
    Returns the signals received, in order (empty if the worker stopped otherwise): a
    command line exits 130 after a Ctrl-C. For command lines and simple programs."""
    received: list[signal.Signals] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        # A service nursery: what worker.run() raises comes out as itself, not in a group.
        async with open_service_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    received.append(signal.Signals(signum))
                    name = received[-1].name
                    if len(received) == 1:
                        running = len(worker._running)
                        event(
                            log, logging.WARNING, "worker.draining", signal=name,
                            running=running, timeout_s=worker.shutdown_timeout,
                            message=f"{name}: draining: no more leases; {running} running "
                            f"job(s) may finish within {worker.shutdown_timeout:g} s, then are "
                            "released (signal again: stop at once)",
                        )  # fmt: skip
                    else:
                        event(
                            log, logging.WARNING, "worker.stopping_now", signal=name,
                            running=len(worker._running),
                            message=f"{name} again: stopping at once; the running jobs' "
                            "leases are released",
                        )  # fmt: skip
                    worker.stop()

            nursery.start_soon(watch)
            await worker.run()
    return received


__all__ = ["PermanentError", "Worker", "WorkerStatistics", "default_worker_id", "run_worker"]
