"""Fuzzing the way in: random bytes, and requests built to be nearly right.

Every frame gets exactly one reply, an error with a protocol code (never ``internal``), or
is accepted as valid; a frame over the limit closes the connection; nothing raises. The
requests are built from the contract's real ops and fields (/work/shared/protocol.md) with
one mutation that must be refused (a missing field, a wrong type, a value out of range, a
bad id or op), and the refusal must name that field; or with mutations that must not
matter (unknown fields, duplicate keys, field order, any valid id), and then the request
must be accepted. Some frames also get tokens no JSON parser should take (NaN, Infinity,
invalid UTF-8 in strings, lone surrogates, nesting past the parser's depth), or odd but
valid ones (integers past 64 bits, -0, 1.0, deep nesting), where only the invariants hold.

Two levels: ``LineSplitter`` and ``Dispatcher.dispatch`` with fakes (many examples, no
sockets), and a real server on port 0 fed the same frames over one connection, after
which a second connection must still be served.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import Counter
from typing import Any

import attrs
import orjson
import trio
import trio.testing
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from relay.protocol import framing, wire
from relay.protocol.model import QUEUE_NAME_RE
from relay.protocol.requests import REQUEST_TYPES
from relay.server.requests.dispatch import Dispatcher
from relay.server.requests.longpoll import LongPolls
from relay.server.requests.watch import Watchers
from relay.store import commands as cmd
from tests.server.conftest import BOUND_S, LineClient
from tests.server.requests.test_dispatch import FakeConnection as DispatchConnection
from tests.worker.helpers import serving, start_server

# The error codes of the contract. `internal` is among them, but it means a bug.
PROTOCOL_CODES = {
    "bad_request", "frame_too_large", "unknown_op", "not_found", "stale_token",
    "lease_expired", "invalid_state", "overloaded", "shutting_down", "unauthorized",
    "internal",
}  # fmt: skip
ERROR_CODES = PROTOCOL_CODES - {"internal"}

# Small limits, so that "too many", "too large" and "over the frame" are cheap to reach.
LIMITS = wire.Limits(
    max_frame_bytes=16 * 1024,
    max_payload_bytes=2048,
    max_batch=4,
    max_queues_per_lease=4,
    max_wait_ms=1000,
)

# -- values --------------------------------------------------------------------------------


@attrs.frozen
class Raw:
    """A value's JSON text written as is: it may not be valid JSON at all."""

    text: bytes


@attrs.frozen
class Obj:
    """A JSON object as (key, value) pairs: keys may repeat, order is kept."""

    pairs: tuple[tuple[str, Any], ...]


def render(value: Any) -> bytes:
    """The JSON text of ``value``, with ``Raw`` and ``Obj`` anywhere inside it as they are."""
    return orjson.dumps(value, default=_fragment)


def _fragment(value: Any) -> orjson.Fragment:
    if isinstance(value, Raw):
        return orjson.Fragment(value.text)
    if isinstance(value, Obj):
        pairs = (render(k) + b":" + render(v) for k, v in value.pairs)
        return orjson.Fragment(b"{" + b",".join(pairs) + b"}")
    raise TypeError(type(value))


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list"}.get(
        type(value), "object"
    )


# JSON values, shallow (a recursive strategy costs several times more per draw; deep
# nesting comes from `nested` and the raw tokens below).
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.one_of(
    _scalars,
    st.lists(_scalars, max_size=3),
    st.dictionaries(st.text(max_size=4), _scalars, max_size=3),
)


def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


# Deeper than orjson writes (254 levels), within what it reads (1,024): a value that
# arrives but cannot be stored.
TOO_DEEP = Raw(b'{"a":[' * 150 + b"1" + b"]}" * 150)


# Values of each JSON type, some of them odd; Python values only, each encoded by orjson
# (nesting up to its writing limit of 254 levels).
BY_TYPE: dict[str, st.SearchStrategy[Any]] = {
    "null": st.none(),
    "bool": st.booleans(),
    "int": st.sampled_from([0, -1, 2**64 - 1, -(2**63)]) | st.integers(-(2**63), 2**64 - 1),
    "float": st.sampled_from([1.0, -0.0, 0.5, 1e300, -1e-300])
    | st.floats(allow_nan=False, allow_infinity=False),
    "str": st.sampled_from(["", "5", "true", "null", "q", "é", "\x00"]) | st.text(max_size=12),
    "list": st.sampled_from([[], [1], ["q"], [None], nested(40), nested(200)])
    | st.lists(_scalars, max_size=3),
    "object": st.sampled_from([{}, {"kind": "fixed"}, {"": None}, nested(41)])
    | st.dictionaries(st.text(max_size=4), _scalars, max_size=3),
}
any_value = st.one_of(*BY_TYPE.values())


@functools.cache
def wrong_value(kind: str, nullable: bool) -> st.SearchStrategy[Any]:
    """A value whose JSON type a field of ``kind`` does not take (no filter: a filter on a
    one_of applies to each branch, and may have none to draw from)."""
    return st.one_of(
        *(values for name, values in BY_TYPE.items()
          if name != kind and not (name == "null" and nullable))
    )  # fmt: skip


