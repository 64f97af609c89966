"""One job's task in the worker: run its handler, then hand its ack over or report the rest.

The lease loop (relay/worker/worker.py) starts one such task per leased job, in the worker's jobs
nursery; the job holds its slot from lease to settlement. The handler runs in the job's
``_Running.scope``, which the renewal task cancels if the lease is lost. A handler that
returns hands a ``_PendingAck`` to the ack task (relay/worker/acks.py), which settles the
job once its ack is answered, and the job's task ends there. Any other outcome the job's
task reports itself (a raise: fail; cancelled by a stop: release; an ack once the ack task
has ended), shielded, within ``SETTLE_TIMEOUT_S``; then it frees the slot.

A failed job is one ``fail`` with the error and the formatted traceback of the handler's
exception (its end, within ``MAX_TRACEBACK_BYTES``), and one WARNING line in the log:
the job, its error, what happens next (retrying at, or dead), the traceback as a field.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from traceback import format_exception
from types import TracebackType
from typing import Any

import attrs
import orjson
import trio

from relay.client.client import Client, LeasedJob
from relay.protocol.errors import Cancelled, JobNotFound, LeaseExpired, RelayError, StaleToken
from relay.protocol.model import FailOutcome, JobState, timeout_error, truncate_utf8_end
from relay.util.log import event

log = logging.getLogger("relay.worker")  # the worker's: its parts log as the worker does

Handler = Callable[[LeasedJob], Any] | Callable[[LeasedJob], Awaitable[Any]]

# Bound on reporting a job's outcome (ack, fail, release): past it the lease expires and
# the job runs again, which at-least-once delivery allows.
SETTLE_TIMEOUT_S = 10.0
# The end of a failed handler's traceback that the worker sends: the server's default
# ``max_traceback_bytes`` (relay/protocol/wire.py), which is all a server keeps by default.
MAX_TRACEBACK_BYTES = 8 * 1024
# The error's first line in a log line's message is cut to this many characters (its
# ``error`` field has all of it).
MESSAGE_ERROR_CHARS = 200


class PermanentError(Exception):
    """Raise from a handler to fail the job without retries (it goes dead at once)."""


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


# Refusals that mean the worker's lease on the job has ended.
_LEASE_GONE = (StaleToken, LeaseExpired, JobNotFound)


def _is_cancellation(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_cancellation(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


class JobTimedOut(Exception):
    """The handler ran past the job's execution timeout (``timeout_ms``): it was cancelled,
    and the attempt fails with the error the server gives a timed-out lease."""

    def __init__(self, timeout_ms: int) -> None:
        super().__init__(timeout_error(timeout_ms))


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, JobTimedOut):
        return str(exc)  # "timed out after N ms", as the server's reaper writes it
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _traceback_text(exc: BaseException, handler: Any) -> str:
    """``exc``'s traceback as Python prints it (its causes and contexts included), from
    the handler's frame on, its last MAX_TRACEBACK_BYTES: the failing frame and the
    exception are at the end."""
    tb = _from_handler(exc.__traceback__, handler)
    text = "".join(format_exception(type(exc), exc, tb)).rstrip("\n")
    return truncate_utf8_end(text, MAX_TRACEBACK_BYTES)


def _from_handler(tb: TracebackType | None, handler: Any) -> TracebackType | None:
    """``tb`` from the handler's own frame on: the worker's frames above it (and trio's
    thread machinery, for a sync handler) say nothing about the job. All of ``tb`` where
    the handler's frame is not found (a ``functools.partial``, no handler at all)."""
    if handler is None:
        return tb
    target = inspect.unwrap(handler)
    code = getattr(target, "__code__", None)
    if code is None:  # an object with a __call__ method, or a partial (then none)
        code = getattr(type(target).__call__, "__code__", None)
    entry = tb
    while code is not None and entry is not None:
        if entry.tb_frame.f_code is code:
            return entry
        entry = entry.tb_next
    return tb


def _one_line(error: str) -> str:
    line = error.split("\n", 1)[0]
    if len(line) > MESSAGE_ERROR_CHARS or line != error:
        line = line[:MESSAGE_ERROR_CHARS] + "…"
    return line


