"""The wire contract in code: limits, request types, validation, reply encoding, framing.

Requests arrive as one JSON object per line. ``parse_request`` turns a frame into a typed,
validated request (attrs) or raises ``BadRequest`` / ``UnknownOp`` naming the field; the
cattrs converter does the typing (strictly: no "5" for 5, no true for 1) and each request's
``check`` does the ranges. Replies are plain dicts encoded with orjson; JSON texts that the
store keeps (payloads, results) are embedded as ``orjson.Fragment`` without re-parsing.
"""

from __future__ import annotations

from typing import Any

import attrs
import cattrs
import orjson
from cattrs.preconf.orjson import make_converter

from relay.errors import BadRequest, RelayError, UnknownOp
from relay.model import (
    DEFAULT_BACKOFF,
    PRIORITY_BY_WIRE,
    QUEUE_NAME_RE,
    WIRE_PRIORITIES,
    Backoff,
    JobInfo,
    Lease,
    Priority,
    SubmitSpec,
    parse_job_id,
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
    # Not advertised by hello, but documented (docs/protocol.md) and enforced the same way.
    max_result_bytes: int = 256 * 1024
    max_retries: int = 1000
    max_delay_ms: int = 366 * DAY_MS
    max_backoff_ms: int = 7 * DAY_MS
    max_id_bytes: int = 256  # worker_id, token, idempotency_key, client name
    max_dead_list: int = 1000
    # A lease or dead_list reply stops adding jobs once their texts reach this (at least
    # one job is always given), so a reply stays near a frame's size whatever count asked.
    max_reply_bytes: int = MiB

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
        }


