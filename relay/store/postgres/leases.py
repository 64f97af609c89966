"""The transitions of a lease on PostgreSQL: claim (one or many claims), renew, ack (one
or many), fail and release, the check of a held lease, and their statements.

The rules are SqliteStore's (relay/store/sqlite/leases.py); what differs is how they hold
when several servers write at once. A claim locks its candidates with ``FOR UPDATE SKIP
LOCKED``, so a job another server is leasing is skipped, never waited for and never leased
twice; a command on a held lease locks the job's row before it checks the token.

Batches are a few statements whatever their size: many rows go in as arrays (``unnest``),
and each statement is prepared at its first run (pipe.py), since their texts do not vary.
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.protocol.errors import RelayError
from relay.protocol.model import (
    TIMEOUT_GRACE_MS,
    AttemptOutcome,
    Backoff,
    FailOutcome,
    Lease,
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
    SETTINGS_COLUMNS,
    SUCCEEDED,
    ClaimArgs,
    QueueSettings,
    check_lease,
)
from relay.store.postgres.base import PostgresBase
from relay.store.postgres.sql import atomic, encode_text, opaque

# The oldest ready jobs of each (queue, priority class), locked, skipping the ones other
# servers have locked: the only candidates, since within a class the oldest job has both
# the earliest ready time and the most aging. Each class is an index scan of jobs_ready.
# A queue paused (a row of queue_settings, committed when the statement starts, by any
# server) is left out before its jobs are looked at: one primary-key probe per queue asked,
# which also says whether the queue has a limit (each row's last field).
#
# Each candidate also carries what its lease answers (locked, so it stays so until the
# claim's update): its attempt so far, max_attempts, its schedule's slot, and its payload
# if at most SMALL_PAYLOAD bytes (else NULL): a claim whose jobs all have theirs needs no
# result of its update, which then goes with the commit (``_write_later``). A larger one
# is read by the update, as it is taken, and never for a candidate left: a claim reads
# a large payload once, as before.
SMALL_PAYLOAD = 8192
_CANDIDATES = (
    "SELECT j.id, j.priority, j.ready_at, j.size, j.queue, j.timeout_ms, q.limited, "
    "j.attempt, j.max_attempts, j.scheduled_for, j.small "
    "FROM (SELECT u.queue, "
    "coalesce(s.max_leased IS NOT NULL OR s.rate_limit IS NOT NULL, false) AS limited "
    f"FROM unnest({opaque('%b::text[]')}) AS u(queue) "
    "LEFT JOIN queue_settings s ON s.queue = u.queue "
    "WHERE s.paused IS NOT TRUE) AS q "
    "CROSS JOIN unnest(ARRAY[3, 2, 1, 0]) AS p(priority) "
    "CROSS JOIN LATERAL (SELECT id, priority, ready_at, octet_length(payload) AS size, queue, "
    "timeout_ms, attempt, max_attempts, scheduled_for, CASE WHEN octet_length(payload) <= "
    f"{SMALL_PAYLOAD} THEN payload END AS small "
    "FROM jobs WHERE state = 'ready' AND queue = q.queue AND priority = p.priority "
    f"ORDER BY ready_at, id LIMIT {opaque('%s::bigint')} FOR UPDATE SKIP LOCKED) AS j"
)
# The limited queues among those asked, locked, with their rate windows; skipping those
# another transaction holds: a claim never waits for a lock (so never deadlocks and never
# stalls its writer), and takes nothing this time from a limited queue it could not lock.
# A claim that meets a limited queue's candidate takes these locks, for every limited
# queue it asks for, and holds them to its end, so the claims of a limited queue take
# turns across servers, each counting the leases of those before it (the counts it reads
# next are committed with them).
_LOCK_LIMITS = (
    f"SELECT {SETTINGS_COLUMNS}, rate_window_start, rate_window_count FROM queue_settings "
    "WHERE queue = ANY(%s) AND (max_leased IS NOT NULL OR rate_limit IS NOT NULL) "
    "ORDER BY queue FOR UPDATE SKIP LOCKED"
)
_SET_WINDOW = (
    "UPDATE queue_settings SET rate_window_start = %s, rate_window_count = %s WHERE queue = %s"
)
# A batch's rows: four arrays of these types, their lengths unseen by the planner.
_ARRAYS = "unnest(" + ", ".join(opaque("%b::{}[]") for _ in range(4)) + ")"
# The attempt starts now (``leased_at``); a job with an execution timeout gets its
# attempt's deadline (its expiry is already no later than that: claims.grant).
_CLAIM = (
    "UPDATE jobs SET state = 'leased', attempt = jobs.attempt + 1, lease_token = v.token, "
    "lease_worker = v.worker, lease_expires_at = v.expires_at, leased_at = %s, "
    "deadline_at = CASE WHEN "
    f"jobs.timeout_ms IS NULL THEN NULL ELSE %s + jobs.timeout_ms + {TIMEOUT_GRACE_MS} END "
    f"FROM {_ARRAYS.format('bigint', 'text', 'text', 'bigint')} "
    "AS v(id, token, worker, expires_at) WHERE jobs.id = v.id"
)
# The same, for a claim that took a job whose payload its candidate left out.
_CLAIM_READ = _CLAIM + " RETURNING jobs.id, jobs.payload"

# The columns ``check_lease`` reads, in its order.
_LEASE_COLUMNS = (
    "id, queue, state, attempt, max_attempts, lease_token, lease_worker, "
    "lease_expires_at, backoff_kind, backoff_base_ms, backoff_max_ms, backoff_jitter, "
    "deadline_at, leased_at, attempts_ended"
)
_LEASE_ROW = f"SELECT {_LEASE_COLUMNS} FROM jobs WHERE id = %s FOR UPDATE"
# In id order: two servers locking the same rows lock them in the same order.
_LEASE_ROWS = f"SELECT {_LEASE_COLUMNS} FROM jobs WHERE id = ANY(%s) ORDER BY id FOR UPDATE"
# The acks (id order) whose token and worker hold their job's unexpired lease complete it.
# Each row is found by its primary key, in the order given (a nested loop over the
# array): the state and the expiry are written as expressions that no index serves, as
# jobs_leased otherwise would, and the planner then hashes every leased job (measured:
# all 5,000 read to ack 64).
_ACK_HELD = (
    "UPDATE jobs SET state = 'succeeded', finished_at = %s, result = v.result, "
    f"lease_expires_at = NULL FROM {_ARRAYS.format('bigint', 'text', 'text', 'text')} "
    "AS v(id, worker, token, result) WHERE jobs.id = v.id AND (jobs.state || '') = 'leased' "
    "AND jobs.lease_token = v.token AND jobs.lease_worker = v.worker "
    "AND jobs.lease_expires_at + 0 > %s "
    "RETURNING jobs.id, jobs.queue, jobs.attempt, jobs.leased_at"
)
# A failed attempt: its row in the history (its start and worker from the lease's row),
# its error on the job and one more ended attempt counted, in one statement.
_FAILED = (
    "WITH e AS (INSERT INTO job_errors (job_id, attempt, error, at, traceback, started_at, "
    "worker, outcome) VALUES (%(id)s, %(attempt)s, %(error)s, %(now)s, %(traceback)s, "
    "%(started_at)s, %(worker)s, 'failed') RETURNING job_id, error) "
    "UPDATE jobs SET {changes}, last_error = e.error, lease_expires_at = NULL, "
    "attempts_ended = jobs.attempts_ended + 1 FROM e WHERE jobs.id = e.job_id"
)
_FAILED_RETRYING = _FAILED.format(changes="state = 'retrying', run_at = %(at)s")
_FAILED_DEAD = _FAILED.format(changes="state = 'dead', finished_at = %(at)s")


class Leases(PostgresBase):
    """Claim, renew, ack, fail, release: part of ``PostgresStore``."""

    def jobs_claim(
        self,
        queues: Sequence[str],
        worker_id: str,
        count: int,
        lease_ms: int,
        now: int,
        max_bytes: int | None = None,
    ) -> list[Lease]:
        """Lease up to ``count`` ready jobs from ``queues``, best effective priority first
        (see ``SqliteStore.jobs_claim``). Jobs that another server is leasing at this
        moment are skipped, never waited for."""
        return self.jobs_claim_many([(queues, worker_id, count, lease_ms, max_bytes)], now)[0]

    @atomic
    def jobs_claim_many(self, claims: Sequence[ClaimArgs], now: int) -> list[list[Lease]]:
        """Many claims (each the arguments of ``jobs_claim``): one statement per set of
        queues for the candidates, and one update for all the leases.

        The outcome is that of ``SqliteStore.jobs_claim_many`` among the jobs no other
        server holds locked: claims grouped by their set of queues, the groups in the order
        they first appear (among the claims that ask for at least one job), the claims of
        a group in the order given; each takes the best jobs the ones before it left.
        Candidates this transaction locked but did not lease stay locked until it ends,
        and other servers skip them meanwhile.
        """

        self._expiry_told.now = max(self._expiry_told.now, now)
        room: dict[str, int] = {}  # (filled once a limited queue's candidate is met)
        limited: dict[str, tuple[QueueSettings, tuple[int | None, int]]] | None = None
        seen: dict[str, set[int]] = {}  # limited queue -> its candidates (some stay ready?)

        def fetch(queues: tuple[str, ...], wanted: int) -> list:
            nonlocal limited
            rows = self._read(_CANDIDATES, (list(queues), wanted)).fetchall()
            if any([row[6] for row in rows]):
                if limited is None:
                    asked = sorted({q for claim in claims for q in claim[0]})
                    limited = self._lock_limits(asked, now, room)
                for row in rows:
                    if row[6] and row[4] not in room:
                        # Limited, but not locked here: another server's claim (or
                        # setting) holds it now, or it was limited after the lock.
                        room[row[4]] = 0
                    if row[4] in room:
                        seen.setdefault(row[4], set()).add(row[0])
            return rows

        chosen, found = claims_.choose(claims, now, fetch, room)
        if limited is not None:
            self._claimed_limited(limited, found, seen, room, now)
        if not found:
            return [[] for _ in claims]
        # Per claim: (key, token, worker, expiry); a candidate's timeout is its field 5.
        granted = claims_.grant(claims, chosen, now, found, 5)
        updates = [update for mine in granted for update in mine]
        params = (
            now,  # the attempt's start
            now,
            [u[0] for u in updates],
            [u[1] for u in updates],
            [encode_text(u[2]) for u in updates],
            [u[3] for u in updates],
        )
        payloads = {key: candidate[10] for key, candidate in found.items()}
        if None in payloads.values():  # (a large payload: read as the job is taken)
            payloads.update(self._write(_CLAIM_READ, params).fetchall())
        else:
            self._write_later(_CLAIM, params)
        per_queue: dict[str, int] = {}
        results: list[list[Lease]] = []
        for claim, mine in zip(claims, granted, strict=True):
            leases = []
            for key, token, _worker, expires_at in mine:
                candidate = found[key]
                _, priority, _, _, queue, timeout, _limited, attempt, max_attempts, slot = (
                    candidate[:10]
                )
                leases.append(
                    Lease(
                        f"job_{key:016x}", queue, payloads[key], priority, attempt + 1,
                        max_attempts, token, expires_at, timeout, slot,
                    )
                )  # fmt: skip
                if timeout is not None:
                    self.changes.expiry(expires_at)  # (perhaps before the claim's, below)
                per_queue[queue] = per_queue.get(queue, 0) + 1
            if leases:
                self.changes.expiry(now + claim[3])  # one expiry for all of a claim's leases
            results.append(leases)
        for queue, n in per_queue.items():
            self._move(queue, READY, LEASED, n)
            self._count(queue, "leased", n)
        self._observe_claimed(list(found.values()), 4, 2, now)  # (its history)
        if self.recording:  # claim by claim
            self.changes.events += [
                (lease.job_id, lease.queue, "leased", lease.attempt, now, "ready")
                for leases in results
                for lease in leases
            ]
        return results

    def _lock_limits(
        self, queues: list[str], now: int, room: dict[str, int]
    ) -> dict[str, tuple[QueueSettings, tuple[int | None, int]]]:
        """Lock the settings of the limited ``queues``; put in ``room`` how many jobs each
        may lease now (its limit less its jobs leased, over every server and with this
        transaction's claims; its rate window's room). Returns each one's settings and
        window."""
        limited = {
            row[0]: (QueueSettings.from_row(row[:8]), (row[8], row[9]))
            for row in self._read(_LOCK_LIMITS, (queues,)).fetchall()
        }
        counts = self._counts(list(limited)) if limited else {}
        for queue, (settings, window) in limited.items():
            leased = counts.get((queue, LEASED), 0)
            room[queue] = claims_.room_for(settings, leased, window, now)
        return limited

    def _claimed_limited(
        self,
        limited: dict[str, tuple[QueueSettings, tuple[int | None, int]]],
        found: dict[int, Sequence],
        seen: dict[str, set[int]],
        room: dict[str, int],
        now: int,
    ) -> None:
        """After a claim that locked ``limited`` queues and leased ``found``: each rate
        window counts its leases; one left full (and open) while some of its queue's
        candidates (``seen``) stayed ready waits for its end (as in SQLite). A queue left
        with room and candidates is reported as having ready jobs: a claim on another
        server that found it locked (and leased none of it) may be parked on it."""
        leased: dict[str, int] = {}
        for candidate in found.values():
            leased[candidate[4]] = leased.get(candidate[4], 0) + 1
        for queue, (settings, window) in limited.items():
            n = leased.get(queue, 0)
            unleased = len(seen.get(queue, ())) - n
            if unleased > 0 and room.get(queue, 0) > 0:
                self.changes.made_ready(queue, min(unleased, room[queue]))
            rate = settings.rate
            if rate is None:
                continue
            after = self._rate_waits.after_claim(
                queue, rate, window, now, n, unleased, self.changes
            )
            if after is not None:
                self._write(_SET_WINDOW, (*after, queue))

    def _held_lease(
        self, job_id: str, worker_id: str, token: str, now: int, operation: str
    ) -> tuple | None:
        """The job row, locked, if ``token`` and ``worker_id`` hold its unexpired lease.

        Returns None for an ack repeated with the token that completed the job.

        Raises:
            JobNotFound, StaleToken, LeaseExpired: and changes nothing.
        """
        key = parse_job_id(job_id)
        row = None
        if key is not None:
            row = self._read(_LEASE_ROW, (key,)).fetchone()
        return check_lease(row, job_id, encode_text(worker_id), token, now, operation)

    @atomic
    def lease_renew(self, job_id: str, worker_id: str, token: str, lease_ms: int, now: int) -> int:
        """Extend a held lease to now + ``lease_ms``, or to its attempt's deadline if that
        comes first (an execution timeout); return the new expiry."""
        row = self._held_lease(job_id, worker_id, token, now, "renew")
        assert row is not None
        self._expiry_told.now = max(self._expiry_told.now, now)
        expires_at = now + lease_ms
        if row[12] is not None and row[12] < expires_at:  # no later than its deadline
            expires_at = row[12]
        self._write_later(
            "UPDATE jobs SET lease_expires_at = %s WHERE id = %s", (expires_at, row[0])
        )
        self.changes.expiry(expires_at)
        return expires_at

    @atomic
    def jobs_ack(
        self, job_id: str, worker_id: str, token: str, result: str | None, now: int
    ) -> None:
        """Complete a job. Repeating the ack with the completing token is answered ok."""
        [refused] = self.jobs_ack_many([(job_id, worker_id, token, result)], now)
        if refused is not None:
            raise refused

    @atomic
    def jobs_ack_many(
        self, acks: Sequence[tuple[str, str, str, str | None]], now: int
    ) -> list[RelayError | None]:
        """Ack many jobs (job_id, worker_id, token, result) with one statement: each ack's
        outcome (None, or the ``RelayError`` that refuses it), as if each had been acked on
        its own. Raises ValueError, having changed nothing, if one job appears twice.

        The update completes the jobs whose lease its ack holds (``_ACK_HELD``: it locks
        each row, waits for another server's transaction that holds it, then checks the
        row as committed, as ``check_lease`` does); only the others are read (locked), to
        find why each is refused, or that it repeats the completing ack."""
        keys = [parse_job_id(job_id) for job_id, *_ in acks]
        known = [key for key in keys if key is not None]  # (a malformed id: not found)
        if len(set(known)) != len(known):
            raise ValueError("not a run of distinct job ids")
        # In id order: two servers locking the same rows lock them in the same order.
        held = sorted(
            (key, encode_text(worker_id), encode_text(token), result)
            for key, (_job_id, worker_id, token, result) in zip(keys, acks, strict=True)
            if key is not None
        )
        acked: dict[int, tuple[str, int]] = {}
        if held:
            params = [now, *([ack[i] for ack in held] for i in range(4)), now]
            cursor = self._write(_ACK_HELD, params)
            acked = {key: (queue, attempt, started) for key, queue, attempt, started in cursor}
        others = [key for key in known if key not in acked]
        rows = {row[0]: row for row in self._read(_LEASE_ROWS, (others,))} if others else {}
        per_queue: dict[str, int] = {}
        outcomes: list[RelayError | None] = []
        for key, (job_id, worker_id, token, _result) in zip(keys, acks, strict=True):
            if key in acked:
                outcomes.append(None)
                queue = acked[key][0]
                per_queue[queue] = per_queue.get(queue, 0) + 1
                continue
            try:
                row = check_lease(rows.get(key), job_id, encode_text(worker_id), token, now, "ack")
            except RelayError as exc:
                outcomes.append(exc)
                continue
            # None: an ack repeated with the completing token. (A lease held now that the
            # update found not held cannot be: no lease is granted to a token twice.)
            assert row is None, "a held lease the ack's update passed over"
            outcomes.append(None)
        for queue, n in per_queue.items():
            self._move(queue, LEASED, SUCCEEDED, n)
            self._count(queue, "acked", n, now)
        if acked:  # (their history)
            done = [key for key in keys if key in acked]
            self._observe_ended(
                [acked[key][0] for key in done], [acked[key][2] for key in done], now
            )
            if self.recording:
                for key in done:
                    queue, attempt, _started = acked[key]
                    self._record(key, queue, "leased", "succeeded", attempt, now)
        return outcomes

    @atomic
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
        """Record a failed attempt: retrying after its backoff, or dead when spent (the
        texts truncated as ``SqliteStore.jobs_fail`` says)."""
        row = self._held_lease(job_id, worker_id, token, now, "fail")
        assert row is not None
        key, queue, _state, attempt, max_attempts = row[:5]
        if traceback:
            traceback = encode_text(truncate_utf8_end(traceback, self.config.max_traceback_bytes))
        params = {
            "id": key,
            "attempt": attempt,
            "error": encode_text(truncate_utf8(error, self.config.max_error_bytes)),
            "now": now,
            "traceback": traceback or None,
            "started_at": row[13],
            "worker": row[6],
        }
        self._count(queue, "failed", 1, now)
        self._observe_ended([queue], [row[13]], now)
        if retryable and attempt < max_attempts:
            backoff = Backoff(row[8], row[9], row[10], bool(row[11]))
            retry_at = now + backoff.delay_ms(attempt, self._rng)
            self._write_later(_FAILED_RETRYING, {**params, "at": retry_at})
            self._failed_trim(key, row[14])
            self._move(queue, LEASED, RETRYING)
            self._count(queue, "retried")
            self.changes.due(retry_at)
            if self.recording:
                self._record(key, queue, "leased", "retrying", attempt, now)
            return FailOutcome(RETRYING, retry_at)
        self._write_later(_FAILED_DEAD, {**params, "at": now})
        self._failed_trim(key, row[14])
        self._move(queue, LEASED, DEAD)
        self._count(queue, "dead", 1, now)
        if self.recording:
            self._record(key, queue, "leased", "dead", attempt, now)
        return FailOutcome(DEAD, None)

    def _failed_trim(self, key: int, ended: int) -> None:
        """After a fail's row: the oldest rows go once the job's history passes its bound
        (``ended``: its ended attempts before this one)."""
        if ended >= ATTEMPTS_KEPT:
            self._trim_history([key])

    @atomic
    def jobs_release(self, job_id: str, worker_id: str, token: str, now: int) -> None:
        """Give a leased job back at once; its attempt counter returns to the value it had
        before this lease, and it keeps its place (ready_at) in the queue."""
        row = self._held_lease(job_id, worker_id, token, now, "release")
        assert row is not None
        self._end_leases([row[0]], AttemptOutcome.RELEASED.value, "", now)
        self._write(
            "UPDATE jobs SET state = 'ready', attempt = attempt - 1, lease_expires_at = NULL "
            "WHERE id = %s",
            (row[0],),
        )
        self._move(row[1], LEASED, READY)
        self.changes.ready_queues.add(row[1])
        if self.recording:  # the attempt given back
            self._record(row[0], row[1], "leased", "ready", row[3] - 1, now)
