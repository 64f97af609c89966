"""Which queues each server has long-polls parked on (the table ``waiters``): what decides
whether a commit that made jobs ready notifies the other servers (notify.py).

A server keeps one row per queue it has leases parked on, or had within a while (its
service, relay/server/services/waiters.py), and renews them; a commit elsewhere that made
jobs ready in a queue notifies only if some other server has a row for it (or for every
queue, notify.EVERY). The order that makes this safe: a server's row is committed before it
parks anything it has not woken since (``waiters_put`` returns the rows it inserted, and
the leases parked on those queues claim again), and a commit's check runs after that
commit. So either the check sees the row, or the claim after the row sees the job.

Rows of a server that stopped without removing its own are removed by the next server
that writes its own, once they are STALE_MS past their ``until``; until then they cost
the notifications they ask for, nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.store.postgres.base import PostgresBase
from relay.store.postgres.notify import EVERY
from relay.store.postgres.sql import atomic

__all__ = ["EVERY", "Waiters"]
# How long past its ``until`` another server's row is taken for left behind.
STALE_MS = 10 * 60_000

# The rows there already renewed (locked: a server removing them as left behind waits, or
# they are gone and inserted anew), the others inserted; the inserted ones returned.
_PUT = (
    "WITH renewed AS (UPDATE waiters SET until = %s WHERE origin = %s AND queue = ANY(%s) "
    "RETURNING queue) INSERT INTO waiters (queue, origin, until) SELECT q, %s, %s "
    "FROM unnest(%s::text[]) AS q WHERE q NOT IN (SELECT queue FROM renewed) "
    "ON CONFLICT (queue, origin) DO NOTHING RETURNING queue"
)
_DROP = "DELETE FROM waiters WHERE origin = %s AND queue = ANY(%s)"
# Never waits for a row another server holds (its own writes), so never deadlocks.
_DROP_STALE = (
    "DELETE FROM waiters WHERE ctid = ANY(ARRAY(SELECT ctid FROM waiters "
    "WHERE until < %s AND origin <> %s FOR UPDATE SKIP LOCKED))"
)


class Waiters(PostgresBase):
    """The rows of ``waiters``: part of ``PostgresStore``."""

    @atomic
    def waiters_put(
        self, put: Sequence[str], drop: Sequence[str], until: int, now: int
    ) -> list[str]:
        """Hold a row of this server's for each of ``put`` until ``until``, and none for
        ``drop``; return the queues of ``put`` that had none (their rows are new). Also
        removes the rows other servers left behind (STALE_MS)."""
        inserted: list[str] = []
        if drop:
            self._write_later(_DROP, (self.origin, sorted(drop)))
        self._write_later(_DROP_STALE, (now - STALE_MS, self.origin))
        if put:  # (the one round trip, with the writes above)
            queues = sorted(put)
            params = (until, self.origin, queues, self.origin, until, queues)
            inserted = [row[0] for row in self._write(_PUT, params)]
        return inserted