DEFAULT_LEASE_MS = 30_000
DEFAULT_RETRIES = 3
DEFAULT_DEAD_LIST = 100

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
    retries: int = DEFAULT_RETRIES
    backoff: WireBackoff | None = None
    idempotency_key: str | None = None

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
        check_range(prefix + "retries", self.retries, 0, limits.max_retries)
        if self.idempotency_key is not None:
            check_text(prefix + "idempotency_key", self.idempotency_key, limits.max_id_bytes)
        backoff = (
            DEFAULT_BACKOFF
            if self.backoff is None
            else self.backoff.to_model(prefix + "backoff", limits)
        )
        return SubmitSpec(
            queue=self.queue,
            payload=payload,
            priority=PRIORITY_BY_WIRE[self.priority],
            delay_ms=self.delay_ms or 0,
            run_at=self.run_at,
            max_attempts=self.retries + 1,
            backoff=backoff,
            idempotency_key=self.idempotency_key,
        )


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
    the two paths never disagree on an accepted request (tests/test_wire.py checks it).
    """
    if not _FAST_FIELDS.issuperset(job):
        return None
    get = job.get
    queue = get("queue")
    if type(queue) is not str or (queue not in _VALID_QUEUES and not valid_queue(queue)):
        return None
    priority_name = get("priority", "normal")
    priority = PRIORITY_BY_WIRE.get(priority_name) if type(priority_name) is str else None
    retries = get("retries", DEFAULT_RETRIES)
    delay_ms = get("delay_ms", 0)
    key = get("idempotency_key")
    if (
        priority is None
        or type(retries) is not int
        or not 0 <= retries <= limits.max_retries
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
        SubmitSpec, (queue, payload.decode(), priority, delay_ms, None, retries + 1,
                     DEFAULT_BACKOFF, key)
    )  # fmt: skip


# A named tuple made from a tuple at once: skips its __new__'s argument handling (the
# fast path makes one per job).
_new_spec = tuple.__new__


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


_FAST_LEASE_FIELDS = frozenset({"op", "id", "queues", "worker_id", "count", "lease_ms", "wait_ms"})


def fast_lease(fields: dict[str, Any], limits: Limits) -> LeaseRequest | None:
    """The ``LeaseRequest`` of a plain, valid lease, or None to take the full path (as
    ``fast_submit_spec``)."""
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
    return LeaseRequest(queues, worker_id, count, lease_ms, wait_ms)


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

    def check(self, limits: Limits) -> None:
        self.check_ref(limits)
        # Long texts are truncated by the store (max_error_bytes), not refused; only a
        # frame's own limit bounds what arrives here.


@attrs.frozen
class Release(LeaseRef):
    def check(self, limits: Limits) -> None:
        self.check_ref(limits)


@attrs.frozen
class Inspect:
    job_id: str

    def check(self, limits: Limits) -> None:
        check_text("job_id", self.job_id, limits.max_id_bytes)


@attrs.frozen
class Stats:
    def check(self, limits: Limits) -> None:
        pass


@attrs.frozen
class DeadList:
    queue: str | None = None
    limit: int = DEFAULT_DEAD_LIST
    cursor: str | None = None

    def check(self, limits: Limits) -> None:
        if self.queue is not None:
            check_queue("queue", self.queue)
        check_range("limit", self.limit, 1, limits.max_dead_list)
        if self.cursor is not None and parse_job_id(self.cursor) is None:
            raise _bad("cursor", "not a cursor returned by dead_list")


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


@attrs.frozen
class DeadRetry(DeadSelect):
    pass


@attrs.frozen
class DeadPurge(DeadSelect):
    pass


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
    "stats": Stats,
    "dead_list": DeadList,
    "dead_retry": DeadRetry,
    "dead_purge": DeadPurge,
}


def _strict_list(value: Any, _type: Any) -> list[Any]:
    # cattrs would take any iterable: a string as a list of letters, an object's keys.
    # The items are checked by the request's own check, which names their index.
    if type(value) is not list:
        raise TypeError("expected an array")
    return value


def _strict(kind: type, name: str):
    def structure(value: Any, _type: Any) -> Any:
        # bool is an int in Python, not on the wire.
        if type(value) is not kind:
            raise TypeError(f"expected {name}")
        return value

    return structure


def _make_converter() -> cattrs.Converter:
    converter = make_converter(forbid_extra_keys=False)
    converter.register_structure_hook(int, _strict(int, "an integer"))
    converter.register_structure_hook(str, _strict(str, "a string"))
    converter.register_structure_hook(bool, _strict(bool, "true or false"))
    converter.register_structure_hook(Any, lambda value, _type: value)
    converter.register_structure_hook_func(
        lambda t: t in (list[str], list[dict[str, Any]]), _strict_list
    )
    return converter


converter = _make_converter()


def structure(data: dict[str, Any], cls: type, prefix: str = "") -> Any:
    """``data`` as an instance of ``cls``, or ``BadRequest`` naming the first bad field."""
    try:
        return converter.structure(data, cls)
    except cattrs.ClassValidationError as exc:
        message = cattrs.transform_error(exc)[0]
        problem, _, path = message.partition(" @ $.")
        field = prefix + (path or "?")
        raise BadRequest(f"{field}: {problem}", field=field) from None
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{prefix or 'request'}: {exc}", field=prefix or None) from None


@attrs.frozen
class Frame:
    """A request as it arrived: its ``id`` (echoed in the reply), ``op`` and fields."""

    id: Any
    op: Any
    fields: dict[str, Any]


def decode_frame(line: bytes) -> Frame:
    """Parse one line into a ``Frame``; BadRequest if it is not a JSON object.

    An ``id`` of the wrong type is dropped (``Frame.id`` is None, so the reply carries
    ``id: null``) and reported by ``parse_request``; a missing or ill-typed ``op`` too.
    """
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("a request must be a JSON object")
    request_id = data.get("id")
    return Frame(request_id if valid_id(request_id) else None, data.get("op"), data)


def valid_id(request_id: Any) -> bool:
    kind = type(request_id)
    return request_id is None or kind is int or (kind is str and len(request_id) <= 256)


def parse_request(frame: Frame, limits: Limits) -> Any:
    """The typed, range-checked request of ``frame``.

    ``submit`` becomes a ``SubmitSpec``; ``submit_batch`` a tuple of them (all checked
    before any is used: one bad job rejects the batch, naming its index).
    """
    if not valid_id(frame.fields.get("id")):
        raise _bad("id", "must be a string (at most 256 characters) or an integer")
    if not isinstance(frame.op, str):
        raise _bad("op", "required, a string")
    cls = REQUEST_TYPES.get(frame.op)
    if cls is None:
        raise UnknownOp(f"unknown op {frame.op!r}")
    if cls is Submit:
        spec = fast_submit_spec(frame.fields, limits)
        if spec is not None:
            return spec
    request = structure(frame.fields, cls)
    if cls is Submit:
        return request.to_spec(limits)
    if cls is SubmitBatch:
        jobs = request.jobs
        if not 1 <= len(jobs) <= limits.max_batch:
            raise _bad("jobs", f"must hold 1 to {limits.max_batch} jobs, got {len(jobs)}")
        specs = []
        for i, job in enumerate(jobs):
            if type(job) is not dict:
                raise _bad(f"jobs[{i}]", "must be an object")
            spec = fast_submit_spec(job, limits)
            if spec is None:
                prefix = f"jobs[{i}]."
                spec = structure(job, Submit, prefix).to_spec(limits, prefix)
            specs.append(spec)
        return tuple(specs)
    if cls is AckBatch:
        return _parse_ack_batch(request, limits)
    request.check(limits)
    return request


# (job_id, worker_id, token, result text or None) per ack of an ack_batch.
AckTuples = tuple[tuple[str, str, str, str | None], ...]


def _parse_ack_batch(request: AckBatch, limits: Limits) -> AckTuples:
    """(job_id, worker_id, token, result text or None) per ack, every one checked before
    any is used: one bad item rejects the request, naming its index."""
    check_text("worker_id", request.worker_id, limits.max_id_bytes)
    items = request.acks
    if not 1 <= len(items) <= limits.max_batch:
        raise _bad("acks", f"must hold 1 to {limits.max_batch} acks, got {len(items)}")
    acks: list[tuple[str, str, str, str | None]] = []
    for i, item in enumerate(items):
        prefix = f"acks[{i}]."
        if not isinstance(item, dict):
            raise _bad(f"acks[{i}]", "must be an object")
        ack = structure(item, AckItem, prefix)
        check_text(prefix + "job_id", ack.job_id, limits.max_id_bytes)
        check_text(prefix + "token", ack.token, limits.max_id_bytes)
        result = None
        if ack.result is not None:
            result = encode_json_value(prefix + "result", ack.result, limits.max_result_bytes)
        acks.append((ack.job_id, request.worker_id, ack.token, result))
    return tuple(acks)


# -- replies --------------------------------------------------------------------------------


def encode_ok(request_id: Any, fields: dict[str, Any]) -> bytes:
    return orjson.dumps({"id": request_id, "ok": True, **fields}) + b"\n"


def encode_error(request_id: Any, error: RelayError) -> bytes:
    body = {"code": error.code, "message": error.message}
    return orjson.dumps({"id": request_id, "ok": False, "error": body}) + b"\n"


def lease_fields(lease: Lease) -> dict[str, Any]:
    job_id, queue, payload, priority, attempt, max_attempts, token, expires_at = lease
    return {
        "job_id": job_id,
        "queue": queue,
        "payload": orjson.Fragment(payload),
        "priority": WIRE_PRIORITIES[priority],
        "attempt": attempt,
        "max_attempts": max_attempts,
        "token": token,
        "lease_expires_at": expires_at,
    }


def job_fields(job: JobInfo) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "job_id": job.job_id,
        "queue": job.queue,
        "state": str(job.state),
        "priority": Priority(job.priority).wire,
        "payload": orjson.Fragment(job.payload),
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "created_at": job.created_at,
        "errors": [{"attempt": e.attempt, "error": e.error, "at": e.at} for e in job.errors],
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
    }
    fields.update((k, v) for k, v in optional.items() if v is not None)
    return fields


# -- framing --------------------------------------------------------------------------------


def _strip_cr(lines: list[bytes]) -> list[bytes]:
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


class LineSplitter:
    """Splits a byte stream into lines, never holding more than one frame's worth.

    ``feed`` returns the complete lines (newline and a trailing \\r removed) and keeps the
    rest. Once a line is longer than ``max_frame_bytes`` (as soon as that many bytes have
    arrived without a newline), ``overflow`` is set and nothing more is returned: the
    lines before it are still returned, and the buffer never grows past the limit.
    """

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self.overflow = False

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        if self.overflow:
            return []
        buffer = self._buffer
        if b"\n" not in data:  # no line ends here: keep it (a bytearray grows cheaply)
            buffer += data
            self._check_rest()
            return []
        if buffer:
            buffer += data
            data = bytes(buffer)
            buffer.clear()
        # bytes.split does the scanning; Python looks at each line only when one could
        # be too long (a read and the buffer are usually far below the limit) or ends
        # with \r.
        lines = data.split(b"\n")
        buffer += lines.pop()
        if len(data) > self.max_frame_bytes:
            for i, line in enumerate(lines):
                if len(line) - line.endswith(b"\r") > self.max_frame_bytes:
                    self._overflowed()
                    return _strip_cr(lines[:i])
        self._check_rest()
        return _strip_cr(lines) if b"\r" in data else lines

    def _check_rest(self) -> None:
        # The rest has no newline yet; a \r at its end may be the first half of \r\n.
        buffer = self._buffer
        if len(buffer) - buffer.endswith(b"\r") > self.max_frame_bytes:
            self._overflowed()

    def _overflowed(self) -> None:
        self.overflow = True
        self._buffer = bytearray()
