"""The session's write path and watchdog (connections/session.py), over real TCP sockets.

Replies are written through at once when nothing is queued before them; what the socket
does not take goes to the sender task. The watchdog closes a connection that idles or
does not read its replies, but not one waiting on its own long-poll. Most tests here make
replies larger than the socket buffers, so that partial writes, the sender task and the
watchdog's ``not_reading`` branch are exercised, not only the write-through path.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from relay.protocol import wire
from relay.protocol.errors import ShuttingDown
from relay.server.connections import outbox as outbox_module
from relay.server.connections import session as session_module
from relay.server.connections.session import SLICE_LINES
from relay.server.connections.streamio import RECEIVE_BYTES
from relay.server.requests.dispatch import Dispatcher
from relay.store import thread as thread_module
from relay.store.writer import Writer
from tests.server.conftest import (
    BOUND_S,
    LineClient,
    RunningServer,
    start_server,
    writer_barrier,
)
from tests.server.test_lifecycle import scrape
from tests.server.test_protocol import (
    W,
    assert_error,
    connected,
    custom_server,
    queue_stats,
    submit,
    well_behaved_round,
)
from tests.worker.helpers import wait_until

# A job payload this large makes each inspect reply about as large: a few of them fill
# the socket buffers of both ends on loopback.
BIG = 200 * 1024


def pipelined(requests: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in requests)


async def open_raw(srv: RunningServer, rcvbuf: int = 4096) -> trio.socket.SocketType:
    """A client socket with a small receive buffer, set before connecting so that the TCP
    window is small from the start: a client that does not read blocks the server soon."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    with trio.fail_after(BOUND_S):
        await sock.connect(srv.handle.address)
    return sock


async def connections(c: LineClient) -> int:
    """Open client connections as the server counts them (``c`` itself included)."""
    return (await c.ok("stats"))["server"]["connections"]


async def closed_but(c: LineClient) -> bool:
    """Whether ``c`` is the only client connection the server still counts."""
    return await connections(c) == 1


async def stall_with_big_replies(
    srv: RunningServer, good: LineClient, n: int = 40
) -> trio.socket.SocketType:
    """A raw client that pipelines ``n`` inspects of a BIG job (~8 MB of replies for 40)
    and reads nothing."""
    job_id = await submit(good, "big", "x" * BIG)
    stalled = await open_raw(srv)
    data = pipelined([{"op": "inspect", "id": i, "job_id": job_id} for i in range(n)])
    with trio.fail_after(BOUND_S):
        await stalled.send(data)  # a few KB: all of it fits in the socket buffers
    return stalled


@contextlib.contextmanager
def session_events() -> Iterator[list[str]]:
    """The events the session logs meanwhile (by name), whatever the logging config."""
    events: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: events.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("relay.session")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield events
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# -- a client that does not read its replies --------------------------------------------------


async def test_client_not_reading_large_replies_does_not_disturb_others(tmp_path):
    """While the server owes a non-reading client MBs, another client is served at once."""
    async with (
        custom_server(tmp_path, idle_timeout_ms=400) as srv,
        connected(srv) as good,
    ):
        stalled = await stall_with_big_replies(srv, good)
        try:
            assert await connections(good) == 2
            started = trio.current_time()
            while trio.current_time() - started < 1.0:
                with trio.fail_after(1):  # each round: no waiting on the stalled client
                    await well_behaved_round(good, "good")
                await trio.sleep(0.05)
        finally:
            stalled.close()
        await well_behaved_round(good, "good")


async def test_client_not_reading_large_replies_is_closed_within_bounds(tmp_path):
    idle_s = 0.4
    async with (
        custom_server(tmp_path, idle_timeout_ms=int(idle_s * 1000)) as srv,
        connected(srv) as good,
    ):
        stalled = await stall_with_big_replies(srv, good)
        try:
            assert await connections(good) == 2
            started = trio.current_time()
            closed_after: float | None = None
            with trio.fail_after(idle_s + 2):
                while closed_after is None:
                    await well_behaved_round(good, "good")  # served normally meanwhile
                    if await connections(good) == 1:
                        closed_after = trio.current_time() - started
                    else:
                        await trio.sleep(0.05)
            assert closed_after >= idle_s * 0.5, closed_after
            # Reading at last, the stalled client gets part of its replies, then EOF.
            received = 0
            with trio.fail_after(BOUND_S):
                while True:
                    try:
                        chunk = await stalled.recv(65536)
                    except ConnectionResetError:
                        break
                    if not chunk:
                        break
                    received += len(chunk)
            assert received < 40 * BIG, received
        finally:
            stalled.close()
        await well_behaved_round(good, "good")


