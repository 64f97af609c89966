"""Typed requests: one attrs class per op, each with the range checks of its fields.

The classes say what each request holds and what its values may be (``check``; a submit's
``to_spec``, a backoff's ``to_model``), naming the field that is wrong. Turning a frame
into one of them (the strict cattrs converter, ``parse_request``) is relay/protocol/parsing.py: the
dispatcher's general path, for anything the fast checks of ``relay.protocol.wire`` do not accept.
"""

from __future__ import annotations

from typing import Any

import attrs

from relay.protocol import cron
from relay.protocol.errors import BadRequest
from relay.protocol.model import (
    DEFAULT_BACKOFF,
    ID_ABBREV_MIN,
    ID_HEX_DIGITS,
    PRIORITY_INT_BY_WIRE,
    QUEUE_NAME_RE,
    UNIQUE_FOR,
    WIRE_PRIORITIES,
    Backoff,
    JobState,
    Rate,
    SubmitSpec,
    job_id_keys,
    parse_job_id,
)
from relay.protocol.wire import (
    DAY_MS,
    DEFAULT_DEAD_LIST,
    DEFAULT_LEASE_MS,
    STATS_PAGE,
    Limits,
    _bad,
    check_queue,
    check_range,
    check_text,
    encode_json_value,
)

# -- requests -------------------------------------------------------------------------------


@attrs.frozen
class Hello:
    client: str | None = None
    token: str | None = None

    def check(self, limits: Limits) -> None:
        if self.client is not None:
            check_text("client", self.client, limits.max_id_bytes, empty_ok=True)
        if self.token is not None:
            check_text("token", self.token, limits.max_id_bytes, empty_ok=True)


@attrs.frozen
class Ping:
    def check(self, limits: Limits) -> None:
        pass


@attrs.frozen
class WireBackoff:
    kind: str
    delay_ms: int | None = None
    base_ms: int | None = None
    max_ms: int | None = None
    jitter: bool = True

    def to_model(self, field: str, limits: Limits) -> Backoff:
        top = limits.max_backoff_ms
        if self.kind == "fixed":
            if self.delay_ms is None:
                raise _bad(f"{field}.delay_ms", "required for a fixed backoff")
            check_range(f"{field}.delay_ms", self.delay_ms, 0, top)
            return Backoff.fixed(self.delay_ms)
        if self.kind == "exponential":
            base = DEFAULT_BACKOFF.base_ms if self.base_ms is None else self.base_ms
            cap = DEFAULT_BACKOFF.max_ms if self.max_ms is None else self.max_ms
            check_range(f"{field}.base_ms", base, 1, top)
            if self.max_ms is None and base > cap:
                raise _bad(f"{field}.max_ms", f"required when base_ms is over its default {cap}")
            check_range(f"{field}.max_ms", cap, base, top)
            return Backoff("exponential", base, cap, self.jitter)
        raise _bad(f"{field}.kind", 'must be "fixed" or "exponential"')


@attrs.frozen
class Submit:
    queue: str
    payload: Any
    priority: str = "normal"
    delay_ms: int | None = None
    run_at: int | None = None
    # Left out (None): the queue's default, else the protocol's (SubmitSpec).
    retries: int | None = None
    backoff: WireBackoff | None = None
    idempotency_key: str | None = None
    unique_key: str | None = None
    unique_for: str | None = None
    timeout_ms: int | None = None

    def to_spec(self, limits: Limits, prefix: str = "") -> SubmitSpec:
        """Check every field and return the store's ``SubmitSpec``."""
        check_queue(prefix + "queue", self.queue)
        payload = encode_json_value(prefix + "payload", self.payload, limits.max_payload_bytes)
        if self.priority not in WIRE_PRIORITIES:
            raise _bad(prefix + "priority", f"must be one of {', '.join(WIRE_PRIORITIES)}")
        if self.delay_ms is not None and self.run_at is not None:
            raise _bad(prefix + "delay_ms", "give delay_ms or run_at, not both")
        if self.delay_ms is not None:
            check_range(prefix + "delay_ms", self.delay_ms, 0, limits.max_delay_ms)
        if self.run_at is not None:
            check_range(prefix + "run_at", self.run_at, 0, 2**53)
        if self.retries is not None:
            check_range(prefix + "retries", self.retries, 0, limits.max_retries)
        if self.idempotency_key is not None:
            check_text(prefix + "idempotency_key", self.idempotency_key, limits.max_id_bytes)
        if self.unique_key is not None:
            check_text(prefix + "unique_key", self.unique_key, limits.max_id_bytes)
        if self.unique_for is not None:
            if self.unique_key is None:
                raise _bad(prefix + "unique_for", "needs a unique_key")
            if self.unique_for not in UNIQUE_FOR:
                raise _bad(prefix + "unique_for", 'must be "unfinished" or "queued"')
        if self.timeout_ms is not None:
            check_range(prefix + "timeout_ms", self.timeout_ms, 1, limits.max_timeout_ms)
        backoff = (
            None if self.backoff is None else self.backoff.to_model(prefix + "backoff", limits)
        )
        return SubmitSpec(
            queue=self.queue,
            payload=payload,
            priority=PRIORITY_INT_BY_WIRE[self.priority],
            delay_ms=self.delay_ms or 0,
            run_at=self.run_at,
            max_attempts=None if self.retries is None else self.retries + 1,
            backoff=backoff,
            idempotency_key=self.idempotency_key,
            unique_key=self.unique_key,
            unique_for=self.unique_for or UNIQUE_FOR[0],
            timeout_ms=self.timeout_ms,
        )


