"""The commands that run jobs: ``relay-trio worker`` on a server's queues, with a handler
imported by name (``load_handler``) or the demo executor, and ``relay-trio demo``, an
embedded queue and a worker in one process (cli/demo.py runs it).
"""

from __future__ import annotations

import functools
import importlib
import logging
import operator
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import click
from rich.text import Text

from relay.protocol.errors import BadRequest
from relay.util import log as relay_log
from relay.util.log import event
from relay.worker.worker import DEFAULT_LEASE_MS, Worker, run_worker
from relay_cli import views
from relay_cli.calls import console, plural
from relay_cli.demo import DEMO_CONCURRENCY, demo_counts, demo_handler, run_demo
from relay_cli.errors import EXIT_INTERRUPTED, fail, run
from relay_cli.options import (
    address_option,
    check_queues,
    client_target,
    client_timeout,
    client_token,
)

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


@click.command()
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
    """Lease jobs from QUEUEs and run them until Ctrl-C or SIGTERM.

    The first signal drains: no more leases; running jobs may finish within the shutdown
    timeout, then are released. A second signal stops at once. Exit code 130 after
    Ctrl-C, 0 after a SIGTERM that drained.

    A server that is down, at start or later, is tried again with backoff, and logged
    (--timeout bounds each attempt). At start, a token, TLS setting or option the server
    refuses ends the worker with one line; later, refused leases are logged and asked
    again. Logs on stderr: a line per failed job, per lost connection, per retry.
    """
    relay_log.configure()
    address, tls_ca = client_target(address)
    worker = Worker(
        address, queues=list(queues), handler=handler or _told_demo_handler(),
        concurrency=concurrency,
        lease_ms=lease_ms, shutdown_timeout=shutdown_timeout_ms / 1000, token=client_token(),
        tls_ca=tls_ca, connect_timeout=client_timeout(),
    )  # fmt: skip
    received = run(_work, worker, address=address)
    if signal.SIGINT in received or len(received) > 1:
        sys.exit(EXIT_INTERRUPTED)


def _told_demo_handler() -> Callable[..., Any]:
    """The demo executor, which says once, as it takes its first job, that it runs and
    acks whatever it leases: a worker started without --handler by mistake empties real
    queues otherwise without a word (found from outside, 2026-12-04)."""
    told = False

    async def run(job: Any) -> Any:
        nonlocal told
        if not told:
            told = True
            event(logging.getLogger("relay.worker"), logging.WARNING, "worker.demo_handler",
                  message=f"no --handler: the demo executor runs the jobs of {job.queue} and acks "
                  "them (sleep_ms sleeps, fail fails, anything else succeeds); give "
                  "--handler MODULE:FUNCTION to run your own", queue=job.queue)  # fmt: skip
        return await demo_handler(job)

    return run


# The worker's settings that the server may refuse at start, by the field its error names.
_OPTIONS = {"lease_ms": "--lease-ms", "queues": "--queue"}


async def _work(worker: Worker) -> list[signal.Signals]:
    """``run_worker``, with a setting the server refused (``BadRequest`` naming the
    field) turned into a usage error naming the option."""
    try:
        return await run_worker(worker)
    except BadRequest as exc:
        if exc.field not in _OPTIONS:
            raise
        raise click.BadParameter(exc.message, param_hint=_OPTIONS[exc.field]) from None


# -- demo -----------------------------------------------------------------------------------


@click.command()
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
            Text("relay-trio demo", style="bold"),
            f": {jobs} jobs into an embedded queue ({path}), one "
            f"worker with {concurrency} slots.\n"
            f"  {counts['quick']} quick (email), {counts['slow']} slow (thumbnails), "
            f"{counts['delayed']} delayed (reports), {counts['flaky']} failing once then "
            f"retried (payments), {counts['doomed'] + counts['rejected']} failing for good "
            "(payments, webhooks).",
            highlight=False,
            sep="",
        )
        outcome = run(functools.partial(run_demo, out, path, jobs, concurrency=concurrency,
                                        seed=seed))  # fmt: skip
    out.print(views.stats_table(outcome.stats))
    out.print(views.dead_table(outcome.dead, short=outcome.short))
    totals = views.totals_by_state(outcome.stats)
    if not outcome.finished:
        fail(f"demo timed out after {outcome.seconds:.0f} s with "
             f"{plural(views.unfinished(outcome.stats), 'unfinished job')}")  # fmt: skip
    history = ""
    if totals["dead"]:
        history = "; each dead job keeps its error history" + (
            " (see below)" if db is not None else " (--db PATH keeps the queue to look at)"
        )
    out.print(
        f"Done in {outcome.seconds:.1f} s: {totals['succeeded']} succeeded, "
        f"{totals['dead']} dead{history}.",
        highlight=False,
    )
    if db is not None:
        out.print(
            f"The queue is kept in {db}: relay-trio server --db {db}, then relay-trio stats "
            "or relay-trio dead list.",
            highlight=False,
        )
