"""Exactly once per slot, with real server processes killed (SIGKILL) while slots are due:
a SQLite server killed and restarted in a loop, and three servers on one PostgreSQL
database, one of them killed. Second-resolution schedules (--allow-second-schedules) with
catch_up "all" make every second a slot that must have exactly one job in the end: none
twice (a slot's job and the move past it commit together), none missing (the slots missed
while no server ran are caught up)."""

from __future__ import annotations

import random
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import trio

from tests import pg

from .conftest import BOUND_S
from .test_process import server_process
from .test_servers_postgres import servers

SECONDS = ("--allow-second-schedules",)


def assert_each_slot_once(rows: list[tuple[str, int]], last: dict[str, int]) -> int:
    """``rows`` (schedule, slot) of every scheduled job: each slot at most once, and every
    second from a schedule's first slot to its last slot passed has its job. Returns the
    slots checked."""
    by_schedule: dict[str, list[int]] = {}
    for name, slot in rows:
        by_schedule.setdefault(name, []).append(slot)
    checked = 0
    for name, slots in by_schedule.items():
        assert len(slots) == len(set(slots)), f"{name}: a slot submitted twice"
        expected = list(range(min(slots), last[name] + 1, 1000))
        assert sorted(slots) == expected, f"{name}: slots missing"
        checked += len(slots)
    return checked


async def put(client, name: str) -> None:
    await client.ok(
        "schedule_put", name=name, cron="* * * * * *", queue="ticks", payload={"s": name},
        catch_up="all", catch_up_max=1000,
    )  # fmt: skip


async def test_sqlite_server_killed_in_a_loop_submits_each_slot_once(tmp_path: Path):
    db = tmp_path / "relay.db"
    rng = random.Random(28)
    for round_ in range(4):
        async with server_process(db, *SECONDS) as server:
            if round_ == 0:
                client = await server.connect()
                await put(client, "tick")
                await client.aclose()
            await trio.sleep(rng.uniform(1.0, 2.0))  # a slot or more due, maybe mid-commit
            server.process.kill()
            assert await server.wait(BOUND_S) == -signal.SIGKILL
        await trio.sleep(rng.uniform(0.0, 1.5))  # down: slots missed, caught up next start
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute(
            "SELECT 'tick', scheduled_for FROM jobs WHERE scheduled_for IS NOT NULL"
        ).fetchall()
        last = dict(conn.execute("SELECT name, last_slot FROM schedules").fetchall())
    finally:
        conn.close()
    assert assert_each_slot_once(rows, last) >= 6


@pytest.fixture(scope="module")
def db_url() -> Iterator[str]:
    with pg.run_database() as conninfo:
        yield pg.server_url(conninfo)


async def test_three_postgres_servers_one_killed_submit_each_slot_once(db_url: str):
    names = [f"s{i}" for i in range(5)]
    async with servers(db_url, extra=SECONDS) as group:
        client = await group[0].connect()
        for name in names:
            await put(client, name)
        await client.aclose()
        await trio.sleep(2.0)
        group[1].process.send_signal(signal.SIGKILL)
        assert await group[1].wait(BOUND_S) == -signal.SIGKILL
        await trio.sleep(2.0)
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT s.name, j.scheduled_for FROM jobs j JOIN schedules s "
            "ON j.payload::jsonb ->> 's' = s.name WHERE j.scheduled_for IS NOT NULL"
        ).fetchall()
        last = dict(conn.execute("SELECT name, last_slot FROM schedules").fetchall())
    assert set(last) == set(names)
    assert assert_each_slot_once(rows, last) >= 5 * 3
