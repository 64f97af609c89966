"""The relay-trio command line: arguments in, calls out. Rendering lives in cli/views.py.

Every command that talks to a server takes ``--address`` (env ``RELAY_ADDRESS``), ``--tls``
and ``--tls-ca`` (env ``RELAY_TLS_CA``); the read commands take ``--json``. An expected
failure (no server, a bad argument, an error reply) is one line on stderr, "relay-trio:
...", and a non-zero exit: 2 for usage errors, else 1.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import operator
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import click
import orjson
import trio

from cli import views
from cli.calls import call, console, converter, plural, print_json
from cli.demo import DEMO_CONCURRENCY, demo_counts, demo_handler, run_demo
from cli.errors import PROG, RelayGroup, fail, run
from cli.options import (
    address_option,
    check_queues,
    client_target,
    client_token,
    json_option,
    read_client_token,
)
from cli.server import SPARE_FILES, raise_open_files_limit, server
from relay import log as relay_log
from relay.client import Client, open_client
from relay.model import WIRE_PRIORITIES, JobState
from relay.worker import DEFAULT_LEASE_MS, Worker, run_worker

STATE_NAMES = [str(state) for state in JobState]


@click.group(cls=RelayGroup)
@click.version_option(package_name="relay-trio", prog_name=PROG)
def main() -> None:
    """relay-trio: a durable job queue server with visible failure semantics.

    Start with `relay-trio demo` to see jobs run, retry and die in a few seconds.
    """


main.add_command(server)


# -- worker ---------------------------------------------------------------------------------


def load_handler(spec: str) -> Callable[..., Any]:
    """Import "package.module:function" (the function may be dotted: "module:Class.method").
    The current directory is importable, as with ``python -m``."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise click.BadParameter(f"{spec!r} is not package.module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise click.BadParameter(
            f"cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from None
    try:
        handler = operator.attrgetter(attribute)(module)
    except AttributeError:
        raise click.BadParameter(f"module {module_name} has no {attribute}") from None
    if not callable(handler):
        raise click.BadParameter(f"{spec} is not callable")
    return handler


def _handler_option(ctx: click.Context, param: click.Parameter, value: str | None):
    return None if value is None else load_handler(value)


@main.command()
@address_option
@click.option(
    "--queue", "queues", multiple=True, required=True, callback=check_queues,
    help="A queue to lease from; repeat for several.",
)  # fmt: skip
@click.option(
    "--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
    help="Slots: the most jobs run at once.",
)  # fmt: skip
@click.option(
    "--shutdown-timeout-ms", type=click.IntRange(min=0), default=30_000, show_default=True,
    help="At SIGINT/SIGTERM, how long running jobs may finish before they are released.",
)  # fmt: skip
@click.option(
    "--lease-ms", type=click.IntRange(min=1), default=DEFAULT_LEASE_MS, show_default=True,
    help="Lease length; the worker renews it about every third of it.",
)  # fmt: skip
@click.option(
    "--handler", "handler", metavar="MODULE:FUNCTION", callback=_handler_option,
    help="The function to run each job with (async or not). Default: the demo executor: "
    'payload {"sleep_ms": N} sleeps, {"fail": true, "error": "..."} fails, anything else '
    "succeeds.",
)  # fmt: skip
def worker(
    address: str,
    queues: tuple[str, ...],
    concurrency: int,
    shutdown_timeout_ms: int,
    lease_ms: int,
    handler: Callable[..., Any] | None,
) -> None:
    """Lease jobs from QUEUEs and run them until SIGINT or SIGTERM (graceful: running jobs
    get the shutdown timeout; a second signal stops at once). Logs JSON lines on stderr."""
    relay_log.configure()
    worker = functools.partial(
        Worker, queues=list(queues), handler=handler or demo_handler, concurrency=concurrency,
        lease_ms=lease_ms, shutdown_timeout=shutdown_timeout_ms / 1000,
    )  # fmt: skip
    address, tls_ca = client_target(address)
    run(_work, address, tls_ca, client_token(), worker, address=address)


async def _work(
    address: str, tls_ca: str | None, token: str | None, make_worker: Callable[[Client], Worker]
) -> None:
    # The worker rides out server restarts, so its client reconnects (open_client's default).
    async with open_client(address, tls_ca=tls_ca, token=token) as client:
        hello = await client.hello("relay-trio worker")
        worker = make_worker(client)
        if hello.role == "producer":
            raise click.ClickException(
                f"the token's role is {hello.role}: a worker needs the worker or admin role"
            )
        _check_worker_limits(worker, hello.limits)
        await run_worker(worker)


def _check_worker_limits(worker: Worker, limits: dict[str, int]) -> None:
    """Refuse at start what every lease request would be refused for, instead of a worker
    that logs the same bad_request forever."""
    checks = (
        ("--lease-ms", worker.lease_ms, "max_lease_ms"),
        ("--concurrency", worker.concurrency, "max_batch"),
        ("--queue", len(worker.queues), "max_queues_per_lease"),
    )
    for option, value, limit in checks:
        top = limits.get(limit)
        if top is not None and value > top:
            raise click.BadParameter(
                f"{value} is more than the server allows ({limit} = {top})", param_hint=option
            )


# -- submit ---------------------------------------------------------------------------------


def _payload_option(ctx: click.Context, param: click.Parameter, value: str) -> Any:
    text = click.get_text_stream("stdin").read() if value == "-" else value
    if not text.strip():
        raise click.BadParameter("empty; give a JSON value" + (" on stdin" if value == "-" else ""))
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}") from None


