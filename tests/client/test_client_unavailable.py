"""The client's retries of ``unavailable`` (the server could not commit: disk full, I/O
errors): the calls that are safe to repeat are sent again with backoff, within the caller's
deadline; the others raise ``Unavailable`` at once.

A fake transport answers ``unavailable`` a given number of times, then ok; trio's
MockClock makes the backoff's sleeps instant.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import trio
import trio.testing

from relay import Client, job_fields
from relay.client.client import UNAVAILABLE_CAP_S, UNAVAILABLE_FIRST_S
from relay.client.coalesce import Coalescer
from relay.protocol.errors import Unavailable

MESSAGE = "not committed: disk full (SQLITE_FULL); retry later"

REPLIES: dict[str, dict[str, Any]] = {
    "submit": {"job_id": "job_0000000000000001", "state": "ready", "duplicate": False},
    "submit_batch": {
        "results": [{"job_id": "job_0000000000000001", "state": "ready", "duplicate": False}]
    },
    "ack": {"state": "succeeded"},
    "ack_batch": {"results": [{"ok": True, "state": "succeeded"}]},
    "renew": {"lease_expires_at": 123},
    "release": {"state": "ready"},
    "fail": {"state": "retrying", "retry_at": 5},
}


class DiskFullTransport:
    """Answers ``unavailable`` to the first ``failures`` requests, then ok."""

    def __init__(self, failures: float) -> None:
        self.failures = failures
        self.sent: list[tuple[float, str]] = []  # (trio time, op)

    async def request(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        self.sent.append((trio.current_time(), op))
        if self.failures > 0:
            self.failures -= 1
            raise Unavailable(MESSAGE)
        return REPLIES[op]

    def gaps(self) -> list[float]:
        times = [t for t, _ in self.sent]
        return [b - a for a, b in itertools.pairwise(times)]


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


IDEMPOTENT_CALLS = {
    "ack": lambda c: c.ack("job_1", "w", "t"),
    "ack_batch": lambda c: c.ack_batch("w", [("job_1", "t")]),
    "renew": lambda c: c.renew("job_1", "w", "t"),
    "release": lambda c: c.release("job_1", "w", "t"),
    "submit": lambda c: c.submit("q", {}, idempotency_key="k"),
    "submit_batch": lambda c: c.submit_batch([job_fields("q", {}, idempotency_key="k")]),
}


@pytest.mark.parametrize("op", sorted(IDEMPOTENT_CALLS))
async def test_calls_safe_to_repeat_are_retried_with_growing_waits(autojump_clock, op):
    transport = DiskFullTransport(failures=3)
    await IDEMPOTENT_CALLS[op](Client(transport))
    assert [sent_op for _, sent_op in transport.sent] == [op] * 4
    # 50 ms doubling, each wait a random 50-100 % of its step.
    for gap, step in zip(transport.gaps(), (0.05, 0.1, 0.2), strict=True):
        assert step / 2 <= gap <= step


NOT_RETRIED = {
    "submit without a key": lambda c: c.submit("q", {}),
    "submit_batch with a job without a key": lambda c: c.submit_batch(
        [job_fields("q", {}, idempotency_key="k"), job_fields("q", {})]
    ),
    "fail": lambda c: c.fail("job_1", "w", "t", "boom"),
}


@pytest.mark.parametrize("call", sorted(NOT_RETRIED))
async def test_calls_that_could_act_twice_raise_unavailable_at_once(autojump_clock, call):
    transport = DiskFullTransport(failures=1)
    with pytest.raises(Unavailable) as raised:
        await NOT_RETRIED[call](Client(transport))
    assert raised.value.message == MESSAGE
    assert len(transport.sent) == 1


async def test_the_retries_stop_before_the_callers_deadline(autojump_clock):
    transport = DiskFullTransport(failures=math.inf)
    with trio.fail_after(3.0):  # TooSlowError would mean a wait was begun past it
        with pytest.raises(Unavailable):
            await Client(transport).ack("job_1", "w", "t")
        raised_at = trio.current_time()
    # The last try came when the next wait (at most 1 s) would have reached the deadline.
    assert 2.0 <= raised_at < 3.0
    assert transport.sent[-1][0] == raised_at


async def test_a_deadline_too_close_for_any_wait_raises_after_one_try(autojump_clock):
    transport = DiskFullTransport(failures=math.inf)
    with trio.move_on_after(UNAVAILABLE_FIRST_S / 4):
        with pytest.raises(Unavailable):
            await Client(transport).renew("job_1", "w", "t")
    assert len(transport.sent) == 1


async def test_without_a_deadline_the_waits_grow_to_a_second_and_stay_there(autojump_clock):
    transport = DiskFullTransport(failures=12)
    await Client(transport).release("job_1", "w", "t")
    gaps = transport.gaps()
    assert len(gaps) == 12
    assert all(gap <= UNAVAILABLE_CAP_S for gap in gaps)
    assert all(gap >= UNAVAILABLE_CAP_S / 2 for gap in gaps[5:])  # 0.05 * 2**5 > 1


async def test_coalesced_calls_are_retried_each_by_its_own_rule(autojump_clock):
    transport = DiskFullTransport(failures=1)
    outcomes: dict[str, Any] = {}

    async def call(name: str, fn: Any) -> None:
        try:
            outcomes[name] = await fn
        except Unavailable as exc:
            outcomes[name] = exc

    async with trio.open_nursery() as nursery:
        client = Client(transport, Coalescer(transport.request, 0.002, nursery))
        # Made in one tick: they go as one submit_batch, which the disk refuses.
        nursery.start_soon(call, "keyed", client.submit("q", {}, idempotency_key="k"))
        nursery.start_soon(call, "plain", client.submit("q", {}))
    assert transport.sent[0][1] == "submit_batch"
    assert isinstance(outcomes["plain"], Unavailable)
    assert outcomes["keyed"].job_id == "job_0000000000000001"
    assert [op for _, op in transport.sent] == ["submit_batch", "submit"]


# -- the blocking client ------------------------------------------------------------------


class FakeTime:
    """The blocking client's clock and sleep: sleeping moves the clock, instantly."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def disk_full_blocking(failures: float, timeout: float = 30.0):
    """A blocking client whose requests are answered ``unavailable`` ``failures`` times,
    then ok; its sleeps instant. Returns it, its fake time and the ops it sent."""
    from relay.client.blocking import BlockingClient

    client = BlockingClient("127.0.0.1:1", timeout=timeout)
    fake, sent, left = FakeTime(), [], [failures]

    def request(op: str, **fields: Any) -> dict[str, Any]:
        sent.append(op)
        if left[0] > 0:
            left[0] -= 1
            raise Unavailable(MESSAGE)
        return REPLIES[op]

    client.request = request  # type: ignore[method-assign]
    client._clock, client._sleep = fake.clock, fake.sleep
    return client, fake, sent