@attrs.frozen
class SubmitBatch:
    jobs: list[dict[str, Any]]


@attrs.frozen
class LeaseRequest:
    queues: list[str]
    worker_id: str
    count: int = 1
    lease_ms: int = DEFAULT_LEASE_MS
    wait_ms: int = 0

    def check(self, limits: Limits) -> None:
        if not self.queues:
            raise _bad("queues", "must name at least one queue")
        if len(self.queues) > limits.max_queues_per_lease:
            raise _bad("queues", f"at most {limits.max_queues_per_lease} queues")
        for i, queue in enumerate(self.queues):
            check_queue(f"queues[{i}]", queue)
        check_text("worker_id", self.worker_id, limits.max_id_bytes)
        check_range("count", self.count, 1, limits.max_batch)
        check_range("lease_ms", self.lease_ms, 1, limits.max_lease_ms)
        check_range("wait_ms", self.wait_ms, 0, limits.max_wait_ms)


@attrs.frozen
class LeaseRef:
    """The fields every lease operation carries."""

    job_id: str
    worker_id: str
    token: str

    def check_ref(self, limits: Limits) -> None:
        check_text("job_id", self.job_id, limits.max_id_bytes)
        check_text("worker_id", self.worker_id, limits.max_id_bytes)
        check_text("token", self.token, limits.max_id_bytes)


@attrs.frozen
class Renew(LeaseRef):
    lease_ms: int = DEFAULT_LEASE_MS

    def check(self, limits: Limits) -> None:
        self.check_ref(limits)
        check_range("lease_ms", self.lease_ms, 1, limits.max_lease_ms)


@attrs.frozen
class Ack(LeaseRef):
    result: Any = None

    def check(self, limits: Limits) -> None:
        self.check_ref(limits)

    def result_text(self, limits: Limits) -> str | None:
        if self.result is None:
            return None
        return encode_json_value("result", self.result, limits.max_result_bytes)


@attrs.frozen
class AckItem:
    """One ack of an ``ack_batch``: the worker is the batch's."""

    job_id: str
    token: str
    result: Any = None


@attrs.frozen
class AckBatch:
    """``ack_batch`` (an extension): many acks of one worker in one request. Parsed into
    ``acks``: (job_id, worker_id, token, result text) per item, each checked like ``ack``."""

    worker_id: str
    acks: list[dict[str, Any]]


@attrs.frozen
class Fail(LeaseRef):
    error: str
    retryable: bool = True
    # The failed attempt's traceback (an extension); null or empty: none.
    traceback: str | None = None

    def check(self, limits: Limits) -> None:
        self.check_ref(limits)
        # Long texts are truncated by the store (max_error_bytes, max_traceback_bytes),
        # not refused; only a frame's own limit bounds what arrives here.


@attrs.frozen
class Release(LeaseRef):
    def check(self, limits: Limits) -> None:
        self.check_ref(limits)


