"""The store interface, and what every store shares: its values, rules and counts.

``Store`` is the interface (a ``Protocol``): the methods and attributes that the writer
thread (relay/store/thread.py), the request ops (relay/server/requests/ops.py), the typed commands
(relay/store/commands.py) and the tests call. Each dialect implements it in its own
package (relay/store/sqlite/, relay/store/postgres/), split by the same concerns: submit,
leases, maintenance, dead letters, reads.

Also here, written once: the values a store reports (``Changes``, ``Reaped``, ``JobEvent``)
and takes (``StoreConfig``, ``ClaimArgs``), the constants callers import, the dialect-free
rules (``check_lease``, ``info_size``). What both stores count in memory is
relay/store/counts.py. Nothing here touches a database.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import attrs
import orjson

from relay.protocol.errors import (
    Cancelled,
    InvalidState,
    JobNotFound,
    LeaseExpired,
    RelayError,
    StaleToken,
    TooManyQueues,
    TooManySchedules,
    Unauthorized,
)
from relay.protocol.model import (
    Backoff,
    FailOutcome,
    JobInfo,
    JobState,
    Lease,
    Rate,
    SubmitResult,
    SubmitSpec,
)
from relay.store.history import HistoryFlushed, HistoryPoint
from relay.store.view import QueueView

PENDING, READY, LEASED = JobState.PENDING, JobState.READY, JobState.LEASED
RETRYING, SUCCEEDED, DEAD = JobState.RETRYING, JobState.SUCCEEDED, JobState.DEAD
CANCELLED = JobState.CANCELLED
UNFINISHED = (PENDING, READY, LEASED, RETRYING)
# The states a job may be cancelled from, and those of a job that has not started (which
# a producer may cancel; the wire's default for a whole queue).
CANCELLABLE = (PENDING, READY, RETRYING, LEASED)
NOT_STARTED = (PENDING, READY, RETRYING)
# A whole queue's bulk actions (dead_retry, dead_purge with ``states``): the states whose
# jobs may be made ready again (the finished ones that did not succeed), and those whose
# jobs may be deleted (the finished ones). A promote takes a job that waits for its time.
RETRYABLE = (DEAD, CANCELLED)
PURGEABLE = (DEAD, SUCCEEDED, CANCELLED)
PROMOTABLE = (PENDING, RETRYING)


def refusal_hint(operation: str, state: str, states: Sequence[str]) -> str:
    """What to do about a job in ``state`` that a retry or purge of one job (in
    ``states``) refused: the words after ``InvalidState``'s reason."""
    allowed = RETRYABLE if operation == "retry" else PURGEABLE
    if state in allowed:  # allowed, but not asked for
        return f'name "{state}" in states to {operation} it'
    if operation == "purge":
        return "only a finished job is purged: cancel it first"
    if state == SUCCEEDED:
        return "a succeeded job is not retried: submit it again to run it again"
    if state in PROMOTABLE:
        return "it waits to run: promote it to run it now"
    return "only a dead or cancelled job is retried: it has not finished"


LEASE_EXPIRED_ERROR = "lease expired"
RESTART_ERROR = "lease lost: the server restarted while the job was leased"

# Bytes of randomness per lease token: 128 bits, as the contract requires.
TOKEN_BYTES = 16

# Error history entries shown per job (inspect, dead_list): the most recent ones. With
# errors and tracebacks of at most 8 KiB each, a job's history stays under 512 KiB of
# text in a reply.
ERRORS_SHOWN = 32
# A job browser's item (jobs_list) carries the first this many characters of its last
# error (relay/store/rows.py); the request's reply reservation counts on it.
SUMMARY_ERROR_CHARS = 200
# Ended attempts kept per job (the rows of job_errors): the most recent ones. Each write of
# one past this deletes the oldest (only then: the job row counts its ended attempts,
# ``attempts_ended``), so a job retried 10,000 times keeps this many rows. The errors
# shown are the erring ones among them.
ATTEMPTS_KEPT = ERRORS_SHOWN
# What a job's fields other than its texts add to a reply, roughly: for byte budgets.
REPLY_OVERHEAD_BYTES = 256


# Queues that may have settings (a row of queue_settings) at once. An admin's request
# makes one, for a queue that need not hold jobs, so they are bounded as queues with jobs
# are (``max_queues``); a row that holds only defaults (a queue resumed) is deleted.
MAX_QUEUE_SETTINGS = 10_000
# A page of settings at most (``queue_settings`` reads one more: whether more follow).
SETTINGS_PAGE = 1000


