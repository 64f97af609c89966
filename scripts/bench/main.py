"""The command line of relay-bench: its options, checked together, and a run's order of
business: the disk baseline, the scenarios, the disk baseline again, the report."""

from __future__ import annotations

import sys
import tempfile
import time

import click
import trio
from rich.console import Console

from relay_scripts.bench.measure import SCENARIO_FILTER
from relay_scripts.bench.report import closing_line, render, write_json
from relay_scripts.bench.sampling import commit_baseline_us
from relay_scripts.bench.scenarios import FULL, QUICK
from relay_scripts.bench.servers import Target, make_tls
from relay_scripts.bench.suite import run_all


@click.command()
@click.option("--quick", is_flag=True, help="Reduced sizes, one run each: under 30 s.")
@click.option(
    "--runs",
    type=click.IntRange(1, 20),
    default=None,
    help="Runs of each scenario  [default: 3; 1 with --quick]",
)
@click.option(
    "--sync",
    "sync_modes",
    type=click.Choice(["full", "normal", "both"]),
    default="both",
    show_default=True,
    help="Server synchronous mode; 'both' adds NORMAL for the submit scenarios.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write the results as JSON here.",
)
@click.option("--address", default=None, help="Target a running server instead.")
@click.option(
    "--tls",
    is_flag=True,
    help="Only the one-at-a-time and pipelined submits, against a plain server and a TLS "
    "one (a self-signed certificate made with the openssl command).",
)
@click.option(
    "--watchers",
    is_flag=True,
    help="Only submit and lease+ack, each with no watcher, an idle one and one of every "
    "event, interleaved on one server (FULL).",
)
@click.option(
    "--db",
    "pg_admin_url",
    default=None,
    help="A PostgreSQL URL (postgresql://USER@HOST:PORT/DBNAME) of an existing database: "
    "each group of scenarios runs on a fresh database created through it and dropped after.",
)
@click.option(
    "--servers",
    type=click.IntRange(1, 16),
    default=1,
    show_default=True,
    help="With --db: servers on the one database; connections go round-robin over them.",
)
@click.option(
    "--scenarios",
    "scenario_filter",
    multiple=True,
    help="Only the scenarios whose name contains this (repeatable).",
)
def main(quick: bool, runs: int | None, sync_modes: str, json_path: str | None,
         address: str | None, tls: bool, watchers: bool, pg_admin_url: str | None,
         servers: int, scenario_filter: tuple[str, ...]) -> None:  # fmt: skip
    """Measure a relay-trio server: submit, lease+ack, latency, claim cost, memory."""
    if pg_admin_url is not None and (address is not None or tls or watchers):
        raise click.UsageError("--db starts its own servers: not with --address, --tls, --watchers")
    if servers > 1 and pg_admin_url is None:
        raise click.UsageError("--servers N needs --db: servers share a PostgreSQL database")
    SCENARIO_FILTER[:] = scenario_filter
    target = Target(pg_admin_url, servers)
    for flag, given in (("--tls", tls), ("--watchers", watchers)):
        if given and address is not None:
            raise click.UsageError(f"{flag} starts its own servers: it does not take --address")
    if tls and watchers:
        raise click.UsageError("--tls and --watchers are separate runs")
    if runs is None:
        runs = 1 if quick else 3
    # Not a terminal (a file, a CI log): wide enough that no scenario name wraps.
    console = Console(width=None if sys.stdout.isatty() else 120)
    syncs = ("full", "normal") if sync_modes == "both" else (sync_modes,)
    if pg_admin_url is not None:
        # --synchronous is SQLite's; PostgreSQL commits as the database is configured
        # (synchronous_commit on by default: every ok reply is on disk, as with FULL).
        syncs = ("full",)
    sizes = QUICK if quick else FULL
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as db_dir:
        before = commit_baseline_us(db_dir, sizes.baseline_commits)
        certificate = make_tls(db_dir) if tls else None
        results = trio.run(
            run_all,
            sizes,
            runs,
            syncs,
            address,
            db_dir,
            console,
            certificate,
            watchers,
            target,
        )
        after = commit_baseline_us(db_dir, sizes.baseline_commits)
    render(results, console)
    closing_line(console, len(results), time.monotonic() - started, before, after)
    if json_path:
        write_json(json_path, quick, runs, before, after, results)


if __name__ == "__main__":
    main()
