"""The relay-trio command line: arguments in, calls out. Rendering lives in cli/views.py."""

from __future__ import annotations

import sys

import click


@click.group()
def main() -> None:
    """relay-trio: a durable job queue server with visible failure semantics."""


@main.command()
@click.option("--db", default="relay.db", show_default=True, help="SQLite database file.")
def server(db: str) -> None:
    """Run the server (arrives with the server issue; the store engine is here now)."""
    click.echo(
        f"relay-trio server is not built yet: the store engine is ready ({db} would be used).",
        err=True,
    )
    sys.exit(2)
