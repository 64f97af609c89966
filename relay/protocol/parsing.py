"""From a frame to a typed request: the general path of parsing, which names what is wrong.

``parse_request`` turns a frame into a typed, validated request (relay/protocol/requests.py) or
raises ``BadRequest`` / ``UnknownOp`` naming the field; the cattrs converter here does the
typing (strictly: no "5" for 5, no true for 1) and each request's ``check`` does the
ranges. The dispatcher comes here for anything the fast checks of ``relay.protocol.wire`` do not
accept.
"""

from __future__ import annotations

from typing import Any

import attrs
import cattrs
import orjson
from cattrs.gen import make_dict_structure_fn, override
from cattrs.preconf.orjson import make_converter

from relay.protocol.errors import BadRequest, UnknownOp
from relay.protocol.requests import (
    REQUEST_TYPES,
    AckBatch,
    AckItem,
    History,
    Submit,
    SubmitBatch,
)
from relay.protocol.wire import (
    Limits,
    _bad,
    check_text,
    encode_json_value,
    fast_submit_spec,
    valid_id,
)


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
    # history's "from" and "to" are Python keywords: its fields are start and end.
    converter.register_structure_hook(
        History,
        make_dict_structure_fn(
            History, converter, start=override(rename="from"), end=override(rename="to")
        ),
    )
    return converter


converter = _make_converter()


# Fields whose wire name is not their attribute's (a Python keyword): for the errors.
_WIRE_NAMES: dict[type, dict[str, str]] = {History: {"start": "from", "end": "to"}}


def structure(data: dict[str, Any], cls: type, prefix: str = "") -> Any:
    """``data`` as an instance of ``cls``, or ``BadRequest`` naming the first bad field."""
    try:
        return converter.structure(data, cls)
    except cattrs.ClassValidationError as exc:
        message = cattrs.transform_error(exc)[0]
        problem, _, path = message.partition(" @ $.")
        path = _WIRE_NAMES.get(cls, {}).get(path, path)
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


# (job_id, worker_id, token, result text or None) per ack of an ack_batch; in place of
# an ack of a job that an earlier ack of the batch names, the error that answers it.
AckTuples = tuple[tuple[str, str, str, str | None] | BadRequest, ...]


def _parse_ack_batch(request: AckBatch, limits: Limits) -> AckTuples:
    """(job_id, worker_id, token, result text or None) per ack, every one checked before
    any is used: one bad item rejects the request, naming its index. A job acked twice
    in the batch: its first ack stands, each later one is answered ``bad_request`` here,
    without reaching the store (where a repeat would cost the batch its one statement)."""
    check_text("worker_id", request.worker_id, limits.max_id_bytes)
    items = request.acks
    if not 1 <= len(items) <= limits.max_batch:
        raise _bad("acks", f"must hold 1 to {limits.max_batch} acks, got {len(items)}")
    acks: list[tuple[str, str, str, str | None] | BadRequest] = []
    first: dict[str, int] = {}  # job id -> index of its first ack
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
        earlier = first.setdefault(ack.job_id, i)
        if earlier != i:
            acks.append(
                BadRequest(
                    f"{prefix}job_id: acked by acks[{earlier}] of this batch; ack each job once"
                )
            )
            continue
        acks.append((ack.job_id, request.worker_id, ack.token, result))
    return tuple(acks)
