"""The pull worker (relay.Worker) against a real server over TCP and against open_local.

Concurrency bound, async and sync handlers, results, retries and dead letters, per-queue
handlers, lease renewal, a refused renewal (the handler is cancelled and nothing is acked),
graceful and immediate stop, and a worker process killed with SIGKILL (its job runs again
once the lease expires) or stopped with SIGTERM (its job is released at once).
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
import trio
import trio.testing

from relay import (
    BadRequest,
    Client,
    JobState,
    LeasedJob,
    PermanentError,
    Unauthorized,
    Worker,
    open_client,
    open_local,
    run_worker,
)
from relay.protocol.wire import Limits
from relay.util.log import JsonFormatter
from relay.worker import acks as worker_acks
from relay.worker import jobs as worker_jobs
from relay.worker import worker as worker_module
from relay.worker.worker import WorkerStatistics
from tests.server.conftest import logged
from tests.worker.helpers import (
    BOUND_S,
    Server,
    queue_counts,
    running,
    start_server,
    wait_for_state,
    wait_until,
)

REPO = Path(__file__).resolve().parent.parent


@attrs.define
class Backend:
    kind: str
    target: Any  # what Worker takes: an address, or the local Client
    client: Client  # for submitting and inspecting
    server: Server | None = None


@pytest.fixture
async def tcp(tmp_path) -> AsyncIterator[Backend]:
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, str(tmp_path / "relay.db"))
        async with open_client(server.address) as client:
            yield Backend("tcp", server.address, client, server)
        server.handle.shutdown()


@pytest.fixture(params=["tcp", "local"])
async def backend(request, tmp_path) -> AsyncIterator[Backend]:
    if request.param == "tcp":
        async with trio.open_nursery() as nursery:
            server = await start_server(nursery, str(tmp_path / "relay.db"))
            async with open_client(server.address) as client:
                yield Backend("tcp", server.address, client, server)
            server.handle.shutdown()
    else:
        async with open_local(str(tmp_path / "local.db")) as client:
            yield Backend("local", client, client)


def make_worker(target: Any, **options: Any) -> Worker:
    options.setdefault("queues", ["q"])
    options.setdefault("shutdown_timeout", 1.0)
    return Worker(target, **options)


async def wait_succeeded(client: Client, queue: str, n: int, within: float = BOUND_S) -> None:
    async def done() -> bool:
        return (await queue_counts(client, queue))["succeeded"] >= n

    await wait_until(done, within, f"{n} succeeded jobs in {queue}")


# -- concurrency, handlers, results ------------------------------------------------------------


async def test_never_more_than_concurrency_jobs_run(backend):
    ids = [r.job_id for r in await backend.client.submit_batch(
        [{"queue": "q", "payload": i} for i in range(40)]
    )]  # fmt: skip
    now = 0
    peak = 0
    ran: list[int] = []

    async def handler(job: LeasedJob) -> int:
        nonlocal now, peak
        now += 1
        peak = max(peak, now)
        try:
            await trio.sleep(0.01)  # the work
            return job.payload * 10
        finally:
            now -= 1
            ran.append(job.payload)

    worker = make_worker(backend.target, handler=handler, concurrency=4)
    async with running(worker):
        await wait_succeeded(backend.client, "q", 40)
        assert worker.statistics().running <= 4
    assert peak == 4
    assert sorted(ran) == list(range(40))
    stats = worker.statistics()
    assert stats == WorkerStatistics(
        running=0, concurrency=4, succeeded=40, failed=0, lost=0, released=0
    )
    counts = await queue_counts(backend.client, "q")
    assert counts["succeeded"] == 40 and counts["ready"] == counts["leased"] == 0
    for i in (0, 17, 39):
        view = await backend.client.inspect(ids[i])
        assert view.result == i * 10 and view.attempt == 1


async def test_sync_handler_runs_in_a_thread_and_its_result_is_stored(backend):
    submitted = await backend.client.submit("q", {"n": 21})
    threads: list[threading.Thread] = []

    def handler(job: LeasedJob) -> dict[str, Any]:
        threads.append(threading.current_thread())
        return {"double": job.payload["n"] * 2}

    async with running(make_worker(backend.target, handler=handler)) as worker:
        view = await wait_for_state(backend.client, submitted.job_id, "succeeded")
        assert worker.statistics().succeeded == 1
    assert view.result == {"double": 42}
    assert threads and threads[0] is not threading.main_thread()


async def test_sync_handlers_are_bounded_by_concurrency(backend):
    await backend.client.submit_batch([{"queue": "q", "payload": i} for i in range(12)])
    lock = threading.Lock()
    now = 0
    peak = 0
    gate = threading.Event()

    def handler(job: LeasedJob) -> None:
        nonlocal now, peak
        with lock:
            now += 1
            peak = max(peak, now)
            if now == 3:
                gate.set()
        gate.wait(timeout=2)  # the first three meet here, proving they overlap
        with lock:
            now -= 1

    async with running(make_worker(backend.target, handler=handler, concurrency=3)):
        await wait_succeeded(backend.client, "q", 12)
    assert peak == 3


async def test_async_handler_result_and_none(backend):
    first = await backend.client.submit("q", "a")
    second = await backend.client.submit("q", "b")

    async def handler(job: LeasedJob) -> Any:
        return {"echo": job.payload} if job.payload == "a" else None

    async with running(make_worker(backend.target, handler=handler)):
        one = await wait_for_state(backend.client, first.job_id, "succeeded")
        two = await wait_for_state(backend.client, second.job_id, "succeeded")
    assert one.result == {"echo": "a"}
    assert two.result is None


async def test_non_json_return_value_is_stored_as_none_and_still_succeeds(backend):
    submitted = await backend.client.submit("q", {})

    async def handler(job: LeasedJob) -> Any:
        return {"not json": object()}

    async with running(make_worker(backend.target, handler=handler)) as worker:
        view = await wait_for_state(backend.client, submitted.job_id, "succeeded", "dead")
        assert worker.statistics().succeeded == 1
    assert view.state == JobState.SUCCEEDED
    assert view.result is None and view.errors == []


async def test_handler_exception_retries_then_dead_with_the_error_text(backend):
    submitted = await backend.client.submit(
        "q", {}, retries=1, backoff={"kind": "fixed", "delay_ms": 100}
    )
    attempts: list[int] = []

    async def handler(job: LeasedJob) -> None:
        attempts.append(job.attempt)
        raise ValueError(f"boom on attempt {job.attempt}")

    async with running(make_worker(backend.target, handler=handler)) as worker:
        view = await wait_for_state(backend.client, submitted.job_id, "dead")
        await wait_until(
            lambda: _async_true(worker.statistics().failed == 2), what="two failures reported"
        )
    assert attempts == [1, 2]
    assert [(e.attempt, e.error) for e in view.errors] == [
        (1, "ValueError: boom on attempt 1"),
        (2, "ValueError: boom on attempt 2"),
    ]
    assert view.last_error == "ValueError: boom on attempt 2"
    # The retry waited for the fixed backoff.
    assert view.errors[1].at - view.errors[0].at >= 100


async def _async_true(value: bool) -> bool:
    return value


async def test_permanent_error_is_dead_at_the_first_failure(backend):
    submitted = await backend.client.submit("q", {}, retries=5)
    calls = 0

    def handler(job: LeasedJob) -> None:
        nonlocal calls
        calls += 1
        raise PermanentError("bad payload")

    async with running(make_worker(backend.target, handler=handler)):
        view = await wait_for_state(backend.client, submitted.job_id, "dead")
    assert calls == 1
    assert view.attempt == 1 and view.max_attempts == 6
    assert [(e.attempt, e.error) for e in view.errors] == [(1, "PermanentError: bad payload")]


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_handler_past_its_timeout_is_cancelled_and_the_attempt_fails(backend, kind):
    submitted = await backend.client.submit("q", {}, retries=0, timeout_ms=300)
    assert (await backend.client.inspect(submitted.job_id)).timeout_ms == 300
    stopped = threading.Event()

    async def async_handler(job: LeasedJob) -> None:
        assert job.timeout_ms == 300
        try:
            await trio.sleep_forever()
        finally:
            stopped.set()

    def handler(job: LeasedJob) -> None:  # a thread cannot be interrupted: it is left
        stopped.wait(BOUND_S)

    worker = make_worker(backend.target, handler=async_handler if kind == "async" else handler)
    async with running(worker):
        view = await wait_for_state(backend.client, submitted.job_id, "dead")
    stopped.set()
    assert [(e.attempt, e.error) for e in view.errors] == [(1, "timed out after 300 ms")]
    assert view.errors[0].traceback is not None and "JobTimedOut" in view.errors[0].traceback
    assert worker.statistics().failed == 1


async def test_a_thread_left_running_keeps_its_slot_and_no_job_times_out_waiting(backend):
    # A sync handler stuck past its timeout cannot be interrupted: its job fails, and its
    # slot stays held until the thread returns, so the next job is not leased into a slot
    # with no thread for it (where it would time out without running, every attempt).
    stuck = await backend.client.submit("q", {"stuck": True}, retries=0, timeout_ms=200)
    healthy = await backend.client.submit("q", {"stuck": False}, retries=2, timeout_ms=300)
    release = threading.Event()
    ran: list[Any] = []

    def handler(job: LeasedJob) -> None:
        ran.append(job.payload)
        if job.payload["stuck"]:
            release.wait(BOUND_S)

    with logged("relay.worker") as records:
        async with running(make_worker(backend.target, handler=handler, concurrency=1)):
            await wait_for_state(backend.client, stuck.job_id, "dead")

            async def held() -> bool:
                return any(getattr(r, "event", None) == "job.thread_running" for r in records)

            await wait_until(held, what="the stuck thread's slot held")
            assert (await backend.client.inspect(healthy.job_id)).state == "ready"
            release.set()
            view = await wait_for_state(backend.client, healthy.job_id, "succeeded")
    assert ran == [{"stuck": True}, {"stuck": False}]
    assert view.attempt == 1 and not view.errors


async def test_a_handler_within_its_timeout_succeeds(backend):
    submitted = await backend.client.submit("q", {"n": 2}, timeout_ms=int(BOUND_S * 1000))

    async def handler(job: LeasedJob) -> int:
        return job.payload["n"] * 2

    async with running(make_worker(backend.target, handler=handler)):
        view = await wait_for_state(backend.client, submitted.job_id, "succeeded")
    assert view.result == 4 and not view.errors


# -- what a failure records and logs ---------------------------------------------------------


def parse_the_row(row: dict[str, Any]) -> None:
    """A handler's helper that fails: the traceback must name its frame."""
    raise ValueError(f"row {row['n']} has no amount")


