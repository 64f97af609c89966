"""The commands that look and change nothing: ``inspect`` (one job), ``stats``, ``watch``
(job events as JSON lines), ``top`` (a live view, drawn by cli/top.py) and ``history``
(the jobs per minute of the last hours).
"""

from __future__ import annotations

import time

import click
import orjson

from relay.client.client import Client, Stats, open_client
from relay.protocol.errors import ConnectionLost
from relay.protocol.model import JobState
from relay_cli import views
from relay_cli.calls import call, console, converter, print_json
from relay_cli.errors import run
from relay_cli.options import (
    DURATION_FORMS,
    JOB_HELP,
    abbreviated,
    address_option,
    check_job,
    check_queues,
    client_target,
    client_timeout,
    client_token,
    json_option,
    parse_duration,
)
from relay_cli.queue import limited_queues

STATE_NAMES = [str(state) for state in JobState]


@click.command(
    "inspect",
    help="Show one job: state, attempts, timings, errors, payload and result. " + JOB_HELP,
)
@click.argument("job_id", metavar="JOB", callback=check_job)
@address_option
@json_option
def inspect_command(job_id: str, address: str, as_json: bool) -> None:
    prefix = abbreviated(job_id)
    job = call(address, lambda client: client.inspect(job_id, prefix=prefix))
    if as_json:
        print_json(job)
    else:
        console().print(views.job_panel(job))


@click.command()
@click.option("--queue", "queues", multiple=True, callback=check_queues,
              help="Only this queue's jobs (repeatable). Default: every queue.")  # fmt: skip
@click.option("--state", "states", multiple=True, type=click.Choice(STATE_NAMES),
              help="Only changes into this state (repeatable). Default: every state.")  # fmt: skip
@address_option
def watch(queues: tuple[str, ...], states: tuple[str, ...], address: str) -> None:
    """Print job events as JSON lines, one per state change, after its commit, until
    Ctrl-C: {"event":"job","job_id","queue","state","attempt","at"}, and
    {"event":"lagged","dropped":N} where N were lost to a slow reader."""
    token = client_token()
    address, tls_ca = client_target(address)
    out = click.get_text_stream("stdout")

    timeout = client_timeout()

    async def session() -> None:
        async with open_client(
            address, reconnect=False, token=token, tls_ca=tls_ca, connect_timeout=timeout
        ) as client:
            events = client.watch(queues or None, states or None)
            try:
                async with events:
                    async for event in events:
                        out.write(orjson.dumps(event).decode() + "\n")
                        out.flush()
            except ConnectionLost:
                raise click.ClickException(
                    f"the connection to {address} was lost, and the watch with it (the events "
                    "after it are not shown: watch again to go on)"
                ) from None

    run(session, address=address)


@click.command()
@click.option("--full", is_flag=True, help="Whole job ids in the failures.")
@address_option
def top(full: bool, address: str) -> None:
    """A live view of the queues until Ctrl-C: counts by state, jobs submitted, succeeded
    and failed per second over the last 10 s, and the latest failures. Waits for a server
    that is down, and reconnects when it restarts (--timeout bounds each attempt); ends at
    once on what no reconnection fixes (a token refused, a TLS mismatch, a server that is
    not relay-trio)."""
    from relay_cli.top import TopView, run_top

    token = client_token()
    address, tls_ca = client_target(address)
    view = TopView(full_ids=full)
    run(run_top, address, token, tls_ca, view, client_timeout(), address=address)


@click.command()
@address_option
@json_option
@click.option(
    "--queue", "queues", multiple=True, metavar="QUEUE",
    help="Only this queue (repeatable). Without it: the first 1,000 queues by name, and how "
    "many more there are.",
)  # fmt: skip
def stats(address: str, as_json: bool, queues: tuple[str, ...]) -> None:
    """Jobs per queue and state, and the server's version, uptime and connections; a queue
    paused or with a limit (`queue set`) is marked so."""
    only = list(queues) or None

    async def asking(client: Client) -> tuple[Stats, frozenset[str]]:
        result = await client.stats(oldest_ready=True, queues=only)
        if as_json:
            return result, frozenset()
        return result, await limited_queues(client, result.queues) or frozenset()

    result, limited = call(address, asking)
    if as_json:
        data = converter.unstructure(result)
        data["queues"] = dict(sorted(data["queues"].items()))
        print_json(data)
    else:
        console().print(views.stats_table(result, limited))


# What `history` may ask: a step of whole minutes, at most this many steps (the server's
# bound on a reply's points), and no further back than the server keeps.
HISTORY_STEP_MS = 60_000
HISTORY_POINTS = 1_440
HISTORY_KEPT_MS = 7 * 86_400_000


def _history_duration(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        ms = parse_duration(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected {DURATION_FORMS}") from None
    if param.name == "step" and (ms <= 0 or ms % HISTORY_STEP_MS):
        raise click.BadParameter(f"{value!r}: a step is whole minutes (1m, 15m, 1h)")
    if param.name == "since" and not 0 < ms <= HISTORY_KEPT_MS:
        raise click.BadParameter(f"{value!r}: from 1m to 7d (the history is kept 7 days)")
    return ms


def _history_queue(ctx: click.Context, param: click.Parameter, value: str | None):
    return None if value is None else check_queues(ctx, param, (value,))[0]


@click.command()
@click.option("--queue", callback=_history_queue,
              help="Only this queue's jobs. Default: every queue, summed.")  # fmt: skip
@click.option("--since", default="1h", show_default=True, callback=_history_duration,
              help="How far back: 30m, 6h, 1d, at most 7d.")  # fmt: skip
@click.option("--step", default="1m", show_default=True, callback=_history_duration,
              help="One row per this long: whole minutes (1m, 15m, 1h).")  # fmt: skip
@address_option
@json_option
def history(queue: str | None, since: int, step: int, address: str, as_json: bool) -> None:
    """Jobs per step over the last hours: submitted, succeeded, failed (attempts: fail,
    expiry, timeout) and dead, with the mean and longest run time (lease to ack or fail)
    and wait (ready to lease); a bar per step and sparklines where the width allows.
    Counted by every server, written every 5 s: the last seconds show a little late."""
    if -(-since // step) > HISTORY_POINTS:
        back = views.step_text(since) if since % step == 0 else views.format_duration(since)
        raise click.UsageError(
            f"--since {back} in steps of {views.step_text(step)} is more than "
            f"{HISTORY_POINTS} rows: a longer --step or a shorter --since"
        )
    start = time.time_ns() // 1_000_000 - since
    result = call(address, lambda client: client.history(queue, start=start, step=step))
    if as_json:
        print_json(result)
    else:
        console().print(views.history_table(result))
