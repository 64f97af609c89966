"""What every part of the SQLite store shares: statements of many rows, reads as one row of
JSON, the claim's candidates statement, and ``SqliteBase``, the state and the few helper
transitions that the parts (jobs.py, leases.py, maintenance.py, dead.py, reads.py) are
written against.
"""

from __future__ import annotations

import functools
import random
import sqlite3
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

import orjson

from relay.protocol.model import JobIdGenerator, Priority
from relay.store.base import ATTEMPTS_KEPT, LEASED, READY, Changes, StoreConfig
from relay.store.counts import CountsBook

_PRIORITIES_HIGH_FIRST = tuple(sorted((int(p) for p in Priority), reverse=True))

# "id IN" this, bound to a JSON array of ids: any number of ids with one parameter.
_JSON_IDS = "(SELECT value FROM json_each(?))"
# Ended attempts (the reaper's: no traceback), many rows a statement.
_INSERT_ERRORS = (
    "INSERT INTO job_errors (job_id, attempt, error, at, started_at, worker, outcome) "
    "VALUES {values}"
)
# A failed attempt's entry: one statement, with or without its traceback.
_INSERT_ERROR = (
    "INSERT INTO job_errors (job_id, attempt, error, at, traceback, started_at, worker, "
    "outcome) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
# The attempts of leased jobs ended otherwise (release, cancel, recovery at start), from
# their rows as they are: ?1 the ids, ?2 the error ('' for an outcome that is none), ?3
# now, ?4 the outcome; then their count of ended attempts, for ``_trim_history``.
_END_LEASES = (
    "INSERT INTO job_errors (job_id, attempt, error, at, started_at, worker, outcome) "
    "SELECT id, attempt, ?2, ?3, leased_at, lease_worker, ?4 FROM jobs "
    "WHERE id IN (SELECT value FROM json_each(?1))"
)
_COUNT_ENDED = (
    f"UPDATE jobs SET attempts_ended = attempts_ended + 1 WHERE id IN {_JSON_IDS} "
    "RETURNING id, attempts_ended"
)
# A job's rows past the ATTEMPTS_KEPT most recent: a seek of job_errors_job (job_id, then
# rowid) that reads at most ATTEMPTS_KEPT + 1 entries.
_TRIM_HISTORY = (
    "DELETE FROM job_errors WHERE job_id = ?1 AND rowid <= (SELECT rowid FROM job_errors "
    f"WHERE job_id = ?1 ORDER BY rowid DESC LIMIT 1 OFFSET {ATTEMPTS_KEPT})"
)


# Few steps, not one per row. Python's sqlite3 releases the GIL around every sqlite3_step,
# and the writer thread must then take it back from the trio thread: on a busy two-core
# machine that wait is tens of microseconds each time (an executemany of 4 rows took about
# 45 µs a row inside the server, against 7 µs alone). So the paths that touch many rows do
# it in a handful of steps however many rows there are: writes are one multi-row statement
# per chunk of rows, and reads of many rows come back as one row of JSON.
ROWS_PER_STATEMENT = 256  # a power of two: chunks are powers of two (few distinct SQL texts)
# Up to this many rows are one statement whatever their number (so at most this many
# distinct texts per kind of statement; the connection caches 512, see schema.py). A
# submit_batch of 100 plain jobs is then one statement that commits on its own.
ONE_STATEMENT_ROWS = 128
# A batch of plain submits is one statement outside a transaction (``jobs_submit(alone=
# True)``) up to this many jobs and payload characters: about one frame's worth, so that
# its one statement's text stays small (the transaction path takes anything larger).
ALONE_ROWS = 1000
ALONE_PAYLOAD_CHARS = 1024 * 1024


def _chunks(rows: Sequence[tuple]) -> Iterator[Sequence[tuple]]:
    """``rows`` in one chunk if there are at most ONE_STATEMENT_ROWS, else in chunks of a
    power-of-two length, largest first, at most ROWS_PER_STATEMENT each: 100 rows are
    64 + 32 + 4. So few distinct statements are prepared, and a small batch is one."""
    if len(rows) <= ONE_STATEMENT_ROWS:
        if rows:
            yield rows
        return
    start = 0
    while start < len(rows):
        n = min(ROWS_PER_STATEMENT, 1 << ((len(rows) - start).bit_length() - 1))
        yield rows[start : start + n]
        start += n


@functools.lru_cache(maxsize=1024)  # a text per (statement, row count): a few hundred
def _values_sql(template: str, row: str, n: int) -> str:
    return template.format(values=", ".join([row] * n))


def _execute_rows(
    db: sqlite3.Connection, template: str, row: str, rows: Sequence[tuple], head: tuple = ()
) -> None:
    """Run ``template`` with ``{values}`` replaced by ``row`` once per row, a chunk of rows
    per statement; each statement binds ``head``, then the chunk's values in order."""
    for chunk in _chunks(rows):
        params = list(head)
        for values in chunk:
            params += values
        db.execute(_values_sql(template, row, len(chunk)), params)


def _json_ids(keys: Iterable[int]) -> str:
    """Job ids as the text of a JSON array, the parameter of ``_JSON_IDS``."""
    return orjson.dumps(list(keys)).decode()


def _json_select(columns: str, rest: str) -> str:
    """``SELECT {columns} {rest}`` as one row of JSON, for ``_json_rows``."""
    return f"SELECT json_group_array(json_array({columns})) FROM (SELECT {columns} {rest})"


def _json_rows(db: sqlite3.Connection, sql: str, params: Sequence[object] = ()) -> list[list]:
    """The rows of ``sql``, a ``SELECT json_group_array(json_array(...))``: one step."""
    return orjson.loads(db.execute(sql, params).fetchone()[0])


@functools.lru_cache(maxsize=64)
def _claim_candidates_sql(queue_count: int, inline: bool) -> str:
    # One sub-select per (queue, priority class), each a seek on jobs_ready returning that
    # class's oldest ready jobs, so the cost is independent of the backlog.
    # The payload's size in bytes (for the reply bound) costs a row lookup per candidate;
    # with ``inline``, a payload of at most INLINE_PAYLOAD_BYTES comes too, so that the
    # leased jobs need no read after the update.
    payload = f"CASE WHEN size <= {INLINE_PAYLOAD_BYTES} THEN payload END" if inline else "NULL"
    part = (
        "SELECT * FROM (SELECT id, priority, ready_at, length(CAST(payload AS BLOB)) AS size, "
        "queue, attempt, max_attempts, payload, timeout_ms, scheduled_for FROM jobs "
        "INDEXED BY jobs_ready "
        "WHERE state = 'ready' AND queue = ? AND priority = ? ORDER BY ready_at, id LIMIT ?)"
    )
    parts = " UNION ALL ".join([part] * (queue_count * len(_PRIORITIES_HIGH_FIRST)))
    return (
        "SELECT json_group_array(json_array(id, priority, ready_at, size, queue, attempt, "
        f"max_attempts, {payload}, timeout_ms, scheduled_for)) FROM ({parts})"
    )


# Small payloads come with the claim's candidates (above), while a claim's candidates are
# at most INLINE_CANDIDATES: their JSON row then stays under ~1.5 MiB (payload bytes
# escaped at most 6 times), and a lease of a few jobs takes two statements, not three.
INLINE_PAYLOAD_BYTES = 512
INLINE_CANDIDATES = 256


# The leases this store granted and has not seen end, at most this many (~150 bytes each):
# beyond it, acks of the leases not kept read their rows instead (see ``_held``).
HELD_MAX = 100_000


class SqliteBase(CountsBook):
    """What the parts of ``SqliteStore`` share (relay/store/sqlite/store.py sets it up):
    its state, the counts of jobs per state in memory, and a few helper transitions.

    Not thread-safe: exactly one thread (the writer) may call a store.
    """

    _db: sqlite3.Connection  # the store's one connection, which it owns
    config: StoreConfig
    _rng: random.Random  # backoff jitter
    _ids: JobIdGenerator  # job ids, above every id ever committed
    changes: Changes  # what the calls since the last commit changed
    recording: bool  # whether transitions append to ``changes.events``
    # (queue, state) -> jobs, every one in memory: loaded at open, moved by each transition
    # (``_move``), undone with the journal (``CountsBook``), so never a scan of the table.
    _counts: Counter[tuple[str, str]]
    # job id, as the lease gave it -> (key, token, worker, expires_at, queue, attempt,
    # leased_at) of each lease this store granted (jobs_claim_many) and has not seen end:
    # what an ack of it needs to know, without a read of its row or a parse of its id (an
    # id written otherwise, in capitals say, is not found here and takes the read). A
    # cache: every ack is still conditioned on the row's lease, and one that changes fewer
    # rows than expected reads them (jobs_ack_many). A rolled-back claim leaves leases
    # nobody holds (their tokens were never sent); a rolled-back ack, fail or release
    # forgets a lease still held (its ack then reads its row).
    _held: dict[str, tuple[int, str, str, int, str, int, int]]
    # The queues with a concurrency or rate limit, as committed (settings.py).
    _limited: frozenset[str] = frozenset()

    def _move(self, queue: str, src: str | None, dst: str | None, n: int = 1) -> None:
        if src is not None:
            self._bump(self._counts, (queue, src), -n)
            # A limited queue's lease ended: a parked lease may take its place.
            if (
                src == LEASED
                and self._limited
                and queue in self._limited
                and dst != READY
                and self._counts.get((queue, READY), 0) > 0
            ):
                self.changes.made_ready(queue, n)
        if dst == READY:
            self.changes.made_ready(queue, n)
        if dst is not None:
            self._bump(self._counts, (queue, dst), n)

    def _end_leases(self, keys: Sequence[int], outcome: str, error: str, now: int) -> None:
        """Record the attempts of these leased jobs as ended now with ``outcome`` (before
        their rows change), and keep each job's history to its bound."""
        ids = _json_ids(keys)
        self._db.execute(_END_LEASES, (ids, error, now, outcome))
        ended = self._db.execute(_COUNT_ENDED, (ids,)).fetchall()
        self._trim_history([key for key, n in ended if n > ATTEMPTS_KEPT])

    def _trim_history(self, keys: Iterable[int]) -> None:
        """Delete these jobs' ended attempts past the ATTEMPTS_KEPT most recent: called
        only for jobs whose ``attempts_ended`` passed it, so most writes never run it."""
        for key in keys:
            self._db.execute(_TRIM_HISTORY, (key,))

    def _save_last_id(self) -> None:
        # The high-water mark of issued ids, written only where jobs are deleted: with it,
        # and max(id) of the jobs that remain, the generator starts above every id ever
        # committed, also after a restart with the clock set back. (A submit needs no
        # write of its own: its job is the max(id) until it is deleted.)
        self._db.execute(
            "INSERT OR REPLACE INTO meta (key, value) VALUES ('last_job_id', ?)",
            (str(self._ids.last_id),),
        )

    def _delete_jobs(self, rows: Iterable[tuple[int, str]], state: str) -> None:
        """Delete these jobs (id, queue), all in ``state``, with their errors and unique
        keys. Their idempotency keys stay until they expire (jobs_prune), naming the job
        and the state it was deleted in: a submit with one is still a duplicate."""
        rows = list(rows)
        if not rows:
            return
        self._save_last_id()
        keys = (_json_ids([row[0] for row in rows]),)
        self._db.execute(f"DELETE FROM job_errors WHERE job_id IN {_JSON_IDS}", keys)
        self._db.execute(
            f"UPDATE idempotency_keys SET final_state = ? WHERE job_id IN {_JSON_IDS}",
            (state, *keys),
        )
        self._db.execute(f"DELETE FROM unique_keys WHERE job_id IN {_JSON_IDS}", keys)
        self._db.execute(f"DELETE FROM jobs WHERE id IN {_JSON_IDS}", keys)
        for _key, queue in rows:
            self._move(queue, state, None)
