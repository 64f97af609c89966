"""The dispatcher's accounting, with fakes for the writer and the connection."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import trio
import trio.lowlevel
from trio.testing import wait_all_tasks_blocked

from relay.protocol import wire
from relay.protocol.errors import ShuttingDown
from relay.server.requests.dispatch import Dispatcher
from relay.server.requests.longpoll import LongPolls
from relay.store import commands as cmd


class BlockingWriter:
    """Answers DeadRetryQueue with a full chunk once, then blocks forever."""

    def __init__(self) -> None:
        self.calls = 0
        self.blocked = trio.Event()

    async def execute(self, command: Any) -> Any:
        assert isinstance(command, cmd.DeadRetryQueue)
        self.calls += 1
        if self.calls == 1:
            return command.limit
        self.blocked.set()
        await trio.sleep_forever()

    def put(self, item: Any) -> None:
        raise AssertionError("not used here")


class FakeConnection:
    def __init__(self, nursery: trio.Nursery, dispatcher: Dispatcher) -> None:
        self.nursery = nursery
        self.peer = "127.0.0.1:1"
        dispatcher.access.set_role(self, dispatcher.access.first_role)  # type: ignore[arg-type]
        self.closed = False
        self.can_wait = True
        self.in_flight = 0
        self.reserved = 0
        self.replies: list[dict[str, Any]] = []

    def begin_request(self) -> None:
        self.in_flight += 1

    def reserve(self, nbytes: int) -> None:
        self.reserved += nbytes

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes

    def reply(self, data: bytes) -> None:
        self.in_flight -= 1
        self.replies.append(orjson.loads(data))

    def deliver(self, replies: list[tuple[Any, Any]]) -> None:
        raise AssertionError("not used here")


async def test_a_whole_queue_retry_cut_short_is_still_answered_and_accounted():
    writer = BlockingWriter()
    dispatcher = Dispatcher(writer, wire.Limits(), LongPolls(writer))  # type: ignore[arg-type]
    async with trio.open_nursery() as connection_nursery:
        connection = FakeConnection(connection_nursery, dispatcher)
        line = orjson.dumps({"op": "dead_retry", "id": 7, "queue": "q", "all": True})
        dispatcher.dispatch(connection, line, trio.current_time())
        with trio.fail_after(5):
            await writer.blocked.wait()
        assert dispatcher.in_flight == 1
        connection_nursery.cancel_scope.cancel()  # the connection closes mid-way
    assert dispatcher.in_flight == 0
    assert connection.in_flight == 0
    (reply,) = connection.replies
    assert reply["id"] == 7 and reply["error"]["code"] == "shutting_down"
    with trio.fail_after(1):
        await dispatcher.wait_idle()


class ClosedWriter:
    """A writer that is shutting down: nothing can be queued."""

    def full(self) -> bool:
        return False

    def put(self, item: Any) -> None:
        raise ShuttingDown("the store is shutting down")


async def test_a_request_the_writer_refuses_is_answered_and_accounted():
    writer = ClosedWriter()
    dispatcher = Dispatcher(writer, wire.Limits(), LongPolls(writer))  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        connection = FakeConnection(nursery, dispatcher)
        line = orjson.dumps({"op": "submit", "id": 9, "queue": "q", "payload": 1})
        dispatcher.dispatch(connection, line, trio.current_time())
    assert dispatcher.in_flight == 0 and connection.in_flight == 0
    (reply,) = connection.replies
    assert reply["id"] == 9 and reply["error"]["code"] == "shutting_down"


INSPECT = {"op": "inspect", "id": 3, "job_id": "job_0000000000000001"}
LEASE = {"op": "lease", "id": 4, "queues": ["q"], "worker_id": "w", "count": 10}


@pytest.mark.parametrize("request_fields", [INSPECT, LEASE])
async def test_a_large_reply_reserved_for_a_request_not_queued_is_given_back(request_fields):
    """Bytes set aside for a large reply must be given back when the request never reaches
    the writer (shutting down), or the connection would stay full for good."""
    writer = ClosedWriter()
    dispatcher = Dispatcher(writer, wire.Limits(), LongPolls(writer))  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        connection = FakeConnection(nursery, dispatcher)
        dispatcher.dispatch(connection, orjson.dumps(request_fields), trio.current_time())
    assert connection.reserved == 0 and connection.in_flight == 0
    (reply,) = connection.replies
    assert reply["error"]["code"] == "shutting_down"


async def test_replies_answered_together_are_each_counted_out_and_timed():
    from relay.server.requests import ops

    writer = ClosedWriter()
    dispatcher = Dispatcher(writer, wire.Limits(), LongPolls(writer))  # type: ignore[arg-type]
    dispatcher._in_flight = 5  # (as if dispatched)
    items = [
        (ops.SUBMIT, None, 1, 10.0, None),
        (ops.SUBMIT, None, 2, 10.0, None),
        (ops.ACK, None, 3, 10.0, None),
        (ops.SUBMIT, None, 4, 10.5, None),
        (ops.SUBMIT, None, 5, 10.5, None),
    ]
    dispatcher.answered_lines(items, 11.0)
    durations = dispatcher.statistics().durations
    assert dispatcher.in_flight == 0
    assert durations["submit"].count == 4 and durations["ack"].count == 1
    assert durations["submit"].total == pytest.approx(1.0 * 2 + 0.5 * 2)
    with trio.fail_after(1):
        await dispatcher.wait_idle()


async def test_replies_the_writer_wrote_itself_are_counted_out_and_timed_with_the_others():
    from relay.server.requests import ops

    writer = ClosedWriter()
    dispatcher = Dispatcher(writer, wire.Limits(), LongPolls(writer))  # type: ignore[arg-type]
    dispatcher._in_flight = 3  # (as if dispatched)
    started = trio.current_time()
    dispatcher.answered_lines([(ops.SUBMIT, None, 1, started, None)], started)
    answered = [(ops.SUBMIT, None, 2, started, None), (ops.ACK, None, 3, started, None)]
    dispatcher.answered_now.answered([(item, b"{}\n") for item in answered])  # (writer's)
    assert dispatcher.in_flight == 0
    durations = dispatcher.statistics().durations
    assert durations["submit"].count == 2 and durations["ack"].count == 1
    with trio.fail_after(1):
        await dispatcher.wait_idle()


async def test_every_caller_of_wait_idle_returns_once_idle():
    writer = ClosedWriter()
    dispatcher = Dispatcher(writer, wire.Limits(), LongPolls(writer))  # type: ignore[arg-type]
    dispatcher._in_flight = 1  # (as if dispatched)
    done: list[str] = []

    async def waiter(name: str) -> None:
        await dispatcher.wait_idle()
        done.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, "first")
        await wait_all_tasks_blocked()
        nursery.start_soon(waiter, "second")
        await wait_all_tasks_blocked()
        assert done == []
        dispatcher._count_out(1)
        with trio.fail_after(1):
            while len(done) < 2:
                await trio.lowlevel.checkpoint()
    assert sorted(done) == ["first", "second"]
