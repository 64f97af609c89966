"""``relay-trio schedule put|list|pause|resume|delete`` against a real server, and the
schedule table at 80, 120 and 200 columns."""

from __future__ import annotations

import io

import pytest
from rich.cells import cell_len
from rich.console import Console

from relay.client.client import ScheduleInfo, SchedulePage
from relay_cli import views
from tests.cli.conftest import assert_one_line_error, cli_env, relay_trio

T = 1_772_424_000_000  # 2026-03-02 04:00 UTC


async def test_put_list_pause_resume_delete(address, client):
    put = await relay_trio(
        "schedule", "put", "nightly", "30 2 * * *", "--queue", "reports", "--payload",
        '{"r": 1}', "--timezone", "Europe/Berlin", "--catch-up", "all", address=address,
    )  # fmt: skip
    assert put.code == 0 and put.stderr == "", put
    assert "schedule nightly: 30 2 * * * (Europe/Berlin) -> queue reports" in put.stdout
    assert "UTC)" in put.stdout  # the next run, in local time and UTC
    [info] = (await client.schedule_list()).schedules
    assert (info.catch_up, info.payload) == ("all", {"r": 1})

    table = await relay_trio(
        "schedule", "list", address=address, env={**cli_env(address), "COLUMNS": "80"}
    )
    assert table.code == 0, table
    lines = table.stdout.splitlines()
    assert all(cell_len(line) <= 80 for line in lines), lines
    assert lines[1].split() == ["schedule", "cron", "next", "run", "last", "job"]
    first = next(line for line in lines if line.startswith("nightly"))
    assert "30 2 * * *" in first and ("CET" in first or "CEST" in first)
    assert any("Europe/Berlin" in line and "UTC" in line for line in lines)

    paused = await relay_trio("schedule", "pause", "nightly", address=address)
    assert paused.code == 0 and "paused schedule nightly" in paused.stdout, paused
    listed = (await relay_trio("schedule", "list", "--json", address=address)).json()
    assert listed["schedules"][0]["paused"] is True and listed["next_cursor"] is None
    resumed = await relay_trio("schedule", "resume", "nightly", "--json", address=address)
    assert resumed.json()["paused"] is False
    deleted = await relay_trio("schedule", "delete", "nightly", address=address)
    assert deleted.code == 0 and "deleted schedule nightly" in deleted.stdout, deleted
    assert (await client.schedule_list()).schedules == []


async def test_refusals_are_one_line(address, client):
    bad = await relay_trio(
        "schedule", "put", "n", "61 * * * *", "--queue", "q", "--payload", "1", address=address
    )
    assert_one_line_error(bad, "cron", "bad minute", code=2)
    zone = await relay_trio(
        "schedule", "put", "n", "@daily", "--queue", "q", "--payload", "1", "--timezone",
        "Mars/Base", address=address,
    )  # fmt: skip
    assert_one_line_error(zone, "timezone", "Mars/Base", code=2)
    assert_one_line_error(await relay_trio("schedule", "delete", "gone", address=address),
                          "no schedule gone")  # fmt: skip
    assert_one_line_error(
        await relay_trio("schedule", "put", "n", "@daily", "--queue", "a b", "--payload", "1",
                         address=address), "queue name", code=2,
    )  # fmt: skip
    assert (await client.schedule_list()).schedules == []


def info(name: str, cron: str, tz: str, **kw) -> ScheduleInfo:
    fields = {"queue": "q", "payload": {}, "priority": "normal", "retries": 3, "backoff": {},
              "catch_up": "latest", "catch_up_max": 100, "paused": False, "next_at": T,
              "created_at": T, "updated_at": T, **kw}  # fmt: skip
    return ScheduleInfo(name, cron, tz, **fields)


@pytest.mark.parametrize("width", [80, 120, 200])
def test_the_table_shows_next_runs_in_local_time_and_utc_and_the_last_job(width):
    page = SchedulePage(
        [
            info("nightly-report", "30 2 * * *", "Europe/Berlin", last_slot=T,
                 last_job_id="job_33952eec94000001", last_job_state="succeeded"),
            info("billing.invoice-reminders.nightly-run-eu", "*/15 9-17 * * MON-FRI",
                 "America/New_York", queue="billing.invoices"),
            info("off", "@daily", "UTC", paused=True, last_job_id="job_33952eec94000002"),
        ],
        "off",
    )  # fmt: skip
    console = Console(file=io.StringIO(), width=width)
    console.print(views.schedule_table(page))
    lines = console.file.getvalue().splitlines()
    for line in lines:
        assert cell_len(line) <= width and line == line.rstrip(), line
    text = "\n".join(lines)
    assert "2026-03-02 05:00 CET" in text and "2026-03-02 04:00 UTC" in text
    assert "2026-03-01 23:00 EST" in text  # the same instant in New York
    assert "*/15 9-17 * * MON-FRI" in text  # an expression is whole
    assert "succeeded" in text and "paused" in text and "next page: --cursor off" in text
    assert ("billing.invoices" in text) == (width >= views.SCHEDULE_WIDE)
    # A name is whole at every width, folded if it must be: it is what `schedule pause`
    # takes back. A narrow table says where the queue went.
    name = "billing.invoice-reminders.nightly-run-eu"
    header = next(line for line in lines if line.startswith("schedule "))
    first_column = "".join(line[: header.index("cron")].strip() for line in lines)
    assert name in first_column and "…" not in first_column
    assert ("queues and catch-up: --json" in text) == (width < views.SCHEDULE_WIDE)


@pytest.mark.parametrize("width", [80, 120])
def test_a_refused_last_slot_is_said_under_its_old_job(width):
    refusal = "queue full: 'reports' holds 1000 unfinished jobs (max 1000)"
    page = SchedulePage(
        [info("hourly", "0 * * * *", "UTC", last_job_id="job_33952eec94000001",
              last_job_state="ready", last_job_slot=T - 7_200_000, last_refusal=refusal),
         info("fine", "@daily", "UTC", last_job_id="job_33952eec94000002",
              last_job_state="succeeded")],
        None,
    )  # fmt: skip
    console = Console(file=io.StringIO(), width=width)
    console.print(views.schedule_table(page))
    text = console.file.getvalue()
    assert all(cell_len(line) <= width for line in text.splitlines())
    assert text.count("last slot: no job") == 1
    assert "hourly: its last slot made no job: queue full" in " ".join(text.split())
    # A UTC schedule's next run once, not again as its UTC time.
    assert text.count(views.next_run_line(page.schedules[0])) == 2
