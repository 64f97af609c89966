"""History per queue and minute, and the run-time and wait-time histograms: what every
store counts in memory and flushes, and the values it reads back. No database here.

A store counts as it commits, never a row per job: each transition it makes already
counts per queue (``CountsBook._count``), and adds there to a ``Counter`` keyed by
(queue, minute, field) (``FIELD_*``); a claim observes each job's wait (from ``ready_at``,
a delayed or retried job's due time, to now) and an ack or fail each attempt's run time
(from its lease's start, the job's ``leased_at``, to now), summed per queue and call
(``observe``). Every change goes through the counts' journal, so a rolled-back command
or transaction takes its counts back. ``history_flush`` (the maintenance service's, every
FLUSH_INTERVAL_S) writes what was counted as one upsert per flush into the table
``history``, adding to what is there (several servers sharing a PostgreSQL database each
add theirs), and hands the histogram buckets to the trio side (``Histograms``), which
``/metrics`` renders. See docs/design-decisions.md, "History counted in memory".
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Sequence

import attrs

MINUTE_MS = 60_000
# How long the history is kept, at minute resolution (pruned by the maintenance service).
HISTORY_KEEP_MS = 7 * 24 * 3_600_000
# Points per history reply at most: a day at minute resolution.
MAX_POINTS = 1_440
# How often the maintenance service flushes what was counted to the table: a crash loses
# at most this long of history (and the histograms on /metrics lag by as much).
FLUSH_INTERVAL_S = 5.0
# The rows of every queue summed, written by each flush beside the queues' own: a read of
# all queues is then one range of the key, as a queue's is (never a sum over 1,000 queues
# in the writer). Not a queue name ([A-Za-z0-9._:-]): no queue's rows can be mistaken.
ALL_QUEUES = "*"
# The queue that sums every queue beyond the bound on queues with rows of their own (the
# metrics' ``_other``: a queue really named so is summed into it too).
OTHER_QUEUES = "_other"

# The table's columns after (queue, minute), in order; the fields of a point.
COLUMNS = (
    "submitted", "succeeded", "failed", "dead",
    "run_count", "run_sum_ms", "run_max_ms", "wait_count", "wait_sum_ms", "wait_max_ms",
)  # fmt: skip
N_COLUMNS = len(COLUMNS)
FIELD_SUBMITTED, FIELD_SUCCEEDED, FIELD_FAILED, FIELD_DEAD = 0, 1, 2, 3
FIELD_RUN, FIELD_WAIT = 4, 7  # count, then sum, then max
_MAX_FIELDS = (6, 9)

# The store's event -> the history field it adds to: a failed attempt is a fail, a lease
# expiry or an execution timeout (both reaped as "expired").
EVENT_FIELDS = {
    "submitted": FIELD_SUBMITTED,
    "acked": FIELD_SUCCEEDED,
    "failed": FIELD_FAILED,
    "expired": FIELD_FAILED,
    "dead": FIELD_DEAD,
}

# The histograms' upper bounds (ms; relay_job_run_seconds and relay_job_wait_seconds in
# seconds): from 5 ms, where a job's own overhead lies, to an hour, a long job or wait.
BOUNDS_MS = (5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000,
             300_000, 1_800_000, 3_600_000)  # fmt: skip
N_BUCKETS = len(BOUNDS_MS) + 1  # the last: above every bound
# Fields of the in-memory counter only: a bucket's count, run then wait.
RUN_BUCKETS = N_COLUMNS
WAIT_BUCKETS = N_COLUMNS + N_BUCKETS
N_FIELDS = N_COLUMNS + 2 * N_BUCKETS

HistoryKey = tuple[str, int, int]  # (queue, minute, field)


def minute_of(ms: int) -> int:
    return ms - ms % MINUTE_MS


_bucket_of = functools.partial(bisect.bisect_left, BOUNDS_MS)


def observe_fields(kind: int, values: Sequence[int]) -> list[tuple[int, int]]:
    """(field, n) to add for ``values`` (ms) observed of ``kind`` (FIELD_RUN or FIELD_WAIT):
    their sum and bucket counts (their count is the buckets' sum: ``take_rows``; the max is
    the caller's, not being a sum). This runs per claim and per ack."""
    first = RUN_BUCKETS if kind == FIELD_RUN else WAIT_BUCKETS
    fields = [(kind + 1, sum(values))]
    if len(values) == 1:
        fields.append((first + _bucket_of(values[0]), 1))
        return fields
    buckets: dict[int, int] = {}
    for bucket in map(_bucket_of, values):  # (a Counter costs twice this, for a few values)
        buckets[bucket] = buckets.get(bucket, 0) + 1
    fields += [(first + bucket, n) for bucket, n in buckets.items()]
    return fields


@attrs.frozen
class HistoryRow:
    """One (queue, minute)'s counts as flushed: COLUMNS' values."""

    queue: str
    minute: int
    values: tuple[int, ...]


@attrs.frozen
class QueueObserved:
    """What a flush adds to one queue's histograms: bucket counts (not cumulative, the
    last above every bound) and sums in ms, run time then wait time."""

    run: tuple[int, ...]
    run_sum_ms: int
    wait: tuple[int, ...]
    wait_sum_ms: int


@attrs.frozen
class HistoryFlushed:
    """A flush's outcome: the rows written (upserted) and the histograms' deltas."""

    rows: int
    observed: dict[str, QueueObserved]


@attrs.frozen
class HistoryPoint:
    """The totals of one step from ``at`` (ms): COLUMNS' values (maxima as maxima)."""

    at: int
    values: tuple[int, ...]

    def as_fields(self) -> dict[str, int]:
        return {"at": self.at, **dict(zip(COLUMNS, self.values, strict=True))}


def take_rows(
    pending: dict[HistoryKey, int], max_queues: int, kept: set[str]
) -> tuple[list[HistoryRow], dict[str, QueueObserved]]:
    """The rows and histogram deltas of what ``pending`` holds (its zero entries left
    alone). The queues in ``kept`` get rows of their own, and so do new ones, added to it,
    while it holds fewer than ``max_queues`` (the first seen keep theirs: queues made
    later, however named, cannot push them out); the others are summed into
    ``OTHER_QUEUES`` (maxima as maxima). Every minute also gets the row of every queue
    summed (``ALL_QUEUES``)."""
    fields: dict[tuple[str, int], list[int]] = {}
    for (queue, minute, field), n in pending.items():
        if n:
            row = fields.get((queue, minute))
            if row is None:
                row = fields[(queue, minute)] = [0] * N_FIELDS
            row[field] = n
    for row in fields.values():  # a count is its buckets' sum (``observe_fields``)
        row[FIELD_RUN] = sum(row[RUN_BUCKETS:WAIT_BUCKETS])
        row[FIELD_WAIT] = sum(row[WAIT_BUCKETS:])
    for name in sorted({queue for queue, _ in fields} - kept):
        if len(kept) >= max_queues:
            break
        if name != OTHER_QUEUES:
            kept.add(name)
    own = kept
    merged: dict[tuple[str, int], list[int]] = {}
    observed: dict[str, list[int]] = {}
    for (queue, minute), values in fields.items():
        name = queue if queue in own else OTHER_QUEUES
        row = merged.get((name, minute))
        if row is None:
            merged[(name, minute)] = list(values[:N_COLUMNS])
        else:
            for i in range(N_COLUMNS):
                row[i] = max(row[i], values[i]) if i in _MAX_FIELDS else row[i] + values[i]
        seen = observed.setdefault(queue, [0] * N_FIELDS)
        for i in range(N_FIELDS):
            seen[i] += values[i]
    for (_queue, minute), values in list(merged.items()):
        row = merged.get((ALL_QUEUES, minute))
        if row is None:
            merged[(ALL_QUEUES, minute)] = list(values)
        else:
            for i in range(N_COLUMNS):
                row[i] = max(row[i], values[i]) if i in _MAX_FIELDS else row[i] + values[i]
    rows = [HistoryRow(q, m, tuple(v)) for (q, m), v in sorted(merged.items())]
    deltas = {
        queue: QueueObserved(
            tuple(v[RUN_BUCKETS:WAIT_BUCKETS]),
            v[FIELD_RUN + 1],
            tuple(v[WAIT_BUCKETS:]),
            v[FIELD_WAIT + 1],
        )
        for queue, v in observed.items()
        if v[FIELD_RUN] or v[FIELD_WAIT]
    }
    return rows, deltas


def points(start: int, end: int, step: int, rows: Iterable[Sequence[int]]) -> list[HistoryPoint]:
    """Every step from ``start`` before ``end``, with the totals of ``rows`` (each the
    step's index, then COLUMNS' values summed or maxed by the database), zeros where none."""
    count = -(-(end - start) // step)
    found = {int(row[0]): tuple(int(v or 0) for v in row[1:]) for row in rows}
    zero = (0,) * N_COLUMNS
    return [HistoryPoint(start + i * step, found.get(i, zero)) for i in range(count)]


# The history read, the same SQL on both stores (with the dialect's parameter mark): one
# queue's rows (ALL_QUEUES: every queue's) in a range of the key, per step, sums and
# maxima. Parameters: start, step, queue, start, end.
def read_sql(mark: str) -> str:
    sums = ", ".join(
        f"max({c})" if i in _MAX_FIELDS else f"sum({c})" for i, c in enumerate(COLUMNS)
    )
    return (
        f"SELECT (minute - {mark}) / {mark} AS i, {sums} FROM history "
        f"WHERE queue = {mark} AND minute >= {mark} AND minute < {mark} GROUP BY i ORDER BY i"
    )


class Histograms:
    """Per queue, the run-time and wait-time histograms since this server started, as
    flushes add to them (trio thread: the flusher adds, a scrape reads). At most
    ``max_queues`` queues (the first to be seen) have series of their own; the others are
    summed as ``OTHER_QUEUES``, as /metrics' other per-queue series are."""

    def __init__(self, max_queues: int) -> None:
        self.max_queues = max_queues
        # queue -> [run buckets, run sum ms, wait buckets, wait sum ms]
        self._queues: dict[str, list] = {}

    def add(self, observed: dict[str, QueueObserved]) -> None:
        for queue in sorted(observed):
            o = observed[queue]
            name = queue
            if name not in self._queues and len(self._queues) >= self.max_queues:
                name = OTHER_QUEUES
            mine = self._queues.get(name)
            if mine is None:
                mine = self._queues[name] = [[0] * N_BUCKETS, 0, [0] * N_BUCKETS, 0]
            for i in range(N_BUCKETS):
                mine[0][i] += o.run[i]
                mine[2][i] += o.wait[i]
            mine[1] += o.run_sum_ms
            mine[3] += o.wait_sum_ms

    def snapshot(self) -> dict[str, tuple[tuple[int, ...], int, tuple[int, ...], int]]:
        """queue -> (run buckets, run sum ms, wait buckets, wait sum ms), not cumulative."""
        return {q: (tuple(v[0]), v[1], tuple(v[2]), v[3]) for q, v in self._queues.items()}
