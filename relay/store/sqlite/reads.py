"""The reads, as SQLite: one job (``job_inspect``; by an abbreviated id,
``job_inspect_prefix``) and the dead letters a page at a time
(``dead_list``), with their error histories; how long each queue's oldest ready job has
waited (``oldest_ready_ms``); the shortest abbreviations of job ids
(``job_ids_abbreviate``).

``queue_stats`` reads no table: it comes from the counts kept in memory (``_counts``,
sql.py); nor does ``event_totals`` (``CountsBook``, relay/store/counts.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.protocol.errors import JobNotFound
from relay.protocol.model import (
    JobInfo,
    JobState,
    format_job_id,
    job_id_keys,
    parse_job_id,
)
from relay.store.base import ATTEMPTS_KEPT, READY
from relay.store.rows import (
    HISTORY_COLUMNS,
    JOB_COLUMNS,
    PREFIX_KEYS_READ,
    cursor_bound,
    job_info,
    only_key,
    page,
    short_id,
)
from relay.store.sqlite.sql import _PRIORITIES_HIGH_FIRST, SqliteBase

# The oldest ready_at of a queue: the least of each priority's first entry in jobs_ready.
_OLDEST_READY_SQL = (
    "SELECT min(oldest) FROM ("
    + " UNION ALL ".join(
        "SELECT min(ready_at) AS oldest FROM jobs INDEXED BY jobs_ready "
        f"WHERE state = 'ready' AND queue = ?1 AND priority = {p}"
        for p in _PRIORITIES_HIGH_FIRST
    )
    + ")"
)

# The first keys of an abbreviated id's range: a range seek of the rowid, whatever the
# number of jobs.
_PREFIX_KEYS_SQL = (
    f"SELECT id FROM jobs WHERE id BETWEEN ? AND ? ORDER BY id LIMIT {PREFIX_KEYS_READ}"
)

# An id's nearest key below and its keys from its own up (its own, if it is a job's, and
# the nearest above): two seeks of the rowid, whatever the number of jobs (rows.short_id).
_NEIGHBOURS_SQL = (
    "SELECT id FROM (SELECT id FROM jobs WHERE id < ?1 ORDER BY id DESC LIMIT 1) "
    "UNION ALL SELECT id FROM (SELECT id FROM jobs WHERE id >= ?1 ORDER BY id LIMIT 2)"
)

# A page of the dead list, by (of one queue, newest first): one seek of a partial index
# (jobs_dead, or jobs_dead_queue: queue then id), read forward or backward from the
# cursor's bound (rows.cursor_bound), never a sort.
_DEAD_PAGES = {
    (False, False): (
        f"SELECT {JOB_COLUMNS} FROM jobs INDEXED BY jobs_dead "
        "WHERE state = 'dead' AND id > ? ORDER BY id LIMIT ?"
    ),
    (False, True): (
        f"SELECT {JOB_COLUMNS} FROM jobs INDEXED BY jobs_dead "
        "WHERE state = 'dead' AND id <= ? ORDER BY id DESC LIMIT ?"
    ),
    (True, False): (
        f"SELECT {JOB_COLUMNS} FROM jobs INDEXED BY jobs_dead_queue "
        "WHERE state = 'dead' AND queue = ? AND id > ? ORDER BY id LIMIT ?"
    ),
    (True, True): (
        f"SELECT {JOB_COLUMNS} FROM jobs INDEXED BY jobs_dead_queue "
        "WHERE state = 'dead' AND queue = ? AND id <= ? ORDER BY id DESC LIMIT ?"
    ),
}


# The leases held by some workers ({marks}: one parameter each, so that any text, a NUL
# too, is compared as given): the jobs_leased partial index holds only leased jobs, so
# this reads as many rows as jobs are leased.
_LEASES_HELD_SQL = (
    "SELECT id, queue, lease_worker, lease_expires_at, leased_at FROM jobs "
    "INDEXED BY jobs_leased WHERE state = 'leased' AND lease_expires_at > ? "
    "AND lease_worker IN ({marks}) ORDER BY id LIMIT ?"
)


class SqliteReads(SqliteBase):
    """Inspect and the dead list: part of ``SqliteStore``."""

    def job_inspect(self, job_id: str) -> JobInfo:
        """One job, with its attempts and errors (``Store.job_inspect``)."""
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._db.execute(
                f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?", (key,)
            ).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        return self._job_infos([row])[0]

    def job_inspect_prefix(self, prefix: str) -> JobInfo:
        """The one job whose id begins with ``prefix`` ("job_" and 7 to 16 hex digits)."""
        keys = job_id_keys(prefix)
        found = []
        if keys:
            found = self._db.execute(_PREFIX_KEYS_SQL, (keys.start, keys[-1])).fetchall()
        return self.job_inspect(format_job_id(only_key(prefix, found)))

    def job_ids_abbreviate(self, job_ids: Sequence[str]) -> list[str]:
        """Each id's shortest start that no other job's id has (``rows.short_id``)."""
        shown = []
        for job_id in job_ids:
            key = parse_job_id(job_id)
            keys = []
            if key is not None:
                keys = [k for (k,) in self._db.execute(_NEIGHBOURS_SQL, (key,))]
            shown.append(short_id(job_id, keys))
        return shown

    def queue_stats(self) -> dict[str, dict[str, int]]:
        """Jobs per queue and state (every state present, zeros included).

        Kept in memory and updated by every transition, so this never scans the table.
        """
        stats: dict[str, dict[str, int]] = {}
        for (queue, state), n in self._counts.items():
            if n:
                stats.setdefault(queue, dict.fromkeys(JobState, 0))[JobState(state)] = n
        return {
            queue: {str(s): n for s, n in by_state.items()} for queue, by_state in stats.items()
        }

    def oldest_ready_ms(self, now: int, queues: Sequence[str] | None = None) -> dict[str, int]:
        """Per queue with ready jobs (of ``queues``, or of all): how long its oldest ready
        job has waited (ms).

        One index seek per queue and priority (the ``jobs_ready`` index is ordered by
        ready_at within each), never a scan of the ready jobs."""
        if queues is None:
            queues = [queue for (queue, state), n in self._counts.items() if n and state == READY]
        ages = {}
        for queue in queues:
            if self._counts.get((queue, READY)):
                oldest = self._db.execute(_OLDEST_READY_SQL, (queue,)).fetchone()[0]
                if oldest is not None:
                    ages[queue] = max(0, now - oldest)
        return ages

    def leases_held(
        self, worker_ids: Sequence[str], now: int, limit: int
    ) -> list[tuple[str, str, str, int, int | None]]:
        """The unexpired leases of ``worker_ids`` (at most ``limit``, by job id): the
        leased jobs' partial index, filtered by worker, never the table."""
        if not worker_ids or limit <= 0:
            return []
        sql = _LEASES_HELD_SQL.format(marks=", ".join("?" * len(worker_ids)))
        rows = self._db.execute(sql, (now, *worker_ids, limit))
        return [(format_job_id(key), *rest) for key, *rest in rows]

    def _job_infos(self, rows: list[tuple]) -> list[JobInfo]:
        history: dict[int, list[tuple]] = {row[0]: [] for row in rows}
        if rows:
            marks = ", ".join("?" * len(rows))
            # The most recent ATTEMPTS_KEPT ended attempts of each job, oldest first (a
            # job keeps no more: base.ATTEMPTS_KEPT; the window bounds the read anyway).
            for key, *entry in self._db.execute(
                f"SELECT job_id, {HISTORY_COLUMNS} FROM (SELECT rowid AS seq, *, "
                "row_number() OVER (PARTITION BY job_id ORDER BY rowid DESC) AS back "
                f"FROM job_errors WHERE job_id IN ({marks})) WHERE back <= ? ORDER BY seq",
                [*history, ATTEMPTS_KEPT],
            ):
                history[key].append(entry)
        return [job_info(row, history[row[0]]) for row in rows]

    def dead_list(
        self,
        queue: str | None,
        limit: int,
        cursor: str | None,
        max_bytes: int | None = None,
        newest: bool = False,
    ) -> tuple[list[JobInfo], str | None]:
        """Dead jobs by job id, oldest first (``newest``: newest first), ``limit`` at a
        time; pass ``next_cursor`` for the next page.

        With ``max_bytes``, a page also ends once its jobs' texts reach it (always at
        least one job); ``next_cursor`` then continues after the last job given.
        """
        bound = cursor_bound(cursor, newest)
        params = (bound, limit + 1) if queue is None else (queue, bound, limit + 1)
        rows = self._db.execute(_DEAD_PAGES[queue is not None, newest], params).fetchall()
        return page(self._job_infos(rows[:limit]), len(rows) > limit, max_bytes)
