"""The schedule ops over real sockets (TCP and WebSocket, SQLite and PostgreSQL):
schedule_put, schedule_list, schedule_pause/resume, schedule_delete, their refusals, and a
seconds schedule's jobs leased with their slot (``scheduled_for``)."""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import AsyncIterator

import pytest
import trio

from relay.protocol import wire
from tests import pg
from tests.server.conftest import LineClient, RunningServer, start_server
from tests.server.test_protocol import assert_error, custom_server
from tests.worker.helpers import serving

SCHEDULE_FIELDS = {
    "name", "cron", "timezone", "queue", "payload", "priority", "retries", "backoff",
    "catch_up", "catch_up_max", "paused", "next_at", "last_slot", "last_job_id",
    "last_job_state", "last_job_slot", "last_refusal", "created_at", "updated_at",
}  # fmt: skip
SECONDS = wire.Limits(allow_second_schedules=True)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@pytest.fixture(params=["sqlite", "postgres"])
async def server(request, tmp_path) -> AsyncIterator[RunningServer]:
    db = str(tmp_path / "relay.db")
    if request.param == "postgres":
        db = pg.server_url(request.getfixturevalue("pg_url"), f"sched_{secrets.token_hex(4)}")
    start = functools.partial(start_server, limits=SECONDS, max_schedules=3)
    async with serving(start, db) as running:
        yield running


@pytest.fixture(params=["tcp", "websocket"])
async def client(request, server: RunningServer) -> AsyncIterator[LineClient]:
    c = await server.connect_by(request.param)
    try:
        yield c
    finally:
        await c.aclose()


async def test_put_list_pause_resume_delete(client):
    before = now_ms()
    reply = await client.ok(
        "schedule_put", name="nightly", cron="@daily", queue="reports", payload={"r": 1},
        timezone="Europe/Berlin", retries=2, priority="high", timeout_ms=5000,
    )  # fmt: skip
    schedule = reply["schedule"]
    assert set(schedule) == SCHEDULE_FIELDS | {"timeout_ms"}
    assert (schedule["cron"], schedule["timezone"], schedule["payload"]) == (
        "0 0 * * *", "Europe/Berlin", {"r": 1},
    )  # fmt: skip
    assert (schedule["retries"], schedule["priority"], schedule["catch_up"]) == (
        2,
        "high",
        "latest",
    )
    assert before < schedule["next_at"] <= before + 25 * 3_600_000
    assert schedule["last_job_id"] is None and schedule["paused"] is False
    await client.ok("schedule_put", name="a", cron="*/5 * * * *", queue="q", payload=None)
    page = await client.ok("schedule_list", limit=1)
    assert [s["name"] for s in page["schedules"]] == ["a"] and page["next_cursor"] == "a"
    rest = await client.ok("schedule_list", cursor="a")
    assert [s["name"] for s in rest["schedules"]] == ["nightly"] and rest["next_cursor"] is None
    paused = (await client.ok("schedule_pause", name="a"))["schedule"]
    assert paused["paused"] is True
    resumed = (await client.ok("schedule_resume", name="a"))["schedule"]
    assert resumed["paused"] is False and resumed["next_at"] > before
    assert (await client.ok("schedule_delete", name="a"))["deleted"] is True
    assert_error(await client.request("schedule_delete", name="a"), "not_found")
    assert_error(await client.request("schedule_pause", name="a"), "not_found")
    assert [s["name"] for s in (await client.ok("schedule_list"))["schedules"]] == ["nightly"]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "* * *"}, "cron"),
        ({"cron": "@reboot"}, "cron"),
        ({"timezone": "Mars/Base"}, "timezone"),
        ({"timezone": "localtime"}, "timezone"),  # each host's own zone: not an IANA name
        ({"timezone": "posix/Europe/Berlin"}, "timezone"),
        ({"queue": "no spaces"}, "queue"),
        ({"name": "bad name"}, "name"),
        ({"payload": "x" * 300_000}, "payload"),
        ({"catch_up": "some"}, "catch_up"),
        ({"catch_up_max": 0}, "catch_up_max"),
        ({"priority": "urgent"}, "priority"),
    ],
)
async def test_put_refusals_name_the_field(client, fields, field):
    request = {"name": "n", "cron": "* * * * *", "queue": "q", "payload": 1, **fields}
    error = assert_error(await client.request("schedule_put", **request), "bad_request")
    assert error["message"].startswith(field), error


async def test_the_number_of_schedules_is_bounded(client):
    for name in "abc":
        await client.ok("schedule_put", name=name, cron="@hourly", queue="q", payload=1)
    error = assert_error(
        await client.request("schedule_put", name="d", cron="@hourly", queue="q", payload=1),
        "too_many_schedules",
    )
    assert "max 3" in error["message"]
    await client.ok("schedule_put", name="a", cron="@daily", queue="q", payload=2)


