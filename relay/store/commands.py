"""The typed commands trio code sends to the writer thread, one per store operation.

A command is a frozen value with ``apply(store, now)``: the writer calls it inside the
batch's transaction with the batch's ``now``. Keeping commands as plain data (rather than
closures) lets the writer see what it runs, and lets a later store reuse the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from relay.protocol.errors import RelayError
from relay.protocol.model import SubmitSpec
from relay.store.base import ClaimArgs, Store


class Command(Protocol):
    def apply(self, store: Store, now: int) -> Any: ...


# A command class may also offer ``apply_many(store, now, commands) -> outcomes``: the
# writer then runs all the commands of that class in one batch in one call. If that
# raises, the writer runs them one by one instead, so each command still gets its own
# outcome. Merging gives each command the answer it would have had alone, in some order
# of the run: for submits and acks the order given; for leases, grouped by queue set
# (see Store.jobs_claim_many), a valid order for requests that were concurrent.
# ``PHASE`` (default 1) orders the classes within a batch (relay/store/thread.py).

# The reply budgets that one merged call of leases may add up to: bounds the memory and
# the size of the one JSON row that reads the leased jobs back.
CLAIM_RUN_BYTES = 16 * 1024 * 1024

# job_id, worker_id, token, result text (or None): one ack.
AckArgs = tuple[str, str, str, str | None]


@attrs.frozen
class Submit:
    specs: tuple[SubmitSpec, ...]

    PHASE = 1  # after the claims (as relay/server/requests/ops.py orders requests)

    def apply(self, store: Store, now: int) -> Any:
        return store.jobs_submit(self.specs, now)

    @staticmethod
    def apply_many(store: Store, now: int, commands: list[Submit]) -> list[Any]:
        # One insert for the whole run; then each command gets its own slice.
        results = store.jobs_submit([spec for c in commands for spec in c.specs], now)
        return split_results(results, [c.specs for c in commands])


def parts(groups: Sequence[Sequence[Any]]) -> list[slice]:
    """Where each of ``groups`` lies in the list of all their items, in order."""
    slices, start = [], 0
    for group in groups:
        slices.append(slice(start, start + len(group)))
        start += len(group)
    return slices


def split_results(results: Any, groups: Sequence[Sequence[Any]]) -> list[Any]:
    """``results`` (one per spec of all ``groups``, in order) cut into one list per group."""
    return [results[part] for part in parts(groups)]


@attrs.frozen
class Claim:
    queues: tuple[str, ...]
    worker_id: str
    count: int
    lease_ms: int
    max_bytes: int | None = None

    PHASE = 0  # first: it claims what was ready before the batch

    def apply(self, store: Store, now: int) -> Any:
        return store.jobs_claim(
            self.queues, self.worker_id, self.count, self.lease_ms, now, self.max_bytes
        )

    @staticmethod
    def apply_many(store: Store, now: int, commands: list[Claim]) -> list[Any]:
        return claim_in_pieces(
            store,
            now,
            [(c.queues, c.worker_id, c.count, c.lease_ms, c.max_bytes) for c in commands],
        )


def claim_in_pieces(store: Store, now: int, claims: list[ClaimArgs]) -> list[Any]:
    """``jobs_claim_many`` in pieces whose reply budgets add up to at most CLAIM_RUN_BYTES,
    one after the other (a claim without a budget counts as that much on its own)."""
    outcomes: list[Any] = []
    piece: list[ClaimArgs] = []
    budget = 0
    for claim in claims:
        size = CLAIM_RUN_BYTES if claim[4] is None else claim[4]
        if piece and budget + size > CLAIM_RUN_BYTES:
            outcomes += store.jobs_claim_many(piece, now)
            piece, budget = [], 0
        piece.append(claim)
        budget += size
    return outcomes + store.jobs_claim_many(piece, now)


@attrs.frozen
class Renew:
    job_id: str
    worker_id: str
    token: str
    lease_ms: int

    def apply(self, store: Store, now: int) -> Any:
        return store.lease_renew(self.job_id, self.worker_id, self.token, self.lease_ms, now)


@attrs.frozen
class Ack:
    job_id: str
    worker_id: str
    token: str
    result: str | None = None

    PHASE = 2

    def apply(self, store: Store, now: int) -> Any:
        return store.jobs_ack(self.job_id, self.worker_id, self.token, self.result, now)

    @staticmethod
    def apply_many(store: Store, now: int, commands: list[Ack]) -> list[Any]:
        acks = [(c.job_id, c.worker_id, c.token, c.result) for c in commands]
        return store.jobs_ack_many(acks, now)


@attrs.frozen
class AckBatch:
    """Many acks in one command, each with its own outcome (None, or the ``RelayError``
    that refused it), exactly as if each had been its own ``Ack``, in order."""

    acks: tuple[tuple[str, str, str, str | None], ...]  # job_id, worker_id, token, result

    PHASE = 2

    def apply(self, store: Store, now: int) -> list[Any]:
        return ack_each(store, now, self.acks)


def ack_each(store: Store, now: int, acks: Sequence[AckArgs]) -> list[Any]:
    """Each ack's outcome (None, or the ``RelayError`` that refused it), exactly as if each
    had been its own ``Ack``, in order: one store call unless a job appears twice."""
    mark = store.write_mark()
    try:
        return store.jobs_ack_many(acks, now)
    except ValueError:
        # A job twice, and nothing written: each on its own below. (Anything that has
        # written is the writer's to handle: its careful pass.)
        if store.write_mark() != mark:
            raise
    outcomes: list[Any] = []
    for job_id, worker_id, token, result in acks:
        try:
            outcomes.append(store.jobs_ack(job_id, worker_id, token, result, now))
        except RelayError as exc:
            outcomes.append(exc)
    return outcomes


@attrs.frozen
class Fail:
    job_id: str
    worker_id: str
    token: str
    error: str
    retryable: bool = True
    traceback: str | None = None

    def apply(self, store: Store, now: int) -> Any:
        return store.jobs_fail(
            self.job_id, self.worker_id, self.token, self.error, self.retryable, now,
            self.traceback,
        )  # fmt: skip


@attrs.frozen
class Release:
    job_id: str
    worker_id: str
    token: str

    def apply(self, store: Store, now: int) -> Any:
        return store.jobs_release(self.job_id, self.worker_id, self.token, now)


@attrs.frozen
class PromoteDue:
    limit: int

    def apply(self, store: Store, now: int) -> Any:
        return store.jobs_promote_due(now, self.limit)


@attrs.frozen
class ReapExpired:
    limit: int

    def apply(self, store: Store, now: int) -> Any:
        return store.leases_reap_expired(now, self.limit)


@attrs.frozen
class Prune:
    limit: int

    def apply(self, store: Store, now: int) -> Any:
        return store.jobs_prune(now, self.limit)


@attrs.frozen
class HistoryFlush:
    """What was counted since the last flush, added to the history table
    (relay/store/history.py); returns the histograms' deltas."""

    def apply(self, store: Store, now: int) -> Any:
        return store.history_flush(now)


