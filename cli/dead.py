"""``relay-trio dead``: the dead jobs: ``list`` them a page at a time (newest first, or
``--oldest``), ``retry`` them with fresh attempts, ``purge`` them for good; one job (by its
id, or its start as ``list`` shows it: unique among all jobs when it is shown, cli/ids.py),
or every dead job of a queue.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from relay.client.client import Client, DeadPage
from relay.protocol.errors import InvalidState
from relay.protocol.requests import PURGE_STATES, RETRY_STATES
from relay_cli import views
from relay_cli.calls import call, console, plural, print_json
from relay_cli.confirm import confirm
from relay_cli.ids import server_short_ids
from relay_cli.options import (
    DEFAULT_TIMEOUT_S,
    JOB_HELP,
    abbreviated,
    address_option,
    check_job,
    json_option,
)


@click.group()
def dead() -> None:
    """Dead jobs: list them, retry them, purge them."""


@dead.command("list", short_help="List dead jobs, newest first, a page at a time.")
@click.option("--queue", help="Only this queue's dead jobs.")
@click.option("--limit", type=click.IntRange(min=1), help="Jobs per page (default 100).")
@click.option(
    "--cursor",
    help="Where the previous page ended (its next_cursor): the next page, in the same order.",
)
@click.option("--oldest", is_flag=True, help="Oldest first instead.")
@click.option("--full", is_flag=True, help="Whole job ids (--json always has them).")
@address_option
@json_option
def dead_list(
    queue: str | None,
    limit: int | None,
    cursor: str | None,
    oldest: bool,
    full: bool,
    address: str,
    as_json: bool,
) -> None:
    """List dead jobs, newest first (by job id: the most recently submitted first), a
    page at a time. The next page: the same command with the --cursor that the table's
    caption gives (next_cursor with --json). Job ids are shortened as git shortens a
    hash, unique among all jobs at the time they are shown: inspect, dead retry and
    dead purge take them as shown."""
    order = "oldest" if oldest else "newest"

    async def listing(client: Client) -> tuple[DeadPage, dict[str, str] | None]:
        page = await client.dead_list(queue, limit=limit, cursor=cursor, order=order)
        if as_json or full:
            return page, None
        return page, await server_short_ids(client, [job.job_id for job in page.jobs])

    page, short = call(address, listing)
    if as_json:
        print_json(page)
        return
    caption = paging_caption(oldest, page.next_cursor)
    console().print(views.dead_table(page, full_ids=full, caption=caption, short=short))


def paging_caption(oldest: bool, next_cursor: str | None, cursor_option: str = "--cursor") -> str:
    """A job table's caption (``dead list``, ``jobs list``): which order, and the option
    that gives the next page (on a line of its own, so that it is never wrapped in two)."""
    if oldest:
        order = "oldest first (--oldest)"
        more = f"next page (newer): --oldest {cursor_option} {next_cursor}"
    else:
        order = "newest first (--oldest: oldest first)"
        more = f"next page (older): {cursor_option} {next_cursor}"
    return order if next_cursor is None else f"{order}\n{more}"


def _dead_target(job_id: str | None, queue: str | None, every: bool) -> dict[str, Any]:
    """The selection of ``dead retry``/``dead purge``: one job, or a whole queue."""
    if job_id is not None:
        if queue is not None or every:
            raise click.UsageError("give a JOB id, or --queue Q --all, not both")
        return {"job_id": job_id}
    if queue is None and not every:
        raise click.UsageError("give a JOB id, or --queue Q --all")
    if queue is None:
        raise click.UsageError("--all needs --queue Q: one queue at a time")
    if not every:
        raise click.UsageError(f"--queue {queue} means every dead job of it: add --all")
    return {"queue": queue, "all": True}


# Retrying or purging a whole queue's dead jobs runs in many bounded transactions, and is
# answered when the last has committed: on a queue of a million dead jobs, tens of seconds.
WHOLE_QUEUE_TIMEOUT_S = 600.0


def _timeout(every: bool) -> float:
    """The default --timeout: a whole queue's may take long; one job's is quick."""
    return WHOLE_QUEUE_TIMEOUT_S if every else DEFAULT_TIMEOUT_S


def _dead_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = json_option(fn)
    fn = address_option(fn)
    fn = click.option(
        "--all",
        "every",
        is_flag=True,
        help="Every dead job of --queue (--timeout then defaults to 600 s).",
    )(fn)
    fn = click.option("--queue", help="With --all: the queue whose dead jobs to take.")(fn)
    return click.argument("job_id", metavar="[JOB]", required=False, callback=check_job)(fn)


async def _whole(client: Client, target: dict[str, Any]) -> dict[str, Any]:
    """``target`` with its JOB, if abbreviated, as the whole id of the one job whose id
    begins so (``inspect`` with ``prefix``: none is not_found, several bad_request)."""
    job_id = target.get("job_id")
    if job_id is None or not abbreviated(job_id):
        return target
    return {"job_id": (await client.inspect(job_id, prefix=True)).job_id}


async def refused(
    client: Client, exc: InvalidState, job_id: str, operation: str
) -> click.ClickException:
    """The one-line error for a job refused for its state by ``operation`` (retry, purge,
    promote): where another command takes a job in that state, the server's advice (in
    the wire's words) is replaced by it."""
    state = str((await client.inspect(job_id)).state)
    reason = exc.message.split(" (", 1)[0]
    if operation == "promote" and state in RETRY_STATES:
        hint = f"relay-trio jobs retry {job_id} makes it ready again"
    elif operation == "retry" and state in RETRY_STATES:
        hint = f"relay-trio jobs retry {job_id} takes a {state} job"
    elif operation == "purge" and state in PURGE_STATES:
        hint = f"relay-trio jobs purge {job_id} takes a {state} job"
    else:
        return click.ClickException(f"{exc.code}: {exc.message}")
    return click.ClickException(f"{exc.code}: {reason} ({hint})")


