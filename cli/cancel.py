"""``relay-trio cancel``: cancel one job (by its id, or its start as ``dead list`` and
``top`` show it, cli/ids.py), or every job of a queue in some states (``--queue Q --all``,
``--state``: by default those that have not started). One line of output either way.
"""

from __future__ import annotations

from typing import Any

import click

from relay.client.client import Client
from relay.protocol.requests import CANCEL_DEFAULT_STATES, CANCEL_STATES
from relay_cli.calls import call, plural, print_json
from relay_cli.dead import WHOLE_QUEUE_TIMEOUT_S, _whole
from relay_cli.options import DEFAULT_TIMEOUT_S, JOB_HELP, address_option, check_job, json_option


@click.command(
    "cancel",
    short_help="Cancel a job, or a queue's jobs.",
    help="Cancel a job that has not finished: it becomes cancelled and never runs (again); "
    "a running (leased) one is stopped by its worker at its next renewal, and needs an "
    "admin token. Or every job of a queue (--queue Q --all) in the --state given (default: "
    f"{', '.join(CANCEL_DEFAULT_STATES)}, the jobs that have not started). " + JOB_HELP,
)
@click.argument("job_id", metavar="[JOB]", required=False, callback=check_job)
@click.option("--queue", help="With --all: the queue whose jobs to cancel.")
@click.option(
    "--all", "every", is_flag=True,
    help="Every job of --queue in the --state given (--timeout then defaults to 600 s).",
)  # fmt: skip
@click.option(
    "--state", "states", multiple=True, type=click.Choice(CANCEL_STATES),
    help="With --all: cancel the jobs in this state (repeat it for several; leased: the "
    f"running ones). Default: {', '.join(CANCEL_DEFAULT_STATES)}.",
)  # fmt: skip
@address_option
@json_option
def cancel(
    job_id: str | None,
    queue: str | None,
    every: bool,
    states: tuple[str, ...],
    address: str,
    as_json: bool,
) -> None:
    if job_id is not None:
        if queue is not None or every or states:
            raise click.UsageError("give a JOB id, or --queue Q --all [--state S], not both")
        _cancel_one(job_id, address, as_json)
        return
    if queue is None and not every:
        raise click.UsageError("give a JOB id, or --queue Q --all")
    if queue is None:
        raise click.UsageError("--all needs --queue Q: one queue at a time")
    if not every:
        raise click.UsageError(f"--queue {queue} means every job of it in some states: add --all")
    chosen = [state for state in CANCEL_STATES if state in (states or CANCEL_DEFAULT_STATES)]

    async def cancel_queue(client: Client) -> int:
        return await client.cancel_queue(queue, states=chosen)

    count = call(address, cancel_queue, timeout=WHOLE_QUEUE_TIMEOUT_S)
    if as_json:
        print_json({"cancelled": count})
    else:
        click.echo(f"cancelled {plural(count, 'job')} of queue {queue} ({', '.join(chosen)})")


def _cancel_one(job_id: str, address: str, as_json: bool) -> None:
    async def cancel_one(client: Client) -> dict[str, Any]:
        whole = (await _whole(client, {"job_id": job_id}))["job_id"]
        was = await client.cancel(whole)
        return {"job_id": whole, "state": "cancelled", "was": str(was)}

    reply = call(address, cancel_one, timeout=DEFAULT_TIMEOUT_S)
    if as_json:
        print_json(reply)
    else:
        click.echo(f"cancelled {reply['job_id']} (it was {reply['was']})")
