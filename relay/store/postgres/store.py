"""``PostgresStore``: the store interface of ``SqliteStore`` on a PostgreSQL database that
several relay-trio servers share. Never imports trio; never reads the clock.

Each server's writer thread owns one store and its one connection, and commits a batch of
commands in one transaction (``begin``, ``command`` as a savepoint, ``commit``), exactly as
with SQLite. What differs is that other servers commit to the same tables meanwhile:

- Rows are locked where a decision depends on them. A claim, and every time-driven pass
  (promote, reap, prune, a queue's dead letters), takes its rows with ``FOR UPDATE SKIP
  LOCKED``: two servers never take one job, and neither waits for the other. A command on
  one named job (renew, ack, fail, release, a dead job's retry or purge) locks that row
  with ``FOR UPDATE`` before it checks the lease, and waits if another server holds it.
- Time is the caller's ``now``, never the database's: one server's clock decides each
  transition, as with SQLite. Servers are assumed to agree on the time to well within the
  shortest lease (NTP keeps them within milliseconds); a server whose clock runs ahead by
  ``d`` reaps leases ``d`` early and lets aging advance ``d`` sooner, one behind accepts a
  late ack up to ``d`` after the lease expired.
- Counts per queue and state (``queue_stats``, the depth limits) come from the database,
  since this server's memory knows only its own commits: see ``_flush_counts_and_commit``. Event
  totals (``event_totals``) stay per process, as Prometheus counters are summed over
  instances anyway.
- ``leases_recover`` does nothing: see maintenance.py.

Methods called outside ``begin`` run in a transaction of their own (``sql.atomic``).
Every method that refuses (``RelayError``) does so before it writes anything, as in SQLite,
and the writer checks this with ``write_mark``.
"""

from __future__ import annotations

import random

from relay.store.base import StoreConfig
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.browse import Browse
from relay.store.postgres.cancel import Cancel
from relay.store.postgres.dead import DeadLetters
from relay.store.postgres.history import History
from relay.store.postgres.jobs import Jobs
from relay.store.postgres.leases import Leases
from relay.store.postgres.maintenance import Maintenance
from relay.store.postgres.reads import Reads
from relay.store.postgres.schedules import Schedules
from relay.store.postgres.schema import open_connection
from relay.store.postgres.settings import Settings
from relay.store.postgres.waiters import Waiters


class PostgresStore(
    Jobs,
    Leases,
    Maintenance,
    DeadLetters,
    Cancel,
    Reads,
    Settings,
    Schedules,
    Browse,
    History,
    Waiters,
    PostgresBase,
):
    """The job store on one PostgreSQL connection, which it owns.

    Not thread-safe: exactly one thread (the writer) may call it.
    """

    # Whether ``leases_recover`` at start makes every leased job ready again. Not here:
    # the other servers' leases are alive (see maintenance.py).
    recovers_on_start = False

    @classmethod
    def open(
        cls,
        url: str,
        config: StoreConfig | None = None,
        *,
        rng: random.Random | None = None,
        slot: int | None = None,
    ) -> PostgresStore:
        """Connect to ``url`` (``postgresql://...``), creating or migrating the schema
        (see ``schema.open_connection``)."""
        store = cls(open_connection(url), config, rng=rng, slot=slot)
        store.url = url
        return store