def too_many_settings(held: int) -> TooManyQueues:
    return TooManyQueues(
        f"{held} queues have settings (max {MAX_QUEUE_SETTINGS}); clear the settings of "
        "queues that need them no longer (resume them, set their limits and defaults to null)"
    )


@attrs.frozen
class QueueSettings:
    """A queue's settings, as kept in queue_settings (the defaults for a queue with none).

    None is "not set": no limit, and a submit's own value or the protocol's default."""

    queue: str
    paused: bool = False
    # At most this many jobs of the queue leased at once, over every server.
    max_leased: int | None = None
    rate: Rate | None = None
    # What a submit to the queue gets for a field it leaves out (taken at submit: a job
    # keeps what it was made with).
    default_timeout_ms: int | None = None
    default_retries: int | None = None
    default_backoff: Backoff | None = None

    @property
    def limited(self) -> bool:
        """A claim must count against this queue's limits."""
        return self.max_leased is not None or self.rate is not None

    @property
    def submit_defaults(self) -> SubmitDefaults | None:
        """What a submit to this queue gets for the fields it leaves out (``with_defaults``),
        or None if the queue has no default."""
        retries = self.default_retries
        defaults = (
            None if retries is None else retries + 1,
            self.default_backoff,
            self.default_timeout_ms,
        )
        return None if defaults == (None, None, None) else defaults

    @property
    def is_default(self) -> bool:
        """Nothing set: the queue's row says nothing (it is deleted)."""
        return self == QueueSettings(self.queue)

    def to_row(self) -> tuple:
        """As the columns SETTINGS_COLUMNS name (the rate window is the store's own)."""
        backoff = self.default_backoff
        return (
            self.queue,
            self.paused,
            self.max_leased,
            None if self.rate is None else self.rate.limit,
            None if self.rate is None else self.rate.period_ms,
            self.default_timeout_ms,
            self.default_retries,
            None if backoff is None else json.dumps(attrs.astuple(backoff)),
        )

    @classmethod
    def from_row(cls, row: Sequence) -> QueueSettings:
        queue, paused, max_leased, rate_limit, rate_period, timeout, retries, backoff = row
        return cls(
            queue,
            bool(paused),
            max_leased,
            None if rate_limit is None else Rate(rate_limit, rate_period),
            timeout,
            retries,
            None if backoff is None else Backoff(*json.loads(backoff)),
        )

    def loosens(self, old: QueueSettings) -> bool:
        """Whether a claim may take from the queue what it could not with ``old``: resumed,
        or a limit changed (raised, removed, or a new window: a change wakes to look)."""
        return (old.paused and not self.paused) or (
            old.limited and (old.max_leased, old.rate) != (self.max_leased, self.rate)
        )

    def changed(self, changes: Mapping[str, Any]) -> QueueSettings:
        """These settings with ``changes`` (field -> value; None clears) applied."""
        return attrs.evolve(self, **changes)


# What a submit to a queue gets for the fields it leaves out: (max_attempts, backoff,
# timeout_ms), each None where the queue has no default (``QueueSettings.submit_defaults``).
SubmitDefaults = tuple[int | None, Backoff | None, int | None]


def with_defaults(spec: SubmitSpec, defaults: SubmitDefaults) -> SubmitSpec:
    """``spec`` with each field it left out (None) that its queue has a default for set to
    that default. What stays None is the protocol's default (DEFAULT_MAX_ATTEMPTS,
    DEFAULT_BACKOFF, no timeout), which the stores write as they write a plain job.
    (By position, as the fast parse makes a spec: this runs per job.)"""
    s, (attempts, backoff, timeout) = spec, defaults
    return _new_spec(
        SubmitSpec, (s[0], s[1], s[2], s[3], s[4], attempts if s[5] is None else s[5],
                     backoff if s[6] is None else s[6], s[7], s[8], s[9],
                     timeout if s[10] is None else s[10])
    )  # fmt: skip


# A named tuple made from a tuple at once, every field given (relay/protocol/wire.py).
_new_spec = tuple.__new__


