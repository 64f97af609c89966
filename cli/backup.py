"""``relay-trio backup DEST``: a consistent copy of a SQLite database while its server runs
(relay/store/backup.py), on the machine that holds the file. A PostgreSQL database is
backed up with pg_dump (docs/operations.md)."""

from __future__ import annotations

import json

import click

from relay.server.core import is_postgres_url
from relay_cli.errors import EXIT_USAGE, fail


@click.command()
@click.argument("dest", type=click.Path(dir_okay=False))
@click.option(
    "--db", envvar="RELAY_DB", default="relay.db", show_default=True,
    help="The server's SQLite database file (its --db; env RELAY_DB).",
)  # fmt: skip
@click.option("--force", is_flag=True, help="Replace DEST if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def backup(dest: str, db: str, force: bool, as_json: bool) -> None:
    """Copy the server's SQLite database to DEST, consistently, while it runs.

    The copy holds every job committed before the backup began; the server goes on
    serving meanwhile. DEST is created with mode 0600 and checked (PRAGMA integrity_check)
    before it gets its name. To restore: stop the server, put the copy in place of the
    database file (removing any -wal and -shm file beside it), start the server.
    """
    if is_postgres_url(db):
        fail(
            "backup copies a SQLite database; this server uses PostgreSQL: back it up with "
            "pg_dump (see docs/operations.md, 'Back up and restore')",
            EXIT_USAGE,
        )
    from relay.store.backup import BackupError, backup_file

    try:
        result = backup_file(db, dest, force=force)
    except BackupError as exc:
        fail(str(exc))
    if as_json:
        click.echo(json.dumps({"path": result.path, "bytes": result.bytes, "jobs": result.jobs,
                               "schema_version": result.schema_version,
                               "seconds": round(result.seconds, 3)}))  # fmt: skip
        return
    click.echo(
        f"backed up {db} to {result.path}: {result.jobs} jobs, {result.bytes:,} bytes, "
        f"schema {result.schema_version}, in {result.seconds:.2f} s (integrity check ok)"
    )
