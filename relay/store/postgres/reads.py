"""Reads on PostgreSQL: a job, the dead letters, the counts, and the shortest
abbreviations of job ids.

None of these locks or writes anything. ``queue_stats`` sums every server's counts (see
``PostgresStore._flush_counts_and_commit``), so it answers for the whole database, not for
what this server committed; ``event_totals`` stays this process's own, in memory as with
SQLite (``CountsBook``, relay/store/counts.py; Prometheus sums counters over the servers).
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
from relay.store.base import ATTEMPTS_KEPT
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.sql import decode_text, encode_text
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

LEASED = JobState.LEASED

_JOB = f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = %s"
# The first keys of an abbreviated id's range: a range scan of jobs_pkey.
_PREFIX_KEYS = (
    f"SELECT id FROM jobs WHERE id BETWEEN %s AND %s ORDER BY id LIMIT {PREFIX_KEYS_READ}"
)
# Each id's nearest key below and its keys from its own up (its own, if it is a job's, and
# the nearest above), in the order given: two seeks of jobs_pkey per id, all the ids in
# one round trip (rows.short_id).
_NEIGHBOURS = (
    "SELECT ARRAY(SELECT id FROM jobs WHERE id < k ORDER BY id DESC LIMIT 1) "
    "|| ARRAY(SELECT id FROM jobs WHERE id >= k ORDER BY id LIMIT 2) "
    "FROM unnest(%s::bigint[]) WITH ORDINALITY AS given(k, n) ORDER BY n"
)
# The most recent ATTEMPTS_KEPT ended attempts of each job, oldest first (a job keeps no
# more: base.ATTEMPTS_KEPT; the window bounds the read anyway).
_HISTORY = (
    f"SELECT job_id, {HISTORY_COLUMNS} FROM (SELECT job_id, {HISTORY_COLUMNS}, "
    "seq, row_number() OVER (PARTITION BY job_id ORDER BY seq DESC) AS back "
    "FROM job_errors WHERE job_id = ANY(%s)) AS e WHERE back <= %s ORDER BY seq"
)
# The leases held by some workers: the jobs_leased partial index holds only leased jobs.
_LEASES_HELD = (
    "SELECT id, queue, lease_worker, lease_expires_at, leased_at FROM jobs "
    "WHERE state = 'leased' "
    "AND lease_expires_at > %s AND lease_worker = ANY(%s::text[]) ORDER BY id LIMIT %s"
)
# Per queue, the least of each priority's first ready_at in jobs_ready.
_OLDEST_READY = (
    "SELECT q, (SELECT min(first) FROM (SELECT (SELECT ready_at FROM jobs WHERE "
    "state = 'ready' AND queue = q AND priority = p ORDER BY ready_at LIMIT 1) AS first "
    "FROM unnest(ARRAY[3, 2, 1, 0]) AS p) AS firsts) FROM unnest(%s::text[]) AS q"
)
# A page of the dead list, by (of one queue, newest first): an index scan of jobs_dead
# (or jobs_dead_queue: queue then id), forward or backward from the cursor's bound
# (rows.cursor_bound), never a sort.
_DEAD = f"SELECT {JOB_COLUMNS} FROM jobs WHERE state = 'dead' AND id > %s ORDER BY id LIMIT %s"
_DEAD_NEWEST = (
    f"SELECT {JOB_COLUMNS} FROM jobs WHERE state = 'dead' AND id <= %s ORDER BY id DESC LIMIT %s"
)
_DEAD_OF_QUEUE = (
    f"SELECT {JOB_COLUMNS} FROM jobs WHERE state = 'dead' AND queue = %s AND id > %s "
    "ORDER BY id LIMIT %s"
)
_DEAD_OF_QUEUE_NEWEST = (
    f"SELECT {JOB_COLUMNS} FROM jobs WHERE state = 'dead' AND queue = %s AND id <= %s "
    "ORDER BY id DESC LIMIT %s"
)
_DEAD_PAGES = {
    (False, False): _DEAD,
    (False, True): _DEAD_NEWEST,
    (True, False): _DEAD_OF_QUEUE,
    (True, True): _DEAD_OF_QUEUE_NEWEST,
}


class Reads(PostgresBase):
    """The reads of ``PostgresStore``."""

    def job_inspect(self, job_id: str) -> JobInfo:
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._read(_JOB, (key,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        return self._job_infos([row])[0]

    def job_inspect_prefix(self, prefix: str) -> JobInfo:
        keys = job_id_keys(prefix)
        found = []
        if keys:
            found = self._read(_PREFIX_KEYS, (keys.start, keys[-1])).fetchall()
        return self.job_inspect(format_job_id(only_key(prefix, found)))

    def job_ids_abbreviate(self, job_ids: Sequence[str]) -> list[str]:
        keys = [parse_job_id(job_id) for job_id in job_ids]
        given = [key for key in keys if key is not None]
        found = iter(self._read(_NEIGHBOURS, (given,)).fetchall() if given else ())
        return [
            short_id(job_id, [] if key is None else next(found)[0])
            for job_id, key in zip(job_ids, keys, strict=True)
        ]

    def _job_infos(self, rows: list[tuple]) -> list[JobInfo]:
        history: dict[int, list[tuple]] = {row[0]: [] for row in rows}
        if rows:
            for key, *entry in self._read(_HISTORY, (list(history), ATTEMPTS_KEPT)):
                history[key].append(entry)
        return [job_info(row, history[row[0]], decode_text) for row in rows]

    def queue_stats(self) -> dict[str, dict[str, int]]:
        """Jobs per queue and state (every state present, zeros included), over every
        server: the sums of job_counts, a few rows per (queue, state)."""
        stats: dict[str, dict[str, int]] = {}
        for (queue, state), n in sorted(self._counts().items()):
            if n:
                stats.setdefault(queue, dict.fromkeys(map(str, JobState), 0))[state] = n
        return stats

    def oldest_ready_ms(self, now: int, queues: Sequence[str] | None = None) -> dict[str, int]:
        """Per queue with ready jobs (of ``queues``, or of all): how long its oldest ready
        job has waited (ms); one index probe (``jobs_ready``) per queue and priority,
        never a scan. A queue asked with no ready job costs its probes and is left out."""
        if queues is None:
            queues = sorted(
                {queue for (queue, state), n in self._counts().items() if n and state == "ready"}
            )
        else:
            queues = sorted(set(queues))
        if not queues:
            return {}
        rows = self._read(_OLDEST_READY, (queues,))
        return {queue: max(0, now - oldest) for queue, oldest in rows if oldest is not None}

    def leases_held(
        self, worker_ids: Sequence[str], now: int, limit: int
    ) -> list[tuple[str, str, str, int, int | None]]:
        """The unexpired leases of ``worker_ids`` (at most ``limit``, by job id), over
        every server: the leased jobs' partial index, filtered by worker."""
        if not worker_ids or limit <= 0:
            return []
        names = [encode_text(name) for name in worker_ids]  # (as leases store them)
        rows = self._read(_LEASES_HELD, (now, names, limit)).fetchall()
        return [
            (format_job_id(key), queue, decode_text(worker), expires_at, leased_at)
            for key, queue, worker, expires_at, leased_at in rows
        ]

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
        rows = self._read(_DEAD_PAGES[queue is not None, newest], params).fetchall()
        return page(self._job_infos(rows[:limit]), len(rows) > limit, max_bytes)
