"""Which errors mean "the database cannot take the writes now, retry later", by kind.

The writer thread (relay/store/thread.py) answers a batch that fails with one of these
``unavailable`` and counts it by kind (``relay_store_errors_total``); any other error is
a bug, answered ``internal``. See docs/failure-model.md.
"""

from __future__ import annotations

import sqlite3
import sys

from relay.protocol.errors import StoreError

# SQLite's primary result codes that mean "cannot write now", not a bug: the file system is
# full (or over its quota), or the device failed a read or a write. They are answered
# ``unavailable`` and counted by kind; the extended codes (SQLITE_IOERR_WRITE, ...) carry
# the primary one in their low byte.
STORE_ERRORS = {
    sqlite3.SQLITE_FULL: ("full", "disk full (SQLITE_FULL)"),
    sqlite3.SQLITE_IOERR: ("ioerr", "I/O error (SQLITE_IOERR)"),
}
# PostgreSQL's: the connection is lost (or cannot be made), or the database broke a
# deadlock or a serialization conflict by rolling this transaction back.
CONNECTION = ("connection", "the database connection is lost")
CONFLICT = ("conflict", "the database rolled the transaction back (a lock conflict)")
STORE_ERROR_KINDS = (*(kind for kind, _ in STORE_ERRORS.values()), CONNECTION[0], CONFLICT[0])
# Waits between attempts to connect again to a database whose connection was lost.
RECONNECT_S, RECONNECT_MAX_S = 0.1, 5.0


def store_error(exc: BaseException | None) -> tuple[str, str] | None:
    """(kind, description) if ``exc`` means the database cannot take the writes now (the
    disk: SQLITE_FULL, SQLITE_IOERR_*; PostgreSQL: a lost connection, a rolled-back
    conflict), else None. The chain of contexts is searched too: a savepoint's ``ROLLBACK
    TO`` fails ("no such savepoint") after SQLite rolled the whole transaction back, and
    its error then hides the one that did it."""
    # psycopg is looked up, not imported: a server on SQLite never loads it, and if it is
    # not loaded, no error can be one of its.
    psycopg = sys.modules.get("psycopg")
    while exc is not None:
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None and code & 0xFF in STORE_ERRORS:
            return STORE_ERRORS[code & 0xFF]
        if psycopg is not None and isinstance(exc, psycopg.errors.TransactionRollback):
            return CONFLICT
        if isinstance(exc, StoreError) or (
            psycopg is not None and isinstance(exc, psycopg.OperationalError)
        ):
            return CONNECTION
        exc = exc.__context__
    return None