# Tokens no JSON parser should take: the whole line is then not JSON.
INVALID_TOKENS = [
    b"NaN", b"-NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"+1", b"01", b".5",
    b"1.", b"0x10", b"'q'", b"tru", b"undefined", b'"\xff"', b'"q\xc3"', b'"\xed\xa0\x80"',
    b'"\xc0\xaf"', b'"\\ud800"', b'"\\udfff"', b'"\\ud800\\u0041"', b'"\\x41"', b'"\\u12"',
    b'"a\x00b"', b"[1,]", b'{"a":1,}', b'{"a"}', b"[" * 1100 + b"]" * 1100,
]  # fmt: skip
# Valid but odd: integers past 64 bits (read as floats), -0, nesting deeper than orjson
# writes (254) up to what it reads (1,024), escapes.
ODD_TOKENS = [
    b"18446744073709551616", b"-9223372036854775809", b"18446744073709551615",
    b"-9223372036854775808", b"1.0", b"-0", b"-0.0", b"1e2", b"1E-400", b'"\\u0000"',
    b'"\\ud83d\\ude00"', b'"\\/"', b"[" * 300 + b"]" * 300,
    b'{"a":' * 300 + b"1" + b"}" * 300, b"[" * 1000 + b"]" * 1000,
]  # fmt: skip
raw_tokens = st.one_of(
    st.sampled_from(INVALID_TOKENS + ODD_TOKENS).map(Raw),
    # Arbitrary bytes inside a string: invalid UTF-8, control characters, stray quotes.
    st.binary(max_size=12).map(lambda b: Raw(b'"' + b.replace(b"\n", b"") + b'"')),
)

# -- the fields of each op ------------------------------------------------------------------


@attrs.frozen
class Field:
    kind: str  # the JSON type it takes: str, int, bool, list, object, or any
    valid: st.SearchStrategy[Any]
    required: bool = False
    nullable: bool = False  # null is accepted (as if absent)
    # Values of the right type that are refused (out of range, malformed), naming it.
    bad: st.SearchStrategy[Any] | None = None
    missing_names: str | None = None  # the field the refusal names when this one is absent
    excludes: str | None = None  # a field that may not be given with this one


def in_range(low: int, high: int) -> st.SearchStrategy[int]:
    return st.sampled_from([low, high]) | st.integers(low, high)


def out_of_range(low: int, high: int) -> st.SearchStrategy[int]:
    return st.one_of(
        st.sampled_from([low - 1, high + 1, -(2**63), 2**64 - 1]),
        st.integers(-(2**63), low - 1),
        st.integers(high + 1, 2**64 - 1),
    )


def int_field(low: int, high: int, **kw: Any) -> Field:
    return Field("int", in_range(low, high), bad=out_of_range(low, high), **kw)


queue_names = st.sampled_from(["q", "emails", "a.b:c-d_9", "Q" * 128]) | st.text(
    "abcxyz", min_size=1, max_size=8
)
bad_queue_names = st.sampled_from(
    ["", "a" * 129, "q q", "é", "q\n", "日本", "q/x", "\x00", "🚀"]
) | st.text(max_size=10).filter(lambda s: not QUEUE_NAME_RE.fullmatch(s))
# worker ids, tokens, job ids, keys: 1 to 256 bytes of UTF-8.
idents = st.text(min_size=1, max_size=30) | st.sampled_from(
    ["w", "x" * 256, "é" * 128, "𝄞" * 64, "job_0000000000000001", "job_7fffffffffffffff"]
)
bad_idents = st.sampled_from(["", "x" * 257, "é" * 129, "𝄞" * 65, "\x00" * 257])
job_ids = idents | st.integers(0, 2**63 - 1).map(lambda n: f"job_{n:016x}")
cursors = st.integers(0, 2**63 - 1).map(lambda n: f"job_{n:016x}")
bad_cursors = st.sampled_from(
    ["job_ffffffffffffffff", "job_8000000000000000", "job_", "nope", "job_000000000000000G",
     "JOB_0000000000000001", "job_0000000000000001\n", "job_00000000000000001", ""]
)  # fmt: skip


