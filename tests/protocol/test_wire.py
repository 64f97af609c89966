"""The wire codec: framing, typed parsing, and reply encoding."""

from __future__ import annotations

import attrs
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.protocol import framing, parsing, requests, wire
from relay.protocol.errors import BadRequest, UnknownOp
from relay.protocol.model import (
    DEFAULT_BACKOFF,
    DEFAULT_MAX_ATTEMPTS,
    JobInfo,
    JobState,
    Lease,
    Priority,
)

LIMITS = wire.Limits()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


def parse(**fields):
    return parsing.parse_request(parsing.decode_frame(orjson.dumps(fields)), LIMITS)


@given(
    lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=20),
    cuts=st.lists(st.integers(0, 2000), max_size=10),
    crlf=st.booleans(),
)
def test_splitter_returns_each_line_whatever_the_chunking(lines, cuts, crlf):
    # Lines that end in \r would be ambiguous with \r\n; the contract strips one \r.
    lines = [line.rstrip(b"\r") for line in lines]
    stream = b"".join(line + (b"\r\n" if crlf else b"\n") for line in lines)
    splitter = framing.LineSplitter(100)
    out = []
    start = 0
    for cut in [*sorted({c % (len(stream) + 1) for c in cuts}), len(stream)]:
        out += splitter.feed(stream[start:cut])
        start = cut
    assert out == lines
    assert splitter.buffered == 0 and not splitter.overflow


def test_splitter_flags_overflow_without_buffering_past_the_limit():
    splitter = framing.LineSplitter(10)
    assert splitter.feed(b"0123456789") == []
    assert not splitter.overflow
    assert splitter.feed(b"A") == []
    assert splitter.overflow
    assert splitter.buffered == 0
    assert splitter.feed(b"more\n") == []


def test_splitter_returns_lines_before_an_oversized_one():
    splitter = framing.LineSplitter(4)
    assert splitter.feed(b"ok\nmuch too long\nlater\n") == [b"ok"]
    assert splitter.overflow


def test_a_line_of_exactly_the_limit_is_accepted_also_with_crlf():
    splitter = framing.LineSplitter(4)
    assert splitter.feed(b"abcd\r") == []
    assert splitter.feed(b"\n") == [b"abcd"]
    assert not splitter.overflow


@given(payload=json_values)
def test_submit_payload_round_trips_through_the_store_text(payload):
    spec = parse(op="submit", queue="q", payload=payload)
    assert orjson.loads(spec.payload) == payload


def test_submit_defaults_match_the_contract():
    spec = parse(op="submit", queue="q", payload=1)
    assert spec.priority == Priority.NORMAL
    assert spec.delay_ms == 0 and spec.run_at is None
    # Left to the store, which gives the queue's defaults, else the protocol's (retries 3,
    # exponential 1000/300000 with jitter, no timeout: tests/store/test_queue_defaults.py).
    assert (spec.max_attempts, spec.backoff, spec.timeout_ms) == (None, None, None)
    assert (DEFAULT_MAX_ATTEMPTS, attrs.astuple(DEFAULT_BACKOFF)) == (
        4,
        ("exponential", 1000, 300000, True),
    )