async def test_client_leaving_too_many_reply_bytes_unread_is_closed_at_once(tmp_path, monkeypatch):
    """max_in_flight counts replies, not bytes: 40 inspects of a big job owe ~8 MB. Past
    MAX_UNSENT_BYTES the connection is closed at once, not at the idle timeout, and the
    memory is let go. (The reader takes inspects while their reservations, each an
    inspect's most with its attempt history, ~6.6 MiB, fit under MAX_OWED_BYTES: raised
    here so that more replies than MAX_UNSENT_BYTES can be owed at once.)"""
    monkeypatch.setattr(outbox_module, "MAX_UNSENT_BYTES", 2 * 1024 * 1024)
    monkeypatch.setattr(session_module, "MAX_OWED_BYTES", 128 * 1024 * 1024)
    async with custom_server(tmp_path) as srv, connected(srv) as good:  # idle timeout 300 s
        with session_events() as events:
            stalled = await stall_with_big_replies(srv, good)
            try:
                with trio.fail_after(BOUND_S):
                    while await connections(good) == 2:
                        await well_behaved_round(good, "good")  # served meanwhile
            finally:
                stalled.close()
        assert "connection.backlog_too_large" in events
        await well_behaved_round(good, "good")


async def request_count(srv: RunningServer, op: str) -> int:
    """Requests of ``op`` the server has answered (its duration histogram's count)."""
    _, samples = await scrape(srv)
    return int(samples.get(f'relay_request_duration_seconds_count{{op="{op}"}}', 0))


async def test_reading_stops_while_large_replies_owed_reach_max_owed_bytes(tmp_path, monkeypatch):
    """max_in_flight (256) would admit all 100 inspects of a big job (~20 MB of replies)
    from a client that reads none; the bytes they may need stop the reader first."""
    monkeypatch.setattr(session_module, "MAX_OWED_BYTES", 3 * 1024 * 1024)
    async with custom_server(tmp_path) as srv, connected(srv) as good:
        stalled = await stall_with_big_replies(srv, good, n=100)
        try:
            await wait_all_tasks_blocked()
            await writer_barrier(good)  # the writer answered what the reader took before this
            answered = await request_count(srv, "inspect")
            assert 1 <= answered < 100, answered
            await well_behaved_round(good, "good")  # others are served meanwhile
        finally:
            stalled.close()


async def test_large_replies_read_as_they_come_are_all_answered(tmp_path, monkeypatch):
    """Each inspect reserves its most (~2 MiB) until answered; with room for one at a
    time, 50 pipelined ones are still answered in full: every reservation is released."""
    monkeypatch.setattr(session_module, "MAX_OWED_BYTES", 3 * 1024 * 1024)
    async with custom_server(tmp_path) as srv, connected(srv) as c:
        job_id = await submit(c, "small", {"n": 1})
        await c.send_raw(
            pipelined([{"op": "inspect", "id": i, "job_id": job_id} for i in range(50)])
        )
        for i in range(50):
            reply = await c.read()
            assert reply["id"] == i and reply["job"]["job_id"] == job_id
        lease_id = await c.send("lease", queues=["small"], worker_id=W, count=1000)
        assert len((await c.read())["jobs"]) == 1, lease_id
        assert (await c.ok("ping"))["ok"] is True


async def test_client_sending_but_not_reading_is_closed_as_not_reading(tmp_path):
    """Pings keep it from idling, but it reads none of its replies: ``not_reading``."""
    idle_s = 0.4
    with session_events() as events:
        async with (
            custom_server(tmp_path, idle_timeout_ms=int(idle_s * 1000)) as srv,
            connected(srv) as good,
        ):
            stalled = await stall_with_big_replies(srv, good)
            try:
                started = trio.current_time()
                closed_after: float | None = None
                with trio.fail_after(idle_s + 2):
                    while closed_after is None:
                        with contextlib.suppress(OSError):  # reset once closed
                            await stalled.send(b'{"op":"ping"}\n')
                        await good.ok("ping")
                        if await connections(good) == 1:
                            closed_after = trio.current_time() - started
                        else:
                            await trio.sleep(idle_s / 4)
                assert closed_after >= idle_s * 0.5, closed_after
            finally:
                stalled.close()
            await well_behaved_round(good, "good")
    assert "connection.not_reading" in events, events
    assert "connection.idle_timeout" not in events, events