def test_blocking_keyed_submits_are_retried_with_growing_waits():
    client, fake, sent = disk_full_blocking(3)
    assert client.submit("q", {}, idempotency_key="k").job_id == "job_0000000000000001"
    assert sent == ["submit"] * 4
    # 50 ms, then doubling, each a random 50-100 % of it.
    for wait, full in zip(fake.slept, (0.05, 0.1, 0.2), strict=True):
        assert full / 2 <= wait <= full
    client, fake, sent = disk_full_blocking(2)
    jobs = [job_fields("q", i, idempotency_key=f"k{i}") for i in range(2)]
    assert len(client.submit_batch(jobs)) == 1 and sent == ["submit_batch"] * 3


def test_blocking_calls_that_could_act_twice_raise_unavailable_at_once():
    client, fake, sent = disk_full_blocking(1)
    with pytest.raises(Unavailable):
        client.submit("q", {})
    with pytest.raises(Unavailable):
        client, fake, sent = disk_full_blocking(1)
        client.submit_batch([job_fields("q", 1, idempotency_key="k"), job_fields("q", 2)])
    assert sent == ["submit_batch"] and fake.slept == []


def test_blocking_retries_stop_within_the_timeout():
    client, fake, sent = disk_full_blocking(math.inf, timeout=5.0)
    with pytest.raises(Unavailable):
        client.submit("q", {}, idempotency_key="k")
    assert fake.now < 5.0 and sum(fake.slept) == fake.now
    assert len(sent) > 5 and max(fake.slept) <= UNAVAILABLE_CAP_S