@pytest.mark.parametrize("op", ["submit", "submit_batch"])
def test_submit_fields_given_are_kept_also_when_they_are_the_protocols_defaults(op):
    given = {"queue": "q", "payload": 1, "retries": 3, "backoff": {"kind": "exponential"}}
    left_out = {"queue": "q", "payload": 1}
    # Each on the fast path (plain) and the full one (run_at).
    for fields, expected in ((given, (4, DEFAULT_BACKOFF)), (left_out, (None, None))):
        for job in (fields, {**fields, "run_at": 5}):
            if op == "submit":
                spec = parse(op="submit", **job)
            else:
                [spec] = parse(op="submit_batch", jobs=[job])
            assert (spec.max_attempts, spec.backoff) == expected


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"op": "submit", "payload": 1}, "queue"),
        ({"op": "submit", "queue": "q"}, "payload"),
        ({"op": "submit", "queue": "q", "payload": 1, "retries": "3"}, "retries"),
        ({"op": "submit", "queue": "q", "payload": 1, "retries": True}, "retries"),
        ({"op": "submit", "queue": "q", "payload": 1, "retries": -1}, "retries"),
        ({"op": "submit", "queue": "q", "payload": 1, "delay_ms": -5}, "delay_ms"),
        ({"op": "submit", "queue": "q", "payload": 1, "delay_ms": 1, "run_at": 5}, "delay_ms"),
        ({"op": "submit", "queue": "bad name", "payload": 1}, "queue"),
        ({"op": "submit", "queue": "q" * 129, "payload": 1}, "queue"),
        ({"op": "submit", "queue": "q", "payload": 1, "priority": "urgent"}, "priority"),
        ({"op": "submit", "queue": "q", "payload": 1, "backoff": {"kind": "x"}}, "backoff.kind"),
        (
            {"op": "submit", "queue": "q", "payload": 1, "backoff": {"kind": "fixed"}},
            "backoff.delay_ms",
        ),
        (
            {
                "op": "submit",
                "queue": "q",
                "payload": 1,
                "backoff": {"kind": "exponential", "base_ms": 10, "max_ms": 5},
            },
            "backoff.max_ms",
        ),
        (
            {"op": "submit", "queue": "q", "payload": 1, "idempotency_key": "k" * 257},
            "idempotency_key",
        ),
        ({"op": "submit_batch", "jobs": []}, "jobs"),
        ({"op": "submit_batch", "jobs": [{"queue": "q", "payload": 1}, 5]}, "jobs[1]"),
        (
            {"op": "submit_batch", "jobs": [{"queue": "q", "payload": 1}, {"queue": "q"}]},
            "jobs[1].payload",
        ),
        ({"op": "lease", "queues": [], "worker_id": "w"}, "queues"),
        ({"op": "lease", "queues": ["q"] * 17, "worker_id": "w"}, "queues"),
        ({"op": "lease", "queues": ["q"], "worker_id": ""}, "worker_id"),
        ({"op": "lease", "queues": ["q"], "worker_id": "w", "count": 0}, "count"),
        ({"op": "lease", "queues": ["q"], "worker_id": "w", "lease_ms": 0}, "lease_ms"),
        (
            {"op": "lease", "queues": ["q"], "worker_id": "w", "lease_ms": LIMITS.max_lease_ms + 1},
            "lease_ms",
        ),
        (
            {"op": "lease", "queues": ["q"], "worker_id": "w", "wait_ms": LIMITS.max_wait_ms + 1},
            "wait_ms",
        ),
        ({"op": "ack", "job_id": "j", "worker_id": "w"}, "token"),
        ({"op": "fail", "job_id": "j", "worker_id": "w", "token": "t"}, "error"),
        ({"op": "fail", "job_id": "j", "worker_id": "w", "token": "t", "error": 5}, "error"),
        ({"op": "dead_list", "limit": 0}, "limit"),
        ({"op": "dead_retry", "queue": "q"}, "all"),
        ({"op": "dead_retry"}, "job_id"),
        ({"op": "dead_purge", "job_id": "j", "queue": "q", "all": True}, "job_id"),
        ({"op": 5}, "op"),
        ({"op": "ping", "id": [1]}, "id"),
        ({"op": "ping", "id": 1.5}, "id"),
    ],
)
def test_invalid_fields_are_bad_requests_naming_the_field(fields, field):
    with pytest.raises(BadRequest) as caught:
        parse(**fields)
    assert caught.value.field == field
    assert caught.value.message.startswith(field)


def test_payload_over_the_limit_is_refused():
    limits = wire.Limits(max_payload_bytes=10)
    frame = parsing.decode_frame(orjson.dumps({"op": "submit", "queue": "q", "payload": "x" * 9}))
    with pytest.raises(BadRequest, match="payload"):
        parsing.parse_request(frame, limits)


