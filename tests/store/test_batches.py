"""How the writer thread forms a batch from what its connections sent (``take_batch``):
the connections take turns, and one connection's share of a batch is bounded."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from relay.store.thread import add_pending, take_batch


class Op:
    def __init__(self, name: str, weigh: Any = None) -> None:
        self.name = name
        self.weigh = weigh


LIGHT = Op("submit")
HEAVY = Op("ack_batch", len)


def items(sink: str, op: Op, n: int, size: int = 1) -> list[tuple]:
    return [(op, sink, f"{sink}{i}", 0.0, (None,) * size) for i in range(n)]


def pending_of(*groups: list[tuple]) -> OrderedDict:
    pending: OrderedDict = OrderedDict()
    for group in groups:
        for item in group:
            add_pending(pending, item)
    return pending


def tags(batch: list[tuple]) -> list[str]:
    return [item[2] for item in batch]


def test_one_connections_heavy_requests_take_one_at_a_time_beside_another_connection():
    heavy = items("a", HEAVY, 32, size=1000)
    pending = pending_of(heavy, items("b", LIGHT, 1))
    batch = take_batch(pending, max_batch=512, max_share=1000)
    assert tags(batch) == ["a0", "b0"]  # not a's 32 heavy requests before b's submit
    assert [tags(take_batch(pending, 512, 1000)) for _ in range(3)] == [["a1"], ["a2"], ["a3"]]


def test_a_request_heavier_than_the_share_is_taken_alone():
    pending = pending_of(items("a", HEAVY, 2, size=5000))
    assert tags(take_batch(pending, 512, 1000)) == ["a0"]
    assert tags(take_batch(pending, 512, 1000)) == ["a1"]
    assert not pending


def test_light_requests_of_one_connection_alone_fill_a_batch():
    pending = pending_of(items("a", LIGHT, 600))
    assert len(take_batch(pending, 512, 1000)) == 512
    assert len(take_batch(pending, 512, 1000)) == 88


def test_connections_share_a_full_batch_evenly_each_in_its_order():
    pending = pending_of(items("a", LIGHT, 400), items("b", LIGHT, 400), items("c", LIGHT, 5))
    batch = take_batch(pending, 12, 1000)
    expected = [f"{sink}{i}" for sink in "abc" for i in range(4)]
    assert sorted(tags(batch)) == expected
    # Room left by a connection with little to send goes to the others, in later passes.
    batch = take_batch(pending, 12, 1000)
    assert tags(batch).count("c4") == 1 and len(batch) == 12
    a = [t for t in tags(batch) if t.startswith("a")]
    assert a == sorted(a, key=lambda t: int(t[1:])) and a[0] == "a4"


def test_a_connection_that_reached_its_share_waits_behind_the_others():
    pending = pending_of(items("a", HEAVY, 3, size=600), items("b", HEAVY, 3, size=600))
    assert sorted(tags(take_batch(pending, 512, 1000))) == ["a0", "a1", "b0", "b1"]
    assert [mine[0][1] for mine in pending.values()] == ["a", "b"]
    assert tags(take_batch(pending, 512, 1000)) == ["a2", "b2"]
