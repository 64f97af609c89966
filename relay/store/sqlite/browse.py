"""The job browser, as SQLite: a page of any states' jobs (``jobs_list``), and a promote
of one waiting job (``job_promote``).

A page is one seek of ``jobs_queue_state`` (queue, state, id) per (queue, state) asked
that holds jobs (the counts in memory say which), each read lazily and merged by id: the
page costs those seeks and its own rows, at any number of jobs.
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.protocol.errors import InvalidState, JobNotFound
from relay.protocol.model import JobInfo, JobState, parse_job_id
from relay.store.base import PROMOTABLE, READY
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
from relay.store.sqlite.sql import _JSON_IDS, SqliteBase, _json_ids

# One (queue, state)'s jobs beyond the cursor's bound, oldest or newest first.
_RUN = {
    False: f"SELECT {SUMMARY_COLUMNS} FROM jobs INDEXED BY jobs_queue_state "
    "WHERE queue = ? AND state = ? AND id > ? ORDER BY id LIMIT ?",
    True: f"SELECT {SUMMARY_COLUMNS} FROM jobs INDEXED BY jobs_queue_state "
    "WHERE queue = ? AND state = ? AND id <= ? ORDER BY id DESC LIMIT ?",
}
# A search's jobs: those of an id range (a range of the key) or of a list of keys, of the
# states asked, beyond the cursor's bound.
_FILTER = (
    "AND state IN (SELECT value FROM json_each(?)) AND (? IS NULL OR queue = ?) "
    "AND {bound} ORDER BY id {order} LIMIT ?"
)
_SEARCH = {
    (by_range, newest): f"SELECT {SUMMARY_COLUMNS} FROM jobs WHERE "
    + ("id BETWEEN ? AND ? " if by_range else f"id IN {_JSON_IDS} ")
    + _FILTER.format(bound="id <= ?" if newest else "id > ?", order="DESC" if newest else "")
    for by_range in (False, True)
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
        if search is not None:
            runs = self._search_runs(queue, states, search, bound, limit, newest)
        else:
            queues = [queue] if queue is not None else sorted({q for q, _ in self._counts})
            runs = [
                self._db.execute(_RUN[newest], (q, state, bound, limit + 1))
                for q in queues
                for state in states
                if self._counts.get((q, state))
            ]
        rows, more = merged(runs, limit, newest)
        return list_page(summaries(rows), more)

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
        filters = (_json_ids(list(states)), queue, queue, bound, limit + 1)
        runs = []
        if keys:
            runs.append(self._db.execute(_SEARCH[True, newest], (keys.start, keys[-1], *filters)))
        if queue is not None:
            found: set[int] = set()
            for sql in _KEYS.values():
                rows = self._db.execute(sql, (queue, search, search + "\U0010ffff")).fetchall()
                found.update(key_matches(search, rows))
            if keys:  # (those of the id range are listed by it already)
                found = {key for key in found if key not in keys}
            if found:
                runs.append(self._db.execute(_SEARCH[False, newest], (_json_ids(found), *filters)))
        return runs

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