def failure_lines(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if getattr(r, "event", None) == "job.failed"]


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_failure_sends_its_traceback_and_logs_one_line(backend, kind):
    submitted = await backend.client.submit(
        "q", {"n": 7}, retries=1, backoff={"kind": "fixed", "delay_ms": 50}
    )

    def handler(job: LeasedJob) -> None:
        parse_the_row(job.payload)

    async def async_handler(job: LeasedJob) -> None:
        parse_the_row(job.payload)

    worker = make_worker(backend.target, handler=async_handler if kind == "async" else handler)
    with logged("relay.worker") as records:
        async with running(worker):
            view = await wait_for_state(backend.client, submitted.job_id, "dead")
            await wait_until(
                lambda: _async_true(worker.statistics().failed == 2), what="two failures"
            )
    error = "ValueError: row 7 has no amount"
    assert [(e.attempt, e.error) for e in view.errors] == [(1, error), (2, error)]
    name = "async_handler" if kind == "async" else "handler"
    for entry in view.errors:
        assert entry.traceback is not None
        first, second, *_ = entry.traceback.splitlines()
        # From the handler's frame on: the worker's own frames (and trio's, for a thread)
        # say nothing about the job.
        assert first == "Traceback (most recent call last):" and second.endswith(f", in {name}")
        assert ", in parse_the_row\n" in entry.traceback and entry.traceback.endswith(error)
        assert "relay/worker/jobs.py" not in entry.traceback and "trio" not in entry.traceback

    # One WARNING line per failed attempt: the job, its error, what comes next; the
    # traceback is a field, never printed as lines of its own.
    retrying, dead = failure_lines(records)
    for record, entry in ((retrying, view.errors[0]), (dead, view.errors[1])):
        fields = record.fields  # type: ignore[attr-defined]
        assert record.levelno == logging.WARNING and record.exc_info is None
        assert (fields["job_id"], fields["queue"], fields["attempt"]) == (
            submitted.job_id, "q", entry.attempt,
        )  # fmt: skip
        assert (fields["error"], fields["traceback"]) == (error, entry.traceback)
        message = record.getMessage()
        assert submitted.job_id in message and error in message and "\n" not in message
    assert retrying.fields["state"] == "retrying" and retrying.fields["retry_at"] > 0  # type: ignore[attr-defined]
    assert "; retrying at 20" in retrying.getMessage()
    assert dead.fields["state"] == "dead"  # type: ignore[attr-defined]
    assert dead.getMessage().endswith("; dead: no attempts left")
    # As relay's JSON log writes it: one line, the traceback a field of it.
    line = JsonFormatter().format(dead)
    assert "\n" not in line
    written = orjson.loads(line)
    assert (written["event"], written["level"], written["job_id"]) == (
        "job.failed", "warning", submitted.job_id,
    )  # fmt: skip
    assert written["traceback"] == view.errors[1].traceback
    assert written["message"] == dead.getMessage()


async def test_a_handlers_traceback_is_in_its_attempt_with_its_worker_and_times(backend):
    submitted = await backend.client.submit("q", {"n": 7}, retries=0)

    def handler(job: LeasedJob) -> None:
        parse_the_row(job.payload)

    worker = make_worker(backend.target, handler=handler, worker_id="w-attempts")
    async with running(worker):
        view = await wait_for_state(backend.client, submitted.job_id, "dead")
    [attempt] = view.attempts
    assert (attempt.attempt, attempt.outcome, attempt.worker_id) == (1, "failed", "w-attempts")
    assert attempt.error == "ValueError: row 7 has no amount"
    assert attempt.traceback is not None and attempt.traceback == view.errors[0].traceback
    assert ", in parse_the_row\n" in attempt.traceback
    assert attempt.traceback.endswith(attempt.error)
    assert attempt.started_at is not None and attempt.ended_at is not None
    assert attempt.started_at <= attempt.ended_at == view.finished_at
    assert view.attempts_dropped == 0


def handle_labelled(label: str, job: LeasedJob) -> None:
    parse_the_row(job.payload)


class RowHandler:
    def __call__(self, job: LeasedJob) -> None:
        parse_the_row(job.payload)


def test_the_traceback_starts_at_a_callable_objects_frame_and_is_whole_for_a_partial():
    def via(handler: Any) -> str:
        def the_worker() -> None:
            handler(LeasedJob("job_1", "q", {"n": 1}, "normal", 1, 1, "t", 0))

        try:
            the_worker()
        except ValueError as exc:
            return worker_jobs._traceback_text(exc, handler)
        raise AssertionError("no failure")

    called = via(RowHandler()).splitlines()
    assert called[1].endswith(", in __call__") and called[-1] == "ValueError: row 1 has no amount"
    # Where the handler's frame cannot be told (a partial): all of it.
    whole = via(functools.partial(handle_labelled, "rows")).splitlines()
    assert whole[1].endswith(", in via") and ", in parse_the_row" in whole[-3]


