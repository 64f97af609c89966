"""Submit as SQLite: ``jobs_submit`` and its helpers, the depth check and idempotency
keys, with their statements. The transitions of a held lease are leases.py.

``jobs_submit`` is a hot path: a batch of jobs is a few statements (see sql.py), and its
per-job Python is written out where profiles showed it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import orjson

from relay.protocol.errors import QueueFull
from relay.protocol.model import (
    DEFAULT_BACKOFF,
    DEFAULT_MAX_ATTEMPTS,
    ID_SEQ_BITS,
    JobState,
    SubmitResult,
    SubmitSpec,
    format_job_id,
    unique_key_held,
)
from relay.store.base import (
    PENDING,
    READY,
    SETTINGS_COLUMNS,
    UNFINISHED,
    Later,
    QueueSettings,
    SubmitDefaults,
    with_defaults,
)
from relay.store.sqlite.sql import (
    ALONE_PAYLOAD_CHARS,
    ALONE_ROWS,
    ONE_STATEMENT_ROWS,
    SqliteBase,
    _execute_rows,
)

# A named tuple made from a tuple at once, without its __new__'s argument handling.
_new_result = tuple.__new__

_INSERT_JOBS = (
    "INSERT INTO jobs (id, queue, state, priority, payload, attempt, max_attempts, "
    "backoff_kind, backoff_base_ms, backoff_max_ms, backoff_jitter, created_at, ready_at, "
    "run_at, idempotency_key, timeout_ms) VALUES {values}"
)
_INSERT_JOBS_ROW = "(?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
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
# A unique key is taken by its new job: the holder it replaces (if any) is out of scope.
_INSERT_UNIQUE = (
    "INSERT OR REPLACE INTO unique_keys (queue, key, job_id, unique_for) VALUES {values}"
)
_SETTINGS_ROW = f"SELECT {SETTINGS_COLUMNS} FROM queue_settings WHERE queue = ?"
_UNIQUE_HOLDER = (
    "SELECT u.job_id, u.unique_for, j.state, j.attempt FROM unique_keys u "
    "JOIN jobs j ON j.id = u.job_id WHERE u.queue = ? AND u.key = ?"
)


def _plain(spec: SubmitSpec) -> bool:
    """Ready at once, with the default backoff (None, once its queue's defaults are
    applied: the protocol's), no timeout and no key: one insert of seven values."""
    return (
        spec.idempotency_key is None
        and spec.unique_key is None
        and spec.timeout_ms is None
        and spec.run_at is None
        and not spec.delay_ms
        and (spec.backoff is None or spec.backoff is DEFAULT_BACKOFF)
    )


class SqliteJobs(SqliteBase):
    """Submit: part of ``SqliteStore``."""

    # The queues with submit defaults, as committed, and the queues whose settings the
    # open transaction changed (settings.py).
    _defaults: dict[str, SubmitDefaults]
    _settings_touched: set[str]

    # -- submit ----------------------------------------------------------------------------

    def jobs_submit_later(self, specs: Sequence[SubmitSpec], now: int) -> Later:
        """``jobs_submit``, whose answers SQLite knows at once."""
        return Later(self.jobs_submit(specs, now))

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
        if self._defaults or self._settings_touched:  # (no queue has any: one test)
            specs = self._with_defaults(specs)
        # From here a spec's max_attempts and backoff left None are the protocol's.
        # (_plain, written out by position: this runs per job, and a named tuple's
        # attributes are descriptors, its unpacking an iteration, each dearer than an
        # index. SubmitSpec: queue 0, payload 1, priority 2, delay_ms 3, run_at 4,
        # max_attempts 5, backoff 6, idempotency_key 7, unique_key 8, unique_for 9,
        # timeout_ms 10.)
        plain_only = all(
            [
                s[7] is None and s[4] is None and not s[3]
                and (s[6] is None or s[6] is DEFAULT_BACKOFF)
                and s[8] is None and s[10] is None
                for s in specs
            ]
        )  # fmt: skip
        if alone and not (
            plain_only
            and len(specs) <= ALONE_ROWS
            and sum([len(spec[1]) for spec in specs]) <= ALONE_PAYLOAD_CHARS  # (payloads)
        ):
            return None
        if plain_only:
            return self._submit_plain(specs, now, alone)
        results: list[SubmitResult] = []
        plain: list[tuple] = []  # ready now, default backoff, no key: the common job
        rows: list[tuple] = []  # every other job
        keys: list[tuple] = []
        fresh_keys: dict[tuple[str, str], SubmitResult] = {}
        uniques: list[tuple] = []  # unique keys taken by new jobs
        fresh_uniques: dict[tuple[str, str], SubmitResult] = {}
        per_queue: dict[tuple[str, str], int] = {}  # (queue, state) -> new jobs
        key_expires_at = now + self.config.idempotency_window_ms
        # Ids as JobIdGenerator.next_id gives them, written out (one call per job showed
        # in the profile): the first is above the last and at least now's, then +1 each.
        floor = now << ID_SEQ_BITS
        last_id = self._ids.last_id
        ready_queues = self.changes.ready_queues
        for spec in specs:
            queue, _, _, delay_ms, run_at, attempts, backoff, idempotency_key = spec[:8]
            if attempts is None:
                attempts = DEFAULT_MAX_ATTEMPTS
            if idempotency_key is not None:
                seen = fresh_keys.get((queue, idempotency_key))
                if seen is None:
                    seen = self._idempotent_hit(queue, idempotency_key, now)
                if seen is not None:
                    results.append(SubmitResult(seen.job_id, seen.state, duplicate=True))
                    continue
            unique_key = spec[8]
            if unique_key is not None:
                seen = fresh_uniques.get((queue, unique_key)) or self._unique_holder(
                    queue, unique_key
                )
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
                and (backoff is None or backoff is DEFAULT_BACKOFF)
                and spec[10] is None
            ):  # (_plain, written out)
                plain.append((key, queue, spec.priority, spec.payload, attempts, now, now))
            else:
                if backoff is None:
                    backoff = DEFAULT_BACKOFF
                rows.append(
                    (
                        key, queue, state.value, int(spec.priority), spec.payload, attempts,
                        backoff.kind, backoff.base_ms, backoff.max_ms, int(backoff.jitter),
                        now, ready_at, run_at, idempotency_key, spec[10],
                    )
                )  # fmt: skip
            result = _new_result(SubmitResult, (f"job_{key:016x}", state, False))
            results.append(result)
            per_queue[queue, state] = per_queue.get((queue, state), 0) + 1
            if idempotency_key is not None:
                keys.append((queue, idempotency_key, key, key_expires_at))
                fresh_keys[(queue, idempotency_key)] = result
            if unique_key is not None:
                uniques.append((queue, unique_key, key, spec[9]))
                fresh_uniques[(queue, unique_key)] = _new_result(
                    SubmitResult, (result[0], state, True)
                )
        self._check_queues({queue for queue, _ in per_queue})
        self._ids.last_id = last_id
        self._check_depth(per_queue)
        _execute_rows(self._db, _INSERT_PLAIN_JOBS, _INSERT_PLAIN_ROW, plain)
        _execute_rows(self._db, _INSERT_JOBS, _INSERT_JOBS_ROW, rows)
        # An expired key for the same (queue, key) is replaced: its window has passed.
        _execute_rows(self._db, _INSERT_KEYS, "(?, ?, ?, ?)", keys)
        _execute_rows(self._db, _INSERT_UNIQUE, "(?, ?, ?, ?)", uniques)
        # Counted once written: a statement that fails outside a transaction (``alone``)
        # leaves nothing to undo.
        for (queue, state), n in per_queue.items():
            self._move(queue, None, state, n)
            self._count(queue, "submitted", n, now)
        if self.recording:  # (a duplicate created nothing: no event)
            self.changes.events += [
                (result[0], spec.queue, result[1].value, 0, now, None)
                for spec, result in zip(specs, results, strict=True)
                if not result[2]
            ]
        return results

    def _submit_plain(
        self, specs: Sequence[SubmitSpec], now: int, alone: bool
    ) -> list[SubmitResult]:
        """``jobs_submit`` of jobs that are all plain (``_plain``), in list comprehensions
        over the specs by position (see jobs_submit): the common batch, whose per-job work
        showed in the profile of submit_batch. The insert is its last step that can fail:
        what comes after only counts."""
        per_queue: dict[str, int] = {}  # queue -> new jobs
        for spec in specs:
            queue = spec[0]
            per_queue[queue] = per_queue.get(queue, 0) + 1
        self._check_queues(per_queue)
        if self.config.max_depth is not None or self.config.queue_depths:
            self._check_depth({(queue, READY): n for queue, n in per_queue.items()})
        # Consecutive ids, as JobIdGenerator.next_id would give them one by one.
        first = max(now << ID_SEQ_BITS, self._ids.last_id + 1)
        self._ids.last_id = first + len(specs) - 1
        # (max_attempts left None: the protocol's; never 0, so ``or`` tells.)
        if len(specs) <= ONE_STATEMENT_ROWS or not alone:
            rows = [
                (key, s[0], s[2], s[1], s[5] or DEFAULT_MAX_ATTEMPTS, now, now)
                for key, s in enumerate(specs, first)
            ]
            _execute_rows(self._db, _INSERT_PLAIN_JOBS, _INSERT_PLAIN_ROW, rows)
        else:
            # Alone, with more rows than one VALUES statement takes: one json_each
            # statement, so that the batch is still one statement (a VALUES text per row
            # count would be prepared anew for each count, ~2 ms for 1,000 rows). Its JSON
            # is bounded by ALONE_ROWS and ALONE_PAYLOAD_CHARS.
            rows = [
                (key, s[0], int(s[2]), s[1], s[5] or DEFAULT_MAX_ATTEMPTS)
                for key, s in enumerate(specs, first)
            ]
            self._db.execute(_INSERT_PLAIN_JSON, (now, orjson.dumps(rows)))
        results = [
            _new_result(SubmitResult, (f"job_{key:016x}", READY, False))
            for key in range(first, first + len(specs))
        ]
        self.changes.ready_queues.update(per_queue)
        for queue, n in per_queue.items():
            self._move(queue, None, READY, n)
            self._count(queue, "submitted", n, now)
        if self.recording:
            self.changes.events += [
                (result[0], spec[0], "ready", 0, now, None)
                for spec, result in zip(specs, results, strict=True)
            ]
        return results

    def _with_defaults(self, specs: Sequence[SubmitSpec]) -> list[SubmitSpec]:
        """``specs`` with their queues' defaults (``with_defaults``), as this transaction
        sees them: as committed (``_defaults``), but for the queues whose settings it
        changed, read from the table. One dict lookup per spec of a queue without any."""
        defaults = self._defaults
        if self._settings_touched:
            defaults = dict(defaults)
            for queue in self._settings_touched:
                row = self._db.execute(_SETTINGS_ROW, (queue,)).fetchone()
                fill = None if row is None else QueueSettings.from_row(row).submit_defaults
                if fill is not None:
                    defaults[queue] = fill
                else:
                    defaults.pop(queue, None)
        get = defaults.get
        return [
            spec if (fill := get(spec[0])) is None else with_defaults(spec, fill) for spec in specs
        ]

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

    def _unique_holder(self, queue: str, key: str) -> SubmitResult | None:
        """The duplicate answer for a job that holds this unique key, if one still does."""
        row = self._db.execute(_UNIQUE_HOLDER, (queue, key)).fetchone()
        if row is None or not unique_key_held(row[1], row[2], row[3]):
            return None
        return SubmitResult(format_job_id(row[0]), JobState(row[2]), duplicate=True)

    def _idempotent_hit(self, queue: str, key: str, now: int) -> SubmitResult | None:
        row = self._db.execute(
            # The job, or one deleted since (purged, pruned): the state it was deleted in.
            "SELECT k.job_id, coalesce(j.state, k.final_state) FROM idempotency_keys k "
            "LEFT JOIN jobs j ON j.id = k.job_id "
            "WHERE k.queue = ? AND k.key = ? AND k.expires_at > ?",
            (queue, key, now),
        ).fetchone()
        if row is None or row[1] is None:
            return None
        return SubmitResult(format_job_id(row[0]), JobState(row[1]), duplicate=True)
