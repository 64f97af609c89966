"""A Hypothesis state machine over the synchronous store against a small model.

The model is written from the wire contract (protocol.md) and the store's documented
semantics, never by asking the store what should happen. Where the
contract leaves a choice open (which of several equally ranked jobs a claim, promote,
reap or prune with a small limit takes), the test checks that the store's choice is one
of the allowed ones and then follows it.

The machine runs on both stores (``test_store_state_machine[sqlite]``, ``[postgres]``).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from relay.protocol.errors import (
    Cancelled,
    InvalidState,
    JobNotFound,
    LeaseExpired,
    QueueFull,
    StaleToken,
    Unauthorized,
)
from relay.protocol.model import (
    AGING_STEP_MS,
    UNIQUE_FOR,
    Backoff,
    JobState,
    Priority,
    unique_key_held,
)
from relay.protocol.model import SubmitSpec as Spec
from relay.store.base import StoreConfig
from tests.conftest import T0
from tests.store.conformance import Store, Stores, recovers_on_start, rows, scalar

PENDING, READY, LEASED = JobState.PENDING, JobState.READY, JobState.LEASED
RETRYING, SUCCEEDED, DEAD = JobState.RETRYING, JobState.SUCCEEDED, JobState.DEAD
CANCELLED = JobState.CANCELLED
# The states retention prunes from, and those that never change again.
PRUNED = (SUCCEEDED, CANCELLED)
TERMINAL = (SUCCEEDED, DEAD, CANCELLED)

QUEUES = ("alpha", "beta")
WORKERS = ("w1", "w2")
KEYS = ("k1", "k2")
UNIQUE_KEYS = ("u1", "u2")
# Ids that name no job: well-formed but never issued (the clock starts at T0), and malformed.
UNKNOWN_IDS = ("job_0000000000000001", "not-a-job")

LEASE_EXPIRED_ERROR = "lease expired"
RESTART_ERROR = "lease lost: the server restarted while the job was leased"

# Short windows so that idempotency keys expire and succeeded jobs are pruned within the
# few simulated minutes of one run (40 steps of at most 200 s each); one queue is bounded.
BETA_MAX_DEPTH = 6
CONFIG = StoreConfig(
    idempotency_window_ms=600_000,
    retention_ms=400_000,
    queue_depths={"beta": BETA_MAX_DEPTH},
)
UNFINISHED = (PENDING, READY, LEASED, RETRYING)
UNLIMITED = 1_000
TOKEN_RE = re.compile(r"[0-9a-f]{32,}")
JOB_ID_RE = re.compile(r"job_[0-9a-f]{16}")


@dataclass(frozen=True)
class IssuedLease:
    job_id: str
    worker: str
    token: str


@dataclass
class ModelJob:
    job_id: str
    queue: str
    priority: int
    payload: str
    max_attempts: int
    backoff: Backoff
    idempotency_key: str | None
    created_at: int
    state: JobState
    attempt: int = 0
    ready_at: int | None = None
    run_at: int | None = None
    finished_at: int | None = None
    result: str | None = None
    last_error: str | None = None
    errors: list[tuple[int, str, int]] = field(default_factory=list)
    # The last lease issued, kept for the tests even after it stops meaning anything.
    last_lease: IssuedLease | None = None
    # The last lease issued, if its token still means anything to the store.
    token: str | None = None
    worker: str | None = None
    lease_expires_at: int | None = None  # while leased
    # How the last lease ended: None (still held), "holder" (its own ack, fail or release),
    # "expired" (reaper or restart recovery, at `expired_at`), or "cancelled" (its job was
    # cancelled while leased: the token is answered Cancelled).
    lease_end: str | None = None
    expired_at: int | None = None
    # The number of full promote passes run when the job last became pending or retrying.
    waiting_since_promote: int = 0


def effective_priority(base: int, ready_at: int, now: int) -> int:
    # Written out here, not imported, so the model does not share the code under test.
    return min(int(Priority.CRITICAL), base + max(0, now - ready_at) // AGING_STEP_MS)


def backoff_bounds(backoff: Backoff, retry: int) -> tuple[int, int]:
    """The contract's wait before retry ``retry``: (least, most)."""
    if backoff.kind == "fixed":
        return backoff.base_ms, backoff.base_ms
    full = min(backoff.max_ms, backoff.base_ms * 2 ** (retry - 1))
    # "a uniformly random 50-100 %": never below half, also for an odd number of ms.
    return (-(-full // 2) if backoff.jitter else full), full


backoffs = st.one_of(
    st.integers(0, 5_000).map(Backoff.fixed),
    st.builds(
        lambda base, extra, jitter: Backoff("exponential", base, base + extra, jitter),
        st.integers(1, 2_000),
        st.integers(0, 8_000),
        st.booleans(),
    ),
)

specs = st.fixed_dictionaries(
    {
        "queue": st.sampled_from(QUEUES),
        "priority": st.sampled_from([int(p) for p in Priority]),
        # Mostly ready at once, so that claims find work.
        "delay_ms": st.one_of(st.just(0), st.just(0), st.integers(1, 300_000)),
        "retries": st.integers(0, 3),
        "backoff": backoffs,
        "key": st.one_of(st.none(), st.sampled_from(KEYS)),
        "unique": st.one_of(st.none(), st.none(), st.sampled_from(UNIQUE_KEYS)),
        "unique_for": st.sampled_from(UNIQUE_FOR),
    }
)


class StoreMachine(RuleBasedStateMachine):
    """The store against the model; ``now`` only moves forward."""

    def __init__(self, open_store: Callable[[], Store]) -> None:
        super().__init__()
        self.store = open_store()
        self.now = T0
        self.jobs: dict[str, ModelJob] = {}
        self.gone: list[str] = []  # ids of purged or pruned jobs
        # The state each was deleted in: its idempotency key, until it expires, answers
        # with it.
        self.gone_states: dict[str, JobState] = {}
        self.keys: dict[tuple[str, str], tuple[str, int]] = {}  # -> (job id, expires_at)
        # (queue, unique key) -> the job that last took it, and for how long it holds it.
        self.uniques: dict[tuple[str, str], tuple[str, str]] = {}
        self.issued: list[IssuedLease] = []
        self.tokens: set[str] = set()
        self.last_id = ""
        self.payloads = 0
        # For the invariants: the store's rows after the previous step, and which terminal
        # jobs the current step was allowed to change.
        self.previous_rows: dict[int, tuple] = {}
        self.may_change: set[str] = set()
        # Full promote passes so far, and the `now` of the last one.
        self.full_promotes = 0
        self.full_promote_at: int | None = None
        self.paused: set[str] = set()  # queues no claim takes from
        self.max_leased: dict[str, int] = {}  # queues with a concurrency limit

    def teardown(self) -> None:
        self.store.close()

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def key(job_id: str) -> int:
        """The row id of a job id; -1 (no row) for a malformed one."""
        return int(job_id[4:], 16) if JOB_ID_RE.fullmatch(job_id) else -1

    def row(self, job_id: str) -> tuple | None:
        found = rows(self.store, "SELECT * FROM jobs WHERE id = ?", self.key(job_id))
        return found[0] if found else None

    def footprint(self, job_id: str) -> tuple:
        """Everything a refused operation must leave as it was."""
        key = self.key(job_id)
        errors = scalar(self.store, "SELECT count(*) FROM job_errors WHERE job_id = ?", key)
        return self.row(job_id), errors, self.store.queue_stats()

    def expected_lease_check(
        self, job_id: str, worker: str, token: str, operation: str
    ) -> tuple[type[Exception] | None, object]:
        """(exception class or None, detail) that the contract prescribes.

        Detail: the expiry for LeaseExpired, "repeat" for an ack repeated with the
        completing token.
        """
        job = self.jobs.get(job_id)
        if job is None:
            return JobNotFound, None
        if job.token is None or token != job.token or worker != job.worker:
            return StaleToken, None
        if job.state is LEASED:
            assert job.lease_expires_at is not None
            if self.now >= job.lease_expires_at:
                return LeaseExpired, job.lease_expires_at
            return None, None
        if job.state is SUCCEEDED and operation == "ack":
            return None, "repeat"
        if job.state is CANCELLED:
            assert job.lease_end == "cancelled"
            return Cancelled, None
        if job.lease_end == "expired":
            return LeaseExpired, job.expired_at
        assert job.lease_end == "holder"
        # The holder's own ack, fail or release ended it: the token holds no lease now.
        return StaleToken, None

    def draw_lease(self, data: st.DataObject) -> IssuedLease:
        """A lease to use: one held now, one whose expiry the clock has just reached (or
        is 1 ms short of), any ever issued (mostly stale), or a good token with a wrong
        worker or job id. Which outcome is due, the model decides, not the draw."""
        leased = [j for j in self.jobs.values() if j.state is LEASED]
        held = [j for j in leased if j.lease_expires_at > self.now]
        kinds = ["any", "any", "wrong_worker", "wrong_job"]
        kinds += ["held"] * 3 if held else []
        kinds += ["at_expiry"] if held else []
        ended = [j for j in self.jobs.values() if j.state is not LEASED and j.last_lease]
        kinds += ["ended", "ended"] if ended else []
        kind = data.draw(st.sampled_from(kinds), label="kind")
        if kind in ("held", "at_expiry"):
            job = data.draw(st.sampled_from(held), label="held")
            if kind == "at_expiry":
                by = data.draw(st.sampled_from([0, -1]), label="by")
                self.now = max(self.now, job.lease_expires_at + by)
            return IssuedLease(job.job_id, job.worker, job.token)
        if kind == "ended":  # the job's own last token after its lease ended, however
            return data.draw(st.sampled_from(ended), label="ended").last_lease
        lease = data.draw(st.sampled_from(self.issued), label="issued")
        if kind == "wrong_worker":
            return IssuedLease(lease.job_id, f"{lease.worker}-impostor", lease.token)
        if kind == "wrong_job":
            job_id = data.draw(st.sampled_from([*UNKNOWN_IDS, *self.gone, *self.jobs]))
            return IssuedLease(job_id, lease.worker, lease.token)
        return lease

    def check_refusal(
        self, exc: Exception, expected: type[Exception], detail: object, before: tuple, job_id
    ) -> None:
        assert type(exc) is expected, f"expected {expected.__name__}, got {exc!r}"
        if isinstance(exc, LeaseExpired):
            assert exc.expired_at == detail
        if isinstance(exc, InvalidState):
            assert exc.state == detail
        assert self.footprint(job_id) == before, "a refused operation changed the job"

    def call_lease_op(self, operation: str, lease: IssuedLease, call) -> tuple[bool, object]:
        """Run one renew/ack/fail/release; return (accepted, store result)."""
        expected, detail = self.expected_lease_check(
            lease.job_id, lease.worker, lease.token, operation
        )
        outcome = "ok" if expected is None else expected.__name__
        event(f"{operation}: {outcome} {detail if isinstance(detail, str) else ''}".strip())
        before = self.footprint(lease.job_id)
        try:
            result = call()
        except (JobNotFound, StaleToken, LeaseExpired, InvalidState, Cancelled) as exc:
            assert expected is not None, f"{operation} should have succeeded: {exc!r}"
            self.check_refusal(exc, expected, detail, before, lease.job_id)
            return False, None
        assert expected is None, f"{operation} should have raised {expected.__name__}"
        if detail == "repeat":
            assert self.footprint(lease.job_id) == before, "a repeated ack changed the job"
            return False, result
        return True, result

    def ready_jobs(self, queues: list[str]) -> list[ModelJob]:
        return [j for j in self.jobs.values() if j.state is READY and j.queue in queues]

    def rank(self, job: ModelJob) -> tuple[int, int]:
        assert job.ready_at is not None
        return (-effective_priority(job.priority, job.ready_at, self.now), job.ready_at)

    def add_error(self, job: ModelJob, text: str) -> None:
        job.errors.append((job.attempt, text, self.now))
        job.last_error = text

    # -- rules -----------------------------------------------------------------------------

    @initialize(batch=st.lists(specs, min_size=1, max_size=6))
    def start(self, batch: list[dict]) -> None:
        # Most runs would otherwise spend their first steps on an empty store.
        self.submit(batch)
        self.previous_rows = self.all_rows()

    @rule(ms=st.integers(0, 200_000))
    def advance_time(self, ms: int) -> None:
        self.now += ms

    @rule(data=st.data())
    def advance_to_a_deadline(self, data: st.DataObject) -> None:
        # Onto (or 1 ms either side of) the next instants where something changes: a lease
        # expires, a job falls due, an idempotency key lapses, a succeeded job passes its
        # retention. Random jumps almost never hit these boundaries exactly.
        deadlines = set()
        for j in self.jobs.values():
            if j.state is LEASED:
                deadlines.add(j.lease_expires_at)
            elif j.state in (PENDING, RETRYING):
                deadlines.add(j.run_at)
            elif j.state in PRUNED:
                deadlines.add(j.finished_at + CONFIG.retention_ms)
        deadlines.update(expires_at for _job_id, expires_at in self.keys.values())
        upcoming = sorted(t for t in deadlines if t >= self.now)
        if not upcoming:
            return
        target = data.draw(st.sampled_from(upcoming[:3]), label="deadline")
        self.now = max(self.now, target + data.draw(st.sampled_from([0, -1, 1]), label="by"))

    @rule(batch=st.lists(specs, min_size=1, max_size=3))
    def submit(self, batch: list[dict]) -> None:
        submit_specs = []
        for s in batch:
            self.payloads += 1
            submit_specs.append(
                Spec(
                    s["queue"],
                    f'{{"n": {self.payloads}}}',
                    priority=s["priority"],
                    delay_ms=s["delay_ms"],
                    max_attempts=s["retries"] + 1,
                    backoff=s["backoff"],
                    idempotency_key=s["key"],
                    unique_key=s["unique"],
                    unique_for=s["unique_for"],
                )
            )
        # What the contract says each spec gets: a duplicate of a job (with its state) or a
        # new job; and whether the batch as a whole overfills a bounded queue.
        fresh: dict[tuple[str, str], int] = {}  # key -> index of the spec that created it
        fresh_unique: dict[tuple[str, str], int] = {}  # the same, for unique keys
        expected: list[tuple[str, object]] = []  # ("dup", job id) / ("fresh", index) / ("new",)
        for s in submit_specs:
            k = (s.queue, s.idempotency_key) if s.idempotency_key is not None else None
            if k is not None and k in fresh:
                expected.append(("fresh", fresh[k]))
                continue
            if k is not None and k in self.keys:
                job_id, expires_at = self.keys[k]
                if expires_at > self.now and (job_id in self.jobs or job_id in self.gone_states):
                    expected.append(("dup", job_id))
                    continue
            u = (s.queue, s.unique_key) if s.unique_key is not None else None
            if u is not None and u in fresh_unique:
                expected.append(("fresh", fresh_unique[u]))
                continue
            if u is not None and u in self.uniques:
                job_id, unique_for = self.uniques[u]
                holder = self.jobs.get(job_id)
                if holder is not None and unique_key_held(
                    unique_for, holder.state.value, holder.attempt
                ):
                    expected.append(("dup", job_id))
                    continue
            if k is not None:
                fresh[k] = len(expected)
            if u is not None:
                fresh_unique[u] = len(expected)
            expected.append(("new", None))
        new_per_queue = Counter(
            s.queue for s, e in zip(submit_specs, expected, strict=True) if e[0] == "new"
        )
        unfinished = Counter(j.queue for j in self.jobs.values() if j.state in UNFINISHED)
        overfull = [
            q
            for q, n in new_per_queue.items()
            if q in CONFIG.queue_depths and unfinished[q] + n > CONFIG.queue_depths[q]
        ]
        before = self.all_rows(), self.store.queue_stats()
        try:
            results = self.store.jobs_submit(submit_specs, self.now)
        except QueueFull:
            assert overfull, "QueueFull below the queue's max depth"
            # All or nothing: not even the jobs of other queues were created.
            assert (self.all_rows(), self.store.queue_stats()) == before
            return
        assert not overfull, f"submit went past the max depth of {overfull}"
        assert len(results) == len(submit_specs)
        for s, result, (kind, ref) in zip(submit_specs, results, expected, strict=True):
            if kind == "fresh":
                assert result.duplicate, "a repeated key in one batch created a second job"
                first = results[ref]
                assert (result.job_id, result.state) == (first.job_id, first.state)
                continue
            if kind == "dup":
                assert result.duplicate, "a key within its window, or a held unique key, made a job"
                assert result.job_id == ref
                if ref in self.jobs:
                    assert result.state is self.jobs[ref].state
                else:  # deleted since, within its key's window
                    assert result.state is self.gone_states[ref]
                continue
            assert not result.duplicate
            assert result.job_id not in self.jobs and result.job_id not in self.gone
            assert result.job_id > self.last_id, "job ids must sort by creation"
            self.last_id = result.job_id
            delayed = s.delay_ms > 0
            state = PENDING if delayed else READY
            assert result.state is state
            self.jobs[result.job_id] = ModelJob(
                job_id=result.job_id,
                queue=s.queue,
                priority=int(s.priority),
                payload=s.payload,
                max_attempts=s.max_attempts,
                backoff=s.backoff,
                idempotency_key=s.idempotency_key,
                created_at=self.now,
                state=state,
                ready_at=None if delayed else self.now,
                run_at=self.now + s.delay_ms if delayed else None,
                waiting_since_promote=self.full_promotes,
            )
            if s.idempotency_key is not None:
                key = (s.queue, s.idempotency_key)
                self.keys[key] = (result.job_id, self.now + CONFIG.idempotency_window_ms)
            if s.unique_key is not None:
                self.uniques[(s.queue, s.unique_key)] = (result.job_id, s.unique_for)

    @rule(
        queues=st.lists(st.sampled_from(QUEUES), min_size=1, max_size=2, unique=True),
        worker=st.sampled_from(WORKERS),
        count=st.integers(1, 3),
        lease_ms=st.integers(1, 300_000),
    )
    def claim(self, queues: list[str], worker: str, count: int, lease_ms: int) -> None:
        # A paused queue's ready jobs stay where they are: the others' are the candidates.
        open_queues = [queue for queue in queues if queue not in self.paused]
        candidates = sorted(self.ready_jobs(open_queues), key=self.rank)
        # A limited queue may lease its limit less its jobs leased now.
        room = {
            q: max(0, self.max_leased[q] - sum(j.state is LEASED and j.queue == q
                                               for j in self.jobs.values()))
            for q in open_queues if q in self.max_leased
        }  # fmt: skip
        leases = self.store.jobs_claim(queues, worker, count, lease_ms, self.now)
        takeable = sum(min(room.get(q, UNLIMITED), len(self.ready_jobs([q]))) for q in open_queues)
        assert len(leases) == min(count, takeable)
        for lease in leases:
            job = self.jobs.get(lease.job_id)
            assert job is not None and job.state is READY and job.queue in open_queues
        if not room:
            # Best effective priority first, then the earliest ready time; among jobs
            # equal in both, the contract does not say which goes first.
            expected_ranks = [self.rank(j) for j in candidates[: len(leases)]]
            assert [self.rank(self.jobs[lease.job_id]) for lease in leases] == expected_ranks
        for queue in open_queues:
            # Within a queue, its best jobs; a limited queue no more than its room.
            mine = [self.rank(self.jobs[lease.job_id]) for lease in leases if lease.queue == queue]
            assert len(mine) <= room.get(queue, UNLIMITED)
            assert mine == [self.rank(j) for j in candidates if j.queue == queue][: len(mine)]
        assert len({lease.job_id for lease in leases}) == len(leases)
        for lease in leases:
            job = self.jobs[lease.job_id]
            assert lease.queue == job.queue
            assert lease.payload == job.payload
            assert lease.priority == job.priority
            assert lease.attempt == job.attempt + 1
            assert lease.max_attempts == job.max_attempts
            assert lease.lease_expires_at == self.now + lease_ms
            assert TOKEN_RE.fullmatch(lease.token), "tokens carry at least 128 random bits"
            assert lease.token not in self.tokens, "a token was issued twice"
            self.tokens.add(lease.token)
            job.state = LEASED
            job.attempt += 1
            job.token, job.worker = lease.token, worker
            job.lease_expires_at = lease.lease_expires_at
            job.lease_end = job.expired_at = None
            job.last_lease = IssuedLease(job.job_id, worker, lease.token)
            self.issued.append(job.last_lease)

    @precondition(lambda self: self.issued)
    @rule(data=st.data(), lease_ms=st.integers(1, 300_000))
    def renew(self, data: st.DataObject, lease_ms: int) -> None:
        lease = self.draw_lease(data)
        accepted, expires_at = self.call_lease_op(
            "renew",
            lease,
            lambda: self.store.lease_renew(
                lease.job_id, lease.worker, lease.token, lease_ms, self.now
            ),
        )
        if accepted:
            assert expires_at == self.now + lease_ms
            self.jobs[lease.job_id].lease_expires_at = expires_at

    @precondition(lambda self: self.issued)
    @rule(data=st.data(), result=st.sampled_from([None, '"ok"', '{"rows": 3}']))
    def ack(self, data: st.DataObject, result: str | None) -> None:
        lease = self.draw_lease(data)
        accepted, _ = self.call_lease_op(
            "ack",
            lease,
            lambda: self.store.jobs_ack(lease.job_id, lease.worker, lease.token, result, self.now),
        )
        if accepted:
            job = self.jobs[lease.job_id]
            job.state = SUCCEEDED
            job.finished_at = self.now
            job.result = result
            job.lease_expires_at = None
            job.lease_end = "holder"

    @precondition(lambda self: self.issued)
    @rule(data=st.data(), retryable=st.booleans(), error=st.sampled_from(["boom", "timeout"]))
    def fail(self, data: st.DataObject, retryable: bool, error: str) -> None:
        lease = self.draw_lease(data)
        accepted, outcome = self.call_lease_op(
            "fail",
            lease,
            lambda: self.store.jobs_fail(
                lease.job_id, lease.worker, lease.token, error, retryable, self.now
            ),
        )
        if not accepted:
            return
        job = self.jobs[lease.job_id]
        self.add_error(job, error)
        job.lease_expires_at = None
        job.lease_end = "holder"
        if retryable and job.attempt < job.max_attempts:
            least, most = backoff_bounds(job.backoff, job.attempt)
            assert outcome.state is RETRYING
            assert self.now + least <= outcome.retry_at <= self.now + most
            job.state = RETRYING
            job.run_at = outcome.retry_at
            job.waiting_since_promote = self.full_promotes
        else:
            assert outcome.state is DEAD
            assert outcome.retry_at is None
            job.state = DEAD
            job.finished_at = self.now

    @precondition(lambda self: self.issued)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease = self.draw_lease(data)
        accepted, _ = self.call_lease_op(
            "release",
            lease,
            lambda: self.store.jobs_release(lease.job_id, lease.worker, lease.token, self.now),
        )
        if accepted:
            job = self.jobs[lease.job_id]
            job.state = READY
            job.attempt -= 1  # ready_at is kept: the job keeps its place
            job.lease_expires_at = None
            job.lease_end = "holder"

    def jump_to(self, instants: list[int], by: int) -> None:
        """Move the clock onto the first instant still ahead, shifted by ``by`` ms."""
        upcoming = [t for t in instants if t >= self.now]
        if upcoming:
            self.now = max(self.now, min(upcoming) + by)

    @rule(limit=st.sampled_from([1, 2, UNLIMITED]), jump=st.sampled_from([None, 0, -1]))
    def promote_due(self, limit: int, jump: int | None) -> None:
        if jump is not None:  # onto the next due time, or 1 ms before it
            self.jump_to(
                [j.run_at for j in self.jobs.values() if j.state in (PENDING, RETRYING)], jump
            )
        due = [
            j
            for j in self.jobs.values()
            if j.state in (PENDING, RETRYING) and j.run_at is not None and j.run_at <= self.now
        ]
        promoted_count = self.store.jobs_promote_due(self.now, limit)
        assert promoted_count == min(limit, len(due))
        promoted = self.chosen(due, promoted_count, lambda j: j.run_at)
        for job in promoted:
            job.state = READY
            job.ready_at = job.run_at  # ready from its due time, not from this pass
        if limit >= len(due):
            self.full_promotes += 1
            self.full_promote_at = self.now
            leftover = scalar(
                self.store,
                "SELECT count(*) FROM jobs WHERE state IN ('pending', 'retrying') AND run_at <= ?",
                self.now,
            )
            assert leftover == 0

    def chosen(self, eligible: list[ModelJob], n: int, order) -> list[ModelJob]:
        """The ``n`` jobs of ``eligible`` a limited pass took, checking that they are first
        by ``order``; when the limit cuts through a tie, the store's pick decides."""
        if n == len(eligible):
            return eligible
        # The caller checked n == min(limit, len(eligible)), so here 0 < n < len(eligible).
        eligible = sorted(eligible, key=order)
        cut = order(eligible[n - 1])
        taken = [j for j in eligible if order(j) < cut]
        tied = [j for j in eligible if order(j) == cut]
        picked = []
        for job in tied:
            row = self.row(job.job_id)
            if row is None or row[2] != job.state:
                picked.append(job)
        assert len(taken) + len(picked) == n, "a limited pass skipped an earlier job"
        for job in eligible[len(taken) + len(tied) :]:
            row = self.row(job.job_id)
            assert row is not None and row[2] == job.state, "a limited pass took a later job"
        return taken + picked

    @rule(limit=st.sampled_from([1, 2, UNLIMITED]), jump=st.sampled_from([None, 0, -1]))
    def reap_expired(self, limit: int, jump: int | None) -> None:
        if jump is not None:  # onto the next lease expiry, or 1 ms before it
            self.jump_to(
                [j.lease_expires_at for j in self.jobs.values() if j.state is LEASED], jump
            )
        expired = [
            j for j in self.jobs.values() if j.state is LEASED and j.lease_expires_at <= self.now
        ]
        reaped = self.store.leases_reap_expired(self.now, limit)
        assert len(reaped) == min(limit, len(expired))
        by_id = {r.job_id: r for r in reaped}
        assert len(by_id) == len(reaped)
        order = sorted(j.lease_expires_at for j in expired)
        if reaped:
            # The ones that expired first go first.
            latest_taken = max(self.jobs[i].lease_expires_at for i in by_id)
            assert latest_taken == order[len(reaped) - 1]
        for job_id, r in by_id.items():
            job = self.jobs.get(job_id)
            assert job is not None and job in expired
            assert r.queue == job.queue
            assert r.attempt == job.attempt
            self.add_error(job, LEASE_EXPIRED_ERROR)
            job.lease_end, job.expired_at = "expired", job.lease_expires_at
            if job.attempt < job.max_attempts:
                assert r.state is READY
                job.state = READY
                job.ready_at = job.lease_expires_at
            else:
                assert r.state is DEAD
                job.state = DEAD
                job.finished_at = self.now
            job.lease_expires_at = None

    @rule(queue=st.sampled_from(QUEUES), paused=st.booleans())
    def pause(self, queue: str, paused: bool) -> None:
        # Idempotent; it changes no job (and none of their rows), paused or resumed.
        before = self.all_rows(), self.store.queue_stats()
        self.store.take_changes()
        assert self.store.queue_pause(queue, paused, self.now) is paused
        woken = self.store.take_changes().ready_counts
        ready = len(self.ready_jobs([queue]))
        # Resuming a paused queue wakes as many parked leases as it has ready jobs.
        resumed = queue in self.paused and not paused
        assert woken == ({queue: ready} if resumed and ready else {})
        (self.paused.add if paused else self.paused.discard)(queue)
        assert (self.all_rows(), self.store.queue_stats()) == before
        assert self.store.view.paused == self.paused

    @rule(queue=st.sampled_from(QUEUES), limit=st.sampled_from([None, 1, 2]))
    def limit_leased(self, queue: str, limit: int | None) -> None:
        # It changes no job; a limit raised or removed wakes as many parked leases as the
        # queue has ready jobs.
        before = self.all_rows(), self.store.queue_stats()
        self.store.take_changes()
        settings = self.store.queue_config(queue, {"max_leased": limit}, self.now)
        assert (settings.max_leased, settings.paused) == (limit, queue in self.paused)
        woken = self.store.take_changes().ready_counts
        ready = len(self.ready_jobs([queue]))
        loosened = queue in self.max_leased and self.max_leased[queue] != limit
        assert woken == ({queue: ready} if loosened and ready else {})
        if limit is None:
            self.max_leased.pop(queue, None)
        else:
            self.max_leased[queue] = limit
        assert (self.all_rows(), self.store.queue_stats()) == before

    @precondition(lambda self: any(j.state is LEASED for j in self.jobs.values()))
    @rule()
    def recover(self) -> None:
        # What a restart does before serving: every leased job is ready again at once
        # (SQLite), or nothing at all, leases being left to expire (PostgreSQL, whose other
        # servers hold live leases).
        if not recovers_on_start(self.store):
            before = self.all_rows(), self.store.queue_stats()
            assert self.store.leases_recover(self.now) == 0
            assert (self.all_rows(), self.store.queue_stats()) == before
            return
        leased = [j for j in self.jobs.values() if j.state is LEASED]
        assert self.store.leases_recover(self.now) == len(leased)
        for job in leased:
            self.add_error(job, RESTART_ERROR)
            job.state = READY
            job.attempt -= 1  # the lease was lost with the process, not through the job
            job.lease_end, job.expired_at = "expired", self.now
            job.lease_expires_at = None

    def draw_job_id(self, data: st.DataObject, wanted: JobState) -> str:
        matching = [j.job_id for j in self.jobs.values() if j.state is wanted]
        pools = [st.sampled_from([*UNKNOWN_IDS, *self.gone])]
        if self.jobs:
            pools.append(st.sampled_from(sorted(self.jobs)))
        if matching:
            pools += [st.sampled_from(matching)] * 4
        return data.draw(st.one_of(pools), label="job_id")

    def expected_dead_op(self, job_id: str) -> tuple[type[Exception] | None, object]:
        job = self.jobs.get(job_id)
        if job is None:
            return JobNotFound, None
        if job.state is not DEAD:
            return InvalidState, job.state
        return None, None

    @precondition(lambda self: any(j.state is DEAD for j in self.jobs.values()) or self.gone)
    @rule(data=st.data())
    def dead_retry(self, data: st.DataObject) -> None:
        job_id = self.draw_job_id(data, DEAD)
        expected, detail = self.expected_dead_op(job_id)
        event(f"dead_retry: {'ok' if expected is None else expected.__name__}")
        before = self.footprint(job_id)
        try:
            count = self.store.dead_retry(job_id, self.now)
        except (JobNotFound, InvalidState) as exc:
            assert expected is not None, f"dead_retry should have succeeded: {exc!r}"
            self.check_refusal(exc, expected, detail, before, job_id)
            return
        assert expected is None, f"dead_retry should have raised {expected.__name__}"
        assert count == 1
        job = self.jobs[job_id]
        job.state = READY
        job.attempt = 0
        job.ready_at = self.now
        job.run_at = job.finished_at = None
        # Fresh attempts: no old token holds anything any more (errors are kept).
        job.token = job.worker = None
        job.lease_end = job.expired_at = None
        self.may_change.add(job_id)

    @precondition(lambda self: any(j.state is DEAD for j in self.jobs.values()) or self.gone)
    @rule(data=st.data())
    def dead_purge(self, data: st.DataObject) -> None:
        job_id = self.draw_job_id(data, DEAD)
        expected, detail = self.expected_dead_op(job_id)
        event(f"dead_purge: {'ok' if expected is None else expected.__name__}")
        before = self.footprint(job_id)
        try:
            count = self.store.dead_purge(job_id)
        except (JobNotFound, InvalidState) as exc:
            assert expected is not None, f"dead_purge should have succeeded: {exc!r}"
            self.check_refusal(exc, expected, detail, before, job_id)
            return
        assert expected is None, f"dead_purge should have raised {expected.__name__}"
        assert count == 1
        del self.jobs[job_id]
        self.gone.append(job_id)
        self.gone_states[job_id] = DEAD
        self.may_change.add(job_id)
        with pytest.raises(JobNotFound):
            self.store.job_inspect(job_id)

    def expected_cancel(
        self, job_id: str, leased_ok: bool
    ) -> tuple[type[Exception] | None, object]:
        job = self.jobs.get(job_id)
        if job is None:
            return JobNotFound, None
        if job.state in TERMINAL:
            return InvalidState, job.state
        if job.state is LEASED and not leased_ok:
            return Unauthorized, None
        return None, None

    def cancelled(self, job: ModelJob) -> None:
        """The model's job, cancelled now (from an unfinished state)."""
        if job.state is LEASED:
            job.lease_end = "cancelled"  # its token is kept: answered Cancelled
        else:
            job.token = None  # an old token of it holds nothing: stale
        job.state = CANCELLED
        job.finished_at = self.now
        job.lease_expires_at = None

    @rule(data=st.data(), leased_ok=st.sampled_from([True, True, False]))
    def cancel(self, data: st.DataObject, leased_ok: bool) -> None:
        wanted = data.draw(st.sampled_from([PENDING, READY, LEASED, RETRYING, *TERMINAL]))
        job_id = self.draw_job_id(data, wanted)
        expected, detail = self.expected_cancel(job_id, leased_ok)
        event(f"cancel: {'ok' if expected is None else expected.__name__}")
        before = self.footprint(job_id)
        try:
            was = self.store.job_cancel(job_id, self.now, leased_ok)
        except (JobNotFound, InvalidState, Unauthorized) as exc:
            assert expected is not None, f"cancel should have succeeded: {exc!r}"
            self.check_refusal(exc, expected, detail, before, job_id)
            return
        assert expected is None, f"cancel should have raised {expected.__name__}"
        job = self.jobs[job_id]
        assert was is job.state
        self.cancelled(job)

    @rule(
        queue=st.sampled_from(QUEUES),
        states=st.sets(st.sampled_from([PENDING, READY, LEASED, RETRYING]), min_size=1),
        limit=st.sampled_from([1, 2, UNLIMITED]),
    )
    def cancel_queue(self, queue: str, states: set[JobState], limit: int) -> None:
        eligible = [j for j in self.jobs.values() if j.queue == queue and j.state in states]
        count = self.store.job_cancel_queue(queue, sorted(map(str, states)), self.now, limit)
        assert count == min(limit, len(eligible))
        # Which of them a limited piece takes is not specified.
        for job in self.chosen(eligible, count, lambda j: 0):
            self.cancelled(job)

    @rule(limit=st.sampled_from([1, UNLIMITED]), jump=st.sampled_from([None, 0, 1]))
    def prune(self, limit: int, jump: int | None) -> None:
        if jump is not None:  # onto the end of the next retention period, or 1 ms past it
            self.jump_to(
                [
                    j.finished_at + CONFIG.retention_ms
                    for j in self.jobs.values()
                    if j.state in PRUNED
                ],
                jump,
            )
        old = [
            j
            for j in self.jobs.values()
            if j.state in PRUNED and j.finished_at < self.now - CONFIG.retention_ms
        ]
        pruned = self.store.jobs_prune(self.now, limit)
        assert pruned == min(limit, len(old))
        # Which old job a limited prune takes is not specified.
        for job in self.chosen(old, pruned, lambda j: 0):
            del self.jobs[job.job_id]
            self.gone.append(job.job_id)
            self.gone_states[job.job_id] = job.state
            self.may_change.add(job.job_id)

    # -- invariants ------------------------------------------------------------------------

    def all_rows(self) -> dict[int, tuple]:
        return {row[0]: row for row in rows(self.store, "SELECT * FROM jobs")}

    @invariant()
    def queue_stats_match_a_recount_and_the_model(self) -> None:
        recount: dict[str, dict[str, int]] = {}
        for queue, state, n in rows(
            self.store, "SELECT queue, state, count(*) FROM jobs GROUP BY 1, 2"
        ):
            recount.setdefault(queue, {str(s): 0 for s in JobState})[state] = n
        assert self.store.queue_stats() == recount
        model: dict[str, dict[str, int]] = {}
        for job in self.jobs.values():
            model.setdefault(job.queue, {str(s): 0 for s in JobState})[str(job.state)] += 1
        assert recount == model

    @invariant()
    def every_job_looks_as_the_model_says(self) -> None:
        stored = {row[0] for row in rows(self.store, "SELECT id FROM jobs")}
        assert stored == {self.key(job_id) for job_id in self.jobs}
        for job in self.jobs.values():
            info = self.store.job_inspect(job.job_id)
            leased = job.state is LEASED
            assert (info.job_id, info.queue, info.state) == (job.job_id, job.queue, job.state)
            assert info.attempt == job.attempt
            assert (info.priority, info.payload) == (job.priority, job.payload)
            assert (info.max_attempts, info.created_at) == (job.max_attempts, job.created_at)
            assert info.idempotency_key == job.idempotency_key
            assert info.lease_expires_at == (job.lease_expires_at if leased else None)
            if leased:
                assert info.worker_id == job.worker
            if job.state is READY:
                assert info.ready_at == job.ready_at
            if job.state in (PENDING, RETRYING):
                assert info.run_at == job.run_at
            assert info.finished_at == job.finished_at
            assert info.result == job.result
            assert info.last_error == job.last_error
            assert [(e.attempt, e.error, e.at) for e in info.errors] == job.errors
        for job_id in self.gone[-3:]:
            with pytest.raises(JobNotFound):
                self.store.job_inspect(job_id)

    @invariant()
    def at_most_one_live_lease_per_job(self) -> None:
        # Every leased job holds exactly the token the model issued last, with an expiry;
        # the lease rules check that every other token of it is refused.
        leased = rows(
            self.store,
            "SELECT id, lease_token, lease_worker, lease_expires_at FROM jobs "
            "WHERE state = 'leased'",
        )
        for key, token, worker, expires_at in leased:
            job = self.jobs[f"job_{key:016x}"]
            assert job.state is LEASED
            assert (token, worker, expires_at) == (job.token, job.worker, job.lease_expires_at)
        assert len(leased) == sum(j.state is LEASED for j in self.jobs.values())

    @invariant()
    def no_row_refers_to_a_deleted_job(self) -> None:
        # Only an idempotency key outlives its job (until it expires), with the state the
        # job was deleted in.
        for table, orphan in (
            ("job_errors", "j.id IS NULL"),
            ("idempotency_keys", "j.id IS NULL AND t.final_state IS NULL"),
        ):
            orphans = scalar(
                self.store,
                f"SELECT count(*) FROM {table} AS t LEFT JOIN jobs AS j ON j.id = t.job_id "
                f"WHERE {orphan}",
            )
            assert orphans == 0, table

    @invariant()
    def attempts_stay_within_bounds(self) -> None:
        bad = scalar(
            self.store, "SELECT count(*) FROM jobs WHERE attempt < 0 OR attempt > max_attempts"
        )
        assert bad == 0
        ready_spent = scalar(
            self.store,
            "SELECT count(*) FROM jobs WHERE state IN ('ready', 'pending', 'retrying') "
            "AND attempt >= max_attempts",
        )
        assert ready_spent == 0, "a job that may run again has no attempt left"

    @invariant()
    def terminal_states_stay_terminal(self) -> None:
        now_rows = self.all_rows()
        for key, before in self.previous_rows.items():
            state = before[2]
            if state not in TERMINAL:
                continue
            job_id = f"job_{key:016x}"
            if job_id in self.may_change:
                continue
            assert now_rows.get(key) == before, f"terminal job {job_id} ({state}) changed"
        self.previous_rows = now_rows
        self.may_change.clear()

    @invariant()
    def nothing_due_stays_waiting_after_a_full_promote(self) -> None:
        if self.full_promote_at != self.now:
            return
        # Only a job that started waiting after that promote (a fail with a zero backoff,
        # say) may still be due and waiting at the same `now`.
        waiting = rows(
            self.store,
            "SELECT id FROM jobs WHERE state IN ('pending', 'retrying') AND run_at <= ?",
            self.now,
        )
        for (key,) in waiting:
            job = self.jobs[f"job_{key:016x}"]
            assert job.waiting_since_promote == self.full_promotes, f"{job.job_id} stayed due"


SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_store_state_machine(stores: Stores) -> None:
    run_state_machine_as_test(
        lambda: StoreMachine(lambda: stores.open(config=CONFIG, rng=random.Random(0))),
        settings=SETTINGS,
    )