async def test_a_permanent_error_sends_its_causes_and_logs_the_job_dead(backend):
    submitted = await backend.client.submit("q", {}, retries=5)

    async def handler(job: LeasedJob) -> None:
        try:
            job.payload["amount"]
        except KeyError as exc:
            raise PermanentError("the payload has no amount") from exc

    with logged("relay.worker") as records:
        async with running(make_worker(backend.target, handler=handler)) as worker:
            view = await wait_for_state(backend.client, submitted.job_id, "dead")
            await wait_until(lambda: _async_true(worker.statistics().failed == 1), what="failed")
    [entry] = view.errors
    assert entry.error == "PermanentError: the payload has no amount"
    assert entry.traceback is not None and entry.traceback.endswith(entry.error)
    assert "KeyError: 'amount'" in entry.traceback
    assert "The above exception was the direct cause of the following exception" in (
        entry.traceback
    )
    [line] = failure_lines(records)
    assert line.getMessage() == (
        f"job {submitted.job_id} (queue q, attempt 1 of 6) failed: "
        "PermanentError: the payload has no amount; dead: not retryable"
    )


async def test_a_long_traceback_is_sent_as_its_last_8_kib(tmp_path):
    # The server would keep 64 KiB: what it stores is the end the worker sent.
    async with open_local(
        str(tmp_path / "local.db"), limits=Limits(max_traceback_bytes=65_536)
    ) as client:
        submitted = await client.submit("q", {}, retries=0)

        async def handler(job: LeasedJob) -> None:
            raise ValueError("x" * 20_000 + " the end")

        async with running(make_worker(client, handler=handler)):
            view = await wait_for_state(client, submitted.job_id, "dead")
    [entry] = view.errors
    assert entry.traceback is not None and entry.traceback.endswith("x the end")
    assert len(entry.traceback.encode()) == worker_jobs.MAX_TRACEBACK_BYTES == 8 * 1024


FAILING_PROGRAM = textwrap.dedent(
    """
    import sys

    import trio

    import relay


    def parse_the_row(row):
        raise ValueError(f"row {row['n']} has no amount")


    async def handler(job):
        parse_the_row(job.payload)


    async def main():
        async with relay.open_local(sys.argv[1]) as queue:
            job = await queue.submit("q", {"n": 7}, retries=0)
            print(job.job_id, flush=True)
            worker = relay.Worker(queue, queues=["q"], handler=handler, shutdown_timeout=1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(worker.run)
                with trio.fail_after(10):
                    while worker.statistics().failed < 1:
                        await trio.sleep(0.02)
                worker.stop()


    trio.run(main)
    """
)


async def test_a_python_program_without_a_log_config_hears_which_job_died_and_why(tmp_path):
    """A program that configures no logging gets Python's last-resort handler: the
    record's message alone, WARNING and up. The dead job's line names it and its error,
    and no traceback is printed."""
    script = tmp_path / "failing.py"
    script.write_text(FAILING_PROGRAM)
    with trio.fail_after(30):
        done = await trio.run_process(
            [sys.executable, str(script), str(tmp_path / "local.db")],
            capture_stdout=True, capture_stderr=True, check=False, cwd=str(REPO),
        )  # fmt: skip
    stderr = done.stderr.decode()
    assert done.returncode == 0, stderr
    job_id = done.stdout.decode().strip()
    lines = stderr.splitlines()
    worker_line = (
        f"job {job_id} (queue q, attempt 1 of 1) failed: ValueError: row 7 has no amount; "
        "dead: no attempts left"
    )
    assert worker_line in lines, stderr
    assert not [line for line in lines if "Traceback" in line or 'File "' in line], stderr
    # The server in the program says so too, naming the job and the error.
    assert f"job {job_id} dead (failed): ValueError: row 7 has no amount" in lines, stderr


async def test_handlers_registry_routes_by_queue(backend):
    a = await backend.client.submit("a", 1)
    b = await backend.client.submit("b", 2)
    seen: list[tuple[str, str]] = []

    async def on_a(job: LeasedJob) -> str:
        seen.append(("a", job.queue))
        return f"a:{job.payload}"

    def on_b(job: LeasedJob) -> str:
        seen.append(("b", job.queue))
        return f"b:{job.payload}"

    worker = Worker(backend.target, handlers={"a": on_a, "b": on_b}, shutdown_timeout=1)
    assert worker.queues == ["a", "b"]
    async with running(worker):
        va = await wait_for_state(backend.client, a.job_id, "succeeded")
        vb = await wait_for_state(backend.client, b.job_id, "succeeded")
    assert va.result == "a:1" and vb.result == "b:2"
    assert sorted(seen) == [("a", "a"), ("b", "b")]


async def test_queue_without_a_handler_goes_dead(backend):
    orphan = await backend.client.submit("c", {}, retries=3)

    async def on_a(job: LeasedJob) -> None:
        return None

    worker = Worker(backend.target, queues=["a", "c"], handlers={"a": on_a}, shutdown_timeout=1)
    async with running(worker):
        view = await wait_for_state(backend.client, orphan.job_id, "dead")
    assert view.attempt == 1
    assert "no handler for queue c" in (view.last_error or "")


# -- acks ----------------------------------------------------------------------------------------


def record_acks(client: Client) -> list[tuple[str, int]]:
    """Record each ack request the client sends: ("ack", 1) or ("ack_batch", n)."""
    calls: list[tuple[str, int]] = []
    ack, ack_batch = client.ack, client.ack_batch

    async def one(*args: Any, **kwargs: Any) -> None:
        calls.append(("ack", 1))
        await ack(*args, **kwargs)

    async def many(worker_id: str, acks: Any) -> Any:
        calls.append(("ack_batch", len(acks)))
        return await ack_batch(worker_id, acks)

    client.ack, client.ack_batch = one, many  # type: ignore[method-assign]
    return calls


class Together:
    """A handler whose jobs wait for each other: ``expect(n)`` jobs are held until all n
    have arrived, then return together, each the value of ``results`` for its payload."""

    def __init__(self, results: dict[int, Any]) -> None:
        self.results = results
        self.arrived = 0
        self.expected = 0
        self.all_in = trio.Event()

    def expect(self, n: int) -> None:
        self.arrived, self.expected, self.all_in = 0, n, trio.Event()

    async def __call__(self, job: LeasedJob) -> Any:
        self.arrived += 1
        if self.arrived == self.expected:
            self.all_in.set()
        await self.all_in.wait()
        return self.results[job.payload]


async def submit_together(client: Client, together: Together, payloads: list[int]) -> list[str]:
    together.expect(len(payloads))
    submitted = await client.submit_batch([{"queue": "q", "payload": n} for n in payloads])
    return [r.job_id for r in submitted]


async def settled(worker: Worker, succeeded: int) -> None:
    await wait_until(
        lambda: _async_true(
            worker.statistics().running == 0 and worker.statistics().succeeded == succeeded
        ),
        within=BOUND_S, what=f"{succeeded} acked and nothing running",
    )  # fmt: skip


async def test_jobs_that_finish_together_are_acked_in_one_request(tmp_path):
    together = Together({n: n * 10 for n in range(8)})
    async with open_local(str(tmp_path / "local.db")) as client:
        calls = record_acks(client)
        ids = await submit_together(client, together, list(range(8)))
        worker = make_worker(client, handler=together, concurrency=8)
        async with running(worker):
            await settled(worker, 8)
        assert calls == [("ack_batch", 8)]
        views = [await client.inspect(job_id) for job_id in ids]
        assert [v.state for v in views] == [JobState.SUCCEEDED] * 8
        assert [v.result for v in views] == [n * 10 for n in range(8)]