async def test_client_reading_a_large_backlog_steadily_is_not_closed(tmp_path):
    idle_s = 1.0  # generous: a loaded machine may pause this reader for a while
    n = 30  # ~6 MB of replies, read at ~3 MB/s: more than one idle_timeout to read
    async with (
        custom_server(tmp_path, idle_timeout_ms=int(idle_s * 1000)) as srv,
        connected(srv) as c,
    ):
        job_id = await submit(c, "big", "x" * BIG)
        await c.send_raw(
            pipelined([{"op": "inspect", "id": i, "job_id": job_id} for i in range(n)])
        )
        inspected = 0
        pings = 0
        buffer = b""

        async def keep_sending() -> None:  # so that it is not idle either
            for i in range(1000, 2000):
                await c.send_raw(orjson.dumps({"op": "ping", "id": i}) + b"\n")
                await trio.sleep(idle_s / 5)

        with trio.fail_after(BOUND_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_sending)
                while inspected < n:
                    chunk = await c.stream.receive_some(32 * 1024)
                    assert chunk, f"closed after {inspected} of {n} replies"
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        reply = orjson.loads(line)
                        assert reply["ok"] is True, reply
                        if reply["id"] < 1000:
                            assert reply["id"] == inspected
                            inspected += 1
                        else:
                            pings += 1
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
            # Still open: a last ping is answered (after the other pings' replies). Sent
            # once keep_sending has ended: it may have been inside a send when cancelled.
            await c.send_raw(b'{"op":"ping","id":"last"}\n')
            while b'"id":"last"' not in buffer:
                chunk = await c.stream.receive_some(32 * 1024)
                assert chunk, "closed after reading every reply"
                buffer += chunk
        assert pings >= 1


# -- ordering when replies go through the sender task ----------------------------------------


async def send_in_groups(c: LineClient, requests: list[dict[str, Any]], size: int = 3) -> None:
    for start in range(0, len(requests), size):
        await c.send_raw(pipelined(requests[start : start + size]))
        await trio.sleep(0.001)


@pytest.mark.parametrize("max_in_flight", [256, 8])
async def test_pipelined_large_replies_arrive_whole_and_in_order(tmp_path, max_in_flight):
    """250 pipelined requests, ~16 MB of replies, read slowly at first: every reply comes
    whole, once, as valid JSON. Those answered through the store (inspects, found or not)
    come in request order; so do the pings (answered at once, they may overtake)."""
    limits = wire.Limits(max_in_flight=max_in_flight)
    async with custom_server(tmp_path, limits=limits) as srv, connected(srv) as c:
        payloads = {tag: tag * (100 * 1024) for tag in "abc"}
        jobs = {tag: await submit(c, "order", p) for tag, p in payloads.items()}
        expected: dict[int, str | None] = {}  # request id -> payload tag, or "" (ping)
        requests: list[dict[str, Any]] = []
        for i in range(1000, 1250):
            if i % 5 == 0:
                requests.append({"op": "ping", "id": i})
                expected[i] = ""
            elif i % 7 == 0:
                requests.append({"op": "inspect", "id": i, "job_id": "job_nope"})
                expected[i] = None
            else:
                tag = "abc"[i % 3]
                requests.append({"op": "inspect", "id": i, "job_id": jobs[tag]})
                expected[i] = tag

        lines: list[bytes] = []
        buffer = b""
        with trio.fail_after(BOUND_S):
            async with trio.open_nursery() as nursery:
                # Sent from its own task, a few at a time, so that replies keep coming
                # while earlier ones are still being written (and with a small
                # max_in_flight the server stops reading until replies are read).
                nursery.start_soon(send_in_groups, c, requests)
                while len(lines) < len(requests):
                    chunk = await c.stream.receive_some(65536)
                    assert chunk, f"EOF after {len(lines)} replies"
                    buffer += chunk
                    *complete, buffer = buffer.split(b"\n")
                    lines.extend(complete)
                    if len(lines) < 40:  # slow at first: the server's writes come out partial
                        await trio.sleep(0.005)
        assert buffer == b""

        ids = []
        for line in lines:
            reply = orjson.loads(line)
            ids.append(reply["id"])
            tag = expected[reply["id"]]
            if tag == "":
                assert reply == {"id": reply["id"], "ok": True}
            elif tag is None:
                assert_error(reply, "not_found", reply["id"])
            else:
                assert reply["ok"] is True, reply
                assert reply["job"]["job_id"] == jobs[tag]
                assert reply["job"]["payload"] == payloads[tag]
        assert sorted(ids) == sorted(expected), "a reply missing or duplicated"
        pings = [i for i in ids if expected[i] == ""]
        stored = [i for i in ids if expected[i] != ""]
        assert pings == sorted(pings)
        assert stored == sorted(stored)
        # Nothing else is owed: the next request's reply is the next line.
        request_id = await c.send("ping")
        assert await c.read() == {"id": request_id, "ok": True}