@attrs.frozen
class HistoryPrune:
    limit: int

    def apply(self, store: Store, now: int) -> Any:
        return store.history_prune(now, self.limit)


@attrs.frozen
class NextDeadlines:
    """(earliest due time of a pending/retrying job, earliest lease expiry), either None."""

    def apply(self, store: Store, now: int) -> Any:
        return store.next_due_at(), store.next_expiry_at()


@attrs.frozen
class Inspect:
    job_id: str
    prefix: bool = False  # job_id may be abbreviated: the one job whose id begins so

    def apply(self, store: Store, now: int) -> Any:
        if self.prefix:
            return store.job_inspect_prefix(self.job_id)
        return store.job_inspect(self.job_id)


@attrs.frozen
class ShortIds:
    job_ids: tuple[str, ...]

    def apply(self, store: Store, now: int) -> Any:
        return store.job_ids_abbreviate(self.job_ids)


@attrs.frozen
class Stats:
    def apply(self, store: Store, now: int) -> Any:
        return store.queue_stats()


@attrs.frozen
class RefreshCounts:
    """PostgreSQL: read a page of every server's counts into the view (the next cursor)."""

    after: str | None
    limit: int

    def apply(self, store: Store, now: int) -> Any:
        return store.counts_refresh(self.after, self.limit)  # type: ignore[attr-defined]


