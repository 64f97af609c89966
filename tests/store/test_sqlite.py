"""The job store, driven synchronously: every call gets its ``now`` explicitly and commits
on its own (no writer, no trio, no sleeps).

Every test that takes ``store`` (or ``stores``) runs on both stores, SQLite and PostgreSQL
(tests/store/conftest.py); the few about SQLite's own statements and query plans are marked
``sqlite_only``.

Expectations come from the wire contract (/work/shared/protocol.md) and the store's
documented semantics, not from the SQL: times and counts are derived from the rules.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings, strategies

from relay.protocol.errors import (
    BadRequest,
    InvalidState,
    JobNotFound,
    LeaseExpired,
    RelayError,
    StaleToken,
)
from relay.protocol.model import (
    Backoff,
    ErrorEntry,
    FailOutcome,
    JobState,
    Lease,
    Priority,
    SubmitSpec,
    parse_job_id,
)
from relay.store import commands as cmd
from relay.store.base import ERRORS_SHOWN, Changes, StoreConfig
from relay.store.sqlite import SqliteStore
from relay.store.sqlite.reads import _NEIGHBOURS_SQL, _PREFIX_KEYS_SQL
from relay.store.sqlite.sql import _claim_candidates_sql
from tests.conftest import T0, assert_abbreviated_as_git_does, common_start
from tests.store.conformance import (
    Store,
    Stores,
    counted_queues,
    recovers_on_start,
    rows,
    scalar,
    sqlite_only,
)

LOW, NORMAL, HIGH, CRITICAL = (int(p) for p in Priority)
PENDING, READY, LEASED = JobState.PENDING, JobState.READY, JobState.LEASED
RETRYING, SUCCEEDED, DEAD = JobState.RETRYING, JobState.SUCCEEDED, JobState.DEAD

LEASE_MS = 30_000
MINUTE = 60_000
DAY = 24 * 3600 * 1000
NO_JITTER = Backoff("exponential", 1_000, 300_000, jitter=False)


# -- helpers -----------------------------------------------------------------------------


def spec(queue: str = "q", **kw) -> SubmitSpec:
    kw.setdefault("payload", '{"n": 1}')
    return SubmitSpec(queue=queue, **kw)


def submit(store: Store, now: int = T0, queue: str = "q", **kw) -> str:
    return store.jobs_submit([spec(queue, **kw)], now)[0].job_id


def claim_one(
    store: Store,
    now: int = T0,
    queues: tuple[str, ...] = ("q",),
    worker: str = "w1",
    lease_ms: int = LEASE_MS,
) -> Lease:
    leases = store.jobs_claim(list(queues), worker, 1, lease_ms, now)
    assert len(leases) == 1
    return leases[0]


def claimed_ids(store: Store, now: int, count: int = 10, queues=("q",)) -> list[str]:
    return [lease.job_id for lease in store.jobs_claim(list(queues), "w1", count, LEASE_MS, now)]


def make_dead(store: Store, now: int = T0, queue: str = "q", **kw) -> str:
    """A job that failed non-retryably on its only attempt."""
    job = submit(store, now, queue, max_attempts=1, **kw)
    lease = claim_one(store, now, (queue,))
    assert lease.job_id == job
    store.jobs_fail(job, "w1", lease.token, "fatal", False, now)
    return job


def state(store: Store, job_id: str) -> JobState:
    return store.job_inspect(job_id).state


def dump(store: Store) -> tuple:
    """Every stored row: a refused command must leave all of it as it was."""
    return tuple(
        rows(store, f"SELECT * FROM {table} ORDER BY 1, 2")
        for table in ("jobs", "job_errors", "idempotency_keys")
    )


def snapshot(store: Store, job_id: str) -> tuple:
    return (
        store.job_inspect(job_id),
        store.queue_stats(),
        store.event_totals(),
        store.next_expiry_at(),
        dump(store),
    )


def recount(store: Store) -> dict[str, dict[str, int]]:
    stats: dict[str, dict[str, int]] = {}
    for queue, st, n in rows(store, "SELECT queue, state, count(*) FROM jobs GROUP BY 1, 2"):
        stats.setdefault(queue, {str(s): 0 for s in JobState})[st] = n
    return stats


# The four operations that need a held lease, each with the state it leaves the job in.
OPS: dict[str, Callable[..., object]] = {
    "renew": lambda s, job, worker, token, now: s.lease_renew(job, worker, token, LEASE_MS, now),
    "ack": lambda s, job, worker, token, now: s.jobs_ack(job, worker, token, '"done"', now),
    # With a traceback: a refused fail keeps none of it either.
    "fail": lambda s, job, worker, token, now: s.jobs_fail(
        job, worker, token, "x", True, now, "Traceback (most recent call last):\nValueError: x"
    ),
    "release": lambda s, job, worker, token, now: s.jobs_release(job, worker, token, now),
}
STATE_AFTER = {"renew": LEASED, "ack": SUCCEEDED, "fail": RETRYING, "release": READY}
op_names = pytest.mark.parametrize("op", list(OPS))


# -- submit and job ids ------------------------------------------------------------------


def test_submit_without_delay_is_ready_from_now(store):
    [result] = store.jobs_submit(
        [spec("emails", payload='{"to": "a"}', priority=HIGH, idempotency_key="k")], T0
    )
    assert (result.state, result.duplicate) == (READY, False)
    info = store.job_inspect(result.job_id)
    assert info.state == READY
    assert info.ready_at == T0
    assert info.created_at == T0
    assert (info.queue, info.payload, info.priority) == ("emails", '{"to": "a"}', HIGH)
    assert info.attempt == 0
    assert info.idempotency_key == "k"
    assert info.lease_expires_at is None and info.finished_at is None and info.errors == ()


def test_submit_with_delay_is_pending_until_due(store):
    [result] = store.jobs_submit([spec(delay_ms=5_000)], T0)
    assert result.state == PENDING
    info = store.job_inspect(result.job_id)
    assert (info.state, info.run_at, info.ready_at) == (PENDING, T0 + 5_000, None)


@pytest.mark.parametrize(
    ("run_at", "expected"),
    [(T0 - 5_000, READY), (T0, READY), (T0 + 1, PENDING)],
    ids=["past", "now", "future"],
)
def test_submit_with_run_at_is_pending_only_if_in_the_future(store, run_at, expected):
    job = submit(store, T0, run_at=run_at)
    info = store.job_inspect(job)
    assert info.state == expected
    if expected == READY:
        assert info.ready_at == T0
    else:
        assert info.run_at == run_at


@pytest.mark.parametrize("retries", [0, 1, 3])
def test_job_runs_at_most_retries_plus_one_times(store, retries):
    job = submit(store, T0, max_attempts=retries + 1, backoff=Backoff.fixed(10))
    now, runs = T0, 0
    while state(store, job) != DEAD:
        store.jobs_promote_due(now, 10)
        lease = claim_one(store, now)
        runs += 1
        assert (lease.attempt, lease.max_attempts) == (runs, retries + 1)
        store.jobs_fail(job, "w1", lease.token, "boom", True, now)
        now += 10
    assert runs == retries + 1


def test_submit_batch_answers_in_order(store):
    results = store.jobs_submit([spec("a"), spec("b", delay_ms=1), spec("c", payload="[3]")], T0)
    assert [r.state for r in results] == [READY, PENDING, READY]
    assert [store.job_inspect(r.job_id).queue for r in results] == ["a", "b", "c"]


def test_job_ids_sort_strictly_by_creation_within_one_millisecond(store):
    ids = [r.job_id for r in store.jobs_submit([spec() for _ in range(50)], T0)]
    ids += [submit(store, T0) for _ in range(5)]
    assert all(job.startswith("job_") for job in ids)
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)


def test_job_ids_keep_increasing_when_the_clock_steps_back(store):
    ids = [
        submit(store, T0 + 10_000),
        submit(store, T0),
        submit(store, T0 - DAY),
        submit(store, T0),
    ]
    assert ids == sorted(ids) and len(set(ids)) == 4


def test_job_ids_keep_increasing_across_reopen_after_newest_job_was_purged(stores: Stores):
    store = stores.open("relay", rng=random.Random(1))
    submit(store, T0, "other")
    newest = make_dead(store, T0 + 10_000)
    store.dead_purge(newest)
    store.close()
    store = stores.open("relay", rng=random.Random(1))
    after_restart = submit(store, T0)  # the clock also went back
    assert after_restart > newest


def test_job_ids_keep_increasing_across_reopen_after_every_job_was_pruned(stores: Stores):
    # Pruning deletes the newest jobs too; max(id) is then gone, and only the high-water
    # mark written by the deleting transaction (SQLite) or the sequence (PostgreSQL) keeps
    # an id from coming back.
    config = StoreConfig()
    store = stores.open("relay", config, rng=random.Random(1))
    newest = ""
    for offset in (0, 5_000):
        newest = submit(store, T0 + offset)
        lease = claim_one(store, T0 + offset)
        store.jobs_ack(newest, "w1", lease.token, None, T0 + offset)
    assert store.jobs_prune(T0 + 5_000 + config.retention_ms + 1, 100) == 2
    store.close()
    store = stores.open("relay", config, rng=random.Random(1))
    assert store.queue_stats() == {}
    after_restart = submit(store, T0)  # the clock also went back
    assert after_restart > newest


# -- idempotency -------------------------------------------------------------------------


def test_duplicate_key_returns_first_job_and_creates_nothing(store):
    [first] = store.jobs_submit([spec(idempotency_key="k1")], T0)
    stats, totals, rows = store.queue_stats(), store.event_totals(), dump(store)
    [again] = store.jobs_submit([spec(payload='"other"', idempotency_key="k1")], T0 + 1_000)
    assert (again.job_id, again.state, again.duplicate) == (first.job_id, READY, True)
    assert store.job_inspect(first.job_id).payload == '{"n": 1}'
    assert (store.queue_stats(), store.event_totals(), dump(store)) == (stats, totals, rows)


def _lease(store, job):
    claim_one(store, T0)


def _succeed(store, job):
    lease = claim_one(store, T0)
    store.jobs_ack(job, "w1", lease.token, None, T0)


def _retry(store, job):
    lease = claim_one(store, T0)
    store.jobs_fail(job, "w1", lease.token, "x", True, T0)


def _kill(store, job):
    lease = claim_one(store, T0)
    store.jobs_fail(job, "w1", lease.token, "x", False, T0)


@pytest.mark.parametrize(
    ("move", "expected"),
    [(_lease, LEASED), (_succeed, SUCCEEDED), (_retry, RETRYING), (_kill, DEAD)],
    ids=["leased", "succeeded", "retrying", "dead"],
)
def test_duplicate_answers_the_first_jobs_current_state(store, move, expected):
    job = submit(store, T0, idempotency_key="k")
    move(store, job)
    [again] = store.jobs_submit([spec(idempotency_key="k")], T0 + 10)
    assert (again.job_id, again.state, again.duplicate) == (job, expected, True)


def test_same_key_in_another_queue_is_a_new_job(store):
    first = submit(store, T0, "a", idempotency_key="k")
    [other] = store.jobs_submit([spec("b", idempotency_key="k")], T0)
    assert other.job_id != first and other.duplicate is False
    assert store.job_inspect(other.job_id).queue == "b"


@pytest.mark.parametrize("window", [24 * 3600 * 1000, 5_000])
def test_same_key_after_the_window_creates_a_new_job(stores: Stores, window):
    store = stores.open(config=StoreConfig(idempotency_window_ms=window))
    first = submit(store, T0, idempotency_key="k")
    [inside] = store.jobs_submit([spec(idempotency_key="k")], T0 + window - 1)
    assert (inside.job_id, inside.duplicate) == (first, True)
    [after] = store.jobs_submit([spec(idempotency_key="k")], T0 + window + 1)
    assert after.duplicate is False and after.job_id != first
    # The new job now owns the key for a window of its own.
    [third] = store.jobs_submit([spec(idempotency_key="k")], T0 + window + 2)
    assert (third.job_id, third.duplicate) == (after.job_id, True)


def test_duplicates_within_one_submit_call_yield_one_job(store):
    results = store.jobs_submit(
        [
            spec(idempotency_key="k"),
            spec(),
            spec(idempotency_key="k"),
            spec("b", idempotency_key="k"),
        ],
        T0,
    )
    assert [r.duplicate for r in results] == [False, False, True, False]
    assert results[2].job_id == results[0].job_id
    assert len({r.job_id for r in results}) == 3
    assert store.queue_stats()["q"]["ready"] == 2
    assert store.event_totals()[("q", "submitted")] == 2


# -- claim -------------------------------------------------------------------------------


def test_claim_leases_job_with_next_attempt_fresh_token_and_expiry(store):
    job = submit(store, T0, priority=HIGH)
    lease = claim_one(store, T0 + 500, worker="w7", lease_ms=10_000)
    assert (lease.job_id, lease.queue, lease.payload, lease.priority) == (
        job,
        "q",
        '{"n": 1}',
        HIGH,
    )
    assert (lease.attempt, lease.max_attempts) == (1, 4)
    assert lease.lease_expires_at == T0 + 10_500
    assert re.fullmatch(r"[0-9a-f]{32,}", lease.token), "token must carry >= 128 bits"
    info = store.job_inspect(job)
    assert (info.state, info.attempt, info.worker_id) == (LEASED, 1, "w7")
    assert info.lease_expires_at == T0 + 10_500


def test_claim_issues_distinct_tokens(store):
    store.jobs_submit([spec() for _ in range(40)], T0)
    tokens = [lease.token for lease in store.jobs_claim(["q"], "w1", 20, LEASE_MS, T0)]
    tokens += [claim_one(store, T0).token for _ in range(20)]
    assert len(tokens) == 40 and len(set(tokens)) == 40


def test_leased_job_is_not_claimed_again(store):
    submit(store, T0)
    claim_one(store, T0)
    assert store.jobs_claim(["q"], "w2", 5, LEASE_MS, T0 + 1) == []


def test_pending_job_is_not_claimable_before_it_is_due_and_promoted(store):
    job = submit(store, T0, delay_ms=1_000)
    assert store.jobs_claim(["q"], "w1", 1, LEASE_MS, T0 + 999) == []
    assert store.jobs_promote_due(T0 + 999, 10) == 0
    assert store.jobs_claim(["q"], "w1", 1, LEASE_MS, T0 + 999) == []
    assert store.jobs_promote_due(T0 + 1_000, 10) == 1
    assert claim_one(store, T0 + 1_000).job_id == job


def test_claim_prefers_higher_base_priority(store):
    low = submit(store, T0, priority=LOW)
    normal = submit(store, T0, priority=NORMAL)
    critical = submit(store, T0, priority=CRITICAL)
    high = submit(store, T0, priority=HIGH)
    assert claimed_ids(store, T0 + 1) == [critical, high, normal, low]


def test_claim_is_fifo_by_ready_time_not_by_id(store):
    later = submit(store, T0 + 5_000)
    earlier = submit(store, T0)  # clock stepped back: larger id, earlier ready_at
    assert earlier > later
    assert claimed_ids(store, T0 + 6_000) == [earlier, later]


def test_claim_breaks_ready_time_ties_by_id(store):
    ids = [r.job_id for r in store.jobs_submit([spec() for _ in range(5)], T0)]
    assert claimed_ids(store, T0, count=5) == ids


@pytest.mark.parametrize(
    ("old_base", "new_base", "new_ready_after", "claim_after", "winner"),
    [
        # low + 1 class at one full minute is still below high
        (LOW, HIGH, 100_000, 119_999, "new"),
        # low + 2 classes ties a high that has waited < 1 minute: the older one wins
        (LOW, HIGH, 100_000, 120_000, "old"),
        (NORMAL, HIGH, 30_000, 59_999, "new"),
        (NORMAL, HIGH, 30_000, 60_000, "old"),
        (LOW, CRITICAL, 0, 179_999, "new"),
        (LOW, CRITICAL, 1, 180_000, "old"),
    ],
)
def test_old_job_overtakes_fresher_higher_job_after_full_minutes_ready(
    store, old_base, new_base, new_ready_after, claim_after, winner
):
    old = submit(store, T0, priority=old_base)
    new = submit(store, T0 + new_ready_after, priority=new_base)
    first = claimed_ids(store, T0 + claim_after, count=1)
    assert first == [old if winner == "old" else new]


def test_aging_is_capped_at_critical(store):
    # At 4 minutes the low job would be class 4 and the critical job (3 minutes ready)
    # class 6 without the cap; capped, both are critical and the older one goes first.
    low = submit(store, T0, priority=LOW)
    critical = submit(store, T0 + MINUTE, priority=CRITICAL)
    assert claimed_ids(store, T0 + 4 * MINUTE, count=2) == [low, critical]


def test_aged_job_never_passes_an_older_job_of_the_same_class(store):
    older_low = submit(store, T0, priority=LOW)
    newer_low = submit(store, T0 + 1, priority=LOW)
    assert claimed_ids(store, T0 + 10 * MINUTE) == [older_low, newer_low]


def test_promoted_job_counts_as_ready_from_its_due_time(store):
    delayed = submit(store, T0, delay_ms=1_000)
    immediate = submit(store, T0 + 2_000)
    assert store.jobs_promote_due(T0 + 5_000, 10) == 1
    assert store.job_inspect(delayed).ready_at == T0 + 1_000
    assert claimed_ids(store, T0 + 5_000) == [delayed, immediate]


def test_claim_takes_at_most_count_jobs_best_first(store):
    jobs = [submit(store, T0 + i, priority=p) for i, p in enumerate([LOW, HIGH, NORMAL, HIGH, LOW])]
    assert claimed_ids(store, T0 + 10, count=3) == [jobs[1], jobs[3], jobs[2]]
    assert claimed_ids(store, T0 + 10, count=3) == [jobs[0], jobs[4]]
    assert claimed_ids(store, T0 + 10, count=3) == []


@pytest.mark.parametrize("queues", [["q"], []], ids=["count0", "no-queues"])
def test_claim_of_nothing_returns_nothing_and_changes_nothing(store, queues):
    job = submit(store, T0)
    before = snapshot(store, job)
    count = 0 if queues else 1
    assert store.jobs_claim(queues, "w1", count, LEASE_MS, T0) == []
    assert snapshot(store, job) == before


def test_claim_orders_across_several_queues_and_ignores_unlisted_ones(store):
    a_low = submit(store, T0, "a", priority=LOW)
    b_high = submit(store, T0 + 1, "b", priority=HIGH)
    a_high = submit(store, T0 + 2, "a", priority=HIGH)
    submit(store, T0, "c", priority=CRITICAL)
    leases = store.jobs_claim(["a", "b"], "w1", 10, LEASE_MS, T0 + 3)
    assert [lease.job_id for lease in leases] == [b_high, a_high, a_low]
    assert [lease.queue for lease in leases] == ["b", "a", "a"]
    assert store.queue_stats()["c"]["ready"] == 1


def test_claim_with_duplicate_queue_names_leases_each_job_once(store):
    jobs = [submit(store, T0 + i) for i in range(3)]
    leases = store.jobs_claim(["q", "q", "q"], "w1", 5, LEASE_MS, T0 + 5)
    assert [lease.job_id for lease in leases] == jobs
    assert store.queue_stats()["q"]["leased"] == 3
    assert store.event_totals()[("q", "leased")] == 3


# -- the held-lease rule: renew, ack, fail, release --------------------------------------


@op_names
def test_op_in_the_last_millisecond_of_the_lease_succeeds(store, op):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    OPS[op](store, job, "w1", lease.token, lease.lease_expires_at - 1)
    assert state(store, job) == STATE_AFTER[op]


@op_names
def test_op_at_the_expiry_instant_raises_lease_expired_and_changes_nothing(store, op):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    before = snapshot(store, job)
    with pytest.raises(LeaseExpired) as exc:
        OPS[op](store, job, "w1", lease.token, lease.lease_expires_at)
    assert exc.value.expired_at == lease.lease_expires_at
    assert snapshot(store, job) == before


@op_names
@pytest.mark.parametrize("wrong", ["token", "worker"])
def test_op_with_wrong_token_or_worker_raises_stale_token_and_changes_nothing(store, op, wrong):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    token = "0" * 32 if wrong == "token" else lease.token
    worker = "w2" if wrong == "worker" else "w1"
    before = snapshot(store, job)
    with pytest.raises(StaleToken):
        OPS[op](store, job, worker, token, T0 + 1)
    assert snapshot(store, job) == before


@op_names
def test_op_with_wrong_token_after_expiry_is_stale_not_expired(store, op):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    with pytest.raises(StaleToken):
        OPS[op](store, job, "w1", "f" * 32, lease.lease_expires_at + 5)


@op_names
@pytest.mark.parametrize(
    "bad_id",
    ["job_0000000000000001", "job_ffffffffffffffff", "job_XYZ", "JOB_0000000000000001", "", "42"],
)
def test_op_on_unknown_or_malformed_id_raises_not_found_and_changes_nothing(store, op, bad_id):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    before = snapshot(store, job)
    with pytest.raises(JobNotFound):
        OPS[op](store, bad_id, "w1", lease.token, T0 + 1)
    assert snapshot(store, job) == before


def test_renew_extends_the_lease_from_now(store):
    job = submit(store, T0)
    lease = claim_one(store, T0, lease_ms=10_000)
    assert store.lease_renew(job, "w1", lease.token, 20_000, T0 + 9_999) == T0 + 29_999
    assert store.job_inspect(job).lease_expires_at == T0 + 29_999
    assert store.next_expiry_at() == T0 + 29_999
    assert store.leases_reap_expired(T0 + 10_000, 10) == []
    store.jobs_ack(job, "w1", lease.token, None, T0 + 29_998)  # past the first expiry
    assert state(store, job) == SUCCEEDED


# -- ack ---------------------------------------------------------------------------------


def test_ack_marks_job_succeeded_with_result_and_finish_time(store):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    store.jobs_ack(job, "w1", lease.token, '{"ok": 1}', T0 + 700)
    info = store.job_inspect(job)
    assert (info.state, info.result, info.finished_at) == (SUCCEEDED, '{"ok": 1}', T0 + 700)
    assert info.lease_expires_at is None


def test_repeated_ack_with_the_completing_token_is_ok_and_changes_nothing(store):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    store.jobs_ack(job, "w1", lease.token, '"first"', T0 + 1)
    before = snapshot(store, job)
    # A retried ack, even long after the lease would have expired, with another result.
    store.jobs_ack(job, "w1", lease.token, '"second"', T0 + 10 * LEASE_MS)
    assert snapshot(store, job) == before
    assert store.job_inspect(job).result == '"first"'


@pytest.mark.parametrize("wrong", ["token", "worker"])
def test_ack_after_success_without_the_completing_lease_raises_stale_token(store, wrong):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    store.jobs_ack(job, "w1", lease.token, None, T0 + 1)
    before = snapshot(store, job)
    with pytest.raises(StaleToken):
        if wrong == "token":
            store.jobs_ack(job, "w1", "a" * 32, None, T0 + 2)
        else:
            store.jobs_ack(job, "w2", lease.token, None, T0 + 2)
    assert snapshot(store, job) == before


@pytest.mark.parametrize("op", ["renew", "fail", "release"])
def test_other_ops_with_the_completing_token_after_success_raise_stale_token(store, op):
    # The contract: without the current lease, renew/ack/fail/release answer stale_token.
    job = submit(store, T0)
    lease = claim_one(store, T0)
    store.jobs_ack(job, "w1", lease.token, None, T0 + 1)
    before = snapshot(store, job)
    with pytest.raises(StaleToken):
        OPS[op](store, job, "w1", lease.token, T0 + 2)
    assert snapshot(store, job) == before


# -- fail --------------------------------------------------------------------------------


def test_fail_records_the_error_and_schedules_the_retry(store):
    job = submit(store, T0, backoff=Backoff.fixed(2_500))
    lease = claim_one(store, T0)
    outcome = store.jobs_fail(job, "w1", lease.token, "timeout", True, T0 + 100)
    assert outcome == FailOutcome(RETRYING, T0 + 2_600)
    info = store.job_inspect(job)
    assert (info.state, info.run_at, info.last_error) == (RETRYING, T0 + 2_600, "timeout")
    assert info.errors == (ErrorEntry(1, "timeout", T0 + 100),)
    assert info.finished_at is None and info.lease_expires_at is None


def test_fail_not_retryable_is_dead_at_once_with_attempts_left(store):
    job = submit(store, T0, max_attempts=5)
    lease = claim_one(store, T0)
    outcome = store.jobs_fail(job, "w1", lease.token, "bad input", False, T0 + 10)
    assert outcome == FailOutcome(DEAD, None)
    info = store.job_inspect(job)
    assert (info.state, info.finished_at, info.last_error) == (DEAD, T0 + 10, "bad input")
    assert info.errors == (ErrorEntry(1, "bad input", T0 + 10),)


def test_fail_on_the_last_attempt_is_dead(store):
    job = submit(store, T0, max_attempts=1)
    lease = claim_one(store, T0)
    assert store.jobs_fail(job, "w1", lease.token, "e", True, T0 + 3) == FailOutcome(DEAD, None)
    assert store.job_inspect(job).finished_at == T0 + 3


@pytest.mark.parametrize("retryable", [True, False])
def test_repeated_fail_with_the_same_token_raises_stale_token(store, retryable):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    store.jobs_fail(job, "w1", lease.token, "once", retryable, T0 + 1, "first traceback")
    before = snapshot(store, job)
    with pytest.raises(StaleToken):
        store.jobs_fail(job, "w1", lease.token, "twice", retryable, T0 + 2, "second traceback")
    assert snapshot(store, job) == before
    assert [e.traceback for e in store.job_inspect(job).errors] == ["first traceback"]


def _longest_prefix_within(text: str, max_bytes: int) -> str:
    prefix = ""
    for ch in text:
        if len((prefix + ch).encode()) > max_bytes:
            break
        prefix += ch
    return prefix


@pytest.mark.parametrize(
    "make_error",
    [
        lambda m: "short",
        lambda m: "a" * m,
        lambda m: "a" * (m + 100),
        lambda m: "a" + "é" * m,  # a 2-byte character straddles the limit
        lambda m: "ab" + "€" * m,  # a 3-byte character straddles the limit
    ],
    ids=["short", "exact", "ascii", "2-byte", "3-byte"],
)
def test_fail_truncates_the_error_to_max_error_bytes_without_splitting_characters(
    store, make_error
):
    max_bytes = store.config.max_error_bytes
    error = make_error(max_bytes)
    job = submit(store, T0)
    lease = claim_one(store, T0)
    store.jobs_fail(job, "w1", lease.token, error, True, T0)
    info = store.job_inspect(job)
    expected = _longest_prefix_within(error, max_bytes)
    assert len(expected.encode()) <= max_bytes
    assert info.last_error == expected
    assert info.errors[0].error == expected


TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "jobs.py", line 7, in parse_row\n'
    "    raise ValueError(row)\n"
    "ValueError: row 7"
)


def test_fail_keeps_the_traceback_beside_the_error_of_its_attempt(store):
    job = submit(store, T0, max_attempts=4, backoff=Backoff.fixed(10))
    for n, traceback in enumerate((TRACEBACK, None, "")):
        now = T0 + 10 * n
        store.jobs_promote_due(now, 10)
        lease = claim_one(store, now)
        store.jobs_fail(job, "w1", lease.token, f"failure {n + 1}", True, now, traceback)
    expected = (
        ErrorEntry(1, "failure 1", T0, TRACEBACK),
        ErrorEntry(2, "failure 2", T0 + 10),  # none given
        ErrorEntry(3, "failure 3", T0 + 20),  # an empty one is none
    )
    assert store.job_inspect(job).errors == expected
    assert store.job_inspect(job).last_error == "failure 3"
    store.jobs_promote_due(T0 + 30, 10)
    lease = claim_one(store, T0 + 30)
    store.jobs_fail(job, "w1", lease.token, "failure 4", True, T0 + 30, TRACEBACK)
    [info], _ = store.dead_list("q", 10, None)
    assert info.errors == (*expected, ErrorEntry(4, "failure 4", T0 + 30, TRACEBACK))


def _longest_suffix_within(text: str, max_bytes: int) -> str:
    suffix = ""
    for ch in reversed(text):
        if len((ch + suffix).encode()) > max_bytes:
            break
        suffix = ch + suffix
    return suffix


@pytest.mark.parametrize(
    "make_traceback",
    [
        lambda m: "a" * m,
        lambda m: "head\n" + "a" * m + "\nValueError: the end",
        lambda m: "é" * m + "a",  # a 2-byte character straddles the limit
        lambda m: "€" * m + "ab",  # a 3-byte character straddles the limit
    ],
    ids=["exact", "ascii", "2-byte", "3-byte"],
)
def test_fail_truncates_the_traceback_keeping_its_end_without_splitting_characters(
    store, make_traceback
):
    max_bytes = store.config.max_traceback_bytes
    traceback = make_traceback(max_bytes)
    job = submit(store, T0)
    lease = claim_one(store, T0)
    store.jobs_fail(job, "w1", lease.token, "e", True, T0, traceback)
    [entry] = store.job_inspect(job).errors
    expected = _longest_suffix_within(traceback, max_bytes)
    assert max_bytes - 3 <= len(expected.encode()) <= max_bytes
    assert entry.traceback == expected and traceback.endswith(entry.traceback)


def test_tracebacks_count_in_the_dead_lists_page_bytes(store):
    for _ in range(4):
        job = submit(store, T0, max_attempts=1)
        lease = claim_one(store, T0)
        store.jobs_fail(job, "w1", lease.token, "e", False, T0, "t" * 8_000)
    page, _ = store.dead_list(None, 100, None, max_bytes=20_000)
    assert len(page) == 3  # ~8.3 KB a job: without its traceback all 4 would fit


@pytest.mark.parametrize(
    ("backoff", "max_attempts", "delays"),
    [
        (Backoff.fixed(5_000), 4, [5_000, 5_000, 5_000]),
        (NO_JITTER, 4, [1_000, 2_000, 4_000]),
        (Backoff("exponential", 250, 1_500, jitter=False), 6, [250, 500, 1_000, 1_500, 1_500]),
    ],
    ids=["fixed", "exponential", "exponential-capped"],
)
def test_failing_job_retries_after_its_backoff_until_dead(store, backoff, max_attempts, delays):
    job = submit(store, T0, backoff=backoff, max_attempts=max_attempts)
    now = T0
    history = []
    for attempt, delay in enumerate(delays, start=1):
        lease = claim_one(store, now)
        assert lease.attempt == attempt
        outcome = store.jobs_fail(job, "w1", lease.token, f"e{attempt}", True, now)
        history.append(ErrorEntry(attempt, f"e{attempt}", now))
        assert outcome == FailOutcome(RETRYING, now + delay)
        assert store.next_due_at() == now + delay
        assert store.jobs_promote_due(now + delay - 1, 10) == 0
        assert state(store, job) == RETRYING
        now += delay
        assert store.jobs_promote_due(now, 10) == 1
        info = store.job_inspect(job)
        assert (info.state, info.ready_at, info.attempt) == (READY, now, attempt)
    lease = claim_one(store, now)
    assert lease.attempt == max_attempts
    assert store.jobs_fail(job, "w1", lease.token, "last", True, now) == FailOutcome(DEAD, None)
    info = store.job_inspect(job)
    assert (info.state, info.finished_at, info.last_error) == (DEAD, now, "last")
    assert info.errors == (*history, ErrorEntry(max_attempts, "last", now))


def test_jittered_backoff_waits_between_half_and_all_of_the_exponential_delay(store):
    base, cap, failures = 1_000, 16_000, 80
    job = submit(store, T0, max_attempts=failures + 1, backoff=Backoff("exponential", base, cap))
    now = T0
    capped_delays = []
    for n in range(1, failures + 1):
        lease = claim_one(store, now)
        retry_at = store.jobs_fail(job, "w1", lease.token, "e", True, now).retry_at
        delay = retry_at - now
        full = min(cap, base * 2 ** (n - 1))
        assert full / 2 <= delay <= full, (n, delay)
        if full == cap:
            capped_delays.append(delay)
        now = retry_at
        assert store.jobs_promote_due(now, 10) == 1
    assert len(set(capped_delays)) > 10, "jitter should spread the delays"


# -- release -----------------------------------------------------------------------------


def test_release_gives_the_job_back_with_its_attempt_and_place(store):
    first = submit(store, T0)
    second = submit(store, T0 + 1)
    lease = claim_one(store, T0 + 10)
    assert lease.job_id == first
    store.jobs_release(first, "w1", lease.token, T0 + 20)
    info = store.job_inspect(first)
    assert (info.state, info.attempt, info.ready_at) == (READY, 0, T0)
    assert info.lease_expires_at is None
    assert claimed_ids(store, T0 + 30) == [first, second]


def test_release_after_a_failed_attempt_keeps_the_failed_attempt(store):
    job = submit(store, T0, backoff=Backoff.fixed(100))
    lease = claim_one(store, T0)
    store.jobs_fail(job, "w1", lease.token, "e", True, T0)
    store.jobs_promote_due(T0 + 100, 10)
    lease = claim_one(store, T0 + 100)
    assert lease.attempt == 2
    store.jobs_release(job, "w1", lease.token, T0 + 101)
    info = store.job_inspect(job)
    assert (info.attempt, info.ready_at) == (1, T0 + 100)
    assert claim_one(store, T0 + 102).attempt == 2


def test_repeated_release_with_the_same_token_raises_stale_token(store):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    store.jobs_release(job, "w1", lease.token, T0 + 1)
    before = snapshot(store, job)
    with pytest.raises(StaleToken):
        store.jobs_release(job, "w1", lease.token, T0 + 2)
    assert snapshot(store, job) == before


# -- promote -----------------------------------------------------------------------------


def test_promote_makes_due_pending_jobs_ready_from_their_due_time(store):
    soon = submit(store, T0, delay_ms=1_000)
    later = submit(store, T0, delay_ms=5_000)
    assert store.jobs_promote_due(T0 + 999, 10) == 0
    assert store.jobs_promote_due(T0 + 3_000, 10) == 1
    assert (state(store, soon), state(store, later)) == (READY, PENDING)
    assert store.job_inspect(soon).ready_at == T0 + 1_000
    assert store.jobs_promote_due(T0 + 3_000, 10) == 0


def test_promote_respects_its_limit(store):
    store.jobs_submit([spec(delay_ms=100 + i) for i in range(5)], T0)
    assert store.jobs_promote_due(T0 + 1_000, 2) == 2
    assert store.queue_stats()["q"]["ready"] == 2
    assert store.jobs_promote_due(T0 + 1_000, 2) == 2
    assert store.jobs_promote_due(T0 + 1_000, 2) == 1
    assert store.queue_stats()["q"]["ready"] == 5


# -- lease expiry (reaper) ---------------------------------------------------------------


def test_reap_leaves_leases_that_have_not_expired(store):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    assert store.leases_reap_expired(lease.lease_expires_at - 1, 10) == []
    assert state(store, job) == LEASED


def test_reap_makes_an_expired_job_with_attempts_left_ready_from_its_expiry(store):
    job = submit(store, T0, max_attempts=2)
    lease = claim_one(store, T0)
    expiry = lease.lease_expires_at
    [reaped] = store.leases_reap_expired(expiry + 50, 10)
    assert (reaped.job_id, reaped.queue, reaped.state, reaped.attempt) == (job, "q", READY, 1)
    info = store.job_inspect(job)
    assert (info.state, info.ready_at, info.attempt) == (READY, expiry, 1)
    assert [e.error for e in info.errors] == ["lease expired"]
    assert info.errors[0].attempt == 1
    assert claim_one(store, expiry + 60).attempt == 2


def test_reap_at_the_expiry_instant_ends_the_lease(store):
    submit(store, T0)
    lease = claim_one(store, T0)
    assert len(store.leases_reap_expired(lease.lease_expires_at, 10)) == 1


def test_reap_on_the_last_attempt_makes_the_job_dead_with_lease_expired(store):
    job = submit(store, T0, max_attempts=1)
    lease = claim_one(store, T0)
    [reaped] = store.leases_reap_expired(lease.lease_expires_at + 5, 10)
    assert (reaped.state, reaped.attempt) == (DEAD, 1)
    info = store.job_inspect(job)
    assert (info.state, info.last_error) == (DEAD, "lease expired")
    assert info.finished_at is not None
    assert [(e.attempt, e.error) for e in info.errors] == [(1, "lease expired")]


def test_reap_respects_its_limit(store):
    store.jobs_submit([spec() for _ in range(5)], T0)
    store.jobs_claim(["q"], "w1", 5, LEASE_MS, T0)
    assert len(store.leases_reap_expired(T0 + LEASE_MS, 3)) == 3
    assert len(store.leases_reap_expired(T0 + LEASE_MS, 3)) == 2
    assert store.queue_stats()["q"]["ready"] == 5


def _end_by_reap(store, lease):
    store.leases_reap_expired(lease.lease_expires_at, 10)


def _end_by_recover(store, lease):
    if recovers_on_start(store):
        store.leases_recover(T0 + 5)
        return
    # Where several servers share the store, a starting server leaves every lease alone;
    # a lost one ends at its expiry, through the reaper.
    assert store.leases_recover(T0 + 5) == 0
    assert store.job_inspect(lease.job_id).lease_expires_at == lease.lease_expires_at
    store.leases_reap_expired(lease.lease_expires_at, 10)


@op_names
@pytest.mark.parametrize("end", [_end_by_reap, _end_by_recover], ids=["reaped", "recovered"])
@pytest.mark.parametrize("max_attempts", [1, 3])
def test_old_token_after_the_server_ended_the_lease_raises_lease_expired(
    store, op, end, max_attempts
):
    job = submit(store, T0, max_attempts=max_attempts)
    lease = claim_one(store, T0)
    end(store, lease)
    before = snapshot(store, job)
    with pytest.raises(LeaseExpired):
        OPS[op](store, job, "w1", lease.token, lease.lease_expires_at + 10)
    assert snapshot(store, job) == before


@op_names
@pytest.mark.parametrize("end", [_end_by_reap, _end_by_recover], ids=["reaped", "recovered"])
def test_old_token_after_another_worker_claimed_the_job_raises_stale_token(store, op, end):
    job = submit(store, T0)
    lease = claim_one(store, T0)
    end(store, lease)
    now = lease.lease_expires_at + 10
    claim_one(store, now, worker="w2")
    before = snapshot(store, job)
    with pytest.raises(StaleToken):
        OPS[op](store, job, "w1", lease.token, now + 1)
    assert snapshot(store, job) == before


# -- restart recovery --------------------------------------------------------------------


def test_recover_makes_every_leased_job_ready_at_once_and_gives_the_attempt_back(store):
    held = submit(store, T0)
    expired = submit(store, T0 + 1)
    waiting = submit(store, T0 + 2)
    pending = submit(store, T0, delay_ms=DAY)
    claim_one(store, T0 + 10, lease_ms=DAY)
    claim_one(store, T0 + 10, lease_ms=100)  # expired but never reaped
    if not recovers_on_start(store):
        # Other servers' leases are alive: nothing is taken back; the reaper ends the
        # expired one, and the held one stays held.
        before = dump(store), store.queue_stats()
        assert store.leases_recover(T0 + 1_000) == 0
        assert (dump(store), store.queue_stats()) == before
        assert [r.job_id for r in store.leases_reap_expired(T0 + 1_000, 10)] == [expired]
        assert (state(store, held), state(store, expired)) == (LEASED, READY)
        assert store.next_expiry_at() == T0 + 10 + DAY
        return
    assert store.leases_recover(T0 + 1_000) == 2
    for job in (held, expired):
        info = store.job_inspect(job)
        assert (info.state, info.attempt) == (READY, 0)
    assert (state(store, waiting), state(store, pending)) == (READY, PENDING)
    assert store.next_expiry_at() is None
    assert sorted(claimed_ids(store, T0 + 1_000)) == [held, expired, waiting]


# -- terminal states ---------------------------------------------------------------------


def test_terminal_jobs_are_never_claimed_promoted_or_reaped(store):
    succeeded = submit(store, T0)
    lease = claim_one(store, T0)
    store.jobs_ack(succeeded, "w1", lease.token, None, T0)
    # Dead after a retry: it still remembers a past run_at.
    retried = submit(store, T0, backoff=Backoff.fixed(10), max_attempts=2)
    lease = claim_one(store, T0)
    store.jobs_fail(retried, "w1", lease.token, "e", True, T0)
    store.jobs_promote_due(T0 + 10, 10)
    lease = claim_one(store, T0 + 10)
    store.jobs_fail(retried, "w1", lease.token, "e", True, T0 + 10)
    # Dead by lease expiry: it still remembers a past lease expiry.
    expired = submit(store, T0, max_attempts=1)
    lease = claim_one(store, T0)
    store.leases_reap_expired(lease.lease_expires_at, 10)
    assert [state(store, j) for j in (succeeded, retried, expired)] == [SUCCEEDED, DEAD, DEAD]
    before = dump(store), store.queue_stats()
    far = T0 + 30 * DAY
    assert store.jobs_promote_due(far, 100) == 0
    assert store.leases_reap_expired(far, 100) == []
    assert store.jobs_claim(["q"], "w1", 10, LEASE_MS, far) == []
    assert store.leases_recover(far) == 0
    assert (dump(store), store.queue_stats()) == before
    assert store.next_due_at() is None and store.next_expiry_at() is None


# -- dead letters ------------------------------------------------------------------------


@pytest.mark.parametrize("total", [4, 5])
def test_dead_list_pages_oldest_first_until_next_cursor_is_none(store, total):
    dead = [make_dead(store, T0 + i) for i in range(total)]
    submit(store, T0)  # a live job is never listed
    pages, cursor = [], None
    while True:
        jobs, cursor = store.dead_list(None, 2, cursor)
        pages.append([j.job_id for j in jobs])
        if cursor is None:
            break
        assert cursor == jobs[-1].job_id
    assert [job for page in pages for job in page] == dead
    assert [len(p) for p in pages] == [2] * (total // 2) + ([1] if total % 2 else [])


def _pages(store: Store, queue: str | None, limit: int, newest: bool) -> list[list[str]]:
    """Every page of the dead list in one order, following next_cursor to the end."""
    pages: list[list[str]] = []
    cursor = None
    while True:
        jobs, cursor = store.dead_list(queue, limit, cursor, newest=newest)
        pages.append([j.job_id for j in jobs])
        if cursor is None:
            return pages
        assert cursor == jobs[-1].job_id and len(pages) < 100


@pytest.mark.parametrize("queue", [None, "q"])
def test_dead_list_pages_newest_first_by_job_id(store, queue):
    # The oldest job dies last: the order is by job id (creation), not by time of death.
    first = submit(store, T0, max_attempts=1, delay_ms=10)
    dead = [make_dead(store, T0 + i) for i in range(1, 6)]
    make_dead(store, T0, "other")  # listed only without a queue
    store.jobs_promote_due(T0 + 10, 10)
    lease = claim_one(store, T0 + 10)
    assert lease.job_id == first
    store.jobs_fail(first, "w1", lease.token, "late", False, T0 + 10)
    submit(store, T0 + 20)  # a live job is never listed
    mine = [first, *dead]
    pages = _pages(store, queue, 2, newest=True)
    assert [len(p) for p in pages] == ([2, 2, 2] if queue else [2, 2, 2, 1])
    listed = [job for page in pages for job in page]
    assert [j for j in listed if j in mine] == mine[::-1]
    assert listed == sorted(listed, reverse=True)
    assert [job for page in _pages(store, queue, 2, newest=False) for job in page] == listed[::-1]


def test_dead_list_cursor_means_after_its_job_in_the_order_asked(store):
    dead = [make_dead(store, T0 + i) for i in range(5)]
    jobs, cursor = store.dead_list(None, 2, None, newest=True)
    assert [j.job_id for j in jobs] == [dead[4], dead[3]] and cursor == dead[3]
    # A job that dies between pages is on a later page only if it lies beyond the cursor:
    # newest first, a new job (the newest id) is not; oldest first, it is.
    late = make_dead(store, T0 + 10)
    jobs, _ = store.dead_list(None, 10, cursor, newest=True)
    assert [j.job_id for j in jobs] == [dead[2], dead[1], dead[0]]
    # The same cursor oldest first: the jobs after it in that order.
    jobs, _ = store.dead_list(None, 10, cursor, newest=False)
    assert [j.job_id for j in jobs] == [dead[4], late]
    # The cursor's own job need not be dead any more.
    store.dead_purge(dead[3])
    jobs, _ = store.dead_list(None, 1, cursor, newest=True)
    assert [j.job_id for j in jobs] == [dead[2]]
    # A cursor that names no job: the first page, in either order.
    assert store.dead_list(None, 1, "nope", newest=True)[0][0].job_id == late
    assert store.dead_list(None, 1, "nope")[0][0].job_id == dead[0]


def test_dead_list_filters_by_queue(store):
    a = [make_dead(store, T0, "a") for _ in range(3)]
    make_dead(store, T0, "b")
    jobs, cursor = store.dead_list("a", 10, None)
    assert [j.job_id for j in jobs] == a and cursor is None
    jobs, cursor = store.dead_list("a", 2, None)
    jobs2, cursor2 = store.dead_list("a", 2, cursor)
    assert [j.job_id for j in jobs + jobs2] == a and cursor2 is None
    assert store.dead_list("nope", 10, None) == ([], None)


def test_dead_list_shows_the_error_history(store):
    job = submit(store, T0, max_attempts=2, backoff=Backoff.fixed(10))
    lease = claim_one(store, T0)
    store.jobs_fail(job, "w1", lease.token, "first", True, T0)
    store.jobs_promote_due(T0 + 10, 10)
    lease = claim_one(store, T0 + 10)
    store.jobs_fail(job, "w1", lease.token, "second", True, T0 + 20)
    [info], _ = store.dead_list("q", 10, None)
    assert info.errors == (ErrorEntry(1, "first", T0), ErrorEntry(2, "second", T0 + 20))
    assert (info.state, info.last_error) == (DEAD, "second")


def test_dead_retry_makes_the_job_ready_with_fresh_attempts(store):
    job = submit(store, T0, max_attempts=2, backoff=Backoff.fixed(10))
    for now in (T0, T0 + 10):
        store.jobs_promote_due(now, 10)
        lease = claim_one(store, now)
        store.jobs_fail(job, "w1", lease.token, "e", True, now)
    assert state(store, job) == DEAD
    assert store.dead_retry(job, T0 + 100) == 1
    info = store.job_inspect(job)
    assert (info.state, info.attempt, info.finished_at) == (READY, 0, None)
    assert len(info.errors) == 2
    lease = claim_one(store, T0 + 100)
    assert (lease.job_id, lease.attempt, lease.max_attempts) == (job, 1, 2)


@pytest.mark.parametrize("live", ["ready", "pending", "leased", "retrying", "succeeded"])
@pytest.mark.parametrize("op", ["retry", "purge"])
def test_dead_retry_or_purge_of_a_live_job_raises_invalid_state(store, live, op):
    job = submit(store, T0, delay_ms=DAY if live == "pending" else 0)
    if live in ("leased", "retrying", "succeeded"):
        lease = claim_one(store, T0)
        if live == "retrying":
            store.jobs_fail(job, "w1", lease.token, "e", True, T0)
        elif live == "succeeded":
            store.jobs_ack(job, "w1", lease.token, None, T0)
    before = snapshot(store, job)
    with pytest.raises(InvalidState):
        store.dead_retry(job, T0 + 1) if op == "retry" else store.dead_purge(job)
    assert snapshot(store, job) == before


@pytest.mark.parametrize("bad_id", ["job_0000000000000001", "job_nope"])
def test_dead_retry_or_purge_of_an_unknown_job_raises_not_found(store, bad_id):
    make_dead(store, T0)
    with pytest.raises(JobNotFound):
        store.dead_retry(bad_id, T0)
    with pytest.raises(JobNotFound):
        store.dead_purge(bad_id)


@pytest.mark.parametrize("action", ["retry", "purge"])
def test_dead_retry_and_purge_of_a_queue_are_bounded_by_limit(store, action):
    for _ in range(5):
        make_dead(store, T0, "a")
    other = make_dead(store, T0, "b")

    def run(limit):
        if action == "retry":
            return store.dead_retry_queue("a", T0 + 1, limit)
        return store.dead_purge_queue("a", limit)

    assert [run(2), run(2), run(2), run(2)] == [2, 2, 1, 0]
    stats = store.queue_stats()
    assert stats.get("a", {}).get("dead", 0) == 0
    assert stats.get("a", {}).get("ready", 0) == (5 if action == "retry" else 0)
    assert state(store, other) == DEAD


def test_dead_purge_deletes_the_job_and_its_errors_and_keeps_its_key_until_it_expires(store):
    job = make_dead(store, T0, idempotency_key="k")
    assert store.dead_purge(job) == 1
    with pytest.raises(JobNotFound):
        store.job_inspect(job)
    key = parse_job_id(job)
    assert scalar(store, "SELECT count(*) FROM job_errors WHERE job_id = ?", key) == 0
    [again] = store.jobs_submit([spec(idempotency_key="k")], T0 + 1)
    assert (again.job_id, again.state, again.duplicate) == (job, DEAD, True)
    assert store.queue_stats().get("q", {}).get("ready", 0) == 0
    expired = T0 + store.config.idempotency_window_ms
    store.jobs_prune(expired, 100)
    assert scalar(store, "SELECT count(*) FROM idempotency_keys") == 0
    [again] = store.jobs_submit([spec(idempotency_key="k")], expired + 1)
    assert again.duplicate is False and again.job_id != job


def test_a_job_pruned_within_its_keys_window_keeps_its_key(stores):
    store = stores.open(config=StoreConfig(retention_ms=DAY // 4))
    job = submit(store, T0, idempotency_key="k")
    lease = claim_one(store, T0)
    store.jobs_ack(job, "w1", lease.token, None, T0 + 5)
    assert store.jobs_prune(T0 + 6 + DAY // 4, 100) == 1
    with pytest.raises(JobNotFound):
        store.job_inspect(job)
    [again] = store.jobs_submit([spec(idempotency_key="k")], T0 + DAY // 2)
    assert (again.job_id, again.state, again.duplicate) == (job, SUCCEEDED, True)
    assert store.queue_stats() == recount(store) == {}


# -- prune -------------------------------------------------------------------------------


def test_prune_deletes_succeeded_jobs_only_once_past_retention(store):
    retention = store.config.retention_ms
    done = submit(store, T0)
    lease = claim_one(store, T0)
    store.jobs_ack(done, "w1", lease.token, None, T0 + 5)
    dead = make_dead(store, T0)
    ready = submit(store, T0)
    assert store.jobs_prune(T0 + 5 + retention, 100) == 0
    assert state(store, done) == SUCCEEDED
    assert store.jobs_prune(T0 + 5 + retention + 1, 100) == 1
    with pytest.raises(JobNotFound):
        store.job_inspect(done)
    assert (state(store, dead), state(store, ready)) == (DEAD, READY)
    assert store.queue_stats() == recount(store)


def test_prune_respects_its_limit_and_deletes_errors_of_pruned_jobs(store):
    jobs = []
    for _ in range(3):
        job = submit(store, T0, backoff=Backoff.fixed(1))
        lease = claim_one(store, T0 + 10)
        store.jobs_fail(job, "w1", lease.token, "e", True, T0 + 10)
        store.jobs_promote_due(T0 + 11, 10)
        lease = claim_one(store, T0 + 11)
        store.jobs_ack(job, "w1", lease.token, None, T0 + 12)
        jobs.append(job)
    later = T0 + store.config.retention_ms + DAY
    assert store.jobs_prune(later, 2) == 2
    assert store.jobs_prune(later, 2) == 1
    assert store.jobs_prune(later, 2) == 0
    assert scalar(store, "SELECT count(*) FROM job_errors") == 0


def test_prune_deletes_expired_idempotency_keys_only(store):
    window = store.config.idempotency_window_ms
    old = submit(store, T0, idempotency_key="old")
    submit(store, T0 + DAY // 2, idempotency_key="new")

    def keys():
        return sorted(k for (k,) in rows(store, "SELECT key FROM idempotency_keys"))

    store.jobs_prune(T0 + window - 1, 100)
    assert keys() == ["new", "old"]
    store.jobs_prune(T0 + window + 1, 100)
    assert keys() == ["new"]
    assert state(store, old) == READY  # the job itself stays


# -- inspect by an abbreviated id --------------------------------------------------------


def test_inspect_prefix_answers_the_one_job_whose_id_begins_so(store):
    job = submit(store)
    lease = claim_one(store)
    store.jobs_fail(job, "w1", lease.token, "boom", True, T0 + 1)
    for digits in range(7, 17):
        assert store.job_inspect_prefix(job[: 4 + digits]) == store.job_inspect(job)


def test_inspect_prefix_tells_apart_jobs_by_the_digits_that_differ(store):
    # Made 3 s apart: the same first 7 digits (they change every 2**15 ms), not 8; a day
    # later, not 7. (The ids' layout: relay/protocol/model.py; PostgreSQL's sequence keeps it.)
    early, late, next_day = (submit(store, now) for now in (T0, T0 + 3_000, T0 + DAY))
    assert early[:11] == late[:11] != next_day[:11] and early[:12] != late[:12]
    with pytest.raises(BadRequest, match="more than one job") as refused:
        store.job_inspect_prefix(early[:11])
    assert refused.value.field == "job_id"
    assert store.job_inspect_prefix(early[:12]).job_id == early
    assert store.job_inspect_prefix(late[:12]).job_id == late
    assert store.job_inspect_prefix(next_day[:11]).job_id == next_day


def test_inspect_prefix_of_one_millisecond_needs_the_digits_that_differ(store):
    a, b = (r.job_id for r in store.jobs_submit([spec(), spec()], T0))
    assert a[:19] == b[:19]  # sequence numbers 0 and 1
    with pytest.raises(BadRequest, match="job_id"):
        store.job_inspect_prefix(a[:19])
    assert [store.job_inspect_prefix(i).job_id for i in (a, b)] == [a, b]


def test_inspect_prefix_at_the_top_of_the_key_range(store):
    # The last millisecond a key holds (in 2109): the range of a prefix that covers it
    # ends at the largest key, not past it.
    top = submit(store, (1 << 42) - 1)
    assert top.startswith("job_7fffffffffe")
    assert store.job_inspect_prefix("job_7ffffff").job_id == top
    assert store.job_inspect_prefix("job_7fffffffffe").job_id == top


@pytest.mark.parametrize(
    "prefix",
    ["job_0000000", "job_8000000", "job_fffffff", "job_ffffffffffffffff", "job_123", "", "x" * 11],
)
def test_inspect_prefix_of_no_job_or_of_no_id_raises_not_found(store, prefix):
    submit(store)
    with pytest.raises(JobNotFound):
        store.job_inspect_prefix(prefix)


@sqlite_only  # one range seek of the rowid, never a scan (PostgreSQL: test_postgres.py)
def test_inspect_prefix_reads_a_range_of_the_key(store):
    details = _plan(store, _PREFIX_KEYS_SQL, (0, 1 << 36))
    assert details == ["SEARCH jobs USING INTEGER PRIMARY KEY (rowid>? AND rowid<?)"]


# -- the shortest abbreviations of ids ---------------------------------------------------


def test_short_ids_of_the_only_job_have_7_digits_and_of_no_job_are_whole(store):
    job = submit(store)
    key = parse_job_id(job)
    near = [f"job_{k:016x}" for k in (key - 1, key + 1, 0, (1 << 63) - 1)]
    assert store.job_ids_abbreviate([job, *near, job]) == [job[:11], *near, job[:11]]


def test_short_ids_tell_each_job_from_its_nearest_neighbours(store):
    # Made 3 s apart, two ids share their first 7 digits (they change every 2**15 ms): 8
    # tell them apart. Two of one batch (one millisecond) share 15: whole ids. A day
    # later, a lone job: 7 digits. (The ids' layout: relay/protocol/model.py.)
    early, late = submit(store, T0), submit(store, T0 + 3_000)
    a, b = (r.job_id for r in store.jobs_submit([spec(), spec()], T0 + 10_000))
    lone = submit(store, T0 + DAY)
    every = [early, late, a, b, lone]
    shown = store.job_ids_abbreviate(every)
    assert shown == [early[:12], late[:12], a, b, lone[:11]]
    assert_abbreviated_as_git_does(every, every, shown)
    # Asked again after a job that shares more digits is made: longer, at that time.
    nearer = submit(store, T0 + DAY + 1)
    assert store.job_ids_abbreviate([lone])[0] == lone[: len(common_start(lone, nearer)) + 1]
    assert len(store.job_ids_abbreviate([lone])[0]) > 11


def test_short_ids_of_ids_sharing_12_digits_keep_13(store):
    # Ids of one millisecond run on in their sequence's digits: ...0fff and ...1000 share 12
    # of 16. The batch is sized so that its last id is ...1000 (a key's last 21 bits count
    # within the millisecond; PostgreSQL's first is ...0001, SQLite's ...0000).
    first = store.jobs_submit([spec()], T0)[0].job_id
    seq = parse_job_id(first) & 0x1FFFFF
    rest = [r.job_id for r in store.jobs_submit([spec()] * (0x1000 - seq), T0)]
    below, last = rest[-2:]
    assert (below[-4:], last[-4:]) == ("0fff", "1000") and len(common_start(below, last)) == 16
    every = [first, *rest]
    asked = [first, rest[0], below, last, *random.Random(7).sample(rest, 50)]
    shown = store.job_ids_abbreviate(asked)
    assert shown[3] == last[:17] and shown[2] == below  # 13 digits; 16 (0ffe is below it)
    assert_abbreviated_as_git_does(every, asked, shown)


def test_short_ids_of_the_smallest_and_largest_ids_have_one_neighbour_each(store):
    # The first millisecond there is, and the last a key holds (in 2109): ids with no
    # neighbour below, and none above. Each of a pair of one millisecond needs 16 digits.
    low = [r.job_id for r in store.jobs_submit([spec(), spec()], 0)]
    middle = submit(store, T0)
    high = [r.job_id for r in store.jobs_submit([spec(), spec()], (1 << 42) - 1)]
    assert low[0] <= "job_0000000000000001" and high[1] > "job_7fffffffffe00000"
    every = [*low, middle, *high]
    assert store.job_ids_abbreviate(every) == [*low, middle[:11], *high]
    assert_abbreviated_as_git_does(every, every, store.job_ids_abbreviate(every))


@sqlite_only  # two seeks of the rowid, never a scan (PostgreSQL: test_postgres.py)
def test_short_ids_seek_the_nearest_keys(store):
    details = _plan(store, _NEIGHBOURS_SQL, (1 << 50,))
    assert [d for d in details if "jobs" in d] == [
        "SEARCH jobs USING INTEGER PRIMARY KEY (rowid<?)",
        "SEARCH jobs USING INTEGER PRIMARY KEY (rowid>?)",
    ], details


# -- stats, totals, next times -----------------------------------------------------------


def test_queue_stats_show_all_six_states_per_queue(store):
    submit(store, T0, "a")
    submit(store, T0, "b", delay_ms=10)
    stats = store.queue_stats()
    assert set(stats) == {"a", "b"}
    for by_state in stats.values():
        assert set(by_state) == {str(s) for s in JobState}
    assert stats["a"] == {**dict.fromkeys(map(str, JobState), 0), "ready": 1}
    assert stats["b"] == {**dict.fromkeys(map(str, JobState), 0), "pending": 1}


def test_oldest_ready_is_the_longest_wait_over_every_priority_of_a_queue(store):
    submit(store, T0, "a", priority=LOW)
    submit(store, T0 + 500, "a", priority=CRITICAL)
    submit(store, T0 + 900, "a", priority=NORMAL)
    submit(store, T0 + 200, "b")
    submit(store, T0, "c", delay_ms=MINUTE)  # pending: not waiting to be leased yet
    assert store.oldest_ready_ms(T0 + 1000) == {"a": 1000, "b": 800}
    # Leased in priority order: the critical job, then the normal one; the low one waits on.
    assert len(store.jobs_claim(["a"], "w1", 2, LEASE_MS, T0 + 1000)) == 2
    assert store.oldest_ready_ms(T0 + 3000) == {"a": 3000, "b": 2800}
    store.jobs_claim(["a"], "w1", 1, LEASE_MS, T0 + 3000)
    assert store.oldest_ready_ms(T0 + 3000) == {"b": 2800}
    # A promoted job counts as ready from its due time.
    store.jobs_promote_due(T0 + MINUTE + 100, 10)
    assert store.oldest_ready_ms(T0 + MINUTE + 100) == {"b": MINUTE - 100, "c": 100}


def test_queue_stats_match_a_recount_after_every_kind_of_transition(store):
    steps: list[str] = []

    def check(step: str) -> None:
        steps.append(step)
        assert store.queue_stats() == recount(store), step

    fixed = Backoff.fixed(100)
    jobs = [r.job_id for r in store.jobs_submit([spec(backoff=fixed) for _ in range(6)], T0)]
    jobs.append(submit(store, T0, "b", delay_ms=50, max_attempts=1))
    check("submit")
    store.jobs_submit([spec(idempotency_key="k"), spec(idempotency_key="k")], T0)
    check("submit duplicate")
    leases = {lease.job_id: lease for lease in store.jobs_claim(["q"], "w1", 7, LEASE_MS, T0)}
    check("claim")
    store.lease_renew(jobs[0], "w1", leases[jobs[0]].token, LEASE_MS, T0 + 1)
    check("renew")
    store.jobs_ack(jobs[0], "w1", leases[jobs[0]].token, None, T0 + 1)
    check("ack")
    store.jobs_fail(jobs[1], "w1", leases[jobs[1]].token, "e", True, T0 + 1)
    check("fail to retrying")
    store.jobs_fail(jobs[2], "w1", leases[jobs[2]].token, "e", False, T0 + 1)
    check("fail to dead")
    store.jobs_release(jobs[3], "w1", leases[jobs[3]].token, T0 + 1)
    check("release")
    store.jobs_promote_due(T0 + 200, 100)
    check("promote")
    store.leases_reap_expired(T0 + 10 + LEASE_MS, 1)
    check("reap to ready")
    lease = claim_one(store, T0 + 200, ("b",))
    store.leases_reap_expired(lease.lease_expires_at, 100)
    check("reap to dead")
    store.jobs_claim(["q"], "w1", 2, LEASE_MS, T0 + 300)
    store.leases_recover(T0 + 400)
    check("recover")
    store.dead_retry(jobs[2], T0 + 500)
    check("dead retry")
    store.dead_retry_queue("b", T0 + 500, 10)
    check("dead retry queue")
    make_dead(store, T0 + 600, "c")
    make_dead(store, T0 + 600, "c")
    store.dead_purge(store.dead_list("c", 1, None)[0][0].job_id)
    check("dead purge")
    store.dead_purge_queue("c", 10)
    check("dead purge queue")
    store.jobs_prune(T0 + store.config.retention_ms + DAY, 100)
    check("prune")
    assert "c" not in store.queue_stats()


def test_event_totals_count_each_kind_of_event_per_queue(store):
    fixed = Backoff.fixed(10)
    jobs = [r.job_id for r in store.jobs_submit([spec(backoff=fixed) for _ in range(4)], T0)]
    store.jobs_submit([spec(idempotency_key="k"), spec(idempotency_key="k")], T0)
    last = submit(store, T0, "b", max_attempts=1)
    leases = {lease.job_id: lease for lease in store.jobs_claim(["q"], "w1", 4, LEASE_MS, T0)}
    store.jobs_ack(jobs[0], "w1", leases[jobs[0]].token, None, T0)
    store.jobs_fail(jobs[1], "w1", leases[jobs[1]].token, "e", True, T0)
    store.jobs_fail(jobs[2], "w1", leases[jobs[2]].token, "e", False, T0)
    store.jobs_release(jobs[3], "w1", leases[jobs[3]].token, T0)
    lease = claim_one(store, T0, ("b",))
    store.leases_reap_expired(lease.lease_expires_at, 10)
    assert state(store, last) == DEAD
    assert store.event_totals() == {
        ("q", "submitted"): 5,
        ("q", "leased"): 4,
        ("q", "acked"): 1,
        ("q", "failed"): 2,
        ("q", "retried"): 1,
        ("q", "dead"): 1,
        ("b", "submitted"): 1,
        ("b", "leased"): 1,
        ("b", "expired"): 1,
        ("b", "dead"): 1,
    }


def test_a_queue_left_without_jobs_is_forgotten_when_that_commits(store):
    """Counts and event totals are kept in memory per queue: a queue whose last job is
    deleted leaves nothing behind, or a server would grow with every queue name ever used."""

    def in_one_transaction(step: Callable[[], object]) -> None:
        store.begin()
        step()
        store.commit()

    in_one_transaction(lambda: (submit(store, T0, "gone"), submit(store, T0, "kept")))
    lease = claim_one(store, T0, ("gone",))
    in_one_transaction(lambda: store.jobs_ack(lease.job_id, "w1", lease.token, None, T0))
    assert ("gone", "acked") in store.event_totals()
    in_one_transaction(lambda: store.jobs_prune(T0 + store.config.retention_ms + DAY, 100))
    assert set(store.queue_stats()) == {"kept"}
    assert {queue for queue, _ in store.event_totals()} == {"kept"}
    assert counted_queues(store) == {"kept"}  # no zero entries either
    # A rolled-back deletion forgets nothing.
    make_dead(store, T0, "dq")
    store.begin()
    store.dead_purge_queue("dq", 10)
    store.rollback()
    assert store.queue_stats()["dq"]["dead"] == 1
    assert ("dq", "submitted") in store.event_totals()


def test_next_due_at_is_the_earliest_pending_or_retrying_run_at(store):
    assert store.next_due_at() is None
    job = submit(store, T0, backoff=Backoff.fixed(1_000))  # ready jobs have no due time
    assert store.next_due_at() is None
    submit(store, T0, delay_ms=5_000)
    submit(store, T0, delay_ms=3_000)
    assert store.next_due_at() == T0 + 3_000
    lease = claim_one(store, T0)
    store.jobs_fail(job, "w1", lease.token, "e", True, T0 + 500)
    assert store.next_due_at() == T0 + 1_500
    assert store.jobs_promote_due(T0 + 3_000, 10) == 2
    assert store.next_due_at() == T0 + 5_000
    store.jobs_promote_due(T0 + 5_000, 10)
    assert store.next_due_at() is None


def test_next_expiry_at_is_the_earliest_held_lease_expiry(store):
    assert store.next_expiry_at() is None
    a, b = submit(store, T0), submit(store, T0)
    lease_a = claim_one(store, T0, lease_ms=10_000)
    lease_b = claim_one(store, T0, lease_ms=5_000)
    assert store.next_expiry_at() == T0 + 5_000
    store.jobs_ack(b, "w1", lease_b.token, None, T0 + 1)
    assert store.next_expiry_at() == T0 + 10_000
    store.jobs_release(a, "w1", lease_a.token, T0 + 2)
    assert store.next_expiry_at() is None


# -- changes (whom the writer wakes) -----------------------------------------------------


def _fresh_changes(store: Store) -> None:
    store.changes = Changes()


def _setup_submit_ready(store):
    return lambda: submit(store, T0, "a")


def _setup_promote(store):
    submit(store, T0, "a", delay_ms=10)
    return lambda: store.jobs_promote_due(T0 + 10, 10)


def _setup_release(store):
    job = submit(store, T0, "a")
    lease = claim_one(store, T0, ("a",))
    return lambda: store.jobs_release(job, "w1", lease.token, T0 + 1)


def _setup_reap(store):
    submit(store, T0, "a")
    lease = claim_one(store, T0, ("a",))
    return lambda: store.leases_reap_expired(lease.lease_expires_at, 10)


def _setup_dead_retry(store):
    job = make_dead(store, T0, "a")
    return lambda: store.dead_retry(job, T0 + 1)


def _setup_dead_retry_queue(store):
    make_dead(store, T0, "a")
    return lambda: store.dead_retry_queue("a", T0 + 1, 10)


@pytest.mark.parametrize(
    "setup",
    [
        _setup_submit_ready,
        _setup_promote,
        _setup_release,
        _setup_reap,
        _setup_dead_retry,
        _setup_dead_retry_queue,
    ],
    ids=["submit", "promote", "release", "reap", "dead_retry", "dead_retry_queue"],
)
def test_changes_name_the_queue_of_a_job_that_became_ready(store, setup):
    submit(store, T0, "other", delay_ms=DAY)
    action = setup(store)
    _fresh_changes(store)
    action()
    assert store.changes.ready_queues == {"a"}
    assert store.changes.ready_counts == {"a": 1}  # how many parked long-polls it wakes


def test_changes_count_the_jobs_made_ready_per_queue(store):
    _fresh_changes(store)
    store.jobs_submit([SubmitSpec("a", "1")] * 3 + [SubmitSpec("b", "1")], T0)
    store.jobs_submit([SubmitSpec("a", "1", delay_ms=DAY)], T0)
    assert store.changes.ready_counts == {"a": 3, "b": 1}


def test_changes_do_not_name_queues_where_nothing_became_ready(store):
    jobs = [submit(store, T0), submit(store, T0)]
    _fresh_changes(store)
    submit(store, T0, "p", delay_ms=100)
    leases = store.jobs_claim(["q"], "w1", 2, LEASE_MS, T0)
    store.jobs_ack(jobs[0], "w1", leases[0].token, None, T0)
    store.jobs_fail(jobs[1], "w1", leases[1].token, "e", True, T0)
    assert store.changes.ready_queues == set()
    assert store.changes.ready_counts == {}


def test_changes_track_the_earliest_new_due_time(store):
    _fresh_changes(store)
    submit(store, T0, delay_ms=5_000)
    submit(store, T0, delay_ms=3_000)
    submit(store, T0, delay_ms=4_000)
    assert store.changes.next_due_at == T0 + 3_000
    job = submit(store, T0, backoff=Backoff.fixed(700))
    lease = claim_one(store, T0)
    _fresh_changes(store)
    store.jobs_fail(job, "w1", lease.token, "e", True, T0 + 10)
    assert store.changes.next_due_at == T0 + 710


def test_changes_track_the_earliest_new_lease_expiry(store):
    job = submit(store, T0)
    submit(store, T0)
    _fresh_changes(store)
    lease = claim_one(store, T0, lease_ms=9_000)
    claim_one(store, T0, lease_ms=20_000)
    assert store.changes.next_expiry_at == T0 + 9_000
    _fresh_changes(store)
    store.lease_renew(job, "w1", lease.token, 4_000, T0 + 100)
    assert store.changes.next_expiry_at == T0 + 4_100


# -- claim cost is independent of the backlog --------------------------------------------
# SQLite's query plans and VM steps: PostgreSQL's plans are checked in test_postgres.py.


def _plan(store: Store, sql: str, params=()) -> list[str]:
    return [row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + sql, params)]


def _assert_seeks_only(details: list[str], index: str) -> list[str]:
    on_jobs = [d for d in details if re.search(r"\bjobs\b", d)]
    assert on_jobs, details
    for detail in on_jobs:
        # (jobs_leased is read whole where a queue's leases are wanted: every lease held,
        # a number bounded by the workers' slots)
        scan = "SCAN jobs USING INDEX jobs_leased" if index == "jobs_leased" else None
        assert detail.startswith("SEARCH jobs USING") or detail == scan, details
        assert re.search(rf"INDEX {index}\b", detail), details
    assert not any("TEMP B-TREE" in d for d in details), details
    return on_jobs


@sqlite_only
@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize("queue_count", [1, 3])
def test_claim_query_seeks_jobs_ready_once_per_queue_and_class(store, queue_count, inline):
    params = []
    for i in range(queue_count):
        for priority in Priority:
            params += [f"q{i}", int(priority), 5]
    details = _plan(store, _claim_candidates_sql(queue_count, inline), params)
    seeks = _assert_seeks_only(details, "jobs_ready")
    assert len(seeks) == queue_count * len(Priority)


def _traced_selects(store: Store, call: Callable[[], object]) -> list[str]:
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    try:
        call()
    finally:
        store._db.set_trace_callback(None)
    return [s for s in statements if re.match(r"\s*SELECT\b.*\bFROM jobs\b", s, re.I | re.S)]


@pytest.mark.parametrize(
    ("call", "index"),
    [
        (lambda s: s.jobs_promote_due(T0, 100), ("jobs_due",)),
        (lambda s: s.leases_reap_expired(T0, 100), ("jobs_leased",)),
        (lambda s: s.jobs_prune(T0 + 30 * DAY, 100), ("jobs_succeeded", "jobs_cancelled")),
        (
            lambda s: s.job_cancel_queue("q", ("pending", "ready", "retrying", "leased"), T0, 9),
            ("jobs_ready", "jobs_due_queue", "jobs_leased"),
        ),
    ],
    ids=["promote", "reap", "prune", "cancel_queue"],
)
@sqlite_only
def test_time_driven_pass_seeks_its_partial_index(store, call, index):
    submit(store, T0, delay_ms=10)
    selects = _traced_selects(store, lambda: call(store))
    assert len(selects) == len(index), selects
    for select, name in zip(selects, index, strict=True):
        _assert_seeks_only(_plan(store, select), name)


@sqlite_only
@pytest.mark.parametrize("queue", [None, "q"])
@pytest.mark.parametrize("newest", [False, True], ids=["oldest", "newest"])
def test_dead_list_seeks_its_partial_index_in_either_order(store, queue, newest):
    make_dead(store, T0)
    selects = _traced_selects(store, lambda: store.dead_list(queue, 10, None, newest=newest))
    assert len(selects) == 1, selects
    _assert_seeks_only(_plan(store, selects[0]), "jobs_dead_queue" if queue else "jobs_dead")


@sqlite_only
def test_claim_cost_does_not_grow_with_the_backlog(store):
    # One spec per (queue, class), repeated: a backlog over every candidate the claim sees.
    kinds = [spec(queue, priority=int(p)) for queue in ("q", "other") for p in Priority]

    def claim_steps(now: int) -> tuple[int, Lease]:
        steps = 0

        def count() -> int:
            nonlocal steps
            steps += 1
            return 0

        store._db.set_progress_handler(count, 1)
        try:
            [lease] = store.jobs_claim(["q"], "w1", 1, LEASE_MS, now)
        finally:
            store._db.set_progress_handler(None, 1)
        return steps, lease

    store.jobs_submit(kinds * (1_000 // len(kinds)), T0)
    small, lease = claim_steps(T0 + 1)
    assert lease.priority == CRITICAL
    store.jobs_submit(kinds * (49_000 // len(kinds)), T0 + 2)
    assert (
        sum(store.queue_stats()["q"].values()) + sum(store.queue_stats()["other"].values())
        == 50_000
    )
    large, lease = claim_steps(T0 + 3)
    assert lease.priority == CRITICAL and store.job_inspect(lease.job_id).ready_at == T0
    assert small > 0 and large <= 1.5 * small, (small, large)


# -- acks in one call (the writer's merged path) ----------------------------------------------


def test_ack_many_completes_every_job_with_its_result(store):
    jobs = [submit(store, T0) for _ in range(3)]
    leases = store.jobs_claim(["q"], "w1", 3, LEASE_MS, T0)
    acks = [(lease.job_id, "w1", lease.token, f'{{"n":{i}}}') for i, lease in enumerate(leases)]
    assert store.jobs_ack_many(acks, T0 + 1) == [None] * 3
    for i, lease in enumerate(leases):
        info = store.job_inspect(lease.job_id)
        assert (info.state, info.result, info.finished_at) == ("succeeded", f'{{"n":{i}}}', T0 + 1)
    assert store.queue_stats()["q"]["succeeded"] == 3 == len(jobs)
    assert store.event_totals()[("q", "acked")] == 3


@pytest.mark.parametrize("count", [1, 16, 128])  # (up to ONE_STATEMENT_ROWS)
@pytest.mark.parametrize("granted_here", [True, False])
def test_ack_many_is_one_update_or_a_read_and_an_update(tmp_path, count, granted_here):
    # Not an update RETURNING its rows: SQLite returns them one step each, and each step
    # releases and retakes the GIL (the writer then waits for the trio thread). The leases
    # this store granted need no read; a store opened afresh (a restart) reads the rows.
    path = str(tmp_path / "acks.db")
    store = SqliteStore.open(path)
    store.jobs_submit([spec() for _ in range(count)], T0)
    leases = store.jobs_claim(["q"], "w1", count, LEASE_MS, T0)
    if not granted_here:
        store.close()
        store = SqliteStore.open(path)
    traced: list[str] = []
    store._db.set_trace_callback(traced.append)
    outcomes = store.jobs_ack_many([(x.job_id, "w1", x.token, None) for x in leases], T0 + 1)
    store._db.set_trace_callback(None)
    assert outcomes == [None] * count
    assert (
        [sql.split()[0] for sql in traced] == ["UPDATE"] if granted_here else ["SELECT", "UPDATE"]
    )
    assert "RETURNING" not in traced[-1]
    assert store.queue_stats()["q"]["succeeded"] == count
    assert store.event_totals()[("q", "acked")] == count
    store.close()


@sqlite_only
def test_an_ack_of_a_lease_that_ended_unseen_is_refused_and_the_others_are_acked(store, caplog):
    """A lease the store took for held but that ended behind its back (only a bug would
    do that): the update finds fewer rows than expected, and the rows say which."""
    store.jobs_submit([spec(), spec(), spec()], T0)
    leases = store.jobs_claim(["q"], "w1", 3, LEASE_MS, T0)
    gone = parse_job_id(leases[1].job_id)
    store._db.execute(
        "UPDATE jobs SET state = 'ready', lease_expires_at = NULL WHERE id = ?", (gone,)
    )
    store._counts[("q", "leased")] -= 1  # (as the transition that ended it would have)
    store._counts[("q", "ready")] += 1
    outcomes = store.jobs_ack_many([(x.job_id, "w1", x.token, None) for x in leases], T0 + 1)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], StaleToken)
    assert store.job_inspect(leases[1].job_id).state == "ready"
    counts = store.queue_stats()["q"]
    assert (counts["succeeded"], counts["ready"], counts["leased"]) == (2, 1, 0)
    assert "lease_book_stale" in caplog.text


def test_ack_many_accepts_an_ack_repeated_with_the_completing_token(store):
    submit(store, T0)
    submit(store, T0)
    first, second = store.jobs_claim(["q"], "w1", 2, LEASE_MS, T0)
    store.jobs_ack(first.job_id, "w1", first.token, None, T0 + 1)
    acks = [(first.job_id, "w1", first.token, None), (second.job_id, "w1", second.token, None)]
    store.jobs_ack_many(acks, T0 + 2)
    assert store.queue_stats()["q"]["succeeded"] == 2
    assert store.job_inspect(first.job_id).finished_at == T0 + 1  # the repeat changed nothing


@pytest.mark.parametrize(
    ("bad", "refusal"),
    [("stale", StaleToken), ("expired", LeaseExpired), ("unknown", JobNotFound)],
)
def test_ack_many_answers_each_ack_and_a_refusal_changes_only_its_own_nothing(store, bad, refusal):
    for _ in range(3):
        submit(store, T0)
    good, other, last = store.jobs_claim(["q"], "w1", 3, LEASE_MS, T0)
    acks = [(good.job_id, "w1", good.token, '"a"')]
    now = T0 + 1
    if bad == "stale":
        acks.append((other.job_id, "w1", "0" * 32, None))
    elif bad == "expired":
        acks.append((other.job_id, "w1", other.token, None))
        # (The other leases were made at T0 too: renewed, they are still held.)
        for held in (good, last):
            store.lease_renew(held.job_id, "w1", held.token, 2 * LEASE_MS, T0)
        now = other.lease_expires_at
    else:
        acks.append(("job_0000000000000001", "w1", other.token, None))
    acks.append((last.job_id, "w1", last.token, None))
    before = store.job_inspect(other.job_id)
    outcomes = store.jobs_ack_many(acks, now)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], refusal)
    assert store.job_inspect(other.job_id) == before
    assert store.job_inspect(good.job_id).result == '"a"'
    assert store.queue_stats()["q"]["succeeded"] == 2
    assert store.event_totals()[("q", "acked")] == 2


def test_ack_many_answers_malformed_ids_not_found_without_giving_up_the_run(store):
    submit(store, T0)
    (lease,) = store.jobs_claim(["q"], "w1", 1, LEASE_MS, T0)
    acks = [("nope", "w1", "t", None), ("job_zz", "w1", "t", None)]
    outcomes = store.jobs_ack_many([*acks, (lease.job_id, "w1", lease.token, None)], T0 + 1)
    assert [type(o) for o in outcomes] == [JobNotFound, JobNotFound, type(None)]
    assert store.job_inspect(lease.job_id).state == "succeeded"


def test_ack_many_refuses_a_job_twice_and_changes_nothing(store):
    submit(store, T0)
    (lease,) = store.jobs_claim(["q"], "w1", 1, LEASE_MS, T0)
    ack = (lease.job_id, "w1", lease.token, None)
    before = snapshot(store, lease.job_id)
    with pytest.raises(ValueError):
        store.jobs_ack_many([ack, ack], T0 + 1)
    assert snapshot(store, lease.job_id) == before


@pytest.mark.parametrize("reopened", [False, True])
def test_ack_many_refuses_a_job_twice_whether_its_lease_is_known_or_read(tmp_path, reopened):
    # One ack the lease book vouches for and the same job's again, or (a store opened
    # afresh) both from the rows: either way refused before anything is written.
    path = str(tmp_path / "twice.db")
    store = SqliteStore.open(path)
    store.jobs_submit([spec(), spec()], T0)
    leases = store.jobs_claim(["q"], "w1", 2, LEASE_MS, T0)
    if reopened:
        store.close()
        store = SqliteStore.open(path)
    acks = [(x.job_id, "w1", x.token, None) for x in leases]
    with pytest.raises(ValueError):
        store.jobs_ack_many([acks[0], acks[1], acks[0]], T0 + 1)
    assert store.queue_stats()["q"]["leased"] == 2
    assert store.jobs_ack_many(acks, T0 + 1) == [None, None]  # (and the book still serves)
    assert store.queue_stats()["q"]["succeeded"] == 2
    store.close()


# -- replies stay bounded whatever a client asks for ------------------------------------------


def test_claim_stops_at_its_byte_budget_but_always_gives_one_job(store):
    big = '"' + "x" * 10_000 + '"'
    for _ in range(10):
        store.jobs_submit([spec("q", payload=big)], T0)
    leases = store.jobs_claim(["q"], "w1", 10, LEASE_MS, T0, max_bytes=25_000)
    assert len(leases) == 3  # 10 KB each: the third reaches the budget
    assert store.queue_stats()["q"]["ready"] == 7
    assert len(store.jobs_claim(["q"], "w1", 10, LEASE_MS, T0, max_bytes=1)) == 1


def test_byte_budgets_count_bytes_not_characters(store):
    # 4,000 characters, 12,000 bytes in UTF-8 (as on the wire): the budget is in bytes.
    wide = '"' + "\u20ac" * 4_000 + '"'
    for _ in range(5):
        store.jobs_submit([spec("q", payload=wide)], T0)
    leases = store.jobs_claim(["q"], "w1", 5, LEASE_MS, T0, max_bytes=20_000)
    assert len(leases) == 2  # counting characters would have given 5
    for lease in leases:
        store.jobs_fail(lease.job_id, "w1", lease.token, "fatal", False, T0)
    page, cursor = store.dead_list(None, 100, None, max_bytes=20_000)
    assert len(page) == 2 and cursor is None  # the two dead jobs: both fit one page
    page, cursor = store.dead_list(None, 100, None, max_bytes=12_000)
    assert len(page) == 1 and cursor is not None


def test_dead_list_pages_count_error_texts_as_escaped_in_the_reply(store):
    """An error of control characters is 6 times longer once escaped as JSON: the page is
    cut by what the reply will hold, not by the stored text."""
    for _ in range(4):
        job = submit(store, T0, max_attempts=1)
        lease = claim_one(store, T0)
        # 1,000 bytes stored, 6,002 in JSON; twice per job (last_error and the history).
        store.jobs_fail(job, "w1", lease.token, "\x01" * 1_000, False, T0)
    page, _ = store.dead_list(None, 100, None, max_bytes=20_000)
    assert len(page) == 2  # ~12 KB a job; counting its 2,000 stored bytes would give all 4


def test_dead_list_pages_by_bytes_too_and_the_cursor_goes_on(store):
    big = '"' + "x" * 10_000 + '"'
    dead = [make_dead(store, T0, payload=big) for _ in range(5)]
    seen, cursor = [], None
    while True:
        page, cursor = store.dead_list(None, 100, cursor, max_bytes=25_000)
        assert 1 <= len(page) <= 3
        seen += [info.job_id for info in page]
        if cursor is None:
            break
    assert seen == dead


def test_a_jobs_error_history_shows_its_most_recent_entries(store):
    job = submit(store, T0, max_attempts=100, backoff=Backoff.fixed(0))
    for n in range(40):
        lease = claim_one(store, T0 + n)
        store.jobs_fail(job, "w1", lease.token, f"failure {n + 1}", True, T0 + n)
        store.jobs_promote_due(T0 + n, 10)
    errors = store.job_inspect(job).errors
    assert len(errors) == ERRORS_SHOWN
    assert [e.error for e in errors] == [f"failure {n}" for n in range(9, 41)]


# -- ack_batch: each ack as if it were its own, in order --------------------------------------

ACK_AT = T0 + 1_000
WRONG_TOKEN = "0" * 32


def _ack_scene(store: Store) -> list[tuple[str, str]]:
    """(job_id, the token of its lease, if any) for: two held leases, a lease that ends at
    ACK_AT, a job acked already, a ready job never leased, an unknown id, a malformed one."""
    jobs = [submit(store, T0) for _ in range(5)]
    held = [claim_one(store, T0), claim_one(store, T0)]
    ending = claim_one(store, T0, lease_ms=ACK_AT - T0)
    acked = claim_one(store, T0)
    store.jobs_ack(acked.job_id, "w1", acked.token, '"early"', T0 + 1)
    leases = [*held, ending, acked]
    assert [lease.job_id for lease in leases] == jobs[:4]
    return [(lease.job_id, lease.token) for lease in leases] + [
        (jobs[4], WRONG_TOKEN),
        ("job_0000000000000001", WRONG_TOKEN),
        ("nope", WRONG_TOKEN),
    ]


def _outcome(outcome: object) -> tuple[type, str] | None:
    return None if outcome is None else (type(outcome), str(outcome))


# (The `stores` fixture opens fresh stores for each example.)
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    strategies.lists(
        strategies.tuples(
            strategies.integers(0, 6),  # which job of the scene
            strategies.booleans(),  # its lease's token, or a wrong one
            strategies.sampled_from(["w1", "w2"]),
            strategies.sampled_from([None, '"r"', '{"n":1}']),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_an_ack_batch_does_exactly_what_its_acks_one_by_one_would(stores: Stores, items):
    # Two fresh stores per example (the `store` fixture is one per test): the same scene in
    # each, the batch as one command in one, the same acks one by one in the other.
    batched, alone = (stores.open(rng=random.Random(1)) for _ in range(2))
    try:
        scenes = [_ack_scene(s) for s in (batched, alone)]

        def acks(scene: list[tuple[str, str]]) -> list[tuple[str, str, str, str | None]]:
            return [
                (scene[i][0], worker, scene[i][1] if held else WRONG_TOKEN, result)
                for i, held, worker, result in items
            ]

        batched.begin()
        with batched.command():  # as the writer runs every command
            outcomes = cmd.AckBatch(tuple(acks(scenes[0]))).apply(batched, ACK_AT)
        batched.commit()
        expected: list[object] = []
        for ack in acks(scenes[1]):
            try:
                expected.append(alone.jobs_ack(*ack, ACK_AT))
            except RelayError as exc:
                expected.append(exc)

        assert [_outcome(o) for o in outcomes] == [_outcome(o) for o in expected]
        for (job_id, _), (same_id, _) in zip(scenes[0][:5], scenes[1][:5], strict=True):
            assert batched.job_inspect(job_id) == alone.job_inspect(same_id)
        assert batched.queue_stats() == alone.queue_stats() == recount(batched)
        assert batched.event_totals() == alone.event_totals()
    finally:
        batched.close()
        alone.close()


# -- many claims at once (the writer merges a run of lease requests) ---------------------

QUEUE_SETS = [("a",), ("b",), ("a", "b"), ("b", "a")]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    jobs=strategies.lists(
        strategies.tuples(
            strategies.sampled_from(["a", "b"]),
            strategies.sampled_from([LOW, NORMAL, HIGH, CRITICAL]),
            strategies.integers(0, 3),  # submitted at T0 + this many minutes
            strategies.integers(0, 600),  # payload length
        ),
        max_size=14,
    ),
    claims=strategies.lists(
        strategies.tuples(
            strategies.sampled_from(QUEUE_SETS),
            strategies.integers(0, 4),  # count
            strategies.sampled_from([None, 1, 700, 1500]),  # reply budget in bytes
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_many_claims_at_once_lease_what_the_same_claims_one_by_one_would(
    stores: Stores, jobs, claims
):
    # The documented order: claims on the same queue set in the order given, the sets in
    # the order they first appear among the claims that ask for a job; each claim takes
    # the best jobs the ones before it left.
    merged, alone = (stores.open(rng=random.Random(1)) for _ in range(2))
    now = T0 + 10 * MINUTE
    try:
        for store in (merged, alone):
            for queue, priority, minute, length in sorted(jobs, key=lambda job: job[2]):
                submit(store, T0 + minute * MINUTE, queue, priority=priority,
                       payload='"' + "x" * length + '"')  # fmt: skip
        args = [(list(queues), f"w{i}", count, LEASE_MS + i, budget)
                for i, (queues, count, budget) in enumerate(claims)]  # fmt: skip
        got = merged.jobs_claim_many(args, now)

        first_seen: dict[tuple[str, ...], int] = {}
        for queues, count, _budget in claims:
            if count > 0:
                first_seen.setdefault(tuple(dict.fromkeys(queues)), len(first_seen))

        def place(i: int) -> tuple[int, int]:
            return first_seen.get(tuple(dict.fromkeys(claims[i][0])), 0), i

        order = sorted(range(len(claims)), key=place)
        expected: dict[int, list[Lease]] = {}
        for i in order:
            queues, worker, count, lease_ms, budget = args[i]
            expected[i] = alone.jobs_claim(queues, worker, count, lease_ms, now, budget)

        def shape(lease: Lease) -> tuple:
            return (lease.job_id, lease.queue, lease.payload, lease.priority, lease.attempt,
                    lease.max_attempts, lease.lease_expires_at)  # fmt: skip

        assert [[shape(x) for x in leases] for leases in got] == [
            [shape(x) for x in expected[i]] for i in range(len(claims))
        ]
        leased = [lease.job_id for leases in got for lease in leases]
        assert len(leased) == len(set(leased))
        assert merged.queue_stats() == alone.queue_stats() == recount(merged)
        assert merged.event_totals() == alone.event_totals()
        # Each lease is held by its own claim's worker, with the token it was given.
        for i, leases in enumerate(got):
            for lease in leases:
                info = merged.job_inspect(lease.job_id)
                assert (info.state, info.worker_id) == (LEASED, f"w{i}")
                merged.jobs_ack(lease.job_id, f"w{i}", lease.token, None, now + 1)
    finally:
        merged.close()
        alone.close()


def test_a_claim_reads_no_more_candidates_for_what_claims_on_other_queues_took(monkeypatch):
    import relay.store.sqlite.leases as sqlite_module

    store = SqliteStore.open(":memory:")
    store.jobs_submit([spec("a")] * 300 + [spec("b")] * 10, T0)
    reads: list[int] = []
    real = sqlite_module._json_rows

    def counting(db, sql, params=()):
        rows = real(db, sql, params)
        if "jobs_ready" in sql:
            reads.append(len(rows))
        return rows

    monkeypatch.setattr(sqlite_module, "_json_rows", counting)
    claims = [(["a"], "w1", 100, LEASE_MS, None), (["a"], "w2", 100, LEASE_MS, None),
              (["b"], "w3", 1, LEASE_MS, None)]  # fmt: skip
    got = store.jobs_claim_many(claims, T0 + 1)
    assert [len(leases) for leases in got] == [100, 100, 1]
    # The claims on "a" took 200 jobs of "a"; the claim on "b" needs one candidate.
    assert reads == [200, 1]


# -- a claim's statements ----------------------------------------------------------------------
# How many statements SQLite runs (its trace callback); PostgreSQL's claim is always two.


def _traced(store: Store, call: Callable[[], object]) -> tuple[object, list[str]]:
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    try:
        result = call()
    finally:
        store._db.set_trace_callback(None)
    return result, statements


def test_a_claim_gives_each_job_its_own_payload_small_or_large(store):
    small, large = '{"s": "\\u00e9 \\" x"}', '"' + "y" * 70_000 + '"'
    ids = [submit(store, payload=small), submit(store, payload=large), submit(store, payload=small)]
    leases = store.jobs_claim(["q"], "w1", 3, LEASE_MS, T0)
    assert [(lease.job_id, lease.payload) for lease in leases] == list(
        zip(ids, [small, large, small], strict=True)
    )


@sqlite_only
def test_a_claim_of_a_few_small_jobs_is_two_statements(store):
    ids = [submit(store, payload=f'{{"n": {i}}}') for i in range(3)]
    leases, statements = _traced(store, lambda: store.jobs_claim(["q"], "w1", 3, LEASE_MS, T0))
    assert len(statements) == 2  # the candidates (with their payloads) and the update
    assert [(lease.job_id, lease.payload, lease.attempt) for lease in leases] == [
        (job_id, f'{{"n": {i}}}', 1) for i, job_id in enumerate(ids)
    ]


@sqlite_only
def test_a_claim_reads_back_only_the_payloads_too_large_to_come_with_it(store):
    small, large = '{"s": "\\u00e9 \\" x"}', '"' + "y" * 2000 + '"'
    ids = [submit(store, payload=small), submit(store, payload=large), submit(store, payload=small)]
    leases, statements = _traced(store, lambda: store.jobs_claim(["q"], "w1", 3, LEASE_MS, T0))
    assert len(statements) == 3
    assert [(lease.job_id, lease.payload) for lease in leases] == list(
        zip(ids, [small, large, small], strict=True)
    )


@sqlite_only
def test_a_claim_of_many_jobs_reads_their_payloads_after_the_update(store):
    store.jobs_submit([spec(payload=f"[{i}]") for i in range(100)], T0)
    leases, statements = _traced(store, lambda: store.jobs_claim(["q"], "w1", 100, LEASE_MS, T0))
    assert len(statements) == 3  # 400 candidate slots: no payloads with the candidates
    assert [lease.payload for lease in leases] == [f"[{i}]" for i in range(100)]


def test_a_claimed_job_s_attempt_counts_the_earlier_ones(store):
    job_id = submit(store, max_attempts=4)
    first = claim_one(store)
    store.jobs_fail(job_id, "w1", first.token, "boom", True, T0 + 1)
    store.jobs_promote_due(T0 + 3_600_000, 10)
    (again,) = store.jobs_claim(["q"], "w2", 1, LEASE_MS, T0 + 3_600_000)
    assert (first.attempt, again.attempt) == (1, 2)
    assert store.job_inspect(job_id).attempt == 2