# The settings' columns of queue_settings, in ``QueueSettings.to_row``'s order.
SETTINGS_COLUMNS = (
    "queue, paused, max_leased, rate_limit, rate_period_ms, default_timeout_ms, "
    "default_retries, default_backoff"
)
# What ``queue_config`` may change: QueueSettings' fields but the queue.
SETTING_FIELDS = tuple(f.name for f in attrs.fields(QueueSettings))[1:]


# Schedules a store holds at most by default (``StoreConfig.max_schedules``,
# --max-schedules): each is a row and, when due, a few milliseconds of the writer's time.
DEFAULT_MAX_SCHEDULES = 1000
# A page of schedules at most (``schedule_list`` reads one more: whether more follow).
SCHEDULES_PAGE = 1000
# What a schedule does with the slots that passed while no server ran it (or while the
# queue refused): run the latest once (the default), none, or all of them, the latest
# ``catch_up_max`` at most.
CATCH_UP = ("latest", "none", "all")
CATCH_UP_MAX = 1000


@attrs.frozen
class ScheduleSpec:
    """A schedule as ``schedule_put`` takes it: its name, a normalized cron expression
    (relay/protocol/cron.py), an IANA zone, the job each slot submits, the catch-up policy."""

    name: str
    cron: str
    timezone: str
    queue: str
    payload: str  # JSON text, checked and size-bounded as a submit's
    priority: int = 1
    # None: left out by ``schedule_put``, so each slot's job gets its queue's default at
    # submit (``with_defaults``), else the protocol's, as a submit that leaves them out.
    max_attempts: int | None = None
    backoff: Backoff | None = None
    timeout_ms: int | None = None
    catch_up: str = "latest"
    catch_up_max: int = 100

    def job(self) -> SubmitSpec:
        """The job one slot submits: ready at once."""
        return SubmitSpec(
            self.queue, self.payload, self.priority, max_attempts=self.max_attempts,
            backoff=self.backoff, timeout_ms=self.timeout_ms,
        )  # fmt: skip


@attrs.frozen
class ScheduleInfo:
    """A schedule and where it stands: its next slot (None: none ever again), the last slot
    it submitted, that slot's job and the job's state now (None once the job is pruned)."""

    spec: ScheduleSpec
    paused: bool
    next_at: int | None
    last_slot: int | None
    last_job_id: str | None
    last_job_state: str | None
    created_at: int
    updated_at: int
    last_job_slot: int | None = None  # the slot of last_job_id
    last_refusal: str | None = None  # why the last slot passed made no job; None: it made one


@attrs.frozen
class ScheduleRun:
    """One slot a schedule submitted (``schedules_run_due``): its job, or the refusal that
    kept it from being created (``error``: a full queue; the slot is passed all the same)."""

    name: str
    queue: str
    slot: int
    job_id: str | None
    error: str | None = None


def too_many_schedules(held: int, most: int) -> TooManySchedules:
    return TooManySchedules(
        f"{held} schedules exist (max {most}, --max-schedules); delete schedules that are "
        "no longer needed"
    )


# The arguments of one claim: queues, worker id, count, lease ms, reply budget in bytes.
ClaimArgs = tuple[Sequence[str], str, int, int, int | None]


@attrs.frozen
class StoreConfig:
    """Policies of the store. Durations in milliseconds."""

    idempotency_window_ms: int = 24 * 3600 * 1000
    retention_ms: int = 7 * 24 * 3600 * 1000
    max_error_bytes: int = 8 * 1024
    # A failed attempt's traceback keeps its last this many bytes (its failing frame).
    max_traceback_bytes: int = 8 * 1024
    # Unfinished jobs a queue may hold (pending + ready + leased + retrying) before a
    # submit is refused with QueueFull: per queue, else ``max_depth`` (None: unbounded).
    max_depth: int | None = None
    queue_depths: dict[str, int] = attrs.Factory(dict)
    # Queues that may hold jobs (a job in any state, retained succeeded and dead ones
    # included) before a submit that would create one more is refused with TooManyQueues
    # (None: unbounded). Checked in memory (relay/store/counts.py).
    max_queues: int | None = None
    # Schedules that may exist at once: a schedule_put of a new one past it is refused
    # with TooManySchedules.
    max_schedules: int = DEFAULT_MAX_SCHEDULES
    # Queues with history rows of their own (the first seen since the store opened); the others'
    # counts are summed as queue "_other" (relay/store/history.py). The server passes its
    # --metrics-max-queues.
    history_max_queues: int = 1_000

    def depth_limit(self, queue: str) -> int | None:
        return self.queue_depths.get(queue, self.max_depth)