def draw_object(
    fields: dict[str, Field], *, break_it: bool | None = None
) -> st.SearchStrategy[tuple[Obj, str | None]]:
    """An object of ``fields`` and the field a refusal must name (None: valid).

    ``break_it``: True, exactly one mutation that must be refused; False, none; None,
    either. Mutations that must not matter (unknown fields, duplicate keys whose last
    value is the real one, another order) may come with either.
    """

    @st.composite
    def build(draw: st.DrawFn) -> tuple[Obj, str | None]:
        pairs: dict[str, Any] = {}
        for name, field in fields.items():
            if field.required or draw(st.booleans()):
                if field.excludes in pairs:
                    continue
                pairs[name] = draw(field.valid)
        # Values out of range get two shares: a wrong type is refused by the typing alone.
        kinds = ["missing", "wrong_type", "bad_value", "bad_value"]
        kind = draw(st.sampled_from(kinds)) if break_it else None
        if break_it is None and draw(st.booleans()):
            kind = draw(st.sampled_from(kinds))
        names: str | None = None
        if kind == "missing":
            required = [n for n, f in fields.items() if f.required]
            if required:
                name = draw(st.sampled_from(required))
                del pairs[name]
                names = fields[name].missing_names or name
        elif kind is not None:
            typed = [n for n, f in fields.items() if f.kind != "any" or f.bad is not None]
            if kind == "bad_value":
                typed = [n for n, f in fields.items() if f.bad is not None]
            if typed:
                name = draw(st.sampled_from(typed))
                field = fields[name]
                if kind == "wrong_type" and field.kind != "any":
                    value = draw(wrong_value(field.kind, field.nullable))
                else:
                    value = draw(field.bad)  # type: ignore[arg-type]
                if field.excludes is not None:
                    pairs.pop(field.excludes, None)
                pairs[name] = value
                names = name
        if break_it and names is None:  # nothing to break in this op: cannot happen
            raise AssertionError(f"no mutation applies to {sorted(fields)}")
        items = list(pairs.items())
        if draw(st.booleans()):
            items.append((draw(unknown_keys), draw(any_value)))
        # The order, and where a duplicate key goes, from one draw (a draw costs ~0.2 ms).
        layout = random.Random(draw(st.integers(0, 2**32 - 1)))
        layout.shuffle(items)
        if items and draw(st.booleans()):
            # A duplicate key before the real one: the last one counts.
            at = layout.randrange(len(items))
            items.insert(at, (items[at][0], draw(any_value)))
        return Obj(tuple(items)), names

    return build()


def object_of(fields: dict[str, Field]) -> st.SearchStrategy[Obj]:
    """A valid object of ``fields`` (required ones, and some optional ones)."""
    return draw_object(fields, break_it=False).map(lambda drawn: drawn[0])


def broken_object_of(fields: dict[str, Field]) -> st.SearchStrategy[Obj]:
    return draw_object(fields, break_it=True).map(lambda drawn: drawn[0])


def list_field(items: st.SearchStrategy[Any], broken_item: st.SearchStrategy[Any], most: int,
               **kw: Any) -> Field:  # fmt: skip
    """A list of 1 to ``most`` items; refused: empty, too long, or one broken item."""

    @st.composite
    def with_a_broken_item(draw: st.DrawFn) -> list[Any]:
        good = draw(st.lists(items, max_size=most - 1))
        at = draw(st.integers(0, len(good)))
        return [*good[:at], draw(broken_item), *good[at:]]

    bad = st.one_of(
        st.just([]),
        st.lists(items, min_size=most + 1, max_size=most + 2),
        with_a_broken_item(),
    )
    return Field("list", st.lists(items, min_size=1, max_size=most), bad=bad, **kw)


backoffs = st.one_of(
    st.builds(lambda d: {"kind": "fixed", "delay_ms": d}, in_range(0, LIMITS.max_backoff_ms)),
    st.integers(1, 300_000).flatmap(
        lambda base: st.fixed_dictionaries(
            {"kind": st.just("exponential")},
            optional={
                "base_ms": st.just(base),
                "max_ms": in_range(max(base, 300_000), LIMITS.max_backoff_ms),
                "jitter": st.booleans(),
            },
        )
    ),
)
bad_backoffs = st.sampled_from([
    {}, {"kind": "linear"}, {"kind": "fixed"}, {"kind": "fixed", "delay_ms": -1},
    {"kind": "fixed", "delay_ms": 1.5}, {"kind": "exponential", "base_ms": 0},
    {"kind": "exponential", "base_ms": 10, "max_ms": 5},
    {"kind": "exponential", "base_ms": 400_000}, {"kind": "exponential", "jitter": 1},
    {"kind": None}, {"kind": "fixed", "delay_ms": 2**64 - 1},
])  # fmt: skip