async def test_one_unacceptable_result_does_not_fail_the_others_acks(tmp_path, monkeypatch):
    # The worker keeps a batch's results within MAX_ACK_BATCH_BYTES and a quarter of the
    # server's frame; lifted here, so that the one result the server refuses is in the
    # same batch as the others.
    monkeypatch.setattr("relay.worker.worker.MAX_ACK_BATCH_BYTES", 10 * 1024 * 1024)

    def keep_defaults(self: Worker, limits: Any) -> None:
        pass

    monkeypatch.setattr(Worker, "_fit", keep_defaults)
    too_large = "x" * (256 * 1024 + 1)  # over the server's max_result_bytes
    together = Together({0: too_large, 1: "one", 2: "two"})
    async with open_local(str(tmp_path / "local.db")) as client:
        calls = record_acks(client)
        ids = await submit_together(client, together, [0, 1, 2])
        worker = make_worker(client, handler=together, concurrency=3)
        async with running(worker):
            await settled(worker, 2)
        # The batch is refused as a whole; then each job is acked on its own.
        assert calls == [("ack_batch", 3)] + [("ack", 1)] * 3
        views = [await client.inspect(job_id) for job_id in ids]
        assert [v.result for v in views[1:]] == ["one", "two"]
        assert [v.state for v in views[1:]] == [JobState.SUCCEEDED] * 2
        # The refused ack leaves its job leased: it runs again once the lease expires.
        assert views[0].state == JobState.LEASED


async def test_a_server_without_ack_batch_gets_one_ack_per_job(tmp_path):
    from relay.protocol.errors import UnknownOp

    together = Together({n: n for n in range(6)})
    async with open_local(str(tmp_path / "local.db")) as client:
        calls = record_acks(client)

        async def unknown(worker_id: str, acks: Any) -> Any:
            calls.append(("ack_batch", len(acks)))
            raise UnknownOp("unknown op 'ack_batch'")

        client.ack_batch = unknown  # type: ignore[method-assign]
        worker = make_worker(client, handler=together, concurrency=4)
        async with running(worker):
            await submit_together(client, together, [0, 1, 2, 3])
            await settled(worker, 4)
            assert calls == [("ack_batch", 4)] + [("ack", 1)] * 4
            # Once told, the worker does not ask again.
            await submit_together(client, together, [4, 5])
            await settled(worker, 6)
        assert calls[5:] == [("ack", 1)] * 2
        assert (await queue_counts(client, "q"))["succeeded"] == 6


async def test_leases_and_ack_batches_keep_within_the_servers_max_batch(tmp_path):
    # A server that takes at most 3 jobs per request: a worker of 8 slots must lease and
    # ack in threes (a lease of 8 would be refused, every time).
    from relay.protocol import wire

    together = Together({n: n for n in range(8)})
    async with open_local(str(tmp_path / "local.db"), limits=wire.Limits(max_batch=3)) as client:
        calls = record_acks(client)
        together.expect(8)
        for n in range(8):
            await client.submit("q", n)
        worker = make_worker(client, handler=together, concurrency=8)
        async with running(worker):
            await settled(worker, 8)
        assert calls and all(op == "ack_batch" and n <= 3 for op, n in calls), calls
        assert sum(n for _, n in calls) == 8
        assert (await queue_counts(client, "q"))["succeeded"] == 8


async def test_a_worker_reads_the_limits_again_when_its_lease_is_refused(tmp_path):
    # As after a restart of the server with a smaller max_batch: the worker read 1000 at
    # start, so its leases of 8 are refused until it reads the limits again.
    from relay.protocol import wire

    async with open_local(str(tmp_path / "local.db")) as client:
        dispatcher = client._transport._core.dispatcher  # type: ignore[attr-defined]

        async def handler(job: LeasedJob) -> None:
            return None

        worker = make_worker(client, handler=handler, concurrency=8, wait_ms=20)
        async with running(worker):
            dispatcher.limits = wire.Limits(max_batch=3)
            calls = record_acks(client)
            for n in range(8):
                await client.submit("q", n)
            await wait_succeeded(client, "q", 8)
        assert calls and all(n <= 3 for _, n in calls), calls


async def test_acks_of_large_results_go_in_requests_that_fit_a_frame(tcp):
    # Each result is within max_result_bytes (256 KiB), eight together are over the 1 MiB
    # frame: one ack_batch of all eight would be refused and close the connection.
    together = Together({n: "x" * (200 * 1024) for n in range(8)})
    ids = await submit_together(tcp.client, together, list(range(8)))
    worker = make_worker(tcp.target, handler=together, concurrency=8)
    async with running(worker):
        await settled(worker, 8)
    views = [await tcp.client.inspect(job_id) for job_id in ids]
    assert [v.state for v in views] == [JobState.SUCCEEDED] * 8
    assert all(len(v.result) == 200 * 1024 for v in views)


async def test_a_job_that_finishes_as_the_worker_is_cancelled_is_still_acked(tcp):
    # Cancelled from outside (an application shutting down) just as a handler returns:
    # the ack task, cancelled too, still sends what was queued (shielded), at once.
    job = await tcp.client.submit("q", 1)
    outer = trio.CancelScope()

    async def handler(leased: LeasedJob) -> int:
        outer.cancel()
        return 42

    worker = make_worker(tcp.client, handler=handler)  # the client outlives the worker
    began = trio.current_time()
    with trio.fail_after(BOUND_S), outer:
        await worker.run()
    assert trio.current_time() - began < 2  # not the 10 s settle timeout
    view = await tcp.client.inspect(job.job_id)
    assert view.state == JobState.SUCCEEDED and view.result == 42


async def take_away(client: Client, worker: Worker, job: LeasedJob) -> LeasedJob:
    """From outside: give ``job``'s lease back with the worker's own token, and let another
    worker ("other") take the job. Returns the other's lease."""
    await client.release(job.job_id, worker.worker_id, job.token)
    (taken,) = await client.lease(["q"], "other", lease_ms=60_000)
    assert taken.job_id == job.job_id
    return taken


class HeldAcks:
    """Wraps a client's ``ack``: the first ``held`` calls (one by default) wait until
    ``release`` (or for ever, with ``forever``), as acks whose answers are slow to come;
    later calls go through."""

    def __init__(self, client: Client, *, forever: bool = False, hold: int = 1) -> None:
        self.calls = 0
        self.hold = hold
        self.held = trio.Event()
        self.release = trio.Event()
        self.forever = forever
        self._ack = client.ack
        client.ack = self.ack  # type: ignore[method-assign]

    async def ack(self, *args: Any, **kwargs: Any) -> None:
        self.calls += 1
        if self.calls <= self.hold:
            self.held.set()
            if self.forever:
                await trio.sleep_forever()
            await self.release.wait()
        await self._ack(*args, **kwargs)


@asynccontextmanager
async def run_cancellable(worker: Worker) -> AsyncIterator[trio.CancelScope]:
    """Run ``worker`` in a scope the block may cancel, as an application shutting down
    would; leaving the block waits (bounded) until ``run`` has returned."""
    outer = trio.CancelScope()

    async def run() -> None:
        with outer:
            await worker.run()

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            yield outer


