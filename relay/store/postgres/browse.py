"""The job browser on PostgreSQL: a page of any states' jobs (``jobs_list``), and a
promote of one waiting job (``job_promote``). The rules are SqliteStore's
(relay/store/sqlite/browse.py).

A page is one statement: for each (queue, state) asked that holds jobs (job_counts says
which), a scan of ``jobs_queue_state`` (queue, state, id) from the cursor that stops at
the page's size, the runs then merged by id.
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.protocol.errors import InvalidState, JobNotFound
from relay.protocol.model import JobInfo, JobState, parse_job_id
from relay.store.base import PROMOTABLE, READY
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.sql import atomic, decode_text, encode_text
from relay.store.rows import (
    KEY_SEARCH_MAX,
    SUMMARY_COLUMNS,
    cursor_bound,
    key_matches,
    list_page,
    merged,
    search_ids,
    summaries,
)

_DIRECTION = {False: ("id > %s", ""), True: ("id <= %s", "DESC")}
# Each (queue, state)'s first jobs beyond the cursor's bound, then the first of them all.
_RUNS = {
    newest: f"SELECT c.* FROM unnest(%s::text[], %s::text[]) AS k(q, s) CROSS JOIN LATERAL "
    f"(SELECT {SUMMARY_COLUMNS} FROM jobs WHERE queue = k.q AND state = k.s AND {bound} "
    f"ORDER BY id {order} LIMIT %s) AS c ORDER BY c.id {order} LIMIT %s"
    for newest, (bound, order) in _DIRECTION.items()
}
# A search's jobs: those of an id range (of jobs_pkey) or of a list of keys, of the states
# asked, beyond the cursor's bound.
_SEARCH = {
    (by_range, newest): f"SELECT {SUMMARY_COLUMNS} FROM jobs WHERE "
    + ("id BETWEEN %s AND %s " if by_range else "id = ANY(%s) ")
    + f"AND state = ANY(%s) AND (%s::text IS NULL OR queue = %s) AND {bound} "
    f"ORDER BY id {order} LIMIT %s"
    for by_range in (False, True)
    for newest, (bound, order) in _DIRECTION.items()
}
# The first keys of a queue that begin with a prefix: the queue's part of each key table's
# primary key (queue, key), from the prefix on. Where the database sorts text by its bytes
# ("C" collations), the keys that begin with it end below the prefix followed by the
# highest character, so the read is one range; under a language's collation they need not
# be contiguous, and the read goes on through the queue's keys after the prefix.
_KEYS = {
    ranged: [
        f"SELECT key, job_id FROM {table} WHERE queue = %s AND key >= %s "
        + ("AND key < %s " if ranged else "")
        + f"AND starts_with(key, %s) ORDER BY key LIMIT {KEY_SEARCH_MAX + 1}"
        for table in ("idempotency_keys", "unique_keys")
    ]
    for ranged in (False, True)
}
_BYTE_ORDER = ("C", "POSIX", "C.UTF-8", "C.utf8", "ucs_basic")


class Browse(PostgresBase):
    """The job browser and promote: part of ``PostgresStore``."""

    def jobs_list(
        self,
        queue: str | None,
        states: Sequence[str],
        search: str | None,
        cursor: str | None,
        limit: int,
        newest: bool = True,
    ) -> tuple[list[JobInfo], str | None]:
        bound = cursor_bound(cursor, newest)
        if search is not None:
            runs = self._search_runs(queue, states, search, bound, limit, newest)
        else:
            counts = self._counts(None if queue is None else [queue])
            pairs = sorted(
                (q, state) for (q, state), n in counts.items() if n > 0 and state in states
            )
            runs = []
            if pairs:
                params = ([q for q, _ in pairs], [s for _, s in pairs], bound, limit + 1)
                runs.append(self._read(_RUNS[newest], (*params, limit + 1)).fetchall())
        rows, more = merged(runs, limit, newest)
        return list_page(summaries(rows, decode_text), more)

    def _search_runs(
        self,
        queue: str | None,
        states: Sequence[str],
        search: str,
        bound: int,
        limit: int,
        newest: bool,
    ) -> list:
        keys = search_ids(queue, search)
        filters = (list(states), queue, queue, bound, limit + 1)
        runs = []
        if keys:
            runs.append(
                self._read(_SEARCH[True, newest], (keys.start, keys[-1], *filters)).fetchall()
            )
        if queue is not None:
            found: set[int] = set()
            prefix = encode_text(search)
            ranged = self._byte_order()
            params = (
                (queue, prefix, prefix + "\U0010ffff", prefix)
                if ranged
                else (queue, prefix, prefix)
            )
            for sql in _KEYS[ranged]:
                found.update(key_matches(search, self._read(sql, params).fetchall()))
            if keys:  # (those of the id range are listed by it already)
                found = {key for key in found if key not in keys}
            if found:
                runs.append(
                    self._read(_SEARCH[False, newest], (sorted(found), *filters)).fetchall()
                )
        return runs

    def _byte_order(self) -> bool:
        """Whether the database sorts text by its bytes (read once)."""
        known = getattr(self, "_sorts_bytes", None)
        if known is None:
            collation = self._read(
                "SELECT datcollate FROM pg_database WHERE datname = current_database()"
            ).fetchone()[0]
            known = self._sorts_bytes = collation in _BYTE_ORDER
        return known

    @atomic
    def job_promote(self, job_id: str, now: int) -> JobState:
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._read(
                "SELECT queue, state, attempt FROM jobs WHERE id = %s FOR UPDATE", (key,)
            ).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        queue, state, attempt = row
        if state not in PROMOTABLE:
            raise InvalidState(job_id, state, "promote")
        # Ready from now; its run_at stays, as a promote by the clock keeps it.
        self._write("UPDATE jobs SET state = 'ready', ready_at = %s WHERE id = %s", (now, key))
        self._move(queue, state, READY)
        self.changes.ready_queues.add(queue)
        if self.recording:
            self._record(key, queue, state, "ready", attempt, now)
        return JobState(state)
