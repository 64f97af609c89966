"""``relay-trio jobs``: the job browser. ``list`` any state's jobs a page at a time (newest
first, or ``--oldest``; by queue, state and a search); ``retry`` or ``purge`` one finished
job by id, or a queue's by state after a confirmation that names how many; ``promote`` a delayed or
retrying job to run now.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from relay.client.client import Client, JobsPage
from relay.protocol.errors import InvalidState
from relay.protocol.model import JobState
from relay.protocol.requests import DEFAULT_JOBS_LIST, MAX_JOBS_LIST, PURGE_STATES, RETRY_STATES
from relay_cli import views
from relay_cli.calls import call, console, plural, print_json
from relay_cli.confirm import confirm
from relay_cli.dead import WHOLE_QUEUE_TIMEOUT_S, _whole, paging_caption, refused
from relay_cli.ids import server_short_ids
from relay_cli.options import DEFAULT_TIMEOUT_S, JOB_HELP, address_option, check_job, json_option

EVERY_STATE = tuple(str(state) for state in JobState)


@click.group()
def jobs() -> None:
    """Browse jobs in any state; retry, purge or promote them."""


@jobs.command("list", short_help="List jobs of any state, newest first, a page at a time.")
@click.option("--queue", help="Only this queue's jobs.")
@click.option(
    "--state", "states", multiple=True, type=click.Choice(EVERY_STATE),
    help="Only jobs in this state (repeat it for several). Default: every state.",
)  # fmt: skip
@click.option(
    "--search",
    help="Jobs whose id begins with this (job_ and 7 to 16 hex digits), or, with --queue, "
    "whose idempotency or unique key does.",
)
@click.option("--limit", type=click.IntRange(1, MAX_JOBS_LIST), help="Jobs per page (default 50).")
@click.option(
    "--after",
    "cursor",
    metavar="CURSOR",
    help="Where the previous page ended (the caption's --after): the next page, in the same order.",
)
@click.option("--oldest", is_flag=True, help="Oldest first instead.")
@click.option("--full", is_flag=True, help="Whole job ids (--json always has them).")
@address_option
@json_option
def jobs_list(
    queue: str | None,
    states: tuple[str, ...],
    search: str | None,
    limit: int | None,
    cursor: str | None,
    oldest: bool,
    full: bool,
    address: str,
    as_json: bool,
) -> None:
    """List jobs of any state, newest first (by job id: the most recently submitted
    first), a page at a time, without their payloads (relay-trio inspect shows one job
    whole). The next page: the same command with the --after that the table's caption
    gives (next_cursor with --json). Job ids are shortened as git shortens a hash:
    inspect, jobs promote and cancel take them as shown."""
    order = "oldest" if oldest else "newest"

    async def listing(client: Client) -> tuple[JobsPage, dict[str, str] | None]:
        page = await client.jobs_list(
            queue,
            states=list(states) or None,
            search=search,
            limit=limit,
            cursor=cursor,
            order=order,
        )
        if as_json or full:
            return page, None
        return page, await server_short_ids(client, [job.job_id for job in page.jobs])

    page, short = call(address, listing)
    if as_json:
        print_json(page)
        return
    caption = paging_caption(oldest, page.next_cursor, "--after")
    if page.next_cursor is not None and len(page.jobs) < (limit or DEFAULT_JOBS_LIST):
        # A short page with a cursor: the server read its bounded stretch of jobs.
        order, more = caption.split("\n", 1)
        caption = f"{order}\nfewer than a page here: each page reads a stretch of jobs\n{more}"
    console().print(views.jobs_table(page, full_ids=full, caption=caption, short=short))


def _one_or_queue(job_id: str | None, queue: str | None, states: tuple[str, ...]) -> None:
    """Check the selection of ``jobs retry``/``jobs purge``: a JOB, or --queue and --state."""
    if job_id is not None:
        if queue is not None or states:
            raise click.UsageError("give a JOB id, or --queue Q --state S, not both")
    elif queue is None or not states:
        raise click.UsageError(
            "give a JOB id, or --queue Q and --state S (every job of the queue in that state)"
        )


def _one(verb: str, allowed: tuple[str, ...], job_id: str, address: str, as_json: bool) -> None:
    """Retry or purge the one job ``job_id`` in any of the states ``allowed``."""

    async def one(client: Client) -> str:
        whole = (await _whole(client, {"job_id": job_id}))["job_id"]
        action = client.dead_retry if verb == "retry" else client.dead_purge
        try:
            await action(whole, states=allowed)
        except InvalidState as exc:
            raise await refused(client, exc, whole, verb) from None
        return whole

    whole = call(address, one, timeout=DEFAULT_TIMEOUT_S)
    if as_json:
        print_json({"count": 1, "job_id": whole})
    else:
        click.echo(f"{'retried' if verb == 'retry' else 'purged'} {whole}")


def _bulk(verb: str, allowed: tuple[str, ...], what: str) -> Callable[..., None]:
    @click.argument("job_id", metavar="[JOB]", required=False, callback=check_job)
    @click.option("--queue", help="Without JOB: the queue whose jobs to take.")
    @click.option(
        "--state", "states", multiple=True, type=click.Choice(allowed),
        help=f"With --queue: take its jobs in this state (repeat it for several; of "
        f"{', '.join(allowed)}).",
    )  # fmt: skip
    @click.option("--yes", is_flag=True, help="Do not ask first (a whole queue's).")
    @address_option
    @json_option
    def command(
        job_id: str | None,
        queue: str | None,
        states: tuple[str, ...],
        yes: bool,
        address: str,
        as_json: bool,
    ) -> None:
        _one_or_queue(job_id, queue, states)
        if job_id is not None:
            _one(verb, allowed, job_id, address, as_json)
            return
        assert queue is not None
        chosen = [state for state in allowed if state in states]
        named = f"queue {queue} ({', '.join(chosen)})"
        if not yes:
            if not sys.stdin.isatty():
                raise click.UsageError(
                    f"{verb} would take every job of {named}, and there is no terminal to "
                    "confirm on: add --yes"
                )

            async def counting(client: Client) -> int:
                counts = (await client.stats(queues=[queue])).queues.get(queue, {})
                return sum(counts.get(state, 0) for state in chosen)

            n = call(address, counting)
            confirm(f"{verb.capitalize()} {plural(n, 'job')} of {named}{what}")

        async def bulk(client: Client) -> int:
            action = client.dead_retry if verb == "retry" else client.dead_purge
            return await action(queue=queue, all=True, states=chosen)

        count = call(address, bulk, timeout=WHOLE_QUEUE_TIMEOUT_S)
        if as_json:
            print_json({"count": count})
        else:
            done = "retried" if verb == "retry" else "purged"
            click.echo(f"{done} {plural(count, 'job')} of {named}")

    return command


jobs.command(
    "retry",
    short_help="Make a dead or cancelled job (or a queue's) ready again.",
    help="Make a dead or cancelled JOB ready again, with fresh attempts; or every job of "
    "--queue in the --state given (dead, cancelled), after a confirmation that names how "
    "many (--yes: without), in transactions of 1,000 jobs (--timeout defaults to 600 s). "
    + JOB_HELP,
)(_bulk("retry", RETRY_STATES, " with fresh attempts?"))
jobs.command(
    "purge",
    short_help="Delete a finished job (or a queue's) for good.",
    help="Delete a dead, succeeded or cancelled JOB for good (its idempotency key stays "
    "until it expires); or every job of --queue in the --state given (dead, succeeded, "
    "cancelled), after a confirmation that names how many (--yes: without), in "
    "transactions of 1,000 jobs (--timeout defaults to 600 s). " + JOB_HELP,
)(_bulk("purge", PURGE_STATES, " for good? This cannot be undone"))


@jobs.command(
    "promote",
    short_help="Run a delayed or retrying job now.",
    help="Make a pending (delayed) or retrying job ready now, without waiting for its time. "
    + JOB_HELP,
)
@click.argument("job_id", metavar="JOB", callback=check_job)
@address_option
@json_option
def jobs_promote(job_id: str, address: str, as_json: bool) -> None:
    async def promote(client: Client) -> dict[str, str]:
        whole = (await _whole(client, {"job_id": job_id}))["job_id"]
        try:
            was = await client.promote(whole)
        except InvalidState as exc:
            raise await refused(client, exc, whole, "promote") from None
        return {"job_id": whole, "state": "ready", "was": str(was)}

    reply = call(address, promote, timeout=DEFAULT_TIMEOUT_S)
    if as_json:
        print_json(reply)
    else:
        click.echo(f"promoted {reply['job_id']}: {reply['was']} -> ready")