async def test_a_commits_replies_wait_for_an_earlier_commits_hand_off(tmp_path, monkeypatch):
    """A commit whose replies of a connection went to the trio thread (a long-poll among
    them found nothing) is delivered there; a later commit's replies of that connection,
    committed before that hand-off ran, are not written by the writer thread ahead of it.
    The interleaving is forced: the writer thread waits at ``offer`` for the next request
    to be queued, and the trio thread is held until the later commit is offered."""
    token = trio.lowlevel.current_trio_token()
    timeout = BOUND_S / 2  # (each wait is bounded: a missed step fails the asserts below)
    put = {rid: threading.Event() for rid in "pxy"}  # the request was queued
    offered = {rid: threading.Event() for rid in "pxy"}  # its commit's replies were offered
    real_put, real_offer = Writer.put, thread_module.offer

    def put_and_tell(self: Writer, item: Any) -> None:
        real_put(self, item)
        if item[2] in put:
            put[item[2]].set()

    def hold_trio() -> None:  # (the trio thread: the hand-off queued after this waits)
        offered["y"].wait(timeout)

    def offer(pairs: list[Any]) -> Any:
        rids = {item[2] for item, _reply in pairs}
        if "p" in rids:  # held until the long-poll and x are both queued
            offered["p"].set()
            put["x"].wait(timeout)
        taken = real_offer(pairs)
        if "x" in rids:  # x's commit is handed off: y is queued meanwhile
            offered["x"].set()
            put["y"].wait(timeout)
            token.run_sync_soon(hold_trio)
        if "y" in rids:
            offered["y"].set()
        return taken

    async with custom_server(tmp_path) as srv, connected(srv) as c:
        await writer_barrier(c)
        monkeypatch.setattr(Writer, "put", put_and_tell)
        monkeypatch.setattr(thread_module, "offer", offer)
        with trio.fail_after(BOUND_S):
            await c.send_raw(b'{"op":"inspect","id":"p","job_id":"job_nope"}\n')
            await trio.to_thread.run_sync(offered["p"].wait, timeout)
            longpoll = {"op": "lease", "id": "l", "queues": ["none"], "worker_id": W,
                        "wait_ms": 60_000}  # fmt: skip
            x = {"op": "inspect", "id": "x", "job_id": "job_nope"}
            await c.send_raw(pipelined([longpoll, x]))
            await trio.to_thread.run_sync(offered["x"].wait, timeout)
            await c.send_raw(b'{"op":"inspect","id":"y","job_id":"job_nope"}\n')
            ids = [(await c.read())["id"] for _ in range(3)]
        assert all(e.is_set() for e in offered.values()), "the interleaving was not forced"
        assert ids == ["p", "x", "y"]


# -- the read path -----------------------------------------------------------------------------