@attrs.frozen
class Reaped:
    """One expired lease the reaper ended: the job is now ``state`` (ready or dead)."""

    job_id: str
    queue: str
    state: JobState
    attempt: int


# One state change of a job, recorded while ``Store.recording``: (job id, queue, state it
# entered, its attempt after the change, the ``now`` of the call that made it, the state
# it left: None for a job just made).
JobEvent = tuple[str, str, str, int, int, str | None]


@attrs.define
class Changes:
    """What committed changes mean for the trio side: whom to wake, and when.

    Collected while a transaction runs and taken by the writer after its commit. A command
    that is rolled back may leave a spurious entry in ``ready_queues`` and the times; a
    spurious wake-up is harmless. ``events`` is exact: a rolled-back command's are removed
    (``Store.command``), a rolled-back transaction's dropped with it.
    """

    ready_queues: set[str] = attrs.Factory(set)
    # How many jobs were made ready per queue (``made_ready``): how many parked long-polls
    # a commit wakes (relay/server/requests/longpoll.py). A queue in ``ready_queues`` without a
    # count here (another server's notification of an older version) counts as one.
    ready_counts: dict[str, int] = attrs.Factory(dict)
    # The earliest due time of a job that became pending or retrying, and the earliest new
    # lease expiry: the promoter and the reaper sleep until these if they are sooner.
    next_due_at: int | None = None
    next_expiry_at: int | None = None
    # The earliest next slot of a schedule put or resumed: the scheduler sleeps until it.
    next_schedule_at: int | None = None
    # Every state change of a job, in the order made, while the store is ``recording``
    # (for ``watch``); else empty.
    events: list[JobEvent] = attrs.Factory(list)

    def made_ready(self, queue: str, n: int = 1) -> None:
        self.ready_queues.add(queue)
        self.ready_counts[queue] = self.ready_counts.get(queue, 0) + n

    def due(self, at: int) -> None:
        if self.next_due_at is None or at < self.next_due_at:
            self.next_due_at = at

    def expiry(self, at: int) -> None:
        if self.next_expiry_at is None or at < self.next_expiry_at:
            self.next_expiry_at = at

    def schedule(self, at: int | None) -> None:
        if at is not None and (self.next_schedule_at is None or at < self.next_schedule_at):
            self.next_schedule_at = at


class Later:
    """The answers of a call that a store knows only once its transaction has sent its
    writes: ``results``, None until then. The PostgreSQL store's new jobs draw their ids
    in the insert, which goes with the commit's round trip (``jobs_submit_later``); the
    writer reads the answers after the commit, when it makes the replies."""

    __slots__ = ("results",)

    def __init__(self, results: list[SubmitResult] | None = None) -> None:
        self.results = results


def check_cancel(job_id: str, row: tuple | None, leased_ok: bool) -> tuple[str, str, int]:
    """A job's (queue, state, attempt) as read for a cancel, if it may be cancelled; else
    the refusal, raised, the store having written nothing: ``JobNotFound`` (no row),
    ``InvalidState`` (finished), ``Unauthorized`` (leased, and ``leased_ok`` is False: a
    producer's cancel)."""
    if row is None:
        raise JobNotFound(job_id)
    queue, state, attempt = row
    if state not in CANCELLABLE:
        raise InvalidState(job_id, state, "cancel")
    if state == LEASED and not leased_ok:
        raise Unauthorized(
            f"cannot cancel {job_id}: it is leased (running); only an admin may cancel it"
        )
    return queue, state, attempt


def check_lease(
    row: tuple | None, job_id: str, worker_id: str, token: str, now: int, operation: str
) -> tuple | None:
    """``row`` if the token and worker hold its unexpired lease; None for an ack repeated
    with the completing token; else the refusal, raised (``Cancelled`` for the token of a
    lease its job's cancel voided).

    ``row`` is the job's (id, queue, state, attempt, max_attempts, lease_token,
    lease_worker, lease_expires_at, ...), or None if there is no such job.
    """
    if row is None:
        raise JobNotFound(job_id)
    state, lease_token, lease_worker, expires_at = row[2], row[5], row[6], row[7]
    if lease_token is None or token != lease_token or worker_id != lease_worker:
        raise StaleToken(job_id)
    if state == LEASED:
        if now >= expires_at:
            raise LeaseExpired(job_id, expires_at)
        return row
    if state == SUCCEEDED and operation == "ack":
        return None
    if state == CANCELLED:
        # A leased job cancelled keeps its token and worker on the row (job_cancel), and
        # only then: a job cancelled before it started clears them.
        raise Cancelled(job_id)
    # This token's lease has ended. An expiry leaves lease_expires_at set (reaper,
    # restart recovery): the token held the lease and it expired. The holder's own ack,
    # fail or release clears it: the token no longer holds the current lease.
    if expires_at is not None:
        raise LeaseExpired(job_id, expires_at)
    raise StaleToken(job_id)


