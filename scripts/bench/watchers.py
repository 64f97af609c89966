"""What a watcher costs: ``relay-bench --watchers``.

Each scenario runs against one server three ways, in turn: with no watcher, with one idle
watcher (watching a queue that gets no jobs: the store records every event, the pump
filters them all out) and with one watcher of every event (reading as fast as it can).
The runs of the three are interleaved, so that the machine's drift falls on all three
alike. The all-events watcher's count of events received and of events dropped (``lagged``)
is reported beside its rate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import attrs
import orjson
import trio

from relay_scripts.bench.conn import READ_BYTES, Conn
from relay_scripts.bench.loads import (
    lease_ack_processes,
    prefill,
    submit_batches,
    submit_one_at_a_time,
    submit_pipelined,
)
from relay_scripts.bench.measure import RUN_TIMEOUT_S
from relay_scripts.bench.results import Result
from relay_scripts.bench.scenarios import Sizes
from relay_scripts.bench.servers import running_server

KINDS = ("none", "idle", "all")
IDLE_QUEUE = "bench-watch-idle"  # no scenario submits to it


@attrs.define
class Seen:
    """What a watcher received: job events, and events it lost (``lagged``)."""

    events: int = 0
    dropped: int = 0


async def _read_events(conn: Conn, seen: Seen) -> None:
    while True:
        data = await conn.stream.receive_some(READ_BYTES)
        if not data:
            return
        conn.buffer += data
        *lines, conn.buffer = conn.buffer.split(b"\n")
        for line in lines:
            if b'"event":"job"' in line:
                seen.events += 1
            elif b'"event":"lagged"' in line:
                seen.dropped += orjson.loads(line)["dropped"]


@asynccontextmanager
async def watching(address: tuple[str, int], kind: str) -> AsyncIterator[Seen]:
    """A watcher of ``kind`` (see KINDS) open for the block; what it saw."""
    seen = Seen()
    if kind == "none":
        yield seen
        return
    conn = await Conn.open(address)
    filters = {} if kind == "all" else {"queues": [IDLE_QUEUE]}
    await conn.call("watch", **filters)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_read_events, conn, seen)
        try:
            yield seen
            # The events of the run's last commits are still on their way.
            with trio.move_on_after(0.5):
                await trio.sleep_forever()
        finally:
            nursery.cancel_scope.cancel()
    await conn.aclose()


Scenario = tuple[str, Callable[[], Awaitable[float]], Callable[[], Awaitable[None]] | None]


def _scenarios(address: tuple[str, int], sizes: Sizes) -> list[Scenario]:
    a = [address]
    return [
        ("submit, 8 producer(s) one-at-a-time",
         lambda: submit_one_at_a_time(a, 8, sizes.per_producer), None),
        ("submit, 1 connection pipelining (window 64)",
         lambda: submit_pipelined(a, 64, sizes.pipelined), None),
        ("submit_batch of 100, 1 client(s)",
         lambda: submit_batches(a, 1, 100, sizes.batches), None),
        ("lease+ack, 8 processes, count 8, pipelined acks",
         lambda: lease_ack_processes(a, 8, 8, sizes.backlog),
         lambda: prefill(a, sizes.backlog)),
    ]  # fmt: skip


async def run_watchers(
    sizes: Sizes, runs: int, db_dir: str, note: Callable[[Result], None]
) -> None:
    """Every scenario of ``_scenarios``, ``runs`` times with each kind of watcher; each
    result given to ``note``. The all-events watcher's counts go in its ``extra``."""
    with running_server("full", db_dir) as server:
        for name, run_once, before_each in _scenarios(server.address, sizes):
            by_kind = {kind: Result(f"{name}, watcher: {kind}", "jobs/s", []) for kind in KINDS}
            for _ in range(runs):
                for kind, result in by_kind.items():
                    if before_each is not None:
                        await before_each()
                    async with watching(server.address, kind) as seen:
                        with trio.fail_after(RUN_TIMEOUT_S):
                            result.runs.append(await run_once())
                    if kind == "all":
                        result.extra["events"] = result.extra.get("events", 0) + seen.events
                        result.extra["dropped"] = result.extra.get("dropped", 0) + seen.dropped
            for result in by_kind.values():
                note(result)
