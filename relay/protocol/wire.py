"""The wire contract in code: limits, field checks, the fast checks, reply encoding.

Requests arrive as one JSON object per line (``relay.protocol.framing`` cuts the lines). The
common shapes of submit, ack and lease are checked by hand here (``fast_*``); anything
else goes through the typed requests of ``relay.protocol.requests``, which name what is wrong.
Replies are plain dicts encoded with orjson; JSON texts that the store keeps (payloads,
results) are embedded as ``orjson.Fragment`` without re-parsing.
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson

from relay.protocol.errors import BadRequest, RelayError
from relay.protocol.model import (
    PRIORITY_INT_BY_WIRE,
    QUEUE_NAME_RE,
    WIRE_PRIORITIES,
    AttemptEntry,
    Backoff,
    ErrorEntry,
    JobInfo,
    Lease,
    Priority,
    SubmitSpec,
)

PROTOCOL_VERSION = 1

MiB = 1024 * 1024
HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


@attrs.frozen
class Limits:
    """Every size, count and duration a client controls. Advertised (in part) by ``hello``."""

    max_frame_bytes: int = MiB
    max_payload_bytes: int = 256 * 1024
    max_in_flight: int = 256
    max_connections: int = 1024
    max_lease_ms: int = 12 * HOUR_MS
    max_wait_ms: int = 60_000
    max_batch: int = 1000
    max_queues_per_lease: int = 16
    max_error_bytes: int = 8 * 1024
    # A failed attempt's traceback (``fail.traceback``, an extension): the server keeps
    # its last this many bytes, where the failing frame and the exception are. Not
    # advertised by hello, as ``max_error_bytes`` is not: nothing is refused for its length.
    max_traceback_bytes: int = 8 * 1024
    # Not advertised by hello, but documented (docs/protocol.md) and enforced the same way.
    max_result_bytes: int = 256 * 1024
    max_retries: int = 1000
    max_delay_ms: int = 366 * DAY_MS
    max_backoff_ms: int = 7 * DAY_MS
    # A job's execution timeout (``submit.timeout_ms``, an extension). Not advertised.
    max_timeout_ms: int = 7 * DAY_MS
    max_id_bytes: int = 256  # worker_id, token, idempotency_key, client name
    max_dead_list: int = 1000
    # A lease or dead_list reply stops adding jobs once their texts reach this (at least
    # one job is always given), so a reply stays near a frame's size whatever count asked.
    max_reply_bytes: int = MiB
    # Connections watching job events at once, and the events each may have waiting to be
    # sent before it loses some (relay/server/requests/watch.py). Advertised by hello.
    max_watchers: int = 64
    max_watch_buffer: int = 4096
    # Schedules may have a seconds field (six fields: more often than once a minute) only
    # if the operator allows it (--allow-second-schedules). Not advertised.
    allow_second_schedules: bool = False

    def advertised(self) -> dict[str, int]:
        return {
            "max_frame_bytes": self.max_frame_bytes,
            "max_payload_bytes": self.max_payload_bytes,
            "max_in_flight": self.max_in_flight,
            "max_connections": self.max_connections,
            "max_lease_ms": self.max_lease_ms,
            "max_wait_ms": self.max_wait_ms,
            "max_batch": self.max_batch,
            "max_queues_per_lease": self.max_queues_per_lease,
            "max_watchers": self.max_watchers,
            "max_watch_buffer": self.max_watch_buffer,
        }


# With tokens configured, the longest line a connection may send before its hello (on TCP
# and WebSocket alike): a hello is at most a few hundred bytes (a 256-byte token and
# client name), and an unauthenticated client holds no more memory than this. A longer
# line is frame_too_large, and the connection is closed.
MAX_HELLO_BYTES = 4 * 1024

DEFAULT_LEASE_MS = 30_000
DEFAULT_DEAD_LIST = 100
# Queues per stats reply (an extension: stats pages by queue name), by default and at
# most: 1,000 queues with the longest names are about 400 KB of reply, within
# max_reply_bytes, and the page costs the event loop about a millisecond to make.
STATS_PAGE = 1000

# -- field checks ---------------------------------------------------------------------------


def _bad(field: str, problem: str) -> BadRequest:
    return BadRequest(f"{field}: {problem}", field=field)


def check_range(field: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise _bad(field, f"must be between {low} and {high}, got {value}")


# Queue names seen valid: most requests name one of a few queues, and a set lookup is
# several times cheaper than the regex (the profile of submit_batch showed the check).
_VALID_QUEUES: set[str] = set()
_VALID_QUEUES_MAX = 4096


def valid_queue(name: Any) -> bool:
    if type(name) is not str:
        return False
    if name in _VALID_QUEUES:
        return True
    if not QUEUE_NAME_RE.fullmatch(name):
        return False
    if len(_VALID_QUEUES) >= _VALID_QUEUES_MAX:
        _VALID_QUEUES.clear()
    _VALID_QUEUES.add(name)
    return True


def check_queue(field: str, name: str) -> None:
    if not valid_queue(name):
        raise _bad(field, "a queue name is 1-128 characters of [A-Za-z0-9._:-]")


def check_text(field: str, value: str, max_bytes: int, *, empty_ok: bool = False) -> None:
    if not value and not empty_ok:
        raise _bad(field, "must not be empty")
    if len(value) > max_bytes or len(value.encode("utf-8")) > max_bytes:
        raise _bad(field, f"longer than {max_bytes} bytes")


def encode_json_value(field: str, value: Any, max_bytes: int) -> str:
    """The JSON text of ``value``, checked against ``max_bytes`` encoded."""
    try:
        text = orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        # orjson reads 1,024 levels of nesting but writes at most 254.
        raise _bad(field, f"nested too deeply to store ({exc})") from None
    if len(text) > max_bytes:
        raise _bad(field, f"{len(text)} bytes encoded, more than {max_bytes}")
    return text.decode("utf-8")


def valid_id(request_id: Any) -> bool:
    kind = type(request_id)
    return request_id is None or kind is int or (kind is str and len(request_id) <= 256)


# The fields of a submit that the fast path handles; anything else takes the full path.
_FAST_FIELDS = frozenset(
    {"op", "id", "queue", "payload", "priority", "retries", "delay_ms", "idempotency_key"}
)


def fast_submit_spec(job: dict[str, Any], limits: Limits) -> SubmitSpec | None:
    """The ``SubmitSpec`` of a plain, valid submit, or None to take the full path.

    The profile of submit and submit_batch put most of their CPU in the general parse
    (cattrs structuring, then ``to_spec``). This accepts only the common shape, with
    every value already right; anything else (a backoff, run_at, an unknown field, any
    bad value) returns None, and the full path then parses it or names what is wrong. So
    the two paths never disagree on an accepted request (tests/protocol/test_wire.py checks it).
    """
    if not _FAST_FIELDS.issuperset(job):
        return None
    get = job.get
    queue = get("queue")
    if type(queue) is not str or (queue not in _VALID_QUEUES and not valid_queue(queue)):
        return None
    priority_name = get("priority", "normal")
    priority = PRIORITY_INT_BY_WIRE.get(priority_name) if type(priority_name) is str else None
    attempts = get("retries")  # None: left out, for the store to resolve (SubmitSpec)
    if attempts is not None:
        if type(attempts) is not int or not 0 <= attempts <= limits.max_retries:
            return None
        attempts += 1
    delay_ms = get("delay_ms", 0)
    key = get("idempotency_key")
    if (
        priority is None
        or type(delay_ms) is not int
        or not 0 <= delay_ms <= limits.max_delay_ms
        or (key is not None and not _short_text(key, limits.max_id_bytes))
        or "payload" not in job
    ):
        return None
    try:
        payload = orjson.dumps(job["payload"])
    except orjson.JSONEncodeError:
        return None  # nested too deeply: the full path says so
    if len(payload) > limits.max_payload_bytes:
        return None
    return _new_spec(
        SubmitSpec, (queue, payload.decode(), priority, delay_ms, None,
                     attempts, None, key, None, UNFINISHED, None)
    )  # fmt: skip


# A named tuple made from a tuple at once: skips its __new__'s argument handling (the
# fast path makes one per job), so every field is given, defaults too.
_new_spec = tuple.__new__
UNFINISHED = SubmitSpec._field_defaults["unique_for"]


def _short_text(value: Any, max_bytes: int) -> bool:
    """A non-empty string of at most ``max_bytes`` UTF-8 bytes (the common case cheaply:
    a string of at most max_bytes / 4 characters cannot be longer)."""
    if type(value) is not str or not value:
        return False
    return len(value) <= max_bytes >> 2 or len(value.encode()) <= max_bytes


_FAST_ACK_FIELDS = frozenset({"op", "id", "job_id", "worker_id", "token", "result"})


def fast_ack(fields: dict[str, Any], limits: Limits) -> tuple[str, str, str, str | None] | None:
    """(job_id, worker_id, token, result text) of a plain, valid ack, or None to take the
    full path (as ``fast_submit_spec``)."""
    if not _FAST_ACK_FIELDS.issuperset(fields):
        return None
    job_id, worker_id, token = fields.get("job_id"), fields.get("worker_id"), fields.get("token")
    most = limits.max_id_bytes
    if not (
        _short_text(job_id, most) and _short_text(worker_id, most) and _short_text(token, most)
    ):
        return None
    result = fields.get("result")
    if result is not None:
        result = encode_json_value("result", result, limits.max_result_bytes)
    return job_id, worker_id, token, result


# queues, worker_id, count, lease_ms, wait_ms: a lease's fields, checked.
LeaseFields = tuple[list[str], str, int, int, int]

_FAST_LEASE_FIELDS = frozenset({"op", "id", "queues", "worker_id", "count", "lease_ms", "wait_ms"})


def fast_lease(fields: dict[str, Any], limits: Limits) -> LeaseFields | None:
    """(queues, worker_id, count, lease_ms, wait_ms) of a plain, valid lease, or None to
    take the full path (as ``fast_submit_spec``)."""
    if not _FAST_LEASE_FIELDS.issuperset(fields):
        return None
    queues = fields.get("queues")
    worker_id = fields.get("worker_id")
    count = fields.get("count", 1)
    lease_ms = fields.get("lease_ms", DEFAULT_LEASE_MS)
    wait_ms = fields.get("wait_ms", 0)
    if (
        type(queues) is not list
        or not 1 <= len(queues) <= limits.max_queues_per_lease
        or not all(valid_queue(queue) for queue in queues)
        or not _short_text(worker_id, limits.max_id_bytes)
        or type(count) is not int or not 1 <= count <= limits.max_batch
        or type(lease_ms) is not int or not 1 <= lease_ms <= limits.max_lease_ms
        or type(wait_ms) is not int or not 0 <= wait_ms <= limits.max_wait_ms
    ):  # fmt: skip
        return None
    return queues, worker_id, count, lease_ms, wait_ms


# -- replies --------------------------------------------------------------------------------


def encode_ok(request_id: Any, fields: dict[str, Any]) -> bytes:
    return orjson.dumps({"id": request_id, "ok": True, **fields}) + b"\n"


def encode_error(request_id: Any, error: RelayError) -> bytes:
    body = {"code": error.code, "message": error.message}
    return orjson.dumps({"id": request_id, "ok": False, "error": body}) + b"\n"


def lease_fields(lease: Lease) -> dict[str, Any]:
    job_id, queue, payload, priority, attempt, max_attempts, token, expires_at, timeout, slot = (
        lease
    )
    fields = {
        "job_id": job_id,
        "queue": queue,
        "payload": orjson.Fragment(payload),
        "priority": WIRE_PRIORITIES[priority],
        "attempt": attempt,
        "max_attempts": max_attempts,
        "token": token,
        "lease_expires_at": expires_at,
    }
    if timeout is not None:
        fields["timeout_ms"] = timeout
    if slot is not None:
        fields["scheduled_for"] = slot
    return fields


def _error_fields(entry: ErrorEntry) -> dict[str, Any]:
    fields: dict[str, Any] = {"attempt": entry.attempt, "error": entry.error, "at": entry.at}
    if entry.traceback is not None:
        fields["traceback"] = entry.traceback
    return fields


def _attempt_fields(entry: AttemptEntry) -> dict[str, Any]:
    fields: dict[str, Any] = {"attempt": entry.attempt, "outcome": str(entry.outcome)}
    optional = {
        "started_at": entry.started_at,
        "ended_at": entry.ended_at,
        "worker_id": entry.worker_id,
        "error": entry.error,
        "traceback": entry.traceback,
    }
    fields.update((k, v) for k, v in optional.items() if v is not None)
    return fields


def backoff_fields(backoff: Backoff) -> dict[str, Any]:
    """A backoff as ``submit`` takes it."""
    if backoff.kind == "fixed":
        return {"kind": "fixed", "delay_ms": backoff.base_ms}
    return {
        "kind": backoff.kind,
        "base_ms": backoff.base_ms,
        "max_ms": backoff.max_ms,
        "jitter": backoff.jitter,
    }


def job_summary_fields(job: JobInfo) -> dict[str, Any]:
    """A job as ``jobs_list`` gives it: as ``inspect`` does, without payload, result and
    error history (``inspect`` shows them), its last error cut short by the store."""
    fields: dict[str, Any] = {
        "job_id": job.job_id,
        "queue": job.queue,
        "state": str(job.state),
        "priority": Priority(job.priority).wire,
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "created_at": job.created_at,
    }
    optional = {
        "ready_at": job.ready_at,
        "run_at": job.run_at,
        "lease_expires_at": job.lease_expires_at,
        "worker_id": job.worker_id,
        "last_error": job.last_error,
        "idempotency_key": job.idempotency_key,
        "finished_at": job.finished_at,
        "timeout_ms": job.timeout_ms,
        "scheduled_for": job.scheduled_for,
    }
    fields.update((k, v) for k, v in optional.items() if v is not None)
    return fields


def job_fields(job: JobInfo, attempts: bool = False) -> dict[str, Any]:
    """A job as ``inspect`` and ``dead_list`` give it; with ``attempts`` (``inspect``'s),
    its attempt history too."""
    fields: dict[str, Any] = {
        "job_id": job.job_id,
        "queue": job.queue,
        "state": str(job.state),
        "priority": Priority(job.priority).wire,
        "payload": orjson.Fragment(job.payload),
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "created_at": job.created_at,
        "errors": [_error_fields(entry) for entry in job.errors],
    }
    optional = {
        "ready_at": job.ready_at,
        "run_at": job.run_at,
        "lease_expires_at": job.lease_expires_at,
        "worker_id": job.worker_id,
        "last_error": job.last_error,
        "result": None if job.result is None else orjson.Fragment(job.result),
        "idempotency_key": job.idempotency_key,
        "finished_at": job.finished_at,
        "timeout_ms": job.timeout_ms,
        "scheduled_for": job.scheduled_for,
    }
    fields.update((k, v) for k, v in optional.items() if v is not None)
    if attempts:
        fields["attempts"] = [_attempt_fields(entry) for entry in job.attempts]
        fields["attempts_dropped"] = job.attempts_dropped
    return fields