def info_size(info: JobInfo) -> int:
    """Roughly the bytes of ``info`` in a reply: payload and result go in as the JSON they
    are, error texts and tracebacks as JSON strings (escaping can make one 6 times its
    UTF-8 length)."""
    size = len(info.payload.encode()) + len((info.result or "").encode())
    texts = [info.last_error or ""]
    for entry in info.errors:
        texts.append(entry.error)
        if entry.traceback is not None:
            texts.append(entry.traceback)
    return size + sum(len(orjson.dumps(text)) for text in texts) + REPLY_OVERHEAD_BYTES


class Store(Protocol):
    """The job store: every state transition and read, synchronous, for one thread.

    Exactly one thread (the writer) calls a store; it is not thread-safe. Every method
    that depends on time takes ``now`` (milliseconds since the epoch) from its caller and
    never reads a clock, so tests drive time with plain integers. Methods do not commit:
    the writer groups many calls into one transaction with ``begin`` and ``commit`` (and
    ``command``, a savepoint, when it must run them carefully). Called outside ``begin``,
    each call commits on its own, which is what the synchronous unit tests do.

    Every method that refuses (a ``RelayError``: ``JobNotFound``, ``StaleToken``,
    ``LeaseExpired``, ``Cancelled``, ``InvalidState``, ``Unauthorized``, ``QueueFull``,
    ``ScheduleNotFound``, ``TooManySchedules``) does so before it writes anything,
    so a refused call never leaves a partial change behind, even without a savepoint; the
    writer checks this with ``write_mark``. Job ids that do not parse are ``JobNotFound``.
    """

    config: StoreConfig
    # What the calls since the last commit mean for the trio side (whom to wake, when).
    changes: Changes
    # Whether transitions append to ``changes.events``; the writer sets it per batch.
    recording: bool
    # Whether ``leases_recover`` at start returns every leased job (one server owns the
    # database), or leaves them to expire (servers sharing it hold live leases).
    recovers_on_start: bool
    # The counts per queue as of the last commit, published by the store after each commit
    # (relay/store/view.py): what ``stats`` and /metrics read, from any thread.
    view: QueueView

    # -- transactions and lifetime (the writer's) --------------------------------------------

    @property
    def broken(self) -> bool:
        """The database connection is lost (PostgreSQL; never for a SQLite file)."""

    def reconnect(self) -> None:
        """Replace a lost connection; raises while the database cannot be reached. What
        the lost connection's open transaction held is gone (rolled back by the database)."""

    def begin(self) -> None:
        """Start the transaction that the calls until ``commit`` or ``rollback`` share."""

    @property
    def in_transaction(self) -> bool:
        """False if the database rolled the transaction back itself (disk full, I/O error)."""

    def write_mark(self) -> tuple[int, int]:
        """Where the writes stand: equal marks before and after a call mean it wrote nothing."""

    def command(self) -> AbstractContextManager[None]:
        """One command inside ``begin``: on any exception, its writes, counts and events are
        undone and the exception propagates; the rest of the transaction stands."""

    def commit(self) -> Changes:
        """Commit (raises if the database cannot); return what changed, and start afresh."""

    def rollback(self) -> None:
        """Undo the transaction, its counts and its changes; raises no database error."""

    def take_changes(self) -> Changes:
        """What changed since the last call or commit, after a call that committed on its
        own (``jobs_submit(alone=True)``); start afresh."""

    def recount(self) -> None:
        """Count the jobs per queue and state again from the database."""

    def close(self) -> None:
        """Make the database's file complete (checkpoint) and close it; ends the store."""

    # -- jobs and leases: the transitions a client makes -------------------------------------

    def jobs_submit(
        self, specs: Sequence[SubmitSpec], now: int, *, alone: bool = False
    ) -> list[SubmitResult] | None:
        """Create jobs, all or none (``QueueFull`` over a depth limit); a (queue, key) seen
        within the idempotency window answers the first job as a duplicate. A field a
        spec leaves out (None) gets its queue's default as this transaction sees the
        queue's settings, else the protocol's (``with_defaults``); the job keeps it.
        ``alone``: one self-committing statement, or None having written nothing."""

    def jobs_submit_later(self, specs: Sequence[SubmitSpec], now: int) -> Later:
        """``jobs_submit`` in the open transaction, its answers (``Later.results``) known
        once the transaction's writes are sent (by its commit at the latest): a store may
        so create the jobs without a round trip of their own."""

    def jobs_claim(
        self,
        queues: Sequence[str],
        worker_id: str,
        count: int,
        lease_ms: int,
        now: int,
        max_bytes: int | None = None,
    ) -> list[Lease]:
        """Lease up to ``count`` ready jobs of the queues not paused, best effective
        priority first, each with a fresh token and its attempt incremented; stops once
        payloads reach ``max_bytes``."""

    def jobs_claim_many(self, claims: Sequence[ClaimArgs], now: int) -> list[list[Lease]]:
        """Many claims, with the outcome of making them one after the other, grouped by
        their set of queues (groups in order of first appearance)."""

    def lease_renew(self, job_id: str, worker_id: str, token: str, lease_ms: int, now: int) -> int:
        """Extend a held lease to ``now + lease_ms`` and return that; raises
        ``JobNotFound``, ``StaleToken`` or ``LeaseExpired`` (see ``check_lease``)."""

    def jobs_ack(
        self, job_id: str, worker_id: str, token: str, result: str | None, now: int
    ) -> None:
        """Complete a held job (succeeded, with ``result``); an ack repeated with the
        completing token is ok; else raises as ``lease_renew`` does."""

    def jobs_ack_many(
        self, acks: Sequence[tuple[str, str, str, str | None]], now: int
    ) -> list[RelayError | None]:
        """Ack ``acks`` (job_id, worker_id, token, result): each one's outcome (None, or
        the ``RelayError`` that refuses it, as ``jobs_ack`` would raise it), as if each had
        been acked on its own in order. Raises ValueError, having changed nothing, if one
        job appears twice."""

    def jobs_fail(
        self,
        job_id: str,
        worker_id: str,
        token: str,
        error: str,
        retryable: bool,
        now: int,
        traceback: str | None = None,
    ) -> FailOutcome:
        """Record a failed attempt (its error, and its ``traceback`` if given and not
        empty, each truncated to its limit): retrying after its backoff, or dead when spent
        or not ``retryable``; raises as ``lease_renew`` does."""

    def jobs_release(self, job_id: str, worker_id: str, token: str, now: int) -> None:
        """Give a held job back: ready at once in its old place, its attempt given back;
        raises as ``lease_renew`` does."""

    # -- maintenance: time-driven transitions ------------------------------------------------

    def jobs_promote_due(self, now: int, limit: int) -> int:
        """Make up to ``limit`` due pending and retrying jobs ready (from their due time);
        return how many."""

    def leases_reap_expired(self, now: int, limit: int) -> list[Reaped]:
        """End up to ``limit`` leases expired at ``now``: ready again, or dead when spent
        (error "lease expired")."""

    def leases_recover(self, now: int) -> int:
        """At start, before serving: every leased job ready again, its attempt given back;
        return how many."""

    def jobs_prune(self, now: int, limit: int) -> int:
        """Delete up to ``limit`` succeeded and cancelled jobs past retention, and up to
        ``limit`` expired idempotency keys; return the jobs deleted."""

    def next_due_at(self) -> int | None:
        """The earliest due time of a pending or retrying job, or None."""

    def next_expiry_at(self) -> int | None:
        """The earliest expiry of a held lease, or None."""

    # -- reads -------------------------------------------------------------------------------

    def job_inspect(self, job_id: str) -> JobInfo:
        """One job with its attempts (the latest ``ATTEMPTS_KEPT`` that ended, then the one
        running or succeeded) and the erring ones among them as its errors; raises
        ``JobNotFound``."""

    def job_inspect_prefix(self, prefix: str) -> JobInfo:
        """As ``job_inspect``, of the one job whose id begins with ``prefix``, an abbreviated
        id ("job_" and 7 to 16 hex digits, ``model.job_id_keys``): one range read of the
        key. Raises ``JobNotFound`` if no id begins so (or ``prefix`` is not one),
        ``BadRequest`` naming job_id if several do."""

    def job_ids_abbreviate(self, job_ids: Sequence[str]) -> list[str]:
        """Each of ``job_ids``, in order, as its shortest start ("job_" and 7 hex digits at
        least) that no other job's id begins with now (``model.job_id_abbreviation``); the
        whole id if it is no job's. Two seeks of the key per id, at any number of jobs:
        the nearest ids below and above it share the most digits with it."""

    def queue_stats(self) -> dict[str, dict[str, int]]:
        """Jobs per queue and state (every state present, zeros included)."""

    def event_totals(self) -> dict[tuple[str, str], int]:
        """(queue, event) -> how many times it happened since this store was opened."""

    def oldest_ready_ms(self, now: int, queues: Sequence[str] | None = None) -> dict[str, int]:
        """Per queue with ready jobs (of ``queues``; None: of every queue): how long its
        oldest ready job has waited (ms). A few index seeks per queue asked."""

    def leases_held(
        self, worker_ids: Sequence[str], now: int, limit: int
    ) -> list[tuple[str, str, str, int, int | None]]:
        """The unexpired leases held by any of ``worker_ids``: (job_id, queue, worker_id,
        lease_expires_at, leased_at) of at most ``limit`` of them, by job id. Reads the leased jobs'
        index (``jobs_leased``): as many rows as jobs are leased, never the table."""

    def dead_list(
        self,
        queue: str | None,
        limit: int,
        cursor: str | None,
        max_bytes: int | None = None,
        newest: bool = False,
    ) -> tuple[list[JobInfo], str | None]:
        """Dead jobs by job id, oldest first (``newest``: newest first), a page of at most
        ``limit`` (and ``max_bytes``, at least one job) after ``cursor``'s job in that
        order, and the cursor of the next page or None."""

    def jobs_list(
        self,
        queue: str | None,
        states: Sequence[str],
        search: str | None,
        cursor: str | None,
        limit: int,
        newest: bool = True,
    ) -> tuple[list[JobInfo], str | None]:
        """The job browser: jobs in ``states`` (of ``queue``, or of every queue) by job id,
        newest first (or oldest), at most ``limit`` after ``cursor``'s job in that order,
        each without payload, result or errors (``rows.summaries``), and the next cursor.
        One seek of ``jobs_queue_state`` per (queue, state) holding jobs, each read only
        for what the page takes. ``search``: ids that begin with it ("job_" and 7 to 16
        hex digits: one range of the key), or, with ``queue``, jobs whose idempotency or
        unique key begins with it (at most KEY_SEARCH_MAX of each; more is
        ``BadRequest`` naming search, as is a search that is no id without ``queue``)."""

    # -- queue settings ----------------------------------------------------------------------

    def queue_pause(self, queue: str, paused: bool, now: int) -> bool:
        """Pause (no claim leases from it) or resume ``queue``, idempotent, whether or not
        it holds jobs; return ``paused``. Resuming a paused queue reports its ready jobs as
        made ready (parked leases wake). Raises ``TooManyQueues`` past MAX_QUEUE_SETTINGS."""

    def queue_config(self, queue: str, changes: Mapping[str, Any], now: int) -> QueueSettings:
        """Change ``queue``'s settings (``changes``: SETTING_FIELDS -> value, None clears
        one) and return them all; no changes reads them. Whatever loosens what a claim
        may take (a resume, a limit raised or removed) reports the queue's ready jobs as
        made ready (parked leases wake). Raises ``TooManyQueues`` past MAX_QUEUE_SETTINGS."""

    def queue_settings_of(self, queues: Sequence[str]) -> list[QueueSettings]:
        """The settings of those of ``queues`` that have any: one statement."""

    def queue_settings(self, after: str | None, limit: int) -> list[QueueSettings]:
        """The settings of up to ``limit`` (at most SETTINGS_PAGE + 1, so that a page of
        SETTINGS_PAGE can tell whether another follows) queues that have any,
        named after ``after`` (None: from the first), in name order: one range read."""

    # -- dead letters ------------------------------------------------------------------------

    def dead_retry(self, job_id: str, now: int, states: Sequence[str] = (DEAD,)) -> int:
        """Make one job in ``states`` (of RETRYABLE) ready with fresh attempts, keeping
        its errors; return 1; raises ``JobNotFound``, or ``InvalidState`` (with
        ``refusal_hint``) if it is in another state."""

    def dead_retry_queue(
        self, queue: str, now: int, limit: int, states: Sequence[str] = (DEAD,)
    ) -> int:
        """Make up to ``limit`` jobs of ``queue`` in ``states`` (of RETRYABLE) ready with
        fresh attempts; return how many."""

    def dead_purge(self, job_id: str, states: Sequence[str] = (DEAD,)) -> int:
        """Delete one job in ``states`` (of PURGEABLE) and its history (its idempotency
        key stays until it expires); return 1; raises as ``dead_retry`` does."""

    def dead_purge_queue(self, queue: str, limit: int, states: Sequence[str] = (DEAD,)) -> int:
        """Delete up to ``limit`` jobs of ``queue`` in ``states`` (of PURGEABLE); return
        how many."""

    def job_promote(self, job_id: str, now: int) -> JobState:
        """Make a pending or retrying job ready now (its wait ends early) and return the
        state it was in. Raises ``JobNotFound``, or ``InvalidState`` in any other state."""

    # -- cancel ------------------------------------------------------------------------------

    def job_cancel(self, job_id: str, now: int, leased_ok: bool = True) -> JobState:
        """Cancel one unfinished job (finished_at ``now``) and return the state it was in;
        a leased one's lease is void, its token then answered ``Cancelled``. Raises
        ``JobNotFound``, ``InvalidState`` if it is finished, ``Unauthorized`` if it is
        leased and not ``leased_ok`` (a producer's cancel)."""

    def job_cancel_queue(self, queue: str, states: Sequence[str], now: int, limit: int) -> int:
        """Cancel up to ``limit`` jobs of ``queue`` in ``states`` (of ``CANCELLABLE``);
        return how many (call again while it returns ``limit``)."""

    # -- schedules ---------------------------------------------------------------------------

    def schedule_put(self, spec: ScheduleSpec, now: int) -> ScheduleInfo:
        """Create the schedule ``spec.name``, or replace its definition (keeping its last
        slot and job, its pause and its creation time); its next slot is the first after
        ``now`` (and after its last slot). Raises ``TooManySchedules`` for a new one past
        ``config.max_schedules``."""

    def schedule_delete(self, name: str) -> None:
        """Delete a schedule (its jobs stay); raises ``ScheduleNotFound``."""

    def schedule_pause(self, name: str, paused: bool, now: int) -> ScheduleInfo:
        """Pause a schedule (no slot runs), or resume it from its first slot after ``now``
        (the slots it missed while paused are not caught up); idempotent. Raises
        ``ScheduleNotFound``."""

    def schedule_list(self, after: str | None, limit: int) -> list[ScheduleInfo]:
        """Up to ``limit`` (at most SCHEDULES_PAGE + 1) schedules named after ``after``, by
        name, each with its last job's state: one range read and a seek per job."""

    def schedules_run_due(self, now: int, limit: int) -> list[ScheduleRun]:
        """For up to ``limit`` schedules whose next slot is at or before ``now`` (not
        paused; none more once RUN_JOBS jobs are made): create the job of each slot its
        catch-up policy runs, and move its next slot past ``now``, in this transaction: a
        slot is submitted once or not at all.
        On PostgreSQL a schedule another server is running is skipped (``SKIP LOCKED``)."""

    def next_schedule_at(self) -> int | None:
        """The earliest next slot of a schedule not paused, or None."""

    # -- history (relay/store/history.py) ---------------------------------------------------

    def history_flush(self, now: int) -> HistoryFlushed:
        """Add what was counted since the last flush to the table ``history`` (one upsert
        per flush) and return the histograms' deltas; a rollback counts it again."""

    def history_read(
        self, queue: str | None, start: int, end: int, step: int
    ) -> list[HistoryPoint]:
        """The totals of ``queue`` (None: every queue) per ``step`` ms from ``start`` to
        ``end`` (minutes), every step given (zeros where nothing was counted): one range
        read of an index."""

    def history_prune(self, now: int, limit: int) -> int:
        """Delete up to ``limit`` history rows older than HISTORY_KEEP_MS; return how many."""

    def schedule_last_slots(self, limit: int) -> list[tuple[str, int | None]]:
        """(name, the last slot that made a job, or None) of the first ``limit`` schedules
        by name (for /metrics: no payloads read)."""
