"""``relay-trio queue``: a queue's settings: ``pause`` a queue (it takes submits, but no
worker leases its jobs), ``resume`` it, ``list`` the queues with their settings and counts.
"""

from __future__ import annotations

import click

from relay.client.client import Client, QueuePage
from relay_cli import views
from relay_cli.calls import call, console, print_json
from relay_cli.options import address_option, check_queues, json_option


def _check_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    return check_queues(ctx, param, (value,))[0]


@click.group()
def queue() -> None:
    """Queues: pause and resume them, list them with their settings."""


@queue.command("pause", short_help="Stop workers leasing a queue's jobs.")
@click.argument("name", callback=_check_name)
@address_option
@json_option
def queue_pause(name: str, address: str, as_json: bool) -> None:
    """Pause the queue NAME: it still takes submits, and its delayed and retried jobs still
    become ready when due, but no worker leases its jobs until it is resumed. Jobs leased
    already run to the end. A queue may be paused before it has jobs. Needs an admin
    token on a server with tokens."""
    _set_paused(name, True, address, as_json)


@queue.command("resume", short_help="Let workers lease a paused queue's jobs again.")
@click.argument("name", callback=_check_name)
@address_option
@json_option
def queue_resume(name: str, address: str, as_json: bool) -> None:
    """Resume the queue NAME: its ready jobs are leased again, at once (workers waiting on
    it are woken). Resuming a queue that is not paused changes nothing. Needs an admin
    token on a server with tokens."""
    _set_paused(name, False, address, as_json)


def _set_paused(name: str, paused: bool, address: str, as_json: bool) -> None:
    """Pause or resume the queue ``name``, and say what it is now."""

    async def set_paused(client: Client) -> bool:
        return await (client.queue_pause(name) if paused else client.queue_resume(name))

    now_paused = call(address, set_paused)
    if as_json:
        print_json({"queue": name, "paused": now_paused})
    elif now_paused:
        click.echo(f"paused queue {name}: its jobs wait until `relay-trio queue resume {name}`")
    else:
        click.echo(f"resumed queue {name}")


@queue.command("list", short_help="The queues, paused or not, with their jobs per state.")
@click.option("--limit", type=click.IntRange(1, 1000), help="Queues per page (default 1000).")
@click.option("--cursor", help="Where the previous page ended (its next_cursor): the next page.")
@address_option
@json_option
def queue_list(limit: int | None, cursor: str | None, address: str, as_json: bool) -> None:
    """List the queues that hold jobs or have settings (a paused queue without jobs too),
    by name, a page at a time: whether each is paused, and its jobs per state."""

    async def listing(client: Client) -> QueuePage:
        return await client.queue_list(limit=limit, cursor=cursor)

    page = call(address, listing)
    if as_json:
        print_json(page)
        return
    console().print(views.queue_table(page))
