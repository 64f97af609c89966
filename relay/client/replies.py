"""What the clients' calls return, as typed values, and a reply's fields made into one.

Frozen attrs classes (``LeasedJob``, the job a worker's handler gets; ``JobView``,
``Stats``, ``DeadPage``, ``QueuePage``, ``Hello``...), made from a reply's fields by
``structure_reply`` (which ignores fields it does not know) and ``submit_result``. Used by
the async client (relay/client/client.py) and the blocking one (relay/client/blocking.py);
no I/O.
"""

from __future__ import annotations

from typing import Any

import attrs
import cattrs
from cattrs.preconf.orjson import make_converter

from relay.protocol.errors import RelayError
from relay.protocol.model import AttemptEntry, ErrorEntry, JobState, SubmitResult


@attrs.frozen
class LeasedJob:
    job_id: str
    queue: str
    payload: Any
    priority: str
    attempt: int
    max_attempts: int
    token: str
    lease_expires_at: int
    timeout_ms: int | None = None  # the job's execution timeout: the handler's time
    # The slot (UTC ms) of the schedule that submitted the job; None for any other job.
    scheduled_for: int | None = None


@attrs.frozen
class JobView:
    """A job as ``inspect`` and ``dead_list`` show it."""

    job_id: str
    queue: str
    state: JobState
    priority: str
    payload: Any
    attempt: int
    max_attempts: int
    created_at: int
    errors: list[ErrorEntry] = attrs.Factory(list)
    ready_at: int | None = None
    run_at: int | None = None
    lease_expires_at: int | None = None
    worker_id: str | None = None
    last_error: str | None = None
    result: Any = None
    idempotency_key: str | None = None
    finished_at: int | None = None
    timeout_ms: int | None = None
    scheduled_for: int | None = None  # the slot of the schedule that submitted it
    # ``inspect``'s (empty from ``dead_list``, and from a server without the history):
    # the job's attempts, oldest first, and how many older ended ones it no longer keeps.
    attempts: list[AttemptEntry] = attrs.Factory(list)
    attempts_dropped: int = 0


@attrs.frozen
class ServerInfo:
    version: str
    uptime_ms: int
    connections: int


@attrs.frozen
class Stats:
    queues: dict[str, dict[str, int]]
    server: ServerInfo
    # With ``stats(oldest_ready=True)``: per queue with ready jobs, how long (ms) its
    # oldest ready job has waited.
    oldest_ready_ms: dict[str, int] | None = None
    # The page's end (stats answers at most a page of queues by name): the cursor of the
    # next page, None if this is the last; and how many queues hold jobs in all (None from
    # a server that does not page stats).
    next_cursor: str | None = None
    total_queues: int | None = None
    # The queues of the page that are paused, by name (empty from a server without pauses).
    paused: list[str] = attrs.Factory(list)


@attrs.frozen
class DeadPage:
    jobs: list[JobView]
    next_cursor: str | None


@attrs.frozen
class JobSummary:
    """A job as ``jobs_list`` shows it: as ``inspect`` does without payload, result and
    error history (``inspect`` has them), its last error cut to 200 characters."""

    job_id: str
    queue: str
    state: JobState
    priority: str
    attempt: int
    max_attempts: int
    created_at: int
    ready_at: int | None = None
    run_at: int | None = None
    lease_expires_at: int | None = None
    worker_id: str | None = None
    last_error: str | None = None
    idempotency_key: str | None = None
    finished_at: int | None = None
    timeout_ms: int | None = None
    scheduled_for: int | None = None


@attrs.frozen
class JobsPage:
    jobs: list[JobSummary]
    next_cursor: str | None


@attrs.frozen
class QueueConfig:
    """A queue's settings, as ``queue_config`` answers them (None: not set). ``rate`` is
    ``{"limit": N, "period_ms": M}``, ``default_backoff`` as ``submit`` takes it."""

    queue: str
    paused: bool = False
    max_leased: int | None = None
    rate: dict[str, int] | None = None
    default_timeout_ms: int | None = None
    default_retries: int | None = None
    default_backoff: dict[str, Any] | None = None


# What ``queue_config`` may set (each None to clear it).
QUEUE_SETTINGS = tuple(f.name for f in attrs.fields(QueueConfig))[1:]


def config_fields(queue: str, settings: dict[str, Any]) -> dict[str, Any]:
    """A ``queue_config`` request's fields: None stays (it clears the setting)."""
    unknown = sorted(settings.keys() - set(QUEUE_SETTINGS))
    if unknown:
        raise TypeError(f"not a queue setting: {', '.join(unknown)}; see QUEUE_SETTINGS")
    return {"queue": queue, **settings}


@attrs.frozen
class QueueInfo(QueueConfig):
    """A queue as ``queue_list`` shows it: its settings and its jobs per state."""

    counts: dict[str, int] = attrs.Factory(dict)