SUBMIT = {
    "queue": Field("str", queue_names, required=True, bad=bad_queue_names),
    # Any JSON value; refused: too large, or nested deeper than can be stored.
    "payload": Field(
        "any", json_values, required=True, bad=st.sampled_from(["x" * 2048, TOO_DEEP])
    ),
    "priority": Field(
        "str",
        st.sampled_from(["low", "normal", "high", "critical"]),
        bad=st.sampled_from(["", "NORMAL", "urgent", "normal "]),
    ),
    "delay_ms": int_field(0, LIMITS.max_delay_ms, nullable=True, excludes="run_at"),
    "run_at": int_field(0, 2**53, nullable=True, excludes="delay_ms"),
    "retries": int_field(0, LIMITS.max_retries),
    "backoff": Field("object", backoffs, nullable=True, bad=bad_backoffs),
    "idempotency_key": Field("str", idents, nullable=True, bad=bad_idents),
}
LEASE_REF = {
    "job_id": Field("str", job_ids, required=True, bad=bad_idents),
    "worker_id": Field("str", idents, required=True, bad=bad_idents),
    "token": Field("str", idents, required=True, bad=bad_idents),
}
ACK_ITEM = {
    "job_id": Field("str", job_ids, required=True, bad=bad_idents),
    "token": Field("str", idents, required=True, bad=bad_idents),
    "result": Field("any", json_values, bad=st.just(TOO_DEEP)),
}
DEAD_ONE = {"job_id": Field("str", job_ids, required=True, nullable=True, bad=bad_idents)}
DEAD_QUEUE = {
    "queue": Field(
        "str", queue_names, required=True, nullable=True, bad=bad_queue_names,
        missing_names="job_id",
    ),
    "all": Field("bool", st.just(True), required=True, bad=st.just(False)),
}  # fmt: skip
# A whole queue's cancel: also the states it takes (1 to 4 of the unfinished ones).
CANCEL_QUEUE = {
    **DEAD_QUEUE,
    "states": list_field(
        st.sampled_from(["pending", "ready", "retrying", "leased"]),
        st.sampled_from(["", "succeeded", "dead", "cancelled", "READY"])
        | wrong_value("str", False),
        4, nullable=True,
    ),
}  # fmt: skip
# A whole queue's bulk retry and purge (extension): the finished states each takes.
RETRY_QUEUE = {
    **DEAD_QUEUE,
    "states": list_field(
        st.sampled_from(["dead", "cancelled"]),
        st.sampled_from(["", "succeeded", "ready", "DEAD"]) | wrong_value("str", False),
        2, nullable=True,
    ),
}  # fmt: skip
PURGE_QUEUE = {
    **DEAD_QUEUE,
    "states": list_field(
        st.sampled_from(["dead", "succeeded", "cancelled"]),
        st.sampled_from(["", "ready", "leased", "DEAD"]) | wrong_value("str", False),
        3, nullable=True,
    ),
}  # fmt: skip

# A schedule: names as queue names; five fields (the fuzzed server allows no seconds).
SCHEDULE_ONE = {"name": Field("str", queue_names, required=True, bad=bad_queue_names)}
SCHEDULE_PUT = {
    **SCHEDULE_ONE,
    "cron": Field(
        "str", st.sampled_from(["* * * * *", "@daily", "0 3 * * MON-FRI", "*/15 9-17 * * *"]),
        required=True,
        bad=st.sampled_from(["", "61 * * * *", "* * *", "@reboot", "* * * * * *", "0 0 30 2 *"]),
    ),
    "queue": SUBMIT["queue"],
    "payload": SUBMIT["payload"],
    "priority": SUBMIT["priority"],
    "retries": SUBMIT["retries"],
    "backoff": SUBMIT["backoff"],
    "timeout_ms": int_field(1, LIMITS.max_timeout_ms, nullable=True),
    "timezone": Field(
        "str", st.sampled_from(["UTC", "Europe/Berlin", "America/New_York"]),
        bad=st.sampled_from(["", "Mars/Base", "Europe/", "../etc/passwd"]),
    ),
    "catch_up": Field(
        "str", st.sampled_from(["latest", "none", "all"]),
        bad=st.sampled_from(["", "ALL", "some", "latest "]),
    ),
    "catch_up_max": int_field(1, 1000),
}  # fmt: skip

