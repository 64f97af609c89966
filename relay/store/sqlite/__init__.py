"""The SQLite store: every state transition as synchronous SQL on one connection.

``SqliteStore`` implements the ``Store`` interface (relay/store/base.py); the schema and
opening a file are relay/store/schema.py. Where each part lives:

- store.py: ``SqliteStore`` itself: open, close, transactions, the counts loaded at open
- jobs.py: submit: new jobs, the depth limits, idempotency keys
- leases.py: the transitions of a lease: claim, renew, ack, fail, release
- maintenance.py: promote due jobs, reap expired leases, recover, prune, next deadlines
- dead.py: dead-letter retry and purge
- reads.py: inspect, the dead list, the counts (event totals are the counts book's)
- sql.py: statements of many rows, JSON reads, and the base the parts share
"""

from relay.store.sqlite.store import SqliteStore

__all__ = ["SqliteStore"]
