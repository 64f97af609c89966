"""The job browser on PostgreSQL: a page of any states' jobs (``jobs_list``), and a
promote of one waiting job (``job_promote``). The rules are SqliteStore's
(relay/store/sqlite/browse.py).

A page of one queue, or of every queue while at most MERGED_RUNS_MAX (queue, state) hold
jobs in the states asked (job_counts says which), is one statement: for each, a scan of
``jobs_queue_state`` (queue, state, id) from the cursor that stops at the page's size, the
runs then merged by id. Past that, a page reads the jobs by id (``jobs_pkey``; the dead
ones by ``jobs_dead``), at most ROWS_EXAMINED_MAX of them, as a search by an id's start
reads its range of ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.protocol.errors import InvalidState, JobNotFound
from relay.protocol.model import ID_MAX, JobInfo, JobState, parse_job_id
from relay.store import rows as browse_rows
from relay.store.base import PROMOTABLE, READY
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.sql import atomic, decode_text, encode_text
from relay.store.rows import (
    KEY_SEARCH_MAX,
    SUMMARY_COLUMNS,
    cursor_bound,
    held_runs,
    key_matches,
    list_page,
    search_ids,
    summaries,
    window_page,
)

_DIRECTION = {False: ("id > %s", "", "id <= %s"), True: ("id <= %s", "DESC", "id >= %s")}
# Each (queue, state)'s first jobs beyond the cursor's bound, then the first of them all.
_RUNS = {
    newest: f"SELECT c.* FROM unnest(%s::text[], %s::text[]) AS k(q, s) CROSS JOIN LATERAL "
    f"(SELECT {SUMMARY_COLUMNS} FROM jobs WHERE queue = k.q AND state = k.s AND {bound} "
    f"ORDER BY id {order} LIMIT %s) AS c ORDER BY c.id {order} LIMIT %s"
    for newest, (bound, order, _) in _DIRECTION.items()
}
# The (queue, state) pairs of the states asked that hold jobs, up to a number.
_HELD = (
    "SELECT queue, state, sum(n)::bigint FROM job_counts WHERE state = ANY(%s) "
    "GROUP BY queue, state HAVING sum(n) > 0 LIMIT %s"
)
# Every queue's dead jobs (the partial index ``jobs_dead`` by id).
_DEAD = {
    newest: f"SELECT {SUMMARY_COLUMNS} FROM jobs WHERE state = 'dead' AND {bound} "
    f"ORDER BY id {order} LIMIT %s"
    for newest, (bound, order, _) in _DIRECTION.items()
}
# The edge of a read by id: the key ROWS_EXAMINED_MAX jobs on from the cursor's bound
# (within an id range, or none), past which a page examines nothing. None: fewer are left.
_EDGE = {
    (by_range, newest): "SELECT id FROM jobs WHERE "
    + ("id BETWEEN %s AND %s AND " if by_range else "")
    + f"{bound} ORDER BY id {order} OFFSET %s LIMIT 1"
    for by_range in (False, True)
    for newest, (bound, order, _) in _DIRECTION.items()
}
# A search's jobs, or a page's read by id: those of an id range (of jobs_pkey), of every
# id, or of a list of keys, beyond the cursor's bound and up to the edge (-1 or the
# largest key: none), then of the states (and queue) asked. The jobs are read by id in a
# subquery whose LIMIT keeps the planner from filtering by state first (a partial index
# of a state, read whole, is as many rows as jobs are in it).
_SEARCH = {
    (by, newest): f"SELECT {SUMMARY_COLUMNS} FROM (SELECT * FROM jobs WHERE "
    + {"range": "id BETWEEN %s AND %s ", "all": "TRUE ", "keys": "id = ANY(%s) "}[by]
    + f"AND {bound} AND {edge} ORDER BY id {order} LIMIT %s) AS w "
    "WHERE state = ANY(%s) AND (%s::text IS NULL OR queue = %s) "
    f"ORDER BY id {order} LIMIT %s"
    for by in ("range", "all", "keys")
    for newest, (bound, order, edge) in _DIRECTION.items()
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
        edge = None
        if search is not None:
            runs, edge = self._search_runs(queue, states, search, bound, limit, newest)
        elif queue is None and tuple(states) == ("dead",):
            runs = [self._read(_DEAD[newest], (bound, limit + 1)).fetchall()]
        else:
            held = self._held(queue, states)
            most = browse_rows.MERGED_RUNS_MAX
            pairs = None if held is None else held_runs(held.items(), states, most)
            runs = []
            if pairs is None:  # too many to merge: the jobs by id
                edge = self._edge(None, bound, newest)
                params = self._window(bound, edge, newest, states, queue, limit)
                runs.append(self._read(_SEARCH["all", newest], params).fetchall())
            elif pairs:
                params = ([q for q, _ in pairs], [s for _, s in pairs], bound, limit + 1)
                runs.append(self._read(_RUNS[newest], (*params, limit + 1)).fetchall())
        rows, after = window_page(runs, edge, limit, newest)
        return list_page(summaries(rows, decode_text), after)

    def _held(self, queue: str | None, states: Sequence[str]) -> dict[tuple[str, str], int] | None:
        """Jobs per (queue, state) of ``queue`` (None: every queue), with this
        transaction's moves: all of them for a queue; of every queue, those in ``states``
        holding jobs, or None if more than MERGED_RUNS_MAX do (a read of at most one more)."""
        if queue is not None:
            return dict(self._counts([queue]))
        most = browse_rows.MERGED_RUNS_MAX + 1
        rows = self._read(_HELD, (list(states), most)).fetchall()
        if len(rows) >= most:
            return None
        counts = {(q, s): n for q, s, n in rows}
        for key, n in self._moves.items():
            counts[key] = counts.get(key, 0) + n
        return counts

    def _edge(self, keys: range | None, bound: int, newest: bool) -> int | None:
        """The last key a read by id from ``bound`` (within ``keys``) may examine; None:
        fewer than ROWS_EXAMINED_MAX jobs are left to read."""
        span = () if keys is None else (keys.start, keys[-1])
        row = self._read(
            _EDGE[keys is not None, newest], (*span, bound, browse_rows.ROWS_EXAMINED_MAX - 1)
        ).fetchone()
        return None if row is None else row[0]

    @staticmethod
    def _window(
        bound: int,
        edge: int | None,
        newest: bool,
        states: Sequence[str],
        queue: str | None,
        limit: int,
    ) -> tuple:
        """The parameters of ``_SEARCH`` after its keys: the jobs from ``bound`` to
        ``edge`` (None: a key beyond every job's), at most ROWS_EXAMINED_MAX, then those
        of ``states`` and ``queue``, a page's worth and one."""
        if edge is None:
            edge = -1 if newest else ID_MAX
        examined = browse_rows.ROWS_EXAMINED_MAX
        return (bound, edge, examined, list(states), queue, queue, limit + 1)

    def _search_runs(
        self,
        queue: str | None,
        states: Sequence[str],
        search: str,
        bound: int,
        limit: int,
        newest: bool,
    ) -> tuple[list, int | None]:
        keys = search_ids(queue, search)
        edge = None if not keys else self._edge(keys, bound, newest)
        filters = self._window(bound, edge, newest, states, queue, limit)
        runs = []
        if keys:
            runs.append(
                self._read(_SEARCH["range", newest], (keys.start, keys[-1], *filters)).fetchall()
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
                    self._read(_SEARCH["keys", newest], (sorted(found), *filters)).fetchall()
                )
        return runs, edge

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