async def test_a_finished_job_keeps_its_slot_and_lease_until_its_ack_is_answered(tmp_path):
    async with open_local(str(tmp_path / "local.db")) as client:
        first, second = await client.submit("q", 1), await client.submit("q", 2)
        acks = HeldAcks(client)
        started: list[int] = []

        async def handler(job: LeasedJob) -> int:
            started.append(job.payload)
            return job.payload

        worker = make_worker(client, handler=handler, concurrency=1, lease_ms=900)
        async with running(worker):
            with trio.fail_after(BOUND_S):
                await acks.held.wait()
            # Three leases long: only renewals keep the first job's lease alive.
            await trio.sleep(2.7)
            assert started == [1]  # its slot is still taken: the second job waits
            assert worker.statistics().running == 1
            acks.release.set()
            await settled(worker, 2)
        assert started == [1, 2]
        assert worker.statistics().lost == 0
        for job in (first, second):
            view = await client.inspect(job.job_id)
            assert view.state == JobState.SUCCEEDED and view.attempt == 1, view


async def test_an_ack_refused_because_the_lease_ended_counts_the_job_as_lost(tmp_path):
    async with open_local(str(tmp_path / "local.db")) as client:
        await client.submit("q", 1)
        acks = HeldAcks(client)
        held: list[LeasedJob] = []

        async def handler(job: LeasedJob) -> str:
            held.append(job)
            return "too late"

        worker = make_worker(client, handler=handler, concurrency=1, lease_ms=900)
        async with running(worker):
            with trio.fail_after(BOUND_S):
                await acks.held.wait()
            # While the ack waits, the lease ends (given back with the worker's own token)
            # and another worker takes the job.
            (job,) = held
            await take_away(client, worker, job)
            acks.release.set()
            await wait_until(
                lambda: _async_true(worker.statistics().lost == 1), within=3, what="lost == 1"
            )
            assert worker.statistics().succeeded == 0
            assert worker.statistics().running == 0  # its slot is free again
        view = await client.inspect(job.job_id)
        assert view.state == JobState.LEASED and view.worker_id == "other"


async def test_a_fail_refused_because_the_lease_ended_counts_the_job_as_lost(backend):
    await backend.client.submit("q", {})
    started = trio.Event()
    go = trio.Event()
    held: list[LeasedJob] = []

    async def handler(job: LeasedJob) -> None:
        held.append(job)
        started.set()
        await go.wait()
        raise ValueError("too late")

    # A long lease: no renewal comes (and notices) before the handler fails.
    worker = make_worker(backend.target, handler=handler, lease_ms=60_000)
    with logged("relay.worker") as records:
        async with running(worker):
            with trio.fail_after(BOUND_S):
                await started.wait()
            (job,) = held
            await take_away(backend.client, worker, job)
            go.set()
            await wait_until(
                lambda: _async_true(worker.statistics().lost == 1), within=3, what="lost == 1"
            )
            assert worker.statistics().failed == 0
    view = await backend.client.inspect(job.job_id)
    assert view.state == JobState.LEASED and view.worker_id == "other" and not view.errors
    # The failed job's one line says so, with the handler's error and traceback.
    [line] = [r for r in records if getattr(r, "event", None) == "job.lease_lost"]
    assert line.fields["handler_error"] == "ValueError: too late"  # type: ignore[attr-defined]
    assert line.fields["traceback"].endswith("ValueError: too late")  # type: ignore[attr-defined]
    assert line.getMessage().startswith(f"job {job.job_id} (queue q, attempt 1 of 4) failed: ")
    assert "its fail was not taken" in line.getMessage()
    assert not failure_lines(records)


async def test_an_ack_cut_short_by_cancellation_is_sent_again(tmp_path):
    async with open_local(str(tmp_path / "local.db")) as client:
        job = await client.submit("q", 1)
        acks = HeldAcks(client, forever=True)  # the first ack is never answered
        worker = make_worker(client, handler=lambda leased: 7)
        async with run_cancellable(worker) as outer:
            await acks.held.wait()
            outer.cancel()  # the application stops while the ack is in flight
        assert acks.calls == 2
        view = await client.inspect(job.job_id)
        assert view.state == JobState.SUCCEEDED and view.result == 7
        assert worker.statistics().succeeded == 1 and worker.statistics().running == 0


async def test_acks_sent_again_after_a_cancellation_keep_their_leases_alive(tmp_path):
    # Cancelled from outside while its ack is in flight; the ack sent again is slow to be
    # answered, for three leases: the job's lease must be renewed all the while.
    async with open_local(str(tmp_path / "local.db")) as client:
        job = await client.submit("q", 1)
        real_ack = client.ack
        calls = 0
        first_sent, again_sent, answer = trio.Event(), trio.Event(), trio.Event()

        async def ack(*args: Any, **kwargs: Any) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                first_sent.set()
                await trio.sleep_forever()  # cut short by the cancellation
            again_sent.set()
            await answer.wait()
            await real_ack(*args, **kwargs)

        client.ack = ack  # type: ignore[method-assign]
        worker = make_worker(client, handler=lambda leased: 5, lease_ms=900)
        async with run_cancellable(worker) as outer:
            await first_sent.wait()
            outer.cancel()
            await again_sent.wait()
            await trio.sleep(2.7)  # three leases long
            answer.set()
        assert calls == 2
        view = await client.inspect(job.job_id)
        assert view.state == JobState.SUCCEEDED and view.attempt == 1, view
        assert worker.statistics().succeeded == 1


async def test_a_graceful_stop_waits_for_an_unanswered_ack_no_longer_than_before(
    tmp_path, monkeypatch
):
    # A job finishes as the worker is stopped, and its ack is never answered: the stop
    # is bounded by one settle timeout, as when each job waited for its own ack (not a
    # wait for the acks and then a second one to send them again).
    # In each module of the worker that reads it: the stop's bound, the ack task, a job's.
    for module in (worker_module, worker_acks, worker_jobs):
        monkeypatch.setattr(module, "SETTLE_TIMEOUT_S", 1.0)
    async with open_local(str(tmp_path / "local.db")) as client:
        job = await client.submit("q", 1)
        acks = HeldAcks(client, forever=True, hold=2)  # a second try would hang too
        stopped_at: list[float] = []

        async def handler(leased: LeasedJob) -> int:
            worker.stop()
            stopped_at.append(trio.current_time())
            return 1

        worker = make_worker(client, handler=handler, shutdown_timeout=5.0)
        with trio.fail_after(BOUND_S):
            await worker.run()
        took = trio.current_time() - stopped_at[0]
        assert 1.0 <= took < 1.9, took  # not a second settle timeout (2 s)
        assert acks.calls == 1  # given up, not sent again past the bound
        stats = worker.statistics()
        assert stats.running == 0 and stats.succeeded == 0
        assert (await client.inspect(job.job_id)).state == JobState.LEASED


async def test_acks_answered_before_a_cancellation_are_not_sent_again(tmp_path):
    # One ack per job (a server without ack_batch); the worker is cancelled while one of
    # two acks has its answer and the other has not: only the unanswered one goes again.
    from relay.protocol.errors import UnknownOp

    together = Together({n: n for n in range(2)})
    async with open_local(str(tmp_path / "local.db")) as client:

        async def unknown(worker_id: str, acks: Any) -> Any:
            raise UnknownOp("unknown op 'ack_batch'")

        client.ack_batch = unknown  # type: ignore[method-assign]
        real_ack = client.ack
        sent: dict[str, int] = {}
        answered, slow = trio.Event(), trio.Event()

        async def ack(job_id: str, *args: Any, **kwargs: Any) -> None:
            sent[job_id] = sent.get(job_id, 0) + 1
            if job_id == ids[1] and sent[job_id] == 1:
                slow.set()
                await trio.sleep_forever()  # this answer never comes
            await real_ack(job_id, *args, **kwargs)
            if job_id == ids[0]:
                answered.set()

        client.ack = ack  # type: ignore[method-assign]
        ids = await submit_together(client, together, [0, 1])
        worker = make_worker(client, handler=together, concurrency=2)
        async with run_cancellable(worker) as outer:
            await answered.wait()
            await slow.wait()
            outer.cancel()
        assert sent == {ids[0]: 1, ids[1]: 2}
        stats = worker.statistics()
        assert stats.succeeded == 2 and stats.running == 0
        assert (await queue_counts(client, "q"))["succeeded"] == 2


