"""The worker's ack task: the acks of finished jobs, sent together in ``ack_batch``es.

``Worker.run`` (relay/worker/worker.py) starts it, with the renewal task, in its helpers nursery,
and cancels both once no job runs and the last acks are answered, or at a graceful stop's
bound. A job's task (relay/worker/jobs.py) whose handler returned queues its ack here as
a ``_PendingAck`` and ends; the ack task settles the job once the ack is answered: counts
it, ends its renewals, frees its slot. Cancelled, it still sends what is left, shielded
and bounded (``WorkerAcks._ack_loop``).
"""

from __future__ import annotations

import logging

import trio

from relay.client.client import Client
from relay.protocol.errors import (
    BadRequest,
    ConnectionLost,
    FrameTooLarge,
    InternalError,
    RelayError,
    UnknownOp,
)
from relay.util.log import event
from relay.worker.jobs import SETTLE_TIMEOUT_S, _is_cancellation, _PendingAck

log = logging.getLogger("relay.worker")  # the worker's: its parts log as the worker does

# What an ack costs in a request besides its result: ids, token, keys.
ACK_OVERHEAD_BYTES = 128


def _give_up(acks: list[_PendingAck], error: RelayError) -> None:
    """The acks of ``acks`` still unanswered end with ``error``."""
    for pending in acks:
        if not pending.answered:
            pending.error, pending.answered = error, True


class WorkerAcks:
    """The ack task of ``Worker`` (relay/worker/worker.py), a part it inherits as ``SqliteStore``
    inherits the store's parts. It uses the worker's ``worker_id``, ``_counts``,
    ``_settle_by``, ``_slot_freed``, its ack state (``_acks``, ``_acks_sending``,
    ``_acks_queued``, ``_acks_answered``, ``_acking``, ``_ack_batches``, ``_ack_batch_max``,
    ``_ack_batch_bytes``), the renewal task (``_renew_loop``) and the job tasks'
    ``_not_settled`` and ``_release``."""

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