def _done(verb: str, count: int, given: str | None, whole: str | None) -> str:
    """What was done ("retried 1 dead job"), and the whole id if the JOB was abbreviated."""
    done = f"{verb} {plural(count, 'dead job')}"
    return done if given is None or whole == given else f"{done}: {whole}"


@dead.command(
    "retry",
    short_help="Make dead jobs ready again, with fresh attempts.",
    help="Make a dead job (or every dead job of a queue) ready again, with fresh attempts. "
    + JOB_HELP,
)
@_dead_options
def dead_retry(
    job_id: str | None, queue: str | None, every: bool, address: str, as_json: bool
) -> None:
    target = _dead_target(job_id, queue, every)

    async def retry(client: Client) -> int:
        target.update(await _whole(client, target))
        try:
            return await client.dead_retry(**target)
        except InvalidState as exc:
            raise await refused(client, exc, target["job_id"], "retry") from None

    count = call(address, retry, timeout=_timeout(every))
    if as_json:
        print_json({"count": count})
    else:
        click.echo(_done("retried", count, job_id, target.get("job_id")))


@dead.command(
    "purge",
    short_help="Delete dead jobs for good.",
    help="Delete a dead job (or every dead job of a queue) for good. " + JOB_HELP,
)
@_dead_options
@click.option("--yes", is_flag=True, help="Do not ask before purging a whole queue.")
def dead_purge(
    job_id: str | None, queue: str | None, every: bool, address: str, as_json: bool, yes: bool
) -> None:
    target = _dead_target(job_id, queue, every)
    if every and not yes:
        if not sys.stdin.isatty():
            raise click.UsageError(
                f"--all would delete every dead job of queue {queue} for good, and there is "
                "no terminal to confirm on: add --yes"
            )
        confirm(f"Delete every dead job of queue {queue}? This cannot be undone")

    async def purge(client: Client) -> int:
        target.update(await _whole(client, target))
        try:
            return await client.dead_purge(**target)
        except InvalidState as exc:
            raise await refused(client, exc, target["job_id"], "purge") from None

    count = call(address, purge, timeout=_timeout(every))
    if as_json:
        print_json({"count": count})
    else:
        click.echo(_done("purged", count, job_id, target.get("job_id")))
