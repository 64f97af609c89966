"""``relay-trio queue``: a queue's settings: ``pause`` a queue (it takes submits, but no
worker leases its jobs), ``resume`` it, ``set`` its limits and submit defaults, ``show`` one
queue, ``list`` the queues with their settings and counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import click

from relay.client.client import Client, QueueConfig, QueueInfo, QueuePage
from relay.protocol.errors import BadRequest, UnknownOp
from relay_cli import views
from relay_cli.calls import call, console, print_json
from relay_cli.options import (
    BACKOFF_FORMS,
    DURATION_FORMS,
    RATE_FORMS,
    address_option,
    check_queues,
    json_option,
    parse_backoff,
    parse_duration,
    parse_rate,
)

# Queues per queue_list request at most (the server's page: relay/protocol/requests.py).
QUEUE_LIST_PAGE = 1000
# What clears a setting of ``queue set``.
CLEAR = "none"


def _check_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    return check_queues(ctx, param, (value,))[0]


@click.group()
def queue() -> None:
    """Queues: pause and resume them, set their limits and defaults, show and list them."""


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


def _setting(parse: Any, forms: str) -> Any:
    """An option's callback: ``none`` (None: the setting is cleared), else ``parse``'s
    value; not given: ``...`` (the setting stays)."""

    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
        if value is None:
            return ...
        if value == CLEAR:
            return None
        try:
            return parse(value)
        except ValueError:
            raise click.BadParameter(f"{value!r}: expected {forms}, or {CLEAR}") from None

    return check


def _count(low: int):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < low:
            raise ValueError(text)
        return int(text)

    return parse


# option -> (the setting it sets, its callback, its metavar, its help)
SET_OPTIONS = {
    "--max-leased": ("max_leased", _setting(_count(1), "a number of jobs, 1 or more"), "N",
                     "At most N of the queue's jobs leased at once, over every worker."),
    "--rate": ("rate", _setting(parse_rate, RATE_FORMS), "LIMIT/PERIOD",
               f"At most LIMIT leases of the queue per PERIOD ({RATE_FORMS})."),
    "--default-timeout": ("default_timeout_ms", _setting(parse_duration, DURATION_FORMS),
                          "DURATION", "The timeout of a submit that gives none (30s, 5m; a "
                          "bare number is milliseconds)."),
    "--default-retries": ("default_retries", _setting(_count(0), "a number, 0 or more"), "N",
                          "The retries of a submit that gives none."),
    "--default-backoff": ("default_backoff", _setting(parse_backoff, BACKOFF_FORMS), "SPEC",
                          f"The backoff of a submit that gives none: {BACKOFF_FORMS}."),
}  # fmt: skip


def _set_options(fn: Any) -> Any:
    for option, (name, callback, metavar, text) in reversed(SET_OPTIONS.items()):
        fn = click.option(option, name, callback=callback, metavar=f"{metavar}|{CLEAR}",
                          help=f"{text} {CLEAR} clears it.")(fn)  # fmt: skip
    return fn


@queue.command("set", short_help="Set a queue's limits and submit defaults.")
@click.argument("name", callback=_check_name)
@_set_options
@address_option
@json_option
def queue_set(name: str, address: str, as_json: bool, **options: Any) -> None:
    """Set some of the settings of the queue NAME (the others stay), and show them all:
    its limits on leases (--max-leased, --rate) and what a submit to it gets for what it
    leaves out (--default-timeout, --default-retries, --default-backoff). `none` clears
    a setting. A queue may be set up before it has jobs. Needs an admin token on a server
    with tokens.

    \b
    relay-trio queue set email --max-leased 5 --rate 100/s
    relay-trio queue set email --default-timeout 30s --default-backoff exp:1s:5m
    relay-trio queue set email --rate none
    """
    settings = {key: value for key, value in options.items() if value is not ...}
    if not settings:
        raise click.UsageError(f"give at least one of {', '.join(SET_OPTIONS)}")

    async def configure(client: Client) -> QueueConfig:
        return await client.queue_config(name, **settings)

    config = call(address, configure)
    if as_json:
        print_json(config)
    else:
        console().print(views.queue_panel(config))


@queue.command("show", short_help="One queue's settings and jobs per state.")
@click.argument("name", callback=_check_name)
@address_option
@json_option
def queue_show(name: str, address: str, as_json: bool) -> None:
    """Show the queue NAME: whether it is paused, its limits, its submit defaults (and what
    applies where one is not set), and its jobs per state. A queue without jobs or settings
    is shown with none."""

    async def showing(client: Client) -> QueueInfo:
        return (await client.queue_list(queues=[name])).queues[0]

    info = call(address, showing)
    if as_json:
        print_json(info)
    else:
        console().print(views.queue_panel(info))


@queue.command("list", short_help="The queues, their settings, and their jobs per state.")
@click.option("--limit", type=click.IntRange(1, 1000), help="Queues per page (default 1000).")
@click.option("--cursor", help="Where the previous page ended (its next_cursor): the next page.")
@address_option
@json_option
def queue_list(limit: int | None, cursor: str | None, address: str, as_json: bool) -> None:
    """List the queues that hold jobs or have settings (a paused queue without jobs too),
    by name, a page at a time: whether each is paused, its limits and defaults (`queue
    set`), and its jobs per state."""

    async def listing(client: Client) -> QueuePage:
        return await client.queue_list(limit=limit, cursor=cursor)

    page = call(address, listing)
    if as_json:
        print_json(page)
        return
    console().print(views.queue_table(page))


async def limited_queues(client: Client, queues: Iterable[str]) -> frozenset[str] | None:
    """Of ``queues`` (a stats page: 1,000 at most), those with a limit (max_leased or rate).
    A stats reply does not say, so this is one ``queue_list`` of those names (one request,
    its reply the size of the stats'): ``stats`` and ``top`` ask it with each stats, and
    only where there are queues. None from a server without ``queue_list {queues}``."""
    names = sorted(queues)[:QUEUE_LIST_PAGE]
    if not names:
        return frozenset()
    try:
        page = await client.queue_list(queues=names)
    except (UnknownOp, BadRequest):  # (a server from before queue settings)
        return None
    return frozenset(q.queue for q in page.queues if q.max_leased is not None or q.rate)
