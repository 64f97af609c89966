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
nothing is acked: the job belongs to someone else. A handler that returns is acked
with its return value as the result (when it is JSON-serialisable; the acks of jobs that
finish while an ack request is in flight go together in one ``ack_batch``); one that raises is
failed with the exception's text (``PermanentError``: not retryable). Synchronous handlers
run in a worker thread, under the same slots.

Graceful stop: stop leasing, let running jobs finish within ``shutdown_timeout``, then
cancel them and ``release`` their leases so others can take them at once. A second stop
(second signal) cancels at once.
"""

from __future__ import annotations

import inspect
import logging
import os
import secrets
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import orjson
import trio

from relay.client import Client, LeasedJob, open_client
from relay.errors import (
    BadRequest,
    ConnectionLost,
    FrameTooLarge,
    InternalError,
    JobNotFound,
    LeaseExpired,
    RelayError,
    StaleToken,
    UnknownOp,
)
from relay.histogram import Histogram
from relay.log import event

log = logging.getLogger("relay.worker")

Handler = Callable[[LeasedJob], Any] | Callable[[LeasedJob], Awaitable[Any]]

DEFAULT_LEASE_MS = 30_000
# How long one lease request may wait on the server for work (a long-poll).
LEASE_WAIT_MS = 5_000
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# After a failed lease request (server restarting...), wait this long before the next.
LEASE_ERROR_BACKOFF_S = 0.5
# Bound on reporting a job's outcome (ack, fail, release): past it the lease expires and
# the job runs again, which at-least-once delivery allows.
SETTLE_TIMEOUT_S = 10.0
# Most acks, and most bytes of results, sent in one ack_batch: well inside the server's
# default max_batch (1000) and max_frame_bytes (1 MiB), and lowered to a quarter of the
# frame and to max_batch if the server advertises less. A batch the server refuses anyway
# is acked one by one.
MAX_ACK_BATCH = 100
MAX_ACK_BATCH_BYTES = 256 * 1024
# What an ack costs in a request besides its result: ids, token, keys.
ACK_OVERHEAD_BYTES = 128


class PermanentError(Exception):
    """Raise from a handler to fail the job without retries (it goes dead at once)."""


def default_worker_id() -> str:
    """Unique per process: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def _result_of(value: Any) -> tuple[orjson.Fragment | None, int]:
    """The handler's return value as JSON, if it can be stored as JSON (else None), and
    its size. Encoded once: the ack request embeds the fragment as it is."""
    if value is None:
        return None, 0
    try:
        text = orjson.dumps(value)
    except TypeError:
        return None, 0
    return orjson.Fragment(text), len(text)


def _is_coroutine_handler(handler: Handler) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004
    )


# Refusals that mean the worker's lease on the job has ended.
_LEASE_GONE = (StaleToken, LeaseExpired, JobNotFound)


def _give_up(acks: list[_PendingAck], error: RelayError) -> None:
    """The acks of ``acks`` still unanswered end with ``error``."""
    for pending in acks:
        if not pending.answered:
            pending.error, pending.answered = error, True