def _utc(ms: int) -> str:
    """A server time (ms since the epoch) as ISO 8601 UTC, to the millisecond."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def _job_words(job: LeasedJob) -> str:
    return f"job {job.job_id} (queue {job.queue}, attempt {job.attempt} of {job.max_attempts})"


def _log_failed(
    job: LeasedJob, error: str, traceback: str, outcome: FailOutcome, retryable: bool
) -> None:
    """The one line of a failed job whose fail the server took: what happens next."""
    if outcome.state == JobState.DEAD:
        then = "dead: " + ("not retryable" if not retryable else "no attempts left")
    else:
        then = f"retrying at {_utc(outcome.retry_at)}" if outcome.retry_at else "retrying"
    event(log, logging.WARNING, "job.failed",
          message=f"{_job_words(job)} failed: {_one_line(error)}; {then}",
          job_id=job.job_id, queue=job.queue, attempt=job.attempt,
          max_attempts=job.max_attempts, state=str(outcome.state), retry_at=outcome.retry_at,
          error=error, traceback=traceback)  # fmt: skip


@attrs.define(eq=False)
class _Running:
    """A job whose handler runs: what the renewal task needs to keep or give up its lease."""

    job: LeasedJob
    scope: trio.CancelScope  # the handler's: cancelled when the lease is lost
    renew_at: float
    lost: bool = False
    # The server answered a renewal ``cancelled``: the job was cancelled, its handler is
    # stopped, and nothing is reported for it.
    cancelled: bool = False
    # The handler has returned: a renewal refusal no longer cancels anything. (If its
    # ack, fail or release is still to come, that is refused too, and counted as lost.)
    done: bool = False
    # A sync handler's thread, as the one token of its own limiter, held while it runs:
    # a thread left running (timed out, lease lost, stop) keeps the job's slot until it
    # returns, so no job is leased that no thread could run (``WorkerJobs._call``).
    thread: trio.CapacityLimiter | None = None


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


class WorkerJobs:
    """The job tasks of ``Worker`` (relay/worker/worker.py), a part it inherits as ``SqliteStore``
    inherits the store's parts. They use the worker's ``worker_id``, ``_handlers``,
    ``_default``, ``_is_async``, ``_slots``, ``_slot_freed``, ``_running``,
    ``_counts`` and ``durations``, and the ack task's ``_acking``, ``_acks`` and
    ``_acks_queued``."""

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
                try:
                    await self._thread_ended(running)
                finally:
                    self._finish(running, owner, started)

    async def _thread_ended(self, running: _Running) -> None:
        """Wait for the handler's thread, if one was left running (it cannot be
        interrupted): its slot is free only once it returns. A stop cancels the wait."""
        thread = running.thread
        if thread is None or not thread.borrowed_tokens:
            return
        job = running.job
        event(log, logging.WARNING, "job.thread_running",
              message=f"{_job_words(job)}: its handler's thread runs on after it was given up; "
              "its slot is held until the thread returns",
              job_id=job.job_id, queue=job.queue, attempt=job.attempt)  # fmt: skip
        async with thread:  # (acquired once the thread has released it)
            pass

    async def _execute(self, running: _Running) -> tuple[str, Any]:
        """Run the handler (the renewal task keeps its lease). Returns (outcome, value):
        ("ok", result), ("error", exception), ("lost", None), ("cancelled", None) (by a
        stop: released) or ("withdrawn", None) (the job was cancelled on the server)."""
        job = running.job
        handler = self._handlers.get(job.queue, self._default)
        outcome: tuple[str, Any] = ("cancelled", None)
        timeout = job.timeout_ms
        with running.scope:
            try:
                if handler is None:
                    raise PermanentError(f"no handler for queue {job.queue}")
                if timeout is None:
                    outcome = ("ok", await self._call(handler, running))
                else:
                    # The job's execution timeout, from when this worker got it (a little
                    # after the server's start of the attempt, whose deadline allows a
                    # grace for the fail below: model.TIMEOUT_GRACE_MS).
                    with trio.move_on_after(timeout / 1000) as limit:
                        outcome = ("ok", await self._call(handler, running))
                    if limit.cancelled_caught:
                        raise JobTimedOut(timeout)
            except Exception as exc:
                outcome = ("error", exc)
        # From here on a refused renewal is about a token this job is done with.
        running.done = True
        if running.lost:
            return "lost", None
        if running.cancelled:
            return "withdrawn", None
        return outcome

    async def _call(self, handler: Handler, running: _Running) -> Any:
        job = running.job
        if self._is_async[id(handler)]:
            return await handler(job)  # type: ignore[misc]
        # A thread cannot be interrupted. On cancellation (timeout, lease lost, shutdown
        # timeout) stop waiting for it: it runs on to its end, its result ignored, nothing
        # acked. It keeps the one token of its own limiter until then (trio releases it
        # when the thread reports back, abandoned or not), and the job keeps its slot
        # while it does (``_thread_ended``): so threads never exceed the slots.
        running.thread = trio.CapacityLimiter(1)
        result = await trio.to_thread.run_sync(
            handler, job, limiter=running.thread, abandon_on_cancel=True
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
        if outcome == "withdrawn":  # cancelled on the server: nothing to report (logged)
            self._counts["cancelled"] += 1
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
            self._not_settled(job, outcome, error, value if outcome == "error" else None)

    def _not_settled(
        self,
        job: LeasedJob,
        outcome: str,
        error: BaseException,
        failure: BaseException | None = None,
    ) -> None:
        """Log (and count) an ack, fail or release the server did not take. Refused because
        the lease had ended (expired, or taken by the server): the job is lost to this
        worker and runs again, as for a handler cancelled by a refused renewal. Otherwise
        (no answer, the server unreachable or overloaded) it runs again once its lease
        expires. A fail's line is the failed job's one line: ``failure`` is the handler's
        exception, its error and traceback go in too. Refused because the job was
        cancelled: it is settled so, one ``job.cancelled`` line."""
        request = {"ok": "ack", "error": "fail"}.get(outcome, "release")
        if isinstance(error, Cancelled):
            self._counts["cancelled"] += 1
            fields = {}
            if failure is not None:
                fields = {"handler_error": _error_text(failure)}
            self._log_cancelled(job, f"its {request}", "it is settled so, not failed", **fields)
            return
        lost = isinstance(error, _LEASE_GONE)
        if lost:
            self._counts["lost"] += 1
        words = _job_words(job)
        fields: dict[str, Any] = {}
        if failure is not None:
            handler = self._handlers.get(job.queue, self._default)
            fields = {
                "handler_error": _error_text(failure),
                "traceback": _traceback_text(failure, handler),
            }
            words += f" failed: {_one_line(fields['handler_error'])}"
        then = "the lease had ended" if lost else "it runs again once its lease expires"
        event(log, logging.WARNING, "job.lease_lost" if lost else "job.settle_failed",
              message=f"{words}; its {request} was not taken ({error!r}): {then}",
              outcome=outcome, error=repr(error), job_id=job.job_id, queue=job.queue,
              attempt=job.attempt, **fields)  # fmt: skip

    def _log_cancelled(self, job: LeasedJob, told_by: str, then: str, **fields: Any) -> None:
        """The one line of a job the server said was cancelled (answering ``told_by``)."""
        event(log, logging.INFO, "job.cancelled",
              message=f"{_job_words(job)} was cancelled: the server refused {told_by}; {then}",
              job_id=job.job_id, queue=job.queue, attempt=job.attempt, **fields)  # fmt: skip

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
            handler = self._handlers.get(job.queue, self._default)
            error, traceback = _error_text(value), _traceback_text(value, handler)
            result = await client.fail(
                job.job_id, self.worker_id, job.token, error, retryable=retryable,
                traceback=traceback,
            )  # fmt: skip
            self._counts["failed"] += 1
            _log_failed(job, error, traceback, result, retryable)
        else:  # cancelled by shutdown: give the job back at once
            await client.release(job.job_id, self.worker_id, job.token)
            self._counts["released"] += 1
            event(log, logging.INFO, "job.released", **ids)

    def _finish(self, running: _Running, owner: object, started: float) -> None:
        """A job its own task settled: no more renewals, and its slot is free."""
        self._release(running, owner, trio.current_time() - started)
        self._slot_freed.unpark_all()

    def _release(self, running: _Running, owner: object, duration: float) -> None:
        self._running.discard(running)
        self._slots.release_on_behalf_of(owner)
        self.durations.observe(duration)