BACKOFF_FORMS = "fixed:MS or exp:BASE:MAX[:nojitter]"


def parse_backoff(text: str) -> dict[str, Any]:
    """ "fixed:MS" or "exp:BASE:MAX[:nojitter]" as the wire's backoff object."""
    kind, *numbers = text.split(":")
    jitter = True
    if kind in ("exp", "exponential") and numbers and numbers[-1] in ("jitter", "nojitter"):
        jitter = numbers.pop() == "jitter"
    if not all(n.isdigit() for n in numbers):
        raise click.BadParameter(f"{text!r}: expected {BACKOFF_FORMS}")
    if kind == "fixed" and len(numbers) == 1:
        return {"kind": "fixed", "delay_ms": int(numbers[0])}
    if kind in ("exp", "exponential") and len(numbers) == 2:
        base, top = map(int, numbers)
        return {"kind": "exponential", "base_ms": base, "max_ms": top, "jitter": jitter}
    raise click.BadParameter(f"{text!r}: expected {BACKOFF_FORMS}")


def _backoff_option(ctx: click.Context, param: click.Parameter, value: str | None):
    return None if value is None else parse_backoff(value)


@main.command()
@click.argument("queue")
@click.option(
    "--payload", required=True, callback=_payload_option, metavar="JSON",
    help="The job's payload, any JSON value; '-' reads it from stdin.",
)  # fmt: skip
@click.option("--priority", type=click.Choice(WIRE_PRIORITIES), help="Default: normal.")
@click.option(
    "--retries", type=click.IntRange(min=0), help="Retries after the first attempt (default 3)."
)
@click.option("--delay-ms", type=click.IntRange(min=0), help="Run no sooner than this from now.")
@click.option(
    "--run-at", type=click.IntRange(min=0), metavar="MS", help="Run at this time (ms since epoch)."
)
@click.option(
    "--backoff", callback=_backoff_option, metavar="SPEC",
    help=f"Wait between retries: {BACKOFF_FORMS} (default exp:1000:300000).",
)  # fmt: skip
@click.option("--idempotency-key", metavar="KEY", help="Submit at most once per queue and key.")
@address_option
@json_option
def submit(
    queue: str,
    payload: Any,
    priority: str | None,
    retries: int | None,
    delay_ms: int | None,
    run_at: int | None,
    backoff: dict[str, Any] | None,
    idempotency_key: str | None,
    address: str,
    as_json: bool,
) -> None:
    """Submit a job to QUEUE; print its id and state (and "duplicate" when the idempotency
    key matched an earlier job)."""
    if delay_ms is not None and run_at is not None:
        raise click.UsageError("give --delay-ms or --run-at, not both")
    result = call(address, lambda client: client.submit(
        queue, payload, priority=priority, retries=retries, delay_ms=delay_ms, run_at=run_at,
        backoff=backoff, idempotency_key=idempotency_key,
    ))  # fmt: skip
    if as_json:
        print_json(result)
    else:
        click.echo(f"{result.job_id} {result.state}" + (" duplicate" if result.duplicate else ""))


