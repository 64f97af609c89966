"""The job browser, as SQLite: a page of any states' jobs (``jobs_list``), and a promote
of one waiting job (``job_promote``).

A page of one queue is one seek of ``jobs_queue_state`` (queue, state, id) per state asked
that holds jobs (the counts in memory say which), each read lazily and merged by id: the
page costs those seeks and its own rows, at any number of jobs. A page of every queue
does the same while at most MERGED_RUNS_MAX (queue, state) hold jobs in the states asked;
past that it reads the jobs by id (the table's key; the dead ones by ``jobs_dead``), at
most ROWS_EXAMINED_MAX of them, as a search by an id's start reads its range of ids: a
page costs at most that many rows whatever the number of queues or jobs (rows.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.protocol.errors import InvalidState, JobNotFound
from relay.protocol.model import JobInfo, JobState, parse_job_id
from relay.store import rows as browse_rows
from relay.store.base import PROMOTABLE, READY
from relay.store.rows import (
    KEY_SEARCH_MAX,
    SUMMARY_COLUMNS,
    cursor_bound,
    held_runs,
    key_matches,
    list_page,
    search_ids,
    summaries,
    window,
    window_page,
)
from relay.store.sqlite.sql import _JSON_IDS, SqliteBase, _json_ids

# Where a page's jobs are, beyond the cursor's bound, oldest or newest first.
_BOUND = {False: ("id > ?", ""), True: ("id <= ?", "DESC")}
# One (queue, state)'s jobs beyond the cursor's bound.
_RUN = {
    newest: f"SELECT {SUMMARY_COLUMNS} FROM jobs INDEXED BY jobs_queue_state "
    f"WHERE queue = ? AND state = ? AND {bound} ORDER BY id {order} LIMIT ?"
    for newest, (bound, order) in _BOUND.items()
}
# Every queue's dead jobs (the partial index ``jobs_dead`` by id).
_DEAD = {
    newest: f"SELECT {SUMMARY_COLUMNS} FROM jobs INDEXED BY jobs_dead "
    f"WHERE state = 'dead' AND {bound} ORDER BY id {order} LIMIT ?"
    for newest, (bound, order) in _BOUND.items()
}
# The edge of a read by id: the key ROWS_EXAMINED_MAX jobs on within a window of keys (the
# cursor's bound to the end, within an id range or not), past which a page examines
# nothing. None: fewer are left. (One range of the key: given several bounds of the same
# side, SQLite may seek by the loosest and filter by the others row by row.)
_EDGE = {
    newest: "SELECT id FROM jobs NOT INDEXED WHERE id BETWEEN ? AND ? "
    f"ORDER BY id {'DESC' if newest else ''} LIMIT 1 OFFSET ?"
    for newest in (False, True)
}
# The jobs of the states asked (of a queue, or of any) in a window of keys, or of a list of
# keys in it.
_SEARCH = {
    (by_keys, newest): f"SELECT {SUMMARY_COLUMNS} FROM jobs NOT INDEXED WHERE "
    + (f"id IN {_JSON_IDS} AND " if by_keys else "")
    + "id BETWEEN ? AND ? AND state IN (SELECT value FROM json_each(?)) "
    f"AND (? IS NULL OR queue = ?) ORDER BY id {'DESC' if newest else ''} LIMIT ?"
    for by_keys in (False, True)
    for newest in (False, True)
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
            if pairs is None:  # too many to merge: the jobs by id
                span, edge = self._window(window(None, bound, newest), newest)
                filters = (_json_ids(list(states)), queue, queue, limit + 1)
                runs = [self._db.execute(_SEARCH[False, newest], (*span, *filters))]
            else:
                runs = [
                    self._db.execute(_RUN[newest], (q, state, bound, limit + 1))
                    for q, state in pairs
                ]
        rows, after = window_page(runs, edge, limit, newest)
        return list_page(summaries(rows), after)

    def _window(self, span: tuple[int, int], newest: bool) -> tuple[tuple[int, int], int | None]:
        """``span``, the keys (lowest, highest) a read by id may take, cut at its edge:
        the key ROWS_EXAMINED_MAX jobs into it in the order asked (None: it holds fewer)."""
        offset = browse_rows.ROWS_EXAMINED_MAX - 1
        row = self._db.execute(_EDGE[newest], (*span, offset)).fetchone()
        if row is None:
            return span, None
        edge = row[0]
        return ((edge, span[1]) if newest else (span[0], edge)), edge

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
        low, high = window(None, bound, newest)  # (the keys' jobs: any id from the cursor)
        filters = (_json_ids(list(states)), queue, queue, limit + 1)
        runs, edge = [], None
        if keys:
            span, edge = self._window(window(keys, bound, newest), newest)
            runs.append(self._db.execute(_SEARCH[False, newest], (*span, *filters)))
            if edge is not None:  # (none beyond the range's edge: the next page has them)
                low, high = (edge, high) if newest else (low, edge)
        if queue is not None:
            found: set[int] = set()
            for sql in _KEYS.values():
                rows = self._db.execute(sql, (queue, search, search + "\U0010ffff")).fetchall()
                found.update(key_matches(search, rows))
            if keys:  # (those of the id range are listed by it already)
                found = {key for key in found if key not in keys}
            if found:
                sql = _SEARCH[True, newest]
                runs.append(self._db.execute(sql, (_json_ids(found), low, high, *filters)))
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
