"""A job as both dialects read it: the columns, the ``JobInfo`` a row of them makes, the
one job of an abbreviated id, an id's shortest abbreviation, and the pages of the dead
list."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence

import attrs

from relay.protocol.errors import BadRequest, JobNotFound
from relay.protocol.model import (
    ID_MAX,
    AttemptEntry,
    AttemptOutcome,
    ErrorEntry,
    JobInfo,
    JobState,
    format_job_id,
    job_id_abbreviation,
    job_id_keys,
    parse_job_id,
)
from relay.store.base import LEASE_EXPIRED_ERROR, RESTART_ERROR, SUMMARY_ERROR_CHARS, info_size

# The columns of a job's row, in the order ``job_info`` reads them.
JOB_COLUMNS = (
    "id, queue, state, priority, payload, attempt, max_attempts, created_at, ready_at, run_at, "
    "lease_expires_at, lease_worker, last_error, result, idempotency_key, finished_at, "
    "timeout_ms, scheduled_for, leased_at, attempts_ended"
)
# The columns of an ended attempt's row (job_errors), in the order ``job_info`` reads them.
HISTORY_COLUMNS = "attempt, error, at, traceback, started_at, worker, outcome"


# An abbreviated id's range of keys (model.job_id_keys) is read for at most this many:
# one names the job, a second says that the abbreviation is ambiguous.
PREFIX_KEYS_READ = 2


def only_key(prefix: str, keys: Sequence[tuple]) -> int:
    """The key of the one job whose id begins with ``prefix``, from the rows of the first
    PREFIX_KEYS_READ keys of its range (``job_inspect_prefix``); raises ``JobNotFound``
    for none, ``BadRequest`` naming job_id for several, as git refuses an ambiguous
    abbreviation of a hash."""
    if not keys:
        raise JobNotFound(prefix)
    if len(keys) > 1:
        raise BadRequest(
            f"job_id: {prefix} matches more than one job: give more of its hex digits",
            field="job_id",
        )
    return keys[0][0]


def short_id(job_id: str, keys: Sequence[int]) -> str:
    """``job_id`` as ``job_ids_abbreviate`` answers it, from ``keys``: the nearest key
    below its own and the keys from its own up, read by one seek each way of the jobs'
    key (at most one below, two from it up). Its whole id if it is no job's."""
    key = parse_job_id(job_id)
    if key is None or key not in keys:
        return job_id
    return job_id_abbreviation(key, [other for other in keys if other != key])


def _same(text: str | None) -> str | None:
    return text


def _old_outcome(error: str) -> AttemptOutcome:
    """How an attempt recorded before outcomes were kept ended, from its error: such rows
    were written only by fail, the reaper and the recovery at start."""
    if error == LEASE_EXPIRED_ERROR:
        return AttemptOutcome.EXPIRED
    if error == RESTART_ERROR:
        return AttemptOutcome.INTERRUPTED
    if error.startswith("timed out after ") and error.endswith(" ms"):
        return AttemptOutcome.TIMED_OUT
    return AttemptOutcome.FAILED


def attempts_of(
    row: Sequence, history: Sequence[Sequence], text: Callable[[str | None], str | None] = _same
) -> tuple[list[ErrorEntry], list[AttemptEntry], int]:
    """A job's errors, attempts and attempts dropped, from its ``row`` (JOB_COLUMNS) and
    ``history``, the rows (HISTORY_COLUMNS) of its latest ended attempts, oldest first.

    The attempt running now, or the one that succeeded, has no row: it is the job row's
    (its start ``leased_at``, its worker, its end ``finished_at``), so that a claim and
    an ack write nothing more than the job row."""
    errors, attempts = [], []
    for attempt, error, at, traceback, started_at, worker, outcome in history:
        error, traceback = text(error), text(traceback)
        ended = AttemptOutcome(outcome) if outcome else _old_outcome(error)
        if ended.erred:
            errors.append(ErrorEntry(attempt, error, at, traceback))
        else:
            error = traceback = None  # (their rows hold an empty error)
        attempts.append(
            AttemptEntry(attempt, ended, started_at, at, text(worker), error, traceback)
        )
    state = row[2]
    if state in (JobState.LEASED, JobState.SUCCEEDED):
        outcome = AttemptOutcome.RUNNING if state == JobState.LEASED else AttemptOutcome.SUCCEEDED
        ended_at = row[15] if state == JobState.SUCCEEDED else None
        attempts.append(AttemptEntry(row[5], outcome, row[18], ended_at, text(row[11])))
    return errors, attempts, max(0, row[19] - len(history))


