"""The transitions of a lease as SQLite: claim (one or many claims), renew, ack (one or
many), fail and release, the check of a held lease, and their statements.

These are hot paths (``jobs_claim_many``, ``jobs_ack_many``): each touches many rows in a
few statements (see sql.py), and their per-job Python is written out where profiles
showed it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from relay.protocol.errors import RelayError
from relay.protocol.model import (
    TIMEOUT_GRACE_MS,
    AttemptOutcome,
    Backoff,
    FailOutcome,
    Lease,
    format_job_id,
    parse_job_id,
    truncate_utf8,
    truncate_utf8_end,
)
from relay.store import claims as claims_
from relay.store.base import (
    ATTEMPTS_KEPT,
    DEAD,
    LEASED,
    READY,
    RETRYING,
    SUCCEEDED,
    ClaimArgs,
    check_lease,
)
from relay.store.sqlite.sql import (
    _INSERT_ERROR,
    _JSON_IDS,
    _PRIORITIES_HIGH_FIRST,
    HELD_MAX,
    INLINE_CANDIDATES,
    SqliteBase,
    _claim_candidates_sql,
    _execute_rows,
    _json_ids,
    _json_rows,
)

log = logging.getLogger("relay.store")

_ACK_ROW = "(?, ?, ?, ?)"
_FAILED, _RELEASED = AttemptOutcome.FAILED.value, AttemptOutcome.RELEASED.value
_new_lease = tuple.__new__  # (a NamedTuple's own __new__ is a Python function)

# A job's lease row: the columns ``check_lease`` reads, in its order, then the backoff.
_LEASE_COLUMNS = (
    "id, queue, state, attempt, max_attempts, lease_token, lease_worker, "
    "lease_expires_at, backoff_kind, backoff_base_ms, backoff_max_ms, backoff_jitter, "
    "deadline_at, leased_at, attempts_ended"
)
# The same for many jobs, as one row of JSON, without the backoff (what acks need).
_ACK_ROWS_SQL = (
    "SELECT json_group_array(json_array(id, queue, state, attempt, max_attempts, lease_token, "
    f"lease_worker, lease_expires_at, leased_at)) FROM jobs WHERE id IN {_JSON_IDS}"
)
# Acks the jobs whose lease the (token, worker) holds unexpired, and only those: the
# condition of ``check_lease`` accepting, as SQL (jobs_ack_many checks it first as well).
_ACK_HELD = (
    "UPDATE jobs SET state = 'succeeded', finished_at = ?1, result = v.column4, "
    "lease_expires_at = NULL FROM (VALUES {values}) AS v WHERE jobs.id = v.column1 "
    "AND jobs.state = 'leased' AND jobs.lease_token = v.column2 "
    "AND jobs.lease_worker = v.column3 AND jobs.lease_expires_at > ?1"
)
_LEASE_ROW_SQL = f"SELECT {_LEASE_COLUMNS} FROM jobs WHERE "

# One statement leases a chunk of jobs, each with its own token, worker and expiry.
# ?1 is now, the attempt's start: a job with an execution timeout gets its attempt's
# deadline (its expiry, column4, is already no later than that: claims.grant).
_CLAIM_UPDATE = (
    "UPDATE jobs SET state = 'leased', attempt = attempt + 1, lease_token = v.column2, "
    "lease_worker = v.column3, lease_expires_at = v.column4, leased_at = ?1, "
    "deadline_at = CASE WHEN "
    f"timeout_ms IS NULL THEN NULL ELSE ?1 + timeout_ms + {TIMEOUT_GRACE_MS} END "
    "FROM (VALUES {values}) AS v WHERE jobs.id = v.column1"
)
_CLAIMED_PAYLOADS_SQL = (
    f"SELECT json_group_array(json_array(id, payload)) FROM jobs WHERE id IN {_JSON_IDS}"
)


class SqliteLeases(SqliteBase):
    """Claim, renew, ack, fail, release: part of ``SqliteStore``."""

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

        A queue paused (as committed: ``_paused``, settings.py) is left out of every
        claim. The outcome is that of making the claims one after the other: grouped by
        their set of queues, the groups in the order they first appear (among the claims
        that ask for at least one job), the claims of a group in the order given; each
        takes the best jobs the ones before it left.
        """

        def fetch(queues: tuple[str, ...], wanted: int) -> list:
            params: list[object] = []
            for queue in queues:
                for priority in _PRIORITIES_HIGH_FIRST:
                    params += (queue, priority, wanted)
            inline = wanted * len(params) // 3 <= INLINE_CANDIDATES
            return _json_rows(self._db, _claim_candidates_sql(len(queues), inline), params)

        if self._paused:  # (none paused: this one test is all a claim pays for pausing)
            claims = claims_.without_paused(claims, self._paused)
        room = None
        if self._limited:  # (likewise for limits)
            room = self._claim_room(claims, now)
        chosen, found = claims_.choose(claims, now, fetch, room)
        if not found:
            if room is not None:
                self._claimed_limited({}, now)
            return [[] for _ in claims]
        # Per claim: (key, token, worker, expiry); a candidate's timeout is its field 8.
        granted = claims_.grant(claims, chosen, now, found, 8)
        updates = [update for mine in granted for update in mine]
        _execute_rows(self._db, _CLAIM_UPDATE, "(?, ?, ?, ?)", updates, (now,))
        missing = [key for key in found if found[key][7] is None]
        if missing:  # payloads that did not come with the candidates
            for key, payload in _json_rows(self._db, _CLAIMED_PAYLOADS_SQL, (_json_ids(missing),)):
                found[key][7] = payload
        per_queue: dict[str, int] = {}
        results: list[list[Lease]] = []
        book = self._held
        for claim, mine in zip(claims, granted, strict=True):
            leases = []
            for key, token, worker, expires_at in mine:
                _, priority, _, _, queue, attempt, max_attempts, payload, timeout, slot = found[key]
                job_id = f"job_{key:016x}"
                leases.append(
                    _new_lease(Lease, (
                        job_id, queue, payload, priority, attempt + 1, max_attempts, token,
                        expires_at, timeout, slot,
                    ))
                )  # fmt: skip
                if timeout is not None:
                    self.changes.expiry(expires_at)  # (perhaps before the claim's, below)
                per_queue[queue] = per_queue.get(queue, 0) + 1
                if len(book) < HELD_MAX:
                    book[job_id] = (key, token, worker, expires_at, queue, attempt + 1, now)
            if leases:
                self.changes.expiry(now + claim[3])  # one expiry for all of a claim's leases
            results.append(leases)
        for queue, n in per_queue.items():
            self._move(queue, READY, LEASED, n)
            self._count(queue, "leased", n)
        self._observe_claimed(list(found.values()), 4, 2, now)  # (its history)
        if room is not None:
            self._claimed_limited(per_queue, now)
        if self.recording:  # in the order of the update: claim by claim
            self.changes.events += [
                (lease.job_id, lease.queue, "leased", lease.attempt, now, "ready")
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
        return check_lease(row, job_id, worker_id, token, now, operation)

    def lease_renew(self, job_id: str, worker_id: str, token: str, lease_ms: int, now: int) -> int:
        """Extend a held lease to now + ``lease_ms``, or to its attempt's deadline if that
        comes first (an execution timeout); return the new expiry."""
        row = self._held_lease(job_id, worker_id, token, now, "renew")
        assert row is not None
        expires_at = now + lease_ms
        if row[12] is not None and row[12] < expires_at:  # no later than its deadline
            expires_at = row[12]
        self._db.execute("UPDATE jobs SET lease_expires_at = ? WHERE id = ?", (expires_at, row[0]))
        held_id = format_job_id(row[0])
        if (held := self._held.get(held_id)) is not None:
            self._held[held_id] = (*held[:3], expires_at, *held[4:])
        self.changes.expiry(expires_at)
        return expires_at

    def jobs_ack(
        self, job_id: str, worker_id: str, token: str, result: str | None, now: int
    ) -> None:
        """Complete a job. Repeating the ack with the completing token is answered ok."""
        refusal = self.jobs_ack_many([(job_id, worker_id, token, result)], now)[0]
        if refusal is not None:
            raise refusal

    def jobs_ack_many(
        self, acks: Sequence[tuple[str, str, str, str | None]], now: int
    ) -> list[RelayError | None]:
        """Ack many jobs (job_id, worker_id, token, result) with one update: each ack's
        outcome (None, or the ``RelayError`` that refuses it), as if each had been acked on
        its own. Which leases are held comes from the leases this store granted (``_held``,
        see sql.py), else from a read of the jobs' rows, checked as ``check_lease`` checks
        them; the update's condition is that of a held lease again, and what it changed is
        checked against what was expected. Raises ValueError, having changed nothing, if
        one job appears twice."""
        book = self._held
        outcomes: list[RelayError | None] = [None] * len(acks)
        updates: list[tuple] = []
        # (position, key, queue, attempt, job id, leased at) of each ack to make
        held: list[tuple] = []
        unknown: list[int] = []  # positions of the acks the book cannot vouch for
        for i, (job_id, worker_id, token, result) in enumerate(acks):
            lease = book.get(job_id)  # (key, token, worker, expires_at, queue, attempt, at)
            if lease is not None and lease[1] == token and lease[2] == worker_id and now < lease[3]:
                updates.append((lease[0], token, worker_id, result))
                held.append((i, lease[0], lease[4], lease[5], job_id, lease[6]))
            else:
                unknown.append(i)
        keys = [entry[1] for entry in held]
        if unknown:
            unknown_keys = [parse_job_id(acks[i][0]) for i in unknown]
            keys += [key for key in unknown_keys if key is not None]  # (malformed: not found)
        if len(set(keys)) != len(keys):
            raise ValueError("not a run of distinct job ids")
        if unknown:
            self._ack_unknown(acks, unknown, unknown_keys, now, outcomes, updates, held)
        if updates:
            before = self._db.total_changes
            _execute_rows(self._db, _ACK_HELD, _ACK_ROW, updates, (now,))
            if self._db.total_changes - before != len(updates):
                held = self._ack_checked(acks, held, now, outcomes)
            for entry in held:
                book.pop(entry[4], None)
        per_queue: dict[str, int] = {}
        for entry in held:
            per_queue[entry[2]] = per_queue.get(entry[2], 0) + 1
        for queue, n in per_queue.items():
            self._move(queue, LEASED, SUCCEEDED, n)
            self._count(queue, "acked", n, now)
        if held:  # (their history)
            self._observe_ended([e[2] for e in held], [e[5] for e in held], now)
        if self.recording:  # in the order of the acks
            for _i, key, queue, attempt, *_ in sorted(held):
                self._record(key, queue, "leased", "succeeded", attempt, now)
        return outcomes

    def _ack_unknown(
        self,
        acks: Sequence[tuple[str, str, str, str | None]],
        unknown: list[int],
        keys: list[int | None],
        now: int,
        outcomes: list[RelayError | None],
        updates: list[tuple],
        held: list[tuple],
    ) -> None:
        """The acks at ``unknown`` (their jobs' ``keys``), checked against their rows as
        they are: each is to be made (added to ``updates`` and ``held``) or answered in
        ``outcomes``."""
        ids = [key for key in keys if key is not None]
        rows = {row[0]: row for row in _json_rows(self._db, _ACK_ROWS_SQL, (_json_ids(ids),))}
        for i, key in zip(unknown, keys, strict=True):
            job_id, worker_id, token, result = acks[i]
            row = rows.get(key)
            try:
                if check_lease(row, job_id, worker_id, token, now, "ack") is None:
                    continue  # an ack repeated with the completing token: ok
            except RelayError as exc:
                outcomes[i] = exc
                continue
            assert row is not None and key is not None
            updates.append((key, token, worker_id, result))
            held.append((i, key, row[1], row[3], format_job_id(key), row[8]))  # (book's id)

    def _ack_checked(
        self,
        acks: Sequence[tuple[str, str, str, str | None]],
        held: list[tuple],
        now: int,
        outcomes: list[RelayError | None],
    ) -> list[tuple]:
        """After an update that acked fewer jobs than ``held``: the rows say which were
        acked (those now succeeded with the ack's token: only this store acks, and it
        forgets a lease as it acks it), and why the others were refused. Only a lease that
        ended without this store forgetting it (a bug) brings this about."""
        log.warning("ack.lease_book_stale: an ack found a lease ended that was taken as held")
        ids = [entry[1] for entry in held]
        rows = {row[0]: row for row in _json_rows(self._db, _ACK_ROWS_SQL, (_json_ids(ids),))}
        acked = []
        for entry in held:
            i, key = entry[0], entry[1]
            job_id, worker_id, token, _result = acks[i]
            self._held.pop(entry[4], None)
            row = rows.get(key)
            if row is not None and row[2] == SUCCEEDED and row[5] == token and row[6] == worker_id:
                acked.append(entry)
                continue
            try:
                check_lease(row, job_id, worker_id, token, now, "ack")
            except RelayError as exc:
                outcomes[i] = exc
                continue
            raise AssertionError(f"{job_id}: held, yet not acked")
        return acked

    def jobs_fail(
        self,
        job_id: str,
        worker_id: str,
        token: str,
        error: str,
        retryable: bool,
        now: int,
        traceback: str | None = None,
    ) -> FailOutcome:
        """Record a failed attempt: retrying after its backoff, or dead when spent. The
        error keeps its first ``max_error_bytes``, the traceback its last
        ``max_traceback_bytes`` (an empty one is none)."""
        row = self._held_lease(job_id, worker_id, token, now, "fail")
        assert row is not None
        key, queue, _state, attempt, max_attempts = row[:5]
        self._held.pop(format_job_id(key), None)
        error = truncate_utf8(error, self.config.max_error_bytes)
        if traceback:
            traceback = truncate_utf8_end(traceback, self.config.max_traceback_bytes)
        # The attempt's row (its start and worker from the lease's row), and one more
        # ended attempt counted in the job's update: the oldest row goes only past the bound.
        entry = (key, attempt, error, now, traceback or None, row[13], row[6], _FAILED)
        self._db.execute(_INSERT_ERROR, entry)
        if row[14] >= ATTEMPTS_KEPT:
            self._trim_history((key,))
        self._count(queue, "failed", 1, now)
        self._observe_ended([queue], [row[13]], now)
        if retryable and attempt < max_attempts:
            backoff = Backoff(row[8], row[9], row[10], bool(row[11]))
            retry_at = now + backoff.delay_ms(attempt, self._rng)
            self._db.execute(
                "UPDATE jobs SET state = 'retrying', run_at = ?, last_error = ?, "
                "lease_expires_at = NULL, attempts_ended = attempts_ended + 1 WHERE id = ?",
                (retry_at, error, key),
            )
            self._move(queue, LEASED, RETRYING)
            self._count(queue, "retried")
            self.changes.due(retry_at)
            if self.recording:
                self._record(key, queue, "leased", "retrying", attempt, now)
            return FailOutcome(RETRYING, retry_at)
        self._db.execute(
            "UPDATE jobs SET state = 'dead', finished_at = ?, last_error = ?, "
            "lease_expires_at = NULL, attempts_ended = attempts_ended + 1 WHERE id = ?",
            (now, error, key),
        )
        self._move(queue, LEASED, DEAD)
        self._count(queue, "dead", 1, now)
        if self.recording:
            self._record(key, queue, "leased", "dead", attempt, now)
        return FailOutcome(DEAD, None)

    def jobs_release(self, job_id: str, worker_id: str, token: str, now: int) -> None:
        """Give a leased job back at once; its attempt counter returns to the value it had
        before this lease, and it keeps its place (ready_at) in the queue."""
        row = self._held_lease(job_id, worker_id, token, now, "release")
        assert row is not None
        self._held.pop(format_job_id(row[0]), None)
        self._end_leases((row[0],), _RELEASED, "", now)
        self._db.execute(
            "UPDATE jobs SET state = 'ready', attempt = attempt - 1, lease_expires_at = NULL "
            "WHERE id = ?",
            (row[0],),
        )
        self._move(row[1], LEASED, READY)
        self.changes.ready_queues.add(row[1])
        if self.recording:  # the attempt given back
            self._record(row[0], row[1], "leased", "ready", row[3] - 1, now)