# Deeper than orjson writes (254 levels), within what it reads (1,024).
DEEP = b"[" * 300 + b"]" * 300


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (b'{"op":"submit","queue":"q","payload":%s}', "payload"),
        (b'{"op":"submit","queue":"q","backoff":{"kind":"fixed"},"payload":%s}', "payload"),
        (b'{"op":"submit_batch","jobs":[{"queue":"q","payload":1},{"queue":"q","payload":%s}]}',
         "jobs[1].payload"),
        (b'{"op":"ack","job_id":"j","worker_id":"w","token":"t","result":%s}', "result"),
        (b'{"op":"ack_batch","worker_id":"w","acks":[{"job_id":"j","token":"t","result":%s}]}',
         "acks[0].result"),
    ],
)  # fmt: skip
def test_json_nested_too_deeply_to_store_is_a_bad_request_naming_the_field(line, field):
    """Not an internal error: the value is the client's, and it is refused before use."""
    frame = parsing.decode_frame(line % DEEP)
    with pytest.raises(BadRequest) as caught:
        request = parsing.parse_request(frame, wire.Limits())
        if isinstance(request, requests.Ack):
            request.result_text(wire.Limits())
    assert caught.value.field == field
    assert "nested too deeply" in caught.value.message


def test_a_base_over_the_default_max_asks_for_max_ms_rather_than_misreport_it():
    backoff = {"kind": "exponential", "base_ms": 600_000}
    with pytest.raises(BadRequest) as caught:
        parse(op="submit", queue="q", payload=1, backoff=backoff)
    assert caught.value.field == "backoff.max_ms"
    assert "required when base_ms is over its default 300000" in caught.value.message
    spec = parse(op="submit", queue="q", payload=1, backoff={**backoff, "max_ms": 600_000})
    assert (spec.backoff.base_ms, spec.backoff.max_ms) == (600_000, 600_000)


def test_unknown_op_is_its_own_error():
    with pytest.raises(UnknownOp):
        parse(op="explode")


@pytest.mark.parametrize("line", [b"", b"nope", b"[1,2]", b'"text"', b"{", b"\xff\xfe"])
def test_lines_that_are_not_json_objects_are_bad_requests(line):
    with pytest.raises(BadRequest):
        parsing.decode_frame(line)


def test_unknown_fields_are_ignored_for_forward_compatibility():
    request = parse(op="lease", queues=["q"], worker_id="w", future_field=1)
    assert request.queues == ["q"]


def test_lease_reply_embeds_the_payload_text_as_json():
    lease = Lease("job_0000000000000001", "q", '{"a":[1,2]}', 2, 1, 4, "t" * 32, 99)
    reply = orjson.loads(wire.encode_ok(7, {"jobs": [wire.lease_fields(lease)]}))
    assert reply == {
        "id": 7,
        "ok": True,
        "jobs": [
            {
                "job_id": "job_0000000000000001",
                "queue": "q",
                "payload": {"a": [1, 2]},
                "priority": "high",
                "attempt": 1,
                "max_attempts": 4,
                "token": "t" * 32,
                "lease_expires_at": 99,
            }
        ],
    }


def test_job_fields_leave_out_what_is_unset():
    info = JobInfo("job_0000000000000001", "q", JobState.READY, 1, "null", 0, 4, 5, ready_at=5)
    fields = orjson.loads(orjson.dumps(wire.job_fields(info)))
    assert fields == {
        "job_id": "job_0000000000000001",
        "queue": "q",
        "state": "ready",
        "priority": "normal",
        "payload": None,
        "attempt": 0,
        "max_attempts": 4,
        "created_at": 5,
        "ready_at": 5,
        "errors": [],
    }


submit_values = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 2_000), st.text(max_size=6),
    st.sampled_from(["q", "email", "bad name", "", "normal", "high", "urgent", "k" * 300]),
    st.lists(st.integers(), max_size=2),
)  # fmt: skip
submit_dicts = st.dictionaries(
    st.sampled_from(
        ["queue", "payload", "priority", "retries", "delay_ms", "idempotency_key", "run_at",
         "backoff", "op", "id", "extra"]
    ),
    submit_values,
    max_size=8,
).map(lambda d: {"queue": "q", "payload": 1, **d})  # fmt: skip