def job_info(
    row: Sequence,
    history: Sequence[Sequence],
    text: Callable[[str | None], str | None] = _same,
) -> JobInfo:
    """The job of ``row`` (JOB_COLUMNS), with ``history``, the rows (HISTORY_COLUMNS) of
    its latest ended attempts, oldest first; ``text`` turns the client's texts (worker
    id, error, key) back from how the dialect stored them."""
    state = JobState(row[2])
    errors, attempts, dropped = attempts_of(row, history, text)
    return JobInfo(
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
        lease_expires_at=row[10] if state == JobState.LEASED else None,
        worker_id=text(row[11]),
        last_error=text(row[12]),
        errors=tuple(errors),
        result=row[13],
        idempotency_key=text(row[14]),
        finished_at=row[15],
        timeout_ms=row[16],
        scheduled_for=row[17],
        attempts=tuple(attempts),
        attempts_dropped=dropped,
    )


def cursor_bound(cursor: str | None, newest: bool) -> int:
    """Where a dead-list page starts: after its cursor's job in the order asked. Oldest
    first, the page holds ids above the bound (the cursor's id, or -1); newest first, ids
    up to it (the cursor's id less one, or the largest id). No cursor, or one that names
    no job: the first page."""
    key = parse_job_id(cursor) if cursor is not None else None
    if newest:
        return ID_MAX if key is None else key - 1  # (the largest key a job id can have)
    return -1 if key is None else key


def page(
    infos: list[JobInfo], more: bool, max_bytes: int | None
) -> tuple[list[JobInfo], str | None]:
    """A dead-list page of ``infos`` (``more``: rows follow them), cut once the jobs'
    texts reach ``max_bytes`` (always at least one job); and its next cursor."""
    if max_bytes is not None:
        size = 0
        for i, info in enumerate(infos):
            size += info_size(info)
            if size >= max_bytes and i + 1 < len(infos):
                infos, more = infos[: i + 1], True
                break
    return infos, (infos[-1].job_id if more else None)


# -- the job browser (jobs_list) --------------------------------------------------------------

# A browser's item: every column of JOB_COLUMNS but the payload and the result, which a
# page never reads (inspect shows them), in the same places so ``job_info`` reads them.
SUMMARY_COLUMNS = JOB_COLUMNS.replace("payload", "'' AS payload").replace(
    "result", "NULL AS result"
)
# A search by key prefix takes at most this many keys of each kind (idempotency, unique);
# a prefix that more keys begin with is refused: give more of it.
KEY_SEARCH_MAX = 1000


def summaries(
    rows: Sequence[Sequence], text: Callable[[str | None], str | None] = _same
) -> list[JobInfo]:
    """The browser's items of ``rows`` (SUMMARY_COLUMNS): no payload, result or errors,
    the last error cut to SUMMARY_ERROR_CHARS characters."""
    infos = []
    for row in rows:
        info = job_info(row, (), text)
        error = info.last_error
        if error is not None and len(error) > SUMMARY_ERROR_CHARS:
            info = attrs.evolve(info, last_error=error[:SUMMARY_ERROR_CHARS])
        infos.append(info)
    return infos


