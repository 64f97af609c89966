"""An online backup of a SQLite database that a server may be using: ``backup_file``.

The copy is made from a second connection with SQLite's backup API in one step, which
reads the whole database inside one read transaction: a consistent snapshot, holding every
transaction committed before it began. In WAL mode a reader never blocks the writer, nor
the writer the reader, so the server keeps committing throughout; what the copy costs it
is the WAL, which cannot be checkpointed past the snapshot until the copy ends and grows
meanwhile by what is written (the server's automatic checkpoint is passive: it never waits
for a reader). A backup in many small steps would not do here: a step after another
connection wrote starts the copy over, so under a steady load it might never end.
docs/design-decisions.md says why this and not ``VACUUM INTO`` or a copy through the server.

The copy is written beside ``dest`` under a temporary name, created with mode 0600 (as the
server creates its database), switched to the rollback journal (one file, nothing beside
it), checked with ``PRAGMA integrity_check``, made durable, and only then given its name:
a backup that fails or is interrupted leaves no file at ``dest``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from urllib.parse import quote

import attrs

from relay.store.owner import create_private
from relay.store.schema import APPLICATION_ID, SCHEMA_VERSION, SQLITE_HEADER

# How long the copy's read waits for a lock (a checkpoint that truncates the WAL, at the
# server's shutdown) before failing.
BUSY_TIMEOUT_MS = 5_000


class BackupError(Exception):
    """The backup was not made; the message is one line naming what failed."""


@attrs.frozen
class BackupResult:
    path: str
    bytes: int
    jobs: int
    schema_version: int
    seconds: float


def backup_file(source: str, dest: str, *, force: bool = False) -> BackupResult:
    """Copy the relay-trio database at ``source`` to ``dest`` consistently, while a server
    may use it. ``dest`` must not exist unless ``force`` (then it is replaced, at once, once
    the copy is complete). Raises BackupError (one line)."""
    began = time.monotonic()
    _check_dest(dest, force)
    src = _open_source(source)
    temp = os.path.join(os.path.dirname(os.path.abspath(dest)),
                        f".{os.path.basename(dest)}.partial-{os.getpid()}")  # fmt: skip
    try:
        try:
            os.close(create_private(temp, os.O_RDWR))
        except OSError as exc:
            raise BackupError(f"cannot create {temp}: {exc.strerror or exc}") from None
        try:
            copy = sqlite3.connect(temp, isolation_level=None)
        except sqlite3.Error as exc:
            raise BackupError(f"cannot open {temp}: {exc}") from None
        try:
            src.backup(copy)  # one step: one read transaction of the source
            # One file at rest: the copy keeps no WAL of its own (a server that opens it
            # switches it back to WAL).
            copy.execute("PRAGMA journal_mode = DELETE")
            problems = [row[0] for row in copy.execute("PRAGMA integrity_check")]
            if problems != ["ok"]:
                raise BackupError(f"the copy of {source} fails its integrity check: "
                                  + "; ".join(problems[:3]))  # fmt: skip
            version = copy.execute("PRAGMA user_version").fetchone()[0]
            jobs = copy.execute("SELECT count(*) FROM jobs").fetchone()[0]
        except sqlite3.Error as exc:
            raise BackupError(f"cannot copy {source}: {exc}") from None
        finally:
            copy.close()
        _sync(temp)
        _put_in_place(temp, dest, force)
        temp = ""
    finally:
        src.close()
        if temp:
            with contextlib.suppress(OSError):
                os.remove(temp)
            for suffix in ("-journal", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.remove(temp + suffix)
    size = os.path.getsize(dest)
    return BackupResult(dest, size, jobs, version, time.monotonic() - began)


def _check_dest(dest: str, force: bool) -> None:
    directory = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(directory):
        raise BackupError(f"the directory of {dest} does not exist: create it first")
    if os.path.isdir(dest):
        raise BackupError(f"{dest} is a directory: give the path of the backup file")
    if os.path.lexists(dest) and not force:
        raise BackupError(f"{dest} exists: choose another path, or pass --force to replace it")


def _open_source(source: str) -> sqlite3.Connection:
    """A connection to ``source`` that never creates it, never writes to it, and refuses
    a file that is not a relay-trio database this code can read."""
    if not os.path.isfile(source):
        raise BackupError(f"no database at {source}: give the server's --db file")
    try:
        with open(source, "rb") as f:
            header = f.read(len(SQLITE_HEADER))
    except OSError as exc:
        raise BackupError(f"cannot read {source}: {exc.strerror or exc}") from None
    if header != SQLITE_HEADER:
        raise BackupError(f"{source} is not a SQLite database")
    try:
        # Read-write (a reader of a WAL database may need to write its -shm index) but
        # never created; query_only: this connection changes nothing.
        src = sqlite3.connect(f"file:{quote(source)}?mode=rw", uri=True, isolation_level=None)
        src.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        src.execute("PRAGMA query_only = ON")
        application_id = src.execute("PRAGMA application_id").fetchone()[0]
        version = src.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.Error as exc:
        raise BackupError(f"cannot open {source}: {exc}") from None
    if application_id != APPLICATION_ID:
        src.close()
        raise BackupError(f"{source} is not a relay-trio database")
    if version > SCHEMA_VERSION:
        src.close()
        raise BackupError(f"{source} has schema version {version}, newer than this "
                          f"relay-trio ({SCHEMA_VERSION}): back it up with the server's "
                          "version")  # fmt: skip
    return src


def _sync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _put_in_place(temp: str, dest: str, force: bool) -> None:
    """Give the complete copy its name: never over a file that appeared meanwhile, unless
    ``force``; then make the name durable."""
    try:
        if force:
            os.replace(temp, dest)
        else:
            os.link(temp, dest)  # fails if dest exists: no file is overwritten
            os.remove(temp)
    except FileExistsError:
        raise BackupError(
            f"{dest} exists: choose another path, or pass --force to replace it"
        ) from None
    except OSError as exc:
        raise BackupError(f"cannot write {dest}: {exc.strerror or exc}") from None
    fd = os.open(os.path.dirname(os.path.abspath(dest)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
