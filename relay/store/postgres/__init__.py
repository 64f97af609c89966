"""The PostgreSQL store: several relay-trio servers sharing one database (see store.py).

``PostgresStore`` implements the ``Store`` interface (relay/store/base.py) in the same
parts as ``SqliteStore`` (relay/store/sqlite/), file for file:

- store.py: ``PostgresStore`` itself: connect, reconnect, transactions, the counts' slots
- jobs.py: submit: new jobs, ids from a sequence, the depth limits, idempotency keys
- leases.py: the transitions of a lease: claim, renew, ack, fail, release
- maintenance.py: promote due jobs, reap expired leases, prune, next deadlines
- dead.py: dead-letter retry and purge
- reads.py: inspect, the dead list, the counts (event totals are the counts book's)
- sql.py: the wrapper that gives a call its own transaction, and the text codec
- schema.py: create and migrate the schema; notify.py: what a commit tells other servers
"""

from relay.store.postgres.store import PostgresStore

__all__ = ["PostgresStore"]