@attrs.frozen
class Inspect:
    job_id: str
    # An extension: job_id may be abbreviated, "job_" and 7 to 16 of its hex digits.
    prefix: bool = False

    def check(self, limits: Limits) -> None:
        check_text("job_id", self.job_id, limits.max_id_bytes)
        if self.prefix and job_id_keys(self.job_id) is None:
            raise _bad(
                "job_id",
                f"with prefix, job_ and {ID_ABBREV_MIN} to {ID_HEX_DIGITS} lowercase hex "
                "digits: the start of a job id",
            )


@attrs.frozen
class ShortIds:
    """``short_ids`` (an extension): whole job ids, 1 to max_batch of them, each to be
    answered as its shortest start that no other job's id has."""

    job_ids: list[str]

    def check(self, limits: Limits) -> None:
        n = len(self.job_ids)
        if not 1 <= n <= limits.max_batch:
            raise _bad("job_ids", f"must hold 1 to {limits.max_batch} job ids, got {n}")
        for i, job_id in enumerate(self.job_ids):
            if type(job_id) is not str or parse_job_id(job_id) is None:
                raise _bad(f"job_ids[{i}]", "not a job id: job_ and 16 lowercase hex digits")


@attrs.frozen
class Stats:
    # Also how long the oldest ready job of each queue has waited (an extension).
    oldest_ready: bool = False
    # Extensions: only these queues; a page of at most ``limit`` queues by name, after
    # the queue named ``cursor`` (the ``next_cursor`` of the page before).
    queues: list[str] | None = None
    limit: int = STATS_PAGE
    cursor: str | None = None

    def check(self, limits: Limits) -> None:
        if self.queues is not None:
            if not 1 <= len(self.queues) <= STATS_PAGE:
                raise _bad("queues", f"must name 1 to {STATS_PAGE} queues (omit it: all)")
            for i, queue in enumerate(self.queues):
                check_queue(f"queues[{i}]", queue)
        check_range("limit", self.limit, 1, STATS_PAGE)
        if self.cursor is not None:
            try:
                check_queue("cursor", self.cursor)
            except BadRequest:
                raise _bad("cursor", "not a cursor returned by stats") from None


# The orders of a dead list (an extension): by job id, so by creation time.
DEAD_ORDERS = ("oldest", "newest")


@attrs.frozen
class DeadList:
    queue: str | None = None
    limit: int = DEFAULT_DEAD_LIST
    cursor: str | None = None
    order: str = "oldest"

    def check(self, limits: Limits) -> None:
        if self.queue is not None:
            check_queue("queue", self.queue)
        check_range("limit", self.limit, 1, limits.max_dead_list)
        if self.cursor is not None and parse_job_id(self.cursor) is None:
            raise _bad("cursor", "not a cursor returned by dead_list")
        if self.order not in DEAD_ORDERS:
            raise _bad("order", 'must be "oldest" or "newest"')


@attrs.frozen
class DeadSelect:
    """``{job_id}`` or ``{queue, all: true}``: one dead job, or every dead job of a queue."""

    job_id: str | None = None
    queue: str | None = None
    all: bool = False

    def check(self, limits: Limits) -> None:
        if self.job_id is not None:
            if self.queue is not None or self.all:
                raise _bad("job_id", "give job_id, or queue with all: true, not both")
            check_text("job_id", self.job_id, limits.max_id_bytes)
            return
        if self.queue is None:
            raise _bad("job_id", "required (or queue with all: true)")
        check_queue("queue", self.queue)
        if not self.all:
            raise _bad("all", "must be true to act on a whole queue")


# Retry and purge of one job or of a whole queue (an extension, ``states``): the states
# each may name, the finished ones (retry: those that did not succeed); omitted, dead only.
RETRY_STATES = ("dead", "cancelled")
PURGE_STATES = ("dead", "succeeded", "cancelled")


def _check_bulk_states(states: list[str] | None, allowed: tuple[str, ...]) -> None:
    if states is None:
        return
    if not 1 <= len(states) <= len(allowed):
        raise _bad("states", f"must name 1 to {len(allowed)} states (omit it: dead)")
    for i, state in enumerate(states):
        if type(state) is not str or state not in allowed:
            raise _bad(f"states[{i}]", f"must be one of {', '.join(allowed)}")


