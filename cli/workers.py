"""``relay-trio workers``: the connected workers of one server, what they hold and for how
long, and the queues with ready jobs that no worker asks for (cli/views.py draws them)."""

from __future__ import annotations

import attrs
import click

from relay.client.client import Client, Stats, WorkerInfo, WorkersPage
from relay_cli import views
from relay_cli.calls import call, console, converter, print_json
from relay_cli.options import address_option, json_option

# Pages of workers read at most (100 each): the second table needs every worker's queues.
MAX_PAGES = 100


@click.command()
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True,
              help="Workers shown at most (all are read, up to 10,000, for the queues "
              "with no worker).")  # fmt: skip
@address_option
@json_option
def workers(limit: int, address: str, as_json: bool) -> None:
    """The connected workers of the server at --address: worker id, client, address,
    queues, the jobs each holds and the longest it has held one, and how long since its
    last request; then the queues with ready jobs that no worker asks for. With several
    servers on one database, each lists its own: ask each. Needs a worker or admin
    token."""

    async def asking(client: Client) -> tuple[WorkersPage, list[WorkerInfo], bool, Stats]:
        first = page = await client.workers_list()
        every = list(page.workers)
        pages = 1
        while page.next_cursor is not None and pages < MAX_PAGES:
            page = await client.workers_list(cursor=page.next_cursor)
            every += page.workers
            pages += 1
        stats = await client.stats(oldest_ready=True)
        return first, every, page.next_cursor is not None, stats

    first, every, partial, stats = call(address, asking)
    if as_json:
        print_json({
            "server": first.server,
            "at": first.at,
            "total": first.total,
            "workers": converter.unstructure(every),
            "partial": partial,
            "idle_queues": views.idle_queues(stats, every),
        })  # fmt: skip
        return
    shown = attrs.evolve(first, workers=every[:limit])
    console().print(views.workers_table(shown, stats, more=max(0, len(every) - limit),
                                        partial=partial))  # fmt: skip