async def test_requests_in_full_reads_then_one_at_a_time_are_all_answered_in_order(tmp_path):
    """The reader reads at once after a full read and waits first after a short one: a
    burst of ~1 MB of pipelined submits (many full reads, and pauses at max_in_flight),
    then requests one at a time, then one line split across two sends, all answered."""
    async with custom_server(tmp_path) as srv, connected(srv) as c:
        burst = [
            {"op": "submit", "id": i, "queue": "read", "payload": "p" * 400} for i in range(2500)
        ]
        data = pipelined(burst)
        assert len(data) > 16 * 64 * 1024
        ids: list[int] = []
        with trio.fail_after(BOUND_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(c.send_raw, data)
                while len(ids) < len(burst):
                    reply = await c.read()
                    assert reply["ok"] is True, reply
                    ids.append(reply["id"])
        assert ids == [r["id"] for r in burst]
        for _ in range(20):
            assert (await c.ok("ping"))["ok"] is True
        line = orjson.dumps({"op": "submit", "id": "split", "queue": "read", "payload": 1})
        await c.send_raw(line[:10])
        await wait_all_tasks_blocked()  # the server has read the first part, waits for more
        await c.send_raw(line[10:] + b"\n")
        reply = await c.read()
        assert reply["id"] == "split" and reply["ok"] is True, reply
        stats = (await c.ok("stats"))["queues"]["read"]
        assert stats["ready"] == len(burst) + 1


async def test_a_full_read_then_nothing_more_waits_for_the_next_request(tmp_path):
    """Exactly one full read's worth of requests: the reader reads again at once, finds
    nothing (EAGAIN), and must wait for the socket rather than take that as the end."""
    async with custom_server(tmp_path) as srv, connected(srv) as c:
        lines: list[bytes] = []
        size = 0
        while size < RECEIVE_BYTES - 100:
            lines.append(orjson.dumps({"op": "ping", "id": len(lines)}) + b"\n")
            size += len(lines[-1])
        last = orjson.dumps({"op": "ping", "id": -1, "pad": ""}) + b"\n"
        lines.append(last.replace(b'""', b'"' + b"p" * (RECEIVE_BYTES - size - len(last)) + b'"'))
        data = b"".join(lines)
        assert len(data) == RECEIVE_BYTES
        await c.send_raw(data)
        for line in lines:
            assert await c.read() == {"id": orjson.loads(line)["id"], "ok": True}
        await wait_all_tasks_blocked()  # the server's reader waits for more
        assert (await c.ok("ping"))["ok"] is True


async def test_half_closed_client_gets_every_reply_then_eof(tmp_path):
    async with custom_server(tmp_path) as srv:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with sock, trio.fail_after(BOUND_S):
            await sock.connect(srv.handle.address)
            await sock.send(pipelined([{"op": "ping", "id": i} for i in range(500)]))
            sock.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := await sock.recv(65536):
                data += chunk
        assert [orjson.loads(line)["id"] for line in data.splitlines()] == list(range(500))


async def test_shutdown_reaches_every_reader_waiting_for_its_socket(tmp_path):
    async with trio.open_nursery() as nursery:
        srv = await start_server(nursery, str(tmp_path / "relay.db"))
        clients = [await srv.connect() for _ in range(30)]
        for c in clients:
            await c.ok("ping")
        await wait_all_tasks_blocked()
        with trio.fail_after(1):  # each reader is woken at once, not at its idle timeout
            srv.handle.shutdown()
            for c in clients:
                assert await c.at_eof()


async def test_a_read_of_many_cheap_requests_is_dispatched_in_slices(tmp_path, monkeypatch):
    """1,000 pings in one read: the reader lets other tasks run at least every SLICE_LINES
    lines, rather than once for the whole read (a ping flood held others for ~170 ms)."""
    trace: list[str] = []  # "d": a line dispatched; "o": another task ran
    dispatch = Dispatcher.dispatch

    def traced(self: Dispatcher, connection: Any, line: bytes, started: float) -> None:
        trace.append("d")
        dispatch(self, connection, line, started)

    monkeypatch.setattr(Dispatcher, "dispatch", traced)
    async with custom_server(tmp_path) as srv, connected(srv) as c:
        reading = True

        async def other_task() -> None:
            while reading:
                trace.append("o")
                await trio.lowlevel.checkpoint()

        with trio.fail_after(BOUND_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(other_task)
                await c.send_raw(pipelined([{"op": "ping", "id": i} for i in range(1000)]))
                for i in range(1000):
                    assert await c.read() == {"id": i, "ok": True}
                reading = False
    slices = [len(run) for run in "".join(trace).split("o") if run]
    assert sum(slices) == 1000
    # trio may run the reader last in one batch of tasks and first in the next, so two of
    # its slices can meet in the trace; one read of all the lines would make 1,000.
    assert max(slices) <= 2 * SLICE_LINES, slices


async def test_replies_held_within_a_read_do_not_stall_it_at_max_in_flight(tmp_path):
    """Replies given at once are written together, but count as owed until written: a
    read of more of them than max_in_flight must still be answered in full."""
    limits = wire.Limits(max_in_flight=8)
    async with custom_server(tmp_path, limits=limits) as srv, connected(srv) as c:
        requests = [
            {"op": "ping", "id": i} if i % 3 else {"op": "no_such_op", "id": i} for i in range(100)
        ]
        await c.send_raw(pipelined(requests))
        for i in range(100):
            reply = await c.read()
            assert reply["id"] == i and reply["ok"] is bool(i % 3), reply


async def test_a_reply_from_another_task_is_written_while_the_reader_waits_for_room(tmp_path):
    """A whole-queue dead_retry is answered by a task of its own, not by the reader: its
    reply must go out at once even while the reader, mid-read, waits at max_in_flight
    (only the reader's own replies are held)."""
    limits = wire.Limits(max_in_flight=1)
    async with custom_server(tmp_path, limits=limits) as srv, connected(srv) as c:
        await c.send_raw(
            pipelined(
                [
                    {"op": "dead_retry", "id": "retry", "queue": "q", "all": True},
                    {"op": "ping", "id": "ping"},
                ]
            )
        )
        with trio.fail_after(BOUND_S):
            assert await c.read() == {"id": "retry", "ok": True, "count": 0}
            assert await c.read() == {"id": "ping", "ok": True}


# -- long-polls at max_in_flight -----------------------------------------------------------------


def parked_leases(n: int, wait_ms: int = 30_000) -> bytes:
    return pipelined(
        [
            {"op": "lease", "id": i, "queues": ["lp"], "worker_id": W, "wait_ms": wait_ms}
            for i in range(n)
        ]
    )


async def test_long_polls_filling_max_in_flight_end_at_once_when_the_client_half_closes(
    tmp_path,
):
    """A reader waiting for room must still see the client stop sending: its parked
    long-polls are then answered at once, as with fewer of them (not at their wait)."""
    limits = wire.Limits(max_in_flight=4)
    async with custom_server(tmp_path, limits=limits) as srv:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with sock, trio.fail_after(5):  # the leases wait 30 s
            await sock.connect(srv.handle.address)
            await sock.send(parked_leases(4))
            await wait_all_tasks_blocked()  # all four parked; the reader waits for room
            sock.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := await sock.recv(65536):
                data += chunk
        replies = [orjson.loads(line) for line in data.splitlines()]
        assert sorted(r["id"] for r in replies) == [0, 1, 2, 3]
        assert all(r["ok"] and r["jobs"] == [] for r in replies), replies


def reset(sock: trio.socket.SocketType) -> None:
    """Close with a reset (SO_LINGER 0), as a killed or vanished client may."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
    sock.close()


@pytest.mark.parametrize(
    ("leases", "after"),
    [(4, b""), (4, pipelined([{"op": "ping", "id": "more"}])), (5, b"")],
    ids=["nothing more", "a request after them", "one lease past room"],
)
async def test_no_job_is_leased_to_a_client_gone_while_its_long_polls_fill_max_in_flight(
    tmp_path, leases, after
):
    """Gone (a reset) while its parked leases fill max_in_flight: they must not take the
    next job. A request sent before the reset (or a lease past room) stays unread, so the
    reader cannot see the reset behind it; nor may that lease be dispatched later."""
    limits = wire.Limits(max_in_flight=4)
    async with custom_server(tmp_path, limits=limits) as srv, connected(srv) as c:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with trio.fail_after(BOUND_S):
            await sock.connect(srv.handle.address)
            await sock.send(parked_leases(leases))
            await wait_all_tasks_blocked()  # read and sent to the writer
            await writer_barrier(c)  # the writer answered them before this: they are parked
            if after:
                await sock.send(after)
                await wait_all_tasks_blocked()
            reset(sock)
            await wait_all_tasks_blocked()
        await submit(c, queue="lp")
        # Woken, each lease asks the socket's state before it is claimed again, and a
        # reset closes the connection. That happens in the trio thread when it runs the
        # submit's hand-off, which the submit's reply (written by the writer thread) and a
        # barrier's do not wait for: so wait for the close, then for any claim queued
        # before it to commit.
        await wait_until(lambda: closed_but(c), what="the reset connection closed")
        await writer_barrier(c)
        counts = await queue_stats(c, "lp")
        assert (counts["ready"], counts["leased"]) == (1, 0), counts


async def test_parked_long_polls_do_not_count_against_the_reply_byte_budget(tmp_path):
    """A lease reserves its largest reply, but gives it back while it is parked: 128 of
    them (count 1, ~256 KiB each: 32 MiB) must not stop the reader behind them."""
    async with custom_server(tmp_path) as srv, connected(srv) as c:
        await c.send_raw(parked_leases(128))
        await wait_all_tasks_blocked()
        async with connected(srv) as other:
            await writer_barrier(other)  # all 128 parked
        with trio.fail_after(2):  # not their 30 s wait
            assert (await c.ok("ping"))["ok"] is True
            await submit(c, queue="lp")  # wakes one of them


async def test_a_session_closed_for_any_reason_has_its_woken_long_polls_claim_nothing(
    tmp_path, monkeypatch
):
    """The watchdog, the unsent cap or a failed write may close a session in the same
    tick as a commit wakes its long-polls: they must not be claimed again for it."""
    sessions: list[session_module.Session] = []
    init = session_module.Session.__init__

    def keep(self: session_module.Session, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        sessions.append(self)

    monkeypatch.setattr(session_module.Session, "__init__", keep)
    async with custom_server(tmp_path) as srv, connected(srv) as c:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with sock, trio.fail_after(BOUND_S):
            await sock.connect(srv.handle.address)
            await sock.send(parked_leases(2))
            await wait_all_tasks_blocked()
            await writer_barrier(c)  # both parked
            session = sessions[-1]
            listeners = session.dispatcher.writer.commit_listeners
            on_commit = session.dispatcher.longpolls.on_commit
            at = next(i for i, x in enumerate(listeners) if x.on_commit == on_commit)

            def close_first(changes: Any, wake: Any = listeners[at]) -> None:
                if not session.closed:
                    session._broken(trio.TooSlowError("closed as the commit lands"))
                wake(changes)

            listeners[at] = close_first
            await submit(c, queue="lp")
            await wait_all_tasks_blocked()
            await writer_barrier(c)  # (a woken claim, queued before this, committed)
            counts = await queue_stats(c, "lp")
        assert (counts["ready"], counts["leased"]) == (1, 0), counts


async def test_long_polls_woken_together_stay_within_the_reply_budget(tmp_path, monkeypatch):
    """20 parked leases of count 5 may take ~4 MB of 40 KiB jobs when one commit makes
    100 of them ready. A client slow to read must not be sent all of that (past the unsent
    cap it would be closed with those jobs leased to it): each woken lease reserves its
    reply within the room left (so it may take fewer than its count), and those past it
    park again until the client reads. Then every lease gets jobs, and every job leased
    is received."""
    monkeypatch.setattr(session_module, "MAX_OWED_BYTES", 1024 * 1024)
    monkeypatch.setattr(outbox_module, "MAX_UNSENT_BYTES", 2 * 1024 * 1024)
    payload = "x" * 40 * 1024
    limits = wire.Limits(max_frame_bytes=8 * 1024 * 1024)  # all 100 jobs in one commit
    async with custom_server(tmp_path, limits=limits) as srv, connected(srv) as c:
        slow = await open_raw(srv)  # a small receive buffer: it reads later
        leases = [
            {"op": "lease", "id": i, "queues": ["lp"], "worker_id": W, "count": 5,
             "wait_ms": 30_000}
            for i in range(20)
        ]  # fmt: skip
        with trio.fail_after(BOUND_S):
            await slow.send(pipelined(leases))
            await wait_all_tasks_blocked()
            await writer_barrier(c)  # all parked
            with session_events() as events:
                await c.ok("submit_batch", jobs=[{"queue": "lp", "payload": payload}] * 100)
                await wait_all_tasks_blocked()  # the woken leases' claims are queued
                await writer_barrier(c)  # and committed and answered before this
            assert (await queue_stats(c, "lp"))["leased"] < 100  # not all sent at once
            # Now it reads: all 20 replies, and a ping after them on the same connection.
            await slow.send(pipelined([{"op": "ping", "id": "after"}]))
            replies, buffer = [], b""
            while len(replies) < 21:
                buffer += await slow.recv(1 << 20)
                *lines, buffer = buffer.split(b"\n")
                replies += [orjson.loads(line) for line in lines]
        slow.close()
        assert "connection.backlog_too_large" not in events
        leased = [reply["jobs"] for reply in replies if reply["id"] != "after"]
        assert all(leased)  # each lease waited for room rather than end with no job
        jobs = {job["job_id"] for jobs in leased for job in jobs}
        assert 20 <= len(jobs) <= 100 and (await queue_stats(c, "lp"))["leased"] == len(jobs)


async def test_a_woken_long_poll_takes_no_more_than_a_lease_that_found_jobs_at_once(tmp_path):
    """Both stop adding jobs at max_reply_bytes (1 MiB of texts; 200 KiB jobs: 6): a woken
    lease's claim, budgeted by what it reserved, must not take more."""
    payload = "x" * 200 * 1024
    limits = wire.Limits(max_frame_bytes=4 * 1024 * 1024)  # all ten jobs in one commit
    async with (
        custom_server(tmp_path, limits=limits) as srv,
        connected(srv) as c,
        connected(srv) as w,
    ):
        for _ in range(10):
            await submit(c, queue="now", payload=payload)
        direct = (await w.ok("lease", queues=["now"], worker_id=W, count=10))["jobs"]
        waiting = await w.send("lease", queues=["later"], worker_id=W, count=10, wait_ms=9000)
        await wait_all_tasks_blocked()
        await writer_barrier(c)  # parked
        await c.ok("submit_batch", jobs=[{"queue": "later", "payload": payload}] * 10)
        reply = await w.read()
        assert reply["id"] == waiting
        assert len(reply["jobs"]) == len(direct) == 6


# -- the watchdog ------------------------------------------------------------------------------


async def test_long_poll_longer_than_idle_timeout_is_not_idle(tmp_path):
    async with custom_server(tmp_path, idle_timeout_ms=300) as srv, connected(srv) as c:
        started = trio.current_time()
        request_id = await c.send("lease", queues=["empty"], worker_id=W, wait_ms=1000)
        reply = await c.read()  # not EOF at the idle timeout
        waited = trio.current_time() - started
        assert reply == {"id": request_id, "ok": True, "jobs": []}
        assert waited >= 0.9, waited
        await c.ok("ping")  # and still open after it


async def test_long_poll_does_not_keep_a_half_sent_line_open(tmp_path):
    """A parked long-poll is not idleness, but a line stalled half-way is."""
    async with custom_server(tmp_path, idle_timeout_ms=300) as srv, connected(srv) as c:
        started = trio.current_time()
        await c.send("lease", queues=["empty"], worker_id=W, wait_ms=5000)
        await c.send_raw(b'{"op":"ping","id":')
        lines = []
        with trio.fail_after(2):  # well before the long-poll's 5 s
            while (line := await c.read_line()) is not None:
                lines.append(orjson.loads(line))
        closed_after = trio.current_time() - started
        assert closed_after >= 0.25, closed_after
        # The parked lease, if answered before closing, is answered with no job.
        assert all(reply["jobs"] == [] for reply in lines), lines


async def test_idle_connection_is_closed_and_a_pinging_one_is_not(tmp_path):
    idle_s = 0.3
    async with (
        custom_server(tmp_path, idle_timeout_ms=int(idle_s * 1000)) as srv,
        connected(srv) as idle,
        connected(srv) as busy,
    ):
        started = trio.current_time()
        idle_closed_after: list[float] = []

        async def watch_idle() -> None:
            assert await idle.at_eof()
            idle_closed_after.append(trio.current_time() - started)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_idle)
                while trio.current_time() - started < 4 * idle_s:
                    await busy.ok("ping")
                    await trio.sleep(idle_s / 3)
        assert len(idle_closed_after) == 1
        assert idle_s * 0.8 <= idle_closed_after[0] <= idle_s + 1.5, idle_closed_after
        await busy.ok("ping")  # open past four idle timeouts
        assert await connections(busy) == 1


# -- a reader stopped while it waits for the writer ------------------------------------------


class FullWriter:
    """A writer that stays full (as under heavy load) and then closes: a line dispatched
    once the reader stops waiting for room is refused."""

    def full(self) -> bool:
        return True

    async def wait_room(self) -> None:
        await trio.sleep_forever()

    def put(self, item: Any) -> None:
        raise ShuttingDown("the store is shutting down")


async def test_replies_are_written_when_reading_stops_in_the_middle_of_a_chunk():
    # One chunk: a ping (answered at once), then a submit that waits for room in the
    # writer. Stopping the reader there (shutdown) still dispatches the submit, which the
    # closed writer refuses: both replies must reach the client, promptly.
    from relay.server.connections.session import Session
    from relay.server.requests.dispatch import Dispatcher
    from relay.server.requests.longpoll import LongPolls

    server_end, client_end = socket.socketpair()
    server_stream = trio.SocketStream(trio.socket.from_stdlib_socket(server_end))
    client = trio.SocketStream(trio.socket.from_stdlib_socket(client_end))
    writer: Any = FullWriter()
    dispatcher = Dispatcher(writer, wire.Limits(max_wait_ms=3000), LongPolls(writer))
    session = Session(server_stream, dispatcher, idle_timeout=60.0)
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.run)
            await client.send_all(
                pipelined([
                    {"op": "ping", "id": 1},
                    {"op": "submit", "id": 2, "queue": "q", "payload": {}},
                ])
            )  # fmt: skip
            await wait_all_tasks_blocked()
            session.stop_reading()
            data = b""
            with trio.fail_after(1.0):  # not the drain's 3 s + grace
                while data.count(b"\n") < 2:
                    got = await client.receive_some(65536)
                    assert got, f"closed with {data!r}"
                    data += got
            nursery.cancel_scope.cancel()
    replies = {r["id"]: r for r in map(orjson.loads, data.splitlines())}
    assert replies[1]["ok"] is True
    assert replies[2]["error"]["code"] == "shutting_down"