# (op, its fields); the dead letter ops come in their two forms.
OPS: list[tuple[str, dict[str, Field]]] = [
    (
        "hello",
        {
            "client": Field("str", st.text(max_size=20), nullable=True, bad=st.just("x" * 257)),
            "token": Field("str", st.text(max_size=20), nullable=True, bad=st.just("é" * 129)),
        },
    ),
    ("ping", {}),
    ("stats", {}),
    ("submit", SUBMIT),
    (
        "submit_batch",
        {"jobs": list_field(object_of(SUBMIT), broken_object_of(SUBMIT), LIMITS.max_batch,
                            required=True)},
    ),
    (
        "lease",
        {
            "queues": list_field(
                queue_names, bad_queue_names | wrong_value("str", False),
                LIMITS.max_queues_per_lease, required=True,
            ),
            "worker_id": Field("str", idents, required=True, bad=bad_idents),
            "count": int_field(1, LIMITS.max_batch),
            "lease_ms": int_field(1, LIMITS.max_lease_ms),
            "wait_ms": int_field(0, LIMITS.max_wait_ms),
        },
    ),
    ("renew", {**LEASE_REF, "lease_ms": int_field(1, LIMITS.max_lease_ms)}),
    ("ack", {**LEASE_REF, "result": ACK_ITEM["result"]}),
    (
        "ack_batch",
        {
            "worker_id": Field("str", idents, required=True, bad=bad_idents),
            "acks": list_field(object_of(ACK_ITEM), broken_object_of(ACK_ITEM),
                               LIMITS.max_batch, required=True),
        },
    ),
    (
        "fail",
        {
            **LEASE_REF,
            "error": Field("str", st.text(max_size=40), required=True),
            "retryable": Field("bool", st.booleans()),
        },
    ),
    ("release", LEASE_REF),
    ("inspect", {"job_id": LEASE_REF["job_id"]}),
    (
        "short_ids",
        {"job_ids": list_field(cursors, bad_cursors | wrong_value("str", False), LIMITS.max_batch,
                               required=True)},
    ),
    (
        "dead_list",
        {
            "queue": Field("str", queue_names, nullable=True, bad=bad_queue_names),
            "limit": int_field(1, LIMITS.max_dead_list),
            "cursor": Field("str", cursors, nullable=True, bad=bad_cursors),
            "order": Field("str", st.sampled_from(["oldest", "newest"]),
                           bad=st.sampled_from(["", "newer", "NEWEST", "oldest "])),
        },
    ),
    ("dead_retry", DEAD_ONE),
    ("dead_retry", DEAD_QUEUE),
    ("dead_retry", RETRY_QUEUE),
    ("dead_purge", DEAD_ONE),
    ("dead_purge", DEAD_QUEUE),
    ("dead_purge", PURGE_QUEUE),
    ("cancel", DEAD_ONE),
    ("cancel", CANCEL_QUEUE),
    (
        "jobs_list",
        {
            "queue": Field("str", queue_names, nullable=True, bad=bad_queue_names),
            "states": list_field(
                st.sampled_from(
                    ["pending", "ready", "leased", "retrying", "succeeded", "dead", "cancelled"]
                ),
                st.sampled_from(["", "gone", "READY"]) | wrong_value("str", False), 7,
                nullable=True,
            ),
            "search": Field("str", cursors, nullable=True, bad=st.just("")),
            "cursor": Field("str", cursors, nullable=True, bad=bad_cursors),
            "limit": int_field(1, 100),
            "order": Field("str", st.sampled_from(["oldest", "newest"]),
                           bad=st.sampled_from(["", "newer", "NEWEST", "oldest "])),
        },
    ),
    ("promote", {"job_id": LEASE_REF["job_id"]}),
    (
        "watch",
        {
            "queues": list_field(queue_names, bad_queue_names | wrong_value("str", False), 256,
                                 nullable=True),
            "states": list_field(
                st.sampled_from(
                    ["pending", "ready", "leased", "retrying", "succeeded", "dead", "cancelled"]
                ),
                st.sampled_from(["", "gone", "READY"]) | wrong_value("str", False), 7,
                nullable=True,
            ),
        },
    ),
    ("unwatch", {}),
    ("queue_pause", {"queue": Field("str", queue_names, required=True, bad=bad_queue_names)}),
    ("queue_resume", {"queue": Field("str", queue_names, required=True, bad=bad_queue_names)}),
    (
        "queue_list",
        {
            "cursor": Field("str", queue_names, nullable=True, bad=bad_queue_names),
            "limit": int_field(1, 1000),
        },
    ),
    (
        "queue_config",
        {
            "queue": Field("str", queue_names, required=True, bad=bad_queue_names),
            "paused": Field("bool", st.booleans()),
            "max_leased": int_field(1, 1_000_000, nullable=True),
            "rate": Field(
                "object",
                st.fixed_dictionaries(
                    {"limit": in_range(1, 1_000_000), "period_ms": in_range(1, 86_400_000)}
                ),
                nullable=True,
                bad=st.sampled_from([{"limit": 0, "period_ms": 1000}, {"limit": 5},
                                     {"limit": 5, "period_ms": 86_400_001}, {}]),
            ),
            "default_timeout_ms": int_field(1, LIMITS.max_timeout_ms, nullable=True),
            "default_retries": int_field(0, LIMITS.max_retries, nullable=True),
            "default_backoff": Field("object", backoffs, nullable=True, bad=bad_backoffs),
        },
    ),
    ("schedule_put", SCHEDULE_PUT),
    ("schedule_delete", SCHEDULE_ONE),
    ("schedule_pause", SCHEDULE_ONE),
    ("schedule_resume", SCHEDULE_ONE),
    (
        "schedule_list",
        {
            "cursor": Field("str", queue_names, nullable=True, bad=bad_queue_names),
            "limit": int_field(1, 1000),
        },
    ),
    ("reload", {}),
    (
        "workers_list",
        {
            "cursor": Field(
                "str", st.integers(0, 10**19).map(str), nullable=True,
                bad=st.sampled_from(["", "x", "-1", "1.5", "1" * 21, "\u0661"]),
            ),
            "limit": int_field(1, 100),
        },
    ),
    (
        "history",
        {
            "queue": Field("str", queue_names, nullable=True, bad=bad_queue_names),
            # (from before to, at most 1,440 steps apart: whatever each is, within these)
            "from": Field("int", in_range(0, 1_000_000), nullable=True,
                          bad=out_of_range(0, 2**53)),
            "to": Field("int", in_range(2_000_000, 60_000_000), nullable=True,
                        bad=out_of_range(0, 2**53)),
            "step": Field("int", st.integers(1, 1440).map(lambda n: n * 60_000),
                          bad=st.sampled_from([0, 59_999, 60_001, -60_000, 5_184_060_000])),
        },
    ),
]  # fmt: skip
assert {op for op, _ in OPS} == set(REQUEST_TYPES)