def _server_in_thread(db: str) -> tuple[str, threading.Event, threading.Thread]:
    """A server on its own thread and event loop, so that the test's loop may block."""
    addresses: list[str] = []
    started, stop = threading.Event(), threading.Event()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            server = await start_server(nursery, db)
            addresses.append(server.address)
            started.set()
            await trio.to_thread.run_sync(stop.wait)
            server.handle.shutdown()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(BOUND_S)
    return addresses[0], stop, thread


async def test_a_job_leased_again_to_the_same_worker_keeps_its_two_runs_apart(tmp_path):
    # The first run blocks the worker's event loop past its lease; the server hands the
    # job out again, to this same worker, while the first run is still finishing. The
    # second run must be renewed and settled as its own (the first's ack is refused).
    address, stop, thread = _server_in_thread(str(tmp_path / "relay.db"))
    try:
        async with open_client(address) as client:
            job = await client.submit("q", 1)
            attempts: list[int] = []

            async def handler(leased: LeasedJob) -> int:
                attempts.append(leased.attempt)
                if leased.attempt == 1:
                    time.sleep(2.0)  # noqa: ASYNC251 (blocks the loop: no renewal meanwhile)
                else:
                    await trio.sleep(1.2)  # past the lease: lives on renewals
                return leased.attempt

            # A lease long enough that a renewal late by a loaded machine's few hundred
            # milliseconds still comes in time, and short enough to expire in the first run.
            worker = make_worker(address, handler=handler, concurrency=2, lease_ms=1000)
            async with running(worker):
                view = await wait_for_state(client, job.job_id, "succeeded", "dead")
            assert view.state == JobState.SUCCEEDED
            assert view.result == view.attempt == 2
            assert attempts == [1, 2]
    finally:
        stop.set()
        thread.join(BOUND_S)


# -- renewal -----------------------------------------------------------------------------------


async def test_renewal_keeps_a_long_job_alive_past_its_lease(backend):
    submitted = await backend.client.submit("q", {})

    async def handler(job: LeasedJob) -> str:
        await trio.sleep(2.5)  # the work: over three times the lease
        return "done"

    # (A lease long enough that renewals a loaded machine delays by a few hundred ms
    # still come in time.)
    async with running(make_worker(backend.target, handler=handler, lease_ms=800)) as worker:
        view = await wait_for_state(backend.client, submitted.job_id, "succeeded", "dead")
        assert worker.statistics().lost == 0
    assert view.state == JobState.SUCCEEDED
    assert view.result == "done"
    assert view.attempt == 1
    assert view.errors == [], view.errors
    assert view.last_error is None


async def test_one_renewal_task_keeps_jobs_started_at_different_times_alive(backend):
    # Jobs leased at different moments fall due for renewal at different moments; the
    # worker's single renewal task must keep every one of them alive.
    first = await backend.client.submit("q", {"n": 0})
    started = trio.Event()

    async def handler(job: LeasedJob) -> int:
        started.set()
        await trio.sleep(2.5)  # over three times the lease
        return job.payload["n"]

    worker = make_worker(backend.target, handler=handler, lease_ms=800, concurrency=4)
    async with running(worker):
        with trio.fail_after(BOUND_S):
            await started.wait()
        later = []
        for n in (1, 2, 3):
            await trio.sleep(0.35)  # between renewal passes (~267 ms apart at this lease)
            later.append(await backend.client.submit("q", {"n": n}))
        views = [
            await wait_for_state(backend.client, s.job_id, "succeeded", "dead")
            for s in (first, *later)
        ]
        assert worker.statistics().lost == 0
    assert [v.state for v in views] == [JobState.SUCCEEDED] * 4
    assert [v.result for v in views] == [0, 1, 2, 3]
    assert [v.attempt for v in views] == [1] * 4


async def test_an_unanswered_renewal_does_not_hold_up_the_others(tmp_path):
    # The first renewal of one job never gets an answer; the renewal task gives it up
    # after one interval and goes on, so both jobs keep their leases to the end.
    async with open_local(str(tmp_path / "local.db")) as client:
        first, second = await client.submit_batch([{"queue": "q", "payload": n} for n in (0, 1)])
        renew = client.renew
        hung: list[str] = []

        async def renew_or_hang(job_id: str, *args: Any, **kwargs: Any) -> int:
            if not hung:
                hung.append(job_id)
                await trio.sleep_forever()
            return await renew(job_id, *args, **kwargs)

        client.renew = renew_or_hang  # type: ignore[method-assign]

        async def handler(job: LeasedJob) -> int:
            await trio.sleep(3.5)  # over three times the lease
            return job.payload

        # Renewal passes a third of a lease apart: a pass that gives up the hung renewal
        # after one interval still renews the other job with the rest of its lease to
        # spare, also when a loaded machine delays the passes by a few hundred ms.
        worker = make_worker(client, handler=handler, lease_ms=1000, concurrency=2)
        async with running(worker):
            views = [
                await wait_for_state(client, s.job_id, "succeeded", "dead") for s in (first, second)
            ]
        assert hung
        assert [(v.state, v.attempt) for v in views] == [(JobState.SUCCEEDED, 1)] * 2
        assert worker.statistics().lost == 0


async def test_refused_renewal_cancels_the_handler_and_nothing_is_acked(backend):
    submitted = await backend.client.submit("q", {})
    started = trio.Event()
    cancelled = trio.Event()
    held: list[LeasedJob] = []
    finished_normally = False

    async def handler(job: LeasedJob) -> str:
        nonlocal finished_normally
        held.append(job)
        started.set()
        try:
            await trio.sleep(30)
        except trio.Cancelled:
            cancelled.set()
            raise
        finished_normally = True
        return "should not be acked"

    worker = make_worker(backend.target, handler=handler, lease_ms=900)
    async with running(worker):
        with trio.fail_after(BOUND_S):
            await started.wait()
        (job,) = held
        taken = await take_away(backend.client, worker, job)  # the next renewal is refused
        with trio.fail_after(3):
            await cancelled.wait()
        await wait_until(
            lambda: _async_true(worker.statistics().lost == 1), within=3, what="lost == 1"
        )
        view = await backend.client.inspect(job.job_id)
        assert view.state == JobState.LEASED and view.worker_id == "other"
        stats = worker.statistics()
        assert stats.succeeded == 0 and stats.failed == 0 and stats.released == 0
    assert not finished_normally
    # The new holder still owns the job.
    await backend.client.ack(taken.job_id, "other", taken.token, "by other")
    view = await backend.client.inspect(submitted.job_id)
    assert view.state == JobState.SUCCEEDED and view.result == "by other"


# -- stop --------------------------------------------------------------------------------------