@attrs.frozen
class DeadRetry(DeadSelect):
    """``{job_id, states?}``, or ``{queue, all: true, states?}`` (states: an extension)."""

    states: list[str] | None = None

    def check(self, limits: Limits) -> None:
        super().check(limits)
        _check_bulk_states(self.states, RETRY_STATES)


@attrs.frozen
class DeadPurge(DeadSelect):
    """``{job_id, states?}``, or ``{queue, all: true, states?}`` (states: an extension)."""

    states: list[str] | None = None

    def check(self, limits: Limits) -> None:
        super().check(limits)
        _check_bulk_states(self.states, PURGE_STATES)


# The job browser (an extension): a page of at most this many summaries, 50 by default.
MAX_JOBS_LIST = 100
DEFAULT_JOBS_LIST = 50
_EVERY_STATE = tuple(str(state) for state in JobState)


@attrs.frozen
class JobsList:
    """``jobs_list``: jobs of any states (default: all), of a queue or of all, by job id,
    newest first by default; ``search``: the start of a job id, or (with queue) of an
    idempotency or unique key."""

    queue: str | None = None
    states: list[str] | None = None
    search: str | None = None
    cursor: str | None = None
    limit: int = DEFAULT_JOBS_LIST
    order: str = "newest"

    def check(self, limits: Limits) -> None:
        if self.queue is not None:
            check_queue("queue", self.queue)
        if self.states is not None:
            if not 1 <= len(self.states) <= len(_EVERY_STATE):
                raise _bad("states", f"must name 1 to {len(_EVERY_STATE)} states (omit it: all)")
            for i, state in enumerate(self.states):
                if type(state) is not str or state not in _EVERY_STATE:
                    raise _bad(f"states[{i}]", f"must be one of {', '.join(_EVERY_STATE)}")
        if self.search is not None:
            check_text("search", self.search, limits.max_id_bytes)
        check_range("limit", self.limit, 1, MAX_JOBS_LIST)
        if self.cursor is not None and parse_job_id(self.cursor) is None:
            raise _bad("cursor", "not a cursor returned by jobs_list")
        if self.order not in DEAD_ORDERS:
            raise _bad("order", 'must be "newest" or "oldest"')

    @property
    def chosen_states(self) -> tuple[str, ...]:
        """The states asked, in state order, each once."""
        wanted = _EVERY_STATE if self.states is None else self.states
        return tuple(state for state in _EVERY_STATE if state in wanted)


@attrs.frozen
class Promote:
    """``promote`` (an extension): a pending or retrying job becomes ready now."""

    job_id: str

    def check(self, limits: Limits) -> None:
        check_text("job_id", self.job_id, limits.max_id_bytes)


# The states a cancel of a whole queue may name, and the ones it takes if it names none:
# the jobs that have not started (leased ones only when asked for).
CANCEL_STATES = ("pending", "ready", "retrying", "leased")
CANCEL_DEFAULT_STATES = ("pending", "ready", "retrying")


@attrs.frozen
class Cancel(DeadSelect):
    """``cancel``, an extension: ``{job_id}``, one job; or ``{queue, all: true, states?}``,
    every job of a queue in those states (default: those that have not started). Chosen
    as the dead letters' requests are (``DeadSelect``), with the states beside."""

    states: list[str] | None = None

    def check(self, limits: Limits) -> None:
        if self.job_id is not None and self.states is not None:
            raise _bad("job_id", "give job_id, or queue with all: true, not both")
        super().check(limits)
        if self.states is not None:
            if not 1 <= len(self.states) <= len(CANCEL_STATES):
                raise _bad(
                    "states", f"must name 1 to {len(CANCEL_STATES)} states (omit it: not started)"
                )
            for i, state in enumerate(self.states):
                if type(state) is not str or state not in CANCEL_STATES:
                    raise _bad(f"states[{i}]", f"must be one of {', '.join(CANCEL_STATES)}")

    @property
    def chosen_states(self) -> tuple[str, ...]:
        """The states a whole-queue cancel takes, in CANCEL_STATES order, each once."""
        wanted = CANCEL_DEFAULT_STATES if self.states is None else self.states
        return tuple(state for state in CANCEL_STATES if state in wanted)


# A watch names at most this many queues (it may name none: every queue).
MAX_WATCH_QUEUES = 256
_STATES = frozenset(str(state) for state in JobState)