# Every field name any request knows: an "unknown field" added to a request is none of them.
KNOWN_FIELDS = {"op", "id"} | {name for _, fields in OPS for name in fields} | {
    "delay_ms", "base_ms", "max_ms", "jitter", "kind", "acks", "jobs", "all", "queue",
}  # fmt: skip
unknown_keys = st.sampled_from(["future", "", "OP", "Id", "queue ", "é", "__init__"]) | st.text(
    max_size=6
).filter(lambda k: k not in KNOWN_FIELDS)

# -- nearly right ---------------------------------------------------------------------------


valid_ids = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=20),
    st.sampled_from([0, -1, 2**64 - 1, -(2**63), "", "x" * 256, "é" * 256]),
)
bad_ids = st.one_of(
    st.sampled_from([True, False, 1.0, -0.0, 1e300, [], [1], {}, {"id": 1}, "x" * 257]),
    st.floats(allow_nan=False, allow_infinity=False),
)
unknown_ops = st.one_of(
    st.sampled_from(["", "Submit", "submit ", "nop", "__class__", "_ops", "dispatch"]),
    st.text(max_size=12),
).filter(lambda op: op not in REQUEST_TYPES)


# Each op's objects, made once (a composite strategy made per draw costs milliseconds).
OP_OBJECTS = [(op, draw_object(fields)) for op, fields in OPS]


@attrs.frozen
class Case:
    line: bytes
    op: str | None = None
    # What the reply must be: "accept", or an error code and the field it names (None:
    # any), or None when only the invariants apply.
    expect: str | tuple[str, str | None] | None = None


@st.composite
def nearly_right(draw: st.DrawFn, which: int | None = None) -> Case:
    """A request of the op ``OPS[which]`` (any op if None), nearly right."""
    op, objects = draw(st.sampled_from(OP_OBJECTS)) if which is None else OP_OBJECTS[which]
    obj, names = draw(objects)
    head: list[tuple[str, Any]] = [("op", op)]
    expect: str | tuple[str, str | None] | None = (
        "accept" if names is None else ("bad_request", names)
    )
    head_kind = draw(st.sampled_from(["id", "id", "id", "no id", "bad id", "op"]))
    if head_kind == "id":
        head.append(("id", draw(valid_ids)))
    elif names is None and head_kind == "bad id":
        head.append(("id", draw(bad_ids)))
        expect = ("bad_request", "id")
    elif names is None and head_kind == "op":
        how = draw(st.sampled_from(["unknown", "type", "missing"]))
        head = [] if how == "missing" else [("op", draw(unknown_ops))]
        expect = ("unknown_op", None)
        if how != "unknown":
            expect = ("bad_request", "op")
            if how == "type":
                head = [("op", draw(wrong_value("str", False)))]
    # The op and id go anywhere among the fields, which keep their order (a duplicate key
    # stays before the one that counts).
    pairs = list(obj.pairs)
    layout = random.Random(draw(st.integers(0, 2**32 - 1)))
    for pair in head:
        pairs.insert(layout.randint(0, len(pairs)), pair)
    if pairs and layout.random() < 0.2:
        # A token that is no JSON, or odd JSON, in place of a value: invariants only.
        at = layout.randrange(len(pairs))
        pairs[at] = (pairs[at][0], draw(raw_tokens))
        expect = None
    return Case(render(Obj(tuple(pairs))), op, expect)


@st.composite
def garbled(draw: st.DrawFn) -> Case:
    """A nearly right request cut short, or with a byte changed or inserted."""
    line = draw(nearly_right()).line
    at = draw(st.integers(0, len(line)))
    how = draw(st.sampled_from(["cut", "flip", "insert", "bom", "pad"]))
    if how == "cut":
        line = line[:at]
    elif how == "bom":
        line = b"\xef\xbb\xbf" + line
    elif how == "pad":
        line = b" \t\r" + line + b" \t"
    else:
        byte = bytes([draw(st.integers(0, 255).filter(lambda b: b != 10))])
        line = line[:at] + byte + line[at + (how == "flip") :]
    return Case(line)


def no_newline(data: bytes) -> bytes:
    return data.replace(b"\n", b"")


frames = st.one_of(
    # Weighted: most frames are nearly right, so most reach the typed checks.
    nearly_right(), nearly_right(), nearly_right(), nearly_right(), nearly_right(),
    nearly_right(), garbled(),
    st.binary(max_size=200).map(lambda b: Case(no_newline(b))),
    st.builds(lambda v: Case(render(v)), json_values),
    st.builds(
        lambda op, d: Case(render({"op": op, **d})),
        st.sampled_from(sorted(REQUEST_TYPES)), st.dictionaries(st.text(max_size=8), any_value),
    ),
)  # fmt: skip

# Hypothesis draws a few frames per example, and favours simple ones: left to chance, some
# mutations of some ops would come up once in several runs. So the frames of an example
# are one nearly right request of every op (in either form), in any order, among others.
every_op = st.tuples(
    st.tuples(*(nearly_right(i) for i in range(len(OPS)))),
    st.lists(frames, max_size=4),
).flatmap(lambda drawn: st.permutations([*drawn[0], *drawn[1]]))

