"""Every job state transition as synchronous SQL. Never imports trio; never reads the clock.

``SqliteStore`` is the store interface (see docs/architecture.md): each method takes the
current time ``now`` (milliseconds) from its caller, so tests drive time explicitly and a
future PostgreSQL store can offer the same methods. Methods do not commit: the writer
thread (relay/store/thread.py) groups many of them into one transaction with ``begin`` and
``commit`` (and ``command``, a savepoint, when it must run them carefully). Called outside
``begin``, each statement commits on its own, which is what the synchronous unit tests do.

Every method that refuses (``RelayError``) does so before it writes anything, so a refused
command never leaves a partial change behind, even without a savepoint; the writer checks
this with ``write_mark``.
"""

from __future__ import annotations

import contextlib
import functools
import random
import secrets
import sqlite3
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

import attrs
import orjson

from relay.errors import InvalidState, JobNotFound, LeaseExpired, QueueFull, StaleToken
from relay.model import (
    DEFAULT_BACKOFF,
    ID_SEQ_BITS,
    Backoff,
    ErrorEntry,
    FailOutcome,
    JobIdGenerator,
    JobInfo,
    JobState,
    Lease,
    Priority,
    SubmitResult,
    SubmitSpec,
    effective_priority,
    format_job_id,
    parse_job_id,
    truncate_utf8,
)
from relay.store.schema import open_database

PENDING, READY, LEASED = JobState.PENDING, JobState.READY, JobState.LEASED
RETRYING, SUCCEEDED, DEAD = JobState.RETRYING, JobState.SUCCEEDED, JobState.DEAD
UNFINISHED = (PENDING, READY, LEASED, RETRYING)

LEASE_EXPIRED_ERROR = "lease expired"
RESTART_ERROR = "lease lost: the server restarted while the job was leased"

# Bytes of randomness per lease token: 128 bits, as the contract requires.
TOKEN_BYTES = 16

# Error history entries shown per job (inspect, dead_list): the most recent ones. With
# errors of at most 8 KiB, a job's history stays under 256 KiB in a reply.
ERRORS_SHOWN = 32
# What a job's fields other than its texts add to a reply, roughly: for byte budgets.
REPLY_OVERHEAD_BYTES = 256

# Events counted per queue for metrics (relay_jobs_<event>_total, relay_leases_expired_total).
EVENTS = ("submitted", "leased", "acked", "failed", "retried", "dead", "expired")

_PRIORITIES_HIGH_FIRST = tuple(sorted((int(p) for p in Priority), reverse=True))

_JOB_COLUMNS = (
    "id, queue, state, priority, payload, attempt, max_attempts, created_at, ready_at, run_at, "
    "lease_expires_at, lease_worker, last_error, result, idempotency_key, finished_at"
)


# The arguments of one claim: queues, worker id, count, lease ms, reply budget in bytes.
ClaimArgs = tuple[Sequence[str], str, int, int, int | None]


@attrs.frozen
class StoreConfig:
    """Policies of the store. Durations in milliseconds."""

    idempotency_window_ms: int = 24 * 3600 * 1000
    retention_ms: int = 7 * 24 * 3600 * 1000
    max_error_bytes: int = 8 * 1024
    # Unfinished jobs a queue may hold (pending + ready + leased + retrying) before a
    # submit is refused with QueueFull: per queue, else ``max_depth`` (None: unbounded).
    max_depth: int | None = None
    queue_depths: dict[str, int] = attrs.Factory(dict)

    def depth_limit(self, queue: str) -> int | None:
        return self.queue_depths.get(queue, self.max_depth)


@attrs.frozen
class Reaped:
    """One expired lease the reaper ended: the job is now ``state`` (ready or dead)."""

    job_id: str
    queue: str
    state: JobState
    attempt: int


# One state change of a job, recorded while ``SqliteStore.recording``: (job id, queue,
# state it entered, its attempt after the change, the ``now`` of the call that made it).
JobEvent = tuple[str, str, str, int, int]


@attrs.define
class Changes:
    """What committed changes mean for the trio side: whom to wake, and when.

    Collected while a transaction runs and taken by the writer after its commit. A command
    that is rolled back may leave a spurious entry in ``ready_queues`` and the times; a
    spurious wake-up is harmless. ``events`` is exact: a rolled-back command's are removed
    (``SqliteStore.command``), a rolled-back transaction's dropped with it.
    """

    ready_queues: set[str] = attrs.Factory(set)
    # The earliest due time of a job that became pending or retrying, and the earliest new
    # lease expiry: the promoter and the reaper sleep until these if they are sooner.
    next_due_at: int | None = None
    next_expiry_at: int | None = None
    # Every state change of a job, in the order made, while the store is ``recording``
    # (for ``watch``); else empty.
    events: list[JobEvent] = attrs.Factory(list)

    def due(self, at: int) -> None:
        if self.next_due_at is None or at < self.next_due_at:
            self.next_due_at = at

    def expiry(self, at: int) -> None:
        if self.next_expiry_at is None or at < self.next_expiry_at:
            self.next_expiry_at = at


# A named tuple made from a tuple at once, without its __new__'s argument handling.
_new_result = tuple.__new__

