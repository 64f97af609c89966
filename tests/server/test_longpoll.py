"""The registry of parked long-polls (relay/server/longpoll.py), without a server."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from relay.server.longpoll import COMPACT_SLACK, LongPolls


@attrs.define
class Lease:
    queues: tuple[str, ...]
    deadline: float


def item(lease: Lease, sink: Any) -> tuple:
    return (None, sink, None, 0.0, lease)


class Sink:
    def __init__(self) -> None:
        self.answered: list[tuple[Any, Any]] = []

    def deliver(self, replies: list[tuple[Any, Any]]) -> None:
        self.answered += replies


async def test_leases_answered_before_their_deadline_do_not_pile_up():
    """A long-poll answered early leaves its deadline behind; parking again and again
    (a busy consumer, or clients that come and go) must not grow the registry for the
    whole of max_wait_ms."""
    longpolls = LongPolls(writer=None)  # type: ignore[arg-type]
    sink = Sink()
    far = trio.current_time() + 60
    for _ in range(10):
        for i in range(COMPACT_SLACK):
            longpolls.park(item(Lease(("q",), far + i), sink), sink)
        longpolls.drop(sink)
    assert len(sink.answered) == 10 * COMPACT_SLACK
    assert longpolls.parked == 0
    longpolls.park(item(Lease(("q",), far), sink), sink)
    assert longpolls.parked == 1
    assert len(longpolls._deadlines) <= 2 + COMPACT_SLACK