async def test_a_seconds_schedule_submits_jobs_leased_with_their_slot(client):
    await client.ok("schedule_put", name="tick", cron="* * * * * *", queue="ticks", payload=7)
    with trio.fail_after(10):
        reply = await client.ok("lease", queues=["ticks"], worker_id="w", wait_ms=5_000)
    [job] = reply["jobs"]
    assert job["payload"] == 7 and job["scheduled_for"] % 1000 == 0
    assert now_ms() - 5_000 < job["scheduled_for"] <= now_ms()
    info = (await client.ok("inspect", job_id=job["job_id"]))["job"]
    assert info["scheduled_for"] == job["scheduled_for"]
    await client.ok("schedule_pause", name="tick")
    [listed] = (await client.ok("schedule_list"))["schedules"]
    assert listed["last_slot"] >= job["scheduled_for"]
    assert listed["last_job_state"] in ("ready", "leased")
    # A job of no schedule carries no slot.
    await client.ok("submit", queue="plain", payload=1)
    [plain] = (await client.ok("lease", queues=["plain"], worker_id="w"))["jobs"]
    assert "scheduled_for" not in plain


async def test_a_schedule_leaves_what_it_does_not_give_to_the_queues_defaults(client):
    """retries, backoff and timeout_ms left out: each slot's job gets its queue's defaults
    as they are when the slot runs; given, the schedule's own."""
    await client.ok("queue_config", queue="ticks", default_retries=7, default_timeout_ms=9000)
    put = await client.ok("schedule_put", name="t", cron="* * * * * *", queue="ticks", payload=1)
    assert put["schedule"]["retries"] is None and put["schedule"]["backoff"] is None
    assert "timeout_ms" not in put["schedule"]
    with trio.fail_after(10):
        [job] = (await client.ok("lease", queues=["ticks"], worker_id="w", wait_ms=5_000))["jobs"]
    assert (job["max_attempts"], job["timeout_ms"]) == (8, 9000)
    await client.ok("schedule_put", name="t", cron="* * * * * *", queue="ticks", payload=1,
                    retries=1)  # fmt: skip
    with trio.fail_after(10):
        while True:
            reply = await client.ok("lease", queues=["ticks"], worker_id="w", wait_ms=5_000)
            if reply["jobs"] and reply["jobs"][0]["max_attempts"] == 2:
                break
    [listed] = (await client.ok("schedule_list"))["schedules"]
    assert listed["retries"] == 1 and listed["backoff"] is None


async def test_seconds_need_the_servers_option(tmp_path):
    async with custom_server(tmp_path) as server:
        c = await server.connect()
        try:
            error = assert_error(
                await c.request("schedule_put", name="t", cron="* * * * * *", queue="q", payload=1),
                "bad_request",
            )
            assert (
                error["message"].startswith("cron")
                and "--allow-second-schedules" in error["message"]
            )
        finally:
            await c.aclose()


async def test_metrics_count_a_schedules_runs_and_the_age_of_its_last_slot(server, client):
    from tests.server.test_lifecycle import scrape

    await client.ok("schedule_put", name="tick", cron="* * * * * *", queue="ticks", payload=1)
    await client.ok("schedule_put", name="never", cron="0 0 1 1 *", queue="q", payload=1)
    with trio.fail_after(10):
        await client.ok("lease", queues=["ticks"], worker_id="w", wait_ms=5_000)
    _text, samples = await scrape(server)
    assert samples['relay_schedule_runs_total{schedule="tick"}'] >= 1
    assert 0 <= samples['relay_schedule_last_run_age_seconds{schedule="tick"}'] < 10
    assert 'relay_schedule_last_run_age_seconds{schedule="never"}' not in samples


async def test_a_refused_slot_shows_in_the_list_and_metrics_and_the_age_grows(tmp_path):
    """A queue at its depth limit refuses every slot: the schedule says so, the refusals
    are counted, and the age of its last job's slot keeps growing (the alert fires)."""
    from tests.server.test_lifecycle import scrape

    async with custom_server(tmp_path, limits=SECONDS, queue_depths={"full": 1}) as custom:
        c = await custom.connect()
        try:
            await c.ok("submit", queue="full", payload=0)  # the queue is full from the start
            await c.ok("schedule_put", name="t", cron="* * * * * *", queue="full", payload=1)
            with trio.fail_after(10):
                while True:
                    [listed] = (await c.ok("schedule_list"))["schedules"]
                    if listed["last_slot"] is not None:
                        break
                    await trio.sleep(0.05)
            assert listed["last_job_id"] is None and listed["last_job_slot"] is None
            assert "full" in listed["last_refusal"], listed
            _text, samples = await scrape(custom)
            assert samples['relay_schedule_refused_total{schedule="t"}'] >= 1
            assert 'relay_schedule_last_run_age_seconds{schedule="t"}' not in samples
        finally:
            await c.aclose()


async def test_a_list_page_stops_once_its_payloads_reach_the_reply_bound(tmp_path):
    async with custom_server(tmp_path) as server:
        c = await server.connect()
        try:
            big = "x" * 250_000  # under max_payload_bytes; four and more pass 1 MiB
            for i in range(6):
                await c.ok("schedule_put", name=f"s{i}", cron="@daily", queue="q", payload=big)
            page = await c.ok("schedule_list")
            assert [s["name"] for s in page["schedules"]] == [f"s{i}" for i in range(5)]
            assert page["next_cursor"] == "s4"
            rest = await c.ok("schedule_list", cursor="s4")
            assert [s["name"] for s in rest["schedules"]] == ["s5"] and rest["next_cursor"] is None
        finally:
            await c.aclose()
