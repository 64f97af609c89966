"""Clients that pipeline requests with large replies and never read them: what all the
connections owe together stays within the server's reply budget plus one reply per
connection (each connection alone would hold up to 32 MiB), a client that reads is served
meanwhile, and a connection that starts reading gets every reply and is read again.

A real server on 127.0.0.1; what the connections owe is read off its sessions.
"""

from __future__ import annotations

import socket
import time

import attrs
import pytest
import trio

from relay.protocol import wire
from relay.server import serve as serve_module
from relay.server.connections.session import MAX_OWED_BYTES, Session
from relay.server.requests.admin import inspect_reply_bytes
from tests.server.conftest import LineClient
from tests.worker.helpers import BOUND_S, start_server, wait_until

BUDGET = 2 * 1024 * 1024
# Small texts beside the payload keep an inspect's reservation (its most) near its payload.
LIMITS = wire.Limits(max_result_bytes=4096, max_error_bytes=256, max_traceback_bytes=256)
PAYLOAD = {"pad": "x" * 200_000}  # an inspect's reply: ~200 kB
HOGS = 4
PIPELINED = 200  # inspects each hog sends and never reads: ~40 MB of replies
WATCH_S = 1.5  # how long what the sessions owe is watched
# A reader's inspect, while the hogs hold the budget, is answered within this (it takes
# milliseconds: the bound is generous for a loaded test machine).
ANSWERED_WITHIN_S = 2.0


@pytest.fixture
def sessions(monkeypatch) -> list[Session]:
    """Every session the server makes, in order."""
    made: list[Session] = []

    class Recorded(Session):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(serve_module, "Session", Recorded)
    return made


def owed(sessions: list[Session]) -> int:
    """The reply bytes all sessions owe: reserved for replies in flight, or unsent."""
    return sum(s._reserved - s._released_now + s._outbox.unsent for s in sessions)


async def connect_small(address: tuple[str, int]) -> LineClient:
    """A connection whose receive buffer is small, so that the kernel holds few of the
    replies it does not read (the server's memory holds the rest)."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    await sock.connect(address)
    return LineClient(trio.SocketStream(sock))


async def test_connections_that_never_read_stay_within_the_budget(tmp_path, sessions):
    reservation = inspect_reply_bytes(LIMITS)  # what one inspect reserves: its most
    assert reservation < BUDGET // 4  # (its texts and attempts: ~0.5 MB)
    # The bound is far below what the hogs would hold on the per-connection limit alone.
    bound = BUDGET + (HOGS + 1) * reservation
    assert 8 * bound < HOGS * MAX_OWED_BYTES
    with trio.fail_after(4 * BOUND_S):
        async with trio.open_nursery() as nursery:
            server = await start_server(
                nursery, str(tmp_path / "relay.db"), limits=LIMITS, max_reply_buffer_bytes=BUDGET
            )
            reader = LineClient(await trio.open_tcp_stream(*server.handle.address))
            job_id = (await reader.ok("submit", queue="q", payload=PAYLOAD))["job_id"]

            hogs = [await connect_small(server.handle.address) for _ in range(HOGS)]
            line = b'{"op":"inspect","id":1,"job_id":"%s"}\n' % job_id.encode()
            for hog in hogs:
                await hog.send_raw(line * PIPELINED)

            peak = 0
            deadline = trio.current_time() + WATCH_S
            while trio.current_time() < deadline:
                peak = max(peak, owed(sessions))
                await trio.sleep(0.005)
            assert peak > BUDGET // 2, "the hogs never filled the budget: the test proves nothing"
            assert peak <= bound, f"{peak} bytes owed, over {bound}"

            # (The hogs still hold about the budget: read again whenever their sockets
            # take some of what they owe and the total falls under it.)
            assert owed(sessions) > BUDGET // 2

            # A client that reads is served meanwhile, promptly.
            for _ in range(10):
                began = time.monotonic()
                reply = await reader.ok("inspect", job_id=job_id)
                assert reply["job"]["payload"] == PAYLOAD
                assert time.monotonic() - began < ANSWERED_WITHIN_S
            assert owed(sessions) <= bound
            # So is a worker: a lease, and a long-poll woken by a submit.
            worker = LineClient(await trio.open_tcp_stream(*server.handle.address))
            await reader.ok("submit", queue="work", payload=PAYLOAD)
            began = time.monotonic()
            [leased] = (await worker.ok("lease", queues=["work"], worker_id="w"))["jobs"]
            assert leased["payload"] == PAYLOAD
            parked = await worker.send("lease", queues=["later"], worker_id="w", wait_ms=10_000)
            await worker.ok("ack", job_id=leased["job_id"], worker_id="w", token=leased["token"])
            later_id = (await reader.ok("submit", queue="later", payload=PAYLOAD))["job_id"]
            woken = await worker.read()
            assert woken["id"] == parked and woken["jobs"][0]["job_id"] == later_id, woken
            assert time.monotonic() - began < 3 * ANSWERED_WITHIN_S
            await worker.aclose()
            assert owed(sessions) <= bound

            # A hog that reads gets every reply, and its later requests are read too.
            first = hogs[0]
            for _ in range(PIPELINED):
                assert (await first.read())["ok"]
            assert (await first.request("ping"))["ok"]
            assert owed(sessions) <= bound

            # Nothing is left owed once the others go: the budget is whole again.
            for hog in hogs:
                await hog.aclose()
            await reader.aclose()

            async def nothing_owed() -> bool:
                return owed(sessions) == 0 and sessions[0]._budget.total == 0

            await wait_until(nothing_owed, what="every reply byte counted out")
            await server.stop()


def test_the_budget_is_a_server_option_with_a_documented_default():
    from relay.server.core import ServerConfig

    assert attrs.fields(ServerConfig).max_reply_buffer_bytes.default == 256 * 1024 * 1024