async def test_stop_cancels_a_slow_handler_after_the_timeout_and_releases_its_job(backend):
    submitted = await backend.client.submit("q", {})
    started = trio.Event()
    cancelled = trio.Event()

    async def handler(job: LeasedJob) -> None:
        started.set()
        try:
            await trio.sleep(5)
        except trio.Cancelled:
            cancelled.set()
            raise

    worker = make_worker(backend.target, handler=handler, shutdown_timeout=0.2, lease_ms=60_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        with trio.fail_after(BOUND_S):
            await started.wait()
        stopping = trio.current_time()
        worker.stop()
    elapsed = trio.current_time() - stopping
    assert elapsed < 2.0, f"run() returned {elapsed:.2f}s after stop (timeout 0.2 s)"
    assert cancelled.is_set()
    view = await backend.client.inspect(submitted.job_id)
    # Released, not left leased for the 60 s lease: ready, its attempt given back.
    assert view.state == JobState.READY and view.attempt == 0
    assert worker.statistics().released == 1 and worker.statistics().running == 0


async def test_stop_lets_a_handler_that_finishes_in_time_be_acked(backend):
    first = await backend.client.submit("q", 1)
    second = await backend.client.submit("q", 2)
    started = trio.Event()
    proceed = trio.Event()
    returned = trio.Event()

    async def handler(job: LeasedJob) -> str:
        started.set()
        await proceed.wait()
        return f"finished {job.payload}"

    worker = make_worker(backend.target, handler=handler, shutdown_timeout=5, concurrency=1)

    async def run() -> None:
        await worker.run()
        returned.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        with trio.fail_after(BOUND_S):
            await started.wait()
        worker.stop()
        await trio.testing.wait_all_tasks_blocked()
        assert not returned.is_set()  # waits for the running job
        proceed.set()
        with trio.fail_after(BOUND_S):
            await returned.wait()
    view = await backend.client.inspect(first.job_id)
    assert view.state == JobState.SUCCEEDED and view.result == "finished 1"
    # Nothing more was leased after stop().
    view = await backend.client.inspect(second.job_id)
    assert view.state == JobState.READY and view.attempt == 0
    assert worker.statistics().succeeded == 1


async def test_second_stop_cancels_at_once_and_still_releases(backend):
    submitted = await backend.client.submit("q", {})
    started = trio.Event()

    async def handler(job: LeasedJob) -> None:
        started.set()
        await trio.sleep(30)

    worker = make_worker(backend.target, handler=handler, shutdown_timeout=30, lease_ms=60_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        with trio.fail_after(BOUND_S):
            await started.wait()
        worker.stop()
        worker.stop()
        stopping = trio.current_time()
    assert trio.current_time() - stopping < 2.0
    view = await backend.client.inspect(submitted.job_id)
    assert view.state == JobState.READY and view.attempt == 0
    assert worker.statistics().released == 1


async def test_stop_while_idle_returns_promptly_and_leaves_jobs_alone(backend):
    worker = make_worker(backend.target, handler=lambda job: None)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await trio.testing.wait_all_tasks_blocked()  # the long-poll lease is waiting
        stopping = trio.current_time()
        worker.stop()
    assert trio.current_time() - stopping < 2.0
    # A job submitted after the stop is not kept by the abandoned long-poll: whoever
    # asks next gets it, as its first attempt.
    submitted = await backend.client.submit("q", {})
    with trio.fail_after(BOUND_S):
        jobs = await backend.client.lease(["q"], "next", wait_ms=3_000)
    assert [(j.job_id, j.attempt) for j in jobs] == [(submitted.job_id, 1)]


# -- identity and statistics -------------------------------------------------------------------


def test_worker_ids_are_unique_and_contain_the_pid():
    workers = [Worker("127.0.0.1:1", queues=["q"], handler=lambda job: None) for _ in range(3)]
    ids = [w.worker_id for w in workers]
    assert len(set(ids)) == 3
    for worker_id in ids:
        assert str(os.getpid()) in worker_id.split(":"), worker_id
    assert Worker("127.0.0.1:1", queues=["q"], handler=print, worker_id="mine").worker_id == "mine"


def test_worker_arguments_are_checked():
    with pytest.raises(ValueError):
        Worker("127.0.0.1:1", queues=["q"])
    with pytest.raises(ValueError):
        Worker("127.0.0.1:1", queues=["q"], handler=print, handlers={"q": print})
    with pytest.raises(ValueError):
        Worker("127.0.0.1:1", queues=[], handler=print)
    with pytest.raises(ValueError):
        Worker("127.0.0.1:1", queues=["q"], handler=print, concurrency=0)


async def test_statistics_while_running(backend):
    await backend.client.submit("q", {})
    started = trio.Event()
    proceed = trio.Event()

    async def handler(job: LeasedJob) -> None:
        started.set()
        await proceed.wait()

    async with running(make_worker(backend.target, handler=handler, concurrency=2)) as worker:
        with trio.fail_after(BOUND_S):
            await started.wait()
        assert worker.statistics() == WorkerStatistics(
            running=1, concurrency=2, succeeded=0, failed=0, lost=0, released=0
        )
        proceed.set()
        await wait_succeeded(backend.client, "q", 1)
        await wait_until(lambda: _async_true(worker.statistics().succeeded == 1))
        assert worker.statistics().running == 0


# -- worker processes --------------------------------------------------------------------------

WORKER_SCRIPT = textwrap.dedent(
    """
    import sys

    import trio

    import relay

    address, lease_ms, shutdown = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])


    async def handler(job):
        print("started", job.job_id, job.attempt, flush=True)
        await trio.sleep_forever()


    async def main():
        worker = relay.Worker(
            address, queues=["q"], handler=handler, concurrency=1, lease_ms=lease_ms,
            shutdown_timeout=shutdown,
        )
        await relay.run_worker(worker)


    trio.run(main)
    """
)


@asynccontextmanager
async def worker_process(
    tmp_path: Path, address: str, lease_ms: int, shutdown: float
) -> AsyncIterator[tuple[trio.Process, str]]:
    """A worker process (a script using relay.Worker); yields it and the first
    "started JOB_ID ATTEMPT" line its handler prints."""
    script = tmp_path / "worker_script.py"
    script.write_text(WORKER_SCRIPT)
    command = [sys.executable, str(script), address, str(lease_ms), str(shutdown)]
    async with reaped(command, stdout=subprocess.PIPE) as process:
        assert process.stdout is not None
        buffer = b""
        with trio.fail_after(BOUND_S):
            while b"\n" not in buffer:
                data = await process.stdout.receive_some(4096)
                assert data, "the worker process exited before running a job"
                buffer += data
        yield process, buffer.partition(b"\n")[0].decode()


@asynccontextmanager
async def reaped(command: list[str], **options: Any) -> AsyncIterator[trio.Process]:
    """A child process, run from the repository; killed (if still running) and waited
    for, bounded, when the block ends."""
    process = await trio.lowlevel.open_process(command, cwd=str(REPO), **options)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        with trio.fail_after(BOUND_S):
            await process.wait()


async def assert_runs_again_after_expiry(tcp: Any, job_id: str, killed: float) -> None:
    """A second worker gets the job of a killed one as attempt 2, promptly, and its history
    shows the lease expired (it was not released)."""
    attempts: list[int] = []
    picked_up = trio.Event()

    async def handler(job: LeasedJob) -> str:
        attempts.append(job.attempt)
        picked_up.set()
        return "ran again"

    async with running(make_worker(tcp.target, handler=handler)):
        with trio.fail_after(5):
            await picked_up.wait()
        view = await wait_for_state(tcp.client, job_id, "succeeded")
    assert trio.current_time() - killed < 5
    assert attempts == [2]
    assert view.attempt == 2 and view.result == "ran again"
    assert [(e.attempt, e.error) for e in view.errors] == [(1, "lease expired")]


async def test_killed_worker_process_job_runs_again_after_the_lease_expires(tcp, tmp_path):
    submitted = await tcp.client.submit("q", {"run": "twice"}, retries=3)
    async with worker_process(tmp_path, tcp.target, lease_ms=500, shutdown=1) as (proc, line):
        assert line == f"started {submitted.job_id} 1"
        assert (await tcp.client.inspect(submitted.job_id)).state == JobState.LEASED
        proc.kill()  # SIGKILL: no release, no ack
        with trio.fail_after(BOUND_S):
            await proc.wait()
        assert proc.returncode == -9
    await assert_runs_again_after_expiry(tcp, submitted.job_id, killed=trio.current_time())


async def test_sigterm_stops_a_worker_process_and_releases_its_job_at_once(tcp, tmp_path):
    submitted = await tcp.client.submit("q", {})
    async with worker_process(tmp_path, tcp.target, lease_ms=60_000, shutdown=0.2) as (
        proc,
        line,
    ):
        assert line == f"started {submitted.job_id} 1"
        proc.terminate()  # SIGTERM: graceful stop
        with trio.fail_after(BOUND_S):
            await proc.wait()
        assert proc.returncode == 0
    # Released well before its 60 s lease: ready, attempt given back, no error recorded.
    view = await tcp.client.inspect(submitted.job_id)
    assert view.state == JobState.READY and view.attempt == 0 and view.errors == []


# The `relay-trio worker` command (its default handler sleeps for payload["sleep_ms"]).

RELAY_TRIO = Path(sys.executable).parent / "relay-trio"


def _has_worker_command() -> bool:
    if not RELAY_TRIO.exists():
        return False
    done = subprocess.run(
        [str(RELAY_TRIO), "worker", "--help"], capture_output=True, timeout=30, check=False
    )
    return done.returncode == 0


needs_worker_command = pytest.mark.skipif(
    not _has_worker_command(), reason="no `relay-trio worker` command"
)


@asynccontextmanager
async def cli_worker(address: str, *options: str) -> AsyncIterator[trio.Process]:
    command = [str(RELAY_TRIO), "worker", "--address", address, "--queue", "q", *options]
    async with reaped(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as process:
        yield process


async def _leased_by(client: Client, job_id: str, pid: int) -> bool:
    view = await client.inspect(job_id)
    return view.state == JobState.LEASED and str(pid) in (view.worker_id or "").split(":")


@needs_worker_command
async def test_killed_worker_command_job_runs_again_after_the_lease_expires(tcp):
    submitted = await tcp.client.submit("q", {"sleep_ms": 60_000}, retries=3)
    options = ("--concurrency", "1", "--lease-ms", "500")
    async with cli_worker(tcp.target, *options) as proc:
        await wait_until(
            lambda: _leased_by(tcp.client, submitted.job_id, proc.pid),
            what="the job leased by the worker process",
        )
        proc.kill()  # SIGKILL: no release, no ack
        with trio.fail_after(BOUND_S):
            await proc.wait()
        assert proc.returncode == -9
    await assert_runs_again_after_expiry(tcp, submitted.job_id, killed=trio.current_time())


@needs_worker_command
async def test_sigterm_to_the_worker_command_releases_its_job_at_once(tcp):
    submitted = await tcp.client.submit("q", {"sleep_ms": 60_000})
    options = ("--lease-ms", "60000", "--shutdown-timeout-ms", "200")
    async with cli_worker(tcp.target, *options) as proc:
        await wait_until(
            lambda: _leased_by(tcp.client, submitted.job_id, proc.pid),
            what="the job leased by the worker process",
        )
        proc.terminate()
        with trio.fail_after(BOUND_S):
            await proc.wait()
        assert proc.returncode == 0
    view = await tcp.client.inspect(submitted.job_id)
    assert view.state == JobState.READY and view.attempt == 0 and view.errors == []


# -- stopping a worker that has not reached its server ---------------------------------------


class _OnEvent(logging.Handler):
    """Sets ``seen`` when a record of event ``name`` is emitted."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.DEBUG)
        self.name, self.seen = name, trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", record.getMessage()) == self.name:
            self.seen.set()


@pytest.mark.parametrize("server", ["silent", "down"])
async def test_stop_ends_a_worker_still_trying_to_reach_its_server(server):
    """A server that accepts and never answers (the worker is in its connection's hello)
    or none at all (it waits between attempts): stop() ends run() at once, wherever the
    attempt is, and nothing is left running."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    failed = _OnEvent("worker.connect_failed")
    logging.getLogger("relay.worker").addHandler(failed)
    try:
        with trio.fail_after(BOUND_S):
            async with trio.open_nursery() as server_side:
                accepted = trio.Event()
                if server == "silent":

                    async def accept() -> None:
                        async with await listeners[0].accept():
                            accepted.set()
                            await trio.sleep_forever()

                    server_side.start_soon(accept)
                else:
                    await listeners[0].aclose()
                worker = Worker(f"127.0.0.1:{port}", queues=["q"], handler=lambda job: None)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(worker.run)
                    # In an attempt (its hello unanswered), or between two.
                    await (accepted if server == "silent" else failed.seen).wait()
                    stopped = trio.current_time()
                    worker.stop()
                assert trio.current_time() - stopped < 1.0
                server_side.cancel_scope.cancel()
    finally:
        logging.getLogger("relay.worker").removeHandler(failed)
        await listeners[0].aclose()


async def test_a_refusal_at_start_comes_out_of_run_worker_as_itself(server):
    """run_worker (and run) raise what no retry fixes as the error itself, never in an
    exception group: here a lease longer than the server allows."""
    worker = Worker(server.address, queues=["q"], handler=lambda job: None, lease_ms=10**12)
    with trio.fail_after(BOUND_S), pytest.raises(BadRequest) as refused:
        await run_worker(worker)
    assert refused.value.field == "lease_ms"


class _RefusingTransport:
    """A server that says hello and refuses every lease (a token revoked after start)."""

    def __init__(self) -> None:
        self.leases = 0

    async def request(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        if op == "hello":
            return {"server": "relay-trio", "version": "t", "protocol": 1, "limits": {},
                    "role": "worker"}  # fmt: skip
        if op == "lease":
            self.leases += 1
            raise Unauthorized("invalid token")
        return {}


async def test_refused_leases_are_asked_again_less_and_less_often(autojump_clock, caplog):
    """A running worker is not stopped by its server; a lease refused again and again is
    asked again after 0.5 s, doubling to 10 s: about 10 requests (and log lines) in the
    first minute, not 120."""
    transport = _RefusingTransport()
    worker = Worker(Client(transport), queues=["q"], handler=lambda job: None)
    with caplog.at_level(logging.WARNING, logger="relay.worker"):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await trio.sleep(60)
            worker.stop()
    assert 8 <= transport.leases <= 12, transport.leases
    waits = [r.fields["retry_in_s"] for r in caplog.records if r.getMessage() and
             getattr(r, "event", "") == "worker.lease_failed"]  # fmt: skip
    assert waits[:6] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]


async def test_a_handler_sees_the_slot_of_the_schedule_that_submitted_its_job():
    seen: list[int | None] = []
    both = trio.Event()  # a scheduled job and a plain one seen
    async with open_local(limits=Limits(allow_second_schedules=True)) as queue:
        await queue.schedule_put("tick", "* * * * * *", "ticks", {"n": 1})
        await queue.submit("ticks", {"n": 2})  # no schedule's: no slot

        async def handler(job):
            seen.append(job.scheduled_for)
            if None in seen and any(slot is not None for slot in seen):
                both.set()

        worker = Worker(queue, queues=["ticks"], handler=handler, shutdown_timeout=1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.run)
            with trio.fail_after(10):
                await both.wait()
            worker.stop()
    slots = [slot for slot in seen if slot is not None]
    assert slots and all(slot % 1000 == 0 for slot in slots)