# "id IN" this, bound to a JSON array of ids: any number of ids with one parameter.
_JSON_IDS = "(SELECT value FROM json_each(?))"
_INSERT_JOBS = (
    "INSERT INTO jobs (id, queue, state, priority, payload, attempt, max_attempts, "
    "backoff_kind, backoff_base_ms, backoff_max_ms, backoff_jitter, created_at, ready_at, "
    "run_at, idempotency_key) VALUES {values}"
)
_INSERT_JOBS_ROW = "(?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
# A job ready at once with the default backoff and no key: seven values, not fourteen.
_INSERT_PLAIN_JOBS = (
    "INSERT INTO jobs (id, queue, state, priority, payload, attempt, max_attempts, "
    "backoff_kind, backoff_base_ms, backoff_max_ms, backoff_jitter, created_at, ready_at) "
    "VALUES {values}"
)
_INSERT_PLAIN_JSON = (
    "INSERT INTO jobs (id, queue, state, priority, payload, attempt, max_attempts, "
    "backoff_kind, backoff_base_ms, backoff_max_ms, backoff_jitter, created_at, ready_at) "
    "SELECT value ->> 0, value ->> 1, 'ready', value ->> 2, value ->> 3, 0, value ->> 4, "
    f"'{DEFAULT_BACKOFF.kind}', {DEFAULT_BACKOFF.base_ms}, {DEFAULT_BACKOFF.max_ms}, "
    f"{int(DEFAULT_BACKOFF.jitter)}, ?1, ?1 FROM json_each(?2)"
)
_INSERT_PLAIN_ROW = (
    f"(?, ?, 'ready', ?, ?, 0, ?, '{DEFAULT_BACKOFF.kind}', {DEFAULT_BACKOFF.base_ms}, "
    f"{DEFAULT_BACKOFF.max_ms}, {int(DEFAULT_BACKOFF.jitter)}, ?, ?)"
)
_INSERT_KEYS = (
    "INSERT OR REPLACE INTO idempotency_keys (queue, key, job_id, expires_at) VALUES {values}"
)

_LEASE_COLUMNS = (
    "id, queue, state, attempt, max_attempts, lease_token, lease_worker, "
    "lease_expires_at, backoff_kind, backoff_base_ms, backoff_max_ms, backoff_jitter"
)
_LEASE_ROWS_SQL = (
    f"SELECT json_group_array(json_array({_LEASE_COLUMNS})) FROM jobs WHERE id IN {_JSON_IDS}"
)
_ACK_UPDATE = (
    "UPDATE jobs SET state = 'succeeded', finished_at = ?, result = v.column2, "
    "lease_expires_at = NULL FROM (VALUES {values}) AS v WHERE jobs.id = v.column1"
)
_INSERT_ERRORS = "INSERT INTO job_errors (job_id, attempt, error, at) VALUES {values}"
_REAP_READY = (
    "UPDATE jobs SET state = 'ready', ready_at = v.column2, last_error = ? "
    "FROM (VALUES {values}) AS v WHERE jobs.id = v.column1"
)
_LEASE_ROW_SQL = f"SELECT {_LEASE_COLUMNS} FROM jobs WHERE "
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


def _plain(spec: SubmitSpec) -> bool:
    """Ready at once, with the default backoff and no key: one insert of seven values."""
    return (
        spec.idempotency_key is None
        and spec.run_at is None
        and not spec.delay_ms
        and spec.backoff is DEFAULT_BACKOFF
    )


def _check_lease(
    row: tuple | None, job_id: str, worker_id: str, token: str, now: int, operation: str
) -> tuple | None:
    """``row`` (from _LEASE_ROW_SQL) if the token and worker hold its unexpired lease;
    None for an ack repeated with the completing token; else the refusal, raised."""
    if row is None:
        raise JobNotFound(job_id)
    state, lease_token, lease_worker, expires_at = row[2], row[5], row[6], row[7]
    if lease_token is None or token != lease_token or worker_id != lease_worker:
        raise StaleToken(job_id)
    if state == LEASED:
        if now >= expires_at:
            raise LeaseExpired(job_id, expires_at)
        return row
    if state == SUCCEEDED and operation == "ack":
        return None
    # This token's lease has ended. An expiry leaves lease_expires_at set (reaper,
    # restart recovery): the token held the lease and it expired. The holder's own ack,
    # fail or release clears it: the token no longer holds the current lease.
    if expires_at is not None:
        raise LeaseExpired(job_id, expires_at)
    raise StaleToken(job_id)


def _info_size(info: JobInfo) -> int:
    """Roughly the bytes of ``info`` in a reply: payload and result go in as the JSON they
    are, error texts as JSON strings (escaping can make one 6 times its UTF-8 length)."""
    size = len(info.payload.encode()) + len((info.result or "").encode())
    errors = [info.last_error or "", *(entry.error for entry in info.errors)]
    return size + sum(len(orjson.dumps(text)) for text in errors) + REPLY_OVERHEAD_BYTES


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


_DUE_ROWS_SQL = _json_select(
    "id, queue, state",
    "FROM jobs WHERE state IN ('pending', 'retrying') AND run_at <= ? ORDER BY run_at LIMIT ?",
)
# The same rows with their attempts, for ``changes.events`` (only while recording).
_DUE_EVENT_ROWS_SQL = _json_select(
    "id, queue, state, attempt",
    "FROM jobs WHERE state IN ('pending', 'retrying') AND run_at <= ? ORDER BY run_at LIMIT ?",
)
_EXPIRED_ROWS_SQL = _json_select(
    "id, queue, attempt, max_attempts, lease_expires_at",
    "FROM jobs WHERE state = 'leased' AND lease_expires_at <= ? ORDER BY lease_expires_at LIMIT ?",
)
_SUCCEEDED_BEFORE_SQL = _json_select(
    "id, queue", "FROM jobs WHERE state = 'succeeded' AND finished_at < ? LIMIT ?"
)
_DEAD_OF_QUEUE_SQL = _json_select(
    "id, queue",
    "FROM jobs INDEXED BY jobs_dead_queue WHERE state = 'dead' AND queue = ? ORDER BY id LIMIT ?",
)


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
        "queue, attempt, max_attempts, payload FROM jobs INDEXED BY jobs_ready "
        "WHERE state = 'ready' AND queue = ? AND priority = ? ORDER BY ready_at, id LIMIT ?)"
    )
    parts = " UNION ALL ".join([part] * (queue_count * len(_PRIORITIES_HIGH_FIRST)))
    return (
        "SELECT json_group_array(json_array(id, priority, ready_at, size, queue, attempt, "
        f"max_attempts, {payload})) FROM ({parts})"
    )


# Small payloads come with the claim's candidates (above), while a claim's candidates are
# at most INLINE_CANDIDATES: their JSON row then stays under ~1.5 MiB (payload bytes
# escaped at most 6 times), and a lease of a few jobs takes two statements, not three.
INLINE_PAYLOAD_BYTES = 512
INLINE_CANDIDATES = 256


