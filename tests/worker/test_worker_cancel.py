"""relay.Worker and a job cancelled on the server (``cancel``): the handler is stopped by the
next renewal, the job is settled without a fail, its slot frees, one ``job.cancelled`` line.

Against a fake server (a transport that answers as the contract says) under trio's
MockClock, so renewals come at their times without waiting for them; and once end to end,
against a real server."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

from relay import Cancelled, Client, JobState, LeasedJob, Worker, open_client
from tests.server.conftest import logged
from tests.worker.helpers import BOUND_S, wait_until

LEASE_MS = 30_000
JOB = "job_0000000000000abc"
TOKEN = "f" * 32


class CancellingServer:
    """One job, leased once; ``cancel()`` voids its lease as the server does: from then on
    its renew, ack (also in an ack_batch), fail and release are refused ``cancelled``."""

    def __init__(self) -> None:
        self.cancelled_at: float | None = None
        self.leased = False
        self.sent: list[tuple[str, float]] = []  # (op, trio time) of every job op

    def cancel(self) -> None:
        self.cancelled_at = trio.current_time()

    def _refusal(self) -> Cancelled:
        return Cancelled(JOB)

    async def request(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        if op == "hello":
            return {"server": "relay-trio", "version": "t", "protocol": 1, "limits": {},
                    "role": "admin"}  # fmt: skip
        if op == "lease":
            if self.leased:
                await trio.sleep(fields["wait_ms"] / 1000)
                return {"jobs": []}
            self.leased = True
            job = {"job_id": JOB, "queue": "q", "payload": {"n": 1}, "priority": "normal",
                   "attempt": 1, "max_attempts": 4, "token": TOKEN,
                   "lease_expires_at": 10**12}  # fmt: skip
            return {"jobs": [job]}
        self.sent.append((op, trio.current_time()))
        cancelled = self.cancelled_at is not None
        if op == "ack_batch":
            error = {"code": "cancelled", "message": str(self._refusal())}
            return {"results": [{"ok": False, "error": error} if cancelled else {"ok": True}
                                for _ in fields["acks"]]}  # fmt: skip
        if cancelled:
            raise self._refusal()
        if op == "renew":
            return {"lease_expires_at": 10**12}
        if op == "fail":
            return {"state": "retrying", "retry_at": 10**12}
        return {}


async def run_until(worker: Worker, condition, within: float) -> None:
    # (The worker has no event to wait on for its statistics: polled, in virtual time.)
    with trio.fail_after(within):
        while not condition():  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_a_job_cancelled_while_its_handler_runs_is_stopped_at_the_next_renewal(
    autojump_clock,
):
    server = CancellingServer()
    started, stopped = trio.Event(), trio.Event()

    async def handler(job: LeasedJob) -> str:
        started.set()
        try:
            await trio.sleep(3600)
        finally:
            stopped.set()
        return "never"

    worker = Worker(Client(server), queues=["q"], handler=handler, lease_ms=LEASE_MS)
    with logged("relay.worker") as records:
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await started.wait()
            await trio.sleep(5)  # within the first renewal interval (10 s)
            server.cancel()
            await stopped.wait()
            # At the latest at the next renewal: a third of the lease after the lease.
            assert trio.current_time() - server.cancelled_at <= LEASE_MS / 3000 + 0.01
            await run_until(worker, lambda: worker.statistics().running == 0, within=1)
            stats = worker.statistics()
            worker.stop()
    assert (stats.cancelled, stats.failed, stats.succeeded, stats.lost, stats.released) == (
        1, 0, 0, 0, 0,
    )  # fmt: skip
    # No fail, ack or release was sent: only renewals, the last one refused.
    assert {op for op, _ in server.sent} == {"renew"}
    lines = [r for r in records if getattr(r, "event", None) == "job.cancelled"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert JOB in lines[0].getMessage() and "\n" not in lines[0].getMessage()


@pytest.mark.parametrize("ends", ["returns", "raises"])
async def test_a_job_cancelled_before_its_ack_or_fail_is_settled_without_a_fail(
    autojump_clock, ends
):
    server = CancellingServer()

    async def handler(job: LeasedJob) -> str:
        await trio.sleep(1)
        server.cancel()  # before the first renewal: the ack or the fail is what is told
        if ends == "raises":
            raise ValueError("boom")
        return "done"

    worker = Worker(Client(server), queues=["q"], handler=handler, lease_ms=LEASE_MS)
    with logged("relay.worker") as records:
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await run_until(worker, lambda: worker.statistics().cancelled == 1, within=60)
            await run_until(worker, lambda: worker.statistics().running == 0, within=1)
            stats = worker.statistics()
            worker.stop()
    assert (stats.failed, stats.succeeded, stats.lost, stats.released) == (0, 0, 0, 0)
    # One report, refused: the fail, or the ack (alone, or in an ack_batch).
    expected = [["fail"]] if ends == "raises" else [["ack"], ["ack_batch"]]
    assert [op for op, _ in server.sent] in expected
    events = [getattr(r, "event", None) for r in records]
    assert events.count("job.cancelled") == 1
    assert not {"job.failed", "job.lease_lost", "job.settle_failed"} & set(events)


async def test_a_real_server_cancels_a_running_job_and_the_worker_stops_it(server):
    started, stopped = trio.Event(), trio.Event()

    async def handler(job: LeasedJob) -> None:
        started.set()
        try:
            await trio.sleep(3600)
        finally:
            stopped.set()

    async with open_client(server.address) as client:
        job_id = (await client.submit("rc", 1)).job_id
        # A short lease: its renewals come every 0.1 s.
        worker = Worker(server.address, queues=["rc"], handler=handler, lease_ms=300)
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            with trio.fail_after(BOUND_S):
                await started.wait()
            assert await client.cancel(job_id) == JobState.LEASED
            with trio.fail_after(BOUND_S):
                await stopped.wait()

            async def done() -> bool:
                return worker.statistics().cancelled == 1 and worker.statistics().running == 0

            await wait_until(done, within=BOUND_S, what="the job settled as cancelled")
            worker.stop()
        view = await client.inspect(job_id)
        assert view.state == JobState.CANCELLED and view.errors == []
        assert worker.statistics().failed == 0