# -- the frame reader and the dispatcher, with fakes ------------------------------------------


class RecordingWriter:
    """Takes every item and command, answers none (a command counts 0)."""

    def full(self) -> bool:
        return False

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.commands: list[Any] = []

    def put(self, item: Any) -> None:
        self.items.append(item)

    async def execute(self, command: Any) -> Any:
        self.commands.append(command)
        if isinstance(command, cmd.LeasesHeld):  # (workers_list: no lease held, at 0)
            return [], 0
        return 0

    async def wait_room(self) -> None:
        pass


class FakeConnection(DispatchConnection):
    """The dispatch tests' connection, which also checks that each reply is one line and
    takes a watch (no event is ever recorded here)."""

    def reply_room(self) -> int:
        return 2**40

    def unsent_bytes(self) -> int:
        return 0

    async def wait_sent(self) -> None:
        await trio.sleep_forever()

    def push(self, data: bytes) -> None:
        raise AssertionError("no events without a store")

    def reply(self, data: bytes) -> None:
        assert data.endswith(b"\n") and data.count(b"\n") == 1, data
        super().reply(data)

    def deliver(self, pairs: list[tuple[Any, Any]]) -> None:
        raise AssertionError("the fake writer answers nothing")

    def still_wanted(self) -> bool:
        return True


def reply_id(line: bytes) -> Any:
    """The id a reply to ``line`` must carry: the request's, if it is a valid one."""
    try:
        fields = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    request_id = fields.get("id") if type(fields) is dict else None
    return request_id if wire.valid_id(request_id) else None


def check_error(reply: dict[str, Any]) -> str:
    assert reply["ok"] is False, reply
    error = reply["error"]
    assert error["code"] in ERROR_CODES, reply
    assert type(error["message"]) is str and error["message"]
    return error["code"]


def stream_of(lines: list[bytes], crlf: bool) -> bytes:
    return b"".join(line + (b"\r\n" if crlf else b"\n") for line in lines)