# One statement leases a chunk of jobs, each with its own token, worker and expiry.
_CLAIM_UPDATE = (
    "UPDATE jobs SET state = 'leased', attempt = attempt + 1, lease_token = v.column2, "
    "lease_worker = v.column3, lease_expires_at = v.column4 FROM (VALUES {values}) AS v "
    "WHERE jobs.id = v.column1"
)
_CLAIMED_PAYLOADS_SQL = (
    f"SELECT json_group_array(json_array(id, payload)) FROM jobs WHERE id IN {_JSON_IDS}"
)


class SqliteStore:
    """The job store on one SQLite connection, which it owns.

    Not thread-safe: exactly one thread (the writer) may call it.
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        config: StoreConfig | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._db = conn
        self.config = config or StoreConfig()
        # Jitter needs no cryptographic strength; tokens do, and use `secrets`.
        self._rng = rng or random.Random()
        last = conn.execute("SELECT value FROM meta WHERE key = 'last_job_id'").fetchone()
        top = conn.execute("SELECT max(id) FROM jobs").fetchone()[0]
        self._ids = JobIdGenerator(max(int(last[0]) if last else 0, top or 0))
        self._counts: Counter[tuple[str, str]] = Counter()  # (queue, state) -> jobs
        self._totals: Counter[tuple[str, str]] = Counter()  # (queue, event) -> since start
        self._load_counts()
        # While a transaction runs: every counter change, to undo them on rollback.
        self._journal: list[tuple[Counter[tuple[str, str]], tuple[str, str], int]] | None = None
        self.changes = Changes()
        # Whether transitions append to ``changes.events``. Off, they cost one check of
        # this flag per call and no statement more; the writer sets it per batch.
        self.recording = False

    @classmethod
    def open(
        cls,
        path: str,
        config: StoreConfig | None = None,
        *,
        synchronous: str = "full",
        rng: random.Random | None = None,
    ) -> SqliteStore:
        """Open or create the database at ``path`` (see ``schema.open_database``)."""
        return cls(open_database(path, synchronous=synchronous), config, rng=rng)

    def close(self) -> None:
        """Checkpoint the WAL into the main file and close the connection."""
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()

    # -- transactions (used by the writer) -------------------------------------------------

    def begin(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        self._journal = []

    @property
    def in_transaction(self) -> bool:
        """False if SQLite itself rolled the transaction back (disk full, I/O error):
        then nothing of it stands, and nothing more may run as if it did."""
        return self._db.in_transaction

    def write_mark(self) -> tuple[int, int]:
        """Where the transaction's writes stand (rows changed, counter moves): equal marks
        before and after a call mean that it wrote nothing."""
        # (total_changes counts a statement once it has finished; the store leaves no
        # statement unfinished, e.g. no RETURNING cursor, when a method returns or raises.)
        return self._db.total_changes, len(self._journal or ())

    @contextlib.contextmanager
    def command(self) -> Iterator[None]:
        """One command inside the transaction: on any exception its changes are undone."""
        assert self._journal is not None, "command() outside begin()"
        mark = len(self._journal)
        events = self.changes.events
        events_mark = len(events)
        self._db.execute("SAVEPOINT command")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK TO command")
            self._db.execute("RELEASE command")
            self._undo(mark)
            del events[events_mark:]  # no event of what did not happen
            raise
        self._db.execute("RELEASE command")

    def _save_last_id(self) -> None:
        # The high-water mark of issued ids, written only where jobs are deleted: with it,
        # and max(id) of the jobs that remain, the generator starts above every id ever
        # committed, also after a restart with the clock set back. (A submit needs no
        # write of its own: its job is the max(id) until it is deleted.)
        self._db.execute(
            "INSERT OR REPLACE INTO meta (key, value) VALUES ('last_job_id', ?)",
            (str(self._ids.last_id),),
        )

    def take_changes(self) -> Changes:
        """What changed since the last call (or commit), after a statement that committed
        on its own (``jobs_submit(alone=True)``)."""
        changes, self.changes = self.changes, Changes()
        return changes

    def commit(self) -> Changes:
        """Commit; return what changed and start collecting afresh."""
        self._db.execute("COMMIT")
        journal, self._journal = self._journal, None
        if journal:
            self._forget_empty(journal)
        changes, self.changes = self.changes, Changes()
        return changes

    def _forget_empty(self, journal: list[tuple[Counter, tuple[str, str], int]]) -> None:
        """Drop the counts that this transaction brought to zero, and the event totals of
        a queue left with no jobs at all: what is kept in memory then grows with the queues
        that have jobs, not with every queue name ever used."""
        emptied = set()
        for counter, key, _ in journal:
            if counter is self._counts and key in self._counts and not self._counts[key]:
                del self._counts[key]
                emptied.add(key[0])
        for queue in emptied:
            if not any(self._counts.get((queue, state)) for state in JobState):
                for state in JobState:
                    self._counts.pop((queue, state), None)
                for event in EVENTS:
                    self._totals.pop((queue, event), None)

    def rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("ROLLBACK")
        # Ids issued in the rolled-back transaction stay used in this process (the
        # generator never goes back); none was committed or answered, so none needs
        # remembering across a restart.
        if self._journal is not None:
            self._undo(0)
        self._journal = None
        self.changes = Changes()

    def _undo(self, mark: int) -> None:
        assert self._journal is not None
        for counter, key, n in reversed(self._journal[mark:]):
            counter[key] -= n
        del self._journal[mark:]

    def _bump(self, counter: Counter[tuple[str, str]], key: tuple[str, str], n: int) -> None:
        counter[key] += n
        if self._journal is not None:
            self._journal.append((counter, key, n))

    def _move(self, queue: str, src: str | None, dst: str | None, n: int = 1) -> None:
        if src is not None:
            self._bump(self._counts, (queue, src), -n)
        if dst is not None:
            self._bump(self._counts, (queue, dst), n)

    def _count(self, queue: str, event: str, n: int = 1) -> None:
        self._bump(self._totals, (queue, event), n)

    def _record(self, key: int, queue: str, state: str, attempt: int, now: int) -> None:
        """One job's state change, for ``changes.events`` (call only while recording)."""
        self.changes.events.append((f"job_{key:016x}", queue, state, attempt, now))

    def recount(self) -> None:
        """Count the jobs per queue and state again from the table (after a failure that
        may have left the counts short of what was committed outside a transaction)."""
        self._load_counts()

    def _load_counts(self) -> None:
        self._counts.clear()
        rows = self._db.execute("SELECT queue, state, count(*) FROM jobs GROUP BY queue, state")
        for queue, state, n in rows:
            self._counts[(queue, state)] = n

    # -- submit ----------------------------------------------------------------------------

    def jobs_submit(
        self, specs: Sequence[SubmitSpec], now: int, *, alone: bool = False
    ) -> list[SubmitResult] | None:
        """Create jobs, all or none. A key seen within the window returns the first job.

        A repeated (queue, idempotency key) within the window, also within ``specs``,
        creates nothing and answers the first job's id and current state.

        ``alone``: called outside a transaction, to create the jobs with one statement,
        which SQLite commits on its own as durably as a transaction; if these jobs need
        more than that (a key, a delay, a backoff of their own, many jobs), returns None
        having written nothing. (The writer's group commit of plain submits: BEGIN and
        COMMIT are two statements more, each a wait for the GIL.)
        """
        plain_only = all(map(_plain, specs))
        if alone and not (
            plain_only
            and len(specs) <= ALONE_ROWS
            and sum(len(spec.payload) for spec in specs) <= ALONE_PAYLOAD_CHARS
        ):
            return None
        if plain_only:
            return self._submit_plain(specs, now, alone)
        results: list[SubmitResult] = []
        plain: list[tuple] = []  # ready now, default backoff, no key: the common job
        rows: list[tuple] = []  # every other job
        keys: list[tuple] = []
        fresh_keys: dict[tuple[str, str], SubmitResult] = {}
        per_queue: dict[tuple[str, str], int] = {}  # (queue, state) -> new jobs
        key_expires_at = now + self.config.idempotency_window_ms
        # Ids as JobIdGenerator.next_id gives them, written out (one call per job showed
        # in the profile): the first is above the last and at least now's, then +1 each.
        floor = now << ID_SEQ_BITS
        last_id = self._ids.last_id
        ready_queues = self.changes.ready_queues
        for spec in specs:
            queue, _payload, _priority, delay_ms, run_at, _max, backoff, idempotency_key = spec
            if idempotency_key is not None:
                seen = fresh_keys.get((queue, idempotency_key))
                if seen is None:
                    seen = self._idempotent_hit(queue, idempotency_key, now)
                if seen is not None:
                    results.append(SubmitResult(seen.job_id, seen.state, duplicate=True))
                    continue
            key = last_id = floor if floor > last_id else last_id + 1
            due = run_at if run_at is not None else now + delay_ms
            if due > now:
                state, ready_at, run_at = PENDING, None, due
                self.changes.due(due)
            else:
                state, ready_at = READY, now
                ready_queues.add(queue)
            if (
                state is READY
                and run_at is None
                and idempotency_key is None
                and (backoff is DEFAULT_BACKOFF)
            ):  # (_plain, written out)
                plain.append((key, queue, spec.priority, spec.payload, spec.max_attempts, now, now))
            else:
                rows.append(
                    (
                        key, queue, state, int(spec.priority), spec.payload, spec.max_attempts,
                        backoff.kind, backoff.base_ms, backoff.max_ms, int(backoff.jitter),
                        now, ready_at, run_at, idempotency_key,
                    )
                )  # fmt: skip
            result = _new_result(SubmitResult, (f"job_{key:016x}", state, False))
            results.append(result)
            per_queue[queue, state] = per_queue.get((queue, state), 0) + 1
            if idempotency_key is not None:
                keys.append((queue, idempotency_key, key, key_expires_at))
                fresh_keys[(queue, idempotency_key)] = result
        self._ids.last_id = last_id
        self._check_depth(per_queue)
        _execute_rows(self._db, _INSERT_PLAIN_JOBS, _INSERT_PLAIN_ROW, plain)
        _execute_rows(self._db, _INSERT_JOBS, _INSERT_JOBS_ROW, rows)
        # An expired key for the same (queue, key) is replaced: its window has passed.
        _execute_rows(self._db, _INSERT_KEYS, "(?, ?, ?, ?)", keys)
        # Counted once written: a statement that fails outside a transaction (``alone``)
        # leaves nothing to undo.
        for (queue, state), n in per_queue.items():
            self._move(queue, None, state, n)
            self._count(queue, "submitted", n)
        if self.recording:  # (a duplicate created nothing: no event)
            self.changes.events += [
                (result[0], spec.queue, result[1].value, 0, now)
                for spec, result in zip(specs, results, strict=True)
                if not result[2]
            ]
        return results

    def _submit_plain(
        self, specs: Sequence[SubmitSpec], now: int, alone: bool
    ) -> list[SubmitResult]:
        """``jobs_submit`` of jobs that are all plain (``_plain``), in list comprehensions:
        the common batch, whose per-job work showed in the profile of submit_batch. The
        insert is its last step that can fail: what comes after only counts."""
        per_queue: dict[tuple[str, str], int] = {}
        for spec in specs:
            per_queue[spec.queue, READY] = per_queue.get((spec.queue, READY), 0) + 1
        self._check_depth(per_queue)
        # Consecutive ids, as JobIdGenerator.next_id would give them one by one.
        first = max(now << ID_SEQ_BITS, self._ids.last_id + 1)
        self._ids.last_id = first + len(specs) - 1
        if len(specs) <= ONE_STATEMENT_ROWS or not alone:
            rows = [
                (key, spec.queue, spec.priority, spec.payload, spec.max_attempts, now, now)
                for key, spec in enumerate(specs, first)
            ]
            _execute_rows(self._db, _INSERT_PLAIN_JOBS, _INSERT_PLAIN_ROW, rows)
        else:
            # Alone, with more rows than one VALUES statement takes: one json_each
            # statement, so that the batch is still one statement (a VALUES text per row
            # count would be prepared anew for each count, ~2 ms for 1,000 rows). Its JSON
            # is bounded by ALONE_ROWS and ALONE_PAYLOAD_CHARS.
            rows = [
                (key, spec.queue, int(spec.priority), spec.payload, spec.max_attempts)
                for key, spec in enumerate(specs, first)
            ]
            self._db.execute(_INSERT_PLAIN_JSON, (now, orjson.dumps(rows)))
        results = [_new_result(SubmitResult, (f"job_{row[0]:016x}", READY, False)) for row in rows]
        self.changes.ready_queues.update([queue for queue, _ in per_queue])
        for (queue, state), n in per_queue.items():
            self._move(queue, None, state, n)
            self._count(queue, "submitted", n)
        if self.recording:
            self.changes.events += [
                (result[0], spec.queue, "ready", 0, now)
                for spec, result in zip(specs, results, strict=True)
            ]
        return results

    def _check_depth(self, per_queue: dict[tuple[str, str], int]) -> None:
        if self.config.max_depth is None and not self.config.queue_depths:
            return
        new: Counter[str] = Counter()
        for (queue, _state), n in per_queue.items():
            new[queue] += n
        for queue, n in new.items():
            limit = self.config.depth_limit(queue)
            if limit is None:
                continue
            depth = sum(self._counts[(queue, state)] for state in UNFINISHED)
            if depth + n > limit:
                raise QueueFull(f"queue {queue} holds {depth} unfinished jobs (max {limit})")

    def _idempotent_hit(self, queue: str, key: str, now: int) -> SubmitResult | None:
        row = self._db.execute(
            "SELECT k.job_id, j.state FROM idempotency_keys k JOIN jobs j ON j.id = k.job_id "
            "WHERE k.queue = ? AND k.key = ? AND k.expires_at > ?",
            (queue, key, now),
        ).fetchone()
        if row is None:
            return None
        return SubmitResult(format_job_id(row[0]), JobState(row[1]), duplicate=True)

    # -- leases ----------------------------------------------------------------------------

    def jobs_claim(
        self,
        queues: Sequence[str],
        worker_id: str,
        count: int,
        lease_ms: int,
        now: int,
        max_bytes: int | None = None,
    ) -> list[Lease]:
        """Lease up to ``count`` ready jobs from ``queues``, best effective priority first.

        Each claim increments the attempt and issues a fresh random token. Within one
        effective priority, the job that became ready first goes first. With
        ``max_bytes``, claiming stops once the payloads reach it (always at least one
        job), so that one reply stays bounded whatever ``count`` asked for.
        """
        return self.jobs_claim_many([(queues, worker_id, count, lease_ms, max_bytes)], now)[0]

    def jobs_claim_many(self, claims: Sequence[ClaimArgs], now: int) -> list[list[Lease]]:
        """Many claims (each the arguments of ``jobs_claim``) with two statements in all, or
        three when some payloads are large (more than INLINE_PAYLOAD_BYTES) or the claims
        want many jobs (more than INLINE_CANDIDATES candidates).

        The outcome is that of making the claims one after the other: grouped by their set
        of queues, the groups in the order they first appear (among the claims that ask
        for at least one job), the claims of a group in the order given; each takes the
        best jobs the ones before it left.
        """
        chosen: list[list[int]] = [[] for _ in claims]  # the keys each claim leases
        found: dict[int, list] = {}  # key -> its candidate row
        taken: set[int] = set()
        taken_from: Counter[str] = Counter()  # queue -> jobs taken by earlier groups
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, (queues, _worker, count, _lease_ms, _max_bytes) in enumerate(claims):
            if count > 0 and queues:
                groups.setdefault(tuple(dict.fromkeys(queues)), []).append(i)
        for queues, members in groups.items():
            # Enough candidates for every member, even if earlier groups (claims on some of
            # these queues among others) took some of them.
            wanted = sum(claims[i][2] for i in members) + sum(taken_from[q] for q in queues)
            params: list[object] = []
            for queue in queues:
                for priority in _PRIORITIES_HIGH_FIRST:
                    params += (queue, priority, wanted)
            inline = wanted * len(params) // 3 <= INLINE_CANDIDATES
            candidates = _json_rows(self._db, _claim_candidates_sql(len(queues), inline), params)
            # Within one (queue, class) the oldest job also has the highest effective
            # priority, so the best of all candidates are the best jobs overall.
            if len(candidates) > 1:
                candidates.sort(key=lambda c: (-effective_priority(c[1], c[2], now), c[2], c[0]))
            available = (c for c in candidates if c[0] not in taken)
            for i in members:
                count, max_bytes = claims[i][2], claims[i][4]
                mine, size = chosen[i], 0
                for candidate in available:
                    key, length, queue = candidate[0], candidate[3], candidate[4]
                    mine.append(key)
                    found[key] = candidate
                    taken.add(key)
                    taken_from[queue] += 1
                    size += length + REPLY_OVERHEAD_BYTES
                    if len(mine) == count or (max_bytes is not None and size >= max_bytes):
                        break
        if not taken:
            return [[] for _ in claims]
        # One urandom call for all the tokens.
        hex_digits = secrets.token_hex(TOKEN_BYTES * len(taken))
        width = 2 * TOKEN_BYTES
        tokens = iter([hex_digits[i : i + width] for i in range(0, len(hex_digits), width)])
        # Per claim: (key, token, worker, expiry) of each job it leases.
        granted = [
            [(key, next(tokens), claim[1], now + claim[3]) for key in mine]
            for claim, mine in zip(claims, chosen, strict=True)
        ]
        updates = [update for mine in granted for update in mine]
        _execute_rows(self._db, _CLAIM_UPDATE, "(?, ?, ?, ?)", updates)
        missing = [key for key in taken if found[key][7] is None]
        if missing:  # payloads that did not come with the candidates
            for key, payload in _json_rows(self._db, _CLAIMED_PAYLOADS_SQL, (_json_ids(missing),)):
                found[key][7] = payload
        per_queue: dict[str, int] = {}
        results: list[list[Lease]] = []
        for claim, mine in zip(claims, granted, strict=True):
            leases = []
            for key, token, _worker, expires_at in mine:
                _, priority, _, _, queue, attempt, max_attempts, payload = found[key]
                leases.append(
                    Lease(
                        f"job_{key:016x}", queue, payload, priority, attempt + 1, max_attempts,
                        token, expires_at,
                    )
                )  # fmt: skip
                per_queue[queue] = per_queue.get(queue, 0) + 1
            if leases:
                self.changes.expiry(now + claim[3])  # one expiry for all of a claim's leases
            results.append(leases)
        for queue, n in per_queue.items():
            self._move(queue, READY, LEASED, n)
            self._count(queue, "leased", n)
        if self.recording:  # in the order of the update: claim by claim
            self.changes.events += [
                (lease.job_id, lease.queue, "leased", lease.attempt, now)
                for leases in results
                for lease in leases
            ]
        return results

    def _held_lease(
        self, job_id: str, worker_id: str, token: str, now: int, operation: str
    ) -> tuple | None:
        """The job row if ``token`` and ``worker_id`` hold its unexpired lease.

        Returns None for an ack repeated with the token that completed the job.

        Raises:
            JobNotFound, StaleToken, LeaseExpired: and changes nothing.
        """
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._db.execute(_LEASE_ROW_SQL + "id = ?", (key,)).fetchone()
        return _check_lease(row, job_id, worker_id, token, now, operation)

    def lease_renew(self, job_id: str, worker_id: str, token: str, lease_ms: int, now: int) -> int:
        """Extend a held lease to now + ``lease_ms``; return the new expiry."""
        row = self._held_lease(job_id, worker_id, token, now, "renew")
        assert row is not None
        expires_at = now + lease_ms
        self._db.execute("UPDATE jobs SET lease_expires_at = ? WHERE id = ?", (expires_at, row[0]))
        self.changes.expiry(expires_at)
        return expires_at

    def jobs_ack(
        self, job_id: str, worker_id: str, token: str, result: str | None, now: int
    ) -> None:
        """Complete a job. Repeating the ack with the completing token is answered ok."""
        row = self._held_lease(job_id, worker_id, token, now, "ack")
        if row is None:
            return
        self._db.execute(
            "UPDATE jobs SET state = 'succeeded', finished_at = ?, result = ?, "
            "lease_expires_at = NULL WHERE id = ?",
            (now, result, row[0]),
        )
        self._move(row[1], LEASED, SUCCEEDED)
        self._count(row[1], "acked")
        if self.recording:
            self._record(row[0], row[1], "succeeded", row[3], now)

    def jobs_ack_many(
        self, acks: Sequence[tuple[str, str, str, str | None]], now: int
    ) -> list[None]:
        """Ack many jobs (job_id, worker_id, token, result) with one read and one write.

        All or nothing: if any ack would be refused, or one job appears twice, raises
        (a ``RelayError`` or ValueError) having changed nothing; the caller then acks one
        by one to give each its own answer.
        """
        keys = [parse_job_id(job_id) for job_id, *_ in acks]
        if None in keys or len(set(keys)) != len(keys):
            raise ValueError("not a run of distinct job ids")
        found = _json_rows(self._db, _LEASE_ROWS_SQL, (_json_ids(keys),))
        rows = {row[0]: row for row in found}
        updates = []
        per_queue: dict[str, int] = {}
        for key, (job_id, worker_id, token, result) in zip(keys, acks, strict=True):
            row = _check_lease(rows.get(key), job_id, worker_id, token, now, "ack")
            if row is not None:  # None: an ack repeated with the completing token
                updates.append((key, result))
                per_queue[row[1]] = per_queue.get(row[1], 0) + 1
        _execute_rows(self._db, _ACK_UPDATE, "(?, ?)", updates, (now,))
        for queue, n in per_queue.items():
            self._move(queue, LEASED, SUCCEEDED, n)
            self._count(queue, "acked", n)
        if self.recording:
            for key, _result in updates:
                row = rows[key]
                self._record(key, row[1], "succeeded", row[3], now)
        return [None] * len(acks)

    def jobs_fail(
        self, job_id: str, worker_id: str, token: str, error: str, retryable: bool, now: int
    ) -> FailOutcome:
        """Record a failed attempt: retrying after its backoff, or dead when spent."""
        row = self._held_lease(job_id, worker_id, token, now, "fail")
        assert row is not None
        key, queue, _state, attempt, max_attempts = row[:5]
        error = truncate_utf8(error, self.config.max_error_bytes)
        self._record_error(key, attempt, error, now)
        self._count(queue, "failed")
        if retryable and attempt < max_attempts:
            backoff = Backoff(row[8], row[9], row[10], bool(row[11]))
            retry_at = now + backoff.delay_ms(attempt, self._rng)
            self._db.execute(
                "UPDATE jobs SET state = 'retrying', run_at = ?, last_error = ?, "
                "lease_expires_at = NULL WHERE id = ?",
                (retry_at, error, key),
            )
            self._move(queue, LEASED, RETRYING)
            self._count(queue, "retried")
            self.changes.due(retry_at)
            if self.recording:
                self._record(key, queue, "retrying", attempt, now)
            return FailOutcome(RETRYING, retry_at)
        self._db.execute(
            "UPDATE jobs SET state = 'dead', finished_at = ?, last_error = ?, "
            "lease_expires_at = NULL WHERE id = ?",
            (now, error, key),
        )
        self._move(queue, LEASED, DEAD)
        self._count(queue, "dead")
        if self.recording:
            self._record(key, queue, "dead", attempt, now)
        return FailOutcome(DEAD, None)

    def jobs_release(self, job_id: str, worker_id: str, token: str, now: int) -> None:
        """Give a leased job back at once; its attempt counter returns to the value it had
        before this lease, and it keeps its place (ready_at) in the queue."""
        row = self._held_lease(job_id, worker_id, token, now, "release")
        assert row is not None
        self._db.execute(
            "UPDATE jobs SET state = 'ready', attempt = attempt - 1, lease_expires_at = NULL "
            "WHERE id = ?",
            (row[0],),
        )
        self._move(row[1], LEASED, READY)
        self.changes.ready_queues.add(row[1])
        if self.recording:  # the attempt given back
            self._record(row[0], row[1], "ready", row[3] - 1, now)

    def _record_error(self, key: int, attempt: int, error: str, now: int) -> None:
        _execute_rows(self._db, _INSERT_ERRORS, "(?, ?, ?, ?)", [(key, attempt, error, now)])

    # -- time-driven transitions -------------------------------------------------------------

    def jobs_promote_due(self, now: int, limit: int) -> int:
        """Make up to ``limit`` due pending and retrying jobs ready; return how many.

        A promoted job counts as ready from its due time, not from when this pass ran.
        """
        recording = self.recording
        # Recording, the rows come with their attempts: the same statement, one column more.
        sql = _DUE_EVENT_ROWS_SQL if recording else _DUE_ROWS_SQL
        rows = _json_rows(self._db, sql, (now, limit))
        if rows:
            self._db.execute(
                f"UPDATE jobs SET state = 'ready', ready_at = run_at WHERE id IN {_JSON_IDS}",
                (_json_ids([row[0] for row in rows]),),
            )
        for row in rows:
            queue = row[1]
            self._move(queue, row[2], READY)
            self.changes.ready_queues.add(queue)
        if recording:
            for key, queue, _state, attempt in rows:
                self._record(key, queue, "ready", attempt, now)
        return len(rows)

    def leases_reap_expired(self, now: int, limit: int) -> list[Reaped]:
        """End up to ``limit`` leases that expired at or before ``now``.

        A job with attempts left becomes ready (from its expiry time); one without becomes
        dead with the error "lease expired". The old token keeps answering lease_expired.
        """
        rows = _json_rows(self._db, _EXPIRED_ROWS_SQL, (now, limit))
        reaped = []
        ready: list[tuple[int, int]] = []  # (id, expired at): ready again from its expiry
        dead: list[int] = []
        for key, queue, attempt, max_attempts, expired_at in rows:
            self._count(queue, "expired")
            if attempt < max_attempts:
                ready.append((key, expired_at))
                state = READY
                self.changes.ready_queues.add(queue)
            else:
                dead.append(key)
                state = DEAD
                self._count(queue, "dead")
            self._move(queue, LEASED, state)
            reaped.append(Reaped(format_job_id(key), queue, state, attempt))
        errors = [(key, attempt, LEASE_EXPIRED_ERROR, now) for key, _, attempt, *_ in rows]
        _execute_rows(self._db, _INSERT_ERRORS, "(?, ?, ?, ?)", errors)
        _execute_rows(self._db, _REAP_READY, "(?, ?)", ready, (LEASE_EXPIRED_ERROR,))
        if dead:
            self._db.execute(
                "UPDATE jobs SET state = 'dead', finished_at = ?, last_error = ? "
                f"WHERE id IN {_JSON_IDS}",
                (now, LEASE_EXPIRED_ERROR, _json_ids(dead)),
            )
        if self.recording:  # in the order of their expiry (one change per job)
            self.changes.events += [
                (r.job_id, r.queue, r.state.value, r.attempt, now) for r in reaped
            ]
        return reaped

    def leases_recover(self, now: int) -> int:
        """At start, before serving: every leased job becomes ready again, at once.

        The lease was lost with the previous process, not through the job, so the attempt
        is given back (as with release). The old token answers lease_expired from now on.
        Returns how many jobs were recovered.
        """
        rows = self._db.execute(
            "SELECT id, queue, attempt FROM jobs WHERE state = 'leased'"
        ).fetchall()
        for key, queue, attempt in rows:
            self._record_error(key, attempt, RESTART_ERROR, now)
            self._move(queue, LEASED, READY)
            self.changes.ready_queues.add(queue)
        self._db.execute(
            "UPDATE jobs SET state = 'ready', attempt = attempt - 1, lease_expires_at = ?, "
            "last_error = ? WHERE state = 'leased'",
            (now, RESTART_ERROR),
        )
        if self.recording:  # the attempt given back, as the update does
            for key, queue, attempt in rows:
                self._record(key, queue, "ready", attempt - 1, now)
        return len(rows)

    def next_due_at(self) -> int | None:
        """The earliest due time of a pending or retrying job."""
        return self._db.execute(
            "SELECT min(run_at) FROM jobs WHERE state IN ('pending', 'retrying')"
        ).fetchone()[0]

    def next_expiry_at(self) -> int | None:
        """The earliest expiry of a held lease."""
        return self._db.execute(
            "SELECT min(lease_expires_at) FROM jobs WHERE state = 'leased'"
        ).fetchone()[0]

    def jobs_prune(self, now: int, limit: int) -> int:
        """Delete up to ``limit`` succeeded jobs finished longer than the retention period
        ago, and up to ``limit`` expired idempotency keys. Returns jobs deleted."""
        self._db.execute(
            "DELETE FROM idempotency_keys WHERE rowid IN "
            "(SELECT rowid FROM idempotency_keys WHERE expires_at <= ? LIMIT ?)",
            (now, limit),
        )
        rows = _json_rows(self._db, _SUCCEEDED_BEFORE_SQL, (now - self.config.retention_ms, limit))
        self._delete_jobs(rows, SUCCEEDED)
        return len(rows)

    def _delete_jobs(self, rows: Iterable[tuple[int, str]], state: str) -> None:
        rows = list(rows)
        if not rows:
            return
        self._save_last_id()
        keys = (_json_ids([row[0] for row in rows]),)
        self._db.execute(f"DELETE FROM job_errors WHERE job_id IN {_JSON_IDS}", keys)
        self._db.execute(f"DELETE FROM idempotency_keys WHERE job_id IN {_JSON_IDS}", keys)
        self._db.execute(f"DELETE FROM jobs WHERE id IN {_JSON_IDS}", keys)
        for _key, queue in rows:
            self._move(queue, state, None)

    # -- reads -----------------------------------------------------------------------------

    def job_inspect(self, job_id: str) -> JobInfo:
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._db.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (key,)
            ).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        return self._job_infos([row])[0]

    def _job_infos(self, rows: list[tuple]) -> list[JobInfo]:
        errors: dict[int, list[ErrorEntry]] = {row[0]: [] for row in rows}
        if rows:
            marks = ", ".join("?" * len(rows))
            # The most recent ERRORS_SHOWN entries of each job, oldest first: the history
            # of a job with a thousand retries would not fit a reply.
            for key, attempt, error, at in self._db.execute(
                "SELECT job_id, attempt, error, at FROM (SELECT rowid AS seq, *, "
                "row_number() OVER (PARTITION BY job_id ORDER BY rowid DESC) AS back "
                f"FROM job_errors WHERE job_id IN ({marks})) WHERE back <= ? ORDER BY seq",
                [*errors, ERRORS_SHOWN],
            ):
                errors[key].append(ErrorEntry(attempt, error, at))
        infos = []
        for row in rows:
            state = JobState(row[2])
            leased = state == LEASED
            infos.append(
                JobInfo(
                    job_id=format_job_id(row[0]),
                    queue=row[1],
                    state=state,
                    priority=row[3],
                    payload=row[4],
                    attempt=row[5],
                    max_attempts=row[6],
                    created_at=row[7],
                    ready_at=row[8],
                    run_at=row[9],
                    lease_expires_at=row[10] if leased else None,
                    worker_id=row[11],
                    last_error=row[12],
                    errors=tuple(errors[row[0]]),
                    result=row[13],
                    idempotency_key=row[14],
                    finished_at=row[15],
                )
            )
        return infos

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

    def oldest_ready_ms(self, now: int) -> dict[str, int]:
        """Per queue with ready jobs: how long its oldest ready job has waited (ms).

        One index seek per queue and priority (the ``jobs_ready`` index is ordered by
        ready_at within each), never a scan of the ready jobs."""
        ages = {}
        for (queue, state), n in self._counts.items():
            if n and state == READY:
                oldest = self._db.execute(_OLDEST_READY_SQL, (queue,)).fetchone()[0]
                if oldest is not None:
                    ages[queue] = max(0, now - oldest)
        return ages

    def event_totals(self) -> dict[tuple[str, str], int]:
        """(queue, event) -> how many times it happened since this store was opened."""
        return {key: n for key, n in self._totals.items() if n}

    def dead_list(
        self, queue: str | None, limit: int, cursor: str | None, max_bytes: int | None = None
    ) -> tuple[list[JobInfo], str | None]:
        """Dead jobs oldest first, ``limit`` at a time; pass ``next_cursor`` for the next page.

        With ``max_bytes``, a page also ends once its jobs' texts reach it (always at
        least one job); ``next_cursor`` then continues after the last job given.
        """
        after = -1
        if cursor is not None:
            after = parse_job_id(cursor)
            if after is None:
                after = -1
        if queue is None:
            rows = self._db.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs INDEXED BY jobs_dead "
                "WHERE state = 'dead' AND id > ? ORDER BY id LIMIT ?",
                (after, limit + 1),
            ).fetchall()
        else:
            rows = self._db.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs INDEXED BY jobs_dead_queue "
                "WHERE state = 'dead' AND queue = ? AND id > ? ORDER BY id LIMIT ?",
                (queue, after, limit + 1),
            ).fetchall()
        more = len(rows) > limit
        infos = self._job_infos(rows[:limit])
        if max_bytes is not None:
            size = 0
            for i, info in enumerate(infos):
                size += _info_size(info)
                if size >= max_bytes and i + 1 < len(infos):
                    infos, more = infos[: i + 1], True
                    break
        return infos, (infos[-1].job_id if more else None)

    # -- dead letters ----------------------------------------------------------------------

    def _dead_job(self, job_id: str, operation: str) -> tuple[int, str]:
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._db.execute("SELECT queue, state FROM jobs WHERE id = ?", (key,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        if row[1] != DEAD:
            raise InvalidState(job_id, row[1], operation)
        assert key is not None
        return key, row[0]

    def dead_retry(self, job_id: str, now: int) -> int:
        """Make one dead job ready with fresh attempts. Its error history is kept."""
        key, queue = self._dead_job(job_id, "retry")
        self._revive([(key, queue)], now)
        return 1

    def dead_retry_queue(self, queue: str, now: int, limit: int) -> int:
        """Make up to ``limit`` dead jobs of ``queue`` ready; return how many. Call again
        while it returns ``limit``: each call is one bounded piece of work."""
        rows = _json_rows(self._db, _DEAD_OF_QUEUE_SQL, (queue, limit))
        self._revive(rows, now)
        return len(rows)

    def _revive(self, rows: list[tuple[int, str]], now: int) -> None:
        self._db.execute(
            "UPDATE jobs SET state = 'ready', attempt = 0, ready_at = ?, run_at = NULL, "
            "finished_at = NULL, lease_token = NULL, lease_worker = NULL, "
            f"lease_expires_at = NULL WHERE id IN {_JSON_IDS}",
            (now, _json_ids([key for key, _queue in rows])),
        )
        for _key, queue in rows:
            self._move(queue, DEAD, READY)
            self.changes.ready_queues.add(queue)
        if self.recording:  # with fresh attempts
            for key, queue in rows:
                self._record(key, queue, "ready", 0, now)

    def dead_purge(self, job_id: str) -> int:
        """Delete one dead job and its history."""
        key, queue = self._dead_job(job_id, "purge")
        self._delete_jobs([(key, queue)], DEAD)
        return 1

    def dead_purge_queue(self, queue: str, limit: int) -> int:
        """Delete up to ``limit`` dead jobs of ``queue``; return how many (see retry)."""
        rows = _json_rows(self._db, _DEAD_OF_QUEUE_SQL, (queue, limit))
        self._delete_jobs(rows, DEAD)
        return len(rows)