class RecordingFullWriter(FullWriter):
    """A writer that stays full, and records what is put into it."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, item: Any) -> None:
        self.items.append(item)


async def test_lines_waiting_for_room_are_dropped_when_the_connection_fails():
    """A connection closed for a fault (a reset, a client that stops reading) while its
    reader waits for room in the writer: the lines it read are not dispatched, so no lease
    takes jobs for a client nobody serves. (At shutdown they are: see the test above.)"""
    from relay.server.connections.session import Session
    from relay.server.requests.dispatch import Dispatcher
    from relay.server.requests.longpoll import LongPolls

    server_end, client_end = socket.socketpair()
    server_stream = trio.SocketStream(trio.socket.from_stdlib_socket(server_end))
    client = trio.SocketStream(trio.socket.from_stdlib_socket(client_end))
    writer = RecordingFullWriter()
    dispatcher = Dispatcher(writer, wire.Limits(max_wait_ms=3000), LongPolls(writer))  # type: ignore[arg-type]
    session = Session(server_stream, dispatcher, idle_timeout=60.0)
    lease = {"op": "lease", "id": 2, "queues": ["q"], "worker_id": "w"}
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.run)
            await client.send_all(pipelined([{"op": "ping", "id": 1}, lease]))
            await wait_all_tasks_blocked()
            session._broken(ConnectionResetError("reset by the peer"))
    assert writer.items == [] and session.closed
    await client.aclose()