def chunked(data: bytes, cuts: list[int], at_newlines: bool) -> list[bytes]:
    """``data`` cut at ``cuts`` (modulo its length), and if ``at_newlines`` also just
    before each newline and its \\r: where a frame is complete but not yet ended."""
    points = {c % (len(data) + 1) for c in cuts}
    if at_newlines:
        ends = [i for i, byte in enumerate(data) if byte == 10]
        points.update(ends)
        points.update(i - 1 for i in ends if data[i - 1 : i] == b"\r")
    bounds = [0, *sorted(points), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def frame_of_size(size: int) -> bytes:
    """A ping of exactly ``size`` bytes (padded with spaces)."""
    head = b'{"op":"ping","id":"exact"'
    return head + b" " * (size - len(head) - 1) + b"}"


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(
    cases=every_op,
    cuts=st.lists(st.integers(0, 2**20), max_size=8),
    at_newlines=st.booleans(),
    crlf=st.booleans(),
    # At the end: a frame of exactly the limit (answered), or one byte over it (closes),
    # then another frame or none.
    last=st.sampled_from([None, "exact", "over", "over, unterminated"]),
)
async def test_each_frame_is_answered_once_or_accepted_never_internal(
    cases, cuts, at_newlines, crlf, last
):
    if last == "exact":
        cases = [*cases, Case(frame_of_size(LIMITS.max_frame_bytes), "ping", "accept")]
    lines = [case.line for case in cases]
    # The reader strips one \r before the \n (a line sent with \n alone may end in one).
    expected_lines = [line if crlf or not line.endswith(b"\r") else line[:-1] for line in lines]
    data = stream_of(lines, crlf)
    if last == "over":
        data += stream_of([b"x" * (LIMITS.max_frame_bytes + 1), b'{"op":"ping"}'], crlf)
    elif last == "over, unterminated":
        data += b"x" * (LIMITS.max_frame_bytes + 1)
    splitter = framing.LineSplitter(LIMITS.max_frame_bytes)
    got: list[bytes] = []
    for chunk in chunked(data, cuts, at_newlines):
        got += splitter.feed(chunk)
        assert splitter.buffered <= LIMITS.max_frame_bytes + 1
    # Every frame is cut out whole, whatever the chunking; an oversized one closes
    # the connection: nothing after it is returned.
    assert got == expected_lines
    assert splitter.overflow == (last is not None and last.startswith("over"))

    writer = RecordingWriter()
    watchers = Watchers(writer, LIMITS.max_watchers, LIMITS.max_watch_buffer)  # type: ignore[arg-type]
    dispatcher = Dispatcher(writer, LIMITS, LongPolls(writer), watchers=watchers)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        connection = FakeConnection(nursery, dispatcher)
        for case, line in zip(cases, got, strict=True):
            n_replies, n_items, n_commands = (
                len(connection.replies), len(writer.items), len(writer.commands),
            )  # fmt: skip
            dispatcher.dispatch(connection, line, trio.current_time())
            await trio.testing.wait_all_tasks_blocked()  # a whole-queue dead op's task
            replies = connection.replies[n_replies:]
            items = writer.items[n_items:]
            commands = writer.commands[n_commands:]
            want_id = reply_id(line)
            if items:  # accepted, for the writer: handed over exactly once, no reply yet
                assert len(items) == 1 and not replies and not commands, (replies, commands)
                op, item_connection, item_id = items[0][:3]
                assert op.name == case.op or case.op is None
                assert item_connection is connection and item_id == want_id
                outcome = "accept"
            else:
                assert len(replies) == 1, replies
                (reply,) = replies
                assert reply["id"] == want_id
                if reply["ok"]:  # answered at once: hello, ping, stats (from the counts in
                    # memory), reload (nothing to reload here), workers_list (no worker
                    # here: no read), or a whole queue's dead op
                    name = orjson.loads(line)["op"]
                    queue_ops = ("dead_retry", "dead_purge", "cancel")
                    ops_now = ("hello", "ping", "unwatch", "stats", "reload", "workers_list",
                               *queue_ops)  # fmt: skip
                    assert name in ops_now, reply
                    # (workers_list reads the leases of the workers it lists, if any)
                    assert (name in queue_ops) == bool(commands) or name == "workers_list"
                    assert len(commands) <= 1
                    outcome = "accept"
                else:
                    assert not commands
                    outcome = check_error(reply)
            event(f"outcome: {outcome}")
            if case.expect == "accept":
                assert outcome == "accept", (replies, case)
            elif case.expect is not None:
                code, field = case.expect
                assert outcome == code, (replies, items, case)
                message = replies[0]["error"]["message"]
                assert field is None or message.startswith(field), (replies, case)
        watchers.unwatch(connection)  # its pump would wait for events forever
    # Nothing answered counts as answered: in flight are exactly the items handed over.
    assert dispatcher.in_flight == len(writer.items) == connection.in_flight


# -- a real server ------------------------------------------------------------------------------

_databases = itertools.count()


async def send_and_read_all(client: LineClient, data: bytes) -> tuple[list[dict[str, Any]], bool]:
    """Send ``data`` then EOF while reading every reply line until the server closes.
    Returns the replies, and whether the connection was reset rather than closed."""
    replies: list[dict[str, Any]] = []
    reset = False

    async def send() -> None:
        try:
            await client.send_raw(data)
            await client.stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # closed over a frame too large: the rest is not read

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            while True:
                try:
                    line = await client.read_line()
                except trio.BrokenResourceError:
                    reset = True
                    break
                if line is None:
                    break
                message = orjson.loads(line)
                if "event" not in message:  # a watch's events answer no request
                    replies.append(message)
    return replies, reset


@settings(
    deadline=None,
    max_examples=20,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    # Every op, so that the valid ones among them reach the store with odd values too.
    cases=every_op,
    crlf=st.booleans(),
    last=st.sampled_from([None, "exact", "over"]),
)
async def test_a_server_answers_every_bad_frame_and_keeps_serving(tmp_path, cases, crlf, last):
    lines = [case.line for case in cases]
    if last == "exact":
        lines.append(frame_of_size(LIMITS.max_frame_bytes))
    data = stream_of(lines, crlf)
    oversized = last == "over"
    if oversized:
        data += b"y" * (LIMITS.max_frame_bytes + 100) + b"\n"
    db = str(tmp_path / f"fuzz-{next(_databases)}.db")
    # A server per example: ~20 ms to start and stop (no metrics endpoint).
    start = functools.partial(start_server, limits=LIMITS)
    async with serving(start, db) as server:
        first = LineClient(await trio.open_tcp_stream("127.0.0.1", server.port))
        try:
            replies, reset = await send_and_read_all(first, data)
        finally:
            await first.aclose()
        assert not reset, "the server reset the connection instead of closing it"
        # One reply per frame, matched by id (replies may come in another order), and
        # a last frame_too_large (with no id) if a frame was over the limit.
        want = Counter(orjson.dumps(reply_id(line)) for line in lines)
        if oversized:
            want[b"null"] += 1
            assert replies[-1]["error"]["code"] == "frame_too_large"
        assert Counter(orjson.dumps(r["id"]) for r in replies) == want, replies
        for reply in replies:
            if not reply["ok"]:
                check_error(reply)
            for result in reply.get("results", []):  # an ack_batch's acks, one by one
                if result.get("ok") is False:
                    check_error(result)
        for reply in replies:
            event("server: " + ("ok" if reply["ok"] else reply["error"]["code"]))

        # A second connection is served as if nothing had happened.
        second = LineClient(await trio.open_tcp_stream("127.0.0.1", server.port))
        try:
            await second.ok("ping")
            queue = "check:after-fuzz"
            submitted = await second.ok("submit", queue=queue, payload={"n": 1})
            leased = await second.ok("lease", queues=[queue], worker_id="w-check")
            (job,) = leased["jobs"]
            assert job["job_id"] == submitted["job_id"] and job["payload"] == {"n": 1}
            acked = await second.ok(
                "ack", job_id=job["job_id"], worker_id="w-check", token=job["token"]
            )
            assert acked["state"] == "succeeded"
        finally:
            await second.aclose()
