"""Submit on PostgreSQL: ``jobs_submit`` and its helpers, ids from a sequence, the depth
check and idempotency keys. The transitions of a held lease are leases.py.

The rules are SqliteStore's (relay/store/sqlite/jobs.py); what differs is how they hold
when several servers write at once. Ids come from one sequence in the database; an
idempotency key is taken with ``INSERT ... ON CONFLICT`` on its primary key, so that of
two servers submitting one key at once, one creates the job and the other answers it.

A batch is a few statements whatever its size: many rows go in as arrays (``unnest``),
and each statement is prepared at its first run (pipe.py), since their texts do not vary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from relay.protocol.errors import QueueFull
from relay.protocol.model import (
    DEFAULT_BACKOFF,
    DEFAULT_MAX_ATTEMPTS,
    ID_SEQ_BITS,
    JobState,
    SubmitResult,
    SubmitSpec,
    unique_key_held,
)
from relay.store.base import PENDING, READY, UNFINISHED, Later
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.pipe import Result
from relay.store.postgres.sql import atomic, encode_text, opaque

# Job ids come from the sequence job_ids (one per database: an in-process generator would
# collide across servers), in the layout of relay.protocol.model: milliseconds << 21 plus a count.
# The sequence only counts; a submit that finds it more than half of ID_LAG_MS behind its
# `now` moves it up to now << 21 (forward only, under ID_LOCK, so that two servers never
# move it back past ids the other issued). Ids so sort by creation (the order the sequence
# hands them out), also across servers and clocks set back, and their time part is at
# most ID_LAG_MS behind. Half the lag is large next to the ids any server can draw while
# another moves the sequence (2**30 ids), and makes the move rare: twice a second at most.
# Once an id is seen, the sequence is known to be fresh enough until ``_fresh_until``: till
# then jobs without keys draw their ids in their insert (``jobs_submit_later``), with no
# round trip of their own; the first submit after it reads ids first, and moves the
# sequence if it must.
ID_LAG_MS = 1_000
ID_LOCK = 0x524C5954_00000002
_ID_LAG = ID_LAG_MS << ID_SEQ_BITS
_NEXT_IDS = f"SELECT nextval('job_ids') FROM generate_series(1, {opaque('%s::int')})"
_CATCH_UP = "SELECT setval('job_ids', %s) FROM job_ids WHERE last_value < %s"


def _fresh_until(drawn: int) -> int:
    """Until when (the callers' ``now``) the sequence, having given the id ``drawn``, is
    known to be at most ID_LAG_MS behind: its ids only grow."""
    return (drawn >> ID_SEQ_BITS) + ID_LAG_MS


def _defaults(queues: str) -> str:
    """The join that gives each job (``t``) its queue's settings (``s``), read by the
    insert itself: a field a submit left out (NULL in its array) gets its queue's default
    as committed when the statement starts (or as this transaction changed it), else the
    protocol's, with no round trip more. A backoff is given whole or left out whole; a
    queue's default_backoff is Backoff's four fields as JSON.

    The rows are those of the batch's queues (``queues``, the placeholder of its queue
    array) by one index scan. That array is ``opaque``: with plans that counted it, the
    statement was planned anew on every run once queue_settings was large (measured:
    +0.1 ms a submit with 10,000 queues' settings); this way the generic plan holds, one
    index scan whatever the size.
    """
    # (Cast again: ANY of a bare sub-select would compare with its rows.)
    return _settings_join(f"queue = ANY({opaque(queues + '::text[]')}::text[])")


def _settings_join(where: str) -> str:
    """``_defaults``'s join, of the settings rows ``where`` says."""
    return (
        "LEFT JOIN (SELECT queue, default_retries + 1 AS attempts, default_timeout_ms, "
        f"default_backoff::jsonb AS b FROM queue_settings WHERE {where}) s "
        "ON s.queue = t.queue"
    )


def _with_defaults(given: bool) -> str:
    """max_attempts and the four backoff columns: the submit's (``given``: its backoff
    may be, as t.kind...; else none is), else the queue's default, else the protocol's."""
    b = DEFAULT_BACKOFF
    backoff = (
        ("kind", "s.b ->> 0", f"'{b.kind}'"),
        ("base_ms", "(s.b ->> 1)::bigint", b.base_ms),
        ("max_ms", "(s.b ->> 2)::bigint", b.max_ms),
        ("jitter", "(s.b ->> 3)::boolean", str(b.jitter).lower()),
    )
    columns = [f"coalesce(t.max_attempts, s.attempts, {DEFAULT_MAX_ATTEMPTS})"]
    for name, default, protocols in backoff:
        submits = f"t.{name}, " if given else ""
        columns.append(f"coalesce({submits}{default}, {protocols})")
    return ", ".join(columns)


def _insert(values: str, arrays: str, names: str, drawn: bool) -> str:
    """An insert of one job per element of ``arrays`` (each a named placeholder and its
    cast; ``queues`` among them), their columns ``names`` as ``t``, the jobs' columns
    ``_COLUMNS`` made of them by ``values``.

    The ids are the array ``ids``; or, ``drawn``, the insert draws them from the sequence
    itself, in the order of the arrays (the scan is in ordinality order; volatile output
    runs after a sort, were there one), and returns them in that order: the jobs are
    then made with no round trip of their own (``jobs_submit_later``)."""
    if not drawn:
        return (
            f"INSERT INTO jobs ({_COLUMNS}) SELECT {values} FROM unnest(%(ids)b::bigint[], "
            f"{arrays}) AS t(id, {names}) {_defaults('%(queues)b')}"
        )
    return (
        "WITH t AS MATERIALIZED (SELECT nextval('job_ids') AS id, u.* "
        f"FROM unnest({arrays}) WITH ORDINALITY AS u({names}, ord) ORDER BY u.ord), "
        f"made AS (INSERT INTO jobs ({_COLUMNS}) SELECT {values} FROM t "
        f"{_defaults('%(queues)b')}) SELECT id FROM t ORDER BY ord"
    )


_COLUMNS = (
    "id, queue, state, priority, payload, attempt, max_attempts, backoff_kind, "
    "backoff_base_ms, backoff_max_ms, backoff_jitter, created_at, ready_at, run_at, "
    "idempotency_key, timeout_ms"
)
# A job ready now, with no backoff, timeout or key of its own: its columns after the id.
_PLAIN_ROW = (
    f"t.queue, 'ready', t.priority, t.payload, 0, {_with_defaults(False)}, "
    "%(now)s, %(now)s, NULL::bigint, NULL::text, s.default_timeout_ms"
)
# Such jobs: four arrays.
_PLAIN = (
    f"t.id, {_PLAIN_ROW}",
    "%(queues)b::text[], %(priorities)b::int[], %(payloads)b::text[], %(max_attempts)b::int[]",
    "queue, priority, payload, max_attempts",
)
_ANY = (
    f"t.id, t.queue, t.state, t.priority, t.payload, 0, {_with_defaults(True)}, "
    "%(now)s, t.ready_at, t.run_at, t.key, coalesce(t.timeout, s.default_timeout_ms)",
    "%(queues)b::text[], %(states)b::text[], %(priorities)b::int[], %(payloads)b::text[], "
    "%(max_attempts)b::int[], %(kinds)b::text[], %(base_ms)b::bigint[], "
    "%(max_ms)b::bigint[], %(jitters)b::boolean[], %(ready_ats)b::bigint[], "
    "%(run_ats)b::bigint[], %(keys)b::text[], %(timeouts)b::bigint[]",
    "queue, state, priority, payload, max_attempts, kind, base_ms, max_ms, jitter, "
    "ready_at, run_at, key, timeout",
)
# (drawn, plain) -> the insert
_INSERTS = {
    (drawn, plain): _insert(*(_PLAIN if plain else _ANY), drawn)
    for drawn in (False, True)
    for plain in (False, True)
}
# One plain job whose id the insert draws, as a submit one at a time makes it: the same
# row as ``_INSERTS[True, True]`` makes of a one-element batch, from four values instead of
# arrays, and without the ordered CTE (one row comes back in its only order). Measured:
# a tenth less time and 8% less database CPU per transaction (docs/benchmarking.md,
# "One job, an insert of its own").
_INSERT_ONE = (
    f"INSERT INTO jobs ({_COLUMNS}) SELECT nextval('job_ids'), {_PLAIN_ROW} "
    "FROM (SELECT %(queue)s::text AS queue, %(priority)s::int AS priority, "
    "%(payload)s::text AS payload, %(max_attempts)s::int AS max_attempts) t "
    f"{_settings_join('queue = %(queue)s')} RETURNING id"
)
# The keys among these within their window, with their job's state (or, for a job
# deleted since, by a purge or a prune, the state it was deleted in).
_LIVE_KEYS = (
    "SELECT k.queue, k.key, k.job_id, coalesce(j.state, k.final_state) "
    "FROM unnest(%s::text[], %s::text[]) AS w(queue, key) JOIN idempotency_keys k "
    "ON k.queue = w.queue AND k.key = w.key LEFT JOIN jobs j ON j.id = k.job_id "
    "WHERE k.expires_at > %s AND coalesce(j.state, k.final_state) IS NOT NULL"
)
# Take keys for new jobs: a key whose window has passed is taken over; a live one (another
# server's, committed since we looked, or in flight: then this waits for its commit) is
# not, and is not returned.
_TAKE_KEYS = (
    "INSERT INTO idempotency_keys (queue, key, job_id, expires_at) "
    "SELECT queue, key, job_id, %(expires_at)s "
    "FROM unnest(%(queues)s::text[], %(keys)s::text[], %(ids)s::bigint[]) AS t(queue, key, job_id) "
    "ON CONFLICT (queue, key) DO UPDATE SET job_id = EXCLUDED.job_id, "
    "expires_at = EXCLUDED.expires_at, final_state = NULL "
    "WHERE idempotency_keys.expires_at <= %(now)s "
    "RETURNING queue, key"
)


# Unique keys (SubmitSpec.unique_key): their holders now, with what decides whether they
# still hold them.
_UNIQUE_HOLDERS = (
    "SELECT u.queue, u.key, u.job_id, u.unique_for, j.state, j.attempt "
    "FROM unnest(%s::text[], %s::text[]) AS w(queue, key) "
    "JOIN unique_keys u ON u.queue = w.queue AND u.key = w.key JOIN jobs j ON j.id = u.job_id"
)
# Take the keys no row holds; the others are decided under their rows' locks (a holder
# inserted by another server meanwhile: this waits for its commit, then finds it).
_TAKE_UNIQUE = (
    "INSERT INTO unique_keys (queue, key, job_id, unique_for) "
    "SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::text[]) "
    "ON CONFLICT (queue, key) DO NOTHING RETURNING queue, key"
)
_LOCK_UNIQUE = (
    "SELECT u.queue, u.key, u.job_id, u.unique_for FROM unnest(%s::text[], %s::text[]) "
    "AS w(queue, key) JOIN unique_keys u ON u.queue = w.queue AND u.key = w.key "
    "ORDER BY u.queue, u.key FOR UPDATE OF u"
)
# Rounds of taking unique keys whose holder rows vanish in between (a purge per round).
_TAKE_ATTEMPTS = 3
_MOVE_UNIQUE = "UPDATE unique_keys SET job_id = %s, unique_for = %s WHERE queue = %s AND key = %s"


def _duplicate(
    key: tuple[str, str],
    fresh: dict[tuple[str, str], int],
    committed: dict[tuple[str, str], SubmitResult],
) -> SubmitResult | tuple[int, bool] | None:
    """A submit's answer as a duplicate of the job that has ``key`` (idempotency or unique,
    per its maps): an earlier job of this batch (its index, and True), a committed job (its
    answer), or None."""
    if key in fresh:
        return fresh[key], True
    return committed.get(key)


class Jobs(PostgresBase):
    """Submit: part of ``PostgresStore``."""

    # -- submit ----------------------------------------------------------------------------

    @atomic
    def jobs_submit(
        self, specs: Sequence[SubmitSpec], now: int, *, alone: bool = False
    ) -> list[SubmitResult] | None:
        """Create jobs, all or none. A key seen within the window returns the first job.

        A repeated (queue, idempotency key) within the window, also within ``specs``,
        creates nothing and answers the first job's id and current state.

        ``alone``: always None, having written nothing. Every submit here takes ids from the
        sequence and moves the counts, which a transaction holds together.
        """
        if alone:
            return None
        results = self._submit(specs, now, None)
        assert results is not None
        return results

    @atomic
    def jobs_submit_later(self, specs: Sequence[SubmitSpec], now: int) -> Later:
        """``jobs_submit``, whose answers may come with the transaction's next round trip:
        jobs without keys draw their ids in their insert (``_insert``), which waits for
        it, rather than in a round trip of their own first."""
        later = Later()
        results = self._submit(specs, now, later)
        if results is not None:
            later.results = results
        return later

    def _submit(
        self, specs: Sequence[SubmitSpec], now: int, later: Later | None
    ) -> list[SubmitResult] | None:
        """``jobs_submit``'s answers; or None if they are to be ``later``'s, once the
        insert is sent (only with ``later``, for jobs without keys)."""
        keyed = {
            (spec.queue, encode_text(spec.idempotency_key))
            for spec in specs
            if spec.idempotency_key is not None
        }
        live = self._live_keys(keyed, now) if keyed else {}
        unique = {
            (spec.queue, encode_text(spec.unique_key))
            for spec in specs
            if spec.unique_key is not None
        }
        held = self._unique_holders(unique) if unique else {}
        # Per spec, a duplicate's answer or (index of its new job, duplicate within specs).
        answers: list[SubmitResult | tuple[int, bool]] = []
        new: list[SubmitSpec] = []
        new_keys: list[tuple[str, str] | None] = []
        new_uniques: list[tuple[str, str] | None] = []
        fresh: dict[tuple[str, str], int] = {}
        fresh_uniques: dict[tuple[str, str], int] = {}
        per_queue: dict[tuple[str, str], int] = {}
        for spec in specs:
            key = unique_key = None
            if spec.idempotency_key is not None:
                key = (spec.queue, encode_text(spec.idempotency_key))
            if spec.unique_key is not None:
                unique_key = (spec.queue, encode_text(spec.unique_key))
            # The idempotency key first, then the unique key (docs/protocol.md, submit).
            seen = (key and _duplicate(key, fresh, live)) or (
                unique_key and _duplicate(unique_key, fresh_uniques, held)
            )
            if seen:
                answers.append(seen)
                continue
            if key is not None:
                fresh[key] = len(new)
            if unique_key is not None:
                fresh_uniques[unique_key] = len(new)
            answers.append((len(new), False))
            new.append(spec)
            new_keys.append(key)
            new_uniques.append(unique_key)
            state = PENDING if spec.due_at(now) > now else READY
            per_queue[spec.queue, state] = per_queue.get((spec.queue, state), 0) + 1
        self._check_queues({queue for queue, _ in per_queue})
        self._check_depth(per_queue)
        if not new:
            return [answer for answer in answers if isinstance(answer, SubmitResult)]
        if later is not None and not keyed and not unique and now <= self._ids_fresh_until:
            self._submit_drawn(new, now, later)
            return None
        ids = self._next_ids(len(new), now)
        states = self._insert_jobs(new, ids, now)
        # New jobs that another server's job beat to their key: answered as its duplicate.
        lost: dict[int, SubmitResult] = {}
        if fresh:
            by_key = self._take_keys(new_keys, ids, now)
            lost = {i: by_key[key] for i, key in enumerate(new_keys) if key in by_key}
        if fresh_uniques:
            lost.update(self._take_uniques(new, new_uniques, ids, lost))
        if lost:
            # Never made, as SQLite never makes them: with their idempotency keys, which a
            # job that lost only its unique key took (a key outlives a job deleted
            # otherwise, and would answer for this one until its window ends).
            gone = [ids[i] for i in lost]
            self._write("DELETE FROM idempotency_keys WHERE job_id = ANY(%s)", (gone,))
            self._write("DELETE FROM jobs WHERE id = ANY(%s)", (gone,))
        results: list[SubmitResult] = []
        for answer in answers:
            if isinstance(answer, SubmitResult):
                results.append(answer)
                continue
            i, duplicate = answer
            if i in lost:
                results.append(lost[i])
            else:
                results.append(SubmitResult(f"job_{ids[i]:016x}", states[i], duplicate))
        made = [i for i in range(len(new)) if i not in lost]
        self._made([new[i] for i in made], [states[i] for i in made], now)
        if self.recording:  # (a duplicate created nothing: no event)
            self.changes.events += [
                (f"job_{ids[i]:016x}", new[i].queue, states[i].value, 0, now, None) for i in made
            ]
        return results

    def _submit_drawn(self, specs: list[SubmitSpec], now: int, later: Later) -> None:
        """Make a job of each spec (none has a key), their ids drawn by the insert; the
        answers, and the events, filled in as its result comes back. The events' places
        are taken now, so that they keep their order among the transaction's."""
        events = self.changes.events
        first = len(events)
        recording = self.recording
        if recording:
            events += [None] * len(specs)  # type: ignore[list-item]

        def made(result: Result) -> None:
            ids = [row[0] for row in result]
            self._ids_fresh_until = max(self._ids_fresh_until, _fresh_until(ids[-1]))
            later.results = [
                SubmitResult(f"job_{key:016x}", state, False)
                for key, state in zip(ids, states, strict=True)
            ]
            if recording:
                events[first : first + len(ids)] = [
                    (f"job_{key:016x}", spec.queue, state.value, 0, now, None)
                    for key, spec, state in zip(ids, specs, states, strict=True)
                ]

        states = self._insert_jobs(specs, None, now, made)
        self._made(specs, states, now)

    def _made(self, specs: list[SubmitSpec], states: list[JobState], now: int) -> None:
        """Count the jobs just made of ``specs``, in ``states``, and say whom they wake."""
        moves: Counter[tuple[str, str]] = Counter()
        for spec, state in zip(specs, states, strict=True):
            moves[spec.queue, state] += 1
            if state is READY:
                self.changes.ready_queues.add(spec.queue)
            else:
                self.changes.due(spec.due_at(now))
        for (queue, state), n in moves.items():
            self._move(queue, None, state, n)
            self._count(queue, "submitted", n, now)

    def _live_keys(
        self, keys: set[tuple[str, str]], now: int
    ) -> dict[tuple[str, str], SubmitResult]:
        """The duplicate answer of each of ``keys`` that names a job within its window."""
        ordered = sorted(keys)
        rows = self._read(
            _LIVE_KEYS, ([queue for queue, _ in ordered], [key for _, key in ordered], now)
        )
        return {
            (queue, key): SubmitResult(f"job_{job:016x}", JobState(state), True)
            for queue, key, job, state in rows
        }

    def _next_ids(self, n: int, now: int) -> list[int]:
        """``n`` new job ids, ascending (see ID_LAG_MS)."""
        ids = [row[0] for row in self._read(_NEXT_IDS, (n,))]
        floor = now << ID_SEQ_BITS
        if ids[0] < floor - _ID_LAG // 2:
            self._read("SELECT pg_advisory_xact_lock(%s)", (ID_LOCK,))
            self._read(_CATCH_UP, (floor, floor - _ID_LAG // 2))
            ids = [row[0] for row in self._read(_NEXT_IDS, (n,))]
        ids.sort()
        self._ids_fresh_until = max(self._ids_fresh_until, _fresh_until(ids[-1]))
        return ids

    def _insert_jobs(
        self,
        specs: list[SubmitSpec],
        ids: list[int] | None,
        now: int,
        then: Callable[[Result], None] | None = None,
    ) -> list[JobState]:
        """Insert one job per spec, with these ids (None: drawn by the insert, which
        ``then`` is given the result of: ``_insert``); return their states. What a spec
        left out (None) the statement fills in (``_defaults``)."""
        plain = all(
            spec.idempotency_key is None
            and spec.timeout_ms is None
            and spec.run_at is None
            and not spec.delay_ms
            and spec.backoff is None
            for spec in specs
        )
        if plain and ids is None and len(specs) == 1:
            (spec,) = specs
            one = {
                "now": now,
                "queue": spec.queue,
                "priority": int(spec.priority),
                "payload": spec.payload,
                "max_attempts": spec.max_attempts,
            }
            self._write_later(_INSERT_ONE, one, then)
            return [READY]
        params: dict[str, Any] = {
            "now": now,
            "queues": [spec.queue for spec in specs],
            "priorities": [int(spec.priority) for spec in specs],
            "payloads": [spec.payload for spec in specs],
            "max_attempts": [spec.max_attempts for spec in specs],
        }
        if ids is not None:
            params["ids"] = ids
        insert = _INSERTS[ids is None, plain]
        if plain:  # the common batch: four arrays, not thirteen
            self._write_later(insert, params, then)
            return [READY] * len(specs)
        states: list[JobState] = []
        ready_ats: list[int | None] = []
        run_ats: list[int | None] = []
        for spec in specs:
            due = spec.due_at(now)
            if due > now:
                states.append(PENDING)
                ready_ats.append(None)
                run_ats.append(due)
            else:
                states.append(READY)
                ready_ats.append(now)
                run_ats.append(spec.run_at)
        backoffs = [spec.backoff for spec in specs]
        params.update(
            states=[state.value for state in states],
            kinds=[None if backoff is None else backoff.kind for backoff in backoffs],
            base_ms=[None if backoff is None else backoff.base_ms for backoff in backoffs],
            max_ms=[None if backoff is None else backoff.max_ms for backoff in backoffs],
            jitters=[None if backoff is None else bool(backoff.jitter) for backoff in backoffs],
            ready_ats=ready_ats,
            run_ats=run_ats,
            keys=[
                None if spec.idempotency_key is None else encode_text(spec.idempotency_key)
                for spec in specs
            ],
            timeouts=[spec.timeout_ms for spec in specs],
        )
        self._write_later(insert, params, then)
        return states

    def _take_keys(
        self, keys: list[tuple[str, str] | None], ids: list[int], now: int
    ) -> dict[tuple[str, str], SubmitResult]:
        """Take the idempotency keys of the new jobs; return the keys that another server
        took first (each with the answer for its job), whose jobs the caller deletes."""
        taken = sorted((key, job) for key, job in zip(keys, ids, strict=True) if key is not None)
        # In (queue, key) order: two servers taking the same keys wait in the same order.
        rows = self._write(
            _TAKE_KEYS,
            {
                "expires_at": now + self.config.idempotency_window_ms,
                "queues": [queue for (queue, _), _ in taken],
                "keys": [key for (_, key), _ in taken],
                "ids": [job for _, job in taken],
                "now": now,
            },
        ).fetchall()
        if len(rows) == len(taken):
            return {}
        won = {(queue, key) for queue, key in rows}
        lost = {key: job for key, job in taken if key not in won}
        found = self._live_keys(set(lost), now)
        if len(found) != len(lost):
            # The other server's job held the key within its window (else it would have
            # been taken over), and a key outlives its job within its window.
            raise RuntimeError("an idempotency key was taken by a job that is gone since")
        return found

    def _unique_holders(self, keys: set[tuple[str, str]]) -> dict[tuple[str, str], SubmitResult]:
        """The duplicate answer of each of ``keys`` whose job still holds it."""
        ordered = sorted(keys)
        rows = self._read(
            _UNIQUE_HOLDERS, ([queue for queue, _ in ordered], [key for _, key in ordered])
        )
        return {
            (queue, key): SubmitResult(f"job_{job:016x}", JobState(state), True)
            for queue, key, job, unique_for, state, attempt in rows
            if unique_key_held(unique_for, state, attempt)
        }

    def _take_uniques(
        self,
        specs: list[SubmitSpec],
        keys: list[tuple[str, str] | None],
        ids: list[int],
        lost: dict[int, SubmitResult],
    ) -> dict[int, SubmitResult]:
        """Take the unique keys of the new jobs (those not already ``lost``): a key no
        row holds, or whose holder is out of its scope, goes to the new job; a key that a
        job of another server holds (committed since ``_unique_holders`` looked) makes the
        new job its duplicate. Returns the new jobs so lost, by index."""
        wanted = sorted((key, i) for i, key in enumerate(keys) if key is not None and i not in lost)
        if not wanted:
            return {}
        beaten: dict[int, SubmitResult] = {}
        for _ in range(_TAKE_ATTEMPTS):
            rows = self._write(
                _TAKE_UNIQUE,
                (
                    [queue for (queue, _), _ in wanted],
                    [name for (_, name), _ in wanted],
                    [ids[i] for _, i in wanted],
                    [specs[i].unique_for for _, i in wanted],
                ),
            ).fetchall()
            taken = {(queue, key) for queue, key in rows}
            rest = [(key, i) for key, i in wanted if key not in taken]
            if not rest:
                return beaten
            # Locked in (queue, key) order, as taken: two servers wait for each other in
            # one order. Once locked, a holder's job is committed, and the next statement
            # reads its state.
            locked = {
                (queue, key): (job, unique_for)
                for queue, key, job, unique_for in self._read(
                    _LOCK_UNIQUE, ([q for (q, _), _ in rest], [k for (_, k), _ in rest])
                )
            }
            jobs = {
                job: (state, attempt)
                for job, state, attempt in self._read(
                    "SELECT id, state, attempt FROM jobs WHERE id = ANY(%s)",
                    ([job for job, _ in locked.values()],),
                )
            }
            wanted = []
            for key, i in rest:
                if key not in locked:  # its holder went since (purged): take it again
                    wanted.append((key, i))
                    continue
                job, unique_for = locked[key]
                state, attempt = jobs[job]
                if unique_key_held(unique_for, state, attempt):
                    beaten[i] = SubmitResult(f"job_{job:016x}", JobState(state), True)
                else:  # its holder has left the scope: the key is the new job's
                    self._write(_MOVE_UNIQUE, (ids[i], specs[i].unique_for, *key))
            if not wanted:
                return beaten
        raise RuntimeError("a unique key changed hands too often while a submit took it")

    def _check_depth(self, per_queue: dict[tuple[str, str], int]) -> None:
        """Refuse (QueueFull) new jobs that would take a queue past its limit.

        The depth is the sum of every server's committed counts and this transaction's
        moves, so across servers the limit is soft: two servers committing at once may
        each see room for their own jobs and together pass it by their batches."""
        if self.config.max_depth is None and not self.config.queue_depths:
            return
        new: Counter[str] = Counter()
        for (queue, _state), n in per_queue.items():
            new[queue] += n
        limits = {queue: self.config.depth_limit(queue) for queue in new}
        bounded = sorted(queue for queue, limit in limits.items() if limit is not None)
        if not bounded:
            return
        counts = self._counts(bounded)
        for queue, n in new.items():
            limit = limits[queue]
            if limit is None:
                continue
            depth = sum(counts[(queue, state)] for state in UNFINISHED)
            if depth + n > limit:
                raise QueueFull(f"queue {queue} holds {depth} unfinished jobs (max {limit})")