# -- inspect and stats ----------------------------------------------------------------------


@main.command("inspect")
@click.argument("job_id", metavar="JOB")
@address_option
@json_option
def inspect_command(job_id: str, address: str, as_json: bool) -> None:
    """Show one job: state, attempts, timings, errors, payload and result."""
    job = call(address, lambda client: client.inspect(job_id))
    if as_json:
        print_json(job)
    else:
        console().print(views.job_panel(job))


@main.command()
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

    async def session() -> None:
        async with open_client(address, reconnect=False, token=token, tls_ca=tls_ca) as client:
            events = client.watch(queues or None, states or None)
            async with events:
                async for event in events:
                    out.write(orjson.dumps(event).decode() + "\n")
                    out.flush()

    run(session, address=address)


@main.command()
@address_option
def top(address: str) -> None:
    """A live view of the queues until Ctrl-C: counts by state, jobs submitted, succeeded
    and failed per second over the last 10 s, and the latest failures. Reconnects when
    the server restarts."""
    from cli.top import TopView, run_top

    token = client_token()
    address, tls_ca = client_target(address)
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(run_top, address, token, tls_ca, TopView())


@main.command()
@address_option
@json_option
def stats(address: str, as_json: bool) -> None:
    """Jobs per queue and state, and the server's version, uptime and connections."""
    result = call(address, lambda client: client.stats(oldest_ready=True))
    if as_json:
        data = converter.unstructure(result)
        data["queues"] = dict(sorted(data["queues"].items()))
        print_json(data)
    else:
        console().print(views.stats_table(result))


# -- dead letters ---------------------------------------------------------------------------


@main.group()
def dead() -> None:
    """Dead jobs: list them, retry them, purge them."""


@dead.command("list")
@click.option("--queue", help="Only this queue's dead jobs.")
@click.option("--limit", type=click.IntRange(min=1), help="Jobs per page (default 100).")
@click.option("--cursor", help="Where the previous page ended (its next_cursor).")
@address_option
@json_option
def dead_list(
    queue: str | None, limit: int | None, cursor: str | None, address: str, as_json: bool
) -> None:
    """List dead jobs, oldest first, a page at a time."""
    page = call(address, lambda client: client.dead_list(queue, limit=limit, cursor=cursor))
    if as_json:
        print_json(page)
    else:
        console().print(views.dead_table(page))


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


def _dead_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = json_option(fn)
    fn = address_option(fn)
    fn = click.option("--all", "every", is_flag=True, help="Every dead job of --queue.")(fn)
    fn = click.option("--queue", help="With --all: the queue whose dead jobs to take.")(fn)
    return click.argument("job_id", metavar="[JOB]", required=False)(fn)


@dead.command("retry")
@_dead_options
def dead_retry(
    job_id: str | None, queue: str | None, every: bool, address: str, as_json: bool
) -> None:
    """Make a dead job (or every dead job of a queue) ready again, with fresh attempts."""
    target = _dead_target(job_id, queue, every)
    count = call(address, lambda client: client.dead_retry(**target))
    if as_json:
        print_json({"count": count})
    else:
        click.echo(f"retried {plural(count, 'dead job')}")


