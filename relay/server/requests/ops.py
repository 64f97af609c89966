"""The request ops: how the writer runs each kind of request and makes its reply.

One constant per op (``SUBMIT``, ``ACK``, ``CLAIM``, ...). The dispatcher puts items
``(op, connection, request_id, started, args)`` into the writer (relay/store/writer.py);
in the writer thread ``op.run`` (or ``op.run_many``, for all the batch's items of the op
at once) changes the store, and after the commit ``op.reply`` encodes the reply line, so
the trio thread only writes bytes. A reply that needs the trio thread's say is left as
the outcome itself: a long-poll lease that found nothing (park it, or answer no jobs).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import attrs
import orjson

from relay.protocol import requests, wire
from relay.protocol.errors import RelayError
from relay.protocol.model import FailOutcome, JobInfo, JobState, Lease, SubmitSpec
from relay.server.requests.auth import Role
from relay.store import commands as cmd
from relay.store.base import (
    READY,
    REPLY_OVERHEAD_BYTES,
    Later,
    QueueSettings,
    ScheduleInfo,
    ScheduleSpec,
    Store,
)
from relay.store.items import Item, whole_share
from relay.store.view import STATES
from relay.util.log import event

log = logging.getLogger("relay.dispatch")

_NL = orjson.OPT_APPEND_NEWLINE


@attrs.define(slots=True, eq=False)
class Reserving:
    """The args of a request whose reply may be large, with the reply bytes its connection
    set aside for it until it is answered (see ``Dispatcher.answered``)."""

    args: Any
    reserved: int = 0


@attrs.define(slots=True, eq=False)
class PendingLease:
    """A lease request in flight: its claim, and what a parked long-poll needs."""

    connection: Any  # asked still_wanted() before a woken long-poll's claim (writer thread)
    queues: tuple[str, ...]
    worker_id: str
    count: int
    lease_ms: int
    deadline: float  # trio time; 0: no long-poll
    max_bytes: int | None  # the claim's budget of job texts
    reply_bytes: int = 0  # the most its reply may take: what it reserves while claimed
    job_bytes: int = 0  # the most one job takes in its reply
    reserved: int = 0
    woken: bool = False  # claimed again after it parked (LongPolls.run)
    place: int = -1  # its place among parked leases, from its first park (LongPolls)
    sent: float = 0.0  # trio time its claim was last handed to the writer

    def claim_args(self) -> cmd.ClaimArgs:
        return self.queues, self.worker_id, self.count, self.lease_ms, self.max_bytes


class RequestOp:
    """An op whose reply is ``{"id", "ok": true, **fields(outcome)}``, or the error."""

    phase = 1
    run_many: Any = None
    run_alone: Any = None
    weigh: Any = None  # one job (relay/store/items.py, Op.weigh)
    reserves = False  # its args are a Reserving (or a PendingLease)

    def __init__(self, name: str) -> None:
        self.name = name

    def run(self, store: Store, now: int, args: Any) -> Any:
        raise NotImplementedError

    def fields(self, outcome: Any, args: Any) -> dict[str, Any]:
        return {}

    def reply(self, item: Item, outcome: Any) -> Any:
        if isinstance(outcome, RelayError):
            return wire.encode_error(item[2], outcome)
        return wire.encode_ok(item[2], self.fields(outcome, item[4]))


def _wanted(lease: PendingLease) -> bool:
    """No lease claims for a connection that has closed (a fault, or its client went), or
    whose role a later hello lowered below worker: its jobs would be held for nobody (or
    for a client that may not ack them) until their leases expire. A woken long-poll is
    claimed only while its client may still take the jobs (its connection was asked just
    before it was queued again, and is asked once more here)."""
    connection = lease.connection
    if connection.closed or connection.role < Role.WORKER:
        return False
    return not lease.woken or connection.still_wanted()


def _pass_on(store: Store, lease: PendingLease, jobs: list[Lease], ran: bool) -> None:
    """A parked long-poll was woken for up to ``count`` of the jobs some commit made ready
    (relay/server/requests/longpoll.py): if its claim did not take them all, and did not show that
    none is left (it was not run, or its byte budget stopped it first), the jobs it leaves
    wake other parked leases at this commit, as if made ready by it: none is left ready
    while leases wait for it."""
    left = lease.count - len(jobs)
    if not left or (ran and not jobs):
        return  # it took its share, or found none: its queues have no ready job left
    if ran:
        if lease.max_bytes is None:
            return
        # Its budget, measured as the store does (characters or bytes: never more than
        # the bytes measured here).
        size = sum([len(job.payload.encode()) + REPLY_OVERHEAD_BYTES for job in jobs])
        if size < lease.max_bytes:
            return  # it took every job there was in its queues
    for queue in lease.queues:
        store.changes.made_ready(queue, left)


class _Share:
    """An item's part of a merged submit's answers (``Later``), known after the commit,
    when the replies are made: the answer at ``at``, or the list of those in ``at``."""

    __slots__ = ("at", "later")

    def __init__(self, later: Later, at: int | slice) -> None:
        self.later = later
        self.at = at

    def get(self) -> Any:
        assert self.later.results is not None, "read before its transaction was sent"
        return self.later.results[self.at]


def _share(later: Later, at: int | slice) -> Any:
    """The answer (or answers) of ``later`` at ``at``: as they are if already known (as
    SQLite's always are), else a ``_Share`` of them."""
    if later.results is not None:
        return later.results[at]
    return _Share(later, at)


class _Submit(RequestOp):
    """``submit``: args is one ``SubmitSpec``; a batch's submits are one insert."""

    phase = 1  # after the leases (see _Claim)

    @staticmethod
    def run_many(store: Store, now: int, specs: list[SubmitSpec]) -> list[Any]:
        later = store.jobs_submit_later(specs, now)
        if later.results is not None:  # (known at once: SQLite's, or ids read first)
            return later.results
        return [_Share(later, i) for i in range(len(specs))]

    @staticmethod
    def run_alone(store: Store, now: int, specs: list[SubmitSpec]) -> list[Any] | None:
        return store.jobs_submit(specs, now, alone=True)

    def run(self, store: Store, now: int, spec: SubmitSpec) -> Any:
        return _share(store.jobs_submit_later([spec], now), 0)

    def reply(self, item: Item, outcome: Any) -> Any:
        if isinstance(outcome, RelayError):
            return wire.encode_error(item[2], outcome)
        if type(outcome) is _Share:
            outcome = outcome.get()
        # Written out, as the batch's common reply is (job ids and states need no escaping).
        return _SUBMITTED % (
            orjson.dumps(item[2]),
            outcome[0].encode(),
            outcome[1].encode(),
            b"true" if outcome[2] else b"false",
        )


_SUBMITTED = b'{"id":%s,"ok":true,"job_id":"%s","state":"%s","duplicate":%s}\n'


class _SubmitBatch(RequestOp):
    """``submit_batch``: args is a tuple of ``SubmitSpec``; the batch's are one insert."""

    phase = 1
    weigh = len

    @staticmethod
    def run_many(store: Store, now: int, batches: list[tuple[SubmitSpec, ...]]) -> list:
        later = store.jobs_submit_later([spec for specs in batches for spec in specs], now)
        return [_share(later, part) for part in cmd.parts(batches)]

    @staticmethod
    def run_alone(store: Store, now: int, batches: list[tuple[SubmitSpec, ...]]) -> Any:
        results = store.jobs_submit([spec for specs in batches for spec in specs], now, alone=True)
        return None if results is None else cmd.split_results(results, batches)

    def run(self, store: Store, now: int, specs: tuple[SubmitSpec, ...]) -> Any:
        return _share(store.jobs_submit_later(specs, now), slice(None))

    def reply(self, item: Item, outcome: Any) -> Any:
        if isinstance(outcome, RelayError):
            return wire.encode_error(item[2], outcome)
        if type(outcome) is _Share:
            outcome = outcome.get()
        if outcome and all([state is READY and not dup for _id, state, dup in outcome]):
            # The common batch, every job new and ready: the ids joined into the one text
            # (job ids need no JSON escaping), several times cheaper than a dict per job.
            return _READY_RESULTS % (
                orjson.dumps(item[2]),
                _READY_JOINER.join([r[0] for r in outcome]).encode(),
            )
        results = [
            {"job_id": job_id, "state": state.value, "duplicate": duplicate}
            for job_id, state, duplicate in outcome
        ]
        return orjson.dumps({"id": item[2], "ok": True, "results": results}, option=_NL)


_READY_RESULTS = (
    b'{"id":%s,"ok":true,"results":[{"job_id":"%s","state":"ready","duplicate":false}]}\n'
)
_READY_JOINER = '","state":"ready","duplicate":false},{"job_id":"'


class _Ack(RequestOp):
    """``ack``: args is (job_id, worker_id, token, result); a batch's acks are one
    statement (Store.jobs_ack_many), each answered on its own."""

    phase = 2

    @staticmethod
    def run_many(store: Store, now: int, acks: list[cmd.AckArgs]) -> list[Any]:
        return store.jobs_ack_many(acks, now)

    def run(self, store: Store, now: int, args: cmd.AckArgs) -> Any:
        return store.jobs_ack(*args, now)

    def reply(self, item: Item, outcome: Any) -> Any:
        if outcome is None:
            return b'{"id":%s,"ok":true,"state":"succeeded"}\n' % orjson.dumps(item[2])
        return wire.encode_error(item[2], outcome)


class _AckBatch(RequestOp):
    """``ack_batch``: args is a tuple of acks, each answered on its own."""

    phase = 2
    weigh = len

    def run(self, store: Store, now: int, acks: tuple[Any, ...]) -> Any:
        if all([type(ack) is tuple for ack in acks]):
            return cmd.ack_each(store, now, acks)
        # Repeats of a job acked earlier in the batch were answered when parsed (each
        # job once in the store's one statement).
        outcomes = iter(cmd.ack_each(store, now, [a for a in acks if type(a) is tuple]))
        return [next(outcomes) if type(ack) is tuple else ack for ack in acks]

    def fields(self, outcome: list[RelayError | None], args: Any) -> dict[str, Any]:
        return {
            "results": [
                {"ok": True, "state": "succeeded"}
                if each is None
                else {"ok": False, "error": {"code": each.code, "message": each.message}}
                for each in outcome
            ]
        }


class _Claim(RequestOp):
    """``lease``: args is a ``PendingLease``; a batch's leases are two or three
    statements (Store.jobs_claim_many)."""

    # First: a lease claims what was ready before its batch, as it would have had it been
    # answered before the batch's submits and releases (a long-poll that finds nothing
    # parks, and that batch's commit wakes it). So a lease queued just before its client
    # went takes no job that its batch makes ready.
    phase = 0
    reserves = True
    weigh = operator.attrgetter("count")

    @staticmethod
    def run_many(store: Store, now: int, leases: list[PendingLease]) -> list[Any]:
        outcomes: list[Any] = [[] for _ in leases]
        wanted = [i for i, lease in enumerate(leases) if _wanted(lease)]
        claims = [leases[i].claim_args() for i in wanted]
        for i, jobs in zip(wanted, cmd.claim_in_pieces(store, now, claims), strict=True):
            outcomes[i] = jobs
        ran = set(wanted)
        for i, lease in enumerate(leases):
            if lease.woken:
                _pass_on(store, lease, outcomes[i], i in ran)
        return outcomes

    def run(self, store: Store, now: int, lease: PendingLease) -> Any:
        return self.run_many(store, now, [lease])[0]

    def reply(self, item: Item, outcome: Any) -> Any:
        if not outcome and item[4].deadline and not isinstance(outcome, RelayError):
            return outcome  # a long-poll found nothing: the trio thread decides
        return super().reply(item, outcome)

    def fields(self, outcome: list[Lease], args: Any) -> dict[str, Any]:
        return {"jobs": [wire.lease_fields(lease) for lease in outcome]}


class _Renew(RequestOp):
    def run(self, store: Store, now: int, args: tuple) -> Any:
        return store.lease_renew(*args, now)

    def fields(self, outcome: int, args: Any) -> dict[str, Any]:
        return {"lease_expires_at": outcome}


class _Fail(RequestOp):
    def run(self, store: Store, now: int, args: tuple) -> Any:
        job_id, worker_id, token, error, retryable, traceback = args
        return store.jobs_fail(job_id, worker_id, token, error, retryable, now, traceback)

    def fields(self, outcome: FailOutcome, args: Any) -> dict[str, Any]:
        if outcome.state == JobState.DEAD:
            job_id, _, _, error, retryable, _ = args
            reason = "failed" if retryable else "failed, not retryable"
            first_line = error.split("\n", 1)[0][:200]
            event(
                log, logging.WARNING, "job.dead", job_id=job_id, reason=reason, error=error[:200],
                message=f"job {job_id} dead ({reason}): {first_line}",
            )  # fmt: skip
            return {"state": outcome.state}
        return {"state": outcome.state, "retry_at": outcome.retry_at}


class _Release(RequestOp):
    def run(self, store: Store, now: int, args: tuple) -> Any:
        return store.jobs_release(*args, now)

    def fields(self, outcome: None, args: Any) -> dict[str, Any]:
        return {"state": "ready"}


class _Inspect(RequestOp):
    """``inspect``: args.args is the job id and whether it may be abbreviated (prefix)."""

    reserves = True

    def run(self, store: Store, now: int, args: Reserving) -> Any:
        job_id, prefix = args.args
        return store.job_inspect_prefix(job_id) if prefix else store.job_inspect(job_id)

    def fields(self, outcome: JobInfo, args: Any) -> dict[str, Any]:
        return {"job": wire.job_fields(outcome, attempts=True)}


class _ShortIds(RequestOp):
    """``short_ids``: args is the tuple of whole job ids, checked."""

    weigh = len

    def run(self, store: Store, now: int, job_ids: tuple[str, ...]) -> Any:
        return store.job_ids_abbreviate(job_ids)

    def fields(self, outcome: list[str], args: Any) -> dict[str, Any]:
        return {"short_ids": outcome}


class _DeadList(RequestOp):
    reserves = True
    weigh = staticmethod(whole_share)  # up to 1,000 jobs with their texts

    def run(self, store: Store, now: int, args: Reserving) -> Any:
        return store.dead_list(*args.args)

    def fields(self, outcome: tuple[list[JobInfo], str | None], args: Any) -> dict[str, Any]:
        jobs, next_cursor = outcome
        return {"jobs": [wire.job_fields(job) for job in jobs], "next_cursor": next_cursor}


class _JobsList(RequestOp):
    """``jobs_list``: args is a Reserving of (queue, states, search, cursor, limit,
    newest)."""

    reserves = True
    weigh = staticmethod(whole_share)  # up to 10,000 jobs examined

    def run(self, store: Store, now: int, args: Reserving) -> Any:
        return store.jobs_list(*args.args)

    def fields(self, outcome: tuple[list[JobInfo], str | None], args: Any) -> dict[str, Any]:
        jobs, next_cursor = outcome
        return {"jobs": [wire.job_summary_fields(job) for job in jobs], "next_cursor": next_cursor}


class _Promote(RequestOp):
    """``promote``: args is the job's id."""

    def run(self, store: Store, now: int, job_id: str) -> Any:
        return store.job_promote(job_id, now)

    def fields(self, outcome: JobState, args: Any) -> dict[str, Any]:
        return {"job_id": args, "state": "ready", "was": str(outcome)}


class _Stats(RequestOp):
    """``stats``: never run by the writer. Answered from the counts in memory, its ages
    read by oldest.py (dispatch.py); this names its item."""

    def run(self, store: Store, now: int, args: Any) -> Any:
        raise NotImplementedError("stats is answered by the dispatcher")


class _WorkersList(_Stats):
    """``workers_list``: never run by the writer; answered by the dispatcher
    (relay/server/requests/workers.py). Its args are a ``Reserving``."""

    reserves = True


class _DeadOne(RequestOp):
    """``dead_retry`` / ``dead_purge`` of one job: args is (its id, the states allowed)."""

    def run(self, store: Store, now: int, args: tuple[str, tuple[str, ...]]) -> Any:
        job_id, states = args
        if self.name == "dead_retry":
            return store.dead_retry(job_id, now, states)
        return store.dead_purge(job_id, states)

    def fields(self, outcome: int, args: Any) -> dict[str, Any]:
        return {"count": outcome}


class _QueuePause(RequestOp):
    """``queue_pause`` / ``queue_resume``: args is (queue, paused)."""

    def run(self, store: Store, now: int, args: tuple[str, bool]) -> Any:
        return store.queue_pause(args[0], args[1], now)

    def fields(self, outcome: bool, args: tuple[str, bool]) -> dict[str, Any]:
        return {"queue": args[0], "paused": outcome}


def settings_fields(settings: QueueSettings) -> dict[str, Any]:
    """A queue's settings as ``queue_config`` and ``queue_list`` answer them (null: not set)."""
    rate, backoff = settings.rate, settings.default_backoff
    return {
        "queue": settings.queue,
        "paused": settings.paused,
        "max_leased": settings.max_leased,
        "rate": None if rate is None else {"limit": rate.limit, "period_ms": rate.period_ms},
        "default_timeout_ms": settings.default_timeout_ms,
        "default_retries": settings.default_retries,
        "default_backoff": None if backoff is None else wire.backoff_fields(backoff),
    }


class _QueueConfig(RequestOp):
    """``queue_config``: args is (queue, changes)."""

    def run(self, store: Store, now: int, args: tuple[str, dict[str, Any]]) -> Any:
        return store.queue_config(args[0], args[1], now)

    def fields(self, outcome: QueueSettings, args: Any) -> dict[str, Any]:
        return settings_fields(outcome)


class _QueueList(RequestOp):
    """``queue_list``: args is (cursor, limit, queues). The queues that hold jobs (the
    store's view, as committed) or have settings (read in this transaction), merged by
    name; or the queues named, each with its settings and counts."""

    weigh = staticmethod(whole_share)  # up to 1,000 queues' settings

    def run(self, store: Store, now: int, args: tuple[str | None, int, list[str] | None]) -> Any:
        after, limit, named = args
        if named is not None:
            names = sorted(set(named))
            settings = {s.queue: s for s in store.queue_settings_of(names)}
            entries = {q: store.view.get(q) for q in names}
            more = False
        else:
            settings = {s.queue: s for s in store.queue_settings(after, limit + 1)}
            counted, _ = store.view.page(after, limit + 1)
            entries = {queue: entry for queue, entry in counted if entry is not None}
            names = sorted(settings.keys() | entries.keys())
            more = len(names) > limit
            names = names[:limit]
        queues = []
        for queue in names:
            entry = entries.get(queue) or (0,) * len(STATES)
            fields = settings_fields(settings.get(queue) or QueueSettings(queue))
            fields["counts"] = dict(zip(STATES, entry[: len(STATES)], strict=True))
            queues.append(fields)
        return queues, names[-1] if more else None

    def fields(self, outcome: tuple[list, str | None], args: Any) -> dict[str, Any]:
        return {"queues": outcome[0], "next_cursor": outcome[1]}


class _Cancel(RequestOp):
    """``cancel`` of one job: args is (its id, whether a leased job may be cancelled: the
    connection's role is admin). Its reply is also what a whole queue's is made of."""

    def run(self, store: Store, now: int, args: tuple[str, bool]) -> Any:
        return store.job_cancel(args[0], now, args[1])

    def fields(self, outcome: JobState, args: Any) -> dict[str, Any]:
        return {"job_id": args[0], "state": "cancelled", "was": str(outcome)}


def schedule_fields(info: ScheduleInfo) -> dict[str, Any]:
    """A schedule as ``schedule_put`` and ``schedule_list`` answer it (docs/protocol.md)."""
    spec = info.spec
    fields: dict[str, Any] = {
        "name": spec.name,
        "cron": spec.cron,
        "timezone": spec.timezone,
        "queue": spec.queue,
        "payload": orjson.Fragment(spec.payload),
        "priority": wire.WIRE_PRIORITIES[spec.priority],
        "retries": None if spec.max_attempts is None else spec.max_attempts - 1,
        "backoff": None if spec.backoff is None else wire.backoff_fields(spec.backoff),
        "catch_up": spec.catch_up,
        "catch_up_max": spec.catch_up_max,
        "paused": info.paused,
        "next_at": info.next_at,
        "last_slot": info.last_slot,
        "last_job_id": info.last_job_id,
        "last_job_state": info.last_job_state,
        "last_job_slot": info.last_job_slot,
        "last_refusal": info.last_refusal,
        "created_at": info.created_at,
        "updated_at": info.updated_at,
    }
    if spec.timeout_ms is not None:
        fields["timeout_ms"] = spec.timeout_ms
    return fields


class _SchedulePut(RequestOp):
    """``schedule_put``: args is the ``ScheduleSpec``."""

    def run(self, store: Store, now: int, args: ScheduleSpec) -> Any:
        return store.schedule_put(args, now)

    def fields(self, outcome: ScheduleInfo, args: Any) -> dict[str, Any]:
        return {"schedule": schedule_fields(outcome)}


class _ScheduleDelete(RequestOp):
    """``schedule_delete``: args is the name."""

    def run(self, store: Store, now: int, args: str) -> Any:
        return store.schedule_delete(args)

    def fields(self, outcome: None, args: str) -> dict[str, Any]:
        return {"name": args, "deleted": True}


class _SchedulePause(RequestOp):
    """``schedule_pause`` / ``schedule_resume``: args is (name, paused)."""

    def run(self, store: Store, now: int, args: tuple[str, bool]) -> Any:
        return store.schedule_pause(args[0], args[1], now)

    def fields(self, outcome: ScheduleInfo, args: Any) -> dict[str, Any]:
        return {"schedule": schedule_fields(outcome)}


class _ScheduleList(RequestOp):
    """``schedule_list``: args is a Reserving of (cursor, limit, max_bytes): a page stops
    once its payloads reach max_bytes (at least one schedule is given)."""

    reserves = True

    def run(self, store: Store, now: int, args: Reserving) -> Any:
        after, limit, max_bytes = args.args
        page = store.schedule_list(after, limit + 1)
        more = len(page) > limit
        page, size = page[:limit], 0
        for n, info in enumerate(page):
            size += len(info.spec.payload.encode()) + REPLY_OVERHEAD_BYTES
            if size >= max_bytes and n + 1 < len(page):
                page, more = page[: n + 1], True
                break
        return page, page[-1].spec.name if more else None

    def fields(self, outcome: tuple[list, str | None], args: Any) -> dict[str, Any]:
        return {
            "schedules": [schedule_fields(info) for info in outcome[0]],
            "next_cursor": outcome[1],
        }


# The most a history reply takes: its points (each field a number of up to 16 digits).
HISTORY_REPLY_BYTES = requests.HISTORY_POINTS * 320 + REPLY_OVERHEAD_BYTES


class _History(RequestOp):
    """``history``: args is a Reserving of the typed request; the writer's ``now`` ends a
    range whose ``to`` is left out. A read of one queue's rows (or every queue's summed),
    one range of the key."""

    reserves = True

    def run(self, store: Store, now: int, args: Reserving) -> Any:
        start, end, step = args.args.span(now)
        return start, end, step, store.history_read(args.args.queue, start, end, step)

    def fields(self, outcome: tuple, args: Any) -> dict[str, Any]:
        start, end, step, points = outcome
        return {
            "queue": args.args.queue, "from": start, "to": end, "step": step,
            "points": [point.as_fields() for point in points],
        }  # fmt: skip


class _Watch(RequestOp):
    """``watch``: nothing to run; its reply comes after a commit made while recording
    (relay/server/requests/watch.py)."""

    def run(self, store: Store, now: int, args: Any) -> Any:
        return None


SUBMIT = _Submit("submit")
SUBMIT_BATCH = _SubmitBatch("submit_batch")
ACK = _Ack("ack")
ACK_BATCH = _AckBatch("ack_batch")
CLAIM = _Claim("lease")
RENEW = _Renew("renew")
FAIL = _Fail("fail")
RELEASE = _Release("release")
INSPECT = _Inspect("inspect")
SHORT_IDS = _ShortIds("short_ids")
DEAD_LIST = _DeadList("dead_list")
STATS = _Stats("stats")
JOBS_LIST = _JobsList("jobs_list")
PROMOTE = _Promote("promote")
WORKERS_LIST = _WorkersList("workers_list")
DEAD_RETRY = _DeadOne("dead_retry")
DEAD_PURGE = _DeadOne("dead_purge")
CANCEL = _Cancel("cancel")
WATCH = _Watch("watch")
QUEUE_PAUSE = _QueuePause("queue_pause")
RELOAD = RequestOp("reload")  # (answered by its task: relay/server/requests/admin.py)
QUEUE_RESUME = _QueuePause("queue_resume")
QUEUE_LIST = _QueueList("queue_list")
QUEUE_CONFIG = _QueueConfig("queue_config")
SCHEDULE_PUT = _SchedulePut("schedule_put")
SCHEDULE_DELETE = _ScheduleDelete("schedule_delete")
SCHEDULE_PAUSE = _SchedulePause("schedule_pause")
SCHEDULE_RESUME = _SchedulePause("schedule_resume")
SCHEDULE_LIST = _ScheduleList("schedule_list")
HISTORY = _History("history")
