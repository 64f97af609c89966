"""Replies the writer thread writes itself (connections/direct.py): which connections get
them, that the trio thread then has nothing to deliver, and that whoever waits on the
trio side is still woken."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest
import trio

from relay.protocol import wire
from relay.server.connections import session as session_module
from relay.server.requests import durations as durations_module
from relay.store.base import Changes
from relay.store.writer import CommitListener, Writer
from tests.server.conftest import BOUND_S
from tests.server.test_protocol import connected, custom_server, submit


@contextmanager
def delivered_by_trio(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, int]]]:
    """(session, number of pairs) of each delivery the trio thread makes to a session."""
    calls: list[tuple[Any, int]] = []
    deliver = session_module.Session.deliver

    def counted(self: session_module.Session, pairs: list) -> None:
        calls.append((self, len(pairs)))
        deliver(self, pairs)

    monkeypatch.setattr(session_module.Session, "deliver", counted)
    yield calls


async def test_the_replies_of_an_idle_tcp_connection_are_written_by_the_writer(
    tmp_path, monkeypatch
):
    with delivered_by_trio(monkeypatch) as delivered:
        async with custom_server(tmp_path) as srv, connected(srv) as c:
            with trio.fail_after(BOUND_S):
                ids = [await submit(c, payload={"n": i}) for i in range(20)]
                job = (await c.ok("inspect", job_id=ids[-1]))["job"]
                leased = await c.ok("lease", queues=["q"], worker_id="w", count=20)
                for one in leased["jobs"]:
                    await c.ok("ack", job_id=one["job_id"], worker_id="w", token=one["token"])
                stats = await c.ok("stats")
    assert job["payload"] == {"n": 19}
    assert stats["queues"]["q"]["succeeded"] == 20
    # Every reply went out from the writer thread: none through the trio thread's delivery.
    assert delivered == []


async def test_leases_answered_by_the_writer_give_back_the_reply_bytes_they_reserved(
    tmp_path, monkeypatch
):
    # Each lease of 8 sets aside ~1.25 MiB of the connection's 32 MiB for its reply until
    # it is answered: were it not given back when the writer writes the reply, the reader
    # would stop for good after ~26 of them.
    leases = 40
    with delivered_by_trio(monkeypatch) as delivered:
        async with custom_server(tmp_path) as srv, connected(srv) as c:
            with trio.fail_after(BOUND_S):
                jobs = [{"queue": "q", "payload": i} for i in range(8 * leases)]
                await c.ok("submit_batch", jobs=jobs)
                for _ in range(leases):
                    got = await c.ok("lease", queues=["q"], worker_id="w", count=8)
                    assert len(got["jobs"]) == 8
                stats = await c.ok("stats")
    assert stats["queues"]["q"]["leased"] == 8 * leases
    assert delivered == []  # (all written by the writer thread)


async def test_a_long_poll_that_finds_nothing_and_a_websocket_go_through_the_trio_thread(
    tmp_path, monkeypatch
):
    with delivered_by_trio(monkeypatch) as delivered:
        async with custom_server(tmp_path) as srv, connected(srv) as c:
            with trio.fail_after(BOUND_S):
                reply = await c.ok("lease", queues=["q"], worker_id="w", wait_ms=50)
                assert reply["jobs"] == []
                # Its empty outcome (it parks), then its answer at the deadline.
                assert len(delivered) == 2
                ws = await srv.connect_websocket()
                try:
                    await submit(ws)
                finally:
                    await ws.aclose()
    assert len(delivered) == 3  # and the submit over WebSocket


async def test_a_reader_waiting_for_room_is_woken_by_replies_the_writer_wrote(tmp_path):
    """max_in_flight 4: the reader stops after four of a pipelined burst, and only the
    writer thread's replies make room again."""
    limits = wire.Limits(max_in_flight=4)
    async with custom_server(tmp_path, limits=limits) as srv, connected(srv) as c:
        with trio.fail_after(BOUND_S):
            burst = [{"op": "submit", "id": i, "queue": "q", "payload": i} for i in range(200)]
            await c.send_raw(b"".join(orjson.dumps(r) + b"\n" for r in burst))
            replies = [await c.read() for _ in burst]
    assert sorted(r["id"] for r in replies if r["ok"]) == list(range(200))


async def every_reply(c: Any) -> list[dict[str, Any]]:
    """Every reply until the server closes the connection, after the client's EOF: the
    server writes all it owes first."""
    await c.stream.send_eof()
    out: list[dict[str, Any]] = []
    while (line := await c.read_line()) is not None:
        out.append(orjson.loads(line))
    return out


async def test_a_failure_asking_who_waits_for_a_commit_costs_no_second_answer(
    tmp_path, monkeypatch
):
    """Its replies are out when the writer asks who waits for the commit (a listener's
    wants, say): a failure there must not make the writer answer the batch again (as not
    committed), nor stop it."""

    def failing(self: Writer, changes: Any) -> bool:
        raise RuntimeError("a listener's bug")

    monkeypatch.setattr(Writer, "_wants_trio", failing)
    async with custom_server(tmp_path) as srv, connected(srv) as c:
        with trio.fail_after(BOUND_S):
            # One at a time, so that nobody waits (a drain would be woken, not asked).
            await c.ok("submit", queue="q", payload=1)
            stats = await c.ok("stats")
            replies = await every_reply(c)
    assert replies == []  # nothing more: not the submit again, as not committed
    assert stats["queues"]["q"]["ready"] == 1


def test_a_commit_listener_whose_wants_fails_is_told():
    writer = Writer(capacity=8)
    heard: list[Any] = []

    def failing(changes: Changes) -> bool:
        raise RuntimeError("a listener's bug")

    writer.commit_listeners.append(CommitListener(heard.append, failing))
    assert writer._wants_trio(Changes(ready_queues={"q"})) is True


async def test_a_failure_counting_what_the_writer_wrote_costs_no_second_answer(
    tmp_path, monkeypatch
):
    """The durations of what the writer wrote are kept after the write: a failure there
    must not send the replies again through the trio thread."""
    observe_runs = durations_module.Durations.observe_runs
    calls: list[float] = []

    def failing_once(self: durations_module.Durations, items: Any, now: float) -> None:
        calls.append(now)
        if len(calls) == 1:  # (the first: the writer's, for the submit it answered)
            raise ValueError("a bug in timing")
        observe_runs(self, items, now)

    monkeypatch.setattr(durations_module.Durations, "observe_runs", failing_once)
    async with custom_server(tmp_path) as srv, connected(srv) as c:
        with trio.fail_after(BOUND_S):
            await c.ok("submit", queue="q", payload=1)
            await c.ok("stats")
            replies = await every_reply(c)
    assert replies == []  # nothing more: not the submit again