def _is_cancellation(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_cancellation(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


def _error_text(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@attrs.define(eq=False)
class _Running:
    """A job whose handler runs: what the renewal task needs to keep or give up its lease."""

    job: LeasedJob
    scope: trio.CancelScope  # the handler's: cancelled when the lease is lost
    renew_at: float
    lost: bool = False
    # The handler has returned: a renewal refusal no longer cancels anything. (If its
    # ack, fail or release is still to come, that is refused too, and counted as lost.)
    done: bool = False


@attrs.define(eq=False)
class _PendingAck:
    """A finished job's ack, waiting for the ack task to send it with the others. Until
    it is answered the job keeps its slot, and its lease is renewed."""

    running: _Running
    owner: object  # holds the job's slot
    started: float  # when the job was leased (trio clock)
    result: Any
    size: int  # bytes of the result's JSON
    error: RelayError | None = None  # why the server refused it (or could not be asked)
    answered: bool = False  # the server's answer (or a final error) has come


@attrs.frozen
class WorkerStatistics:
    running: int
    concurrency: int
    succeeded: int
    failed: int
    lost: int  # renewal refused: cancelled, not acked
    released: int


class Worker:
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
        self.concurrency = concurrency
        self.lease_ms = lease_ms
        self.wait_ms = wait_ms
        self.shutdown_timeout = shutdown_timeout
        self.worker_id = worker_id or default_worker_id()
        self._slots = trio.CapacityLimiter(concurrency)
        # Sync handlers' threads: as many as slots, so trio's default thread limit (40)
        # never stands between a slot and its job.
        self._threads = trio.CapacityLimiter(concurrency)
        self._leasing = trio.CancelScope()
        self._jobs_scope = trio.CancelScope()
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
        self._counts = dict.fromkeys(("succeeded", "failed", "lost", "released"), 0)
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

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        """Work until ``stop()``. Owns its connection (unless given a client), one task per
        running job, the renewal task and the ack task; all end before this returns."""
        async with self._client() as client, trio.open_nursery() as helpers:
            event(
                log, logging.INFO, "worker.started", worker_id=self.worker_id,
                queues=self.queues, concurrency=self.concurrency,
            )  # fmt: skip
            await self._fit_to_server(client)
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
        event(log, logging.INFO, "worker.stopped", worker_id=self.worker_id, **self._counts)

    @asynccontextmanager
    async def _client(self) -> AsyncIterator[Client]:
        if isinstance(self._server, Client):
            yield self._server
        else:
            async with open_client(self._server, token=self._token, tls_ca=self._tls_ca) as client:
                yield client

    async def _lease_loop(self, client: Client, jobs: trio.Nursery) -> None:
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
                event(log, logging.WARNING, "worker.lease_failed", error=repr(exc))
                if isinstance(exc, BadRequest):
                    # A lease this worker made within the limits it read is refused: the
                    # server may have restarted with smaller ones. Read them again.
                    await self._fit_to_server(client)
                await trio.sleep(LEASE_ERROR_BACKOFF_S)
                continue
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

    async def _fit_to_server(self, client: Client) -> None:
        """Keep leases and ack batches within the limits the server advertises (``hello``):
        a lease of more than its max_batch would be refused. Without an answer, the
        defaults hold, and a batch the server refuses is acked one by one."""
        try:
            with trio.move_on_after(SETTLE_TIMEOUT_S):
                limits = (await client.hello()).limits
                most = max(1, limits.get("max_batch", MAX_ACK_BATCH))
                self._lease_max = min(self.concurrency, most)
                self._ack_batch_max = min(MAX_ACK_BATCH, most)
                frame = limits.get("max_frame_bytes", 4 * MAX_ACK_BATCH_BYTES)
                self._ack_batch_bytes = max(1, min(MAX_ACK_BATCH_BYTES, frame // 4))
        except RelayError as exc:
            event(log, logging.INFO, "worker.hello_failed", error=repr(exc))

    async def _ack_loop(self, client: Client) -> None:
        """Send the acks of finished jobs: all that are waiting, in one ``ack_batch``. One
        request is in flight at a time, so acks that finish meanwhile form the next batch:
        an idle worker acks at once, a busy one in batches that grow with the load.

        The ack task settles the jobs it acks: once an ack is answered it frees the job's
        slot and ends its renewals, so a job's own task ends as soon as its ack is queued
        (no wake-up per job). An ack unanswered within the settle timeout is given up.
        Cancelled, it still sends what is queued or was in flight, shielded, within the
        settle timeout and never past a graceful stop's bound (``_settle_by``), renewing
        those jobs' leases meanwhile; a repeated ack is answered ok. What a cut-short
        request already got answered is not sent again, and after a bug (not a
        cancellation) nothing is: it would meet the bug again.
        """
        failure: BaseException | None = None
        try:
            while True:
                while not self._acks:
                    await self._acks_queued.park()
                await self._ack_next(client)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._acking = False
            leftovers = self._acks_sending + self._acks
            self._acks_sending, self._acks = [], []
            # What the cut-short request got answered is settled; the rest goes again.
            self._settled([p for p in leftovers if p.answered])
            leftovers = [p for p in leftovers if not p.answered]
            if leftovers and failure is not None and not _is_cancellation(failure):
                # A bug, not a stop: sending again would meet it again.
                _give_up(leftovers, InternalError(f"the ack task failed: {failure!r}"))
                self._settled(leftovers)
            elif leftovers:
                await self._send_leftovers(client, leftovers)

    async def _send_leftovers(self, client: Client, leftovers: list[_PendingAck]) -> None:
        deadline = trio.current_time() + SETTLE_TIMEOUT_S
        if self._settle_by is not None:
            deadline = min(deadline, self._settle_by)
        self._acks = leftovers  # _take_acks cuts them into batches within the limits
        try:
            with trio.CancelScope(shield=True, deadline=deadline):
                async with trio.open_nursery() as renewing:
                    # The renewal task went with the rest of the worker: these jobs still
                    # hold their leases until their acks are answered, so renew them here.
                    renewing.start_soon(self._renew_loop, client)
                    while self._acks:
                        await self._ack_next(client)
                    renewing.cancel_scope.cancel()
        finally:
            # Past the deadline: not acked; each lease expires and the job runs again.
            unanswered = self._acks_sending + self._acks
            self._acks_sending, self._acks = [], []
            _give_up(unanswered, ConnectionLost("no answer to the acks in time"))
            self._settled(unanswered)

    async def _ack_next(self, client: Client) -> None:
        """Send the oldest waiting acks as one batch and settle them once answered; an
        ack unanswered within the settle timeout is given up. Cancelled meanwhile, the
        batch stays in ``_acks_sending`` for the caller."""
        batch = self._acks_sending = self._take_acks()
        with trio.move_on_after(SETTLE_TIMEOUT_S):
            await self._send_acks(client, batch)
        _give_up(batch, ConnectionLost("no answer to the acks in time"))
        self._acks_sending = []
        self._settled(batch)

    def _settled(self, batch: list[_PendingAck]) -> None:
        """The acks of ``batch`` are answered (or given up): count, log, free the slots."""
        debug = log.isEnabledFor(logging.DEBUG)
        now = trio.current_time()
        for pending in batch:
            job = pending.running.job
            if pending.error is None:
                self._counts["succeeded"] += 1
                if debug:
                    event(log, logging.DEBUG, "job.succeeded", job_id=job.job_id,
                          queue=job.queue, attempt=job.attempt)  # fmt: skip
            else:
                self._not_settled(job, "ok", pending.error)
            self._release(pending.running, pending.owner, now - pending.started)
        self._slot_freed.unpark_all()  # once for the batch: the lease loop asks for them all
        self._acks_answered.unpark_all()

    def _finish(self, running: _Running, owner: object, started: float) -> None:
        """A job its own task settled: no more renewals, and its slot is free."""
        self._release(running, owner, trio.current_time() - started)
        self._slot_freed.unpark_all()

    def _release(self, running: _Running, owner: object, duration: float) -> None:
        self._running.discard(running)
        self._slots.release_on_behalf_of(owner)
        self.durations.observe(duration)

    def _take_acks(self) -> list[_PendingAck]:
        """The oldest waiting acks, within the batch's count and bytes (at least one)."""
        size = 0
        n = 0
        for pending in self._acks[: self._ack_batch_max]:
            size += pending.size + ACK_OVERHEAD_BYTES
            if n and size > self._ack_batch_bytes:
                break
            n += 1
        batch = self._acks[:n]
        del self._acks[:n]
        return batch

    async def _send_acks(self, client: Client, batch: list[_PendingAck]) -> None:
        if len(batch) > 1 and self._ack_batches:
            acks = [(p.running.job.job_id, p.running.job.token, p.result) for p in batch]
            try:
                outcomes = await client.ack_batch(self.worker_id, acks)
            except UnknownOp:
                self._ack_batches = False  # an older server: one ack per job from now on
            except (BadRequest, FrameTooLarge):
                pass  # one unacceptable result must not fail the others: one by one
            except RelayError as exc:
                for pending in batch:
                    pending.error, pending.answered = exc, True
                return
            else:
                for pending, outcome in zip(batch, outcomes, strict=True):
                    pending.error, pending.answered = outcome, True
                return

        async def ack_one(pending: _PendingAck) -> None:
            job = pending.running.job
            try:
                await client.ack(job.job_id, self.worker_id, job.token, pending.result)
            except RelayError as exc:
                pending.error = exc
            pending.answered = True

        async with trio.open_nursery() as nursery:
            for pending in batch:
                nursery.start_soon(ack_one, pending)

    async def _renew(self, client: Client, running: _Running) -> None:
        job = running.job
        try:
            await client.renew(job.job_id, self.worker_id, job.token, lease_ms=self.lease_ms)
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

    async def _run_job(self, client: Client, running: _Running, owner: object) -> None:
        started = trio.current_time()
        job = running.job
        handed_over = False  # to the ack task, which then finishes the job
        try:
            try:
                outcome, value = await self._execute(running)
            except BaseException as exc:
                # Shutdown timeout or a second stop: hand the job back, then go.
                running.done = True
                if _is_cancellation(exc):
                    await self._settle(client, job, "cancelled", None)
                raise
            if outcome == "ok" and self._acking:
                result, size = _result_of(value)
                self._acks.append(_PendingAck(running, owner, started, result, size))
                self._acks_queued.unpark_all()
                handed_over = True
                return
            await self._settle(client, job, outcome, value)
        finally:
            if not handed_over:
                self._finish(running, owner, started)

    async def _execute(self, running: _Running) -> tuple[str, Any]:
        """Run the handler (the renewal task keeps its lease). Returns (outcome, value):
        ("ok", result), ("error", exception), ("lost", None) or ("cancelled", None)."""
        job = running.job
        handler = self._handlers.get(job.queue, self._default)
        outcome: tuple[str, Any] = ("cancelled", None)
        with running.scope:
            try:
                if handler is None:
                    raise PermanentError(f"no handler for queue {job.queue}")
                outcome = ("ok", await self._call(handler, job))
            except Exception as exc:
                outcome = ("error", exc)
        # From here on a refused renewal is about a token this job is done with.
        running.done = True
        if running.lost:
            return "lost", None
        return outcome

    async def _call(self, handler: Handler, job: LeasedJob) -> Any:
        if self._is_async[id(handler)]:
            return await handler(job)  # type: ignore[misc]
        # A thread cannot be interrupted. On cancellation (lease lost, shutdown timeout)
        # stop waiting for it: it runs on to its end, its result ignored, nothing acked.
        # It keeps its token of _threads until then, so threads never exceed the slots.
        result = await trio.to_thread.run_sync(
            handler, job, limiter=self._threads, abandon_on_cancel=True
        )
        if inspect.isawaitable(result):
            return await result
        return result

    async def _settle(self, client: Client, job: LeasedJob, outcome: str, value: Any) -> None:
        """Ack, fail or release, shielded from cancellation (a stopping worker still
        reports what it finished) but within its own deadline: past it the lease simply
        expires and the job runs again (at-least-once). One scope does both."""
        ids = {"job_id": job.job_id, "queue": job.queue, "attempt": job.attempt}
        if outcome == "lost":
            self._counts["lost"] += 1
            return
        error: BaseException | None = None
        deadline = trio.current_time() + SETTLE_TIMEOUT_S
        with trio.CancelScope(shield=True, deadline=deadline) as scope:
            try:
                await self._report(client, job, outcome, value, ids)
            except RelayError as exc:
                error = exc
        if scope.cancelled_caught:
            error = trio.TooSlowError(f"no answer within {SETTLE_TIMEOUT_S} s")
        if error is not None:
            self._not_settled(job, outcome, error)

    def _not_settled(self, job: LeasedJob, outcome: str, error: BaseException) -> None:
        """Log (and count) an ack, fail or release the server did not take. Refused because
        the lease had ended (expired, or taken by the server): the job is lost to this
        worker and runs again, as for a handler cancelled by a refused renewal. Otherwise
        (no answer, the server unreachable or overloaded) it runs again once its lease
        expires."""
        lost = isinstance(error, _LEASE_GONE)
        if lost:
            self._counts["lost"] += 1
        event(log, logging.WARNING, "job.lease_lost" if lost else "job.settle_failed",
              outcome=outcome, error=repr(error), job_id=job.job_id, queue=job.queue,
              attempt=job.attempt)  # fmt: skip

    async def _report(
        self, client: Client, job: LeasedJob, outcome: str, value: Any, ids: dict[str, Any]
    ) -> None:
        if outcome == "ok":  # the ack task has stopped (the worker is being cancelled)
            result, _ = _result_of(value)
            await client.ack(job.job_id, self.worker_id, job.token, result)
            self._counts["succeeded"] += 1
            event(log, logging.DEBUG, "job.succeeded", **ids)
        elif outcome == "error":
            retryable = not isinstance(value, PermanentError)
            result = await client.fail(
                job.job_id, self.worker_id, job.token, _error_text(value), retryable=retryable
            )
            self._counts["failed"] += 1
            event(log, logging.INFO, "job.failed", state=str(result.state),
                  error=_error_text(value), **ids)  # fmt: skip
        else:  # cancelled by shutdown: give the job back at once
            await client.release(job.job_id, self.worker_id, job.token)
            self._counts["released"] += 1
            event(log, logging.INFO, "job.released", **ids)


async def run_worker(worker: Worker) -> None:
    """Run ``worker`` until SIGINT/SIGTERM: the first stops it gracefully, the second at
    once. For command lines and simple programs."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    event(log, logging.INFO, "worker.signal", signal=signal.Signals(signum).name)
                    worker.stop()

            nursery.start_soon(watch)
            await worker.run()
            nursery.cancel_scope.cancel()