@attrs.frozen
class Watch:
    """``watch``: job events of these queues and states (omitted: all)."""

    queues: list[str] | None = None
    states: list[str] | None = None

    def check(self, limits: Limits) -> None:
        if self.queues is not None:
            if not 1 <= len(self.queues) <= MAX_WATCH_QUEUES:
                raise _bad("queues", f"must name 1 to {MAX_WATCH_QUEUES} queues (omit it: all)")
            for i, queue in enumerate(self.queues):
                check_queue(f"queues[{i}]", queue)
        if self.states is not None:
            if not 1 <= len(self.states) <= len(_STATES):
                raise _bad("states", f"must name 1 to {len(_STATES)} states (omit it: all)")
            for i, state in enumerate(self.states):
                if type(state) is not str or state not in _STATES:
                    raise _bad(f"states[{i}]", f"must be one of {', '.join(sorted(_STATES))}")


@attrs.frozen
class Unwatch:
    def check(self, limits: Limits) -> None:
        pass


@attrs.frozen
class Reload:
    """``reload`` (an extension): read the token file and the TLS certificate and key
    again. No fields."""

    def check(self, limits: Limits) -> None:
        pass


@attrs.frozen
class QueuePause:
    """``queue_pause`` / ``queue_resume`` (extensions): one queue, which need not exist."""

    queue: str

    def check(self, limits: Limits) -> None:
        check_queue("queue", self.queue)


@attrs.frozen
class QueueResume(QueuePause):
    pass


# The bounds of a queue's settings (``queue_config``): a queue's jobs leased at once; a
# rate's leases per window and the window's length (a day at most).
MAX_LEASED_LIMIT = 1_000_000
MAX_RATE_LIMIT = 1_000_000
MAX_RATE_PERIOD_MS = DAY_MS
# A setting's field, absent (unchanged), as told from null (cleared).
UNSET: Any = attrs.make_class("Unset", [], repr_ns=None)()


@attrs.frozen
class WireRate:
    limit: int
    period_ms: int


@attrs.frozen
class QueueConfig:
    """``queue_config`` (an extension): set some of a queue's settings, clear others (null),
    leave the rest; with none given, read them."""

    queue: str
    paused: bool = UNSET
    max_leased: int | None = UNSET
    rate: WireRate | None = UNSET
    default_timeout_ms: int | None = UNSET
    default_retries: int | None = UNSET
    default_backoff: WireBackoff | None = UNSET

    def check(self, limits: Limits) -> None:
        self.changes(limits)

    def changes(self, limits: Limits) -> dict[str, Any]:
        """Check every field given; return them as the store takes them (SETTING_FIELDS
        of relay/store/base.py: a rate and a backoff as their models)."""
        check_queue("queue", self.queue)
        changes: dict[str, Any] = {}
        for field in attrs.fields(QueueConfig)[1:]:
            value = getattr(self, field.name)
            if value is UNSET:
                continue
            if value is not None:
                value = self._checked(field.name, value, limits)
            elif field.name == "paused":
                raise _bad("paused", "must be true or false")
            changes[field.name] = value
        return changes

    @staticmethod
    def _checked(name: str, value: Any, limits: Limits) -> Any:
        if name == "max_leased":
            check_range(name, value, 1, MAX_LEASED_LIMIT)
        elif name == "rate":
            check_range("rate.limit", value.limit, 1, MAX_RATE_LIMIT)
            check_range("rate.period_ms", value.period_ms, 1, MAX_RATE_PERIOD_MS)
            return Rate(value.limit, value.period_ms)
        elif name == "default_timeout_ms":
            check_range(name, value, 1, limits.max_timeout_ms)
        elif name == "default_retries":
            check_range(name, value, 0, limits.max_retries)
        elif name == "default_backoff":
            return value.to_model(name, limits)
        return value


# Queues per queue_list reply at most, and by default: as a stats page.
QUEUE_LIST_PAGE = STATS_PAGE