@dead.command("purge")
@_dead_options
@click.option("--yes", is_flag=True, help="Do not ask before purging a whole queue.")
def dead_purge(
    job_id: str | None, queue: str | None, every: bool, address: str, as_json: bool, yes: bool
) -> None:
    """Delete a dead job (or every dead job of a queue) for good."""
    target = _dead_target(job_id, queue, every)
    if every and not yes:
        click.confirm(
            f"Delete every dead job of queue {queue}? This cannot be undone", abort=True, err=True
        )
    count = call(address, lambda client: client.dead_purge(**target))
    if as_json:
        print_json({"count": count})
    else:
        click.echo(f"purged {plural(count, 'dead job')}")


# -- demo -----------------------------------------------------------------------------------


@main.command()
@click.option(
    "--db", type=click.Path(dir_okay=False), metavar="PATH",
    help="Keep the demo's queue in this SQLite file (default: a temporary file, deleted).",
)  # fmt: skip
@click.option(
    "--jobs", type=click.IntRange(1, 10_000), default=60, show_default=True,
    help="How many jobs to submit.",
)  # fmt: skip
@click.option(
    "--concurrency", type=click.IntRange(min=1), default=DEMO_CONCURRENCY, show_default=True,
    help="The demo worker's slots.",
)  # fmt: skip
@click.option("--seed", type=int, help="Seed the job mix, for a repeatable run.")
def demo(db: str | None, jobs: int, concurrency: int, seed: int | None) -> None:
    """Watch jobs run, retry and die, in one process, in a few seconds.

    Starts an embedded queue and a worker running the demo executor, submits a mix of
    quick, slow, delayed and failing jobs of every priority, shows each state's count as
    it changes, then the stats and the dead jobs.
    """
    relay_log.configure()
    if "RELAY_LOG" not in os.environ:
        # The demo's jobs die on purpose; their warnings would only garble the progress.
        logging.getLogger("relay").setLevel(logging.ERROR)
    out = console()
    with tempfile.TemporaryDirectory(prefix="relay-trio-demo-") as tmp:
        path = db or os.path.join(tmp, "demo.db")
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise click.BadParameter(f"{db}: no such directory", param_hint="'--db'")
        counts = demo_counts(jobs)
        out.print(
            f"[bold]relay-trio demo[/]: {jobs} jobs into an embedded queue ({path}), one "
            f"worker with {concurrency} slots.\n"
            f"  {counts['quick']} quick (email), {counts['slow']} slow (thumbnails), "
            f"{counts['delayed']} delayed (reports), {counts['flaky']} failing once then "
            f"retried (payments), {counts['doomed'] + counts['rejected']} failing for good "
            "(payments, webhooks).",
            highlight=False,
        )
        outcome = run(functools.partial(run_demo, out, path, jobs, concurrency=concurrency,
                                        seed=seed))  # fmt: skip
    out.print(views.stats_table(outcome.stats))
    out.print(views.dead_table(outcome.dead))
    totals = views.totals_by_state(outcome.stats)
    if not outcome.finished:
        fail(f"demo timed out after {outcome.seconds:.0f} s with "
             f"{plural(views.unfinished(outcome.stats), 'unfinished job')}")  # fmt: skip
    out.print(
        f"Done in {outcome.seconds:.1f} s: {totals['succeeded']} succeeded, "
        f"{totals['dead']} dead; each dead job keeps its error history"
        + (" (see below)." if db is not None else " (--db PATH keeps the queue to look at)."),
        highlight=False,
    )
    if db is not None:
        out.print(
            f"The queue is kept in {db}: relay-trio server --db {db}, then relay-trio stats "
            "or relay-trio dead list.",
            highlight=False,
        )


# What tests and scripts import from here, besides the commands.
__all__ = [
    "SPARE_FILES",
    "load_handler",
    "main",
    "parse_backoff",
    "raise_open_files_limit",
    "read_client_token",
]