@attrs.frozen
class QueuePage:
    queues: list[QueueInfo]
    next_cursor: str | None


@attrs.frozen
class ScheduleInfo:
    """A schedule as ``schedule_put`` and ``schedule_list`` show it: its definition, its
    next slot (UTC ms; None: none left), the last slot it passed, its last job and that
    job's state now (None once pruned). See docs/protocol.md, Schedules."""

    name: str
    cron: str
    timezone: str
    queue: str
    payload: Any
    priority: str
    retries: int | None  # None (and backoff, timeout_ms): the queue's default at each slot
    backoff: dict[str, Any] | None
    catch_up: str
    catch_up_max: int
    paused: bool
    next_at: int | None
    created_at: int
    updated_at: int
    last_slot: int | None = None
    last_job_id: str | None = None
    last_job_state: str | None = None
    timeout_ms: int | None = None
    last_job_slot: int | None = None
    last_refusal: str | None = None


@attrs.frozen
class SchedulePage:
    schedules: list[ScheduleInfo]
    next_cursor: str | None


@attrs.frozen
class HeldJob:
    """A job a worker holds now (``workers_list``): ``held_ms`` since its lease began,
    None when not known (leased before an upgrade that began recording it)."""

    job_id: str
    queue: str
    worker_id: str
    held_ms: int | None
    lease_expires_at: int


@attrs.frozen
class WorkerInfo:
    """One connected worker of a server (``workers_list``; docs/protocol.md, Workers)."""

    worker_id: str
    worker_ids: list[str]
    client: str | None
    peer: str
    queues: list[str]
    queues_total: int
    jobs: list[HeldJob]
    jobs_held: int
    longest_held_ms: int | None
    connected_at: int
    first_lease_at: int
    last_request_at: int
    parked: int


@attrs.frozen
class WorkersPage:
    """A page of one server's connected workers, and which server (``server``) it is."""

    server: str
    workers: list[WorkerInfo]
    total: int
    next_cursor: str | None
    held_truncated: bool = False
    at: int = 0  # the server's clock (UTC ms) when it made the page


@attrs.frozen
class HistoryPoint:
    """The totals of one step of ``history``, from ``at`` (ms since the epoch): jobs
    submitted, succeeded, failed (attempts: fail, expiry, timeout), dead; run times (lease
    to ack or fail) and waits (ready to lease) timed: count, sum and longest, in ms. See
    docs/protocol.md, History."""

    at: int
    submitted: int = 0
    succeeded: int = 0
    failed: int = 0
    dead: int = 0
    run_count: int = 0
    run_sum_ms: int = 0
    run_max_ms: int = 0
    wait_count: int = 0
    wait_sum_ms: int = 0
    wait_max_ms: int = 0

    @property
    def run_mean_ms(self) -> float | None:
        return self.run_sum_ms / self.run_count if self.run_count else None

    @property
    def wait_mean_ms(self) -> float | None:
        return self.wait_sum_ms / self.wait_count if self.wait_count else None


@attrs.frozen
class History:
    """A ``history`` reply: the queue (None: every queue), the range it covers (``start``
    and ``end``: the wire's ``from`` and ``to``, whole minutes), its step (ms) and one
    point per step."""

    queue: str | None
    start: int
    end: int
    step: int
    points: list[HistoryPoint]


def history_reply(reply: dict[str, Any]) -> History:
    """A history reply as ``History`` (its ``from`` and ``to`` as ``start`` and ``end``)."""
    fields = {**reply, "start": reply.get("from"), "end": reply.get("to")}
    return structure_reply(fields, History)


def history_fields(
    queue: str | None, start: int | None, end: int | None, step: int | None
) -> dict[str, Any]:
    """A history request's fields as the wire wants them (the ones given)."""
    given = {"queue": queue, "from": start, "to": end, "step": step}
    return {key: value for key, value in given.items() if value is not None}


@attrs.frozen
class Hello:
    server: str
    version: str
    protocol: int
    limits: dict[str, int]
    role: str = "admin"  # what the connection may do (a server without tokens: admin)


_converter = make_converter(forbid_extra_keys=False)
_converter.register_structure_hook(Any, lambda value, _type: value)


def structure_reply(data: Any, cls: type) -> Any:
    try:
        return _converter.structure(data, cls)
    except (cattrs.BaseValidationError, TypeError, ValueError) as exc:
        raise RelayError(f"unexpected reply from the server: {exc}") from None


def stats_reply(reply: dict[str, Any]) -> Any:
    """A stats reply as ``Stats``."""
    return structure_reply(reply, Stats)


def submit_result(reply: dict[str, Any]) -> SubmitResult:
    return SubmitResult(reply["job_id"], JobState(reply["state"]), reply["duplicate"])