@attrs.frozen
class PutWaiters:
    """PostgreSQL: write this server's rows of ``waiters``: one for each queue of ``put``
    (its time ``ttl_ms`` from now), none for those of ``drop``. Answers the queues of
    ``put`` that had no row."""

    put: tuple[str, ...]
    drop: tuple[str, ...]
    ttl_ms: int

    def apply(self, store: Store, now: int) -> Any:
        return store.waiters_put(self.put, self.drop, now + self.ttl_ms, now)  # type: ignore[attr-defined]


@attrs.frozen
class OldestReadyAt:
    """When the oldest ready job of each of these queues became ready (those with one)."""

    queues: tuple[str, ...]

    def apply(self, store: Store, now: int) -> Any:
        return {queue: now - age for queue, age in store.oldest_ready_ms(now, self.queues).items()}


@attrs.frozen
class LeasesHeld:
    """The unexpired leases of these workers (``Store.leases_held``), and the store's now."""

    worker_ids: tuple[str, ...]
    limit: int

    def apply(self, store: Store, now: int) -> Any:
        return store.leases_held(self.worker_ids, now, self.limit), now


@attrs.frozen
class EventTotals:
    def apply(self, store: Store, now: int) -> Any:
        return store.event_totals()


@attrs.frozen
class DeadList:
    queue: str | None
    limit: int
    cursor: str | None = None
    max_bytes: int | None = None
    newest: bool = False

    def apply(self, store: Store, now: int) -> Any:
        return store.dead_list(self.queue, self.limit, self.cursor, self.max_bytes, self.newest)


@attrs.frozen
class DeadRetry:
    job_id: str
    states: tuple[str, ...] = ("dead",)

    def apply(self, store: Store, now: int) -> Any:
        return store.dead_retry(self.job_id, now, self.states)


@attrs.frozen
class DeadRetryQueue:
    queue: str
    limit: int
    states: tuple[str, ...] = ("dead",)

    def apply(self, store: Store, now: int) -> Any:
        return store.dead_retry_queue(self.queue, now, self.limit, self.states)


@attrs.frozen
class DeadPurge:
    job_id: str
    states: tuple[str, ...] = ("dead",)

    def apply(self, store: Store, now: int) -> Any:
        return store.dead_purge(self.job_id, self.states)


@attrs.frozen
class DeadPurgeQueue:
    queue: str
    limit: int
    states: tuple[str, ...] = ("dead",)

    def apply(self, store: Store, now: int) -> Any:
        return store.dead_purge_queue(self.queue, self.limit, self.states)


@attrs.frozen
class QueuePause:
    """Pause (``paused``) or resume a queue; answers whether it is paused now."""

    queue: str
    paused: bool

    def apply(self, store: Store, now: int) -> Any:
        return store.queue_pause(self.queue, self.paused, now)


@attrs.frozen
class QueueSettingsPage:
    """The settings of up to ``limit`` queues that have any, named after ``after``."""

    after: str | None
    limit: int

    def apply(self, store: Store, now: int) -> Any:
        return store.queue_settings(self.after, self.limit)


@attrs.frozen
class JobCancel:
    job_id: str
    leased_ok: bool = True  # False (a producer's cancel): a leased job is refused

    def apply(self, store: Store, now: int) -> Any:
        return store.job_cancel(self.job_id, now, self.leased_ok)


@attrs.frozen
class JobCancelQueue:
    queue: str
    states: tuple[str, ...]
    limit: int

    def apply(self, store: Store, now: int) -> Any:
        return store.job_cancel_queue(self.queue, self.states, now, self.limit)


@attrs.frozen
class RunSchedules:
    """Submit the due slots of up to ``limit`` schedules (``Store.schedules_run_due``);
    answers (the runs, the earliest next slot of any schedule afterwards, the ``now`` it
    ran at), so that the scheduler knows whether more are due and when to wake."""

    limit: int

    def apply(self, store: Store, now: int) -> Any:
        runs = store.schedules_run_due(now, self.limit)
        return runs, store.next_schedule_at(), now


@attrs.frozen
class ScheduleAges:
    """(name -> ms since the slot of its last job) of the first ``limit`` schedules by
    name that have made one: /metrics' relay_schedule_last_run_age_seconds."""

    limit: int

    def apply(self, store: Store, now: int) -> Any:
        slots = store.schedule_last_slots(self.limit)
        return {name: now - slot for name, slot in slots if slot is not None}
