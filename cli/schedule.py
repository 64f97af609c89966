"""``relay-trio schedule``: cron schedules: ``put`` one (create or replace), ``list`` them
with their next run and last job, ``pause``, ``resume`` and ``delete`` one.
"""

from __future__ import annotations

from typing import Any

import click

from relay.client.client import Client, ScheduleInfo, SchedulePage
from relay.protocol.model import WIRE_PRIORITIES
from relay_cli import views
from relay_cli.calls import call, console, print_json
from relay_cli.ids import server_short_ids
from relay_cli.options import address_option, check_queues, json_option
from relay_cli.submit import BACKOFF_FORMS, _backoff_option, _payload_option

CATCH_UP = ("latest", "none", "all")


def _check_queue(ctx: click.Context, param: click.Parameter, value: str) -> str:
    return check_queues(ctx, param, (value,))[0]


@click.group()
def schedule() -> None:
    """Cron schedules: a job submitted at each slot of a cron expression, once per slot."""


@schedule.command("put", short_help="Create or replace a cron schedule.")
@click.argument("name")
@click.argument("cron")
@click.option("--queue", required=True, callback=_check_queue, help="The queue of its jobs.")
@click.option(
    "--payload", required=True, callback=_payload_option, metavar="JSON",
    help="Each job's payload, any JSON value; '-' reads it from stdin.",
)  # fmt: skip
@click.option(
    "--timezone", "timezone", metavar="ZONE",
    help="The IANA zone the expression is read in, e.g. Europe/Berlin (default UTC).",
)  # fmt: skip
@click.option("--priority", type=click.Choice(WIRE_PRIORITIES), help="Default: normal.")
@click.option(
    "--retries", type=click.IntRange(min=0),
    help="Retries after the first attempt (default: the queue's at each slot, else 3).",
)  # fmt: skip
@click.option(
    "--backoff", callback=_backoff_option, metavar="SPEC",
    help=f"Wait between retries: {BACKOFF_FORMS} (default: the queue's at each slot, else "
    "exp:1s:5m).",
)  # fmt: skip
@click.option("--timeout-ms", type=click.IntRange(min=1), metavar="MS",
              help="Longest run of one attempt (default: the queue's at each slot, "
              "else none).")  # fmt: skip
@click.option(
    "--catch-up", type=click.Choice(CATCH_UP),
    help="Slots missed while no server ran: the latest once (default), none, or all of "
    "them (at most --catch-up-max).",
)  # fmt: skip
@click.option("--catch-up-max", type=click.IntRange(1, 1000), help="Default 100.")
@address_option
@json_option
def schedule_put(name: str, cron: str, address: str, as_json: bool, **fields: Any) -> None:
    """Create the schedule NAME, or replace it, to submit a job at each slot of CRON: five
    fields (minute hour day month weekday, e.g. '0 3 * * MON-FRI') or @hourly, @daily,
    @weekly, @monthly, @yearly. A local time that a daylight-saving change skips does not
    run; one it repeats runs once. Needs an admin token on a server with tokens."""

    async def put(client: Client) -> ScheduleInfo:
        return await client.schedule_put(name, cron, **fields)

    info = call(address, put)
    if as_json:
        print_json(info)
        return
    click.echo(f"schedule {info.name}: {info.cron} ({info.timezone}) -> queue {info.queue}; "
               f"next run {views.next_run_line(info)}")  # fmt: skip


def _one(verb: str, name: str, address: str, as_json: bool) -> None:
    async def act(client: Client) -> ScheduleInfo | None:
        return await getattr(client, f"schedule_{verb}")(name)

    info = call(address, act)
    if as_json:
        print_json({"name": name, "deleted": True} if info is None else info)
    elif info is None:
        click.echo(f"deleted schedule {name} (its jobs stay)")
    elif info.paused:
        click.echo(f"paused schedule {name}: no slot runs until `relay-trio schedule resume "
                   f"{name}`")  # fmt: skip
    else:
        click.echo(f"resumed schedule {name}: next run {views.next_run_line(info)}")


@schedule.command("pause", short_help="Stop a schedule's slots until resumed.")
@click.argument("name")
@address_option
@json_option
def schedule_pause(name: str, address: str, as_json: bool) -> None:
    """Pause the schedule NAME: no slot runs until it is resumed. Needs an admin token on a
    server with tokens."""
    _one("pause", name, address, as_json)


@schedule.command("resume", short_help="Run a paused schedule again, from its next slot.")
@click.argument("name")
@address_option
@json_option
def schedule_resume(name: str, address: str, as_json: bool) -> None:
    """Resume the schedule NAME from its first slot after now (the slots missed while it
    was paused do not run). Needs an admin token on a server with tokens."""
    _one("resume", name, address, as_json)


@schedule.command("delete", short_help="Delete a schedule (its jobs stay).")
@click.argument("name")
@address_option
@json_option
def schedule_delete(name: str, address: str, as_json: bool) -> None:
    """Delete the schedule NAME; the jobs it submitted stay. Needs an admin token on a
    server with tokens."""
    _one("delete", name, address, as_json)


@schedule.command("list", short_help="The schedules, their next run and last job.")
@click.option("--limit", type=click.IntRange(1, 1000), help="Schedules per page (default 1000).")
@click.option("--cursor", help="Where the previous page ended (its next_cursor): the next page.")
@address_option
@json_option
def schedule_list(limit: int | None, cursor: str | None, address: str, as_json: bool) -> None:
    """List the schedules by name, a page at a time: each one's expression and zone, its
    next run in its zone's local time and in UTC, and its last job with that job's state
    now (ids shortened as `relay-trio inspect` takes them)."""

    async def listing(client: Client) -> tuple[SchedulePage, dict[str, str] | None]:
        page = await client.schedule_list(limit=limit, cursor=cursor)
        if as_json:
            return page, None
        ids = [s.last_job_id for s in page.schedules if s.last_job_id is not None]
        return page, await server_short_ids(client, ids)

    page, short = call(address, listing)
    if as_json:
        print_json(page)
        return
    console().print(views.schedule_table(page, short=short))