@given(submit_dicts)
def test_the_fast_submit_path_agrees_with_the_full_path(job):
    """Whatever the fast path accepts, the full path accepts and turns into the same spec;
    what it declines, the full path parses or refuses on its own."""
    fast = wire.fast_submit_spec(job, LIMITS)
    try:
        full = parsing.structure(job, requests.Submit).to_spec(LIMITS)
    except BadRequest:
        full = None
    if fast is not None:
        assert fast == full


@pytest.mark.parametrize(
    "job",
    [
        {"queue": "q", "payload": {"a": [1]}},
        {"op": "submit", "id": 3, "queue": "email", "payload": None, "priority": "high",
         "retries": 0, "delay_ms": 500, "idempotency_key": "k"},
    ],
)  # fmt: skip
def test_plain_submits_take_the_fast_path(job):
    fast = wire.fast_submit_spec(job, LIMITS)
    assert fast is not None
    assert fast == parsing.structure(job, requests.Submit).to_spec(LIMITS)


@pytest.mark.parametrize(
    "extra",
    [{"backoff": {"kind": "fixed", "delay_ms": 5}}, {"run_at": 5}, {"unknown": 1},
     {"retries": True}, {"priority": ["high"]}, {"queue": ["q"]}],
)  # fmt: skip
def test_anything_unusual_leaves_the_fast_path(extra):
    assert wire.fast_submit_spec({"queue": "q", "payload": 1, **extra}, LIMITS) is None


# -- ack_batch (an extension) -------------------------------------------------------------


def test_ack_batch_parses_into_one_tuple_per_ack_in_order():
    acks = parse(
        op="ack_batch",
        worker_id="w",
        acks=[
            {"job_id": "j1", "token": "t1"},
            {"job_id": "j2", "token": "t2", "result": {"a": [1, None]}},
            {"job_id": "j1", "token": "t3", "result": None, "unknown": 5},
        ],
    )
    assert acks[:2] == (("j1", "w", "t1", None), ("j2", "w", "t2", '{"a":[1,null]}'))
    # A job acked again in the batch: answered here, never sent to the store.
    assert isinstance(acks[2], BadRequest) and acks[2].code == "bad_request"
    assert str(acks[2]).startswith("acks[2].job_id: acked by acks[0] of this batch")


@given(result=json_values)
def test_ack_batch_result_round_trips_through_the_store_text(result):
    ((_, _, _, text),) = parse(
        op="ack_batch", worker_id="w", acks=[{"job_id": "j", "token": "t", "result": result}]
    )
    assert (None if text is None else orjson.loads(text)) == result


OK_ACK = {"job_id": "j", "token": "t"}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"worker_id": "w"}, "acks"),
        ({"worker_id": "w", "acks": "x"}, "acks"),
        ({"worker_id": "w", "acks": {"job_id": "j", "token": "t"}}, "acks"),
        ({"worker_id": "w", "acks": []}, "acks"),
        ({"acks": [OK_ACK]}, "worker_id"),
        ({"worker_id": "", "acks": [OK_ACK]}, "worker_id"),
        ({"worker_id": 5, "acks": [OK_ACK]}, "worker_id"),
        ({"worker_id": "w" * 257, "acks": [OK_ACK]}, "worker_id"),
        ({"worker_id": "w", "acks": [OK_ACK, 5]}, "acks[1]"),
        ({"worker_id": "w", "acks": [OK_ACK, None]}, "acks[1]"),
        ({"worker_id": "w", "acks": [OK_ACK, ["j", "t"]]}, "acks[1]"),
        ({"worker_id": "w", "acks": [OK_ACK, {"job_id": "j"}]}, "acks[1].token"),
        ({"worker_id": "w", "acks": [{"token": "t"}, OK_ACK]}, "acks[0].job_id"),
        ({"worker_id": "w", "acks": [OK_ACK, {"job_id": "j", "token": 5}]}, "acks[1].token"),
        ({"worker_id": "w", "acks": [OK_ACK, {"job_id": 7, "token": "t"}]}, "acks[1].job_id"),
        ({"worker_id": "w", "acks": [OK_ACK, {"job_id": "", "token": "t"}]}, "acks[1].job_id"),
        ({"worker_id": "w", "acks": [OK_ACK, {"job_id": "j", "token": ""}]}, "acks[1].token"),
        (
            {"worker_id": "w", "acks": [OK_ACK, {"job_id": "j", "token": "t" * 257}]},
            "acks[1].token",
        ),
        (
            {"worker_id": "w", "acks": [OK_ACK, {"job_id": "j" * 257, "token": "t"}]},
            "acks[1].job_id",
        ),
        # The first bad item is the one named.
        ({"worker_id": "w", "acks": [OK_ACK, {"job_id": "j"}, 5]}, "acks[1].token"),
    ],
)
def test_invalid_ack_batches_are_bad_requests_naming_the_field(fields, field):
    with pytest.raises(BadRequest) as caught:
        parse(op="ack_batch", **fields)
    assert caught.value.field == field
    assert caught.value.message.startswith(field + ": ")