@attrs.frozen
class QueueList:
    """``queue_list`` (an extension): a page of at most ``limit`` queues that hold jobs or
    have settings, by name, after the queue named ``cursor``; or the ``queues`` named (each
    listed, with or without jobs or settings)."""

    cursor: str | None = None
    limit: int = QUEUE_LIST_PAGE
    queues: list[str] | None = None

    def check(self, limits: Limits) -> None:
        check_range("limit", self.limit, 1, QUEUE_LIST_PAGE)
        if self.cursor is not None:
            try:
                check_queue("cursor", self.cursor)
            except BadRequest:
                raise _bad("cursor", "not a cursor returned by queue_list") from None
        if self.queues is not None:
            if not 1 <= len(self.queues) <= QUEUE_LIST_PAGE:
                raise _bad("queues", f"1 to {QUEUE_LIST_PAGE} queue names")
            if self.cursor is not None:
                raise _bad("cursor", "not with queues: the queues named are one page")
            for i, queue in enumerate(self.queues):
                check_queue(f"queues[{i}]", queue)


# A schedule's catch-up policies (see relay/store/schedules.py) and their bound.
CATCH_UP = ("latest", "none", "all")
CATCH_UP_MAX = 1000
DEFAULT_CATCH_UP_MAX = 100
# Schedules per schedule_list reply at most, and by default.
SCHEDULE_LIST_PAGE = 1000


def check_schedule_name(field: str, name: str) -> None:
    if not isinstance(name, str) or not QUEUE_NAME_RE.fullmatch(name):
        raise _bad(field, "a schedule name is 1-128 characters of [A-Za-z0-9._:-]")


@attrs.frozen
class SchedulePut:
    """``schedule_put`` (an extension): create or replace the schedule ``name``."""

    name: str
    cron: str
    queue: str
    payload: Any
    priority: str = "normal"
    retries: int | None = None  # None (and backoff, timeout_ms): the queue's default
    backoff: WireBackoff | None = None
    timeout_ms: int | None = None
    timezone: str = "UTC"
    catch_up: str = "latest"
    catch_up_max: int = DEFAULT_CATCH_UP_MAX

    def check(self, limits: Limits) -> None:
        self.to_fields(limits)

    def to_fields(self, limits: Limits) -> dict[str, Any]:
        """Every field checked, as the store's ``ScheduleSpec`` takes them (the cron
        expression normalized: relay/protocol/cron.py)."""
        check_schedule_name("name", self.name)
        expr = cron.normalize_cron(self.cron, allow_seconds=limits.allow_second_schedules)
        cron.zone(self.timezone)
        check_queue("queue", self.queue)
        payload = encode_json_value("payload", self.payload, limits.max_payload_bytes)
        if self.priority not in WIRE_PRIORITIES:
            raise _bad("priority", f"must be one of {', '.join(WIRE_PRIORITIES)}")
        if self.retries is not None:
            check_range("retries", self.retries, 0, limits.max_retries)
        if self.timeout_ms is not None:
            check_range("timeout_ms", self.timeout_ms, 1, limits.max_timeout_ms)
        if self.catch_up not in CATCH_UP:
            raise _bad("catch_up", 'must be "latest", "none" or "all"')
        check_range("catch_up_max", self.catch_up_max, 1, CATCH_UP_MAX)
        backoff = None if self.backoff is None else self.backoff.to_model("backoff", limits)
        return {
            "name": self.name, "cron": expr, "timezone": self.timezone, "queue": self.queue,
            "payload": payload, "priority": PRIORITY_INT_BY_WIRE[self.priority],
            "max_attempts": None if self.retries is None else self.retries + 1,
            "backoff": backoff, "timeout_ms": self.timeout_ms,
            "catch_up": self.catch_up, "catch_up_max": self.catch_up_max,
        }  # fmt: skip


@attrs.frozen
class ScheduleDelete:
    """``schedule_delete``, ``schedule_pause``, ``schedule_resume`` (extensions): one
    schedule, by name."""

    name: str

    def check(self, limits: Limits) -> None:
        check_schedule_name("name", self.name)


@attrs.frozen
class SchedulePause(ScheduleDelete):
    pass


@attrs.frozen
class ScheduleResume(ScheduleDelete):
    pass


@attrs.frozen
class ScheduleList:
    """``schedule_list`` (an extension): a page of at most ``limit`` schedules by name,
    after the schedule named ``cursor``."""

    cursor: str | None = None
    limit: int = SCHEDULE_LIST_PAGE

    def check(self, limits: Limits) -> None:
        check_range("limit", self.limit, 1, SCHEDULE_LIST_PAGE)
        if self.cursor is not None:
            try:
                check_schedule_name("cursor", self.cursor)
            except BadRequest:
                raise _bad("cursor", "not a cursor returned by schedule_list") from None