def merged(
    runs: Iterable[Iterable[Sequence]], limit: int, newest: bool
) -> tuple[list[Sequence], bool]:
    """The first ``limit`` rows of ``runs`` (each in id order: descending if ``newest``)
    merged into one run, and whether more follow. Each run is read lazily, so a run
    gives only the rows the page takes and one more."""
    rows = list(
        itertools.islice(heapq.merge(*runs, key=lambda row: row[0], reverse=newest), limit + 1)
    )
    return rows[:limit], len(rows) > limit


# What one page may cost, at any number of queues or jobs (docs/protocol.md, "The job
# browser"). A page of every queue merges one run of the index by (queue, state, id) per
# (queue, state) asked that holds jobs, while there are at most MERGED_RUNS_MAX; past that
# (or for an id prefix's range), it reads the jobs by id, and examines at most
# ROWS_EXAMINED_MAX of them: if those run out before the page is full, the page is short
# and its cursor is the last job examined (more may follow).
MERGED_RUNS_MAX = 32
ROWS_EXAMINED_MAX = 10_000


def held_runs(
    counts: Iterable[tuple[tuple[str, str], int]], states: Sequence[str], most: int
) -> list[tuple[str, str]] | None:
    """The (queue, state) pairs of ``counts`` in ``states`` that hold jobs, sorted; None
    once there are more than ``most``."""
    pairs = []
    for pair, n in counts:
        if n > 0 and pair[1] in states:
            pairs.append(pair)
            if len(pairs) > most:
                return None
    return sorted(pairs)


def window(keys: range | None, bound: int, newest: bool) -> tuple[int, int]:
    """The keys (lowest, highest) a read by id from the cursor's ``bound``
    (``cursor_bound``) may take, within ``keys`` (an id prefix's, or None: any)."""
    low, high = (-1, bound) if newest else (bound + 1, ID_MAX)
    if keys:
        low, high = max(low, keys.start), min(high, keys[-1])
    return low, high


def window_page(
    runs: Iterable[Iterable[Sequence]], edge: int | None, limit: int, newest: bool
) -> tuple[list[Sequence], int | None]:
    """A page of ``runs`` (as ``merged`` takes them) of which one stopped at ``edge``,
    the last key its read examined (None: it read to its end), and the key of its next
    cursor: the page's last row's if more rows follow it, else ``edge`` (a short page:
    the rows beyond the edge are left for the next), else None."""
    rows, more = merged(runs, limit, newest)
    if edge is not None:
        before = [row for row in rows if (row[0] >= edge if newest else row[0] <= edge)]
        if len(before) < len(rows):
            rows, more = before, False
    if more:
        return rows, rows[-1][0]
    return rows, edge


def search_ids(queue: str | None, search: str) -> range | None:
    """The job keys whose ids begin with ``search`` (``job_id_keys``), or None for a key
    prefix; refuses (``BadRequest`` naming search) a key prefix without a queue, whose keys
    are looked up per queue."""
    keys = job_id_keys(search)
    if keys is None and queue is None:
        raise BadRequest(
            "search: not the start of a job id (job_ and 7 to 16 hex digits); "
            "a key prefix needs queue",
            field="search",
        )
    return keys


def key_matches(prefix: str, found: Sequence[Sequence]) -> list[int]:
    """The job keys of ``found`` ((key, job key) rows of one queue's keys, the first
    KEY_SEARCH_MAX + 1 that begin with ``prefix``); refuses (``BadRequest`` naming search)
    a prefix that more keys begin with."""
    if len(found) > KEY_SEARCH_MAX:
        raise BadRequest(
            f"search: {KEY_SEARCH_MAX} or more keys begin with {prefix!r}: give more of it",
            field="search",
        )
    return [row[1] for row in found]


def list_page(infos: list[JobInfo], after: int | None) -> tuple[list[JobInfo], str | None]:
    """A browser's page and its next cursor: the id of the key ``after`` (its last job's,
    or the last job examined for a short page), None on the last page."""
    return infos, (None if after is None else format_job_id(after))