def test_ack_batch_holds_one_to_max_batch_acks():
    limits = wire.Limits(max_batch=3)

    def parse_acks(n: int):
        acks = [{"job_id": f"j{i}", "token": "t"} for i in range(n)]
        frame = parsing.decode_frame(
            orjson.dumps({"op": "ack_batch", "worker_id": "w", "acks": acks})
        )
        return parsing.parse_request(frame, limits)

    assert [job_id for job_id, *_ in parse_acks(3)] == ["j0", "j1", "j2"]
    for n in (0, 4):
        with pytest.raises(BadRequest) as caught:
            parse_acks(n)
        assert caught.value.field == "acks"


def test_ack_batch_result_over_the_limit_is_refused_naming_its_ack():
    limits = wire.Limits(max_result_bytes=10)

    def parse_results(*results):
        acks = [{"job_id": f"j{i}", "token": "t", "result": r} for i, r in enumerate(results)]
        frame = parsing.decode_frame(
            orjson.dumps({"op": "ack_batch", "worker_id": "w", "acks": acks})
        )
        return parsing.parse_request(frame, limits)

    exact = "x" * 8  # 10 bytes encoded, with its quotes
    assert [result for *_, result in parse_results(1, exact)] == ["1", '"xxxxxxxx"']
    with pytest.raises(BadRequest) as caught:
        parse_results(1, exact, "x" * 9)
    assert caught.value.field == "acks[2].result"


ack_item_values = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=12),
    st.sampled_from(["", "j", "t" * 256, "t" * 257, "é" * 128, "é" * 129]),
    st.lists(st.integers(-5, 5), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(0, 9)),
)  # fmt: skip
# A valid ack with up to two fields replaced and perhaps one left out.
ack_items = st.builds(
    lambda replaced, left_out: {
        k: v for k, v in {"job_id": "j", "token": "t", **replaced}.items() if k not in left_out
    },
    st.dictionaries(st.sampled_from(["job_id", "token", "result", "extra"]), ack_item_values,
                    max_size=2),
    st.sets(st.sampled_from(["job_id", "token"]), max_size=1),
)  # fmt: skip


@given(ack_items)
def test_each_ack_of_a_batch_is_checked_exactly_like_an_ack(item):
    """An item is accepted as an ``ack`` with the same fields would be, with the same
    result text; refused, it names the same field under ``acks[0].``."""
    limits = wire.Limits(max_result_bytes=12)

    def request(fields):
        return parsing.parse_request(parsing.decode_frame(orjson.dumps(fields)), limits)

    try:
        ack = request({"op": "ack", "worker_id": "w", **item})
        alone = (ack.job_id, "w", ack.token, ack.result_text(limits))
    except BadRequest as exc:
        alone = exc.field
    try:
        (batched,) = request({"op": "ack_batch", "worker_id": "w", "acks": [item]})
    except BadRequest as exc:
        assert exc.field is not None and exc.field.startswith("acks[0].")
        batched = exc.field.removeprefix("acks[0].")
    assert batched == alone