# Connections per workers_list reply at most, and by default.
WORKERS_PAGE = 100


@attrs.frozen
class WorkersList:
    """``workers_list`` (an extension): a page of at most ``limit`` of this server's
    connections that have leased, in the order they first leased, after the one whose
    ``next_cursor`` is ``cursor``."""

    cursor: str | None = None
    limit: int = WORKERS_PAGE

    def check(self, limits: Limits) -> None:
        check_range("limit", self.limit, 1, WORKERS_PAGE)
        if self.cursor is not None and not (
            self.cursor.isascii() and self.cursor.isdigit() and len(self.cursor) <= 20
        ):
            raise _bad("cursor", "not a cursor returned by workers_list")


# history: steps are whole minutes; a reply holds at most this many points (a day of
# minutes, or 60 days of hours: more than the history keeps).
HISTORY_STEP_MS = 60_000
HISTORY_MAX_STEP_MS = 86_400_000  # a day
HISTORY_POINTS = 1_440


@attrs.frozen
class History:
    """``history`` (an extension): the totals of ``queue`` (None: every queue) per
    ``step`` ms from ``from`` to ``to`` (ms since the epoch; None: ``to`` is now, ``from``
    60 steps before ``to``). On the wire the fields are ``from`` and ``to`` (parsing.py)."""

    queue: str | None = None
    start: int | None = None
    end: int | None = None
    step: int = HISTORY_STEP_MS

    def check(self, limits: Limits) -> None:
        if self.queue is not None:
            check_queue("queue", self.queue)
        check_range("step", self.step, HISTORY_STEP_MS, HISTORY_MAX_STEP_MS)
        if self.step % HISTORY_STEP_MS:
            raise _bad("step", f"must be a multiple of {HISTORY_STEP_MS} (whole minutes)")
        for field, value in (("from", self.start), ("to", self.end)):
            if value is not None:
                check_range(field, value, 0, 2**53)
        if self.start is not None and self.end is not None:
            if self.start >= self.end:
                raise _bad("from", "must be before to")
            self.span(self.end)

    def span(self, now: int) -> tuple[int, int, int]:
        """(start, end, step), whole minutes: ``from`` down to its minute, ``to`` up to its
        (the minute under way is in), each as defaulted; BadRequest naming ``from`` if
        ``from`` is not before ``to`` (``now`` when left out), naming ``step`` if they are
        more than HISTORY_POINTS steps apart."""
        minute = HISTORY_STEP_MS
        end = now if self.end is None else self.end
        if self.start is not None and self.start >= end:
            raise _bad("from", "must be before to")
        end = -(-end // minute) * minute
        start = end - 60 * self.step if self.start is None else self.start
        start = max(0, start - start % minute)
        if -(-(end - start) // self.step) > HISTORY_POINTS:
            raise _bad(
                "step", f"at most {HISTORY_POINTS} points a reply: a longer step, or a "
                "shorter range from..to",
            )  # fmt: skip
        return start, end, self.step


REQUEST_TYPES: dict[str, type] = {
    "hello": Hello,
    "ping": Ping,
    "submit": Submit,
    "submit_batch": SubmitBatch,
    "lease": LeaseRequest,
    "renew": Renew,
    "ack": Ack,
    "ack_batch": AckBatch,
    "fail": Fail,
    "release": Release,
    "inspect": Inspect,
    "short_ids": ShortIds,
    "stats": Stats,
    "dead_list": DeadList,
    "dead_retry": DeadRetry,
    "dead_purge": DeadPurge,
    "cancel": Cancel,
    "jobs_list": JobsList,
    "promote": Promote,
    "watch": Watch,
    "unwatch": Unwatch,
    "queue_pause": QueuePause,
    "queue_resume": QueueResume,
    "queue_list": QueueList,
    "queue_config": QueueConfig,
    "schedule_put": SchedulePut,
    "schedule_delete": ScheduleDelete,
    "schedule_pause": SchedulePause,
    "schedule_resume": ScheduleResume,
    "schedule_list": ScheduleList,
    "reload": Reload,
    "workers_list": WorkersList,
    "history": History,
}
