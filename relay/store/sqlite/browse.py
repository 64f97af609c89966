"""The job browser, as SQLite: a page of any states' jobs (``jobs_list``), and a promote
of one waiting job (``job_promote``).

A page of one queue is one seek of ``jobs_queue_state`` (queue, state, id) per state
asked that holds jobs (the counts in memory say which), each read lazily and merged by
id: the page costs those seeks and its own rows, at any number of jobs. Ready and leased
jobs are not in that index (base.BROWSED): their runs read the queue's ready jobs of
jobs_ready, or every leased job of jobs_leased, sorted by id, while those are at most
rows.SORTED_MAX. A page of every queue does the same while at most MERGED_RUNS_MAX
(queue, state) hold jobs in the states asked; past that it reads the jobs by id (the
table's key; the dead ones by ``jobs_dead``), at most ROWS_EXAMINED_MAX of them, as a
search by an id's start reads its range of ids: a page costs at most that many rows
whatever the number of queues or jobs (rows.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.protocol.errors import InvalidState, JobNotFound
from relay.protocol.model import ID_MAX, JobInfo, JobState, parse_job_id
from relay.store import rows as browse_rows
from relay.store.base import BROWSED, LEASED, PROMOTABLE, READY
from relay.store.rows import (
    KEY_SEARCH_MAX,
    SUMMARY_COLUMNS,
    cursor_bound,
    held_runs,
    key_matches,
    list_page,
    search_ids,
    sortable,
    summaries,
    window_page,
)
from relay.store.sqlite.sql import _JSON_IDS, SqliteBase, _json_ids

# Where a page's jobs are, beyond the cursor's bound, oldest or newest first.
_BOUND = {False: ("id > ?", "", "id <= ?"), True: ("id <= ?", "DESC", "id >= ?")}
# One (queue, state)'s jobs beyond the cursor's bound: of a state in the browser's index
# (its condition repeated, so that SQLite sees the partial index answers), or a queue's
# ready jobs from jobs_ready, or its leased ones from every leased job's jobs_leased,
# sorted (rows.SORTED_MAX).
_RUN = {
    newest: f"SELECT {SUMMARY_COLUMNS} FROM jobs INDEXED BY jobs_queue_state "
    f"WHERE queue = ? AND state = ? AND {BROWSED} AND {bound} ORDER BY id {order} LIMIT ?"
    for newest, (bound, order, _) in _BOUND.items()
}
_SORTED_RUN = {
    (state, newest): f"SELECT {SUMMARY_COLUMNS} FROM jobs INDEXED BY {index} "
    f"WHERE queue = ? AND state = ? AND state = '{state}' AND {bound} "
    f"ORDER BY id {order} LIMIT ?"
    for state, index in ((READY, "jobs_ready"), (LEASED, "jobs_leased"))
    for newest, (bound, order, _) in _BOUND.items()
}
# Every queue's dead jobs (the partial index ``jobs_dead`` by id).
_DEAD = {
    newest: f"SELECT {SUMMARY_COLUMNS} FROM jobs INDEXED BY jobs_dead "
    f"WHERE state = 'dead' AND {bound} ORDER BY id {order} LIMIT ?"
    for newest, (bound, order, _) in _BOUND.items()
}
# The edge of a read by id: the key ROWS_EXAMINED_MAX jobs on from the cursor's bound
# (within an id range, or none), past which a page examines nothing. None: fewer are left.
_EDGE = {
    (by_range, newest): "SELECT id FROM jobs NOT INDEXED WHERE "
    + ("id BETWEEN ? AND ? AND " if by_range else "")
    + f"{bound} ORDER BY id {order} LIMIT 1 OFFSET ?"
    for by_range in (False, True)
    for newest, (bound, order, _) in _BOUND.items()
}
# The jobs of the states asked (of a queue, or of any) among those up to the edge (-1 or
# the largest key: none), of an id range (or every id), or of a list of keys.
_FILTER = (
    "AND state IN (SELECT value FROM json_each(?)) AND (? IS NULL OR queue = ?) "
    "AND {bound} AND {edge} ORDER BY id {order} LIMIT ?"
)
_SEARCH = {
    (by, newest): f"SELECT {SUMMARY_COLUMNS} FROM jobs NOT INDEXED WHERE "
    + {"range": "id BETWEEN ? AND ? ", "all": "1 ", "keys": f"id IN {_JSON_IDS} "}[by]
    + _FILTER.format(bound=bound, edge=edge, order=order)
    for by in ("range", "all", "keys")
    for newest, (bound, order, edge) in _BOUND.items()
}
# The first keys of a queue that begin with a prefix: a range of each key table's primary
# key (queue, key); a key sorts below the prefix followed by the highest character.
_KEYS = {
    table: f"SELECT key, job_id FROM {table} WHERE queue = ? AND key >= ? AND key < ? "
    f"ORDER BY key LIMIT {KEY_SEARCH_MAX + 1}"
    for table in ("idempotency_keys", "unique_keys")
}


class SqliteBrowse(SqliteBase):
    """The job browser and promote: part of ``SqliteStore``."""

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
            runs = [self._db.execute(_DEAD[newest], (bound, limit + 1))]
        else:
            counts = (
                self._counts.items()
                if queue is None
                else (((queue, state), self._counts.get((queue, state), 0)) for state in states)
            )
            pairs = held_runs(counts, states, browse_rows.MERGED_RUNS_MAX)
            if pairs is not None and not sortable(pairs, self._count_of):
                pairs = None
            if pairs is None:  # too many to merge or to sort: the jobs by id
                edge = self._edge(None, bound, newest)
                filters = (_json_ids(list(states)), queue, queue, bound)
                sql = _SEARCH["all", newest]
                runs = [self._db.execute(sql, (*filters, self._no_edge(edge, newest), limit + 1))]
            else:
                runs = [
                    self._db.execute(
                        _SORTED_RUN.get((state, newest)) or _RUN[newest],
                        (q, state, bound, limit + 1),
                    )
                    for q, state in pairs
                ]
        rows, after = window_page(runs, edge, limit, newest)
        return list_page(summaries(rows), after)

    def _count_of(self, queue: str | None, state: str) -> int:
        """Jobs of ``queue`` (None: every queue) in ``state``, from the counts in memory."""
        if queue is not None:
            return self._counts.get((queue, state), 0)
        return sum(n for (_, s), n in self._counts.items() if s == state)

    def _edge(self, keys: range | None, bound: int, newest: bool) -> int | None:
        """The last key a read by id from ``bound`` (within ``keys``) may examine; None:
        fewer than ROWS_EXAMINED_MAX jobs are left to read."""
        span = () if keys is None else (keys.start, keys[-1])
        row = self._db.execute(
            _EDGE[keys is not None, newest], (*span, bound, browse_rows.ROWS_EXAMINED_MAX - 1)
        ).fetchone()
        return None if row is None else row[0]

    @staticmethod
    def _no_edge(edge: int | None, newest: bool) -> int:
        """The edge as the statements take it: without one, a key beyond every job's."""
        if edge is not None:
            return edge
        return -1 if newest else ID_MAX

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
        filters = (_json_ids(list(states)), queue, queue, bound, self._no_edge(edge, newest))
        runs = []
        if keys:
            sql = _SEARCH["range", newest]
            runs.append(self._db.execute(sql, (keys.start, keys[-1], *filters, limit + 1)))
        if queue is not None:
            found: set[int] = set()
            for sql in _KEYS.values():
                rows = self._db.execute(sql, (queue, search, search + "\U0010ffff")).fetchall()
                found.update(key_matches(search, rows))
            if keys:  # (those of the id range are listed by it already)
                found = {key for key in found if key not in keys}
            if found:
                sql = _SEARCH["keys", newest]
                runs.append(self._db.execute(sql, (_json_ids(found), *filters, limit + 1)))
        return runs, edge

    def job_promote(self, job_id: str, now: int) -> JobState:
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._db.execute(
                "SELECT queue, state, attempt FROM jobs WHERE id = ?", (key,)
            ).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        queue, state, attempt = row
        if state not in PROMOTABLE:
            raise InvalidState(job_id, state, "promote")
        # Ready from now; its run_at stays, as a promote by the clock keeps it.
        self._db.execute("UPDATE jobs SET state = 'ready', ready_at = ? WHERE id = ?", (now, key))
        self._move(queue, state, READY)
        self.changes.ready_queues.add(queue)
        if self.recording:
            self._record(key, queue, state, "ready", attempt, now)
        return JobState(state)
